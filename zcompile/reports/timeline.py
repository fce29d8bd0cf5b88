"""One training step under the profiler: a Chrome/Perfetto trace, its collectives and its memory.

``record_step(step_fn, out_dir)`` runs ``step_fn()`` (forward, backward, optimizer step) under
``torch.profiler``, writes ``out_dir/rank{R}.trace.json`` (open it in https://ui.perfetto.dev or
chrome://tracing) and reads the trace back into a ``TimelineResult``; ``read_trace(path)`` does
the reading alone, for a trace already on disk. ``plot_memory`` draws the memory series with the
communication shaded (needs matplotlib: ``pip install zcompile[inspect]``).

What the profiler records for a collective (torch 2.13, gloo, CPU; a stage-3 step of the
example GPT on 2 ranks), one level inside the other:

- ``_c10d_functional::all_gather_into_tensor`` / ``_c10d_functional::reduce_scatter_tensor`` /
  ``_c10d_functional::all_reduce``: the graph's functional collective, on the issuing thread;
  it returns at once. On gloo the graphs' all-gathers run as ``all_gather_into_tensor_out``
  (``passes/all_gather_lowering.py``), read as all-gathers all the same.
- inside it, ``c10d::allgather_into_tensor_coalesced_`` / ``c10d::reduce_scatter_tensor_coalesced_``:
  the process-group op. Eager calls (the stage 1 and 2 optimizer step) appear only at this
  level: its all-gather into the parameters as ``c10d::allgather_into_tensor_coalesced_``, stage
  1's gradient reduction as ``c10d::alltoall_base_`` on gloo and ``c10d::_reduce_scatter_base_``
  elsewhere.
- ``gloo:all_gather`` / ``gloo:all_to_all``: the transfer itself, on gloo's worker threads. On gloo
  the graphs' reduce-scatters run as all-to-alls (``passes/reduce_scatter_lowering.py``), so they
  show up here as all-to-alls.
- ``_c10d_functional::wait_tensor``: the issuing thread blocked until the result is there. The
  blocking ``Work.wait()`` of eager synchronous collectives records no event on gloo.
- no ``record_param_comms`` events on gloo (NCCL builds record them; they are read here too).

``collectives`` keeps one event per collective issued (the outermost functional or c10d event on
its thread) and one per wait; ``transfers`` keeps the backend's own events (``gloo:*``, NCCL's
kernels and ``record_param_comms``), named by what the backend ran.

The memory series is the running sum of the trace's ``[memory]`` events (one per allocation and
free, ``Bytes`` < 0 for a free), from every thread, on the GPU when the trace has GPU memory
events, else on the CPU. It is relative to the start of the step: the CPU allocator reports to
the profiler only while it records, so memory allocated before the step (parameters, optimizer
state) is not in it, and a free of such memory makes the series go down.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from zcompile.passes.collectives import KINDS

log = logging.getLogger(__name__)

STEP_ANNOTATION = "zcompile.record_step"
MEMORY_EVENT = "[memory]"
WAIT = "wait"  # the kind of a wait event (the collectives' kinds are ``passes.collectives.KINDS``)

_ISSUE_PREFIXES = ("_c10d_functional::", "c10d_functional::", "c10d::")
_BACKEND_PREFIXES = ("gloo:", "nccl:", "nccl")  # "nccl" without colon: the GPU kernels (ncclDevKernel_...)
_CPU_DEVICE_TYPES = {0, 2, 5}  # c10::DeviceType CPU, MKLDNN, IDEEP
_DEVICE_NAMES = {1: "cuda", 6: "hip", 12: "xpu", 20: "privateuse1"}


@dataclass(frozen=True)
class CollectiveEvent:
    name: str  # the profiler's event name
    kind: str  # all_gather | reduce_scatter | all_reduce | wait
    start_us: float  # from the start of the step
    duration_us: float
    thread: int


@dataclass
class TimelineResult:
    trace_path: str
    rank: int
    step_us: float  # duration of the step (0.0 when the trace has no step annotation)
    collectives: list[CollectiveEvent]  # one per collective issued and one per wait, in time order
    transfers: list[CollectiveEvent]  # the backend's events (data moving), in time order
    wait_us: float  # time covered by wait events: communication the step waited for
    memory: list[tuple[float, int]] = field(default_factory=list)  # (time_us, bytes allocated since step start)
    memory_device: str = "cpu"

    @property
    def peak_bytes(self) -> int:
        return max((allocated for _, allocated in self.memory), default=0)

    def count(self, kind: str) -> int:
        """How many collectives of ``kind`` (or waits, ``kind="wait"``) the step issued."""
        return sum(event.kind == kind for event in self.collectives)


def classify(name: str, args: dict | None = None) -> tuple[str, str] | None:
    """``(kind, level)`` of a profiler event name, level ``"issue"`` or ``"backend"``; None if not a collective.

    ``record_param_comms`` events name their collective in the ``Collective name`` argument.
    """
    if name == "record_param_comms":
        kind = _kind_from(str((args or {}).get("Collective name", "")))
        return (kind, "backend") if kind else None
    lowered = name.lower()
    if lowered.startswith(_ISSUE_PREFIXES):
        level = "issue"
    elif lowered.startswith(_BACKEND_PREFIXES):
        level = "backend"
    else:
        return None
    kind = WAIT if level == "issue" and "wait" in lowered else _kind_from(lowered)
    return (kind, level) if kind else None


_SQUASHED_KINDS = {kind.replace("_", ""): kind for kind in KINDS}  # "allgather" -> "all_gather", ...


def _kind_from(name: str) -> str | None:
    """The collective a name speaks of, whatever its spelling (``allgather_``, ``AllGather``, ``all_gather``)."""
    squashed = re.sub(r"[^a-z]", "", name.lower())
    return next((kind for key, kind in _SQUASHED_KINDS.items() if key in squashed), None)


def record_step(step_fn: Callable[[], Any], out_dir: str | os.PathLike, rank: int | None = None) -> TimelineResult:
    """Profiles one call of ``step_fn`` and writes ``out_dir/rank{R}.trace.json``; returns what it holds.

    ``rank`` defaults to the ``torch.distributed`` rank (0 without a process group). Run a
    warm-up step first: a first step also compiles, and its trace is mostly Dynamo.
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    if rank is None:
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        rank = torch.distributed.get_rank() if distributed else 0
    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(os.fspath(out_dir), f"rank{rank}.trace.json")
    with profile(activities=activities, profile_memory=True, record_shapes=True, with_stack=False) as prof:
        with record_function(STEP_ANNOTATION):
            step_fn()
            if cuda:
                torch.cuda.synchronize()  # the step ends when its kernels have
    prof.export_chrome_trace(path)
    result = read_trace(path, rank)
    log.info(
        "timeline: rank %d step %.1f ms, %d collectives issued, %.1f ms waited, peak +%.2f MiB (%s); trace %s",
        rank,
        result.step_us / 1e3,
        len(result.collectives) - result.count(WAIT),
        result.wait_us / 1e3,
        result.peak_bytes / 2**20,
        result.memory_device,
        path,
    )
    return result


def read_trace(path: str | os.PathLike, rank: int = 0) -> TimelineResult:
    """Collectives, waits, transfers and the memory series of a Chrome trace written by ``torch.profiler``."""
    with open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    spans = [e for e in events if e.get("ph") == "X" and "ts" in e]
    step = next((e for e in spans if e.get("name") == STEP_ANNOTATION), None)
    origin = step["ts"] if step else min((e["ts"] for e in events if "ts" in e), default=0.0)

    issued, transfers = [], []
    for e in spans:
        found = classify(e.get("name", ""), e.get("args"))
        if found is None:
            continue
        kind, level = found
        event = CollectiveEvent(e["name"], kind, e["ts"] - origin, float(e.get("dur", 0.0)), int(e.get("tid", 0)))
        (transfers if level == "backend" else issued).append(event)
    collectives = _outermost(issued)
    waits = [(e.start_us, e.start_us + e.duration_us) for e in collectives if e.kind == WAIT]
    memory, device = memory_series(events, origin)
    return TimelineResult(
        trace_path=os.fspath(path),
        rank=rank,
        step_us=float(step.get("dur", 0.0)) if step else 0.0,
        collectives=collectives,
        transfers=sorted(transfers, key=lambda e: e.start_us),
        wait_us=_covered(waits),
        memory=memory,
        memory_device=device,
    )


def _outermost(events: list[CollectiveEvent]) -> list[CollectiveEvent]:
    """Drops issue events nested in another one on the same thread (the c10d op inside the functional op)."""
    kept, open_until = [], {}  # thread -> end of the outermost issue event still open
    for event in sorted(events, key=lambda e: (e.start_us, -e.duration_us)):
        end = event.start_us + event.duration_us
        if event.kind != WAIT and event.start_us < open_until.get(event.thread, float("-inf")):
            continue
        if event.kind != WAIT:
            open_until[event.thread] = end
        kept.append(event)
    return kept


def _covered(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of ``intervals``."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def memory_series(events: list[dict], origin: float = 0.0) -> tuple[list[tuple[float, int]], str]:
    """``([(time_us, bytes allocated since origin), ...], device)`` from a trace's ``[memory]`` events.

    Starts with ``(0.0, 0)``. GPU events are used when there are any, else CPU ones.
    """
    records = [e for e in events if e.get("name") == MEMORY_EVENT and "Bytes" in e.get("args", {})]
    device_types = {int(e["args"].get("Device Type", 0)) for e in records}
    gpu = sorted(device_types - _CPU_DEVICE_TYPES)
    if gpu:
        device = _DEVICE_NAMES.get(gpu[0], f"device{gpu[0]}")
        chosen = [e for e in records if int(e["args"].get("Device Type", 0)) == gpu[0]]
    else:
        device, chosen = "cpu", records
    series, allocated = [(0.0, 0)], 0
    for e in sorted(chosen, key=lambda e: e["ts"]):
        allocated += int(e["args"]["Bytes"])
        series.append((e["ts"] - origin, allocated))
    return series, device


_COLORS = {
    "all_gather": "tab:blue",
    "reduce_scatter": "tab:orange",
    "all_reduce": "tab:green",
    "all_to_all": "tab:purple",
    WAIT: "tab:red",
}


def plot_memory(result: TimelineResult, path_png: str | os.PathLike) -> None:
    """PNG of the memory allocated over the step, waits shaded, and one lane per kind of transfer below."""
    try:
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError(
            "zcompile.timeline.plot_memory: matplotlib is not installed (pip install zcompile[inspect])"
        ) from error

    fig = Figure(figsize=(12, 5.5), layout="constrained")
    ax, lanes = fig.subplots(2, 1, sharex=True, height_ratios=[3, 1])
    waits = [e for e in result.collectives if e.kind == WAIT]
    for event in waits:
        ax.axvspan(
            event.start_us / 1e3,
            (event.start_us + event.duration_us) / 1e3,
            color=_COLORS[WAIT],
            alpha=0.15,
            linewidth=0,
        )
    ax.step(
        [t / 1e3 for t, _ in result.memory],
        [b / 2**20 for _, b in result.memory],
        where="post",
        color="black",
        linewidth=1,
    )
    ax.set_ylabel(f"{result.memory_device} MiB allocated\nsince step start")
    ax.set_title(
        f"rank {result.rank}: step {result.step_us / 1e3:.1f} ms, peak +{result.peak_bytes / 2**20:.2f} MiB, "
        f"waited {result.wait_us / 1e3:.1f} ms (shaded)"
    )
    rows = [(f"wait ({len(waits)})", WAIT, waits)]
    for kind in KINDS:
        events = [e for e in result.transfers if e.kind == kind]
        if events:
            names = ", ".join(sorted({e.name for e in events}))
            rows.append((f"{names} ({len(events)})", kind, events))
    for y, (_, kind, events) in enumerate(rows):
        lanes.broken_barh(
            [(e.start_us / 1e3, e.duration_us / 1e3) for e in events], (y - 0.4, 0.8), color=_COLORS[kind], linewidth=0
        )
    lanes.set_yticks(range(len(rows)), [label for label, _, _ in rows], fontsize="small")
    lanes.set_ylim(len(rows) - 0.5, -0.5)
    lanes.set_xlabel("time since step start (ms)")
    fig.savefig(path_png, dpi=100)
    log.info("timeline: memory plot written to %s", path_png)
