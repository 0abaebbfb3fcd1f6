"""Layers held for a bank: one session's model, optimizer, step state and checkpoints (``parties.protocol.layers``).

A session is one of three kinds:

- ``trunk`` (U-shaped): ``forward`` takes the bank's cut-layer activations and returns the trunk's output;
  ``backward`` takes the gradient of that output, updates the trunk and returns the gradient of its input.
- ``server`` (vanilla): ``train`` takes activations and their targets, computes the task's loss, updates and
  returns the gradient of the activations; the labels of every training batch are the server's to see.
- ``bottom`` (horizontal): ``forward`` takes row positions in the branch's own table and returns their
  embedding; ``backward`` takes its gradient and updates. ``weights``/``load_weights`` move the client-side
  model between branches (relay) or replace it with the average (SplitFed).

Steps are numbered from 1 and applied in order, each exactly once: a call for a step already answered is
answered again from the cache, if it carries the same inputs (a retry); anything else is ``OutOfOrder``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from parties.errors import BadMessage, ConfigError, DataError, OutOfOrder
from parties.learning.model import build_optimizer, check_targets, mlp, task_loss
from parties.protocol.layers import LayerInfo, LayerStart
from parties.protocol.wire import all_finite
from parties.storage.checkpoint import (
    load_model_state,
    model_state,
    read_held_checkpoint,
    remove_checkpoints,
    write_checkpoint,
)

__all__ = ["LayerSession", "count_parameters", "digest"]

logger = logging.getLogger(__name__)


def digest(*tensors: torch.Tensor) -> bytes:
    """A fingerprint of a call's inputs: a retry carries the same bytes, another call does not."""
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        h.update(str((t.dtype, tuple(t.shape))).encode())
        # reshape first: a 0-d tensor (a bank may send one) cannot be viewed as bytes of another size
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.digest()


def count_parameters(in_width: int, hidden: tuple[int, ...], out_width: int) -> int:
    """The parameters of ``mlp(in_width, hidden, out_width)``, before building it (a bank cannot make us allocate)."""
    widths = [in_width, *hidden, out_width]
    return sum(a * b + b for a, b in zip(widths, widths[1:]))


#: The per-parameter state a checked optimizer state may hold (``load_weights``): fused Adam's, SGD's (none
#: without momentum, which ``OptimizerConfig`` does not offer).
_OPTIMIZER_STATE = {"adam": ("exp_avg", "exp_avg_sq", "step"), "sgd": ()}


def _state_fits(key: str, value: torch.Tensor, param: torch.Tensor) -> bool:
    """Whether one tensor of a bank's optimizer state is one this parameter's optimizer could hold."""
    if key == "step":  # Adam divides by 1 - beta ** step: 0 divides by zero, a fraction or a negative is no count
        return value.dim() == 0 and 1 <= float(value) < 1 << 53 and float(value).is_integer()
    if value.shape != param.shape or not all_finite(value):
        return False
    return key != "exp_avg_sq" or not bool((value < 0).any())  # its square root is taken


@dataclass
class _Answer:
    step: int
    inputs: bytes
    reply: dict[str, torch.Tensor]


class LayerSession:
    """One bank's layers in one session; every public method holds the session's lock."""

    def __init__(self, start: LayerStart, owner: str, folder: Path | None, features: torch.Tensor | None = None,
                 *, max_rows: int = 1 << 16, max_activations: int | None = None,
                 quota: Callable[[int], AbstractContextManager[object]] | None = None) -> None:
        """``quota(nbytes)``: holds ``nbytes`` of ``owner``'s disk quota for a checkpoint, or raises ``StorageError``."""
        self.start, self.owner, self.folder, self.quota = start, owner, folder, quota
        self.used = time.monotonic()  # the last call that named this session (``LayerHost`` expires idle ones)
        self.kind = start.kind
        if self.kind == "bottom":
            if features is None:
                raise DataError("a bottom session needs the branch's encoded rows")
            self.features = features
            self.in_width = int(features.shape[1])
        else:
            self.features = None
            self.in_width = start.in_width
        # One row holds an activation per layer width (kept for the backward): the rows a call may carry are
        # bounded so that rows x widths stays within ``max_activations``.
        per_row = self.in_width + sum(start.hidden) + start.out_width
        self.max_rows = min(max_rows, (max_activations or per_row * max_rows) // per_row)
        if self.max_rows < 1:
            raise ConfigError(f"one row of this model holds {per_row} activations; this service holds at most "
                              f"{max_activations} in one call")
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
            raise BadMessage(f"a call to this session carries 1 to {self.max_rows} rows, not {len(positions)}")
        if int(positions.min()) < 0 or int(positions.max()) >= len(self.features):
            raise BadMessage(f"row positions must lie in [0, {len(self.features)})")
        return self.features[positions]

    def _activations(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.in_width:
            raise BadMessage(f"activations must be (rows, {self.in_width}), not {tuple(x.shape)}")
        if not 0 < x.shape[0] <= self.max_rows:
            raise BadMessage(f"a call to this session carries 1 to {self.max_rows} rows, not {x.shape[0]}")
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
            if (wrong := check_targets(self.start.task, labels, x.shape[0], self.start.out_width)) is not None:
                raise BadMessage(f"labels: {wrong}")
            loss = task_loss(self.start.task, self.model(leaf), labels)
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
            tensors, optim_meta = model_state(self.model, self.optimizer if with_optimizer else None)
            meta: dict[str, object] = {"step": self.step}
            if optim_meta is not None:
                meta["optimizer"] = optim_meta
            return tensors, meta

    def load_weights(self, tensors: dict[str, torch.Tensor], meta: dict[str, object]) -> None:
        """Replace the bottom model (and, if given, its optimizer state) with a bank's: same names and shapes.

        The optimizer state is checked tensor by tensor against what this session's own optimizer holds; its
        hyper-parameters (``param_groups``) stay this session's, from its start: a bank that could send them
        could turn on ``maximize`` or ``amsgrad``, or map one parameter's moments onto another's, and the
        next step would fail inside the optimizer (or quietly train something else).
        """
        if self.kind != "bottom":
            raise OutOfOrder("only a branch's bottom model moves between parties")
        with self.lock:
            self._at_boundary("replace the weights")
            unknown = sorted(k for k in tensors if not k.startswith(("model.", "optim.")))
            if unknown:
                raise BadMessage(f"the weights name tensors this session does not hold: {unknown[:8]}")
            own = self.model.state_dict()
            model = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
            if set(model) != set(own):
                raise BadMessage(f"the weights must name exactly {sorted(own)}")
            for name, value in model.items():
                if value.shape != own[name].shape or value.dtype != torch.float32 or not all_finite(value):
                    raise BadMessage(f"weight 'model.{name}' must be finite float32 of shape "
                                     f"{tuple(own[name].shape)}")
            optim = {k[len("optim."):]: v for k, v in tensors.items() if k.startswith("optim.")}
            if optim:
                self.optimizer = self._checked_optimizer(optim, meta)
            self.model.load_state_dict(model)

    def _checked_optimizer(self, optim: dict[str, torch.Tensor], meta: dict[str, object]) -> torch.optim.Optimizer:
        """A fresh optimizer on this model, holding a bank's optimizer state once every tensor of it is checked."""
        fresh = build_optimizer(self.model.parameters(), self.start.optimizer)
        groups = fresh.state_dict()["param_groups"]
        described = meta.get("optimizer")
        if not isinstance(described, dict) or "param_groups" not in described:
            raise BadMessage("the optimizer state comes without its description (param_groups)")
        # As JSON carries them (tuples become lists); a key only one torch version has is no difference.
        mine, theirs = json.loads(json.dumps(groups)), described["param_groups"]
        if not (isinstance(theirs, list) and len(theirs) == len(mine) and all(
                isinstance(t, dict) and all(t[k] == m[k] for k in m.keys() & t.keys()) for t, m in zip(theirs, mine))):
            raise BadMessage(f"the optimizer's hyper-parameters are this session's own (param_groups {mine}); "
                             "they are not the bank's to change")
        if described.get("scalars"):
            raise BadMessage("the optimizer state holds values that are not tensors")
        params, keys = list(self.model.parameters()), _OPTIMIZER_STATE[self.start.optimizer.optimizer]
        state: dict[int, dict[str, torch.Tensor]] = {}
        for name, value in optim.items():
            index, _, key = name.partition(".")
            if not (index.isdigit() and int(index) < len(params) and key in keys
                    and _state_fits(key, value, params[int(index)])):
                raise BadMessage(f"optimizer state {name!r} does not fit this model")
            state.setdefault(int(index), {})[key] = value
        for index, entry in state.items():
            if set(entry) != set(keys):  # a parameter with some of its state: the optimizer's step fails on it
                raise BadMessage(f"optimizer state for parameter {index} must be all of {sorted(keys)} or none")
        fresh.load_state_dict({"state": state, "param_groups": groups})
        return fresh

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
            tensors, meta = model_state(self.model, self.optimizer)
            nbytes = sum(t.numel() * t.element_size() for t in tensors.values())  # its folder is the session's
            with self.quota(nbytes) if self.quota is not None else nullcontext():
                write_checkpoint(self.folder, step, tensors,
                                 {"optimizer": meta, "step": step, "layout": self._layout()}, keep=None)

    def _layout(self) -> dict[str, object]:
        """What a checkpoint's state fits: the model's shape and its optimizer (not the seed: only a start uses it)."""
        return {"kind": self.kind, "in_width": self.in_width, **self.start.model_dump(
            mode="json", include={"hidden", "out_width", "optimizer"})}

    def restore(self, step: int) -> None:
        """Go back to the checkpoint of step ``step``: weights, optimizer and step counter."""
        if self.folder is None:
            raise OutOfOrder("this session has no folder for checkpoints")
        with self.lock:
            try:
                saved = read_held_checkpoint(  # never a path made from the bank's number
                    self.folder, step, lambda held: f"this session has no checkpoint of step {step}")
            except DataError as exc:
                logger.error("%s", exc)  # the path is the operator's to see, not the bank's
                raise DataError(f"the checkpoint of step {step} is not readable") from exc
            # A bank may resume a session with another model than the one that wrote the checkpoint: loading
            # would fail half-way (a 500, the session half restored), or load another optimizer's state.
            if saved.meta.get("layout") != self._layout():
                raise OutOfOrder(f"the checkpoint of step {step} was written by another model "
                                 f"({saved.meta.get('layout')}), not this session's ({self._layout()})")
            load_model_state(self.model, self.optimizer, saved, saved.meta["optimizer"])
            self.step, self._pending, self._answers = step, None, {}

    def close(self) -> None:
        if self.folder is not None:
            remove_checkpoints(self.folder)
