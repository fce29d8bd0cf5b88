"""Python's full garbage collections deferred while zcompile compiles a graph.

A compile makes on the order of a million tracked objects (FX nodes, fake tensors, sympy
expressions, AOTAutograd's and inductor's metadata), and CPython collects generation 2, which
walks every tracked object of the process, each time generation 1 has been collected 10 times:
over and over while the heap grows, so a compile spends a sizeable share of its time in full
collections that find little to free.

``full_collections_deferred`` raises generation 2's threshold for the duration of zcompile's own
part of a compile (the backend: its passes, AOTAutograd, the inner compiler; a backward compiled
at its first call) and restores it after, as torch proposed for Dynamo (pytorch/pytorch#193289).
Generations 0 and 1 go on collecting, and refcounting frees what is not in a cycle the moment it
dies; what waits is cyclic garbage already promoted to generation 2, which the first collection
of generation 1 after the restore, with the count already past the threshold, collects in full.
Nested uses (the forward's compile inside the backend) leave the outermost one in charge: no
state of its own, it reads the threshold it finds.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

# generation 2's threshold during a compile: never reached by one (a compile counts a few hundred
# generation-1 collections at most)
DEFERRED_THRESHOLD = 1_000_000


@contextlib.contextmanager
def full_collections_deferred() -> Iterator[None]:
    """Generation 2 collected only after the block (module docstring); usable as a decorator."""
    first, second, third = gc.get_threshold()
    if third >= DEFERRED_THRESHOLD or not gc.isenabled():  # an outer compile's deferral, or no collector
        yield
        return
    gc.set_threshold(first, second, DEFERRED_THRESHOLD)
    try:
        yield
    finally:
        gc.set_threshold(*gc.get_threshold()[:2], third)
