"""Schedule auto-tuning: ``tune`` (measured on real ranks), ``load_result`` and ``simulate_tune``
(predicted at a world this machine does not have)."""

from zcompile.tune.result import TuneResult
from zcompile.tune.tuner import load_result, tune

__all__ = ["tune", "load_result", "TuneResult"]
