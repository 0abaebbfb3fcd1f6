"""The README and the docs are true: the README's first lines install and run, the by-hand flow trains the
walkthrough's model, every page is in the site's nav and every link and path they name exists."""

from __future__ import annotations

import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
import unicodedata
from pathlib import Path

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from parties.storage.layout import bank_folder, model_folder

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs"


def _page(relative: str) -> str:
    """A docs page's text, e.g. ``_page("how-to/by-hand.md")``."""
    return (DOCS / relative).read_text()


def _doc_files() -> list[Path]:
    """README.md and every Markdown page of the docs site."""
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def _bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def _commands(block: str) -> list[list[str]]:
    """The block's commands as argv lists: continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [argv for line in joined.splitlines() if (argv := shlex.split(line, comments=True))]


def test_the_readme_opens_with_a_venv_the_install_and_the_two_commands() -> None:
    first = _bash_blocks(README)[0]
    assert README.index(first) < README.index("## ")  # before any section
    lines = [" ".join(argv) for argv in _commands(first)]
    assert lines[0].startswith("python3 -m venv .venv") and ". .venv/bin/activate" in lines[0]
    assert lines[1] == "pip install torch==2.13.0 && pip install -e .[test]"
    assert lines[2:] == ["python -m bank walkthrough", "python -m pytest"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "torch==2.13.0" in ci and "'.[test]'" in ci
    # CI runs the README's test command, then the slow tests it leaves out (pyproject's addopts: -m 'not slow').
    ran = [" ".join(argv) for argv in _commands(ci) if argv[:3] == ["python", "-m", "pytest"]]
    assert ran == ["python -m pytest", "python -m pytest -m slow"]
    assert "-m 'not slow'" in (ROOT / "pyproject.toml").read_text()


def test_the_by_hand_flow_writes_nothing_git_would_pick_up(tmp_path: Path) -> None:
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout")
    for path in ("demo/ca/ca.key", "demo/bank/bank.key", "demo/state/bank/runs/x/model/top.safetensors",
                 "notebooks/analysis.nbconvert.ipynb", "runs/20260101-000000/certs/ca.key"):
        check = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT)
        assert check.returncode == 0, f"{path}: demo/ (with the development CA's private key) is not ignored by git"


def test_the_readme_points_only_at_what_a_clone_has() -> None:
    """README.md and every docs page: no path outside a clone, and every module or notebook they name exists."""
    assert len(_doc_files()) > 10, "the docs pages are missing"
    for doc in _doc_files():
        text, name = doc.read_text(), doc.relative_to(ROOT)
        assert "../shared" not in text, name  # the developers' shared folder is not part of a clone
        for path in re.findall(r"`((?:bank|parties|partner|alignment|data|notebooks|tests)/[\w./-]+\.(?:py|ipynb))`", text):
            assert (ROOT / path).exists() or ".nbconvert." in path, f"{name} names {path}, which does not exist"


def _slug(heading: str) -> str:
    """A heading's anchor as MkDocs (Python-Markdown's toc) writes it."""
    text = re.sub(r"[`*]|\[([^]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text).strip().lower())


def _anchors(page: Path) -> set[str]:
    prose = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)  # a "# comment" in a block is no heading
    return {_slug(h) for h in re.findall(r"^#{1,6} +(.+?) *$", prose, flags=re.M)}


def test_every_docs_page_is_in_the_nav_and_every_relative_link_resolves() -> None:
    """Cheap checks of what ``mkdocs build --strict`` would refuse, and of the README's links, which it never sees."""
    config = (ROOT / "mkdocs.yml").read_text()
    assert re.search(r"^docs_dir: docs$", config, flags=re.M)
    in_nav = set(re.findall(r"^\s+- (?:[^\n]*?: )?([\w./-]+\.md)$", config, flags=re.M))
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert pages - in_nav == set(), f"docs pages missing from mkdocs.yml's nav: {sorted(pages - in_nav)}"
    assert in_nav - pages == set(), f"mkdocs.yml's nav names pages that do not exist: {sorted(in_nav - pages)}"

    for doc in _doc_files():
        prose = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.S | re.M)
        for target in re.findall(r"\]\(([^)\s]+)\)", prose):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            resolved = (doc.parent / path).resolve() if path else doc
            where = f"{doc.relative_to(ROOT)} links to {target}"
            assert resolved.is_file(), f"{where}, which does not exist"
            if doc.is_relative_to(DOCS):
                assert resolved.is_relative_to(DOCS), f"{where}, outside docs/ (the site cannot serve it)"
            if anchor and resolved.suffix == ".md":
                assert anchor in _anchors(resolved), f"{where}: {resolved.name} has no heading #{anchor}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _by_hand_block() -> str:
    return _bash_blocks(_page("how-to/by-hand.md"))[0]


def _run_as_written(block: str, ports: dict[str, str], tmp_path: Path, adjust=lambda argv: argv) -> dict:
    """Run a docs block's commands as written, but for ``ports`` (fixed ones -> free ones) and ``adjust``
    (argv -> argv); each ``serve`` in the background until it listens. Returns each other command's output by
    (module, command). The caller stops the services: they are in the returned ``"services"``."""
    services: list[subprocess.Popen[bytes]] = []
    outputs: dict = {"services": services}
    pattern = r"\b(" + "|".join(ports) + r")\b"
    for argv in _commands(block):
        assert argv[:2] == ["python", "-m"], argv
        argv = [sys.executable, "-m", *(re.sub(pattern, lambda m: ports[m.group(1)], a) for a in argv[2:])]
        argv = adjust(argv)
        module, command = argv[2], argv[3]
        if command == "serve":
            ready = tmp_path / f"{module}.ready"
            log = (tmp_path / f"{module}.log").open("wb")
            services.append(subprocess.Popen([*argv, "--workers", "1", "--ready-file", str(ready)], cwd=tmp_path,
                                             stdout=log, stderr=subprocess.STDOUT))
            deadline = time.monotonic() + 120
            while not ready.exists():
                assert services[-1].poll() is None, (tmp_path / f"{module}.log").read_text()[-3000:]
                assert time.monotonic() < deadline, f"{module} did not start"
                time.sleep(0.05)
            continue
        run = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, f"{' '.join(argv)}:\n{run.stderr[-3000:]}"
        outputs[(module, command)] = run
    return outputs


def _stop(services: list) -> None:
    for proc in services:
        proc.terminate()
        proc.wait(30)


def test_the_by_hand_flow_as_written_trains_the_walkthroughs_model(bank_full: Path, tmp_path: Path) -> None:
    """Run the by-hand commands as the docs write them (on a slice, fewer epochs, free ports), then the walkthrough
    with the same slice and epochs: every weight of every party and every test score must be equal."""
    rows, epochs = "3000", "2"
    ports = {"8443": str(_free_port()), "8444": str(_free_port())}
    small = {("data", "bank-marketing"): ["--rows", rows, "--cache-dir", str(bank_full.parent), "--no-download"],
             ("bank", "train"): ["--epochs", epochs]}
    outputs: dict = {"services": []}
    try:
        outputs = _run_as_written(_by_hand_block(), ports, tmp_path,
                                  lambda argv: argv + small.get((argv[2], argv[3]), []))
    finally:
        _stop(outputs["services"])
    train_output = outputs[("bank", "train")].stdout

    model_id = re.search(r"^model id: (\w+)$", train_output, flags=re.M)
    assert model_id, f"train did not print the model id:\n{train_output}"
    assert f"--model {model_id.group(1)}" in train_output  # and the next command to run
    by_hand_run = tmp_path / "demo" / "state" / "bank" / "runs" / model_id.group(1)
    by_hand_partner = model_folder(tmp_path / "demo" / "state" / "partner", "bank", model_id.group(1))

    out = tmp_path / "walkthrough"
    run = subprocess.run(
        [sys.executable, "-m", "bank", "walkthrough", "--out", str(out), "--rows", rows, "--epochs", epochs,
         "--cache-dir", str(bank_full.parent), "--no-download", "--workers", "1"],
        capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    session = next((bank_folder(out / "partner", "bank") / "models").iterdir()).name
    walkthrough_run = out / "bank" / "runs" / session

    pairs = [(by_hand_run / "model" / f, walkthrough_run / "model" / f)
             for f in ("top.safetensors", "bank/bottom.safetensors")]
    pairs.append((by_hand_partner / "bottom.safetensors", model_folder(out / "partner", "bank", session) / "bottom.safetensors"))
    for a, b in pairs:
        ta, tb = load_file(str(a)), load_file(str(b))
        assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta), f"{a.name} differs"
    pd.testing.assert_frame_equal(pd.read_csv(by_hand_run / "test_predictions.csv"),
                                  pd.read_csv(walkthrough_run / "test_predictions.csv"), check_exact=True)


def _own_data_block() -> str:
    return _bash_blocks(_page("how-to/own-data.md"))[0]


def test_the_own_data_flow_as_written_runs_on_pre_split_files(tmp_path: Path) -> None:
    """The "Your own data" commands as the docs write them, on a bank's and a partner's files made the way two
    organisations hold them (generic column names, integer IDs), free ports for its fixed ones."""
    from tests.test_own_files import write_pair

    write_pair(tmp_path, "binary", rows=1200)
    ports = {"8450": str(_free_port()), "8451": str(_free_port())}
    block = _own_data_block()
    before, after = block.split("python -m bank score", 1)
    outputs: dict = {"services": []}
    try:
        outputs = _run_as_written(before, ports, tmp_path)
        trained = outputs[("bank", "train")].stdout
        model_id = re.search(r"^model id: (\w+)$", trained, flags=re.M).group(1)
        assert "partner: 1,200 of the bank's 1,200 customers matched (100.0%)" in outputs[("bank", "align")].stderr
        _run_as_written("python -m bank score" + after.replace("MODEL_ID", model_id), ports, tmp_path)
    finally:
        _stop(outputs["services"])
    assert model_id is not None
    scores = pd.read_csv(tmp_path / "scores.csv")
    assert len(scores) == 1200 and (scores["status"] == "scored").all()
    comparison = pd.read_csv(tmp_path / "cutlayer-state" / "lender" / "runs" / model_id / "analysis" / "comparison.csv")
    assert "split model (this run)" in set(comparison["model"])
