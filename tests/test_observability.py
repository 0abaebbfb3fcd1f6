"""What a running service shows its operator: Prometheus metrics on a local port, JSON log lines, readiness."""

from __future__ import annotations

import json
import logging
import re
import shutil

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bank.config import TrainingConfig
from bank.service.operator import BankOperator
from data.prepare import prepare_bank_marketing
from parties.cli import configure_logging
from parties.errors import ConfigError
from parties.observability import bind_log, log_context, set_log_party, start_metrics_server
from parties.protocol.common import HEALTH, READY
from parties.protocol.training import SESSIONS as TRAIN_SESSIONS
from parties.settings import load_settings
from parties.transport.client import make_client
from parties.transport.tls import TLSFiles
from partner.settings import PartnerSettings


@pytest.fixture(scope="module")
def metrics_url() -> str:
    return f"http://127.0.0.1:{start_metrics_server('127.0.0.1', 0)}/metrics"


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(url, timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_a_training_shows_in_the_metrics_by_route_template_and_never_by_id(
        metrics_url, pki, bank_full, tmp_path, start_partner, start_bank) -> None:
    paths = prepare_bank_marketing(tmp_path / "data", rows=2000, cache=bank_full.parent, download=False)
    partner = start_partner(paths["partner"])
    bank = start_bank(paths["bank"], {"partner": partner.url})
    before = scrape(metrics_url)
    with BankOperator(bank.url, TLSFiles.from_dir(pki, "bank")) as op:
        op.wait(op.start_alignment())
        result = op.wait(op.start_training(TrainingConfig(epochs=2, batch_size=128)))
    with make_client(TLSFiles.from_dir(pki, "partner2"), base_url=partner.url) as stranger:
        assert stranger.get(TRAIN_SESSIONS).status_code == 403  # a partner may not list a bank's sessions
    after = scrape(metrics_url)

    def grew(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    step = "/train/sessions/{session_id}/step"
    assert grew("cutlayer_requests_total", route=step, status="200") >= result["steps"] > 0
    assert grew("cutlayer_request_bytes_total", route=step) > 0 and grew("cutlayer_response_bytes_total", route=step) > 0
    assert grew("cutlayer_request_seconds_count", route=step) >= result["steps"]
    assert grew("cutlayer_training_steps_total") >= result["steps"]  # the partner's bottom and the bank's
    assert grew("cutlayer_psi_ids_total", direction="received") >= 2000 * 0.8
    assert grew("cutlayer_psi_ids_total", direction="sent") > 0
    assert grew("cutlayer_checkpoint_writes_total") > 0 and grew("cutlayer_checkpoint_bytes_total") > 0
    assert grew("cutlayer_refusals_total", reason="Forbidden") >= 1
    assert ("cutlayer_sessions", (("kind", "training"),)) in after
    routes = {dict(labels).get("route") for _, labels in after if dict(labels).get("route")}
    session_id = result["session"]
    assert all(r == "unmatched" or r.startswith("/") for r in routes)
    assert not any(session_id in r or re.search(r"[0-9a-f]{16}", r) for r in routes), routes


def test_metrics_are_served_on_a_loopback_address_only(tmp_path, pki) -> None:
    with pytest.raises(ConfigError, match="loopback address only"):
        load_settings(PartnerSettings, name="partner", data=tmp_path / "p.csv", tls_dir=pki, metrics_port=9100,
                      metrics_host="0.0.0.0")


def test_json_log_lines_carry_the_party_session_and_step(capsys) -> None:
    configure_logging("INFO", "json")
    set_log_party("telco")
    with log_context(session="abc", step=7):
        logging.getLogger("parties.test").warning("step %d applied", 7)
    bind_log(epoch=3)  # outside a context: nothing to bind to, and nothing leaks into the next line
    logging.getLogger("parties.test").info("between sessions")
    first, second = (json.loads(line) for line in capsys.readouterr().err.splitlines())
    assert first["party"] == "telco" and first["session"] == "abc" and first["step"] == 7
    assert first["message"] == "step 7 applied" and first["level"] == "WARNING" and first["logger"] == "parties.test"
    assert "session" not in second and "epoch" not in second and second["party"] == "telco"


def test_ready_is_not_live_a_service_that_cannot_write_its_state_is_live_but_not_ready(
        pki, tmp_path, start_partner, write_csv) -> None:
    state = tmp_path / "partner-state"
    partner = start_partner(write_csv("p.csv", customer_id=["1", "2"], x=["1", "2"]), state_dir=state)
    with make_client(TLSFiles.from_dir(pki, "bank"), base_url=partner.url) as client:
        assert client.get(READY).json() == {"status": "ready"}
        shutil.rmtree(state)
        state.write_text("not a folder")  # the state folder is gone: nothing can be checkpointed
        answer = client.get(READY)
        assert answer.status_code == 503 and "the state folder cannot be written" in answer.json()["problems"][0]
        assert str(tmp_path) not in answer.text  # no path of the party's
        assert client.get(HEALTH).status_code == 200
