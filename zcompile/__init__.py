"""zcompile: ZeRO data parallelism as a torch.compile backend (``backend="zero"``)."""

from zcompile import optim
from zcompile.config import ZeroConfig
from zcompile.gathered import gathered
from zcompile.memory import ModelStateBytes, model_state_bytes, zero_formula_bytes
from zcompile.pipeline import PassError
from zcompile.report import StepReport, step_report

__all__ = [
    "ZeroConfig", "gathered", "optim", "model_state_bytes", "zero_formula_bytes", "ModelStateBytes", "PassError",
    "StepReport", "step_report",
]
__version__ = "0.1.0"
