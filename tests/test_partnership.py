"""A partner serving several banks, against a dishonest bank or partner: each attack through the real services.

Enumeration (a peer bringing IDs it guessed), squatting (another bank's alignment, slots or sessions),
starvation (disk), and a layer service that would serve any bank. Every test plays the attack the
independent review played against the code, and checks what the attacker got: nothing, or a bounded,
logged amount.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pandas as pd
import pytest
import torch

from alignment import curve
from alignment.exposure import Exposure, OverlapTooHigh, customer_keys
from alignment.psi import run_initiator
from bank.service.aligner import align_with_partners
from bank.config import TrainingConfig
from bank.vertical.http_partner import HttpPartner
from bank.service.operator import BankOperator, JobFailed
from parties.errors import DataError, OutOfOrder, OverBudget, PeerError, QuotaExceeded, StorageError, UnknownSession
from parties.protocol.control import AlignmentRequest
from parties.limits import BankQuotas, PsiLimits
from partner.settings import PartnerSettings
from parties.storage.session_log import RESERVED, SessionLog, verify_log
from parties.tables.table import load_party_table
from parties.transport.access import peer_detail
from parties.transport.client import make_client
from parties.transport.tls import PeerIdentity, TLSFiles

CONFIG = TrainingConfig(epochs=1, batch_size=128)


def _party_file(path: Path, ids: np.ndarray, *, label: bool, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    frame = pd.DataFrame({"customer_id": ids, "x": rng.normal(size=len(ids)).round(3),
                          "kind": rng.choice(["a", "b", "c"], size=len(ids))})
    if label:
        frame["y"] = np.where(frame["x"] + rng.normal(scale=0.5, size=len(ids)) > 0, "yes", "no")
    path.parent.mkdir(parents=True, exist_ok=True)
    frame.to_csv(path, index=False)
    return path


@pytest.fixture()
def files(tmp_path: Path) -> Callable[..., Path]:
    """``files(name, ids, label=False)``: a party's CSV with these customer IDs (integers) and a few columns."""
    made: list[str] = []

    def make(name: str, ids: object, *, label: bool = False) -> Path:
        made.append(name)
        return _party_file(tmp_path / "data" / f"{name}.csv", np.asarray(ids), label=label, seed=len(made))

    return make


def _client(pki: Path, name: str) -> httpx.Client:
    return make_client(TLSFiles.from_dir(pki, name), caller=PeerIdentity(name, "bank"))


def _operator(pki: Path, bank, name: str = "bank") -> BankOperator:
    return BankOperator(bank.url, TLSFiles.from_dir(pki, name), name)


def _events(path: Path) -> list[tuple[str, object]]:
    """(event, peer) of every record of a session log, after checking its chain."""
    return [(r["event"], r.get("peer")) for r in verify_log(path)]


def _points(ids: object) -> bytes:
    return curve.hash_to_curve([curve.normalize_id(str(i)) for i in ids])


# --- enumeration: a partner claiming IDs it does not hold ----------------------------------------------------


def test_a_partner_claiming_every_possible_id_learns_none_of_the_banks_customers(pki, files, start_partner,
                                                                               start_bank) -> None:
    """The review's partner served C000000-C049999 and learned all 42,950 bank customers; here the space is
    900 IDs and the bank holds 600 of them (the same 1.5 : 1 as the walkthrough's file)."""
    bank_ids = np.random.default_rng(1).choice(900, size=600, replace=False)
    partner = start_partner(files("everyone", np.arange(900)), name="partner")
    bank = start_bank(files("bank", bank_ids, label=True), {"partner": partner.url})
    with _operator(pki, bank) as op, pytest.raises(JobFailed) as refused:
        op.wait(op.start_alignment())
    assert ("would have matched 600 of the 600 bank customers sent to it in this session that it had not matched "
            "before (100.0%), more than the 95% allowed") in str(refused.value)
    assert "nothing was committed" in str(refused.value)
    # The partner learns which of its IDs are the bank's only from a commit: there was none.
    core = partner.app.state.core
    assert core.alignment_of("bank") is None and core.sessions("bank").sessions == []
    partner_log = core.settings.state_path / "psi-sessions.log"
    assert _events(partner_log) == [("opened", "bank"), ("aborted", "bank")]
    bank_log = bank.app.state.core.settings.state_path / "psi-sessions.log"
    assert _events(bank_log) == [("opened", "partner"), ("refused", "partner")]
    # An operator who knows this partner holds everyone says so, and the same partner aligns.
    with _operator(pki, bank) as op:
        assert op.wait(op.start_alignment(AlignmentRequest(max_overlap=1.0)))["rows"] == 600
    assert len(core.alignment_of("bank")) == 600


@pytest.mark.parametrize(("space", "bank_limits"), [
    (900, {"partner": 500}),  # the partnership agreed on the partner's size: 900 is over it
    (1000, {}),  # no agreement: the default, twice the bank's own 400
], ids=["agreed-size", "default-twice-own"])
def test_a_partner_announcing_more_ids_than_agreed_is_refused_before_anything_is_sent(
        pki, files, start_partner, start_bank, space, bank_limits) -> None:
    bank_ids = np.random.default_rng(2).choice(space, size=400 if not bank_limits else 600, replace=False)
    partner = start_partner(files("everyone", np.arange(space)), name="partner")
    bank = start_bank(files("bank", bank_ids, label=True), {"partner": partner.url},
                      psi_limits=PsiLimits(peer_max_ids=bank_limits))
    with _operator(pki, bank) as op, pytest.raises(JobFailed, match=rf"announced {space:,} IDs for one PSI session"):
        op.wait(op.start_alignment())
    records = verify_log(partner.app.state.core.settings.state_path / "psi-sessions.log")
    assert [r["event"] for r in records] == ["opened", "aborted"]
    assert records[1]["received"] == 0  # not one of the bank's blinded IDs reached the partner


def test_claims_spread_over_sessions_add_up(pki, files, start_partner, pool, tmp_path) -> None:
    """The second review's partner claimed 90% of the space at the training alignment (accepted) and the whole space
    at the next session: per session the first stayed under the bound. Here the second claim is 90% of the space
    too, but the 10% the first left out: each session passes alone, and together they are every bank customer."""
    rng = np.random.default_rng(4)
    table = load_party_table(files("bank", rng.choice(1000, size=600, replace=False), label=True), "customer_id", "y")
    first_claim = rng.choice(1000, size=900, replace=False)
    rest = np.setdiff1d(np.arange(1000), first_claim)
    second_claim = np.concatenate([rest, rng.choice(first_claim, size=800, replace=False)])
    most = start_partner(files("most", first_claim), name="partner")
    other = start_partner(files("other", second_claim), name="partner", state_dir=tmp_path / "other")
    told = Exposure()
    with _client(pki, "bank") as client:
        first, _ = align_with_partners(table, {"partner": HttpPartner("partner", most.url, client)}, pool,
                                       exposure=told)
        assert 0.85 < len(first) / 600 < 0.95  # the first claim is within the bound
        with pytest.raises(OverlapTooHigh, match=r"would have matched 600 of the 600 bank customers sent to it over "
                                                 r"the partnership \(100.0%\) \(\d+ of 600 in earlier sessions\)"):
            align_with_partners(table, {"partner": HttpPartner("partner", other.url, client)}, pool, exposure=told)
    assert other.app.state.core.alignment_of("bank") is None  # nothing committed: it learned nothing more
    assert told.totals("partner") == (600, len(first))


def test_over_the_partnership_a_partner_learns_at_most_the_ceiling_less_its_share() -> None:
    """Small scoring batches, each all claimed, pass a per-batch test; the running totals stop them."""
    rng = np.random.default_rng(5)
    told, ceiling = Exposure(), 0.95
    portfolio = customer_keys([f"c{i}".encode() for i in range(1000)])
    held = rng.random(1000) < 0.9  # the partner's honest share of the portfolio
    told.claim("p", portfolio, portfolio[held], ceiling)
    learned_beyond = 0
    for batch in range(100):  # new applicants, 20 at a time, each claimed whatever the partner holds
        keys = customer_keys([f"new{batch}-{i}".encode() for i in range(20)])
        try:
            told.claim("p", keys, keys, ceiling)
        except OverlapTooHigh:
            break
        learned_beyond += int(np.sum(rng.random(20) >= 0.9))  # of those, about 10% it does not hold
    else:
        pytest.fail("every batch passed: the claims were never added up")
    sent, matched = told.totals("p")
    chance = 4 * np.sqrt(sent * ceiling * (1 - ceiling))  # the test's slack: a binomial tail of 1e-3 and less
    assert batch < 100 and matched <= ceiling * sent + chance
    assert learned_beyond <= (ceiling - held.mean()) * sent + chance


def test_a_ledger_on_disk_counts_sessions_as_sets_whatever_their_order(tmp_path) -> None:
    """Claims sort what they are given in place and keep nothing in memory: a later claim, or another service's
    ledger reading the same folder, counts each customer once, as set arithmetic says."""
    names = [f"c{i}".encode() for i in range(3000)]
    rng = np.random.default_rng(5)
    sessions = [np.sort(rng.choice(3000, size=n, replace=False)) for n in (1200, 900, 1500)]
    told = Exposure(tmp_path / "exposure")
    sent_all: set[int] = set()
    matched_all: set[int] = set()
    for k, sent in enumerate(sessions):
        matched = sent[rng.permutation(len(sent))[: len(sent) // 2]]  # row order, as a PSI result gives them
        keys = customer_keys(names, rng.permutation(sent))
        totals = told.claim("partner", keys, customer_keys(names, matched), 0.95)
        assert np.all(keys[:-1] < keys[1:])  # sorted in place
        sent_all |= set(sent.tolist())
        matched_all |= set(matched.tolist())
        assert totals == (len(sent_all), len(matched_all)) == Exposure(tmp_path / "exposure").totals("partner"), k
    assert told._memory == {}


def test_a_ledger_rolled_back_while_the_service_runs_is_refused_at_the_next_claim(tmp_path) -> None:
    """The ledger is read from disk per claim: one restored from an older copy mid-run must not restart the count."""
    told = Exposure(tmp_path / "exposure")
    names = [f"c{i}".encode() for i in range(3000)]
    told.claim("partner", customer_keys(names[:1000]), customer_keys(names[:100]), 0.95)
    older = (tmp_path / "exposure" / "partner.npz").read_bytes()
    told.claim("partner", customer_keys(names[1000:2000]), customer_keys(names[1000:1100]), 0.95)
    (tmp_path / "exposure" / "partner.npz").write_bytes(older)
    with pytest.raises(DataError, match=r"holds \(1000, 100\).*fewer than the \(2000, 200\) this service last "
                                        r"recorded there: it was deleted or rolled back while the service ran"):
        told.claim("partner", customer_keys(names[2000:]), customer_keys(names[2000:2100]), 0.95)


def test_a_ledger_deleted_or_rolled_back_stops_the_bank(tmp_path) -> None:
    """Deleting the ledger (or restoring an older one) would let a partner be told again what it was told."""
    told = Exposure(tmp_path / "exposure")
    keys = customer_keys([f"c{i}".encode() for i in range(100)])
    totals = told.claim("partner", keys, keys[:60], 0.95)
    logged = [{"event": "committed", "peer": "partner", "seq": 7, "told_sent": totals[0], "told_matched": totals[1]}]
    Exposure(tmp_path / "exposure").verify_against(logged)  # as the log says: starts
    (tmp_path / "exposure" / "partner.npz").unlink()
    with pytest.raises(DataError, match=r"holds \(0, 0\).*record 7 says it held, \(100, 60\): it was deleted or "
                                        r"rolled back"):
        Exposure(tmp_path / "exposure").verify_against(logged)


def test_both_logs_keep_the_others_chain_head_so_a_rewritten_log_shows(pki, files, start_partner, start_bank,
                                                                       tmp_path) -> None:
    partner = start_partner(files("partner", np.arange(50, 550)), name="partner")
    bank = start_bank(files("bank", np.arange(100, 600), label=True), {"partner": partner.url})
    with _operator(pki, bank) as op:
        op.wait(op.start_alignment())
    partner_log = partner.app.state.core.settings.state_path / "psi-sessions.log"
    bank_log = bank.app.state.core.settings.state_path / "psi-sessions.log"
    partner.stop()
    bank.stop()
    partner_hashes = {r["hash"]: r for r in verify_log(partner_log)}
    kept = [(r["peer_head"], r["session"]) for r in verify_log(bank_log) if r.get("peer_head")]
    assert len(kept) == 2  # the partner's records of the opening and of the commit, each of this session
    assert all(partner_hashes[head]["session"] == session for head, session in kept)
    bank_hashes = {r["hash"]: r for r in verify_log(bank_log)}
    (commit,) = [r for r in verify_log(partner_log) if r["event"] == "committed"]
    assert bank_hashes[commit["peer_head"]]["event"] == "opened"  # the bank's record of this session
    assert bank_hashes[commit["peer_head"]]["session"] == commit["session"]

    def verify(log: Path, against: Path, peer: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "parties", "verify-log", str(log), "--against", str(against),
                               "--peer", peer], capture_output=True, text=True, timeout=60)

    checked = verify(bank_log, partner_log, "partner")
    assert checked.returncode == 0 and "the sizes of every session both logged agree" in checked.stdout
    assert verify(partner_log, bank_log, "bank").returncode == 0
    # What the other side never got the hash of (the bank's last record of the session) is said, not implied.
    assert "not anchored here" in verify(partner_log, bank_log, "bank").stdout
    # The partner rewrites its own log (the bank "brought" more), its chain recomputed so that it verifies alone.
    records = verify_log(partner_log)
    records[0]["declared"] = 10_000_000
    forged = tmp_path / "forged.log"
    with SessionLog(forged) as log:
        for r in records:
            log.append(r["event"], **{k: v for k, v in r.items() if k not in RESERVED})
    assert subprocess.run([sys.executable, "-m", "parties", "verify-log", str(forged)],
                          capture_output=True, timeout=60).returncode == 0
    refused = verify(bank_log, forged, "partner")
    assert refused.returncode == 2 and "one of the two logs was rewritten or cut" in refused.stderr
    # A partner that withholds the hash of its records is refused by the bank, so it cannot avoid being anchored.
    with _client(pki, "bank") as client:
        class Withholding(HttpPartner):
            def once(self, method, path, what, limit=1 << 16, **kwargs):
                content = super().once(method, path, what, limit, **kwargs)
                if what == "opening a PSI session":
                    body = json.loads(content)
                    body.pop("log_head")
                    content = json.dumps(body).encode()
                return content

        withheld = start_partner(files("partner2", np.arange(50, 550)), name="partner", state_dir=tmp_path / "w")
        with pytest.raises(PeerError, match="without a valid session-log record hash"):
            Withholding("partner", withheld.url, client).open(10, 1024, "integer")


def test_refusals_count_against_the_hour_and_are_not_written_without_end(pki, files, start_partner,
                                                                          tmp_path) -> None:
    """The review flooded a partner with 5,000 over-size opens: each answered, and each fsynced to its log."""
    state = tmp_path / "partner-state"
    partner = start_partner(files("partner", np.arange(400)), name="partner", state_dir=state,
                            psi_limits=PsiLimits(sessions_per_hour=5))
    with _client(pki, "bank2") as client:
        peer = HttpPartner("partner", partner.url, client)
        for _ in range(40):
            with pytest.raises(OverBudget, match="announced 100,000 IDs"):
                peer.open(100_000, 1024, "integer")
        with pytest.raises(OverBudget, match="asked for 40 PSI sessions in the last hour \\(refused ones count\\)"):
            peer.open(10, 1024, "integer")  # a valid session now waits for the hour
    partner.stop()
    records = verify_log(state / "psi-sessions.log")
    assert [r["event"] for r in records] == ["refused"] * 6
    assert sum(int(r.get("count", 1)) for r in records) == 41  # 5 written one by one, 36 counted in one


# --- enumeration: a bank probing with guessed IDs -------------------------------------------------------------


def test_a_bank_probing_with_guessed_ids_is_bounded_per_session_and_per_day(pki, files, start_partner, tmp_path,
                                                                           pool) -> None:
    """The review's bank sent 50,000 guessed IDs and learned all 40,690 partner customers; here the partner
    holds 400 IDs of a space of 1,200, and a bank that guesses the whole space is refused before any blinding."""
    partner_file = files("partner", np.random.default_rng(3).choice(1200, size=400, replace=False))
    state = tmp_path / "partner-state"
    partner = start_partner(partner_file, name="partner", state_dir=state)
    with _client(pki, "bank") as client:
        peer = HttpPartner("partner", partner.url, client, retry_deadline=2)
        with pytest.raises(OverBudget, match=r"bank 'bank' announced 1,200 IDs .* at most 800 are accepted "
                                             r"from it \(2 x this party's own 400 customers, the default\)"):
            run_initiator(peer, _points(range(1200)), pool, id_type="integer")
        for _ in range(2):  # under the per-session limit, over a day: aborted sessions count
            peer.abort(peer.open(700, 1024, "integer").session_id)
        with pytest.raises(OverBudget, match=r"brought 1,400 IDs to PSI in the last 24 hours; 700 more would pass "
                                             r"the limit of 1,600"):
            peer.open(700, 1024, "integer")
    partner.stop()
    # The budget is read back from the log: a restart does not refill it.
    partner = start_partner(partner_file, name="partner", state_dir=state)
    with _client(pki, "bank") as client, _client(pki, "bank2") as other:
        with pytest.raises(OverBudget, match="brought 1,400 IDs"):
            HttpPartner("partner", partner.url, client).open(700, 1024, "integer")
        assert HttpPartner("partner", partner.url, other).open(700, 1024, "integer").peer_count == 400  # a budget of its own
    events = [(r["event"], r["peer"], r.get("declared")) for r in verify_log(state / "psi-sessions.log")]
    assert events == [("refused", "bank", 1200), ("opened", "bank", 700), ("aborted", "bank", None),
                      ("opened", "bank", 700), ("aborted", "bank", None), ("refused", "bank", 700),
                      ("refused", "bank", 700), ("opened", "bank2", 700)]


def test_the_agreed_size_holds_for_one_bank_and_the_default_for_another(pki, files, start_partner) -> None:
    partner = start_partner(files("partner", np.arange(400)), name="partner",
                            psi_limits=PsiLimits(peer_max_ids={"bank": 450}))
    with _client(pki, "bank") as client, _client(pki, "bank2") as other:
        with pytest.raises(OverBudget, match="at most 450 are accepted from it \\(the size the partnership agreed\\)"):
            HttpPartner("partner", partner.url, client).open(451, 1024, "integer")
        assert HttpPartner("partner", partner.url, other).open(800, 1024, "integer").peer_count == 400


# --- isolation: another bank's alignment, slots and sessions ----------------------------------------------------


def test_another_bank_neither_replaces_nor_reaches_a_banks_alignment(pki, files, start_partner, start_bank) -> None:
    """The review's second bank committed its own training alignment; the real bank's next start got 409."""
    partner = start_partner(files("partner", np.arange(50, 550)), name="partner")
    bank = start_bank(files("bank", np.arange(100, 600), label=True), {"partner": partner.url})
    evil = start_bank(files("evil", np.arange(0, 450), label=True), {"partner": partner.url}, name="bank2")
    with _operator(pki, bank) as op, _operator(pki, evil, "bank2") as other:
        mine = op.wait(op.start_alignment())
        theirs = other.wait(other.start_alignment())
        result = op.wait(op.start_training(CONFIG))  # the first bank's alignment is still its own
    assert result["epochs_run"] == 1
    core = partner.app.state.core
    assert core.alignment_of("bank").alignment_id == mine["alignment_id"]
    assert core.alignment_of("bank2").alignment_id == theirs["alignment_id"]
    with _client(pki, "bank2") as client:  # its alignment ID is no key to it
        with pytest.raises(OutOfOrder, match="is not this partner's current alignment with bank2"):
            HttpPartner("partner", partner.url, client).start_training("s1", mine["alignment_id"], torch.arange(10))


def test_another_banks_sessions_take_none_of_this_banks_slots(pki, files, start_partner, start_bank) -> None:
    """The review's second bank held both training slots and all four PSI slots, refreshing them; the real bank
    got 409 for up to an hour."""
    partner = start_partner(files("partner", np.arange(50, 550)), name="partner")
    bank = start_bank(files("bank", np.arange(100, 600), label=True), {"partner": partner.url})
    evil = start_bank(files("evil", np.arange(0, 450), label=True), {"partner": partner.url}, name="bank2")
    with _operator(pki, evil, "bank2") as other:
        aligned = other.wait(other.start_alignment())["alignment_id"]
    with _client(pki, "bank2") as client:
        squatter = HttpPartner("partner", partner.url, client)
        for i in range(2):
            squatter.start_training(f"squat{i}", aligned, torch.arange(100))
        for _ in range(4):
            squatter.open(10, 1024, "integer")
        with _operator(pki, bank) as op:
            squatter.sessions()  # kept busy all along
            op.wait(op.start_alignment())
            squatter.sessions()
            assert op.wait(op.start_training(CONFIG))["epochs_run"] == 1
        assert len(squatter.sessions().sessions) == 6  # its own, untouched


def test_a_leaked_session_or_model_id_gives_another_bank_nothing(pki, files, start_partner, start_bank) -> None:
    """The review read a partner's embeddings of chosen rows, injected step 0 and ended a session for good with
    another bank's certificate and an ID from a run folder."""
    partner = start_partner(files("partner", np.arange(50, 550)), name="partner")
    bank = start_bank(files("bank", np.arange(100, 600), label=True), {"partner": partner.url})
    with _operator(pki, bank) as op:
        aligned = op.wait(op.start_alignment())["alignment_id"]
    with _client(pki, "bank") as mine, _client(pki, "bank2") as theirs:
        owner = HttpPartner("partner", partner.url, mine)
        width = owner.start_training("leaked", aligned, torch.arange(300))
        owner.submit_step(0, None, torch.arange(8), checkpoint=True)()
        assert owner.checkpoints() == [0]
        thief = HttpPartner("partner", partner.url, theirs, retry_deadline=1)
        thief.attach("leaked", width)
        rows = torch.arange(4)
        for attempt in (lambda: thief.embed(rows), lambda: thief.step(1, torch.zeros(8, width), rows),
                        thief.mark_best, lambda: thief.restore(0), thief.privacy, lambda: thief.finish(False)):
            with pytest.raises(UnknownSession):  # 404: not even told that the session exists
                attempt()
        assert thief.checkpoints() == []  # what any unknown session answers
        thief.end()  # ending is idempotent (a bank may retry it): it ends only a session of the caller's own
        assert owner.step(1, torch.zeros(8, width), rows).shape == (4, width)  # untouched, still the owner's
        files_ = owner.finish(False).files
        with pytest.raises(UnknownSession, match="no model leaked"):
            thief.load_model("leaked", files_, width)
        owner.load_model("leaked", files_, width)
    assert [s.owner for s in partner.app.state.core.sessions().sessions] == ["bank"]


# --- quotas: disk a bank may fill -----------------------------------------------------------------------------


def test_a_banks_disk_at_a_partner_is_bounded_with_a_clear_507(pki, files, start_partner, start_bank) -> None:
    """The review's bank kept 93.5 MB of models and checkpoints from 30 sessions in 23 s, with no cap."""
    quota = 120_000
    partner = start_partner(files("partner", np.arange(50, 550)), name="partner",
                            quotas=BankQuotas(disk_per_bank=quota))
    bank = start_bank(files("bank", np.arange(100, 600), label=True), {"partner": partner.url})
    with _operator(pki, bank) as op:
        aligned = op.wait(op.start_alignment())["alignment_id"]
    folder = partner.app.state.core.banks["bank"].folder
    with _client(pki, "bank") as client:
        peer = HttpPartner("partner", partner.url, client)
        for i in range(30):
            peer.start_training(f"s{i}", aligned, torch.arange(300))
            try:
                peer.finish(False)
            except QuotaExceeded as exc:
                message = str(exc)
                break
            finally:
                peer.end()
        else:
            pytest.fail("30 models were kept: no quota")
    assert i < 30 and "HTTP 507" in message
    assert "bank 'bank' keeps" in message and f"its quota of 0.1 MB ({quota:,} bytes, --disk-quota-per-bank)" in message
    assert str(folder) not in message  # no path of the partner's disk for the bank
    used = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    assert used <= quota


def test_checkpoints_of_an_unused_session_are_removed(pki, files, start_partner, start_bank) -> None:
    partner = start_partner(files("partner", np.arange(50, 550)), name="partner",
                            quotas=BankQuotas(checkpoint_ttl=1.0))
    bank = start_bank(files("bank", np.arange(100, 600), label=True), {"partner": partner.url})
    with _operator(pki, bank) as op:
        aligned = op.wait(op.start_alignment())["alignment_id"]
    with _client(pki, "bank") as client:
        peer = HttpPartner("partner", partner.url, client)
        width = peer.start_training("left", aligned, torch.arange(300))
        peer.submit_step(0, None, torch.arange(8), checkpoint=True)()
        assert peer.checkpoints() == [0]
        peer.end(finished=False)  # the bank's run stopped: resumable, for a while
        folder = partner.app.state.core.banks["bank"].training_dir("left")
        assert list(folder.glob("step-*"))
        time.sleep(1.2)
        peer.start_training("next", aligned, torch.arange(300))  # any start sweeps
        assert width and not list(folder.glob("step-*"))


# --- a layer service names the banks it serves ----------------------------------------------------------------


@pytest.mark.parametrize("command", ["compute", "branch"])
def test_a_layer_service_refuses_to_start_without_the_banks_it_serves(pki, files, command) -> None:
    """The review's second bank took both slots of a compute party started without --bank, for an hour."""
    args = [sys.executable, "-m", "partner", command, "--name", "compute", "--tls-dir", str(pki)]
    if command == "branch":
        args += ["--data", str(files("branch", np.arange(50)))]
    done = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--bank: name the banks this service holds layers for (--bank NAME, repeat per bank)" in done.stderr


def test_a_refusal_names_no_folder_of_the_partys_disk(tmp_path) -> None:
    """A failed write's message carries the party's path; what the peer reads names it <state>."""
    settings = PartnerSettings(name="partner", data=tmp_path / "p.csv", insecure=True, state_dir=tmp_path / "state")
    failed = StorageError(f"could not write the checkpoint of step 3 to {tmp_path / 'state'}/banks/b/training/s/x: "
                          "disk full")
    assert peer_detail(settings, failed) == ("could not write the checkpoint of step 3 to <state>/banks/b/training/s/x:"
                                             " disk full")
