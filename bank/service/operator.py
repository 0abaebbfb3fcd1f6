"""The bank operator's client: start work on the bank service and follow it to the end."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

import httpx

from bank.config import TrainingConfig
from parties.errors import CutlayerError, NotAligned, PeerError, PeerUntrusted
from parties.protocol import control
from parties.protocol.common import fill
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
from parties.transport.client import make_client
from parties.transport.tls import PeerIdentity, TLSFiles, handshake_failure

__all__ = ["BankOperator"]


class JobFailed(CutlayerError):
    status_code = 500


class BankOperator:
    """Calls the bank service as the bank's own operator (with the bank's certificate)."""

    def __init__(self, url: str, tls: TLSFiles | None, name: str = "bank", timeout: float = 60.0) -> None:
        self.url = url.rstrip("/")
        # The bank service answers with the bank's own certificate: nothing is sent to anyone else at that URL.
        self.client = make_client(tls, caller=PeerIdentity(name, "bank"), timeout=timeout, base_url=self.url,
                                  expect=PeerIdentity(name, "bank"))

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self.client.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            untrusted = handshake_failure(exc)
            if untrusted:
                raise PeerUntrusted(f"the bank service at {self.url} answered, but {untrusted}") from exc
            raise PeerError(f"the bank service at {self.url} did not answer: {exc}") from exc
        if not response.is_success:
            try:
                body = response.json()
                kind, detail = body.get("error"), body.get("detail")
            except (ValueError, AttributeError):
                kind, detail = None, response.text[:200]
            if kind == NotAligned.__name__:
                raise NotAligned("the bank has no alignment yet: run `python -m bank align` first")
            raise PeerError(f"the bank service refused {method} {path} (HTTP {response.status_code}): {detail}")
        return response

    def start_alignment(self, request: AlignmentRequest | None = None) -> JobStatus:
        body = (request or AlignmentRequest()).model_dump()
        return JobStatus.model_validate(self._request("POST", control.ALIGNMENTS, json=body).json())

    def start_training(self, config: TrainingConfig | None = None) -> JobStatus:
        body = (config or TrainingConfig()).model_dump(mode="json")
        return JobStatus.model_validate(self._request("POST", control.TRAININGS, json=body).json())

    def resume_training(self, session_id: str) -> JobStatus:
        return JobStatus.model_validate(self._request("POST", fill(control.RESUME, session_id=session_id)).json())

    def sessions(self) -> SessionList:
        return SessionList.model_validate(self._request("GET", control.TRAININGS).json())

    def end_session(self, session_id: str) -> None:
        self._request("DELETE", fill(control.TRAINING, session_id=session_id))

    def start_scoring(self, model_id: str, csv: bytes, allow_missing: bool = False,
                      accept_drift: bool = False, max_overlap: float | None = None) -> JobStatus:
        params = {"model": model_id, "allow_missing": str(allow_missing).lower(),
                  "accept_drift": str(accept_drift).lower()}
        if max_overlap is not None:
            params["max_overlap"] = str(max_overlap)
        response = self._request("POST", control.SCORINGS, content=csv, headers={"content-type": "text/csv"},
                                 params=params)
        return JobStatus.model_validate(response.json())

    def wait_job_id(self, job: JobStatus) -> str:
        """Wait for ``job`` to end well; return its id (to fetch what it produced)."""
        self.wait(job)
        return job.job_id

    def scores(self, job_id: str) -> bytes:
        return self._request("GET", fill(control.SCORES, job_id=job_id)).content

    def job(self, job_id: str) -> JobStatus:
        return JobStatus.model_validate(self._request("GET", fill(control.JOB, job_id=job_id)).json())

    def jobs(self) -> JobList:
        return JobList.model_validate(self._request("GET", control.JOBS).json())

    def stop_job(self, job_id: str) -> JobStatus:
        return JobStatus.model_validate(self._request("POST", fill(control.JOB_STOP, job_id=job_id)).json())

    def alignment(self) -> AlignmentInfo | None:
        """The current alignment, or ``None`` before the first."""
        try:
            return AlignmentInfo.model_validate(self._request("GET", control.ALIGNMENT).json())
        except NotAligned:
            return None

    def partners(self) -> PartnerList:
        return PartnerList.model_validate(self._request("GET", control.PARTNERS).json())

    def runs(self) -> RunList:
        return RunList.model_validate(self._request("GET", control.RUNS).json())

    def run(self, session_id: str) -> RunDetail:
        return RunDetail.model_validate(self._request("GET", fill(control.RUN, session_id=session_id)).json())

    def run_file(self, session_id: str, name: str) -> httpx.Response:
        """One of the files ``run`` lists, as the service sent it (its body and media type)."""
        path = fill(control.RUN, session_id=session_id) + "/files/" + "/".join(quote(p, safe="") for p in name.split("/"))
        return self._request("GET", path)

    def wait(
        self, job: JobStatus, on_progress: Callable[[JobStatus], None] | None = None, poll: float = 0.2
    ) -> dict[str, Any]:
        """Poll until the job ends; return its result or raise with its error."""
        seen: tuple[str, int] = ("", 0)
        while True:
            job = self.job(job.job_id)
            if on_progress is not None and (job.progress, len(job.events)) != seen:
                seen = (job.progress, len(job.events))
                on_progress(job)
            if job.state == "succeeded":
                return job.result or {}
            if job.state in ("failed", "stopped"):
                raise JobFailed(f"{job.kind} {job.state}: {job.error}")
            time.sleep(poll)

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> BankOperator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
