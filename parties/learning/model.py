"""The models every party builds: a seeded MLP (bottoms, tops, trunks, server layers), the built-in bottom's column
embeddings, a party's own bottom from its factory, their optimizers, and the loss a task trains on, wherever the
loss is computed (the bank's top, or a vanilla compute party's server)."""

from __future__ import annotations

import importlib
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from parties.errors import ConfigError
from parties.learning.config import BottomConfig, OptimizerConfig, TaskKind
from parties.tables.encoding import InputLayout

__all__ = ["BottomConfig", "Drawing", "InputLayout", "OptimizerConfig", "Randomness", "TabularBottom", "build_bottom",
           "build_optimizer", "build_top", "check_targets", "ends_in_relu", "load_factory", "mlp", "own_module",
           "prepare_optimizers", "task_loss"]


class TopLike(Protocol):
    """What ``build_top`` reads of ``bank.config.TopConfig`` (which this module cannot import)."""

    hidden: tuple[int, ...]
    seed: int


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


class TabularBottom(nn.Module):
    """The built-in bottom with embeddings of its columns before the MLP (Gorishniy et al., NeurIPS 2022).

    Numeric columns: with ``numeric_embedding="ple"`` each arrives as its piecewise-linear bins (the encoder's,
    ``parties.tables.encoding``), with ``"periodic"`` as its z-score, turned into ``frequencies`` learned sin/cos
    pairs; either then goes through a linear layer and ReLU of its own (``numeric_width`` wide). Categorical
    columns: with ``category_width`` each one-hot block is multiplied by a learned table, one row per category
    (an unseen category, all zeros, gets zeros). Initial weights come from ``seed`` alone, as ``mlp``'s do.
    """

    def __init__(self, layout: InputLayout, config: BottomConfig, seed: int) -> None:
        super().__init__()
        # Without numeric columns there is nothing to embed but the categories.
        self.layout, self.mode = layout, config.numeric_embedding if layout.numeric else "none"
        generator = torch.Generator().manual_seed(seed)
        m = len(layout.numeric)
        self.numeric_in = sum(layout.numeric)
        if self.mode == "periodic" and any(c != 1 for c in layout.numeric):
            raise ConfigError("periodic embeddings take each numeric column as one number, not as bins")
        if self.mode == "none":
            width = self.numeric_in
        else:
            # One linear layer per numeric column, batched: each column's input padded to the widest.
            parts = 2 * config.frequencies if self.mode == "periodic" else max(layout.numeric, default=1)
            if self.mode == "periodic":
                self.frequencies = nn.Parameter(torch.randn(m, config.frequencies, generator=generator)
                                                * config.frequency_scale)
            else:
                self.register_buffer("_spread", _spread(layout.numeric), persistent=False)
            bound = 1 / math.sqrt(parts)
            self.weight = nn.Parameter(torch.empty(m, parts, config.numeric_width).uniform_(-bound, bound, generator=generator))
            self.bias = nn.Parameter(torch.empty(m, config.numeric_width).uniform_(-bound, bound, generator=generator))
            width = m * config.numeric_width
        self.tables = nn.ParameterList()
        if config.category_width:
            bound = 1 / math.sqrt(config.category_width)
            for size in layout.categories:
                self.tables.append(nn.Parameter(torch.empty(size, config.category_width).uniform_(
                    -bound, bound, generator=generator)))
            width += len(layout.categories) * config.category_width
        else:
            width += sum(layout.categories)
        self.mlp = mlp(width, config.hidden, config.cut_width, activate_output=True,
                       seed=int(torch.randint(1 << 62, (1,), generator=generator)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        numbers, rest = x[:, : self.numeric_in], x[:, self.numeric_in :]
        parts = []
        if self.mode == "none":
            parts.append(numbers)
        else:
            if self.mode == "periodic":
                angles = 2 * math.pi * numbers[:, :, None] * self.frequencies
                columns = torch.cat([torch.sin(angles), torch.cos(angles)], dim=2)
            else:  # each column's bins, padded with zeros to the widest column's
                columns = numbers @ self._spread
                columns = columns.view(len(x), len(self.layout.numeric), -1)
            parts.append(torch.relu(torch.einsum("nmp,mpd->nmd", columns, self.weight) + self.bias).flatten(1))
        if len(self.tables):
            start = 0
            for size, table in zip(self.layout.categories, self.tables):
                parts.append(rest[:, start : start + size] @ table)
                start += size
        else:
            parts.append(rest)
        return self.mlp(torch.cat(parts, dim=1))


def _spread(components: Sequence[int]) -> torch.Tensor:
    """The 0/1 matrix that places each column's bins in a block as wide as the widest column's."""
    widest = max(components, default=1)
    spread = torch.zeros(sum(components), len(components) * widest)
    start = 0
    for j, c in enumerate(components):
        spread[start + torch.arange(c), j * widest + torch.arange(c)] = 1.0
        start += c
    return spread


def load_factory(name: str, role: str = "bottom") -> Callable[[int, int], nn.Module]:
    """The function ``MODULE:FUNCTION`` names, imported from this party's own installation."""
    module_name, _, function = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{role} factory {name}: cannot import {module_name} ({exc}); install it where this "
                          "party runs") from None
    except Exception as exc:  # the party's own code failed as it was imported (a syntax error, say)
        raise ConfigError(f"{role} factory {name}: importing {module_name} failed: {type(exc).__name__}: "
                          f"{exc}") from exc
    factory = getattr(module, function, None)
    if not callable(factory):
        raise ConfigError(f"{role} factory {name}: {module_name} has no function {function}")
    return factory


#: torch's default generator is the process's: a party's own model draws from it under this lock only.
_GLOBAL_RNG = threading.RLock()


@contextmanager
def _seeded(state: torch.Tensor) -> Iterator[None]:
    with _GLOBAL_RNG, torch.random.fork_rng(devices=[]):
        torch.set_rng_state(state)
        yield


def own_module(name: str, in_width: int, out_width: int, seed: int, role: str = "bottom") -> nn.Module:
    """A party's own module from the factory ``name``, built with torch's default generator seeded from ``seed``
    and checked on a (2, in_width) batch to give (2, out_width) float32."""
    factory = load_factory(name, role)
    with _seeded(torch.Generator().manual_seed(seed).get_state()):
        try:
            model = factory(in_width, out_width)
        except Exception as exc:  # the party's own code: say whose it is
            raise ConfigError(f"{role} factory {name}({in_width}, {out_width}) failed: "
                              f"{type(exc).__name__}: {exc}") from exc
        if not isinstance(model, nn.Module):
            raise ConfigError(f"{role} factory {name} returned {type(model).__name__}, not a torch module")
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                out = model(torch.zeros(2, in_width))
        except Exception as exc:
            raise ConfigError(f"{role} factory {name}: its model fails on a (2, {in_width}) float32 "
                              f"batch: {type(exc).__name__}: {exc}") from exc
        model.train(was_training)
    if not isinstance(out, torch.Tensor) or out.shape != (2, out_width) or out.dtype != torch.float32:
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        what = "the cut width" if role == "bottom" else "the task's output width"
        raise ConfigError(f"{role} factory {name}: its model maps (2, {in_width}) to {shape}, not "
                          f"(2, {out_width}) float32 ({what})")
    return model


class Drawing(nn.Module):
    """A module of the party's own whose random draws (dropout) come from a stream it carries as a buffer: the
    stream is part of its ``state_dict``, so a checkpoint, a rollback and the best epoch's weights all hold it,
    and a resumed run draws what the uninterrupted one would have. Evaluation draws from the stream without
    moving it (the same batch always scores the same)."""

    def __init__(self, model: nn.Module, seed: int) -> None:
        super().__init__()
        self.model = model
        self.register_buffer("random_state", torch.Generator().manual_seed(seed).get_state())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with _seeded(self.random_state):
            out = self.model(x)
            if self.training:
                self.random_state.copy_(torch.get_rng_state())
        return out


def build_top(in_width: int, config: TopLike, out_width: int) -> nn.Module:
    """The bank's top: an MLP of ``config.hidden`` (no activation after the last layer), or the bank's own module
    from ``config.factory`` (``Drawing``), seeded from ``config.seed`` either way."""
    factory = getattr(config, "factory", None)
    if factory is None:
        return mlp(in_width, config.hidden, out_width, activate_output=False, seed=config.seed)
    # Training mode, whatever mode the factory left its module in: the coordinator trains it from here.
    return Drawing(own_module(factory, in_width, out_width, config.seed, "top"), config.seed).train()


class Randomness:
    """The random numbers a party's own model draws (dropout, say) from torch's default generator, as a stream of
    its own: the same seed gives the same draws, another thread's draws do not shift them, and the stream's state
    is part of a checkpoint, so a resumed session draws what the uninterrupted one would have."""

    def __init__(self, seed: int) -> None:
        self.state = torch.Generator().manual_seed(seed).get_state()

    @contextmanager
    def drawing(self) -> Iterator[None]:
        with _seeded(self.state):
            yield
            self.state = torch.get_rng_state()


def ends_in_relu(model: nn.Module) -> bool:
    """Whether the model's output passes a ReLU last (where it is 0, a gradient reaches no weight)."""
    if isinstance(model, TabularBottom):
        model = model.mlp
    return isinstance(model, nn.Sequential) and len(model) > 0 and isinstance(model[-1], nn.ReLU)


def build_bottom(inputs: int | InputLayout, config: BottomConfig, seed: int | None = None) -> nn.Module:
    """The bottom model; the same (inputs, config) always gives the same initial weights. ``inputs``: the
    encoded columns' layout (``EncodedRows.layout``, ``TabularEncoder.layout``), or a width of plain numbers.
    ``seed`` overrides the config's: a config whose seed is None (the party's secret) needs it.

    The defaults give the plain MLP (``mlp``), as does ``category_width`` without categorical columns; column
    embeddings give a ``TabularBottom``; a factory, the party's own module, built with torch's default generator
    seeded from ``seed`` and checked on a batch.
    """
    seed = config.seed if seed is None else seed
    if seed is None:
        raise ValueError("this bottom's initial weights come from its party's secret: its trainer builds it")
    layout = InputLayout.dense(inputs) if isinstance(inputs, int) else inputs
    if config.factory is not None:
        return own_module(config.factory, layout.width, config.cut_width, seed)
    if (config.numeric_embedding == "none" or not layout.numeric) and not (config.category_width and layout.categories):
        return mlp(layout.width, config.hidden, config.cut_width, activate_output=True, seed=seed)  # nothing to embed
    return TabularBottom(layout, config, seed)


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
