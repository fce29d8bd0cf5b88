"""Sharded optimizers: drop-in ``AdamW`` and ``SGD`` that update each rank's 1/N shard, their state
dict, bucketed eager collectives, gradient-norm clipping and the skip of non-finite steps."""

from zcompile.optim.sharded import SGD, AdamW, ShardedOptimizer

__all__ = ["AdamW", "SGD", "ShardedOptimizer"]
