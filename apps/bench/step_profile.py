"""Where a step's time goes: a window of steps under torch.profiler, its kernels grouped by name (those of CUDA
graph replays included), as calls and µs a step and their share of the window's kernel time. On the CPU (the
ref backend) the same table lists the top-level torch ops.

On the GPU kernels overlap: programmatic dependent launch starts a kernel while the one before still runs, and
its wait counts in its duration, so the durations add up to more than the step. Each kernel's tail (its time
past the end of every kernel that started before it) counts the overlap once: the tails add up to the GPU's
busy time, and a kernel's tail is what the step would lose without it."""
from __future__ import annotations

import re

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile


def short_name(name: str) -> str:
    """A kernel's name without its signature, template arguments and namespaces:
    'void minfer::attn::decode::flash_decode_kernel<__nv_bfloat16, 64>(...)' -> 'flash_decode_kernel'."""
    name = re.sub(r"^void ", "", name)
    depth, out = 0, []
    for ch in name:  # drop <...> and (...) at any depth
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    return "".join(out).split("::")[-1].strip()[:60] or name[:60]


def tails(intervals) -> dict[str, float]:
    """(name, start, end) triples, any order -> µs by name past the end of every interval that started before."""
    out: dict[str, float] = {}
    reach = float("-inf")
    for name, start, end in sorted(intervals, key=lambda e: e[1]):
        out[name] = out.get(name, 0.0) + max(0.0, end - max(reach, start))
        reach = max(reach, end)
    return out


def profile_steps(run_step, steps: int, cuda: bool) -> list[dict]:
    """Runs run_step() `steps` times under the profiler; returns rows (name, calls and µs a step, share of the
    window's time; on the GPU also tail_us, µs a step past the kernels before), the largest first (by tail on
    the GPU)."""
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            run_step()
        if cuda:
            torch.cuda.synchronize()
    groups: dict[str, list[float]] = {}
    for e in prof.key_averages():
        if cuda and e.device_type != DeviceType.CUDA:
            continue
        if not cuda and (e.device_type != DeviceType.CPU or not e.key.startswith("aten::")):
            continue
        us = e.self_device_time_total if cuda else e.self_cpu_time_total
        g = groups.setdefault(short_name(e.key), [0, 0.0])
        g[0] += e.count
        g[1] += us
    total = sum(us for _, us in groups.values()) or 1.0
    rows = [dict(name=n, calls=c / steps, us=us / steps, share=us / total) for n, (c, us) in groups.items()]
    if not cuda:
        return sorted(rows, key=lambda r: -r["us"])
    tail = tails((short_name(e.name), e.time_range.start, e.time_range.end) for e in prof.events()
                 if e.device_type == DeviceType.CUDA)
    for r in rows:
        r["tail_us"] = tail.get(r["name"], 0.0) / steps
    return sorted(rows, key=lambda r: -r["tail_us"])


def print_breakdown(rows: list[dict], step_ms: float | None, top: int = 15) -> None:
    """The table, `top` rows and the rest in one; step_ms (the step's wall time) gives the kernels' sum a share of it,
    and on the GPU each kernel's tail a share of the step."""
    gpu = bool(rows) and "tail_us" in rows[0]
    busy, busy_tail = sum(r["us"] for r in rows), sum(r.get("tail_us", 0.0) for r in rows)
    head = f"{'kernel':<60} {'calls':>6} {'µs/step':>9} {'share':>6}" + (f" {'tail µs':>9} {'of step':>7}" if gpu else "")
    print(head + "\n" + "-" * len(head))
    shown, rest = rows[:top], rows[top:]
    if rest:
        more = dict(name=f"({len(rest)} more)", calls=sum(r["calls"] for r in rest), us=sum(r["us"] for r in rest),
                    share=sum(r["share"] for r in rest))
        if gpu:
            more["tail_us"] = sum(r["tail_us"] for r in rest)
        shown = shown + [more]
    for r in shown:
        line = f"{r['name']:<60} {r['calls']:6.1f} {r['us']:9.1f} {100 * r['share']:5.1f}%"
        if gpu:
            of_step = f"{100 * r['tail_us'] / (1000 * step_ms):6.1f}%" if step_ms else f"{'':>7}"
            line += f" {r['tail_us']:9.1f} {of_step}"
        print(line)
    if step_ms:
        print(f"kernels {busy:.1f} µs a step: {100 * busy / (1000 * step_ms):.1f}% of the step's {1000 * step_ms:.1f} µs")
        if gpu:
            print(f"tails (the GPU busy, overlaps once) {busy_tail:.1f} µs a step: {100 * busy_tail / (1000 * step_ms):.1f}% "
                  f"of the step")
