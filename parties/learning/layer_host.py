"""Layers held for a bank: one session's model, optimizer, step state and checkpoints (``parties.protocol.layers``).

A session is one of three kinds:

- ``trunk`` (U-shaped): ``forward`` takes the bank's cut-layer activations and returns the trunk's output;
  ``backward`` takes the gradient of that output, updates the trunk and returns the gradient of its input.
- ``server`` (vanilla): ``train`` takes activations and their labels, computes the loss, updates and returns
  the gradient of the activations; the labels of every training batch are the server's to see.
- ``bottom`` (horizontal): ``forward`` takes row positions in the branch's own table and returns their
  embedding; ``backward`` takes its gradient and updates. ``weights``/``load_weights`` move the client-side
  model between branches (relay) or replace it with the average (SplitFed).

Steps are numbered from 1 and applied in order, each exactly once: a call for a step already answered is
answered again from the cache, if it carries the same inputs (a retry); anything else is ``OutOfOrder``.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from parties.errors import BadMessage, DataError, OutOfOrder
from parties.learning.model import build_optimizer, mlp
from parties.protocol.layers import LayerInfo, LayerStart
from parties.protocol.wire import all_finite
from parties.storage.checkpoint import (
    flatten_optimizer,
    read_checkpoint,
    remove_checkpoints,
    unflatten_optimizer,
    write_checkpoint,
)

__all__ = ["LayerSession", "count_parameters", "digest"]

logger = logging.getLogger(__name__)


def digest(*tensors: torch.Tensor) -> bytes:
    """A fingerprint of a call's inputs: a retry carries the same bytes, another call does not."""
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.digest()


def count_parameters(in_width: int, hidden: tuple[int, ...], out_width: int) -> int:
    """The parameters of ``mlp(in_width, hidden, out_width)``, before building it (a bank cannot make us allocate)."""
    widths = [in_width, *hidden, out_width]
    return sum(a * b + b for a, b in zip(widths, widths[1:]))


@dataclass
class _Answer:
    step: int
    inputs: bytes
    reply: dict[str, torch.Tensor]


class LayerSession:
    """One bank's layers in one session; every public method holds the session's lock."""

    def __init__(self, start: LayerStart, owner: str, folder: Path | None, features: torch.Tensor | None = None,
                 *, max_rows: int = 1 << 16) -> None:
        self.start, self.owner, self.folder, self.max_rows = start, owner, folder, max_rows
        self.kind = start.kind
        if self.kind == "bottom":
            if features is None:
                raise DataError("a bottom session needs the branch's encoded rows")
            self.features = features
            self.in_width = int(features.shape[1])
        else:
            self.features = None
            self.in_width = start.in_width
        self.model: nn.Sequential = mlp(self.in_width, start.hidden, start.out_width,
                                        activate_output=self.kind != "server", seed=start.seed)
        self.optimizer = build_optimizer(self.model.parameters(), start.optimizer)
        self.step = 0
        self.lock = threading.Lock()
        self._pending: tuple[int, bytes, torch.Tensor, torch.Tensor] | None = None  # step, inputs, input, output
        self._answers: dict[str, _Answer] = {}
        if start.resume_step is not None:
            self.restore(start.resume_step)

    # --- what the bank sees ---------------------------------------------------------------------------------
    def info(self, rows: int = 0, ids_sha256: str = "") -> LayerInfo:
        return LayerInfo(session=self.start.session, kind=self.kind, in_width=self.in_width,
                         out_width=self.start.out_width, parameters=sum(p.numel() for p in self.model.parameters()),
                         step=self.step, rows=rows, ids_sha256=ids_sha256)

    # --- inputs ---------------------------------------------------------------------------------------------
    def _rows(self, positions: torch.Tensor) -> torch.Tensor:
        assert self.features is not None
        if positions.dim() != 1 or positions.dtype != torch.int64:
            raise BadMessage("positions must be a 1-d int64 tensor")
        if not 0 < len(positions) <= self.max_rows:
            raise BadMessage(f"a call carries 1 to {self.max_rows} rows, not {len(positions)}")
        if int(positions.min()) < 0 or int(positions.max()) >= len(self.features):
            raise BadMessage(f"row positions must lie in [0, {len(self.features)})")
        return self.features[positions]

    def _activations(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.in_width:
            raise BadMessage(f"activations must be (rows, {self.in_width}), not {tuple(x.shape)}")
        if not 0 < x.shape[0] <= self.max_rows:
            raise BadMessage(f"a call carries 1 to {self.max_rows} rows, not {x.shape[0]}")
        if x.dtype != torch.float32 or not all_finite(x):
            raise BadMessage("activations must be finite float32")
        return x

    def _input(self, x: torch.Tensor) -> torch.Tensor:
        return self._rows(x) if self.kind == "bottom" else self._activations(x)

    def _replay(self, phase: str, step: int, inputs: bytes) -> dict[str, torch.Tensor] | None:
        """The cached answer to a retried call; ``None`` if ``step`` is the next one; ``OutOfOrder`` otherwise."""
        answer = self._answers.get(phase)
        if answer is not None and answer.step == step:
            if answer.inputs != inputs:
                raise OutOfOrder(f"step {step} was already {phase}ed with other inputs")
            return answer.reply
        return None

    def _expect_next(self, step: int) -> None:
        if step != self.step + 1:
            raise OutOfOrder(f"step {step} is out of order: the next step is {self.step + 1}")

    # --- training -------------------------------------------------------------------------------------------
    def forward(self, step: int, x: torch.Tensor) -> torch.Tensor:
        """Trunk, bottom: the output for step ``step``'s batch (kept until its ``backward``)."""
        if self.kind == "server":
            raise OutOfOrder("a server session trains with `train` (activations and labels in one call)")
        with self.lock:
            inputs = digest(x)
            if (cached := self._replay("forward", step, inputs)) is not None:
                return cached["output"]
            self._expect_next(step)
            source = self._input(x)
            leaf = source.detach().requires_grad_(self.kind == "trunk")
            output = self.model(leaf)
            self._pending = (step, inputs, leaf, output)
            reply = output.detach()
            self._answers["forward"] = _Answer(step, inputs, {"output": reply})
            return reply

    def backward(self, step: int, grad: torch.Tensor) -> torch.Tensor | None:
        """Trunk, bottom: apply step ``step``'s gradient; the trunk returns its input's gradient."""
        with self.lock:
            inputs = digest(grad)
            if (cached := self._replay("backward", step, inputs)) is not None:
                return cached.get("grad")
            if self._pending is None or self._pending[0] != step:
                raise OutOfOrder(f"no forward of step {step} awaits its gradient (last step applied: {self.step})")
            _, _, leaf, output = self._pending
            if grad.shape != output.shape or grad.dtype != torch.float32 or not all_finite(grad):
                raise BadMessage(f"the gradient must be finite float32 of shape {tuple(output.shape)}")
            self.optimizer.zero_grad(set_to_none=True)
            output.backward(grad)
            self.optimizer.step()
            self.step, self._pending = step, None
            reply = {"grad": leaf.grad.detach()} if self.kind == "trunk" else {}
            self._answers["backward"] = _Answer(step, inputs, reply)
            return reply.get("grad")

    def train(self, step: int, x: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, float]:
        """Server (vanilla): one step on activations ``x`` and their labels; the gradient of ``x`` and the loss."""
        if self.kind != "server":
            raise OutOfOrder(f"a {self.kind} session trains with forward and backward")
        with self.lock:
            inputs = digest(x, labels)
            if (cached := self._replay("train", step, inputs)) is not None:
                return cached["grad"], float(cached["loss"])
            self._expect_next(step)
            leaf = self._activations(x).detach().requires_grad_(True)
            if labels.shape != (x.shape[0],) or labels.dtype != torch.float32 or not bool(
                    ((labels == 0) | (labels == 1)).all()):
                raise BadMessage("labels must be float32 0/1, one per row")
            loss = F.binary_cross_entropy_with_logits(self.model(leaf).squeeze(1), labels)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            self.step = step
            reply = {"grad": leaf.grad.detach(), "loss": loss.detach()}
            self._answers["train"] = _Answer(step, inputs, reply)
            return reply["grad"], float(reply["loss"])

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """The output for rows (bottom) or activations, changing nothing (evaluation, scoring)."""
        with self.lock, torch.no_grad():
            return self.model(self._input(x))

    # --- weights (horizontal) -------------------------------------------------------------------------------
    def weights(self, with_optimizer: bool) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
        """The client-side model (and its optimizer's state: the relay hands it on whole)."""
        if self.kind != "bottom":
            raise OutOfOrder("only a branch's bottom model moves between parties")
        with self.lock:
            self._at_boundary("read the weights")
            tensors = {f"model.{k}": v.detach().clone() for k, v in self.model.state_dict().items()}
            meta: dict[str, object] = {"step": self.step}
            if with_optimizer:
                optim, meta["optimizer"] = flatten_optimizer(self.optimizer, "optim")
                tensors.update(optim)
            return tensors, meta

    def load_weights(self, tensors: dict[str, torch.Tensor], meta: dict[str, object]) -> None:
        """Replace the bottom model (and, if given, its optimizer state) with a bank's: same names and shapes."""
        if self.kind != "bottom":
            raise OutOfOrder("only a branch's bottom model moves between parties")
        with self.lock:
            self._at_boundary("replace the weights")
            own = self.model.state_dict()
            model = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
            if set(model) != set(own):
                raise BadMessage(f"the weights must name exactly {sorted(own)}")
            for name, value in model.items():
                if value.shape != own[name].shape or value.dtype != torch.float32 or not all_finite(value):
                    raise BadMessage(f"weight {name!r} must be finite float32 of shape {tuple(own[name].shape)}")
            optim = {k[len("optim."):]: v for k, v in tensors.items() if k.startswith("optim.")}
            if optim:
                fresh = build_optimizer(self.model.parameters(), self.start.optimizer)
                shapes = [p.shape for p in self.model.parameters()]
                for name, value in optim.items():
                    index, _, key = name.partition(".")
                    if not index.isdigit() or int(index) >= len(shapes) or not all_finite(value) or (
                            value.dim() and value.shape != shapes[int(index)]):
                        raise BadMessage(f"optimizer state {name!r} does not fit this model")
                try:
                    unflatten_optimizer(fresh, optim, meta["optimizer"])  # type: ignore[arg-type]
                except (KeyError, ValueError, TypeError, AttributeError) as exc:
                    raise BadMessage(f"the optimizer state does not fit this model ({exc})") from exc
                self.optimizer = fresh
            self.model.load_state_dict(model)

    def _at_boundary(self, what: str) -> None:
        if self._pending is not None:
            raise OutOfOrder(f"cannot {what} while step {self._pending[0]} awaits its gradient")

    # --- checkpoints ----------------------------------------------------------------------------------------
    def checkpoint(self, step: int) -> None:
        """Write the state after step ``step`` (the last applied) to the session's folder."""
        with self.lock:
            if step != self.step:
                raise OutOfOrder(f"a checkpoint is of the last step applied ({self.step}), not {step}")
            self._at_boundary("checkpoint")
            if self.folder is None:
                raise OutOfOrder("this session has no folder for checkpoints")
            tensors = {f"model.{k}": v.detach().clone() for k, v in self.model.state_dict().items()}
            optim, meta = flatten_optimizer(self.optimizer, "optim")
            tensors.update(optim)
            write_checkpoint(self.folder, step, tensors, {"optimizer": meta, "step": step}, keep=None)

    def restore(self, step: int) -> None:
        """Go back to the checkpoint of step ``step``: weights, optimizer and step counter."""
        if self.folder is None:
            raise OutOfOrder("this session has no folder for checkpoints")
        with self.lock:
            saved = read_checkpoint(self.folder, step)
            self.model.load_state_dict(saved.section("model"))
            unflatten_optimizer(self.optimizer, saved.section("optim"), saved.meta["optimizer"])
            self.step, self._pending, self._answers = step, None, {}

    def close(self) -> None:
        if self.folder is not None:
            remove_checkpoints(self.folder)
