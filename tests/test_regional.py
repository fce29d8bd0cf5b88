"""zcompile.mark_repeated_blocks: which modules become regions, what stays as it was, wrong names.

The multi-rank parity of regional runs is in test_training (``regional=True`` specs).
"""

import pytest
import torch
from gpt import Block

import zcompile
from support.models import GPT, GPTConfig, synthetic_batch  # puts examples/ on the path
from zcompile.backend.regional import marked_block_count

CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32)


def _pair():
    torch.manual_seed(0)
    model = GPT(CONFIG)
    reference = GPT(CONFIG)
    reference.load_state_dict(model.state_dict())
    return model, reference


def test_finds_the_block_class_and_leaves_other_instances_alone():
    model, reference = _pair()
    keys = list(model.state_dict())
    assert zcompile.mark_repeated_blocks(model) == [Block]  # not nn.Linear of the MLP's Sequential
    assert marked_block_count(model) == CONFIG.n_layer
    assert all(isinstance(block, Block) for block in model.blocks)
    assert list(model.state_dict()) == keys
    assert marked_block_count(reference) == 0 and type(reference.blocks[0]) is Block
    assert zcompile.mark_repeated_blocks(model) == [type(model.blocks[0])]  # again: nothing new
    assert marked_block_count(model) == CONFIG.n_layer


def test_a_marked_model_compiles_each_block_once_and_computes_the_same():
    """Dynamo's graph calls one subgraph per layer; the loss and every gradient equal the
    unmarked model's (an instance-bound mark reused layer 0's weights at every layer)."""
    model, reference = _pair()
    zcompile.mark_repeated_blocks(model)
    graphs = []

    def backend(gm, example_inputs):  # records Dynamo's graph; an invoke_subgraph runs only compiled
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    tokens, targets = synthetic_batch(0, 2, CONFIG)
    torch._dynamo.reset()
    try:
        loss = torch.compile(model, backend=backend)(tokens, targets)
    finally:
        torch._dynamo.reset()
    expected = reference(tokens, targets)
    loss.backward()
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)
    for (name, param), ref_param in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, ref_param.grad, rtol=1e-6, atol=1e-7, msg=name)
    calls = [node for gm in graphs for node in gm.graph.nodes if "invoke_subgraph" in str(node.target)]
    assert len(calls) == CONFIG.n_layer
    assert len({node.args[0].target for node in calls}) == 1


def _block_schemas_made(layers: int, backend, monkeypatch) -> int:
    """How many times torch re-traced a block for invoke_subgraph's schema in one training compile."""
    from torch._higher_order_ops.invoke_subgraph import InvokeSubgraphHOP

    made = []
    original = InvokeSubgraphHOP.gen_schema

    def counted(self, *args):
        made.append(args[1])
        return original(self, *args)

    monkeypatch.setattr(InvokeSubgraphHOP, "gen_schema", counted)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=layers, n_head=2, n_embd=32))
    zcompile.mark_repeated_blocks(model)
    torch._dynamo.reset()
    try:
        torch.compile(model, **backend)(*synthetic_batch(0, 2, CONFIG)).backward()
    finally:
        torch._dynamo.reset()
    return len(made)


def test_a_block_is_traced_for_its_schema_once_per_compile_not_once_per_layer(monkeypatch):
    """torch 2.13 re-traces a block at every call to check it for input mutation, twice per layer
    (plain aot_eager below: the torch cause, still there); the zero backend holds
    regional.schema_once_per_subgraph around AOTAutograd, so the count does not grow with depth,
    and the HOP is left as it was."""
    plain = {n: _block_schemas_made(n, {"backend": "aot_eager"}, monkeypatch) for n in (2, 4)}
    assert plain[4] - plain[2] == 2 * 2, plain
    zero = {n: _block_schemas_made(n, {"backend": "zero", "options": {"stage": 3}}, monkeypatch) for n in (2, 4)}
    assert zero[2] == zero[4] <= 3, zero
    assert "gen_schema" not in vars(torch.ops.higher_order.invoke_subgraph)


def test_schema_table_is_per_subgraph_and_removed_on_the_way_out():
    from zcompile.backend.regional import schema_once_per_subgraph

    hop = torch.ops.higher_order.invoke_subgraph
    with pytest.raises(RuntimeError, match="inside"):
        with schema_once_per_subgraph():
            assert "gen_schema" in vars(hop)
            with schema_once_per_subgraph():  # nested: the outer table stays
                inner = vars(hop)["gen_schema"]
            assert vars(hop)["gen_schema"] is inner
            raise RuntimeError("inside")
    assert "gen_schema" not in vars(hop)


def test_torch_layers_with_submodules_are_blocks():
    encoder = torch.nn.TransformerEncoder(
        torch.nn.TransformerEncoderLayer(32, 2, 64, batch_first=True), 2, enable_nested_tensor=False
    )
    assert zcompile.mark_repeated_blocks(encoder) == [torch.nn.TransformerEncoderLayer]
    assert marked_block_count(encoder) == 2


def test_named_classes_and_errors():
    model, _ = _pair()
    assert zcompile.mark_repeated_blocks(model, block_classes=["LayerNorm"]) == [torch.nn.LayerNorm]
    assert marked_block_count(model) == 2 * CONFIG.n_layer + 1
    with pytest.raises(ValueError, match="no submodule of GPT is a Attention.*Block"):
        zcompile.mark_repeated_blocks(GPT(CONFIG), block_classes=["Attention"])
    with pytest.raises(TypeError, match="nn.Module"):
        zcompile.mark_repeated_blocks(lambda x: x)


def test_a_model_without_repeated_blocks_is_said_not_silent(caplog):
    with caplog.at_level("WARNING", logger="zcompile.backend.regional"):
        assert zcompile.mark_repeated_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())) == []
    assert "nothing marked" in caplog.text


# kept weights, hpZ and bf16 in one run (two simulations each: the suite's time), as test_zeropp.py trains them
@pytest.mark.parametrize(
    "options",
    [{}, {"keep_gathered_mb": 0.05, "hpz_size": "node", "param_dtype": "bf16"}],
    ids=["default", "kept_hpz_bf16"],
)
def test_stage3_regathers_the_blocks_weights_instead_of_saving_them(options):
    """A block's subgraph hands its weight inputs back for its backward; without
    passes/regions.py the outer partition saves them (every layer's gathered weights alive from
    forward to backward), and keep_gathered could not see them read by the backward. Simulated at
    8 ranks in nodes of 4: the marked model saves, keeps, gathers (inside and across nodes) and
    reduces exactly what the unmarked one does, and estimate_memory says the same before compiling."""
    from zcompile.predict.simulate import simulate

    config = GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32)
    batch = synthetic_batch(0, 2, config)

    def make(regional):
        def make_model():
            model = GPT(config)
            if regional:
                zcompile.mark_repeated_blocks(model)
            return model

        return make_model

    # default buckets: a block's weights are all live at its call, so without buckets (bucket_mb=0)
    # the marked model's gathered peak is one block's weights, not one weight's
    results = {
        r: simulate(make(r), batch, world_size=8, node_size=4, hardware="h100-sxm", options=options)
        for r in (False, True)
    }
    plain, marked = results[False], results[True]
    assert marked.memory == plain.memory
    assert (plain.memory["kept_gathered_bytes"] > 0) == ("keep_gathered_mb" in options)
    for where in ("forward", "backward"):
        assert marked.bytes_by(where) == plain.bytes_by(where) > 0, where
    assert marked.bytes_by(inside_node=True) == plain.bytes_by(inside_node=True)
    if options:
        return
    estimates = [
        zcompile.estimate_memory(make(r)(), 8, {"stage": 3}, batch=batch).saved_activation_bytes for r in (False, True)
    ]
    assert estimates[0] == estimates[1] == plain.memory["saved_activation_bytes"]


def test_copies_stay_marked_and_a_saved_model_loads_as_its_own_classes():
    import copy
    import io

    from gpt import Block

    model, _ = _pair()
    zcompile.mark_repeated_blocks(model)
    copied = copy.deepcopy(model)
    assert marked_block_count(copied) == CONFIG.n_layer and copied.head.weight is copied.wte.weight
    buffer = io.BytesIO()
    torch.save(model, buffer)  # the generated subclass has no importable name: saved as Block
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert type(loaded.blocks[0]) is Block and marked_block_count(loaded) == 0
    tokens, _ = synthetic_batch(0, 2, CONFIG)
    torch.testing.assert_close(loaded(tokens), model(tokens), rtol=0, atol=0)
    torch.testing.assert_close(copied(tokens), model(tokens), rtol=0, atol=0)


def test_inductor_with_marked_blocks_is_refused_with_the_fix():
    """It trained wrong from the second step on 2 ranks (stages 2 and 3); refused, not silent."""
    model, _ = _pair()
    zcompile.mark_repeated_blocks(model)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, backend="zero", options={"stage": 3, "compiler": "inductor"})
        with pytest.raises(Exception, match="compiler='eager' with regional compilation"):
            compiled(*synthetic_batch(0, 2, CONFIG))
    finally:
        torch._dynamo.reset()


def _compile_marked_on_rank0_only(rank, world):
    """Rank 0 marks its blocks, rank 1 does not; returns the error each rank met (or None)."""
    import time

    model, _ = _pair()
    if rank == 0:
        zcompile.mark_repeated_blocks(model)
    compiled = torch.compile(model, backend="zero", options={"stage": 3, "check_timeout_s": 30})
    tokens, targets = synthetic_batch(0, 2, CONFIG)
    started = time.perf_counter()
    try:
        compiled(tokens, targets).backward()
    except Exception as error:  # Dynamo wraps the backend's RankDivergenceError
        return str(error), time.perf_counter() - started
    return None, time.perf_counter() - started


def test_blocks_marked_on_one_rank_only_is_an_error_on_every_rank_naming_it():
    """The buckets of the backward follow the block calls, so the ranks' collectives would differ;
    the compile-time check names the marking, on both ranks, before any collective runs."""
    from support.launch import run_ranks

    results = run_ranks(2, _compile_marked_on_rank0_only, timeout_s=120)
    for message, seconds in results:
        assert message is not None and "RankDivergenceError" in message, message
        assert "blocks marked by mark_repeated_blocks" in message, message
        assert seconds < 30, seconds  # at the check, not at a collective's timeout


# ---- one graph for every block when Dynamo compiles the block's forward on its own ----


class _BreakingBlock(Block):
    """The example block with a graph break in its forward (a print, an ``.item()``): Dynamo then
    runs the model's loop over its blocks eagerly and compiles the block's forward on its own."""

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        torch._dynamo.graph_break()
        return x + self.mlp(self.ln_2(x))


LAYERS_PAST_LIMIT = 10  # more than Dynamo's recompile_limit (8): a recompile per layer ran the rest eagerly


def _train_blocks(how: str, stage: int | None) -> dict:
    """Three steps of a 10-layer GPT whose blocks Dynamo compiles on their own; ``stage`` None: eager
    torch with torch.optim.AdamW (the reference)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=64, block_size=16, n_layer=LAYERS_PAST_LIMIT, n_head=2, n_embd=32)
    model = GPT(config)
    if how == "graph break":
        for block in model.blocks:
            block.__class__ = _BreakingBlock
    compiles, runner = [], model
    if stage is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        optimizer = zcompile.optim.AdamW(model.parameters(), lr=1e-2)
        options = {"stage": stage, "on_compile": compiles.append}
        if how == "block.compile":
            for block in model.blocks:
                block.compile(backend="zero", options=options)
        else:
            runner = torch.compile(model, backend="zero", options=options)
    losses = []
    for step in range(3):
        tokens, targets = synthetic_batch(step, 2, config)
        loss = runner(tokens, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    block_weights = [p for block in model.blocks for p in block.parameters()]
    torch._dynamo.reset()
    return {
        "losses": losses,
        "compiles": len(compiles),
        "freed": sum(p.untyped_storage().nbytes() == 0 for p in block_weights),
        "block_weights": len(block_weights),
    }


@pytest.mark.parametrize("how", ["graph break", "block.compile"])
def test_blocks_compiled_on_their_own_share_one_graph_and_all_shard(how):
    """Dynamo guards a graph's weights by type and reuses it for every block; the first block's weights
    became ``ShardedParameter`` after its compile while the next block's were still plain, so every
    layer recompiled, and past the recompile limit ran eagerly with its weights replicated (16
    graphs, 52 of 148 weights never sharded at 12 layers). The siblings are now marked ahead."""
    reference = _train_blocks(how, None)
    run = _train_blocks(how, 3)
    expected_compiles = 2 if how == "graph break" else 1  # the block's two halves, or the whole block
    assert run["compiles"] == expected_compiles, run
    assert run["freed"] == run["block_weights"], run  # every block weight sharded, none replicated
    # one rank: the same AdamW steps (the fused CPU kernel against torch's single-tensor loop)
    torch.testing.assert_close(run["losses"], reference["losses"], rtol=1e-5, atol=0)
