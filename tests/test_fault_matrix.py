"""The fault matrix: any party SIGKILLed at any point of the loop, restarted, and the model is bit-identical.

Every party is a real process: the partners are supervised services (restarted
on their state dir when they die); the bank's side runs in a process of its
own, SIGKILLs itself at its fault, and the session is then resumed (in the
test's process, as ``--resume`` does in the service). Each cell trains one
session with one fault and compares every party's final model, the losses and
the test metrics with an uninterrupted run's, under ``torch.equal``.

CI runs a share of the matrix (cells that failed before this module existed),
two seeded runs with three random kills each, and a full disk at a partner and
at the bank; ``CUTLAYER_LONG_TESTS=1`` runs every cell (each party x each point
x the default configuration and ``checkpoint_every`` 0, 1 and 50) and six
random runs.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytest

from alignment.parallel import WorkerPool
from bank.service.aligner import align_with_partners
from bank.config import TrainingConfig
from bank.vertical.http_partner import HttpPartner
from data.prepare import prepare_bank_marketing
from parties.errors import StorageError
from parties.storage.checkpoint import checkpoint_steps, read_checkpoint
from parties.tables.table import load_party_table, save_alignment
from parties.transport.client import make_client
from parties.transport.tls import PeerIdentity, TLSFiles
from tests.faults import POINTS, BankSpec, Fault, PartnerProcess, run_bank, spec_json
from tests.training_helpers import saved, state_equal
from parties.storage.layout import model_folder, training_folder

LONG = os.environ.get("CUTLAYER_LONG_TESTS") == "1"
PARTNERS = ("partner", "partner2")
CONFIGS = {
    "default": TrainingConfig(epochs=3, batch_size=64),  # checkpoints at epoch ends only (every 500 steps)
    "every0": TrainingConfig(epochs=3, batch_size=64, checkpoint_every=0),
    "every1": TrainingConfig(epochs=3, batch_size=64, checkpoint_every=1),
    "every50": TrainingConfig(epochs=3, batch_size=64, checkpoint_every=50),
}
FAULT_SCRIPT = Path(__file__).with_name("faults.py")


@dataclass
class Federation:
    pki: Path
    tmp: Path
    bank_data: Path
    partners: dict[str, PartnerProcess]
    clean: dict[str, dict[str, Any]]

    def spec(self, config: str, session: str, faults: list[Fault] = (), **extra: Any) -> BankSpec:
        return BankSpec(pki=str(self.pki), data=str(self.bank_data), state=str(self.tmp / "bank"),
                        partners={n: p.url for n, p in self.partners.items()},
                        pid_files={n: str(p.pid_file) for n, p in self.partners.items()},
                        config=CONFIGS[config].model_dump(mode="json"), session=session,
                        faults=[asdict(f) for f in faults], **extra)

    def settle(self) -> None:
        for p in self.partners.values():
            p.settle()

    def reference(self, config: str) -> dict[str, Any]:
        if config not in self.clean:
            self.settle()
            self.clean[config] = run_bank(self.spec(config, f"clean{config}"))
        return self.clean[config]

    def models(self, session: str) -> dict[str, Path]:
        bank = self.tmp / "bank" / session
        out = {"top": bank / "top.safetensors", "bank": bank / "model" / "bottom.safetensors"}
        return out | {n: model_folder(p.state, "bank", session) / "bottom.safetensors" for n, p in self.partners.items()}

    def run(self, config: str, session: str, faults: list[Fault]) -> dict[str, Any]:
        """Train ``session`` with ``faults`` (in the order they fire); each bank fault kills the bank's
        process, and the next process resumes the session."""
        remaining, resume = list(faults), False
        for n, fault in enumerate(f for f in faults if f.party == "bank"):
            self.settle()
            spec_file = self.tmp / f"{session}-{n}.json"
            spec_file.write_text(spec_json(self.spec(config, session, remaining, resume=resume)))
            done = subprocess.run([sys.executable, str(FAULT_SCRIPT), str(spec_file)], capture_output=True,
                                  text=True, timeout=600)
            assert done.returncode == -9, f"the bank was to be killed at {fault}:\n{done.stderr[-3000:]}"
            remaining, resume = remaining[remaining.index(fault) + 1 :], True
        self.settle()
        return run_bank(self.spec(config, session, remaining, resume=resume))

    def assert_identical(self, config: str, session: str, outcome: dict[str, Any]) -> None:
        clean = self.reference(config)
        for party, path in self.models(session).items():
            reference = self.models(f"clean{config}")[party]
            assert state_equal(saved(reference), saved(path)), f"{party}'s model differs"
        assert outcome["steps"] == clean["steps"]
        assert outcome["losses"] == clean["losses"]
        assert outcome["test"] == clean["test"]
        assert outcome["best_epoch"] == clean["best_epoch"]


@pytest.fixture(scope="module")
def fed(pki: Path, bank_full: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Federation]:
    tmp = tmp_path_factory.mktemp("faults")
    paths = prepare_bank_marketing(tmp / "data", n_partners=2, partner_names=PARTNERS, rows=1500,
                                   cache=bank_full.parent, download=False)
    partners: dict[str, PartnerProcess] = {}
    try:
        for seed, name in enumerate(PARTNERS, start=2):
            partners[name] = PartnerProcess(name, pki, paths[name], tmp / name, seed)
        table = load_party_table(paths["bank"], "customer_id", "y")
        tls = TLSFiles.from_dir(pki, "bank")
        with make_client(tls, caller=PeerIdentity("bank", "bank")) as client, WorkerPool(1) as pool:
            peers = {n: HttpPartner(n, p.url, client) for n, p in partners.items()}
            alignment, _ = align_with_partners(table, peers, pool)
        save_alignment(tmp / "bank", table, alignment)
        yield Federation(pki, tmp, paths["bank"], partners, {})
    finally:
        for p in partners.values():
            p.stop()


def _cells() -> list[Any]:
    """(config, party, point): every cell with CUTLAYER_LONG_TESTS=1, else the share CI runs."""
    share = {("default", "partner", "flush"), ("default", "bank", "validation"), ("every0", "bank", "flush"),
             ("default", "partner2", "validation"), ("every0", "partner2", "mark_best"),
             ("every50", "partner", "finish"), ("every1", "partner", "checkpoint_write")}
    cells = []
    for config in CONFIGS:
        for party in ("bank", *PARTNERS):
            for point in POINTS:
                if LONG or (config, party, point) in share:
                    cells.append(pytest.param(config, party, point, id=f"{config}-{party}-{point}"))
    return cells


@pytest.mark.parametrize(("config", "party", "point"), _cells())
def test_a_party_killed_at_any_point_resumes_to_the_bit_identical_model(
    fed: Federation, config: str, party: str, point: str
) -> None:
    fault = Fault(party, point, epoch=0 if point == "mark_best" else 1)  # epoch 0 is always the best so far
    session = f"{config}{party}{point}".replace("_", "")
    outcome = fed.run(config, session, [fault])
    if party != "bank":
        assert outcome["fired"] == [asdict(fault)], "the fault never fired"
        assert outcome["rollbacks"] >= 1
    fed.assert_identical(config, session, outcome)


@pytest.mark.parametrize("seed", [0, 1] + ([2, 3, 4, 5] if LONG else []))
def test_several_random_kills_in_one_run_still_give_the_bit_identical_model(fed: Federation, seed: int) -> None:
    """Three kills per run, of any party, before steps drawn from the run's steps."""
    rng = random.Random(seed)
    config = ("default", "every0", "every1", "every50")[seed % 4]
    total = fed.reference(config)["steps"]
    faults = [Fault(rng.choice(("bank", *PARTNERS)), "step", at=s) for s in sorted(rng.sample(range(1, total), 3))]
    session = f"random{seed}"
    outcome = fed.run(config, session, faults)
    fed.assert_identical(config, session, outcome)
    last_bank = max((i for i, f in enumerate(faults) if f.party == "bank"), default=-1)
    assert outcome["fired"] == [asdict(f) for f in faults[last_bank + 1 :]]  # the bank's own: it was killed


@pytest.fixture()
def small_disk(fed: Federation) -> Iterator[Callable[[Path], Path]]:
    """Mount a 1 MiB tmpfs at a folder (the test runs as root, or is skipped)."""
    mounted: list[Path] = []

    def mount(folder: Path) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode(errors='replace').strip()}")
        mounted.append(folder)
        return folder

    yield mount
    for folder in mounted:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def _fill(folder: Path) -> None:
    with (folder / "filler").open("wb", buffering=0) as f:  # unbuffered: nothing left to fail at close
        try:
            while f.write(b"\0" * 65536):
                pass
        except OSError:  # ENOSPC: the disk is full
            pass


@pytest.mark.skipif(shutil.which("mount") is None, reason="needs mount(8)")
@pytest.mark.parametrize("party", ["partner2", "bank"])
def test_a_full_disk_stops_training_at_once_and_a_resume_finishes_the_same_model(
    fed: Federation, small_disk: Callable[[Path], Path], party: str
) -> None:
    config, session, full_at = "every1", f"diskfull{party}", 20
    if party == "bank":
        disk = small_disk(fed.tmp / "bank" / session)  # the bank's run folder: its checkpoints and model
        folders = [disk / "coordinator", disk / "own"]
    else:
        disk = small_disk(training_folder(fed.partners[party].state, "bank", session))
        folders = [disk]
    fed.settle()
    spec = fed.spec(config, session, [Fault(party, "step", at=full_at)])
    with pytest.raises(StorageError) as info:
        run_bank(spec, fire=lambda _fault: _fill(disk))
    message = str(info.value)
    who = "the bank 'bank'" if party == "bank" else f"partner {party!r}"
    # The bank names its own folder; a partner's reaches the bank as <state>/...: no path of the partner's disk.
    where = str(disk) if party == "bank" else f"<state>/banks/bank/training/{session}"
    assert message.startswith(who) and where in message and "disk full" in message, message
    assert "Training stopped" in message
    coordinator = checkpoint_steps(fed.tmp / "bank" / session / "coordinator")
    assert coordinator[-1] <= full_at + 2, "training went on after the disk was full"
    for folder in folders:  # the whole checkpoints are still there, and readable
        steps = checkpoint_steps(folder)
        assert steps and all(read_checkpoint(folder, s).step == s for s in steps)

    (disk / "filler").unlink()  # space is back: the session resumes, to the same model
    fed.settle()
    outcome = run_bank(fed.spec(config, session, resume=True))
    fed.assert_identical(config, session, outcome)
