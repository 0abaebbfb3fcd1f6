"""Where a party that serves several banks keeps what it holds for each: one folder per bank.

``<state>/banks/<bank>/`` holds a partner's training alignment with that bank, ``training/<session>/``
(checkpoints) and ``models/<session>/`` (trained bottoms). The partner writes there (``partner.banks``); a
simulation that started the partner reads its model files there (the walkthrough, the lab's run reader).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["bank_folder", "banks_root", "model_folder", "training_folder"]


def banks_root(state: Path) -> Path:
    return Path(state) / "banks"


def bank_folder(state: Path, bank: str) -> Path:
    return banks_root(state) / bank


def training_folder(state: Path, bank: str, session: str) -> Path:
    return bank_folder(state, bank) / "training" / session


def model_folder(state: Path, bank: str, model_id: str) -> Path:
    return bank_folder(state, bank) / "models" / model_id
