"""The hijack monitor's rank test against banks that know the monitor, and the study that measures it."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from bank.config import TrainingConfig
from bank.lab.attacks import hijackers
from bank.lab.attacks.hijackers import Attacker, HijackingBank
from bank.lab.studies.hijack import HONEST, StudyConfig, _slice, monitor_cost, run_hijack_study, summarise, wilson
from bank.lab.studies.privacy import PARTNER_BOTTOM
from data.prepare import prepare_bank_marketing
from parties.errors import CutlayerError, HijackSuspected
from parties.learning.bottom import BottomTrainer
from parties.learning.hijack_monitor import HijackMonitor, MonitorConfig
from parties.learning.model import BottomConfig
from parties.storage.checkpoint import Checkpoint
from tests.training_helpers import PartnerProcess, federation

BOTTOMS = {"bank": BottomConfig(cut_width=8, seed=1), "partner": BottomConfig(hidden=(16,), cut_width=8, seed=2)}


def share(grad: torch.Tensor, rank: int, active: torch.Tensor | None = None) -> float:
    return HijackMonitor.task_fit(grad, active, rank)[0]


def test_the_off_task_share_is_what_lies_outside_the_task_directions() -> None:
    gen = torch.Generator().manual_seed(0)
    direction = torch.randn(1, 16, generator=gen)
    task = torch.randn(64, 1, generator=gen) * direction  # every row along one direction: a binary task
    assert share(task, 1) < 1e-6
    three = torch.randn(64, 3, generator=gen) @ torch.randn(3, 16, generator=gen)  # a 3-class task
    assert share(three, 1) > 0.05 and share(three, 3) < 1e-6
    spread = torch.randn(64, 16, generator=gen)  # every direction: what a loss on the embedding gives
    assert share(spread, 1) > 0.8
    assert share(torch.zeros(64, 16), 1) == 0.0


def test_the_rank_test_judges_a_whole_window_and_only_then() -> None:
    gen = torch.Generator().manual_seed(1)
    monitor = HijackMonitor(MonitorConfig(watch=True, window=5, limit=0.2))
    for step in range(4):
        monitor.observe(step, torch.randn(32, 8, generator=gen))
    assert monitor.alarm is None  # four steps: no verdict yet
    monitor.observe(4, torch.randn(32, 8, generator=gen))
    assert monitor.alarm is not None and monitor.alarm_step == 4 and "hijack suspected" in monitor.alarm
    quiet = HijackMonitor(MonitorConfig(watch=True, window=5, limit=0.2))
    for step in range(50):  # a task's gradients: one direction, any signs and sizes
        quiet.observe(step, torch.randn(32, 1, generator=gen) * torch.ones(1, 8))
    assert quiet.alarm is None and quiet.observed == 50


def _features(n: int = 200, width: int = 6) -> np.ndarray:
    return np.random.default_rng(0).normal(size=(n, width)).astype(np.float32)


def test_the_rank_test_leaves_training_bit_identical_and_survives_a_checkpoint() -> None:
    x = _features()
    gen = torch.Generator().manual_seed(2)
    batches = [torch.randperm(200, generator=gen)[:32] for _ in range(30)]
    direction = torch.randn(1, 8, generator=gen)  # a task's gradients: one direction that turns slowly
    grads = [torch.randn(32, 1, generator=gen) * (direction + 0.01 * k) for k in range(30)]
    plain = BottomTrainer(x, BOTTOMS["partner"])
    watched = BottomTrainer(x, BOTTOMS["partner"], monitor=MonitorConfig(watch=True, window=5))
    for step, rows in enumerate(batches):
        for trainer in (plain, watched):
            trainer.step(step, grads[step - 1] if step else None, rows)
    assert watched.monitor is not None and watched.monitor.alarm is None and watched.monitor.observed == 29
    for (name, a), b in zip(plain.model.state_dict().items(), watched.model.state_dict().values()):
        assert torch.equal(a, b), name
    tensors, meta = watched.state()
    restored = BottomTrainer(x, BOTTOMS["partner"], monitor=MonitorConfig(watch=True, window=5))
    restored.load_state(Checkpoint(0, tensors, meta), meta)
    assert restored.monitor is not None
    assert list(restored.monitor.shares) == list(watched.monitor.shares) and restored.monitor.observed == 29


def test_an_alarm_in_warn_mode_is_logged_and_training_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    x = _features()
    gen = torch.Generator().manual_seed(3)
    trainer = BottomTrainer(x, BOTTOMS["partner"], monitor=MonitorConfig(watch=True, window=3, on_alarm="warn"))
    stopper = BottomTrainer(x, BOTTOMS["partner"], monitor=MonitorConfig(watch=True, window=3))
    rows = torch.arange(32)
    trainer.step(0, None, rows)
    stopper.step(0, None, rows)
    with pytest.raises(HijackSuspected, match="hijack suspected"):
        for step in range(1, 10):
            grad = torch.randn(32, 8, generator=gen)
            trainer.step(step, grad, rows)
            stopper.step(step, grad, rows)
    assert step == 3  # the stopper stops when the window is full
    for step in range(4, 10):
        trainer.step(step, torch.randn(32, 8, generator=gen), rows)
    assert trainer.monitor is not None and trainer.monitor.alarm_step == 3
    assert "Training goes on" in caplog.text


# --- adaptive banks, caught on a small dataset ---------------------------------------------------------------

@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory, bank_full: Path):
    config = StudyConfig(rows=2000, epochs=20, aux_rows=2000)  # max_steps ends each run sooner
    return (*_slice(tmp_path_factory.mktemp("hijack"), config, bank_full.parent, False), config)


def _train(small, attacker: Attacker, monitor: MonitorConfig, seed: int = 0, steps: int = 40,
           partner_bottom: BottomConfig = PARTNER_BOTTOM) -> HijackingBank:
    fed, aux, config = small
    coordinator = fed.coordinator(config.training(seed, max_steps=steps), monitor=monitor,
                                  partner_bottom=partner_bottom)
    bank = HijackingBank(coordinator, attacker, aux, PARTNER_BOTTOM, seed)
    coordinator.run()
    return bank


#: Training steps in 40 protocol steps: the 22-batch first epoch ends with a flush, a step without a batch.
TRAINED = 39

ADAPTIVE = [Attacker("noise", "noise", 2.0), Attacker("mix", "mix", 0.5), Attacker("one", "one-direction"),
            Attacker("probe-aware", "probe-aware", answer="honest"), Attacker("ballast", "ballast", 20.0)]


@pytest.mark.parametrize("attacker", [Attacker("FSHA", "fsha"), *ADAPTIVE], ids=lambda a: a.name)
def test_the_rank_test_stops_a_hijacking_bank_that_knows_the_monitor(small, attacker: Attacker) -> None:
    with pytest.raises(HijackSuspected, match="hijack suspected"):
        _train(small, attacker, MonitorConfig(watch=True), steps=150)  # the others stop by step 40


def test_a_pretrained_pilot_is_reused_to_the_bit(small, monkeypatch: pytest.MonkeyPatch) -> None:
    """The study's banks share their pretraining: a bank that takes it from the cache ends where one that
    pretrained ends, decoder and reconstruction error alike."""
    monkeypatch.setattr(hijackers, "_PRETRAINED", {})
    fresh = _train(small, Attacker("FSHA", "fsha"), MonitorConfig(), steps=12)
    assert len(hijackers._PRETRAINED) == 1
    cached = _train(small, Attacker("FSHA", "fsha"), MonitorConfig(), steps=12)
    assert all(torch.equal(a, b) for a, b in zip(fresh.answered, cached.answered))
    assert all(torch.equal(a, b) for a, b in zip(fresh.decoder.state_dict().values(),
                                                  cached.decoder.state_dict().values()))
    assert fresh.reconstruction_error(5) == cached.reconstruction_error(5)
    other = _train(small, Attacker("FSHA", "fsha"), MonitorConfig(), steps=12, seed=1)  # another seed pretrains
    assert len(hijackers._PRETRAINED) == 2 and not torch.equal(other.answered[0], fresh.answered[0])


@pytest.mark.parametrize("seed", [0, 1])
def test_the_rank_test_lets_an_honest_bank_train(small, seed: int) -> None:
    bank = _train(small, HONEST, MonitorConfig(watch=True), seed=seed)
    assert len(bank.sent) == TRAINED  # to the end


def test_with_an_honest_bank_the_rank_test_changes_nothing_in_training(small) -> None:
    """Every embedding the partner sent, at every step, is bit for bit the one it sends with no monitor."""
    watched = _train(small, HONEST, MonitorConfig(watch=True))
    plain = _train(small, HONEST, MonitorConfig())  # off: no monitor at all
    assert len(watched.sent) == len(plain.sent) == TRAINED
    assert all(torch.equal(a[1], b[1]) for a, b in zip(watched.sent, plain.sent))


@pytest.mark.slow  # an attack demonstrated at study size
def test_a_probe_aware_bank_evades_the_copy_probes(small) -> None:
    """Why the rank test exists: the copy probes catch FSHA, but not a bank that answers copies honestly."""
    with pytest.raises(HijackSuspected):
        _train(small, Attacker("FSHA", "fsha"), MonitorConfig(probe_every=3))
    evader = _train(small, Attacker("probe-aware", "probe-aware", answer="honest"), MonitorConfig(probe_every=3))
    assert len(evader.sent) == TRAINED  # trained to the end, unnoticed


@pytest.mark.slow  # an attack demonstrated at study size
def test_fsha_reconstructs_the_partners_features(small) -> None:
    """The attack the monitor is judged against works: FSHA decodes the partner's features, an honest bank's
    decoder does not."""
    honest = _train(small, HONEST, MonitorConfig(watch=True, on_alarm="warn"), steps=300)
    fsha = _train(small, Attacker("FSHA", "fsha"), MonitorConfig(watch=True, on_alarm="warn"), steps=300)
    assert fsha.reconstruction_error(20) < 0.8 < honest.reconstruction_error(20)


def test_a_bank_that_freezes_the_partner_inverts_weights_it_can_rebuild_and_not_secret_ones(small) -> None:
    """The freeze: honest gradients ×1e-12 pass the rank test (they are a task's) and keep the partner at its
    initial weights; from a seed the bank knows, its decoder inverts the embeddings; from the partner's secret
    it decodes a function the partner never had."""
    freeze, warn = Attacker("freeze", "freeze"), MonitorConfig(watch=True, on_alarm="warn")
    known = _train(small, freeze, warn, steps=150)
    secret = _train(small, freeze, warn, steps=150, partner_bottom=PARTNER_BOTTOM.model_copy(update={"seed": None}))
    assert known.reconstruction_error(20) < 0.5 < 0.9 < secret.reconstruction_error(20)


def test_a_partner_with_the_monitor_on_starts_from_weights_only_its_secret_gives(tmp_path: Path) -> None:
    from parties.learning.model import build_bottom
    from parties.settings import load_settings
    from partner.settings import PartnerSettings
    from parties.flags import flag_values
    from partner.__main__ import build_parser

    def settings(**values) -> PartnerSettings:
        return load_settings(PartnerSettings, name="p", data=tmp_path / "x.csv", insecure=True, **values)

    watching = settings(monitor={"watch": True})
    assert watching.bottom.seed is None and settings(monitor={"probe_every": 5}).bottom.seed is None
    assert settings().bottom.seed == 0  # no monitor: the public default, reproducible
    assert settings(monitor={"watch": True}, bottom={"seed": 7}).bottom.seed == 7  # chosen: kept, and public
    x = np.random.default_rng(0).normal(size=(64, 5))
    rebuilt = build_bottom(5, BottomConfig())  # what a bank that reads the code can build
    first, second = (BottomTrainer(x, watching.bottom, monitor=watching.monitor) for _ in range(2))
    for trainer in (first, second):
        assert not torch.equal(trainer.model[0].weight, rebuilt[0].weight)
    assert not torch.equal(first.model[0].weight, second.model[0].weight)
    pinned = MonitorConfig(watch=True, seed=3)  # a study's pin repeats them
    assert torch.equal(BottomTrainer(x, watching.bottom, monitor=pinned).model[0].weight,
                       BottomTrainer(x, watching.bottom, monitor=pinned).model[0].weight)
    parse = lambda *flags: flag_values(build_parser().parse_args(["serve", "--name", "p", "--data", "x.csv", *flags]),  # noqa: E731
                                       PartnerSettings)["bottom"]["seed"]
    assert parse("--seed", "secret") is None and parse("--seed", "4") == 4  # None: drawn from the secret
    with pytest.raises(SystemExit):
        parse("--seed", "four")
    with pytest.raises(ValueError, match="secret"):
        build_bottom(5, watching.bottom)  # never silently the default seed


def _noisy_hijack(seed: int):
    """A loss on the partner's embedding alone, plus noise keyed on (step, position), never repeated."""
    w = torch.randn(8, 1, generator=torch.Generator().manual_seed(seed))
    gen = torch.Generator().manual_seed(seed + 1)

    def adversarial(top, leaves, rows):
        z = leaves[1]
        noise = torch.randn(z.shape, generator=gen) * 2e-3
        return torch.tanh(z @ w).mean() + (z * noise).sum() + 0.0 * leaves[0].sum()

    return adversarial


# --- over a real service ---------------------------------------------------------------------------------------

def test_a_real_partner_service_stops_a_noisy_hijacker(pki, bank_full: Path, tmp_path: Path, start_partner) -> None:
    """Over mutual TLS: a hijacking loss on the embedding plus noise keyed on the row's position (which defeats
    the copy probes) is stopped by the partner's rank test; the honest bank trains to the end."""
    paths = prepare_bank_marketing(tmp_path / "data", rows=1500, cache=bank_full.parent, download=False)
    start = lambda data, **kw: start_partner(data, monitor=MonitorConfig(watch=True), **kw)  # noqa: E731
    config = TrainingConfig(epochs=2, batch_size=64, seed=0)
    with federation(pki, paths, start, tmp_path, BOTTOMS) as fed:
        assert fed.coordinator(config, BOTTOMS["bank"]).run().history
        hijacker = fed.coordinator(config, BOTTOMS["bank"])
        hijacker._loss = _noisy_hijack(seed=0)
        with pytest.raises(CutlayerError, match="outside the 1 direction"):
            hijacker.run()


@pytest.mark.parametrize("flags", [("--hijack-monitor",), ("--hijack-monitor", "--hijack-project")], ids=" ".join)
def test_partner_serve_with_the_hijack_monitor_flag_stops_a_hijacker(
        pki, bank_full: Path, tmp_path: Path, flags: tuple[str, ...]) -> None:
    paths = prepare_bank_marketing(tmp_path / "data", rows=1200, cache=bank_full.parent, download=False)
    started: list[PartnerProcess] = []

    def start(data: Path, name: str, bottom: BottomConfig) -> PartnerProcess:
        started.append(PartnerProcess(pki, data, tmp_path / name, bottom, *flags))
        return started[-1]

    try:
        with federation(pki, paths, start, tmp_path, BOTTOMS) as fed:
            config = TrainingConfig(epochs=4, batch_size=64)
            assert fed.coordinator(config, BOTTOMS["bank"]).run().history  # honest: no alarm
            hijacker = fed.coordinator(config, BOTTOMS["bank"])
            hijacker._loss = _noisy_hijack(seed=0)  # the copy probes' evader
            with pytest.raises(CutlayerError, match="hijack suspected"):
                hijacker.run()
    finally:
        for partner in started:
            partner.process.stop()
    log = started[0].log.read_text()
    assert "hijack monitor on: the rank test (task rank 1, 20-step window" in log  # said at each session's start
    assert "hijack suspected" in log
    assert ("applying only each gradient's task part" in log) == ("--hijack-project" in flags)


# --- the study -------------------------------------------------------------------------------------------------

def test_wilson_intervals() -> None:
    assert wilson(20, 20)[0] == pytest.approx(0.8389, abs=1e-3) and wilson(20, 20)[1] == 1.0
    low, high = wilson(1, 20)
    assert low < 0.05 < high and high == pytest.approx(0.2361, abs=1e-3)


@pytest.mark.slow
@pytest.mark.timeout(1500)  # a small study of its own: minutes on a loaded two-core machine
def test_the_study_writes_a_row_per_bank_with_its_rates(tmp_path: Path, bank_full: Path) -> None:
    config = StudyConfig(rows=1500, epochs=2, aux_rows=1000)
    attackers = [Attacker("FSHA", "fsha"), Attacker("probe-aware: copies answered honestly", "probe-aware")]
    result = run_hijack_study(tmp_path, runs=2, attackers=attackers, config=config, cache=bank_full.parent,
                              download=False)
    runs = pd.read_csv(tmp_path / "hijack_runs.csv")
    assert len(runs) == 6 and set(runs.seed) == {0, 1} and runs.test_roc_auc.between(0, 1).all()
    study = result["study"].set_index("bank")
    assert list(study.index) == ["honest bank", "FSHA", "probe-aware: copies answered honestly"]
    assert study.loc["honest bank", "rank_alarm_rate"] == 0.0
    assert study.loc["FSHA", "rank_alarm_rate"] == 1.0 and study.loc["FSHA", "probe_alarm_rate"] == 1.0
    assert study.loc["probe-aware: copies answered honestly", "probe_alarm_rate"] == 0.0
    assert study.loc["probe-aware: copies answered honestly", "rank_alarm_rate"] == 1.0
    assert (tmp_path / "hijack_study.txt").read_text().count("\n") >= 5


def test_success_is_judged_halfway_from_the_baseline_to_fsha() -> None:
    table = pd.DataFrame([
        *({"bank": "honest bank", "seed": s, "reconstruction_error": 2.0, "rank_alarm": False, "rank_alarm_step": None,
           "probe_alarm": False} for s in range(2)),
        *({"bank": "FSHA", "seed": s, "reconstruction_error": 0.4, "rank_alarm": True, "rank_alarm_step": 19,
           "probe_alarm": True} for s in range(2)),
        *({"bank": "weak", "seed": s, "reconstruction_error": 0.75, "rank_alarm": False, "rank_alarm_step": None,
           "probe_alarm": False} for s in range(2)),
        *({"bank": "strong", "seed": s, "reconstruction_error": 0.65, "rank_alarm": s == 0,
           "rank_alarm_step": 30 if s == 0 else None, "probe_alarm": False} for s in range(2)),
    ])
    study = summarise(table).set_index("bank")
    assert study.attrs["baseline"] == 1.0 and study.attrs["halfway"] == pytest.approx(0.7)  # the mean beats 2.0
    assert not study.loc["weak", "attack_succeeds"] and study.loc["strong", "attack_succeeds"]
    assert study.loc["strong", "rank_alarm_rate"] == 0.5 and math.isnan(study.loc["honest bank", "median_alarm_step"])
    # When plain FSHA itself does no better than the mean there is no bar: nothing is called a success.
    failed = table.assign(reconstruction_error=np.where(table.bank == "FSHA", 1.08, table.reconstruction_error))
    failing = summarise(failed)
    assert failing.attrs["halfway"] is None and not failing.attack_succeeds.any()


def test_the_monitor_cost_is_printed_beside_an_unmonitored_partner() -> None:
    cost = monitor_cost(steps=60).set_index("partner")
    assert list(cost.index) == ["unmonitored", "rank test", "copy probes (every 5 steps)"]
    assert cost.loc["rank test", "fake_rows_per_step"] == 0.0 and cost.fake_rows_per_step.iloc[2] == 0.8
    assert (cost.extra_bytes == 0).all() and cost.loc["unmonitored", "extra_compute"] == 0.0
    assert (cost.median_step_us > 0).all()


def test_the_rank_test_sees_a_one_direction_hijack_wander() -> None:
    """A hijack cut to one direction per step has no off-task energy, but its direction goes all over the
    embedding; a task's jitters from batch to batch around one that moves only as fast as the top learns."""
    gen = torch.Generator().manual_seed(4)
    turning = HijackMonitor(MonitorConfig(watch=True, window=5))
    steady = HijackMonitor(MonitorConfig(watch=True, window=5))
    direction = torch.randn(8, generator=gen)
    for step in range(8):
        turning.observe(step, torch.randn(32, 1, generator=gen) * torch.randn(1, 8, generator=gen))
        direction = direction + 0.01 * torch.randn(8, generator=gen)  # a top that learns slowly
        jitter = 0.15 * direction.norm() * torch.randn(8, generator=gen) / 8**0.5  # and a batch's own
        steady.observe(step, torch.randn(32, 1, generator=gen) * (direction + jitter))
    assert turning.alarm is not None and "wandered" in turning.alarm and max(turning.shares) < 1e-6
    assert steady.alarm is None and steady.observed == 8


def test_a_direction_that_creeps_a_little_every_step_is_judged_by_where_it_went() -> None:
    """Turning 10 degrees a step passes any step-to-step test an honest task's jitter passes, but over the
    drift window the direction has gone round the embedding."""
    gen = torch.Generator().manual_seed(6)
    creeping = HijackMonitor(MonitorConfig(watch=True, window=5, drift_window=40))
    a, b = torch.zeros(8), torch.zeros(8)
    a[0], b[1] = 1.0, 1.0
    for step in range(40):
        angle = math.radians(10 * step)
        creeping.observe(step, torch.randn(32, 1, generator=gen) * (math.cos(angle) * a + math.sin(angle) * b))
    assert 1 - math.cos(math.radians(10)) ** 2 < 0.04  # each step's turn is small
    assert creeping.alarm is not None and "wandered" in creeping.alarm and 5 <= creeping.alarm_step < 39


def test_off_task_bursts_in_under_half_a_window_count() -> None:
    """A median over the window never sees bursts on 9 steps of 20; the mean does."""
    gen = torch.Generator().manual_seed(7)
    direction = torch.randn(1, 8, generator=gen)
    bursting = HijackMonitor(MonitorConfig(watch=True, window=20))
    steady = HijackMonitor(MonitorConfig(watch=True, window=20))
    for step in range(20):
        task = torch.randn(32, 1, generator=gen) * direction
        off = torch.randn(32, 8, generator=gen) * (step < 9)
        bursting.observe(step, task + 3 * off * task.norm() / 32**0.5)
        steady.observe(step, task)
    assert float(np.median(bursting.shares)) < 1e-6 < bursting.config.limit < float(np.mean(bursting.shares))
    assert bursting.alarm is not None and "mean" in bursting.alarm and steady.alarm is None


def test_a_task_rank_the_embedding_cannot_exceed_is_refused_naming_the_flags(tmp_path: Path) -> None:
    from parties.errors import ConfigError
    from parties.settings import load_settings
    from partner.settings import PartnerSettings

    with pytest.raises(ConfigError, match=r"--hijack-task-rank 8 .* below the embedding width \(--cut-width 8\)"):
        load_settings(PartnerSettings, name="p", data=tmp_path / "x.csv", insecure=True,
                      monitor={"watch": True, "task_rank": 8}, bottom={"cut_width": 8})


def test_restoring_a_monitor_replaces_its_window() -> None:
    gen = torch.Generator().manual_seed(5)
    monitor = HijackMonitor(MonitorConfig(watch=True, window=5, on_alarm="warn"))
    for step in range(3):
        monitor.observe(step, torch.randn(16, 1, generator=gen) * torch.ones(1, 8))
    saved = monitor.state()
    for step in range(3, 6):
        monitor.observe(step, torch.randn(16, 1, generator=gen) * torch.ones(1, 8))
    monitor.load_state(saved)
    assert list(monitor.shares) == saved["shares"] and monitor.observed == 3
    assert len(monitor.directions) == 3 and all(d.shape == (8, 1) for d in monitor.directions)
    assert [d.tolist() for d in monitor.directions] == saved["directions"]


def test_what_the_rank_test_does_not_catch_a_bank_shaped_under_its_limits(small) -> None:
    """Documented, not hidden (README): a bank that knows the limits can shape FSHA to pass them."""
    bank = _train(small, Attacker("rank-aware", "rank-aware"), MonitorConfig(watch=True))
    assert len(bank.sent) == TRAINED


def test_the_rank_test_judges_only_what_reaches_the_weights() -> None:
    """Nothing on an output unit that is off for the row (a ReLU at 0) reaches the partner's weights: the test
    leaves those entries out, so ballast there changes nothing it reads, and an honest gradient's own values
    there (the top does not know the unit is off) cannot make it look like a hijack."""
    generator = torch.Generator().manual_seed(0)
    active = (torch.rand(64, 16, generator=generator) > 0.4).float()  # the bottom's output units that are on
    dead = 1 - active
    direction = torch.randn(16, generator=generator)
    honest = torch.randn(64, 1, generator=generator) * direction + dead * torch.randn(64, 16, generator=generator)
    hijack = torch.randn(64, 16, generator=generator)  # every direction, as FSHA's
    ballast = torch.zeros(64, 16)
    ballast[:, 3] = 30.0 * dead[:, 3]  # only where unit 3 is off: it reaches nothing
    assert share(honest, 1, active) < 1e-6 < 0.2 < share(honest, 1)  # off-task only where nothing arrives
    assert share(hijack, 1, active) > 0.5
    assert share(hijack + ballast, 1) < 0.2  # to a test of the raw gradient the ballast is one direction
    padded, plain = HijackMonitor.task_fit(hijack + ballast, active, 1), HijackMonitor.task_fit(hijack, active, 1)
    assert padded[0] == plain[0] and np.array_equal(padded[1], plain[1])  # the ballast is not seen at all
    assert HijackMonitor.task_fit(hijack, torch.ones(64, 16), 1)[0] == pytest.approx(share(hijack, 1), abs=1e-12)
    results = {}
    for name, grad in (("honest", honest), ("ballast", hijack + ballast)):
        monitor = HijackMonitor(MonitorConfig(watch=True, on_alarm="warn"))
        for step in range(25):
            monitor.observe(step, grad, active)
        results[name] = monitor
    assert results["honest"].alarm is None
    assert results["ballast"].alarm is not None and results["ballast"].alarm_step == 19
    assert "reaches this partner's weights" in results["ballast"].alarm


def test_a_row_with_every_unit_off_or_a_unit_off_on_every_row_is_fitted_without_error() -> None:
    generator = torch.Generator().manual_seed(1)
    active = torch.ones(32, 8)
    active[5] = 0  # this row reaches nothing
    active[:, 2] = 0  # this unit is off everywhere
    grad = torch.randn(32, 1, generator=generator) * torch.randn(1, 8, generator=generator)
    left, directions = HijackMonitor.task_fit(grad, active, 1)
    assert left < 1e-9 and directions is not None and np.isfinite(directions).all()
    assert HijackMonitor.task_fit(grad, torch.zeros(32, 8), 1) == (0.0, None)  # nothing reaches: nothing to judge


def test_projecting_applies_only_the_task_part_of_what_reaches_the_weights() -> None:
    """With ``project`` the partner applies the rank test's fit: a task's gradient arrives whole, and what a bank
    hides off the task's direction (under the limits or not) never reaches the weights."""
    generator = torch.Generator().manual_seed(8)
    active = (torch.rand(64, 16, generator=generator) > 0.4).float()
    direction = torch.randn(16, generator=generator)
    task = torch.randn(64, 1, generator=generator) * direction
    off = 0.3 * torch.randn(64, 16, generator=generator)
    plain = HijackMonitor(MonitorConfig(watch=True))
    projecting = HijackMonitor(MonitorConfig(watch=True, project=True))
    assert plain.observe(0, task + off, active) is not None
    assert torch.equal(plain.observe(1, task + off, active), task + off)  # the rank test alone changes nothing
    applied = projecting.observe(0, task + off, active)
    assert torch.equal(applied * (1 - active), torch.zeros_like(applied))  # nothing where nothing arrives
    assert share(applied, 1, active) < 1e-12  # one direction over the live entries: a task's gradient
    assert (applied - task * active).norm() < 0.5 * (off * active).norm()  # most of what was hidden is gone
    exact = projecting.observe(1, task * active, active)
    assert torch.allclose(exact, task * active, atol=1e-6)  # a task's own gradient arrives as it was sent
    assert projecting.shares[0] == plain.shares[0]  # and it judges what arrived, not what it applies


def test_projecting_is_refused_without_the_rank_test_naming_the_flags(tmp_path: Path) -> None:
    from parties.errors import ConfigError
    from parties.settings import load_settings
    from partner.settings import PartnerSettings

    with pytest.raises(ConfigError, match="--hijack-monitor"):
        load_settings(PartnerSettings, name="p", data=tmp_path / "x.csv", insecure=True, monitor={"project": True})


def test_a_partner_that_projects_keeps_training_after_a_warned_alarm_on_the_task_part_only() -> None:
    x = _features()
    gen = torch.Generator().manual_seed(9)
    trainer = BottomTrainer(x, BOTTOMS["partner"], monitor=MonitorConfig(watch=True, window=3, on_alarm="warn",
                                                                          project=True))
    rows = torch.arange(32)
    trainer.step(0, None, rows)
    for step in range(1, 8):  # gradients in every direction: a hijack, caught at the third
        trainer.step(step, torch.randn(32, 8, generator=gen), rows)
    monitor = trainer.monitor
    assert monitor is not None and monitor.alarm_step == 3
    applied = monitor.observe(8, torch.randn(32, 8, generator=gen), torch.ones(32, 8))
    assert share(applied, 1) < 1e-12  # after the alarm still only one direction reaches the weights


def test_a_probe_step_sent_again_is_answered_from_the_stored_response() -> None:
    """A retried step repeats the gradient the bank sent, not the one the probes cleaned."""
    x = _features()
    gen = torch.Generator().manual_seed(10)
    trainer = BottomTrainer(x, BOTTOMS["partner"], monitor=MonitorConfig(probe_every=1, pairs=2))
    rows = torch.arange(32)
    trainer.step(0, None, rows)
    grad = torch.randn(32, 8, generator=gen)
    first = trainer.step(1, grad, rows)
    again = trainer.step(1, grad, rows)
    assert first is not None and again is not None and torch.equal(first, again)


def test_the_hijack_study_command_can_make_the_partners_project(tmp_path: Path) -> None:
    from bank.lab.__main__ import build_parser

    parser = build_parser()
    assert parser.parse_args(["hijack-study", "--out", str(tmp_path), "--project"]).project is True
    assert parser.parse_args(["hijack-study", "--out", str(tmp_path)]).project is False


def test_the_rank_test_refuses_local_steps_which_would_apply_gradients_it_did_not_judge() -> None:
    """Local steps apply a gradient to an embedding recomputed with moved weights, where units that were off
    (whose entries the test left out) may be on: refused with the rank test, allowed with the probes alone."""
    from parties.errors import ConfigError
    from parties.learning.config import LocalSteps

    x = _features()
    with pytest.raises(ConfigError, match="exact mode"):
        BottomTrainer(x, BOTTOMS["partner"], monitor=MonitorConfig(watch=True), local=LocalSteps(steps=2, batch=32))
    with pytest.raises(ConfigError, match="exact mode"):
        BottomTrainer(x, BOTTOMS["partner"], monitor=MonitorConfig(watch=True), local=LocalSteps(steps=2, batch=32, reuse=2))
    assert BottomTrainer(x, BOTTOMS["partner"], monitor=MonitorConfig(probe_every=5),
                         local=LocalSteps(steps=2, batch=32)).local is not None
    assert BottomTrainer(x, BOTTOMS["partner"], monitor=MonitorConfig(watch=True), local=LocalSteps()).local is None


def test_projecting_applies_nothing_of_a_gradient_that_reaches_no_weight_and_refuses_an_overflow() -> None:
    from parties.errors import BadMessage

    projecting = HijackMonitor(MonitorConfig(watch=True, project=True))
    active = torch.zeros(8, 4)
    active[:, 0] = 1.0
    dead_only = torch.zeros(8, 4)
    dead_only[:, 1:] = 5.0  # only where the units were off
    applied = projecting.observe(0, dead_only, active)
    assert torch.equal(applied, torch.zeros(8, 4)) and projecting.observed == 0
    assert torch.equal(HijackMonitor(MonitorConfig(watch=True)).observe(0, dead_only, active), dead_only)
    huge = torch.tensor([[3.4e38, 3.4e38], [3.4e38, 0.0]])  # finite, but its fit is not in float32
    with pytest.raises(BadMessage, match="overflows float32"):
        projecting.observe(1, huge, torch.ones(2, 2))


def test_a_stopped_partner_releases_no_more_embeddings() -> None:
    x = _features()
    gen = torch.Generator().manual_seed(11)
    trainer = BottomTrainer(x, BOTTOMS["partner"], monitor=MonitorConfig(watch=True, window=3))
    rows = torch.arange(32)
    trainer.step(0, None, rows)
    assert trainer.embed(rows).shape == (32, 8)
    with pytest.raises(HijackSuspected):
        for step in range(1, 10):
            trainer.step(step, torch.randn(32, 8, generator=gen), rows)
    with pytest.raises(HijackSuspected, match="hijack suspected"):
        trainer.embed(rows)
