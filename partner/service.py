"""The partner's HTTP edge: thin routes over ``partner.core``."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import numpy as np
import torch
from fastapi import APIRouter, Depends, FastAPI, Header, Request, Response
from starlette.concurrency import run_in_threadpool

from parties.errors import BadMessage, OutOfOrder
from parties.protocol.messages import (
    ALIGNMENT_HEADER,
    OCTET_STREAM,
    PURPOSE_HEADER,
    AlignmentInfo,
    CheckpointList,
    FinishRequest,
    LoadModelRequest,
    ModelFiles,
    PrivacyReport,
    PsiOpenRequest,
    PsiOpenResponse,
    RestoreRequest,
    SessionList,
    TrainSessionInfo,
)
from parties.protocol.wire import SAFETENSORS, WireMessage, decode, encode
from parties.settings import PartnerSettings
from parties.tables.table import PartyTable
from parties.transport.app import create_party_app, read_body, require_role, require_self
from parties.transport.hot_routes import HotRequest, HotResponse, HotRoute
from parties.transport.tls import PeerIdentity
from partner.core import WAIT_SECONDS, PartnerCore

__all__ = ["create_app"]

logger = logging.getLogger(__name__)

bank_only = Depends(require_role("bank"))
psi = APIRouter(prefix="/psi/sessions", dependencies=[bank_only], tags=["alignment"])
train = APIRouter(prefix="/train/sessions", dependencies=[bank_only], tags=["training"])
admin = APIRouter(prefix="/admin", dependencies=[Depends(require_self)], tags=["operator"])


async def core(request: Request) -> PartnerCore:
    return request.app.state.core


def _octets(data: bytes) -> Response:
    return Response(content=data, media_type=OCTET_STREAM)


@psi.post("", response_model=PsiOpenResponse)
async def open_session(
    body: PsiOpenRequest, who: PeerIdentity = Depends(require_role("bank")), c: PartnerCore = Depends(core)
) -> PsiOpenResponse:
    return await run_in_threadpool(c.open_session, body, who.name)


@psi.put("/{session_id}/blinded/{index}", status_code=204)
async def put_blinded(session_id: str, index: int, request: Request, who: PeerIdentity = Depends(require_role("bank")),
                      c: PartnerCore = Depends(core)) -> Response:
    responder = c.session(session_id, who.name)
    data = await read_body(request, c.settings.max_body_bytes)
    responder.receive_blinded(index, data)
    return Response(status_code=204)


@psi.get("/{session_id}/reblinded/{index}")
async def get_reblinded(session_id: str, index: int, who: PeerIdentity = Depends(require_role("bank")),
                        c: PartnerCore = Depends(core)) -> Response:
    responder = c.session(session_id, who.name)
    return _octets(await run_in_threadpool(responder.reblinded_chunk, index, WAIT_SECONDS))


@psi.get("/{session_id}/blinded/{index}")
async def get_blinded(session_id: str, index: int, who: PeerIdentity = Depends(require_role("bank")),
                      c: PartnerCore = Depends(core)) -> Response:
    responder = c.session(session_id, who.name)
    return _octets(await run_in_threadpool(responder.blinded_chunk, index, WAIT_SECONDS))


@psi.post("/{session_id}/commit", response_model=AlignmentInfo)
async def commit(
    session_id: str,
    request: Request,
    alignment_id: str = Header(alias=ALIGNMENT_HEADER),
    purpose: str = Header("training", alias=PURPOSE_HEADER),
    who: PeerIdentity = Depends(require_role("bank")),
    c: PartnerCore = Depends(core),
) -> AlignmentInfo:
    c.session(session_id, who.name)
    data = await read_body(request, c.settings.max_body_bytes)
    if len(data) % 4:
        raise BadMessage("positions are little-endian uint32 values")
    positions = np.frombuffer(data, dtype="<u4").astype(np.int64)
    return await run_in_threadpool(c.commit, session_id, alignment_id, positions, purpose, who.name)


@psi.delete("/{session_id}", status_code=204)
async def abort(session_id: str, who: PeerIdentity = Depends(require_role("bank")),
                c: PartnerCore = Depends(core)) -> Response:
    c.abort(session_id, who.name)
    return Response(status_code=204)


def _checked(
    body: bytes, allowed: dict[str, torch.dtype], session: str | None, *, check_finite: bool = True
) -> WireMessage:
    message = decode(body, allowed, check_finite=check_finite)
    if session is not None and message.meta.get("session") != session:
        raise BadMessage("the message names another session than the URL")
    return message


async def _message(
    request: Request, c: PartnerCore, allowed: dict[str, torch.dtype], session: str | None, *, check_finite: bool = True
) -> WireMessage:
    return _checked(await read_body(request, c.settings.max_body_bytes), allowed, session, check_finite=check_finite)


def _tensors(tensors: dict[str, torch.Tensor], **meta: object) -> Response:
    return Response(content=encode(tensors, **meta), media_type=SAFETENSORS)


@train.get("", response_model=SessionList)
async def my_sessions(who: PeerIdentity = Depends(require_role("bank")), c: PartnerCore = Depends(core)) -> SessionList:
    """The calling bank's live sessions (a bank restarted after a crash finds what it left)."""
    return c.sessions(owner=who.name)


@train.post("", response_model=TrainSessionInfo)
async def start_training(
    request: Request, who: PeerIdentity = Depends(require_role("bank")), c: PartnerCore = Depends(core)
) -> TrainSessionInfo:
    message = await _message(request, c, {"train_rows": torch.int64}, None)
    rows = message.get("train_rows")
    if rows is None:
        raise BadMessage("the message carries no train_rows")
    session, alignment = message.meta.get("session", ""), message.meta.get("alignment", "")
    return await run_in_threadpool(c.start_training, session, alignment, rows, who.name)


def step(request: HotRequest) -> HotResponse:
    """One training step: a hot route (``parties.transport.hot_routes``), run on the event loop."""
    c: PartnerCore = request.state.core
    session_id = request.params["session_id"]
    session = c.training(session_id)
    session.writer.check()  # this partner's last checkpoint failed: the bank stops at this step
    # BottomTrainer.step checks the gradient's finiteness itself.
    message = _checked(request.body, {"grad": torch.float32, "rows": torch.int64}, session_id, check_finite=False)
    number = message.int_meta("step")
    floor = message.int_meta("keep_from") if "keep_from" in message.meta else None
    z = session.trainer.step(number, message.get("grad"), message.get("rows"))
    # The answer says which step this partner has on disk: the bank's retention counts on it.
    durable = {} if session.writer.durable is None else {"durable": session.writer.durable}
    body = encode({} if z is None else {"embedding": z}, session=session_id, step=number, **durable)
    # Every party checkpoints after the same step. The snapshot is taken once the answer has gone, before
    # the event loop reads the next request: the same state, off the bank's critical path.
    checkpoint = message.meta.get("checkpoint") == "1"
    return HotResponse(body, SAFETENSORS, after=(lambda: c.checkpoint(session_id, floor)) if checkpoint else None)


@train.post("/{session_id}/embed")
async def embed(session_id: str, request: Request, c: PartnerCore = Depends(core)) -> Response:
    trainer = c.training(session_id).trainer
    message = await _message(request, c, {"rows": torch.int64}, session_id)
    rows = message.get("rows")
    if rows is None:
        raise BadMessage("the message carries no rows")
    z = await run_in_threadpool(trainer.embed, rows)
    return _tensors({"embedding": z}, session=session_id)


@train.post("/{session_id}/best", status_code=204)
async def mark_best(session_id: str, c: PartnerCore = Depends(core)) -> Response:
    c.training(session_id).trainer.mark_best()
    return Response(status_code=204)


@train.post("/{session_id}/finish", response_model=ModelFiles)
async def finish(session_id: str, body: FinishRequest, c: PartnerCore = Depends(core)) -> ModelFiles:
    return await run_in_threadpool(c.finish_training, session_id, body.restore_best)


@train.get("/{session_id}/checkpoints", response_model=CheckpointList)
async def checkpoints(session_id: str, c: PartnerCore = Depends(core)) -> CheckpointList:
    return CheckpointList(session=session_id, steps=await run_in_threadpool(c.checkpoints, session_id))


@train.post("/{session_id}/restore", status_code=204)
async def restore(session_id: str, body: RestoreRequest, c: PartnerCore = Depends(core)) -> Response:
    await run_in_threadpool(c.restore, session_id, body.step)
    return Response(status_code=204)


@train.get("/{session_id}/privacy", response_model=PrivacyReport)
async def privacy(session_id: str, c: PartnerCore = Depends(core)) -> PrivacyReport:
    return c.privacy(session_id)


@train.delete("/{session_id}", status_code=204)
async def end_training(session_id: str, finished: bool = True, c: PartnerCore = Depends(core)) -> Response:
    """``finished=false``: unload the session only (the bank's run stopped; it stays resumable)."""
    await run_in_threadpool(c.end_training, session_id, finished)
    return Response(status_code=204)


models = APIRouter(prefix="/models", dependencies=[bank_only], tags=["scoring"])


@models.post("/{model_id}/load", status_code=204)
async def load_model(model_id: str, body: LoadModelRequest, c: PartnerCore = Depends(core)) -> Response:
    await run_in_threadpool(c.load_model, model_id, body.files, body.embedding_width)
    return Response(status_code=204)


@models.post("/{model_id}/embed")
async def embed_for_scoring(model_id: str, request: Request, c: PartnerCore = Depends(core)) -> Response:
    message = await _message(request, c, {"rows": torch.int64}, None)
    rows = message.get("rows")
    if rows is None:
        raise BadMessage("the message carries no rows")
    z, fallbacks = await run_in_threadpool(c.embed_for_scoring, model_id, message.meta.get("alignment", ""), rows)
    return _tensors({"embedding": z}, model=model_id, fallbacks=json.dumps(fallbacks))


@admin.get("/sessions", response_model=SessionList)
async def sessions(c: PartnerCore = Depends(core)) -> SessionList:
    """Every live session, PSI and training, whichever bank opened it."""
    return c.sessions()


@admin.delete("/sessions/{session_id}", status_code=204)
async def end_session(session_id: str, c: PartnerCore = Depends(core)) -> Response:
    """End a session for good (an abandoned one): a training session's checkpoints go with it."""
    await run_in_threadpool(c.end_session, session_id)
    return Response(status_code=204)


@admin.get("/alignment", response_model=AlignmentInfo)
async def alignment(c: PartnerCore = Depends(core)) -> AlignmentInfo:
    if c.alignment is None:
        raise OutOfOrder("no alignment yet")
    return AlignmentInfo(alignment_id=c.alignment.alignment_id, rows=len(c.alignment))


def create_app(settings: PartnerSettings, table: PartyTable | None = None) -> FastAPI:
    """The partner service: loads its own table at start-up (unless given one), answers the bank's PSI."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loaded = table or settings.load_table()
        app.state.core = PartnerCore(settings, loaded)
        try:
            yield
        finally:
            app.state.core.close()

    hot = [HotRoute("POST", "/train/sessions/{session_id}/step", "bank", step)]
    return create_party_app(settings, lifespan=lifespan, routers=[psi, train, models, admin], hot_routes=hot)
