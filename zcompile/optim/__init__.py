"""Sharded optimizers: drop-in ``AdamW`` and ``SGD`` that update each rank's 1/N shard, their state
dict, bucketed eager collectives, gradient-norm clipping and the skip of non-finite steps."""

from __future__ import annotations

from typing import TYPE_CHECKING

from zcompile.common.lazy import lazy_attributes

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


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY)
