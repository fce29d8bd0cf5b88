"""Tuning by simulation (``zcompile.simulate_tune``): the example GPT at 64 ranks it does not have;
the front against a non-dominated set computed here, the memory limit, bad spaces, failing points,
the JSON, the plot and the command line."""

import json

import pytest

import zcompile
from support.models import build_model, global_batch
from zcompile.tune.simulated import GIB, SimulatedTuneResult

WORLD = 64
SPACE = {"stage": [2, 3], "bucket_mb": [0, 4], "hpz_size": [None, "node"]}


def _tune(**kwargs):
    return zcompile.simulate_tune(
        lambda: build_model("gpt"), global_batch(0, 2), world_size=WORLD, node_size=8, **kwargs
    )


@pytest.fixture(scope="module")
def result():
    return _tune(space=SPACE, base_options={"param_dtype": "bf16"})


def _non_dominated(points) -> set[int]:
    """A sweep, not ``pareto_front``'s pairwise test: by memory then step time, a point is on the front
    when it is faster than every point of less memory (or equal to the last point kept)."""
    kept, best = [], None
    for p in sorted(points, key=lambda p: (p.memory_bytes, p.step_s)):
        if best is None or p.step_s < best[1] or (p.memory_bytes, p.step_s) == best:
            kept.append(p.index)
            best = (p.memory_bytes, p.step_s)
    return set(kept)


def test_every_valid_point_is_simulated_and_hpz_at_stage_2_is_invalid(result):
    by_options = {tuple(p.options.values()): p for p in result.points}
    assert len(result.points) == 8
    for (stage, _, hpz), point in by_options.items():
        if stage == 2 and hpz == "node":
            assert point.status == "invalid" and "hpz_size" in point.error
        else:
            assert point.status == "predicted", point.error
            # the step's peak: at least the model states and the saved activations held together
            parts = point.memory_parts
            assert point.memory_bytes >= parts["model_states_bytes"] + parts["saved_activation_bytes"] > 0
            assert 0 < point.exposed_comm_s < point.step_s and 0 < point.mfu < 1
    # stage 3 holds 16 bytes per parameter over 64 ranks; stage 2 the bf16 replica on top
    assert (
        by_options[(2, 4, None)].memory_parts["model_states_bytes"]
        > by_options[(3, 4, None)].memory_parts["model_states_bytes"]
    )


def test_front_is_exactly_the_non_dominated_points(result):
    front = {p.index for p in result.front}
    assert front == _non_dominated(result.eligible)
    assert len(front) >= 2  # the space trades memory against time: a front of one would test nothing
    assert result.fastest.index in front
    assert result.fastest is result.fastest_fitting  # a tiny model fits any GPU
    assert result.best == {"param_dtype": "bf16", **result.fastest.options}
    assert result.fastest.step_s == min(p.step_s for p in result.eligible)


def test_memory_limit_prunes_points_from_the_front_and_the_choice(result):
    """A limit between stage 2's and stage 3's memory (bucket_mb=4): the larger is pruned, the smaller chosen."""
    by_stage = {
        s: next(p for p in result.points if p.options == {"stage": s, "bucket_mb": 4, "hpz_size": None}) for s in (2, 3)
    }
    small, large = sorted(by_stage, key=lambda s: by_stage[s].memory_bytes)
    assert by_stage[small].memory_bytes < by_stage[large].memory_bytes
    limit_gb = (by_stage[small].memory_bytes + by_stage[large].memory_bytes) / 2 / GIB
    limited = _tune(
        space={"stage": [2, 3]}, base_options={"param_dtype": "bf16", "bucket_mb": 4}, memory_limit_gb=limit_gb
    )
    points = {p.options["stage"]: p for p in limited.points}
    assert points[large].status == "pruned" and "over memory_limit_gb" in points[large].error
    assert points[large].memory_bytes == by_stage[large].memory_bytes  # its numbers kept, for the table and plot
    assert points[small].status == "predicted"
    assert [p.index for p in limited.front] == [points[small].index]
    assert limited.best["stage"] == small


def test_bad_space_or_limit_is_refused_before_anything_compiles():
    with pytest.raises(ValueError, match="'bukcet_mb' is not a zero backend option"):
        _tune(space={"bukcet_mb": [1, 4]})
    with pytest.raises(ValueError, match=r"space\['stage'\] is empty"):
        _tune(space={"stage": []})
    with pytest.raises(ValueError, match="memory_limit_gb must be a positive number"):
        _tune(space={"stage": [3]}, memory_limit_gb=-1)
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        zcompile.simulate_tune(lambda: build_model("gpt"), global_batch(0, 2), world_size=0, space={"stage": [3]})


def test_a_failing_point_is_recorded_and_the_others_go_on():
    """node_size=4 in the options disagrees with the simulated nodes of 8: that point fails, named."""
    result = _tune(space={"node_size": [4, 8]}, base_options={"bucket_mb": 4})
    failed, ok, default = result.points  # the default (node_size=None: the simulated nodes) appended
    assert failed.status == "failed" and "node_size=8 and the option node_size=4 disagree" in failed.error
    assert ok.status == default.status == "predicted" and default.is_default
    assert (ok.memory_bytes, ok.step_s) == (default.memory_bytes, default.step_s)  # the same nodes of 8
    assert {p.index for p in result.front} == {ok.index, default.index}


def test_json_table_and_plot(result, tmp_path):
    saved = json.loads(result.to_json(str(tmp_path / "sim.json")))
    assert saved["format"] == "zcompile.simulate_tune/1"
    assert saved["front"] == [p.index for p in result.front]
    assert [p["status"] for p in saved["points"]] == [p.status for p in result.points]
    assert saved["points"][0]["options"] == {"stage": 2, "bucket_mb": 0, "hpz_size": None}
    again = SimulatedTuneResult.from_json(str(tmp_path / "sim.json"))
    assert [p.index for p in again.front] == saved["front"] and again.best == result.best
    text = result.render()
    assert "Pareto front" in text and "fastest that fits HBM: #" in text
    pytest.importorskip("matplotlib")
    result.plot(str(tmp_path / "pareto.png"))
    assert (tmp_path / "pareto.png").read_bytes()[:4] == b"\x89PNG"


def test_command_line_tunes_a_spec_by_simulation(tmp_path, capsys):
    from zcompile.cli.commands import main

    spec = tmp_path / "llama.json"
    spec.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "vocab_size": 256,
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 1,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
            }
        )
    )
    out_json = tmp_path / "tune.json"
    assert (
        main(
            [
                "simulate",
                str(spec),
                "--world",
                "16",
                "--seq",
                "16",
                "--plain",
                "--space",
                "stage=2,3",
                "--option",
                "param_dtype=bf16",
                "--json",
                str(out_json),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "2 points simulated at 16 ranks" in printed and "Pareto front" in printed
    assert [p["options"] for p in json.loads(out_json.read_text())["points"]] == [{"stage": 2}, {"stage": 3}]
    assert main(["simulate", str(spec), "--world", "16", "--space", "stgae=2,3"]) == 2
    assert "'stgae' is not a zero backend option" in capsys.readouterr().err
