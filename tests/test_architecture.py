"""The architecture's rules, checked on the source: who may import whom, and what an import costs.

- Packages depend in one direction: ``data`` and ``parties`` below everything, ``alignment`` on
  ``parties`` only, and the two roles (``bank``, ``partner``) never on each other.
- The product never imports the lab (``bank.lab``: simulation and study tooling). The lab plays
  every party on one machine, so it alone may import the partner's service.
- A PSI worker process needs neither FastAPI, pandas nor torch.
- A command line's ``--help`` needs none of them either: its handlers import them when they run.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("alignment", "bank", "data", "parties", "partner")

#: package -> the project packages it may import (besides itself).
ALLOWED = {
    "parties": set(),
    "alignment": {"parties"},
    "data": {"parties"},
    "partner": {"parties", "alignment"},
    "bank": {"parties", "alignment", "data"},
}


def _imports(path: Path) -> set[str]:
    """Every project module ``path`` imports, at any depth of the file (lazy imports count too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in found if name.split(".")[0] in PACKAGES}


def _modules() -> dict[str, set[str]]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            out[".".join(path.relative_to(ROOT).with_suffix("").parts)] = _imports(path)
    return out


def test_packages_depend_in_one_direction() -> None:
    wrong = [
        f"{module} imports {target}"
        for module, targets in _modules().items()
        for target in targets
        if (src := module.split(".")[0]) != (dst := target.split(".")[0]) and dst not in ALLOWED[src]
        and not (module.startswith("bank.lab") and dst == "partner")
    ]
    assert not wrong, "\n".join(wrong)


def test_the_product_never_imports_the_lab() -> None:
    wrong = [
        f"{module} imports {target}"
        for module, targets in _modules().items()
        # the configurations' walkthroughs compare with their single-process twin and audit what crossed the cut
        if not module.startswith(("bank.lab", "bank.configurations.commands"))
        for target in targets
        if target.startswith("bank.lab")
    ]
    assert not wrong, "\n".join(wrong)


def test_the_rule_checker_sees_a_forbidden_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from bank.lab.bench.training import run\n    import partner.core\n")
    assert _imports(bad) >= {"bank.lab.bench.training", "partner.core"}


def _loaded_after(statement: str) -> dict[str, object]:
    code = (
        "import json, resource, sys, time\n"
        f"t = time.perf_counter()\n{statement}\nt = time.perf_counter() - t\n"
        "heavy = sorted(m for m in ('torch', 'pandas', 'fastapi', 'starlette', 'pydantic') if m in sys.modules)\n"
        "print(json.dumps({'heavy': heavy, 'seconds': t,"
        " 'max_rss_mb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


@pytest.mark.parametrize(("statement", "allowed"), [
    ("import alignment.curve", set()),  # what a PSI worker process imports
    ("import alignment.parallel", set()),  # the pool, in every process that runs PSI
    # The protocol driver reads the PSI exchange's constants from parties.protocol.psi (pydantic messages).
    ("import alignment.psi, alignment.in_process_peer", {"pydantic"}),
    ("import parties.errors, parties.storage.files, parties.tables.ids", set()),
])
def test_light_modules_stay_light(statement: str, allowed: set[str]) -> None:
    heavy = set(_loaded_after(statement)["heavy"]) - allowed
    assert not heavy, f"{statement!r} loads {sorted(heavy)}"


@pytest.mark.parametrize("cli", ["bank", "bank.lab", "partner", "data", "parties"])
def test_a_command_line_loads_torch_pandas_and_fastapi_only_when_a_command_runs(cli: str) -> None:
    loaded = _loaded_after(f"import {cli}.__main__ as cli\ncli.build_parser()")  # what --help does
    # pydantic stays: help texts state their defaults from the settings models the commands build.
    heavy = [m for m in loaded["heavy"] if m != "pydantic"]
    assert heavy == [], f"python -m {cli} --help loads {heavy}"
