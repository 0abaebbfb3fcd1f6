"""The layer exchange: a bank drives layers that another party holds, one cut at a time.

Two configurations of split learning beside vertical use it:

- **U-shaped and vanilla** (``bank/configurations/u_shaped.py``): the bank owns the data (and the labels); a *compute party*
  (certificate role ``compute``) holds a ``trunk`` (U-shaped: the bank keeps its head, so labels never
  leave it) or a ``server`` (vanilla: the rest of the model and the loss, so each batch's labels go with it).
- **Horizontal** (``bank/configurations/horizontal.py``): *branches* with the bank's schema and customers of their own
  each hold a ``bottom`` on their own rows; the bank holds the top and the labels, and moves the
  client-side weights between branches (relay) or averages them (SplitFed).

Bodies are JSON for control and safetensors (``parties.protocol.wire``) for tensors, as for vertical.
A training step is numbered; a step already answered is answered again from the party's cache, so a
retry after a lost reply never applies an update twice (exactly once). Checkpoints are numbered by step.
A branch's steps take one round trip each (``STEP``: the gradient of step *s−1*, then the rows of step *s*),
as vertical's do; a trunk's take two, because the bank's bottom needs the trunk's input gradient of step
*s* before it can compute step *s+1*'s activations.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Literal

from pydantic import Field, model_validator

from parties.learning.config import OptimizerConfig, TaskKind
from parties.protocol.common import Message

__all__ = [
    "BACKWARD", "CHECKPOINT", "FORWARD", "PREDICT", "RESTORE", "SESSION", "SESSIONS", "STATS", "STEP", "TRAIN",
    "WEIGHTS",
    "LayerInfo", "LayerKind", "LayerStart", "StatsReply", "StatsRequest", "ids_sha256",
]

SESSIONS = "/layers/sessions"
SESSION = "/layers/sessions/{session_id}"
FORWARD = "/layers/sessions/{session_id}/forward"
BACKWARD = "/layers/sessions/{session_id}/backward"
TRAIN = "/layers/sessions/{session_id}/train"
#: A bottom's step in one round trip: the gradient of the step before (if any), then the next batch's rows.
STEP = "/layers/sessions/{session_id}/step"
PREDICT = "/layers/sessions/{session_id}/predict"
CHECKPOINT = "/layers/sessions/{session_id}/checkpoints/{step}"
RESTORE = "/layers/sessions/{session_id}/restore/{step}"
WEIGHTS = "/layers/sessions/{session_id}/weights"
#: A branch's column statistics on rows the bank names: the bank builds one encoder every branch shares.
STATS = "/layers/stats"

LayerKind = Literal["trunk", "server", "bottom"]
SessionId = str
_SESSION = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"


class LayerStart(Message):
    """Start (or, with ``resume_step``, resume from a checkpoint) a session of layers held for the caller.

    ``trunk``: an MLP from ``in_width`` to ``out_width`` (ReLU after each layer, the last too).
    ``server``: an MLP from ``in_width`` to the task's outputs (``out_width``: one, or one per class) and the
    task's loss (``task``) on the targets sent with each batch (vanilla). ``bottom``: an MLP from the branch's encoded columns (``encoder``) to
    ``out_width``, ReLU after the last layer too, as every party's bottom model.
    """

    session: SessionId = Field(pattern=_SESSION)
    kind: LayerKind
    in_width: int = Field(0, ge=0, le=1 << 16, description="trunk, server: the width the bank sends")
    hidden: tuple[int, ...] = Field((64,), max_length=16)
    out_width: int = Field(16, ge=1, le=1 << 16)
    seed: int = Field(0, ge=-(1 << 63), lt=1 << 64, description="torch's generator takes no seed outside this range")
    optimizer: OptimizerConfig = OptimizerConfig()
    encoder: dict[str, object] | None = Field(None, description="bottom: the shared encoder (TabularEncoder.to_dict)")
    resume_step: int | None = Field(None, ge=0, description="load this step's checkpoint instead of starting afresh")
    task: TaskKind = Field("binary", description="server: the loss it computes (parties.learning.model.task_loss)")

    @model_validator(mode="after")
    def _shape(self) -> LayerStart:
        if self.kind == "bottom":
            if self.encoder is None:
                raise ValueError("a bottom session needs the shared encoder")
        elif self.in_width < 1:
            raise ValueError(f"a {self.kind} session needs in_width >= 1")
        if self.kind == "server" and (self.out_width < 2 if self.task == "multiclass" else self.out_width != 1):
            raise ValueError(f"a server session of a {self.task} task ends in "
                             + ("one logit per class: out_width must be at least 2" if self.task == "multiclass"
                                else "one output: out_width must be 1"))
        if any(h < 1 for h in self.hidden):
            raise ValueError("hidden widths must be at least 1")
        o = self.optimizer  # JSON carries 1e400 (and pydantic's reader Infinity): a model of NaN from its first step
        if not (math.isfinite(o.learning_rate) and math.isfinite(o.weight_decay)):
            raise ValueError(f"the optimizer's learning_rate ({o.learning_rate}) and weight_decay ({o.weight_decay}) "
                             "must be finite")
        return self


class LayerInfo(Message):
    """What the service holds for a session, so the bank can check it before the first step."""

    session: SessionId
    kind: LayerKind
    in_width: int
    out_width: int
    parameters: int
    step: int = Field(description="the last training step applied (0: none)")
    rows: int = Field(0, description="bottom: how many rows the branch holds")
    ids_sha256: str = Field("", description="bottom: SHA-256 of the branch's customer IDs in row order")


class StatsRequest(Message):
    """The rows (positions in the branch's table) the shared encoder is fitted on: the training rows."""

    positions: list[int] = Field(max_length=1 << 24)


class StatsReply(Message):
    """Per numeric column: count, sum and sum of squares; per categorical column: the values seen.

    Sums, not rows: enough for the bank to build the one encoder every branch shares.
    """

    rows: int
    numeric: dict[str, tuple[int, float, float]]
    categorical: dict[str, list[str]]


def ids_sha256(ids: Sequence[str]) -> str:
    """SHA-256 of customer IDs in row order, joined by newlines: the bank checks its labels line up with a branch's
    rows. Hashed a block at a time, so a column of 10^7 IDs is never one string."""
    h = hashlib.sha256()
    block = 1 << 16
    for start in range(0, len(ids), block):
        h.update(("\n" if start else "").encode() + "\n".join(ids[start : start + block]).encode())
    return h.hexdigest()
