"""One party's side of a training session: encoder fitted on its own training rows, bottom model, files."""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save as save_tensors

from parties.errors import BadMessage, StorageError
from parties.learning.bottom import BottomTrainer
from parties.learning.config import LocalSteps
from parties.learning.embedding_noise import PrivacyConfig
from parties.learning.hijack_monitor import MonitorConfig
from parties.learning.model import BottomConfig
from parties.storage.checkpoint import CheckpointWriter, read_checkpoint, read_held_checkpoint
from parties.storage.files import atomic_write_bytes
from parties.storage.quota import FOLDER_BYTES
from parties.tables.encoding import TabularEncoder
from parties.tables.table import AlignedRows, PartyTable

__all__ = ["PartySession"]

logger = logging.getLogger(__name__)


class PartySession:
    """Created when the bank starts training; owns this party's encoder and bottom trainer."""

    def __init__(
        self,
        session_id: str,
        table: PartyTable,
        alignment: AlignedRows,
        train_positions: torch.Tensor,
        config: BottomConfig,
        privacy: PrivacyConfig | None = None,
        monitor: MonitorConfig | None = None,
        local: LocalSteps | None = None,
    ) -> None:
        started = time.perf_counter()
        n = len(alignment)
        if train_positions.dtype != torch.int64 or train_positions.dim() != 1 or train_positions.numel() == 0:
            raise BadMessage("train_rows must be a non-empty 1-D int64 tensor")
        positions = train_positions.numpy()
        if positions.min() < 0 or positions.max() >= n or not _distinct(positions, n):
            raise BadMessage(f"train_rows must be distinct positions in [0, {n})")
        self.session_id, self.alignment_id, self.config = session_id, alignment.alignment_id, config
        self.train_digest = _digest(train_positions)
        self.restarted_at: int | None = None  # rebuilt after a restart from the checkpoint at this step
        self.owner = ""  # the bank that started it
        self.encoder = TabularEncoder(table.schema, bins=config.encoder_bins).fit(table.features.iloc[alignment.rows[positions]])
        self.privacy, self.monitor = privacy, monitor
        features, _ = self.encoder.encode_rows(table.features, alignment.rows)
        self.trainer = BottomTrainer(features, config, privacy, monitor, local)
        self.writer = CheckpointWriter()
        self.last_used = time.monotonic()
        logger.info("training session %s: %d aligned rows, %d encoded features, cut width %d; set up in %.3f s",
                    session_id, n, self.encoder.width, config.cut_width, time.perf_counter() - started)

    def started_with(self, alignment_id: str, train_positions: torch.Tensor) -> bool:
        """Whether this session was started with these arguments."""
        return alignment_id == self.alignment_id and self.train_digest == _digest(train_positions)

    # --- checkpoints -----------------------------------------------------------------------

    def checkpoint(self, folder: Path, floor: int | None = None) -> int:
        """Snapshot the state after the last processed step and write it in the background; returns that step.

        ``floor``: the newest step every party has on disk; older checkpoints may be deleted."""
        tensors, trainer_meta = self.trainer.state()
        step = trainer_meta["next_step"] - 1
        meta = {"session": self.session_id, "alignment_id": self.alignment_id, "trainer": trainer_meta,
                "train_digest": self.train_digest, "owner": self.owner,
                "encoder": self.encoder.to_dict(), "config": self.config.model_dump(mode="json"),
                "privacy": self.privacy.model_dump(mode="json") if self.privacy is not None else None,
                "monitor": self.monitor.model_dump(mode="json") if self.monitor is not None else None}
        self.writer.submit(folder, step, tensors, meta, floor)
        return step

    def flush_checkpoints(self) -> None:
        """Wait until every checkpoint taken so far is on disk."""
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()

    def restore(self, folder: Path, step: int) -> None:
        """Roll this session back (or forward) to its checkpoint at ``step``."""
        self.writer.flush()
        checkpoint = read_held_checkpoint(folder, step, lambda held: (
            f"training session {self.session_id} has no checkpoint at step {step} to roll back to; this party "
            f"holds steps {held}"))
        if checkpoint.meta["session"] != self.session_id:
            raise BadMessage(f"the checkpoint at step {step} belongs to another session")
        self.trainer.load_state(checkpoint, checkpoint.meta["trainer"])
        self.writer.reset(step)

    @classmethod
    def from_checkpoint(cls, folder: Path, step: int, table: PartyTable, alignment: AlignedRows) -> PartySession:
        """Rebuild a session after a restart, from its own checkpoint and this party's own table."""
        checkpoint = read_checkpoint(folder, step)
        meta = checkpoint.meta
        if meta["alignment_id"] != alignment.alignment_id:
            raise BadMessage(f"the checkpoint is for alignment {meta['alignment_id']}, not {alignment.alignment_id}")
        self = cls.__new__(cls)
        self.session_id, self.alignment_id = meta["session"], meta["alignment_id"]
        self.config = BottomConfig.model_validate(meta["config"])
        self.privacy = PrivacyConfig.model_validate(meta["privacy"]) if meta.get("privacy") else None
        self.monitor = MonitorConfig.model_validate(meta["monitor"]) if meta.get("monitor") else None
        self.encoder = TabularEncoder.from_dict(meta["encoder"])
        features, _ = self.encoder.encode_rows(table.features, alignment.rows)
        self.trainer = BottomTrainer(features, self.config, self.privacy, self.monitor,
                                     LocalSteps.model_validate(meta["trainer"].get("local", {})))
        self.trainer.load_state(checkpoint, meta["trainer"])
        self.train_digest, self.restarted_at, self.owner = meta.get("train_digest"), step, meta.get("owner", "")
        self.writer = CheckpointWriter()
        self.writer.durable = step
        self.last_used = time.monotonic()
        logger.info("training session %s restored from its checkpoint at step %d", self.session_id, step)
        return self

    def save(self, directory: Path, quota: Callable[[int], AbstractContextManager[object]] | None = None) -> dict[str, str]:
        """Write this party's own model files; return ``{file name: sha256}``. ``quota(nbytes)`` holds their
        bytes of the owner's disk quota while they are written, or raises ``StorageError``."""
        blobs = {
            "bottom.safetensors": save_tensors(
                {k: v.contiguous() for k, v in self.trainer.model.state_dict().items()},
                metadata={"session": self.session_id, "alignment": self.alignment_id},
            ),
            # Each file's SHA-256 goes to the bank (the manifest): a salt of this party's own keeps a small file's
            # digest from telling a bank that guesses its content (a factory's name, the settings) it guessed right.
            "encoder.json": json.dumps(self.encoder.to_dict() | {"salt": secrets.token_hex(16)}, indent=2).encode(),
            "bottom-config.json": json.dumps(self.config.model_dump(mode="json") | {"salt": secrets.token_hex(16)},
                                             indent=2).encode(),
        }
        digests = {name: hashlib.sha256(data).hexdigest() for name, data in blobs.items()}
        listing = (json.dumps(digests, indent=2) + "\n").encode()
        try:
            nbytes = sum(map(len, blobs.values())) + len(listing) + (0 if Path(directory).is_dir() else FOLDER_BYTES)
            with quota(nbytes) if quota is not None else nullcontext():
                for name, data in blobs.items():
                    atomic_write_bytes(Path(directory) / name, data)
                atomic_write_bytes(Path(directory) / "files.json", listing)
        except OSError as exc:
            raise StorageError(f"could not write the model files to {directory}: {exc.strerror or exc}") from exc
        return digests


def _distinct(positions: np.ndarray, n: int) -> bool:
    """Whether positions in ``[0, n)`` repeat none: one pass over a mask, not a sort (``np.unique``)."""
    seen = np.zeros(n, dtype=bool)
    seen[positions] = True
    return int(np.count_nonzero(seen)) == len(positions)


def _digest(positions: torch.Tensor) -> str:
    return hashlib.sha256(positions.numpy().astype("<i8").tobytes()).hexdigest()
