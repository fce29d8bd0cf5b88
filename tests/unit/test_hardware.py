"""Hardware profiles (``zcompile.hardware``): the shipped files load, their collective costs follow
nccl-tests' bus-bandwidth rule, and a broken profile is a clear error naming the field."""

import copy
import json
import math
from dataclasses import replace

import pytest
import torch

from zcompile.predict.hardware import HardwareProfileError, available_profiles, load_profile, profile_from_dict

GIB = 2**30


def test_shipped_profiles_load_and_name_their_sources():
    assert {"h100-sxm", "a100-80gb", "cpu-local"} <= set(available_profiles())
    for name in available_profiles():
        profile = load_profile(name)
        assert profile.name == name
        assert json.loads(open(profile.source).read())["sources"]


def test_all_gather_inside_a_node_follows_the_bus_bandwidth_rule():
    """8 H100s in one node: an all-gather whose output is 1 GiB puts 7/8 GiB through each GPU's
    NVLink at the profile's 365 GB/s bus bandwidth, after 3 latency steps (log2 8)."""
    h100 = load_profile("h100-sxm")
    costs = h100.collective_costs(8)
    expected = 3 * 8e-6 + GIB * 7 / 8 / 365e9
    assert costs.seconds("all_gather", GIB) == pytest.approx(expected, rel=1e-12)
    # an all-reduce moves its bytes twice (reduce-scatter then all-gather)
    assert costs.seconds("all_reduce", GIB) == pytest.approx(3 * 8e-6 + 2 * GIB * 7 / 8 / 365e9, rel=1e-12)


def test_a_group_across_nodes_runs_at_the_inter_node_link():
    h100 = load_profile("h100-sxm")
    across = h100.collective_costs(1024).seconds("reduce_scatter", GIB)
    assert across == pytest.approx(10 * 15e-6 + GIB * 1023 / 1024 / 42e9, rel=1e-12)
    # the same 16 ranks are one node when nodes hold 16 (node_size overrides the profile's)
    assert h100.collective_costs(16, node_size=16).seconds("all_gather", GIB) < h100.collective_costs(16).seconds(
        "all_gather", GIB
    )
    assert h100.collective_costs(1).seconds("all_gather", GIB) == 0  # a world of one communicates nothing


def test_compute_costs_take_the_dtypes_peak():
    a100 = load_profile("a100-80gb")
    assert a100.compute_costs(torch.bfloat16).flops_per_s == 312e12
    assert a100.compute_costs("fp32").flops_per_s == 19.5e12
    # a 4096^3 bf16 matmul is compute-bound: 2 * 4096^3 FLOPs at 312 TFLOP/s, plus one op's overhead
    seconds = a100.compute_costs(torch.bfloat16).seconds(2 * 4096**3, 3 * 4096**2 * 2)
    assert seconds == pytest.approx(6e-6 + 2 * 4096**3 / 312e12)
    with pytest.raises(HardwareProfileError, match="no peak_flops_per_s for torch.float64"):
        a100.compute_costs(torch.float64)


def _h100() -> dict:
    return json.loads(open(load_profile("h100-sxm").source).read())


@pytest.mark.parametrize("path", ["links.inter_node.bus_bytes_per_s", "memory_bytes_per_s", "sources", "node_size"])
def test_a_missing_field_is_named(path):
    data = _h100()
    *parents, last = path.split(".")
    holder = data
    for key in parents:
        holder = holder[key]
    del holder[last]
    with pytest.raises(HardwareProfileError, match=f"missing field '{path}'"):
        profile_from_dict(data, "broken.json")


@pytest.mark.parametrize(
    "path, value",
    [
        ("links.intra_node.bus_bytes_per_s", -1.0),
        ("peak_flops_per_s.bf16", 0),
        ("links.inter_node.latency_s", float("nan")),
        ("memory_bytes", "80GB"),
    ],
)
def test_an_impossible_value_is_named(path, value):
    data = copy.deepcopy(_h100())
    *parents, last = path.split(".")
    holder = data
    for key in parents:
        holder = holder[key]
    holder[last] = value
    with pytest.raises(HardwareProfileError, match=f"broken.json.*{path.replace('.', '[.]')} must be a number"):
        profile_from_dict(data, "broken.json")


def test_unknown_profile_lists_the_shipped_ones():
    with pytest.raises(HardwareProfileError, match="no hardware profile named 'tpu-v9'.*h100-sxm"):
        load_profile("tpu-v9")


def test_log2_steps_grow_slowly_with_the_world():
    """The latency term grows with log2 of the ranks (a tree's depth), not linearly (a ring's)."""
    h100 = load_profile("h100-sxm")
    small = h100.collective_costs(2048).cost("all_gather").latency_s
    assert small == pytest.approx(15e-6 * math.ceil(math.log2(2048)))


def test_a_group_is_priced_on_the_link_its_ranks_need():
    """Per-group pricing (``LinkCosts``): 64 ranks in nodes of 8; the 8 ranks of node 0 use NVLink,
    the 8 ranks with local rank 0 (one per node) InfiniBand; a group of unknown ranks is across
    nodes when larger than a node."""
    h100 = load_profile("h100-sxm")
    costs = h100.link_costs(64, 8, {"intra": tuple(range(8)), "inter": tuple(range(0, 64, 8))})
    assert not costs.across_nodes("intra", 8) and costs.across_nodes("inter", 8)
    assert costs.across_nodes("unknown", 16) and not costs.across_nodes("unknown", 8)
    assert h100.group_cost("all_gather", 8, across_nodes=False).seconds(GIB) == pytest.approx(
        3 * 8e-6 + GIB * 7 / 8 / 365e9, rel=1e-12
    )
    assert h100.group_cost("all_to_all", 8, across_nodes=True).seconds(GIB) == pytest.approx(
        3 * 15e-6 + GIB * 7 / 8 / 42e9, rel=1e-12
    )
    # the whole-world costs are the same rule at the world's size
    assert h100.collective_costs(64).cost("reduce_scatter") == h100.group_cost("reduce_scatter", 64, True)


def test_optional_figures_reach_the_cost_model():
    """A CPU-like profile: attention at half the peak, transcendental ops at their own bandwidth, a
    reduce-scatter moving twice the rule's bytes (gloo's all-reduce), an issue cost and a contention
    factor; the GPU profiles leave them out and keep the plain rule."""
    data = _h100()
    data.update(attention_efficiency=0.5, transcendental_bytes_per_s=1e12, overlap_slowdown=3.0, device_type="cpu")
    data["links"]["intra_node"].update(
        issue_latency_s=1e-4,
        issue_bytes_per_s=1e10,
        bus_factor={"reduce_scatter": 2.0},
        latency_factor={"reduce_scatter": 3.0},
    )
    profile = profile_from_dict(data)
    compute = profile.compute_costs(torch.bfloat16)
    assert compute.attention_flops_per_s == 989e12 / 2 and compute.transcendental_bytes_per_s == 1e12
    costs = profile.collective_costs(8)
    assert costs.overlap_slowdown == 3.0 and profile.link_costs(8).overlap_slowdown == 3.0
    rs, ag = costs.cost("reduce_scatter"), costs.cost("all_gather")
    assert rs.seconds_per_byte == pytest.approx(2 * 7 / 8 / 365e9) and ag.seconds_per_byte == pytest.approx(
        7 / 8 / 365e9
    )
    assert rs.latency_s == pytest.approx(3 * ag.latency_s) and ag.latency_s == pytest.approx(3 * 8e-6)  # log2(8) steps
    assert ag.issue_seconds(10**6) == pytest.approx(1e-4 + 10**6 / 1e10)
    plain = load_profile("h100-sxm")
    assert plain.device_type == "cuda" and plain.collective_costs(8).overlap_slowdown == 1.0
    assert plain.compute_costs(torch.bfloat16).transcendental_bytes_per_s == 0.0  # the memory bandwidth's
    assert plain.collective_costs(8).cost("all_gather").issue_seconds(10**9) == 0.0


def test_compute_efficiency_slows_every_op():
    """``compute_efficiency`` e divides each op's predicted time by e (``ComputeCosts.scaled``)."""
    data = _h100()
    plain = profile_from_dict(data).compute_costs(torch.bfloat16)
    data["compute_efficiency"] = 0.5
    slowed = profile_from_dict(data).compute_costs(torch.bfloat16)
    for flops, nbytes in [(1e12, 1e6), (1e6, 1e10), (0.0, 0.0)]:
        assert slowed.op_seconds(flops, nbytes) == pytest.approx(2 * plain.op_seconds(flops, nbytes), rel=1e-12)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("attention_efficiency", 1.5, "attention_efficiency is a fraction"),
        ("compute_efficiency", 1.2, "compute_efficiency is a fraction"),
        ("compute_efficiency", 0.0, "compute_efficiency must be a number > 0"),
        ("overlap_slowdown", 0.5, "overlap_slowdown is a transfer's time"),
        ("transcendental_bytes_per_s", -1.0, "transcendental_bytes_per_s must be a number > 0"),
        ("device_type", "tpu", "device_type must be 'cuda' or 'cpu'"),
        ("host_cores", -1, "host_cores must be an int >= 0"),
        ("host_cores", 1.5, "host_cores must be an int >= 0"),
    ],
)
def test_impossible_optional_figure_is_named(key, value, message):
    data = _h100()
    data[key] = value
    with pytest.raises(HardwareProfileError, match=message):
        profile_from_dict(data)


@pytest.mark.parametrize("key", ["bus_factor", "latency_factor"])
def test_bad_per_kind_factor_is_named(key):
    data = _h100()
    data["links"]["inter_node"][key] = {"broadcast": 2.0}
    with pytest.raises(HardwareProfileError, match=f"links.inter_node.{key} must map"):
        profile_from_dict(data)
    data["links"]["inter_node"][key] = {"reduce_scatter": 0}
    with pytest.raises(HardwareProfileError, match=f"links.inter_node.{key}.reduce_scatter must be a number > 0"):
        profile_from_dict(data)


def test_ranks_beyond_the_hosts_cores_share_them():
    """``host_cores``: a rank's figures hold while each has a core; 4 ranks on 2 cores take turns (2x),
    and a profile without it (a GPU's) never slows."""
    data = _h100()
    assert profile_from_dict(data).time_sharing(64) == 1.0
    data["host_cores"] = 2
    profile = profile_from_dict(data)
    assert [profile.time_sharing(n) for n in (1, 2, 3, 4, 8)] == [1.0, 1.0, 1.5, 2.0, 4.0]


def test_the_stores_time_per_request_is_its_round_trip_or_its_turn_through_every_ranks():
    """``store_seconds`` against the store measured at a rank count the profile was not built from:
    cpu-local's figures come from 1 rank (the round trip) and 16 (the rate); at 4 ranks each
    request took 56.6 us (``bench_store_throughput.py``, results/store_throughput_4.json), where the
    rate alone would say 51 and the round trip 53."""
    from pathlib import Path

    profile = load_profile("cpu-local")
    results = Path(__file__).parent.parent.parent / "benchmarks" / "results"
    for ranks in (1, 4, 16):
        measured = json.loads((results / f"store_throughput_{ranks}.json").read_text())["us_per_request_per_rank"]
        assert profile.store_seconds(1, ranks) * 1e6 == pytest.approx(measured, rel=0.1), ranks
    assert profile.store_seconds(5, 1024) == pytest.approx(5 * 1024 / profile.store_requests_per_s)
    assert replace(profile, store_requests_per_s=0.0).store_seconds(5, 1024) == 0.0  # not priced
