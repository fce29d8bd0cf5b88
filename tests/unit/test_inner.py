"""``zcompile.backend.aot``: the eager inner compiler runs its graphs in the boxed calling convention, so a
backward frees each saved activation and tangent after its last reader instead of holding them all
until it returns (what ``functorch.compile.make_boxed_func`` did)."""

from __future__ import annotations

import tempfile
import weakref
from types import SimpleNamespace

import torch
from functorch.compile import make_boxed_func

from zcompile.backend.aot import _quoting_abort_notes, boxed_graph_function
from zcompile.backend.compiled import CompiledGraphs
from zcompile.common.process_group import DataParallelGroup
from zcompile.reports.timeline import record_step


def _graph_with_probe(probe) -> torch.fx.GraphModule:
    """``c = a * 2; probe(); return c + b, probe's result``: ``a``'s last reader comes before the probe."""
    graph = torch.fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    c = graph.call_function(torch.mul, (a, 2))
    seen = graph.call_function(probe, ())
    graph.output((graph.call_function(torch.add, (c, b)), seen))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _input_alive_at_probe(make_run) -> bool:
    alive = []
    gm = _graph_with_probe(lambda: alive.append(ref() is not None))
    run = make_run(gm)
    a = torch.ones(4)
    ref = weakref.ref(a)
    args = [a, torch.ones(4)]
    del a  # the list is the only holder, as when AOTAutograd hands over its list
    out, _ = run(args)
    assert torch.equal(out, torch.full((4,), 3.0))
    return alive[0]


def test_boxed_graph_function_frees_an_input_after_its_last_reader():
    """The weakref to ``a`` is dead when the probe runs, after ``a``'s last reader and before the graph
    returns, also through the backward's wrapper that quotes abort notes; under ``make_boxed_func``
    (the list kept) it is alive, so the probe does observe it. The graph module keeps its ordinary
    code: reports and dumps read it."""
    one_rank = CompiledGraphs(dynamo=None, context=SimpleNamespace(group=DataParallelGroup(0, 1, "g", None)))
    assert not _input_alive_at_probe(boxed_graph_function)
    assert not _input_alive_at_probe(lambda gm: _quoting_abort_notes(boxed_graph_function(gm), one_rank))
    assert _input_alive_at_probe(lambda gm: make_boxed_func(gm.forward))
    gm = _graph_with_probe(lambda: None)
    boxed_graph_function(gm)
    assert gm.code.lstrip().startswith("def forward(self, a, b)")


LAYERS, WIDTH = 8, 256
ACTIVATION = WIDTH * WIDTH * 4  # one layer's saved activation (a WIDTH x WIDTH batch), and one weight's gradient


class Chain(torch.nn.Module):
    """Square layers on a square batch: each layer saves one activation of the size of its weight's
    gradient, so the backward frees one as it makes the other."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.sum()


def _step_peak(compile_model) -> int:
    """The allocator's peak of one forward and backward (torch.profiler's memory events), after a warm-up."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Chain()
    run = compile_model(model)
    x = torch.randn(WIDTH, WIDTH)
    run(x).backward()
    model.zero_grad(set_to_none=True)
    with tempfile.TemporaryDirectory() as trace_dir:
        return record_step(lambda: run(x).backward(), trace_dir, rank=0).peak_bytes


def test_compiled_backward_frees_saved_activations_as_it_goes():
    """The real allocator's peak of a step of the zero backend (world of one, eager inner compiler)
    is eager PyTorch's, which frees each saved tensor once its node ran: the 8 saved activations plus
    two layer-sized transients of the backward, 10 activations' bytes (the gradients replace the
    activations as they are made). With the backward's inputs held to its end (``make_boxed_func``)
    it was 17: the saved activations kept beside the gradients."""
    eager = _step_peak(lambda model: model)
    zero = _step_peak(lambda model: torch.compile(model, backend="zero", options={"stage": 1}))
    slack = ACTIVATION // 8  # the loss, the scalar tangent: bytes
    assert abs(eager - (LAYERS + 2) * ACTIVATION) < slack, eager / ACTIVATION
    assert zero <= eager + slack, (zero / ACTIVATION, eager / ACTIVATION)


def test_pipeline_graphs_write_their_code_once_when_run_or_read_and_never_stale(monkeypatch):
    """``codegen_on_demand``: the passes' ``recompile()`` calls write no code (each wrote and exec'd
    the whole graph's, about 50 ms a pass on the 16-layer GPT's backward); calling the module or
    reading its code writes it once, from the graph as it is then, so nothing runs a stale graph."""
    from zcompile.backend.aot import codegen_on_demand

    written = []
    real = torch.fx.GraphModule.recompile
    monkeypatch.setattr(torch.fx.GraphModule, "recompile", lambda self: written.append(1) or real(self))
    gm = _graph_with_probe(lambda: None)
    gm.meta["dynamo_compile_id"] = "0/0"
    written.clear()
    lazy = codegen_on_demand(gm)
    assert lazy.meta["dynamo_compile_id"] == "0/0"
    for _ in range(3):  # three passes, each turning the graph's add into a sub (then sub into sub)
        for node in lazy.graph.find_nodes(op="call_function", target=torch.add):
            node.target = torch.sub
        lazy.recompile()
    assert written == []
    out, _ = lazy(torch.ones(4), torch.ones(4))
    assert torch.equal(out, torch.ones(4)) and len(written) == 1  # 1 * 2 - 1: the current graph
    assert "torch.sub" in lazy.code and len(written) == 1
    runnable = boxed_graph_function(lazy)
    assert torch.equal(runnable([torch.ones(4), torch.ones(4)])[0], torch.ones(4)) and len(written) == 2


def test_inductors_compiled_backward_quotes_abort_notes_as_the_eager_one_does(monkeypatch):
    """inductor's backward runs through the wrapper that marks the heartbeat and quotes another rank's
    abort note when a collective fails (before: gloo's "connection closed by peer" alone on the rank
    that waited in it). A spy on the wrapper counts the backward's calls through it."""
    import zcompile.backend.aot as inner

    calls, real = [], inner._quoting_abort_notes

    def spy(run, graphs, first_call_check=None):
        wrapped = real(run, graphs, first_call_check)

        def counted(args):
            calls.append(len(args))
            return wrapped(args)

        counted._boxed_call = True
        return counted

    monkeypatch.setattr(inner, "_quoting_abort_notes", spy)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    compiled = torch.compile(model, backend="zero", options={"compiler": "inductor"})
    loss = compiled(torch.randn(4, 8)).sum()
    assert calls == []
    loss.backward()
    assert len(calls) == 1 and calls[0] > 0


def test_a_split_graph_inductor_cannot_compile_is_compiled_whole_with_a_warning(monkeypatch, caplog):
    """Cross-call prefetch under inductor compiles the split graph's body; where inductor refuses it,
    the graph is compiled whole (no chain: each call gathers its own first bucket), with a warning
    naming the error, rather than the compile failing (every rank compiles alike, so every rank does
    the same)."""
    import logging
    from types import SimpleNamespace

    import torch._inductor.compile_fx as compile_fx

    import zcompile.backend.aot as inner

    split = SimpleNamespace(body=torch.fx.symbolic_trace(torch.nn.Identity()))
    monkeypatch.setattr(inner, "cross_call_split", lambda graph_module, kind, graphs: split)
    monkeypatch.setattr(inner, "issued_example", lambda split: None)

    def refuse(graph_module, inputs, **kwargs):
        raise NotImplementedError("no lowering for that")

    monkeypatch.setattr(compile_fx, "compile_fx_inner", refuse)
    graphs = SimpleNamespace(call_chains={})
    with caplog.at_level(logging.WARNING, logger="zcompile.backend.aot"):
        assert inner._inductor_prefetching_call(None, [], "forward", graphs, {}) is None
    assert graphs.call_chains == {}
    assert "NotImplementedError: no lowering for that" in caplog.text and "compiled whole" in caplog.text
