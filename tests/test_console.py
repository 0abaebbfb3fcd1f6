"""The operator's console: the bank service's new resources (partners, runs, stopping a job), the console's own
guard (its token, its address), and the whole flow in a real headless Chromium: align, train while the curve
grows, stop and resume, open the run, score a file and download the scores.

The browser tests need Debian's ``chromium`` and ``chromium-driver`` and the ``selenium`` package; they skip
without them, unless ``CUTLAYER_BROWSER_TESTS=required`` (CI sets it) makes that a failure.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pandas as pd
import pytest

from bank.config import TrainingConfig
from bank.console.app import create_console
from bank.service.operator import BankOperator, JobFailed
from data.prepare import prepare_bank_marketing
from parties.errors import PeerError
from parties.protocol.control import AlignmentRequest
from parties.transport.server import ServerThread
from parties.transport.tls import TLSFiles

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def services(pki, bank_full: Path, tmp_path: Path, start_partner, start_bank):
    """A partner and a bank on 1,500 customers, real TLS; the operator with the bank's certificate."""
    paths = prepare_bank_marketing(tmp_path / "data", rows=1500, cache=bank_full.parent, download=False)
    partner = start_partner(paths["partner"])
    bank = start_bank(paths["bank"], {"partner": partner.url, "partner2": "https://127.0.0.1:9"})
    operator = BankOperator(bank.url, TLSFiles.from_dir(pki, "bank"))
    yield operator, paths, bank
    operator.close()


def _wait(operator: BankOperator, job_id: str, states: tuple[str, ...], timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while (state := operator.job(job_id).state) not in states:
        assert time.monotonic() < deadline, f"job {job_id} still {state}"
        time.sleep(0.1)
    return state


# --- the bank service's resources --------------------------------------------------------------------------


def test_partners_runs_and_stopping_a_training_through_the_bank_service(services, tmp_path: Path) -> None:
    operator, _, _ = services
    partners = {p.name: p for p in operator.partners().partners}
    assert partners["partner"].reachable and partners["partner"].ready
    cert = partners["partner"].certificate
    assert (cert.name, cert.role) == ("partner", "partner") and cert.days_left > 300
    assert not partners["partner2"].reachable and partners["partner2"].problem

    operator.wait(operator.start_alignment(AlignmentRequest(partners=["partner"])))
    # A training stopped mid-way ends "stopped", with a curve of the epochs it ran, and resumes to the end.
    job = operator.start_training(TrainingConfig(epochs=40, batch_size=64, partners=["partner"]))
    deadline = time.monotonic() + 120
    while len(operator.job(job.job_id).curve) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    stopped = operator.stop_job(job.job_id)
    assert _wait(operator, job.job_id, ("stopped", "failed", "succeeded")) == "stopped"
    status = operator.job(job.job_id)
    assert "stopped by the operator" in status.error
    point = status.curve[0]
    assert point["epoch"] == 1 and "val_roc_auc" in point and point["bytes_partner"] > 0 and point["round_trips_partner"] > 0
    with pytest.raises(PeerError, match="has ended"):  # stopping what has ended is refused
        operator.stop_job(job.job_id)
    session = next(s for s in operator.sessions().sessions)
    assert session.state == "stopped" and stopped.job_id == job.job_id
    with pytest.raises(JobFailed, match="stopped"):  # the CLI's wait ends on a stopped job, with its reason
        operator.wait(operator.stop_job(operator.resume_training(session.session).job_id))
    result = operator.wait(operator.resume_training(session.session))
    assert result["session"] == session.session

    runs = operator.runs().runs
    assert [r.session for r in runs] == [session.session] and runs[0].state == "finished"
    assert runs[0].test["roc_auc"] == pytest.approx(result["test"]["roc_auc"])
    detail = operator.run(session.session)
    assert detail.metrics["best_epoch"] == result["best_epoch"] and len(detail.history) == result["epochs_run"]
    assert {"metrics.json", "history.csv", "manifest.json"} <= set(detail.files)
    manifest = operator.run_file(session.session, "manifest.json")
    assert manifest.json()["parties"][0]["name"] == "bank"
    # Only listed files, by their names: no rows, nothing outside the run's folder.
    run_dir = Path(result["run_dir"])
    (run_dir / "analysis").mkdir()
    (run_dir / "analysis" / "learning_curves.png").write_bytes(b"\x89PNG fake")
    (run_dir / "analysis" / ".hidden.csv").write_text("a\n1\n")
    assert "analysis/learning_curves.png" in operator.run(session.session).files
    assert operator.run_file(session.session, "analysis/learning_curves.png").headers["content-type"] == "image/png"
    for name in ("test_predictions.csv", "split.csv", "analysis/.hidden.csv", "../training.json",
                 "model/bank/bottom.safetensors", "%2e%2e/%2e%2e/state-bank/psi-sessions.log"):
        with pytest.raises(PeerError, match="HTTP 404"):
            operator.run_file(session.session, name)
    with pytest.raises(PeerError, match="HTTP 404"):
        operator.run("notasession")


def test_a_stopped_alignment_commits_nothing(services) -> None:
    operator, _, _ = services
    job = operator.start_alignment(AlignmentRequest(partners=["partner"]))
    operator.stop_job(job.job_id)
    assert _wait(operator, job.job_id, ("stopped", "failed", "succeeded")) == "stopped"
    assert "stopped by the operator" in operator.job(job.job_id).error
    assert operator.alignment() is None
    operator.wait(operator.start_alignment(AlignmentRequest(partners=["partner"])))  # the partner took it well
    assert operator.alignment().rows > 1000


def test_new_resources_are_for_the_banks_own_operator_only(services, pki) -> None:
    _, _, bank = services
    with BankOperator(bank.url, TLSFiles.from_dir(pki, "bank2"), name="bank2") as stranger:
        for call in (stranger.partners, stranger.runs, stranger.jobs):
            with pytest.raises(PeerError):
                call()


def test_a_partner_that_drags_or_floods_its_answer_is_cut_off(pki, bank_full: Path, tmp_path: Path, start_bank,
                                                             monkeypatch) -> None:
    """A dishonest partner's /ready: a byte at a time (never ending), or a flood with a body that is not JSON.
    The probe ends within its deadline, reads a bounded answer, and shows a short reason."""
    import asyncio

    from starlette.applications import Starlette
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    from bank.service import probe

    async def drip(request):
        async def forever():
            while True:
                yield b" "
                await asyncio.sleep(0.3)
        return StreamingResponse(forever(), media_type="application/json")

    async def flood(request):
        return Response(b"<" * (8 << 20), status_code=503)

    dragging = ServerThread(Starlette(routes=[Route("/ready", drip)]), TLSFiles.from_dir(pki, "partner")).start()
    flooding = ServerThread(Starlette(routes=[Route("/ready", flood)]), TLSFiles.from_dir(pki, "partner2")).start()
    silent = socket.create_server(("127.0.0.1", 0))  # accepts, never starts TLS: the handshake waits
    try:
        monkeypatch.setattr(probe, "PROBE_SECONDS", 1.5)
        paths = prepare_bank_marketing(tmp_path / "data", rows=300, cache=bank_full.parent, download=False)
        bank = start_bank(paths["bank"], {"partner": dragging.url, "partner2": flooding.url,
                                          "silent": f"https://127.0.0.1:{silent.getsockname()[1]}"})
        with BankOperator(bank.url, TLSFiles.from_dir(pki, "bank")) as operator:
            for _ in range(2):  # the second while the silent partner's first probe still waits: it shares it
                started = time.monotonic()
                found = {p.name: p for p in operator.partners().partners}
                took = time.monotonic() - started
                # The deadline (1.5 s) and the slack of a loaded machine; without it, the silent partner's TLS
                # handshake alone waits 10 s.
                assert took < 6, took
                assert not found["silent"].reachable and "did not answer within 2 s" in found["silent"].problem
            assert sum(t.name == "probe-silent" for t in threading.enumerate()) == 1
    finally:
        dragging.stop()
        flooding.stop()
        silent.close()
    assert not found["partner"].reachable and "did not answer within 2 s" in found["partner"].problem
    assert found["partner2"].reachable and not found["partner2"].ready
    assert found["partner2"].problem == "not ready (HTTP 503)"


def test_odd_run_folders_degrade_alone_and_links_are_not_served(tmp_path: Path) -> None:
    from bank.service.runs import run_detail, run_files, run_summary

    runs = tmp_path / "runs"
    odd = runs / "odd"
    (odd / "analysis").mkdir(parents=True)
    (odd / "training.json").write_text("{not json")
    (odd / "metrics.json").write_text('{"test": null, "best_epoch": NaN}')
    (odd / "history.csv").write_text("")
    (odd / "test_predictions.csv").write_text("position,customer_id,score\n0,C1,0.3\n")
    (odd / "analysis" / "preds.csv").symlink_to(odd / "test_predictions.csv")
    (odd / "analysis" / "roc_pr.png").write_bytes(b"\x89PNG")
    summary = run_summary(odd, "finished")
    assert summary.test == {} and summary.alignment_id is None
    detail = run_detail(odd, "finished")
    assert detail.history == [] and detail.config == {} and detail.metrics["best_epoch"] is None
    assert run_files(odd) == ["metrics.json", "history.csv", "analysis/roc_pr.png"]


# --- the console's guard -----------------------------------------------------------------------------------


@pytest.fixture()
def console(services) -> Iterator[tuple[str, str]]:
    operator, _, _ = services
    app = create_console(operator)
    server = ServerThread(app, None).start()
    yield server.url, app.state.token
    server.stop()


def test_the_console_answers_only_under_its_secret_path_and_its_own_name(console, services) -> None:
    url, token = console
    for path in ("/", "/jobs/x", "/static/console.js", f"/{token[:-1]}/", "/%C3%A9/", f"/x/{token}/"):
        assert httpx.get(url + path).status_code == 404, path
    assert httpx.post(url + "/trainings", data={"settings": "{}"}).status_code == 404
    # Another name for this address (DNS rebinding) is refused, secret or not.
    assert httpx.get(url + f"/{token}/", headers={"host": "attacker.example:80"}).status_code == 421
    assert httpx.get(url + f"/{token}").headers["location"] == f"/{token}/"  # its links are relative to it
    with httpx.Client(base_url=f"{url}/{token}/") as browser:
        home = browser.get("")
        assert home.status_code == 200 and "Partnership" in home.text and "partner2" in home.text
        assert f'<base href="/{token}/">' in home.text
        policy = home.headers["content-security-policy"]
        assert "script-src 'self'" in policy and "frame-ancestors 'none'" in policy
        assert home.headers["referrer-policy"] == "same-origin" and "<script>" not in home.text
        # A form posted from another origin (a page on another port of 127.0.0.1) is refused.
        forged = browser.post("alignments", data={"max_overlap": "0.99"}, headers={"origin": "http://127.0.0.1:1"})
        assert forged.status_code == 403
        # Settings are checked as the CLI checks them, and the reason is on the page.
        refused = browser.post("trainings", data={"settings": '{"hidden": [8]}', "epochs": "2"})
        assert refused.status_code == 422 and "belongs under" in refused.text
        refused = browser.post("trainings", data={"settings": "{", "epochs": ""})
        assert refused.status_code == 422 and "the settings box: not a readable JSON" in refused.text
        refused = browser.post("trainings", data={"settings": "{}", "epochs": "two"})
        assert refused.status_code == 422 and "the epochs field: &#39;two&#39; is not a whole number" in refused.text
        assert 'value="two"' in refused.text  # the fields keep what was typed
        refused = browser.post("trainings", data={"settings": "{}", "epochs": "0"})
        assert refused.status_code == 422 and "the epochs field: Input should be greater than" in refused.text
        refused = browser.post("alignments", data={"partners": "nobody"})
        assert refused.status_code == 422 and "unknown partners" in refused.text
        refused = browser.post("alignments", data={"expect_overlap": "7"})
        assert refused.status_code == 422 and "expect_overlap" in refused.text
        assert browser.get("jobs/nosuchjob").status_code == 404
        assert browser.get("runs/nosuchrun").status_code == 404
        assert browser.post("jobs/nosuchjob/stop").status_code == 404
        # A stop that comes after the job ended (it finished between the page's last poll and the click) lands
        # on the job's own page, its result and why nothing was stopped.
        operator = services[0]
        job = operator.start_alignment(AlignmentRequest(partners=["partner"]))
        operator.wait(job)
        late = browser.post(f"jobs/{job.job_id}/stop")
        assert late.status_code == 409 and 'id="stop-refused"' in late.text and "has ended (succeeded)" in late.text
        assert 'id="aligned"' in late.text and 'id="stop-form"' not in late.text


def test_text_a_partner_wrote_cannot_script_the_console() -> None:
    """A job's progress and error can carry a partner's words (its refusal's reason): they are text, never code."""
    from parties.protocol.control import JobStatus

    hostile = "</script><script>window.owned = 1</script><img src=x onerror=alert(1)>"

    class Operator:
        def job(self, job_id: str) -> JobStatus:
            return JobStatus(job_id=job_id, kind="training", state="failed", progress=hostile, error=hostile,
                             curve=[{"epoch": 1.0, "train_loss": 0.5}])

    app = create_console(Operator())  # type: ignore[arg-type]
    server = ServerThread(app, None).start()
    try:
        with httpx.Client(base_url=server.url) as browser:
            page = browser.get(f"/{app.state.token}/jobs/abc").text
    finally:
        server.stop()
    assert hostile not in page and "<img src=x" not in page and "<script>window.owned" not in page
    assert "\\u003c/script\\u003e" in page  # in the page's JSON block, escaped
    assert "&lt;/script&gt;" in page  # in the page's text, escaped


def test_the_console_refuses_an_address_beyond_this_machine(pki) -> None:
    done = subprocess.run([sys.executable, "-m", "bank", "console", "--url", "https://127.0.0.1:9", "--tls-dir",
                           str(pki), "--host", "0.0.0.0"], capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)
    assert done.returncode == 2 and "--host 0.0.0.0" in done.stderr and "Traceback" not in done.stderr
    done = subprocess.run([sys.executable, "-m", "bank", "console", "--url", "https://127.0.0.1:9", "--tls-dir",
                           str(pki)], capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)
    assert done.returncode != 0 and "did not answer" in done.stderr and "Traceback" not in done.stderr


def test_the_walkthrough_with_the_console_serves_its_parties_until_stopped(bank_full: Path, tmp_path: Path) -> None:
    """``python -m bank walkthrough --console``, the newcomer's way: the parties' services and the console, which
    sees the partner ready; Ctrl-C stops them all."""
    env = {**os.environ, "CUTLAYER_DATA_DIR": str(bank_full.parent)}
    process = subprocess.Popen([sys.executable, "-m", "bank", "walkthrough", "--console", "--console-port", "0",
                                "--rows", "2000", "--workers", "1", "--out", str(tmp_path / "run"), "--no-download"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    try:
        lines = []
        while not (link := re.search(r"http://127\.0\.0\.1:\d+/[\w-]+/", "".join(lines))):
            line = process.stdout.readline()
            assert line, f"the walkthrough printed no link: {''.join(lines)} {process.stderr.read()}"
            lines.append(line)
        bank_url = re.search(r"the bank service is at (https://127\.0\.0\.1:\d+)", "".join(lines)).group(1)
        assert str(tmp_path / "run" / "data" / "bank" / "bank.csv") in "".join(lines)  # a file to score, named
        with httpx.Client() as browser:
            home = browser.get(link.group(0), follow_redirects=True)
        assert home.status_code == 200 and re.search(r'data-name="partner">.*?ready', home.text, re.DOTALL)
    finally:
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) in (0, 130)  # 130: the shell's code for Ctrl-C
    assert "Traceback" not in process.stderr.read()
    with pytest.raises(httpx.ConnectError):  # the bank service stopped with it
        httpx.get(bank_url + "/health", verify=False)
    refused = subprocess.run([sys.executable, "-m", "bank", "walkthrough", "--console", "--epochs", "3"],
                             capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)
    assert refused.returncode == 2 and "--epochs" in refused.stderr and "training form" in refused.stderr


# --- in a real browser -------------------------------------------------------------------------------------


def _browser_or_skip():
    required = os.environ.get("CUTLAYER_BROWSER_TESTS") == "required"
    missing = [tool for tool in ("chromium", "chromedriver") if shutil.which(tool) is None]
    try:
        from selenium import webdriver
    except ImportError:
        missing.append("the selenium package")
    if missing:
        reason = f"the browser tests need {', '.join(missing)} (apt-get install chromium chromium-driver)"
        if required:
            pytest.fail(reason)
        pytest.skip(reason)
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = shutil.which("chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1280,1400"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(executable_path=shutil.which("chromedriver")), options=options)


@pytest.fixture()
def browser() -> Iterator[object]:
    driver = _browser_or_skip()
    yield driver
    driver.quit()


def _console_process(url: str, pki: Path) -> tuple[subprocess.Popen, str]:
    """``python -m bank console`` as the docs start it, on a free port: the process and the link it printed."""
    process = subprocess.Popen([sys.executable, "-m", "bank", "console", "--url", url, "--tls-dir", str(pki),
                                "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    for _ in range(5):
        line = process.stdout.readline()
        if found := re.search(r"http://127\.0\.0\.1:\d+/[\w-]+/", line):
            return process, found.group(0)
    process.kill()
    raise AssertionError(f"the console printed no link: {process.stderr.read()}")


def test_align_train_inspect_and_score_in_the_browser(services, browser, pki, tmp_path: Path) -> None:
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    operator, paths, bank = services
    process, link = _console_process(bank.url, pki)
    shots = Path(os.environ.get("CUTLAYER_CONSOLE_SHOTS", tmp_path / "shots"))
    shots.mkdir(parents=True, exist_ok=True)
    # A job's page reloads itself when the job ends: an element read as it does is found again.
    wait = WebDriverWait(browser, 120, poll_frequency=0.2,
                         ignored_exceptions=[NoSuchElementException, StaleElementReferenceException])
    try:
        browser.get(link)
        partner_row = browser.find_element(By.CSS_SELECTOR, 'tr.partner[data-name="partner"]')
        assert "ready" in partner_row.text and "partner partner" in partner_row.text
        assert "unreachable" in browser.find_element(By.CSS_SELECTOR, 'tr.partner[data-name="partner2"]').text
        browser.save_screenshot(str(shots / "console-home.png"))

        # Align with the partner that answers.
        browser.find_element(By.NAME, "partners").send_keys("partner")
        browser.find_element(By.ID, "start-alignment").click()
        wait.until(lambda b: b.find_element(By.ID, "state").text == "succeeded")
        aligned = browser.find_element(By.ID, "aligned").text
        assert int(aligned.split()[0].replace(",", "")) > 1000

        # Train; the curve grows while it trains, the traffic table fills; stop it once it has two epochs. (No
        # early stopping, and epochs enough that it is still training when the click comes on a fast machine.)
        browser.find_element(By.LINK_TEXT, "Partnership, jobs and runs").click()
        box = browser.find_element(By.ID, "settings")
        box.clear()
        box.send_keys('{"batch_size": 32, "patience": 60, "partners": ["partner"], "top": {"hidden": [16]}}')
        browser.find_element(By.ID, "epochs").send_keys("60")
        browser.find_element(By.ID, "start-training").click()
        wait.until(lambda b: int(b.find_element(By.ID, "curve").get_attribute("data-epochs") or 0) >= 2)
        traffic = browser.find_elements(By.CSS_SELECTOR, "#traffic tr.traffic-row")
        assert traffic and traffic[0].text.startswith("partner") and int(traffic[0].text.split()[1].replace(",", "")) > 0
        points = browser.execute_script("return Chart.getChart('curve').data.datasets[0].data.length")
        assert points >= 2
        browser.save_screenshot(str(shots / "console-training.png"))
        browser.find_element(By.ID, "stop").click()
        wait.until(lambda b: b.find_element(By.ID, "state").text == "stopped")
        assert "stopped by the operator" in browser.find_element(By.ID, "job-error").text

        # Resume the stopped session from the home page; it trains to the end.
        browser.find_element(By.LINK_TEXT, "Partnership, jobs and runs").click()
        browser.find_element(By.XPATH, "//section[@id='sessions']//button[text()='Resume']").click()
        wait.until(lambda b: b.find_element(By.ID, "state").text == "succeeded")
        browser.find_element(By.ID, "run-link").click()

        # The run: its metrics, its curve from history.csv, its analysis and audit, the manifest to download.
        session = browser.current_url.rstrip("/").rsplit("/", 1)[1]
        run = operator.run(session)
        shown = browser.find_element(By.ID, "test-metrics").text
        assert f"{run.metrics['test']['roc_auc']:.4f}" in shown
        assert browser.execute_script("return Chart.getChart('curve').data.datasets[0].data.length") == len(run.history)
        manifest = browser.find_element(By.ID, "manifest").get_attribute("href")
        assert manifest.endswith(f"/runs/{session}/files/manifest.json")
        # The notebook's analysis of this run (``python -m bank.lab report`` writes the same files) shows once it
        # is written; the leakage audit's table too (here a stand-in: its real one needs the partner's files).
        from bank.lab.report.analysis import load_run, write_report

        run_dir = Path(bank.app.state.settings.state_path) / "runs" / session
        written = write_report(load_run(run_dir), references=False, audit=False)
        pd.DataFrame({"partner": ["partner"], "attack": ["norm"], "auc": [0.51]}).to_csv(
            run_dir / "analysis" / "label_leakage.csv", index=False)
        browser.refresh()
        images = browser.find_elements(By.CSS_SELECTOR, "img.figure")
        assert len(images) == len(written["figures"])
        for image in images:  # each loaded, through the console and the bank service
            assert browser.execute_script("return arguments[0].naturalWidth", image) > 0
        assert "communication" in browser.find_element(By.TAG_NAME, "main").text
        assert "0.51" in browser.find_element(By.ID, "audit-label_leakage").text
        browser.save_screenshot(str(shots / "console-run.png"))

        # Score the bank's own file through the page, and download the scores.
        customers = tmp_path / "customers.csv"
        pd.read_csv(paths["bank"]).drop(columns=["y"]).head(200).to_csv(customers, index=False)
        browser.find_element(By.LINK_TEXT, "score customers with this model").click()
        browser.find_element(By.ID, "customers").send_keys(str(customers))
        browser.find_element(By.ID, "start-scoring").click()
        wait.until(lambda b: b.find_element(By.ID, "state").text == "succeeded")
        scored = browser.find_element(By.ID, "scored").text
        assert re.search(r"\d+ of 200 customers scored", scored)
        assert "joint" in browser.find_element(By.ID, "models").text
        browser.save_screenshot(str(shots / "console-scoring.png"))
        href = browser.find_element(By.ID, "download-scores").get_attribute("href")
        downloaded = httpx.get(href)
        assert downloaded.status_code == 200 and downloaded.text.startswith("customer_id")
        assert len(downloaded.text.strip().splitlines()) == 201
    finally:
        process.terminate()
        process.wait(timeout=30)
