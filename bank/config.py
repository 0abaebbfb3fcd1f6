"""The bank's training configuration: what the operator chooses for one training run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, ValidationError, model_serializer,
                      model_validator)

from parties.errors import ConfigError
from parties.flags import Flag
from parties.learning.config import BottomConfig, LocalSteps, OptimizerConfig, TaskKind, check_factory_name

__all__ = ["AggregationName", "json_settings", "GradientDefenseName", "MAX_AUTO_BATCH", "MIN_AUTO_BATCH", "TaskKind", "TopConfig", "TrainingConfig",
           "default_batch_size"]

# Here rather than beside their torch code (bank/task.py, bank/vertical/aggregation.py): this module stays light
# enough for the command line's --help to read its defaults.
AggregationName = Literal["concat", "sum", "mean"]
GradientDefenseName = Literal["none", "max_norm", "isotropic", "marvell", "matched"]


#: The adaptive batch size's bounds: bank-full's 36,168 training rows get the largest, which it was tuned at;
#: a table of a few hundred rows gets about ten steps an epoch instead of one.
MIN_AUTO_BATCH, MAX_AUTO_BATCH = 16, 1024


def default_batch_size(train_rows: int) -> int:
    """The largest power of two at most a tenth of ``train_rows``, within [MIN_AUTO_BATCH, MAX_AUTO_BATCH]."""
    batch = MIN_AUTO_BATCH
    while batch * 2 <= min(MAX_AUTO_BATCH, train_rows / 10):
        batch *= 2
    return batch


class TopConfig(OptimizerConfig):
    """The bank's top model: an MLP of ``hidden`` widths, or the bank's own module from ``factory``."""

    factory: str | None = Field(None, description="the bank's own top model: MODULE:FUNCTION, a function installed "
                                "where the bank's service runs, called as FUNCTION(in_width, out_width) with the "
                                "aggregated embeddings' width and the task's output width")
    hidden: tuple[int, ...] = (32,)
    seed: int = 1

    @model_validator(mode="after")
    def _factory_alone(self) -> TopConfig:
        if self.factory is not None:
            check_factory_name(self.factory)
            if "hidden" in self.model_fields_set:
                raise ValueError(f"hidden: a setting of the built-in top, not of your own ({self.factory}), which "
                                 "decides its own architecture; leave it out")
        return self

    @model_serializer(mode="wrap")
    def _without_hidden(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        if self.factory is not None:
            data.pop("hidden", None)
        return data


class TrainingConfig(BaseModel):
    """Defaults are the walkthrough's: they reach the quality bar on bank-full."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    task: TaskKind | None = Field(None, description="what the label is (default: the bank's: its service's --task, "
                                  "its schema file's, or what its label's values show)")
    positive_label: str | None = Field(None, description="binary: the label value that counts as positive "
                                       "(default: 'yes' if present, else the second in sorted order)")
    aggregation: AggregationName = Field("concat", description="how the top model combines the embeddings")
    bank_bottom: BottomConfig = BottomConfig()
    top: TopConfig = TopConfig()
    epochs: int = Field(40, ge=1, le=10_000, description="at most this many epochs (early stopping after patience "
                        "epochs without improvement)")
    batch_size: int | None = Field(None, ge=1, le=1 << 16, description="training rows per step (default: adapts "
                                   f"to the table: the largest power of two at most a tenth of the training rows, "
                                   f"from {MIN_AUTO_BATCH} to {MAX_AUTO_BATCH})")
    eval_batch_size: int = Field(8192, ge=1, le=1 << 16, description="rows per step when scoring")
    patience: int = Field(6, ge=1, description="epochs without a better validation score before stopping")
    stratify: bool = Field(False, description="stratify the train/validation/test split by label: its shuffles then "
                           "come from the bank's secret (a partner that replayed a stratified split read the labels), "
                           "so the split is reproducible only with defense_seed; default: a split from the public "
                           "seed that says nothing of the labels")
    val_fraction: float = Field(0.1, gt=0, lt=0.5, description="share of the aligned rows kept to choose the epoch")
    test_fraction: float = Field(0.1, gt=0, lt=0.5, description="share of the aligned rows kept to test on")
    seed: int = Field(0, description="seed of the split and the batch order (public: every party sees the order)")
    max_steps: int | None = Field(None, ge=1, description="stop after this many steps (tests, smoke runs)")
    restore_best: bool = Field(True, description="end with the weights of the best validation epoch")
    # A checkpoint costs each party about a millisecond of CPU (an fsync'ed write) beside training; a step on
    # bank-full takes about one. Every 500 steps bounds what a crash loses to a second or so of training.
    checkpoint_every: int = Field(
        500, ge=0, description="every party checkpoints every N steps (0: at epoch ends only)"
    )
    partners: Annotated[list[str] | None, Flag(metavar="NAME,NAME")] = Field(
        None, description="the partners to train with (default: every configured partner)")
    label_dp_epsilon: float | None = Field(
        None, gt=0, description="randomized-response label DP: flip each training label once, with prob 1/(1+e^ε)"
    )
    gradient_defense: GradientDefenseName = Field(
        "none", description="perturb the gradients the partners receive (against label inference): matched "
        "(each class gets the other's covariance, both the same noise along their mean difference), marvell (the "
        "paper's model: label-free attacks read it), isotropic, max_norm"
    )
    gradient_noise: float = Field(1.0, ge=0, description="isotropic: noise std in units of the mean gradient norm")
    # 4 by measurement (bank-full, 8000 rows, 8 epochs, seeds 0-2): the per-epoch norm and direction leak AUCs
    # fall from 0.97 and 1.0 to 0.53 and 0.57 for 0.016 of test ROC-AUC; s = 1 leaves 0.61 and 0.63, and s = 16
    # costs 0.04. Per-step noise averages out across epochs: the row-mean attacks still reach 0.66 and 0.78.
    marvell_power: Annotated[float, Flag(metavar="S")] = Field(
        4.0, gt=0, allow_inf_nan=False, description="matched, marvell: the noise power s, in units of the squared "
        "distance between the two classes' mean gradients in a batch (matched: the variance added along that "
        "difference; marvell: the noise's mean squared norm per row)",
    )
    marvell_persistence: Annotated[float, Flag(metavar="RHO")] = Field(
        0.0, ge=0, le=1, description="matched, marvell: the share of each row's noise drawn once for the whole run "
        "rather than at every step; per batch the noise is the same, across epochs it no longer averages away",
    )
    wire_precision: Literal["fp32", "fp16", "bf16", "int8"] = Field(
        "fp32", description="how step embeddings and gradients travel: fp32 is exact (split equals unsplit, bit for "
        "bit); fp16/bf16 halve the bytes, int8 (per-row scales) quarters them (parties/protocol/codec.py)",
    )
    local_steps: Annotated[int, Flag(metavar="K")] = Field(
        1, ge=1, le=32, description="communication-efficient mode (in the spirit of FedBCD): each round trip "
        "carries local_steps batches, and every party makes one update per batch from that round trip's "
        "embeddings and gradients, one round trip stale; 1 (the default) is exact: split equals unsplit, bit for "
        "bit",
    )
    reuse_steps: Annotated[int, Flag(metavar="R")] = Field(
        0, ge=0, le=64, description="with local_steps > 1: further updates per round trip at every party from the "
        "last two round trips' batches, each row weighted by how little its embedding has moved (CELU-VFL style)",
    )
    track_test: bool = Field(
        False, description="also score the test rows after every epoch (history column test_<metric>; never "
        "used to choose anything): learning curves and time-to-target figures",
    )
    defense_seed: int | None = Field(
        None, description="pin the bank's protective noise (label DP, gradient noise, Marvell) for a study that "
        "must repeat; a partner that knows the pin can regenerate the noise. Default: a secret the bank draws "
        "from the operating system for each session and keeps in its run folder",
    )
    audit: bool = Field(
        False,
        description="record, for analysis only, the gradients each partner received and the embeddings the "
        "bank received (the notebook's leakage audit); costs disk, and one extra embedding release",
    )

    @model_validator(mode="after")
    def _binary_only(self) -> TrainingConfig:
        # A task left to the bank (None) is checked again once it is known (``resolved``).
        if self.label_dp_epsilon is not None and self.task not in (None, "binary"):
            raise ValueError("randomized-response label DP is implemented for binary tasks")
        if self.gradient_defense in ("marvell", "matched") and self.task not in (None, "binary"):
            raise ValueError(f"the {self.gradient_defense} gradient defense is for binary tasks (it hides one class "
                             "from the other)")
        return self

    @model_validator(mode="after")
    def _exchange_fits(self) -> TrainingConfig:
        if self.batch_size is not None and self.local_steps * self.batch_size > 1 << 16:
            raise ValueError("local_steps x batch_size is at most 65536 rows per round trip")
        if self.reuse_steps and self.local_steps == 1:
            raise ValueError("reuse_steps needs local_steps > 1 (local_steps 1 is the exact mode)")
        return self

    @property
    def local(self) -> LocalSteps:
        """The session's mode as every party runs it."""
        if self.local_steps == 1:
            return LocalSteps()
        return LocalSteps(steps=self.local_steps, batch=self.batch, reuse=self.reuse_steps)

    @property
    def protects(self) -> bool:
        """Whether the bank draws protective noise in this session (label DP, a gradient defense)."""
        return self.label_dp_epsilon is not None or self.gradient_defense != "none" or self.stratify

    @property
    def batch(self) -> int:
        """The batch size of a resolved configuration (``resolved``)."""
        if self.batch_size is None:
            raise ValueError("batch_size is not resolved yet: TrainingConfig.resolved() sets it from the table")
        return self.batch_size

    def resolved(self, task: TaskKind, train_rows: int, *, why_task: str = "the bank's") -> tuple[TrainingConfig, dict[str, str]]:
        """This configuration with every setting that adapts to the table set, and what each was set to and why.

        ``task``: the bank's label's (used unless this configuration names one); ``train_rows``: the split's.
        A setting given explicitly is kept as it is.
        """
        chosen: dict[str, str] = {}
        values = self.model_dump()
        if self.task is None:
            values["task"] = task
            chosen["task"] = f"{task} ({why_task})"
        if self.batch_size is None:
            values["batch_size"] = default_batch_size(train_rows)
            chosen["batch_size"] = (f"{values['batch_size']} (adapts to the table: {train_rows:,} training rows, "
                                    f"{-(-train_rows // values['batch_size'])} steps an epoch; give --batch-size "
                                    "to choose)")
        try:
            return TrainingConfig.model_validate(values), chosen
        except ValidationError as exc:
            from parties.settings import describe_problems

            raise ConfigError(f"invalid training settings for this {values['task']} task: "
                              f"{describe_problems(exc, lambda loc: '.'.join(map(str, loc)))}") from exc

    @model_validator(mode="after")
    def _fractions(self) -> TrainingConfig:
        if self.val_fraction + self.test_fraction >= 0.8:
            raise ValueError("validation and test fractions leave too few training rows")
        return self


def json_settings(path: Path | None, example: str) -> dict[str, Any]:
    """The settings object a ``--config`` file holds (``{}`` without one); a clear refusal for anything else."""
    if path is None:
        return {}
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: not a readable JSON file ({exc})") from exc
    return json_text_settings(text, str(path), example)


def json_text_settings(text: str, where: str, example: str) -> dict[str, Any]:
    """The settings object ``text`` holds (``{}`` if blank), read from ``where`` (named in a refusal)."""
    if not text.strip():
        return {}
    try:
        values = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: not a readable JSON file ({exc})") from exc
    if not isinstance(values, dict):
        raise ConfigError(f"{where}: settings are a JSON object, e.g. {example}")
    return values
