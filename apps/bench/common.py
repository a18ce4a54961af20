"""What a benchmark case is, and how it is timed.

A Case says how to build inputs for a shape, the ref and minfer callables, and how many bytes and
FLOPs one call must move/do at least (the floor). The harness times each side with rotated input
sets (so HBM is measured, not L2), inside a CUDA graph (so launch gaps do not count), and reports
the median. A replay cycles through the sets until it holds at least MIN_CALLS calls: the graph's own
start (~2 µs of GPU time) is then spread over that many calls instead of over the 1-8 sets that a
large shape gets, and a call is timed as it runs in a stream of calls (an engine's decode graph
replays hundreds of kernels). Each shape first runs for WARMUP_S, so that its timing starts from
settled clocks.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass
class Case:
    shapes: list[tuple]  # default sweep
    make_inputs: Callable[[tuple, torch.dtype], dict]  # shape, dtype -> kwargs (fresh random CUDA tensors)
    ref: Callable[..., object]  # the reference: torch eager / cuBLAS / SDPA
    minfer: Callable[..., object]  # our kernel
    bytes: Callable[[tuple, torch.dtype], int]  # fewest bytes one call must move
    flops: Callable[[tuple], int] | None = None  # None for memory-bound ops
    shape_names: str = ""  # e.g. "tokens x hidden", for the table header
    paths: dict[str, Callable[..., object]] = field(default_factory=dict)  # extra --path variants
    dtypes: tuple = (torch.bfloat16,)


def input_sets(case: Case, shape: tuple, dtype: torch.dtype, l2_bytes: int) -> list[dict]:
    """Enough independent input sets that cycling through them overflows L2 twice."""
    per_set = max(1, case.bytes(shape, dtype))
    n = max(1, min(64, -(-2 * l2_bytes // per_set)))
    return [case.make_inputs(shape, dtype) for _ in range(n)]


# GPU cycles of busy-wait enqueued before each timed region (~100 µs): the host records the start
# event and submits the work while the GPU is still busy, so the region holds the GPU's work alone and
# not the host's launch latency (which otherwise lands inside it whenever the GPU sits idle).
HOLD_CYCLES = 200_000
# Fewest calls per graph replay (the sets cycled in order: a set comes back only after the others,
# which together overflow L2, have passed, as between replays).
MIN_CALLS = 64
# Seconds of this shape's own work before timing: after a power-heavy shape (8192^3 GEMM) the clocks
# take a while to come back, and a short shape's whole timing (tens of ms) could fall inside that dip
# (H200: 1 x 6144 x 4096 right after 8192^3 ran 16.1 us for us and 19.2 for cuBLAS, 13.9 / 16.2 elsewhere).
WARMUP_S = 0.2


def calls_per_replay(n_sets: int, graph: bool, min_calls: int = MIN_CALLS) -> int:
    return n_sets * max(1, -(-min_calls // n_sets)) if graph else n_sets


def _runner(fn: Callable[..., object], sets: list[dict], graph: bool, min_calls: int) -> Callable[[], None]:
    """calls_per_replay calls of fn, cycling through sets, as a CUDA graph replay (graph=True);
    eagerly, one call per set."""
    for s in sets[:2]:
        fn(**s)  # warm-up: module load, autotuning, allocator
    torch.cuda.synchronize()
    if not graph:
        def run():
            for s in sets:
                fn(**s)
        return run
    cycles = calls_per_replay(len(sets), graph, min_calls) // len(sets)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for s in sets:
            fn(**s)
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):  # outputs freed during capture are reused by the next call's
        for _ in range(cycles):
            for s in sets:
                fn(**s)
    return g.replay


def time_many(fns: list[Callable[..., object]], sets: list[dict], reps: int = 20, graph: bool = True,
              hold: bool = True, min_calls: int = MIN_CALLS) -> list[float]:
    """Median µs per call of each fn, cycling through `sets` (calls_per_replay calls per replay).
    The fns take turns rep by rep (the first one rotating), so a drift of the GPU's clocks or
    temperature over the run weighs on all of them alike instead of on whichever runs last.
    hold=False leaves the host's launch latency in the timing (the GPU idles until the work arrives)."""
    runs = [_runner(fn, sets, graph, min_calls) for fn in fns]
    calls = calls_per_replay(len(sets), graph, min_calls)
    t0 = time.perf_counter()
    while True:
        for run in runs:
            run()
        torch.cuda.synchronize()
        if time.perf_counter() - t0 >= WARMUP_S:
            break
    times: list[list[float]] = [[] for _ in fns]
    for rep in range(reps):
        for j in range(len(runs)):
            i = (rep + j) % len(runs)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if hold:
                torch.cuda._sleep(HOLD_CYCLES)
            start.record()
            runs[i]()
            end.record()
            end.synchronize()
            times[i].append(start.elapsed_time(end) * 1000.0 / calls)
    return [sorted(t)[len(t) // 2] for t in times]


def time_us(fn: Callable[..., object], sets: list[dict], reps: int = 20, graph: bool = True,
            hold: bool = True, min_calls: int = MIN_CALLS) -> float:
    """Median µs per call of one fn (see time_many)."""
    return time_many([fn], sets, reps, graph, hold, min_calls)[0]


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy, bytes read + written, GB/s: the memory ceiling of this run."""
    n = 1 << 28  # 512 MiB of bf16: far past L2
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    us = time_us(lambda src, dst: dst.copy_(src), [{"src": src, "dst": dst}], reps=10, graph=False)
    return 2 * src.nbytes / (us * 1e-6) / 1e9
