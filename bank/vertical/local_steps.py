"""The top model's side of local steps, the communication-efficient mode (``TrainingConfig.local_steps``).

A round trip brings every party's embeddings of K batches; the top makes one
update per batch from them and collects every party's gradient for the whole
round trip. With ``reuse_steps`` = R it then makes R more updates from a cache
of the last two round trips' batches, newest first, as every party does with
its own bottom (``parties.learning.bottom``). The coordinator runs those while
the partners work on the next round trip, and its checkpoints keep the cache
(``bank.vertical.recovery``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import numpy as np
import torch

from parties.learning import fast_path

__all__ = ["LocalTop"]

Loss = Callable[[torch.nn.Module, list[torch.Tensor], torch.Tensor], torch.Tensor]


class LocalTop:
    def __init__(self, steps: int, reuse: int, loss: Loss) -> None:
        self.reuse, self._loss = reuse, loss
        # (rows, every party's embedding) of the last two round trips' batches, what reuse learns from.
        self.cache: deque[tuple[torch.Tensor, list[torch.Tensor]]] = deque(maxlen=2 * steps)

    def exchange(
        self, top: torch.nn.Module, optimizer: torch.optim.Optimizer, zs: list[torch.Tensor], group: list[torch.Tensor],
    ) -> tuple[list[torch.Tensor], float]:
        """One top update per batch of ``group``, on the embeddings ``zs`` of all of them; returns every party's
        gradient for the whole round trip, in its batches' order, and the mean loss."""
        params = list(top.parameters())
        public = not fast_path.serves(top)
        grads: list[list[torch.Tensor]] = [[] for _ in zs]
        losses, start = [], 0
        for rows in group:
            leaves = [z[start : start + len(rows)].detach().requires_grad_(True) for z in zs]
            loss = self._loss(top, leaves, rows)
            fast_path.backward(loss, inputs=[*params, *leaves], public=public)
            fast_path.optimizer_step(optimizer, public=public)
            fast_path.clear_grads(params)
            for out, leaf in zip(grads, leaves):
                out.append(leaf.grad)
            losses.append(loss.item())
            if self.reuse:
                self.cache.append((rows, [leaf.detach() for leaf in leaves]))
            start += len(rows)
        return [torch.cat(g) for g in grads], float(np.mean(losses))

    def replay(self, top: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """``reuse`` more top updates from the cache, newest batch first, cycling through it."""
        params = list(top.parameters())
        public = not fast_path.serves(top)
        for k in range(self.reuse):
            rows, cached = self.cache[-1 - k % len(self.cache)]
            fast_path.backward(self._loss(top, cached, rows), inputs=params, public=public)
            fast_path.optimizer_step(optimizer, public=public)
            fast_path.clear_grads(params)
