"""The process groups of a compile: the whole data-parallel group, hybrid sharding's two, or a
tensor-parallel model's (``mesh["dp"]`` shards, ``mesh["tp"]`` holds the pieces: ``_tensor_parallel_groups``;
with a 3-D mesh ``("replicate", "shard", "tp")`` the pieces are sharded over "shard" and replicated across
"replicate").

Hybrid sharding (HSDP, DeepSpeed's MiCS) cuts the ``N`` ranks into ``R = N / S`` shard groups of
``S`` consecutive ranks (node-major, as torchrun numbers them, so a shard group of a node's size is
the node). Model states are sharded 1/S inside a shard group, the same on every group; the ranks at
the same place in each group form a replicate group, across which each reduced gradient shard is
all-reduced once. Gathers and reduce-scatters stay inside the shard group (the fast links), and only
1/S of the gradients crosses the groups.

The groups come from ``shard_size`` (made here, once per process, through
``topology.node_groups``) or from the caller's 2-D ``DeviceMesh`` (``mesh``, dims ``("replicate",
"shard")``). The returned ``DataParallelGroup`` is the shard group, its ``replicate`` the replicate
group: everything that shards (plans, gathers, reduce-scatters, the optimizer, clipping's norm,
``gathered``) reads the shard group as before; what every rank must share (rank 0's starting
weights, buffers) goes through both.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch.distributed.device_mesh import DeviceMesh

from zcompile.agreement.store_exchange import agree_on_store
from zcompile.common.process_group import DataParallelGroup
from zcompile.common.topology import as_data_parallel_group, node_groups, node_size_from_env

log = logging.getLogger(__name__)


def data_parallel_group(config, device_type: str = "cpu") -> DataParallelGroup:
    """The group ``config`` (a ``ZeroConfig``) shards over, with its replicate group when hybrid.

    Collective on the first call with ``shard_size`` (the groups are made; the ranks first agree on the
    size through the store, so a size that differs between ranks is an error on every rank, not a
    ``new_group`` that pairs with another)."""
    if config.tensor_parallel:
        return _tensor_parallel_groups(config)
    if not config.hybrid:
        return DataParallelGroup.resolve(config.group)
    world = DataParallelGroup.resolve(None)
    if config.mesh is not None:
        shard = as_data_parallel_group(config.mesh["shard"].get_group())
        replicate = as_data_parallel_group(config.mesh["replicate"].get_group())
        size = [replicate.world_size, shard.world_size]  # as the store's JSON gives it back
    else:
        size = (
            node_size_from_env(config.node_size, world.world_size) if config.shard_size == "node" else config.shard_size
        )
        if size == 1 and world.world_size > 1:
            raise ValueError(
                'zcompile: shard_size="node" is 1 rank here (one rank per node): hybrid sharding would shard '
                "nothing. Set node_size, or shard_size to an int >= 2"
            )
        if world.world_size % size:
            raise ValueError(
                f"zcompile: option 'shard_size' {size} does not divide the {world.world_size} ranks; use a divisor "
                f"of the world size (the shard groups are {size} consecutive ranks each)"
            )
    if world.world_size > 1 and config.check_ranks:
        agree_on_store(
            size,
            world,
            config.check_timeout_s,
            "hybrid-sharding",
            "compiling with hybrid sharding",
            "Pass the same shard_size (or a mesh of the same shape) on every rank.",
            lambda sizes: (
                f"zcompile: the ranks shard over different groups ({'mesh (replicas, shard size)' if config.mesh is not None else 'shard_size'} "
                f"per rank: {dict(enumerate(sizes))}); pass the same on every rank"
            ),
        )
    mesh = config.mesh
    if mesh is None:
        if size == world.world_size:
            return world  # one shard group: full sharding
        groups = node_groups(world, size)
        shard, replicate = groups.intra, groups.inter
        mesh = DeviceMesh.from_group(
            [replicate.process_group, shard.process_group],
            device_type,
            mesh=torch.arange(world.world_size).view(replicate.world_size, shard.world_size),
            mesh_dim_names=("replicate", "shard"),
        )
    if replicate.world_size == 1:
        return shard
    return dataclasses.replace(shard, replicate=replicate, mesh=mesh)


def _tensor_parallel_groups(config) -> DataParallelGroup:
    """A tensor-parallel model's groups: ``mesh["dp"]`` shards the states, ``mesh["tp"]`` (the one the
    model's DTensors live on) is ``tensor_parallel``. The ranks first agree, over the whole world, on
    the mesh's shape and on the dtypes the tensor-parallel collectives move: the compile check compares
    only the ranks of one dp group, and ranks of different tp coordinates exchange activations."""
    mesh = config.mesh
    hybrid = "shard" in config.mesh_dims  # ("replicate", "shard", "tp"): the pieces sharded over "shard"
    dp = as_data_parallel_group(mesh["shard" if hybrid else "dp"].get_group())
    tp = as_data_parallel_group(mesh["tp"].get_group())
    replicate = as_data_parallel_group(mesh["replicate"].get_group()) if hybrid else None
    world = DataParallelGroup.resolve(None)
    if world.world_size > 1 and config.check_ranks:
        agree_on_store(
            [*mesh.mesh.shape, None if config.param_dtype is None else str(config.param_dtype)],
            world,
            config.check_timeout_s,
            "tensor-parallel-mesh",
            "compiling a tensor-parallel model",
            "Every rank compiles a tensor-parallel model's graphs together: pass the same mesh (dp, tp) and "
            "param_dtype on every rank, and call the model on every rank (an evaluation on some ranks only would "
            "pair their tp collectives with the others' training).",
            lambda sizes: (
                f"zcompile: the ranks pass meshes of different shapes or param_dtypes ([{', '.join(config.mesh_dims)}, "
                f"param_dtype] per rank: {dict(enumerate(sizes))}); pass the same on every rank"
            ),
        )
    if replicate is not None and replicate.world_size > 1:
        return dataclasses.replace(dp, tensor_parallel=tp, replicate=replicate, mesh=mesh)
    return dataclasses.replace(dp, tensor_parallel=tp, mesh=mesh)
