"""``zcompile simulate SPEC``: ``zcompile.simulate`` from the command line, for a transformers model.

``SPEC`` is a small JSON model spec: a transformers config as a dict with its ``model_type``
(``{"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, ...}``), built with
``AutoConfig.for_model`` and ``AutoModelForCausalLM.from_config`` on fake tensors (nothing is
allocated or downloaded). Prints the memory per rank by parts, their sum and the step's peak (with
the phase that holds it: ``zcompile.predict.step_peak``), the collectives per step and the predicted step;
``--json OUT`` also writes the result.

``--tp N`` splits the model over N ranks of a node by its declared tensor-parallel plan
(``zcompile.apply_tp_plan``) and shards the pieces over the other ranks.

With ``--space KEY=V1,V2`` (repeated) it tunes by simulation instead (``zcompile.simulate_tune``):
every combination simulated on top of the ``--option`` ones, a table of the points, the Pareto front
of memory per GPU against step time and the fastest point that fits; ``--plot PNG`` draws it.
"""

from __future__ import annotations

import argparse
import json

from zcompile.common.dumps import DumpError  # the CLI's "exit 2 with a message" error

GIB = 2**30


def add_parser(commands, common: argparse.ArgumentParser) -> None:
    parser = commands.add_parser(
        "simulate",
        parents=[common],
        help="memory and step time of a transformers model "
        "at a world size this machine does not have (zcompile.simulate)",
    )
    add_model_arguments(parser)
    parser.add_argument("--json", default=None, metavar="OUT", help="also write the result as JSON")
    parser.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel degree: the model split by its declared tp plan over tp ranks of a node, "
        "ZeRO over the world / tp (zcompile.apply_tp_plan)",
    )
    parser.add_argument(
        "--extrapolate",
        action="store_true",
        help="simulate two shallow copies (2 and 3 of the model's layers) and extrapolate to its depth: "
        "seconds for a deep model (docs/simulation.md)",
    )
    parser.add_argument(
        "--space",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="tune by simulation: candidates of a zero backend option (repeat for more options)",
    )
    parser.add_argument(
        "--memory-limit-gb", type=float, default=None, help="with --space: GiB per GPU; points over it are pruned"
    )
    parser.add_argument(
        "--plot",
        default=None,
        metavar="PNG",
        help="with --space: step time against memory, the Pareto front highlighted",
    )


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model spec, the world it is predicted for, and the options (``simulate`` and ``plan``)."""
    parser.add_argument("spec", help="JSON file: a transformers config dict with its model_type")
    parser.add_argument("--world", type=int, required=True, help="number of ranks (GPUs)")
    parser.add_argument("--node-size", type=int, default=None, help="ranks per node (default: the profile's)")
    parser.add_argument("--hardware", default="h100-sxm", help="profile name (h100-sxm, a100-80gb, cpu-local) or path")
    parser.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=1, help="sequences per rank")
    parser.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a zero backend option (JSON value, or a plain string), e.g. stage=3, param_dtype=bf16",
    )


def _value(text: str):
    """A JSON value (``3``, ``null``, ``true``), else the plain string (``bf16``, ``node``)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_options(pairs: list[str]) -> dict:
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"--option {pair!r}: expected KEY=VALUE")
        options[key] = _value(value)
    return options


def parse_space(pairs: list[str]) -> dict:
    """``["bucket_mb=16,64", "hpz_size=null,node"]`` -> ``{"bucket_mb": [16, 64], "hpz_size": [None, "node"]}``."""
    space = {}
    for pair in pairs:
        key, sep, values = pair.partition("=")
        if not sep or not values:
            raise ValueError(f"--space {pair!r}: expected KEY=V1,V2,...")
        space[key] = [_value(v) for v in values.split(",")]
    return space


def load_spec(path: str, batch: int, seq: int):
    """``(model_type, make_model, example_batch)`` of a JSON model spec (module doc): a transformers
    causal LM built from its config, and ``batch`` sequences of ``seq`` tokens."""
    import torch  # local, with what follows: `zcompile inspect` loads none of it (import cost)
    import transformers

    try:
        with open(path) as f:
            spec = json.load(f)
        model_type = spec.pop("model_type", None)
        if model_type is None:
            raise ValueError('the spec needs a model_type (e.g. "llama", "gpt2")')
        config = transformers.AutoConfig.for_model(model_type, **spec)
    except (OSError, ValueError) as error:
        raise DumpError(f"{path}: {error}") from None
    config.use_cache = False
    ids = torch.zeros(batch, seq, dtype=torch.long)
    return (
        model_type,
        (lambda: transformers.AutoModelForCausalLM.from_config(config)),
        {"input_ids": ids, "labels": ids},
    )


def cmd_simulate(args: argparse.Namespace, out, warnings: list[str]) -> int:
    from zcompile.predict.simulate import simulate

    model_type, make_model, batch = load_spec(args.spec, args.batch, args.seq)
    try:
        options = parse_options(args.option)
        space = parse_space(args.space)
    except ValueError as error:
        raise DumpError(f"{args.spec}: {error}") from None
    if space and args.tp > 1:
        raise DumpError("--space with --tp: tuning by simulation takes the tp degree as 1; simulate each tp apart")
    if space:
        return _tune(args, out, make_model, batch, space, options)
    try:
        result = simulate(
            make_model,
            batch,
            world_size=args.world,
            node_size=args.node_size,
            options=options,
            hardware=args.hardware,
            tensor_parallel=args.tp,
            extrapolate=args.extrapolate,
        )
    except ValueError as error:  # a bad option, world size or hardware profile: said, not a traceback
        raise DumpError(str(error)) from None
    say_nodes(args, out)
    rows = [[part, f"{nbytes / GIB:.2f}"] for part, nbytes in result.memory.items()]
    rows.append(["per rank", f"{result.per_rank_bytes / GIB:.2f}"])
    rows.append([f"step peak ({result.step_peak_phase})", f"{result.step_peak_bytes / GIB:.2f}"])
    layout = f" as dp {result.world_size // args.tp} x tp {args.tp}" if args.tp > 1 else ""
    if result.extrapolated_from is not None:
        layout += " (extrapolated from {} and {} of its {} layers)".format(*result.extrapolated_from)
    out.table(
        f"{model_type}, {result.num_params / 1e9:.2f}B parameters, {result.world_size} ranks{layout} "
        f"({result.node_size} per node), {result.hardware}: GiB per rank",
        ["part", "GiB"],
        rows,
        numeric={1},
    )
    rows = [
        [where, f"{result.bytes_by(where) / GIB:.2f}", f"{result.bytes_by(where, inside_node=False) / GIB:.2f}"]
        for where in ("forward", "backward", "optimizer")
    ]
    out.table("collectives per step and rank (GiB)", ["where", "all", "across nodes"], rows, numeric={1, 2})
    host = f", host {result.host_overhead_s * 1e3:.1f} ms" if result.host_overhead_s else ""
    if result.store_s:
        host += f", the ranks' {result.store_exchanges} agreement{'s' if result.store_exchanges != 1 else ''} through the store {result.store_s * 1e3:.1f} ms"
    out.line(
        f"step {result.step_s * 1e3:.1f} ms (compute {result.compute_s * 1e3:.1f} ms, exposed communication "
        f"{result.exposed_comm_s * 1e3:.1f} ms{host}), {result.tokens_per_s_per_rank:,.0f} tokens/s per "
        f"rank, MFU {100 * result.mfu:.1f}%; simulated in {result.simulate_s:.1f} s"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.to_dict(), f, indent=1)
    return 0


def say_nodes(args: argparse.Namespace, out) -> None:
    """Says so when the world was split into nodes by a host profile's own node size: on ``cpu-local``
    (2 ranks per node) ``--world 4`` prices two hosts of 2 ranks, each rank with a core of its own,
    where a user on this one machine has 4 ranks taking turns on its 2 cores (about twice the step)."""
    if args.node_size is not None:
        return
    from zcompile.predict.hardware import load_profile  # local: import cost (cmd_simulate)

    profile = load_profile(args.hardware)
    if profile.host_cores and args.world > profile.node_size:
        nodes = -(-args.world // profile.node_size)
        out.line(
            f"note: {args.world} ranks priced as {nodes} hosts of {profile.node_size} ranks (the profile's "
            f"node_size); for all of them on one host of {profile.host_cores} cores, pass "
            f"--node-size {args.world}"
        )


def _tune(args: argparse.Namespace, out, make_model, batch: dict, space: dict, options: dict) -> int:
    from zcompile.tune.simulated import simulate_tune  # local: import cost (cmd_simulate)
    from zcompile.tune.simulated_report import COLUMNS, LEFT, point_rows, summary_lines

    try:
        result = simulate_tune(
            make_model,
            batch,
            space=space,
            world_size=args.world,
            node_size=args.node_size,
            base_options=options,
            hardware=args.hardware,
            memory_limit_gb=args.memory_limit_gb,
        )
    except (TypeError, ValueError) as error:  # a bad space, option, world size or profile: said, not a traceback
        raise DumpError(str(error)) from None
    say_nodes(args, out)
    out.table(
        f"{len(result.points)} points simulated at {result.world_size} ranks ({result.hardware})",
        list(COLUMNS),
        point_rows(result),
        numeric=set(range(len(COLUMNS))) - LEFT,
    )
    for line in summary_lines(result):
        out.line(line)
    if args.json:
        result.to_json(args.json)
    if args.plot:
        result.plot(args.plot)
    return 0
