"""A trained bottom model loaded back from a party's own files, checked against the manifest.

A party's model folder holds ``bottom.safetensors``, ``encoder.json``,
``bottom-config.json`` and ``files.json`` (their SHA-256). Loading checks each
file's digest against what the caller expects (the bank's manifest) and
against ``files.json``; any mismatch is refused before a byte is parsed.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors

from parties.errors import DataError
from parties.learning.model import BottomConfig, build_bottom
from parties.tables.encoding import EncodedRows, TabularEncoder

__all__ = ["MODEL_FILES", "ScoringBottom", "read_bottom_config", "verify_files"]

MODEL_FILES = ("bottom.safetensors", "encoder.json", "bottom-config.json")


def read_bottom_config(data: bytes | str) -> BottomConfig:
    """A party's ``bottom-config.json``: its settings, and the salt that keeps the file's digest unguessable."""
    state = json.loads(data)
    if isinstance(state, dict):
        state.pop("salt", None)
    return BottomConfig.model_validate(state)


def verify_files(folder: Path, expected: dict[str, str], names: tuple[str, ...] = MODEL_FILES) -> dict[str, bytes]:
    """Read the model files ``names`` and check each one's SHA-256 against ``expected``; return their bytes."""
    blobs = {}
    for name in names:
        path = Path(folder) / name
        if name not in expected:
            raise DataError(f"the manifest names no digest for {name}")
        try:
            data = path.read_bytes()
        except FileNotFoundError as exc:
            raise DataError(f"{path}: missing model file") from exc
        digest = hashlib.sha256(data).hexdigest()
        if digest != expected[name]:
            raise DataError(f"{path}: does not match the manifest (sha256 {digest[:12]}…, expected {expected[name][:12]}…)")
        blobs[name] = data
    return blobs


class ScoringBottom:
    """A party's encoder and bottom model, ready to embed new rows of its own table."""

    def __init__(self, folder: Path, expected: dict[str, str]) -> None:
        own = json.loads((Path(folder) / "files.json").read_text()) if (Path(folder) / "files.json").exists() else {}
        if own and any(own.get(n) != expected.get(n) for n in MODEL_FILES):
            raise DataError(f"{folder}: the party's own files.json disagrees with the manifest")
        blobs = verify_files(folder, expected)
        try:
            self.encoder = TabularEncoder.from_dict(json.loads(blobs["encoder.json"]))
            self.config = read_bottom_config(blobs["bottom-config.json"])
            weights = load_tensors(blobs["bottom.safetensors"])
        except (ValueError, KeyError, SafetensorError) as exc:
            raise DataError(f"{folder}: unreadable model files ({exc})") from exc
        self.model = build_bottom(self.encoder.layout, self.config, seed=0)  # its trained weights are loaded next
        try:
            self.model.load_state_dict(weights)
        except RuntimeError as exc:
            raise DataError(f"{folder}: the weights do not fit the model's configuration ({exc})") from exc
        self.model.eval()
        self.schema_hash = expected["encoder.json"]

    @property
    def width(self) -> int:
        return self.config.cut_width

    def embed(self, features: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.model(features)

    def embed_rows(self, rows: EncodedRows, batch: int = 1 << 16) -> torch.Tensor:
        """The embedding of every row of ``rows``, its one-hot built ``batch`` rows at a time."""
        out = torch.empty(len(rows), self.width)
        for start in range(0, len(rows), batch):
            out[start : start + batch] = self.embed(rows.take(torch.arange(start, min(start + batch, len(rows)))))
        return out
