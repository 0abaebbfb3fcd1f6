"""parties.learning.fast_path: the step's torch calls without wrappers give the wrappers' results, bit for bit,
on a verified torch with the switch on; anything else takes the public API, with the same results."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from parties import speed
from parties.learning import fast_path
from parties.learning.model import OptimizerConfig, build_optimizer, mlp

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def path_as(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """``path_as(version=..., switch=...)``: decide the path for another torch version or switch, for one test."""

    def choose(version: str | None = None, switch: str | None = None) -> speed.Gate:
        if version is not None:
            monkeypatch.setattr(torch, "__version__", version)
        if switch is not None:
            monkeypatch.setenv(speed.ENV_VAR, switch)
        return fast_path.refresh()

    yield choose
    monkeypatch.undo()
    fast_path.refresh()  # the process's own decision again, for the tests that follow


def _pair(seed: int = 3) -> tuple[nn.Sequential, nn.Sequential]:
    return mlp(12, (32, 16), 8, activate_output=True, seed=seed), mlp(12, (32, 16), 8, activate_output=True, seed=seed)


def _train(model: nn.Sequential, optimizer: torch.optim.Optimizer, fast: bool, steps: int = 25) -> list[torch.Tensor]:
    """``steps`` steps of the bottom-model pattern: forward, backward with a given gradient, optimiser step."""
    gen = torch.Generator().manual_seed(0)
    params = list(model.parameters())
    outputs = []
    for _ in range(steps):
        x = torch.randn(64, 12, generator=gen)
        g = torch.randn(64, 8, generator=gen)
        if fast:
            z = fast_path.forward(model, x)
            fast_path.clear_grads(params)
            fast_path.backward(z, g)
            fast_path.optimizer_step(optimizer)
        else:
            z = model(x)
            optimizer.zero_grad(set_to_none=True)
            z.backward(g)
            optimizer.step()
        outputs.append(z.detach())
    return outputs


@pytest.mark.parametrize(
    "config",
    [OptimizerConfig(), OptimizerConfig(weight_decay=0.01, learning_rate=0.02), OptimizerConfig(optimizer="sgd")],
    ids=["adam", "adam-weight-decay", "sgd"],
)
def test_a_training_run_equals_the_wrappers(config: OptimizerConfig) -> None:
    a, b = _pair()
    slow = _train(a, build_optimizer(a.parameters(), config), fast=False)
    fast = _train(b, build_optimizer(b.parameters(), config), fast=True)
    assert all(torch.equal(x, y) for x, y in zip(slow, fast))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(next(a.parameters()), mlp(12, (32, 16), 8, activate_output=True, seed=3)[0].weight)


def test_fused_adam_runs_its_kernel_directly_after_the_first_step() -> None:
    model, _ = _pair()
    optimizer = build_optimizer(model.parameters(), OptimizerConfig())
    calls = []
    original = optimizer.step
    optimizer.step = lambda *a, **k: (calls.append(1), original(*a, **k))[1]  # type: ignore[method-assign]
    _train(model, optimizer, fast=True, steps=5)
    # On the fast path the first step creates the state and the others go straight to the kernel.
    assert len(calls) == (1 if fast_path.ACTIVE else 5)
    assert all(float(s["step"]) == 5 for s in optimizer.state.values())


def test_a_model_with_a_hook_or_other_layers_goes_through_its_call() -> None:
    model, _ = _pair()
    x = torch.randn(4, 12)
    seen = []
    handle = model[0].register_forward_hook(lambda m, i, o: seen.append(o.shape))
    assert torch.equal(fast_path.forward(model, x), model(x)) and len(seen) == 2
    handle.remove()
    dropout = nn.Sequential(nn.Linear(12, 4), nn.Dropout(0.5))
    dropout.eval()
    assert torch.equal(fast_path.forward(dropout, x), dropout(x))
    dropout.train()
    torch.manual_seed(0)
    expected = dropout(x)
    torch.manual_seed(0)
    assert torch.equal(fast_path.forward(dropout, x), expected)


def test_grad_and_backward_with_inputs_equal_autograds() -> None:
    top = mlp(8, (16,), 1, activate_output=False, seed=1)
    a, b = torch.randn(32, 4, requires_grad=True), torch.randn(32, 4, requires_grad=True)
    loss = nn.functional.binary_cross_entropy_with_logits(
        fast_path.forward(top, torch.cat([a, b], dim=1)).squeeze(1), (torch.arange(32) % 3 == 0).float())
    (expected,) = torch.autograd.grad(loss, [b], retain_graph=True)
    (got,) = fast_path.grad(loss, [b], retain_graph=True)
    assert torch.equal(got, expected) and b.grad is None
    params = list(top.parameters())
    reference = [torch.autograd.grad(loss, [p], retain_graph=True)[0] for p in params]
    fast_path.backward(loss, inputs=[*params, a])
    assert all(torch.equal(p.grad, r) for p, r in zip(params, reference))
    assert a.grad is not None and b.grad is None  # only the named inputs accumulate


# --- the gate: which path, and the public one gives the same results ---------------------------------------


def test_this_pass_runs_the_path_its_switch_names() -> None:
    """The suite runs the path its switch names (on, in CI): a torch CI installs must be a verified one, or this
    says what to verify. The public path is compared with it here and in the exactness tests (the unsplit model)."""
    gate = fast_path.status()
    assert gate.active is speed.switched_on(), (
        f"{gate}: with the switch on, torch {torch.__version__} must be a verified version; verify the fast path "
        "on it (this file and the exactness tests) and add it to fast_path.VERIFIED_TORCH")
    assert fast_path.ACTIVE is gate.active


@pytest.mark.parametrize(("version", "switch", "active"), [
    ("2.13.0+cpu", "1", True), ("2.13.0", "", True), ("2.14.0+cpu", "1", False), ("2.12.1", "1", False),
    ("2.13.0", "0", False), ("2.13.0", "off", False), ("2.13.0", "FALSE", False), ("2.13.0", "nonsense", False),
], ids=["verified-local", "verified", "newer", "older", "off-0", "off", "off-upper", "unrecognised"])
def test_the_gate_needs_a_verified_torch_and_the_switch_on(path_as, version: str, switch: str, active: bool) -> None:
    gate = path_as(version=version, switch=switch)
    assert gate.active is active and fast_path.ACTIVE is active
    assert (version.split("+")[0] in gate.reason) or (speed.ENV_VAR in gate.reason)


def test_an_unverified_torch_takes_the_public_path_with_the_same_results(path_as, monkeypatch) -> None:
    reference_model, model = _pair()
    reference = _train(reference_model, build_optimizer(reference_model.parameters(), OptimizerConfig()), fast=False)
    public = path_as(version="2.99.0+cpu", switch="1")
    assert not public.active and "2.99.0+cpu not verified" in public.reason

    def no_internals() -> None:
        raise AssertionError("the public path looked up a torch internal")

    monkeypatch.setattr(fast_path, "_Internals", no_internals)
    optimizer = build_optimizer(model.parameters(), OptimizerConfig())
    calls = []
    original = optimizer.step
    optimizer.step = lambda *a, **k: (calls.append(1), original(*a, **k))[1]  # type: ignore[method-assign]
    outputs = _train(model, optimizer, fast=True, steps=25)
    assert len(calls) == 25  # every step through ``Optimizer.step``
    assert all(torch.equal(x, y) for x, y in zip(reference, outputs))
    assert all(torch.equal(p, q) for p, q in zip(reference_model.parameters(), model.parameters()))


def test_both_paths_give_the_same_grad_and_backward(path_as) -> None:
    results = []
    for switch in ("1", "0"):
        gate = path_as(version="2.13.0", switch=switch)
        assert gate.active is (switch == "1")
        top = mlp(8, (16,), 1, activate_output=False, seed=1)
        gen = torch.Generator().manual_seed(5)
        a = torch.randn(32, 4, generator=gen, requires_grad=True)
        b = torch.randn(32, 4, generator=gen, requires_grad=True)
        loss = nn.functional.binary_cross_entropy_with_logits(
            fast_path.forward(top, torch.cat([a, b], dim=1)).squeeze(1), (torch.arange(32) % 3 == 0).float())
        (theirs,) = fast_path.grad(loss, [b], retain_graph=True)
        fast_path.backward(loss, inputs=[*top.parameters(), a])
        scalar = fast_path.forward(top, torch.cat([a, b], dim=1)).sum()
        fast_path.backward(scalar)  # no grad_output for a scalar, no inputs: every leaf
        assert b.grad is not None
        results.append([theirs, a.grad, b.grad, *(p.grad for p in top.parameters())])
    assert all(torch.equal(x, y) for x, y in zip(*results))


def test_a_verified_torch_without_an_internal_takes_the_public_path(path_as, monkeypatch) -> None:
    def lacking() -> None:
        raise AttributeError("module 'torch' has no attribute '_fused_adam_'")

    monkeypatch.setattr(fast_path, "_Internals", lacking)
    gate = path_as(version="2.13.0", switch="1")
    assert not gate.active and "lacks an internal it uses" in gate.reason and "_fused_adam_" in gate.reason


def test_a_torch_without_the_internals_still_imports_the_module() -> None:
    """Nothing private is looked up at import: a torch that dropped them imports and trains on the public path."""
    code = (
        "import torch\n"
        "del torch.autograd.Variable._execution_engine\n"  # what a newer torch might no longer have
        "from parties.learning import fast_path\n"
        "gate = fast_path.status()\n"
        "assert not gate.active and '_execution_engine' in gate.reason, gate\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), speed.ENV_VAR: "1"})
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_the_decision_is_logged_once(path_as, caplog) -> None:
    caplog.set_level("INFO", logger="parties.learning.fast_path")
    path_as(version="2.77.0", switch="1")
    path_as(version="2.77.0", switch="1")
    lines = [r.getMessage() for r in caplog.records if "2.77.0" in r.getMessage()]
    assert lines == [
        "torch fast path: off, the public API instead (torch 2.77.0 not verified (verified: torch 2.13.0))"]
