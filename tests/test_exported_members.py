"""Every package's public API is what its ``__all__`` says, and every name in it exists."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

PACKAGES = ["alignment", "bank", "data", "parties", "partner"]
MODULES = PACKAGES + sorted(
    m.name
    for pkg in PACKAGES
    for m in pkgutil.walk_packages(importlib.import_module(pkg).__path__, prefix=f"{pkg}.")
    if not m.name.endswith(".__main__")
)


@pytest.mark.parametrize("name", MODULES)
def test_all_names_exist(name: str) -> None:
    module = importlib.import_module(name)
    exported = getattr(module, "__all__", None)
    assert exported is not None, f"{name} has no __all__"
    assert sorted(exported) == sorted(set(exported))
    for member in exported:
        assert hasattr(module, member), f"{name}.__all__ names {member!r}, which does not exist"
