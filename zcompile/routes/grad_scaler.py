"""``torch.amp.GradScaler`` over zcompile parameters: unscale and check the gradients the step uses.

A GradScaler unscales ``param.grad`` of the optimizer's parameters and checks them for inf/NaN
(``GradScaler._unscale_grads_``), then skips ``optimizer.step()`` where it found any. Over zcompile
parameters that reads the wrong gradients:

- stages 2 and 3: ``param.grad`` is None (the averaged gradient lives on the shards), so nothing is
  checked and ``scaler.step`` stops with torch's "No inf checks were recorded for this optimizer";
- stage 1: ``param.grad`` is this rank's local gradient, so each rank decides alone. A rank whose
  gradient overflowed skips the step while the others take it: the ranks' weights part (zcompile's
  step agreement turns that into a ``RankDivergenceError``, but the job stops where DDP would have
  skipped a step on every rank and lowered the scale).

``install_grad_scaler_route`` (run when the first parameter is sharded, beside the clip route)
replaces ``torch.amp.GradScaler._unscale_grads_`` by a wrapper that, for an optimizer holding
zcompile parameters, works on the averaged gradient shards, as clipping does (``zcompile.optim.clip``;
stage 1 reduce-scatters its gradients onto the shards now, and the step does not reduce them
again): unscales them in place and sets the found-inf flag from every rank's (one MAX all-reduce
of the flag with the scale beside it: ranks whose scales differ, a scaler state loaded on rank 0
only, get a ``RankDivergenceError`` instead of each unscaling by its own factor), so every rank
skips or steps together and ``scaler.update()`` moves every rank's scale the same way. Other optimizers get torch's own method. ``torch.cuda.amp.GradScaler`` is a subclass
and is routed too. Torch internals: ``_unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)``
and its return value (found-inf per device) are read as in torch 2.11 and 2.13.
"""

from __future__ import annotations

import functools
import logging

import torch

from zcompile.agreement.abort_note import RankDivergenceError
from zcompile.optim.clip import TORCH_ROUTE_BUCKET_BYTES, averaged_grad_shards, keep_records_for_step
from zcompile.optim.nonfinite import any_rank_flag
from zcompile.routes.clip_grad import agree_before_route, route_members
from zcompile.routes.patched import ORIGINAL_ATTR
from zcompile.sharding.shards import ShardedParam, shard_of

log = logging.getLogger(__name__)


def unscale_grad_shards(
    members: list[ShardedParam], inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
) -> dict[torch.device, torch.Tensor]:
    """Multiplies the averaged gradient shards of ``members`` by ``inv_scale`` in place and returns
    ``{device: flag}``, the flag 1.0 where any rank's shards hold an inf or NaN (``found_inf``'s dtype;
    ``GradScaler._unscale_grads_``'s contract). Collective: every rank of the members' group calls it."""
    with_grad, records = averaged_grad_shards(members, TORCH_ROUTE_BUCKET_BYTES)
    grads = [m.shard_grad.detach() for m in with_grad]
    if not allow_fp16 and any(g.dtype == torch.float16 for g in grads):
        raise ValueError(
            "zcompile: Attempting to unscale FP16 gradients: at stage 2 with param_dtype='fp16' each gradient "
            "shard is fp16 (a slice of the fp16 replica), and unscaling it in place would underflow, as torch's "
            "own check says. Use stage 1 or 3 (fp32 gradient shards), param_dtype='bf16' (no loss scaling needed), "
            "or fp32 parameters under torch.autocast(dtype=torch.float16)."
        )
    device = found_inf.device
    flag = torch.zeros((), dtype=torch.float32, device=device)
    by_place: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for grad in grads:
        by_place.setdefault((grad.device, grad.dtype), []).append(grad)
    for (grad_device, _), same in by_place.items():
        local = torch.zeros((), dtype=torch.float32, device=grad_device)
        torch._amp_foreach_non_finite_check_and_unscale_(same, local, inv_scale.to(grad_device))
        flag = torch.maximum(flag, local.to(device))
    # the flag, and the scale as its max and min: a scale that differs between ranks (a scaler state
    # loaded on some ranks only) would unscale one reduced gradient by different factors, silently
    inverse = inv_scale.to(device=device, dtype=torch.float32).reshape(())
    packed = torch.stack([flag, inverse, -inverse])
    record = any_rank_flag(packed, members[0].group if members else None)
    keep_records_for_step(with_grad, records + ([record] if record is not None else []))
    if packed[1] != -packed[2]:
        raise RankDivergenceError(
            f"zcompile: GradScaler.unscale_(): the ranks' loss scales differ (from {1 / float(packed[1]):g} to "
            f"{1 / float(-packed[2]):g}), so each rank would unscale the averaged gradient by another factor. "
            "Create the scaler alike on every rank and load its state (scaler.load_state_dict) on every rank, "
            "not on rank 0 only."
        )
    found_inf.copy_(packed[0].to(found_inf.dtype))
    return {device: found_inf}


def install_grad_scaler_route() -> None:
    """Routes ``torch.amp.GradScaler``'s unscale of zcompile parameters here; idempotent (module docstring)."""
    scaler_class = torch.amp.GradScaler
    if hasattr(scaler_class._unscale_grads_, ORIGINAL_ATTR):
        return
    original = scaler_class._unscale_grads_

    @functools.wraps(original)
    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if not any(shard_of(p) is not None for p in params):
            return original(self, optimizer, inv_scale, found_inf, allow_fp16)
        agree_before_route(params, "GradScaler.unscale_()")
        with torch.no_grad():
            return unscale_grad_shards(route_members(params), inv_scale, found_inf, allow_fp16)

    setattr(_unscale_grads_, ORIGINAL_ATTR, original)
    scaler_class._unscale_grads_ = _unscale_grads_
    log.info("zcompile: torch.amp.GradScaler now unscales and checks zcompile parameters' gradient shards")
