"""Cost model: the step time and exposed communication a compiled graph's schedule will have.

- **Collectives** cost ``latency_s + bytes * seconds_per_byte``, the two constants fitted per kind
  (all-gather, reduce-scatter, all-reduce, all-to-all) by least squares over eager collectives
  timed on the process group (``measure_collective_costs``), plus the same form for the time on the
  issuing thread. Every rank then takes the element-wise median of all ranks' constants, so
  every rank holds the same numbers: a schedule planned from them must be identical on all
  ranks (passes/README.md, invariant 1). Measured so, on one group, a collective is priced by its
  kind alone; a hardware profile prices it by its own group and link instead (``CollectivePricing``,
  ``zcompile.predict.hardware.LinkCosts``: ZeRO++'s intra-node collectives on the intra-node link).
- **Compute** costs a roofline per FX node: ``op_overhead_s + max(flops / flops_per_s,
  bytes / bytes_per_s)``, FLOPs from ``torch.utils.flop_counter``'s formulas, bytes the tensors the
  op reads and writes, both read from the nodes' ``meta["val"]``; throughput, bandwidth and the
  per-op dispatch overhead measured once (``measure_compute_costs``).
- **predict** walks a graph in its node order with one compute stream and one communication
  stream: a collective is issued at the current compute time (which then advances by its issue
  overhead) and its transfer queued behind earlier transfers, starting no earlier than the
  issue; ``wait_tensor`` blocks compute until its transfer has ended, and that wait is the
  exposed communication.
- **Contention**: a transfer progresses ``overlap_slowdown`` times slower while the rank computes
  than while it waits (``CollectiveCosts.overlap_slowdown``, measured by ``measure_collective_costs``
  as an all-gather's time under a matmul loop over its time alone). On a CPU, gloo's threads share
  the cores with compute, so a prefetched transfer runs far slower than alone: without this factor
  the model under-predicts the exposed communication of prefetched buckets. On a GPU it is about 1.

Bytes of a collective are ``zcompile.passes.collectives.CollectiveNode.bytes``: an all-gather moves
its output (input bytes x group size), the others their input. The model knows nothing of what runs
between graphs (autograd engine, guards, optimizer): ``zcompile.tune.calibration`` adds that from
one measured step, and a hardware profile may carry it as the host's time per graph call and per
parameter (``HardwareProfile.host_overhead_seconds``, which ``zcompile.simulate`` adds).
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import Protocol

import torch
import torch.distributed as dist
from torch.utils import flop_counter

from zcompile.common.process_group import DataParallelGroup, all_gather_eager, reduce_scatter_by_all_to_all
from zcompile.passes.collectives import ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, KINDS, REDUCE_SCATTER, WAIT, CollectiveNode
from zcompile.passes.liveness import tensor_bytes
from zcompile.passes.regions import called_subgraph

log = logging.getLogger(__name__)
DEFAULT_SIZES = (2**12, 2**15, 2**18, 2**22)  # bytes: from latency-bound to bandwidth-bound (gloo and NCCL)


# ----------------------------------------------------------------------------- costs
@dataclass(frozen=True)
class CollectiveCost:
    """Time of one collective of ``nbytes``: ``latency_s + nbytes * seconds_per_byte``.

    ``issue_seconds``, the same form: how long the issuing thread is busy before the call returns
    (the functional ops copy their input, gloo enqueues on the caller's thread, NCCL launches a
    kernel). It is charged to the compute stream while the transfer already runs.
    """

    latency_s: float = 0.0
    seconds_per_byte: float = 0.0
    issue_latency_s: float = 0.0
    issue_seconds_per_byte: float = 0.0

    def seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes * self.seconds_per_byte

    def issue_seconds(self, nbytes: int) -> float:
        return self.issue_latency_s + nbytes * self.issue_seconds_per_byte


@dataclass(frozen=True)
class CollectiveCosts:
    """One ``CollectiveCost`` per kind (``KINDS``) for a group of ``world_size`` ranks."""

    world_size: int = 1
    costs: dict[str, CollectiveCost] = field(default_factory=dict)
    overlap_slowdown: float = 1.0  # a transfer's time while the rank computes / its time alone

    def cost(self, kind: str) -> CollectiveCost:
        """A kind that was not measured costs nothing (a world of one communicates nothing)."""
        return self.costs.get(kind, CollectiveCost())

    def seconds(self, kind: str, nbytes: int) -> float:
        return self.cost(kind).seconds(nbytes)

    def cost_of(self, collective: CollectiveNode) -> CollectiveCost:
        """Measured on one group (``measure_collective_costs``): every collective priced by its kind."""
        return self.cost(collective.kind)

    def to_json(self) -> str:
        return json.dumps(
            {
                "world_size": self.world_size,
                "costs": {k: asdict(c) for k, c in self.costs.items()},
                "overlap_slowdown": self.overlap_slowdown,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> CollectiveCosts:
        data = json.loads(text)
        return cls(
            data["world_size"],
            {k: CollectiveCost(**c) for k, c in data["costs"].items()},
            data.get("overlap_slowdown", 1.0),
        )


class CollectivePricing(Protocol):
    """What ``predict`` asks of collective costs: a collective's cost, and the contention factor.

    ``CollectiveCosts`` (measured on the process group) prices by kind alone;
    ``zcompile.predict.hardware.LinkCosts`` (a hardware profile) by kind, group size and the link the
    group runs over, so ZeRO++'s intra-node collectives are priced on the intra-node link.
    """

    overlap_slowdown: float

    def cost_of(self, collective: CollectiveNode) -> CollectiveCost: ...


@dataclass(frozen=True)
class ComputeCosts:
    """Throughput of the device: matmul FLOP/s, memory bytes/s, and the fixed cost of one op call.

    ``op_overhead_s`` is the dispatch time of an op on tiny tensors: on a CPU running small
    models it is most of an op's time, and a pure roofline would miss it.

    Two op classes run slower than the roofline of matmuls and copies says, so each may have its own
    rate (0: the general one): ``attention_flops_per_s`` for the fused attention kernels
    (``ATTENTION_OPS``: their FLOPs below a matmul's rate on a CPU, and below a GPU's GEMM peak too),
    and ``transcendental_bytes_per_s`` for the element-wise ops that evaluate exp, erf or tanh,
    softmax and the normalizations (``TRANSCENDENTAL_OPS``): a CPU thread computing GELU, exp or
    softmax moves several times fewer bytes a second than its add or clone (a GPU's are all
    bandwidth-bound: its profile leaves the field out).
    """

    flops_per_s: float
    bytes_per_s: float
    op_overhead_s: float = 0.0
    attention_flops_per_s: float = 0.0
    transcendental_bytes_per_s: float = 0.0

    def seconds(self, flops: float, nbytes: float) -> float:
        return self.op_overhead_s + max(flops / self.flops_per_s, nbytes / self.bytes_per_s)

    def op_seconds(self, flops: float, nbytes: float, op_class: str = "") -> float:
        """One op of ``op_class`` (``op_class``: "attention", "transcendental" or anything else) at its
        class's rates."""
        flops_per_s = (self.attention_flops_per_s or self.flops_per_s) if op_class == "attention" else self.flops_per_s
        bytes_per_s = (
            (self.transcendental_bytes_per_s or self.bytes_per_s) if op_class == "transcendental" else self.bytes_per_s
        )
        return self.op_overhead_s + max(flops / flops_per_s, nbytes / bytes_per_s)

    def scaled(self, factor: float) -> ComputeCosts:
        """The same device ``factor`` times slower: every node's predicted time multiplied by ``factor``
        (``zcompile.tune.calibration`` fits it to a measured step)."""
        return ComputeCosts(
            self.flops_per_s / factor,
            self.bytes_per_s / factor,
            self.op_overhead_s * factor,
            self.attention_flops_per_s / factor,
            self.transcendental_bytes_per_s / factor,
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ComputeCosts:
        return cls(**json.loads(text))


def fit_linear(samples: Iterable[tuple[float, float]]) -> CollectiveCost:
    """Least-squares ``seconds = latency_s + nbytes * seconds_per_byte`` over ``(nbytes, seconds)``.

    A negative intercept (noise at small sizes) is clamped to 0 by refitting through the origin; a
    negative slope (no size dependence measurable) to 0 with the mean time as latency.
    """
    samples = [(float(x), float(y)) for x, y in samples]
    if not samples:
        return CollectiveCost()
    mean_x = math.fsum(x for x, _ in samples) / len(samples)
    mean_y = math.fsum(y for _, y in samples) / len(samples)
    sxx = math.fsum((x - mean_x) ** 2 for x, _ in samples)
    if sxx == 0.0:
        return CollectiveCost(max(mean_y, 0.0), 0.0)
    slope = math.fsum((x - mean_x) * (y - mean_y) for x, y in samples) / sxx
    latency = mean_y - slope * mean_x
    if latency < 0.0:
        slope = math.fsum(x * y for x, y in samples) / math.fsum(x * x for x, _ in samples)
        latency = 0.0
    if slope < 0.0:
        return CollectiveCost(max(mean_y, 0.0), 0.0)
    return CollectiveCost(latency, slope)


# ----------------------------------------------------------------------------- measuring
def _median_seconds(fn: Callable[[], object], repeats: int, warmup: int, sync: Callable[[], None]) -> float:
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _sync_for(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def _group_device(group: DataParallelGroup) -> torch.device:
    """Where the group's collectives run: the current GPU for NCCL, else the CPU."""
    if "nccl" in str(dist.get_backend(group.process_group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _agree(values: list[float], group: DataParallelGroup, device: torch.device) -> list[float]:
    """Element-wise median of every rank's ``values``: the same list on every rank."""
    local = torch.tensor(values, dtype=torch.float64, device=device)
    gathered = torch.empty(group.world_size * len(values), dtype=torch.float64, device=device)
    all_gather_eager(gathered, local, group)
    rows = gathered.view(group.world_size, len(values)).cpu().tolist()
    return [statistics.median(column) for column in zip(*rows)]


def _issue_call(kind: str, nbytes: int, group: DataParallelGroup, device: torch.device) -> Callable[[], torch.Tensor]:
    """Issues a collective of ``kind`` moving ``nbytes`` as ``CollectiveNode.bytes`` counts them (fp32).

    Through the functional ops the compiled graphs call, run eagerly: what is timed is what the
    graphs run, issue and wait apart; a reduce-scatter in the form the graphs run it by default
    (``process_group.reduce_scatter_by_all_to_all``, option ``"auto"``: the sum of the received rows
    is compute, priced with the graph's other ops).
    """
    world, name = group.world_size, group.name
    numel = -(-nbytes // (4 * world)) * world  # fp32 elements, divisible by the group size
    full = torch.ones(numel, device=device)
    part = torch.ones(numel // world, device=device)
    if kind == "all_gather":  # moves its output: ``numel``
        return lambda: ALL_GATHER(part, world, name)
    if kind == "reduce_scatter" and reduce_scatter_by_all_to_all("auto", group):
        splits = [numel // world] * world
        return lambda: ALL_TO_ALL(full, splits, splits, name)
    if kind == "reduce_scatter":  # moves its input: ``numel``
        return lambda: REDUCE_SCATTER(full, "sum", world, name)
    if kind == "all_reduce":
        return lambda: ALL_REDUCE(full, "sum", name)
    if kind == "all_to_all":
        splits = [numel // world] * world
        return lambda: ALL_TO_ALL(full, splits, splits, name)
    raise ValueError(f"zcompile: unknown collective kind {kind!r}; give one of {KINDS}")


def _time_collective(issue: Callable[[], torch.Tensor], sync: Callable[[], None]) -> tuple[float, float]:
    """(seconds until the call returns, seconds until the result is there) of one collective."""
    start = time.perf_counter()
    out = issue()
    returned = time.perf_counter() - start
    WAIT(out)
    sync()
    return returned, time.perf_counter() - start


def measure_collective_costs(
    group: dist.ProcessGroup | None = None,
    sizes: tuple[int, ...] = DEFAULT_SIZES,
    repeats: int = 5,
    warmup: int = 1,
    kinds: tuple[str, ...] = KINDS,
    measure_overlap: bool = True,
) -> CollectiveCosts:
    """Fits ``CollectiveCost`` per kind from eager collectives of ``sizes`` bytes; agreed across ranks.

    Per kind: ``warmup`` calls of each size, then ``repeats`` rounds over the sizes, each call
    after a barrier (the ranks start together) and timed until it returns and until its result
    is there; the median per size of each is fitted by ``fit_linear``. Rounds interleave the
    sizes so that a burst of load on a shared machine spreads over all sizes instead of bending
    the line at one. The constants of all ranks are all-gathered and every rank keeps their
    element-wise median. ``measure_overlap``: also the contention factor ``overlap_slowdown``
    (``_overlap_slowdown``). A kind whose agreed fit has no cost per byte (its time did not grow
    with its size: a burst of load on a shared machine) is measured again, up to ``MEASURE_AGAIN``
    times, then kept with a warning: priced as free bandwidth it would mislead the tuner. Without a
    process group, or in a group of one, every collective costs 0. Collective: every rank of
    ``group`` must call it with the same arguments.
    """
    resolved = DataParallelGroup.resolve(group)
    if resolved.world_size == 1:
        return CollectiveCosts(1, {kind: CollectiveCost() for kind in kinds})
    device = _group_device(resolved)
    sync = _sync_for(device)
    local = [value for kind in kinds for value in _measure_kind(kind, sizes, repeats, warmup, resolved, device, sync)]
    local.append(_overlap_slowdown(resolved, device, max(sizes), repeats) if measure_overlap else 1.0)
    agreed = _agree(local, resolved, device)
    costs = {kind: CollectiveCost(*agreed[4 * i : 4 * i + 4]) for i, kind in enumerate(kinds)}
    # a time that did not grow with the size is the machine's noise (a burst of load at the larger sizes),
    # not a free transfer: measured again, on every rank alike (they hold the same agreed costs)
    for _ in range(MEASURE_AGAIN):
        flat = [kind for kind, cost in costs.items() if cost.seconds_per_byte <= 0.0]
        if not flat:
            break
        log.info("cost model: the time of %s did not grow with its size (noise): measured again", ", ".join(flat))
        measured = [
            value for kind in flat for value in _measure_kind(kind, sizes, repeats, warmup, resolved, device, sync)
        ]
        again = _agree(measured, resolved, device)
        costs.update({kind: CollectiveCost(*again[4 * i : 4 * i + 4]) for i, kind in enumerate(flat)})
    flat = [kind for kind, cost in costs.items() if cost.seconds_per_byte <= 0.0]
    if flat:
        log.warning(
            "zcompile: in the cost model, the time of %s did not grow with its size in %d measurements (this "
            "machine is too busy to measure it): priced by its latency alone, as if bandwidth were free; "
            "measure again when the machine is idle",
            ", ".join(flat),
            MEASURE_AGAIN + 1,
        )
    log.info(
        "cost model: collectives on %d ranks: %s; %.2fx slower under compute",
        resolved.world_size,
        ", ".join(
            f"{k} {c.latency_s * 1e6:.1f} us + {c.seconds_per_byte * 1e9:.3f} ns/B (issue "
            f"{c.issue_latency_s * 1e6:.1f} us)"
            for k, c in costs.items()
        ),
        agreed[-1],
    )
    return CollectiveCosts(resolved.world_size, costs, max(agreed[-1], 1.0))


MEASURE_AGAIN = 2  # further measurements of a collective whose time did not grow with its size


def _measure_kind(
    kind: str,
    sizes: tuple[int, ...],
    repeats: int,
    warmup: int,
    group: DataParallelGroup,
    device: torch.device,
    sync: Callable[[], None],
) -> list[float]:
    """This rank's fit of one collective ``kind``: [latency, seconds per byte] until its result is
    there, then until the call returns (``measure_collective_costs``)."""
    calls = [_issue_call(kind, nbytes, group, device) for nbytes in sizes]
    for call in calls:
        for _ in range(warmup):
            WAIT(call())
    sync()
    timings = [[] for _ in sizes]  # per size: (returned, done) of each round
    for _ in range(repeats):
        for call, timed in zip(calls, timings):
            dist.barrier(group=group.process_group)
            timed.append(_time_collective(call, sync))
    returned = [(n, statistics.median(r for r, _ in timed)) for n, timed in zip(sizes, timings)]
    done = [(n, statistics.median(d for _, d in timed)) for n, timed in zip(sizes, timings)]
    transfer, issue = fit_linear(done), fit_linear(returned)
    log.debug("cost model: rank %d %s: done %s, returned %s", group.rank, kind, done, returned)
    return [transfer.latency_s, transfer.seconds_per_byte, issue.latency_s, issue.seconds_per_byte]


MAX_OVERLAP_SLOWDOWN = 100.0  # a transfer that does not progress while the rank computes: serial


def _overlap_slowdown(group: DataParallelGroup, device: torch.device, nbytes: int, repeats: int) -> float:
    """The slowdown at which ``predict``'s contention model reproduces a measured overlap: an all-gather
    of ``nbytes`` alone (``M``), a loop of small matmuls about as long alone (``C``), and the two
    together (``T``: issue, compute, wait), medians of ``repeats``. The model moves a transfer at
    ``1 / s`` of its speed while the rank computes, so overlapping hides ``min(M, C / s)`` and
    ``s = C / (C + M - T)``; at least 1, at most ``MAX_OVERLAP_SLOWDOWN`` (nothing hidden, or the
    two together slower than one after the other: where gloo's threads and the ranks' compute share
    a CPU's cores, a small all-gather may hide nothing). 1.0 on a GPU
    (the copy engines do not share the compute's cores; its kernels would only be queued here)."""
    if device.type != "cpu":
        return 1.0
    numel = -(-nbytes // (4 * group.world_size))
    out, shard = torch.empty(numel * group.world_size), torch.ones(numel)
    a = torch.randn(96, 96)

    def gather():
        all_gather_eager(out, shard, group, async_op=True).wait()

    def compute(calls: int):
        for _ in range(calls):
            torch.mm(a, a)

    def timed(fn) -> float:
        times = []
        for _ in range(repeats):
            dist.barrier(group=group.process_group)
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def both(calls: int):
        work = all_gather_eager(out, shard, group, async_op=True)
        compute(calls)
        work.wait()

    transfer = timed(gather)
    per_call = _median_seconds(lambda: compute(50), repeats, 1, lambda: None) / 50
    calls = max(1, round(transfer / per_call))
    computing = timed(lambda: compute(calls))
    hidden = computing + transfer - timed(lambda: both(calls))
    if hidden <= computing / MAX_OVERLAP_SLOWDOWN:
        return MAX_OVERLAP_SLOWDOWN
    return min(max(computing / hidden, 1.0), MAX_OVERLAP_SLOWDOWN)


def measure_compute_costs(
    device: torch.device | str | None = None,
    matmul_size: int = 512,
    copy_bytes: int = 2**22,
    repeats: int = 5,
    dtype: torch.dtype = torch.float32,
    group: dist.ProcessGroup | None = None,
    attention_shape: tuple[int, int, int, int] = (4, 4, 128, 32),
) -> ComputeCosts:
    """Matmul FLOP/s (``matmul_size`` square, ``dtype``), memory bandwidth, op dispatch overhead,
    causal attention's FLOP/s (``attention_shape``: batch, heads, sequence, head dim) and the
    bandwidth of the transcendental ops on ``device``, each the median of ``repeats`` runs.

    The bandwidth is that of ``clone`` of ``copy_bytes`` (bytes read + written): like the graphs'
    ops it allocates its output, which on a CPU costs page faults a copy into a warm buffer does not.
    The transcendental ops' is the median over GELU, exp, softmax and layer norm of ``copy_bytes``
    (``TRANSCENDENTAL_OPS``, bytes read + written), the attention's FLOPs ``flop_counter``'s formula,
    as ``node_flops`` counts them.

    In an initialized process group the numbers are agreed like the collectives' (element-wise
    median over ranks), so predictions that drive decisions are the same on every rank; then
    every rank of ``group`` must call it.
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    sync = _sync_for(device)
    n = matmul_size
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    product = torch.empty(n, n, device=device, dtype=dtype)
    matmul_s = _median_seconds(lambda: torch.mm(a, b, out=product), repeats, 1, sync)
    src = torch.ones(copy_bytes // 4, device=device)
    copy_s = _median_seconds(src.clone, repeats, 1, sync)
    tiny, calls = torch.ones(1, device=device), 100
    add = torch.ops.aten.add.Tensor  # called as the graphs' code calls ops: through the OpOverload

    def dispatch():
        for _ in range(calls):
            add(tiny, tiny)

    overhead_s = _median_seconds(dispatch, repeats, 1, sync) / calls
    heads = torch.randn(attention_shape, device=device, dtype=dtype)
    attention_s = _median_seconds(
        lambda: torch.nn.functional.scaled_dot_product_attention(heads, heads, heads, is_causal=True), repeats, 1, sync
    )
    attention_flops = flop_counter.sdpa_flop_count(heads.shape, heads.shape, heads.shape)
    rows = torch.randn(copy_bytes // (4 * 512), 512, device=device, dtype=dtype)
    weight, bias = torch.ones(512, device=device, dtype=dtype), torch.zeros(512, device=device, dtype=dtype)
    aten = torch.ops.aten
    transcendental = [
        lambda: aten.gelu.default(rows),
        lambda: aten.exp.default(rows),
        lambda: aten._softmax.default(rows, -1, False),
        lambda: aten.native_layer_norm.default(rows, [512], weight, bias, 1e-5),
    ]
    transcendental_s = statistics.median(_median_seconds(op, repeats, 1, sync) for op in transcendental)
    values = [
        2 * n**3 / matmul_s,
        2 * src.numel() * 4 / copy_s,
        overhead_s,
        attention_flops / attention_s,
        2 * rows.numel() * rows.element_size() / transcendental_s,
    ]
    resolved = DataParallelGroup.resolve(group)
    if resolved.world_size > 1:
        values = _agree(values, resolved, _group_device(resolved))
    costs = ComputeCosts(*values)
    log.info(
        "cost model: compute on %s: %.1f GFLOP/s (attention %.1f), %.1f GB/s (transcendental %.1f), %.1f us per op",
        device,
        costs.flops_per_s / 1e9,
        costs.attention_flops_per_s / 1e9,
        costs.bytes_per_s / 1e9,
        costs.transcendental_bytes_per_s / 1e9,
        costs.op_overhead_s * 1e6,
    )
    return costs


# ----------------------------------------------------------------------------- per node
def _vals(node: torch.fx.Node):
    """The node's args and kwargs with every input node replaced by its ``meta["val"]``."""
    return torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))


# flop_counter has formulas for the CUDA attention kernels, not for the CPU one the graphs hold on a CPU
_EXTRA_FLOPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default: lambda q, k, v, *_, **__: (
        flop_counter.sdpa_flop_count(q.shape, k.shape, v.shape)
    ),
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default: lambda grad, q, k, v, *_, **__: (
        flop_counter.sdpa_backward_flop_count(grad.shape, q.shape, k.shape, v.shape)
    ),
}


# the aten attention kernels (by overload packet name), priced at ``ComputeCosts.attention_flops_per_s``
ATTENTION_OPS = frozenset(
    f"_scaled_dot_product_{kind}{suffix}"
    for kind in (
        "flash_attention",
        "flash_attention_for_cpu",
        "efficient_attention",
        "cudnn_attention",
        "fused_attention_overrideable",
    )
    for suffix in ("", "_backward")
)
# element-wise ops evaluating exp, log, erf or tanh, softmax and normalizations (with their
# backwards): compute-bound on a CPU thread, priced at ``ComputeCosts.transcendental_bytes_per_s``
TRANSCENDENTAL_OPS = frozenset(
    [
        f"{op}{suffix}"
        for op in ("gelu", "silu", "sigmoid", "tanh", "elu", "softplus", "mish")
        for suffix in ("", "_backward")
    ]
    + [
        "exp",
        "exp2",
        "expm1",
        "log",
        "log1p",
        "log2",
        "erf",
        "erfinv",
        "sin",
        "cos",
        "_softmax",
        "_softmax_backward_data",
        "_log_softmax",
        "_log_softmax_backward_data",
        "cross_entropy_backward",  # zcompile::cross_entropy_backward (passes/loss_backward.py)
        "native_layer_norm",
        "native_layer_norm_backward",
        "_fused_rms_norm",
        "_fused_rms_norm_backward",
        "native_group_norm",
        "native_group_norm_backward",
        "native_batch_norm",
        "native_batch_norm_backward",
        "_native_batch_norm_legit",
        "_native_batch_norm_legit_functional",
        "_native_batch_norm_legit_no_training",
    ]
)


def node_flops(node: torch.fx.Node) -> int:
    """FLOPs of an aten node by ``torch.utils.flop_counter``'s formulas; 0 for ops without one."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return 0
    (args, kwargs) = _vals(node)
    try:
        if target in _EXTRA_FLOPS:
            return int(_EXTRA_FLOPS[target](*args, **kwargs))
        formula = flop_counter.flop_registry.get(target.overloadpacket)
        return 0 if formula is None else int(formula(*args, **kwargs, out_val=node.meta.get("val")))
    except (AttributeError, TypeError, AssertionError, RuntimeError) as error:  # a val missing or not a tensor
        log.debug("cost model: no FLOPs for %s (%s)", node.name, error)
        return 0


def node_bytes(node: torch.fx.Node) -> int:
    """Bytes an aten node reads (its tensor inputs) and writes (its tensor outputs); 0 for a view."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or target.is_view:
        return 0
    return tensor_bytes(_vals(node)) + tensor_bytes(node.meta.get("val"))


def node_seconds(node: torch.fx.Node, compute: ComputeCosts) -> float:
    """Predicted compute time of one node; 0 for placeholders, outputs and Python calls (getitem).
    A call of a subgraph (a block of ``zcompile.mark_repeated_blocks``) costs its nodes'."""
    subgraph = called_subgraph(node.graph.owning_module, node) if node.graph.owning_module is not None else None
    if subgraph is not None:
        return sum(node_seconds(inner, compute) for inner in subgraph.graph.nodes)
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return 0.0
    return compute.op_seconds(node_flops(node), node_bytes(node), op_class(node))


def op_class(node: torch.fx.Node) -> str:
    """ "attention" (``ATTENTION_OPS``), "transcendental" (``TRANSCENDENTAL_OPS``) or "" (the rest)."""
    target = node.target
    name = target.overloadpacket.__name__ if isinstance(target, torch._ops.OpOverload) else ""
    return "attention" if name in ATTENTION_OPS else "transcendental" if name in TRANSCENDENTAL_OPS else ""


# ----------------------------------------------------------------------------- prediction
@dataclass(frozen=True)
class PredictedCollective:
    graph: str
    name: str
    kind: str
    bytes: int
    issue_s: float  # compute time when it was issued
    start_s: float  # when the transfer starts: issued, and the transfers before it done
    end_s: float
    waited_s: float  # how long compute blocked on it at its wait
    seconds: float = 0.0  # its transfer time at full speed (the cost it was priced at)


@dataclass
class Prediction:
    """Predicted timeline of a graph (or of a step: several graphs back to back)."""

    graph: str
    step_s: float = 0.0  # = compute_s + issue_s + exposed_comm_s
    compute_s: float = 0.0  # the nodes' compute
    issue_s: float = 0.0  # the compute stream busy issuing collectives
    comm_s: float = 0.0  # transfer time, hidden or not
    exposed_comm_s: float = 0.0  # time compute blocked on communication
    collectives: list[PredictedCollective] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)


@dataclass
class _Transfer:
    record: int  # index of its PredictedCollective
    remaining_s: float  # transfer time left at full speed
    start_s: float | None = None


@dataclass
class _CommStream:
    """The communication stream of one prediction: transfers one at a time in issue order, each
    ``slowdown`` times slower while compute runs than while compute waits for one of them."""

    slowdown: float
    now: float = 0.0
    queue: list[_Transfer] = field(default_factory=list)
    ended: dict[int, tuple[float, float]] = field(default_factory=dict)  # record -> (start, end)

    def advance(self, until: float, computing: bool) -> None:
        rate = 1.0 / self.slowdown if computing else 1.0
        while self.queue and self.now < until:
            head = self.queue[0]
            head.start_s = self.now if head.start_s is None else head.start_s
            finish = self.now + head.remaining_s / rate
            if finish > until:
                head.remaining_s -= (until - self.now) * rate
                break
            self.now = finish
            self.ended[head.record] = (head.start_s, finish)
            self.queue.pop(0)
        self.now = max(self.now, until)

    def drain_until(self, record: int | None = None) -> float:
        """When transfer ``record`` (None: every transfer) ends if compute waits for it from ``now``."""
        left = 0.0
        for transfer in self.queue:
            left += transfer.remaining_s
            if transfer.record == record:
                break
        return self.now + left


def predict(
    gm: torch.fx.GraphModule, collectives: CollectivePricing, compute: ComputeCosts, graph: str = ""
) -> Prediction:
    """Simulates ``gm`` in its node order on one compute stream and one communication stream.

    A transfer still running when the graph's compute ends (a collective never waited) extends
    the step and counts as exposed.
    """
    clock = compute_s = issue_s = comm_s = exposed = 0.0
    stream = _CommStream(collectives.overlap_slowdown)
    records: list[PredictedCollective] = []
    pending: dict[torch.fx.Node, int] = {}  # collective node -> index of its record
    for node in gm.graph.nodes:
        collective = CollectiveNode.of(node)
        if collective is not None:
            nbytes, cost = collective.bytes, collectives.cost_of(collective)
            duration, issue = cost.seconds(nbytes), cost.issue_seconds(nbytes)
            pending[node] = len(records)
            records.append(
                PredictedCollective(graph, node.name, collective.kind, nbytes, clock, clock, clock, 0.0, duration)
            )
            stream.queue.append(_Transfer(len(records) - 1, duration))
            stream.advance(clock + issue, computing=True)
            comm_s += duration
            clock += issue
            issue_s += issue
        elif node.op == "call_function" and node.target is WAIT:
            index = pending.pop(node.args[0], None)
            if index is not None and index not in stream.ended:
                end = stream.drain_until(index)
                stream.advance(end, computing=False)
                records[index] = replace(records[index], waited_s=end - clock)
                exposed += end - clock
                clock = end
        else:
            seconds = node_seconds(node, compute)
            stream.advance(clock + seconds, computing=True)
            clock += seconds
            compute_s += seconds
    end = stream.drain_until()
    stream.advance(end, computing=False)
    tail = end - clock
    for index, (start, finish) in stream.ended.items():
        records[index] = replace(records[index], start_s=start, end_s=finish)
    prediction = Prediction(graph, clock + tail, compute_s, issue_s, comm_s, exposed + tail, records)
    log.debug(
        "cost model (%s): step %.3f ms, compute %.3f ms, comm %.3f ms, exposed %.3f ms",
        graph,
        prediction.step_s * 1e3,
        compute_s * 1e3,
        comm_s * 1e3,
        prediction.exposed_comm_s * 1e3,
    )
    return prediction


@dataclass(frozen=True)
class StepGraph:
    """One graph of a step: ``where`` (forward or backward), the index of its compile, the graph."""

    where: str
    index: int
    gm: torch.fx.GraphModule

    @property
    def name(self) -> str:
        """``forward0``, ``backward2``: the ``graph`` of its ``PredictedCollective`` records."""
        return f"{self.where}{self.index}"


def step_graphs(compiled_graphs: Iterable) -> list[StepGraph]:
    """The graphs of one step in the order they run: forward graphs in compile order, then backward
    graphs in reverse (autograd's order); graphs not compiled yet (``None``) left out."""
    compiled_graphs = list(compiled_graphs)
    parts = [StepGraph("forward", i, g.forward) for i, g in enumerate(compiled_graphs)]
    parts += [StepGraph("backward", i, g.backward) for i, g in reversed(list(enumerate(compiled_graphs)))]
    return [part for part in parts if part.gm is not None]


def predict_step(compiled_graphs: Iterable, collectives: CollectivePricing, compute: ComputeCosts) -> Prediction:
    """The graphs of ``step_graphs`` predicted back to back.

    ``compiled_graphs``: the ``CompiledGraphs`` passed to ``on_compile``. Times of the collectives
    are on the step's clock.
    """
    total = Prediction("step")
    for graph in step_graphs(compiled_graphs):
        part = predict(graph.gm, collectives, compute, graph.name)
        offset = total.step_s
        total.collectives += [
            replace(c, issue_s=c.issue_s + offset, start_s=c.start_s + offset, end_s=c.end_s + offset)
            for c in part.collectives
        ]
        total.step_s += part.step_s
        total.compute_s += part.compute_s
        total.issue_s += part.issue_s
        total.comm_s += part.comm_s
        total.exposed_comm_s += part.exposed_comm_s
    return total
