"""Bytes of tensors in a graph and how long they live: the memory rules of the schedule and the report.

- ``tensor_bytes(value)``: bytes of every tensor in a (nested) value; ``node_bytes(node)``: of the
  node's ``meta["val"]``.
- ``storages``: the storages a gathered buffer lives in, each from where it is made to its last
  reader (through views; a copy is a reader and a storage of its own).
- ``peak_bytes``: the most bytes alive at once over such intervals.
- ``gathered_peak_bytes(gm)``: the gathered-parameter peak of a graph as it is ordered now.
- ``saved_activation_bytes(forward, backward)``: what the forward saves for the backward, less
  inputs (parameters, shards) and gathered weights kept for backward (counted with the gathers),
  each storage once (a saved value and a saved view of it are one storage).
- ``aliases(node)`` / ``storage_of(gm, node)``: which values allocate nothing (views, a
  collective's wait, ops whose schema returns an alias) and the storage a value lives in.
- ``live_peak_bytes(gm, preloaded)``: the most bytes a graph holds at once as its generated code
  runs it, every value freed after its last reader (``zcompile.predict.step_peak`` sums a step from it).

The planner predicts with these rules and the report measures the final graph with the same ones,
so a plan and its report agree by construction.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Hashable

import networkx as nx
import torch

from zcompile.passes.collectives import ALL_GATHER, ALL_REDUCE, WAIT, CollectiveNode, is_zero_collective
from zcompile.passes.op_sets import PREP_OPS, VIEW_OPS, is_call_to, makes_copy
from zcompile.passes.regions import INVOKE_SUBGRAPH, called_subgraph, subgraph_output_origin
from zcompile.passes.sizes import traced_int

log = logging.getLogger(__name__)
SUBGRAPH_CALL = frozenset({INVOKE_SUBGRAPH})


def tensor_bytes(value) -> int:
    """Bytes of the tensors in ``value`` (a tensor, or lists/tuples/dicts of them), as a plain int.

    A size Dynamo made symbolic (the RNG state ``torch.utils.checkpoint`` saves has a size the trace
    cannot know) counts at its traced value, without a guard: arithmetic on the symbol would put a
    guard on a shape no input of the frame has, and Dynamo fails building its guards."""
    if isinstance(value, torch.Tensor):
        leaves = (value,)
    elif isinstance(value, (list, tuple)) and all(isinstance(v, torch.Tensor) for v in value):
        leaves = value  # a flat list (the optimizer's buckets, each step): no pytree walk
    else:
        leaves = torch.utils._pytree.tree_leaves(value)
    return sum(traced_int(t.numel()) * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


def node_bytes(node: torch.fx.Node) -> int:
    """Bytes of the value ``node`` produces (0 when it has no ``meta["val"]``)."""
    return tensor_bytes(node.meta.get("val"))


def dependency_graph(gm: torch.fx.GraphModule) -> nx.DiGraph:
    """The nodes of ``gm`` as a networkx DAG (edge: producer -> user), with their positions."""
    dag = nx.DiGraph()
    for position, node in enumerate(gm.graph.nodes):
        dag.add_node(node, position=position)
        for source in node.all_input_nodes:
            dag.add_edge(source, node)
    return dag


def storages(dag: nx.DiGraph, position: dict, collective: torch.fx.Node) -> list[tuple[torch.fx.Node, int, int, int]]:
    """The storages a gathered buffer lives in: (node that makes it, from, last read, bytes).

    The collective's output lives from the collective to its last reader through views; a copy
    (a bucket piece made contiguous, a cast) is a reader of it and a storage of its own, counted
    until its own last reader. Bucketing copies every piece right after the wait, so a bucket
    costs its buffer plus its pieces for a moment, then only the pieces (each until its last
    reader; a piece kept for backward, read by the output, to the end). Copying each piece just
    before its reader instead would hold more with prefetch: the buffer would then live through the
    bucket's compute beside the next bucket's buffer.
    """
    out, todo = [], [collective]
    while todo:
        storage = todo.pop()
        last, stack, seen = position[storage], [storage], {storage}
        while stack:
            for user in dag.successors(stack.pop()):
                last = max(last, position[user])
                if user in seen:
                    continue
                seen.add(user)
                if makes_copy(user):
                    todo.append(user)
                elif is_call_to(user, PREP_OPS):
                    stack.append(user)
        out.append((storage, position[storage], last, node_bytes(storage)))
    return out


def peak_bytes(intervals: list[tuple[float, float, int]]) -> int:
    """Most bytes alive at once over ``(from, last use, bytes)`` intervals (both ends included)."""
    events = sorted(
        [(start, nbytes) for start, _, nbytes in intervals] + [(end + 0.1, -nbytes) for _, end, nbytes in intervals]
    )
    peak = live = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak


def gathered_peak_bytes(gm: torch.fx.GraphModule | None, gather_staging: bool = False) -> int:
    """Most bytes of gathered parameters alive at once in ``gm`` as it is ordered now.

    Each all-gather's output counts from the gather's issue to its last reader, and each copy made
    of it (bucket pieces) from the copy to the copy's last reader (``storages``). A weight kept for
    backward is read by the output, so it counts to the end. ``gather_staging``: also the second
    buffer a gloo all-gather holds from its issue to its wait (``live_peak_bytes``).
    """
    if gm is None:
        return 0
    dag = dependency_graph(gm)
    position = nx.get_node_attributes(dag, "position")
    live = []
    for node in gm.graph.find_nodes(op="call_function", target=ALL_GATHER):
        if is_zero_collective(node):  # the model's own gather moves activations, not weights
            live += [(start, last, nbytes) for _, start, last, nbytes in storages(dag, position, node)]
    if gather_staging:
        live += _gather_staging(gm, position, zero_only=True)
    return peak_bytes(live)


def gathered_peak_parts(graphs: list[torch.fx.GraphModule | None], gather_staging: bool) -> tuple[int, int]:
    """(the most gathered bytes any of ``graphs`` holds at once, what gloo's copies of the gathers in
    flight add to that most) -- ``step_report``'s and ``simulate``'s two parts; the second is 0
    without ``gather_staging`` (NCCL: the gather writes in place)."""
    gathered = max([gathered_peak_bytes(gm) for gm in graphs] or [0])
    if not gather_staging:
        return gathered, 0
    return gathered, max([gathered_peak_bytes(gm, gather_staging=True) for gm in graphs] or [0]) - gathered


def saved_for_backward(forward: torch.fx.GraphModule, backward: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The forward's nodes the backward receives: AOTAutograd's forward returns its outputs, then
    the saved values, one per backward placeholder that is not a tangent."""
    saved_count = sum(1 for p in backward.graph.find_nodes(op="placeholder") if not p.name.startswith("tangents"))
    outputs = list(torch.utils._pytree.tree_leaves(forward.graph.output_node().args))
    return [node for node in outputs[len(outputs) - saved_count :] if isinstance(node, torch.fx.Node)]


def saved_activation_bytes(forward: torch.fx.GraphModule | None, backward: torch.fx.GraphModule | None) -> int:
    """Bytes the forward saves for the backward that are activations: not graph inputs (parameters,
    shards, the batch) and not gathered weights (all-gather outputs kept for backward, counted by
    ``gathered_peak_bytes``); each storage once."""
    if forward is None or backward is None:
        return 0
    gathered = gathered_values(forward)
    storages_held = saved_storages(forward, backward)
    return sum(nbytes for node, (_, nbytes) in storages_held.items() if is_saved_activation(forward, node, gathered))


def saved_storages(
    forward: torch.fx.GraphModule, backward: torch.fx.GraphModule
) -> dict[torch.fx.Node, tuple[Hashable, int]]:
    """The storages the forward's saved values hold from forward to backward, activations and kept
    gathered weights alike: saved node -> (its storage's key, bytes), for the first saved node of each
    storage (``storage_of``); saved inputs and views of them (no storage of their own) left out."""
    out, seen = {}, set()
    for node in saved_for_backward(forward, backward):
        key, nbytes = storage_of(forward, node)
        if key is None or key in seen:
            continue
        seen.add(key)
        out[node] = (key, nbytes)
    return out


def gathered_values(forward: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """The forward's all-gathers of weights (not the model's own, whose results are activations) and
    what prepares their buffers for the readers (``PREP_OPS``)."""
    gathered: set[torch.fx.Node] = set()
    for collective in filter(is_zero_collective, forward.graph.find_nodes(op="call_function", target=ALL_GATHER)):
        stack = [collective]
        while stack:
            node = stack.pop()
            gathered.add(node)
            stack += [user for user in node.users if user not in gathered and is_call_to(user, PREP_OPS)]
    return gathered


def is_saved_activation(forward: torch.fx.GraphModule, node: torch.fx.Node, gathered: set[torch.fx.Node]) -> bool:
    """Whether saved value ``node`` is an activation: its storage (``storage_of``) is not an input's
    and not a gathered weight's (``gathered``: ``gathered_values(forward)``). A block subgraph's input
    handed back by its call (``mark_repeated_blocks``) is judged by the operand it is."""
    key, _ = storage_of(forward, node)
    return key is not None and key not in gathered


def aliases(node: torch.fx.Node) -> bool:
    """Whether ``node`` allocates nothing: its value lives in its first argument's storage (a view,
    ``VIEW_OPS``; a collective's wait; an op whose schema returns an alias of an input, as views and
    in-place ops do; ``getitem`` of an op that returns views, such as ``split``)."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return False
    if is_call_to(node, VIEW_OPS) or node.target is WAIT:
        return True
    if node.target is operator.getitem:
        return aliases(node.args[0])
    schema = getattr(node.target, "_schema", None)
    return bool(schema and schema.returns and schema.returns[0].alias_info is not None)


def storage_of(gm: torch.fx.GraphModule, node: torch.fx.Node) -> tuple[Hashable | None, int]:
    """The storage ``node``'s value lives in, as (key, bytes): the node that allocated it, reached
    through ``aliases``; a block subgraph's output is its operand when the block hands an input back,
    else (call, the subgraph's own storage key). ``(None, 0)`` for a graph input or a view of one."""
    root = _root(gm, node)
    if root.op == "placeholder":
        return None, 0
    inner = _subgraph_output(gm, root)
    if inner is not None:
        subgraph, returned = inner
        key, nbytes = storage_of(subgraph, returned)
        return (None, 0) if key is None else ((root.args[0], key), nbytes)
    return root, node_bytes(root)


def _root(gm: torch.fx.GraphModule, node: torch.fx.Node) -> torch.fx.Node:
    """The node behind ``node``'s value: through ``aliases`` and block subgraphs' handed-back inputs."""
    while True:
        if aliases(node):
            node = node.args[0]
            continue
        origin = subgraph_output_origin(gm, node)
        if origin is None:
            return node
        node = origin[0]


def _subgraph_output(
    gm: torch.fx.GraphModule, node: torch.fx.Node
) -> tuple[torch.fx.GraphModule, torch.fx.Node] | None:
    """For ``getitem(call, k)`` of a block subgraph call: the subgraph and the node it returns at ``k``."""
    if not (node.op == "call_function" and node.target is operator.getitem and is_call_to(node.args[0], SUBGRAPH_CALL)):
        return None
    subgraph = called_subgraph(gm, node.args[0])
    returned = None if subgraph is None else subgraph.graph.output_node().args[0]
    index = node.args[1]
    if not isinstance(returned, (tuple, list)) or index >= len(returned):
        return None
    return (subgraph, returned[index]) if isinstance(returned[index], torch.fx.Node) else None


def live_peak_bytes(
    gm: torch.fx.GraphModule,
    preloaded: dict[torch.fx.Node, tuple[Hashable, int]] | None = None,
    hold_inputs: bool = False,
    gather_staging: bool = False,
) -> int:
    """Most bytes ``gm`` holds at once when its generated code runs it: every value it allocates from
    its node to the last reader of it or of an alias of it (``storage_of``; FX's code frees a value
    after its last reader), the values it returns to the end. Graph inputs are not counted except
    ``preloaded`` placeholders (placeholder -> (storage key, bytes); placeholders with one key are one
    storage), from the start to their last reader, or to the end with ``hold_inputs`` (a caller that
    keeps its arguments until the graph returns, as ``make_boxed_func`` does; zcompile's compilers do
    not: ``zcompile.backend.aot.boxed_graph_function``, inductor's code). A block subgraph call
    adds, while it runs, what its subgraph holds at once (this walk of it) beyond the outputs it
    returns. Another higher-order op's inside is not counted: logged as a warning naming it. A
    collective's input lives at least to its wait: the backend's work holds it while it runs.

    ``gather_staging``: each all-gather also holds a second buffer of its output's bytes from its issue
    to its wait. Gloo gathers into a flat buffer of its own and then copies each rank's piece out
    (``ProcessGroupGloo``'s all-gather work: ``newLikeFlat`` of the outputs, freed when the work is
    done); NCCL writes the output in place. Counted to the wait, the latest the work can end."""
    preloaded = preloaded or {}
    nodes = list(gm.graph.nodes)
    position = {node: i for i, node in enumerate(nodes)}
    end = len(nodes)
    buffers: dict[Hashable, list] = {}  # key -> [from, last read, bytes]
    buffer_of: dict[torch.fx.Node, Hashable] = {}
    transients: list[tuple[float, int]] = []
    walked: dict[int, int] = {}  # a subgraph called once per layer is walked once
    for node in nodes:
        key = _buffer(gm, node, preloaded, buffers, position, hold_inputs)
        if key is not None:
            buffer_of[node] = key
        if is_call_to(node, SUBGRAPH_CALL):
            transients.append((position[node], _subgraph_transient(gm, node, walked, gather_staging)))
    staging = _gather_staging(gm, position) if gather_staging else []
    unwalked = sorted(
        {
            str(n.target)
            for n in nodes
            if n.op == "call_function"
            and not is_call_to(n, SUBGRAPH_CALL)
            and isinstance(n.target, torch._ops.HigherOrderOperator)
        }
    )
    if unwalked:
        log.warning(
            "zcompile: the memory walk of %s does not enter its calls of %s: only their outputs are counted",
            type(gm).__name__,
            ", ".join(unwalked),
        )
    for node in nodes:
        key = buffer_of.get(node)
        for reader in node.users if key is not None else ():
            buffers[key][1] = max(buffers[key][1], end if reader.op == "output" else position[reader])
        held = _held_to_wait(node)
        if held is not None and buffer_of.get(held.input) is not None:
            last = max((position[w] for w in held.waits), default=end)
            buffers[buffer_of[held.input]][1] = max(buffers[buffer_of[held.input]][1], last)
    events = [(start, nbytes) for start, _, nbytes in buffers.values()]
    events += [(max(start, last) + 0.5, -nbytes) for start, last, nbytes in buffers.values()]
    events += [e for at, extra in transients for e in ((at, extra), (at + 0.25, -extra))]
    events += [e for start, wait, nbytes in staging for e in ((start, nbytes), (wait + 0.5, -nbytes))]
    live = peak = 0
    for _, delta in sorted(events):
        live += delta
        peak = max(peak, live)
    return peak


def _held_to_wait(node: torch.fx.Node) -> CollectiveNode | None:
    """The collective ``node`` is, where its work holds its input until the wait (an all-gather, a
    reduce-scatter, an all-to-all: the backend reads the input while it runs; an all-reduce works on
    a copy of its input that is its output)."""
    collective = CollectiveNode.of(node)
    return collective if collective is not None and collective.node.target is not ALL_REDUCE else None


def _buffer(gm, node, preloaded, buffers, position, hold: bool) -> Hashable | None:
    """The key of the storage ``node`` lives in, created in ``buffers`` at its first value; ``None``
    for a graph input that is not preloaded (or a view of one) and for what is not a tensor op. An
    op with several outputs makes each at its node; each lives until the last reader of its
    ``getitem``, one that no ``getitem`` reads is freed at once."""
    if node.op not in ("placeholder", "call_function"):
        return None
    if node.op == "call_function" and isinstance(node.meta.get("val"), (tuple, list)) and not aliases(node):
        read = {user.args[1]: node_bytes(user) for user in node.users if user.target is operator.getitem}
        unread = 0 if is_call_to(node, SUBGRAPH_CALL) else max(0, node_bytes(node) - sum(read.values()))
        buffers[node] = [position[node], position[node], unread]  # a call's are in its transient
        return None
    root = _root(gm, node)
    if root.op == "placeholder":
        if root not in preloaded:
            return None
        key, nbytes = preloaded[root]
        buffers.setdefault(key, [0, len(position) if hold else 0, nbytes])
        return key
    key, nbytes = storage_of(gm, root)
    if key is not None and key not in buffers:
        made = root.args[0] if root.target is operator.getitem else root
        buffers[key] = [position[made], position[made], nbytes]
    return key


def _gather_staging(gm: torch.fx.GraphModule, position: dict, zero_only: bool = False) -> list[tuple[int, int, int]]:
    """(issue, wait, bytes) of each all-gather's second buffer (``live_peak_bytes``' ``gather_staging``);
    ``zero_only``: of the gathers of weights alone, not the model's own."""
    return [
        (
            position[node],
            max((position[w] for w in CollectiveNode.of(node).waits), default=len(position)),
            node_bytes(node),
        )
        for node in gm.graph.find_nodes(op="call_function", target=ALL_GATHER)
        if not zero_only or is_zero_collective(node)
    ]


def _subgraph_transient(
    gm: torch.fx.GraphModule, call: torch.fx.Node, walked: dict[int, int], gather_staging: bool = False
) -> int:
    """Bytes a block subgraph call holds while it runs beyond the outputs it returns (``walked``:
    id of a subgraph -> this, for the calls of one walk)."""
    subgraph = called_subgraph(gm, call)
    if subgraph is None:
        log.warning(
            "zcompile: the memory walk finds no subgraph for %s on its graph: what it holds inside is not counted",
            call.name,
        )
        return 0
    if id(subgraph) not in walked:
        returned = [r for r in subgraph.graph.output_node().args[0] if isinstance(r, torch.fx.Node)]
        outputs = dict(storage_of(subgraph, r) for r in returned)
        outputs.pop(None, None)
        walked[id(subgraph)] = max(0, live_peak_bytes(subgraph, gather_staging=gather_staging) - sum(outputs.values()))
    return walked[id(subgraph)]
