"""Shared set-up for the training tests: aligned bank and partner services on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import torch
from safetensors.torch import load_file

from alignment.parallel import WorkerPool
from bank.service.aligner import align_with_partners
from bank.config import TrainingConfig
from bank.vertical.http_partner import HttpPartner
from bank.vertical.in_process_party import InProcessParty
from bank.lab.references.unsplit import UnsplitModel
from bank.task import Task
from bank.vertical.coordinator import Coordinator
from parties.learning.model import BottomConfig
from parties.learning.training_session import PartySession
from parties.tables.table import AlignedRows, PartyTable, load_party_table
from parties.transport.client import StepConnection, make_client
from parties.transport.process import ServiceProcess
from parties.transport.server import ServerThread
from parties.transport.tls import PeerIdentity, TLSFiles


@dataclass
class Federation:
    bank: PartyTable
    alignment: AlignedRows
    partners: dict[str, ServerThread]
    tables: dict[str, PartyTable]
    client: httpx.Client
    tmp: Path
    tls: TLSFiles

    def partner_core(self, name: str):
        return self.partners[name].app.state.core

    step_connection: Callable[..., StepConnection] | None = None  # e.g. one that injects faults
    steps_over_httpx: bool = False  # the proxy's other client stack: steps too go through the httpx client

    def proxies(self) -> list[HttpPartner]:
        """Partner proxies as the bank builds them: control calls over httpx, steps on a step connection."""
        factory = self.step_connection or StepConnection
        me = PeerIdentity("bank", "bank")
        out = []
        for name, server in self.partners.items():
            steps = None if self.steps_over_httpx else factory(
                server.url, self.tls, expect=PeerIdentity(name, "partner"), caller=me)
            out.append(HttpPartner(name, server.url, self.client, steps=steps, retry_deadline=20))
        return out

    def coordinator(self, config: TrainingConfig, bank_bottom: BottomConfig | None = None) -> Coordinator:
        labels = self.bank.labels.iloc[self.alignment.rows]
        task = Task(config.task).fit(labels)
        own = InProcessParty(
            "bank", self.bank, lambda: self.alignment, bank_bottom or config.bank_bottom,
            model_dir=lambda s: self.tmp / "bank-models" / s,
        )
        return Coordinator(config, task, task.targets(labels), [own, *self.proxies()], alignment_id=self.alignment.alignment_id)

    def partner_alignment(self, name: str) -> AlignedRows:
        return self.partner_core(name).alignment_of("bank")

    def unsplit(self, config: TrainingConfig, coordinator: Coordinator, bottoms: dict[str, BottomConfig]) -> UnsplitModel:
        """The same model in one process: every party's features, encoded exactly as each party does."""
        train = torch.from_numpy(coordinator.split.train.astype(np.int64))
        features, layouts = {}, {}
        for name in ["bank", *self.partners]:
            table, alignment = (self.bank, self.alignment) if name == "bank" else (self.tables[name], self.partner_alignment(name))
            rows = PartySession("ref", table, alignment, train, bottoms[name]).trainer.x
            features[name], layouts[name] = rows.all().numpy(), rows.layout
        return UnsplitModel(features, bottoms, config.top, config.aggregation, coordinator.task, layouts)


def state_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def saved(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


@contextmanager
def federation(
    pki: Path,
    paths: dict[str, Path],
    start_partner: Callable[..., ServerThread],
    tmp: Path,
    bottoms: dict[str, BottomConfig],
) -> Iterator[Federation]:
    bank = load_party_table(paths["bank"], "customer_id", "y")
    servers = {n: start_partner(paths[n], name=n, bottom=bottoms[n]) for n in paths if n != "bank"}
    tables = {n: load_party_table(paths[n], "customer_id") for n in servers}
    client = make_client(TLSFiles.from_dir(pki, "bank"), caller=PeerIdentity("bank", "bank"))
    with client, WorkerPool(1) as pool:
        peers = {n: HttpPartner(n, s.url, client) for n, s in servers.items()}
        alignment, _ = align_with_partners(bank, peers, pool)
        yield Federation(bank, alignment, servers, tables, client, tmp, TLSFiles.from_dir(pki, "bank"))


class PartnerProcess:
    """``python -m partner serve ...``: the command line, in its own process, with ``flags`` after the usual ones."""

    def __init__(self, pki: Path, data: Path, state: Path, bottom: BottomConfig, *flags: str) -> None:
        args = ["--name", "partner", "--data", str(data), "--tls-dir", str(pki), "--state-dir", str(state),
                "--hidden", ",".join(map(str, bottom.hidden)), "--cut-width", str(bottom.cut_width),
                "--seed", str(bottom.seed), "--workers", "1", *flags]
        self.log = state / "log.txt"
        self.process = ServiceProcess("partner", args, state / "ready.json", self.log)
        self.url = self.process.wait_ready()
