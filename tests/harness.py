"""Shared test harness: models, a zero-backend training loop, single-process references, and a
launcher that runs a function on N gloo ranks in fresh processes (with a timeout, never a hang).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "examples"))

from gpt import GPT, GPTConfig, synthetic_batch  # noqa: E402

import zcompile  # noqa: E402
from zcompile.comm_volume import step_collectives  # noqa: E402

VOCAB = 256


# ----------------------------------------------------------------------------- models
class GPTWithBreaks(GPT):
    """The GPT with graph breaks (several Dynamo graphs per forward) and a buffer.

    ``in_loop``: the break sits inside the loop over blocks, so Dynamo runs the whole forward
    frame eagerly and compiles each block's frame: embeddings and head train outside any graph.
    """

    def __init__(self, config: GPTConfig, in_loop: bool = False):
        super().__init__(config)
        self.in_loop = in_loop
        self.register_buffer("logit_scale", torch.tensor(0.75))

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        torch._dynamo.graph_break()
        for block in self.blocks:
            x = block(x)
            if self.in_loop:
                torch._dynamo.graph_break()
        torch._dynamo.graph_break()
        logits = self.head(self.ln_f(x)) * self.logit_scale
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def build_model(name: str) -> torch.nn.Module:
    """The models the tests train, each deterministic (seeded, no dropout)."""
    torch.manual_seed(0)
    small = GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=2, n_embd=32)
    if name == "gpt_breaks":
        return GPTWithBreaks(small)
    if name == "gpt_loop_breaks":  # untied: a stage-3 parameter must not be used both in and out of graphs
        return GPTWithBreaks(GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=2, n_embd=32,
                                       tie_weights=False), in_loop=True)
    if name == "gpt_frozen":  # position embedding and first block's norm frozen
        model = GPT(small)
        model.wpe.weight.requires_grad_(False)
        for param in model.blocks[0].ln_1.parameters():
            param.requires_grad_(False)
        return model
    if name == "gpt_bf16":  # the whole model in bf16 (model.to(torch.bfloat16)), no param_dtype option
        return GPT(small).to(torch.bfloat16)
    if name == "gpt":
        return GPT(GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=2, n_embd=32))
    if name == "gpt_untied_odd":  # sizes not divisible by 2 or 4, no tied weights
        return GPT(GPTConfig(vocab_size=VOCAB - 3, block_size=16, n_layer=2, n_head=3, n_embd=21, tie_weights=False))
    if name == "hf_gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    if name == "hf_llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                            max_position_embeddings=32))
    raise ValueError(name)


def model_loss(name: str, model: Callable, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    if name.startswith("hf_"):
        return model(input_ids=tokens, labels=tokens).loss
    return model(tokens, targets)


def global_batch(step: int, batch_size: int, seq_lens: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, targets = synthetic_batch(step, batch_size, GPTConfig(vocab_size=VOCAB - 3, block_size=16))
    if seq_lens:
        length = seq_lens[step % len(seq_lens)]
        tokens, targets = tokens[:, :length].contiguous(), targets[:, :length].contiguous()
    return tokens, targets


# ----------------------------------------------------------------------------- runs
@dataclass
class RunSpec:
    model: str = "gpt"
    stage: int = 3
    steps: int = 3
    batch_size: int = 8
    optimizer: str = "adamw"  # adamw | sgd
    lr: float = 1e-2
    grad_accum: int = 1  # backward calls per optimizer step (each on its own micro-batch)
    zero_grad_to_none: bool = True
    optimizer_after_forward: bool = False
    seq_lens: tuple[int, ...] = ()  # per-step sequence length (recompiles on new shapes); () = full
    options: dict = field(default_factory=dict)
    optimizer_options: dict = field(default_factory=dict)  # extra zcompile.optim arguments (bucket_mb)


@dataclass
class RunResult:
    losses: list[float]
    params: dict[str, torch.Tensor]
    state_bytes: int = 0
    num_params: int = 0
    padded_numel: int = 0
    collectives: list = field(default_factory=list)
    graphs: list = field(default_factory=list)  # (forward code, backward code) per compiled graph
    facts: dict = field(default_factory=dict)  # structure of the compiled graphs, see graph_facts


def _reads_gathered_param(node) -> bool:
    """Whether ``node`` is a gathered parameter (a wait of an all-gather, through views, casts and
    the split of a bucket)."""
    import operator

    from zcompile.passes.collectives import ALL_GATHER, WAIT
    from zcompile.passes.cleanup import PASS_THROUGH

    through = set(PASS_THROUGH) | {operator.getitem, torch.ops.aten.split_with_sizes.default,
                                   torch.ops.aten.clone.default}
    while isinstance(node, torch.fx.Node) and node.op == "call_function":
        if node.target is WAIT and node.args[0].target is ALL_GATHER:
            return True
        if node.target not in through:
            return False
        node = node.args[0]
    return False


def graph_facts(compiled_graphs) -> dict:
    """Counts read from the compiled graphs, per parameter (a bucketed collective counts each
    parameter it moves): gathers and reduce-scatters per graph, gathered weights saved for
    backward, parameters gathered twice in one graph, and the collective ops themselves."""
    from zcompile.passes.collectives import ALL_GATHER, REDUCE_SCATTER
    from zcompile.passes.graph_ops import gather_param
    from zcompile.passes.metadata import params_of

    facts = dict(graphs=len(compiled_graphs), gather_nodes=0, fw_all_gathers=0, bw_all_gathers=0,
                 bw_reduce_scatters=0, saved_gathered=0, gathered_twice=0, collective_ops=0,
                 overlapped_collectives=0, kept_params=0, keep_plans=[])

    def params_moved(gm, op):
        nodes = gm.graph.find_nodes(op="call_function", target=op)
        facts["collective_ops"] += len(nodes)
        names = [name for node in nodes for name in (params_of(node) or ["?"])]
        facts["gathered_twice"] += len(names) - len(set(names)) if op is ALL_GATHER else 0
        return len(names)

    from zcompile.report import collective_overlaps

    for graphs in compiled_graphs:
        for gm in (graphs.forward, graphs.backward):
            facts["overlapped_collectives"] += sum(r.overlapped_ops > 0 for r in collective_overlaps(gm, "", ""))
        facts["gather_nodes"] += len(graphs.dynamo.graph.find_nodes(op="call_function", target=gather_param))
        if graphs.keep_gathered is not None:
            facts["kept_params"] += len(graphs.keep_gathered.kept)
            facts["keep_plans"].append(json.loads(graphs.keep_gathered.to_json()))
        if graphs.forward is not None:
            facts["fw_all_gathers"] += params_moved(graphs.forward, ALL_GATHER)
            outputs = graphs.forward.graph.find_nodes(op="output")[0].args[0]
            facts["saved_gathered"] += sum(_reads_gathered_param(out) for out in outputs)
        if graphs.backward is not None:
            facts["bw_all_gathers"] += params_moved(graphs.backward, ALL_GATHER)
            facts["bw_reduce_scatters"] += params_moved(graphs.backward, REDUCE_SCATTER)
    return facts


def _optimizer(spec: RunSpec, params, zero: bool):
    module = zcompile.optim if zero else torch.optim
    extra = spec.optimizer_options if zero else {}
    if spec.optimizer == "sgd":
        return module.SGD(params, lr=spec.lr, momentum=0.9, **extra)
    # eps=1e-6 sits above the rounding noise of gradients that are exactly zero in theory (the
    # key third of an attention qkv bias): with eps=1e-8 Adam would normalize that noise to
    # +-lr steps and two correct runs would differ by lr per element.
    return module.AdamW(params, lr=spec.lr, weight_decay=0.01, eps=1e-6, **extra)


def _micro_batches(spec: RunSpec, step: int, rank: int, world: int):
    """This rank's micro-batches of the global batch of ``step``, one per backward call."""
    tokens, targets = global_batch(step, spec.batch_size * spec.grad_accum, spec.seq_lens)
    out = []
    for micro in range(spec.grad_accum):
        chunk = slice(micro * spec.batch_size, (micro + 1) * spec.batch_size)
        local = slice(rank * spec.batch_size // world, (rank + 1) * spec.batch_size // world)
        out.append((tokens[chunk][local], targets[chunk][local]))
    return out


def train_zero(spec: RunSpec, rank: int = 0, world: int = 1) -> RunResult:
    """Trains ``spec.model`` with the zero backend on this rank; returns the gathered result."""
    torch._dynamo.reset()
    model = build_model(spec.model)
    compiled_graphs = []
    options = {"stage": spec.stage, "compiler": "eager", "on_compile": compiled_graphs.append, **spec.options}
    compiled = torch.compile(model, backend="zero", options=options)
    optimizer = None if spec.optimizer_after_forward else _optimizer(spec, model.parameters(), zero=True)
    losses, state_bytes = [], 0
    for step in range(spec.steps):
        step_loss = 0.0
        for tokens, targets in _micro_batches(spec, step, rank, world):
            loss = model_loss(spec.model, compiled, tokens, targets) / spec.grad_accum
            loss.backward()
            step_loss += loss.detach()
            if optimizer is None:
                optimizer = _optimizer(spec, model.parameters(), zero=True)
        optimizer.step()
        state_bytes = zcompile.model_state_bytes(model, optimizer).total
        optimizer.zero_grad(set_to_none=spec.zero_grad_to_none)
        if world > 1:
            dist.all_reduce(step_loss)
        losses.append(float(step_loss) / world)
    collectives = step_collectives(compiled_graphs, optimizer)
    with zcompile.gathered(model):
        params = {name: p.detach().clone() for name, p in model.named_parameters()}
    unique = list(dict.fromkeys(model.parameters()))
    padded = sum(-(-p.numel() // world) * world for p in unique)
    graphs = [(g.forward.code if g.forward else "", g.backward.code if g.backward else "") for g in compiled_graphs]
    facts = graph_facts(compiled_graphs)
    if facts["keep_plans"]:
        facts["report_kept_bytes"] = zcompile.step_report(model, optimizer).memory["kept_gathered_bytes"]
    return RunResult(losses, params, state_bytes, sum(p.numel() for p in unique), padded, collectives, graphs,
                     facts)


def train_reference(spec: RunSpec, world: int = 1, microbatch_like_ranks: bool = False,
                    autocast_dtype: torch.dtype | None = None) -> RunResult:
    """Single process, plain torch: the global batch in one forward per micro-batch.

    With ``microbatch_like_ranks`` the global batch is split into ``world`` slices whose gradients
    are averaged, which is the same arithmetic as data parallelism (only the order of the final
    cross-rank sum can differ), so it can be compared at a much tighter tolerance.
    ``autocast_dtype`` runs each forward under ``torch.autocast`` (the mixed-precision reference).
    """
    model = build_model(spec.model)
    optimizer = _optimizer(spec, model.parameters(), zero=False)
    losses = []
    for step in range(spec.steps):
        step_loss = 0.0
        slices = world if microbatch_like_ranks else 1
        for micro in range(spec.grad_accum):
            tokens, targets = global_batch(step, spec.batch_size * spec.grad_accum, spec.seq_lens)
            chunk = slice(micro * spec.batch_size, (micro + 1) * spec.batch_size)
            tokens, targets = tokens[chunk], targets[chunk]
            for part in range(slices):
                local = slice(part * spec.batch_size // slices, (part + 1) * spec.batch_size // slices)
                with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
                    loss = model_loss(spec.model, model, tokens[local], targets[local]) / (spec.grad_accum * slices)
                loss.backward()
                step_loss += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(step_loss)
    return RunResult(losses, {name: p.detach().clone() for name, p in model.named_parameters()})


# ----------------------------------------------------------------------------- launcher
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_entry(rank: int, world: int, port: int, fn, args, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    path = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
        result = fn(rank, world, *args)
        torch.save({"ok": result}, path)
    except BaseException as error:  # report any failure to the parent instead of hanging it
        torch.save({"error": f"{type(error).__name__}: {error}\n{traceback.format_exc()}"}, path)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world: int, fn: Callable, *args: Any, timeout_s: float = 300) -> list:
    """Runs ``fn(rank, world, *args)`` on ``world`` fresh gloo processes; returns each rank's result.

    A rank that raises makes this raise with its traceback; ranks still alive after ``timeout_s``
    are killed and reported, so a deadlock fails the test instead of hanging the suite.
    """
    context = mp.get_context("spawn")
    port = _free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [context.Process(target=_rank_entry, args=(r, world, port, fn, args, out_dir)) for r in range(world)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(timeout_s)
        hung = [r for r, proc in enumerate(procs) if proc.is_alive()]
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        results, errors = [], []
        for rank in range(world):
            path = os.path.join(out_dir, f"rank{rank}.pt")
            payload = torch.load(path, weights_only=False) if os.path.exists(path) else {"error": "no result"}
            if "error" in payload:
                errors.append(f"rank {rank}: {payload['error']}")
            results.append(payload.get("ok"))
    if hung:
        raise TimeoutError(f"ranks {hung} still running after {timeout_s}s (deadlock?); errors: {errors}")
    if errors:
        raise RuntimeError("\n".join(errors))
    return results


def zero_run_on_rank(rank: int, world: int, specs: list[RunSpec]) -> list[RunResult]:
    """Entry point for ``run_ranks``: trains every spec in turn on this rank."""
    return [train_zero(spec, rank, world) for spec in specs]
