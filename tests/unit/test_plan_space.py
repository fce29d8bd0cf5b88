"""What ``zcompile.plan`` chooses among, and how a memory limit is read (no compiles)."""

import pytest

from zcompile.config import MIB, ZeroConfig, memory_limit_bytes
from zcompile.tune.plan_space import PLANNED, TENSOR_PARALLEL, frugality, planned_candidates


def test_the_options_the_user_set_are_kept_and_stage_3_knobs_vary_at_stage_3_only():
    candidates = planned_candidates({"param_dtype": "bf16", "bucket_mb": 16}, 100.0, 8, 8)
    assert all("bucket_mb" not in c for c in candidates)  # the user's, not planned
    assert {c["stage"] for c in candidates} == {1, 2, 3}
    assert all(("prefetch" in c) == (c["stage"] == 3) for c in candidates)
    assert all(("keep_gathered_mb" in c) == (c["stage"] == 3) for c in candidates)
    assert {c["keep_gathered_mb"] for c in candidates if c["stage"] == 3} == {0.0, 25.0, 100.0}
    assert all(c["shard_size"] is None for c in candidates)  # one node: nothing to shard inside
    assert len(candidates) == len({tuple(sorted(c.items(), key=str)) for c in candidates})  # no repeats
    # 3 budgets x (stage 1, stage 2, stage 3 x 3 keeps x 2 prefetch) = 3 x 20
    assert len(candidates) == 3 * (1 + 1 + 3 * 2)


def test_a_world_of_several_nodes_plans_the_shard_group_too():
    candidates = planned_candidates({}, 10.0, 16, 8)
    assert {c["shard_size"] for c in candidates} == {None, "node"}
    assert all(c["shard_size"] is None for c in planned_candidates({"hpz_size": 8}, 10.0, 16, 8))
    # every layout's fastest variant first: largest buckets, most kept, deepest prefetch
    layouts = 3 * 3 * 2
    assert all(c["bucket_mb"] == 64.0 for c in candidates[:layouts])
    assert all(c.get("prefetch", 2) == 2 and c.get("keep_gathered_mb", 10.0) == 10.0 for c in candidates[:layouts])
    leanest = min(candidates, key=frugality)
    assert leanest["stage"] == 3 and leanest["shard_size"] is None and leanest["bucket_mb"] == 4.0
    assert set(leanest) == set(PLANNED) - {TENSOR_PARALLEL}  # no tp degrees to plan: not in the candidates


def test_tensor_parallel_degrees_are_a_layout_dimension_after_the_activation_budget():
    candidates = planned_candidates({"param_dtype": "bf16"}, 100.0, 16, 8, tensor_parallel=(1, 2, 8))
    assert {c[TENSOR_PARALLEL] for c in candidates} == {1, 2, 8}
    per_layout = 2 + 2 + 3 * 2 * 2  # stage 1's buckets, stage 2's, stage 3's keeps x buckets x prefetch
    # 3 budgets x shard sizes (tp 8: none, a node holds one data-parallel rank)
    assert len(candidates) == 3 * per_layout * (2 + 2 + 1)
    # the first pass, every layout's fastest variant: budget first, then tp ascending, then stage
    firsts = [(c["activation_memory_budget"], c[TENSOR_PARALLEL], c["stage"]) for c in candidates[:16]]
    assert firsts[:6] == [(None, 1, 1), (None, 1, 1), (None, 1, 2), (None, 1, 2), (None, 1, 3), (None, 1, 3)]
    assert firsts[6][1] == 2 and firsts[12][1] == 8 and firsts[15][1] == 1  # tp 8: 3 layouts
    assert not [c for c in candidates if c[TENSOR_PARALLEL] == 8 and c["shard_size"] == "node"]
    assert min(candidates, key=frugality)[TENSOR_PARALLEL] == 8  # least memory: the highest degree
    # keep levels are shares of each degree's pieces (100 MiB gathered whole, 1/tp of it a piece)
    keeps = {
        tp: {c["keep_gathered_mb"] for c in candidates if c["stage"] == 3 and c[TENSOR_PARALLEL] == tp}
        for tp in (1, 2, 8)
    }
    assert keeps == {1: {100.0, 25.0, 0.0}, 2: {50.0, 13.0, 0.0}, 8: {13.0, 4.0, 0.0}}


@pytest.mark.parametrize(
    "limit, expected",
    [(512, 512 * MIB), ("80GiB", 80 * 2**30), ("70GB", 70 * 10**9), ("1.5 MiB", int(1.5 * MIB))],
)
def test_a_memory_limit_is_mib_or_a_size(limit, expected):
    assert memory_limit_bytes(limit) == expected


def test_auto_is_the_profiles_memory_less_the_margin_and_bad_limits_name_the_option():
    from zcompile.predict.hardware import load_profile

    profile = load_profile("h100-sxm")
    assert memory_limit_bytes("auto", profile.memory_bytes) == int(profile.memory_bytes * 0.9)
    for bad in (0, -1, "lots", float("nan"), True):
        with pytest.raises(ValueError, match="option 'memory_limit_mb'"):
            ZeroConfig.from_options({"memory_limit_mb": bad})


def test_an_extrapolated_choice_is_simulated_whole_and_the_next_taken_when_it_does_not_fit():
    """``search_plan`` with ``confirm``: candidates judged on extrapolated figures, the fastest that
    fits simulated whole; one that is over the limit whole is left so, and the next is confirmed."""
    import time

    import torch

    from zcompile.tune.plan import search_plan
    from zcompile.tune.plan_space import CHOSEN, OVER
    from zcompile.tune.simulated import SimulatedPoint

    fixed = {"bucket_mb": 4, "prefetch": 1, "keep_gathered_mb": 0, "activation_memory_budget": None}
    steps = {1: 1.0, 2: 2.0, 3: 3.0}  # stage 1 fastest, then 2, then 3
    whole_peak = {1: 900 * MIB, 2: 500 * MIB, 3: 300 * MIB}  # stage 1 is over 600 MiB only when whole

    def point(options, extrapolated):
        stage = options["stage"]
        peak = 400 * MIB if extrapolated else whole_peak[stage]
        return SimulatedPoint(
            0, options, False, memory_bytes=peak, step_s=steps[stage], exposed_comm_s=0.0, extrapolated=extrapolated
        )

    confirmed = []

    def confirm(options):
        confirmed.append(options["stage"])
        return point(options, False)

    model = torch.nn.Linear(4, 4)
    args = (model, fixed, 600 * MIB, 8, 8, "h100-sxm", lambda o: point(o, True), 8, time.perf_counter())
    plan = search_plan(*args, confirm=confirm)
    assert confirmed == [1, 2]  # stage 1 fits extrapolated, not whole: stage 2 confirmed next
    assert plan.options["stage"] == 2 and plan.chosen.peak_bytes == 500 * MIB and not plan.chosen.extrapolated
    by_stage = {c.options["stage"]: c for c in plan.candidates}
    assert by_stage[1].status == OVER and by_stage[1].peak_bytes == 900 * MIB
    assert by_stage[3].extrapolated and by_stage[2].status == CHOSEN
    # without confirm, the extrapolated figures decide
    assert search_plan(*args).options["stage"] == 1


def test_a_stage_3_layout_over_the_limit_tries_keeping_less_before_the_next_layout():
    import time

    import torch

    from zcompile.tune.plan import search_plan
    from zcompile.tune.plan_space import CHOSEN
    from zcompile.tune.simulated import SimulatedPoint

    model = torch.nn.Linear(256, 256)  # 0.25 MiB gathered in fp32: keeps of 1 MiB (all, and a quarter, ceiled) and 0
    fixed = {"stage": 3, "activation_memory_budget": None}
    tried = []

    def evaluate(options):
        tried.append((options["keep_gathered_mb"], options["bucket_mb"], options["prefetch"]))
        peak = (100 + 200 * options["keep_gathered_mb"]) * MIB  # keeping all: over; keeping none: fits
        step = 1.0 - 0.1 * options["keep_gathered_mb"]
        return SimulatedPoint(0, options, False, memory_bytes=int(peak), step_s=step, exposed_comm_s=0.0)

    plan = search_plan(model, fixed, 150 * MIB, 8, 8, "h100-sxm", evaluate, 8, time.perf_counter())
    # keeping all is over -> keeping none with the same bucket and prefetch, which fits; without the
    # descent the next tried would be the layout's leanest (bucket 4, prefetch 1)
    assert tried[:2] == [(1.0, 64.0, 2), (0.0, 64.0, 2)], tried
    assert plan.chosen.status == CHOSEN and plan.options["keep_gathered_mb"] == 0.0


def test_a_mesh_option_is_written_as_its_dims():
    """A plan's JSON (and its cache key) holds a ``mesh`` option as its dims and sizes, not a crash."""
    from torch.distributed.device_mesh import init_device_mesh

    from zcompile.predict.simulate import fake_world
    from zcompile.tune.serialization import jsonable_options

    with fake_world(4, 4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        assert jsonable_options({"mesh": mesh, "stage": 3}) == {"mesh": "mesh dp=2 tp=2", "stage": 3}
