"""The main job under torchrun ends with exit 0 at stages 1 and 3: no gloo work object of zcompile's left
for gloo's thread to free while the interpreter shuts down (that ended a correct stage-1 run in
``std::terminate``: "terminate called without an active exception"), and no collective left unwaited."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCHES = {
    1: 1,
    3: 1,
}  # once each (the abort was seen at stage 1: 60 of 60 clean since; stage 2 shares stage 1's step)


@pytest.mark.parametrize("stage", [1, 3])
def test_the_main_job_exits_zero_every_time(stage, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        os.path.join(ROOT, "examples", "train_gpt.py"),
        "--stage",
        str(stage),
        "--steps",
        "3",
        "--layers",
        "2",
        "--embd",
        "32",
        "--save",
        str(tmp_path / "ckpt"),
    ]
    for _ in range(LAUNCHES[stage]):
        launch = subprocess.run(command, env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=300)
        output = launch.stdout + launch.stderr
        assert launch.returncode == 0, output[-3000:]
        assert "terminate called" not in output, output[-3000:]
        assert "saved" in launch.stdout and "3 steps in" in launch.stdout, launch.stdout[-2000:]
