"""A party's protective randomness: secret, its own, and still exact on its own resume.

Noise that protects a party (label DP's flips, gradient noise and Marvell at the bank; embedding noise and
the hijack monitor's probe rows at a partner) protects nothing if the other party can draw it again: a
seed it knows (the public training seed, which the batch order reveals, or a default) lets it regenerate
the noise and subtract it. So each party draws a ``Secret`` from the operating system when a session
starts, keeps it in its own private state (the bank's run folder, the partner's checkpoints), never
sends it, and derives every protective draw from it with HMAC-SHA256 under a label naming the draw
(``"marvell", step, party``). A party killed and restarted reads it back and resumes bit for bit.

For a study that must repeat, an operator may pin it (``Secret.pinned(seed)``); the run then says so,
because a counterparty that knows the pin can regenerate the noise as well. Python's ``hash()`` is
never used: it is salted per process and not secret either.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from pathlib import Path

import numpy as np
import torch

from parties.storage.files import atomic_write_text

__all__ = ["Secret"]

_PINNED = b"cutlayer pinned protective noise"


class Secret:
    """32 secret bytes and the generators derived from them, one per labelled draw."""

    def __init__(self, key: bytes, pinned: int | None = None) -> None:
        if len(key) != 32:
            raise ValueError("a secret is 32 bytes")
        self._key, self.pinned = key, pinned

    @classmethod
    def fresh(cls) -> Secret:
        """A new secret from the operating system's randomness."""
        return cls(os.urandom(32))

    @classmethod
    def pinned_to(cls, seed: int) -> Secret:
        """A secret anyone who knows ``seed`` can derive: for studies that must repeat, never for protection."""
        return cls(hashlib.sha256(_PINNED + int(seed).to_bytes(16, "little", signed=True)).digest(), pinned=seed)

    @classmethod
    def of(cls, seed: int | None) -> Secret:
        """``pinned_to(seed)`` if a seed is given, else ``fresh()``."""
        return cls.fresh() if seed is None else cls.pinned_to(seed)

    @classmethod
    def kept_in(cls, path: Path | None, seed: int | None) -> Secret:
        """The secret kept at ``path`` (a resume, or a restart of the session), else a new one (``of(seed)``),
        written there (0600, the party's own state) before anything is drawn from it."""
        if path is not None and path.exists():
            return cls.from_state(json.loads(path.read_text()))
        secret = cls.of(seed)
        if path is not None:
            atomic_write_text(path, json.dumps(secret.to_state()))
        return secret

    def describe(self) -> str:
        return (f"pinned by the operator (seed {self.pinned}): a counterparty that knows the seed can regenerate it"
                if self.pinned is not None else "secret, drawn from the operating system at the session's start")

    # --- storage, in the party's own private state ----------------------------------------------------

    def to_state(self) -> dict[str, object]:
        return {"key": self._key.hex(), "pinned": self.pinned}

    @classmethod
    def from_state(cls, state: dict[str, object]) -> Secret:
        pinned = state.get("pinned")
        return cls(bytes.fromhex(str(state["key"])), None if pinned is None else int(pinned))  # type: ignore[arg-type]

    # --- draws ----------------------------------------------------------------------------------------

    def _derive(self, labels: tuple[object, ...]) -> bytes:
        message = "\x1f".join(str(label) for label in labels).encode()
        return hmac.new(self._key, message, hashlib.sha256).digest()

    def torch(self, *labels: object) -> torch.Generator:
        """A torch generator for the draw named by ``labels`` (63 of the derived bits seed it)."""
        seed = int.from_bytes(self._derive(labels)[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF
        return torch.Generator().manual_seed(seed)

    def numpy(self, *labels: object) -> np.random.Generator:
        """A numpy generator for the draw named by ``labels`` (256 derived bits seed it)."""
        return np.random.default_rng(int.from_bytes(self._derive(labels), "little"))

    def __repr__(self) -> str:  # never the key: a repr ends up in logs
        return f"Secret(pinned={self.pinned})" if self.pinned is not None else "Secret(<secret>)"
