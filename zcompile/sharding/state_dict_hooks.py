"""``model.state_dict()`` and ``model.load_state_dict()`` on a model whose parameters zcompile shards.

The backend attaches these hooks (public ``nn.Module`` hook API) to every module that owns a
sharded parameter, found from the compiled frame (``zcompile.common.dynamo_frame``):

- ``load_state_dict`` works at every stage. Before a module loads, each of its stage-3 parameters
  named in the state dict gets its full storage back (uninitialized: the load overwrites it); after
  the module has loaded, each loaded parameter's shard is rewritten from the new full value and a
  stage-3 parameter is freed again. So a load reaches the master shards (the next step trains
  from the loaded weights, at stages 1 and 2 too) and never writes into freed storage. Memory: the
  full parameters of one module at a time.
- ``state_dict`` works at every stage. At stages 1 and 2 the replicated parameters hold the weights,
  refreshed by every step. At stage 3 (and at stages 1-2 with ``param_dtype``, whose fp32
  parameters live only as shards) no rank holds a full parameter, so ``state_dict()`` gathers
  them (FSDP's full state dict): it is collective, every rank calls it, and a rank that calls it
  alone (``if rank == 0: torch.save(model.state_dict())``) gets a ``RankDivergenceError`` naming the
  fix instead of a hang (the ranks agree through the store before the first gather). Memory: the
  full weights, on every rank, until the state dict is dropped; ``zcompile.checkpoint.save(path,
  model, optimizer)`` writes the shards without them.
"""

from __future__ import annotations

import logging

import torch

from zcompile.agreement.store_exchange import agree_on_store
from zcompile.eager.gathered import DEFAULT_TIMEOUT_S, gather_into_full
from zcompile.passes.dtensor_params import as_parameter_was, local_tensor
from zcompile.sharding.shards import ShardedParam, shard_of

log = logging.getLogger(__name__)

HOOKED_ATTR = "_zcompile_state_dict_hooked"
LOADING_ATTR = "_zcompile_loading"  # (sharded, was freed) of the parameters a load is filling
AGREED_ATTR = "_zcompile_ranks_agreed"  # on a state_dict() call's destination: its gathers were agreed


class ShardedStateDictError(RuntimeError):
    """A state dict that cannot be made: kept for callers that catch it (``state_dict()`` of a stage-3
    model gathers now)."""


def attach_state_dict_hooks(modules: list[torch.nn.Module]) -> int:
    """Hooks every module under ``modules`` that owns a sharded parameter (once each); returns how many."""
    hooked = 0
    for root in modules:
        for module in root.modules():
            if module.__dict__.get(HOOKED_ATTR) or not _owned_shards(module):
                continue
            module.register_state_dict_post_hook(_gather_freed_parameters)
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


@torch.no_grad()
def _gather_freed_parameters(module, state_dict, prefix, local_metadata) -> None:
    """Puts the full value of each of ``module``'s freed parameters into ``state_dict`` (collective).

    The first module of a ``state_dict()`` call that has any makes the ranks agree first, on the
    module's name: every rank then walks the same modules in the same order, so the gathers pair."""
    freed = [(name, s) for name, s in _owned_shards(module) if s.is_freed]
    if not freed:
        return
    group = freed[0][1].group
    if group.world_size > 1 and not state_dict.__dict__.get(AGREED_ATTR):
        agree_on_store(
            prefix + freed[0][0],
            group,
            DEFAULT_TIMEOUT_S,
            "state_dict",
            "model.state_dict()",
            "At stage 3 model.state_dict() gathers the full weights with collectives: call it on every rank "
            "(then save from rank 0), or write the shards with zcompile.checkpoint.save on every rank.",
            lambda calls: (
                f"model.state_dict(): the ranks called it on different modules (first sharded parameter per rank: "
                f"{dict(enumerate(calls))}); call it on the same model on every rank."
            ),
        )
        state_dict.__dict__[AGREED_ATTR] = True
    fulls = [torch.empty(s.numel, dtype=s.param.dtype, device=s.shard.device) for _, s in freed]
    gather_into_full([(full, s.shard.detach().to(s.param.dtype), s) for full, (_, s) in zip(fulls, freed)])
    for full, (name, sharded) in zip(fulls, freed):
        state_dict[prefix + name] = as_parameter_was(module._parameters[name], full.view(sharded.shape))


def _materialize_before_load(
    module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
) -> None:
    loading = []
    for name, sharded in _owned_shards(module):
        value = local_tensor(state_dict.get(prefix + name))  # a DTensor's piece loads into the parameter's piece
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
