"""Cross-call prefetch: a graph's first all-gather split off (passes/call_prologue.py) and issued by
the call before (zcompile/call_prefetch.py), on torch's fake process group (an all-gather there
repeats this rank's shard, so every gathered value is known)."""

import pytest
import torch

from support.graph_builders import fake_process_group, trace
from zcompile.backend.aot import boxed_graph_function
from zcompile.backend.call_prefetch import CallChain, RunPhase, prefetching_call
from zcompile.passes.all_gather_lowering import ALL_GATHER_OUT, all_gathers_into_buffers
from zcompile.passes.call_prologue import issued_by, issued_input_name, shard_placeholder_names, split_first_gather
from zcompile.passes.collectives import ALL_GATHER, REDUCE_SCATTER, WAIT

SHARDS = shard_placeholder_names([0, 2])  # primals_1 and primals_3: the layer's two weights


def _layer_graph(group: str) -> torch.fx.GraphModule:
    """A layer as a stage-3 forward has it: its two weights' shards packed and gathered first, then a
    second gather later (the schedule's next bucket), the activation in between."""

    def layer(primals_1, primals_2, primals_3):
        first = WAIT(ALL_GATHER(torch.cat([primals_1, primals_3]), 2, group))
        hidden = primals_2 * first[:8].sum() + first[8:].mean()
        second = WAIT(ALL_GATHER(primals_3 * 2, 2, group))
        return hidden * second.sum()

    return _as_aot_names(trace(layer, torch.zeros(4), torch.zeros(3), torch.zeros(4)))


def _as_aot_names(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Placeholders named as AOTAutograd names a forward's (``primals_1``, ...): make_fx adds suffixes."""
    for i, node in enumerate(gm.graph.find_nodes(op="placeholder")):
        node.name = node.target = f"primals_{i + 1}"
    gm.recompile()
    return gm


def _layer_inputs(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(4, generator=gen), torch.randn(3, generator=gen), torch.randn(4, generator=gen)]


@pytest.mark.parametrize("lowered", [False, True], ids=["functional", "into buffers"])
def test_the_prologue_issues_the_first_gather_of_the_shards_and_the_body_computes_the_rest(lowered):
    with fake_process_group(world_size=2) as group:
        gm = _layer_graph(group)
        if lowered:  # gloo's form, what the split is made of when it runs (zcompile.backend.aot.executed_form)
            gm = all_gathers_into_buffers(gm)
        before = [n.name for n in gm.graph.nodes]
        split = split_first_gather(gm, SHARDS)
        assert split is not None
        assert [n.name for n in gm.graph.nodes] == before  # the graph given is left as it was
        assert split.input_indices == (0, 2)
        assert split.gathered_bytes == 2 * 8 * 4  # the gathered output: 2 ranks x 8 float32
        gather = ALL_GATHER_OUT if lowered else ALL_GATHER
        assert len(split.prologue.graph.find_nodes(op="call_function", target=gather)) == 1
        assert not split.prologue.graph.find_nodes(op="call_function", target=WAIT)  # issued, not waited
        assert len(split.body.graph.find_nodes(op="call_function", target=gather)) == 1  # the second only
        assert not split.body.graph.find_nodes(op="call_function", target=torch.ops.aten.cat.default)
        inputs = _layer_inputs(0)
        expected = gm(*inputs)
        issued = split.prologue(inputs[0], inputs[2])
        torch.testing.assert_close(split.body(*inputs, issued), expected, rtol=0, atol=0)
        # the fake group's all-gather repeats this rank's shard: the value, independently
        hidden = (
            inputs[1] * torch.cat([inputs[0], inputs[2]]).repeat(2)[:8].sum()
            + torch.cat([inputs[0], inputs[2]]).repeat(2)[8:].mean()
        )
        torch.testing.assert_close(expected, hidden * (inputs[2] * 2).repeat(2).sum())


def test_no_split_where_the_first_gather_reads_more_than_shards_or_the_first_collective_is_not_a_gather():
    with fake_process_group(world_size=2) as group:
        gm = _layer_graph(group)
        assert split_first_gather(gm, shard_placeholder_names([0])) is None  # primals_3 is no shard
        reads_activation = _as_aot_names(
            trace(lambda shard, x: WAIT(ALL_GATHER(shard * x, 2, group)).sum(), torch.zeros(4), torch.zeros(4))
        )
        assert split_first_gather(reads_activation, shard_placeholder_names([0])) is None  # x: an activation
        reduces_first = _as_aot_names(
            trace(
                lambda shard: WAIT(ALL_GATHER(WAIT(REDUCE_SCATTER(shard, "sum", 2, group)), 2, group)).sum(),
                torch.zeros(4),
            )
        )
        assert split_first_gather(reduces_first, shard_placeholder_names([0])) is None
        assert split_first_gather(_as_aot_names(trace(lambda shard: shard * 2, torch.zeros(4))), SHARDS) is None


def _chain(group: str, phase: RunPhase, kind: str = "forward", agreed: bool = False):
    gm = _layer_graph(group)
    split = split_first_gather(gm, SHARDS)
    chain = CallChain(kind, split, phase, agreed=agreed)
    if kind == "forward":  # the layer's weights: the graph's inputs 0 and 2
        chain.shard_positions = {0: 0, 2: 2}
    return gm, chain, prefetching_call(boxed_graph_function(split.body), chain)


def _forward_runs(call, phase: RunPhase, layers: list, runs: int) -> None:
    """``runs`` forwards over ``layers`` in order, each ended as a backward would end it."""
    for _ in range(runs):
        for layer in layers:
            call(list(layer))
        phase.enter("backward")


def test_each_call_takes_the_gather_the_call_before_issued_once_a_run_has_taught_the_order():
    with fake_process_group(world_size=2) as group:
        phase = RunPhase()
        gm, chain, call = _chain(group, phase)
        layers = [_layer_inputs(seed) for seed in range(3)]

        def forward_run(order):
            outputs = []
            for i in order:
                takes = chain.plan([layers[i][0], layers[i][2]]).take
                taken_before = chain.taken
                outputs.append(call(list(layers[i])))
                assert (chain.taken == taken_before + 1) == takes
                torch.testing.assert_close(outputs[-1], gm(*layers[i]), rtol=0, atol=0)
            phase.enter("backward")  # the backward starts: the forward's run is over
            return outputs

        forward_run([0, 1, 2])
        assert (chain.taken, chain.dropped) == (0, 0)  # the first run learns the order
        forward_run([0, 1, 2])
        assert (chain.taken, chain.dropped) == (2, 0)  # layers 1 and 2 were gathered by the call before
        # a layer skipped (LayerDrop drawn alike on every rank): the prefetch of layer 1 is dropped
        forward_run([0, 2])
        assert (chain.taken, chain.dropped) == (2, 1)
        forward_run([0, 2])  # and the new order learned
        assert (chain.taken, chain.dropped) == (3, 1)


def test_a_prefetch_of_weights_changed_since_it_was_issued_is_dropped_not_used():
    """The optimizer updates shards in place; a prefetch issued before a change (here: between two
    calls) would carry the old values. It is dropped and the call gathers the new ones."""
    with fake_process_group(world_size=2) as group:
        phase = RunPhase()
        gm, chain, call = _chain(group, phase)
        layers = [_layer_inputs(seed) for seed in range(2)]
        _forward_runs(call, phase, layers, runs=2)
        assert chain.taken == 1
        call(list(layers[0]))  # issues layer 1's gather
        with torch.no_grad():
            layers[1][2].mul_(3.0)  # in place: its version moves
        assert not chain.plan([layers[1][0], layers[1][2]]).take
        out = call(list(layers[1]))
        assert (chain.taken, chain.dropped) == (1, 1)
        torch.testing.assert_close(out, gm(*layers[1]), rtol=0, atol=0)  # the new values


def test_a_call_of_the_other_kind_ends_the_run_and_the_last_call_prefetches_nothing_for_the_next_step():
    """The forward's last layer learned no successor (the backward came next): nothing held over the
    backward and the step. A backward is its forward's calls in reverse: it prefetches the backward of
    the forward call made before its own from its first run on, and a layer skipped changes nothing."""
    with fake_process_group(world_size=2) as group:
        phase = RunPhase()
        gm, forward_chain, forward = _chain(group, phase, "forward")
        _, backward_chain, backward = _chain(group, phase, "backward")
        layers = [_layer_inputs(seed) for seed in range(3)]
        for order in ([0, 1, 2], [0, 1, 2], [0, 1, 2], [0, 2]):
            for i in order:
                forward(list(layers[i]))
            assert forward_chain.pending is None  # the last layer issued nothing
            for i in reversed(order):
                torch.testing.assert_close(backward(list(layers[i])), gm(*layers[i]), rtol=0, atol=0)
        assert forward_chain.taken == 4 and forward_chain.dropped == 1  # 2 a run after the first; layer 1's dropped
        assert backward_chain.taken == 2 + 2 + 2 + 1 and backward_chain.dropped == 0


@pytest.mark.parametrize("order", [[0, 0], [0, 1, 0]], ids=["the model twice a step", "a layer shared"])
def test_a_graph_called_again_with_the_same_shards_prefetches_only_for_calls_that_come(order):
    """The whole model called on two batches before one backward (DPO's chosen and rejected), or a
    layer shared across depths: the last call with those shards predicts no successor, and the
    backward's last call issues nothing, so no gather is wasted or left in flight after the step."""
    with fake_process_group(world_size=2) as group:
        phase = RunPhase()
        gm, forward_chain, forward = _chain(group, phase, "forward")
        _, backward_chain, backward = _chain(group, phase, "backward")
        layers = [_layer_inputs(seed) for seed in range(2)]
        for _ in range(3):
            for i in order:
                torch.testing.assert_close(forward(list(layers[i])), gm(*layers[i]), rtol=0, atol=0)
            assert forward_chain.pending is None  # the last call issued nothing
            for i in reversed(order):
                torch.testing.assert_close(backward(list(layers[i])), gm(*layers[i]), rtol=0, atol=0)
            assert backward_chain.pending is None  # nothing held over the step
        calls_after_the_first = len(order) - 1
        assert (forward_chain.taken, forward_chain.dropped) == (2 * calls_after_the_first, 0)  # runs 2 and 3
        assert (backward_chain.taken, backward_chain.dropped) == (3 * calls_after_the_first, 0)


def test_a_call_that_skipped_its_agreement_neither_takes_nor_issues_where_calls_are_agreed():
    """With the ranks' agreement on (the backend's), only an agreed call may take or issue a prefetch:
    a call without one (the first after a step) has nothing to make every rank do the same."""
    with fake_process_group(world_size=2) as group:
        phase = RunPhase()
        _, chain, call = _chain(group, phase, agreed=True)
        layers = [_layer_inputs(seed) for seed in range(3)]
        for _ in range(2):
            for i, layer in enumerate(layers):
                if i:  # the run's first call skips its agreement, as after a step
                    chain.plan([layer[0], layer[2]])
                call(list(layer))
            phase.enter("backward")
        # run 2: layer 0 (no agreement) issued nothing, layer 1 (agreed) gathered its own and issued
        # layer 2's, which layer 2 took
        assert (chain.taken, chain.dropped) == (1, 0)


def test_a_call_that_agreed_to_take_and_then_would_not_is_an_error_not_a_collective_fewer():
    with fake_process_group(world_size=2) as group:
        phase = RunPhase()
        _, chain, call = _chain(group, phase)
        layers = [_layer_inputs(seed) for seed in range(2)]
        _forward_runs(call, phase, layers, runs=2)
        call(list(layers[0]))
        assert chain.plan([layers[1][0], layers[1][2]]).take
        with torch.no_grad():
            layers[1][0].add_(1.0)  # changed after the agreement: the call would now gather its own
        with pytest.raises(RuntimeError, match="agreed on taking"):
            call(list(layers[1]))
        chain.end_run()  # its prefetch waited: none left in flight when the group goes


def test_the_body_still_names_the_collective_and_group_its_first_wait_is_for():
    """What a rank waits in, as the other ranks are told (zcompile.agreement.heartbeat reads it from the code's
    lines): the prefetched gather's wait names the all-gather and its group, as before the split."""
    import re

    from zcompile.agreement.heartbeat import _launch_of

    with fake_process_group(world_size=2) as group:
        split = split_first_gather(all_gathers_into_buffers(_layer_graph(group)), SHARDS)
        code = split.body.code
        first_wait = re.search(r"wait_tensor\.default\((\w+)\)", code).group(1)
        assert _launch_of(code.splitlines(True), first_wait) == ("all_gather_into_tensor_out", group)
    # the input's name alone says it (inductor's code keeps it, and has no line that issues it), for
    # any group name, an identifier or not
    for name in ("0", "tp:dp/3", ""):
        assert _launch_of([], issued_input_name("all_gather_into_tensor", name)) == ("all_gather_into_tensor", name)
    assert issued_by("all_gather_into_tensor_out_default") is None


def test_cross_call_prefetch_applies_to_stage3_training_graphs_and_within_a_memory_budget():
    """``zcompile.backend.aot.cross_call_split``: where the split is made, and where not (a budget that the
    schedule's gathered peak plus the held gather would pass, the option off, an inference graph)."""
    from types import SimpleNamespace

    from zcompile.backend.aot import cross_call_split
    from zcompile.config import ZeroConfig

    def graphs(peak: int = 1000, **options):
        params = [SimpleNamespace(index=0), SimpleNamespace(index=2)]
        context = SimpleNamespace(
            config=ZeroConfig(stage=3, **options),
            sharding=SimpleNamespace(stage=3, params=params),
            group=SimpleNamespace(world_size=2, process_group=None),
            plans={"schedule.forward": SimpleNamespace(peak_gathered_bytes=peak)},
            reduce_scatter_by_all_to_all=False,
        )
        return SimpleNamespace(context=context)

    with fake_process_group(world_size=2) as group:
        gm = _layer_graph(group)
        held = 2 * 8 * 4  # the first gather's output
        assert cross_call_split(gm, "forward", graphs()) is not None
        assert cross_call_split(gm, "forward", graphs(memory_budget_mb=(1000 + held) / 2**20)) is not None
        assert cross_call_split(gm, "forward", graphs(memory_budget_mb=(1000 + held - 1) / 2**20)) is None
        assert cross_call_split(gm, "forward", graphs(prefetch_calls=False)) is None
        assert cross_call_split(gm, "forward", graphs(overlap=False)) is None
        assert cross_call_split(gm, "inference", graphs()) is None
