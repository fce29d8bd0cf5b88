"""Public names of a package imported on first use (PEP 562): importing the package, or one module of
it, runs no other module, so ``import zcompile.passes`` or the backend's entry point stays light."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable


def lazy_attributes(package: str, defined_in: dict[str, str]) -> tuple[Callable, Callable]:
    """``__getattr__`` and ``__dir__`` for ``package``: ``defined_in`` maps each public name to the module
    that defines it ("" where the name is the package's own submodule)."""

    def __getattr__(name: str):
        if name not in defined_in:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(defined_in[name] or f"{package}.{name}")
        value = module if not defined_in[name] else getattr(module, name)
        setattr(sys.modules[package], name, value)  # later lookups skip __getattr__
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(defined_in))

    return __getattr__, __dir__
