"""A party's learning settings: its bottom model and optimizer, embedding DP and NoPeek, the hijack monitor.

Plain pydantic models, apart from the torch code that uses them, so the command lines and the
settings classes can state their defaults without importing torch.
"""

from __future__ import annotations

import argparse
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer, model_validator

from parties.flags import Flag

__all__ = ["BottomConfig", "LocalSteps", "MonitorConfig", "MonitorFlags", "NumericEmbedding", "OptimizerConfig",
           "PartnerDefenses", "PrivacyConfig", "PrivacyFlags", "TaskKind", "check_factory_name"]

#: What the bank's label is: it decides the loss, the metrics and how a label column is validated.
TaskKind = Literal["binary", "multiclass", "regression"]


class OptimizerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    optimizer: Literal["adam", "sgd"] = Field("adam", description="the optimizer")
    learning_rate: Annotated[float, Flag("lr")] = Field(5e-3, gt=0, description="learning rate")
    weight_decay: float = Field(0.0, ge=0, description="L2 weight decay")


#: ``BottomConfig``'s settings of the built-in bottom only: refused beside a factory.
BUILT_IN_ONLY = ("hidden", "numeric_embedding", "bins", "frequencies", "frequency_scale", "numeric_width",
                 "category_width")

#: How the built-in bottom takes its numeric columns (``parties.learning.model``; Gorishniy et al., NeurIPS 2022):
#: as z-scores, piecewise-linear over quantile bins of the training rows, or through learned periodic features.
NumericEmbedding = Literal["none", "ple", "periodic"]


class BottomConfig(OptimizerConfig):
    """A party's own bottom model: its architecture, optimizer and seed are its own business.

    The built-in bottom is an MLP over the encoded columns, with optional embeddings of the columns before it;
    ``factory`` names the party's own model instead, a function it installs locally (the code never leaves it).
    """

    factory: Annotated[str | None, Flag("bottom", metavar="MODULE:FUNCTION")] = Field(
        None, description="your own bottom model instead of the built-in one: a function in a module this party "
        "has installed, called as FUNCTION(in_width, cut_width) with the encoded width of its columns and the cut "
        "width, returning a torch module that maps (rows, in_width) float32 to (rows, cut_width). Its code stays "
        "here; only the embedding width is sent")
    hidden: tuple[int, ...] = Field((64,), description="hidden layer widths, comma-separated")
    cut_width: int = Field(16, ge=1, le=4096, description="embedding width sent to the bank")
    numeric_embedding: NumericEmbedding = Field(
        "none", description="how the built-in bottom takes numeric columns: none (z-scores), ple (piecewise-linear "
        "over --bins quantile bins fitted on this party's training rows) or periodic (learned sin/cos features, "
        "then a linear layer and ReLU per column)")
    bins: int = Field(16, ge=2, le=256, description="ple: quantile bins per numeric column (fewer where the "
                      "training rows have fewer distinct values)")
    frequencies: int = Field(16, ge=1, le=256, description="periodic: learned frequencies per numeric column")
    frequency_scale: float = Field(0.1, gt=0, le=100, description="periodic: the initial frequencies' standard "
                                   "deviation")
    numeric_width: int = Field(8, ge=1, le=256, description="ple, periodic: each numeric column's embedding width "
                               "(a linear layer and ReLU per column)")
    category_width: int = Field(0, ge=0, le=256, description="learned embedding width of each categorical column "
                                "(0: its one-hot goes to the MLP as it is)")
    seed: Annotated[int | None, Flag(parse=lambda text: _seed(text))] = Field(
        0, description="the initial weights' seed, or 'secret' (None in a file) to draw them from this party's "
        "secret, so a counterparty cannot rebuild them (a partner with the hijack monitor on defaults to secret)")

    @property
    def built_in(self) -> bool:
        return self.factory is None

    @model_serializer(mode="wrap")
    def _without_built_in(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """With a factory, the built-in bottom's settings are not this model's: they are not written (a file, a
        checkpoint, the bank's request), so reading it back does not take them for settings given."""
        data = handler(self)
        if self.factory is not None:
            for name in BUILT_IN_ONLY:
                data.pop(name, None)
        return data

    @property
    def encoder_bins(self) -> int:
        """Quantile bins the party's encoder fits per numeric column (0: none, z-scores only)."""
        return self.bins if self.numeric_embedding == "ple" and self.built_in else 0

    @model_validator(mode="after")
    def _factory_alone(self) -> BottomConfig:
        if self.factory is not None:
            check_factory_name(self.factory)
            given = [f for f in BUILT_IN_ONLY if f in self.model_fields_set]
            if given:
                raise ValueError(f"{', '.join(given)}: a setting of the built-in bottom, not of your own "
                                 f"({self.factory}), which decides its own architecture; leave it out")
        return self


def check_factory_name(name: str) -> None:
    """``ValueError`` unless ``name`` reads MODULE:FUNCTION (a dotted module, a function name)."""
    module, _, function = name.partition(":")
    if not (module and function and all(p.isidentifier() for p in (*module.split("."), function))):
        raise ValueError(f"factory {name!r}: expected MODULE:FUNCTION, e.g. mypkg.models:make_bottom")


def _seed(text: str) -> int | None:
    if text == "secret":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'secret', got {text!r}") from None


class PrivacyConfig(BaseModel):
    """A partner's own privacy settings: embedding noise (off unless ``clip`` is set; obfuscation, no ε:
    ``parties.learning.embedding_noise``) and NoPeek (off at 0). Either works without the other.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    clip: float | None = Field(None, gt=0, description="L2 bound on each released embedding row (embedding noise "
                               "is off without it)")
    noise: float = Field(0.0, ge=0, description="Gaussian noise std per coordinate, drawn from this partner's own "
                         "secret")
    seed: Annotated[int | None, Flag(cli=False)] = Field(None, description="pin the partner's embedding noise for a study that must repeat (the "
                             "bank, knowing the pin, can regenerate it); default: a secret drawn for each session")
    nopeek: Annotated[float, Flag("--nopeek", metavar="ALPHA", default="0: off")] = Field(
        0.0, ge=0, allow_inf_nan=False, description="add ALPHA x the distance correlation between this partner's "
        "features and its embedding of each training batch to its own loss, so the bank decodes less of the "
        "features; costs some accuracy (more at larger ALPHA) and O(batch size squared) compute per update")

    @property
    def embedding_noise(self) -> bool:
        return self.clip is not None

    @property
    def active(self) -> bool:
        """Whether any of these settings changes what the partner computes."""
        return self.embedding_noise or self.nopeek > 0


class MonitorConfig(BaseModel):
    """The partner's hijack monitor (``parties.learning.hijack_monitor``): the rank test, the copy probes, or both.

    Off unless ``watch`` or ``probe_every`` is set.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    watch: Annotated[bool, Flag("monitor")] = Field(
        False, description="watch for a hijacking bank with the rank test: read every gradient the bank returns and "
        "stop when they move more directions than the task can, or wander further than the bank's model learns "
        "(no extra bytes; training unchanged unless it alarms; not with a bank that adds gradient noise)")
    task_rank: Annotated[int, Flag(metavar="K")] = Field(1, ge=1, le=4096, description="the rank test's task output width: 1 for a binary or regression "
                           "task, the number of classes for a multiclass one")
    window: int = Field(20, ge=1, description="training steps the rank test reads before it judges, and over which "
                        "it takes the mean off-task share")
    limit: float = Field(0.10, gt=0, lt=1, description="alarm when the window's mean off-task share of the "
                         "energy of the gradient that reaches the weights exceeds this")
    drift_window: int = Field(200, ge=1, description="training steps over which the rank test takes the wander "
                              "of the task directions (all it has read, until there are this many)")
    drift_limit: float = Field(0.20, gt=0, le=1, description="alarm when the task directions wander more than this "
                               "over the drift window (1 − the share of their mean projector on its top task_rank "
                               "directions)")
    project: bool = Field(False, description="with the rank test, apply only each gradient's task part (its fit); "
                          "the rest, where a bank that stays under the limits hides its hijack, never reaches "
                          "the weights. Training then differs slightly from an unmonitored partner's")
    on_alarm: Literal["stop", "warn"] = Field("stop", description="stop applying gradients, or log and go on")
    probe_every: Annotated[int, Flag(default="0: off")] = Field(
        0, ge=0, description="watch for a hijacking bank with copy probes every N steps (a bank that knows them "
        "evades them)")
    pairs: int = Field(4, ge=1, description="embeddings copied per probe step")
    threshold: float = Field(1e-3, gt=0, description="alarm when the median relative difference is under this")
    min_pairs: int = Field(8, ge=1, description="pairs observed before any verdict")
    seed: Annotated[int | None, Flag(cli=False)] = Field(None, description="pin which rows are probes, for a study that must repeat (a bank that "
                             "knows the pin knows the probes); default: a secret drawn for each session")

    @property
    def active(self) -> bool:
        return self.watch or self.probe_every > 0

    @model_validator(mode="after")
    def _project_needs_the_fit(self) -> MonitorConfig:
        if self.project and not self.watch:
            raise ValueError("project applies the rank test's fit: it needs the rank test (watch, --hijack-monitor)")
        return self


#: A partner's defenses as settings of its service, their flags prefixed: ``--dp-clip``, ``--hijack-window``.
PrivacyFlags = Annotated[PrivacyConfig, Flag(prefix="dp-", group=(
    "embedding noise (off unless --dp-clip is given): obfuscation against inversion, not differential privacy, and "
    "no ε is claimed (docs/explanation/privacy.md); NoPeek: embeddings that reveal less of this partner's features"))]
MonitorFlags = Annotated[MonitorConfig, Flag(prefix="hijack-", group="the hijack monitor (off unless "
                                             "--hijack-monitor or --hijack-probe-every)")]


class PartnerDefenses(BaseModel):
    """A partner's own defenses, named as its service's flags name them: what a command that starts partners
    (the walkthrough) takes and hands on to each."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    privacy: PrivacyFlags = Field(default_factory=PrivacyConfig, description="embedding noise and NoPeek")
    monitor: MonitorFlags = Field(default_factory=MonitorConfig, description="the hijack monitor")


class LocalSteps(BaseModel):
    """How a training session trades exactness for round trips (``parties.learning.bottom``).

    The default, one batch per round trip and no reuse, is exact. The bank chooses it for a session
    (``TrainingConfig.local_steps``, ``reuse_steps``) and every party runs it, its own bottom too.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    steps: int = Field(1, ge=1, le=32, description="batches per round trip, one update each")
    batch: int | None = Field(None, ge=1, le=1 << 16, description="rows per batch (the bank's batch size)")
    reuse: int = Field(0, ge=0, le=64, description="further updates per round trip from the last two round "
                       "trips' batches, each row weighted by how little its embedding has moved")

    @property
    def exact(self) -> bool:
        return self.steps == 1 and self.reuse == 0

    @model_validator(mode="after")
    def _consistent(self) -> LocalSteps:
        if self.reuse and self.steps == 1:
            raise ValueError("reuse needs local steps (steps > 1)")
        if self.steps > 1 and (self.batch is None or self.steps * self.batch > 1 << 16):
            raise ValueError(f"local steps need a batch size, with steps x batch at most 65536 rows "
                             f"(got {self.steps} x {self.batch})")
        return self
