"""A partner killed with SIGKILL mid-training restarts from its checkpoints; the model is bit-identical."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from alignment.parallel import WorkerPool
from bank.service.aligner import align_with_partners
from bank.config import TrainingConfig
from bank.vertical.http_partner import HttpPartner
from bank.vertical.in_process_party import InProcessParty
from bank.service.operator import BankOperator
from bank.task import Task
from bank.vertical.coordinator import Coordinator
from data.prepare import prepare_bank_marketing
from parties.errors import PeerUnavailable
from parties.learning.model import BottomConfig
from parties.storage.checkpoint import checkpoint_steps, read_checkpoint
from parties.tables.table import load_party_table
from parties.transport.client import StepConnection, make_client
from parties.transport.process import ServiceProcess
from parties.transport.server import bind_socket
from parties.transport.tls import PeerIdentity, TLSFiles
from tests.training_helpers import saved, state_equal
from parties.storage.layout import model_folder

BANK_BOTTOM = BottomConfig(cut_width=8, seed=1)
KILL_AT_STEP = 12  # checkpoints land after steps 4 and 9 (every 5) and at each epoch's flush


class PartnerProcess:
    """The partner as its own OS process, on a fixed port so that a restart answers at the same address."""

    def __init__(self, pki: Path, data: Path, state: Path) -> None:
        sock = bind_socket()
        self.port = sock.getsockname()[1]
        sock.close()
        self.args = ["--name", "partner", "--data", str(data), "--tls-dir", str(pki), "--state-dir", str(state),
                     "--port", str(self.port), "--hidden", "16", "--cut-width", "8", "--seed", "2", "--workers", "1"]
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


def _coordinator(table, alignment, partner: HttpPartner, config: TrainingConfig, folder: Path, session: str) -> Coordinator:
    labels = table.labels.iloc[alignment.rows]
    task = Task().fit(labels)
    own = InProcessParty("bank", table, lambda: alignment, BANK_BOTTOM,
                         model_dir=lambda s: folder / s / "model", checkpoint_dir=lambda s: folder / s / "own")
    return Coordinator(config, task, task.targets(labels), [own, partner], alignment_id=alignment.alignment_id,
                       session_id=session, checkpoint_dir=folder / session / "coordinator")


@pytest.mark.parametrize(("precision", "local_steps", "reuse_steps"), [
    ("fp32", 1, 0), ("int8", 1, 0),  # int8: every step message names its precision
    ("fp32", 3, 2),  # local steps: three batches a round trip, two more updates from the cache every party keeps
], ids=["fp32", "int8", "local-steps"])
def test_a_partner_killed_mid_training_resumes_to_the_bit_identical_model(
        pki, bank_full: Path, tmp_path: Path, precision: str, local_steps: int, reuse_steps: int) -> None:
    paths = prepare_bank_marketing(tmp_path / "data", rows=1500, cache=bank_full.parent, download=False)
    partner = PartnerProcess(pki, paths["partner"], tmp_path / "partner")
    table = load_party_table(paths["bank"], "customer_id", "y")
    tls = TLSFiles.from_dir(pki, "bank")
    me, them = PeerIdentity("bank", "bank"), PeerIdentity("partner", "partner")
    url = f"https://127.0.0.1:{partner.port}"
    config = TrainingConfig(epochs=3 * local_steps, batch_size=64, checkpoint_every=5, restore_best=False,
                            wire_precision=precision, local_steps=local_steps, reuse_steps=reuse_steps, audit=True)
    try:
        with make_client(tls, caller=me) as client, WorkerPool(1) as pool:
            def proxy(cls: type[HttpPartner] = HttpPartner) -> HttpPartner:
                return cls("partner", url, client, steps=StepConnection(url, tls, expect=them, caller=me), retry_deadline=60)

            alignment, _ = align_with_partners(table, {"partner": proxy()}, pool)
            clean = _coordinator(table, alignment, proxy(), config, tmp_path / "bank", "clean").run()

            class KillingPartner(HttpPartner):
                killed = False

                def submit_step(self, step: int, *args: object, **kwargs: object) -> Callable[[], torch.Tensor | None]:
                    if step == KILL_AT_STEP and not self.killed:
                        KillingPartner.killed = True
                        partner.kill_and_restart_later()
                    return super().submit_step(step, *args, **kwargs)  # type: ignore[arg-type]

            killed = proxy(KillingPartner)
            coordinator = _coordinator(table, alignment, killed, config, tmp_path / "bank", "killed")
            outcome = coordinator.run()
    finally:
        partner.process.stop()

    assert KillingPartner.killed and partner.starts == 2
    assert coordinator.rollbacks == 1 and killed.retries >= 1
    assert outcome.steps == clean.steps
    for a, b in ((tmp_path / "bank" / "clean" / "model", tmp_path / "bank" / "killed" / "model"),
                 (model_folder(tmp_path / "partner", "bank", "clean"), model_folder(tmp_path / "partner", "bank", "killed"))):
        assert state_equal(saved(a / "bottom.safetensors"), saved(b / "bottom.safetensors"))
    assert outcome.test_metrics == clean.test_metrics
    assert [h["train_loss"] for h in outcome.history] == [h["train_loss"] for h in clean.history]
    # The audit holds each step once: the rolled-back steps were dropped and recorded again as replayed.
    recorded, expected = outcome.audit.tensors()["gradients-partner"], clean.audit.tensors()["gradients-partner"]
    assert recorded.keys() == expected.keys() and all(torch.equal(recorded[k], expected[k]) for k in expected)


def test_a_partner_down_past_the_deadline_stops_training_with_a_clear_message(pki, bank_full: Path, tmp_path: Path) -> None:
    paths = prepare_bank_marketing(tmp_path / "data", rows=1200, cache=bank_full.parent, download=False)
    partner = PartnerProcess(pki, paths["partner"], tmp_path / "partner")
    table = load_party_table(paths["bank"], "customer_id", "y")
    tls = TLSFiles.from_dir(pki, "bank")
    me, them = PeerIdentity("bank", "bank"), PeerIdentity("partner", "partner")
    url = f"https://127.0.0.1:{partner.port}"
    try:
        with make_client(tls, caller=me) as client, WorkerPool(1) as pool:
            alignment, _ = align_with_partners(table, {"partner": HttpPartner("partner", url, client)}, pool)

            class DyingPartner(HttpPartner):
                def submit_step(self, step: int, *args: object, **kwargs: object) -> Callable[[], torch.Tensor | None]:
                    if step == 8 and partner.process.proc.poll() is None:
                        partner.process.proc.send_signal(signal.SIGKILL)  # and nobody restarts it
                        partner.process.proc.wait()
                    return super().submit_step(step, *args, **kwargs)  # type: ignore[arg-type]

            dying = DyingPartner("partner", url, client, steps=StepConnection(url, tls, expect=them, caller=me),
                                 retry_deadline=1.5)
            config = TrainingConfig(epochs=2, batch_size=64, checkpoint_every=5)
            coordinator = _coordinator(table, alignment, dying, config, tmp_path / "bank", "s")
            with pytest.raises(PeerUnavailable) as info:
                coordinator.run()
    finally:
        partner.process.stop()
    message = str(info.value)
    assert "partner 'partner'" in message and "did not answer" in message
    assert "the bank has checkpointed step 4 (session s)" in message


def test_a_kill_during_a_save_leaves_only_whole_checkpoints(tmp_path: Path) -> None:
    script = (
        "import sys, torch\n"
        "from parties.storage.checkpoint import CheckpointWriter\n"
        "big = {'w': torch.randn(4_000_000)}\n"
        "writer = CheckpointWriter(keep=3)\n"  # what training uses: writes on a background thread
        "for step in range(10_000):\n"
        "    writer.submit(sys.argv[1], step, big, {'step': step})\n"
    )
    folder = tmp_path / "checkpoints"
    writer = subprocess.Popen([sys.executable, "-c", script, str(folder)])
    deadline = time.monotonic() + 60
    while len(checkpoint_steps(folder)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.137)  # somewhere in the middle of another save
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    steps = checkpoint_steps(folder)
    assert len(steps) >= 2
    for step in steps:  # every checkpoint that exists is whole and readable
        checkpoint = read_checkpoint(folder, step)
        assert checkpoint.meta == {"step": step} and checkpoint.tensors["w"].numel() == 4_000_000


@pytest.mark.parametrize("every", [5, TrainingConfig().checkpoint_every], ids=["every5", "default"])
def test_the_bank_killed_mid_training_resumes_to_the_bit_identical_model(
    pki, bank_full: Path, tmp_path: Path, every: int
) -> None:
    paths = prepare_bank_marketing(tmp_path / "data", rows=3000, cache=bank_full.parent, download=False)
    partner = PartnerProcess(pki, paths["partner"], tmp_path / "partner")
    state = tmp_path / "bank"
    bank_args = ["--name", "bank", "--data", str(paths["bank"]), "--label", "y", "--tls-dir", str(pki),
                 "--state-dir", str(state), f"--partner=partner=https://127.0.0.1:{partner.port}", "--workers", "1"]

    def start_bank(n: int) -> ServiceProcess:
        process = ServiceProcess("bank", bank_args, state / "ready.json", state / f"log-{n}.txt")
        process.wait_ready()
        return process

    tls = TLSFiles.from_dir(pki, "bank")
    # The default checkpoints at epoch ends only: the resume starts at a flush, then validates and marks the best.
    config = TrainingConfig(epochs=8, batch_size=64, checkpoint_every=every, patience=50, restore_best=False)
    bank = start_bank(1)
    try:
        with BankOperator(bank.url, tls) as op:
            op.wait(op.start_alignment())
            clean = op.wait(op.start_training(config))
            op.start_training(config)
            runs = state / "runs"
            deadline = time.monotonic() + 120

            def checkpointed_past_40() -> str | None:
                for folder in runs.iterdir():
                    steps = checkpoint_steps(folder / "checkpoints" / "coordinator")
                    if folder.name != clean["session"] and steps and steps[-1] >= 40:
                        return folder.name
                return None

            while (session := checkpointed_past_40()) is None and time.monotonic() < deadline:
                time.sleep(0.005)
            bank.proc.send_signal(signal.SIGKILL)
            bank.proc.wait()
        assert not (runs / session / "metrics.json").exists()  # it really died mid-training
        bank = start_bank(2)
        with BankOperator(bank.url, tls) as op:
            resumed = op.wait(op.resume_training(session))
    finally:
        bank.stop()
        partner.process.stop()

    assert resumed["session"] == session and resumed["steps"] == clean["steps"]
    assert resumed["timings"]["rollbacks"] == 1
    for a, b in ((runs / clean["session"] / "model", runs / session / "model"),
                 (model_folder(tmp_path / "partner", "bank", clean["session"]), model_folder(tmp_path / "partner", "bank", session))):
        for name in ("top.safetensors", "bank/bottom.safetensors") if "runs" in str(a) else ("bottom.safetensors",):
            assert state_equal(saved(a / name), saved(b / name)), name
    assert resumed["test"] == clean["test"]
