"""The one switch for speed code below a library's public API, and the version gate it sits behind.

One place reaches into a library's internals for a measured gain:
``parties.learning.fast_path`` (torch's kernels without their wrappers). It is
active only when both hold:

- the environment does not switch it off: ``CUTLAYER_FAST_PATH=0`` (or ``off``,
  ``false``, ``no``) switches every piece of it off; unset, it is on;
- every library it reaches into is at a version it was verified against.

Otherwise the same functions run through the public API, with the same
results. This module only decides; it imports nothing but the standard library.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass

__all__ = ["ENV_VAR", "Gate", "base_version", "decide", "switched_on"]

#: The environment variable that switches all speed code off.
ENV_VAR = "CUTLAYER_FAST_PATH"
_OFF = frozenset({"0", "off", "false", "no"})
_ON = frozenset({"", "1", "on", "true", "yes"})


def switched_on(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the environment allows speed code. An unrecognised value counts as off: the public path is safe."""
    value = (os.environ if environ is None else environ).get(ENV_VAR, "").strip().lower()
    return value in _ON


def base_version(version: str) -> str:
    """A version without its local part: ``"2.13.0+cpu"`` -> ``"2.13.0"``."""
    return version.split("+", 1)[0].strip()


@dataclass(frozen=True)
class Gate:
    """Whether one piece of speed code is active, and why (for logs, benchmarks and tests)."""

    name: str
    active: bool
    reason: str

    def __str__(self) -> str:
        return f"{self.name}: {'on' if self.active else 'off, the public API instead'} ({self.reason})"


def decide(
    name: str, installed: Mapping[str, str], verified: Mapping[str, Collection[str]],
    environ: Mapping[str, str] | None = None,
) -> Gate:
    """``name`` is active if the switch allows it and each library in ``installed`` is at a ``verified`` version."""
    env = os.environ if environ is None else environ
    if not switched_on(env):
        return Gate(name, False, f"{ENV_VAR}={env.get(ENV_VAR, '')!r}")
    unverified = [f"{lib} {version}" for lib, version in installed.items()
                  if base_version(version) not in verified.get(lib, ())]
    if unverified:
        known = "; ".join(f"{lib} {', '.join(sorted(verified.get(lib, ())))}" for lib in installed)
        return Gate(name, False, f"{', '.join(unverified)} not verified (verified: {known})")
    return Gate(name, True, "verified on " + ", ".join(f"{lib} {v}" for lib, v in installed.items()))
