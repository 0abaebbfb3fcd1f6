"""The bank's state, without HTTP: its table, its partners, its jobs and its alignment."""

from __future__ import annotations

import logging
from typing import Any

from alignment.parallel import WorkerPool
from bank.alignment import align_with_partners
from bank.proxy import HttpPartner
from parties.client import client_for
from parties.dataset import AlignedRows, PartyTable
from parties.errors import ConfigError
from parties.jobs import Job, JobRunner, Progress
from parties.protocol import AlignmentInfo, AlignmentRequest
from parties.settings import BankSettings

__all__ = ["BankCore"]

logger = logging.getLogger(__name__)


class BankCore:
    def __init__(self, settings: BankSettings, table: PartyTable) -> None:
        self.settings, self.table = settings, table
        self.pool = WorkerPool(settings.workers)
        self.jobs = JobRunner()
        self.alignment: AlignedRows | None = None
        self.pairwise: dict[str, int] = {}

    def partners(self, names: list[str] | None) -> dict[str, str]:
        configured = self.settings.partners
        chosen = names if names is not None else list(configured)
        unknown = [n for n in chosen if n not in configured]
        if unknown:
            raise ConfigError(f"unknown partners {unknown}; configured: {sorted(configured)}")
        return {n: configured[n] for n in chosen}

    def align(self, request: AlignmentRequest, progress: Progress) -> AlignmentInfo:
        urls = self.partners(request.partners)
        minimum = request.min_intersection or self.settings.min_intersection
        with client_for(self.settings, timeout=self.settings.peer_timeout) as client:
            peers = {name: HttpPartner(name, url, client) for name, url in urls.items()}
            alignment, pairwise = align_with_partners(
                self.table,
                peers,
                self.pool,
                min_intersection=minimum,
                cache_dir=self.settings.cache_dir,
                progress=progress,
            )
        self.alignment, self.pairwise = alignment, pairwise
        return AlignmentInfo(alignment_id=alignment.alignment_id, rows=len(alignment), pairwise=pairwise)

    def start_alignment(self, request: AlignmentRequest) -> Job:
        self.partners(request.partners)  # refuse unknown names now, not in the job

        def work(progress: Progress) -> dict[str, Any]:
            return self.align(request, progress).model_dump()

        return self.jobs.submit("alignment", work)

    def close(self) -> None:
        self.pool.close()
