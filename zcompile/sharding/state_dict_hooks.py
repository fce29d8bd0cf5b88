"""``model.state_dict()`` and ``model.load_state_dict()`` on a model whose parameters zcompile shards.

The backend attaches these hooks (public ``nn.Module`` hook API) to every module that owns a
sharded parameter, found from the compiled frame (``zcompile.common.dynamo_frame``):

- ``load_state_dict`` works at every stage. Before a module loads, each of its stage-3 parameters
  named in the state dict gets its full storage back (uninitialized: the load overwrites it); after
  the module has loaded, each loaded parameter's shard is rewritten from the new full value and a
  stage-3 parameter is freed again. So a load reaches the master shards (the next step trains
  from the loaded weights, at stages 1 and 2 too) and never writes into freed storage. Memory: the
  full parameters of one module at a time.
- ``state_dict`` works at stages 1 and 2 (the replicated parameters hold the weights, refreshed by
  every step) and inside ``zcompile.gathered(model)``. At stage 3 no rank holds a full parameter:
  the state dict would hold empty storages, which ``torch.save`` writes and ``torch.load`` cannot
  read back, so it raises ``ShardedStateDictError`` naming the fix instead.
"""

from __future__ import annotations

import logging

import torch

from zcompile.sharding.shards import ShardedParam, shard_of

log = logging.getLogger(__name__)

HOOKED_ATTR = "_zcompile_state_dict_hooked"
LOADING_ATTR = "_zcompile_loading"  # (sharded, was freed) of the parameters a load is filling


class ShardedStateDictError(RuntimeError):
    """``state_dict()`` of a stage-3 model outside ``gathered``: the full weights exist on no rank."""


def attach_state_dict_hooks(modules: list[torch.nn.Module]) -> int:
    """Hooks every module under ``modules`` that owns a sharded parameter (once each); returns how many."""
    hooked = 0
    for root in modules:
        for module in root.modules():
            if module.__dict__.get(HOOKED_ATTR) or not _owned_shards(module):
                continue
            module.register_state_dict_post_hook(_refuse_freed_parameters)
            module.register_load_state_dict_pre_hook(_materialize_before_load)
            module.register_load_state_dict_post_hook(_reshard_after_load)
            module.__dict__[HOOKED_ATTR] = True
            hooked += 1
    if hooked:
        log.debug("zcompile: state_dict hooks on %d modules", hooked)
    return hooked


def _owned_shards(module: torch.nn.Module) -> list[tuple[str, ShardedParam]]:
    return [
        (name, s)
        for name, s in ((n, shard_of(p)) for n, p in module._parameters.items() if p is not None)
        if s is not None
    ]


def _refuse_freed_parameters(module, state_dict, prefix, local_metadata) -> None:
    for name, sharded in _owned_shards(module):
        if sharded.is_freed:
            raise ShardedStateDictError(
                f"zcompile: state_dict(): parameter {prefix + name!r} is sharded ({sharded.freed_reason}); no rank "
                "holds its full value, so this state dict could not be read back. Use zcompile.checkpoint.save(path, "
                "model, optimizer) for a sharded checkpoint, zcompile.checkpoint.full_state_dict(model) for the full "
                "weights on rank 0, or call state_dict() inside `with zcompile.gathered(model):` on every rank"
            )


def _materialize_before_load(
    module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
) -> None:
    loading = []
    for name, sharded in _owned_shards(module):
        value = state_dict.get(prefix + name)
        if not isinstance(value, torch.Tensor) or value.shape != sharded.shape:
            continue  # not loaded, or torch reports the mismatch: the shard must stay as it is
        was_freed = sharded.is_freed
        if was_freed:
            sharded.param.untyped_storage().resize_(sharded.numel * sharded.param.element_size())
        loading.append((sharded, was_freed))
    module.__dict__[LOADING_ATTR] = loading


def _reshard_after_load(module, incompatible_keys) -> None:
    for sharded, was_freed in module.__dict__.pop(LOADING_ATTR, []):
        sharded.write_shard_from_full()
        if was_freed:
            sharded.free_full()
