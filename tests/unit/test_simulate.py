"""``zcompile.simulate`` at a world this machine does not have (64 ranks, one process) against ZeRO's
formulas; its agreement with real 2- and 4-rank runs is in test_training."""

import inspect
import json
import math

import pytest
import torch

import zcompile
from support.models import build_model, global_batch
from zcompile.predict.hardware import load_profile, profile_from_dict
from zcompile.predict.simulate import simulate

WORLD = 64


def _padded_bytes(model: torch.nn.Module, world: int) -> int:
    return sum(-(-p.numel() // world) * world * 4 for p in dict.fromkeys(model.parameters()))


@pytest.fixture(scope="module")
def stage3():
    tokens, targets = global_batch(0, 2)
    return simulate(lambda: build_model("gpt"), (tokens, targets), world_size=WORLD, options={"stage": 3})


def test_stage3_at_64_ranks_moves_zeros_volume(stage3):
    """Forward gathers every parameter once (Ψ, padded, fp32); backward reduce-scatters every
    gradient once (Ψ) and re-gathers at most Ψ: 2Ψ < step <= 3Ψ, as ZeRO-3's formula says."""
    padded = _padded_bytes(build_model("gpt"), WORLD)
    kinds = {c.kind for c in stage3.collectives}
    assert kinds == {"all_gather", "reduce_scatter"}
    assert stage3.bytes_by("forward") == padded
    assert sum(c.bytes for c in stage3.collectives if c.kind == "reduce_scatter") == padded
    assert 2 * padded < stage3.bytes_by() <= 3 * padded
    assert stage3.bytes_by(inside_node=True) == 0  # 64 ranks span 8 nodes of 8


def test_stage3_at_64_ranks_holds_16_psi_over_n(stage3):
    formula = zcompile.zero_formula_bytes(stage3.num_params, WORLD, 3)
    # each of the 28 parameters is padded to a multiple of 64: at most 63 elements x 16 bytes each
    assert formula <= stage3.memory["model_states_bytes"] <= formula + 28 * 63 * 16
    assert 0 < stage3.memory["peak_gathered_bytes"] <= 2 * _padded_bytes(build_model("gpt"), WORLD)
    assert stage3.memory["saved_activation_bytes"] > 0


def test_prediction_has_time_and_mfu(stage3):
    assert 0 < stage3.compute_s <= stage3.step_s
    assert 0 <= stage3.exposed_comm_s < stage3.step_s
    assert 0 < stage3.mfu < 1
    assert stage3.tokens_per_rank == 2 * 16


def test_optimizer_update_is_priced_on_rank_zeros_shards(stage3):
    """On an H100 profile the update is AdamW's fused kernel over each of rank 0's shards (a full
    chunk of every parameter: ceil(numel / 64) elements): one op's overhead plus 28 bytes per element
    (reads parameter, gradient and both moments; writes three) at the memory bandwidth."""
    h100 = load_profile("h100-sxm")
    chunks = [-(-p.numel() // WORLD) for p in dict.fromkeys(build_model("gpt").parameters())]
    expected = sum(h100.op_overhead_s + 28 * n / h100.memory_bytes_per_s for n in chunks)
    assert stage3.optimizer_update_s == pytest.approx(expected, rel=1e-9)
    assert stage3.optimizer_update_s <= stage3.compute_s


def test_cpu_profile_prices_torchs_fused_update_and_its_extra_passes():
    """On a "cpu" profile zcompile.optim runs torch's fused AdamW kernel (``kernels.cpu_adamw``): per
    shard one op's overhead and 28 bytes an element, as the GPU's; at stage 1 the gradient scale
    into a copy adds 8 bytes an element, and a bf16 replica the copy into it 4 + 2. The profile's host
    overheads add per graph call (one graph: its forward and its backward) and per trained parameter."""
    data = json.loads(open(load_profile("cpu-local").source).read())
    data.update(
        op_overhead_s=1.0,
        memory_bytes_per_s=1.0,
        device_type="cpu",
        compute_efficiency=1.0,
        graph_call_overhead_s=1000.0,
        parameter_overhead_s=1e6,
    )
    tokens, targets = global_batch(0, 2)
    chunks = [-(-p.numel() // 4) for p in dict.fromkeys(build_model("gpt").parameters())]
    for options, per_element in [
        ({"stage": 3}, 28),
        ({"stage": 1}, 28 + 8),
        ({"stage": 2, "param_dtype": "bf16"}, 28 + 4 + 2),
    ]:
        result = simulate(
            lambda: build_model("gpt"),
            (tokens, targets),
            world_size=4,
            options=options,
            hardware=profile_from_dict(data),
        )
        assert result.optimizer_update_s == pytest.approx(sum(1.0 + per_element * n for n in chunks), rel=1e-9), options
        assert result.graph_calls == 2
        assert result.host_overhead_s == pytest.approx(2 * 1000.0 + len(chunks) * 1e6, rel=1e-12)
        assert result.step_s >= result.host_overhead_s + result.optimizer_update_s


def test_more_ranks_than_host_cores_take_turns_on_them():
    """4 ranks on one host of 2 cores (``host_cores``): every figure of time is twice a rank's own
    (``HardwareProfile.shared_by``), so, the prediction being linear in them, every predicted time
    doubles (compute, update, host overhead, each collective, the step) and the memory does not."""
    data = json.loads(open(load_profile("cpu-local").source).read())
    results = {}
    for cores in (0, 2):
        data["host_cores"] = cores
        results[cores] = simulate(
            lambda: build_model("gpt"),
            global_batch(0, 2),
            world_size=4,
            node_size=4,
            options={"stage": 3},
            hardware=profile_from_dict(data),
        )
    own, shared = results[0], results[2]
    assert (own.time_sharing, shared.time_sharing) == (1.0, 2.0)
    assert shared.hardware == "cpu-local (4 ranks on 2 cores)"
    for part in ("step_s", "compute_s", "exposed_comm_s", "optimizer_update_s", "host_overhead_s"):
        assert getattr(shared, part) == pytest.approx(2 * getattr(own, part), rel=1e-9), part
    assert len(shared.collectives) == len(own.collectives) > 0
    for ours, theirs in zip(shared.collectives, own.collectives):
        assert ours.seconds == pytest.approx(2 * theirs.seconds, rel=1e-9)
    assert shared.memory == own.memory
    assert shared.mfu == pytest.approx(own.mfu / 2, rel=1e-9)  # against a rank's own peak


def test_the_ranks_agreements_are_priced_at_the_profiles_store_rate(caplog):
    """One store server answers 5 requests per rank an exchange (``rank_check``), each waiting its
    round trip or the server's turn through every rank's: a step's exchanges cost exchanges x 5 x
    max(``store_latency_s``, ranks / ``store_requests_per_s``). On a CPU profile they add to the step; on
    a GPU's the host runs ahead, so the step is the longer of the device's and the host's waits. A
    graph called once per layer (a graph break in the layer loop) agrees on each call; where that
    is a large share of the step the warning says so and names the fix."""
    tokens, targets = global_batch(0, 2)
    for name, rates in (("cpu-local", (0.0, 1e3)), ("h100-sxm", (0.0, 1e9, 1e3))):
        data = json.loads(open(load_profile(name).source).read())
        runs = {}
        for rate in rates:
            data["store_requests_per_s"] = rate
            caplog.clear()
            runs[rate] = simulate(
                lambda: build_model("gpt_loop_breaks"),
                (tokens, targets),
                world_size=WORLD,
                options={"stage": 3},
                hardware=profile_from_dict(data),
            )
        unpriced, slow = runs[0.0], runs[1e3]
        assert unpriced.store_s == 0.0  # 0: not priced
        assert unpriced.store_exchanges == slow.store_exchanges > 1  # the count itself: test_simulate_check
        # at 1,000 requests a second the server's turn through 64 ranks outlasts the round trip
        assert slow.store_s == pytest.approx(
            slow.store_exchanges * 5 * max(data["store_latency_s"], WORLD / 1e3), rel=1e-12
        )
        assert "agree on every call" in caplog.text and "mark_repeated_blocks" in caplog.text
        if name == "cpu-local":
            assert slow.step_s == pytest.approx(unpriced.step_s + slow.store_s, rel=1e-9)
        else:
            assert slow.step_s == slow.store_s > unpriced.step_s
            fast = runs[1e9]  # its waits hidden behind the device's step
            assert 0 < fast.store_s < unpriced.step_s and fast.step_s == pytest.approx(unpriced.step_s, rel=1e-12)


def test_stage2_optimizer_gathers_the_parameters_in_bf16():
    tokens, targets = global_batch(0, 2)
    result = simulate(
        lambda: build_model("gpt"),
        (tokens, targets),
        world_size=WORLD,
        options={"stage": 2, "param_dtype": "bf16"},
        hardware="a100-80gb",
    )
    padded = _padded_bytes(build_model("gpt"), WORLD)
    assert result.bytes_by("optimizer") == padded // 2  # bf16 all-gather of the replicas
    assert result.bytes_by("backward") == padded // 2  # bf16 reduce-scatter of the gradients
    formula = zcompile.zero_formula_bytes(result.num_params, WORLD, 2, torch.bfloat16)
    assert formula <= result.memory["model_states_bytes"] <= 1.05 * formula


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        simulate(lambda: build_model("gpt"), global_batch(0, 2), world_size=0)
    with pytest.raises(ValueError, match="no hardware profile named 'h900'"):
        simulate(lambda: build_model("gpt"), global_batch(0, 2), world_size=8, hardware="h900")


def test_command_line_simulates_a_transformers_spec(tmp_path, capsys):
    """`zcompile simulate SPEC.json`: a tiny Llama from a config dict; a spec without model_type and a
    bad option are errors (exit 2) with the reason, not tracebacks."""
    import json

    from zcompile.cli.commands import main

    spec = tmp_path / "llama.json"
    spec.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "vocab_size": 256,
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
            }
        )
    )
    out_json = tmp_path / "sim.json"
    assert (
        main(
            [
                "simulate",
                str(spec),
                "--world",
                "16",
                "--seq",
                "32",
                "--plain",
                "--option",
                "stage=3",
                "--option",
                "param_dtype=bf16",
                "--json",
                str(out_json),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "16 ranks (8 per node)" in printed and "MFU" in printed
    assert "note:" not in printed  # a GPU profile's nodes are what its node_size says
    saved = json.loads(out_json.read_text())
    assert saved["world_size"] == 16 and saved["per_rank_bytes"] > 0
    spec.write_text(json.dumps({"hidden_size": 64}))
    assert main(["simulate", str(spec), "--world", "16"]) == 2
    assert "needs a model_type" in capsys.readouterr().err
    spec.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "vocab_size": 256,
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 1,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
            }
        )
    )
    assert main(["simulate", str(spec), "--world", "16", "--option", "stage=5"]) == 2
    assert "stage" in capsys.readouterr().err
    # a CPU profile at more ranks than its node_size: said, with the flag that puts them on one host
    # (what that flag then prices: test_more_ranks_than_host_cores_take_turns_on_them)
    assert main(["simulate", str(spec), "--world", "4", "--seq", "8", "--plain", "--hardware", "cpu-local"]) == 0
    printed = capsys.readouterr().out
    assert "4 ranks (2 per node), cpu-local" in printed
    assert "priced as 2 hosts of 2 ranks" in printed and "pass --node-size 4" in printed


# ----------------------------------------------------------------------------- ZeRO++ groups priced per link
def _link_seconds(link: dict, ranks: int, nbytes: int) -> float:
    """nccl-tests' bus-bandwidth rule from the profile file's own figures: log2 latency steps plus
    (N - 1) / N of the bytes through the link."""
    return link["latency_s"] * math.ceil(math.log2(ranks)) + nbytes * (ranks - 1) / ranks / link["bus_bytes_per_s"]


def _simulate_gpt(options: dict, hardware="h100-sxm"):
    tokens, targets = global_batch(0, 2)
    return simulate(
        lambda: build_model("gpt"), (tokens, targets), world_size=WORLD, node_size=8, options=options, hardware=hardware
    )


@pytest.fixture(scope="module")
def hpz():
    return _simulate_gpt({"stage": 3, "hpz_size": "node"})


def test_hpz_secondary_gathers_run_at_the_intra_node_link(hpz):
    """64 ranks, nodes of 8, hpZ over the node: backward re-gathers the secondary shards over 8 ranks
    of one node (NVLink), the forward gathers the primary ones over all 64 (InfiniBand)."""
    links = json.loads(open(load_profile("h100-sxm").source).read())["links"]
    secondary = [c for c in hpz.collectives if c.where == "backward" and c.kind == "all_gather"]
    primary = [c for c in hpz.collectives if c.where == "forward" and c.kind == "all_gather"]
    assert secondary and primary
    for c in secondary:
        assert (c.group_size, c.inside_node) == (8, True)
        assert c.seconds == pytest.approx(_link_seconds(links["intra_node"], 8, c.bytes), rel=1e-12)
    for c in primary:
        assert (c.group_size, c.inside_node) == (WORLD, False)
        assert c.seconds == pytest.approx(_link_seconds(links["inter_node"], WORLD, c.bytes), rel=1e-12)


def test_qgz_second_all_to_all_crosses_nodes_though_its_group_is_small():
    """qgZ's second all-to-all runs between the 8 ranks of one local rank, one per node: a group no
    larger than a node, yet across nodes (priced on the inter-node link); the first stays inside one."""
    links = json.loads(open(load_profile("h100-sxm").source).read())["links"]
    result = _simulate_gpt({"stage": 3, "quantize_grads": True})
    to_all = [c for c in result.collectives if c.kind == "all_to_all"]
    assert [(c.group_size, c.inside_node) for c in to_all] == [(8, True), (8, False)]
    intra, inter = to_all
    assert intra.seconds == pytest.approx(_link_seconds(links["intra_node"], 8, intra.bytes), rel=1e-12)
    assert inter.seconds == pytest.approx(_link_seconds(links["inter_node"], 8, inter.bytes), rel=1e-12)


def test_hpz_exposes_less_communication_when_nodes_are_far_apart():
    """A profile whose inter-node link is 1,000x slower than NVLink: the backward re-gather that hpZ
    keeps inside the node leaves less exposed than stage 3's re-gather across nodes; the difference
    is at least most of that gather's time at the inter-node bandwidth."""
    data = json.loads(open(load_profile("h100-sxm").source).read())
    data["links"] = {
        "intra_node": {"bus_bytes_per_s": 1e12, "latency_s": 0.0},
        "inter_node": {"bus_bytes_per_s": 1e9, "latency_s": 0.0},
    }
    slow = profile_from_dict(data, "slow-inter.json")
    plain = _simulate_gpt({"stage": 3}, slow)
    hpz = _simulate_gpt({"stage": 3, "hpz_size": "node"}, slow)
    regather = sum(c.bytes for c in plain.collectives if c.where == "backward" and c.kind == "all_gather")
    assert hpz.exposed_comm_s < plain.exposed_comm_s
    assert plain.exposed_comm_s - hpz.exposed_comm_s > 0.9 * regather * 63 / 64 / 1e9


def test_node_size_argument_and_option_must_agree():
    with pytest.raises(ValueError, match="node_size=8 and the option node_size=4 disagree"):
        simulate(lambda: build_model("gpt"), global_batch(0, 2), world_size=16, node_size=8, options={"node_size": 4})


def test_the_node_note_is_said_for_simulate_and_for_simulate_tune_alike():
    """``say_nodes`` (both commands call it): a CPU profile split into hosts by its own node_size
    says so; an explicit --node-size or a GPU profile says nothing."""
    from argparse import Namespace

    from zcompile.cli.simulate import say_nodes

    class Lines(list):
        def line(self, text):
            self.append(text)

    said = Lines()
    say_nodes(Namespace(node_size=None, hardware="cpu-local", world=6), said)
    assert said == [
        "note: 6 ranks priced as 3 hosts of 2 ranks (the profile's node_size); for all of them on one "
        "host of 2 cores, pass --node-size 6"
    ]
    for args in (
        Namespace(node_size=6, hardware="cpu-local", world=6),
        Namespace(node_size=None, hardware="cpu-local", world=2),
        Namespace(node_size=None, hardware="h100-sxm", world=64),
    ):
        say_nodes(args, said)
    assert len(said) == 1


def test_simulate_is_callable_from_the_top_level_package(stage3):
    """``zcompile.simulate(...)`` (as ``zcompile.estimate_memory``) and the module path give the same
    prediction; the module's public names stay importable."""
    import zcompile.simulate as module
    from zcompile.simulate import SimulationResult

    assert zcompile.simulate is module
    tokens, targets = global_batch(0, 2)
    result = zcompile.simulate(lambda: build_model("gpt"), (tokens, targets), world_size=WORLD, options={"stage": 3})
    assert isinstance(result, SimulationResult)
    assert result.memory == stage3.memory and result.step_s == stage3.step_s
    assert list(inspect.signature(zcompile.simulate).parameters)[:2] == ["make_model", "example_batch"]


def test_an_output_the_loss_does_not_use_gets_no_real_gradient():
    """A causal LM returns its logits beside its loss; AOTAutograd gives the unused output a gradient of
    zeros of its shape at backward, which outside the fake mode was a real tensor: here 64 x 2048 x
    128,256 fp32 logits, 67 GB, which this machine cannot allocate (the simulation stopped; at a
    smaller batch it took that much host memory). Simulated, nothing is allocated at full size."""
    transformers = pytest.importorskip("transformers")

    config = transformers.LlamaConfig(
        vocab_size=128256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        use_cache=False,
    )
    ids = torch.zeros(64, 2048, dtype=torch.long)
    result = simulate(
        lambda: transformers.LlamaForCausalLM(config),
        {"input_ids": ids, "labels": ids},
        world_size=8,
        options={"stage": 3},
    )
    logits_bytes = 64 * 2048 * 128256 * 4
    assert result.memory["saved_activation_bytes"] >= logits_bytes  # the loss saves the logits' softmax
