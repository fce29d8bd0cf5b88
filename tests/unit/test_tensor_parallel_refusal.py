"""A model whose parameters are DTensors (tensor parallelism) is refused before any parameter is
sharded, naming the parameters and what to do instead: zcompile's shards are of plain tensors."""

from __future__ import annotations

import pytest
import torch

from support.graph_builders import fake_process_group


def test_tensor_parallel_parameters_are_refused_by_name():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    with fake_process_group(world_size=2):
        torch._dynamo.reset()
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        compiled = torch.compile(model, backend="zero", options={"stage": 3, "check_ranks": False})
        with pytest.raises(
            Exception, match=r"parameters '0\.weight', '0\.bias', '2\.weight' and 1 more are DTensors"
        ) as error:
            compiled(torch.randn(4, 8))
        assert "fully_shard" in str(error.value) and "option 'mesh'" in str(error.value)
        torch._dynamo.reset()
