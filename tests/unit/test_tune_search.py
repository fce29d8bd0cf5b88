"""The tuner's decisions on fake predictions and measurements (deterministic, no compiling): pruning
by memory, measuring in predicted order up to max_trials, failed trials recorded, the best and its
ties, Spearman against scipy, the Pareto front."""

import pytest

from zcompile.tune.search import (
    FAILED,
    INVALID,
    MEASURED,
    PREDICTED,
    PRUNED,
    SAME,
    Measured,
    Predicted,
    Trial,
    best_trial,
    default_max_trials,
    measure_order,
    pareto_front,
    run_search,
    spearman,
)
from zcompile.tune.space import Point

MIB = 2**20


def _points(n, default=0, invalid=()):
    return [Point(i, {"bucket_mb": float(i)}, i == default, "refused" if i in invalid else "") for i in range(n)]


class Fake:
    """Predicted step i -> ``predicted[i]``, measured -> ``measured[i]``; records what it was asked."""

    def __init__(self, predicted, measured, memory=None, fail_predict=(), fail_measure=(), digests=None):
        self.predicted, self.measured = predicted, measured
        self.digests = digests or [0] * len(predicted)
        self.memory = memory or [MIB] * len(predicted)
        self.fail_predict, self.fail_measure = set(fail_predict), set(fail_measure)
        self.asked_predict, self.asked_measure = [], []

    def predict(self, point):
        self.asked_predict.append(point.index)
        if point.index in self.fail_predict:
            raise RuntimeError("does not compile")
        return Predicted(
            self.predicted[point.index], 0.0, self.memory[point.index], graphs_digest=self.digests[point.index]
        )

    def measure(self, point):
        self.asked_measure.append(point.index)
        if point.index in self.fail_measure:
            raise MemoryError("out of memory")
        return Measured(self.measured[point.index], 0.0, self.memory[point.index])


def test_model_strategy_measures_default_then_best_predicted_up_to_max_trials():
    fake = Fake(predicted=[5, 1, 4, 2, 3, 6], measured=[50, 12, 40, 11, 30, 60])
    trials = run_search(_points(6), fake.predict, fake.measure, strategy="model", max_trials=3)
    assert fake.asked_predict == [0, 1, 2, 3, 4, 5]  # every point predicted
    assert fake.asked_measure == [0, 1, 3]  # the default, then predicted 1 and 2
    assert [t.status for t in trials] == [MEASURED, MEASURED, PREDICTED, MEASURED, PREDICTED, PREDICTED]
    assert best_trial(trials).index == 3  # measured 11 beats the predicted-best's 12


def test_grid_measures_everything_and_max_trials_defaults_to_a_third():
    fake = Fake(predicted=list(range(12)), measured=list(range(12, 0, -1)))
    trials = run_search(_points(12), fake.predict, fake.measure, strategy="grid", max_trials=2)
    assert fake.asked_measure == list(range(12))  # grid ignores max_trials
    assert best_trial(trials).index == 11
    fake = Fake(predicted=list(range(12)), measured=list(range(12)))
    run_search(_points(12, default=7), fake.predict, fake.measure)
    assert fake.asked_measure == [7, 0, 1, 2]  # 12 / 3 = 4 trials, the default first
    assert [default_max_trials(n) for n in (1, 2, 5, 9, 10, 12, 30)] == [1, 2, 3, 3, 4, 4, 10]


def test_memory_limit_prunes_before_measuring():
    fake = Fake(predicted=[3, 1, 2, 4], measured=[3, 1, 2, 4], memory=[MIB, 5 * MIB, MIB, 2 * MIB])
    trials = run_search(_points(4), fake.predict, fake.measure, strategy="grid", memory_limit_bytes=2 * MIB)
    assert [t.status for t in trials] == [MEASURED, PRUNED, MEASURED, MEASURED]  # 2 MiB is not over 2 MiB
    assert 1 not in fake.asked_measure
    assert "5.00 MiB per rank, over the limit of 2.00 MiB" in trials[1].error
    assert best_trial(trials).index == 2  # the fastest (index 1) was pruned


def test_failed_and_invalid_points_are_recorded_and_the_search_goes_on():
    fake = Fake(predicted=[4, 1, 2, 3, 5], measured=[4, 1, 2, 3, 5], fail_predict={1}, fail_measure={2})
    trials = run_search(_points(5, invalid={4}), fake.predict, fake.measure, max_trials=3)
    assert 4 not in fake.asked_predict  # an invalid combination is not compiled
    assert [t.status for t in trials] == [MEASURED, FAILED, FAILED, MEASURED, INVALID]
    assert trials[1].error == "prediction: RuntimeError: does not compile"
    assert trials[2].error == "measurement: MemoryError: out of memory"
    assert trials[4].error == "refused"
    assert fake.asked_measure == [0, 2, 3]  # after the failure, the next best predicted
    assert best_trial(trials).index == 3


def test_points_compiled_to_the_same_graphs_are_measured_once():
    # 1 and 3 compile to the default's (2) graphs, 4 to 0's; digest 0 means unknown: never merged
    fake = Fake(predicted=[1, 2, 3, 1, 1, 4, 4], measured=[5, 6, 7, 8, 9, 3, 3], digests=[7, 9, 9, 9, 7, 0, 0])
    trials = run_search(_points(7, default=2), fake.predict, fake.measure, strategy="grid")
    assert [t.status for t in trials] == [MEASURED, SAME, MEASURED, SAME, SAME, MEASURED, MEASURED]
    assert [t.error for t in trials if t.status == SAME] == [
        "same compiled graphs as #2",
        "same compiled graphs as #2",
        "same compiled graphs as #0",
    ]
    assert fake.asked_measure == [0, 2, 5, 6]


def test_ties_go_to_the_lower_index_whatever_the_order_of_measurement():
    trials = [
        Trial(i, {}, i == 3, MEASURED, Predicted(1.0, 0, 0), Measured(step, 0, 0))
        for i, step in enumerate([2.0, 1.0, 3.0, 1.0])
    ]
    assert best_trial(trials).index == 1
    assert best_trial(list(reversed(trials))).index == 1
    predicted = [Trial(i, {}, False, PREDICTED, Predicted(step, 0, 0)) for i, step in enumerate([2.0, 1.0, 1.0, 0.5])]
    assert measure_order(predicted, "model") == [3, 1, 2, 0]
    assert measure_order(list(reversed(predicted)), "model") == [3, 1, 2, 0]
    assert best_trial([Trial(0, {}, True, FAILED)]) is None


def test_bad_strategy_is_refused():
    with pytest.raises(ValueError, match="strategy must be one of"):
        run_search(_points(2), Fake([1, 2], [1, 2]).predict, Fake([1, 2], [1, 2]).measure, strategy="random")


def test_spearman_against_hand_computed_values():
    # no ties: 1 - 6 sum(d^2) / (n (n^2 - 1)); y ranks 4 1 5 2 6 3, d^2 sums to 28: 1 - 168 / 210
    assert spearman([10, 20, 30, 40, 50, 60], [3, 1, 4, 1.5, 9, 2.6]) == pytest.approx(0.2, abs=1e-12)
    assert spearman([0.1, 0.4, 0.2], [3, 1, 2]) == pytest.approx(-1.0, abs=1e-12)
    assert spearman(list(range(10)), [9 - i for i in range(10)]) == pytest.approx(-1.0, abs=1e-12)
    # ties: y ranks 1 2 3.5 5 3.5; Pearson of the ranks = 8 / sqrt(10 * 9.5)
    assert spearman([1, 2, 3, 4, 5], [5, 6, 7, 8, 7]) == pytest.approx(8 / 95**0.5, abs=1e-12)
    assert spearman([1, 2], [2, 1]) is None  # too few pairs to rank
    assert spearman([1, 1, 1], [1, 2, 3]) is None  # nothing to rank on one side


def test_pareto_front():
    # (memory, time): 0 and 2 are beaten by nothing; 1 by 2 on both; 3 equals 2 on time with more memory
    points = [(1.0, 10.0), (3.0, 6.0), (2.0, 5.0), (4.0, 5.0), (1.0, 10.0)]
    assert pareto_front(points) == [0, 2, 4]
