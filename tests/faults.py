"""Faults for the crash-recovery tests: every party a real process, SIGKILLed at named points of the loop.

A ``Fault`` names the party that dies and where: ``mid_epoch``, ``last_step``
(the last batch of an epoch), ``flush``, ``validation``, ``mark_best``,
``finish``, ``checkpoint_write`` (just after a checkpoint's snapshot, while it
is written), or ``step`` (before step ``at``: the seeded random kills). A
``Tripwire`` watches the bank's calls (through ``TrippedPartner``, a partner
proxy, and ``TrippedCoordinator``) and fires each fault once, just before the
call it names goes out. A partner is killed and restarted on its state dir;
the bank kills itself, and ``run_bank`` is run again with ``resume``.

``python tests/faults.py SPEC.json`` runs the bank's side in a process of its
own; ``run_bank`` is the same in the test's process.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import save_file

if __package__ in (None, ""):  # run as a script: the project's root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bank.config import TrainingConfig
from bank.vertical.http_partner import HttpPartner
from bank.vertical.in_process_party import InProcessParty
from bank.task import Task
from bank.vertical.coordinator import Coordinator
from parties.learning.model import BottomConfig
from parties.tables.table import load_alignment, load_party_table
from parties.transport.client import StepConnection, make_client
from parties.transport.process import ServiceProcess
from parties.transport.server import bind_socket
from parties.transport.tls import PeerIdentity, TLSFiles

Point = Literal["mid_epoch", "last_step", "flush", "validation", "mark_best", "finish", "checkpoint_write", "step"]
POINTS: tuple[Point, ...] = ("mid_epoch", "last_step", "flush", "validation", "mark_best", "finish",
                             "checkpoint_write")
BANK_BOTTOM = BottomConfig(cut_width=8, seed=1)


@dataclass(frozen=True)
class Fault:
    party: str
    point: Point
    epoch: int = 0  # the epoch it happens in (``finish``: ignored)
    at: int = 0  # ``step``: the step before which it happens


class Tripwire:
    """Fires each fault once, when the bank is about to make the call the fault names."""

    def __init__(self, faults: list[Fault], steps_per_epoch: int, fire: Callable[[Fault], None]) -> None:
        self.faults, self.per_epoch, self.fire = list(faults), steps_per_epoch + 1, fire
        self.step = -1  # the last step sent
        self.fired: list[Fault] = []
        self._lock = threading.Lock()

    def _due(self, fault: Fault, kind: str, step: int, checkpoint: bool) -> bool:
        epoch, offset = divmod(self.step, self.per_epoch)
        if fault.point == "finish":
            return kind == "finish"
        if fault.point == "step":
            return kind == "step" and step == fault.at
        if fault.point == "checkpoint_write":  # the bank's write, or a partner's, is in flight
            return kind == ("saved" if fault.party == "bank" else "answered") and checkpoint and step // self.per_epoch == fault.epoch
        if epoch != fault.epoch and kind in ("embed", "mark_best"):
            return False
        flushed = offset == self.per_epoch - 1
        if fault.point in ("validation", "mark_best"):
            return flushed and kind == {"validation": "embed", "mark_best": "mark_best"}[fault.point]
        if kind != "step":
            return False
        target = {"mid_epoch": (self.per_epoch - 1) // 2, "last_step": self.per_epoch - 2,
                  "flush": self.per_epoch - 1}[fault.point]
        return step == fault.epoch * self.per_epoch + target

    def event(self, kind: str, step: int = -1, checkpoint: bool = False) -> None:
        with self._lock:
            if kind == "step":
                self.step = max(self.step, step)
            due = [f for f in self.faults if self._due(f, kind, step, checkpoint)]
            for fault in due:
                self.faults.remove(fault)
                self.fired.append(fault)
        for fault in due:
            self.fire(fault)


class TrippedPartner(HttpPartner):
    """A partner proxy that tells a tripwire about each call before making it."""

    tripwire: Tripwire | None = None
    party_name: str = ""

    def _trip(self, kind: str, step: int = -1, checkpoint: bool = False) -> None:
        if self.tripwire is not None:
            self.tripwire.event(kind, step, checkpoint)

    def submit_step(self, step: int, grad: Any, rows: Any, checkpoint: bool = False,
                    keep_from: int | None = None) -> Callable[[], Any]:
        self._trip("step", step)
        finish = super().submit_step(step, grad, rows, checkpoint, keep_from)

        def result() -> Any:
            out = finish()
            if checkpoint and self.tripwire is not None:  # this partner now writes its checkpoint
                self.tripwire.event("answered", step, checkpoint)
            return out

        return result

    def embed(self, rows: torch.Tensor) -> torch.Tensor:
        self._trip("embed")
        return super().embed(rows)

    def mark_best(self) -> None:
        self._trip("mark_best")
        super().mark_best()

    def finish(self, restore_best: bool) -> Any:
        self._trip("finish")
        return super().finish(restore_best)


class TrippedCoordinator(Coordinator):
    tripwire: Tripwire | None = None

    def _save(self, loop: Any, optimizer: Any) -> None:
        super()._save(loop, optimizer)
        if self.tripwire is not None:  # the bank's write is now in flight
            self.tripwire.event("saved", loop.step - 1, True)


class PartnerProcess:
    """A partner as its own OS process, on a fixed port so that a restart answers at the same address.

    Supervised: when it dies, it is started again on its state dir (as systemd would), and its
    current process id is in ``<state>/pid`` for whoever kills it.
    """

    def __init__(self, name: str, pki: Path, data: Path, state: Path, seed: int, delay: float = 0.3) -> None:
        sock = bind_socket()
        self.port = sock.getsockname()[1]
        sock.close()
        self.name, self.state, self.starts, self.delay = name, state, 0, delay
        self.args = ["--name", name, "--data", str(data), "--tls-dir", str(pki), "--state-dir", str(state),
                     "--port", str(self.port), "--hidden", "16", "--cut-width", "8", "--seed", str(seed),
                     "--workers", "1"]
        self._stopping = threading.Event()
        self._up = threading.Event()
        self.process = self.start()
        self._watch = threading.Thread(target=self._supervise, daemon=True)
        self._watch.start()

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def pid_file(self) -> Path:
        return self.state / "pid"

    def start(self) -> ServiceProcess:
        self.starts += 1
        process = ServiceProcess("partner", self.args, self.state / "ready.json", self.state / f"log-{self.starts}.txt")
        process.wait_ready()
        self.pid_file.write_text(str(process.proc.pid))
        self._up.set()
        return process

    def _supervise(self) -> None:
        while not self._stopping.is_set():
            if self.process.proc.poll() is not None and not self._stopping.is_set():
                self._up.clear()
                time.sleep(self.delay)
                self.process = self.start()
            time.sleep(0.02)

    def settle(self, timeout: float = 120.0) -> None:
        """Wait until the partner is up (after a restart in progress)."""
        deadline = time.monotonic() + timeout
        while (self.process.proc.poll() is not None or not self._up.is_set()) and time.monotonic() < deadline:
            time.sleep(0.02)

    def stop(self) -> None:
        self._stopping.set()
        self._watch.join()
        self.process.stop()


def kill(pid: int) -> None:
    """SIGKILL ``pid`` and wait until it is dead (a zombie or gone), so that nothing more reaches it."""
    os.kill(pid, signal.SIGKILL)
    stat = Path(f"/proc/{pid}/stat")
    while True:
        try:
            if stat.read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                return
        except (FileNotFoundError, ProcessLookupError):
            return
        time.sleep(0.002)


@dataclass
class BankSpec:
    """Everything the bank's side of one run needs, as JSON for a process of its own."""

    pki: str
    data: str  # the bank's CSV
    state: str  # the bank's state dir: its alignment, and a folder per session
    partners: dict[str, str]  # name -> URL
    config: dict[str, Any]
    session: str
    pid_files: dict[str, str] = field(default_factory=dict)  # partner name -> its supervisor's pid file
    faults: list[dict[str, Any]] = field(default_factory=list)
    resume: bool = False
    retry_deadline: float = 60.0


def steps_per_epoch(coordinator: Coordinator) -> int:
    return -(-len(coordinator.split.train) // coordinator.config.batch_size)


def run_bank(spec: BankSpec, fire: Callable[[Fault], None] | None = None) -> dict[str, Any]:
    """One training run (or resume) at the bank; writes ``<state>/<session>/top.safetensors`` and
    ``outcome.json``, and returns the outcome. ``fire``: what a fault does (default: SIGKILL this process)."""
    state = Path(spec.state)
    table = load_party_table(Path(spec.data), "customer_id", "y")
    alignment = load_alignment(state, table)
    assert alignment is not None
    config = TrainingConfig.model_validate(spec.config)
    labels = table.labels.iloc[alignment.rows]
    task = Task().fit(labels)
    tls = TLSFiles.from_dir(Path(spec.pki), "bank")
    me = PeerIdentity("bank", "bank")
    folder = state / spec.session
    with make_client(tls, caller=me) as client:
        partners = []
        for name, url in spec.partners.items():
            proxy = TrippedPartner(name, url, client, retry_deadline=spec.retry_deadline,
                                   steps=StepConnection(url, tls, expect=PeerIdentity(name, "partner"), caller=me))
            proxy.party_name = name
            partners.append(proxy)
        own = InProcessParty("bank", table, lambda: alignment, BANK_BOTTOM,
                             model_dir=lambda s: folder / "model", checkpoint_dir=lambda s: folder / "own")
        coordinator = TrippedCoordinator(config, task, task.targets(labels), [own, *partners],
                                         alignment_id=alignment.alignment_id, session_id=spec.session,
                                         checkpoint_dir=folder / "coordinator")
        faults = [Fault(**f) for f in spec.faults]
        tripwire = None
        if faults:
            def sigkill(fault: Fault) -> None:
                kill(os.getpid() if fault.party == "bank" else int(Path(spec.pid_files[fault.party]).read_text()))

            tripwire = Tripwire(faults, steps_per_epoch(coordinator), fire or sigkill)
            coordinator.tripwire = tripwire
            partners[0].tripwire = tripwire
        outcome = coordinator.run(resume=spec.resume)
    assert coordinator.top is not None
    save_file({k: v.contiguous() for k, v in coordinator.top.state_dict().items()}, str(folder / "top.safetensors"))
    result = {"steps": outcome.steps, "test": outcome.test_metrics, "rollbacks": coordinator.rollbacks,
              "losses": [h["train_loss"] for h in outcome.history], "best_epoch": outcome.best_epoch,
              "retries": sum(p.retries for p in partners),
              "fired": [asdict(f) for f in tripwire.fired] if tripwire is not None else []}
    (folder / "outcome.json").write_text(json.dumps(result))
    return result


def spec_json(spec: BankSpec) -> str:
    return json.dumps(asdict(spec))


if __name__ == "__main__":
    run_bank(BankSpec(**json.loads(Path(sys.argv[1]).read_text())))
