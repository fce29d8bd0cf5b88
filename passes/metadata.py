"""Names of the FX node metadata that zcompile's passes read and write.

``ZCOMPILE_META`` lives under ``node.meta["custom"]``, which torch's tracers copy onto every node
traced from an annotated node; so a tag set on a Dynamo-graph node reappears on the aten nodes of
the AOTAutograd forward and backward graphs.
"""

CUSTOM = "custom"  # torch-owned key, propagated by make_fx / AOTAutograd
ZCOMPILE_META = "zcompile"  # our dict inside node.meta["custom"]
ROLE = "role"  # what the node is for: one of the ROLE_* values
PARAM = "param"  # parameter name the node gathers or reduces
ROLE_GATHER = "param_gather"  # stage 3 all-gather of a parameter
ROLE_REPLICATED = "param_replicated"  # stage 2 use of a replicated parameter
ROLE_REDUCE = "grad_reduce"  # a (bucketed) gradient reduce-scatter
ROLE_HPZ_SECONDARY = "hpz_secondary"  # hpZ: this rank's slice of a gathered weight, saved for backward
ROLE_HPZ_REGATHER = "hpz_regather"  # hpZ: the weight re-gathered from the secondary slices
ROLE_REPLICA_REDUCE = "grad_replica_reduce"  # hybrid sharding: a reduced gradient shard all-reduced across replicas
ROLE_AUTOCAST = "autocast"  # the autocast region around a graph's compute (mixed precision)
# the roles of the collectives zcompile inserts to move parameters and gradients: a collective
# without one is the model's own (a contrastive loss gathering every rank's embeddings)
ZERO_COLLECTIVE_ROLES = frozenset(
    {ROLE_GATHER, ROLE_REPLICATED, ROLE_REDUCE, ROLE_HPZ_SECONDARY, ROLE_HPZ_REGATHER, ROLE_REPLICA_REDUCE}
)
PARAMS = "params"  # parameter names a bucketed collective moves
GROUP_SIZE = "group_size"  # on an all-reduce zcompile inserts: its group's size, which its arguments do not say
LOWERED_FROM = "lowered_from"  # the collective kind a node runs in another form (a reduce-scatter as all-to-all)
RECOMPUTE = "recompute"  # torch-owned key read by the min-cut partitioner
# not metadata but a name torch gives: AOTAutograd's placeholder for a forward input (primals_<i + 1>),
# in the forward graph and, where it is saved, in the backward graph
FORWARD_INPUT_PREFIX = "primals_"


def tag(node, **fields) -> None:
    """Adds ``fields`` to the zcompile metadata of ``node``."""
    custom = dict(node.meta.get(CUSTOM) or {})
    entry = dict(custom.get(ZCOMPILE_META) or {})
    entry.update(fields)
    custom[ZCOMPILE_META] = entry
    node.meta[CUSTOM] = custom


def tags(node) -> dict:
    return (node.meta.get(CUSTOM) or {}).get(ZCOMPILE_META) or {}


def params_of(node) -> list[str]:
    """Parameters a collective node moves: its bucket's, or the one it was inserted for."""
    entry = tags(node)
    if entry.get(PARAMS):
        return list(entry[PARAMS])
    return [entry[PARAM]] if entry.get(PARAM) else []
