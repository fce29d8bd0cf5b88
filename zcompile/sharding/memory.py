"""The bytes of model states a rank holds: parameters, gradients, shards and optimizer state.

Counts the storages that are alive (each storage once, freed storages as 0), not what a plan
says they should be.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from zcompile.passes.dtensor_params import local_tensor
from zcompile.sharding.shards import shard_of


@dataclass(frozen=True)
class ModelStateBytes:
    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def _storage_bytes(tensors, seen: set) -> int:
    total = 0
    for tensor in tensors:
        if tensor is None:
            continue
        storage = tensor.untyped_storage()
        # the StorageImpl itself: a fake tensor's data_ptr is 0 for every storage (and warns)
        key = storage._cdata
        if storage.size() == 0 or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def model_state_bytes(
    model: torch.nn.Module | Iterable[torch.Tensor], optimizer: torch.optim.Optimizer | None = None
) -> ModelStateBytes:
    """Bytes this rank holds for ``model``'s parameters (full and shards), gradients and ``optimizer`` state.

    ``model`` may also be an iterable of parameters.
    """
    seen: set = set()
    params = list(dict.fromkeys(model.parameters() if isinstance(model, torch.nn.Module) else model))
    shards = [shard_of(p) for p in params]
    params = [local_tensor(p) for p in params]  # a tensor-parallel model: this rank's pieces
    sharded = [s for s in shards if s is not None]
    param_tensors = params + [s.shard for s in sharded] + [s.replica for s in sharded]
    grad_tensors = (
        [p.grad for p in params]
        + [s.shard_grad for s in sharded]
        + [s.replica.grad for s in sharded if s.replica is not None]
    )
    state_tensors = []
    if optimizer is not None:
        for state in optimizer.state.values():
            state_tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return ModelStateBytes(
        params=_storage_bytes(param_tensors, seen),
        grads=_storage_bytes(grad_tensors, seen),
        optimizer=_storage_bytes(state_tensors, seen),
    )


def zero_formula_bytes(
    num_params: int, world_size: int, stage: int | None, param_dtype: torch.dtype | None = None
) -> int:
    """ZeRO's model-state bytes per rank for AdamW (``../shared/ZERO.md``).

    fp32 (``param_dtype`` None or fp32): 4 params + 4 grads + 8 moments per element. Mixed
    precision (a 2-byte ``param_dtype``): 2 low-precision params + 2 grads + 12 fp32 master and
    moments, the low-precision ones replicated or sharded by stage as in the ZeRO paper.
    ``stage=None`` is plain data parallelism (DDP): everything replicated.
    """
    low = param_dtype.itemsize if param_dtype is not None and param_dtype.itemsize < 4 else None
    # (bytes per element replicated on every rank, bytes per element sharded 1/N)
    if low is None:
        split = {None: (16, 0), 1: (8, 8), 2: (4, 12), 3: (0, 16)}
    else:
        split = {None: (2 * low + 12, 0), 1: (2 * low, 12), 2: (low, low + 12), 3: (0, 2 * low + 12)}
    if stage not in split:
        raise ValueError(f"zcompile.zero_formula_bytes: stage must be None, 1, 2 or 3, got {stage}")
    replicated, sharded = split[stage]
    return replicated * num_params + sharded * num_params // world_size
