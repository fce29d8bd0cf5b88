"""Hardware profiles as data: the figures the cost model needs to predict a machine zcompile is not on.

A profile is a small JSON file (``zcompile/hardware_profiles/<name>.json``, or any path) with the
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
nodes (its slowest link). ``compute_costs(dtype)`` gives ``ComputeCosts`` at the dtype's peak.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from zcompile.cost_model import CollectiveCost, CollectiveCosts, ComputeCosts
from zcompile.passes.collectives import ALL_REDUCE, COLLECTIVE_KINDS, KINDS

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

    def cost(self, kind: str, ranks: int) -> CollectiveCost:
        """The cost-model form (latency + bytes x seconds per byte) of ``kind`` over ``ranks`` ranks."""
        steps = math.ceil(math.log2(ranks))
        per_byte = _BUS_FACTOR[kind] * (ranks - 1) / ranks / self.bus_bytes_per_s
        return CollectiveCost(latency_s=self.latency_s * steps, seconds_per_byte=per_byte)


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

    def collective_costs(self, world_size: int, node_size: int | None = None) -> CollectiveCosts:
        """``CollectiveCosts`` for a group of ``world_size`` ranks, ``node_size`` per node (default the profile's)."""
        node_size = node_size or self.node_size
        if world_size < 2:
            return CollectiveCosts(world_size, {})
        link = self.intra_node if world_size <= node_size else self.inter_node
        return CollectiveCosts(world_size, {kind: link.cost(kind, world_size) for kind in KINDS})

    def peak_flops(self, dtype: torch.dtype | str) -> float:
        """Peak FLOP/s in ``dtype`` (a ``torch.dtype`` or ``"bf16"``/``"fp16"``/``"fp32"``)."""
        name = next((k for k, v in _DTYPES.items() if v == dtype or k == dtype), None)
        if name not in self.peak_flops_per_s:
            raise HardwareProfileError(f"hardware profile {self.name!r} has no peak_flops_per_s for {dtype}; "
                                       f"it has {sorted(self.peak_flops_per_s)}")
        return self.peak_flops_per_s[name]

    def compute_costs(self, dtype: torch.dtype | str = torch.bfloat16) -> ComputeCosts:
        """``ComputeCosts`` at the peak FLOP/s of ``dtype`` (the compute dtype, ``param_dtype`` or fp32)."""
        return ComputeCosts(self.peak_flops(dtype), self.memory_bytes_per_s, self.op_overhead_s)


def available_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def load_profile(name_or_path: str | os.PathLike) -> HardwareProfile:
    """The profile named ``name_or_path`` (one of ``available_profiles()``) or read from that path."""
    path = Path(name_or_path)
    if not path.suffix:
        path = PROFILE_DIR / f"{name_or_path}.json"
        if not path.exists():
            raise HardwareProfileError(f"no hardware profile named {str(name_or_path)!r}; shipped: "
                                       f"{available_profiles()}, or give the path of a JSON file")
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
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
                value < 0 if allow_zero else value <= 0):
            bound = ">= 0" if allow_zero else "> 0"
            raise HardwareProfileError(f"hardware profile {source!r}: {path} must be a number {bound}, got {value!r}")
        return float(value)

    sources = field("sources")
    if not isinstance(sources, dict) or not sources:
        raise HardwareProfileError(f"hardware profile {source!r}: sources must name where the figures come from "
                                   "(a field -> text map)")
    flops = field("peak_flops_per_s")
    if not isinstance(flops, dict) or not flops or not set(flops) <= set(_DTYPES):
        raise HardwareProfileError(f"hardware profile {source!r}: peak_flops_per_s must map some of "
                                   f"{sorted(_DTYPES)} to FLOP/s, got {flops!r}")
    node_size = field("node_size")
    if isinstance(node_size, bool) or not isinstance(node_size, int) or node_size < 1:
        raise HardwareProfileError(f"hardware profile {source!r}: node_size must be an int >= 1, got {node_size!r}")
    links = {name: Link(positive(f"links.{name}.bus_bytes_per_s"), positive(f"links.{name}.latency_s", True))
             for name in ("intra_node", "inter_node")}
    return HardwareProfile(
        name=str(field("name")),
        peak_flops_per_s={k: positive(f"peak_flops_per_s.{k}") for k in flops},
        memory_bytes_per_s=positive("memory_bytes_per_s"), memory_bytes=positive("memory_bytes"),
        op_overhead_s=positive("op_overhead_s", allow_zero=True), node_size=node_size,
        intra_node=links["intra_node"], inter_node=links["inter_node"], source=source)
