"""The bank's HTTP edge: the coordinator's endpoints, for the bank's own operator only."""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Query, Request, Response
from fastapi.responses import FileResponse
from starlette.concurrency import run_in_threadpool

from bank.config import TrainingConfig
from bank.service.core import BankCore
from parties.errors import NotAligned, OutOfOrder
from parties.learning.model import prepare_optimizers
from parties.protocol import control
from parties.protocol.control import (
    AlignmentInfo,
    AlignmentRequest,
    JobList,
    JobStatus,
    PartnerList,
    RunDetail,
    RunList,
    SessionList,
)
from bank.settings import BankSettings
from parties.tables.table import PartyTable
from parties.transport.app import create_party_app, read_body, require_self

logger = logging.getLogger(__name__)

__all__ = ["create_app"]

coordinator = APIRouter(dependencies=[Depends(require_self)], tags=["coordinator"])


async def core(request: Request) -> BankCore:
    return request.app.state.core


@coordinator.post(control.ALIGNMENTS, status_code=202, response_model=JobStatus)
async def start_alignment(body: AlignmentRequest, c: BankCore = Depends(core)) -> JobStatus:
    return c.start_alignment(body).status()


@coordinator.get(control.ALIGNMENT, response_model=AlignmentInfo)
async def current_alignment(c: BankCore = Depends(core)) -> AlignmentInfo:
    if c.alignment is None:
        raise NotAligned("no alignment yet: align the customers first (POST /alignments)")
    return AlignmentInfo(alignment_id=c.alignment.alignment_id, rows=len(c.alignment), pairwise=c.pairwise)


@coordinator.post(control.TRAININGS, status_code=202, response_model=JobStatus)
async def start_training(body: TrainingConfig, c: BankCore = Depends(core)) -> JobStatus:
    return c.start_training(body).status()


@coordinator.get(control.TRAININGS, response_model=SessionList)
async def training_sessions(c: BankCore = Depends(core)) -> SessionList:
    """Every training session: running, stopped (resumable), finished or ended."""
    return c.sessions()


@coordinator.delete(control.TRAINING, status_code=204)
async def end_training_session(session_id: str, c: BankCore = Depends(core)) -> Response:
    """End a stopped session for good, here and at every partner."""
    await run_in_threadpool(c.end_session, session_id)
    return Response(status_code=204)


@coordinator.post(control.RESUME, status_code=202, response_model=JobStatus)
async def resume_training(session_id: str, c: BankCore = Depends(core)) -> JobStatus:
    return c.start_resume(session_id).status()


@coordinator.post(control.SCORINGS, status_code=202, response_model=JobStatus)
async def start_scoring(
    request: Request, model: str, allow_missing: bool = False, accept_drift: bool = False,
    max_overlap: float | None = Query(None, gt=0, le=1), c: BankCore = Depends(core),
) -> JobStatus:
    """Score the customers in the body (a CSV of IDs and the bank's own columns) with a trained model."""
    csv = await read_body(request, c.settings.max_body_bytes)
    return c.start_scoring(model, csv, allow_missing, accept_drift, max_overlap).status()


@coordinator.get(control.SCORES)
async def scores(job_id: str, c: BankCore = Depends(core)) -> FileResponse:
    job = c.jobs.get(job_id)
    if job.kind != "scoring" or job.state != "succeeded" or job.result is None:
        raise OutOfOrder(f"job {job_id} has no scores (state: {job.state})")
    return FileResponse(job.result["scores_file"], media_type="text/csv")


@coordinator.get(control.JOB, response_model=JobStatus)
async def job(job_id: str, c: BankCore = Depends(core)) -> JobStatus:
    return c.jobs.get(job_id).status()


@coordinator.get(control.JOBS, response_model=JobList)
async def jobs(c: BankCore = Depends(core)) -> JobList:
    """Every job since the service started, newest first, without their curves."""
    return JobList(jobs=[j.status().model_copy(update={"curve": []}) for j in reversed(c.jobs.all())])


@coordinator.post(control.JOB_STOP, status_code=202, response_model=JobStatus)
async def stop_job(job_id: str, c: BankCore = Depends(core)) -> JobStatus:
    """Stop a job at its next report: a training stops between steps and stays resumable; an alignment commits
    nothing."""
    return c.jobs.stop(job_id).status()


@coordinator.get(control.PARTNERS, response_model=PartnerList)
async def partners(c: BankCore = Depends(core)) -> PartnerList:
    """Each partner, probed now: reachable, ready, and the certificate it answered with."""
    return await run_in_threadpool(c.partner_status)


@coordinator.get(control.RUNS, response_model=RunList)
async def runs(c: BankCore = Depends(core)) -> RunList:
    return await run_in_threadpool(c.runs)


@coordinator.get(control.RUN, response_model=RunDetail)
async def run(session_id: str, c: BankCore = Depends(core)) -> RunDetail:
    return await run_in_threadpool(c.run, session_id)


@coordinator.get(control.RUN_FILE.replace("{name}", "{name:path}"))  # analysis/... has a slash
async def run_file(session_id: str, name: str, c: BankCore = Depends(core)) -> FileResponse:
    """One of the files a run lists (its figures and tables, its metrics, its model files' manifest)."""
    path, media_type = c.run_file(session_id, name)
    return FileResponse(path, media_type=media_type)


def _warm_up(done: threading.Event) -> None:
    """What a bank's first training would otherwise wait for: torch's optimizers and scikit-learn (split,
    metrics, the bank-only model), imported after the service listens. Jobs start their work after it."""
    try:
        prepare_optimizers()
        import sklearn.ensemble  # noqa: F401
        import sklearn.metrics  # noqa: F401
        import sklearn.model_selection  # noqa: F401
    except Exception:  # a job imports what it needs itself
        logger.exception("the start-up imports failed")
    finally:
        done.set()


def create_app(settings: BankSettings, table: PartyTable | None = None) -> FastAPI:
    """The bank service: loads its own table (with labels) at start-up, coordinates the partners."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # torch's first optimizer imports (about a second) run in the background: the service listens without
        # waiting for them, and a session that starts sooner waits only for what is left of them.
        warmed = threading.Event()
        threading.Thread(target=_warm_up, args=(warmed,), name="warm-up", daemon=True).start()
        loaded = table or settings.load_table()
        app.state.core = BankCore(settings, loaded)
        app.state.core.jobs.wait_for(warmed)
        try:
            yield
        finally:
            app.state.core.close()

    return create_party_app(settings, lifespan=lifespan, routers=[coordinator])
