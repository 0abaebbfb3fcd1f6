"""A service's jobs: one of each kind at a time, each in its own thread, started after the start-up imports."""

from __future__ import annotations

import threading

import pytest

from parties.errors import OutOfOrder
from parties.transport.jobs import JobRunner


def test_a_job_waits_for_the_start_up_imports_then_runs() -> None:
    """A warm-up thread importing scikit-learn while a job imports it too can fail the job with an ImportError
    (a module the other thread is still importing): the job's work starts once the warm-up is done."""
    runner, warmed, ran = JobRunner(), threading.Event(), threading.Event()
    runner.wait_for(warmed)
    job = runner.submit("training", lambda say: {"ran": ran.set() or True})
    assert not ran.wait(0.3) and job.state == "running"
    assert job.progress == "waiting for the service's start-up imports"
    with pytest.raises(OutOfOrder, match="a training job is already running"):
        runner.submit("training", lambda say: {})
    warmed.set()
    assert job.done.wait(10) and ran.is_set() and job.state == "succeeded" and job.result == {"ran": True}


def test_without_a_warm_up_a_job_runs_at_once_and_a_crash_is_reported_not_raised() -> None:
    runner = JobRunner()
    job = runner.submit("scoring", lambda say: 1 / 0)
    assert job.done.wait(10) and job.state == "failed"
    assert job.error == "unexpected ZeroDivisionError; see the service log"
