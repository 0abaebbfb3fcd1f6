"""Checkpoints: a party's training state in one safetensors file, written atomically, never pickled.

A checkpoint is ``<folder>/step-<n>.safetensors``: tensors (model weights,
optimiser moments, whatever else the state holds) plus a JSON document in the
metadata (step counters, optimiser hyper-parameters, positions). It is written
to a temporary file, fsynced and renamed, so a crash during a save leaves the
previous checkpoints intact and no half-written one.

Retention is by common step: in training, the bank tells every party the
newest step that every party has on disk (``floor``), and a party deletes only
checkpoints older than that; until it knows one, it deletes nothing. So the
step a rollback needs is never deleted, however far apart the parties' writes
are. (``keep``, the last N, is for writers outside a training session.)

Every party's model and optimizer go in and out of a checkpoint the same way (``model_state``,
``load_model_state``), and a step is read only if the folder holds it (``read_held_checkpoint``): the
partner's bottom, a compute party's or branch's layers, and the bank's top. What each adds (a bottom's
retry slot and defenses, a layer's layout, the bank's loop) is its own.

Training writes them through a ``CheckpointWriter``: the snapshot is taken at
once, and the write, which waits on the disk, overlaps the next steps. A write
that fails (a full disk) leaves the checkpoints before it whole, and the
writer refuses to go on (``StorageError``) until a restore resets it.
"""

from __future__ import annotations

import errno
import json
import logging
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch

from parties.errors import BadMessage, DataError, StorageError
from parties.observability import CHECKPOINT_BYTES, CHECKPOINTS
from parties.protocol.wire import parse, serialize
from parties.storage.files import atomic_write_bytes
from parties.storage.quota import FOLDER_BYTES

__all__ = ["Checkpoint", "CheckpointWriter", "checkpoint_steps", "flatten_optimizer", "load_model_state",
           "model_state", "read_checkpoint", "read_held_checkpoint", "remove_checkpoints", "unflatten_optimizer",
           "write_checkpoint"]

logger = logging.getLogger(__name__)

_NAME = re.compile(r"^step-(\d+)\.safetensors$")
#: A checkpoint's header names every tensor of a party's state: larger than a message's, still bounded.
_MAX_CHECKPOINT_HEADER = 1 << 24


class Checkpoint:
    def __init__(self, step: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        self.step, self.tensors, self.meta = step, tensors, meta

    def section(self, prefix: str) -> dict[str, torch.Tensor]:
        return {k[len(prefix) + 1 :]: v for k, v in self.tensors.items() if k.startswith(prefix + ".")}


def flatten_optimizer(optimizer: torch.optim.Optimizer, prefix: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """An optimiser's state as named tensors plus JSON (hyper-parameters, non-tensor values)."""
    state = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, entry in state["state"].items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{prefix}.{index}.{key}"] = value.detach().clone().contiguous()
            else:
                scalars.setdefault(str(index), {})[key] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def unflatten_optimizer(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    state: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        index, key = name.split(".", 1)
        state.setdefault(int(index), {})[key] = value
    for index, entry in meta["scalars"].items():
        state.setdefault(int(index), {}).update(entry)
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def model_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, prefix: str = "model",
                ) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """A model's weights as ``<prefix>.*`` tensors (copies) and, with its ``optimizer``, the optimizer's state as
    ``optim.*`` tensors and its meta (``flatten_optimizer``; ``None`` without one)."""
    tensors = {f"{prefix}.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    if optimizer is None:
        return tensors, None
    optim, meta = flatten_optimizer(optimizer, "optim")
    return tensors | optim, meta


def load_model_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, checkpoint: Checkpoint,
                     optimizer_meta: dict[str, Any], prefix: str = "model") -> None:
    """What ``model_state`` saved, back into ``model`` and ``optimizer``."""
    model.load_state_dict(checkpoint.section(prefix))
    unflatten_optimizer(optimizer, checkpoint.section("optim"), optimizer_meta)


def read_held_checkpoint(folder: Path, step: int, missing: Callable[[list[int]], str]) -> Checkpoint:
    """The checkpoint of ``step`` if ``folder`` holds one, else ``OutOfOrder(missing(held steps))``: a path is
    never made from a number a peer sent before the folder's own listing shows it."""
    from parties.errors import OutOfOrder

    if step not in (held := checkpoint_steps(folder)):
        raise OutOfOrder(missing(held))
    return read_checkpoint(folder, step)


def write_checkpoint(
    folder: Path, step: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any], keep: int | None = 2,
    floor: int | None = None,
) -> Path:
    return _write(folder, step, tensors, json.dumps(meta), keep, floor)


def _write(
    folder: Path, step: int, tensors: dict[str, torch.Tensor], meta_json: str, keep: int | None, floor: int | None
) -> Path:
    path = Path(folder) / f"step-{step}.safetensors"
    if Path(folder).is_dir():  # temporary files a crash left behind (one writer per folder)
        for stale in Path(folder).glob(".step-*.safetensors.*"):
            stale.unlink(missing_ok=True)
    blob = serialize(tensors, {"cutlayer": meta_json})
    atomic_write_bytes(path, blob)
    CHECKPOINTS.inc()
    CHECKPOINT_BYTES.inc(len(blob))
    for old in _expired(checkpoint_steps(folder), step, keep, floor):
        (Path(folder) / f"step-{old}.safetensors").unlink(missing_ok=True)
    logger.info("checkpoint at step %d written", step)
    return path


def _expired(steps: list[int], newest: int, keep: int | None, floor: int | None) -> list[int]:
    """The checkpoints retention lets go: older than the common ``floor``, else beyond the last ``keep``."""
    if floor is not None:
        return [s for s in steps if s < min(floor, newest)]
    return steps[:-keep] if keep else []


class CheckpointWriter:
    """Writes checkpoints on a background thread, in order, one at a time.

    The caller's snapshot must not change afterwards (clone the tensors); the
    metadata is turned into JSON at once. Serialising, fsyncing and renaming
    run on the writer thread while training goes on. Only whole files ever
    carry a checkpoint's name, so a crash loses at most the write in flight;
    ``flush`` waits for it, and whoever lists or reads checkpoints flushes
    first. A failed write sets ``failure``, which ``submit`` and ``check``
    raise from then on, so training stops at the next step; listing and
    reading checkpoints still work, and ``reset`` (after a restore) clears it.

    ``durable`` is the newest step this writer has put on disk (or was reset
    to, after a restore): what the party reports to the bank for retention.
    """

    def __init__(self, keep: int | None = None,
                 quota: Callable[[int], AbstractContextManager[object]] | None = None) -> None:
        """``quota(nbytes)``: holds ``nbytes`` of the owner's disk quota for a write, or raises ``StorageError``."""
        self.keep, self.quota = keep, quota
        self.durable: int | None = None
        self.failure: StorageError | None = None
        self._lock = threading.Lock()
        self._pending: Future[Path] | None = None
        self._pool: ThreadPoolExecutor | None = None

    def submit(
        self, folder: Path, step: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any], floor: int | None = None
    ) -> None:
        """Write in the background; ``floor``: the newest step every party holds (older ones may go)."""
        meta_json = json.dumps(meta)
        with self._lock:
            self._wait()  # one in flight: bounded memory, and a failure surfaces at the next checkpoint
            self._raise_failure()
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
            self._pending = self._pool.submit(self._write, folder, step, tensors, meta_json, floor)

    def _write(self, folder: Path, step: int, tensors: dict[str, torch.Tensor], meta_json: str,
               floor: int | None) -> Path:
        try:
            nbytes = sum(t.numel() * t.element_size() for t in tensors.values()) + len(meta_json)
            nbytes += 0 if Path(folder).is_dir() else FOLDER_BYTES  # the first checkpoint makes the folder
            with self.quota(nbytes) if self.quota is not None else nullcontext():
                path = _write(folder, step, tensors, meta_json, self.keep, floor)
        except StorageError as exc:  # over the owner's quota: nothing was written
            self.failure = exc
            logger.error("checkpoint of step %d not written: %s", step, exc)
            raise
        except OSError as exc:
            self.failure = StorageError(
                f"could not write the checkpoint of step {step} to {Path(folder) / f'step-{step}.safetensors'}: "
                f"{_cause(exc)}")
            self.failure.__cause__ = exc
            logger.error("%s", self.failure)
            raise
        self.durable = step
        return path

    def check(self) -> None:
        """Raise the failure of a write that has ended, without waiting for one in flight."""
        self._raise_failure()

    def _raise_failure(self) -> None:
        if self.failure is not None:
            raise self.failure

    def reset(self, step: int | None) -> None:
        """After a restore to ``step`` (``None``: a fresh start): what is on disk beyond it belongs to an
        abandoned run."""
        with self._lock:
            self._wait()
            self.durable, self.failure = step, None

    def flush(self) -> None:
        """Wait until every submitted checkpoint is on disk or has failed (``check`` says which)."""
        with self._lock:
            self._wait()

    def close(self) -> None:
        with self._lock:
            try:
                self._wait()
            finally:
                if self._pool is not None:
                    self._pool.shutdown()
                    self._pool = None

    def _wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.exception()  # a failure is kept in ``failure``


def _cause(exc: OSError) -> str:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"disk full ({exc.strerror})"
    return exc.strerror or str(exc)


def remove_checkpoints(folder: Path) -> None:
    """Delete every checkpoint in ``folder`` (an abandoned start's), leaving the folder itself."""
    for step in checkpoint_steps(folder):
        (Path(folder) / f"step-{step}.safetensors").unlink(missing_ok=True)


def remove_idle_sessions(folders: Iterable[Path], ttl: float, now: float | None = None) -> list[Path]:
    """Remove each of ``folders`` (a session's: its checkpoints, or the mark that it ended) whose newest entry
    is over ``ttl`` seconds old; return those removed. For sessions no bank has used for that long."""
    now = time.time() if now is None else now
    removed = []
    for folder in folders:
        try:
            newest = max([folder.stat().st_mtime, *(p.stat().st_mtime for p in Path(folder).iterdir())])
        except FileNotFoundError:
            continue
        if now - newest > ttl:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(Path(folder))
    return removed


def checkpoint_steps(folder: Path) -> list[int]:
    """The steps with a complete checkpoint in ``folder``, oldest first."""
    if not Path(folder).is_dir():
        return []
    return sorted(int(m.group(1)) for p in Path(folder).iterdir() if (m := _NAME.match(p.name)))


def read_checkpoint(folder: Path, step: int) -> Checkpoint:
    path = Path(folder) / f"step-{step}.safetensors"
    try:
        header, tensors = parse(path.read_bytes(), max_header=_MAX_CHECKPOINT_HEADER)
        meta = json.loads(header["__metadata__"]["cutlayer"])  # type: ignore[index]
    except FileNotFoundError as exc:
        raise DataError(f"{path}: no checkpoint at step {step}") from exc
    except (ValueError, KeyError, TypeError, BadMessage) as exc:
        raise DataError(f"{path}: not a readable checkpoint ({exc})") from exc
    return Checkpoint(step, tensors, meta)
