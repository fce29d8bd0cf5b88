"""A deep model simulated from two shallow copies of it: its repeated blocks cut to 2 and to 3,
each copy simulated, every figure extrapolated linearly to the model's depth.

A simulation's time grows with depth (Dynamo and AOTAutograd trace every layer): minutes a
candidate for a 70B model on a CPU host. A transformer's layers are one block repeated, and what
a step costs is, block by block, the same: the third block's share (the difference between the
copies of 3 and of 2 blocks) is every interior block's. The copies keep the first and last
blocks' own costs (the first gather, the last reduce-scatter) and add one interior block, so the
extrapolation is exact where each interior block costs the same; it is approximate where an
option's effect depends on depth: buckets that span blocks, an activation budget's cut that is
not the same in every block.

A ``keep_gathered_mb`` that keeps some of the weights but not all is not a share a shallow copy
can keep alike (the greedy keeps the head's weights and then the last blocks'): such a result is
interpolated, by the bytes kept, between the model keeping none and keeping all of its weights,
each extrapolated as above.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

SHALLOW_BLOCKS = (2, 3)  # the two copies' depths: the second adds one interior block to the first
# the least depth worth it: the copies trace 5 blocks in two compiles, where the whole traces its own
MIN_DEPTH = 8


@dataclass(frozen=True)
class BlockStack:
    """Where a model's repeated blocks are: the container's path and how many blocks it holds."""

    path: str  # the ModuleList's (or Sequential's) qualified name in the model
    depth: int


def repeated_stack(model: torch.nn.Module) -> BlockStack | None:
    """The model's deepest stack of blocks of one class (transformers' ``model.layers``): a
    ``ModuleList`` or ``Sequential`` whose children are all modules of one class with children of
    their own; ``None`` when it has none."""
    best: BlockStack | None = None
    for name, module in model.named_modules():
        if not isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)) or len(module) < 2:
            continue
        classes = {type(child) for child in module.children()}
        first = next(module.children())
        if (
            len(classes) == 1
            and next(first.children(), None) is not None
            and (best is None or len(module) > best.depth)
        ):
            best = BlockStack(name, len(module))
    return best


def shallow_copy_builder(make_model: Callable[[], torch.nn.Module], stack: BlockStack, blocks: int):
    """``make_model`` with its stack of blocks cut to its first ``blocks``. A model's config is left
    as it is (often the caller's own object): a forward that runs ``layers[:num_hidden_layers]``
    runs the copy's blocks."""

    def make_shallow() -> torch.nn.Module:
        model = make_model()
        parent_name, _, attribute = stack.path.rpartition(".")
        parent = model.get_submodule(parent_name)
        kept = list(getattr(parent, attribute).children())[:blocks]
        is_list = isinstance(getattr(parent, attribute), torch.nn.ModuleList)
        setattr(parent, attribute, torch.nn.ModuleList(kept) if is_list else torch.nn.Sequential(*kept))
        return model

    return make_shallow


def interpolated(none, every, kept_bytes: float):
    """The ``SimulationResult`` of a model keeping ``kept_bytes`` of its gathered weights, between
    ``none`` (keeping none) and ``every`` (keeping all): each figure by the share kept, the backward
    re-gathers that ``none`` has more of by the share left."""
    all_kept = every.memory.get("kept_gathered_bytes", 0)
    share = min(1.0, kept_bytes / all_kept) if all_kept else 1.0

    def between(a, b):
        value = a + share * (b - a)
        return type(b)(round(value)) if isinstance(b, int) else value

    result = dataclasses.replace(
        every,
        memory={name: between(none.memory[name], value) for name, value in every.memory.items()},
        collectives=_grown_collectives(every.collectives, every.collectives, none.collectives, 1 - share),
        simulate_s=none.simulate_s + every.simulate_s,
    )
    for name in _SUMMED:
        setattr(result, name, between(getattr(none, name), getattr(every, name)))
    if result.step_s:
        result.mfu = every.mfu * every.step_s / result.step_s
    return result


def extrapolated(shallow, deeper, depth: int, blocks: tuple[int, int] = SHALLOW_BLOCKS):
    """The ``SimulationResult`` of ``depth`` blocks from those of ``blocks[0]`` (``shallow``) and
    ``blocks[1]`` (``deeper``) blocks: every sum and part grown by the difference per block, and so
    the collectives of each kind and group, in count, bytes and seconds (``_grown_collectives``)."""
    low, high = blocks
    per_block = (depth - high) / (high - low)

    def grown(a, b):
        value = b + per_block * (b - a)
        return type(b)(round(value)) if isinstance(b, int) else value

    result = dataclasses.replace(
        deeper,
        memory={name: max(0, grown(shallow.memory[name], value)) for name, value in deeper.memory.items()},
        collectives=_grown_collectives(deeper.collectives, shallow.collectives, deeper.collectives, per_block),
        num_params=grown(shallow.num_params, deeper.num_params),
        simulate_s=shallow.simulate_s + deeper.simulate_s,
        extrapolated_from=(low, high, depth),
    )
    for name in _SUMMED:
        setattr(result, name, grown(getattr(shallow, name), getattr(deeper, name)))
    if deeper.step_s and result.step_s:  # MFU: work grows with the parameters, time with the step
        result.mfu = deeper.mfu * (result.num_params / deeper.num_params) * (deeper.step_s / result.step_s)
    return result


_SUMMED = (  # SimulationResult's figures that grow with the blocks (or stay: the calls, the exchanges)
    "step_s",
    "compute_s",
    "exposed_comm_s",
    "optimizer_update_s",
    "host_overhead_s",
    "store_s",
    "graph_calls",
    "store_exchanges",
    "step_peak_bytes",
)


def _grown_collectives(base: list, fewer: list, more: list, factor: float) -> list:
    """``base``'s collectives and, per (where, kind, group), ``factor`` times what ``more`` has over
    ``fewer`` in count, bytes and seconds (a deeper copy's interior block; a model keeping no weight's
    re-gathers): the added ones equal in size and named ``extrapolated``; a kind that adds bytes but
    no collective (a bucket spanning blocks) has its last collective grown instead."""

    def key(c):
        return (c.where, c.kind, c.group_size, c.inside_node)

    def totals(collectives):
        out: dict[tuple, list] = {}
        for c in collectives:
            entry = out.setdefault(key(c), [0, 0, 0.0])
            entry[0] += 1
            entry[1] += c.bytes
            entry[2] += c.seconds
        return out

    before, after = totals(fewer), totals(more)
    out = list(base)
    for kind, (count, nbytes, seconds) in after.items():
        count_a, bytes_a, seconds_a = before.get(kind, (0, 0, 0.0))
        added = round(factor * (count - count_a))
        added_bytes = round(factor * (nbytes - bytes_a))
        added_seconds = factor * (seconds - seconds_a)
        if added > 0:
            like = next(c for c in reversed(more) if key(c) == kind)
            out.extend(  # equal sizes, the remainder's bytes one each on the first
                dataclasses.replace(
                    like,
                    bytes=added_bytes // added + (i < added_bytes % added),
                    seconds=added_seconds / added,
                    graph="",
                    node="extrapolated",
                )
                for i in range(added)
            )
        elif added_bytes and any(key(c) == kind for c in out):
            last = max(i for i, c in enumerate(out) if key(c) == kind)
            grown = out[last]
            out[last] = dataclasses.replace(
                grown, bytes=grown.bytes + added_bytes, seconds=grown.seconds + added_seconds
            )
    return out


def worth_extrapolating(stack: BlockStack | None) -> bool:
    """A stack of ``MIN_DEPTH`` blocks or more: below it the two copies cost about what the whole does."""
    return stack is not None and stack.depth >= MIN_DEPTH
