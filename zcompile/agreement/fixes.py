"""The fix a rank-divergence error offers, chosen by what the ranks were doing: each text owned here once.

A divergence is found where ranks meet (an exchange through the store) by a rank that came, about
ranks that did not or came from elsewhere. What fixes it depends on that pattern, not on where it
was found: a no-grad call on some ranks while others train is an evaluation run on some ranks only;
a checkpoint call on some ranks is a save decided per rank; a step missing on some ranks is a skipped
step or layer. ``choose`` picks the text from this rank's call and the others' (their calls, or what
their heartbeats say they wait in), falling back to the caller's own fix. The table of patterns is
in ``docs/failure-modes.md``.
"""

from __future__ import annotations

from collections.abc import Iterable

# how a compile's rank check names itself (and how a beat shows a rank waiting in one)
COMPILE_CHECK = "zcompile compile check: "
# how a compiled call's agreement names a call that computes no gradient (``ShardSwap.wrap``)
NO_GRAD_CALL = "a call of a compiled no-grad graph"
CHECKPOINT_CALL = "zcompile.checkpoint."

CHECK_FIX = (
    "The ranks took different compile paths (different models, modes, code paths or input shapes per rank) "
    "and their collectives would deadlock. Give every rank the same model, the same mode (model.train() / "
    "model.eval(), torch.no_grad()) and the same code path. A rank may recompile alone for its own input "
    "shapes while the new graph issues the agreed collectives; where it issues others (code that branches on "
    "a shape), give every rank inputs of the same shapes (drop_last=True, padding) or make them dynamic from "
    "the first call (torch._dynamo.mark_dynamic, or torch.compile(..., dynamic=True)). Raise check_timeout_s "
    "if a rank is only slow."
)

STEP_FIX = (
    "Every rank must call it once per training step, after the same forward/backward calls through the same "
    "modules. Skip non-finite steps on every rank together (zcompile.optim.AdamW(..., skip_nonfinite=True)), "
    "not with `if not torch.isfinite(loss): continue` on one rank, and skip layers at random (LayerDrop) on "
    "every rank together (a torch.Generator seeded alike on every rank)."
)

EVALUATION_FIX = (
    "Some ranks evaluate (a call under torch.no_grad()) while others train: the evaluation runs on some ranks "
    "only. At stage 3 every forward gathers the weights from every rank, so evaluate on every rank (each on "
    "its share of the evaluation data, the metric reduced with dist.all_reduce, printed on rank 0); at "
    "stages 1 and 2 a rank may evaluate alone under torch.no_grad()."
)

SAVE_DECISION_FIX = (
    "Some ranks call zcompile.checkpoint while others do not: the decision to save (or load) is made per rank, "
    "as under `if rank == 0:` or when rank 0's validation loss improved. It must be the same on every rank: "
    "compute the metric on every rank, or take rank 0's on every rank (metric = zcompile.from_rank0(metric)) "
    "before deciding; then call it on every rank (the files are written once). Raise timeout_s if a rank is only slow."
)


def choose(fix: str, mine: str, others: Iterable[str | None], grad_enabled: bool = True) -> str:
    """The fix for a divergence found by this rank doing ``mine`` (its call, or what it waits in) while
    the others do ``others`` (theirs, or what their beats say they wait in; None: their own code):
    the pattern's, else ``fix``. ``grad_enabled``: this rank's grad mode (a compile check under
    ``torch.no_grad()`` is an evaluation's)."""
    others = [other or "" for other in others]
    everyone = [mine, *others]
    if any(CHECKPOINT_CALL in what for what in everyone) and not all(CHECKPOINT_CALL in what for what in everyone):
        return SAVE_DECISION_FIX
    evaluating = [NO_GRAD_CALL in mine or (mine.startswith(COMPILE_CHECK) and not grad_enabled)]
    evaluating += [NO_GRAD_CALL in other for other in others]
    if any(evaluating) and not all(evaluating):
        return EVALUATION_FIX
    if any(other.startswith(COMPILE_CHECK) for other in others):
        return CHECK_FIX  # a rank compiling a graph the others did not: the fix is about that
    return fix
