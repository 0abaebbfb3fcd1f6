"""A training step's torch calls without their Python wrappers: the same kernels, in the same order.

On the small models of tabular split learning a step's arithmetic takes a few
hundred microseconds, and ``nn.Module.__call__``, ``Tensor.backward`` and
``Optimizer.step`` add a quarter on top (hook checks, argument normalisation,
profiler records, grouping tensors by device) — more inside a service, whose
networking pushes that Python out of the caches between steps. Every split
step waits on it, at the partner and at the bank.

These functions call what those wrappers call, and fall back to the wrappers
whenever a model or optimiser is anything but what ``parties.learning.model`` builds
(a plain ``Linear``/``ReLU`` stack without hooks, fused Adam with defaults).
The results are bit for bit those of the wrappers: ``tests/test_fast_path.py``
compares them, and the exactness tests compare split training, which uses
these, with the unsplit model, which does not.

What they call is torch's inside (``Variable._execution_engine``,
``torch._fused_adam_``, the modules' and optimisers' hook registries), so it
is used only on a torch version it was verified against (``VERIFIED_TORCH``)
and while ``CUTLAYER_FAST_PATH`` allows it (``parties.speed``); otherwise every
function here is the public call it stands for. Nothing private is touched
before that decision, so a torch without one of these internals still imports
this module, and uses the public path.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from parties import speed

# ``ACTIVE`` (``status().active``) is an attribute too, decided on first use (``__getattr__`` below).
__all__ = ["VERIFIED_TORCH", "backward", "clear_grads", "forward", "grad", "optimizer_step", "refresh", "serves",
           "status"]

logger = logging.getLogger(__name__)

#: torch versions (without a local part such as ``+cpu``) whose internals this module was checked against.
VERIFIED_TORCH = frozenset({"2.13.0"})


class _Internals:
    """The torch internals the fast path calls, looked up once; ``AttributeError`` if this torch lacks one."""

    def __init__(self) -> None:
        from torch.nn.modules import module
        from torch.optim import optimizer

        self.run_backward = torch.autograd.Variable._execution_engine.run_backward
        # Registries that torch mutates in place: holding them sees every later registration.
        self.global_hooks = (
            module._global_forward_hooks, module._global_forward_pre_hooks, module._global_backward_hooks,
            module._global_backward_pre_hooks, module._global_forward_hooks_always_called,
        )
        self.global_optimizer_hooks = (optimizer._global_optimizer_pre_hooks,
                                       optimizer._global_optimizer_post_hooks)
        self.foreach_add_ = torch._foreach_add_
        self.fused_adam_ = torch._fused_adam_


# The decision is the process's: it depends on the installed torch and the environment, nothing else.
_lock = threading.Lock()
_decided: tuple[speed.Gate, _Internals | None] | None = None


def refresh() -> speed.Gate:
    """Decide again from ``torch.__version__`` and the environment (the first call decides on its own)."""
    global _decided
    with _lock:
        gate = speed.decide("torch fast path", {"torch": torch.__version__}, {"torch": VERIFIED_TORCH})
        internals = None
        if gate.active:
            try:
                internals = _Internals()
            except AttributeError as exc:
                gate = speed.Gate(gate.name, False, f"torch {torch.__version__} lacks an internal it uses: {exc}")
        _decided = (gate, internals)
    _announce(gate)
    return gate


@functools.lru_cache(maxsize=None)
def _announce(gate: speed.Gate) -> None:
    logger.info("%s", gate)


def status() -> speed.Gate:
    """Whether the fast path is active in this process, and why."""
    decided = _decided
    return refresh() if decided is None else decided[0]


def __getattr__(name: str) -> Any:
    if name == "ACTIVE":  # ``fast_path.ACTIVE``: decided on first use, not at import
        return status().active
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _fast() -> _Internals | None:
    decided = _decided
    if decided is None:
        refresh()
        decided = _decided
        assert decided is not None
    return decided[1]


def _plain(model: nn.Module, internals: _Internals) -> bool:
    """A ``Sequential`` of ``Linear`` and (not in-place) ``ReLU`` layers, with no hooks anywhere."""
    if type(model) is not nn.Sequential or any(internals.global_hooks):
        return False
    layers = list(model)
    if any(type(m) is not nn.Linear and not (type(m) is nn.ReLU and not m.inplace) for m in layers):
        return False
    return not any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
                   for m in (model, *layers))


def serves(model: nn.Module) -> bool:
    """Whether the fast path is active and ``model`` is what it was verified on (the plain MLP): anything else
    trains on torch's public calls, its backward and optimizer step included (``public=True`` below)."""
    internals = _fast()
    return internals is not None and _plain(model, internals)


def forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``model(x)``; for a plain MLP, each layer's functional form directly."""
    internals = _fast()
    if internals is None or not _plain(model, internals):
        return model(x)
    for layer in model:
        x = F.linear(x, layer.weight, layer.bias) if type(layer) is nn.Linear else torch.relu(x)
    return x


def backward(
    output: torch.Tensor, grad_output: torch.Tensor | None = None, inputs: Sequence[torch.Tensor] = (),
    public: bool = False,
) -> None:
    """``output.backward(grad_output, inputs=inputs)``: accumulate into the leaves' ``.grad``.

    ``grad_output`` may be left out for a scalar ``output``, as with ``backward``. ``public``: that call itself.
    """
    internals = None if public else _fast()
    if internals is None:
        torch.autograd.backward(output, grad_output, inputs=tuple(inputs) or None)
        return
    if grad_output is None:
        grad_output = torch.ones_like(output, memory_format=torch.preserve_format)
    internals.run_backward((output,), (grad_output,), False, False, tuple(inputs), True, True)


def grad(loss: torch.Tensor, inputs: Sequence[torch.Tensor], *, retain_graph: bool,
         public: bool = False) -> tuple[torch.Tensor, ...]:
    """``torch.autograd.grad(loss, inputs, retain_graph=...)`` for a scalar ``loss``; ``public``: that call."""
    internals = None if public else _fast()
    if internals is None:
        return torch.autograd.grad(loss, inputs, retain_graph=retain_graph)
    ones = torch.ones_like(loss, memory_format=torch.preserve_format)
    return internals.run_backward((loss,), (ones,), retain_graph, False, tuple(inputs), False, False)


def clear_grads(params: Sequence[torch.Tensor]) -> None:
    """``optimizer.zero_grad(set_to_none=True)`` for these parameters (public on either path)."""
    for p in params:
        p.grad = None


def _fused_adam(optimizer: torch.optim.Optimizer, internals: _Internals) -> dict | None:
    """The one parameter group of a fused Adam with defaults, if that is what ``optimizer`` is."""
    if type(optimizer) is not torch.optim.Adam or len(optimizer.param_groups) != 1:
        return None
    group = optimizer.param_groups[0]
    plain = (group["fused"] and not group["amsgrad"] and not group["maximize"] and not group["capturable"]
             and not group["differentiable"] and not group["decoupled_weight_decay"]
             and not isinstance(group["lr"], torch.Tensor)
             and getattr(optimizer, "grad_scale", None) is None and getattr(optimizer, "found_inf", None) is None
             and not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks
             and not any(internals.global_optimizer_hooks))
    return group if plain else None


def optimizer_step(optimizer: torch.optim.Optimizer, public: bool = False) -> None:
    """``optimizer.step()``; for fused Adam, its CPU kernel directly (``public``: ``step()`` itself).

    The first step (no state yet) goes through ``step()``, which creates the
    state exactly as usual; so does anything but fused Adam with defaults.
    """
    internals = None if public else _fast()
    group = None if internals is None else _fused_adam(optimizer, internals)
    if group is None or internals is None:
        optimizer.step()
        return
    params = [p for p in group["params"] if p.grad is not None]
    states = [optimizer.state.get(p) for p in params]
    if not params or not all(states) or any(p.device.type != "cpu" or p.is_complex() for p in params):
        optimizer.step()
        return
    steps = [s["step"] for s in states]
    internals.foreach_add_(steps, 1)
    beta1, beta2 = group["betas"]
    internals.fused_adam_(
        params, [p.grad for p in params], [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], [],
        steps, amsgrad=False, lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"],
        eps=group["eps"], maximize=False, grad_scale=None, found_inf=None,
    )
