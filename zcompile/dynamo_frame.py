"""The one place zcompile reads Dynamo internals: the modules of the frame being compiled.

A backend receives a graph and its example inputs, not the ``nn.Module`` they came from; but the
module's own ``state_dict`` / ``load_state_dict`` must learn that its parameters are sharded (see
``zcompile.state_dict_hooks``). While the backend runs, Dynamo's instruction translator holds the
compiled frame's locals (``self`` for a ``forward``). Reading them uses
``torch._dynamo.symbolic_convert.InstructionTranslator.current_tx`` (torch 2.11-2.13); when that
is not available the caller gets no modules and logs it, and nothing else changes.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


def modules_of_compiled_frame() -> list[torch.nn.Module]:
    """The ``nn.Module`` objects among the locals of the frame Dynamo is compiling (may be empty)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        f_locals = tx.output.root_tx.f_locals
    except Exception as error:  # internals moved: degrade to no hooks, never fail the compile
        log.debug("zcompile: cannot read the compiled frame's locals (%s: %s)", type(error).__name__, error)
        return []
    return [value for value in f_locals.values() if isinstance(value, torch.nn.Module)]
