"""TuneResult from a search on fakes: best, default and speedup, the JSON round trip (policies
rebuilt from the saved costs), the table, the plot and ``zcompile tune-report``."""

import json

import pytest

from zcompile.cli.commands import main
from zcompile.predict.cost_model import CollectiveCost, CollectiveCosts, ComputeCosts
from zcompile.tune.policies import CostGuidedPrefetch
from zcompile.tune.result import TuneResult
from zcompile.tune.search import Measured, Predicted, run_search
from zcompile.tune.space import SearchSpace

COSTS = CollectiveCosts(2, {"all_gather": CollectiveCost(1e-4, 1e-9, 2e-5)})
COMPUTE = ComputeCosts(2e10, 5e9, 3e-6)
SPACE = {"bucket_mb": [0.5, 4.0], "schedule_policy": ["greedy", "cost_guided"]}
PREDICTED_MS = [30.0, 28.0, 20.0, 21.0]  # per point index
MEASURED_MS = [40.0, 36.0, 25.0, 24.0]


def _result(strategy="grid"):
    space = SearchSpace.build(SPACE, {"stage": 3})
    trials = run_search(
        space.points,
        lambda p: Predicted(PREDICTED_MS[p.index] / 1e3, 1e-3, (10 + p.index) * 2**20, {"model_states": 10 * 2**20}),
        lambda p: Measured(MEASURED_MS[p.index] / 1e3, 2e-3, (12 + p.index) * 2**20, (5.5, 5.4)),
        strategy=strategy,
    )
    return TuneResult(
        trials, space.base_options, space.space, strategy, 2, 5, 2, None, 12.5, {"costs_s": 1.0}, COSTS, COMPUTE
    )


def test_best_default_speedup_and_correlation():
    result = _result()
    assert result.best_trial.index == 3 and result.default.index == 2  # default: bucket 4, greedy
    assert result.best == {"stage": 3, "bucket_mb": 4.0, "schedule_policy": CostGuidedPrefetch(COSTS, COMPUTE)}
    assert result.speedup_over_default == pytest.approx(25.0 / 24.0)
    # predicted ranks 4 3 1 2, measured 4 3 2 1: d^2 sums to 2, 1 - 12 / 60
    assert result.rank_correlation == pytest.approx(0.8)


def test_json_round_trip_and_saved_policy(tmp_path):
    result = _result()
    path = tmp_path / "tune.json"
    result.to_json(str(path))
    loaded = TuneResult.from_json(str(path))
    assert loaded.to_dict() == result.to_dict()
    assert loaded.best == result.best  # the cost-guided policy rebuilt from the saved costs
    data = json.loads(path.read_text())
    assert data["best_index"] == 3 and data["trials"][3]["options"]["schedule_policy"] == "cost_guided"
    assert data["trials"][0]["measured"]["losses"] == [5.5, 5.4]

    def my_policy(problem):
        return [0] * len(problem.gathers)

    custom = _result()
    custom.trials[3].options = {**custom.trials[3].options, "schedule_policy": my_policy}
    assert custom.best["schedule_policy"] is my_policy  # in this process: the callable itself
    again = TuneResult.from_dict(json.loads(custom.to_json()))
    assert again.trials[3].options["schedule_policy"] == "my_policy"
    with pytest.raises(ValueError, match="'my_policy', a callable of your own; pass it again"):
        again.best


def test_table_plot_and_tune_report(tmp_path, capsys):
    result = _result(strategy="model")  # 4 points, 3 measured: default (2), then predicted 20 -> #2, 21 -> #3, 28 -> #1
    assert [t.status for t in result.trials] == ["predicted", "measured", "measured", "measured"]
    text = result.render()
    assert "strategy model: 3 of 4 points measured" in text
    assert "best: #3 bucket_mb=4.0 schedule_policy=cost_guided: 24.0 ms per step" in text
    assert "1.042x" in text and "Spearman rank correlation of predicted and measured step time 0.50" in text
    png = tmp_path / "tune.png"
    result.plot(str(png))
    assert png.read_bytes()[:4] == b"\x89PNG"
    path = tmp_path / "tune.json"
    result.to_json(str(path))
    assert main(["tune-report", str(path), "--plain"]) == 0
    assert capsys.readouterr().out.strip() == text
    assert main(["tune-report", str(path)]) == 0  # rich
    assert "cost_guided" in capsys.readouterr().out
    (tmp_path / "bad.json").write_text('{"format": "something else"}')
    assert main(["tune-report", str(tmp_path / "bad.json")]) == 2
    assert main(["tune-report", str(tmp_path / "missing.json")]) == 2
    assert "no such file" in capsys.readouterr().err
