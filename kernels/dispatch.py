"""Which implementation a kernel op runs: its Triton kernel or its pure-torch reference.

Triton is optional (``pip install zcompile[kernels]``). A kernel op runs Triton when triton is
importable and either the tensor is on CUDA, or ``TRITON_INTERPRET=1`` is set and the tensor is on
the CPU (the Triton interpreter then runs the kernel with numpy). Otherwise it runs the reference.

``TRITON_INTERPRET`` must be set before triton and the kernel modules are imported: ``triton.jit``
reads it when a kernel is decorated, so setting it later leaves compiled (GPU-only) kernels behind.
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger(__name__)

# The values Triton itself reads as true for its boolean environment knobs.
_TRUE = ("1", "true", "yes", "on", "y")


def triton_available() -> bool:
    """True when triton can be imported (after the first import this is a ``sys.modules`` lookup)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    """True when ``TRITON_INTERPRET`` asks Triton to run kernels with its CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUE


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether a kernel op on ``tensor`` should run its Triton kernel rather than its reference."""
    if not triton_available():
        return False
    if tensor.device.type == "cuda":
        return True
    return tensor.device.type == "cpu" and interpreting()
