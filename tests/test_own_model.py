"""A party's own bottom model, from a factory it installs: trained, killed, resumed bit for bit, then scored.

The model has batch norm (running statistics: state beside the weights) and dropout (random draws: a stream of
the party's own that a checkpoint keeps), the two things a plain MLP never had to carry across a restart.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from bank.config import TopConfig, TrainingConfig
from bank.service.operator import BankOperator
from data.prepare import prepare_bank_marketing
from parties.errors import ConfigError
from parties.learning.config import LocalSteps, PrivacyConfig
from parties.learning.model import BottomConfig, build_bottom
from parties.learning.trained_bottom import read_bottom_config
from parties.storage.layout import model_folder
from parties.transport.process import ServiceProcess
from parties.transport.server import bind_socket
from parties.transport.tls import TLSFiles
from tests.training_helpers import saved, state_equal

MODELS = '''
from torch import nn


def make_bottom(in_width, cut_width):
    return nn.Sequential(nn.Linear(in_width, 24), nn.BatchNorm1d(24), nn.ReLU(), nn.Dropout(0.3),
                         nn.Linear(24, cut_width))


def make_top(in_width, out_width):
    return nn.Sequential(nn.Linear(in_width, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2),
                         nn.Linear(16, out_width))


def left_in_eval_mode(in_width, cut_width):
    return make_bottom(in_width, cut_width).eval()


def top_left_in_eval_mode(in_width, out_width):
    return make_top(in_width, out_width).eval()


def wrong_width(in_width, cut_width):
    return nn.Linear(in_width, cut_width + 1)


def not_a_module(in_width, cut_width):
    return "a model"
'''


@pytest.fixture()
def own_models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``own_models.py``, importable here and by every service this test starts (as a party installs it)."""
    folder = tmp_path / "site"
    folder.mkdir()
    (folder / "own_models.py").write_text(MODELS)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")])))
    return folder


class Partner:
    """``python -m partner serve --bottom own_models:make_bottom``, in its own process, restartable on its port."""

    def __init__(self, pki: Path, data: Path, state: Path) -> None:
        sock = bind_socket()
        self.port = sock.getsockname()[1]
        sock.close()
        self.args = ["--name", "partner", "--data", str(data), "--tls-dir", str(pki), "--state-dir", str(state),
                     "--port", str(self.port), "--bottom", "own_models:make_bottom", "--cut-width", "8",
                     "--seed", "2", "--workers", "1"]
        self.state, self.starts = state, 0
        self.process = self.start()

    def start(self) -> ServiceProcess:
        self.starts += 1
        process = ServiceProcess("partner", self.args, self.state / "ready.json", self.state / f"log-{self.starts}.txt")
        process.wait_ready()
        return process

    def kill_and_restart_later(self, delay: float = 0.5) -> None:
        self.process.proc.send_signal(signal.SIGKILL)
        self.process.proc.wait()

        def restart() -> None:
            time.sleep(delay)
            self.process = self.start()

        threading.Thread(target=restart, daemon=True).start()


def _checkpointed(state: Path, past: int, other_than: str) -> bool:
    """Whether the partner holds a checkpoint past step ``past`` of a session other than ``other_than``."""
    for path in state.rglob("step-*.safetensors"):
        step = re.fullmatch(r"step-(\d+)\.safetensors", path.name)
        if step and int(step[1]) > past and other_than not in str(path):
            return True
    return False


def test_an_own_bottom_with_batch_norm_and_dropout_resumes_bit_for_bit_and_scores(
        pki, bank_full: Path, tmp_path: Path, start_bank, own_models: Path) -> None:
    paths = prepare_bank_marketing(tmp_path / "data", rows=2000, cache=bank_full.parent, download=False)
    partner = Partner(pki, paths["partner"], tmp_path / "partner")
    # The bank brings its own bottom and top too, through its training settings.
    config = TrainingConfig(epochs=4, batch_size=64, checkpoint_every=5, patience=50, restore_best=False,
                            bank_bottom=BottomConfig(factory="own_models:make_bottom", cut_width=8, seed=1),
                            top=TopConfig(factory="own_models:make_top", seed=4))
    bank = start_bank(paths["bank"], {"partner": f"https://127.0.0.1:{partner.port}"})
    try:
        with BankOperator(bank.url, TLSFiles.from_dir(pki, "bank")) as op:
            op.wait(op.start_alignment())
            clean = op.wait(op.start_training(config))
            job = op.start_training(config)
            deadline = time.monotonic() + 120
            while not _checkpointed(partner.state, 27, clean["session"]) and time.monotonic() < deadline:
                time.sleep(0.005)
            partner.kill_and_restart_later()
            killed = op.wait(job)

            # Scoring with the resumed models: each party rebuilds its own model from its factory and files.
            test_rows = pd.read_csv(Path(killed["run_dir"]) / "split.csv").query("split == 'test'")
            customers = pd.read_csv(paths["bank"], dtype=str).iloc[test_rows["bank_row"].to_numpy()[:50]]
            scoring = op.start_scoring(killed["session"], customers.drop(columns=["y"]).to_csv(index=False).encode())
            summary = op.wait(scoring)
            scores = pd.read_csv(io.BytesIO(op.scores(scoring.job_id)), dtype={"customer_id": str})
    finally:
        partner.process.stop()

    assert partner.starts == 2 and killed["timings"]["rollbacks"] >= 1
    # The same settings saved twice, each under a salt of the partner's own: the digests the bank holds differ.
    folders = [model_folder(tmp_path / "partner", "bank", run["session"]) for run in (clean, killed)]
    assert len({read_bottom_config((f / "bottom-config.json").read_bytes()) for f in folders}) == 1
    assert len({json.loads((f / "files.json").read_text())["bottom-config.json"] for f in folders}) == 2
    assert killed["steps"] == clean["steps"] and killed["test"] == clean["test"]
    for party, folder in (("partner", lambda s: model_folder(tmp_path / "partner", "bank", s)),
                          ("bank", lambda s: Path(s["run_dir"]) / "model" / "bank")):
        a, b = (saved(folder(run["session"] if party == "partner" else run) / "bottom.safetensors")
                for run in (clean, killed))
        assert state_equal(a, b), party
        # Batch norm's running statistics are part of it, and training moved them.
        assert any(k.endswith("running_mean") for k in a) and a["1.num_batches_tracked"] > 0, party
        assert not torch.equal(a["1.running_mean"], torch.zeros_like(a["1.running_mean"])), party
    tops = [saved(Path(run["run_dir"]) / "model" / "top.safetensors") for run in (clean, killed)]
    assert state_equal(*tops) and "model.1.running_mean" in tops[0] and "random_state" in tops[0]

    # The scores are the run's own predictions for those customers (evaluation mode: no dropout, running stats).
    assert summary["scored"] == 50
    run = Path(killed["run_dir"])
    predictions = pd.read_csv(run / "test_predictions.csv").merge(pd.read_csv(run / "split.csv"), on="position")
    ids = pd.read_csv(paths["bank"], dtype=str)["customer_id"]
    predictions["customer_id"] = ids.iloc[predictions["bank_row"]].to_numpy()
    joined = predictions.merge(scores, on="customer_id", suffixes=("_run", "_scored"))
    assert len(joined) == 50
    assert np.allclose(joined["score_run"], joined["score_scored"], atol=1e-6)


def test_dropout_draws_from_the_party_s_own_stream(own_models: Path) -> None:
    """Two builds of the same seed are the same model, and drawing elsewhere does not shift their dropout."""
    from parties.learning.bottom import BottomTrainer

    x = np.random.default_rng(0).normal(size=(256, 5)).astype(np.float32)
    config = BottomConfig(factory="own_models:make_bottom", cut_width=4, seed=7)
    a, b = BottomTrainer(x, config), BottomTrainer(x, config)
    assert state_equal(a.model.state_dict(), b.model.state_dict())
    rows = torch.arange(64)
    first = a.step(0, None, rows)
    torch.rand(1000)  # another user of torch's default generator, between the two
    assert torch.equal(first, b.step(0, None, rows))
    # Dropout is on while training: the same rows embed differently on the next draw.
    grad = torch.zeros(64, 4)
    assert not torch.equal(a.step(1, grad, rows), first)


@pytest.mark.parametrize(("factory", "message"), [
    ("own_models:wrong_width", "maps (2, 5) to (2, 5), not (2, 4)"),
    ("own_models:not_a_module", "returned str, not a torch module"),
    ("own_models:absent", "own_models has no function absent"),
    ("no_such_package.models:make", "cannot import no_such_package.models"),
])
def test_a_factory_that_does_not_fit_is_refused_with_its_name(own_models: Path, factory: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        build_bottom(5, BottomConfig(factory=factory, cut_width=4))


def test_a_factory_replaces_the_built_in_settings_instead_of_ignoring_them() -> None:
    for given in ({"hidden": (32,)}, {"hidden": (64,)}, {"bins": 8}, {"category_width": 0}):  # defaults too
        with pytest.raises(ValueError, match=f"{next(iter(given))}: a setting of the built-in bottom"):
            BottomConfig(factory="own_models:make_bottom", **given)
    # Its own settings go through a file, a checkpoint or the bank's request and back without the built-in ones.
    own = BottomConfig(factory="own_models:make_bottom", cut_width=8, seed=3, learning_rate=1e-3)
    assert "hidden" not in own.model_dump() and BottomConfig.model_validate_json(own.model_dump_json()) == own
    with pytest.raises(ValueError, match="expected MODULE:FUNCTION"):
        BottomConfig(factory="own_models.make_bottom")


@pytest.mark.parametrize(("factory", "local", "privacy"), [
    ("own_models:make_bottom", None, None),
    ("own_models:left_in_eval_mode", None, None),  # a factory's mode is not the trainer's: it trains in training mode
    ("own_models:left_in_eval_mode", LocalSteps(steps=2, batch=10, reuse=1), None),
    # NoPeek and embedding noise: the restored graph clips twice, as the step did, or its sums differ in the last bit
    ("own_models:make_bottom", None, PrivacyConfig(clip=1.0, noise=0.1, nopeek=0.1, seed=5)),
    (None, None, PrivacyConfig(clip=1.0, noise=0.1, nopeek=0.1, seed=5)),
], ids=["exact", "eval-mode-factory", "eval-mode-factory-local-steps", "nopeek+noise", "built-in-nopeek+noise"])
def test_an_own_bottom_restored_with_a_pending_batch_continues_exactly(
        own_models: Path, factory: str | None, local: LocalSteps | None, privacy: PrivacyConfig | None) -> None:
    """Restoring recomputes the pending batch's graph: with the same dropout draws, and without counting that
    batch twice in batch norm's running statistics."""
    from parties.learning.bottom import BottomTrainer
    from parties.storage.checkpoint import Checkpoint

    x = np.random.default_rng(1).normal(size=(200, 6)).astype(np.float32)
    config = BottomConfig(factory=factory, cut_width=4, seed=5)
    original = BottomTrainer(x, config, privacy, local=local)
    assert original.model.training
    grad = None
    for step in range(3):
        original.step(step, grad, torch.arange(20 * step, 20 * step + 20))
        grad = torch.full((20, 4), 0.05 * (step + 1))
    tensors, meta = original.state()
    restored = BottomTrainer(x, config, privacy, local=local)
    restored.load_state(Checkpoint(meta["next_step"] - 1, tensors, meta), meta)
    assert state_equal(restored.model.state_dict(), original.model.state_dict())
    for step in range(3, 8):
        rows = torch.arange(20 * step, 20 * step + 20)
        assert torch.equal(original.step(step, grad, rows), restored.step(step, grad, rows)), step
        grad = torch.full((20, 4), -0.03 * step)
    assert state_equal(restored.model.state_dict(), original.model.state_dict())


def test_embeddings_of_a_party_without_numeric_or_categorical_columns() -> None:
    """Nothing to embed on one side: the other side's embedding alone, or the plain MLP."""
    from parties.learning.model import InputLayout, TabularBottom

    categories_only = InputLayout((), (3, 2))
    model = build_bottom(categories_only, BottomConfig(numeric_embedding="ple", category_width=4))
    assert isinstance(model, TabularBottom) and model(torch.eye(5)[:, :5]).shape == (5, 16)
    plain = build_bottom(categories_only, BottomConfig(numeric_embedding="periodic"))
    assert isinstance(plain, torch.nn.Sequential)  # the plain MLP: no numbers to embed
    assert isinstance(build_bottom(InputLayout((1, 1)), BottomConfig(category_width=4)), torch.nn.Sequential)


def test_a_factory_whose_module_fails_to_import_is_a_clear_error(own_models: Path) -> None:
    (own_models / "broken_models.py").write_text("def make(:\n")
    with pytest.raises(ConfigError, match="importing broken_models failed: SyntaxError"):
        build_bottom(5, BottomConfig(factory="broken_models:make", cut_width=4))


def test_the_bank_s_own_top_carries_its_random_stream_in_its_state(own_models: Path) -> None:
    """A checkpoint, a rollback and the best epoch all hold the top's ``state_dict``: restoring it restores its
    dropout draws too, and evaluation never moves them."""
    from parties.learning.model import Drawing, build_top

    config = TopConfig(factory="own_models:make_top", seed=4)
    top = build_top(6, config, 1)
    assert isinstance(top, Drawing) and state_equal(top.state_dict(), build_top(6, config, 1).state_dict())
    x = torch.randn(32, 6, generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        top(x)
    snapshot = {k: v.clone() for k, v in top.state_dict().items()}
    top.eval()
    assert torch.equal(top(x), top(x))  # evaluation: no dropout, and the stream stays where it was
    top.train()
    ahead = [top(x) for _ in range(2)]
    assert not torch.equal(ahead[0], ahead[1])  # dropout draws anew each training forward
    restored = build_top(6, config, 1)
    restored.load_state_dict(snapshot)
    assert all(torch.equal(a, restored(x)) for a in ahead)
    with pytest.raises(ValueError, match="hidden: a setting of the built-in top"):
        TopConfig(factory="own_models:make_top", hidden=(32,))
    # It trains in training mode whatever mode its factory left it in (a resumed epoch must train as the first).
    assert build_top(6, TopConfig(factory="own_models:top_left_in_eval_mode"), 1).model.training


@pytest.mark.parametrize("given", [
    {"top": {"factory": "own_models:make_top"}},
    {"training": {"top": {"factory": "own_models:make_top"}}},
    {"training": {"bank_bottom": {"factory": "own_models:make_bottom"}}},
    {"bottom": {"numeric_embedding": "ple"}},
])
def test_the_other_configurations_refuse_own_models_instead_of_dropping_them(given: dict) -> None:
    from bank.configurations.split_run import ConfigurationSettings

    with pytest.raises(ValueError, match="configuration's models are the built-in MLPs"):
        ConfigurationSettings(configuration="u-shaped", **given)
