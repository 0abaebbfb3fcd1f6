"""A partner killed with SIGKILL mid-training restarts from its checkpoints; the model is bit-identical."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from alignment.parallel import WorkerPool
from bank.alignment import align_with_partners
from bank.config import TrainingConfig
from bank.local import InProcessParty
from bank.proxy import HttpPartner
from bank.task import Task
from bank.trainer import Coordinator
from data.prepare import prepare_bank_marketing
from parties.client import make_channel, make_client
from parties.dataset import load_party_table
from parties.model import BottomConfig
from parties.process import ServiceProcess
from parties.server import bind_socket
from parties.tls import PeerIdentity, TLSFiles
from tests.training_helpers import saved, state_equal

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


def test_a_partner_killed_mid_training_resumes_to_the_bit_identical_model(pki, bank_full: Path, tmp_path: Path) -> None:
    paths = prepare_bank_marketing(tmp_path / "data", rows=1500, cache=bank_full.parent, download=False)
    partner = PartnerProcess(pki, paths["partner"], tmp_path / "partner")
    table = load_party_table(paths["bank"], "customer_id", "y")
    tls = TLSFiles.from_dir(pki, "bank")
    me, them = PeerIdentity("bank", "bank"), PeerIdentity("partner", "partner")
    url = f"https://127.0.0.1:{partner.port}"
    config = TrainingConfig(epochs=3, batch_size=64, checkpoint_every=5, restore_best=False)
    try:
        with make_client(tls, caller=me) as client, WorkerPool(1) as pool:
            def proxy(cls: type[HttpPartner] = HttpPartner) -> HttpPartner:
                return cls("partner", url, client, channel=make_channel(tls, url, expect=them, caller=me), retry_deadline=60)

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
                 (tmp_path / "partner" / "models" / "clean", tmp_path / "partner" / "models" / "killed")):
        assert state_equal(saved(a / "bottom.safetensors"), saved(b / "bottom.safetensors"))
    assert outcome.test_metrics == clean.test_metrics
    assert [h["train_loss"] for h in outcome.history] == [h["train_loss"] for h in clean.history]
