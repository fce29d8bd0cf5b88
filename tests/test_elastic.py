"""torchrun's elastic restarts with the docs' recipe (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, resume
from ``zcompile.checkpoint``): a worker lost at each stage in turn, every stage resumed by a restarted
attempt and ending with the losses of an uninterrupted run."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

from support.training import LOSS_RTOL, RunSpec, train_reference
from zcompile.common import process_group

HERE = os.path.dirname(os.path.abspath(__file__))


def test_restarted_workers_resume_every_stage_like_an_uninterrupted_run(tmp_path):
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([HERE, os.path.join(os.path.dirname(HERE), "examples")])
    launch = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "3",
            "--monitor-interval",
            "0.2",
            os.path.join(HERE, "support", "elastic_worker.py"),
            str(tmp_path),
        ],
        env=env,
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        timeout=480,
    )
    assert launch.returncode == 0, launch.stderr[-3000:]
    for stage in (1, 2, 3):
        with open(tmp_path / f"stage{stage}.json") as handle:
            result = json.load(handle)
        assert result["resumed_at_attempt"] == stage  # lost at attempt stage - 1, finished by the next
        reference = train_reference(RunSpec(stage=stage, steps=6), world=2, microbatch_like_ranks=True).losses
        assert len(result["losses"]) == 6
        for got, want in zip(result["losses"], reference, strict=True):
            assert abs(got - want) <= 10 * LOSS_RTOL * abs(want), (stage, result["losses"], reference)


def test_restarts_sharing_the_agent_store_are_warned_once(monkeypatch, caplog):
    """torchrun with ``--max-restarts`` > 0 and its store shared with the workers (its default): one
    warning naming the fix; none without restarts or with the store unshared."""
    for restarts, shared, warned in (("2", "True", True), ("0", "True", False), ("2", "False", False)):
        process_group.warn_if_restarts_share_the_agent_store.cache_clear()
        monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", restarts)
        monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", shared)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=process_group.__name__):
            process_group.warn_if_restarts_share_the_agent_store()
            process_group.warn_if_restarts_share_the_agent_store()
        messages = [r.getMessage() for r in caplog.records]
        assert len(messages) == (1 if warned else 0), messages
        if warned:
            assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in messages[0]
    process_group.warn_if_restarts_share_the_agent_store.cache_clear()
