"""``zcompile.tune`` for real on 2 gloo ranks: a tiny GPT, a 4-point grid. Every trial trains like a
fresh single-process run of its options (no state leaks between trials), the ranks agree on every
predicted and measured number and on the best, and the saved JSON reads back to the same result."""

import difflib
import os

import pytest
import torch

import zcompile
from support.launch import run_ranks
from support.models import build_model, global_batch
from zcompile.sharding.memory import zero_formula_bytes
from zcompile.tune.result import TuneResult
from zcompile.tune.tuner import tune

# 0.001 MiB: one collective per parameter, so prefetch 1 and 2 differ; 4 MiB: one bucket holds the model, so
# prefetch 2 compiles to the default's graphs (measured once)
SPACE = {"bucket_mb": [0.001, 4.0], "prefetch": [1, 2]}
BATCH, STEPS, WARMUP = 8, 2, 1
LR = 0.1
# SGD: a difference in summation order (the batch mean split over 2 ranks, about 1e-7 relative) reaches
# the weights linearly; over the 4 steps a trial runs, 1e-5 relative on the loss bounds it with room.
# A trial that inherited the last trial's weights or optimizer state is off by ~1e-2 at step 0.
LOSS_RTOL = 1e-5


def _make_model():
    return build_model("gpt")


def _loss(model, batch):
    tokens, targets = batch
    return model(tokens, targets)


def _sgd(params):
    return zcompile.optim.SGD(params, lr=LR)


def _tune_on_rank(rank, world, out_dir):
    torch._dynamo.config.cache_size_limit = 64
    half = BATCH // world
    batches = [tuple(t[rank * half : (rank + 1) * half] for t in global_batch(step, BATCH)) for step in range(2)]
    # each prediction's graph code, in trial order: what tells why two digests differ when they should not
    # (seen once in CI: the default's digest differed from its twin's, not reproduced in 25 runs since)
    codes = []
    digest = zcompile.tune.trial.graphs_digest

    def recording_digest(graphs):
        codes.append(
            [
                (g.forward.code if g.forward is not None else "", g.backward.code if g.backward is not None else "")
                for g in graphs
            ]
        )
        return digest(graphs)

    zcompile.tune.trial.graphs_digest = recording_digest
    try:
        result = tune(
            _make_model,
            _loss,
            batches,
            space=SPACE,
            optimizer=_sgd,
            steps=STEPS,
            warmup=WARMUP,
            strategy="grid",
            out_dir=out_dir,
        )
    finally:
        zcompile.tune.trial.graphs_digest = digest
    return {**result.to_dict(), "codes": codes}


def _code_difference(codes, first, second):
    """Where trial ``first``'s graphs differ from ``second``'s, on each rank: a diff to read in the failure."""
    notes = []
    for rank, predicted in enumerate(codes):
        a, b = predicted[first], predicted[second]
        notes.append(f"rank {rank}: {len(a)} against {len(b)} graphs")
        for index, (graph_a, graph_b) in enumerate(zip(a, b)):
            for kind, code_a, code_b in zip(("forward", "backward"), graph_a, graph_b):
                diff = list(difflib.unified_diff(code_a.splitlines(), code_b.splitlines(), lineterm="", n=1))
                if diff:
                    notes.append(f"graph {index} {kind}:\n" + "\n".join(diff[:80]))
    return "\n".join(notes)


def _reference_losses(options):
    """A fresh single-process run (world of one) of ``options`` on the global batches."""
    torch._dynamo.reset()
    model = _make_model()
    optimizer = _sgd(model.parameters())
    compiled = torch.compile(model, backend="zero", options=options)
    losses = []
    for step in range(WARMUP + STEPS + 1):  # the warm-up, timed and profiled steps of a trial
        loss = _loss(compiled, global_batch(step % 2, BATCH))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    torch._dynamo.reset()
    return losses


def _agreed_part(data):
    """What every rank must hold identically: all but wall times and each rank's own losses."""
    trials = [
        {**t, "measured": t["measured"] and {k: v for k, v in t["measured"].items() if k != "losses"}}
        for t in data["trials"]
    ]
    return {**{k: v for k, v in data.items() if k not in ("wall_s", "timings")}, "trials": trials}


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("tune"))
    ranks = run_ranks(2, _tune_on_rank, out_dir, timeout_s=400)
    codes = [data.pop("codes") for data in ranks]
    return ranks, out_dir, codes


def test_ranks_agree_and_the_json_reads_back(tuned):
    (rank0, rank1), out_dir, _ = tuned
    assert _agreed_part(rank0) == _agreed_part(rank1)
    assert [t["status"] for t in rank0["trials"]] == ["measured", "measured", "measured", "same"], _code_difference(
        tuned[2], 2, 3
    )
    assert rank0["trials"][3]["error"] == "same compiled graphs as #2"
    assert rank0["best_index"] is not None and rank0["best_index"] == rank1["best_index"]
    loaded = TuneResult.from_json(os.path.join(out_dir, "tune.json"))
    assert loaded.to_dict() == rank0  # written by rank 0
    assert open(os.path.join(out_dir, "tune.png"), "rb").read(4) == b"\x89PNG"
    assert loaded.best == loaded.trials[rank0["best_index"]].options  # no base options: the point's own
    assert loaded.default.options == {"bucket_mb": 4.0, "prefetch": 1}


def test_predictions_follow_the_compiled_graphs(tuned):
    (rank0, _), _, _ = tuned
    num_params = sum(p.numel() for p in dict.fromkeys(_make_model().parameters()))
    for trial in rank0["trials"]:
        predicted, measured = trial["predicted"], trial["measured"]
        # ZeRO's formula (16 psi / N at stage 3, fp32 AdamW), independent of the tuner
        assert predicted["memory_parts"]["model_states"] == zero_formula_bytes(num_params, 2, 3)
        assert predicted["memory_bytes"] == sum(predicted["memory_parts"].values())
        assert predicted["step_s"] > 0
        assert measured is None or (measured["step_s"] > 0 and measured["memory_bytes"] > 0)
    digests = [t["predicted"]["graphs_digest"] for t in rank0["trials"]]
    assert digests[2] == digests[3] and len(set(digests)) == 3, _code_difference(tuned[2], 2, 3)
    by_bucket = {}
    for trial in rank0["trials"]:
        by_bucket.setdefault(trial["options"]["bucket_mb"], []).append(trial["predicted"])
    # one collective per parameter pays each collective's latency: predicted slower than one bucket
    assert min(p["step_s"] for p in by_bucket[0.001]) > max(p["step_s"] for p in by_bucket[4.0])


def test_every_trial_trains_like_a_fresh_single_process_run(tuned):
    (rank0, rank1), _, _ = tuned
    measured = [(t0, t1) for t0, t1 in zip(rank0["trials"], rank1["trials"]) if t0["status"] == "measured"]
    assert len(measured) == 3
    for trial0, trial1 in measured:
        options = TuneResult.from_dict(rank0).options_of(TuneResult.from_dict(rank0).trials[trial0["index"]])
        reference = _reference_losses(options)
        # the ranks' halves of the batch average to the global batch's mean loss
        averaged = [(a + b) / 2 for a, b in zip(trial0["measured"]["losses"], trial1["measured"]["losses"])]
        assert len(averaged) == WARMUP + STEPS + 1
        assert averaged == pytest.approx(reference, rel=LOSS_RTOL), trial0["options"]
