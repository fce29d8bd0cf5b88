"""drop_identity_views_pass on hand-built aten graphs, run against the graph before it."""

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from zcompile.passes.identity_views import drop_identity_views_pass

aten = torch.ops.aten


def _graph():
    """x [2, 3] -> view to [2, 3] (an identity) read by a mul and handed out; the mul -> view to [6]
    (kept) -> a sum -> a 0-d view of it (an identity, read by an add only)."""
    mode = FakeTensorMode()
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    same = graph.call_function(aten.view.default, (x, [2, 3]))
    doubled = graph.call_function(aten.mul.Tensor, (same, 2.0))
    flat = graph.call_function(aten.view.default, (doubled, [6]))
    summed = graph.call_function(aten.sum.dim_IntList, (flat, [0]))
    again = graph.call_function(aten._unsafe_view.default, (summed, []))  # a 0-d view of a 0-d sum
    plus_one = graph.call_function(aten.add.Tensor, (again, 1.0))
    graph.output((plus_one, same, flat))
    with mode:
        x.meta["val"] = torch.empty(2, 3)
        same.meta["val"] = doubled.meta["val"] = torch.empty(2, 3)
        flat.meta["val"] = torch.empty(6)
        summed.meta["val"] = again.meta["val"] = plus_one.meta["val"] = torch.empty(())
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_identity_views_are_read_around_and_outputs_kept():
    x = torch.randn(2, 3)
    expected = _graph()(x)
    gm = drop_identity_views_pass(_graph())
    identity, flat = gm.graph.find_nodes(op="call_function", target=aten.view.default)
    (mul,) = gm.graph.find_nodes(op="call_function", target=aten.mul.Tensor)
    assert mul.args[0].op == "placeholder"  # read around the identity
    assert list(identity.users) == [gm.graph.output_node()]  # kept for the output that hands it out
    assert flat.args[0] is mul  # a view to another shape is kept
    assert not gm.graph.find_nodes(op="call_function", target=aten._unsafe_view.default)  # unread: erased
    got = gm(x)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_symbolic_or_unknown_shapes_are_left_alone():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    view = graph.call_function(aten.view.default, (x, [2, 3]))  # no meta["val"]: unknown shapes
    graph.output((graph.call_function(aten.mul.Tensor, (view, 2.0)),))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    code = gm.code
    assert drop_identity_views_pass(gm).code == code
