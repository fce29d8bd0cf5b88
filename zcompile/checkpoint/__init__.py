"""Sharded checkpoints in DCP format that reshard on load: ``save``, ``load``, ``full_state_dict``."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# public name -> the module that defines it, imported on first use (PEP 562): importing one module
# of this package does not run the others
_LAZY = {
    "CheckpointError": "zcompile.checkpoint.layout",
    "save": "zcompile.checkpoint.dcp",
    "load": "zcompile.checkpoint.dcp",
    "full_state_dict": "zcompile.checkpoint.consolidate",
}
__all__ = list(_LAZY)

if TYPE_CHECKING:
    from zcompile.checkpoint.consolidate import full_state_dict
    from zcompile.checkpoint.dcp import load, save
    from zcompile.checkpoint.layout import CheckpointError


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
