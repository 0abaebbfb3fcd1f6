"""The partner's HTTP edge: thin routes over ``partner.core``."""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Header, Request, Response
from starlette.concurrency import run_in_threadpool

from parties.learning.model import prepare_optimizers
from parties.observability import SESSIONS, log_context
from parties.protocol import control, psi, scoring, training
from parties.protocol.common import OCTET_STREAM
from parties.protocol.wire import SAFETENSORS
from parties.tables.table import PartyTable
from parties.transport.app import create_party_app, read_body, require_role, require_self
from parties.transport.hot_routes import HotRequest, HotResponse, HotRoute
from parties.transport.tls import PeerIdentity
from partner.core import WAIT_SECONDS, PartnerCore
from partner.settings import PartnerSettings

__all__ = ["create_app"]

logger = logging.getLogger(__name__)

bank_only = Depends(require_role("bank"))
bank_caller = Depends(require_role("bank"))  # the calling bank, by name: what the partner holds for it alone
# Routes are declared with the templates of ``parties.protocol``, the same the bank fills.
psi_routes = APIRouter(dependencies=[bank_only], tags=["alignment"])
train = APIRouter(dependencies=[bank_only], tags=["training"])
models = APIRouter(dependencies=[bank_only], tags=["scoring"])
admin = APIRouter(dependencies=[Depends(require_self)], tags=["operator"])


async def core(request: Request) -> PartnerCore:
    return request.app.state.core


def _octets(data: bytes) -> Response:
    return Response(content=data, media_type=OCTET_STREAM)


@psi_routes.post(psi.SESSIONS, response_model=psi.PsiOpenResponse)
async def open_session(
    body: psi.PsiOpenRequest, who: PeerIdentity = Depends(require_role("bank")), c: PartnerCore = Depends(core)
) -> psi.PsiOpenResponse:
    return await run_in_threadpool(c.psi.open_session, who.name, body)


@psi_routes.put(psi.BLINDED, status_code=204)
async def put_blinded(session_id: str, index: int, request: Request, who: PeerIdentity = Depends(require_role("bank")),
                      c: PartnerCore = Depends(core)) -> Response:
    responder = c.psi.session(who.name, session_id)
    data = await read_body(request, c.settings.max_body_bytes)
    responder.receive_blinded(index, data)
    return Response(status_code=204)


@psi_routes.get(psi.REBLINDED)
async def get_reblinded(session_id: str, index: int, who: PeerIdentity = Depends(require_role("bank")),
                        c: PartnerCore = Depends(core)) -> Response:
    responder = c.psi.session(who.name, session_id)
    return _octets(await run_in_threadpool(responder.reblinded_chunk, index, WAIT_SECONDS))


@psi_routes.get(psi.BLINDED)
async def get_blinded(session_id: str, index: int, who: PeerIdentity = Depends(require_role("bank")),
                      c: PartnerCore = Depends(core)) -> Response:
    responder = c.psi.session(who.name, session_id)
    return _octets(await run_in_threadpool(responder.blinded_chunk, index, WAIT_SECONDS))


@psi_routes.post(psi.COMMIT, response_model=control.AlignmentInfo, response_model_exclude_none=True)
async def commit(
    session_id: str,
    request: Request,
    alignment_id: str = Header(alias=psi.ALIGNMENT_HEADER),
    purpose: str = Header("training", alias=psi.PURPOSE_HEADER),
    log_head: str = Header(alias=psi.LOG_HEAD_HEADER, pattern=psi.LOG_HEAD),  # the bank's record of the session
    who: PeerIdentity = Depends(require_role("bank")),
    c: PartnerCore = Depends(core),
) -> control.AlignmentInfo:
    c.psi.session(who.name, session_id)
    positions = psi.decode_positions(await read_body(request, c.settings.max_body_bytes))
    return await run_in_threadpool(c.psi.commit, who.name, session_id, alignment_id, positions, purpose, log_head)


@psi_routes.delete(psi.SESSION, status_code=204)
async def abort(session_id: str, who: PeerIdentity = Depends(require_role("bank")),
                c: PartnerCore = Depends(core)) -> Response:
    c.psi.abort(who.name, session_id)
    return Response(status_code=204)


async def _body(request: Request, c: PartnerCore) -> bytes:
    return await read_body(request, c.settings.max_body_bytes)


def _tensors(body: bytes) -> Response:
    return Response(content=body, media_type=SAFETENSORS)


@train.get(training.SESSIONS, response_model=control.SessionList)
async def my_sessions(who: PeerIdentity = Depends(require_role("bank")), c: PartnerCore = Depends(core)) -> control.SessionList:
    """The calling bank's live sessions (a bank restarted after a crash finds what it left)."""
    return c.sessions(who.name)


@train.post(training.SESSIONS, response_model=training.TrainSessionInfo)
async def start_training(
    request: Request, who: PeerIdentity = Depends(require_role("bank")), c: PartnerCore = Depends(core)
) -> training.TrainSessionInfo:
    start = training.StartRequest.decode(await _body(request, c))
    return await run_in_threadpool(c.start_training, who.name, start.session, start.alignment, start.train_rows,
                                  start.precision, start.local)


def step(request: HotRequest) -> HotResponse:
    """One training step: a hot route (``parties.transport.hot_routes``), run on the event loop."""
    c: PartnerCore = request.state.core
    session_id, bank = request.params["session_id"], request.caller.name
    session = c.training(bank, session_id)
    session.writer.check()  # this partner's last checkpoint failed: the bank stops at this step
    request_ = training.StepRequest.decode(request.body, session_id)  # the trainer checks finiteness
    with log_context(session=session_id, step=request_.step):
        z = session.trainer.step(request_.step, request_.grad, request_.rows)
    # The answer says which step this partner has on disk: the bank's retention counts on it.
    body = training.StepReply(session_id, request_.step, z, session.writer.durable, request_.precision).encode()
    # Every party checkpoints after the same step. The snapshot is taken once the answer has gone, before
    # the event loop reads the next request: the same state, off the bank's critical path.
    after = (lambda: c.checkpoint(bank, session_id, request_.keep_from)) if request_.checkpoint else None
    return HotResponse(body, SAFETENSORS, after=after)


@train.post(training.EMBED)
async def embed(session_id: str, request: Request, who: PeerIdentity = bank_caller,
                c: PartnerCore = Depends(core)) -> Response:
    trainer = c.training(who.name, session_id).trainer
    rows = training.EmbedRequest.decode(await _body(request, c), session_id).rows
    z = await run_in_threadpool(trainer.embed, rows)
    return _tensors(training.EmbedReply(session_id, z).encode())


@train.post(training.BEST, status_code=204)
async def mark_best(session_id: str, who: PeerIdentity = bank_caller, c: PartnerCore = Depends(core)) -> Response:
    c.training(who.name, session_id).trainer.mark_best()
    return Response(status_code=204)


@train.post(training.FINISH, response_model=training.ModelFiles)
async def finish(session_id: str, body: training.FinishRequest, who: PeerIdentity = bank_caller,
                 c: PartnerCore = Depends(core)) -> training.ModelFiles:
    return await run_in_threadpool(c.finish_training, who.name, session_id, body.restore_best)


@train.get(training.CHECKPOINTS, response_model=training.CheckpointList)
async def checkpoints(session_id: str, who: PeerIdentity = bank_caller,
                      c: PartnerCore = Depends(core)) -> training.CheckpointList:
    return training.CheckpointList(session=session_id, steps=await run_in_threadpool(c.checkpoints, who.name, session_id))


@train.post(training.RESTORE, status_code=204)
async def restore(session_id: str, body: training.RestoreRequest, who: PeerIdentity = bank_caller,
                  c: PartnerCore = Depends(core)) -> Response:
    await run_in_threadpool(c.restore, who.name, session_id, body.step)
    return Response(status_code=204)


# Without None fields: a partner without NoPeek answers exactly what it answered before NoPeek existed.
@train.get(training.PRIVACY, response_model=training.PrivacyReport, response_model_exclude_none=True)
async def privacy(session_id: str, who: PeerIdentity = bank_caller,
                  c: PartnerCore = Depends(core)) -> training.PrivacyReport:
    return c.privacy(who.name, session_id)


@train.delete(training.SESSION, status_code=204)
async def end_training(session_id: str, finished: bool = True, who: PeerIdentity = bank_caller,
                       c: PartnerCore = Depends(core)) -> Response:
    """``finished=false``: unload the session only (the bank's run stopped; it stays resumable)."""
    await run_in_threadpool(c.end_training, who.name, session_id, finished)
    return Response(status_code=204)


@models.post(scoring.LOAD, status_code=204)
async def load_model(model_id: str, body: scoring.LoadModelRequest, who: PeerIdentity = bank_caller,
                     c: PartnerCore = Depends(core)) -> Response:
    await run_in_threadpool(c.load_model, who.name, model_id, body.files, body.embedding_width)
    return Response(status_code=204)


@models.post(scoring.EMBED)
async def embed_for_scoring(model_id: str, request: Request, who: PeerIdentity = bank_caller,
                            c: PartnerCore = Depends(core)) -> Response:
    wanted = scoring.ScoringRequest.decode(await _body(request, c))
    z, fallbacks, drift = await run_in_threadpool(c.embed_for_scoring, who.name, model_id, wanted.alignment,
                                                  wanted.rows)
    return _tensors(scoring.ScoringReply(model_id, z, fallbacks, drift).encode())


@admin.get(control.ADMIN_SESSIONS, response_model=control.SessionList)
async def sessions(c: PartnerCore = Depends(core)) -> control.SessionList:
    """Every live session, PSI and training, whichever bank opened it."""
    return c.sessions()


@admin.delete(control.ADMIN_SESSION, status_code=204)
async def end_session(bank: str, session_id: str, c: PartnerCore = Depends(core)) -> Response:
    """End a bank's session for good (an abandoned one): a training session's checkpoints go with it."""
    await run_in_threadpool(c.end_session, bank, session_id)
    return Response(status_code=204)


@admin.get(control.ADMIN_ALIGNMENTS, response_model=control.AlignmentList, response_model_exclude_none=True)
async def alignments(c: PartnerCore = Depends(core)) -> control.AlignmentList:
    """Each bank's training alignment here."""
    return control.AlignmentList(alignments=c.alignments())


def create_app(settings: PartnerSettings, table: PartyTable | None = None) -> FastAPI:
    """The partner service: loads its own table at start-up (unless given one), answers the bank's PSI."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # torch's first optimizer imports (about a second) run in the background: the service listens without
        # waiting for them, and a session that starts sooner waits only for what is left of them.
        threading.Thread(target=prepare_optimizers, name="prepare-optimizers", daemon=True).start()
        loaded = table or settings.load_table()
        app.state.core = core = PartnerCore(settings, loaded)
        for kind in ("psi", "training"):  # read when metrics are scraped
            SESSIONS.labels(kind).set_function(lambda kind=kind: sum(len(getattr(s, kind)) for s in core.banks.spaces()))
        try:
            yield
        finally:
            app.state.core.close()

    hot = [HotRoute("POST", training.STEP, "bank", step)]
    return create_party_app(settings, lifespan=lifespan, routers=[psi_routes, train, models, admin], hot_routes=hot)
