"""The configurations beside vertical, over real services and mutual TLS on 127.0.0.1.

- U-shaped, vanilla, relay and SplitFed runs equal their single-process twins (``bank.lab.references.twins``) bit for bit:
  every party's final weights and the test scores, with tuned settings and with the defaults.
- Relay is sequential training of one model on the concatenated schedule (a reference written here, not the twin).
- Every training step is applied exactly once: a resent call is answered from the cache, anything else is refused.
- A compute party killed with SIGKILL mid-run restarts; the run resumes it and ends with the same model.
- The bank refuses branches whose rows or columns do not match, before any training step.
- The shared encoder is the one fitted on the pooled training rows; FedAvg is the row-weighted mean.
"""

from __future__ import annotations

import json
import math
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import numpy as np
import pandas as pd
import pytest
import torch

from bank.config import TopConfig, TrainingConfig
from bank.configurations.runs import read_labels
from bank.configurations.horizontal import HorizontalOutcome, HorizontalTrainer, bottom_start, branch_labels, fedavg, merge_encoder
from bank.lab.references.twins import encode_branches, horizontal_twin, owner_twin
from bank.configurations.layer_peer import LayerPeer
from bank.configurations.u_shaped import OwnerOutcome, OwnerTrainer, compute_start, owner_data
from bank.vertical.schedule import epoch_batches
from bank.configurations.split_run import ConfigurationSettings, TrunkConfig
from bank.task import Task
from data.configurations import BRANCH_COLUMN, LABEL, prepare_branches, prepare_owner
from parties.errors import DataError, PeerError
from parties.learning.config import BottomConfig
from parties.learning.model import build_bottom, build_optimizer, mlp
from parties.protocol import layers
from parties.protocol.common import fill
from parties.protocol.wire import SAFETENSORS, decode, encode
from partner.settings import BranchSettings, ComputeSettings
from parties.storage.checkpoint import read_checkpoint
from parties.tables.encoding import TabularEncoder
from parties.tables.schema import PartySchema, sidecar_path
from parties.tables.table import PartyTable, load_party_table
from parties.transport.client import make_client
from parties.transport.process import ServiceProcess
from parties.transport.server import ServerThread, bind_socket
from parties.transport.tls import PeerIdentity, TLSFiles
from partner.layer_service import create_layer_app

OWNER_ROWS = 2000
BRANCH_ROWS = 3000
Weights = dict[str, torch.Tensor]


# --- data and services ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """Every party of these runs computes on one intra-op thread, as a service does by default (--torch-threads 1):
    a party in this process and the same party in its own process then give the same bits on any CPU (with two
    threads, one CPU's kernels split a product differently from the service's one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def owner_file(bank_full: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_owner(tmp_path_factory.mktemp("owner"), rows=OWNER_ROWS, cache=bank_full.parent,
                         download=False)["bank"]


@pytest.fixture(scope="module")
def branch_files(bank_full: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return prepare_branches(tmp_path_factory.mktemp("branches"), branches=3, rows=BRANCH_ROWS, cache=bank_full.parent,
                            download=False)


def _tls(pki: Path, name: str) -> dict[str, Path]:
    files = TLSFiles.from_dir(pki, name)
    return {"tls_ca": files.ca, "tls_cert": files.cert, "tls_key": files.key}


@contextmanager
def compute_service(pki: Path, state: Path, name: str = "compute") -> Iterator[ServerThread]:
    """A compute party (``create_layer_app`` with no table) in this process, real uvicorn and mutual TLS."""
    settings = ComputeSettings(name=name, state_dir=state, banks=("bank",), **_tls(pki, name))
    server = ServerThread(create_layer_app(settings), settings.tls_files()).start()
    try:
        yield server
    finally:
        server.stop()


@contextmanager
def branch_services(pki: Path, state: Path, files: dict[str, Path]) -> Iterator[dict[str, ServerThread]]:
    """One branch service per file (name -> its CSV), each loading its own table at start-up."""
    with ExitStack() as stack:
        servers = {}
        for name, data in files.items():
            settings = BranchSettings(name=name, data=data, state_dir=state / name, max_sessions=4, banks=("bank",),
                                      **_tls(pki, name))
            servers[name] = ServerThread(create_layer_app(settings), settings.tls_files()).start()
            stack.callback(servers[name].stop)
        yield servers


def bank_client(pki: Path) -> httpx.Client:
    """The bank's client. Close it before stopping a service: a kept-alive connection holds uvicorn's
    graceful shutdown for its full 5 seconds."""
    return make_client(TLSFiles.from_dir(pki, "bank"), caller=PeerIdentity("bank", "bank"))


def _branches_of(files: dict[str, Path]) -> dict[str, Path]:
    return {n: p for n, p in files.items() if n != "bank"}


# --- comparisons ----------------------------------------------------------------------------------------------

def assert_same_weights(split: Weights, twin: Weights, what: str) -> None:
    assert split.keys() == twin.keys(), what
    for k in split:
        assert split[k].dtype == twin[k].dtype == torch.float32, (what, k)
        assert torch.equal(split[k], twin[k]), f"{what}: {k} differs by {float((split[k] - twin[k]).abs().max())}"


def assert_moved(trained: Weights, initial: Weights, what: str) -> None:
    """Equality above is not two untouched initialisations: training changed every tensor."""
    assert trained.keys() == initial.keys()
    for k in trained:
        assert not torch.equal(trained[k], initial[k]), f"{what}: {k} never moved"


def model_part(tensors: Weights) -> Weights:
    return {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")}


def hosted(server: ServerThread, session: str) -> Weights:
    """What a service in this process holds for a session: its layers' weights, read directly."""
    return {k: v.detach().clone() for k, v in server.app.state.host.sessions[("bank", session)].model.state_dict().items()}


# --- settings -------------------------------------------------------------------------------------------------

def tuned(configuration: str, training: TrainingConfig | None = None, **extra: object) -> ConfigurationSettings:
    """Nothing left at a default that could make two different models agree by accident.

    The bank-owned configurations train their bottom with SGD; the horizontal ones their top, so that the
    bottom that moves between branches carries Adam's moments with it."""
    owner = configuration in ("u-shaped", "vanilla")
    return ConfigurationSettings(
        configuration=configuration,  # type: ignore[arg-type]
        training=training or TrainingConfig(epochs=3, batch_size=128, seed=7, patience=10, restore_best=False),
        bottom=BottomConfig(hidden=(24,), cut_width=12, seed=5, optimizer="sgd" if owner else "adam",
                            learning_rate=0.05 if owner else 4e-3),
        trunk=TrunkConfig(hidden=(20, 18), width=10, seed=9, learning_rate=3e-3, weight_decay=1e-4),
        top=TopConfig(hidden=(14,), seed=4, optimizer="adam" if owner else "sgd",
                      learning_rate=2e-3 if owner else 0.1),
        **extra,  # type: ignore[arg-type]
    )


# --- U-shaped and vanilla -------------------------------------------------------------------------------------

def owner_split_run(pki: Path, tmp: Path, settings: ConfigurationSettings,
                    table: PartyTable) -> tuple[OwnerTrainer, OwnerOutcome, Weights]:
    """The bank's loop against a compute service; the compute party's final layers."""
    with compute_service(pki, tmp / "compute") as compute, bank_client(pki) as client:
        peer = LayerPeer("compute", compute.url, client, "compute", retry_deadline=5)
        trainer = OwnerTrainer(settings, owner_data(table, settings.training), peer)
        outcome = trainer.run()
        remote = hosted(compute, trainer.session_id)
        peer.end()
    return trainer, outcome, remote


def _validation(history: list[dict[str, object]]) -> list[dict[str, object]]:
    """Each epoch's validation metrics (every task's: ``val_roc_auc``, ``val_log_loss``, ``val_mse``...)."""
    rows = [{k: v for k, v in h.items() if k.startswith("val_")} for h in history]
    assert rows and all(rows)
    return rows


def check_owner_against_twin(settings: ConfigurationSettings, table: PartyTable, outcome: OwnerOutcome,
                             remote: Weights) -> None:
    data = owner_data(table, settings.training)
    twin = owner_twin(settings, data)
    assert_same_weights(outcome.bottom.state_dict(), twin.models["bottom"].state_dict(), "the bank's bottom")
    if settings.configuration == "u-shaped":
        assert outcome.head is not None
        assert_same_weights(outcome.head.state_dict(), twin.models["head"].state_dict(), "the bank's head")
        assert_same_weights(remote, twin.models["trunk"].state_dict(), "the compute party's trunk")
    else:
        assert outcome.head is None
        assert_same_weights(remote, twin.models["server"].state_dict(), "the compute party's server layers")
    # Probabilities in float32; regression's predictions in the target's units, in float64 (``Task.scores``).
    assert outcome.test_scores.dtype == twin.test_scores.dtype == (np.float64 if data.task.kind == "regression"
                                                                   else np.float32)
    assert np.array_equal(outcome.test_scores, twin.test_scores)
    assert outcome.test == twin.test
    assert _validation(outcome.book.history) == _validation(twin.history)
    assert outcome.book.best_epoch == twin.best_epoch
    # Training moved every part, so the equalities are not of untouched initialisations.
    assert_moved(outcome.bottom.state_dict(), build_bottom(data.features.shape[1], settings.bottom).state_dict(),
                 "bottom")
    start = compute_start(settings, "fresh", data.task)
    fresh = mlp(start.in_width, start.hidden, start.out_width, activate_output=start.kind == "trunk", seed=start.seed)
    assert_moved(remote, fresh.state_dict(), start.kind)


@pytest.mark.parametrize("configuration", ["u-shaped", "vanilla"])
def test_owner_configurations_equal_their_twin_bit_for_bit(pki, owner_file: Path, tmp_path: Path,
                                                           configuration: str) -> None:
    """Bank bottom -> compute trunk -> bank head (U-shaped), bank bottom -> compute server (vanilla): the split
    run's weights at every party and its test scores are the unsplit model's, in float32, bit for bit."""
    settings = tuned(configuration)
    table = load_party_table(owner_file, None, LABEL, labelled=True)
    trainer, outcome, remote = owner_split_run(pki, tmp_path, settings, table)
    assert outcome.steps == 3 * len(epoch_batches(trainer.data.split.train, 128, 7, 0)) and outcome.resumes == 0
    check_owner_against_twin(settings, table, outcome, remote)


# --- relay and SplitFed ---------------------------------------------------------------------------------------

def horizontal_setup(files: dict[str, Path], settings: ConfigurationSettings):
    frame = read_labels(files["bank"])
    task = Task(settings.training.task, settings.training.positive_label).fit(frame[LABEL])
    return task, branch_labels(frame, "customer_id", BRANCH_COLUMN, LABEL, task, settings)


def horizontal_split_run(pki: Path, tmp: Path, settings: ConfigurationSettings,
                         files: dict[str, Path]) -> tuple[HorizontalTrainer, HorizontalOutcome, dict[str, Weights]]:
    task, labels = horizontal_setup(files, settings)
    with branch_services(pki, tmp / "branches", _branches_of(files)) as servers, bank_client(pki) as client:
        peers = {n: LayerPeer(n, s.url, client, "partner", retry_deadline=5) for n, s in servers.items()}
        trainer = HorizontalTrainer(settings, task, labels, peers)
        outcome = trainer.run()
        # Over the wire, as the bank moves them: each branch's client-side model at the end.
        bottoms = {n: model_part(p.weights(optimizer=False)[0]) for n, p in peers.items()}
        for p in peers.values():
            p.end()
    return trainer, outcome, bottoms


def check_horizontal_against_twin(settings: ConfigurationSettings, files: dict[str, Path],
                                  outcome: HorizontalOutcome, bottoms: dict[str, Weights]) -> None:
    task, labels = horizontal_setup(files, settings)
    tables = {b: load_party_table(p) for b, p in _branches_of(files).items()}
    features = encode_branches(tables, outcome.encoder)
    twin = horizontal_twin(settings, task, labels, features)
    for name, bottom in bottoms.items():
        assert_same_weights(bottom, twin.models["bottom"].state_dict(), f"{name}'s bottom")
    assert_same_weights(outcome.top.state_dict(), twin.models["top"].state_dict(), "the bank's top")
    scores = outcome.predictions[[c for c in outcome.predictions.columns if c.startswith("score")]].to_numpy()
    assert scores.dtype == twin.test_scores.dtype == (np.float64 if task.kind == "regression" else np.float32)
    assert np.array_equal(scores, twin.test_scores.reshape(scores.shape))
    assert outcome.test == twin.test
    assert _validation(outcome.book.history) == _validation(twin.history)
    fresh = build_bottom(next(iter(features.values())).shape[1], settings.bottom).state_dict()
    assert_moved(bottoms["branch-1"], fresh, "bottom")


@pytest.mark.parametrize(("configuration", "every"), [("relay", 0), ("splitfed", 0), ("splitfed", 3)],
                         ids=["relay", "splitfed-epoch", "splitfed-every3"])
def test_horizontal_configurations_equal_their_twin_bit_for_bit(pki, branch_files: dict[str, Path], tmp_path: Path,
                                                                configuration: str, every: int) -> None:
    """Three branches' bottoms (relayed, or averaged at epoch ends or every 3 steps) and the bank's top: the split
    run's weights at every branch, the top and the test scores are the twin's, bit for bit."""
    settings = tuned(configuration, fedavg_every=every)
    trainer, outcome, bottoms = horizontal_split_run(pki, tmp_path, settings, branch_files)
    assert sorted(bottoms) == ["branch-1", "branch-2", "branch-3"]
    assert trainer.train_rows == {b: len(trainer.labels[b].split.train) for b in trainer.order}
    # Relay hands one model round; SplitFed averages every copy at the epoch's end at least: one model either way.
    for name in bottoms:
        assert_same_weights(bottoms[name], bottoms["branch-1"], name)
    check_horizontal_against_twin(settings, branch_files, outcome, bottoms)


def test_relay_is_sequential_training_of_one_model_on_the_concatenated_schedule(
        pki, branch_files: dict[str, Path], tmp_path: Path) -> None:
    """Relay = one bottom and one top, one optimizer each, trained step by step on the batches of branch-1's
    epoch, then branch-2's, then branch-3's, epoch after epoch, as if the branches' rows were one table.

    The reference is a plain loop written here over the concatenated rows (not ``bank.lab.references.twins``): the
    relay's final bottom (at every branch), top and test scores equal it bit for bit. That needs the relay
    to hand on Adam's moments and step counts with the weights, and each branch to use the shared encoder."""
    settings = tuned("relay", training=TrainingConfig(epochs=2, batch_size=96, seed=11, restore_best=False))
    trainer, outcome, bottoms = horizontal_split_run(pki, tmp_path, settings, branch_files)

    task, labels = horizontal_setup(branch_files, settings)
    order = sorted(labels)
    tables = {b: load_party_table(p) for b, p in _branches_of(branch_files).items()}
    encoder = TabularEncoder.from_dict(outcome.encoder)
    x = torch.from_numpy(np.concatenate([encoder.transform(tables[b].features) for b in order]))
    y = torch.cat([labels[b].targets for b in order])
    offset = dict(zip(order, np.cumsum([0] + [len(labels[b].targets) for b in order])))
    t = settings.training
    schedule = [rows + int(offset[b]) for epoch in range(t.epochs) for b in order
                for rows in epoch_batches(labels[b].split.train, t.batch_size, t.seed, epoch)]
    bottom = build_bottom(x.shape[1], settings.bottom)
    top = mlp(settings.bottom.cut_width, settings.top.hidden, 1, activate_output=False, seed=settings.top.seed)
    initial = {k: v.clone() for k, v in bottom.state_dict().items()}
    optimizers = [build_optimizer(bottom.parameters(), settings.bottom), build_optimizer(top.parameters(), settings.top)]
    for rows in schedule:
        loss = task.loss(top(bottom(x[rows])), y[rows])
        for o in optimizers:
            o.zero_grad(set_to_none=True)
        loss.backward()
        for o in optimizers:
            o.step()

    assert sum(outcome.steps.values()) == len(schedule) > 30
    for name in order:
        assert_same_weights(bottoms[name], bottom.state_dict(), f"{name}'s bottom")
    assert_same_weights(outcome.top.state_dict(), top.state_dict(), "the bank's top")
    assert_moved(bottom.state_dict(), initial, "bottom")
    # Each branch embeds its own test rows in one batch, as the relay does: a float32 product's last bit can
    # depend on how many rows share it.
    with torch.no_grad():
        expected = np.concatenate([task.scores(top(bottom(x[torch.from_numpy(labels[b].split.test + int(offset[b]))])))
                                   for b in order])
    assert np.array_equal(outcome.predictions["score"].to_numpy(), expected)


# --- every task ---------------------------------------------------------------------------------------------

#: A label of each other task, from a column of bank-full (taken out of the features): four education levels, and
#: the yearly balance in euros (a regression target in the thousands, which the task standardises).
OTHER_TASKS = {"multiclass": "education", "regression": "balance"}


def _with_label_of(path: Path, out: Path, task: str) -> Path:
    """``path`` with its label replaced by the column ``OTHER_TASKS[task]`` (that column no longer a feature)."""
    frame = pd.read_csv(path)
    frame = frame.drop(columns=[LABEL]).rename(columns={OTHER_TASKS[task]: LABEL})
    out.parent.mkdir(parents=True, exist_ok=True)
    frame.to_csv(out, index=False)
    return out


def _relabelled_branches(files: dict[str, Path], out: Path, task: str) -> dict[str, Path]:
    """The branches' files without the column that becomes the label, and the bank's labels file of it."""
    column = OTHER_TASKS[task]
    paths = {}
    values = []
    for name, path in _branches_of(files).items():
        frame = pd.read_csv(path)
        values.append(frame[["customer_id", column]])
        paths[name] = out / name / f"{name}.csv"
        paths[name].parent.mkdir(parents=True, exist_ok=True)
        frame.drop(columns=[column]).to_csv(paths[name], index=False)
    labels = read_labels(files["bank"]).drop(columns=[LABEL])
    labels = labels.merge(pd.concat(values).rename(columns={column: LABEL}), on="customer_id", how="left")
    paths["bank"] = out / "bank" / "labels.csv"
    paths["bank"].parent.mkdir(parents=True, exist_ok=True)
    labels.to_csv(paths["bank"], index=False)
    return paths


@pytest.mark.parametrize("task", ["multiclass", "regression"])
@pytest.mark.parametrize("configuration", ["u-shaped", "vanilla"])
def test_owner_configurations_learn_every_task_and_equal_their_twin(pki, owner_file: Path, tmp_path: Path,
                                                                   configuration: str, task: str) -> None:
    """The task is what the labels show, as in vertical: four classes (one logit each, cross-entropy at the
    bank's head or, vanilla, at the compute party's server), or a standardised regression target (the
    compute party receives the standardised targets). Weights and test scores equal the twin's, bit for bit."""
    settings = tuned(configuration, training=TrainingConfig(epochs=2, batch_size=128, seed=7, restore_best=False))
    assert settings.training.task is None  # inferred from the labels, as vertical does
    table = load_party_table(_with_label_of(owner_file, tmp_path / "data" / "bank.csv", task), "customer_id", LABEL,
                             labelled=True)
    trainer, outcome, remote = owner_split_run(pki, tmp_path, settings, table)
    assert trainer.data.task.kind == task
    if task == "multiclass":
        assert trainer.data.task.output_dim == 4 and outcome.test_scores.shape == (len(trainer.data.split.test), 4)
        assert list(outcome.predictions.columns[2:]) == [f"score_{c}" for c in trainer.data.task.classes_]
        assert outcome.book.metric == "log_loss" and outcome.test["accuracy"] > 0.4
    else:
        assert trainer.data.task.target_scale_ > 1000  # balances in euros: the loss sees them standardised
        assert outcome.book.metric == "mse" and set(outcome.test) == {"mse", "rmse", "mae", "r2"}
    assert outcome.book.history and all(f"val_{outcome.book.metric}" in h for h in outcome.book.history)
    check_owner_against_twin(settings, table, outcome, remote)


@pytest.mark.parametrize(("configuration", "task"), [("relay", "multiclass"), ("splitfed", "regression")])
def test_horizontal_configurations_learn_every_task_and_equal_their_twin(pki, branch_files: dict[str, Path],
                                                                        tmp_path: Path, configuration: str,
                                                                        task: str) -> None:
    """The bank's top ends in the task's outputs and its loss is the task's; a regression target is
    standardised on every branch's training rows pooled. Bit for bit the twin's."""
    files = _relabelled_branches(branch_files, tmp_path / "data", task)
    settings = tuned(configuration, training=TrainingConfig(epochs=2, batch_size=96, seed=11, restore_best=False),
                     fedavg_every=3)
    trainer, outcome, bottoms = horizontal_split_run(pki, tmp_path, settings, files)
    assert trainer.task.kind == task and outcome.book.metric == trainer.task.objective[0]
    columns = [c for c in outcome.predictions.columns if c.startswith("score")]
    assert len(columns) == (4 if task == "multiclass" else 1)
    check_horizontal_against_twin(settings, files, outcome, bottoms)


def test_a_server_session_takes_only_targets_its_task_can_learn(tmp_path: Path) -> None:
    """A vanilla compute party checks what a bank sends as labels before its loss sees them: a class index
    outside the logits, a 0.5 for a binary task, a NaN regression target, or one target too few is refused."""
    from parties.errors import BadMessage
    from parties.learning.layer_host import LayerSession

    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
    bad = {
        "multiclass": [torch.tensor([0, 1, 2, 3]), torch.tensor([0.0, 1.0, 2.0, 1.0]), torch.tensor([0, 1, 2])],
        "binary": [torch.tensor([0.0, 1.0, 0.5, 1.0]), torch.tensor([0, 1, 0, 1])],
        "regression": [torch.tensor([0.0, float("nan"), 1.0, 2.0])],
    }
    good = {"multiclass": torch.tensor([0, 1, 2, 1]), "binary": torch.tensor([0.0, 1.0, 0.0, 1.0]),
            "regression": torch.tensor([-0.5, 0.1, 1.3, 2.0])}
    for task, labels in bad.items():
        start = layers.LayerStart(session=task, kind="server", in_width=6, hidden=(5,),
                                  out_width=3 if task == "multiclass" else 1, task=task)  # type: ignore[arg-type]
        session = LayerSession(start, "bank", None)
        for wrong in labels:
            with pytest.raises(BadMessage, match="labels"):
                session.train(1, x, wrong)
        assert session.step == 0
        grad, loss = session.train(1, x, good[task])
        assert session.step == 1 and grad.shape == x.shape and math.isfinite(loss)
    with pytest.raises(ValueError, match="one logit per class"):
        layers.LayerStart(session="s", kind="server", in_width=6, out_width=1, task="multiclass")
    with pytest.raises(ValueError, match="out_width must be 1"):
        layers.LayerStart(session="s", kind="server", in_width=6, out_width=3, task="regression")


# --- the defaults ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("configuration", ["u-shaped", "vanilla", "relay", "splitfed"])
def test_the_default_settings_equal_their_twin_bit_for_bit(pki, owner_file: Path, branch_files: dict[str, Path],
                                                           tmp_path: Path, configuration: str) -> None:
    """``ConfigurationSettings(configuration=...)`` and nothing else: up to 40 epochs of batches of 1024, early
    stopping after 6 epochs without a better validation score, the best epoch's weights restored at every party."""
    settings = ConfigurationSettings(configuration=configuration)  # type: ignore[arg-type]
    assert settings.training.restore_best and settings.fedavg_every == 10
    if configuration in ("u-shaped", "vanilla"):
        table = load_party_table(owner_file, None, LABEL, labelled=True)
        _, outcome, remote = owner_split_run(pki, tmp_path, settings, table)
        check_owner_against_twin(settings, table, outcome, remote)
    else:
        _, outcome, bottoms = horizontal_split_run(pki, tmp_path, settings, branch_files)
        check_horizontal_against_twin(settings, branch_files, outcome, bottoms)
    # These runs stop early: the weights compared are the best epoch's, restored at every party, not the last.
    book = outcome.book
    t = settings.training
    assert len(book.history) == min(book.best_epoch + t.patience, t.epochs) and 1 <= book.best_epoch < len(book.history)


# --- exactly once ---------------------------------------------------------------------------------------------

def _post(client: httpx.Client, server: ServerThread, template: str, session: str, body: bytes) -> httpx.Response:
    return client.post(server.url + fill(template, session_id=session), content=body,
                       headers={"content-type": SAFETENSORS})


def _refused_out_of_order(response: httpx.Response) -> str:
    assert response.status_code == 409, response.text
    assert response.json()["error"] == "OutOfOrder"
    return str(response.json()["detail"])


def _state(server: ServerThread, session: str) -> tuple[Weights, list[float]]:
    """A session's weights and its optimizer's step count per parameter (Adam counts every update)."""
    held = server.app.state.host.sessions[("bank", session)]
    steps = [float(held.optimizer.state[p]["step"]) if p in held.optimizer.state else 0.0
             for p in held.model.parameters()]
    return hosted(server, session), steps


def test_a_resent_forward_and_backward_are_answered_from_the_cache_and_applied_once(pki, tmp_path: Path) -> None:
    """Over HTTP, the trunk of a U-shaped run: the same body sent twice gets the same answer and one update; the
    same step with other inputs, and a step out of order, are refused (409) and change nothing."""
    g = torch.Generator().manual_seed(0)
    x1, x2, grad1 = torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g), torch.randn(8, 4, generator=g)
    with compute_service(pki, tmp_path / "compute") as compute, bank_client(pki) as client:
        LayerPeer("compute", compute.url, client, "compute").start(
            layers.LayerStart(session="once", kind="trunk", in_width=6, hidden=(5,), out_width=4, seed=3))
        forward1 = encode({"x": x1}, session="once", step=1)
        first, again = (_post(client, compute, layers.FORWARD, "once", forward1) for _ in range(2))
        assert first.status_code == again.status_code == 200
        output = decode(first.content, {"output": torch.float32}).get("output")
        assert output is not None and output.shape == (8, 4)
        assert torch.equal(decode(again.content, {"output": torch.float32}).get("output"), output)
        initial = _state(compute, "once")
        assert initial[1] == [0.0] * 4  # a forward updates nothing

        assert "other inputs" in _refused_out_of_order(
            _post(client, compute, layers.FORWARD, "once", encode({"x": x1 + 1}, session="once", step=1)))
        assert "out of order" in _refused_out_of_order(
            _post(client, compute, layers.FORWARD, "once", encode({"x": x2}, session="once", step=3)))
        _refused_out_of_order(  # step 2's gradient before step 2's forward
            _post(client, compute, layers.BACKWARD, "once", encode({"grad": grad1}, session="once", step=2)))
        assert _equal_states(_state(compute, "once"), initial)

        backward1 = encode({"grad": grad1}, session="once", step=1)
        first = _post(client, compute, layers.BACKWARD, "once", backward1)
        assert first.status_code == 200
        updated = _state(compute, "once")
        assert updated[1] == [1.0] * 4
        assert_moved(updated[0], initial[0], "the trunk after step 1")
        again = _post(client, compute, layers.BACKWARD, "once", backward1)  # the reply was lost: sent again
        assert again.status_code == 200
        assert torch.equal(decode(again.content, {"grad": torch.float32}).get("grad"),
                           decode(first.content, {"grad": torch.float32}).get("grad"))
        assert _equal_states(_state(compute, "once"), updated), "a resent backward updated the trunk twice"
        _refused_out_of_order(
            _post(client, compute, layers.BACKWARD, "once", encode({"grad": grad1 * 2}, session="once", step=1)))
        # A lost forward reply after the backward: still the same answer; a stale step with new inputs is not.
        assert torch.equal(decode(_post(client, compute, layers.FORWARD, "once", forward1).content,
                                  {"output": torch.float32}).get("output"), output)
        assert _equal_states(_state(compute, "once"), updated)
        assert compute.app.state.host.sessions[("bank", "once")].step == 1

        # The next step in order goes through; afterwards step 1 is no longer answered at all.
        assert _post(client, compute, layers.FORWARD, "once", encode({"x": x2}, session="once", step=2)).status_code == 200
        _refused_out_of_order(_post(client, compute, layers.FORWARD, "once", forward1))
        assert _equal_states(_state(compute, "once"), updated)


def _equal_states(a: tuple[Weights, list[float]], b: tuple[Weights, list[float]]) -> bool:
    return a[1] == b[1] and a[0].keys() == b[0].keys() and all(torch.equal(a[0][k], b[0][k]) for k in a[0])


def test_a_resent_vanilla_train_step_is_answered_from_the_cache_and_applied_once(pki, tmp_path: Path) -> None:
    """Over HTTP, the server layers of a vanilla run: ``train`` (activations and labels in one call) resent with
    the same body gets the same gradient and loss and no second update; other inputs or another step: 409."""
    g = torch.Generator().manual_seed(1)
    x1, x2 = torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g)
    y1 = torch.tensor([0, 1, 0, 0, 1, 1, 0, 1], dtype=torch.float32)
    with compute_service(pki, tmp_path / "compute") as compute, bank_client(pki) as client:
        LayerPeer("compute", compute.url, client, "compute").start(
            layers.LayerStart(session="once", kind="server", in_width=6, hidden=(5,), out_width=1, seed=3))
        initial = _state(compute, "once")
        _refused_out_of_order(  # a server trains in one call, never forward then backward
            _post(client, compute, layers.FORWARD, "once", encode({"x": x1}, session="once", step=1)))
        _refused_out_of_order(
            _post(client, compute, layers.TRAIN, "once", encode({"x": x1, "labels": y1}, session="once", step=2)))
        assert _equal_states(_state(compute, "once"), initial)

        train1 = encode({"x": x1, "labels": y1}, session="once", step=1)
        first = _post(client, compute, layers.TRAIN, "once", train1)
        assert first.status_code == 200
        updated = _state(compute, "once")
        assert updated[1] == [1.0] * 4
        assert_moved(updated[0], initial[0], "the server layers after step 1")
        again = _post(client, compute, layers.TRAIN, "once", train1)
        assert again.status_code == 200
        a, b = (decode(r.content, {"grad": torch.float32}) for r in (first, again))
        assert torch.equal(a.get("grad"), b.get("grad")) and a.meta["loss"] == b.meta["loss"]
        assert _equal_states(_state(compute, "once"), updated), "a resent train step updated the server twice"

        for other in ({"x": x1, "labels": 1 - y1}, {"x": x2, "labels": y1}):  # other labels, other activations
            assert "other inputs" in _refused_out_of_order(
                _post(client, compute, layers.TRAIN, "once", encode(other, session="once", step=1)))
        _refused_out_of_order(
            _post(client, compute, layers.TRAIN, "once", encode({"x": x2, "labels": y1}, session="once", step=3)))
        assert _equal_states(_state(compute, "once"), updated)
        assert compute.app.state.host.sessions[("bank", "once")].step == 1
        assert _post(client, compute, layers.TRAIN, "once",
                     encode({"x": x2, "labels": y1}, session="once", step=2)).status_code == 200
        assert _state(compute, "once")[1] == [2.0] * 4


# --- a compute party killed mid-run ---------------------------------------------------------------------------

class ComputeProcess:
    """``python -m partner compute`` in its own process, on a fixed port so that a restart answers at the same address."""

    def __init__(self, pki: Path, state: Path) -> None:
        sock = bind_socket()
        self.port = sock.getsockname()[1]
        sock.close()
        self.url = f"https://127.0.0.1:{self.port}"
        self.args = ["--name", "compute", "--tls-dir", str(pki), "--state-dir", str(state), "--port", str(self.port),
                     "--bank", "bank"]
        self.state, self.starts = state, 0
        self.restarter: threading.Thread | None = None
        self.process = self.start()

    def start(self) -> ServiceProcess:
        self.starts += 1
        process = ServiceProcess("partner", self.args, self.state / f"ready-{self.starts}.json",
                                 self.state / f"log-{self.starts}.txt", command="compute")
        process.wait_ready()
        return process

    def kill_and_restart_later(self, delay: float = 0.2) -> None:
        if self.restarter is not None:
            self.restarter.join(timeout=120)
        self.process.proc.send_signal(signal.SIGKILL)
        self.process.proc.wait()

        def restart() -> None:
            time.sleep(delay)
            self.process = self.start()

        self.restarter = threading.Thread(target=restart, daemon=True)
        self.restarter.start()

    def stop(self) -> None:
        if self.restarter is not None:
            self.restarter.join(timeout=120)
        self.process.stop()


@pytest.fixture(scope="module")
def uninterrupted(pki: Path, owner_file: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[OwnerOutcome, Weights]:
    """The default U-shaped run (audited), never interrupted (against a compute service in this process)."""
    table = load_party_table(owner_file, None, LABEL, labelled=True)
    _, outcome, trunk = owner_split_run(pki, tmp_path_factory.mktemp("clean"), ConfigurationSettings(
        configuration="u-shaped", audit=True), table)
    return outcome, trunk


@pytest.mark.parametrize("when", ["epoch-2", "epoch-1-and-after-training"])
def test_a_compute_party_killed_mid_run_is_resumed_to_the_bit_identical_model(
        pki, owner_file: Path, tmp_path: Path, uninterrupted: tuple[OwnerOutcome, Weights], when: str) -> None:
    """The default settings, U-shaped, against ``python -m partner compute`` killed with SIGKILL and restarted on
    the same port and state folder. ``epoch-2``: at the second step of epoch 2 (epoch 1 checkpointed, one step of
    epoch 2 applied and lost), the bank resumes both sides from epoch 1's end. ``epoch-1-and-after-training``:
    killed twice, at step 2 (resumed from the start) and as the bank restores the best epoch after training
    (resumed at that epoch's checkpoint). Every run ends with the model and test scores of an uninterrupted run
    and of the twin, bit for bit, and its leakage audit records each step once, as the uninterrupted run's does."""
    settings = ConfigurationSettings(configuration="u-shaped", audit=True)
    table = load_party_table(owner_file, None, LABEL, labelled=True)
    t = settings.training
    per_epoch = len(epoch_batches(owner_data(table, t).split.train, t.batch_size, t.seed, 0))
    clean, clean_trunk = uninterrupted
    best = clean.book.history[clean.book.best_epoch - 1]["step"]
    # Where to kill (a forward's step, or "restore"), and the step the restarted party resumes at.
    kills = {"epoch-2": [(per_epoch + 2, per_epoch)], "epoch-1-and-after-training": [(2, 0), ("restore", best)]}[when]
    compute = ComputeProcess(pki, tmp_path / "compute")
    pending = [at for at, _ in kills]

    class KillingPeer(LayerPeer):
        def forward(self, step: int, x: torch.Tensor) -> torch.Tensor:
            if pending and pending[0] == step:
                pending.pop(0)
                compute.kill_and_restart_later()
            return super().forward(step, x)

        def restore(self, step: int) -> None:
            if pending and pending[0] == "restore":
                pending.pop(0)
                compute.kill_and_restart_later()
            super().restore(step)

    try:
        with bank_client(pki) as client:
            peer = KillingPeer("compute", compute.url, client, "compute")  # the default retry deadline
            trainer = OwnerTrainer(settings, owner_data(table, t), peer)
            outcome = trainer.run()
            # The trunk the compute party ended with: the best epoch's checkpoint, the step it was restored to.
            trunk = read_checkpoint(tmp_path / "compute" / "layers" / "bank" / trainer.session_id, best).section("model")
            peer.end()
    finally:
        compute.stop()

    assert not pending and compute.starts == 1 + len(kills) and peer.retries >= len(kills)
    assert outcome.resumes == len(kills) and clean.resumes == 0
    for n, (_, resumed_at) in enumerate(kills, start=2):
        assert f"resumed at step {resumed_at}" in (tmp_path / "compute" / f"log-{n}.txt").read_text()
    assert outcome.steps == clean.steps > per_epoch + 2
    for key in ("train_loss", "val_roc_auc", "step"):
        assert [h[key] for h in outcome.book.history] == [h[key] for h in clean.book.history], key
    assert_same_weights(outcome.bottom.state_dict(), clean.bottom.state_dict(), "the bank's bottom")
    assert outcome.head is not None and clean.head is not None
    assert_same_weights(outcome.head.state_dict(), clean.head.state_dict(), "the bank's head")
    assert_same_weights(trunk, clean_trunk, "the trunk")
    assert np.array_equal(outcome.test_scores, clean.test_scores) and outcome.test == clean.test
    assert outcome.audit is not None and clean.audit is not None
    recorded, expected = outcome.audit.tensors()["gradients-compute"], clean.audit.tensors()["gradients-compute"]
    assert sorted(set(expected["step"].tolist())) == list(range(1, clean.steps + 1))
    assert recorded.keys() == expected.keys() and all(torch.equal(recorded[k], expected[k]) for k in expected)
    check_owner_against_twin(settings, table, outcome, trunk)


# --- horizontal refusals --------------------------------------------------------------------------------------

class CountingPeer(LayerPeer):
    """A branch whose training calls are counted: a refusal must come before the first."""

    calls = 0

    def forward(self, step: int, x: torch.Tensor) -> torch.Tensor:
        CountingPeer.calls += 1
        return super().forward(step, x)

    def backward(self, step: int, grad: torch.Tensor) -> torch.Tensor | None:
        CountingPeer.calls += 1
        return super().backward(step, grad)


def _relabelled(files: dict[str, Path], out: Path, how: str) -> Path:
    """The head office's labels file, with branch-2's rows not those the branch holds."""
    frame = pd.read_csv(files["bank"], dtype=str)
    mine = np.flatnonzero(frame[BRANCH_COLUMN] == "branch-2")
    if how == "reordered":  # the same customers, two of them swapped
        frame.iloc[[mine[0], mine[1]]] = frame.iloc[[mine[1], mine[0]]].to_numpy()
    elif how == "dropped":  # one customer missing
        frame = frame.drop(index=mine[len(mine) // 2])
    else:  # one of branch-1's customers said to bank with branch-2, at the end of its rows
        moved = np.flatnonzero(frame[BRANCH_COLUMN] == "branch-1")[0]
        frame.loc[moved, BRANCH_COLUMN] = "branch-2"
        frame = pd.concat([frame.drop(index=moved), frame.loc[[moved]]])
    path = out / "labels.csv"
    frame.to_csv(path, index=False)
    return path


@pytest.mark.parametrize("how", ["reordered", "dropped", "moved"])
def test_labels_that_do_not_match_a_branchs_rows_are_refused_naming_the_branch(
        pki, branch_files: dict[str, Path], tmp_path: Path, how: str) -> None:
    settings = tuned("relay")
    labels_file = _relabelled(branch_files, tmp_path, how)
    task, labels = horizontal_setup({**branch_files, "bank": labels_file}, settings)
    CountingPeer.calls = 0
    with branch_services(pki, tmp_path / "branches", _branches_of(branch_files)) as servers, bank_client(pki) as client:
        peers = {n: CountingPeer(n, s.url, client, "partner", retry_deadline=5) for n, s in servers.items()}
        with pytest.raises(PeerError) as info:
            HorizontalTrainer(settings, task, labels, peers).run()
        assert all(not s.app.state.host.sessions for s in servers.values())  # every session it started is ended
    message = str(info.value)
    assert "branch 'branch-2'" in message and "branch-1" not in message and "branch-3" not in message, message
    assert "labels" in message and "check both files" in message, message
    assert CountingPeer.calls == 0


def _without_column(path: Path, out: Path, column: str) -> Path:
    frame = pd.read_csv(path, dtype=str).drop(columns=[column])
    target = out / path.name
    out.mkdir(parents=True, exist_ok=True)
    frame.to_csv(target, index=False)
    schema = PartySchema.model_validate_json(sidecar_path(path).read_bytes())
    PartySchema(id_column=schema.id_column, numeric=tuple(c for c in schema.numeric if c != column),
                categorical=tuple(c for c in schema.categorical if c != column)).write(sidecar_path(target))
    return target


def test_branches_with_different_columns_are_refused_with_a_clear_data_error(
        pki, branch_files: dict[str, Path], tmp_path: Path) -> None:
    settings = tuned("splitfed")
    task, labels = horizontal_setup(branch_files, settings)
    files = {**_branches_of(branch_files), "branch-3": _without_column(branch_files["branch-3"], tmp_path / "b3", "pdays")}
    CountingPeer.calls = 0
    with branch_services(pki, tmp_path / "branches", files) as servers, bank_client(pki) as client:
        peers = {n: CountingPeer(n, s.url, client, "partner", retry_deadline=5) for n, s in servers.items()}
        with pytest.raises(DataError) as info:
            HorizontalTrainer(settings, task, labels, peers).run()
        assert all(not s.app.state.host.sessions for s in servers.values())
    message = str(info.value)
    assert "branch-3" in message and "pdays" in message and "one schema" in message, message
    assert CountingPeer.calls == 0


# --- the shared encoder and FedAvg ----------------------------------------------------------------------------

def test_the_merged_encoder_is_the_one_fitted_on_the_pooled_training_rows(pki, branch_files: dict[str, Path],
                                                                          tmp_path: Path) -> None:
    """Each branch sends count, sum and sum of squares per numeric column and its values per categorical one,
    over its training rows (``POST /layers/stats``); the bank's merge is the encoder fitted on every branch's
    training rows pooled: the same means and scales (to float64 rounding) and the very same category lists."""
    settings = tuned("splitfed")
    _, labels = horizontal_setup(branch_files, settings)
    with branch_services(pki, tmp_path / "branches", _branches_of(branch_files)) as servers, bank_client(pki) as client:
        replies = [LayerPeer(n, servers[n].url, client, "partner").stats(labels[n].split.train.tolist())
                   for n in sorted(servers)]
    merged = merge_encoder(replies)
    tables = {b: load_party_table(p) for b, p in _branches_of(branch_files).items()}
    pooled = pd.concat([tables[b].features.iloc[labels[b].split.train] for b in sorted(tables)])
    fitted = TabularEncoder(tables["branch-1"].schema).fit(pooled).to_dict()
    for key in ("schema_version", "policies", "numeric", "categorical", "categories"):
        assert merged[key] == fitted[key], key
    assert merged["means"].keys() == fitted["means"].keys() == merged["scales"].keys() == fitted["scales"].keys()
    for col in fitted["means"]:
        assert merged["means"][col] == pytest.approx(fitted["means"][col], rel=1e-9, abs=1e-9), col
        assert merged["scales"][col] == pytest.approx(fitted["scales"][col], rel=1e-9), col
    # The training rows, not every row: an encoder fitted on all of them is another encoder.
    everything = pd.concat([tables[b].features for b in sorted(tables)])
    assert TabularEncoder(tables["branch-1"].schema).fit(everything).means_ != merged["means"]
    # A branch that lists the same columns in another order holds the same schema.
    shuffled = replies[1].model_copy(update={"numeric": dict(reversed(replies[1].numeric.items())),
                                             "categorical": dict(reversed(replies[1].categorical.items()))})
    assert merge_encoder([replies[0], shuffled, replies[2]]) == merged


def test_fedavg_is_the_row_weighted_mean() -> None:
    g = torch.Generator().manual_seed(0)
    states = [{"w": torch.randn(5, 3, generator=g), "b": torch.randn(3, generator=g)} for _ in range(3)]
    rows = [100, 300, 600]
    average = fedavg(states, rows)
    for name in ("w", "b"):
        expected = sum(s[name].double() * n for s, n in zip(states, rows)) / sum(rows)
        assert average[name].dtype == torch.float32
        assert torch.allclose(average[name].double(), expected, rtol=1e-6, atol=1e-7), name
        assert not torch.allclose(average[name], sum(s[name] for s in states) / 3)  # not the unweighted mean
    halves = fedavg([{"w": torch.zeros(4)}, {"w": torch.ones(4)}], [1, 3])
    assert torch.equal(halves["w"], torch.full((4,), 0.75))
    same = fedavg([states[0]] * 3, rows)  # averaging identical copies changes nothing
    assert all(torch.equal(same[k], states[0][k]) for k in states[0])


def test_a_branch_step_is_one_round_trip_and_a_resent_one_is_applied_once(pki, branch_files: dict[str, Path],
                                                                          tmp_path: Path) -> None:
    """The gradient of step s-1 and the rows of step s share one message. Sent twice, it gets the same answer and
    updates the bottom once; a trunk refuses it (its next activations need its input gradient first)."""
    files = _branches_of(branch_files)
    name = sorted(files)[0]
    settings = ConfigurationSettings(configuration="relay")
    with branch_services(pki, tmp_path, {name: files[name]}) as servers, bank_client(pki) as client:
        server = servers[name]
        peer = LayerPeer(name, server.url, client, "partner")
        stats = peer.stats(list(range(200)))
        peer.start(bottom_start(settings, "combined", merge_encoder([stats])))
        rows1, rows2 = torch.arange(0, 16), torch.arange(16, 32)
        z1 = peer.step(1, None, rows1)
        assert _state(server, "combined")[1] == [0.0] * 4  # no gradient yet: nothing applied
        grad1 = torch.full_like(z1, 0.01)
        message = encode({"grad": grad1, "x": rows2}, session="combined", step=2)
        first, again = (_post(client, server, layers.STEP, "combined", message) for _ in range(2))
        assert first.status_code == again.status_code == 200
        assert torch.equal(decode(first.content, {"output": torch.float32}).get("output"),
                           decode(again.content, {"output": torch.float32}).get("output"))
        assert _state(server, "combined")[1] == [1.0] * 4, "a resent step applied its gradient twice"
        before = peer.round_trips
        peer.step(3, torch.zeros(16, settings.bottom.cut_width), torch.arange(32, 48))
        assert peer.round_trips - before == 1
        peer.end()
    with compute_service(pki, tmp_path / "compute") as compute, bank_client(pki) as client:
        LayerPeer("compute", compute.url, client, "compute").start(
            layers.LayerStart(session="t", kind="trunk", in_width=6, hidden=(5,), out_width=4, seed=3))
        refused = _post(client, compute, layers.STEP, "t", encode({"x": torch.arange(4)}, session="t", step=1))
        assert refused.status_code == 409 and "only a bottom" in refused.json()["detail"]


def test_a_relay_step_costs_one_round_trip_per_batch(pki, branch_files: dict[str, Path], tmp_path: Path) -> None:
    """A relay epoch costs each branch its batches plus a handful of calls (weights in and out, the last gradient,
    evaluation, a checkpoint), not two round trips per batch."""
    settings = ConfigurationSettings(configuration="relay", training=TrainingConfig(epochs=2, batch_size=8))
    trainer, outcome, _ = horizontal_split_run(pki, tmp_path, settings, branch_files)
    epochs = len(outcome.book.history)
    for name, peer in trainer.peers.items():
        steps = outcome.steps[name]
        assert steps >= 40, steps  # so that two round trips per batch could not fit under the bound below
        assert peer.round_trips <= steps + 8 * epochs + 8, (name, peer.round_trips, steps)


def test_the_configurations_report_shows_each_run_on_its_tasks_objective(tmp_path: Path) -> None:
    """A multiclass run is shown by its log-loss, a regression run by its MSE, a binary one by its ROC-AUC (the
    metric its best epoch was chosen on), in the table and the learning curves; not a blank ROC-AUC."""
    from bank.lab.report.config_report import configuration_curves, configuration_table

    runs = []
    for name, objective, test in (("binary", "roc_auc", {"roc_auc": 0.9, "accuracy": 0.8}),
                                  ("multiclass", "log_loss", {"accuracy": 0.6, "log_loss": 1.1}),
                                  ("regression", None, {"mse": 4.0, "r2": 0.3})):  # None: written before it was kept
        folder = tmp_path / name
        folder.mkdir()
        metrics = {"configuration": "u-shaped", "test": test, "best_epoch": 1, "epochs_run": 2,
                   "mean_epoch_seconds": 0.1, "communication": {}}
        if objective:
            metrics["objective"] = objective
        (folder / "metrics.json").write_text(json.dumps(metrics))
        pd.DataFrame({"epoch": [1, 2], "train_loss": [1.0, 0.9], **{f"val_{m}": [v, v] for m, v in test.items()}}
                     ).to_csv(folder / "history.csv", index=False)
        runs.append(folder)
    table = configuration_table(runs, tmp_path).set_index("run")
    assert table.loc["binary", "test_roc_auc"] == 0.9 and table.loc["multiclass", "test_log_loss"] == 1.1
    assert table.loc["regression", "test_mse"] == 4.0
    figure = configuration_curves(runs[1:2], tmp_path)
    assert figure.axes[1].get_title() == "validation log_loss"
