"""What the U-shaped, vanilla and horizontal configurations share: their settings, the epoch bookkeeping
(validation, early stopping, the best epoch) and the run folder, the same files as a vertical run's.

Each configuration's own step loop is in ``bank/configurations/u_shaped.py`` (U-shaped, vanilla) or ``bank/configurations/horizontal.py``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from bank.config import MAX_AUTO_BATCH, TopConfig, TrainingConfig
from bank.epochs import EpochBook
from parties.flags import Flag
from parties.learning.config import BottomConfig, OptimizerConfig
from parties.storage.files import atomic_write_text, private_dir

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["ConfigurationSettings", "Configuration", "TrunkConfig", "write_configuration_run"]

logger = logging.getLogger(__name__)

Configuration = Literal["u-shaped", "vanilla", "relay", "splitfed"]
ProgressFn = Callable[[str, float], None]


class TrunkConfig(OptimizerConfig):
    """U-shaped: the compute party's trunk, from the bank's cut width to ``width`` (ReLU after each layer)."""

    hidden: tuple[int, ...] = (64,)
    width: int = Field(32, ge=1, le=4096)
    seed: int = 2


class ConfigurationSettings(BaseModel):
    """One run of a configuration other than vertical. ``training`` holds what vertical's does (epochs, batch,
    split, seed, patience, early stopping); the models are ``bottom`` (the data owner's or each branch's),
    ``trunk`` (U-shaped, at the compute party) and ``top`` (the head: U-shaped at the bank after the trunk,
    vanilla at the compute party, horizontal at the bank)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    configuration: Configuration
    training: TrainingConfig = TrainingConfig()
    bottom: BottomConfig = BottomConfig()
    trunk: TrunkConfig = TrunkConfig()
    top: TopConfig = TopConfig()
    # 10 by measurement on bank-full (3 branches by job): every step 0.9204, every 10 steps 0.9215, once per epoch
    # 0.9178, against 0.9203 centralised; every 10 steps costs a tenth of the averaging round trips of every step.
    fedavg_every: Annotated[int, Flag(metavar="N")] = Field(10, ge=0, description="splitfed: average the branches' bottoms every N steps, and at "
                              "every epoch end (0: at epoch ends only)")
    audit: bool = Field(False, description="record what crossed each cut and report what each party could infer "
                        "from it (the leakage audit)")

    @model_validator(mode="after")
    def _built_in_bottom(self) -> ConfigurationSettings:
        """These configurations' bottoms are the built-in MLP over one-hot and z-scores, built where the rows are
        (a branch, the data owner): a factory or column embeddings would be dropped on the way, so they are
        refused."""
        default = BottomConfig()
        own = [f"{where}.{f}" for where, bottom in (("bottom", self.bottom), ("training.bank_bottom",
                                                                                self.training.bank_bottom))
               for f in ("factory", "numeric_embedding", "category_width") if getattr(bottom, f) != getattr(default, f)]
        own += [f"{where}.factory" for where, top in (("top", self.top), ("training.top", self.training.top))
                if top.factory is not None]
        if own:
            raise ValueError(f"{', '.join(own)}: the {self.configuration} configuration's models are the built-in "
                             "MLPs (hidden, cut_width, optimizer, seed); your own models and column embeddings are "
                             "vertical training's")
        return self

    @model_validator(mode="before")
    @classmethod
    def _fixed_batch(cls, values: Any) -> Any:
        """These configurations train at vertical's batch size on bank-full's scale: what vertical leaves to adapt
        to the table (``TrainingConfig.resolved``) is fixed here. The task, left unset, is what the labels show."""
        if isinstance(values, dict):
            training = values.get("training", TrainingConfig())
            if isinstance(training, dict):
                training = TrainingConfig(**training)
            if training.batch_size is None:
                training = training.model_copy(update={"batch_size": MAX_AUTO_BATCH})
            values = {**values, "training": training}
        return values

    @model_validator(mode="after")
    def _vertical_only(self) -> ConfigurationSettings:
        unsupported = [name for name, on in (
            ("local_steps", self.training.local_steps != 1), ("wire_precision", self.training.wire_precision != "fp32"),
            ("gradient_defense", self.training.gradient_defense != "none"),
            ("label_dp_epsilon", self.training.label_dp_epsilon is not None),
            ("max_steps", self.training.max_steps is not None and self.configuration in ("relay", "splitfed")),
        ) if on]
        if unsupported:
            raise ValueError(f"{', '.join(unsupported)}: not available in the {self.configuration} configuration "
                             "(vertical training has it)")
        return self


def write_configuration_run(
    out: Path, *, settings: ConfigurationSettings, book: EpochBook, test: dict[str, float],
    predictions: pd.DataFrame, communication: dict[str, dict[str, float]], extra: dict[str, Any],
) -> dict[str, Any]:
    """The run folder: ``config.json``, ``metrics.json``, ``history.csv``, ``test_predictions.csv``; the metrics."""
    import numpy as np  # here, not at the top: the settings are read by every command's parser
    import pandas as pd

    private_dir(out)
    atomic_write_text(out / "config.json", json.dumps(settings.model_dump(mode="json"), indent=2) + "\n")
    atomic_write_text(out / "history.csv", pd.DataFrame(book.history).to_csv(index=False))
    atomic_write_text(out / "test_predictions.csv", predictions.to_csv(index=False))
    epoch_seconds = [h["epoch_seconds"] for h in book.history]
    metrics = {
        "configuration": settings.configuration,
        "test": test,
        "objective": book.metric,  # the validation metric the best epoch was chosen on
        "best_epoch": book.best_epoch,
        "epochs_run": len(book.history),
        "mean_epoch_seconds": float(np.mean(epoch_seconds)) if epoch_seconds else 0.0,
        "communication": communication,
        **extra,
    }
    atomic_write_text(out / "metrics.json", json.dumps(metrics, indent=2, default=str) + "\n")
    return metrics
