"""The partner's HTTP edge: thin routes over ``partner.core``."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import numpy as np
from fastapi import APIRouter, Depends, FastAPI, Header, Request, Response
from starlette.concurrency import run_in_threadpool

from parties.app import create_party_app, read_body, require_role, require_self
from parties.dataset import PartyTable, load_party_table
from parties.errors import BadMessage, OutOfOrder
from parties.protocol import ALIGNMENT_HEADER, DIGEST_HEADER, OCTET_STREAM, AlignmentInfo, PsiOpenRequest, PsiOpenResponse
from parties.settings import PartnerSettings
from partner.core import WAIT_SECONDS, PartnerCore

__all__ = ["create_app"]

logger = logging.getLogger(__name__)

bank_only = Depends(require_role("bank"))
psi = APIRouter(prefix="/psi/sessions", dependencies=[bank_only], tags=["alignment"])
admin = APIRouter(prefix="/admin", dependencies=[Depends(require_self)], tags=["operator"])


def core(request: Request) -> PartnerCore:
    return request.app.state.core


def _octets(data: bytes) -> Response:
    return Response(content=data, media_type=OCTET_STREAM)


@psi.post("", response_model=PsiOpenResponse)
async def open_session(body: PsiOpenRequest, c: PartnerCore = Depends(core)) -> PsiOpenResponse:
    return await run_in_threadpool(c.open_session, body)


@psi.put("/{session_id}/blinded/{index}", status_code=204)
async def put_blinded(session_id: str, index: int, request: Request, c: PartnerCore = Depends(core)) -> Response:
    data = await read_body(request, c.settings.max_body_bytes)
    c.session(session_id).receive_blinded(index, data)
    return Response(status_code=204)


@psi.get("/{session_id}/blinded/{index}")
async def get_blinded(session_id: str, index: int, c: PartnerCore = Depends(core)) -> Response:
    responder = c.session(session_id)
    return _octets(await run_in_threadpool(responder.blinded_chunk, index, WAIT_SECONDS))


@psi.put("/{session_id}/reblinded/{index}", status_code=204)
async def put_reblinded(session_id: str, index: int, request: Request, c: PartnerCore = Depends(core)) -> Response:
    data = await read_body(request, c.settings.max_body_bytes)
    responder = c.session(session_id)
    responder.receive_reblinded(index, data)
    return Response(status_code=204)


@psi.get("/{session_id}/reblinded/{index}")
async def get_reblinded(session_id: str, index: int, c: PartnerCore = Depends(core)) -> Response:
    responder = c.session(session_id)
    return _octets(await run_in_threadpool(responder.reblinded_chunk, index, WAIT_SECONDS))


@psi.post("/{session_id}/commit", response_model=AlignmentInfo)
async def commit(
    session_id: str,
    request: Request,
    digest: str = Header(alias=DIGEST_HEADER),
    alignment_id: str = Header(alias=ALIGNMENT_HEADER),
    c: PartnerCore = Depends(core),
) -> AlignmentInfo:
    data = await read_body(request, c.settings.max_body_bytes)
    if len(data) % 4:
        raise BadMessage("positions are little-endian uint32 values")
    try:
        digest_bytes = bytes.fromhex(digest)
    except ValueError as exc:
        raise BadMessage(f"{DIGEST_HEADER} is not hex") from exc
    positions = np.frombuffer(data, dtype="<u4").astype(np.int64)
    return await run_in_threadpool(c.commit, session_id, alignment_id, positions, digest_bytes)


@psi.delete("/{session_id}", status_code=204)
async def abort(session_id: str, c: PartnerCore = Depends(core)) -> Response:
    c.abort(session_id)
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
        loaded = table or load_party_table(settings.data, settings.id_column, schema_path=settings.schema_file)
        app.state.core = PartnerCore(settings, loaded)
        try:
            yield
        finally:
            app.state.core.close()

    return create_party_app(settings, lifespan=lifespan, routers=[psi, admin])
