"""Hardware profiles as data: the figures the cost model needs to predict a machine zcompile is not on.

A profile is a small JSON file (``zcompile/predict/hardware_profiles/<name>.json``, or any path) with the
peak FLOP/s per dtype, memory bandwidth and size, the per-op overhead, the ranks per node, and two
links (``intra_node``, ``inter_node``), each a bus bandwidth and a per-step latency; every figure's
source is named in its ``sources``. Shipped: ``h100-sxm``, ``a100-80gb`` (datasheets and
nccl-tests figures) and ``cpu-local`` (fitted on the development machine by
``benchmarks/measure_cpu_profile.py`` from ``cost_model.measure_*_costs``).

``HardwareProfile.collective_costs(world_size, node_size)`` turns a profile into the cost model's
``CollectiveCosts`` with nccl-tests' bus-bandwidth rule: a collective over ``N`` ranks that moves
``B`` bytes (``passes.collectives``: an all-gather's output, the others' input) takes
``latency_s * ceil(log2 N) + f * B * (N - 1) / N / bus_bytes_per_s``, ``f`` = 2 for an all-reduce
(reduce-scatter then all-gather) and 1 otherwise, on the inter-node link as soon as the group spans
nodes (its slowest link). ``group_cost`` is that rule, the only copy of it.

ZeRO++ runs collectives on sub-groups of the world: hpZ's secondary all-gathers and qgZ's first
all-to-all inside a node, qgZ's second all-to-all across nodes between ranks of the same local rank
(a group of N / K ranks, one per node: small, yet across nodes). ``link_costs(world_size,
node_size, group_ranks)`` prices each collective of a graph by its own group (``LinkCosts``): at its
group's size, on the link its group's ranks need (``topology.spans_nodes``); a group whose ranks are
not known is taken as consecutive ranks from a node's start (across nodes when larger than a node).
``compute_costs(dtype)`` gives ``ComputeCosts`` at the dtype's peak.

Optional figures, for machines where the plain roofline is wrong (``cpu-local`` has them; the GPU
profiles leave them out, and each defaults to "no effect"):

- ``attention_efficiency``: the attention kernels' FLOP/s as a fraction of the dtype's peak;
- ``transcendental_bytes_per_s``: the bandwidth of the ops that evaluate exp, erf or tanh, softmax
  and the normalizations (``cost_model.TRANSCENDENTAL_OPS``); default ``memory_bytes_per_s``;
- ``overlap_slowdown``: how much slower a transfer moves while its rank computes (``predict``'s
  contention model; gloo's threads share a CPU's cores with compute);
- per link, ``issue_latency_s`` and ``issue_bytes_per_s``: the issuing thread's time per collective;
  ``bus_factor``: a kind's bus bytes per byte moved, and ``latency_factor``: its latency over the
  link's, where the backend's algorithm is not nccl-tests' (gloo's reduce-scatter is an all-reduce:
  twice the bytes, and several times the all-gather's latency);
- ``device_type``: "cuda" (default) or "cpu": which update ``zcompile.optim`` runs, so which one
  ``simulate`` prices;
- ``compute_efficiency``: the fraction of the micro-benchmarked rates a training step's compute
  reaches (``zcompile.predict.compute_efficiency``, measured on a reference workload); every op's predicted
  time is divided by it. Left out (1) in the datasheet profiles;
- ``graph_call_overhead_s`` and ``parameter_overhead_s``: the host's time per compiled graph call
  and per trained parameter that no op's price holds (Dynamo's guards, AOTAutograd's wrappers, the
  autograd engine; zcompile's per-parameter arguments and the optimizer's Python per shard), on
  the step's critical path where the host runs the ops itself (a CPU); fitted by
  ``benchmarks/measure_cpu_profile.py`` on tiny models. Left out (0) in the GPU profiles, where the
  host runs ahead of the device;
- ``host_cores``: the CPU cores one node's ranks share, on a profile whose ranks compute on the
  host (``cpu-local``); its figures are each rank's with at most one rank per core, as fitted.
  More ranks than cores time-share them: ``time_sharing`` is how many times longer each rank's
  compute, host work and transfers take (4 ranks on 2 cores: 2x; ``shared_by`` applies it to every
  figure of time). Left out (0) in the GPU profiles: a device per rank;
- ``store_requests_per_s``: the answered requests a second the process group's store serves (one
  server, torchrun's agent or rank 0's, answers every rank's), which bounds the ranks' agreements
  (``zcompile.agreement.store_exchange``: 5 answered requests per rank an exchange, so 5N through the
  one server). Fitted by ``benchmarks/bench_store_throughput.py``; 0: not priced. ``store_latency_s``:
  one answered request's round trip with the server idle (the same benchmark with one rank). Each of
  a rank's requests waits the longer of the two: its round trip, or the server's turn through every
  rank's (``store_seconds``: at few ranks the latency, at many the queue).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from zcompile.common.topology import spans_nodes
from zcompile.passes.collectives import ALL_REDUCE, COLLECTIVE_KINDS, KINDS, CollectiveNode
from zcompile.predict.cost_model import CollectiveCost, CollectiveCosts, ComputeCosts

PROFILE_DIR = Path(__file__).parent / "hardware_profiles"
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# bytes over the bus per byte moved, per (N - 1) / N: an all-reduce is a reduce-scatter and an all-gather
_BUS_FACTOR = {kind: 2.0 if kind == COLLECTIVE_KINDS[ALL_REDUCE] else 1.0 for kind in KINDS}


class HardwareProfileError(ValueError):
    """A profile that is missing a field or holds a value that cannot be right."""


@dataclass(frozen=True)
class Link:
    bus_bytes_per_s: float
    latency_s: float
    # the issuing thread's time per collective (``CollectiveCost.issue_seconds``): gloo copies and
    # enqueues on the caller's thread; NCCL's launch is in ``op_overhead_s``'s order (left at 0)
    issue_latency_s: float = 0.0
    issue_bytes_per_s: float = math.inf
    # bytes over the bus per byte moved, per (N - 1) / N, where the backend's algorithm differs from
    # nccl-tests' rule (on gloo zcompile's reduce-scatter is an all-to-all, which outruns gloo's
    # all-gather: below 1; gloo's own reduce-scatter, an all-reduce, would be about 2)
    bus_factor: Mapping[str, float] = field(default_factory=dict)
    # a kind's latency over ``latency_s`` where its algorithm takes more steps than nccl-tests' rule says
    latency_factor: Mapping[str, float] = field(default_factory=dict)

    def cost(self, kind: str, ranks: int) -> CollectiveCost:
        """The cost-model form (latency + bytes x seconds per byte) of ``kind`` over ``ranks`` ranks."""
        steps = math.ceil(math.log2(ranks))
        factor = self.bus_factor.get(kind, _BUS_FACTOR[kind])
        per_byte = factor * (ranks - 1) / ranks / self.bus_bytes_per_s
        latency = self.latency_s * self.latency_factor.get(kind, 1.0) * steps
        return CollectiveCost(
            latency_s=latency,
            seconds_per_byte=per_byte,
            issue_latency_s=self.issue_latency_s,
            issue_seconds_per_byte=1.0 / self.issue_bytes_per_s,
        )


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    peak_flops_per_s: dict[str, float]  # by dtype name: "bf16", "fp16", "fp32"
    memory_bytes_per_s: float
    memory_bytes: float
    op_overhead_s: float
    node_size: int
    intra_node: Link
    inter_node: Link
    source: str = ""  # the file it was read from
    # optional figures (module docstring): 0 or 1 when a profile leaves them out
    attention_efficiency: float = 1.0  # the attention kernels' FLOP/s over the dtype's peak
    transcendental_bytes_per_s: float = 0.0  # ``ComputeCosts.transcendental_bytes_per_s``; 0: memory bandwidth
    overlap_slowdown: float = 1.0  # ``CollectiveCosts.overlap_slowdown``: a transfer's time while computing / alone
    device_type: str = "cuda"  # what zcompile.optim runs its update on: the fused kernel ("cuda") or torch ops
    compute_efficiency: float = (
        1.0  # a training step's share of the micro-benchmarked rates (zcompile.predict.compute_efficiency)
    )
    graph_call_overhead_s: float = 0.0  # host time per compiled graph call (forward or backward)
    parameter_overhead_s: float = 0.0  # host time per trained parameter and step
    host_cores: int = 0  # CPU cores a node's ranks share (module docstring); 0: a device per rank
    store_requests_per_s: float = 0.0  # answered requests a second of the process group's store; 0: not priced
    store_latency_s: float = 0.0  # one answered store request's round trip, the server idle

    def time_sharing(self, world_size: int, node_size: int | None = None) -> float:
        """How many times longer each rank's compute, host work and transfers take in a world of
        ``world_size`` ranks, ``node_size`` per node (default the profile's): the ranks on one node over
        its ``host_cores`` where they outnumber them, else 1 (and always 1 on a profile without
        ``host_cores``)."""
        ranks_on_node = self.ranks_on_node(world_size, node_size)
        return max(1.0, ranks_on_node / self.host_cores) if self.host_cores else 1.0

    def ranks_on_node(self, world_size: int, node_size: int | None = None) -> int:
        """The ranks one node holds in a world of ``world_size``, ``node_size`` per node (default the profile's)."""
        return min(world_size, node_size or self.node_size)

    def shared_by(self, world_size: int, node_size: int | None = None) -> HardwareProfile:
        """This profile as each rank of that world sees it (``time_sharing``'s arguments): where the
        ranks on a node outnumber ``host_cores`` every figure of time ``time_sharing`` times slower
        (compute rates, per-op and host overheads, and the links: gloo's threads take turns on the
        cores with the ranks')."""
        share = self.time_sharing(world_size, node_size)
        if share == 1.0:
            return self
        ranks_on_node = self.ranks_on_node(world_size, node_size)

        def link(shared: Link) -> Link:
            return replace(
                shared,
                bus_bytes_per_s=shared.bus_bytes_per_s / share,
                latency_s=shared.latency_s * share,
                issue_latency_s=shared.issue_latency_s * share,
                issue_bytes_per_s=shared.issue_bytes_per_s / share,
            )

        return replace(
            self,
            name=f"{self.name} ({ranks_on_node} ranks on {self.host_cores} cores)",
            host_cores=0,
            peak_flops_per_s={k: v / share for k, v in self.peak_flops_per_s.items()},
            memory_bytes_per_s=self.memory_bytes_per_s / share,
            transcendental_bytes_per_s=self.transcendental_bytes_per_s / share,
            op_overhead_s=self.op_overhead_s * share,
            graph_call_overhead_s=self.graph_call_overhead_s * share,
            parameter_overhead_s=self.parameter_overhead_s * share,
            store_requests_per_s=self.store_requests_per_s / share,  # its server takes turns on the cores too
            store_latency_s=self.store_latency_s * share,
            intra_node=link(self.intra_node),
            inter_node=link(self.inter_node),
        )

    def host_overhead_seconds(self, graph_calls: int, parameters: int) -> float:
        """The step's host time no op's price holds: ``graph_calls`` graph calls, ``parameters`` trained
        parameters (tensors, not elements)."""
        return self.graph_call_overhead_s * graph_calls + self.parameter_overhead_s * parameters

    def store_seconds(self, requests_per_rank: int, ranks: int) -> float:
        """A rank's time for ``requests_per_rank`` answered requests, one after another, while each of
        ``ranks`` ranks sends as many: each waits its round trip or the server's turn through every
        rank's request, the longer (0 where the rate is not priced)."""
        if not self.store_requests_per_s:
            return 0.0
        return requests_per_rank * max(self.store_latency_s, ranks / self.store_requests_per_s)

    def group_cost(self, kind: str, group_size: int, across_nodes: bool) -> CollectiveCost:
        """``kind`` over a group of ``group_size`` ranks, on the inter-node link when the group spans
        nodes, else the intra-node one; a group of one communicates nothing."""
        if group_size < 2:
            return CollectiveCost()
        return (self.inter_node if across_nodes else self.intra_node).cost(kind, group_size)

    def collective_costs(self, world_size: int, node_size: int | None = None) -> CollectiveCosts:
        """``CollectiveCosts`` for the whole world (``world_size`` ranks, ``node_size`` per node, default
        the profile's): every collective priced as if it ran over all ranks (``link_costs`` prices
        sub-groups by their own size and link)."""
        node_size = node_size or self.node_size
        if world_size < 2:
            return CollectiveCosts(world_size, {})
        across = world_size > node_size
        return CollectiveCosts(
            world_size, {kind: self.group_cost(kind, world_size, across) for kind in KINDS}, self.overlap_slowdown
        )

    def link_costs(
        self, world_size: int, node_size: int | None = None, group_ranks: Mapping[str, tuple[int, ...]] | None = None
    ) -> LinkCosts:
        """Costs that price each collective by its group (module docstring); ``group_ranks``: group
        name -> global ranks (``process_group.group_ranks_by_name``)."""
        return LinkCosts(self, world_size, node_size or self.node_size, dict(group_ranks or {}), self.overlap_slowdown)

    def peak_flops(self, dtype: torch.dtype | str) -> float:
        """Peak FLOP/s in ``dtype`` (a ``torch.dtype`` or ``"bf16"``/``"fp16"``/``"fp32"``)."""
        name = next((k for k, v in _DTYPES.items() if v == dtype or k == dtype), None)
        if name not in self.peak_flops_per_s:
            raise HardwareProfileError(
                f"hardware profile {self.name!r} has no peak_flops_per_s for {dtype}; "
                f"it has {sorted(self.peak_flops_per_s)}"
            )
        return self.peak_flops_per_s[name]

    def compute_costs(self, dtype: torch.dtype | str = torch.bfloat16) -> ComputeCosts:
        """``ComputeCosts`` at the peak FLOP/s of ``dtype`` (the compute dtype, ``param_dtype`` or fp32)."""
        peak = self.peak_flops(dtype)
        costs = ComputeCosts(
            peak,
            self.memory_bytes_per_s,
            self.op_overhead_s,
            peak * self.attention_efficiency,
            self.transcendental_bytes_per_s,
        )
        return costs if self.compute_efficiency == 1.0 else costs.scaled(1.0 / self.compute_efficiency)


@dataclass(frozen=True)
class LinkCosts:
    """A profile's costs for one world, each collective priced by its own group (``CollectivePricing``)."""

    profile: HardwareProfile
    world_size: int
    node_size: int
    group_ranks: dict[str, tuple[int, ...]] = field(default_factory=dict)  # group name -> global ranks
    overlap_slowdown: float = 1.0  # the profile's: 1 unless its links are slowed by compute (a CPU's)

    def group_size(self, collective: CollectiveNode) -> int:
        """Ranks of the collective's group (an all-reduce does not say: its group's, else the world's)."""
        return collective.group_size or len(self.group_ranks.get(collective.group_name, ())) or self.world_size

    def across_nodes(self, group_name: str, group_size: int) -> bool:
        """Whether the group runs over the inter-node link: its ranks span nodes (when known), else it
        is larger than a node."""
        ranks = self.group_ranks.get(group_name)
        return spans_nodes(ranks, self.node_size) if ranks else group_size > self.node_size

    def cost_of(self, collective: CollectiveNode) -> CollectiveCost:
        size = self.group_size(collective)
        return self.profile.group_cost(collective.kind, size, self.across_nodes(collective.group_name, size))


def available_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def load_profile(name_or_path: str | os.PathLike) -> HardwareProfile:
    """The profile named ``name_or_path`` (one of ``available_profiles()``) or read from that path."""
    path = Path(name_or_path)
    if not path.suffix:
        path = PROFILE_DIR / f"{name_or_path}.json"
        if not path.exists():
            raise HardwareProfileError(
                f"no hardware profile named {str(name_or_path)!r}; shipped: "
                f"{available_profiles()}, or give the path of a JSON file"
            )
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise HardwareProfileError(f"hardware profile {str(path)!r} cannot be read: {error}") from error
    return profile_from_dict(data, str(path))


def profile_from_dict(data: dict, source: str = "<dict>") -> HardwareProfile:
    """Validates ``data`` (the JSON form) and builds the profile; every error names the field and the file."""

    def field(path: str):
        value = data
        for key in path.split("."):
            if not isinstance(value, dict) or key not in value:
                raise HardwareProfileError(f"hardware profile {source!r}: missing field {path!r}")
            value = value[key]
        return value

    def positive(path: str, allow_zero: bool = False) -> float:
        value = field(path)
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or (value < 0 if allow_zero else value <= 0)
        ):
            bound = ">= 0" if allow_zero else "> 0"
            raise HardwareProfileError(f"hardware profile {source!r}: {path} must be a number {bound}, got {value!r}")
        return float(value)

    sources = field("sources")
    if not isinstance(sources, dict) or not sources:
        raise HardwareProfileError(
            f"hardware profile {source!r}: sources must name where the figures come from (a field -> text map)"
        )
    flops = field("peak_flops_per_s")
    if not isinstance(flops, dict) or not flops or not set(flops) <= set(_DTYPES):
        raise HardwareProfileError(
            f"hardware profile {source!r}: peak_flops_per_s must map some of {sorted(_DTYPES)} to FLOP/s, got {flops!r}"
        )
    node_size = field("node_size")
    if isinstance(node_size, bool) or not isinstance(node_size, int) or node_size < 1:
        raise HardwareProfileError(f"hardware profile {source!r}: node_size must be an int >= 1, got {node_size!r}")
    links = {name: _link(name, positive, data) for name in ("intra_node", "inter_node")}
    optional = {
        key: positive(key)
        for key in ("attention_efficiency", "transcendental_bytes_per_s", "overlap_slowdown", "compute_efficiency")
        if key in data
    }
    optional.update(
        {
            key: positive(key, allow_zero=True)
            for key in ("graph_call_overhead_s", "parameter_overhead_s", "store_requests_per_s", "store_latency_s")
            if key in data
        }
    )
    for fraction in ("attention_efficiency", "compute_efficiency"):
        if optional.get(fraction, 1.0) > 1.0:
            raise HardwareProfileError(
                f"hardware profile {source!r}: {fraction} is a fraction of the measured or "
                f"peak rates, at most 1, got {optional[fraction]!r}"
            )
    if optional.get("overlap_slowdown", 1.0) < 1.0:
        raise HardwareProfileError(
            f"hardware profile {source!r}: overlap_slowdown is a transfer's time while "
            f"computing over its time alone, at least 1, got {optional['overlap_slowdown']!r}"
        )
    if "host_cores" in data:
        cores = data["host_cores"]
        if isinstance(cores, bool) or not isinstance(cores, int) or cores < 0:
            raise HardwareProfileError(
                f"hardware profile {source!r}: host_cores must be an int >= 0 (0: a device per rank), got {cores!r}"
            )
        optional["host_cores"] = cores
    device_type = data.get("device_type", "cuda")
    if device_type not in ("cuda", "cpu"):
        raise HardwareProfileError(
            f"hardware profile {source!r}: device_type must be 'cuda' or 'cpu', got {device_type!r}"
        )
    return HardwareProfile(
        name=str(field("name")),
        peak_flops_per_s={k: positive(f"peak_flops_per_s.{k}") for k in flops},
        memory_bytes_per_s=positive("memory_bytes_per_s"),
        memory_bytes=positive("memory_bytes"),
        op_overhead_s=positive("op_overhead_s", allow_zero=True),
        node_size=node_size,
        intra_node=links["intra_node"],
        inter_node=links["inter_node"],
        source=source,
        device_type=device_type,
        **optional,
    )


def _link(name: str, positive: Callable[..., float], data: dict) -> Link:
    """``links.<name>``: bus bandwidth and latency, and the optional issue cost and per-kind factors."""
    link = (
        data["links"][name] if isinstance(data.get("links"), dict) and isinstance(data["links"].get(name), dict) else {}
    )
    prefix = f"links.{name}"

    def per_kind(key: str) -> dict[str, float]:
        factors = link.get(key, {})
        if not isinstance(factors, dict) or not set(factors) <= set(KINDS):
            raise HardwareProfileError(
                f"hardware profile: {prefix}.{key} must map some of {list(KINDS)} to a factor, got {factors!r}"
            )
        return {kind: positive(f"{prefix}.{key}.{kind}") for kind in factors}

    return Link(
        positive(f"{prefix}.bus_bytes_per_s"),
        positive(f"{prefix}.latency_s", True),
        positive(f"{prefix}.issue_latency_s", True) if "issue_latency_s" in link else 0.0,
        positive(f"{prefix}.issue_bytes_per_s") if "issue_bytes_per_s" in link else math.inf,
        per_kind("bus_factor"),
        per_kind("latency_factor"),
    )
