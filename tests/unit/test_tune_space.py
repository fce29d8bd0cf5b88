"""The tuner's space: bad input is a clear error before anything compiles; points, invalid
combinations and the default point."""

import pytest
import torch

from zcompile.tune.space import SearchSpace
from zcompile.tune.tuner import tune


def _never_called(*args):
    raise AssertionError("tune compiled or built a model before refusing its arguments")


def _tune(space, **kwargs):
    return tune(_never_called, _never_called, [0], space=space, **kwargs)


@pytest.mark.parametrize(
    "space, error, message",
    [
        (
            {"bucket_size": [1, 4]},
            ValueError,
            r"space option 'bucket_size' is not a zero backend option .* valid options "
            r"are \['stage'",
        ),
        (
            {"on_compile": [print]},
            ValueError,
            "space option 'on_compile' is not a zero backend option the tuner can vary",
        ),
        ({"bucket_mb": []}, ValueError, r"space\['bucket_mb'\] is empty; give at least one candidate"),
        (
            {"bucket_mb": 4.0},
            TypeError,
            r"space\['bucket_mb'\] must be a list of candidates, got 4.0; write "
            r"space\['bucket_mb'\] = \[4.0\]",
        ),
        ({"prefetch": "12"}, TypeError, r"space\['prefetch'\] must be a list of candidates"),
        (
            {"bucket_mb": [1, "4"]},
            ValueError,
            r"space\['bucket_mb'\] candidate '4': zcompile: option 'bucket_mb' must "
            r"be a finite number >= 0",
        ),
        ({"prefetch": [1, 1.5]}, ValueError, r"space\['prefetch'\] candidate 1.5: .*'prefetch' must be an int >= 0"),
        ({"stage": [3, 4]}, ValueError, r"space\['stage'\] candidate 4: .*'stage' must be 1, 2 or 3"),
        ({"overlap": [True, "yes"]}, TypeError, r"space\['overlap'\] candidate 'yes': .*'overlap' must be a bool"),
        (
            {"schedule_policy": ["greedy", "fastest"]},
            ValueError,
            r"candidate 'fastest' is not a built-in policy; give one "
            r"of \['greedy', 'cost_guided'\]",
        ),
        ({"schedule_policy": [42]}, TypeError, r"'schedule_policy' must be a callable"),
        ({}, ValueError, "space must be a non-empty dict"),
    ],
)
def test_bad_space_is_refused_before_anything_compiles(space, error, message):
    with pytest.raises(error, match=message):
        _tune(space)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (
            {"base_options": {"stage": 3}, "space": {"stage": [2, 3]}},
            ValueError,
            "'stage' is both in space and in base_options",
        ),
        ({"base_options": {"bucket_mb": -1}}, ValueError, "base_options: zcompile: option 'bucket_mb'"),
        ({"base_options": {"on_compile": print}}, ValueError, "may not set 'on_compile'"),
        ({"strategy": "random"}, ValueError, r"strategy must be one of \('model', 'grid'\)"),
        ({"steps": 0}, ValueError, "steps must be an int >= 1"),
        ({"warmup": -1}, ValueError, "warmup must be an int >= 0"),
        ({"max_trials": 0}, ValueError, "max_trials must be an int >= 1"),
        ({"memory_limit_mb": 0}, ValueError, "memory_limit_mb must be a positive number"),
        ({"optimizer": "adamw"}, TypeError, "optimizer must be a callable"),
    ],
)
def test_bad_arguments_are_refused_before_anything_compiles(kwargs, error, message):
    kwargs = {"space": {"bucket_mb": [1, 4]}, **kwargs}
    with pytest.raises(error, match=message):
        _tune(**kwargs)
    with pytest.raises(ValueError, match="batches is empty"):
        tune(_never_called, _never_called, [], space={"bucket_mb": [1]})


def test_points_are_the_product_in_order_with_the_default_flagged():
    space = SearchSpace.build({"bucket_mb": [1.0, 4.0], "prefetch": [1, 2]}, {"stage": 3})
    assert [p.options for p in space.points] == [
        {"bucket_mb": 1.0, "prefetch": 1},
        {"bucket_mb": 1.0, "prefetch": 2},
        {"bucket_mb": 4.0, "prefetch": 1},
        {"bucket_mb": 4.0, "prefetch": 2},
    ]
    assert [p.is_default for p in space.points] == [False, False, True, False]  # 4.0 and 1 are the defaults
    # the greedy policy is the default's; an int and a float of the same value are the same option
    space = SearchSpace.build({"schedule_policy": ["cost_guided", "greedy"], "bucket_mb": [4]}, None)
    assert [p.is_default for p in space.points] == [False, True]


def test_default_outside_the_space_is_appended_and_invalid_combinations_kept():
    space = SearchSpace.build({"stage": [2, 3], "keep_gathered_mb": [1.0]}, {"param_dtype": torch.bfloat16})
    assert len(space) == 3
    assert space.points[0].invalid.startswith("zcompile: keep_gathered_mb keeps stage-3 gathered weights")
    assert not space.points[1].invalid
    assert space.default.index == 2 and space.default.options == {"stage": 3, "keep_gathered_mb": 0.0}
