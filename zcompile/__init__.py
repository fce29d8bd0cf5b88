"""zcompile: ZeRO data parallelism as a torch.compile backend (``backend="zero"``).

The names below are imported on first use (PEP 562), so that ``import zcompile.passes`` (or the
backend through its entry point) does not import the optimizer, the Triton kernels or matplotlib.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from zcompile.common.lazy import lazy_attributes

__version__ = "0.1.0"

# public name -> the module that defines it ("" : the name is the module itself)
_LAZY = {
    "optim": "",
    "checkpoint": "",
    "ZeroConfig": "zcompile.config",
    "gathered": "zcompile.eager.gathered",
    "lerp_weights_": "zcompile.eager.weight_average",
    "ModelStateBytes": "zcompile.sharding.memory",
    "model_state_bytes": "zcompile.sharding.memory",
    "zero_formula_bytes": "zcompile.sharding.memory",
    "MemoryEstimate": "zcompile.predict.estimate",
    "estimate_memory": "zcompile.predict.estimate",
    "PassError": "zcompile.backend.pass_runner",
    "mark_repeated_blocks": "zcompile.backend.regional",
    "sync_module_states": "zcompile.eager.sync",
    "from_rank0": "zcompile.eager.sync",
    "apply_tp_plan": "zcompile.integrations.hf_tp_plan",
    "StepReport": "zcompile.reports.step_report",
    "step_report": "zcompile.reports.step_report",
    "simulate_tune": "zcompile.tune.simulated",
    "plan": "zcompile.tune.plan",
    "Plan": "zcompile.tune.plan",
    "PlanError": "zcompile.tune.plan",
    "DeepSpeedPort": "zcompile.integrations.deepspeed",
    "options_from_deepspeed": "zcompile.integrations.deepspeed",
    "simulate": "",  # a callable module: zcompile.simulate(...) runs zcompile.predict.simulate.simulate
}
__all__ = list(_LAZY)

if TYPE_CHECKING:
    from zcompile import checkpoint, optim, simulate
    from zcompile.backend.pass_runner import PassError
    from zcompile.backend.regional import mark_repeated_blocks
    from zcompile.config import ZeroConfig
    from zcompile.eager.gathered import gathered
    from zcompile.eager.sync import from_rank0, sync_module_states
    from zcompile.eager.weight_average import lerp_weights_
    from zcompile.integrations.deepspeed import DeepSpeedPort, options_from_deepspeed
    from zcompile.integrations.hf_tp_plan import apply_tp_plan
    from zcompile.predict.estimate import MemoryEstimate, estimate_memory
    from zcompile.reports.step_report import StepReport, step_report
    from zcompile.sharding.memory import ModelStateBytes, model_state_bytes, zero_formula_bytes
    from zcompile.tune.plan import Plan, PlanError, plan
    from zcompile.tune.simulated import simulate_tune


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY)
