"""Sharded optimizers: drop-in ``AdamW`` and ``SGD`` that update each rank's 1/N shard, their state
dict, bucketed eager collectives, gradient-norm clipping and the skip of non-finite steps."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# public name -> the module that defines it, imported on first use (PEP 562): importing one module
# of this package does not run the others
_LAZY = {
    "AdamW": "zcompile.optim.sharded",
    "SGD": "zcompile.optim.sharded",
    "ShardedOptimizer": "zcompile.optim.sharded",
}
__all__ = list(_LAZY)

if TYPE_CHECKING:
    from zcompile.optim.sharded import SGD, AdamW, ShardedOptimizer


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
