"""Training behaviour: determinism, early stopping, other tasks, the bank service's job resource."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from alignment.parallel import WorkerPool
from bank.service.aligner import align_with_partners
from bank.config import TrainingConfig
from bank.vertical.in_process_party import InProcessParty
from bank.service.operator import BankOperator
from bank.task import Task
from bank.vertical.coordinator import Coordinator
from data.prepare import prepare_bank_marketing
from parties.errors import NotAligned, PeerError
from parties.learning.model import BottomConfig
from parties.tables.table import AlignedRows, load_party_table
from parties.transport.tls import TLSFiles
from tests.training_helpers import federation, saved, state_equal

BOTTOMS = {"bank": BottomConfig(cut_width=8, seed=1), "partner": BottomConfig(hidden=(16,), cut_width=8, seed=2)}


def test_the_same_config_gives_the_same_model_even_after_a_new_psi(pki, bank_full, tmp_path, start_partner) -> None:
    paths = prepare_bank_marketing(tmp_path / "data", rows=1500, cache=bank_full.parent, download=False)
    config = TrainingConfig(epochs=2, batch_size=64)
    with federation(pki, paths, start_partner, tmp_path, BOTTOMS) as fed:
        first = fed.coordinator(config, BOTTOMS["bank"]).run()
        with WorkerPool(1) as pool:  # a fresh PSI: new keys, new blinded values, the same seeded order
            fed.alignment, _ = align_with_partners(fed.bank, {"partner": fed.proxies()[0]}, pool)
        second = fed.coordinator(config, BOTTOMS["bank"]).run()
        models = fed.partner_core("partner").banks["bank"].folder / "models"
        for folder in (tmp_path / "bank-models", models):
            a = saved(folder / first.session_id / "bottom.safetensors")
            b = saved(folder / second.session_id / "bottom.safetensors")
            assert state_equal(a, b)
        assert first.test_metrics == second.test_metrics
        assert first.history[-1]["train_loss"] == second.history[-1]["train_loss"]


def _in_process(tmp_path: Path, labels: list[str], task: str, **config: object) -> tuple[Coordinator, object]:
    rng = np.random.default_rng(0)
    n = len(labels)
    ids = [f"c{i}" for i in range(n)]
    signal = rng.normal(size=n)
    bank = pd.DataFrame({"customer_id": ids, "a": signal + rng.normal(scale=0.1, size=n), "y": labels})
    partner = pd.DataFrame({"customer_id": ids, "b": rng.normal(size=n), "c": rng.choice(["u", "v"], size=n)})
    bank.to_csv(tmp_path / "b.csv", index=False)
    partner.to_csv(tmp_path / "p.csv", index=False)
    bt, pt = load_party_table(tmp_path / "b.csv", "customer_id", "y"), load_party_table(tmp_path / "p.csv", "customer_id")
    alignment = AlignedRows("a1", np.arange(n))
    cfg = TrainingConfig(task=task, **config)
    t = Task(cfg.task).fit(bt.labels)
    parties = [InProcessParty(name, table, lambda: alignment, BottomConfig(cut_width=4, seed=i))
               for i, (name, table) in enumerate((("bank", bt), ("partner", pt)))]
    return Coordinator(cfg, t, t.targets(bt.labels), parties, alignment_id="a1"), signal


def test_multiclass_is_a_config_change(tmp_path: Path) -> None:
    signal = np.random.default_rng(0).normal(size=900)
    labels = np.where(signal < -0.5, "low", np.where(signal > 0.5, "high", "mid")).tolist()
    coordinator, _ = _in_process(tmp_path, labels, "multiclass", epochs=15, batch_size=64)
    outcome = coordinator.run()
    assert coordinator.task.output_dim == 3 and outcome.test_scores.shape[1] == 3
    assert outcome.test_metrics["accuracy"] > 0.6  # chance is ~0.38
    assert set(outcome.test_metrics) == {"accuracy", "log_loss", "f1_macro"}


def test_regression_is_a_config_change(tmp_path: Path) -> None:
    signal = np.random.default_rng(0).normal(size=600)
    coordinator, _ = _in_process(tmp_path, [f"{3 * s:.4f}" for s in signal], "regression", epochs=20, batch_size=32)
    outcome = coordinator.run()
    assert outcome.test_metrics["r2"] > 0.5
    assert set(outcome.test_metrics) == {"mse", "rmse", "mae", "r2"}
    assert outcome.test_metrics["rmse"] == pytest.approx(outcome.test_metrics["mse"] ** 0.5)


def test_regression_on_a_monetary_scale_learns_a_standardised_target(tmp_path: Path) -> None:
    signal = np.random.default_rng(0).normal(size=600)
    amounts = [f"{5e6 + 2e6 * s:.2f}" for s in signal]  # euros: the raw squared error is ~1e12
    coordinator, _ = _in_process(tmp_path, amounts, "regression", epochs=20, batch_size=32)
    outcome = coordinator.run()
    train = np.asarray(amounts, dtype=float)[coordinator.split.train]
    assert coordinator.task.target_mean_ == pytest.approx(train.mean()) and coordinator.task.target_scale_ == pytest.approx(train.std())
    assert outcome.history[-1]["train_loss"] < 1  # learned in standardised units
    assert outcome.test_metrics["r2"] > 0.5
    assert outcome.test_metrics["mae"] > 1e4  # metrics in the label's own units
    assert 1e6 < float(np.median(outcome.test_scores)) < 1e7  # and so are the scores


def test_early_stopping_keeps_the_best_epoch(tmp_path: Path) -> None:
    labels = (np.random.default_rng(1).random(400) < 0.3).astype(int).astype(str).tolist()  # pure noise
    coordinator, _ = _in_process(tmp_path, labels, "binary", epochs=50, patience=2, batch_size=32)
    outcome = coordinator.run()
    aucs = [row["val_roc_auc"] for row in outcome.history]
    assert len(outcome.history) < 50  # it stopped early
    assert len(outcome.history) == outcome.best_epoch + 2
    assert outcome.best_epoch == int(np.argmax(aucs)) + 1


def test_progress_reaches_its_end_only_when_training_has(tmp_path: Path) -> None:
    labels = (np.random.default_rng(2).random(400) < 0.3).astype(int).astype(str).tolist()
    coordinator, _ = _in_process(tmp_path, labels, "binary", epochs=3, patience=5, batch_size=32)
    calls: list[tuple[str, float | None]] = []
    coordinator.progress = lambda message, fraction=None, **_: calls.append((message, fraction))
    coordinator.run()
    fractions = [f for _, f in calls if f is not None]
    assert fractions == sorted(fractions) and max(fractions) < 1  # the job sets 1.0 when it has ended
    assert calls[-1][0].startswith("finishing")  # the flush, validation and test rows come after the steps
    assert any(m.startswith("epoch ") for m, _ in calls)


def test_training_through_the_bank_service(pki, bank_full, tmp_path, start_partner, start_bank) -> None:
    paths = prepare_bank_marketing(tmp_path / "data", rows=2000, cache=bank_full.parent, download=False)
    partner = start_partner(paths["partner"])
    bank = start_bank(paths["bank"], {"partner": partner.url})
    with BankOperator(bank.url, TLSFiles.from_dir(pki, "bank")) as op:
        with pytest.raises(NotAligned, match="run `python -m bank align` first"):
            op.start_training(TrainingConfig(epochs=1))
        op.wait(op.start_alignment())
        seen = []
        result = op.wait(op.start_training(TrainingConfig(epochs=2, batch_size=64)), on_progress=seen.append)
        assert op.job(seen[-1].job_id).fraction == 1.0  # the bar's end is the job's end
        with pytest.raises(PeerError, match=r"HTTP 400\): unknown partners \['nobody'\]"):
            op.start_training(TrainingConfig(partners=["nobody"]))
    run_dir = Path(result["run_dir"])
    assert {"config.json", "metrics.json", "history.csv", "test_predictions.csv", "split.csv"} <= {p.name for p in run_dir.iterdir()}
    assert any(0 < (j.fraction or 0) < 1 for j in seen)
    predictions = pd.read_csv(run_dir / "test_predictions.csv")
    assert len(predictions) == result["rows"]["test"] and predictions["score"].between(0, 1).all()
    assert not list(run_dir.rglob("*.pt")) and not list(run_dir.rglob("*.pkl"))


def test_a_party_that_is_always_behind_stops_the_run_after_a_bounded_number_of_rollbacks(tmp_path: Path) -> None:
    """A restarted party answers ``Behind`` once and the run rolls back; a dishonest one that answers it to every
    step would hold the run for ever. After ``MAX_ROLLBACKS`` the run stops, saying why and where it stood."""
    from bank.vertical.coordinator import MAX_ROLLBACKS
    from parties.errors import Behind

    labels = np.where(np.random.default_rng(0).normal(size=400) > 0, "yes", "no").tolist()
    coordinator, _ = _in_process(tmp_path, labels, "binary", epochs=2, batch_size=32, checkpoint_every=5)
    rng = np.random.default_rng(0)
    ids = [f"c{i}" for i in range(400)]
    pd.DataFrame({"customer_id": ids, "b": rng.normal(size=400)}).to_csv(tmp_path / "p2.csv", index=False)
    alignment = AlignedRows("a1", np.arange(400))

    class AlwaysBehind(InProcessParty):
        answers = 0

        def submit_step(self, step, *args, **kwargs):  # type: ignore[no-untyped-def]
            if step >= 7:
                AlwaysBehind.answers += 1
                raise Behind("restarted (not really)")
            return super().submit_step(step, *args, **kwargs)

    bank = InProcessParty("bank", coordinator.parties[0].table, lambda: alignment, BottomConfig(cut_width=4, seed=0),
                          checkpoint_dir=lambda s: tmp_path / s / "bank")
    liar = AlwaysBehind("partner", load_party_table(tmp_path / "p2.csv", "customer_id"), lambda: alignment,
                        BottomConfig(cut_width=4, seed=1), checkpoint_dir=lambda s: tmp_path / s / "partner")
    run = Coordinator(coordinator.config, coordinator.task, coordinator.targets, [bank, liar], alignment_id="a1",
                      session_id="s1", checkpoint_dir=tmp_path / "s1" / "coordinator")
    with pytest.raises(PeerError, match=f"rolled back {MAX_ROLLBACKS} times, the most one run does: training stopped"):
        run.run()
    assert run.rollbacks == MAX_ROLLBACKS and AlwaysBehind.answers == MAX_ROLLBACKS + 1


def test_a_stop_asked_while_the_parties_end_a_finished_session_is_refused(tmp_path: Path) -> None:
    """Once training has finished, every party ends its session as finished (a partner then drops its
    checkpoints): a stop from then on would leave a session reported stopped that can no longer resume, so
    it is refused, and the job completes."""
    from parties.errors import OutOfOrder
    from parties.transport.jobs import JobRunner

    labels = (np.random.default_rng(3).random(300) < 0.3).astype(int).astype(str).tolist()
    coordinator, _ = _in_process(tmp_path, labels, "binary", epochs=2, batch_size=64)
    runner, refusals = JobRunner(), []
    partner = coordinator.parties[1]
    ending = partner.end

    def end(finished: bool) -> None:  # the operator presses Stop as the partner ends its session
        try:
            runner.stop(job.job_id)
        except OutOfOrder as exc:
            refusals.append(str(exc))
        ending(finished=finished)

    partner.end = end

    def work(say):
        coordinator.progress = say
        coordinator.run()
        say("finishing: writing the run")
        return {"finished": True}

    job = runner.submit("training", work)
    assert job.done.wait(120) and job.state == "succeeded" and job.result == {"finished": True}
    assert refusals and "can no longer stop" in refusals[0]
