"""The graph rewrite that gives a tensor-parallel model's graph its DTensor parameters' local pieces
(``passes/dtensor_params.py``), the ``mesh`` option's forms, and the refusal of DTensor parameters
without a ``("dp", "tp")`` mesh. The training itself is tested on 4 ranks (test_tensor_parallel.py)."""

from __future__ import annotations

import pytest
import torch

from support.graph_builders import fake_process_group
from zcompile.config import ZeroConfig
from zcompile.passes.dtensor_params import local_piece_inputs, local_tensor


def _parallel_mlp(mesh) -> torch.nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return model


def test_the_graph_takes_the_local_pieces_and_computes_what_the_model_does():
    from torch.distributed.device_mesh import init_device_mesh

    with fake_process_group(world_size=2):
        torch._dynamo.reset()
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        model = _parallel_mlp(mesh)
        captured = []

        def capture(gm, example_inputs):
            captured.append((gm, list(example_inputs)))
            return gm.forward

        x = torch.randn(4, 8)
        torch.compile(model, backend=capture)(x)
        ((gm, inputs),) = captured
        params = [value for value in inputs if isinstance(value, torch.nn.Parameter)]
        rewritten = local_piece_inputs(gm, inputs)
        assert [spec.shape for spec in rewritten] == [p.shape for p in params]  # every weight and bias
        pieces = [inputs[spec.index] for spec in rewritten]
        assert all(type(piece) is torch.Tensor for piece in pieces)  # plain tensors: the sharding sees these
        assert [piece.shape for piece in pieces] == [(8, 8), (8,), (8, 8), (8,)]  # column, then row pieces
        assert all(piece is local_tensor(param) and piece.requires_grad for piece, param in zip(pieces, params))
        out = gm(*inputs)
        out = out[0] if isinstance(out, (tuple, list)) else out
        torch.testing.assert_close(out, model(x), rtol=0, atol=0)
        torch._dynamo.reset()


def test_the_mesh_option_takes_hybrid_tensor_parallel_or_both_dims_and_names_the_rest():
    from torch.distributed.device_mesh import init_device_mesh

    with fake_process_group(world_size=4):
        dp_tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        assert ZeroConfig(mesh=dp_tp).tensor_parallel and not ZeroConfig(mesh=dp_tp).hybrid
        assert ZeroConfig(mesh=dp_tp).shard_group_size(4) == 2
        hybrid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        assert ZeroConfig(mesh=hybrid).hybrid and not ZeroConfig(mesh=hybrid).tensor_parallel
        other = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp"))
        with pytest.raises(ValueError, match=r"option 'mesh' must be .*\('dp', 'tp'\)"):
            ZeroConfig(mesh=other)
        for options, named in (
            ({"shard_size": 2}, "'shard_size'"),
            ({"memory_limit_mb": 100}, "'memory_limit_mb'"),
            ({"quantize_weights": True}, "ZeRO\\+\\+"),
        ):
            with pytest.raises(ValueError, match=named):
                ZeroConfig(mesh=dp_tp, **options)

    with fake_process_group(world_size=8):  # hybrid sharding of the pieces: ("replicate", "shard", "tp")
        both = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
        assert ZeroConfig(mesh=both).tensor_parallel and ZeroConfig(mesh=both).hybrid
        assert ZeroConfig(mesh=both).shard_group_size(8) == 2
        no_shard = init_device_mesh("cpu", (4, 1, 2), mesh_dim_names=("replicate", "shard", "tp"))
        with pytest.raises(ValueError, match="'shard' dim of 1"):
            ZeroConfig(mesh=no_shard)


def test_tensor_parallel_parameters_without_a_dp_tp_mesh_are_refused_by_name():
    from torch.distributed.device_mesh import init_device_mesh

    with fake_process_group(world_size=2):
        torch._dynamo.reset()
        model = _parallel_mlp(init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))
        compiled = torch.compile(model, backend="zero", options={"stage": 3, "check_ranks": False})
        with pytest.raises(
            Exception, match=r"parameters '0\.weight', '0\.bias', '2\.weight' and 1 more are DTensors"
        ) as error:
            compiled(torch.randn(4, 8))
        assert "('dp', 'tp')" in str(error.value) and "docs/tensor-parallel.md" in str(error.value)
        torch._dynamo.reset()


def test_a_transformers_models_declared_plan_splits_its_layers_and_other_styles_are_named():
    """``zcompile.apply_tp_plan``: the Llama's ``base_model_tp_plan`` (q/k/v, gate/up column-wise; o, down
    row-wise) as torch's styles; embeddings and head stay whole; a style zcompile does not apply is refused."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import zcompile
    from support.models import build_model

    with fake_process_group(world_size=2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        model = zcompile.apply_tp_plan(build_model("hf_llama"), mesh)
        placements = {name: p.placements[0] for name, p in model.named_parameters() if isinstance(p, DTensor)}
        layer = "model.layers.1."
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            assert placements[f"{layer}{name}.weight"] == Shard(0), name
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            assert placements[f"{layer}{name}.weight"] == Shard(1), name
        assert len(placements) == 2 * 7  # two layers of seven split weights, no biases; nothing else split

        other = build_model("hf_llama")
        other.config.base_model_tp_plan = {**other.config.base_model_tp_plan, "embed_tokens": "embedding_rowwise"}
        with pytest.raises(ValueError, match="splits 'embed_tokens' as 'embedding_rowwise'"):
            zcompile.apply_tp_plan(other, mesh)
        with pytest.raises(ValueError, match="declares no tensor-parallel plan"):
            zcompile.apply_tp_plan(torch.nn.Linear(2, 2), mesh)
