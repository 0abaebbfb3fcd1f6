"""A party's learning settings: its bottom model and optimizer, embedding DP, the hijack monitor.

Plain pydantic models, apart from the torch code that uses them, so the command lines and the
settings classes can state their defaults without importing torch.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["BottomConfig", "MonitorConfig", "OptimizerConfig", "PrivacyConfig"]


class OptimizerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    optimizer: Literal["adam", "sgd"] = "adam"
    learning_rate: float = Field(5e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)


class BottomConfig(OptimizerConfig):
    """A party's own bottom model: its architecture, optimizer and seed are its own business."""

    hidden: tuple[int, ...] = (64,)
    cut_width: int = Field(16, ge=1, le=4096)
    seed: int = 0


class PrivacyConfig(BaseModel):
    """A partner's own privacy settings (off unless ``clip`` is set)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    clip: float | None = Field(None, gt=0, description="L2 bound on each released embedding row")
    noise: float = Field(0.0, ge=0, description="Gaussian noise std added to each coordinate")
    delta: float = Field(1e-5, gt=0, lt=1)
    budget: float | None = Field(None, gt=0, description="refuse releases past this ε")
    seed: int = 0


class MonitorConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    probe_every: int = Field(0, ge=0, description="probe every N steps (0: the monitor is off)")
    pairs: int = Field(4, ge=1, description="embeddings copied per probe step")
    threshold: float = Field(1e-3, gt=0, description="alarm when the median relative difference is under this")
    min_pairs: int = Field(8, ge=1, description="pairs observed before any verdict")
    seed: int = 0
