"""``zcompile.simulate(...)``, and ``from zcompile.simulate import simulate``: ``zcompile.predict.simulate``.

A package attribute and a submodule of the same name cannot be two objects, so this module is
itself callable (its class gains a ``__call__``): ``zcompile.simulate(make_model, ...)`` works as
``zcompile.estimate_memory(...)`` does, and the module path keeps working.
"""

import inspect
import sys
import types

from zcompile.predict.simulate import SimulatedCollective, SimulationResult, simulate

__all__ = ["simulate", "SimulationResult", "SimulatedCollective"]
__signature__ = inspect.signature(simulate)


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs) -> SimulationResult:
        return simulate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
