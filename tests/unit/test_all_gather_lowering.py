"""all_gathers_into_buffers: gloo's form of the graphs' all-gathers (passes/all_gather_lowering.py)."""

import re

import pytest
import torch

from support.graph_builders import fake_process_group, trace
from support.hand_built import layered_graph
from zcompile.passes.all_gather_lowering import ALL_GATHER_OUT, all_gathers_into_buffers, gather_inputs_into_out_buffers
from zcompile.passes.bucket_ops import PACK_BUCKET, PACK_BUCKET_AS_LAST_ROW
from zcompile.passes.collectives import ALL_GATHER, WAIT

aten = torch.ops.aten


def test_each_gather_runs_into_a_buffer_of_its_output_shape_allocated_where_it_was_issued():
    gm = layered_graph(layers=3, shard=8, world=2)
    order_before = [n.name for n in gm.graph.nodes]
    all_gathers_into_buffers(gm)
    assert not gm.graph.find_nodes(op="call_function", target=ALL_GATHER)
    gathers = gm.graph.find_nodes(op="call_function", target=ALL_GATHER_OUT)
    assert len(gathers) == 3
    nodes = list(gm.graph.nodes)
    for i, gather in enumerate(gathers):
        buffer = gather.kwargs["out"]
        assert buffer.target is aten.empty.memory_format and buffer.args[0] == [16]
        assert nodes.index(buffer) == nodes.index(gather) - 1  # allocated at the issue, as the functional op does
        assert gather.args[0].name == f"shard{i}" and gather.args[1:] == (2, "0")
        (wait,) = gather.users
        assert wait.target is WAIT and wait.name == f"wait{i}"
    # everything else where it was: the gathers' places taken by buffer + gather
    assert [n for n in order_before if not n.startswith("gather")] == [
        n.name for n in nodes if n.target not in (ALL_GATHER_OUT, aten.empty.memory_format)
    ]


def test_the_rewritten_graph_computes_what_the_graph_did():
    """Run on torch's fake process group of 2 ranks (an all-gather there repeats this rank's shard):
    the same values from the functional op and from the out= form."""
    with fake_process_group(world_size=2) as group:
        gm = trace(lambda shard: WAIT(ALL_GATHER(shard, 2, group)) * 2 + 1, torch.zeros(6))
        shard = torch.randn(6)
        expected = gm(shard)
        lowered = all_gathers_into_buffers(gm)
        assert lowered.graph.find_nodes(op="call_function", target=ALL_GATHER_OUT)
        torch.testing.assert_close(lowered(shard), expected, rtol=0, atol=0)
        torch.testing.assert_close(expected, shard.repeat(2) * 2 + 1, rtol=0, atol=0)


def test_the_front_end_rewrites_the_graph_it_runs_and_keeps_the_one_reports_read():
    """``boxed_graph_function(gm, rewrite)`` runs a rewritten copy: ``gm`` (dumps, step_report, the
    memory walks) keeps its all-gathers; the copy that runs gathers into buffers."""
    from zcompile.backend.aot import boxed_graph_function

    with fake_process_group(world_size=2) as group:
        gm = trace(lambda shard: WAIT(ALL_GATHER(shard, 2, group)) * 2, torch.zeros(4))
        run = boxed_graph_function(gm, all_gathers_into_buffers)
        shard = torch.randn(4)
        torch.testing.assert_close(run([shard]), shard.repeat(2) * 2, rtol=0, atol=0)
    assert len(gm.graph.find_nodes(op="call_function", target=ALL_GATHER)) == 1
    assert not gm.graph.find_nodes(op="call_function", target=ALL_GATHER_OUT)


def _inductor_code_between_issue_and_wait(gm: torch.fx.GraphModule, inputs: list) -> tuple[str, list[str], list]:
    """Inductor's generated code for ``gm``: the name of the buffer the all-gather reads, the lines
    between its issue and its wait, and the outputs of one run."""
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.utils import run_and_get_code

    outputs, (code,) = run_and_get_code(lambda: compile_fx_inner(gm, [t.clone() for t in inputs])(list(inputs)))
    lines = code.splitlines()
    issue = next(i for i, line in enumerate(lines) if "all_gather_into_tensor_out.default(" in line)
    wait = next(i for i, line in enumerate(lines) if "wait_tensor.default(" in line and i > issue)
    read = re.search(r"all_gather_into_tensor_out\.default\((?:reinterpret_tensor\()?(\w+)", lines[issue]).group(1)
    return read, lines[issue + 1 : wait], outputs


@pytest.mark.parametrize("shape", [(16,), (4, 4), ()], ids=["flat", "2d", "0d"])
def test_under_inductor_no_kernel_takes_the_gathers_input_before_its_wait(shape):
    """An input computed in the graph (a cast of a shard, a bucket's pack, an activation the model
    gathers), then a kernel whose output has its size while the gather is in flight: inductor hands
    that kernel the input's memory unless the input lives in the gathered buffer's tail."""

    def step(a, b):
        gathered = ALL_GATHER(a * 2, 2, group)
        busy = (b * 3).sin()  # a kernel between the issue and the wait, its output the input's size
        return WAIT(gathered) + 1, busy

    a, b = torch.randn(shape), torch.randn(shape)
    with fake_process_group(world_size=2) as group:
        exposed = all_gathers_into_buffers(trace(step, a, b))
        read, between, _ = _inductor_code_between_issue_and_wait(exposed, [a, b])
        if shape:  # torch's reuse, why the rewrite exists (a 0-d value it does not reuse)
            assert any(f"= {read}; del {read}" in line for line in between)
        kept = gather_inputs_into_out_buffers(all_gathers_into_buffers(trace(step, a, b)))
        read, between, (gathered, busy) = _inductor_code_between_issue_and_wait(kept, [a, b])
        assert not any(read in line for line in between), between
    # torch's fake group of 2 gathers this rank's input twice
    torch.testing.assert_close(gathered, torch.stack([a * 2] * 2).reshape(-1, *shape[1:]) + 1, rtol=0, atol=0)
    torch.testing.assert_close(busy, (b * 3).sin())


def test_under_inductor_a_buckets_pack_is_written_into_its_gathers_buffer_without_a_copy():
    """A bucket's pack (``zcompile::pack_bucket``, a fallback op to inductor) only the gather reads: the
    pack makes the gather's ``[N + 1, width]`` buffer itself and writes the last row, so inductor runs no
    copy of it (before: a copy of the pack into the row, one more pass over the bucket's shards)."""

    def step(a, c, b):
        gathered = ALL_GATHER(PACK_BUCKET([a, c], 1), 2, group)
        busy = (b * 3).sin()  # a kernel between the issue and the wait, its output the pack's size
        return WAIT(gathered) + 1, busy

    a, c, b = torch.randn(4, 3), torch.randn(4), torch.randn(16)
    with fake_process_group(world_size=2) as group:
        kept = gather_inputs_into_out_buffers(all_gathers_into_buffers(trace(step, a, c, b)))
        assert not kept.graph.find_nodes(op="call_function", target=PACK_BUCKET)
        assert not kept.graph.find_nodes(op="call_function", target=aten.copy_.default)
        (pack,) = kept.graph.find_nodes(op="call_function", target=PACK_BUCKET_AS_LAST_ROW)
        assert pack.args[1:] == (1, 3)
        read, between, (gathered, busy) = _inductor_code_between_issue_and_wait(kept, [a, c, b])
        assert not any(read in line for line in between), between
    packed = torch.cat([a.reshape(-1), c])
    torch.testing.assert_close(gathered, torch.cat([packed, packed]) + 1, rtol=0, atol=0)
    torch.testing.assert_close(busy, (b * 3).sin())


@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "static"])
def test_under_inductor_a_computed_input_is_written_into_its_gathers_buffer_by_the_op(dynamic):
    """A model's own gather of normalized embeddings (a CLIP-like contrastive loss), its batch dynamic
    (``dynamic=True``, or Dynamo's recompile for a shorter last batch) or not: when the input was
    copied into an ``empty`` buffer's last row, inductor 2.11 allocated the buffer after the kernel that
    writes that row, and its generated code stopped in "UnboundLocalError: cannot access local variable
    'buf4'" (stage 3, 2 ranks: 'buf99'). The buffer is made by ``pack_bucket_as_last_row`` from the
    input alone; the gathered values, the loss and the gradient are eager's on the same fake group."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    rewritten = []

    def inner(gm, inputs, **kwargs):
        gm = gather_inputs_into_out_buffers(all_gathers_into_buffers(gm))
        rewritten.append(gm)
        return compile_fx_inner(gm, inputs, **kwargs)

    def contrastive(x, w):
        h = torch.nn.functional.normalize(x @ w, dim=-1)
        # detached: the gather's backward on torch 2.11's fake group reads memory it never wrote
        everyone = WAIT(ALL_GATHER(h.detach(), 2, group))
        return torch.nn.functional.cross_entropy(h @ everyone.t(), torch.arange(h.shape[0])), everyone

    x, w = torch.randn(6, 16), torch.randn(16, 32, requires_grad=True)
    reference_w = w.detach().clone().requires_grad_(True)
    # caches off: a cached graph would skip `inner` (the AOTAutograd cache keys the graph before it)
    with (
        fake_process_group(world_size=2) as group,
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        compiled = torch.compile(
            contrastive, backend=lambda gm, inputs: compile_fx(gm, inputs, inner_compile=inner), dynamic=dynamic
        )
        loss, everyone = compiled(x, w)
        loss.backward()
        reference_loss, reference_everyone = contrastive(x, reference_w)  # eager, on the same fake group
        reference_loss.backward()
    forward = rewritten[0]
    (made,) = forward.graph.find_nodes(op="call_function", target=PACK_BUCKET_AS_LAST_ROW)
    assert made.args[1:] == (1, 3) and len(made.args[0]) == 1
    assert not forward.graph.find_nodes(op="call_function", target=aten.copy_.default)
    assert not forward.graph.find_nodes(op="call_function", target=aten.empty.memory_format)
    # torch's fake group of 2 gathers this rank's input twice
    h = torch.nn.functional.normalize(x @ w.detach(), dim=-1)
    torch.testing.assert_close(everyone, torch.cat([h, h]), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(everyone, reference_everyone, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(loss, reference_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(w.grad, reference_w.grad, rtol=1e-5, atol=1e-7)
