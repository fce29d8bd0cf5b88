"""The step report and the graph dumps, checked against torch.profiler and ZeRO's formulas."""

import json
import os

import pytest
import torch

import zcompile
from support.launch import run_ranks
from support.models import build_model, global_batch
from zcompile.backend.pass_runner import PassError, PassRunner
from zcompile.reports.step_report import StepReport


def _profiled_collectives(prof) -> dict[str, list[int]]:
    """Elements per collective, counted from the profiler's c10d events (independent of zcompile).

    Graph collectives appear as ``_c10d_functional::*`` ops (input shape, group size); the
    optimizer's eager ones as ``c10d::_allgather_base_`` / ``c10d::_reduce_scatter_base_`` (on gloo
    ``c10d::alltoall_base_``, as the graphs' reduce-scatters are ``all_to_all_single`` there), or its
    all-gather into the parameters as ``c10d::allgather_into_tensor_coalesced_`` (a list of outputs).
    """
    found = {"all_gather": [], "reduce_scatter": [], "coalesced_all_gathers": []}
    for event in prof.events():
        shapes = event.input_shapes
        if event.name == "_c10d_functional::all_gather_into_tensor":
            found["all_gather"].append(_numel(shapes[0]) * event.concrete_inputs[1])
        elif event.name in ("_c10d_functional::reduce_scatter_tensor", "_c10d_functional::all_to_all_single"):
            # on gloo zcompile runs a reduce-scatter as an all-to-all (passes/reduce_scatter_lowering.py)
            found["reduce_scatter"].append(_numel(shapes[0]))
        elif event.name == "c10d::alltoall_base_" and not _inside_functional(event):  # the stage-1 optimizer's
            found["reduce_scatter"].append(_numel(shapes[1]))
        elif event.name == "c10d::_allgather_base_":
            found["all_gather"].append(_numel(shapes[0]))
        elif event.name == "c10d::_reduce_scatter_base_":
            found["reduce_scatter"].append(_numel(shapes[1]))
        elif event.name == "c10d::allgather_into_tensor_coalesced_" and not _inside_functional(event):
            # the profiler records no shapes for a list of tensors: counted, its elements checked by
            # test_report_against_zero_formulas (the optimizer's all-gather is the model's padded size)
            found["coalesced_all_gathers"].append(1)
    return found


def _inside_functional(event) -> bool:
    """Whether ``event`` runs inside a graph's functional collective (gloo issues those as coalesced ops)."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("_c10d_functional::"):
            return True
        parent = parent.cpu_parent
    return False


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _report_rank(rank, world, stage, dump_dir):
    torch._dynamo.reset()
    model = build_model("gpt")
    compiled = torch.compile(model, backend="zero", options={"stage": stage, "dump": dump_dir})
    optimizer = zcompile.optim.AdamW(model.parameters(), lr=1e-3)

    def step(i):
        tokens, targets = global_batch(i, 4)
        local = slice(rank * 2, rank * 2 + 2)
        compiled(tokens[local], targets[local]).backward()
        optimizer.step()
        optimizer.zero_grad()

    step(0)  # compiles
    with torch.profiler.profile(record_shapes=True) as prof:
        step(1)
    report = zcompile.step_report(model, optimizer)
    report.to_json(os.path.join(dump_dir, f"rank{rank}", "report.json"))
    return report.to_dict(), _profiled_collectives(prof)


@pytest.fixture(scope="module", params=[2, 3], ids=["stage2", "stage3"])
def reported(request, tmp_path_factory):
    dump_dir = str(tmp_path_factory.mktemp(f"dump_stage{request.param}"))
    results = run_ranks(2, _report_rank, request.param, dump_dir)
    return request.param, dump_dir, results


def test_report_equals_profiler_count(reported):
    stage, _, results = reported
    for report, profiled in results:
        coalesced = [c for c in report["collectives"] if c["kind"] == "all_gather" and c["where"] == "optimizer"]
        assert len(coalesced) == len(profiled.pop("coalesced_all_gathers"))
        for kind in ("all_gather", "reduce_scatter"):
            ours = sorted(c["elements"] for c in report["collectives"] if c["kind"] == kind and c not in coalesced)
            assert ours == sorted(profiled[kind]), kind
        assert report["totals"]["total"] == sum(map(sum, profiled.values())) + sum(c["elements"] for c in coalesced)


def test_report_says_how_gloo_ran_the_reduce_scatters(reported):
    stage, _, results = reported
    report = StepReport(**{**results[0][0], "schedule": []})
    assert report.reduce_scatter_as_all_to_all  # gloo, reduce_scatter="auto"
    assert "reduce-scatters run as an all-to-all and a sum" in report.render()
    assert (
        "all-to-all"
        not in StepReport(**{**results[0][0], "schedule": [], "reduce_scatter_as_all_to_all": False}).render()
    )


def test_report_against_zero_formulas(reported):
    stage, _, results = reported
    report = results[0][0]
    if stage == 3:
        assert report["totals"]["total"] <= report["formula_elements"]
        assert report["memory"]["peak_gathered_bytes"] > 0
        # at most the whole model in fp32 twice (a bucket's buffer and the pieces copied out of it;
        # here one bucket holds the whole model), plus padding: under one element per parameter
        assert report["memory"]["peak_gathered_bytes"] <= 2 * 4 * (report["num_params"] + 64)
        # gloo (these ranks'): a gather in flight is also held in gloo's flat buffer; here one bucket is
        # the whole model, so the peak is its buffer and the pieces copied out of it, after the wait,
        # and the copy (before the wait) raises it by nothing (test_step_peak: when it does)
        assert 0 <= report["memory"]["gather_staging_bytes"] <= report["memory"]["peak_gathered_bytes"]
        staged = StepReport(**{**report, "schedule": [], "memory": {**report["memory"], "gather_staging_bytes": 2**20}})
        assert "+1.00 MiB at most of gloo's copies of the gathers in flight" in staged.render()
    else:
        assert report["totals"]["total"] == report["formula_elements"]  # exactly 2Ψ (padded)
        assert report["memory"]["peak_gathered_bytes"] == report["memory"]["gather_staging_bytes"] == 0
    measured, formula = report["memory"]["model_states_bytes"], report["memory"]["formula_bytes"]
    # padding adds under one element per parameter and rank (the master shard of stages 1 and 2
    # is the replicated parameter's own slice, so fp32 stage 2 is 4Ψ + 12Ψ/N with no extra copy)
    assert abs(measured - formula) <= 0.02 * formula
    # every graph collective sits in the schedule; with no overlap pass each waits right away
    graph_collectives = [c for c in report["collectives"] if c["where"] != "optimizer"]
    assert len(report["schedule"]) == len(graph_collectives)


def test_dump_layout(reported):
    stage, dump_dir, results = reported
    for rank in range(2):
        rank_dir = os.path.join(dump_dir, f"rank{rank}")
        assert os.path.exists(os.path.join(rank_dir, "report.json"))
        graph_dirs = [d for d in os.listdir(rank_dir) if os.path.isdir(os.path.join(rank_dir, d))]
        assert graph_dirs == ["0_0"]
        graph_dir = os.path.join(rank_dir, "0_0")
        passes = json.load(open(os.path.join(graph_dir, "passes.json")))
        post_partition = (["expand_param_gathers"] if stage == 3 else []) + [
            "remove_unused_gathers",
            "drop_identity_views",
            "bucket_collectives",
            "schedule",
        ]
        assert (
            [(p["pass"], p["graph"]) for p in passes]
            == (  # (autocast is off: no param_dtype)
                [("insert_param_collectives", "dynamo"), ("save_random_draws", "joint")]
                + ([("regather_through_regions", "joint")] if stage == 3 else [])
                + [(name, "forward") for name in post_partition]
                + [
                    (name, "backward")
                    for name in ["expand_grad_reductions"]
                    + post_partition[:-2]
                    + ["fuse_cross_entropy_backward"]
                    + post_partition[-2:]
                ]
                + [("reduce_scatter_as_all_to_all", "backward")]  # gloo (the option reduce_scatter="auto")
            )
        )
        for kind in ("forward", "backward"):
            buckets = json.load(open(os.path.join(graph_dir, f"buckets.{kind}.json")))
            schedule = json.load(open(os.path.join(graph_dir, f"schedule.{kind}.json")))
            assert buckets["graph"] == schedule["graph"] == kind
        inserted = passes[0]["added"]
        op = "zcompile.passes.graph_ops.gather_param" if stage == 3 else "zcompile.passes.graph_ops.replicated_param"
        plan = json.load(open(os.path.join(graph_dir, "plan.json")))
        assert inserted[op] == len(plan["params"]) > 0
        after = open(os.path.join(graph_dir, "00_insert_param_collectives.dynamo.after.txt")).read()
        before = open(os.path.join(graph_dir, "00_insert_param_collectives.dynamo.before.txt")).read()
        assert op.rsplit(".", 1)[1] in after and op.rsplit(".", 1)[1] not in before
        dumped = json.load(open(os.path.join(graph_dir, "collectives.forward.json")))
        dumped += json.load(open(os.path.join(graph_dir, "collectives.backward.json")))
        report = results[rank][0]
        in_graphs = [c for c in report["collectives"] if c["where"] != "optimizer"]
        assert dumped == in_graphs


def test_pass_error_names_pass_graph_node_and_dump(tmp_path):
    def broken_pass(gm):
        for node in gm.graph.nodes:
            if node.op == "call_function":
                raise KeyError("no plan entry")
        return gm

    def model(x):
        return torch.relu(x) + 1

    gm = torch.fx.symbolic_trace(model)
    gm.meta["dynamo_compile_id"] = "3/1"
    runner = PassRunner.for_graph(gm, str(tmp_path), rank=0)
    with pytest.raises(PassError) as error:
        runner.run("broken", broken_pass, gm, "dynamo")
    message = str(error.value)
    assert "pass 'broken'" in message and "Dynamo graph 3_1" in message
    assert "at node" in message and "relu" in message.lower()
    assert str(tmp_path / "rank0" / "3_1") in message
    assert (tmp_path / "rank0" / "3_1" / "00_broken.dynamo.before.txt").exists()


def test_a_report_made_without_the_optimizer_says_its_states_are_not_counted(reported):
    """``step_report(model)`` measures parameters and gradients only: the line says so, and how to count
    the optimizer's states, instead of a measured figure far under the formula with no word why."""
    _, _, results = reported
    with_optimizer = StepReport(**{**results[0][0], "schedule": []})
    assert with_optimizer.optimizer_counted and "parameters and gradients only" not in with_optimizer.render()
    without = StepReport(**{**results[0][0], "schedule": [], "optimizer_counted": False}).render()
    assert "parameters and gradients only: step_report(model, optimizer)" in without
