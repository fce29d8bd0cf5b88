"""Sharded optimizers: drop-in ``AdamW`` and ``SGD`` that update each rank's 1/N shard.

They take the model's parameters exactly like ``torch.optim`` and may be created before or after
``torch.compile`` and the first forward: the shard of a parameter is looked up at ``step`` time.
What a step does per parameter, by stage:

- stage 1: the full gradient (``param.grad``) is reduce-scattered and averaged onto the shard;
- stages 2 and 3: the compiled backward already left the averaged gradient on ``shard.grad``;

then the fp32 shard is updated, and at stages 1 and 2 the updated shards are all-gathered back
into the replicated parameters. Optimizer state (moments) has the shard's size. Those eager
collectives are bucketed (``bucket_mb`` of full parameter per bucket, as the backend option counts) and run while
the next bucket updates (``zcompile.optim.buckets``).

Gradient clipping: ``clip_grad_norm_(max_norm)`` between backward and ``step()``, or
``max_grad_norm=`` to clip inside ``step()``, clips the gradient averaged over ranks to a global
norm (``zcompile.optim.clip``; at stage 1 that reduce-scatters the gradients before the step, and the
step does not reduce them again). ``last_grad_norm`` is the norm before clipping of the last step.

Non-finite gradients: with ``skip_nonfinite=True`` (default: on under fp16) a step whose gradients
are not finite on any rank is skipped by every rank together, decided from each rank's flag carried
by the step agreement below (or one all-reduced flag when that check is off; ``zcompile.optim.nonfinite``);
``skipped_steps`` counts them. Before its first collective a step checks
that every rank is taking it after the same training calls (``zcompile.agreement.step_agreement``,
``check_timeout_s``), so a rank that skips its step alone is an error on every rank, not a hang.

The update is one fused pass (``zcompile.kernels.fused_optim``): the Triton kernel on GPU; on CPU
torch's fused AdamW kernel (``zcompile.kernels.cpu_adamw``) and the pure-torch SGD reference. When
the replicated parameter is in a low-precision dtype, the same pass writes the updated shard in that
dtype, ready to be all-gathered. Every path takes torch's ``maximize`` (both) and ``amsgrad`` (AdamW,
its ``max_exp_avg_sq`` state saved and resharded like the moments), per param group as torch does.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from zcompile.agreement.step_agreement import DEFAULT_TIMEOUT_S, agree_before_step, hyperparameters_of
from zcompile.backend.compiled import compiled_graphs_of_params
from zcompile.common.comm_volume import CollectiveRecord
from zcompile.common.process_group import DataParallelGroup
from zcompile.config import finite_number
from zcompile.eager.sync import take_first_ranks_values
from zcompile.kernels.cpu_adamw import adamw_cpu_fused
from zcompile.kernels.dispatch import triton_available
from zcompile.kernels.fused_optim import (
    fused_adamw,
    fused_adamw_multi_triton,
    fused_adamw_reference,
    fused_sgd,
    fused_sgd_multi_triton,
    fused_sgd_reference,
)
from zcompile.optim.buckets import (
    BucketedGradReduce,
    BucketedParamRefresh,
    BufferLedger,
    plan_optimizer_buckets,
    plan_reduce_buckets,
    reduce_grads_onto_shards,
)
from zcompile.optim.clip import clip_grad_norm_of_shards
from zcompile.optim.nonfinite import local_grads_finite, nonfinite_flag, skip_nonfinite_by_default
from zcompile.optim.state_dict import load_sharded_state_dict, recut_loaded_state, sharded_state_dict
from zcompile.routes import install as install_routes
from zcompile.routes.optimizer_guard import SHARDED_OPTIMIZER_ATTR
from zcompile.routes.zero_grad import clear_shard_grad, remember_stepped_grads, stale_grad_members, zero_tensor_grad
from zcompile.sharding.buffer_sync import broadcast_changed_buffers
from zcompile.sharding.memory import ModelStateBytes, model_state_bytes
from zcompile.sharding.sharded_parameter import grad_of
from zcompile.sharding.shards import ShardedParam, shard_eager_parameter, shard_of, warn_eager_sharded

log = logging.getLogger(__name__)


@dataclass
class _Update:
    """One shard's update in a step: what ``_update`` takes, and its parameter."""

    sharded: ShardedParam
    shard: torch.Tensor
    grad: torch.Tensor
    grad_scale: float
    state: dict
    group: dict
    lowp: torch.Tensor | None


class ShardedOptimizer(torch.optim.Optimizer):
    """Base class: gradient collection and parameter refresh around a per-shard update rule."""

    def __init__(
        self,
        params: Iterable,
        defaults: dict,
        bucket_mb: float = 4.0,
        max_grad_norm: float | None = None,
        check_timeout_s: float | None = DEFAULT_TIMEOUT_S,
        skip_nonfinite: bool | None = None,
    ):
        install_routes()  # before any shard exists: torch's clipping, GradScaler, zero_grad route to the shards
        if not finite_number(bucket_mb) or bucket_mb < 0:
            raise ValueError(f"{type(self).__name__}: bucket_mb must be a finite number >= 0 (MiB), got {bucket_mb!r}")
        if max_grad_norm is not None and (
            isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float)) or not max_grad_norm > 0
        ):
            raise ValueError(
                f"{type(self).__name__}: max_grad_norm must be None or a number > 0, got {max_grad_norm!r}"
            )
        self.bucket_mb = bucket_mb  # MiB of full parameter per bucketed collective (0: one per parameter)
        self.max_grad_norm = max_grad_norm  # clip the 2-norm to this inside step() (None: no clipping)
        self.last_grad_norm: float | None = None  # pre-clip norm of the last step (None: not computed)
        if check_timeout_s is not None and (
            isinstance(check_timeout_s, bool)
            or not isinstance(check_timeout_s, (int, float))
            or not check_timeout_s > 0
        ):
            raise ValueError(
                f"{type(self).__name__}: check_timeout_s must be None or a number > 0, got {check_timeout_s!r}"
            )
        # how long step() waits for every rank to reach it (zcompile.agreement.step_agreement); None: no check
        self.check_timeout_s = check_timeout_s
        if skip_nonfinite is not None and not isinstance(skip_nonfinite, bool):
            raise ValueError(
                f"{type(self).__name__}: skip_nonfinite must be None, True or False, got {skip_nonfinite!r}"
            )
        self.skip_nonfinite = skip_nonfinite  # skip steps with non-finite gradients (None: under fp16 only)
        self.skipped_steps = 0  # steps skipped so far because a gradient was not finite on some rank
        self.step_calls = 0  # step() calls so far, skipped ones included (the skip warning names the step)
        self.last_step_skipped = False
        self._clipped_since_step = False
        # the multi-tensor launches' device tables on a GPU (_launch_tables_of), by run: this step's, the last step's
        self._launch_tables: dict[tuple, dict] = {}
        self._previous_tables: dict[tuple, dict] = {}
        self._warned_stale_grads = False
        self._warned_eager_grads = False
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
        # the most bytes the last step's own bucket buffers held at once (optim.buckets.BufferLedger)
        self.last_step_buffer_peak_bytes = 0
        self._state_layout: tuple = ()  # what last_step_state_bytes was measured for (_state_bytes_at_step)

    def add_param_group(self, param_group: dict) -> None:
        """torch's; a group's own settings are checked like the constructor's (``_check_settings``)."""
        _check_settings(type(self).__name__, {**self.defaults, **param_group})
        super().add_param_group(param_group)

    def _update(
        self,
        shard: torch.Tensor,
        grad: torch.Tensor,
        grad_scale: float,
        state: dict,
        group: dict,
        lowp_out: torch.Tensor | None,
    ) -> None:
        """Updates ``shard`` in place from ``grad * grad_scale``; writes it to ``lowp_out`` if given."""
        raise NotImplementedError

    def _update_batch(self, batch: list[_Update], refresher: BucketedParamRefresh) -> None:
        """Updates every shard of ``batch`` (one param group), then hands stages 1 and 2 to ``refresher``.
        An optimizer with a multi-shard update overrides ``_update_many``."""
        self._update_many(batch)
        for update in batch:
            if refresher.bucket_of(update.sharded) is not None:  # stages 1 and 2, unless updated in place
                refresher.updated(update.sharded, update.lowp)

    def _update_many(self, batch: list[_Update]) -> None:
        for u in batch:
            self._update(u.shard, u.grad, u.grad_scale, u.state, u.group, u.lowp)

    @staticmethod
    def _multi_tensor_launch(batch: list[_Update] | list[ShardedParam]) -> bool:
        """Whether ``batch`` (updates, or the parameters to update) updates through the multi-tensor
        Triton launch: shards on a GPU, triton installed, and not inside a compiled region (the
        launch's tables read tensor addresses)."""
        return all(u.shard.is_cuda for u in batch) and triton_available() and not torch.compiler.is_compiling()

    def _launch_tables_of(self, run: list[_Update]) -> dict:
        """The device tables kept for ``run`` (by its first shard and length) from the last step; those
        no run of this step takes are dropped with it (recompiled graphs bring new shards)."""
        key = (id(run[0].sharded), len(run))
        if key not in self._launch_tables:
            self._launch_tables[key] = self._previous_tables.pop(key, {})
        return self._launch_tables[key]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._refuse_state_probe()
        members = self._members()
        skip_enabled = self._skip_nonfinite_enabled()
        # skip_nonfinite without clipping decides from each rank's flag, carried by the agreement
        flag_in_agreement = skip_enabled and self.max_grad_norm is None and not self._clipped_since_step
        finite_everywhere = agree_before_step(
            members,
            self._all_params(),
            "optimizer.step()",  # before any collective
            self.check_timeout_s,
            local_grads_finite(members) if flag_in_agreement else None,
            hyperparameters_of(self.param_groups),
        )
        broadcast_changed_buffers(
            members
        )  # BatchNorm's statistics: rank 0's on every rank (zcompile.sharding.buffer_sync)
        recut_loaded_state(self, members)  # loaded before a compile with hybrid sharding
        for graphs in compiled_graphs_of_params(self._all_params()):  # how often each ran this step (step_report)
            graphs.note_step()
        if self.max_grad_norm is not None and not self._clipped_since_step:
            self._clip_grad_norm(self.max_grad_norm)
        if not self._clipped_since_step:
            self.last_grad_norm = None
        self._clipped_since_step = False
        self._take_rank0_values_of_eager_parameters()
        todo = []  # (sharded, param, param group) with a gradient, in parameter order
        eager: list[str] = []
        for group_index, group in enumerate(self.param_groups):
            for index, param in enumerate(group["params"]):
                sharded = self._sharded(param, group_index, index, eager)
                if sharded is not None and (sharded.shard_grad is not None or sharded.has_full_grad):
                    todo.append((sharded, param, group))
        warn_eager_sharded(eager, "optimizer.step()", [s for s, _, _ in todo])
        bucket_bytes = int(self.bucket_mb * 2**20)
        # collectives already issued by clipping; a full local gradient next to the shard's (stage 1
        # reduced early and grown by a later backward, or zeros kept by zero_grad(set_to_none=False);
        # stages 2 and 3: a gradient from eager code) is reduced and folded in now
        early = [r for s, _, _ in todo for r in s.take_pre_step_records()]
        ledger = BufferLedger()  # the step's own buffers (last_step_buffer_peak_bytes)
        early += reduce_grads_onto_shards(self._local_grads_to_fold([s for s, _, _ in todo]), bucket_bytes, ledger)
        self.step_calls += 1
        with_grads = [s for s, _, _ in todo]
        self._warn_if_not_zeroed(with_grads)
        if finite_everywhere is not None and not set(map(id, with_grads)) <= set(map(id, members)):
            finite_everywhere = None  # a parameter sharded just now (trained eagerly) was not in the flag
        self.last_step_skipped, flag_records = self._nonfinite_step(with_grads, skip_enabled, finite_everywhere)
        if self.last_step_skipped:
            self.last_step_collectives = early + flag_records
            remember_stepped_grads(with_grads)
            return loss
        early += flag_records
        reduced = [s for s, _, _ in todo if s.stage == 1 and s.group.world_size > 1 and s.shard_grad is None]
        reducer = BucketedGradReduce(plan_reduce_buckets(reduced, bucket_bytes), ledger=ledger)
        # a world of one, the shard in the parameter's own storage (fp32): the update writes the weight itself
        refreshed = [s for s, _, _ in todo if s.stage in (1, 2) and not s.updates_replicated_in_place]
        refresher = BucketedParamRefresh(
            plan_optimizer_buckets(refreshed, lambda s: s.replicated_dtype, bucket_bytes), ledger=ledger
        )
        self._previous_tables, self._launch_tables = self._launch_tables, {}  # _launch_tables_of
        # updated a batch at a time (one refresh bucket of one param group): the batch's all-gather
        # starts when it is done and moves while the next batch updates. Where a batch is one
        # multi-tensor launch (a GPU) the batch is the whole param group: each launch costs the host
        # time, which one launch per bucket would make the step wait on, while the update they would let
        # the all-gathers overlap is memory-bound and short
        batch: list[_Update] = []
        batch_key = None  # (param group, refresh bucket or None) of the batch
        # asked once a step, not once a parameter: with shards on several kinds of device a batch is a bucket
        whole_groups = self._multi_tensor_launch([s for s, _, _ in todo])
        for sharded, param, group in todo:
            key = (id(group), None if whole_groups else refresher.bucket_of(sharded))
            if batch and key != batch_key:
                self._update_batch(batch, refresher)
                batch = []
            batch_key = key
            batch.append(self._prepare_update(sharded, self.state[param], group, reducer))
        if batch:
            self._update_batch(batch, refresher)
        refresher.finish()
        self.last_step_buffer_peak_bytes = ledger.peak
        self.last_step_collectives = early + reducer.records + refresher.records
        # measured while gradients still exist (zero_grad frees them): what step_report shows
        self.last_step_state_bytes = self._state_bytes_at_step(self._members())
        remember_stepped_grads(with_grads)
        return loss

    def _prepare_update(self, sharded: ShardedParam, state: dict, group: dict, reducer: BucketedGradReduce) -> _Update:
        """``sharded``'s update in this step, its gradient reduced first if that is left to do. A
        function of its own so that no local of ``step()`` keeps the last gradient of a batch (a view
        of its bucket's reduced shard) alive once the batch is updated, while the next buckets move."""
        shard_grad = sharded.shard_grad
        if shard_grad is not None:  # stages 2 and 3, or stage 1 reduced early by clipping
            grad, grad_scale = shard_grad.detach(), 1.0
        elif sharded.stage == 1 and sharded.group.world_size > 1:
            grad, grad_scale = reducer.grad(sharded), 1.0 / sharded.group.world_size
        else:
            grad, grad_scale = self._local_grad(sharded), 1.0
        shard = sharded.shard.detach()
        lowp = None
        if sharded.stage in (1, 2) and sharded.replicated_dtype != shard.dtype:
            # the next all-gather's input, written where that all-gather puts it anyway: this rank's
            # chunk of the replica's padded storage (no buffer of its own), else a buffer
            padded = sharded.padded_replicated()
            lowp = (
                padded[sharded.shard_offset : sharded.shard_offset + sharded.shard_numel]
                if padded is not None
                else torch.empty_like(shard, dtype=sharded.replicated_dtype)
            )
        return _Update(sharded, shard, grad, grad_scale, state, group, lowp)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips the gradients of this optimizer's parameters like ``torch.nn.utils.clip_grad_norm_``
        does on one process: the gradient averaged over ranks, to a global norm of ``max_norm``
        (``norm_type``: p > 0 or ``inf``). Call between the last backward and ``step()``; every rank
        must call it (one scalar all-reduce; at stage 1 also the step's reduce-scatters, done now).

        Returns the total norm before clipping (an fp32 tensor); also kept as ``last_grad_norm``.
        A call takes the place of ``max_grad_norm`` for the next step.
        """
        agree_before_step(self._members(), self._all_params(), "optimizer.clip_grad_norm_()", self.check_timeout_s)
        return self._clip_grad_norm(max_norm, norm_type)

    def _clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``clip_grad_norm_`` once the ranks agreed (``step()`` clips for ``max_grad_norm`` after its own agreement)."""
        eager: list[str] = []
        self._take_rank0_values_of_eager_parameters()
        members = [
            s
            for group_index, group in enumerate(self.param_groups)
            for index, param in enumerate(group["params"])
            if (s := self._sharded(param, group_index, index, eager)) is not None
        ]
        warn_eager_sharded(eager, "optimizer.clip_grad_norm_()", members)
        norm = clip_grad_norm_of_shards(members, max_norm, norm_type, int(self.bucket_mb * 2**20))
        self.last_grad_norm = float(norm)
        self._clipped_since_step = True
        return norm

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                sharded = shard_of(param)
                if sharded is not None:
                    clear_shard_grad(sharded, set_to_none)
                zero_tensor_grad(param, set_to_none)

    def _warn_if_not_zeroed(self, members: list[ShardedParam]) -> None:
        """Said once per optimizer: a step found the last step's gradient shards (added onto, or used again)."""
        stale = stale_grad_members(members)
        if stale and not self._warned_stale_grads:
            self._warned_stale_grads = True
            log.warning(
                "zcompile: optimizer step %d: the gradients of %d parameters (%s, ...) were not zeroed since the last "
                "step, so this step added onto the last one's, or applied them again (as torch does when nothing "
                "zeroes them). zcompile's gradients live on shards that optimizer.zero_grad() and model.zero_grad() "
                "clear but `p.grad = None` does not: zero through one of those two.",
                self.step_calls,
                len(stale),
                stale[0].name,
            )

    def _skip_nonfinite_enabled(self) -> bool:
        if self.skip_nonfinite is not None:
            return self.skip_nonfinite
        return skip_nonfinite_by_default(list(self._all_params()))

    def _nonfinite_step(
        self, members: list[ShardedParam], enabled: bool, finite_everywhere: bool | None
    ) -> tuple[bool, list[CollectiveRecord]]:
        """Whether this step is skipped (``skip_nonfinite``; the same on every rank, ``zcompile.optim.nonfinite``)
        and the collectives deciding it took: none when the clip's global norm or the flags the
        ranks exchanged in the step agreement (``finite_everywhere``) decide."""
        if not enabled or not members:
            return False, []
        if self.last_grad_norm is not None:  # clipped this step: the global norm decides, no extra collective
            nonfinite, records = not math.isfinite(self.last_grad_norm), []
        elif finite_everywhere is not None:
            nonfinite, records = not finite_everywhere, []
        else:
            nonfinite, record = nonfinite_flag(members)
            records = [record] if record is not None else []
        if nonfinite:
            self.skipped_steps += 1
            log.warning(
                "zcompile: optimizer step %d skipped on every rank: gradients not finite on some rank (%d "
                "skipped so far; skip_nonfinite)",
                self.step_calls,
                self.skipped_steps,
            )
        return nonfinite, records

    def _local_grads_to_fold(self, members: list[ShardedParam]) -> list[ShardedParam]:
        """The members whose full local ``param.grad`` is reduced onto ``shard.grad`` before the update.

        At stages 2 and 3 the compiled backward writes the shard's gradient, so a ``param.grad``
        comes from the parameter running outside the compiled graphs: Dynamo ran the frame eagerly
        (recompile limit, skipped frame) or the user's eager code did. Its gradient is reduced like
        stage 1's, so training stays exact (without overlap); ignoring it would leave the weights
        unchanged with no error. Said once per optimizer.
        """
        eager = [m for m in members if m.stage != 1 and m.has_full_grad]
        if eager and not self._warned_eager_grads:
            self._warned_eager_grads = True
            log.warning(
                "zcompile: %d stage-%d parameters (%s, ...) got gradients outside the compiled graphs: Dynamo ran "
                "their frame eagerly (see its warnings and TORCH_LOGS=recompiles,graph_breaks) or eager code used "
                "them. They are reduce-scattered at the step, so training stays exact but without overlap; make the "
                "frame compile to get it back.",
                len(eager),
                eager[0].stage,
                eager[0].name,
            )
        return [m for m in members if m.has_full_grad and (m.stage != 1 or m.shard_grad is not None)]

    def _take_rank0_values_of_eager_parameters(self) -> None:
        """The parameters about to be sharded here (trained outside every graph: an uncompiled model) take
        rank 0's values where the ranks' differ (per-rank seeds), as DDP's wrap would have made them, before
        their shards are cut: cut from each rank's own values they would train a mix. This step's gradients
        were computed on each rank's own weights, which is said; ``zcompile.sync_module_states(model)``
        before the first forward matches DDP from the start."""
        new = [p for p in self._all_params() if shard_of(p) is None and grad_of(p) is not None]
        if not new:
            return
        group = next((s.group for s in map(shard_of, self._all_params()) if s is not None), None)
        group = group if group is not None else DataParallelGroup.resolve(None)
        if group.world_size == 1:
            return
        took = take_first_ranks_values(
            new,
            group,
            self.check_timeout_s or DEFAULT_TIMEOUT_S,
            "sync-optimizer",
            f"{type(self).__name__}: parameters trained outside the compiled graphs",
            "Every rank steps the same optimizer over the same parameters.",
        )
        if took:
            log.warning(
                "zcompile: %d parameters trained outside the compiled graphs held different values on different "
                "ranks at their first step (each rank seeded apart, or weights loaded on some ranks only); they now "
                "hold rank 0's, but this first step's gradients were computed on each rank's own weights. Call "
                "zcompile.sync_module_states(model) on every rank before the first forward to start like DDP.",
                len(new),
            )

    def _sharded(self, param: torch.Tensor, group_index: int, index: int, eager: list[str]) -> ShardedParam | None:
        """The shard of ``param``, ``param_groups[group_index]['params'][index]``; a parameter trained
        outside any compiled graph is sharded here (stage-1 semantics, see
        ``sharding.shards.shard_eager_parameter``). Its shard is named by that place, the same on every
        rank (the step's agreement compares the names); ``eager`` gets how it reads in the caller's one
        warning: its name when the optimizer was given ``model.named_parameters()`` (torch keeps them as
        the group's ``param_names``), else that place."""
        sharded = shard_of(param)
        if sharded is not None:
            sharded.follow_replaced_storage()  # `param.data = other` since the last call (sharding.shards)
            return sharded
        if grad_of(param) is None:
            return None
        group = next((s.group for s in map(shard_of, self._all_params()) if s is not None), None)
        place = f"param_groups[{group_index}]['params'][{index}]"
        names = self.param_groups[group_index].get("param_names")
        return shard_eager_parameter(
            param,
            place,
            group if group is not None else DataParallelGroup.resolve(None),
            eager,
            label=repr(names[index]) if names else None,
        )

    def _members(self) -> list[ShardedParam]:
        return [s for s in dict.fromkeys(map(shard_of, self._all_params())) if s is not None]

    def _refuse_state_probe(self) -> None:
        """DCP's ``get_optimizer_state_dict`` makes the state of a fresh optimizer by a step with zero
        gradients on every parameter and every learning rate 0. Here that step would shard an
        uncompiled model's parameters for stage 1, or leave stage-2/3 state empty (their gradients
        are on the shards): the checkpoint would silently lack the optimizer. It is refused."""
        if self.state or any(group.get("lr") != 0 for group in self.param_groups):
            return
        params = [p for p in self._all_params() if p.requires_grad]
        if params and all(p.grad is not None and not p.grad.any() for p in params):
            raise RuntimeError(
                f"{type(self).__name__}: a step with zero gradients and learning rate 0 before any real step "
                "(how torch.distributed.checkpoint's get_optimizer_state_dict creates optimizer state) is not "
                "supported. Use zcompile.checkpoint.save/load, or call optimizer.state_dict() / "
                "load_state_dict() (DCP-safe) after the first step"
            )

    def state_dict(self) -> dict:
        """torch's format, each shard-sized state tensor as this rank's piece of the flat tensor (a
        DTensor in a group of several ranks): right with ``dcp.save``/``dcp.load`` and with
        ``torch.save`` per rank (``zcompile.optim.state_dict``). ``zcompile.checkpoint.save`` saves the
        model too and reshards on load."""
        return sharded_state_dict(self, super().state_dict())

    def load_state_dict(self, state_dict: dict) -> None:
        """Restores what ``state_dict()`` returned (or DCP resharded from it); the state stays fp32."""
        load_sharded_state_dict(self, state_dict)

    def _state_bytes_at_step(self, members: list) -> ModelStateBytes:
        """``model_state_bytes`` at the end of a step, walked again only when what exists changed
        (which gradients, which optimizer states): a step re-makes the same tensors at the same
        sizes, and the storage walk is the optimizer's largest per-step cost on small models."""
        layout = (
            tuple((id(s), s.shard_grad is not None, s.has_full_grad) for s in members),
            sum(len(state) for state in self.state.values()),
            len(self.state),
        )
        if layout != self._state_layout or self.last_step_state_bytes is None:
            self._state_layout = layout
            return model_state_bytes(self._all_params(), self)
        return self.last_step_state_bytes

    def _all_params(self):
        return (p for group in self.param_groups for p in group["params"])

    @staticmethod
    def _local_grad(sharded: ShardedParam) -> torch.Tensor:
        """The gradient shard when no reduction is left: stages 2 and 3 (reduced in the backward
        graph) or a world of one (stage 1's full gradient, flat and padded, is the shard)."""
        if sharded.stage != 1:
            return sharded.shard_grad.detach()
        return sharded.padded_flat(sharded.full_grad, torch.float32)


setattr(ShardedOptimizer, SHARDED_OPTIMIZER_ATTR, True)  # what the foreign-optimizer guard recognises


def _check_settings(optimizer: str, settings: dict) -> None:
    """torch's arguments (the constructor's, or a param group's) that zcompile's update cannot follow:
    an error naming the argument, why, and what to do. ``differentiable`` is the one: the update runs
    in fused kernels outside autograd. A tensor setting (torch takes ``lr``, ``betas``, SGD's
    ``weight_decay`` as tensors) must have one element, as torch's; its value is read at each step.
    torch's performance hints (``foreach``, ``fused``, ``capturable``) need no check: whatever they
    say, the update runs zcompile's own fused kernel (and the step stays uncapturable in a CUDA graph)."""
    if settings.get("differentiable"):
        raise ValueError(
            f"zcompile.optim.{optimizer}: differentiable=True is not supported: the update runs in fused "
            "kernels outside autograd, so no gradient flows through it; leave it False (to differentiate "
            "through the update, use torch.optim on a model not compiled with backend='zero')"
        )
    for key in ("lr", "betas", "eps", "weight_decay", "momentum", "dampening"):
        values = settings.get(key)
        for value in values if isinstance(values, (tuple, list)) else (values,):
            if isinstance(value, torch.Tensor) and value.numel() != 1:
                raise ValueError(
                    f"zcompile.optim.{optimizer}: {key}=<tensor of shape {tuple(value.shape)}> is not supported: "
                    "a tensor setting is one number; pass a 1-element tensor or a float"
                )


def _scalar(value: float | torch.Tensor) -> float:
    """A setting as the number the kernels take: a 1-element tensor read now (each step), so one
    changed in place by a scheduler counts, as in torch."""
    return value.item() if isinstance(value, torch.Tensor) else value


def _adamw_settings(group: dict) -> tuple:
    """``(lr, beta1, beta2, eps, weight_decay)`` of ``group`` as numbers, in the kernels' order."""
    beta1, beta2 = group["betas"]
    return tuple(map(_scalar, (group["lr"], beta1, beta2, group["eps"], group["weight_decay"])))


class AdamW(ShardedOptimizer):
    """``torch.optim.AdamW`` over shards: torch's arguments (``amsgrad`` and ``maximize`` as torch's,
    per param group too; ``differentiable=True`` refused; ``foreach``, ``fused``, ``capturable``
    accepted, the update being zcompile's own fused kernel), plus zcompile's own."""

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        bucket_mb: float = 4.0,
        max_grad_norm: float | None = None,
        check_timeout_s: float | None = DEFAULT_TIMEOUT_S,
        skip_nonfinite: bool | None = None,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        **unsupported: Any,
    ):
        _check_settings(
            "AdamW", dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, differentiable=differentiable)
        )
        if unsupported:
            raise TypeError(
                f"zcompile.optim.AdamW: unsupported arguments {sorted(unsupported)}; "
                "supported: torch.optim.AdamW's, and bucket_mb, max_grad_norm, check_timeout_s, skip_nonfinite"
            )
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(
                f"zcompile.optim.AdamW: invalid hyper-parameters lr={lr} betas={betas} eps={eps} weight_decay={weight_decay}"
            )
        super().__init__(
            params,
            dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize),
            bucket_mb,
            max_grad_norm,
            check_timeout_s=check_timeout_s,
            skip_nonfinite=skip_nonfinite,
        )

    @staticmethod
    def _advance_state(state: dict, shard: torch.Tensor, group: dict) -> int:
        """Creates the moments on the first step (and AMSGrad's ``max_exp_avg_sq``, torch's name, when
        the group has ``amsgrad``: zeros, also where it was turned on after the first step), counts
        this one; returns the step."""
        if not state:
            state.update(step=0, exp_avg=torch.zeros_like(shard), exp_avg_sq=torch.zeros_like(shard))
        if group["amsgrad"] and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = torch.zeros_like(shard)
        state["step"] += 1
        return state["step"]

    @staticmethod
    def _maxima(run: list[_Update]) -> list[torch.Tensor] | None:
        """The AMSGrad maxima of a run of one param group, None without ``amsgrad``."""
        return [u.state["max_exp_avg_sq"] for u in run] if run[0].group["amsgrad"] else None

    def _update(self, shard, grad, grad_scale, state, group, lowp_out):
        self._advance_state(state, shard, group)
        update = fused_adamw if shard.is_cuda else fused_adamw_reference
        update(
            shard,
            grad,
            state["exp_avg"],
            state["exp_avg_sq"],
            state["step"],
            *_adamw_settings(group),
            grad_scale,
            lowp_out,
            state["max_exp_avg_sq"] if group["amsgrad"] else None,
            group["maximize"],
        )

    def _update_many(self, batch: list[_Update]) -> None:
        """On a CPU, shards at the same step and gradient scale update together through torch's fused
        CPU AdamW kernel (``kernels.cpu_adamw``: one pass over each tensor, faster than the foreach
        reference; the bits of ``torch.optim.AdamW(fused=True)``); on a GPU through one
        multi-tensor Triton launch per run (``_adamw_gpu_run``).

        On a CPU a run holds at most a quarter of ``bucket_mb`` of shard (at least one shard): its temporaries
        (an fp32 copy of it: the cast or scaled gradients; the foreach reference also makes the
        denominators) exist for the whole run at once, beside a bucket's collectives in flight at stages 1
        and 2, and a stage-3 batch is the whole param group. A quarter keeps them within half a bucket.
        The Triton launch makes no temporaries: its runs are whole."""
        if self._multi_tensor_launch(batch):
            runs_on_gpu: dict[tuple, list[_Update]] = {}
            for u in batch:
                runs_on_gpu.setdefault((self._advance_state(u.state, u.shard, u.group), u.grad_scale), []).append(u)
            for run in runs_on_gpu.values():
                self._adamw_gpu_run(run)
            return None
        if any(u.shard.is_cuda for u in batch):
            return super()._update_many(batch)
        runs: dict[tuple, list[_Update]] = {}
        run_bytes: dict[tuple, int] = {}
        limit = int(self.bucket_mb * 2**20) // 4  # bytes of shard per run (docstring)
        for u in batch:
            key = (self._advance_state(u.state, u.shard, u.group), u.grad_scale)
            nbytes = u.shard.numel() * u.shard.element_size()
            if key in runs and run_bytes[key] + nbytes > limit:
                self._adamw_run(runs.pop(key))
                run_bytes[key] = 0
            runs.setdefault(key, []).append(u)
            run_bytes[key] = run_bytes.get(key, 0) + nbytes
        for run in runs.values():
            self._adamw_run(run)

    def _adamw_gpu_run(self, run: list[_Update]) -> None:
        """One Triton launch per run of shards at the same step and gradient scale (and per gradient
        dtype), not one per shard: each launch costs host time, which a launch per shard would make the
        step wait on. The launch's device tables
        are kept for the next step's same run (``kernels.fused_optim.MultiTensorTables``)."""
        group, (step, grad_scale) = run[0].group, (run[0].state["step"], run[0].grad_scale)
        fused_adamw_multi_triton(
            [u.shard for u in run],
            [u.grad for u in run],
            [u.state["exp_avg"] for u in run],
            [u.state["exp_avg_sq"] for u in run],
            [u.lowp for u in run],
            step,
            *_adamw_settings(group),
            grad_scale,
            self._launch_tables_of(run),
            self._maxima(run),
            group["maximize"],
        )

    @classmethod
    def _adamw_run(cls, run: list[_Update]) -> None:
        """One update of shards at the same step, gradient scale and param group (``_update_many``)."""
        group, (step, grad_scale) = run[0].group, (run[0].state["step"], run[0].grad_scale)
        adamw_cpu_fused(
            [u.shard for u in run],
            [u.grad for u in run],
            [u.state["exp_avg"] for u in run],
            [u.state["exp_avg_sq"] for u in run],
            step,
            *_adamw_settings(group),
            grad_scale,
            cls._maxima(run),
            group["maximize"],
        )
        for u in run:
            if u.lowp is not None:
                u.lowp.copy_(u.shard)


class SGD(ShardedOptimizer):
    """``torch.optim.SGD`` over shards: torch's arguments (momentum, dampening, nesterov, weight decay,
    ``maximize``, per param group too; ``differentiable=True`` refused; ``foreach``, ``fused``
    accepted), plus zcompile's own."""

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        bucket_mb: float = 4.0,
        max_grad_norm: float | None = None,
        check_timeout_s: float | None = DEFAULT_TIMEOUT_S,
        skip_nonfinite: bool | None = None,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        differentiable: bool = False,
        fused: bool | None = None,
    ):
        _check_settings("SGD", dict(lr=lr, weight_decay=weight_decay, differentiable=differentiable))
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError(
                f"zcompile.optim.SGD: invalid hyper-parameters lr={lr} momentum={momentum} weight_decay={weight_decay}"
            )
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("zcompile.optim.SGD: nesterov requires momentum > 0 and zero dampening")
        super().__init__(
            params,
            dict(
                lr=lr,
                momentum=momentum,
                dampening=dampening,
                weight_decay=weight_decay,
                nesterov=nesterov,
                maximize=maximize,
            ),
            bucket_mb,
            max_grad_norm,
            check_timeout_s=check_timeout_s,
            skip_nonfinite=skip_nonfinite,
        )

    def _update_many(self, batch: list[_Update]) -> None:
        """On a GPU, one multi-tensor Triton launch per run of shards at the same gradient scale and
        first step (``AdamW._adamw_gpu_run`` says why); elsewhere one update per shard."""
        if not self._multi_tensor_launch(batch):
            return super()._update_many(batch)
        runs: dict[tuple, list[_Update]] = {}
        for u in batch:
            first_step = "momentum_buffer" not in u.state
            if u.group["momentum"] != 0 and first_step:
                u.state["momentum_buffer"] = torch.empty_like(u.shard)
            runs.setdefault((first_step, u.grad_scale), []).append(u)
        for (first_step, grad_scale), run in runs.items():
            group = run[0].group
            buffers = [u.state["momentum_buffer"] for u in run] if group["momentum"] != 0 else None
            fused_sgd_multi_triton(
                [u.shard for u in run],
                [u.grad for u in run],
                buffers,
                [u.lowp for u in run],
                first_step,
                *self._settings(group),
                grad_scale,
                self._launch_tables_of(run),
                group["maximize"],
            )
        return None

    def _update(self, shard, grad, grad_scale, state, group, lowp_out):
        first_step = "momentum_buffer" not in state
        if group["momentum"] != 0 and first_step:
            state["momentum_buffer"] = torch.empty_like(shard)
        update = fused_sgd if shard.is_cuda else fused_sgd_reference
        update(
            shard,
            grad,
            state.get("momentum_buffer"),
            first_step,
            *self._settings(group),
            grad_scale,
            lowp_out,
            group["maximize"],
        )

    @staticmethod
    def _settings(group: dict) -> tuple:
        """``(lr, momentum, dampening, weight_decay, nesterov)`` of ``group`` as numbers, in the kernels' order."""
        return (
            *map(_scalar, (group["lr"], group["momentum"], group["dampening"], group["weight_decay"])),
            group["nesterov"],
        )
