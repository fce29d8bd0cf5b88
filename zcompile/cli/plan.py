"""``zcompile plan SPEC --world N --limit 80GiB``: ``zcompile.plan`` from the command line, for a
transformers model given as ``zcompile simulate``'s JSON spec. Prints every candidate (chosen, the
others that fit by predicted step, the ones dropped and why) and the options to pass the backend;
``--json OUT`` also writes the plan; ``--tp`` the tensor-parallel degrees to plan. Nothing fits:
exit 2 with what would."""

from __future__ import annotations

import argparse
import json

from zcompile.cli.simulate import add_model_arguments, load_spec, parse_options, say_nodes
from zcompile.common.dumps import DumpError  # the CLI's "exit 2 with a message" error


def add_parser(commands, common: argparse.ArgumentParser) -> None:
    parser = commands.add_parser(
        "plan",
        parents=[common],
        help="the fastest options within a memory limit per GPU, predicted for a transformers model (zcompile.plan)",
    )
    add_model_arguments(parser)
    parser.add_argument(
        "--limit", default="auto", help="memory per GPU: MiB, a size (80GiB, 70GB) or auto (the profile's less 10%%)"
    )
    parser.add_argument("--max-simulations", type=int, default=16, help="simulate at most this many candidates")
    parser.add_argument(
        "--tp",
        default="auto",
        help="tensor-parallel degrees to plan: auto (those the model's declared tp plan allows in a node), "
        "N, or N1,N2,... (1: none)",
    )
    parser.add_argument(
        "--whole",
        action="store_true",
        help="simulate every candidate whole (slower for a deep model), not from shallow copies extrapolated",
    )
    parser.add_argument("--json", default=None, metavar="OUT", help="also write the plan as JSON")


def cmd_plan(args: argparse.Namespace, out, warnings: list[str]) -> int:
    from zcompile.tune.plan import plan
    from zcompile.tune.plan_report import COLUMNS, LEFT, candidate_rows, mib

    _, make_model, batch = load_spec(args.spec, args.batch, args.seq)
    try:
        options = parse_options(args.option)
        limit = float(args.limit) if args.limit.replace(".", "", 1).isdigit() else args.limit
        degrees = "auto" if args.tp == "auto" else tuple(int(t) for t in args.tp.split(","))
        result = plan(
            make_model,
            batch,
            world_size=args.world,
            memory_limit_mb=limit,
            hardware=args.hardware,
            node_size=args.node_size,
            options=options,
            max_simulations=args.max_simulations,
            tensor_parallel=degrees,
            extrapolate=not args.whole,
        )
    except ValueError as error:  # a bad option, limit or world size, or nothing fits (PlanError): said
        raise DumpError(str(error)) from None
    say_nodes(args, out)
    out.table(
        f"{mib(result.memory_limit_bytes)} MiB per GPU, {result.world_size} GPUs, {result.hardware}",
        list(COLUMNS),
        candidate_rows(result),
        numeric=set(range(len(COLUMNS))) - LEFT,
    )
    out.line(result.summary())
    out.line(f"options={json.dumps(result.to_dict()['options'])}")
    if result.tensor_parallel > 1:
        out.line(
            f"tensor_parallel={result.tensor_parallel}: split the model over the tp dim of a ('dp', 'tp') mesh of "
            f"{result.world_size // result.tensor_parallel} x {result.tensor_parallel} ranks and pass the mesh as "
            "option 'mesh' (docs/tensor-parallel.md)"
        )
    if args.json:
        result.to_json(args.json)
    return 0
