"""The bank's end of the layer exchange (``parties.protocol.layers``): a compute party or a branch over mutual TLS.

Every call is idempotent (the service answers a repeated step from its cache), so a call that gets no answer
is sent again under the one retry rule of ``bank.peer.PeerLink``, which also bounds what an answer may hold and
maps refusals to errors. Whatever the peer answers is checked here: shapes, dtypes, finiteness, the session
and step it echoes, and what it says it holds (``LayerInfo``, weights, statistics) against what the bank asked.
"""

from __future__ import annotations

import json
import logging
import math
import re

import httpx
import torch

from bank.peer import HEADER_ROOM, JSON_LIMIT, PeerLink
from parties.errors import PeerError, UnknownSession
from parties.learning.layer_host import count_parameters
from parties.protocol import layers
from parties.protocol.common import fill
from parties.protocol.wire import SAFETENSORS, WireMessage, all_finite, decode, encode, parse

__all__ = ["LayerPeer"]

logger = logging.getLogger(__name__)
#: The most a weights answer may hold (a branch's bottom and its optimizer's moments).
WEIGHTS_LIMIT = 256 << 20
_OPTIM = re.compile(r"^optim\.(\d+)\.[a-z_]+$")


class LayerPeer(PeerLink):
    """A compute party (``role="compute"``) or a branch (``role="partner"``) holding layers for this bank."""

    def __init__(self, name: str, url: str, client: httpx.Client, role: str, *, retry_deadline: float = 60.0,
                 answer_deadline: float = 600.0) -> None:
        super().__init__(name, url, client, role, retry_deadline=retry_deadline, answer_deadline=answer_deadline)
        self.session_id = ""
        self.layer_start: layers.LayerStart | None = None
        self.info: layers.LayerInfo | None = None

    def _tensors(self, template: str, what: str, tensors: dict[str, torch.Tensor], step: int,
                 answer: dict[str, object], elements: int) -> WireMessage:
        """Send ``tensors``; the answer holds at most ``elements`` float32 values and echoes the session and step."""
        body = encode(tensors, session=self.session_id, step=step)
        path = fill(template, session_id=self.session_id)
        content = self.call("POST", path, what, HEADER_ROOM + 4 * elements, content=body,
                            headers={"content-type": SAFETENSORS})
        message = self.decoded(lambda: decode(content, answer), what)  # type: ignore[arg-type]
        said = (message.meta.get("step"), message.meta.get("session"))
        if said != (str(step), self.session_id):  # a stale or confused cache answers another call
            raise PeerError(f"{self.who} answered step {said[0]} of session {said[1]!r} to step {step} "
                            f"of session {self.session_id!r} ({what})")
        return message

    def _shaped(self, t: torch.Tensor | None, shape: tuple[int, ...], what: str) -> torch.Tensor:
        if t is None or tuple(t.shape) != shape:
            raise PeerError(f"{self.who} sent {what} of shape "
                            f"{None if t is None else tuple(t.shape)}; expected {shape}")
        return t

    # --- the exchange ---------------------------------------------------------------------------------------
    def start(self, start: layers.LayerStart) -> layers.LayerInfo:
        self.session_id = start.session
        content = self.call("POST", layers.SESSIONS, "start", JSON_LIMIT, json=start.model_dump(mode="json"))
        info = self.decoded(lambda: layers.LayerInfo.model_validate_json(content), "start")
        # Everything the bank will check answers against comes from what it asked, not from what the peer says.
        in_width = _encoder_width(start.encoder) if start.kind == "bottom" else start.in_width
        expected = (start.session, start.kind, in_width, start.out_width,
                    count_parameters(in_width, start.hidden, start.out_width), start.resume_step or 0)
        said = (info.session, info.kind, info.in_width, info.out_width, info.parameters, info.step)
        if said != expected:
            raise PeerError(f"{self.who} started {info.kind} session {info.session!r} with "
                            f"in_width {info.in_width}, out_width {info.out_width}, {info.parameters} parameters, "
                            f"at step {info.step}; the bank asked for {start.kind} session {start.session!r} with "
                            f"in_width {expected[2]}, out_width {start.out_width}, {expected[4]} parameters, at step "
                            f"{expected[5]}")
        self.layer_start, self.info = start, info
        return info

    @property
    def out_width(self) -> int:
        assert self.info is not None, "start the session first"
        return self.info.out_width

    def forward(self, step: int, x: torch.Tensor) -> torch.Tensor:
        m = self._tensors(layers.FORWARD, f"forward of step {step}", {"x": x}, step, {"output": torch.float32},
                          len(x) * self.out_width)
        return self._shaped(m.get("output"), (len(x), self.out_width), f"the output of step {step}")

    def step(self, step: int, grad: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
        """A branch's step in one round trip: the gradient of step ``step - 1`` (``None``: none due), then the
        embedding of ``rows`` for step ``step``."""
        tensors = {"x": rows} if grad is None else {"grad": grad, "x": rows}
        m = self._tensors(layers.STEP, f"step {step}", tensors, step, {"output": torch.float32},
                          len(rows) * self.out_width)
        return self._shaped(m.get("output"), (len(rows), self.out_width), f"the output of step {step}")

    def backward(self, step: int, grad: torch.Tensor) -> torch.Tensor | None:
        assert self.info is not None, "start the session first"
        m = self._tensors(layers.BACKWARD, f"backward of step {step}", {"grad": grad}, step, {"grad": torch.float32},
                          len(grad) * self.info.in_width if self.info.kind == "trunk" else 0)
        if self.info is not None and self.info.kind == "trunk":
            return self._shaped(m.get("grad"), (len(grad), self.info.in_width), f"the input gradient of step {step}")
        return None

    def train(self, step: int, x: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, float]:
        m = self._tensors(layers.TRAIN, f"step {step}", {"x": x, "labels": labels}, step, {"grad": torch.float32},
                          x.numel())
        grad = self._shaped(m.get("grad"), tuple(x.shape), f"the gradient of step {step}")
        try:
            loss = float(m.meta["loss"])
        except (KeyError, ValueError):
            loss = math.nan
        if not math.isfinite(loss):  # "nan" and "inf" are floats to Python: a loss curve of NaN, silently
            raise PeerError(
                f"{self.who} sent no finite loss for step {step}: {m.meta.get('loss')!r:.40}")
        return grad, loss

    def predict(self, x: torch.Tensor, batch: int = 8192) -> torch.Tensor:
        parts = []
        for i in range(0, len(x), batch):
            chunk = x[i: i + batch]
            m = self._tensors(layers.PREDICT, "predict", {"x": chunk}, 0, {"output": torch.float32},
                              len(chunk) * self.out_width)
            parts.append(self._shaped(m.get("output"), (len(chunk), self.out_width), "a prediction"))
        return torch.cat(parts) if parts else torch.zeros(0, self.out_width)

    def checkpoint(self, step: int) -> None:
        self.call("POST", fill(layers.CHECKPOINT, session_id=self.session_id, step=step), f"checkpoint {step}")

    def restore(self, step: int) -> None:
        self.call("POST", fill(layers.RESTORE, session_id=self.session_id, step=step), f"restore {step}")

    def weights(self, optimizer: bool) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
        """The peer's model (and optimizer state): the names and shapes of the model the bank asked for."""
        path = fill(layers.WEIGHTS, session_id=self.session_id)
        content = self.call("GET", path, "weights", WEIGHTS_LIMIT, params={"optimizer": str(optimizer).lower()})
        header, tensors = self.decoded(lambda: parse(content), "weights")
        if not all(t.dtype == torch.float32 and all_finite(t) for t in tensors.values()):
            raise PeerError(f"{self.who} sent weights that are not finite float32")
        self._check_weights(tensors, optimizer)
        meta = header.get("__metadata__") or {}
        try:
            state = json.loads(meta.get("state", "{}"))  # type: ignore[union-attr]
        except (AttributeError, TypeError, json.JSONDecodeError, RecursionError):
            state = None
        if not isinstance(state, dict):
            raise PeerError(f"{self.who} sent weights without their state")
        return tensors, state

    def _check_weights(self, tensors: dict[str, torch.Tensor], optimizer: bool) -> None:
        """The model tensors are exactly the asked model's; the optimizer's name its parameters, in their shapes.

        The bank hands these on to other branches and averages them: a tensor it did not ask for would fail
        there, or in ``fedavg``, far from the branch that sent it.
        """
        assert self.layer_start is not None and self.info is not None, "start the session first"
        widths = [self.info.in_width, *self.layer_start.hidden, self.info.out_width]
        shapes: dict[str, tuple[int, ...]] = {}
        for j, (a, b) in enumerate(zip(widths, widths[1:])):
            shapes[f"model.{2 * j}.weight"], shapes[f"model.{2 * j}.bias"] = (b, a), (b,)
        params = list(shapes.values())
        model = sorted(k for k in tensors if not _OPTIM.match(k))
        if model != sorted(shapes):
            raise PeerError(f"{self.who} sent weights named {model[:10]}; expected {sorted(shapes)}")
        for name in model:
            if tuple(tensors[name].shape) != shapes[name]:
                raise PeerError(f"{self.who} sent {name!r} of shape {tuple(tensors[name].shape)}; "
                                f"expected {shapes[name]}")
        for name in tensors.keys() - set(model):
            index = int(_OPTIM.match(name).group(1))  # type: ignore[union-attr]
            if not optimizer or index >= len(params) or tuple(tensors[name].shape) not in (params[index], ()):
                raise PeerError(f"{self.who} sent optimizer state {name!r} of shape "
                                f"{tuple(tensors[name].shape)}, which no parameter of the model has")

    def load_weights(self, tensors: dict[str, torch.Tensor], state: dict[str, object]) -> None:
        body = encode(tensors, session=self.session_id, step=0, state=json.dumps(state))
        self.call("PUT", fill(layers.WEIGHTS, session_id=self.session_id), "new weights", content=body,
                  headers={"content-type": SAFETENSORS})

    def stats(self, positions: list[int]) -> layers.StatsReply:
        """A branch's column sums and value sets on ``positions``, each of them possible for that many rows.

        The bank builds every branch's encoder from these: a NaN, an infinity or a sum no set of rows has
        would put NaN (or a scale of nothing) into every branch's features.
        """
        content = self.call("POST", layers.STATS, "column statistics", JSON_LIMIT,
                            json=layers.StatsRequest(positions=positions).model_dump(mode="json"))
        reply = self.decoded(lambda: layers.StatsReply.model_validate_json(content), "column statistics")
        rows = len(positions)
        if reply.rows != rows:
            raise PeerError(f"{self.who} sent statistics of {reply.rows} rows; {rows} were asked")
        for col, (count, total, squares) in reply.numeric.items():
            # Cauchy-Schwarz: (sum x)^2 <= n * sum x^2 for any n values; a little room for rounding.
            if not (0 <= count <= rows and math.isfinite(total) and math.isfinite(squares) and squares >= 0
                    and total * total <= count * squares * (1 + 1e-9) + 1e-9):
                raise PeerError(f"{self.who} sent statistics of column {col!r} that no {count} of "
                                f"{rows} rows have: count {count}, sum {total}, sum of squares {squares}")
        for col, values in reply.categorical.items():
            if len(values) > rows or len(set(values)) != len(values):
                raise PeerError(f"{self.who} sent {len(values)} values of column {col!r} for {rows} "
                                "rows (or the same value twice)")
        return reply

    def end(self) -> None:
        if self.session_id:
            try:
                self.once("DELETE", fill(layers.SESSION, session_id=self.session_id), "end")
            except (PeerError, UnknownSession) as exc:
                logger.warning("ending %s %s's session: %s", self.role, self.name, exc)


def _encoder_width(encoder: dict[str, object] | None) -> int:
    """The width a shared encoder (``TabularEncoder.to_dict``) encodes to: one column per numeric, one per category."""
    state = encoder or {}
    numeric, categorical, categories = state.get("numeric"), state.get("categorical"), state.get("categories")
    try:
        return len(numeric) + sum(len(categories[c]) for c in categorical)  # type: ignore[arg-type,index]
    except (TypeError, KeyError):
        return -1  # the bank's own encoder is malformed: no answer can match
