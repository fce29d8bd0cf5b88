"""Calibration of the cost model on a measured configuration: a device k times slower than the
roofline is recovered from the measured forward + backward, on graphs whose exposed communication
depends on how slow compute is."""

import pytest

from support.hand_built import layered_graph
from zcompile.passes.schedule import plan_schedule, schedule_pass
from zcompile.predict.cost_model import CollectiveCost, CollectiveCosts, ComputeCosts, predict
from zcompile.tune.calibration import SCALE_RANGE, calibrate

# test_cost_model's hand costs: a layer takes 3 s, an all-gather 2 s, the reduce-scatter 1 s
COLLECTIVES = CollectiveCosts(
    2, {"all_gather": CollectiveCost(1.0, 1 / 64), "reduce_scatter": CollectiveCost(0.5, 1 / 128)}
)
COMPUTE = ComputeCosts(flops_per_s=1e9, bytes_per_s=64.0, op_overhead_s=0.125)


def test_scaled_costs_multiply_every_node_time():
    raw, slow = predict(layered_graph(), COLLECTIVES, COMPUTE), predict(layered_graph(), COLLECTIVES, COMPUTE.scaled(3))
    assert slow.compute_s == pytest.approx(3 * raw.compute_s)
    assert slow.comm_s == raw.comm_s


def test_unscheduled_graph_scale_and_outside_time():
    # every collective exposed: 7 s of communication whatever the compute; compute 2.5x -> graphs 7 + 2.5 x 11.5
    compute = predict(layered_graph(), COLLECTIVES, COMPUTE).compute_s
    assert compute == 11.5  # 4 nodes x 0.125 s overhead + 11 s
    graphs_s = 7 + 2.5 * compute
    calibration = calibrate(lambda costs: predict(layered_graph(), COLLECTIVES, costs), COMPUTE, graphs_s, graphs_s + 4)
    assert calibration.compute_scale == pytest.approx(2.5)
    assert calibration.outside_graphs_s == pytest.approx(4)


@pytest.mark.parametrize("true_scale", [0.5, 0.8, 3.0])
def test_scheduled_graph_where_slower_compute_hides_more(true_scale):
    def scheduled(costs):
        gm = layered_graph()
        return predict(schedule_pass(gm, plan_schedule(gm, prefetch=1)), COLLECTIVES, costs)

    # below scale 1 a layer no longer hides the next 2 s gather: exposure depends on the scale
    assert scheduled(COMPUTE.scaled(0.5)).exposed_comm_s > scheduled(COMPUTE.scaled(3)).exposed_comm_s == 2
    measured = scheduled(COMPUTE.scaled(true_scale)).step_s  # the "device": exactly true_scale x the roofline
    calibration = calibrate(scheduled, COMPUTE, measured, measured)
    assert calibration.compute_scale == pytest.approx(true_scale, rel=1e-6)
    assert calibration.outside_graphs_s == 0


def test_a_broken_measurement_is_clamped():
    predict_raw = lambda costs: predict(layered_graph(), COLLECTIVES, costs)  # noqa: E731
    assert calibrate(predict_raw, COMPUTE, 1e-6, 1e-6).compute_scale == pytest.approx(SCALE_RANGE[0], rel=1e-6)
    assert calibrate(predict_raw, COMPUTE, 1e6, 1e6).compute_scale == pytest.approx(SCALE_RANGE[1], rel=1e-6)
