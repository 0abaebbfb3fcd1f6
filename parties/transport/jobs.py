"""Long work behind an HTTP resource: start it, poll its progress, read its result."""

from __future__ import annotations

import logging
import math
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from parties.errors import CutlayerError, OutOfOrder, UnknownSession
from parties.memory import release
from parties.protocol.control import JobStatus

__all__ = ["Job", "JobRunner", "Progress", "Stopped"]

logger = logging.getLogger(__name__)

class Progress(Protocol):
    """``event``: a message the operator must see even if the next one follows at once (a retry, a rollback):
    kept in the job's ``events`` besides being its progress. ``point``: a point of the job's curve (a training's
    epoch: its losses and validation figures, the bytes so far), kept in the job's ``curve`` (figures that are
    not finite left out).

    A job whose stop was asked for raises ``Stopped`` from the first report after the request: work stops where
    it reports, which is where it can stop cleanly (a training between steps, an alignment between stages).
    ``finishing()``: from here the work completes whatever is asked (its parties have ended their sessions as
    finished): a stop is refused."""

    def __call__(self, message: str, fraction: float | None = None, event: bool = False,
                 point: dict[str, float] | None = None) -> None: ...

    def finishing(self) -> None: ...


class Stopped(CutlayerError):
    """The operator stopped the job."""

    status_code = 409


#: The most events a job keeps (the oldest go first), and the most points of its curve.
MAX_EVENTS = 200
MAX_POINTS = 2000


@dataclass
class Job:
    kind: str
    job_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    state: str = "pending"
    progress: str = ""
    fraction: float | None = None
    error: str | None = None
    result: dict[str, Any] | None = None
    events: list[str] = field(default_factory=list)
    curve: list[dict[str, float]] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    stop_asked: bool = False  # the operator asked it to stop: its next report raises Stopped
    finishing: bool = False  # past the point where it may stop
    lock: threading.Lock = field(default_factory=threading.Lock)

    def status(self) -> JobStatus:
        return JobStatus(
            job_id=self.job_id,
            kind=self.kind,
            state=self.state,  # type: ignore[arg-type]
            progress=self.progress,
            fraction=self.fraction,
            error=self.error,
            result=self.result,
            events=list(self.events),
            curve=list(self.curve),
        )


class _Reporter:
    """A job's ``Progress``: records its reports; raises ``Stopped`` once, at the first after a stop request."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.raised = False  # the reports of the unwinding that follows go through

    def __call__(self, message: str, fraction: float | None = None, event: bool = False,
                 point: dict[str, float] | None = None) -> None:
        job = self.job
        with job.lock:
            stop = job.stop_asked and not job.finishing and not self.raised
            self.raised |= stop
        if stop:
            raise Stopped(f"stopped by the operator during: {job.progress or 'its start'}")
        job.progress = message
        if fraction is not None:
            job.fraction = fraction
        if event:
            job.events = [*job.events[-(MAX_EVENTS - 1):], message]
        if point is not None:
            finite = {k: float(v) for k, v in point.items() if math.isfinite(v)}
            job.curve = [*job.curve[-(MAX_POINTS - 1):], finite]

    def finishing(self) -> None:
        with self.job.lock:
            self.job.finishing = True


#: Longest a job waits for the service's start-up imports before it runs anyway (seconds).
STARTUP_WAIT = 120.0


class JobRunner:
    """Runs one job of each kind at a time, each in its own thread."""

    def __init__(self) -> None:
        self._jobs: dict[str, Job] = {}
        self._lock = threading.Lock()
        #: set when a job may start its work: a service's start-up imports (``wait_for``) are done
        self._ready = threading.Event()
        self._ready.set()

    def wait_for(self, ready: threading.Event) -> None:
        """Jobs wait for ``ready`` before their work: two threads importing one package at once (a warm-up's
        scikit-learn and a job's) can fail with an ImportError on a module the other is still importing."""
        self._ready = ready

    def submit(self, kind: str, work: Callable[[Progress], dict[str, Any]]) -> Job:
        with self._lock:
            running = [j.job_id for j in self._jobs.values() if j.kind == kind and not j.done.is_set()]
            if running:
                raise OutOfOrder(f"a {kind} job is already running (job {running[0]}): wait for it to end, or "
                                 "stop it")
            job = Job(kind)
            self._jobs[job.job_id] = job

        say = _Reporter(job)

        def run() -> None:
            job.state = "running"
            try:
                if not self._ready.is_set():
                    say("waiting for the service's start-up imports")
                    self._ready.wait(STARTUP_WAIT)
                job.result = work(say)
                job.fraction = 1.0
                job.state = "succeeded"
            except Stopped as exc:
                job.error, job.state = str(exc), "stopped"
                logger.info("%s job %s stopped by the operator", kind, job.job_id)
            except CutlayerError as exc:
                job.error, job.state = str(exc), "failed"
                logger.warning("%s job %s failed: %s", kind, job.job_id, exc)
            except Exception as exc:  # a bug: keep the service up, say so, keep the traceback in the log
                job.error, job.state = f"unexpected {type(exc).__name__}; see the service log", "failed"
                logger.exception("%s job %s crashed", kind, job.job_id)
            finally:
                release()  # what the job's thread allocated and freed, handed back before the next job
                job.done.set()

        threading.Thread(target=run, name=f"{kind}-{job.job_id[:8]}", daemon=True).start()
        return job

    def stop(self, job_id: str) -> Job:
        """Ask a running job to stop at its next report; a job that has ended, or is finishing, is refused
        (``OutOfOrder``)."""
        job = self.get(job_id)
        with job.lock:
            if job.done.is_set():
                raise OutOfOrder(f"job {job_id} has ended ({job.state}): nothing to stop")
            if job.finishing:
                raise OutOfOrder(f"job {job_id} is finishing ({job.progress}): it can no longer stop")
            job.stop_asked = True
        return job

    def all(self) -> list[Job]:
        """Every job this service ran since it started, oldest first."""
        with self._lock:
            return list(self._jobs.values())

    def get(self, job_id: str) -> Job:
        try:
            return self._jobs[job_id]
        except KeyError:
            raise UnknownSession(f"no job {job_id}") from None
