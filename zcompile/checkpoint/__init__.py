"""Sharded checkpoints in DCP format that reshard on load: ``save``, ``load``, ``full_state_dict``."""

from zcompile.checkpoint.dcp import CheckpointError, full_state_dict, load, save

__all__ = ["CheckpointError", "save", "load", "full_state_dict"]
