"""Stage-3 parameters that say they are sharded when eager code touches them.

At rest a stage-3 parameter keeps its shape and strides (Dynamo's guards read them) but its
storage is freed: the full value exists only inside compiled graphs and ``zcompile.gathered``.
Eager code that reads or writes it anyway (Dynamo running a frame uncompiled, ``generate()``
outside ``gathered``, ``model.lm_head.weight.sum()``) would get torch's "setStorage ... out of
bounds for storage of size 0", or write through a null pointer. So the parameter's class becomes
``ShardedParameter``, an ``nn.Parameter`` whose ``__torch_function__`` raises
``ShardedParameterError`` (the parameter, why it is sharded, where Dynamo fell back, the fix) for
any operation on it while its storage is freed. Metadata (shape, dtype, device, grad, storage) stays
readable; ``detach()`` and ``.data`` of a freed parameter give a ``FreedTensor`` that raises the same way.

Cost: nothing in compiled graphs (Dynamo traces ``__torch_function__`` with ``is_compiling()``
true, and the graphs receive the shards, not the parameters); one Python call per eager op on the
parameter inside ``gathered`` (its storage is there, the op runs unchanged and returns a plain tensor).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch._C import DisableTorchFunctionSubclass

from zcompile.common.dynamo_frame import eager_fallback_reason, never_compiled_as_frames

if TYPE_CHECKING:
    from zcompile.sharding.shards import ShardedParam

SHARD_ATTR = "_zcompile_shard"  # on a parameter: its ShardedParam (set by zcompile.sharding.shards)
ALIASED_ATTR = "_zcompile_aliased"  # on a FreedTensor: the ShardedParam of the parameter it aliases
# the fix for torch.autograd.grad with respect to a sharded parameter (here and in zcompile.routes.autograd)
AUTOGRAD_GRAD_FIX = (
    "Call loss.backward() and read the gradients averaged over ranks inside `with zcompile.gathered(model, "
    "grads=True): ...` (what you assign to p.grad there is what the step applies), or use stage 1, whose graphs "
    "differentiate the parameters themselves"
)

# reading these never touches the (freed) elements
_METADATA = {
    torch.Tensor.size,
    torch.Tensor.dim,
    torch.Tensor.stride,
    torch.Tensor.numel,
    torch.Tensor.nelement,
    torch.Tensor.ndimension,
    torch.Tensor.untyped_storage,
    torch.Tensor.storage_offset,
    torch.Tensor.is_contiguous,
    torch.Tensor.element_size,
    torch.Tensor.requires_grad_,
    torch.Tensor.register_hook,
    torch.Tensor.register_post_accumulate_grad_hook,
    torch.Tensor.__hash__,
    torch.Tensor.__format__,
    torch.Tensor.__len__,
    torch.Tensor.get_device,
    torch.Tensor.data_ptr,
    # what Dynamo asks of a graph input while it wraps it (torch 2.11 asks _is_view through
    # __torch_function__; 2.13 does not): none reads an element
    torch.Tensor._is_view,
    torch.Tensor.is_inference,
    torch.Tensor.is_neg,
    torch.Tensor.is_conj,
    torch.Tensor._is_zerotensor,
    # dtype questions (transformers' PreTrainedModel.dtype asks is_floating_point of each parameter)
    torch.Tensor.is_floating_point,
    torch.is_floating_point,
    torch.Tensor.is_complex,
    torch.is_complex,
    torch.Tensor.is_signed,
    torch.numel,
    # writes that touch no element (reading a property is metadata too: ``_is_metadata``)
    torch.Tensor.requires_grad.__set__,
    torch.Tensor.grad.__set__,
    torch.Tensor.grad.__delete__,
}
# these alias the parameter: the alias must keep refusing (state_dict() detaches before its hooks run)
_ALIASES = {torch.Tensor.detach, torch.Tensor.data.__get__}
# the tensor properties that are views of the elements; every other property is metadata (is_mkldnn,
# is_xpu, ...: Dynamo 2.11 reads many of them while wrapping a graph input)
_VIEW_PROPERTIES = {"data", "T", "mT", "H", "mH", "real", "imag"}


def _is_metadata(func) -> bool:
    """Whether ``func`` leaves the elements alone: a listed method, or reading any tensor property but
    the views (``shape``, ``grad``, ``is_mkldnn``, ...)."""
    if func in _METADATA:
        return True
    owner = getattr(func, "__self__", None)  # a property's __get__ is bound to the tensor type's descriptor
    return (
        getattr(func, "__name__", None) == "__get__"
        and getattr(owner, "__objclass__", None) is torch._C.TensorBase
        and owner.__name__ not in _VIEW_PROPERTIES
    )


class ShardedParameterError(RuntimeError):
    """Eager code used a stage-3 parameter whose full value exists on no rank."""


def mark_sharded(param: torch.nn.Parameter) -> None:
    """Makes ``param`` refuse eager use while freed (its class becomes ``ShardedParameter``)."""
    if type(param) is torch.nn.Parameter:
        param.__class__ = ShardedParameter


def grad_of(tensor: torch.Tensor) -> torch.Tensor | None:
    """``tensor.grad``, read past ``ShardedParameter.__torch_function__``: reading it is metadata, which
    the guard lets through anyway, but only after a Python dispatch, and the optimizer's step and
    ``zero_grad`` read every parameter's several times a step. Any other tensor reads it directly
    (entering the context would cost more than the read)."""
    if type(tensor) is not ShardedParameter:
        return tensor.grad
    with DisableTorchFunctionSubclass():
        return tensor.grad


def set_grad(tensor: torch.Tensor, grad: torch.Tensor | None) -> None:
    """``tensor.grad = grad`` past the guard's dispatch (``grad_of``)."""
    if type(tensor) is not ShardedParameter:
        tensor.grad = grad
        return
    with DisableTorchFunctionSubclass():
        tensor.grad = grad


def is_freed(tensor: torch.Tensor) -> bool:
    with DisableTorchFunctionSubclass():
        return tensor.untyped_storage().size() == 0 and tensor.numel() > 0


def _guarded_call(func, args, kwargs):
    kwargs = kwargs or {}
    with DisableTorchFunctionSubclass():
        if not torch.compiler.is_compiling() and not _is_metadata(func):
            freed = _first_freed(args, kwargs)
            if freed is not None:
                if func in _ALIASES:
                    alias = func(*args, **kwargs).as_subclass(FreedTensor)
                    setattr(alias, ALIASED_ATTR, _sharded(freed))
                    return alias
                raise ShardedParameterError(_message(freed, func))
        return func(*args, **kwargs)


class ShardedParameter(torch.nn.Parameter):
    """A stage-3 ``nn.Parameter``: raises ``ShardedParameterError`` on eager use while freed (module doc)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _guarded_call(func, args, kwargs)


class FreedTensor(torch.Tensor):
    """``detach()`` / ``.data`` of a freed ``ShardedParameter``: refuses element access the same way."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _guarded_call(func, args, kwargs)


# Dynamo compiles these classes' __torch_function__ inline, inside the graph that uses the parameter,
# and never as a frame of its own, nor the helpers it calls. Why: eager code that Dynamo runs under a
# compiled call (a frame it gave up on) may call an op with a marked weight no graph has taken yet;
# compiled as a frame, __torch_function__ (with dynamic=True also _first_freed) would make a graph that
# takes the weight for stage 3, though eager code gives it a stage-1 shard for its gradient, and the
# next step would fail. Once per process: the mark outlives torch._dynamo.reset().
never_compiled_as_frames(ShardedParameter.__torch_function__, FreedTensor.__torch_function__, _guarded_call)


def _first_freed(args, kwargs) -> torch.Tensor | None:
    for value in (*args, *kwargs.values()):
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(item, (ShardedParameter, FreedTensor)) and is_freed(item):
                return item
    return None


def _sharded(tensor: torch.Tensor):
    """The ``ShardedParam`` of ``tensor``: a parameter's own, or the one an alias of it carries."""
    sharded = shard_of(tensor)
    return sharded if sharded is not None else getattr(tensor, ALIASED_ATTR, None)


def _freed_reason(tensor: torch.Tensor) -> str:
    sharded = _sharded(tensor)
    return "ZeRO stage 3" if sharded is None else sharded.freed_reason


def _name_of(tensor: torch.Tensor) -> str:
    sharded = _sharded(tensor)
    return "?" if sharded is None else sharded.name


def _message(tensor: torch.Tensor, func) -> str:
    if func is torch.autograd.grad:
        return (
            f"zcompile: torch.autograd.grad with respect to parameter {_name_of(tensor)!r}, which is sharded "
            f"({_freed_reason(tensor)}): the compiled backward reduce-scatters its gradient onto this rank's shard, "
            f"so no full gradient exists to return. {AUTOGRAD_GRAD_FIX}"
        )
    name = getattr(func, "__name__", str(func))
    if name in ("__get__", "__set__", "__delete__"):  # a property's accessor: name the property
        name = f"{getattr(getattr(func, '__self__', None), '__name__', '?')} ({name})"
    return (
        f"zcompile: parameter {_name_of(tensor)!r} {tuple(tensor.shape)} is sharded ({_freed_reason(tensor)}): "
        "its full value exists only inside the compiled graphs, so eager code cannot use it "
        f"({name} outside a compiled graph). {eager_fallback_reason()} For the full weights in eager code "
        "(generate(), evaluation, export), enter `with zcompile.gathered(model): ...` on every rank "
        "(rank0_only=True gathers to rank 0 only); for checkpoints use zcompile.checkpoint."
    )


def shard_of(param: torch.Tensor) -> ShardedParam | None:
    """The ``ShardedParam`` of a zcompile parameter, else None."""
    return getattr(param, SHARD_ATTR, None)
