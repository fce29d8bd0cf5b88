"""Sharded checkpoints in DCP format that reshard on load: ``save``, ``load``, ``full_state_dict``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from zcompile.common.lazy import lazy_attributes

# public name -> the module that defines it, imported on first use (PEP 562): importing one module
# of this package does not run the others
_LAZY = {
    "CheckpointError": "zcompile.checkpoint.layout",
    "save": "zcompile.checkpoint.dcp",
    "load": "zcompile.checkpoint.dcp",
    "full_state_dict": "zcompile.checkpoint.consolidate",
    "read_extra": "zcompile.checkpoint.consolidate",
}
__all__ = list(_LAZY)

if TYPE_CHECKING:
    from zcompile.checkpoint.consolidate import full_state_dict, read_extra
    from zcompile.checkpoint.dcp import load, save
    from zcompile.checkpoint.layout import CheckpointError


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY)
