"""A size as an int, where Dynamo may have made it symbolic (dynamic shapes)."""

from __future__ import annotations

import torch


def traced_int(size) -> int:
    """``size`` as an int: a symbolic one at its traced value (its hint), guarding nothing.

    Arithmetic on a symbol, or ``int()`` of one, would put a guard on it after the compile, where
    Dynamo can no longer honour it; the hint is the value the trace saw, None only for a
    data-dependent size (counted 0)."""
    if not isinstance(size, torch.SymInt):
        return int(size)
    hint = size.node.hint
    return int(hint) if hint is not None else 0
