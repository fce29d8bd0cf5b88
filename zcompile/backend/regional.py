"""Regional compilation: trace a model's repeated block once, not once per layer.

    zcompile.mark_repeated_blocks(model)      # before torch.compile
    compiled = torch.compile(model, backend="zero", options={...})

Dynamo traces a whole model into one graph, so its compile time grows with depth: a 32-layer
model is traced 32 times over, block by block, by Dynamo and again by AOTAutograd. Marking the
block's ``forward`` with ``torch.compiler.nested_compile_region`` makes Dynamo trace it once and
call that one subgraph (an ``invoke_subgraph``) at every layer; AOTAutograd then traces and
partitions the subgraph once too.

The ZeRO rewrites stay in the outer graph: a block's parameters are inputs of its subgraph call,
so their gathers, bucketing, prefetch across blocks and reduce-scatters are placed by the passes
as without regions, and the subgraph itself holds only the block's compute. What stays linear in
depth is that outer plumbing (a few ops per parameter), not the blocks.

AOTAutograd still meets every call: torch 2.13 re-traces the block's subgraph at each call to
check it for input mutation, which ``schema_once_per_subgraph`` (held by the backend around
AOTAutograd) reduces to once per subgraph; what remains per layer is the call itself and the
outer plumbing.

Which modules are blocks: the modules of a ``ModuleList`` (or ``Sequential``) that holds at least
two modules of one class (transformers' layer lists, ``GPT.blocks``), or the classes named by
``block_classes``. The mark is set on each instance, never on the
class, so other models in the process are untouched: each marked instance's class becomes a subclass
of its own whose ``forward`` is the marked one (``isinstance`` and state dicts are unchanged).
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterable, Iterator

import torch

log = logging.getLogger(__name__)


def mark_repeated_blocks(model: torch.nn.Module, block_classes: Iterable[type | str] | None = None) -> list[type]:
    """Marks every repeated block of ``model`` for one trace per block class (module docstring).

    ``block_classes``: classes (or class names) to mark instead of finding them; a name or class
    that matches no submodule is an error naming the classes the model has. Returns the classes
    marked. Call it before the first compiled call; marking again is a no-op.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"zcompile.mark_repeated_blocks: expected an nn.Module, got {type(model).__name__}")
    classes = _repeated_classes(model) if block_classes is None else _named_classes(model, block_classes)
    if not classes:
        log.warning(
            "zcompile.mark_repeated_blocks: %s has no ModuleList holding two or more modules of one class; "
            "nothing marked (name the block classes with block_classes=[...])",
            type(model).__name__,
        )
        return []
    regions = {cls: _region_class(cls) for cls in classes}
    count = 0
    for module in model.modules():
        region = regions.get(type(module))
        if region is not None:
            module.__class__ = region
            count += 1
    log.info(
        "zcompile.mark_repeated_blocks: %d blocks of %s traced once per class",
        count,
        ", ".join(cls.__name__ for cls in classes),
    )
    return list(classes)


def marked_block_count(model: torch.nn.Module) -> int:
    """How many of ``model``'s modules run as a marked region."""
    return sum(isinstance(module, _Region) for module in model.modules())


class _Region:
    """Base of the region subclasses (``_region_class``): how a marked block is recognised."""

    def __deepcopy__(self, memo):
        # a copy stays marked (copy.deepcopy would otherwise go through __reduce_ex__ below)
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        copied.__setstate__(copy.deepcopy(self.__dict__, memo))
        return copied

    def __reduce_ex__(self, protocol):
        # pickled (torch.save(model)) as the block's own class: the generated subclass has no
        # importable name, and the mark is a compile-time hint the loaded model does not need
        reduced = super().__reduce_ex__(protocol)
        if isinstance(reduced, tuple) and len(reduced) > 1 and reduced[1] and reduced[1][0] is type(self):
            unmarked = next(base for base in type(self).__mro__ if not issubclass(base, _Region))
            reduced = (_new_instance, (unmarked, *reduced[1][1:]), *reduced[2:])
        return reduced


def _new_instance(cls: type, *args):
    """Unpickling's constructor of a block pickled as its own class (``_Region.__reduce_ex__``)."""
    return cls.__new__(cls, *args)


def _region_class(cls: type) -> type:
    """A subclass of ``cls`` whose ``forward`` is ``cls.forward`` marked as a nested compile region.

    A subclass, not an instance attribute: Dynamo takes a marked function bound to one instance as
    that instance's code and reuses the first block's parameters at every layer (wrong losses, even
    with backend="eager"); a method looked up on the class is traced with ``self`` as
    an input. Not ``cls`` itself: other models of the class in the process stay as they were.
    """
    if issubclass(cls, _Region):
        return cls
    forward = torch.compiler.nested_compile_region(cls.forward)
    return type(
        cls.__name__,
        (cls, _Region),
        {"forward": forward, "__module__": cls.__module__, "__qualname__": cls.__qualname__},
    )


def _repeated_classes(model: torch.nn.Module) -> list[type]:
    found: dict[type, None] = {}
    for module in model.modules():
        if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)):
            counts: dict[type, int] = {}
            for child in module.children():
                counts[type(child)] = counts.get(type(child), 0) + 1
            found.update(
                (type(child), None) for child in module.children() if counts[type(child)] >= 2 and _is_block(child)
            )
    return list(found)


def _is_block(module: torch.nn.Module) -> bool:
    # a leaf layer (nn.Linear in an MLP's nn.Sequential) is not a block worth a region, nor a container
    return next(module.children(), None) is not None and not isinstance(module, _CONTAINERS)


_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)


def _named_classes(model: torch.nn.Module, block_classes: Iterable[type | str]) -> list[type]:
    present = {type(m).__name__: type(m) for m in model.modules()}
    wanted = list(block_classes) if not isinstance(block_classes, (str, type)) else [block_classes]
    classes = []
    for entry in wanted:
        cls = present.get(entry) if isinstance(entry, str) else entry if entry in present.values() else None
        if cls is None:
            name = entry if isinstance(entry, str) else getattr(entry, "__name__", repr(entry))
            raise ValueError(
                f"zcompile.mark_repeated_blocks: no submodule of {type(model).__name__} is a {name}; "
                f"its module classes are {sorted(present)}"
            )
        classes.append(cls)
    return classes


@contextlib.contextmanager
def schema_once_per_subgraph() -> Iterator[None]:
    """Within the block: ``invoke_subgraph``'s schema made once per subgraph, not once per call.

    Why: in training, torch 2.13's autograd entry of a higher-order op (``torch/_ops.py``,
    ``HigherOrderOperator.py_autograd_impl``: ``maybe_run_autograd``) calls ``gen_schema`` at
    every call to refuse in-place input mutation, and ``InvokeSubgraphHOP.gen_schema``
    (``torch/_higher_order_ops/invoke_subgraph.py``) re-traces the whole block with ``make_fx``
    (``materialize_as_graph``) to find out. AOTAutograd meets each call twice (metadata collection,
    joint trace): two traces of the block per layer, as many as without regions, which undoes most of
    what regions save in AOTAutograd. Torch keeps this schema per subgraph for functionalization
    (``InvokeSubgraphCache.functionalize_schema_cache``, key: subgraph object, identifier,
    operand types) but not for this check, and no config skips it.

    So, for the compile inside, the HOP's ``gen_schema`` answers from a table with torch's key: the
    mutation check still runs, on the first call of each subgraph. An attribute of the
    ``invoke_subgraph`` instance only, removed on the way out; nested uses and a torch whose HOP
    has no ``gen_schema`` change nothing.
    """
    hop = getattr(torch.ops.higher_order, "invoke_subgraph", None)
    generate = getattr(type(hop), "gen_schema", None)
    if generate is None or "gen_schema" in vars(hop):
        yield
        return
    schemas: dict[tuple, tuple] = {}

    def gen_schema(subgraph, identifier, *operands):
        key = (id(subgraph), identifier, tuple(type(operand) for operand in operands))
        kept = schemas.get(key)
        if kept is None or kept[0] is not subgraph:  # the subgraph is kept with it: its id is not reused
            kept = schemas[key] = (subgraph, generate(hop, subgraph, identifier, *operands))
        return kept[1]

    hop.gen_schema = gen_schema
    try:
        yield
    finally:
        del hop.gen_schema
        log.debug("regions: %d invoke_subgraph schemas made for the calls of this compile", len(schemas))
