"""The models every party builds: a seeded MLP (bottoms, tops, trunks, server layers), their optimizers, and the
loss a task trains on, wherever the loss is computed (the bank's top, or a vanilla compute party's server)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from parties.learning.config import BottomConfig, OptimizerConfig, TaskKind

__all__ = ["BottomConfig", "OptimizerConfig", "build_bottom", "build_optimizer", "check_targets", "mlp",
           "prepare_optimizers", "task_loss"]


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


def task_loss(kind: TaskKind, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The loss of a task on a model's outputs, the same wherever it is computed.

    binary: one logit per row, targets 0/1 (float32), binary cross-entropy. multiclass: one logit per class,
    targets class indices (int64), cross-entropy. regression: one output per row, targets already
    standardised (``bank.task.Task.loss_targets``), mean squared error.
    """
    if kind == "binary":
        return F.binary_cross_entropy_with_logits(outputs.squeeze(1), targets)
    if kind == "multiclass":
        return F.cross_entropy(outputs, targets)
    return F.mse_loss(outputs.squeeze(1), targets)


def check_targets(kind: TaskKind, targets: torch.Tensor, rows: int, classes: int) -> str | None:
    """What is wrong with targets a peer sent for ``task_loss`` (``None``: nothing): one per row, of the task's
    dtype and range. A class index outside ``[0, classes)`` would fail inside cross-entropy, a NaN train on."""
    if targets.shape != (rows,):
        return f"one target per row ({rows}), not shape {tuple(targets.shape)}"
    if kind == "multiclass":
        if targets.dtype != torch.int64 or (rows and not (0 <= int(targets.min()) and int(targets.max()) < classes)):
            return f"multiclass targets are int64 class indices in [0, {classes})"
        return None
    if targets.dtype != torch.float32 or not bool(torch.isfinite(targets).all()):
        return f"{kind} targets are finite float32"
    if kind == "binary" and not bool(((targets == 0) | (targets == 1)).all()):
        return "binary targets are 0 or 1"
    return None
