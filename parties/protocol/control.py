"""Control exchanges: sessions and alignments a party holds, and the bank operator's jobs.

A partner answers its banks' session listing (``parties.protocol.training.SESSIONS``)
and its own operator's admin routes; the bank answers its own operator
(``bank.service.operator`` calls, ``bank.service.app`` answers)::

    partner operator   GET ADMIN_SESSIONS, DELETE ADMIN_SESSION (a bank's), GET ADMIN_ALIGNMENTS (each bank's)
    bank operator      POST ALIGNMENTS (AlignmentRequest), GET ALIGNMENT,
                       POST/GET TRAININGS, POST RESUME, DELETE TRAINING,
                       POST SCORINGS (a CSV), GET SCORES, GET JOB -> JobStatus
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from parties.protocol.common import Message

__all__ = [
    "ADMIN_ALIGNMENTS",
    "ADMIN_SESSION",
    "ADMIN_SESSIONS",
    "ALIGNMENT",
    "ALIGNMENTS",
    "JOB",
    "JOBS",
    "JOB_STOP",
    "PARTNERS",
    "RESUME",
    "RUN",
    "RUNS",
    "RUN_FILE",
    "SCORES",
    "SCORINGS",
    "TRAINING",
    "TRAININGS",
    "AlignmentInfo",
    "AlignmentList",
    "AlignmentRequest",
    "Certificate",
    "JobList",
    "JobStatus",
    "PartnerList",
    "PartnerStatus",
    "RunDetail",
    "RunList",
    "RunSummary",
    "SessionList",
    "SessionSummary",
]

ADMIN_SESSIONS = "/admin/sessions"
ADMIN_SESSION = "/admin/sessions/{bank}/{session_id}"
ADMIN_ALIGNMENTS = "/admin/alignments"

ALIGNMENTS = "/alignments"
ALIGNMENT = "/alignment"
TRAININGS = "/trainings"
TRAINING = "/trainings/{session_id}"
RESUME = "/trainings/{session_id}/resume"
SCORINGS = "/scorings"
SCORES = "/scorings/{job_id}/scores.csv"
JOB = "/jobs/{job_id}"
JOBS = "/jobs"
JOB_STOP = "/jobs/{job_id}/stop"
PARTNERS = "/partners"
RUNS = "/runs"
RUN = "/runs/{session_id}"
RUN_FILE = "/runs/{session_id}/files/{name}"  # name: "manifest.json", "analysis/roc_pr.png"


class AlignmentRequest(Message):
    partners: list[str] | None = Field(None, description="default: every configured partner")
    min_intersection: int | None = Field(None, ge=1)
    order_seed: int = Field(0, description="seeds the shared row order (same data and seed: same order)")
    mode: Literal["concurrent", "sequential"] = Field(
        "concurrent", description="align with every partner at once, or one after another (same result)")
    expect_overlap: float | None = Field(
        None, gt=0, le=1, description="the share of the bank's customers the operator expects each partner to hold: "
        "a partner matching far fewer (under three quarters of it) is warned about")
    max_overlap: float | None = Field(
        None, gt=0, le=1, description="refuse, before anything is committed, a partner matching more than this share "
        "of the bank's customers (a partner claiming IDs it does not hold learns them at the commit); default: "
        "expect_overlap + 0.05 if given, else the bank's setting (0.95)")


class AlignmentInfo(Message):
    alignment_id: str
    rows: int
    bank: str | None = Field(None, description="the bank it is with (a partner's operator's listing only)")
    log_head: str | None = Field(None, description="a partner's session-log chain head after it logged the commit")
    pairwise: dict[str, int] = Field(default_factory=dict)
    bank_customers: int | None = Field(None, description="the bank's customers (the bank's answer only)")
    shares: dict[str, float] = Field(default_factory=dict, description="per partner, the share of the bank's "
                                     "customers it matched")
    warnings: list[str] = Field(default_factory=list)


class AlignmentList(Message):
    alignments: list[AlignmentInfo]


class JobStatus(Message):
    job_id: str
    kind: str
    state: Literal["pending", "running", "succeeded", "failed", "stopped"]
    progress: str = ""
    fraction: float | None = None
    error: str | None = None
    result: dict[str, object] | None = None
    events: list[str] = Field(default_factory=list, description="what the operator must see as it happens: a "
                              "partner retried, every party rolled back")
    curve: list[dict[str, float]] = Field(default_factory=list, description="a training's epochs so far: losses, "
                                          "validation figures, bytes and round trips per partner")


class SessionSummary(Message):
    """A session a party holds, for its owner or operator: no rows, no IDs."""

    kind: Literal["training", "psi"]
    session: str
    owner: str  # the bank that opened it
    state: str  # partner: "live" (in memory); bank: "running", "stopped" (resumable), "finished", "ended"
    idle_seconds: float | None = None
    step: int | None = None  # training: the next step


class SessionList(Message):
    sessions: list[SessionSummary]


class JobList(Message):
    jobs: list[JobStatus]


class Certificate(Message):
    """A peer's certificate as the bank's connection saw it: who it names, who issued it, when it ends."""

    name: str | None
    role: str | None
    issuer: str
    expires: str  # ISO 8601, UTC
    days_left: float


class PartnerStatus(Message):
    """A configured partner, probed by the bank service: reachable and trusted, its certificate, or why not."""

    name: str
    url: str
    reachable: bool
    ready: bool | None = None  # what its /ready said
    certificate: Certificate | None = None  # None on plain HTTP (--insecure), or when unreachable
    problem: str | None = None


class PartnerList(Message):
    partners: list[PartnerStatus]


class RunSummary(Message):
    """A training session's run folder, as the bank's operator lists them: no rows, no IDs."""

    session: str
    state: str  # as SessionSummary's
    started: str  # ISO 8601, UTC (when its folder was written)
    alignment_id: str | None = None
    test: dict[str, float] = Field(default_factory=dict)  # a finished run's test metrics


class RunList(Message):
    runs: list[RunSummary]


class RunDetail(Message):
    """A run for the operator: its metrics and epochs, and the files it may fetch (``RUN_FILE``)."""

    summary: RunSummary
    metrics: dict[str, object] = Field(default_factory=dict)
    config: dict[str, object] = Field(default_factory=dict)
    history: list[dict[str, float | None]] = Field(default_factory=list)
    files: list[str] = Field(default_factory=list)
