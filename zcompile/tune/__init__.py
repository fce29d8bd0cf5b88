"""Schedule auto-tuning: ``tune`` (measured on real ranks), ``load_result`` and ``simulate_tune``
(predicted at a world this machine does not have)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from zcompile.common.lazy import lazy_attributes

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


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY)
