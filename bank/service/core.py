"""The bank's state, without HTTP: its table, its partners, its jobs and its alignment."""

from __future__ import annotations

import json
import logging
import shutil
import threading
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from alignment.exposure import Exposure
from alignment.parallel import make_pool
from alignment.partnership import Partnership
from bank.config import TrainingConfig
from bank.scoring.manifest import read_manifest
from bank.scoring.scorer import score_customers
from bank.scoring.subsets import train_subset_models
from bank.service.aligner import ABOVE_EXPECTED, CEILINGS, align_with_partners, overlap_ceiling, overlap_warnings
from bank.service.probe import PartnerProbes
from bank.service.runs import run_detail, run_file, run_summary, session_folder
from bank.settings import BankSettings
from bank.task import Task
from bank.vertical.coordinator import Coordinator
from bank.vertical.http_partner import HttpPartner
from bank.vertical.in_process_party import InProcessParty
from bank.vertical.results import communication_stats, write_run
from parties.errors import (
    BadMessage,
    ConfigError,
    DataError,
    NotAligned,
    OutOfOrder,
    UnknownSession,
)
from parties.learning.trained_bottom import ScoringBottom
from parties.protocol.control import (
    AlignmentInfo,
    AlignmentRequest,
    PartnerList,
    RunDetail,
    RunList,
    SessionList,
    SessionSummary,
)
from parties.storage.files import atomic_write_bytes, atomic_write_text
from parties.tables.drift import judge_drift
from parties.tables.table import AlignedRows, PartyTable, load_alignment, load_party_table, save_alignment
from parties.transport.client import StepConnection, client_for
from parties.transport.jobs import Job, JobRunner, Progress
from parties.transport.tls import PeerIdentity

__all__ = ["BankCore"]

logger = logging.getLogger(__name__)

ENDED = "ended"  # in a run folder: the operator ended the session; it never resumes


class BankCore:
    def __init__(self, settings: BankSettings, table: PartyTable) -> None:
        self.settings, self.table = settings, table
        self.pool = make_pool(settings.workers, settings.ray_address)
        self.jobs = JobRunner()
        self.alignment: AlignedRows | None = load_alignment(settings.state_path, table)
        self.partnership = Partnership.at(settings.state_path / "psi-sessions.log", settings.psi_limits, len(table))
        self.exposure = Exposure(settings.state_path / "exposure")
        self.exposure.verify_against(self.partnership.records())
        ceilings = settings.state_path / CEILINGS
        self.ceilings: dict[str, float] = json.loads(ceilings.read_text()) if ceilings.exists() else {}
        self.pairwise: dict[str, int] = {}
        self._running: set[str] = set()  # training sessions this process is running
        self.probes = PartnerProbes(settings)
        self._lock = threading.Lock()

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
        ceiling = {name: overlap_ceiling(request.max_overlap, request.expect_overlap,
                                         self.ceilings.get(name, self.settings.max_overlap)) for name in urls}
        with client_for(self.settings, timeout=self.settings.peer_timeout) as client:
            peers = {name: HttpPartner(name, url, client) for name, url in urls.items()}
            alignment, pairwise = align_with_partners(
                self.table,
                peers,
                self.pool,
                min_intersection=minimum,
                order_seed=request.order_seed,
                cache_dir=self.settings.cache_dir,
                progress=progress,
                bank_name=self.settings.name,
                mode=request.mode,
                partnership=self.partnership,
                exposure=self.exposure,
                max_overlap=ceiling,
            )
        self.alignment, self.pairwise = alignment, pairwise
        save_alignment(self.settings.state_path, self.table, alignment)
        # What a partner matched sets what it may match from then on (scoring, the next alignment): its share +
        # ABOVE_EXPECTED, within what was allowed, unless the operator says otherwise next time.
        customers = len(self.table)
        for name, count in pairwise.items():
            self.ceilings[name] = min(ceiling[name], count / customers + ABOVE_EXPECTED) if customers else ceiling[name]
        atomic_write_text(self.settings.state_path / CEILINGS, json.dumps(self.ceilings, indent=2))
        shares = {name: count / customers for name, count in pairwise.items()}
        warnings = overlap_warnings(shares, customers, request.expect_overlap, self.table.id_type)
        for warning in warnings:
            logger.warning("alignment %s: %s", alignment.alignment_id, warning)
        return AlignmentInfo(alignment_id=alignment.alignment_id, rows=len(alignment), pairwise=pairwise,
                             bank_customers=customers, shares=shares, warnings=warnings)

    def start_alignment(self, request: AlignmentRequest) -> Job:
        self.partners(request.partners)  # refuse unknown names now, not in the job

        def work(progress: Progress) -> dict[str, Any]:
            return self.align(request, progress).model_dump(exclude_none=True)

        return self.jobs.submit("alignment", work)

    def train(self, config: TrainingConfig, progress: Progress, resume: str | None = None) -> dict[str, Any]:
        """Train across the bank and its partners on the current alignment; write the run folder.

        ``resume``: continue that session from the latest step every party has checkpointed
        (after the bank stopped), with the configuration it started with.
        """
        alignment = self.alignment
        if alignment is None:
            raise NotAligned("no alignment yet: align the customers first (POST /alignments)")
        runs = self.settings.state_path / "runs"
        if resume is not None:
            config = self._resumable(runs, resume, alignment)
        assert self.table.labels is not None
        labels = self.table.labels.iloc[alignment.rows]
        task = Task(config.task or self.table.task, config.positive_label).fit(labels)
        targets = task.targets(labels)
        urls = self.partners(config.partners)
        session_id = resume or uuid.uuid4().hex
        with self._lock:
            if session_id in self._running:
                raise OutOfOrder(f"training session {session_id} is running")
            self._running.add(session_id)
        try:
            return self._train(config, task, targets, urls, session_id, resume, progress)
        finally:
            with self._lock:
                self._running.discard(session_id)

    def _train(self, config: TrainingConfig, task: Task, targets: Any, urls: dict[str, str], session_id: str,
               resume: str | None, progress: Progress) -> dict[str, Any]:
        alignment = self.alignment
        assert alignment is not None
        runs = self.settings.state_path / "runs"
        with client_for(self.settings, timeout=self.settings.peer_timeout) as client, ExitStack() as proxies:
            partners = [proxies.enter_context(p) for p in self._proxies(client, list(urls)).values()]
            for partner in partners:  # a partner restarting: the operator sees the retries, not a frozen bar
                partner.on_retry = lambda message: progress(message, None, event=True)
            self._release_abandoned(partners)
            own = InProcessParty(
                self.settings.name, self.table, lambda: alignment, config.bank_bottom,
                model_dir=lambda session: runs / session / "model" / "bank",
                checkpoint_dir=lambda session: runs / session / "checkpoints" / "bank-bottom",
            )
            coordinator = Coordinator(
                config, task, targets, [own, *partners], alignment_id=alignment.alignment_id,
                session_id=session_id, progress=progress,
                checkpoint_dir=runs / session_id / "checkpoints" / "coordinator",
            )
            config = coordinator.config  # with what adapts to the table set: a resume needs nothing else
            if resume is None:
                atomic_write_text(runs / session_id / "training.json", json.dumps(
                    {"alignment_id": alignment.alignment_id, "config": config.model_dump(mode="json")}, indent=2))
            for setting, value in coordinator.chosen.items():
                progress(f"{setting}: {value}", 0.0)
            progress("resuming" if resume else "starting the parties' sessions", 0.0)
            outcome = coordinator.run(resume=resume is not None)
        communication = {p.name: communication_stats(p, coordinator, outcome) for p in partners}
        files = {p.name: f.files for p, f in zip([own, *partners], coordinator.files)}
        subsets = train_subset_models(
            table=self.table, aligned=alignment.rows, task=task, targets=targets, split=outcome.split, config=config,
            names=[own.name, *(p.name for p in partners)], joint_test_scores=outcome.test_scores,
            embeddings=coordinator.embeddings, progress=lambda msg: progress(f"finishing: {msg}", None),
        )
        run_dir = runs / outcome.session_id
        assert coordinator.top is not None
        metrics = write_run(
            run_dir, config=config, task=task, outcome=outcome, top=coordinator.top, targets=targets,
            communication=communication, party_files=files, alignment_id=alignment.alignment_id,
            bank_rows=alignment.rows, subsets=subsets, chosen=coordinator.chosen, bank_ids=self.table.ids,
            id_column=self.table.id_column,
            protective_noise=coordinator.secret.describe() if config.protects else None,
        )
        # What a file of customers to score holds: the bank's own file is one (it scores every customer).
        scoring = {"data": str(Path(self.settings.data).resolve()),
                   "columns": [self.table.id_column, *self.table.schema.columns]}
        result = {"run_dir": str(run_dir), **metrics, "scoring": scoring, "positive_label": task.positive_label}
        if self.settings.tracks_runs:
            from bank.tracking import track

            progress("finishing: logging the run to MLflow", None)
            result["mlflow"] = track(run_dir, self.settings)
        return result

    def _release_abandoned(self, partners: list[HttpPartner]) -> None:
        """Unload, at each partner, this bank's sessions that no job of this process runs: what a crash
        left. They stay resumable from their checkpoints, and their slots are free for this training."""
        for partner in partners:
            for s in partner.sessions().sessions:
                with self._lock:
                    running = s.session in self._running
                if s.kind == "training" and not running:
                    logger.info("session %s at %s: no job runs it; unloading it there", s.session, partner.name)
                    partner.end_session(s.session, finished=False)

    # --- sessions, for the bank's operator ----------------------------------------------------

    def _session_state(self, folder: Path) -> str:
        if folder.name in self._running:
            return "running"
        if (folder / ENDED).exists():
            return "ended"
        if (folder / "metrics.json").exists():
            return "finished"
        return "stopped"

    def runs(self) -> RunList:
        """Every training session's run folder, newest first, with a finished one's test metrics."""
        runs = self.settings.state_path / "runs"
        folders = sorted(runs.glob("*/training.json"), key=lambda p: p.stat().st_mtime) if runs.is_dir() else []
        with self._lock:
            states = {f.parent: self._session_state(f.parent) for f in folders}
        return RunList(runs=[run_summary(folder, state) for folder, state in reversed(states.items())])

    def run(self, session_id: str) -> RunDetail:
        folder = session_folder(self.settings.state_path / "runs", session_id)
        with self._lock:
            state = self._session_state(folder)
        return run_detail(folder, state)

    def run_file(self, session_id: str, name: str) -> tuple[Path, str]:
        return run_file(session_folder(self.settings.state_path / "runs", session_id), name)

    def partner_status(self) -> PartnerList:
        return self.probes.status()

    def sessions(self) -> SessionList:
        """Every training session this bank started: running, stopped (resumable), finished or ended."""
        runs = self.settings.state_path / "runs"
        folders = sorted(runs.glob("*/training.json"), key=lambda p: p.stat().st_mtime) if runs.is_dir() else []
        with self._lock:
            return SessionList(sessions=[
                SessionSummary(kind="training", session=f.parent.name, owner=self.settings.name,
                               state=self._session_state(f.parent))
                for f in folders
            ])

    def end_session(self, session_id: str) -> None:
        """End a stopped session for good, here and at every partner: it can no longer be resumed."""
        runs = self.settings.state_path / "runs"
        if not session_id.isalnum() or not (runs / session_id / "training.json").exists():
            raise UnknownSession(f"no training session {session_id}")
        with self._lock:
            if session_id in self._running:
                raise OutOfOrder(f"training session {session_id} is running; it ends with its job")
        started = json.loads((runs / session_id / "training.json").read_text())
        names = TrainingConfig.model_validate(started["config"]).partners
        with client_for(self.settings, timeout=self.settings.peer_timeout) as client:
            for name, partner in self._proxies(client, list(self.partners(names))).items():
                try:
                    partner.end_session(session_id, finished=True)
                except UnknownSession:
                    pass
        atomic_write_text(runs / session_id / ENDED, "")
        logger.info("training session %s ended by the operator", session_id)

    def _resumable(self, runs: Path, session_id: str, alignment: AlignedRows) -> TrainingConfig:
        if not session_id.isalnum():
            raise BadMessage("a session id is letters and digits")
        state = self._session_state(runs / session_id)
        if state in ("ended", "finished", "running"):
            raise OutOfOrder(f"training session {session_id} is {state}; only a stopped session resumes")
        try:
            started = json.loads((runs / session_id / "training.json").read_text())
        except FileNotFoundError as exc:
            raise UnknownSession(f"no training session {session_id} to resume") from exc
        if started["alignment_id"] != alignment.alignment_id:
            raise OutOfOrder(f"session {session_id} trained on alignment {started['alignment_id']}, "
                             f"not on the current {alignment.alignment_id}")
        return TrainingConfig.model_validate(started["config"])

    def start_resume(self, session_id: str) -> Job:
        if self.alignment is None:
            raise NotAligned("no alignment: a resumed session needs the alignment it trained on (POST /alignments)")
        self._resumable(self.settings.state_path / "runs", session_id, self.alignment)
        return self.jobs.submit("training", lambda progress: self.train(TrainingConfig(), progress, resume=session_id))

    # --- scoring ------------------------------------------------------------------------------

    def _proxies(self, client: httpx.Client, names: list[str]) -> dict[str, HttpPartner]:
        """A proxy per partner, each with its own step connection: the caller closes them with the job."""
        me = PeerIdentity(self.settings.name, "bank")
        urls = self.partners(names)
        return {
            name: HttpPartner(name, url, client, steps=StepConnection(
                url, self.settings.tls_files(), expect=PeerIdentity(name, "partner"), caller=me,
                timeout=self.settings.peer_timeout,
            ), retry_deadline=self.settings.peer_retry_deadline, known=True)  # they answered the alignment
            for name, url in urls.items()
        }

    def model_dir(self, model_id: str) -> Path:
        if not model_id.isalnum():
            raise BadMessage("a model id is letters and digits")
        folder = self.settings.state_path / "runs" / model_id / "model"
        if not (folder / "manifest.json").exists():
            raise UnknownSession(f"no trained model {model_id}")
        return folder

    def score(self, model_id: str, upload: Path, table: PartyTable, allow_missing: bool,
              progress: Progress, accept_drift: bool = False, max_overlap: float | None = None) -> dict[str, Any]:
        model_dir = self.model_dir(model_id)
        names = [p.name for p in read_manifest(model_dir).parties[1:]]
        ceilings = {n: max_overlap or self.ceilings.get(n, self.settings.max_overlap) for n in names}
        with client_for(self.settings, timeout=self.settings.peer_timeout) as client, ExitStack() as proxies:
            partners = {n: proxies.enter_context(p) for n, p in self._proxies(client, names).items()}
            result = score_customers(table, model_dir, self.settings.name, partners, self.pool,
                                     allow_missing=allow_missing, accept_drift=accept_drift, progress=progress,
                                     partnership=self.partnership, exposure=self.exposure,
                                     max_overlap=ceilings)
        scores = result.table
        out = upload.with_name("scores.csv")
        atomic_write_text(out, scores.to_csv(index=False))  # 0600, like every file of the bank's
        scored = int(scores["status"].str.startswith("scored").sum())
        return {"model_id": model_id, "scores_file": str(out), "rows": len(scores), "scored": scored,
                "unscorable": len(scores) - scored, "scored_without": result.scored_without,
                "models": result.models, "refused": result.refused, "fallbacks": result.fallbacks,
                "drift": result.drift, "drift_warnings": result.drift_warnings, "max_overlap": ceilings}

    def start_scoring(self, model_id: str, csv: bytes, allow_missing: bool, accept_drift: bool = False,
                      max_overlap: float | None = None) -> Job:
        """Check the customers file now (a bad file, or one whose bank columns drift past the refusal threshold,
        is refused with the reason, HTTP 422), score it in a job."""
        model_dir = self.model_dir(model_id)
        upload = self.settings.state_path / "scores" / uuid.uuid4().hex / "customers.csv"
        atomic_write_bytes(upload, csv)
        own = ScoringBottom(model_dir / "bank", read_manifest(model_dir).party(self.settings.name).files)
        try:
            table = load_party_table(upload, self.table.id_column, schema=own.encoder.schema,
                                     id_type=self.table.id_type, spill_dir=upload.parent)
            judge_drift({self.settings.name: own.encoder.drift(table.features)}, accept_drift,
                        {self.settings.name: len(table)})
        except DataError as exc:
            shutil.rmtree(upload.parent, ignore_errors=True)
            raise DataError(str(exc).replace(str(upload), "the customers file")) from exc
        return self.jobs.submit("scoring", lambda progress: self.score(model_id, upload, table, allow_missing, progress,
                                                                       accept_drift, max_overlap))

    def start_training(self, config: TrainingConfig) -> Job:
        if self.alignment is None:
            raise NotAligned("no alignment yet: align the customers first (POST /alignments)")
        self.partners(config.partners)
        return self.jobs.submit("training", lambda progress: self.train(config, progress))

    def close(self) -> None:
        self.pool.close()
        self.partnership.close()
