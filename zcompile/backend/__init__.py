"""The compile path: Dynamo graph -> pass pipeline -> AOTAutograd -> inner compiler.

``zero_backend`` is the ``torch_dynamo_backends`` entry point (``zcompile.backend:zero_backend``); it
is imported on first use so that importing one module of this package (``backend.pipeline``) does
not load the whole runtime.
"""

from __future__ import annotations

import importlib

_LAZY = {"zero_backend": "zcompile.backend.entry_point"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'zcompile.backend' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
