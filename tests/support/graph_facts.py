"""Facts read from the compiled graphs of a run: collectives per parameter, gathered weights saved
for backward, parameters gathered twice, overlap, keep-gathered plans (see ``graph_facts``)."""

from __future__ import annotations

import json

import torch

from zcompile.passes.collectives import ALL_GATHER, ALL_TO_ALL, REDUCE_SCATTER, WAIT, collective_nodes
from zcompile.passes.graph_ops import gather_param
from zcompile.passes.metadata import params_of
from zcompile.passes.op_sets import PREP_OPS
from zcompile.reports.step_report import collective_overlaps


def _reads_gathered_param(node) -> bool:
    """Whether ``node`` is a gathered parameter: the wait of an all-gather, reached back through the
    ops that prepare a gathered buffer for its reader (``PREP_OPS``: views, casts, copies, the split
    of a bucket)."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function":
        if node.target is WAIT and node.args[0].target is ALL_GATHER:
            return True
        if node.target not in PREP_OPS:
            return False
        node = node.args[0]
    return False


def graph_facts(compiled_graphs) -> dict:
    """Counts read from the compiled graphs, per parameter (a bucketed collective counts each
    parameter it moves): gathers and reduce-scatters per graph, gathered weights saved for
    backward, parameters gathered twice in one graph, and the collective ops themselves."""
    facts = dict(
        graphs=len(compiled_graphs),
        gather_nodes=0,
        fw_all_gathers=0,
        bw_all_gathers=0,
        bw_reduce_scatters=0,
        saved_gathered=0,
        gathered_twice=0,
        collective_ops=0,
        overlapped_collectives=0,
        kept_params=0,
        keep_plans=[],
        bw_all_to_all_ops=0,
        bw_reduce_scatter_ops=0,
    )

    def params_moved(gm, kind):
        # by kind: a reduce-scatter counts also where gloo runs it as an all-to-all (reduce_scatter_lowering)
        nodes = [c.node for c in collective_nodes(gm) if c.kind == kind]
        facts["collective_ops"] += len(nodes)
        names = [name for node in nodes for name in (params_of(node) or ["?"])]
        facts["gathered_twice"] += len(names) - len(set(names)) if kind == "all_gather" else 0
        return len(names)

    for graphs in compiled_graphs:
        for gm in (graphs.forward, graphs.backward):
            facts["overlapped_collectives"] += sum(r.overlapped_ops > 0 for r in collective_overlaps(gm, "", ""))
        facts["gather_nodes"] += len(graphs.dynamo.graph.find_nodes(op="call_function", target=gather_param))
        if graphs.keep_gathered is not None:
            facts["kept_params"] += len(graphs.keep_gathered.kept)
            facts["keep_plans"].append(json.loads(graphs.keep_gathered.to_json()))
        if graphs.forward is not None:
            facts["fw_all_gathers"] += params_moved(graphs.forward, "all_gather")
            outputs = graphs.forward.graph.find_nodes(op="output")[0].args[0]
            facts["saved_gathered"] += sum(_reads_gathered_param(out) for out in outputs)
        if graphs.backward is not None:
            facts["bw_all_gathers"] += params_moved(graphs.backward, "all_gather")
            facts["bw_reduce_scatters"] += params_moved(graphs.backward, "reduce_scatter")
            # how they run: as all-to-alls on gloo unless the option reduce_scatter says "native"
            for key, op in (("bw_all_to_all_ops", ALL_TO_ALL), ("bw_reduce_scatter_ops", REDUCE_SCATTER)):
                facts[key] += len(graphs.backward.graph.find_nodes(op="call_function", target=op))
    return facts
