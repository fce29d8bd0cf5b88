"""A transformers model's declared tensor-parallel plan, applied with torch's ``parallelize_module``.

transformers models declare how their layers split (``config.base_model_tp_plan``: module patterns
to "colwise" / "rowwise"), and ``from_pretrained(tp_plan=...)`` applies it only on a mesh over the
whole world (or with its own FSDP2 beside it). With ZeRO over ``mesh["dp"]`` the plan is applied here
on ``mesh["tp"]`` instead: the same split, torch's styles, nothing of zcompile's own.
"""

from __future__ import annotations

import torch

# transformers' plan entries zcompile applies; the others (gathered or packed outputs, expert and
# embedding splits, sequence parallelism) are refused by name
_STYLES = ("colwise", "rowwise")


def apply_tp_plan(model: torch.nn.Module, tp_mesh) -> torch.nn.Module:
    """Splits ``model`` (a transformers model) over ``tp_mesh`` (``mesh["tp"]``) as its
    ``config.base_model_tp_plan`` says, with ``ColwiseParallel`` / ``RowwiseParallel``; returns it.

    The LM head and the embeddings stay whole (replicated over tp, sharded over dp by ZeRO). Raises
    ``ValueError`` naming the model and the entry when the plan is missing or holds a style other
    than "colwise" and "rowwise"."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    config = getattr(model, "config", None)
    plan = getattr(config, "base_model_tp_plan", None)
    name = type(model).__name__
    if not plan:
        raise ValueError(
            f"zcompile.apply_tp_plan: {name} declares no tensor-parallel plan (config.base_model_tp_plan); "
            "parallelize it with torch's parallelize_module on mesh['tp'] and a plan of your own "
            "(docs/tensor-parallel.md)"
        )
    other = {pattern: style for pattern, style in plan.items() if style not in _STYLES}
    if other:
        pattern, style = next(iter(other.items()))
        raise ValueError(
            f"zcompile.apply_tp_plan: {name}'s plan splits {pattern!r} as {style!r}; zcompile applies "
            f"{' and '.join(_STYLES)} only. Parallelize it with torch's parallelize_module on mesh['tp'] and a "
            "plan of your own (docs/tensor-parallel.md)"
        )
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    base = getattr(model, "base_model", model)  # the plan's patterns are relative to the base model
    parallelize_module(base, tp_mesh, {pattern: styles[style]() for pattern, style in plan.items()})
    return model
