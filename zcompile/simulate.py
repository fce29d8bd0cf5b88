"""``from zcompile.simulate import simulate``: the public path of ``zcompile.predict.simulate``."""

from zcompile.predict.simulate import SimulatedCollective, SimulationResult, simulate

__all__ = ["simulate", "SimulationResult", "SimulatedCollective"]
