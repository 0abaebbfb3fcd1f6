"""The services that hold layers for a bank: a compute party (trunk, or server) and a branch (bottom).

``python -m partner compute`` serves a compute party: certificate role ``compute``, no data of its own.
``python -m partner branch`` serves a branch of horizontal split learning: certificate role ``partner``, a
table with the bank's schema and customers of its own. Both answer the layer exchange
(``parties.protocol.layers``) to callers whose certificate says ``bank``, each bank seeing only its own
sessions; the routes are thin, the state is ``parties.learning.layer_host.LayerSession``.

A dishonest bank is expected (``tests/test_layer_security.py``). A service names the banks it serves
(``banks``, required): a bank that sets a bottom's weights and asks for predictions reads a branch's rows,
and any bank the CA certifies could otherwise take the service's sessions and disk. Sessions are keyed by
the calling bank and the session ID, so another bank can neither reach nor squat one (nor learn that it
exists); each bank has its own ``max_sessions`` and disk quota (checkpoints past it are refused with 507,
and those of sessions unused for ``checkpoint_ttl`` removed); every body, JSON ones too, is read within
``max_body_bytes``; what a bank asks to be held is bounded (widths, parameters, activations per call,
sessions, idle time) before anything is built; and a branch gives column statistics only on at least
``min_stats_rows`` distinct rows.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import torch
from fastapi import APIRouter, Depends, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool

from parties.errors import BadMessage, ConfigError, DataError, Forbidden, OutOfOrder, OverBudget, UnknownSession
from parties.learning.layer_host import LayerSession, count_parameters
from parties.learning.model import prepare_optimizers
from parties.protocol import layers
from parties.protocol.common import SCHEMA_VERSION
from parties.protocol.wire import SAFETENSORS, all_finite, decode, encode, parse
from partner.settings import LayerHostSettings
from parties.storage.checkpoint import remove_idle_sessions
from parties.storage.files import private_dir
from parties.storage.quota import FOLDER_BYTES, DiskQuota
from parties.tables.encoding import TabularEncoder, category_text
from parties.tables.table import FeatureSchema, PartyTable
from parties.transport.app import create_party_app, read_body, require_role
from parties.transport.tls import PeerIdentity

__all__ = ["LayerHost", "create_layer_app"]

logger = logging.getLogger(__name__)

is_bank = require_role("bank")


async def bank_only(request: Request, who: PeerIdentity = Depends(is_bank)) -> PeerIdentity:
    """A caller whose certificate says bank, and (if the service names its banks) one of those."""
    banks = request.app.state.settings.banks
    if banks and who.name not in banks:
        raise Forbidden(f"this service holds no layers for bank {who.name!r}")  # which banks it serves is its own
    return who


routes = APIRouter(tags=["layers"])
_FLOATS = (torch.float32,)
M = TypeVar("M", bound=BaseModel)


def _names(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _read_encoder(state: dict[str, Any], own: FeatureSchema, max_width: int) -> TabularEncoder:
    """The bank's shared encoder, checked before it encodes a row: its columns are this branch's, each of
    them is described (distinct categories; finite means, positive scales), and it is no wider than the
    widest layer this service holds (one-hot columns are allocated for every row before any layer is)."""
    if not (_names(state.get("numeric")) and _names(state.get("categorical"))):
        raise BadMessage("the shared encoder is not readable (its columns must be lists of names)")
    try:
        encoder = TabularEncoder.from_dict(dict(state))
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
        raise BadMessage(f"the shared encoder is not readable ({exc})") from exc
    if set(encoder.schema.numeric) != set(own.numeric) or set(encoder.schema.categorical) != set(own.categorical):
        raise DataError(
            f"the shared encoder's columns (numeric {sorted(encoder.schema.numeric)}, categorical "
            f"{sorted(encoder.schema.categorical)}) are not this branch's (numeric {sorted(own.numeric)}, "
            f"categorical {sorted(own.categorical)})"
        )
    for col in encoder.schema.categorical:
        if col not in encoder.categories_:
            raise BadMessage(f"the shared encoder lacks the categories of {col!r}")
        cats = encoder.categories_[col]
        if not _names(cats) or len(set(cats)) != len(cats):
            raise BadMessage(f"the categories of {col!r} are not a list of distinct strings")
    if encoder.bins:  # a configuration's bottom is the plain MLP over one-hot and z-scores
        raise BadMessage("the shared encoder has quantile bins: a configuration's bottom takes z-scores")
    width = len(encoder.schema.numeric) + sum(len(encoder.categories_[c]) for c in encoder.schema.categorical)
    if width > max_width:
        raise ConfigError(f"the shared encoder is {width} columns wide; this service holds layers of at most "
                          f"{max_width}")
    for col in encoder.schema.numeric:
        mean, scale = encoder.means_.get(col), encoder.scales_.get(col)
        if not (_number(mean) and _number(scale) and scale > 0):  # type: ignore[operator]
            raise BadMessage(f"the mean and scale of {col!r} must be finite numbers, the scale above 0")
    return encoder


class LayerHost:
    """The sessions a service holds, by (bank, session ID): a bank names only its own sessions."""

    def __init__(self, settings: LayerHostSettings, table: PartyTable | None) -> None:
        self.settings, self.table = settings, table
        self.root = settings.state_path / "layers"
        self.quota = DiskQuota(self.root, settings.quotas.disk_per_bank, party=f"{settings.role} {settings.name!r}")
        self.sessions: dict[tuple[str, str], LayerSession] = {}
        self._swept = -60.0  # when idle session folders were last swept (monotonic)
        self._lock = threading.Lock()
        self._starting = threading.Lock()  # one start at a time: the count checked is the count inserted into
        self._ids = layers.ids_sha256(table.ids) if table is not None else ""

    def _check_size(self, start: layers.LayerStart, in_width: int) -> None:
        s = self.settings
        widths = (in_width, *start.hidden, start.out_width)
        if max(widths) > s.max_width:
            raise ConfigError(f"a layer of width {max(widths)} is wider than this service holds ({s.max_width})")
        if (n := count_parameters(in_width, start.hidden, start.out_width)) > s.max_parameters:
            raise ConfigError(f"{n} parameters are more than this service holds ({s.max_parameters})")

    def _features(self, start: layers.LayerStart) -> torch.Tensor:
        if self.table is None:
            raise ConfigError("a compute party holds no rows: it runs trunk and server sessions, not bottoms")
        encoder = _read_encoder(dict(start.encoder or {}), self.table.schema, self.settings.max_width)
        encoded, fallbacks = encoder.encode(self.table.features)
        for column, counts in fallbacks.items():  # never silent: the log says which rows took a policy
            logger.warning("column %r: %s rows took the encoder's fallback", column, counts)
        return torch.from_numpy(encoded)

    def _expire(self) -> None:
        """Drop sessions idle past ``session_ttl`` (not one in a call): memory back, checkpoints kept on disk."""
        now = time.monotonic()
        with self._lock:
            for key, session in list(self.sessions.items()):
                if now - session.used > self.settings.session_ttl and not session.lock.locked():
                    del self.sessions[key]
                    logger.info("session %s of %s idle for %.0fs: dropped (resumable from its checkpoints)",
                                key[1], key[0], now - session.used)

    def _sweep(self) -> None:
        """Remove the folders of sessions unused for ``checkpoint_ttl`` (and not live), once a minute at most."""
        if time.monotonic() - self._swept < min(60.0, self.settings.quotas.checkpoint_ttl / 2):
            return
        self._swept = time.monotonic()
        live = {s.folder for s in self.sessions.values()}
        idle = [f for f in self.root.glob("*/*") if f not in live] if self.root.is_dir() else []
        for folder in remove_idle_sessions(idle, self.settings.quotas.checkpoint_ttl):
            logger.info("session %s of %s unused for over %.0f s: its folder was removed", folder.name,
                        folder.parent.name, self.settings.quotas.checkpoint_ttl)

    def start(self, start: layers.LayerStart, owner: str) -> layers.LayerInfo:
        key = (owner, start.session)
        with self._starting:
            self._expire()
            self._sweep()
            held = sum(1 for bank, _ in self.sessions if bank == owner)
            if key not in self.sessions and held >= self.settings.max_sessions:
                raise OverBudget(f"{owner} holds {held} sessions here, the most one bank may; end one first "
                                 f"(an idle one ends after {self.settings.session_ttl:.0f}s)")
            features = self._features(start) if start.kind == "bottom" else None
            self._check_size(start, int(features.shape[1]) if features is not None else start.in_width)
            folder = self.quota.folder(owner) / start.session
            if not folder.is_dir():  # a session's folder is disk of its bank's too: no folders past the quota
                with self.quota.reserve(owner, FOLDER_BYTES):
                    private_dir(folder)
            session = LayerSession(start, owner, folder, features, max_rows=self.settings.max_batch_rows,
                                   max_activations=self.settings.max_activations,
                                   quota=lambda nbytes: self.quota.reserve(owner, nbytes))
            with self._lock:
                self.sessions[key] = session
        logger.info("%s session %s for %s: %s, %d parameters%s", start.kind, start.session, owner,
                    f"{session.in_width} -> {start.hidden} -> {start.out_width}",
                    sum(p.numel() for p in session.model.parameters()),
                    f", resumed at step {start.resume_step}" if start.resume_step is not None else "")
        rows = len(self.table) if self.table is not None and start.kind == "bottom" else 0
        return session.info(rows, self._ids if rows else "")

    def session(self, session_id: str, owner: str) -> LayerSession:
        self._expire()
        session = self.sessions.get((owner, session_id))
        if session is None:  # another bank's session too: not even its existence is told
            raise UnknownSession(f"no layer session {session_id!r} (ended, idle too long, or this service restarted)")
        session.used = time.monotonic()
        return session

    def end(self, session_id: str, owner: str) -> None:
        session = self.session(session_id, owner)
        with self._lock:
            self.sessions.pop((owner, session_id), None)
        session.close()

    def stats(self, positions: list[int]) -> layers.StatsReply:
        """Sums and value sets on the named rows: never on fewer than ``min_stats_rows`` distinct rows.

        A sum of one row is that row's value; of a few, close to it. The bank and its branches are one
        organisation, but the exchange promises sums, not rows: asking for row k alone, or for a row many
        times over, is refused. Two calls whose rows differ by one still tell that row by their difference:
        the minimum bounds what one call shows, not what a bank that calls twice may work out.
        """
        if self.table is None:
            raise ConfigError("a compute party holds no rows")
        if not positions or min(positions) < 0 or max(positions) >= len(self.table):
            raise BadMessage(f"positions must be a non-empty list in [0, {len(self.table)})")
        distinct, least = len(set(positions)), self.settings.min_stats_rows
        if distinct < least:
            raise BadMessage(f"column statistics are given on at least {least} distinct rows, not {distinct}")
        if distinct != len(positions):
            raise BadMessage("positions name a row more than once: each row counts once in the statistics")
        frame = self.table.features.iloc[positions]
        numeric = {}
        for col in self.table.schema.numeric:
            values = torch.tensor(frame[col].astype("float64").to_numpy())
            seen = values[~torch.isnan(values)]
            numeric[col] = (int(seen.numel()), float(seen.sum()), float((seen * seen).sum()))
        categorical = {col: sorted(category_text(frame[col]).unique().tolist()) for col in self.table.schema.categorical}
        return layers.StatsReply(rows=len(positions), numeric=numeric, categorical=categorical)


async def host(request: Request) -> LayerHost:
    return request.app.state.host


async def _json(request: Request, h: LayerHost, model: type[M]) -> M:
    """A JSON body read within ``max_body_bytes`` (FastAPI's own body parameter reads any size), then validated."""
    body = await read_body(request, h.settings.max_body_bytes)
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False, include_context=False)) from exc


async def _tensors(request: Request, h: LayerHost, allowed: dict[str, object]) -> tuple[dict[str, torch.Tensor], int]:
    message = decode(await read_body(request, h.settings.max_body_bytes), allowed)  # type: ignore[arg-type]
    return message.tensors, message.int_meta("step")


def _reply(session_id: str, step: int, tensors: dict[str, torch.Tensor], **meta: object) -> Response:
    return Response(content=encode(tensors, session=session_id, step=step, **meta), media_type=SAFETENSORS)


def _need(tensors: dict[str, torch.Tensor], *names: str) -> list[torch.Tensor]:
    missing = [n for n in names if n not in tensors]
    if missing:
        raise BadMessage(f"the message lacks {missing}")
    return [tensors[n] for n in names]


@routes.post(layers.SESSIONS, response_model=layers.LayerInfo)
async def start(request: Request, who: PeerIdentity = Depends(bank_only),
                h: LayerHost = Depends(host)) -> layers.LayerInfo:
    return await run_in_threadpool(h.start, await _json(request, h, layers.LayerStart), who.name)


@routes.post(layers.FORWARD)
async def forward(session_id: str, request: Request, who: PeerIdentity = Depends(bank_only),
                  h: LayerHost = Depends(host)) -> Response:
    session = h.session(session_id, who.name)
    tensors, step = await _tensors(request, h, {"x": (torch.float32, torch.int64)})
    (x,) = _need(tensors, "x")
    return _reply(session_id, step, {"output": await run_in_threadpool(session.forward, step, x)})


@routes.post(layers.STEP)
async def step(session_id: str, request: Request, who: PeerIdentity = Depends(bank_only),
               h: LayerHost = Depends(host)) -> Response:
    """A bottom's step in one round trip: apply the gradient of step ``step - 1`` (if sent), then embed the rows.

    Each half is exactly once on its own (``LayerSession``), so a resent message changes nothing twice."""
    session = h.session(session_id, who.name)
    tensors, number = await _tensors(request, h, {"grad": _FLOATS, "x": torch.int64})
    (x,) = _need(tensors, "x")
    if session.kind != "bottom":
        raise OutOfOrder(f"a {session.kind} session steps with forward and backward: only a bottom's gradient and "
                         "next rows can share a round trip")

    def both() -> torch.Tensor:
        if "grad" in tensors:
            session.backward(number - 1, tensors["grad"])
        return session.forward(number, x)

    return _reply(session_id, number, {"output": await run_in_threadpool(both)})


@routes.post(layers.BACKWARD)
async def backward(session_id: str, request: Request, who: PeerIdentity = Depends(bank_only),
                   h: LayerHost = Depends(host)) -> Response:
    session = h.session(session_id, who.name)
    tensors, step = await _tensors(request, h, {"grad": _FLOATS})
    (grad,) = _need(tensors, "grad")
    out = await run_in_threadpool(session.backward, step, grad)
    return _reply(session_id, step, {"grad": out} if out is not None else {})


@routes.post(layers.TRAIN)
async def train(session_id: str, request: Request, who: PeerIdentity = Depends(bank_only),
                h: LayerHost = Depends(host)) -> Response:
    session = h.session(session_id, who.name)
    tensors, step = await _tensors(request, h, {"x": _FLOATS, "labels": (torch.float32, torch.int64)})
    x, labels = _need(tensors, "x", "labels")
    grad, loss = await run_in_threadpool(session.train, step, x, labels)
    return _reply(session_id, step, {"grad": grad}, loss=repr(loss))


@routes.post(layers.PREDICT)
async def predict(session_id: str, request: Request, who: PeerIdentity = Depends(bank_only),
                  h: LayerHost = Depends(host)) -> Response:
    session = h.session(session_id, who.name)
    tensors, step = await _tensors(request, h, {"x": (torch.float32, torch.int64)})
    (x,) = _need(tensors, "x")
    return _reply(session_id, step, {"output": await run_in_threadpool(session.predict, x)})


@routes.get(layers.WEIGHTS)
async def get_weights(session_id: str, optimizer: bool = False, who: PeerIdentity = Depends(bank_only),
                      h: LayerHost = Depends(host)) -> Response:
    session = h.session(session_id, who.name)
    tensors, meta = await run_in_threadpool(session.weights, optimizer)
    return _reply(session_id, session.step, tensors, state=json.dumps(meta))


@routes.put(layers.WEIGHTS, status_code=204)
async def put_weights(session_id: str, request: Request, who: PeerIdentity = Depends(bank_only),
                      h: LayerHost = Depends(host)) -> Response:
    session = h.session(session_id, who.name)
    header, tensors = parse(await read_body(request, h.settings.max_body_bytes))
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict) or meta.get("schema_version") != str(SCHEMA_VERSION):
        raise BadMessage(f"schema version {meta.get('schema_version') if isinstance(meta, dict) else None!r} "
                         f"is not supported (expected {SCHEMA_VERSION})")
    if not all(t.dtype == torch.float32 and all_finite(t) for t in tensors.values()):
        raise BadMessage("weights must be finite float32")
    try:
        state = json.loads(meta.get("state", "{}"))
    except json.JSONDecodeError as exc:
        raise BadMessage("the weights' state is not JSON") from exc
    if not isinstance(state, dict):
        raise BadMessage("the weights' state is not a JSON object")
    await run_in_threadpool(session.load_weights, tensors, state)
    return Response(status_code=204)


@routes.post(layers.CHECKPOINT, status_code=204)
async def checkpoint(session_id: str, step: int, who: PeerIdentity = Depends(bank_only),
                     h: LayerHost = Depends(host)) -> Response:
    await run_in_threadpool(h.session(session_id, who.name).checkpoint, step)
    return Response(status_code=204)


@routes.post(layers.RESTORE, status_code=204)
async def restore(session_id: str, step: int, who: PeerIdentity = Depends(bank_only),
                  h: LayerHost = Depends(host)) -> Response:
    await run_in_threadpool(h.session(session_id, who.name).restore, step)
    return Response(status_code=204)


@routes.delete(layers.SESSION, status_code=204)
async def end(session_id: str, who: PeerIdentity = Depends(bank_only), h: LayerHost = Depends(host)) -> Response:
    await run_in_threadpool(h.end, session_id, who.name)
    return Response(status_code=204)


@routes.post(layers.STATS, response_model=layers.StatsReply)
async def stats(request: Request, _: PeerIdentity = Depends(bank_only),
                h: LayerHost = Depends(host)) -> layers.StatsReply:
    return await run_in_threadpool(h.stats, (await _json(request, h, layers.StatsRequest)).positions)


def create_layer_app(settings: LayerHostSettings, table: PartyTable | None = None) -> FastAPI:
    """A compute party's service (no table) or a branch's (its own table, loaded at start-up unless given)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        prepare_optimizers()
        loaded = table if table is not None or settings.data is None else settings.load_table()
        app.state.host = LayerHost(settings, loaded)
        yield

    return create_party_app(settings, lifespan=lifespan, routers=[routes])
