"""``autocast_pass`` on symbolic-traced graphs (CPU, bf16).

Checked: ``_enter_autocast`` lands right after the last placeholder (first, in a graph without
inputs) and ``_exit_autocast`` right before the output, both tagged ``ROLE_AUTOCAST``; ``dtype=None``
leaves the graph as it was; and the rewritten graph computes exactly what the original function
computes inside ``torch.autocast("cpu", dtype=torch.bfloat16)`` in eager, which differs from fp32,
and leaves autocast off when it returns.
"""

import torch
from torch.testing import FileCheck

from zcompile.passes import metadata
from zcompile.passes.mixed_precision import autocast_pass

_enter = torch.amp.autocast_mode._enter_autocast
_exit = torch.amp.autocast_mode._exit_autocast


def _f(x, w):
    # a matmul (autocast runs it in bf16) feeding a softmax
    return torch.softmax(x @ w, dim=-1)


def _inputs():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(4, 8, generator=gen), torch.randn(8, 16, generator=gen)


def test_enter_after_last_placeholder_and_exit_before_output():
    gm = torch.fx.symbolic_trace(_f)
    assert not gm.graph.find_nodes(op="call_function", target=_enter)
    gm = autocast_pass(gm, torch.bfloat16, "cpu")
    FileCheck().check("def forward(self, x, w):").check_next(
        "_enter_autocast = torch.amp.autocast_mode._enter_autocast('cpu', torch.bfloat16, True, None)"
    ).check_next("matmul = x @ w").check_next("softmax = torch.softmax(matmul").check_next(
        "torch.amp.autocast_mode._exit_autocast(_enter_autocast)"
    ).check_next("return softmax").run(gm.code)
    nodes = list(gm.graph.nodes)
    (enter,) = gm.graph.find_nodes(op="call_function", target=_enter)
    (leave,) = gm.graph.find_nodes(op="call_function", target=_exit)
    assert [n.op for n in nodes[:2]] == ["placeholder"] * 2 and nodes[2] is enter
    assert nodes[-2] is leave and nodes[-1].op == "output" and leave.args == (enter,)
    for node in (enter, leave):
        assert metadata.tags(node) == {metadata.ROLE: metadata.ROLE_AUTOCAST}
    # only the two autocast nodes were added
    assert len(nodes) == len(torch.fx.symbolic_trace(_f).graph.nodes) + 2


def test_none_dtype_leaves_the_graph_alone():
    gm = torch.fx.symbolic_trace(_f)
    before = gm.code
    assert autocast_pass(gm, None, "cpu").code == before


def test_graph_without_inputs_enters_first():
    graph = torch.fx.Graph()
    ones = graph.call_function(torch.ones, (4, 4))
    graph.output(graph.call_function(torch.matmul, (ones, ones)))
    gm = autocast_pass(torch.fx.GraphModule(torch.nn.Module(), graph), torch.bfloat16, "cpu")
    nodes = list(gm.graph.nodes)
    assert nodes[0].target is _enter and nodes[-2].target is _exit
    assert gm().dtype == torch.bfloat16  # the matmul really ran under autocast


def test_rewritten_graph_equals_eager_autocast():
    x, w = _inputs()
    fp32 = _f(x, w)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _f(x, w)
    got = autocast_pass(torch.fx.symbolic_trace(_f), torch.bfloat16, "cpu")(x, w)
    assert got.dtype == want.dtype == torch.bfloat16
    assert torch.equal(got, want)
    assert not torch.equal(got.float(), fp32)  # the autocast really changed the numbers
    assert not torch.is_autocast_enabled("cpu")  # _exit_autocast ran: no autocast state left behind
