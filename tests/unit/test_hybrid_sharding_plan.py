"""Hybrid sharding without processes: the options' checks, ``estimate_memory`` and ``simulate`` with a
shard size (the example GPT on ranks this machine does not have), against ZeRO's formulas."""

import pytest

import zcompile
from support.models import build_model, global_batch
from zcompile.config import ZeroConfig


@pytest.mark.parametrize(
    "options, message",
    [
        ({"shard_size": 1}, "shards nothing"),
        ({"shard_size": 0}, "'shard_size' must be an int >= 2"),
        ({"shard_size": 2, "hpz_size": 2}, "does not compose"),
        ({"shard_size": 2, "quantize_grads": True}, "does not compose"),
        ({"mesh": "mesh"}, "must be a torch DeviceMesh with dims named"),
    ],
)
def test_options_are_validated_naming_the_option(options, message):
    with pytest.raises(ValueError, match=message):
        ZeroConfig.from_options(options)


def test_a_shard_size_that_does_not_divide_the_world_is_refused():
    with pytest.raises(ValueError, match="'shard_size' 3 does not divide the 8 ranks"):
        zcompile.estimate_memory(build_model("gpt"), 8, {"shard_size": 3})


def test_a_shard_group_of_one_rank_is_refused(monkeypatch):
    """'node' on one-GPU nodes, and a mesh whose 'shard' dim is 1: DDP, refused naming the option."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    with pytest.raises(ValueError, match="'shard_size' 'node' is 1 rank here"):
        ZeroConfig.from_options({"shard_size": "node"}).shard_group_size(4)

    class Mesh:  # what the check reads of a DeviceMesh (a real one needs a process group)
        mesh_dim_names, ndim = ("replicate", "shard"), 2

        def size(self, dim):
            return (4, 1)[dim]

    with pytest.raises(ValueError, match="'mesh' has a 'shard' dim of 1"):
        ZeroConfig.from_options({"mesh": Mesh()})


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_estimate_holds_the_states_of_the_shard_group(stage):
    """8 ranks as 4 groups of 2 hold what 2 ranks of full sharding hold, per rank."""
    model = build_model("gpt")
    hybrid = zcompile.estimate_memory(model, 8, {"stage": stage, "shard_size": 2})
    two = zcompile.estimate_memory(model, 2, {"stage": stage})
    assert hybrid.model_states_bytes == two.model_states_bytes
    assert (hybrid.world_size, hybrid.shard_group_size) == (8, 2)
    assert hybrid.model_states_bytes > zcompile.estimate_memory(model, 8, {"stage": stage}).model_states_bytes


@pytest.fixture(scope="module")
def simulated():
    batch = global_batch(0, 2)
    return {
        shard: zcompile.simulate(
            lambda: build_model("gpt"),
            batch,
            world_size=16,
            node_size=4,
            options={"stage": 3} if shard is None else {"stage": 3, "shard_size": shard},
        )
        for shard in (None, 4)
    }


def test_simulated_hybrid_keeps_gathers_in_the_node_and_all_reduces_a_quarter_across(simulated):
    full, hybrid = simulated[None], simulated[4]
    assert all(not c.inside_node for c in full.collectives if c.kind in ("all_gather", "reduce_scatter"))
    inside = [c for c in hybrid.collectives if c.kind in ("all_gather", "reduce_scatter")]
    assert inside and all(c.inside_node and c.group_size == 4 for c in inside)
    across = [c for c in hybrid.collectives if not c.inside_node]
    assert across and {(c.kind, c.group_size) for c in across} == {("all_reduce", 4)}
    # the all-reduce moves each reduced shard: the reduce-scatters' bytes over the shard size
    reduced = sum(c.bytes for c in hybrid.collectives if c.kind == "reduce_scatter")
    assert sum(c.bytes for c in across) == reduced // 4
    assert (
        hybrid.memory["model_states_bytes"]
        == zcompile.estimate_memory(build_model("gpt"), 4, {"stage": 3}).model_states_bytes
    )


def test_simulate_tune_searches_the_shard_size(simulated):
    result = zcompile.simulate_tune(
        lambda: build_model("gpt"), global_batch(0, 2), world_size=16, node_size=4, space={"shard_size": [None, 4]}
    )
    by_shard = {p.options["shard_size"]: p for p in result.points}
    assert {shard: p.status for shard, p in by_shard.items()} == {None: "predicted", 4: "predicted"}
    assert by_shard[4].across_nodes_bytes < by_shard[None].across_nodes_bytes  # only the all-reduce crosses
