"""Forward code that writes a parameter in place, found on Dynamo's graph before it is sharded.

ZeRO keeps a weight's value on its shards, each rank 1/N of it; the graphs read a gathered (stage 3)
or replicated (stages 1 and 2) copy. A write into the parameter inside the forward reaches only
this rank's copy: ``nn.Embedding(max_norm=...)`` renormalizes, in the weight, the rows its batch
looks up (``torch.embedding_renorm_``), and ``weight.data.clamp_(...)`` in a forward clips it. At
stages 2 and 3 autograd refuses the write to the custom function's output with a message about
views ("Output 0 of _GatherParam is a view and its base ... has been modified inplace"); at stage
1 each rank would keep the renormalization of the rows it looked up in its own slice only, the
step's all-gather would overwrite the rest, and the weights would differ from one process's on
the global batch, with no word.

``parameter_writes`` names each such write; the backend refuses the graph with the fix (move the
write after ``optimizer.step()``, inside ``zcompile.gathered(model)``).
"""

from __future__ import annotations

import torch
import torch.fx

_EMBEDDINGS = frozenset({torch.nn.functional.embedding, torch.embedding})
_MAX_NORM_ARG = 3  # F.embedding(input, weight, padding_idx, max_norm, ...)
_DATA_ATTR = "_get_data_attr"  # the name of what Dynamo calls for ``param.data``
_WRITE_METHODS_EXCLUDED = frozenset({"requires_grad_", "retain_grad_"})  # in place on metadata only


def parameter_writes(gm: torch.fx.GraphModule, param_names: dict[int, str]) -> list[tuple[str, str]]:
    """``(parameter name, what writes it)`` for each in-place write into a parameter in ``gm``
    (Dynamo's graph); ``param_names``: placeholder position -> parameter name."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    params = {placeholders[index]: name for index, name in param_names.items() if index < len(placeholders)}

    def param_of(value) -> str | None:
        if not isinstance(value, torch.fx.Node):
            return None
        if value.op == "call_function" and getattr(value.target, "__name__", "") == _DATA_ATTR and value.args:
            value = value.args[0]  # param.data
        return params.get(value)

    writes = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _EMBEDDINGS:
            weight = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
            max_norm = node.args[_MAX_NORM_ARG] if len(node.args) > _MAX_NORM_ARG else node.kwargs.get("max_norm")
            if max_norm is not None and (name := param_of(weight)) is not None:
                writes.append(
                    (name, f"nn.Embedding(max_norm={max_norm}) renormalizes the rows it looks up in the weight")
                )
        elif node.op in ("call_method", "call_function") and node.args:
            target = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
            if (
                isinstance(target, str)
                and target.endswith("_")
                and not target.startswith("__")
                and target not in _WRITE_METHODS_EXCLUDED
                and (name := param_of(node.args[0])) is not None
            ):
                writes.append((name, f"{target}() writes it"))
    return writes
