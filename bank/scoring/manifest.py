"""The model manifest: what ties every party's model files into one model.

Written by the bank when training ends, as ``<run>/model/manifest.json``: the
model id (the training session), the task, the aggregation, and per party (in
the order the top model expects) its embedding width, the hash of its feature
schema (its ``encoder.json``) and the SHA-256 of each of its files. Each party
checks its own files against it before it loads them.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from parties.errors import DataError
from parties.storage.files import atomic_write_text

__all__ = ["Manifest", "PartyEntry", "SubsetEntry", "read_manifest", "write_manifest"]


class PartyEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    embedding_width: int
    schema_hash: str
    files: dict[str, str]


class SubsetEntry(BaseModel):
    """The model for customers only ``parties`` hold, under ``<model>/subsets/<bank+...>/``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    parties: list[str]
    kind: Literal["bank-only", "head"]
    files: dict[str, str]


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model_id: str
    alignment_id: str
    task: dict[str, Any]
    aggregation: str
    parties: list[PartyEntry]
    top: dict[str, str]
    subsets: dict[str, SubsetEntry] = {}  # a model trained before subsets existed has none

    def party(self, name: str) -> PartyEntry:
        for p in self.parties:
            if p.name == name:
                return p
        raise DataError(f"the model {self.model_id} has no party {name!r}")


def write_manifest(path: Path, manifest: Manifest) -> None:
    atomic_write_text(path, manifest.model_dump_json(indent=2) + "\n")


def read_manifest(model_dir: Path) -> Manifest:
    path = Path(model_dir) / "manifest.json"
    try:
        manifest = Manifest.model_validate_json(path.read_text())
    except FileNotFoundError as exc:
        raise DataError(f"{path}: no manifest; is {model_dir} a trained model folder?") from exc
    except ValidationError as exc:
        raise DataError(f"{path}: not a valid manifest ({exc.error_count()} problems)") from exc
    for name, digest in manifest.top.items():
        data = (Path(model_dir) / name).read_bytes() if (Path(model_dir) / name).exists() else b""
        if hashlib.sha256(data).hexdigest() != digest:
            raise DataError(f"{Path(model_dir) / name}: does not match the manifest")
    return manifest

