"""Bottom models: a configurable MLP from a party's encoded columns to its cut-layer embedding."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from parties.learning.config import BottomConfig, OptimizerConfig

__all__ = ["BottomConfig", "OptimizerConfig", "build_bottom", "build_optimizer", "mlp", "prepare_optimizers"]


def mlp(in_dim: int, hidden: Sequence[int], out_dim: int, *, activate_output: bool, seed: int) -> nn.Sequential:
    """An MLP whose initial weights depend only on its shape and ``seed``.

    Layers are created without storage and initialised from a private
    generator, exactly as PyTorch's default ``nn.Linear`` initialisation but
    without the global RNG: two parties building models in one process, in
    two threads, cannot disturb each other's weights.
    """
    layers: list[nn.Module] = []
    width = in_dim
    for h in hidden:
        layers += [nn.Linear(width, h, device="meta"), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, out_dim, device="meta"))
    if activate_output:
        layers.append(nn.ReLU())
    model = nn.Sequential(*layers).to_empty(device="cpu")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model:
            if isinstance(layer, nn.Linear):
                nn.init.kaiming_uniform_(layer.weight, a=math.sqrt(5), generator=generator)
                bound = 1 / math.sqrt(layer.in_features) if layer.in_features > 0 else 0.0
                nn.init.uniform_(layer.bias, -bound, bound, generator=generator)
    return model


def build_bottom(in_dim: int, config: BottomConfig, seed: int | None = None) -> nn.Sequential:
    """The bottom MLP; the same (in_dim, config) always gives the same initial weights. ``seed`` overrides
    the config's: a config whose seed is None (the party's secret) needs it."""
    seed = config.seed if seed is None else seed
    if seed is None:
        raise ValueError("this bottom's initial weights come from its party's secret: its trainer builds it")
    return mlp(in_dim, config.hidden, config.cut_width, activate_output=True, seed=seed)


def build_optimizer(params: Iterable[nn.Parameter], config: OptimizerConfig) -> torch.optim.Optimizer:
    # Fused Adam: one kernel per step instead of a dozen small ops per tensor from Python, which
    # on these small models is most of an optimiser step. Every party and the unsplit reference use it.
    if config.optimizer == "adam":
        return torch.optim.Adam(params, lr=config.learning_rate, weight_decay=config.weight_decay, fused=True)
    return torch.optim.SGD(params, lr=config.learning_rate, weight_decay=config.weight_decay)


def prepare_optimizers() -> None:
    """Build every optimizer once, on a throwaway parameter, so no training session pays its first use.

    torch imports what its optimizers need (``torch._dynamo``, about a second) when the first one is
    built: a service calls this at start-up, off the training path. Public calls only; building an
    optimizer has no other lasting effect.
    """
    param = nn.Parameter(torch.zeros(1))
    for name in ("adam", "sgd"):
        build_optimizer([param], OptimizerConfig(optimizer=name))
