"""Sharded optimizers: drop-in ``AdamW`` and ``SGD`` that update each rank's 1/N shard.

They take the model's parameters exactly like ``torch.optim`` and may be created before or after
``torch.compile`` and the first forward: the shard of a parameter is looked up at ``step`` time.
What a step does per parameter, by stage:

- stage 1: the full gradient (``param.grad``) is reduce-scattered and averaged onto the shard;
- stages 2 and 3: the compiled backward already left the averaged gradient on ``shard.grad``;

then the fp32 shard is updated, and at stages 1 and 2 the updated shards are all-gathered back
into the replicated parameters. Optimizer state (moments) has the shard's size.

The update is one fused pass (``zcompile.kernels.fused_optim``): the Triton kernel on GPU, its
pure-torch reference on CPU. When the replicated parameter is in a low-precision dtype, the same
pass writes the updated shard in that dtype, ready to be all-gathered.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F

from zcompile.collectives import DataParallelGroup, reduce_scatter_eager
from zcompile.comm import CollectiveRecord
from zcompile.memory import ModelStateBytes, model_state_bytes
from zcompile.kernels.fused_optim import fused_adamw, fused_adamw_reference, fused_sgd, fused_sgd_reference
from zcompile.sharding import ShardedParam, shard_of, shard_parameter

log = logging.getLogger(__name__)


class ShardedOptimizer(torch.optim.Optimizer):
    """Base class: gradient collection and parameter refresh around a per-shard update rule."""

    def __init__(self, params: Iterable, defaults: dict):
        super().__init__(params, defaults)
        for index, param in enumerate(self._all_params()):
            if not isinstance(param, torch.nn.Parameter):
                raise TypeError(
                    f"{type(self).__name__}: item #{index} ({type(param).__name__} of shape {tuple(param.shape)}) "
                    "is not an nn.Parameter. Pass the model's parameters (model.parameters()); sharded "
                    "optimizers train the parameters of a model compiled with backend='zero'."
                )
        self.last_step_collectives: list[CollectiveRecord] = []
        self.last_step_state_bytes: ModelStateBytes | None = None  # measured at the end of step()

    def _update(self, shard: torch.Tensor, grad: torch.Tensor, grad_scale: float, state: dict, group: dict,
                lowp_out: torch.Tensor | None) -> None:
        """Updates ``shard`` in place from ``grad * grad_scale``; writes it to ``lowp_out`` if given."""
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        refresh: list[tuple[ShardedParam, torch.Tensor | None]] = []
        self.last_step_collectives: list[CollectiveRecord] = []
        for group in self.param_groups:
            for index, param in enumerate(group["params"]):
                sharded = self._sharded(param, index)
                if sharded is None:
                    continue
                grad, grad_scale = self._shard_grad(sharded)
                if grad is not None and sharded.stage == 1:
                    self._record("reduce_scatter", sharded.padded_numel, sharded.reduce_dtype or torch.float32, sharded)
                if grad is None:
                    continue
                shard = sharded.shard.detach()
                lowp = None
                if sharded.stage in (1, 2) and param.dtype != shard.dtype:
                    lowp = torch.empty_like(shard, dtype=param.dtype)  # the next all-gather's input
                self._update(shard, grad, grad_scale, self.state[param], group, lowp)
                if sharded.stage in (1, 2):
                    refresh.append((sharded, lowp))
        for sharded, lowp in refresh:
            sharded.write_full_from_shards(lowp)
            self._record("all_gather", sharded.padded_numel, sharded.param.dtype, sharded)
        # measured while gradients still exist (zero_grad frees them): what step_report shows
        self.last_step_state_bytes = model_state_bytes(self._all_params(), self)
        return loss

    def _record(self, kind: str, elements: int, dtype: torch.dtype, sharded: ShardedParam) -> None:
        if sharded.group.world_size > 1:
            self.last_step_collectives.append(CollectiveRecord(kind, elements, dtype, "optimizer", (sharded.name,)))

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                sharded = shard_of(param)
                tensors = [param] if sharded is None else [param, sharded.shard]
                for tensor in tensors:
                    if tensor.grad is None:
                        continue
                    if set_to_none:
                        tensor.grad = None
                    else:
                        tensor.grad.detach_()
                        tensor.grad.zero_()

    def _sharded(self, param: torch.Tensor, index: int) -> ShardedParam | None:
        """The shard of ``param``; a parameter trained outside any compiled graph is sharded here.

        Dynamo runs some code eagerly (a graph break inside a loop skips the whole frame), so a
        parameter can get a full ``.grad`` without ever reaching the backend. It is then trained
        with stage-1 semantics (reduce-scatter at the step, all-gather after), which keeps data
        parallelism exact; its memory is not reduced, which is logged once.
        """
        sharded = shard_of(param)
        if sharded is not None or param.grad is None:
            return sharded
        group = next((s.group for s in map(shard_of, self._all_params()) if s is not None), None)
        group = group if group is not None else DataParallelGroup.resolve(None)
        log.warning(
            "zcompile optimizer: parameter #%d %s got a gradient outside the compiled graphs (eager code or "
            "a skipped frame); it is kept replicated and reduced at the step (stage 1)", index, tuple(param.shape),
        )
        return shard_parameter(param, f"param#{index}", stage=1, group=group)

    def _all_params(self):
        return (p for group in self.param_groups for p in group["params"])

    @staticmethod
    def _shard_grad(sharded: ShardedParam) -> tuple[torch.Tensor | None, float]:
        """This rank's gradient shard and the factor the update applies to it (1/N: the mean)."""
        if sharded.stage != 1:
            grad = sharded.shard.grad
            return (None if grad is None else grad.detach()), 1.0
        full_grad = sharded.param.grad
        if full_grad is None:
            return None, 1.0
        flat = full_grad.detach().reshape(-1).to(torch.float32)
        if sharded.padded_numel > sharded.numel:
            flat = F.pad(flat, (0, sharded.padded_numel - sharded.numel))
        world_size = sharded.group.world_size
        if world_size == 1:
            return flat, 1.0
        if sharded.reduce_dtype is not None:
            flat = flat.to(sharded.reduce_dtype)
        grad = torch.empty_like(sharded.shard, dtype=flat.dtype)
        reduce_scatter_eager(grad, flat, sharded.group)
        return grad, 1.0 / world_size


class AdamW(ShardedOptimizer):
    """``torch.optim.AdamW`` over shards (same arguments; ``amsgrad`` is not supported)."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, **unsupported: Any):
        if amsgrad:
            raise ValueError("zcompile.optim.AdamW: amsgrad=True is not supported; use amsgrad=False")
        if unsupported:
            raise TypeError(
                f"zcompile.optim.AdamW: unsupported arguments {sorted(unsupported)}; "
                "supported: lr, betas, eps, weight_decay"
            )
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"zcompile.optim.AdamW: invalid hyper-parameters lr={lr} betas={betas} eps={eps} weight_decay={weight_decay}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    def _update(self, shard, grad, grad_scale, state, group, lowp_out):
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(shard)
            state["exp_avg_sq"] = torch.zeros_like(shard)
        state["step"] += 1
        beta1, beta2 = group["betas"]
        update = fused_adamw if shard.is_cuda else fused_adamw_reference
        update(shard, grad, state["exp_avg"], state["exp_avg_sq"], state["step"], group["lr"], beta1, beta2,
               group["eps"], group["weight_decay"], grad_scale, lowp_out)


class SGD(ShardedOptimizer):
    """``torch.optim.SGD`` over shards (momentum, dampening, nesterov, weight decay)."""

    def __init__(self, params: Iterable, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False):
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError(f"zcompile.optim.SGD: invalid hyper-parameters lr={lr} momentum={momentum} weight_decay={weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("zcompile.optim.SGD: nesterov requires momentum > 0 and zero dampening")
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening,
                                      weight_decay=weight_decay, nesterov=nesterov))

    def _update(self, shard, grad, grad_scale, state, group, lowp_out):
        first_step = "momentum_buffer" not in state
        if group["momentum"] != 0 and first_step:
            state["momentum_buffer"] = torch.empty_like(shard)
        update = fused_sgd if shard.is_cuda else fused_sgd_reference
        update(shard, grad, state.get("momentum_buffer"), first_step, group["lr"], group["momentum"],
               group["dampening"], group["weight_decay"], group["nesterov"], grad_scale, lowp_out)
