"""Schedule auto-tuning: ``tune`` (measured on real ranks), ``load_result`` and ``simulate_tune``
(predicted at a world this machine does not have)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# public name -> the module that defines it, imported on first use (PEP 562): importing one module
# of this package does not run the others
_LAZY = {
    "tune": "zcompile.tune.tuner",
    "load_result": "zcompile.tune.tuner",
    "TuneResult": "zcompile.tune.result",
    "simulate_tune": "zcompile.tune.simulated",
}
__all__ = list(_LAZY)

if TYPE_CHECKING:
    from zcompile.tune.result import TuneResult
    from zcompile.tune.simulated import simulate_tune
    from zcompile.tune.tuner import load_result, tune


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
