"""A torchrun worker for ``test_elastic.py``: the docs' restart recipe, with a worker lost in training.

Run as ``torchrun --nproc-per-node 2 --max-restarts 3 elastic_worker.py ROOT`` with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``. For each stage 1-3 in turn it trains ``STEPS`` steps of the
test GPT, saving ``zcompile.checkpoint`` after step ``HALF``; at attempt ``k`` (torchrun's restart
count) rank 1 leaves (``os._exit``) right after stage ``k + 1``'s save, so every stage is resumed once by
a restarted attempt. A stage that finished writes its losses to ``ROOT/stage{N}.json`` and is skipped
by later attempts.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

import zcompile.checkpoint as ckpt
from support.models import build_model
from support.training import RunSpec, _optimizer, train_steps

STEPS, HALF = 6, 3


def main(root: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    for stage in (1, 2, 3):
        result = os.path.join(root, f"stage{stage}.json")
        if os.path.exists(result):
            continue
        torch._dynamo.reset()
        spec = RunSpec(stage=stage, steps=STEPS)
        model = build_model(spec.model)
        compiled = torch.compile(model, backend="zero", options={"stage": stage})
        optimizer = _optimizer(spec, model.parameters(), zero=True)
        path, start, losses = os.path.join(root, f"ck{stage}"), 0, []
        if os.path.exists(path):
            extra = ckpt.load(path, compiled, optimizer)
            start, losses = extra["step"], extra["losses"]
        for step in range(start, STEPS):
            losses += train_steps(spec, compiled, optimizer, [step], rank, world)
            if step + 1 == HALF:
                ckpt.save(path, compiled, optimizer, extra={"step": HALF, "losses": losses})
                if attempt == stage - 1 and rank == 1:
                    os._exit(17)  # a lost worker: torchrun restarts every worker
        if rank == 0:
            with open(result + ".tmp", "w") as handle:
                json.dump({"losses": losses, "resumed_at_attempt": attempt}, handle)
            os.replace(result + ".tmp", result)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
