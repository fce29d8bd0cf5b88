"""Fuse cross-entropy's backward so it holds one logits-sized buffer, not two.

AOTAutograd writes the backward of ``F.cross_entropy`` (``log_softmax`` then ``nll_loss``) as
``g = nll_loss_backward(grad, log_probs, target, ...)`` followed by
``_log_softmax_backward_data(g, log_probs, dim, input_dtype)``: two tensors the size of the logits,
alive together beside the saved log-probabilities. For a language model the logits are the largest
activation of the step (rows x vocabulary), so this pair is often the step's peak (4 GiB each in
fp32 for a 128k vocabulary at 8k tokens).

The pass replaces each such pair with one ``zcompile::cross_entropy_backward`` call
(``zcompile.kernels.cross_entropy``), which computes the same values (on the CPU, bit for bit: ATen's
two ops a block of rows at a time) into one buffer. It applies
where the pair is exactly the loss's backward: ``g`` read by the softmax backward only, both ops
reading the same log-probabilities (through views such as ``detach``), and the class dimension
last (``[rows, classes]`` or ``[classes]``). Anything else (``nll_loss2d``, a class dimension in
the middle, a ``g`` read by something else) is left as it is: the graph stays correct, only
larger. Nothing is saved from forward that was not before: the op reads what the two ops read.
"""

from __future__ import annotations

import logging

import torch

from zcompile.kernels.cross_entropy import CROSS_ENTROPY_BACKWARD
from zcompile.passes.op_sets import VIEW_OPS, is_call_to

log = logging.getLogger(__name__)
aten = torch.ops.aten

NLL_LOSS_BACKWARD = aten.nll_loss_backward.default
LOG_SOFTMAX_BACKWARD = aten._log_softmax_backward_data.default
_NLL_LOSS_BACKWARD, _LOG_SOFTMAX_BACKWARD = frozenset({NLL_LOSS_BACKWARD}), frozenset({LOG_SOFTMAX_BACKWARD})


def _through_views(node):
    while isinstance(node, torch.fx.Node) and is_call_to(node, VIEW_OPS):
        node = node.args[0]
    return node


def _fusable(softmax_backward: torch.fx.Node) -> torch.fx.Node | None:
    """The ``nll_loss_backward`` node the softmax backward can absorb, or ``None``."""
    grad, log_probs, dim = softmax_backward.args[:3]
    if not (isinstance(grad, torch.fx.Node) and is_call_to(grad, _NLL_LOSS_BACKWARD)):
        return None
    if len(grad.args) != 7 or grad.kwargs or softmax_backward.kwargs:
        return None
    if len(grad.users) != 1 or _through_views(grad.args[1]) is not _through_views(log_probs):
        return None
    value, probs = softmax_backward.meta.get("val"), grad.args[1].meta.get("val")
    if not isinstance(value, torch.Tensor) or not isinstance(probs, torch.Tensor) or probs.dim() not in (1, 2):
        return None
    return grad if dim in (probs.dim() - 1, -1) else None


def _erase_unread_views(gm: torch.fx.GraphModule, node) -> None:
    """The view chain (``detach`` of the saved log-probabilities) only the erased op read."""
    while isinstance(node, torch.fx.Node) and is_call_to(node, VIEW_OPS) and not node.users:
        source = node.args[0]
        gm.graph.erase_node(node)
        node = source


def fuse_cross_entropy_backward_pass(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Each ``nll_loss_backward`` -> ``_log_softmax_backward_data`` pair of the loss becomes one
    ``zcompile::cross_entropy_backward`` (module doc). Reads ``meta["val"]``; the new node gets the
    replaced node's metadata (its value has the same shape and dtype)."""
    fused = 0
    for node in list(gm.graph.nodes):
        if not is_call_to(node, _LOG_SOFTMAX_BACKWARD):
            continue
        nll = _fusable(node)
        if nll is None:
            continue
        grad_loss, log_probs, target, weight, reduction, ignore_index, total_weight = nll.args
        with gm.graph.inserting_before(node):
            call = gm.graph.call_function(
                CROSS_ENTROPY_BACKWARD,
                (
                    grad_loss,
                    log_probs,
                    target,
                    weight,
                    reduction,
                    ignore_index,
                    total_weight,
                    node.args[3],
                    node.meta["val"].dtype,
                ),
            )
        call.meta.update(node.meta)
        node.replace_all_uses_with(call)
        read = node.args[1]
        gm.graph.erase_node(node)
        gm.graph.erase_node(nll)
        _erase_unread_views(gm, read)
        fused += 1
    if fused:
        log.debug("fused %d cross-entropy backward(s) into one buffer each", fused)
    gm.graph.lint()
    gm.recompile()
    return gm
