"""The compile path: Dynamo graph -> pass pipeline -> AOTAutograd -> inner compiler.

``zero_backend`` is the ``torch_dynamo_backends`` entry point (``zcompile.backend:zero_backend``); it
is imported on first use so that importing one module of this package (``backend.pipeline``) does
not load the whole runtime.
"""

from __future__ import annotations

from zcompile.common.lazy import lazy_attributes

_LAZY = {"zero_backend": "zcompile.backend.entry_point"}

__getattr__, __dir__ = lazy_attributes(__name__, _LAZY)
