"""What ``zcompile.tune`` returns: every trial, the best and the default options, how well the
prediction held; saved as JSON and read back (``zcompile tune-report tune.json``).

``best`` is the full options dict, ready for ``torch.compile(..., options=result.best)``: the
base options plus the best point's. A built-in policy named in the space (``"cost_guided"``) is
rebuilt from the costs the tuner measured (saved in the JSON too, so a result read back gives the
same policy); a callable of your own is saved by name only and must be passed again.
Printing and plotting are ``zcompile.tune.report``'s.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from zcompile.predict.cost_model import CollectiveCosts, ComputeCosts
from zcompile.tune.calibration import StepCalibration
from zcompile.tune.policies import POLICY_NAMES, policy_from_name
from zcompile.tune.report import plot_result, print_result, render_result
from zcompile.tune.search import MEASURED, Measured, Predicted, Trial, best_trial, spearman
from zcompile.tune.serialization import dumps_to, jsonable_options, jsonable_value
from zcompile.tune.space import POLICY_OPTION

FORMAT = "zcompile.tune/1"


@dataclass
class TuneResult:
    trials: list[Trial]
    base_options: dict[str, Any]
    space: dict[str, list]
    strategy: str
    world_size: int
    steps: int
    warmup: int
    memory_limit_mb: float | None = None
    wall_s: float = 0.0  # the whole tune call
    timings: dict[str, float] = field(default_factory=dict)  # seconds: costs, calibrate, predict, measure
    collective_costs: CollectiveCosts | None = None
    compute_costs: ComputeCosts | None = None  # calibrated: what the predictions and policies used
    calibration: StepCalibration | None = None

    # ------------------------------------------------------------------ what the search found
    @property
    def best_trial(self) -> Trial | None:
        return best_trial(self.trials)

    @property
    def default(self) -> Trial:
        """The default options' trial (the base options alone): always one of the trials."""
        return next(t for t in self.trials if t.is_default)

    @property
    def best(self) -> dict[str, Any]:
        """The full options of the best measured trial (``ValueError`` when no trial was measured)."""
        trial = self.best_trial
        if trial is None:
            raise ValueError(
                "zcompile.tune: no trial was measured (all failed, invalid or pruned); see the trials' errors"
            )
        return self.options_of(trial)

    def options_of(self, trial: Trial) -> dict[str, Any]:
        """Base options + the trial's, a built-in policy name turned into the policy."""
        options = {**self.base_options, **trial.options}
        name = options.get(POLICY_OPTION)
        if isinstance(name, str):
            if name not in POLICY_NAMES:
                raise ValueError(
                    f"zcompile.tune: the result names schedule_policy {name!r}, a callable of your own; pass it "
                    "again as options['schedule_policy']"
                )
            options[POLICY_OPTION] = policy_from_name(
                name, self.collective_costs or CollectiveCosts(), self.compute_costs or ComputeCosts(1.0, 1.0)
            )
        return options

    @property
    def measured(self) -> list[Trial]:
        return [t for t in self.trials if t.status == MEASURED]

    @property
    def rank_correlation(self) -> float | None:
        """Spearman's rank correlation of predicted and measured step time over the measured trials."""
        pairs = [(t.predicted.step_s, t.measured.step_s) for t in self.measured if t.predicted is not None]
        return spearman([p for p, _ in pairs], [m for _, m in pairs])

    @property
    def speedup_over_default(self) -> float | None:
        """Default's measured step time over the best's (1.0: the default is the best)."""
        best, default = self.best_trial, self.default
        if best is None or default.status != MEASURED:
            return None
        return default.measured.step_s / best.measured.step_s

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        best = self.best_trial
        return {
            "format": FORMAT,
            "strategy": self.strategy,
            "world_size": self.world_size,
            "steps": self.steps,
            "warmup": self.warmup,
            "memory_limit_mb": self.memory_limit_mb,
            "wall_s": self.wall_s,
            "timings": self.timings,
            "base_options": jsonable_options(self.base_options),
            "space": {name: [jsonable_value(v) for v in values] for name, values in self.space.items()},
            "best_index": None if best is None else best.index,
            "rank_correlation": self.rank_correlation,
            "speedup_over_default": self.speedup_over_default,
            "collective_costs": None if self.collective_costs is None else json.loads(self.collective_costs.to_json()),
            "compute_costs": None if self.compute_costs is None else asdict(self.compute_costs),
            "calibration": None if self.calibration is None else asdict(self.calibration),
            "trials": [_trial_dict(t) for t in self.trials],
        }

    def to_json(self, path: str | None = None) -> str:
        return dumps_to(self.to_dict(), path)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TuneResult:
        if data.get("format") != FORMAT:
            raise ValueError(f"zcompile.tune: not a tune result (format {data.get('format')!r}, expected {FORMAT!r})")
        costs = data.get("collective_costs")
        compute, calibration = data.get("compute_costs"), data.get("calibration")
        return cls(
            trials=[_trial_from(t) for t in data["trials"]],
            base_options=data["base_options"],
            space=data["space"],
            strategy=data["strategy"],
            world_size=data["world_size"],
            steps=data["steps"],
            warmup=data["warmup"],
            memory_limit_mb=data.get("memory_limit_mb"),
            wall_s=data.get("wall_s", 0.0),
            timings=data.get("timings", {}),
            collective_costs=None if costs is None else CollectiveCosts.from_json(json.dumps(costs)),
            compute_costs=None if compute is None else ComputeCosts(**compute),
            calibration=None if calibration is None else StepCalibration(**calibration),
        )

    @classmethod
    def from_json(cls, path: str) -> TuneResult:
        with open(path) as handle:
            return cls.from_dict(json.load(handle))

    # ------------------------------------------------------------------ output (zcompile.tune.report)
    def print(self) -> None:
        """The trials as a table (rich when installed) and the summary: a user-facing call."""
        print_result(self)

    def render(self) -> str:
        return render_result(self)

    def plot(self, path: str) -> None:
        """Predicted against measured step time, and step time against memory with the Pareto front."""
        plot_result(self, path)


def _trial_dict(trial: Trial) -> dict[str, Any]:
    data = asdict(trial)
    data["options"] = jsonable_options(trial.options)
    return data


def _trial_from(data: dict[str, Any]) -> Trial:
    predicted, measured = data.get("predicted"), data.get("measured")
    return Trial(
        index=data["index"],
        options=data["options"],
        is_default=data["is_default"],
        status=data["status"],
        predicted=None if predicted is None else Predicted(**predicted),
        measured=None if measured is None else Measured(**{**measured, "losses": tuple(measured.get("losses", ()))}),
        error=data.get("error", ""),
    )
