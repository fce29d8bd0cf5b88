"""The registered ``zero`` backend (the ``torch_dynamo_backends`` entry point): option
``memory_limit_mb`` planned first (``tune.memory_limit``), then ``backend.zero_backend`` compiles.

It sits above both: the plan compiles candidates with the backend, so the backend cannot call it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from zcompile.backend.entry_point import zero_backend
from zcompile.common.dynamo_frame import forward_modules_on_stack, modules_of_compiled_frame
from zcompile.config import ZeroConfig


def zero(gm: torch.fx.GraphModule, example_inputs: list, options: Any = None, mode: str | None = None) -> Callable:
    """``torch.compile(model, backend="zero", options=...)``: ``zero_backend``, with a memory limit planned."""
    if options is None or ZeroConfig.from_options(options).memory_limit_mb is None:
        return zero_backend(gm, example_inputs, options, mode)
    from zcompile.tune.memory_limit import planned_options  # the planner's imports, only where it plans

    return zero_backend(
        gm, example_inputs, planned_options(gm, example_inputs, options, _model_of(example_inputs)), mode
    )


def _model_of(example_inputs: list) -> torch.nn.Module | None:
    """The module the graph trains: of the compiled frame's modules (and those whose forward is on
    the stack), the one that owns the most of the graph's parameters, the outermost of equals."""
    params = {id(v) for v in example_inputs if isinstance(v, torch.nn.Parameter)}
    modules = list(dict.fromkeys([*forward_modules_on_stack()[::-1], *modules_of_compiled_frame()]))
    owned = [(sum(id(p) in params for p in m.parameters()), -i, m) for i, m in enumerate(modules)]
    best = max(owned, key=lambda entry: entry[:2], default=None)
    return None if best is None or best[0] == 0 else best[2]
