"""The optimizer's bucketed eager collectives (stages 1 and 2): plan, and training equal to unbucketed."""

import pytest
import torch

from support.launch import run_ranks
from support.training import RunSpec, assert_same_training, train_reference, zero_run_on_rank
from zcompile.process_group import DataParallelGroup
from zcompile.optim_buckets import _copy_rows, plan_optimizer_buckets
from zcompile.param_shards import shard_parameter


def _sharded(numel, dtype=torch.float32, world=2, name="p"):
    group = DataParallelGroup(rank=0, world_size=world, name="0", process_group=None)
    return shard_parameter(torch.nn.Parameter(torch.zeros(numel, dtype=dtype)), name, 2, group)


def test_buckets_are_consecutive_same_dtype_and_bounded():
    a, b, c = _sharded(100), _sharded(100), _sharded(300)  # 400, 400, 1200 bytes of full fp32 parameter
    half = _sharded(100, torch.bfloat16)
    d = _sharded(10)
    plan = plan_optimizer_buckets([a, b, c, half, d], lambda s: s.param.dtype, bucket_bytes=800)
    # a + b = 800 full bytes (the gathered buffer, not the 400 bytes of shard) fill one bucket; c
    # alone exceeds it; the bf16 one breaks the fp32 run
    assert [[m.param.numel() for m in bucket] for bucket in plan] == [[100, 100], [300], [100], [10]]
    assert [len(b) for b in plan_optimizer_buckets([a, b, c], lambda s: s.param.dtype, 0)] == [1, 1, 1]


@pytest.mark.parametrize("numel", [12, 11, 9, 8, 1])
def test_a_members_columns_land_rank_major_without_the_padding(numel):
    """A member's columns of a gathered bucket (3 ranks, 4 elements each, strided in the bucket's rows)
    written into its parameter straight from the rows: what the flattened copy gave, padding dropped."""
    rows = torch.arange(30.0).view(3, 10)[:, 2:6]
    parameter = torch.full((numel,), -1.0)
    _copy_rows(parameter, rows, numel)
    assert torch.equal(parameter, rows.reshape(-1)[:numel])


SPECS = [
    RunSpec(model="gpt", stage=1, optimizer="adamw", optimizer_options={"bucket_mb": 0}),
    RunSpec(model="gpt", stage=1, optimizer="adamw"),
    RunSpec(model="gpt", stage=2, optimizer="sgd", lr=0.1, optimizer_options={"bucket_mb": 0}),
    RunSpec(model="gpt", stage=2, optimizer="sgd", lr=0.1, optimizer_options={"bucket_mb": 0.002}),
]


@pytest.fixture(scope="module")
def optimizer_runs():
    return run_ranks(2, zero_run_on_rank, SPECS, timeout_s=600)[0]


@pytest.mark.parametrize("index", range(len(SPECS)))
def test_bucketed_optimizer_trains_like_single_process(optimizer_runs, index):
    assert_same_training(optimizer_runs[index], train_reference(SPECS[index], world=2), SPECS[index])


@pytest.mark.parametrize("unbucketed, bucketed", [(0, 1), (2, 3)])
def test_buckets_move_the_same_elements_in_fewer_collectives(optimizer_runs, unbucketed, bucketed):
    def optimizer_records(result):
        return [c for c in result.collectives if c.where == "optimizer"]

    one_each, merged = optimizer_records(optimizer_runs[unbucketed]), optimizer_records(optimizer_runs[bucketed])
    for kind in {c.kind for c in one_each}:
        per_param = [c for c in one_each if c.kind == kind]
        buckets = [c for c in merged if c.kind == kind]
        assert all(len(c.params) == 1 for c in per_param)
        assert 1 <= len(buckets) < len(per_param)
        assert sum(c.elements for c in buckets) == sum(c.elements for c in per_param)
        assert sorted(p for c in buckets for p in c.params) == sorted(p for c in per_param for p in c.params)
    # the bucket layout changes which collective moves an element, not the element's sum
    for name, value in optimizer_runs[unbucketed].params.items():
        assert torch.equal(optimizer_runs[bucketed].params[name], value), name
