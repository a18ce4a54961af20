"""Where a step's time goes: a window of steps under torch.profiler, its kernels grouped by name (those of CUDA
graph replays included), as calls and µs a step and their share of the window's kernel time. On the CPU (the
ref backend) the same table lists the top-level torch ops."""
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


def profile_steps(run_step, steps: int, cuda: bool) -> list[dict]:
    """Runs run_step() `steps` times under the profiler; returns rows (name, calls and µs a step, share of the
    window's time), the largest first."""
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
    return sorted(rows, key=lambda r: -r["us"])


def print_breakdown(rows: list[dict], step_ms: float | None, top: int = 15) -> None:
    """The table, `top` rows and the rest in one; step_ms (the step's wall time) gives the kernels' sum a share of it."""
    busy = sum(r["us"] for r in rows)
    head = f"{'kernel':<60} {'calls':>6} {'µs/step':>9} {'share':>6}"
    print(head + "\n" + "-" * len(head))
    shown, rest = rows[:top], rows[top:]
    if rest:
        shown = shown + [dict(name=f"({len(rest)} more)", calls=sum(r["calls"] for r in rest),
                              us=sum(r["us"] for r in rest), share=sum(r["share"] for r in rest))]
    for r in shown:
        print(f"{r['name']:<60} {r['calls']:6.1f} {r['us']:9.1f} {100 * r['share']:5.1f}%")
    if step_ms:
        print(f"kernels {busy:.1f} µs a step: {100 * busy / (1000 * step_ms):.1f}% of the step's {1000 * step_ms:.1f} µs")
