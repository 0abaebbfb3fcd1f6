"""What crossed each cut during training, recorded for the leakage audit: one record for every flow.

The vertical coordinator records the gradient each partner received, the U-shaped loop the gradient the
compute party received at cut 2, the horizontal loops the gradient each branch received; each with its epoch,
step and the rows (positions) it was about. When a run goes back (a rollback to a checkpoint, a restart, a
compute party resumed from an epoch's end), ``truncate`` drops what the replay will record again, so the
record holds each step once. ``save`` writes ``gradients-<name>.safetensors`` and ``embeddings-<name>.safetensors``
under a run's ``audit/``; ``bank.lab.report.audit`` and ``bank.lab.report.config_audit`` read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save as save_tensors

from parties.storage.files import atomic_write_bytes, private_dir

__all__ = ["AuditRecord"]


@dataclass
class AuditRecord:
    """``gradients[name]``: per training row and step, what ``name`` received (``epoch``, ``step``, ``rows``,
    ``grads``); ``embeddings[name]``: tensors of what the bank saw of ``name`` (``rows``, ``embedding``, ...).
    ``first_step``: the first step recorded (a bank that restarted records from where it resumed)."""

    gradients: dict[str, dict[str, list[torch.Tensor]]] = field(default_factory=dict)
    embeddings: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    first_step: int = 0

    def record(self, name: str, epoch: int, step: int, rows: torch.Tensor, grad: torch.Tensor) -> None:
        kept = self.gradients.setdefault(name, {"epoch": [], "step": [], "rows": [], "grads": []})
        kept["epoch"].append(torch.full((len(rows),), epoch, dtype=torch.int64))
        kept["step"].append(torch.full((len(rows),), step, dtype=torch.int64))
        kept["rows"].append(rows.to(torch.int64).clone())
        kept["grads"].append(grad.detach().clone())

    def truncate(self, next_step: int) -> None:
        """Forget every step from ``next_step`` on: the run goes back there and records them again."""
        self.first_step = min(self.first_step, next_step)
        for name, kept in list(self.gradients.items()):
            keep = [i for i, s in enumerate(kept["step"]) if int(s[0]) < next_step]
            self.gradients[name] = {k: [v[i] for i in keep] for k, v in kept.items()}

    def tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """One flat tensor dict per file: ``gradients-<name>`` and ``embeddings-<name>``."""
        out = {f"gradients-{n}": {k: torch.cat(v) for k, v in r.items()} for n, r in self.gradients.items()
               if r["step"]}
        out |= {f"embeddings-{n}": r for n, r in self.embeddings.items()}
        return out

    def save(self, folder: Path) -> None:
        """Each file of ``tensors()`` under ``folder`` (a run's ``audit/``), with ``first_step`` in its metadata."""
        private_dir(folder)
        for name, tensors in self.tensors().items():
            atomic_write_bytes(folder / f"{name}.safetensors",
                               save_tensors({k: v.contiguous() for k, v in tensors.items()},
                                            metadata={"first_step": str(self.first_step)}))
