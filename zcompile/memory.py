"""Measured bytes of model states per rank: parameters, gradients, shards and optimizer state.

Counts the storages that are alive (each storage once, freed storages as 0), not what a plan
says they should be.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from zcompile.param_shards import shard_of


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
        key = (storage.data_ptr(), tensor.device)
        if storage.size() == 0 or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def model_state_bytes(model: torch.nn.Module | Iterable[torch.Tensor],
                      optimizer: torch.optim.Optimizer | None = None) -> ModelStateBytes:
    """Bytes this rank holds for ``model``'s parameters (full and shards), gradients and ``optimizer`` state.

    ``model`` may also be an iterable of parameters.
    """
    seen: set = set()
    params = list(dict.fromkeys(model.parameters() if isinstance(model, torch.nn.Module) else model))
    shards = [shard_of(p) for p in params]
    param_tensors = [p for p in params] + [s.shard for s in shards if s is not None]
    grad_tensors = [p.grad for p in params] + [s.shard.grad for s in shards if s is not None]
    state_tensors = []
    if optimizer is not None:
        for state in optimizer.state.values():
            state_tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return ModelStateBytes(
        params=_storage_bytes(param_tensors, seen),
        grads=_storage_bytes(grad_tensors, seen),
        optimizer=_storage_bytes(state_tensors, seen),
    )


def zero_formula_bytes(num_params: int, world_size: int, stage: int | None) -> int:
    """ZeRO's model-state bytes per rank for fp32 AdamW (4 params + 4 grads + 8 moments per element).

    ``stage=None`` is plain data parallelism (DDP): everything replicated.
    """
    psi, n = num_params, world_size
    if stage is None:
        return 16 * psi
    if stage == 1:
        return 4 * psi + 4 * psi + 8 * psi // n
    if stage == 2:
        return 4 * psi + 12 * psi // n
    if stage == 3:
        return 16 * psi // n
    raise ValueError(f"stage must be None, 1, 2 or 3, got {stage}")
