"""Code outside the compiled graphs is never silently wrong and never hangs.

Eager fallbacks (Dynamo's recompile limit) train exactly at stages 1 and 2 and fail with a clear
error at stage 3; eager use of a stage-3 weight names ``zcompile.gathered``; rank-divergent code
(``gathered`` or ``optimizer.step()`` on some ranks only) is a ``RankDivergenceError`` on every
rank in seconds instead of a wait for the process-group timeout.
"""

import json
import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

import zcompile
from support.launch import run_ranks
from support.models import build_model, global_batch
from support.training import (
    RunSpec,
    _optimizer,
    assert_same_training,
    micro_batches,
    train_reference,
    train_steps,
    train_zero,
)
from zcompile.agreement.abort_note import RankDivergenceError
from zcompile.agreement.fixes import EVALUATION_FIX, SAVE_DECISION_FIX
from zcompile.sharding.sharded_parameter import ShardedParameterError
from zcompile.sharding.shards import shard_of

# a new sequence length every step with static shapes: from the third step on, Dynamo is past its
# recompile limit of 2 and runs the model's forward frame eagerly
FALLBACK = dict(seq_lens=(16, 8, 12, 10), steps=4, dynamic=False, recompile_limit=2, optimizer="sgd", lr=0.1)


def _stage3_model_after_one_step():
    torch._dynamo.reset()
    model = build_model("gpt")
    compiled = torch.compile(model, backend="zero", options={"stage": 3})
    optimizer = zcompile.optim.SGD(model.parameters(), lr=0.1)
    tokens, targets = global_batch(0, 2)
    compiled(tokens, targets).backward()
    optimizer.step()
    return model, compiled, (tokens, targets)


def test_eager_use_of_a_stage3_weight_names_gathered():
    model, compiled, (tokens, targets) = _stage3_model_after_one_step()
    weight = model.blocks[0].attn.qkv.weight
    assert weight.shape == (96, 32) and weight.dtype == torch.float32  # metadata stays readable
    with pytest.raises(ShardedParameterError, match=r"'blocks\.0\.attn\.qkv\.weight'.*sharded.*zcompile\.gathered"):
        weight.sum()
    with pytest.raises(ShardedParameterError, match="zcompile.gathered"), torch.no_grad():
        weight.data.fill_(0.0)  # a write through .data: was a write into freed storage
    with pytest.raises(ShardedParameterError, match="outside torch.compile.*zcompile.gathered"):
        model(tokens, targets)  # the original module, not the compiled one
    with zcompile.gathered(model):
        eager = model(tokens, targets)
        assert type(weight.sum()) is torch.Tensor  # ops on the gathered weight give plain tensors
    with torch.no_grad():
        torch.testing.assert_close(eager, compiled(tokens, targets), rtol=0, atol=0)
    with pytest.raises(ShardedParameterError):
        weight.sum()  # freed again after the block
    # gradients taken with torch.autograd.grad (meta-learning, gradient penalties): none exists in full
    with pytest.raises(
        ShardedParameterError, match=r"torch.autograd.grad .*'wte.weight'.*gathered\(model, grads=True\)"
    ):
        torch.autograd.grad(compiled(tokens, targets), list(model.parameters()))


@pytest.mark.parametrize("stage", [1, 2])
def test_a_dtype_change_after_sharding_names_the_parameter_and_the_fix(stage):
    """``model.double()`` after the first step (stages 1 and 2 keep the fp32 master weight in the
    parameter's own storage): a clear error at the next call naming the parameter and param_dtype.
    Stage 2 stopped in torch's "mat1 and mat2 must have the same dtype"; stage 1 trained on."""
    torch._dynamo.reset()
    model = build_model("gpt")
    compiled = torch.compile(model, backend="zero", options={"stage": stage})
    optimizer = zcompile.optim.AdamW(model.parameters(), lr=1e-2)
    tokens, targets = global_batch(0, 2)
    compiled(tokens, targets).backward()
    optimizer.step()
    model.double()
    with pytest.raises(Exception, match=r"parameter '.*' became torch.float64.*after it was sharded.*param_dtype"):
        compiled(tokens, targets)
    torch._dynamo.reset()


def test_a_marked_weight_used_by_eager_code_under_a_compiled_call_is_not_compiled_alone():
    """Eager code that Dynamo runs under a compiled call (a frame it gave up on: a graph break inside a
    loop, as transformers' BART has at LayerDrop's ``torch.rand([]) < p``) calls ``F.layer_norm`` with a
    weight marked as a stage-3 parameter. Dynamo compiled the class's ``__torch_function__`` as a frame
    of its own, whose graph took the weight (``L['kwargs']['weight']``): on BART at stage 3, a
    ``ValueError`` at the second step ("already sharded with stage 1"), its eager gradient having given
    it a stage-1 shard at the first."""
    from zcompile.sharding.sharded_parameter import mark_sharded

    torch._dynamo.reset()
    norm = torch.nn.LayerNorm(8)
    mark_sharded(norm.weight)  # marked ahead (mark_like_siblings), not freed: eager use is allowed
    graphs = []

    def recording(gm, example_inputs):
        graphs.append([node.name for node in gm.graph.find_nodes(op="placeholder")])
        return gm.forward

    def forward(x):
        for _ in range(2):
            if x.sum() > 0:  # a graph break inside a loop: Dynamo runs this frame eagerly
                x = x - 1
        return torch.nn.functional.layer_norm(x, (8,), norm.weight, norm.bias)

    x = torch.randn(2, 8)
    for dynamic in (None, True):  # dynamic=True (ZeroTrainer's): the helpers it calls made graphs of their own too
        torch._dynamo.reset()
        torch.testing.assert_close(
            torch.compile(forward, backend=recording, dynamic=dynamic)(x), forward(x), rtol=0, atol=0
        )
    assert not any("l_kwargs_weight_" in inputs for inputs in graphs), graphs


def test_a_freed_weight_in_a_frame_dynamo_gave_up_on_names_that_frame():
    """A stage-3 weight used by a frame Dynamo runs eagerly under a compiled call (a graph break inside
    its loop: transformers' Whisper with LayerDrop, whose decoder embeds its tokens there). The error
    said "It runs outside torch.compile", which it does not: no frame on the way had compiled entries."""
    from zcompile.sharding.sharded_parameter import mark_sharded

    torch._dynamo.reset()
    norm = torch.nn.LayerNorm(8)
    mark_sharded(norm.weight)
    with torch.no_grad():
        norm.weight.untyped_storage().resize_(0)  # as a stage-3 parameter's between graphs

    def forward_with_a_loop_break(x):
        for _ in range(2):
            if x.sum() > 0:  # a graph break inside a loop: Dynamo runs this frame eagerly
                x = x - 1
        return torch.nn.functional.layer_norm(x, (8,), norm.weight, norm.bias)

    with pytest.raises(
        ShardedParameterError,
        match="Dynamo runs 'forward_with_a_loop_break' .* eagerly under the compiled call: it gave up on a frame there",
    ):
        torch.compile(forward_with_a_loop_break, backend="eager")(torch.randn(2, 8))


def test_recompile_limit_at_stage3_names_the_limit():
    torch._dynamo.reset()
    model = build_model("gpt")
    compiled = torch.compile(model, backend="zero", options={"stage": 3}, dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=1):
        compiled(*global_batch(0, 2, (16,))).backward()
        with pytest.raises(ShardedParameterError, match=r"recompile_limit \(cache_size_limit\) = 1.*mark_dynamic"):
            compiled(*global_batch(0, 2, (8,)))


class _MaskedEmbedding(torch.nn.Module):
    """wav2vec2's SpecAugment in training: the masked positions get a learned vector (a boolean mask as an index)."""

    def __init__(self):
        super().__init__()
        self.masked_embed = torch.nn.Parameter(torch.randn(8))
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x, mask):
        x = self.proj(x)
        x[mask] = self.masked_embed.to(x.dtype)
        return x.square().mean()


def test_an_op_whose_shape_depends_on_the_data_names_the_config_that_compiles_it():
    """A boolean-mask assignment (aten.nonzero, whose output shape depends on the values) fails the backend's
    AOTAutograd trace, and Dynamo then runs the frame eagerly, where stage-3 weights have no full value:
    torch's "setStorage ... out of bounds for storage of size 0" at the first (transformers' wav2vec2 in
    training, its SpecAugment masking: a ShardedParameterError blaming a graph break inside a loop). Now
    the compile's error names the op and the one Dynamo setting that compiles it, which then trains as eager."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    x, mask = torch.randn(4, 6, 8), torch.rand(4, 6) < 0.5
    model = _MaskedEmbedding()
    expected = (
        r"ShardedParameterError: zcompile: graph 0/0 did not compile: aten\.nonzero\.default's output shape "
        r"depends on the tensor's values.*'masked_embed'.*capture_dynamic_output_shape_ops = True"
    )
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match=expected):
        torch.compile(model, backend="zero", options={"stage": 3})(x, mask)

    torch._dynamo.reset()
    reference, model = _MaskedEmbedding(), _MaskedEmbedding()
    model.load_state_dict(reference.state_dict())
    reference_loss = reference(x, mask)
    reference_loss.backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        loss = torch.compile(model, backend="zero", options={"stage": 3})(x, mask)
        loss.backward()
        zcompile.optim.SGD(model.parameters(), lr=0.1).step()
    torch.testing.assert_close(loss, reference_loss)
    with zcompile.gathered(model):
        for name, param in reference.named_parameters():
            torch.testing.assert_close(model.get_parameter(name), param, msg=name)


@pytest.mark.parametrize("failing", ["run_passes", "compile_with_aot"])
def test_a_failed_stage3_compile_leaves_parameters_that_refuse_eager_use(monkeypatch, failing):
    """A compile that fails after sharding (a rank check, a pass, AOTAutograd, the inner compiler) left
    stage-3 parameters with freed storage and their plain class: printing one (the model in an except
    clause, pytest showing a failed test's locals) read freed memory and segfaulted."""
    import zcompile.backend.entry_point

    def failing_step(*args, **kwargs):
        raise RuntimeError(f"{failing} failed")

    torch._dynamo.reset()
    model = torch.nn.Linear(4, 4)
    monkeypatch.setattr(zcompile.backend.entry_point, failing, failing_step)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match=f"{failing} failed"):
        torch.compile(model, backend="zero", options={"stage": 3})(torch.randn(2, 4))
    with pytest.raises(ShardedParameterError, match=r"'weight' \(4, 4\) is sharded"):
        repr(model.weight)


def test_gathered_refuses_writeback_with_rank0_only():
    with pytest.raises(ValueError, match="writeback=True with rank0_only=True"):
        with zcompile.gathered(torch.nn.Linear(2, 2), writeback=True, rank0_only=True):
            pass


def _fallback_runs(rank, world):
    torch.manual_seed(0)
    return [train_zero(RunSpec(stage=stage, **FALLBACK), rank, world) for stage in (1, 2)]


def test_recompile_limit_at_stages_1_and_2_trains_like_one_process():
    reference = train_reference(RunSpec(**FALLBACK))
    for stage, result in zip((1, 2), run_ranks(2, _fallback_runs)[0]):
        assert_same_training(result, reference, RunSpec(stage=stage, **FALLBACK))


# zeroing gradients through the model: clipped stage 1 (its shards hold the early-reduced gradient),
# stage 2 in place (set_to_none=False); and `p.grad = None`, which misses the shards
ZEROED_VIA_MODEL = (
    RunSpec(stage=1, clip=0.05, zero_grad_via="model"),
    RunSpec(stage=2, zero_grad_via="model", zero_grad_to_none=False),
)
NOT_ZEROED = RunSpec(stage=2, zero_grad_via="param")


def _zero_grad_runs(rank, world):
    warnings = _messages_logged_by("zcompile.optim", "NOTSET")
    results = [train_zero(spec, rank, world) for spec in (*ZEROED_VIA_MODEL, NOT_ZEROED)]
    return results, [w for w in warnings if "were not zeroed since the last step" in w]


def test_model_zero_grad_clears_the_gradient_shards_and_p_grad_none_is_not_silent():
    """model.zero_grad() used to leave the shards' gradients: every later step trained on the sum of
    all gradients so far (losses off the reference from step 2)."""
    (*zeroed, not_zeroed), warnings = run_ranks(2, _zero_grad_runs)[0]
    for spec, result in zip(ZEROED_VIA_MODEL, zeroed, strict=True):
        assert_same_training(result, train_reference(spec), spec)
    # p.grad = None cannot reach the shards: torch's accumulate-when-not-zeroed, and a warning saying so
    assert len(warnings) == 1 and "model.zero_grad()" in warnings[0] and "p.grad = None" in warnings[0], warnings
    accumulated = train_reference(NOT_ZEROED)
    assert abs(not_zeroed.losses[-1] - accumulated.losses[-1]) > 1e-3  # it did train differently


def _skip_step_on_rank0(rank, world, stage, skipped=1):
    """Rank 0 skips its step ``skipped`` (`if not isfinite(loss): continue`); both ranks must raise, at
    once. Seconds from the last step's start (from the loop's, when no step ran: the first one skipped)."""
    torch._dynamo.reset()
    model = build_model("gpt")
    compiled = torch.compile(model, backend="zero", options={"stage": stage})
    optimizer = zcompile.optim.SGD(model.parameters(), lr=0.1, check_timeout_s=20)
    spec = RunSpec(stage=stage)
    start = time.perf_counter()
    try:
        for step in range(4):
            ((tokens, targets),) = micro_batches(spec, step, rank, world)
            loss = compiled(tokens, targets)
            if step == skipped and rank == 0:
                continue
            loss.backward()
            start = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad()
    except RankDivergenceError as error:
        return str(error), time.perf_counter() - start
    return None, None


@pytest.mark.parametrize("stage", [1, 2])
def test_step_skipped_on_one_rank_fails_fast_on_every_rank(stage):
    for message, seconds in run_ranks(2, _skip_step_on_rank0, stage):
        assert message is not None, "a step skipped on one rank went unnoticed"
        # stage 1 meets at the next step; a stage-2 training call agrees first, as stage 3's does
        where = "different training steps" if stage == 1 else "wait elsewhere"
        assert where in message and "skip_nonfinite" in message, message
        assert seconds < 10, seconds  # no timeout to wait for


def test_a_first_step_skipped_on_one_rank_names_the_skip_not_a_compile():
    """Stage 3, rank 0 skips its first backward and step: rank 1's backward checks its issue order at its
    first call (a check at a call, not at a compile), and a rank waiting for it there was read as one
    compiling alone, and the message on every rank asked for the same shapes and models (the
    compile's fix) where a step had been skipped."""
    for message, seconds in run_ranks(2, _skip_step_on_rank0, 3, 0):
        assert message is not None, "a step skipped on one rank went unnoticed"
        assert "skip_nonfinite" in message and "different compile paths" not in message, message
        assert seconds < 30, seconds


def _messages_logged_by(logger: str, level: str) -> list[str]:
    """A list that collects, from now on in this process, the messages ``logger`` logs at ``level`` or above."""
    import logging

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.getLogger(logger).addHandler(Keep(level=getattr(logging, level)))
    return records


def _one_rank_off_the_path(rank, world, pattern):
    """Stage 3, one training step on both ranks, then rank 0 alone evaluates (its first no-grad call: a
    compile; or a later one, after one evaluation on both ranks) or saves a checkpoint (a decision made
    on rank 0's own metric); then both train on. The error each rank gets, and how long it took."""
    from zcompile.checkpoint import save

    torch._dynamo.reset()
    model = build_model("gpt")
    compiled = torch.compile(model, backend="zero", options={"stage": 3, "check_timeout_s": 5})
    spec = RunSpec(stage=3)
    optimizer = _optimizer(spec, model.parameters(), zero=True)
    train_steps(spec, compiled, optimizer, [0], rank, world)
    ((tokens, targets),) = micro_batches(spec, 1, rank, world)
    start = time.perf_counter()
    try:
        if pattern == "later evaluation on rank 0":
            with torch.no_grad():
                compiled(tokens, targets)
        if rank == 0:
            if pattern == "save decided on rank 0":
                save(os.path.join(tempfile.gettempdir(), f"zcompile-lone-save-{os.getpid()}"), compiled, timeout_s=5)
            else:
                with torch.no_grad():
                    compiled(tokens, targets)
        train_steps(spec, compiled, optimizer, [1], rank, world)
    except Exception as error:  # noqa: BLE001 - Dynamo wraps the compile-time one
        return _divergence(error), time.perf_counter() - start
    return None, None


@pytest.mark.parametrize(
    "pattern, fix",
    [
        ("first evaluation on rank 0", EVALUATION_FIX),
        ("later evaluation on rank 0", EVALUATION_FIX),
        ("save decided on rank 0", SAVE_DECISION_FIX),
    ],
)
def test_a_divergence_names_the_fix_of_what_the_ranks_were_doing(pattern, fix):
    """The fix offered follows the pattern, on every rank: evaluation on some ranks only (a no-grad call,
    compiled or not yet, while the other rank trains), a checkpoint decided per rank; not the skipped-step
    advice (skip_nonfinite, LayerDrop) these got before."""
    for message, seconds in run_ranks(2, _one_rank_off_the_path, pattern):
        assert message is not None, f"{pattern} went unnoticed"
        assert fix in message and "skip_nonfinite" not in message, message
        assert seconds < 30, seconds


def _peer_fails_while_this_rank_is_in_its_own_barrier(rank, world):
    """Stage 3: rank 0 alone enters ``zcompile.gathered`` (a divergence it reports and raises) while rank
    1 waits in a ``dist.barrier()`` of its own, which fails when rank 0 leaves: what rank 1's process
    logs, and its own error."""
    records = _messages_logged_by("zcompile.agreement.heartbeat", "ERROR")
    torch._dynamo.reset()
    model = build_model("gpt")
    compiled = torch.compile(model, backend="zero", options={"stage": 3, "check_timeout_s": 3})
    spec = RunSpec(stage=3)
    optimizer = _optimizer(spec, model.parameters(), zero=True)
    train_steps(spec, compiled, optimizer, [0], rank, world)
    if rank == 0:
        try:
            with zcompile.gathered(model, timeout_s=3):
                pass
        except RankDivergenceError as error:
            return str(error), records
        return None, records
    try:
        dist.barrier()
        error = None
    except Exception as failed:  # noqa: BLE001 - gloo's, whatever its type
        error = str(failed)
    time.sleep(3)  # a beat or more: the heartbeat has read the note by now
    return error, records


def test_a_rank_failing_in_its_own_collective_learns_why_the_peer_left():
    """Rank 1's ``dist.barrier()`` ends with gloo's text alone when rank 0 leaves; its process logs rank
    0's reason (the abort note, read by the heartbeat) next to it, not only "Connection closed"."""
    (reason, _), (error, logged) = run_ranks(2, _peer_fails_while_this_rank_is_in_its_own_barrier)
    assert reason is not None and "gathered" in reason, reason
    assert error is not None, "rank 1's barrier returned although rank 0 left"
    assert any("rank 0 stopped" in line and reason[:80] in line for line in logged), (logged, reason)


def _rank1_held_up_before_its_forward(rank, world):
    """Stage 3, process group timeout 8 s: after a step on both ranks, rank 1 sleeps 12 s before its next
    forward (a slow data loader). Rank 0's forward is the first call after the agreed step, so it waits
    in the graph's all-gather: what it logs meanwhile, and each rank's error."""
    records = _messages_logged_by("zcompile.agreement.heartbeat", "WARNING")
    torch._dynamo.reset()
    model = build_model("gpt")
    compiled = torch.compile(model, backend="zero", options={"stage": 3})
    spec = RunSpec(stage=3)
    optimizer = _optimizer(spec, model.parameters(), zero=True)
    train_steps(spec, compiled, optimizer, [0], rank, world)
    if rank == 1:
        time.sleep(12)
    start = time.perf_counter()
    try:
        train_steps(spec, compiled, optimizer, [1], rank, world)
    except RankDivergenceError as error:
        return str(error), time.perf_counter() - start, records
    return None, None, records


def test_a_rank_held_up_before_its_compiled_call_is_named_not_waited_for_in_silence():
    """The waiting rank warns within a third of the process group's timeout, naming the rank it waits for
    and that it runs its own code; at the timeout its error says so too, not gloo's "Timed out" alone, and
    the late rank stops quoting it."""
    (error0, seconds0, logged0), (error1, _, _) = run_ranks(
        2, _rank1_held_up_before_its_forward, env={"ZCOMPILE_TEST_PG_TIMEOUT_S": "8"}
    )
    assert any("has waited" in line and "rank 1 is alive, running its own code" in line for line in logged0), logged0
    assert error0 is not None and "rank 1 is alive, running its own code" in error0, error0
    assert seconds0 < 30, seconds0
    assert error1 is not None and "rank 0 reported" in error1 and "slow data loader" in error1, error1


def _rank0_busy_between_steps(rank, world, busy_s):
    """Rank 0 alone spends ``busy_s`` (over the check's timeout) on work of its own between steps: here
    an evaluation through the compiled model (or a checkpoint written by rank 0, an upload). Stage 1: rank 1 waits at the next step's
    agreement (at stages 2-3 it waits in the next graph's collectives, with no timeout of zcompile's)."""
    torch._dynamo.reset()
    model = build_model("gpt")
    compiled = torch.compile(model, backend="zero", options={"stage": 1, "check_timeout_s": 3})
    optimizer = zcompile.optim.SGD(model.parameters(), lr=0.1, check_timeout_s=3)
    spec, losses, waited = RunSpec(stage=1), [], 0.0
    for step in range(3):
        ((tokens, targets),) = micro_batches(spec, step, rank, world)
        loss = compiled(tokens, targets)
        loss.backward()
        start = time.perf_counter()
        optimizer.step()
        waited = max(waited, time.perf_counter() - start)
        optimizer.zero_grad()
        losses.append(loss.item())
        if step == 0 and rank == 0:  # evaluating alone through the compiled model: many short compiled calls
            end = time.perf_counter() + busy_s
            with torch.no_grad():
                while time.perf_counter() < end:
                    compiled(tokens, targets)
    return losses, waited


def test_a_rank_busy_with_its_own_work_past_the_timeout_is_waited_for():
    """Before, rank 1 raised RankDivergenceError after check_timeout_s and the run ended; rank 0's beat
    (zcompile.agreement.heartbeat) says it is alive and blocked in nothing, so rank 1 waits, as DDP would."""
    rank0, rank1 = run_ranks(2, _rank0_busy_between_steps, 8.0)
    assert len(rank0[0]) == len(rank1[0]) == 3
    # rank 1 waited past its 3 s timeout at the step after rank 0's work (about 8 s less its own forward and
    # backward, which take seconds when the other pytest worker's ranks share the two cores)
    assert rank1[1] > 4.5


def _new_weights_on_rank0(rank, world, stage):
    torch._dynamo.reset()
    model = build_model("gpt")
    compiled = torch.compile(model, backend="zero", options={"stage": stage})
    optimizer = zcompile.optim.AdamW(model.parameters(), lr=1e-2)
    spec = RunSpec(stage=stage)

    def batches(step):
        if step == 1 and rank == 0:  # weights loaded on rank 0 only
            weight = next(p for p in model.parameters() if p.dim() == 2)
            weight.data = weight.data * 0.5
        return micro_batches(spec, step, rank, world)

    return _steps_until_divergence(compiled, optimizer, batches)


def _steps_until_divergence(compiled, optimizer, batches, steps: int = 3) -> str | None:
    """Trains ``steps`` steps, step ``i`` over the micro-batches ``batches(i)`` gives; the message of
    the RankDivergenceError that stopped it, or None."""
    try:
        for step in range(steps):
            for tokens, targets in batches(step):
                compiled(tokens, targets).backward()
            optimizer.step()
            optimizer.zero_grad()
    except RankDivergenceError as error:
        return str(error)
    return None


@pytest.mark.parametrize("stage", [1, 2])
def test_weights_given_new_values_on_one_rank_only_fail_on_every_rank(stage):
    """Stages 1 and 2 take `p.data = values` as the new master weight (``follow_replaced_storage``):
    done on one rank only, the ranks would train different weights with no word."""
    for message in run_ranks(2, _new_weights_on_rank0, stage):
        assert message is not None and "`.data =` on some ranks only" in message and "wte.weight" in message


def _different_initial_weights(rank, world):
    """Each rank builds the model from its own seed (a checkpoint loaded on rank 0 only is the same).
    With ``sync_module_states=False`` the first training compile refuses (stages 1 and 3), a frozen
    weight no optimizer holds included; ``zcompile.sync_module_states`` makes them rank 0's; new values
    given on every rank through ``.data =`` (unseeded, so per rank) are compared again. By default the
    first compile takes rank 0's weights: the losses are those of a run built from rank 0's seed."""
    out = {}

    def first_step(stage, sync=False, frozen_only=False, strict=True):
        torch._dynamo.reset()
        torch.manual_seed(rank)
        model = _unseeded_gpt()
        if frozen_only:  # every weight equal but one frozen weight, which the optimizer does not hold
            torch.manual_seed(0)
            model = _unseeded_gpt()
            torch.manual_seed(rank)
            model.wpe.weight.data = torch.randn_like(model.wpe.weight)
            model.wpe.weight.requires_grad_(False)
        if sync:
            zcompile.sync_module_states(model)
        options = {"stage": stage} | ({"sync_module_states": False} if strict else {})
        compiled = torch.compile(model, backend="zero", options=options)
        optimizer = zcompile.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        ((tokens, targets),) = micro_batches(RunSpec(stage=stage), 0, rank, world)
        try:
            compiled(tokens, targets).backward()
            optimizer.step()
        except Exception as error:  # noqa: BLE001 - Dynamo wraps the compile-time one
            return _divergence(error), model, compiled, optimizer
        return None, model, compiled, optimizer

    out[1] = first_step(1)[0]
    out[3] = first_step(3)[0]
    out["frozen"] = first_step(3, frozen_only=True)[0]
    out["frozen stage 1"] = first_step(1, frozen_only=True)[0]
    message, model, _, _ = first_step(3, sync=True)
    torch.manual_seed(0)
    rank0s = _unseeded_gpt()
    with zcompile.gathered(model):  # rank 0's initial weights, updated once on every rank alike
        out["synced"] = (
            message,
            max((a - b).abs().max().item() for a, b in zip(model.parameters(), rank0s.parameters())),
        )
    message, model, compiled, optimizer = first_step(2, sync=True)
    weight = next(p for p in model.parameters() if p.dim() == 2)
    weight.data = torch.randn_like(weight)  # on every rank, from each rank's own generator
    ((tokens, targets),) = micro_batches(RunSpec(stage=2), 1, rank, world)
    compiled(tokens, targets).backward()
    try:
        optimizer.step()
        out["new values"] = None
    except RankDivergenceError as error:
        out["new values"] = str(error)
    # the default: rank 0's weights at the first compile, as DDP's wrap; also when every rank first
    # evaluates under no_grad (nanoGPT's estimate_loss at iteration 0), which at stages 1-2 compiles
    # without the other ranks: the first training compile cuts those shards again from rank 0's
    for stage, evaluate_first in ((3, False), (2, True)):  # stage 1 syncs as stage 2 does: one launch less
        losses = {}
        for seed in (rank, 0):
            torch._dynamo.reset()
            torch.manual_seed(seed)
            model = _unseeded_gpt()
            compiled = torch.compile(model, backend="zero", options={"stage": stage})
            optimizer = zcompile.optim.AdamW(model.parameters(), lr=1e-2)
            losses[seed] = []
            if evaluate_first:
                ((tokens, targets),) = micro_batches(RunSpec(stage=stage), 9, rank, world)
                with torch.no_grad():
                    compiled(tokens, targets)
            for step in range(3):
                ((tokens, targets),) = micro_batches(RunSpec(stage=stage), step, rank, world)
                loss = compiled(tokens, targets)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                losses[seed].append(loss.item())
        out[f"synced at compile {stage}{' after an evaluation' if evaluate_first else ''}"] = (losses[rank], losses[0])
    # sync_module_states with another model on one rank, then called on rank 0 alone: errors, not a
    # broadcast that pairs other sizes or waits for the process group's timeout
    torch.manual_seed(0)
    other = _unseeded_gpt() if rank == 0 else torch.nn.Linear(3, 3)
    try:
        zcompile.sync_module_states(other)
        out["other model"] = None
    except RankDivergenceError as error:
        out["other model"] = str(error)
    start = time.perf_counter()
    if rank == 0:
        try:
            zcompile.sync_module_states(_unseeded_gpt(), timeout_s=5)
            out["alone"] = None
        except RankDivergenceError as error:
            out["alone"] = str(error), time.perf_counter() - start
    return out


def _divergence(error: BaseException) -> str:
    """The ``RankDivergenceError`` in ``error``'s chain (Dynamo wraps compile errors), else ``error``."""
    while error is not None and not isinstance(error, RankDivergenceError):
        error = error.__cause__ or error.__context__
    return str(error)


def _unseeded_gpt():
    """``build_model("gpt")`` without its seed: the caller's generator state decides the weights."""
    from gpt import GPT, GPTConfig

    from support.models import VOCAB

    return GPT(GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=2, n_embd=32))


def test_ranks_that_start_from_different_weights_fail_before_any_update():
    """Each rank's shard is cut from its own copy of a parameter: ranks that built (or loaded) the
    model differently trained a mix of their weights with no word (an MLP seeded by rank: 0.49 off
    DDP's weights at stages 1 and 3). DDP broadcasts rank 0's; here digests are compared
    (``zcompile.agreement.initial_values``: at the first training compile, else at the first step) and
    ``sync_module_states`` takes rank 0's; called with different models, or on one rank alone, it
    is an error, not a mismatched or endless broadcast. By default (option ``sync_module_states``) the
    first compile takes rank 0's, so ranks seeded apart train exactly like ranks seeded alike."""
    rank0, rank1 = run_ranks(2, _different_initial_weights)
    for out in (rank0, rank1):
        for case, name in (
            (1, "wte.weight"),
            (3, "wte.weight"),
            ("frozen", "wpe.weight"),
            ("frozen stage 1", "wpe.weight"),
        ):
            assert out[case] is not None, f"{case}: different initial weights went unnoticed"
            assert "started from different weights" in out[case] and name in out[case], out[case]
            assert "sync_module_states" in out[case]
        assert "1 parameter was" in out["frozen"]
        message, distance = out["synced"]
        assert message is None
        assert 0 < distance < 0.05  # rank 0's weights, one AdamW step (lr 1e-2) away
        assert out["new values"] is not None and "started from different weights" in out["new values"]
        assert out["other model"] is not None and "the ranks hold different tensors" in out["other model"]
        for case in [key for key in out if str(key).startswith("synced at compile")]:
            seeded_apart, seeded_alike = out[case]
            assert seeded_apart == seeded_alike, (case, seeded_apart, seeded_alike)
    message, seconds = rank0["alone"]
    assert "ranks [1] did not" in message and seconds < 15


def _uncompiled_model_seeded_by_rank(rank, world):
    """An uncompiled model (the script's ``--compile=False``) with ``zcompile.optim.AdamW``, each rank seeded
    apart: the weights after two steps, gathered across ranks, and the warnings; then seeded alike."""
    records = _messages_logged_by("zcompile.optim.sharded", "WARNING")
    out = {}
    for seeded, seed in (("apart", rank), ("alike", 0)):
        records.clear()
        torch.manual_seed(seed)
        model = _unseeded_gpt()
        optimizer = zcompile.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(2):
            ((tokens, targets),) = micro_batches(RunSpec(stage=1), step, rank, world)
            model(tokens, targets).backward()
            optimizer.step()
            optimizer.zero_grad()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        everyone = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(everyone, flat)
        out[seeded] = (all(torch.equal(everyone[0], other) for other in everyone), list(records))
    # learning rate 0: the first step moves nothing, so the weights are what it started from: rank 0's
    torch.manual_seed(rank)
    model = _unseeded_gpt()
    rank0s = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    dist.broadcast(rank0s, 0)
    optimizer = zcompile.optim.AdamW(model.parameters(), lr=0.0)
    ((tokens, targets),) = micro_batches(RunSpec(stage=1), 0, rank, world)
    model(tokens, targets).backward()
    optimizer.step()
    out["rank 0's after a step at lr 0"] = torch.equal(
        torch.cat([p.detach().reshape(-1) for p in model.parameters()]), rank0s
    )
    return out


def test_an_uncompiled_model_seeded_by_rank_is_not_trained_as_a_mix():
    """Its parameters are sharded at the optimizer's first step: cut from each rank's own values they
    trained a mix, with a warning that said training stays exact. Now they take rank 0's values first (the
    ranks end equal) and a warning says the first step's gradients were each rank's own; seeded alike,
    no broadcast and no warning."""
    for out in run_ranks(2, _uncompiled_model_seeded_by_rank):
        equal, warned = out["apart"]
        assert equal and any("held different values on different ranks" in line for line in warned), warned
        equal, warned = out["alike"]
        assert equal and not any("held different values" in line for line in warned), warned
        assert out["rank 0's after a step at lr 0"]  # not a mix of the ranks' weights


def _plateau_on_each_rank_metric(rank, world):
    """``ReduceLROnPlateau`` fed each rank's own loss: the learning rates part after a few steps."""
    torch._dynamo.reset()
    model = build_model("gpt")
    compiled = torch.compile(model, backend="zero", options={"stage": 2})
    optimizer = zcompile.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, factor=0.5)
    spec = RunSpec(stage=2)
    try:
        for step in range(6):
            ((tokens, targets),) = micro_batches(spec, step, rank, world)
            loss = compiled(tokens, targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step(loss.item() + (rank == 0) * step)  # rank 0's metric only ever grows
    except RankDivergenceError as error:
        return str(error), step
    return None, None


def test_learning_rates_that_differ_by_rank_fail_at_the_next_step():
    """Each rank updates its own shard: a learning rate that differs by rank (a metric-driven
    scheduler fed each rank's metric) trained each slice of the weights at its own rate, silently
    (DDP's replicas would drift apart just as silently). The step's agreement compares the param
    groups' settings."""
    for message, step in run_ranks(2, _plateau_on_each_rank_metric):
        assert message is not None, "learning rates that differ by rank went unnoticed"
        assert "different hyper-parameters" in message and "param group 0 'lr'" in message
        assert "ReduceLROnPlateau" in message
        assert step == 2  # rank 0 halved its rate after step 1 (patience 0): the next step refuses


class _RankBranch(torch.nn.Module):
    """One layer used on every rank and one chosen by the rank: the same number of compiled calls
    with gradients everywhere, gradients on different parameters."""

    def __init__(self, rank):
        super().__init__()
        self.shared, self.left, self.right = (torch.nn.Linear(16, 16) for _ in range(3))
        self.rank = rank

    def forward(self, x):
        return (self.shared(x) + (self.left if self.rank == 0 else self.right)(x)).pow(2).mean()


def _gradients_on_different_parameters(rank, world):
    torch.manual_seed(0)
    model = _RankBranch(rank)
    compiled = torch.compile(model, backend="zero", options={"stage": 1})
    optimizer = zcompile.optim.AdamW(model.parameters(), lr=0.01, check_timeout_s=20)
    compiled(torch.randn(4, 16)).backward()
    start = time.perf_counter()
    try:  # reading the averaged gradients would reduce one parameter's with another's
        with zcompile.gathered(model, grads=True, timeout_s=20):
            gathered_error = None
    except RankDivergenceError as error:
        gathered_error = str(error), time.perf_counter() - start
    start = time.perf_counter()
    try:
        optimizer.step()
    except RankDivergenceError as error:
        return str(error), time.perf_counter() - start, gathered_error
    return None, None, gathered_error


def test_gradients_on_different_parameters_per_rank_fail_fast_on_every_rank():
    """The step's buckets are planned from the parameters with gradients: ranks that differ there
    (same call counts) would average one parameter's gradient with another's. Before this check
    the run trained on, its replicated weights different on each rank. ``gathered(grads=True)``
    reduces the same gradients and checks the same way."""
    for rank, (message, seconds, gathered_error) in enumerate(run_ranks(2, _gradients_on_different_parameters)):
        assert gathered_error is not None, "gathered(grads=True) with gradients on different parameters went unnoticed"
        assert "which parameters have gradients" in gathered_error[0] and gathered_error[1] < 10, gathered_error
        assert message is not None, "gradients on different parameters went unnoticed"
        assert "gradients on different parameters" in message and "p.grad = torch.zeros_like(p)" in message
        assert ("left.weight" if rank == 0 else "right.weight") in message  # this rank's are named
        assert seconds < 10, seconds


def _gpt_skipping_layers(model, tokens, targets, keep):
    """The example GPT's forward with ``keep[i]`` deciding whether layer i runs (LayerDrop)."""
    x = model.wte(tokens) + model.wpe(torch.arange(tokens.shape[1]))
    for block, kept in zip(model.blocks, keep):
        if kept:
            x = block(x)
    logits = model.head(model.ln_f(x))
    return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def _layers_skipped_per_rank(rank, world, stage, keep_per_rank):
    """Blocks compiled one by one; step 0 runs every layer, step 1 the layers ``keep_per_rank[rank]``."""
    torch._dynamo.reset()
    model = build_model("gpt")
    for block in model.blocks:
        block.compile(backend="zero", options={"stage": stage, "check_timeout_s": 20, "compiler": "eager"})
    optimizer = zcompile.optim.SGD(model.parameters(), lr=0.1, check_timeout_s=20)
    tokens, targets = global_batch(0, 2)
    for keep in ([True, True], keep_per_rank[rank]):
        start = time.perf_counter()
        try:
            _gpt_skipping_layers(model, tokens, targets, keep).backward()
            optimizer.step()
        except RankDivergenceError as error:
            return str(error), time.perf_counter() - start
        optimizer.zero_grad()
    return None, None


@pytest.mark.parametrize("stage", [1, 3])
def test_layers_skipped_on_some_ranks_only_fail_at_the_step_on_every_rank(stage):
    """LayerDrop drawn from each rank's own random numbers, with the blocks compiled one by one: one
    graph for every layer, so rank 0 running layer 0 and rank 1 layer 1 made the same calls with
    the same collectives, which paired one layer's weights and gradients with the other's. The
    step's agreement compared call counts and the names of the parameters with gradients, and a
    block's weights are named from the block (``attn.qkv.weight`` in every layer): the step passed
    and trained a mix (measured, 2 ranks, stages 1-3). It now compares positions among the
    optimizer's parameters, and at stages 2-3 the calls each saw, and stops every rank before the update."""
    outcomes = run_ranks(2, _layers_skipped_per_rank, stage, [[True, False], [False, True]])
    for message, seconds in outcomes:
        assert message is not None, "layers skipped per rank went unnoticed"
        assert seconds < 10, seconds
    if stage == 1:  # no collective in the graphs: the step's reduction pairs gradients, which zeros can even out
        assert "gradients on different parameters" in outcomes[0][0], outcomes[0][0]
        assert "#2 ln_1.weight" in outcomes[0][0] and "#14 ln_1.weight" in outcomes[1][0], outcomes
    else:
        assert "ran different parts of the model" in outcomes[0][0] and "LayerDrop" in outcomes[0][0], outcomes[0][0]
        assert "#2-#13 x1" in outcomes[0][0] and "#14-#25 x1" in outcomes[0][0], outcomes[0][0]


def test_a_layer_skipped_on_one_rank_at_stage3_is_an_error_not_a_gloo_abort():
    """Rank 0 runs both layers, rank 1 only the first. The second layer's call was its graph's first
    since the step, which took no agreement (only the first call after a step is where every rank
    goes next): its gathers met rank 1's backward, and gloo aborted the process ("Received data
    size doesn't match expected size", SIGABRT). Every call after the step's first now agrees (the
    agreement is the compiled call's wrapper's, whichever inner compiler made the layers)."""
    for message, seconds in run_ranks(2, _layers_skipped_per_rank, 3, [[True, True], [True, False]]):
        assert message is not None and "same modules" in message, message
        assert seconds < 30, seconds


def _reduce_scatter_form_per_rank(rank, world):
    """Rank 0 runs gloo's own reduce-scatter, rank 1 the all-to-all (the option differs per rank)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 1))
    options = {"stage": 2, "check_timeout_s": 20, "reduce_scatter": "native" if rank == 0 else "all_to_all"}
    compiled = torch.compile(model, backend="zero", options=options)
    start = time.perf_counter()
    try:
        compiled(torch.randn(4, 16)).sum().backward()
    except RankDivergenceError as error:
        return str(error), time.perf_counter() - start
    return None, None


def test_reduce_scatter_option_differing_per_rank_fails_fast_on_every_rank():
    """A reduce-scatter on one rank and an all-to-all on the other would pair two different
    collectives: the compile-time check of the backward's collectives stops both ranks instead."""
    for message, seconds in run_ranks(2, _reduce_scatter_form_per_rank):
        assert message is not None, "a reduce_scatter option differing per rank went unnoticed"
        assert "backward" in message and "run as all_to_all (option reduce_scatter)" in message, message
        assert seconds < 30, seconds


def _gathered_in_buckets_equals_the_weights_before_sharding(rank):
    """``gathered`` gathers a bucket of weights at a time (``full_params._materialize``): with buckets
    of a few hundred bytes, weights of odd sizes (padded shards), a bf16 one, and a stage-2 model's
    fp32 masters beside bf16 replicas, the weights it gives, on every rank and on rank 0 alone, are
    the values they had before the compile sharded them; and so is what ``full_state_dict`` exports."""
    import zcompile.eager.gathered as full_params

    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3), torch.nn.Linear(3, 9))
    model[2].to(torch.bfloat16)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}

    def forward(x):
        return model[3](model[2](model[1](model[0](x)).to(torch.bfloat16)).float())

    torch.compile(forward, backend="zero", options={"stage": 3})(torch.randn(2, 7))
    assert all(p.untyped_storage().size() == 0 for p in model.parameters())  # sharded and freed
    # and stage 2 with param_dtype: the fp32 weights exist only as master shards beside bf16 replicas
    torch.manual_seed(4)
    replicated = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    before_replicated = {name: p.detach().clone() for name, p in replicated.named_parameters()}
    torch.compile(replicated, backend="zero", options={"stage": 2, "param_dtype": "bf16"})(torch.randn(2, 7))
    full_params.GATHER_BUCKET_BYTES = 96  # several buckets, of one and of several weights
    for rank0_only in (False, True):
        for gathered_model, values in ((model, before), (replicated, before_replicated)):
            with zcompile.gathered(gathered_model, rank0_only=rank0_only):
                if rank == 0 or not rank0_only:
                    for name, p in gathered_model.named_parameters():
                        torch.testing.assert_close(p.detach(), values[name], rtol=0, atol=0, msg=name)
    # the export gathers the same buckets (the masters, to rank 1's CPU memory this time)
    from zcompile.checkpoint.dcp import full_state_dict

    for exported_model, values in ((model, before), (replicated, before_replicated)):
        exported = full_state_dict(exported_model, rank=1)
        assert (exported is None) == (rank != 1)
        for name, value in (exported or {}).items():
            torch.testing.assert_close(value.to(values[name].dtype), values[name], rtol=0, atol=0, msg=name)
    full_params.GATHER_BUCKET_BYTES = 4 * 2**20


def _gathered_on_rank0_only(rank, world):
    torch._dynamo.reset()
    model = build_model("gpt")
    compiled = torch.compile(model, backend="zero", options={"stage": 3})
    tokens, targets = global_batch(0, 2)
    compiled(tokens, targets).backward()
    with zcompile.gathered(model, rank0_only=True):  # every rank enters; only rank 0 holds the weights
        on_rank0 = {name: p.detach().clone() for name, p in model.named_parameters()} if rank == 0 else None
        assert rank == 0 or all(p.untyped_storage().size() == 0 for p in model.parameters())
    with zcompile.gathered(model):
        everywhere = {name: p.detach().clone() for name, p in model.named_parameters()}
    if rank == 0:
        assert on_rank0.keys() == everywhere.keys()
        for name, value in everywhere.items():
            torch.testing.assert_close(on_rank0[name], value, rtol=0, atol=0, msg=name)
    _gathered_in_buckets_equals_the_weights_before_sharding(rank)
    message = seconds = None
    if rank == 0:
        start = time.perf_counter()
        try:
            with zcompile.gathered(model, timeout_s=60):
                pass
        except RankDivergenceError as error:
            message, seconds = str(error), time.perf_counter() - start
    dist.barrier()  # rank 1 went on without entering; rank 0's error must come before this
    return message, seconds


def test_gathered_on_one_rank_fails_fast_and_rank0_only_gathers():
    (message, seconds), _ = run_ranks(2, _gathered_on_rank0_only)
    # rank 1's beat says it waits in a barrier of every rank: it waits for rank 0, and rank 0 for it
    assert message is not None and "rank0_only=True" in message, message
    assert "ranks [1] wait elsewhere (rank 1 waits in torch.distributed's barrier (called at " in message, message
    assert "over ranks [0, 1]" in message and "each waits for the other" in message, message
    assert seconds < 15, seconds  # not the 60 s timeout


def _uneven_epoch(rank, world, outcome_path):
    """Rank 0 has one batch fewer and waits in the ``dist.barrier()`` after its loop; rank 1's extra
    step waits in its backward's reduce-scatters for rank 0."""
    torch._dynamo.reset()
    model = build_model("gpt")
    compiled = torch.compile(model, backend="zero", options={"stage": 2})
    optimizer = zcompile.optim.SGD(model.parameters(), lr=0.1)
    start = time.perf_counter()
    try:
        for step in range(2 if rank == 0 else 3):
            start = time.perf_counter()  # rank 0's barrier, rank 1's extra step, begin after this
            tokens, targets = global_batch(step, 2)
            compiled(tokens[rank::2], targets[rank::2]).backward()
            optimizer.step()
            optimizer.zero_grad()
        dist.barrier()
    except RankDivergenceError as error:
        with open(f"{outcome_path}.{rank}", "w") as handle:
            json.dump({"message": str(error), "seconds": time.perf_counter() - start}, handle)
        raise


def test_a_rank_in_a_barrier_while_another_trains_on_ends_in_seconds_not_at_the_timeout(tmp_path):
    """Before, both waited for the process group's timeout (gloo's default 30 min; 120 s here). Rank 0's
    heartbeat sees rank 1 in a collective that needs rank 0 while rank 0 is in its own: rank 0 ends its
    process (exit code 1) leaving a note, and rank 1's backward raises quoting it."""
    outcome = tmp_path / "outcome"
    with pytest.raises(RuntimeError, match=r"rank 0: no result \(exit code 1\)"):
        run_ranks(2, _uneven_epoch, str(outcome), timeout_s=100)
    with open(f"{outcome}.1") as handle:
        rank1 = json.load(handle)
    assert rank1["message"].startswith("zcompile: rank 1 stopped because rank 0 reported: zcompile: rank 0 has waited")
    assert "in torch.distributed's barrier (called at test_never_silent.py:" in rank1["message"]
    assert (
        "and rank 1 in a compiled backward, in " in rank1["message"]
        and "the same number of batches" in rank1["message"]
    )
    assert rank1["seconds"] < 30, rank1


def test_generate_needs_gathered_and_matches_plain_torch():
    """``generate()`` of a Hugging Face model trained at stage 3: an error naming ``gathered`` without
    it; inside it, the same tokens as the plain model holding the same weights."""
    pytest.importorskip("transformers")
    torch._dynamo.reset()
    model = build_model("hf_gpt2")
    compiled = torch.compile(model, backend="zero", options={"stage": 3})
    optimizer = zcompile.optim.SGD(model.parameters(), lr=0.1)
    tokens, _ = global_batch(0, 2)
    compiled(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    prompt = tokens[:1, :4]
    settings = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    with pytest.raises(ShardedParameterError, match="zcompile.gathered"):
        model.generate(prompt, **settings)
    with zcompile.gathered(model):
        ours = model.generate(prompt, **settings)
        plain = build_model("hf_gpt2")
        plain.load_state_dict(model.state_dict())
    torch.testing.assert_close(ours, plain.generate(prompt, **settings), rtol=0, atol=0)
    assert ours.shape == (1, 9)


@pytest.mark.parametrize("named", [True, False])
def test_a_weight_trained_outside_the_graphs_is_named_in_the_warning(named, caplog):
    """Blocks compiled one by one (the FSDP2 habit) leave the embeddings and the final norm eager:
    they train with stage-1 semantics and one warning says so at the first step, counting them and
    naming the first ones (by name with ``named_parameters()``, else by place in the param groups),
    not a line per parameter (56 lines for an uncompiled T5 decoder on 2 ranks) nor one at every step."""
    torch._dynamo.reset()
    model = build_model("gpt")
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block, backend="zero", options={"stage": 2})
    params = model.named_parameters() if named else model.parameters()
    optimizer = zcompile.optim.SGD(params, lr=0.1)
    with caplog.at_level("WARNING", logger="zcompile.sharding.shards"):
        for step in range(2):
            model(*global_batch(step, 2)).backward()
            optimizer.step()
            optimizer.zero_grad()
    warned = [r.getMessage() for r in caplog.records if "outside the compiled graphs" in r.getMessage()]
    eager = [(n, p) for n, p in model.named_parameters() if not n.startswith("blocks.")]
    assert len(eager) > 3 and len(warned) == 1, warned  # once (the shards are kept), for all of them
    assert f"{len(eager)} parameters got a gradient" in warned[0] and f"and {len(eager) - 3} more" in warned[0]
    first = (
        [f"'{n}' of shape {tuple(p.shape)}" for n, p in eager[:3]]
        if named
        else [
            f"param_groups[0]['params'][{i}] "
            for i, (n, p) in enumerate(model.named_parameters())
            if not n.startswith("blocks.")
        ][:3]
    )
    assert all(f in warned[0] for f in first), (first, warned)


def test_an_eager_weights_shard_has_the_same_name_whether_the_optimizer_has_names_or_not():
    """The step's agreement compares a digest of the names of the parameters with gradients, so a
    shard named from ``named_parameters()`` on one rank and by its place on another read as "the
    ranks have gradients on different parameters" (seen with 2 ranks, one of each). The shard is
    named by its place on every rank; the name only goes to the log."""
    names = []
    for named in (True, False):
        torch._dynamo.reset()
        model = build_model("gpt")
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block, backend="zero", options={"stage": 2})
        optimizer = zcompile.optim.SGD(model.named_parameters() if named else model.parameters(), lr=0.1)
        model(*global_batch(0, 2)).backward()
        optimizer.step()
        names.append([shard_of(p).name for n, p in model.named_parameters() if not n.startswith("blocks.")])
    assert names[0] == names[1] and all(n.startswith("param_groups[0]['params'][") for n in names[0]), names


class _Narrow(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x):
        return torch.relu(self.fc(x))


class _Wide(torch.nn.Module):
    """A block of another size than ``_Narrow``: its reduce-scatters move other bytes."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 48), torch.nn.Linear(48, 16)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _two_kinds_of_layers_run_per_rank(rank, world):
    """Narrow and wide blocks, each compiled on its own at stage 2: every block at step 0, then rank 0
    runs narrow, narrow, wide and rank 1 narrow, wide, wide (LayerDrop drawn per rank over an encoder
    and a decoder, as transformers' BART has)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    narrow, wide = [_Narrow() for _ in range(2)], [_Wide() for _ in range(2)]
    for block in narrow + wide:
        block.compile(backend="zero", options={"stage": 2, "check_timeout_s": 20})
    optimizer = zcompile.optim.SGD([p for b in narrow + wide for p in b.parameters()], lr=0.1, check_timeout_s=20)
    x = torch.randn(4, 16)
    for run in ([*narrow, *wide], [narrow[0], narrow[1], wide[0]] if rank == 0 else [narrow[0], wide[0], wide[1]]):
        start = time.perf_counter()
        try:
            y = x
            for block in run:
                y = block(y)
            y.pow(2).mean().backward()
            optimizer.step()
        except RankDivergenceError as error:
            return str(error), time.perf_counter() - start
        optimizer.zero_grad()
    return None, None


def test_layers_of_two_sizes_run_per_rank_at_stage2_are_an_error_not_a_gloo_abort():
    """Rank 0's backward reduce-scattered wide, narrow, narrow where rank 1's did wide, wide, narrow: a
    narrow layer's reduce-scatter met a wide one's and gloo aborted the process ("Received data size
    doesn't match expected size", SIGABRT, 3 runs of 3; transformers' BART with per-rank LayerDrop at
    stage 2). A stage-2 training call now agrees as stage 3's does, and the ranks meet different calls."""
    for message, seconds in run_ranks(2, _two_kinds_of_layers_run_per_rank):
        assert message is not None and "different points of training" in message, message
        assert seconds < 30, seconds


def _one_of_two_models_skipped_on_rank1(rank, world):
    """Two models of one shape at stage 3, each with its optimizer, trained in turn (A, then B) every
    step; at step 2 rank 1 skips A (its forward, backward and step), as a loop that trains a model
    only when its own batch came would on a rank whose loader ran dry."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)) for _ in range(2)]
    options = {"stage": 3, "check_timeout_s": 20}
    compiled = [torch.compile(model, backend="zero", options=options) for model in models]
    optimizers = [zcompile.optim.SGD(model.parameters(), lr=0.1, check_timeout_s=20) for model in models]
    x = torch.randn(4, 8)
    start = time.perf_counter()
    try:
        for step in range(4):
            for which in (0, 1):
                if step == 2 and which == 0 and rank == 1:
                    continue
                start = time.perf_counter()
                compiled[which](x).pow(2).mean().backward()
                optimizers[which].step()
                optimizers[which].zero_grad()
    except RankDivergenceError as error:
        return str(error), time.perf_counter() - start
    return None, None


def test_a_model_skipped_on_one_rank_among_two_stepped_in_turn_is_an_error_not_a_silent_mix():
    """Each model's first call after its own step took no agreement, though only the call after the
    latest agreement is where every rank goes next: at step 2 rank 0's call of A and rank 1's of B
    were both free, their collectives paired, and the run ended in gloo's "Connection closed by peer"
    with no word of why. Only the latest agreement's first call is free now: rank 0's call of A
    agrees, and the ranks stop at it, naming what each waits in."""
    for message, seconds in run_ranks(2, _one_of_two_models_skipped_on_rank1):
        assert message is not None, "a model skipped on one rank trained on silently"
        assert seconds < 30, seconds


def _micro_batch_skipped_on_rank1(rank, world):
    """Stage 3, 2 micro-batches a step; at step 1 rank 1 skips its second (a loader that ran dry on
    one rank): its optimizer.step() meets rank 0's second forward."""
    torch._dynamo.reset()
    model = build_model("gpt")
    compiled = torch.compile(model, backend="zero", options={"stage": 3, "check_timeout_s": 20})
    optimizer = zcompile.optim.SGD(model.parameters(), lr=0.1, check_timeout_s=20)

    def batches(step):
        both = micro_batches(RunSpec(grad_accum=2), step, rank, world)
        return both[:1] if step == 1 and rank == 1 else both

    return _steps_until_divergence(compiled, optimizer, batches)


def test_a_micro_batch_skipped_on_one_rank_is_an_error_on_every_rank():
    """Rank 0's forward agreed on its call where rank 1 agreed on its step: rank 0 read rank 1's step
    fields as a call's and stopped with "ValueError: too many values to unpack". Each rank now names
    what every rank was doing."""
    for message in run_ranks(2, _micro_batch_skipped_on_rank1):
        assert message is not None, "a micro-batch skipped on one rank went unnoticed"
        assert "optimizer.step()" in message and "call of a compiled training graph" in message, message


def _estimate_on_rank0_after_a_step(rank, world):
    """Stage 3; after step 0 rank 0 alone asks estimate_memory for saved activations (logging it)."""
    torch._dynamo.reset()
    model = build_model("gpt")
    compiled = torch.compile(model, backend="zero", options={"stage": 3, "check_timeout_s": 20})
    optimizer = zcompile.optim.SGD(model.parameters(), lr=0.1, check_timeout_s=20)
    spec = RunSpec(stage=3)

    def batches(step):
        if step == 1 and rank == 0:
            zcompile.estimate_memory(model, world, {"stage": 3}, batch=micro_batches(spec, 0, rank, world)[0])
        return micro_batches(spec, step, rank, world)

    try:
        return _steps_until_divergence(compiled, optimizer, batches)
    except ValueError as error:
        return f"ValueError: {error}"


def test_saved_activations_estimated_on_one_rank_mid_training_is_an_error_on_every_rank():
    """The estimate of saved activations resets Dynamo; rank 0 alone then compiled its graphs again and
    both ranks stopped in a RankDivergenceError blaming "different compile paths" (measured with a
    transformers GPT-2, blocks compiled apart under inductor). Rank 0 now raises a ValueError naming
    estimate_memory before anything is reset, and rank 1, in a collective with it, quotes it."""
    rank0, rank1 = run_ranks(2, _estimate_on_rank0_after_a_step)
    assert rank0.startswith("ValueError") and "Call it before the first step" in rank0, rank0
    assert "rank 0 reported: zcompile.estimate_memory(batch=...)" in rank1, rank1


def _tensor_parallel_on_rank0_only(rank, world):
    """Rank 0 alone applies tensor parallelism to the model (its local pieces, no scatter) before both
    compile it: the error and how long it took, per rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    if rank == 0:
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()}, src_data_rank=None)
    compiled = torch.compile(model, backend="zero", options={"stage": 3, "check_timeout_s": 10})
    start = time.perf_counter()
    try:
        compiled(torch.randn(4, 8)).sum().backward()
    except Exception as error:  # noqa: BLE001 - Dynamo wraps the backend's
        return str(error), time.perf_counter() - start
    return None, time.perf_counter() - start


def test_tensor_parallelism_on_one_rank_only_is_an_error_on_every_rank():
    """A model made tensor-parallel on some ranks only (DTensor parameters there, plain ones elsewhere)
    is refused on every rank within seconds, each naming the DTensor parameters: the rank that has them
    at once, the others through its abort note, not at the check's timeout."""
    for rank, (error, seconds) in enumerate(run_ranks(2, _tensor_parallel_on_rank0_only)):
        assert error is not None and "are DTensors (tensor parallelism" in error, (rank, error)
        assert seconds < 8, (rank, seconds)
