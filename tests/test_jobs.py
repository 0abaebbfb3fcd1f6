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


def test_a_stop_raises_at_the_next_report_and_none_once_the_job_is_finishing() -> None:
    runner, reported, go_on = JobRunner(), threading.Event(), threading.Event()

    def work(say):
        say("step 1", 0.1)
        reported.set()
        go_on.wait(10)
        say("step 2", 0.2)  # raises: the stop was asked for after step 1
        return {}

    job = runner.submit("training", work)
    assert reported.wait(10)
    runner.stop(job.job_id)
    go_on.set()
    assert job.done.wait(10) and job.state == "stopped" and job.status().state == "stopped"
    assert job.error == "stopped by the operator during: step 1"
    with pytest.raises(OutOfOrder, match="has ended"):
        runner.stop(job.job_id)

    finishing, go_on = threading.Event(), threading.Event()

    def finish(say):
        say.finishing()  # every party ended its session as finished: the run is written whatever is asked
        finishing.set()
        go_on.wait(10)
        say("writing the run")
        return {"written": True}

    job = runner.submit("training", finish)
    assert finishing.wait(10)
    with pytest.raises(OutOfOrder, match="can no longer stop"):
        runner.stop(job.job_id)
    go_on.set()
    assert job.done.wait(10) and job.state == "succeeded" and job.result == {"written": True}


def test_a_curve_keeps_only_finite_figures() -> None:
    """A figure a partner reported as NaN (its NoPeek dCor) is left out of the point, not sent as null."""
    runner = JobRunner()
    job = runner.submit("training", lambda say: say("epoch 1", 0.5, point={"epoch": 1, "dcor_p": float("nan"),
                                                                          "val_roc_auc": 0.9}) or {})
    assert job.done.wait(10) and job.curve == [{"epoch": 1.0, "val_roc_auc": 0.9}]
    assert type(job.status()).model_validate_json(job.status().model_dump_json()).curve == job.curve
