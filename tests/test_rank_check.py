"""The rank checks: errors that say what differs, no check for graphs without collectives, abort
notes that end every rank's wait, and the exchange's keys and speed.

Three tiers: pure functions on two signatures; the store exchange on an in-process ``HashStore``
with one thread per rank; two gloo ranks evaluating on rank 0 only (stage 2: allowed, no wait;
stage 3: an error on both ranks in seconds), and training under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``.
"""

import json
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import zcompile
from support.hand_built import layered_graph
from support.launch import run_ranks
from support.models import build_model, global_batch, model_loss
from support.training import RunSpec, train_zero
from zcompile.agreement.abort_note import RankDivergenceError, abort_note
from zcompile.agreement.rank_check import (
    collective_signature,
    describe_differences,
    entry_difference,
    issues_collectives,
    models_own_note,
    plan_difference,
    sequence_difference,
    sequence_signature,
)
from zcompile.agreement.rank_state import alive_key
from zcompile.agreement.store_exchange import exchange_through
from zcompile.common.process_group import DataParallelGroup
from zcompile.passes import metadata
from zcompile.passes.metadata import tag
from zcompile.passes.param_collectives import ParamInput, ShardingPlan


def _plan(
    stage=3, params=(("h.0.attn.weight", (32, 96)), ("h.0.attn.bias", (96,))), requires_grad=True, param_dtype=None
) -> ShardingPlan:
    inputs = [ParamInput(i, name, shape, requires_grad) for i, (name, shape) in enumerate(params)]
    return ShardingPlan(stage, 2, "0", param_dtype, None, inputs)


# ---- where two signatures differ (pure) ----


def test_plan_difference_names_the_parameter_and_its_shapes():
    mine = collective_signature(_plan())
    theirs = collective_signature(_plan(params=(("h.0.attn.weight", (32, 64)), ("h.0.attn.bias", (96,)))))
    assert plan_difference(mine, mine, 0, 1) is None
    assert plan_difference(mine, theirs, 0, 1) == (
        "parameter #0: rank 0: parameter 'h.0.attn.weight' shape [32, 96] float32; "
        "rank 1: parameter 'h.0.attn.weight' shape [32, 64] float32"
    )
    frozen = collective_signature(_plan(requires_grad=False))
    assert plan_difference(mine, frozen, 0, 1).endswith("shape [32, 96] float32 (frozen)")


def test_plan_difference_names_the_setting_before_the_parameters():
    bf16 = collective_signature(_plan(param_dtype=torch.bfloat16, params=()))
    assert (
        plan_difference(collective_signature(_plan()), bf16, 0, 1)
        == "setting 'param_dtype': rank 0 None, rank 1 bfloat16"
    )
    zeropp = collective_signature(_plan(), extra=["zero++", True, False, 128, 0, 2])
    assert (
        plan_difference(collective_signature(_plan()), zeropp, 0, 1)
        == "setting 'zero++': rank 0 null, rank 1 [\"zero++\", true, false, 128, 0, 2]"
    )


def test_plan_difference_counts_the_extra_parameters():
    more = [("h.0.attn.weight", (32, 96)), ("h.0.attn.bias", (96,))] + [(f"h.{i}.w", (4,)) for i in range(1, 7)]
    text = plan_difference(collective_signature(_plan()), collective_signature(_plan(params=more)), 0, 1)
    assert text == "rank 1 has 6 more parameters than rank 0: 'h.1.w', 'h.2.w', 'h.3.w', 'h.4.w', ..."
    assert plan_difference(collective_signature(_plan(params=more)), collective_signature(_plan()), 0, 1).startswith(
        "rank 0 has 6 more parameters than rank 1"
    )


def _sequence(shard=8, layers=3, bucket=False) -> list:
    gm = layered_graph(layers=layers, shard=shard)
    for i, node in enumerate(n for n in gm.graph.nodes if n.name.startswith("gather")):
        tag(node, param=f"h.{i}.weight")
    if bucket:
        tag(next(n for n in gm.graph.nodes if n.name == "reduce"), params=[f"h.{i}.weight" for i in range(layers)])
    return sequence_signature(gm)


def test_sequence_signature_reads_kind_shape_dtype_and_parameters():
    assert _sequence(bucket=True) == [
        ["all_gather", [8], "torch.float32", ["2"], ["h.0.weight"]],
        ["all_gather", [8], "torch.float32", ["2"], ["h.1.weight"]],
        ["all_gather", [8], "torch.float32", ["2"], ["h.2.weight"]],
        ["reduce_scatter", [16], "torch.float32", ["sum", "2"], ["h.0.weight", "h.1.weight", "h.2.weight"]],
    ]


def test_sequence_difference_names_the_first_differing_collective():
    assert sequence_difference(_sequence(), _sequence(), 0, 1) is None
    assert sequence_difference(_sequence(), _sequence(shard=4), 0, 1) == (
        "collective #0: rank 0: all_gather of [8] float32 moving parameter 'h.0.weight'; "
        "rank 1: all_gather of [4] float32 moving parameter 'h.0.weight'"
    )
    assert sequence_difference(_sequence(layers=2), _sequence(layers=3), 0, 1) == (
        "collective #2: rank 0: reduce_scatter of [16] float32; "
        "rank 1: all_gather of [8] float32 moving parameter 'h.2.weight'"
    )
    shorter = _sequence()[:2]
    assert sequence_difference(_sequence(), shorter, 0, 1) == (
        "rank 0 has 2 more collectives than rank 1: all_gather of [8] float32 moving parameter 'h.2.weight', "
        "reduce_scatter of [16] float32"
    )


def test_sequence_difference_shows_arguments_and_bucket_members_where_they_differ():
    mine, theirs = _sequence(bucket=True), _sequence(bucket=True)
    theirs[0][3] = ["4"]  # another group size, same input
    assert sequence_difference(mine, theirs, 0, 1).startswith(
        "collective #0: rank 0: all_gather of [8] float32 with arguments ['2'] moving parameter 'h.0.weight'; "
        "rank 1: all_gather of [8] float32 with arguments ['4']"
    )
    theirs = _sequence(bucket=True)
    theirs[3][4] = ["h.0.weight", "h.1.weight", "h.9.weight"]
    assert sequence_difference(mine, theirs, 0, 1) == (
        "collective #3: rank 0: reduce_scatter of [16] float32 moving 3 parameters, from #2: 'h.2.weight'; "
        "rank 1: reduce_scatter of [16] float32 moving 3 parameters, from #2: 'h.9.weight'"
    )


def test_a_difference_in_the_models_own_collective_says_it_must_run_on_every_rank():
    gm = layered_graph(layers=2)
    metadata.tags(next(n for n in gm.graph.nodes if n.name == "reduce")).pop(metadata.ROLE)  # the model's own
    with_it = sequence_signature(gm)
    assert with_it[2][0] == "reduce_scatter (the model's own)"
    text = sequence_difference(with_it, with_it[:2], 0, 1)
    assert text.startswith(
        "rank 0 has 1 more collectives than rank 1: reduce_scatter (the model's own) of [16] "
        "float32. A collective the model calls itself (in its forward, not one zcompile "
        "inserts) must run on every rank"
    )
    other_shape = [list(entry) for entry in with_it]
    other_shape[2][1] = [12]  # another batch size on rank 1
    assert sequence_difference(with_it, other_shape, 0, 1) == (
        "collective #2: rank 0: reduce_scatter (the model's own) of [16] float32; rank 1: reduce_scatter (the "
        "model's own) of [12] float32. A collective the model calls itself (in its forward, not one zcompile "
        "inserts) must run on every rank, in the same order and with the same shapes: take it out of any branch "
        "on the rank or on data that differs by rank"
    )
    # ZeRO's collectives alone differing: the general fix, not this one
    assert "the model calls itself" not in sequence_difference(_sequence(layers=2), _sequence(layers=3), 0, 1)
    # a rank waiting at this graph's check names the collective too (a rank without it has nothing to check)
    assert models_own_note(with_it) == (
        " (with the model's own reduce_scatter of [16] float32, which every rank must run)"
    )
    assert models_own_note(_sequence(layers=2)) == ""


def test_describe_differences_lists_each_rank_that_differs_from_rank_0():
    signatures = [[1, 2], [1, 2], [1, 3], [1, 2, 4]]
    assert describe_differences(signatures, entry_difference) == (
        "entry #1: rank 0: 2; rank 2: 3; rank 3 has 1 more entries than rank 0: 4"
    )


def test_graphs_without_collectives_need_no_agreement():
    assert not issues_collectives(_plan(stage=1), zeropp_active=False)
    assert not issues_collectives(_plan(params=()), zeropp_active=False)
    assert issues_collectives(_plan(stage=2), zeropp_active=False, grad_enabled=True)
    assert not issues_collectives(_plan(stage=2), zeropp_active=False, grad_enabled=False)  # torch.no_grad()
    assert not issues_collectives(_plan(stage=2, requires_grad=False), zeropp_active=False, grad_enabled=True)
    assert issues_collectives(_plan(stage=3), zeropp_active=False, grad_enabled=False)  # gathers in forward
    assert issues_collectives(_plan(stage=1), zeropp_active=True)  # ZeRO++ makes process groups: a collective
    with torch.no_grad():
        assert not issues_collectives(_plan(stage=2), zeropp_active=False)


def test_a_stage3_graph_without_parameters_takes_no_turn_at_its_calls():
    """A piece of a stage-3 forward between graph breaks with no weight of its own (transformers' BART
    with LayerDrop breaks at each layer's ``torch.rand([]) < p``) gathers nothing: its compile raised
    ``IndexError`` naming the call by its first parameter."""
    from types import SimpleNamespace

    from zcompile.backend.entry_point import _agreed_call
    from zcompile.config import ZeroConfig

    config, no_zeropp = ZeroConfig.from_options({"stage": 3}), SimpleNamespace(active=False)
    gm = torch.fx.symbolic_trace(torch.nn.ReLU())
    assert _agreed_call(config, _group(0), _plan(params=()), gm, no_zeropp) is None
    assert "'h.0.attn.weight' and 1 more" in _agreed_call(config, _group(0), _plan(), gm, no_zeropp)


# ---- the exchange on a store: one thread per rank ----


def _in_threads(rank_fn, world: int, timeout_s: float) -> None:
    """``rank_fn(rank)`` for every rank at once, each in a thread named ``rank{rank}``, as ranks run."""
    threads = [threading.Thread(target=rank_fn, args=(rank,), name=f"rank{rank}") for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)


def _group(rank: int) -> DataParallelGroup:
    return DataParallelGroup(rank=rank, world_size=2, name="g", process_group=None)


def test_exchange_meets_every_call_and_keeps_the_store_small():
    store, results = dist.HashStore(), {}

    def rank_calls(rank):
        results[rank] = [
            exchange_through(store, [rank, call], _group(rank), 10, "step", "step", "fix") for call in range(6)
        ]

    _in_threads(rank_calls, 2, 30)
    assert results[0] == results[1] == [[[0, call], [1, call]] for call in range(6)]
    # per rank its counter and its two value slots (6), and the two slots of the first digest and of the
    # arrival count (4); of each call whose values differ, the last rank to read them deleted the rest
    assert store.num_keys() == 6 + 4
    agreeing = {}

    def rank_agrees(rank):
        agreeing[rank] = [
            exchange_through(store, ["step", call], _group(rank), 10, "step", "step", "fix") for call in range(6)
        ]

    _in_threads(rank_agrees, 2, 30)
    assert agreeing[0] == agreeing[1] == [[["step", call]] * 2 for call in range(6)]
    # the counters and slots, and only the last call's "everyone is here" (the next call's last to
    # arrive deletes it)
    assert store.num_keys() == 6 + 4 + 1


def test_ranks_at_different_checks_are_told_where_each_was(monkeypatch):
    """Rank 0 checks a graph's plan while rank 1 checks a backward's issue order (their n-th checks
    met): each raises naming both places, not a comparison of two kinds of signature (which raised
    ``TypeError: unhashable type: 'slice'`` inside the differ)."""
    from zcompile.agreement import rank_check, store_exchange

    store, errors = dist.HashStore(), {}
    monkeypatch.setattr(rank_check, "default_store", lambda: store)
    monkeypatch.setattr(store_exchange, "default_store", lambda: store)
    plan = collective_signature(_plan())
    calls = {
        0: (plan, "graph 0/2", plan_difference),
        1: (_sequence(), "the backward graph of Dynamo graph 0_1", sequence_difference),
    }

    def rank_checks(rank):
        signature, what, difference = calls[rank]
        try:
            rank_check.check_same_on_all_ranks(signature, _group(rank), 10, what, difference)
        except RankDivergenceError as error:
            errors[rank] = str(error)

    _in_threads(rank_checks, 2, 30)
    where = "(rank 0 at graph 0/2; rank 1 at the backward graph of Dynamo graph 0_1)"
    assert set(errors) == {0, 1} and all(where in message for message in errors.values()), errors


class _CountingStore:
    """A store that counts the requests each rank (thread) makes, by method."""

    def __init__(self, store: dist.Store):
        self.store, self.requests = store, {}

    def __getattr__(self, method):
        def call(*args, **kwargs):
            key = (threading.current_thread().name, method)
            self.requests[key] = self.requests.get(key, 0) + 1
            return getattr(self.store, method)(*args, **kwargs)

        return call


@pytest.mark.parametrize("world", [2, 16])
def test_agreeing_ranks_make_the_same_few_requests_at_any_world_size(world):
    """Equal values (a training step's agreement): nobody reads every rank's value, and a rank's
    requests do not grow with the number of ranks (they were N reads each: N^2 through the store)."""
    store, results = _CountingStore(dist.HashStore()), {}

    def rank_calls(rank):
        group = DataParallelGroup(rank=rank, world_size=world, name="g", process_group=None)
        results[rank] = [exchange_through(store, ["step", call], group, 30, "step", "step", "fix") for call in range(4)]

    _in_threads(rank_calls, world, 60)
    assert all(results[rank] == [[["step", call]] * world for call in range(4)] for rank in range(world))
    assert not any(method == "multi_get" for _, method in store.requests)
    per_rank = [sum(n for (thread, _), n in store.requests.items() if thread == f"rank{rank}") for rank in range(world)]
    # 6 requests a call, 9 for the last to arrive (its "everyone is here" and two slots reset)
    assert max(per_rank) <= 4 * 9 and min(per_rank) >= 4 * 6
    # of them answered (a store does not answer a set): 5 a call, whoever arrives last (4 at the first call)
    answered = [
        sum(n for (thread, method), n in store.requests.items() if thread == f"rank{rank}" and method != "set")
        for rank in range(world)
    ]
    assert all(4 * 5 - 1 <= n <= 4 * 5 for n in answered), answered


class _SlowSets:
    """A rank's store whose ``set``s leave 10 ms late (a busy client; a TCPStore does not wait for a
    ``set``'s answer, and keeps each client's requests in order)."""

    def __init__(self, store: dist.Store):
        self.store = store

    def set(self, key, value):
        time.sleep(0.01)
        return self.store.set(key, value)

    def __getattr__(self, method):
        return getattr(self.store, method)


def test_exchange_on_a_tcp_store_keeps_every_call_exact_with_its_unanswered_sets():
    """On a TCPStore a ``set`` is not answered: the exchange counts on each client's requests reaching
    the store in order (a rank's value and "values differ" mark before its arrival, the last rank's
    slot resets before its next arrival). Four ranks, each its own client, through agreeing and
    differing calls, labelled and not; rank 1's sets come late, and it alone differs, arriving first
    (the others start those calls 40 ms later): a mark it set after arriving would reach the store after
    the last rank had read that nobody differs. Every call's result exact on every rank, and the
    store's keys bounded."""
    server = dist.TCPStore("127.0.0.1", 0, 5, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    world, calls, results, errors = 4, 60, {}, []

    def differs(call: int, rank: int) -> bool:
        return call % 7 == 3 and rank == 1

    def rank_calls(rank):
        client = dist.TCPStore("127.0.0.1", server.port, 5, is_master=False, timeout=timedelta(seconds=30))
        client = _SlowSets(client) if rank == 1 else client
        group = DataParallelGroup(rank=rank, world_size=world, name="g", process_group=None)
        got = []
        try:
            for call in range(calls):
                if call % 7 == 3 and rank != 1:
                    time.sleep(0.04)  # rank 1, slow and differing, arrives first: another rank is the last
                elif (call + rank) % 5 == 0:
                    time.sleep(0.002)  # the ranks drift: a different one arrives last
                value = ["v", call, int(differs(call, rank))]
                label = f"rank {rank} call {call}" if call % 2 else None
                got.append(
                    exchange_through(client, value, group, 30, "lab" if label else "plain", "x", "fix", label=label)
                )
        except Exception as error:  # noqa: BLE001 - reported below, with the rank
            errors.append((rank, error))
        results[rank] = got

    _in_threads(rank_calls, world, 120)
    assert not errors, errors
    for rank in range(world):
        for call, got in enumerate(results[rank]):
            values = [["v", call, int(differs(call, other))] for other in range(world)]
            if call % 2 == 0:
                assert got == values, (rank, call, got)
            else:
                labels = (
                    [f"rank {other} call {call}" for other in range(world)]
                    if call % 7 == 3
                    else [f"rank {rank} call {call}"] * world
                )
                assert got == list(zip(values, labels)), (rank, call, got)
    # per purpose: each rank's counter and two value slots, and the two slots' first digest and arrival
    # count; the labels' two slots a rank for the labelled purpose; a purpose's last call's "everyone"
    # key where it agreed (the next call's last to arrive deletes it; a call that differed, its last reader)
    everyone_left = sum(1 for last in (calls - 2, calls - 1) if last % 7 != 3)
    assert server.num_keys() - 1 == 2 * (world * 3 + 4) + world * 2 + everyone_left  # and the store's own key


def test_labels_differing_between_agreeing_ranks_are_not_read():
    """A compile check's label (its compile id, a recompile's reason) may differ between ranks that
    agree: it is not compared, so agreeing ranks still read nobody's value, and a rank gets the others'
    labels only when the values differ."""
    store, results = _CountingStore(dist.HashStore()), {}

    def rank_calls(rank):
        results[rank] = [
            exchange_through(
                store, value, _group(rank), 10, "check", "check", "fix", label=f"rank {rank}'s call {call}"
            )
            for call, value in enumerate(["same", "same", "same", f"differs on {rank}"])
        ]

    _in_threads(rank_calls, 2, 30)
    for rank in range(2):
        assert results[rank][:3] == [[("same", f"rank {rank}'s call {call}")] * 2 for call in range(3)]
        assert results[rank][3] == [(f"differs on {other}", f"rank {other}'s call 3") for other in range(2)]
    # two reads a rank (values, labels), in the one call whose values differ
    assert sum(n for (_, method), n in store.requests.items() if method == "multi_get") == 4


def test_a_rank_alone_times_out_naming_the_missing_rank_and_leaves_a_note():
    store = dist.HashStore()
    start = time.perf_counter()
    with pytest.raises(
        RankDivergenceError,
        match=r"doing: rank 0 \(its call #1\) got there but ranks \[1\] did "
        r"not within 2s \(rank 1 has not started zcompile's beat\)\. the fix",
    ):
        exchange_through(store, "x", _group(0), 1.5, "check", "doing", "the fix")
    assert time.perf_counter() - start < 5
    rank, message = abort_note(store, _group(1))
    assert rank == 0 and "ranks [1] did not" in message


class _Beating:
    """Rank 1's beat in the store, as its heartbeat thread writes it (``state``, a new count each 0.2 s;
    ``fresh=False``: one beat written once, and never again)."""

    def __init__(self, store: dist.Store, state: dict, fresh: bool = True):
        self.store, self.state, self.fresh, self.stop = store, state, fresh, threading.Event()

    def __enter__(self):
        def beat():
            count = 5
            while not self.stop.is_set():
                self.store.set(alive_key(1), json.dumps({"beat": count, **self.state}))
                count += 1 if self.fresh else 0
                time.sleep(0.2)

        threading.Thread(target=beat, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.stop.set()


_IN_EXCHANGE = {"blocked_in": "zcompile.checkpoint.save: rank 1 (its call #1)", "for_s": 10.0, "exchange_group": "g"}
_IN_COLLECTIVE = {
    "blocked_in": "a compiled backward, in reduce_scatter_tensor (c7f.py:12) over ranks [0, 1]",
    "for_s": 4.0,
    "collective_ranks": [0, 1],
}


def _raises_within(store, timeout_s: float, message: str) -> float:
    start = time.perf_counter()
    with pytest.raises(RankDivergenceError, match=message):
        exchange_through(store, "x", _group(0), timeout_s, "check", "doing", "the fix")
    return time.perf_counter() - start


def test_ranks_waiting_in_each_others_exchanges_fail_without_waiting_for_the_timeout():
    """Rank 1 has waited 10 s in another exchange of the group (its beat says so, zcompile.agreement.heartbeat):
    that exchange needs rank 0, which waits here for rank 1, so rank 0 raises within about two beats,
    not at its 30 s timeout. One of another group's exchanges may end without rank 0: it waits on."""
    with _Beating(store := dist.HashStore(), _IN_EXCHANGE):
        seconds = _raises_within(
            store,
            30,
            r"ranks \[1\] wait elsewhere \(rank 1 waits in zcompile.checkpoint.save: "
            r"rank 1 \(its call #1\) \(for 10s\)\): each waits for the other",
        )
    assert seconds < 6
    with _Beating(store := dist.HashStore(), {**_IN_EXCHANGE, "exchange_group": "another group"}):
        assert _raises_within(store, 3.5, r"did not within 4s") > 3.4


def test_a_rank_waiting_in_a_collective_with_this_rank_fails_without_waiting_for_the_timeout():
    """Rank 1 waits in a compiled graph's collective whose group holds rank 0 (global rank 0 here: no
    process group), which waits here instead of joining it: the error within about two beats. A
    collective of ranks without rank 0 may end without it: rank 0 waits for its timeout."""
    with _Beating(store := dist.HashStore(), _IN_COLLECTIVE):
        seconds = _raises_within(
            store,
            30,
            r"ranks \[1\] wait elsewhere \(rank 1 waits in a compiled backward, in "
            r"reduce_scatter_tensor \(c7f.py:12\) over ranks \[0, 1\] \(for 4s\)\)",
        )
    assert seconds < 6
    with _Beating(store := dist.HashStore(), {**_IN_COLLECTIVE, "collective_ranks": [1, 2]}):
        assert _raises_within(store, 3.5, r"did not within 4s") > 3.4


def test_a_rank_whose_process_ended_is_not_waited_for():
    """Rank 1's last beat, written at its exit, says its process ended (its loop ran out while rank 0
    saves a checkpoint alone): rank 0 raises within a beat, not at its 30 s timeout, saying so. Before,
    it waited the whole timeout and then read rank 1 as "alive, running its own code"."""
    store = dist.HashStore()
    store.set(alive_key(1), json.dumps({"beat": 9, "blocked_in": None, "for_s": 0.0, "ended": True}))
    seconds = _raises_within(store, 30, r"ranks \[1\] did not, and will not \(rank 1 has ended its process\)\. the fix")
    assert seconds < 5


def test_a_beat_older_than_the_wait_does_not_count():
    """A beat written before rank 0 came here (rank 1 stopped beating since) may show a wait that
    ended as rank 0 came: rank 0 waits for its timeout rather than raising "each waits for the other"."""
    for state in (_IN_EXCHANGE, _IN_COLLECTIVE):
        with _Beating(store := dist.HashStore(), state, fresh=False):
            assert _raises_within(store, 3.5, r"did not within 4s") > 3.4


# what fx and inductor write for a collective and its wait (torch 2.13), as the beat reads them
_FX_CODE = """def forward(self, primals_1, cat):
    empty = torch.ops.aten.empty.memory_format([64], dtype = torch.float32)
    all_gather_into_tensor_out_default = torch.ops._c10d_functional.all_gather_into_tensor_out.default(cat, 2, '7', out = empty);  cat = empty = None
    wait_tensor_default = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_out_default);  all_gather_into_tensor_out_default = None
    return (wait_tensor_default,)
"""
_INDUCTOR_CODE = """def call(args):
    buf78, = args
    buf79 = torch.ops._c10d_functional.reduce_scatter_tensor.default(buf78, 'sum', 2, '3')
    torch.ops._c10d_functional.wait_tensor.default(buf79)
    return (buf79, )
"""
# a body whose first gather the call before issued (passes/call_prologue.py), as inductor writes it:
# the gather's input, waited, and no line that issues it
_INDUCTOR_BODY = """def call(args):
    issued_by_call_before__all_gather_into_tensor_out__group_35, = args
    torch.ops._c10d_functional.wait_tensor.default(issued_by_call_before__all_gather_into_tensor_out__group_35)
    return (issued_by_call_before__all_gather_into_tensor_out__group_35, )
"""


def _read_while_waiting(code: str, filename: str):
    """What the beat reads from the stack of ``code`` (registered in linecache as fx does) while it
    waits (a stand-in for torch's ops: the generated code's own frame, at its wait's line)."""
    import linecache
    import types

    from zcompile.agreement.heartbeat import collective_wait

    linecache.cache[filename] = (len(code), None, code.splitlines(keepends=True), filename)
    seen = []

    def launch(*args, **kwargs):
        return args[0] if args else kwargs.get("out")

    def wait(tensor):
        seen.append(collective_wait(sys._getframe()))
        return tensor

    functional = types.SimpleNamespace(
        **{
            name: types.SimpleNamespace(default=launch)
            for name in ("all_gather_into_tensor_out", "reduce_scatter_tensor")
        },
        wait_tensor=types.SimpleNamespace(default=wait),
    )
    aten = types.SimpleNamespace(empty=types.SimpleNamespace(memory_format=lambda *a, **k: None))
    fake_torch = types.SimpleNamespace(ops=types.SimpleNamespace(_c10d_functional=functional, aten=aten), float32=None)
    namespace = {"torch": fake_torch}
    exec(compile(code, filename, "exec"), namespace)
    entry = namespace.get("forward") or namespace["call"]
    entry(None, 1, 2) if "forward" in namespace else entry([1])
    return seen[-1]


@pytest.mark.parametrize(
    "line, default_group",
    [
        ("dist.barrier()", True),
        ("    torch.distributed.barrier()  # all", True),
        ("dist.all_reduce(t)", True),
        ("x = dist.all_reduce(t, dist.ReduceOp.MAX)", True),
        ("dist.all_reduce(t, op, group)", False),
        ("dist.all_reduce(t, group=pg)", False),
        ("dist.barrier(pg)", False),
        ("dist.all_reduce(*args)", False),
        ("dist.all_reduce(**kwargs)", False),
        ("dist.all_reduce(", False),
        ("dist.broadcast(t, 0)", True),
    ],
)
def test_a_torch_distributed_call_without_a_group_is_read_as_one_of_every_rank(line, default_group):
    import inspect

    from zcompile.agreement.heartbeat import _on_default_group

    name = line.split("(")[0].split(".")[-1]
    function = inspect.unwrap(getattr(dist, name)).__code__  # past torch's logging decorator
    assert _on_default_group(function, line) is default_group


def test_the_beat_reads_which_collective_compiled_code_waits_for_and_its_group():
    from zcompile.agreement.heartbeat import collective_wait

    assert _read_while_waiting(_FX_CODE, "<eval_with_key>.99") == (
        "all_gather_into_tensor_out (<eval_with_key>.99:4)",
        "7",
    )
    assert _read_while_waiting(_INDUCTOR_CODE, "/tmp/torchinductor_x/ab/cab.py") == (
        "reduce_scatter_tensor (cab.py:4)",
        "3",
    )
    assert _read_while_waiting(_INDUCTOR_BODY, "/tmp/torchinductor_x/cd/ecd.py") == (
        "all_gather_into_tensor_out (ecd.py:3)",
        "5",
    )
    assert collective_wait(sys._getframe()) is None  # this test's own stack waits for nothing


def test_a_busy_rank_is_waited_for_up_to_the_process_groups_timeout(monkeypatch):
    """Rank 1 beats and is blocked in nothing (its own work): rank 0 waits past its 1.5 s timeout, but
    not forever: at the process group's timeout (3 s here; gloo's default is 30 min) it raises."""
    import zcompile.agreement.store_exchange as store_exchange

    monkeypatch.setattr(store_exchange, "process_group_timeout_s", lambda group: 3.0)
    store, stop = dist.HashStore(), threading.Event()

    def beat():
        count = 0
        while not stop.is_set():
            count += 1
            store.set(alive_key(1), json.dumps({"beat": count, "blocked_in": None, "for_s": 0.0}))
            time.sleep(0.2)

    beating = threading.Thread(target=beat, daemon=True)
    beating.start()
    start = time.perf_counter()
    try:
        with pytest.raises(
            RankDivergenceError,
            match=r"ranks \[1\] did not within [34]s, the process group's "
            r"timeout \(rank 1 is alive, running its own code: busy",
        ):
            exchange_through(store, "x", _group(0), 1.5, "check", "doing", "the fix")
    finally:
        stop.set()
    assert 3.0 <= time.perf_counter() - start < 6


def test_a_note_from_another_rank_ends_the_wait_at_once():
    store = dist.HashStore()
    store.set("zcompile/abort/g", '[0, "zcompile: graph 0/1: rank 0 gave up"]')
    start = time.perf_counter()
    with pytest.raises(
        RankDivergenceError,
        match=r"rank 1 \(its call #1\) stopped waiting: rank 0 reported: "
        r"zcompile: graph 0/1: rank 0 gave up",
    ):
        exchange_through(store, "x", _group(1), 60, "step", "zcompile optimizer.step()", "fix")
    assert time.perf_counter() - start < 5  # not the 60s timeout


# ---- two gloo ranks: evaluation on rank 0 only ----


def _train_step(compiled, optimizer):
    model_loss("gpt", compiled, *global_batch(0, 2)).backward()
    optimizer.step()
    optimizer.zero_grad()


def _eval_on_rank0_without_collectives(rank, stage):
    """Stages 1, 2: rank 0 evaluates under no_grad (a graph without collectives) while rank 1 waits at
    the next step; then both train on. Returns rank 0's eval seconds and the first step's."""
    torch._dynamo.reset()
    model = build_model("gpt")
    compiled = torch.compile(model, backend="zero", options={"stage": stage})  # the default 60s timeout
    optimizer = zcompile.optim.SGD(model.parameters(), lr=0.1)
    start = time.perf_counter()
    _train_step(compiled, optimizer)
    first_step_s = time.perf_counter() - start
    eval_s = None
    if rank == 0:
        start = time.perf_counter()
        with torch.no_grad():
            model_loss("gpt", compiled, *global_batch(1, 2))
        eval_s = time.perf_counter() - start
    _train_step(compiled, optimizer)  # the ranks still agree: the eval took no turn in any exchange
    return {"eval_s": eval_s, "first_step_s": first_step_s}


def _eval_on_rank0_stage3(rank):
    """Stage 3: rank 0's eval graph all-gathers, so it needs rank 1, which went on training and waits
    in its forward's all-gather for rank 0. Both must raise within seconds, long before the 60 s
    timeout: rank 0 because rank 1's beat says it waits in a collective that needs rank 0, rank 1
    relaying rank 0's report."""
    torch._dynamo.reset()
    model = build_model("gpt")
    compiled = torch.compile(model, backend="zero", options={"stage": 3})  # the default 60 s timeout
    optimizer = zcompile.optim.SGD(model.parameters(), lr=0.1)
    _train_step(compiled, optimizer)
    start, error = time.perf_counter(), None
    try:
        if rank == 0:
            with torch.no_grad():
                model_loss("gpt", compiled, *global_batch(1, 2))
        else:
            _train_step(compiled, optimizer)  # waits for rank 0 (at the store, or in a collective)
    except Exception as raised:  # noqa: BLE001 - any error goes back to the test (Dynamo wraps compile errors)
        error = raised
    divergence = next((e for e in _chain(error) if isinstance(e, RankDivergenceError)), None)
    return {
        "error": f"{type(error).__name__}: {error}",
        "divergence": str(divergence) if divergence else None,
        "seconds": time.perf_counter() - start,
    }  # rank 0 now leaves, as a failing rank does


def _chain(error):
    while error is not None:
        yield error
        error = error.__cause__ or error.__context__


def _eval_on_rank0_only(rank, world):
    return {
        **{f"stage{stage}": _eval_on_rank0_without_collectives(rank, stage) for stage in (1, 2)},
        "stage3": _eval_on_rank0_stage3(rank),
    }


def test_eval_on_rank0_only_works_at_stages_1_2_and_fails_fast_on_both_ranks_at_stage3():
    # the store outlives rank 0, as torchrun's does: rank 1 reads rank 0's note after it left
    rank0, rank1 = run_ranks(2, _eval_on_rank0_only, timeout_s=240)
    # stages 1, 2: no check, no wait (the default timeout is 60s): a compile of its own, quicker than the first step's
    for stage in (1, 2):
        times = rank0[f"stage{stage}"]
        assert times["eval_s"] < times["first_step_s"] + 5, (stage, times)
    # stage 3: rank 0 names rank 1's wait; rank 1, in its all-gather, relays rank 0's report
    stage3 = rank0["stage3"]
    waits = "ranks [1] wait elsewhere (rank 1 waits in compiled graph 0/0, in all_gather_into_tensor_out"
    assert stage3["divergence"] and waits in stage3["divergence"], stage3["error"]
    assert "over ranks [0, 1]" in stage3["divergence"] and "each waits for the other" in stage3["divergence"]
    assert stage3["seconds"] < 20, stage3  # not the 60 s timeout
    stage3 = rank1["stage3"]
    assert stage3["divergence"] and "rank 0 reported" in stage3["divergence"], stage3["error"]
    assert waits in stage3["divergence"]
    assert stage3["seconds"] < 30, stage3  # never the process group's timeout (120s in the launcher)


# ---- torch's own runtime net ----


def _train_two_steps(rank, world):
    """The losses of 2 stage-2 steps, and the class of the process group's CPU backend."""
    backend = type(dist.group.WORLD._get_backend(torch.device("cpu"))).__name__
    return train_zero(RunSpec(stage=2, steps=2, optimizer="sgd", lr=0.1), rank, world).losses, backend


def test_trains_under_torch_distributed_debug_detail():
    """``TORCH_DISTRIBUTED_DEBUG=DETAIL`` wraps the process group to fingerprint every collective
    across ranks; zcompile's collectives pass it, and the arithmetic is the same to the bit."""
    plain = run_ranks(2, _train_two_steps)
    checked = run_ranks(2, _train_two_steps, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    assert [backend for _, backend in checked] == ["_ProcessGroupWrapper"] * 2  # the net was there
    assert [backend for _, backend in plain] == ["ProcessGroupGloo"] * 2
    assert [losses for losses, _ in checked] == [losses for losses, _ in plain] and len(plain[0][0]) == 2


def test_the_store_going_away_while_a_rank_waits_is_a_divergence_error_not_a_network_error():
    """Without torchrun's agent, rank 0's process hosts the store and leaves as soon as it has raised
    what it found; a rank still polling then got c10d's "Failed to recv ... Did the remote server
    shutdown or crash?" (seen in CI, two ranks on a busy machine). It now says the store's host ended."""
    host = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time, torch.distributed as d\n"
            "s = d.TCPStore('127.0.0.1', 0, 2, is_master=True, wait_for_workers=False)\n"
            "print(s.port, flush=True); sys.stdin.readline(); time.sleep(1.5)\n",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        port = int(host.stdout.readline())
        client = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=10))
        host.stdin.write("go\n")
        host.stdin.flush()  # the host ends 1.5 s from now, past the exchange's first wait (FIRST_WAIT_S)
        start = time.perf_counter()
        with pytest.raises(
            RankDivergenceError,
            match=r"rank 1 \(its call #1\) lost the store the ranks meet "
            r"through.*rank 0's.*the fix",
        ):
            exchange_through(client, "x", _group(1), 30, "check", "doing", "the fix")
        assert time.perf_counter() - start < 10  # not the 30s timeout
    finally:
        host.kill()
        host.wait()
