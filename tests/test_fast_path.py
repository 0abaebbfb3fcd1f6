"""parties.learning.fast_path: the step's torch calls without wrappers give the wrappers' results, bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from parties.learning import fast_path
from parties.learning.model import OptimizerConfig, build_optimizer, mlp


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
    assert len(calls) == 1  # the first step creates the state; the others go straight to the kernel
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
