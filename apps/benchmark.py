"""Time a kernel against its reference, on the GPU.

    python apps/benchmark.py --kernel rmsnorm --which both [--dtype bfloat16] [--shape 16384,4096] [--json out.json]

One row per shape: ref µs, minfer µs, speedup, and minfer's GB/s (% of the copy bandwidth measured
in this run) or TFLOP/s. Cases live in apps/bench/<family>.py.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

import torch

sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # after the stdlib, whose `profile` apps/ shadows
from bench import attention  # noqa: E402
from bench.cli import check_json, int_range  # noqa: E402
from bench.common import MIN_CALLS, Case, copy_bandwidth_gbs, input_sets, time_many  # noqa: E402
from minfer.engine_args import DEFAULT_PAGE_SIZE  # noqa: E402
from minfer.errors import ArgumentParser, MinferError, run_cli  # noqa: E402

FAMILIES = ("memory", "gemm", "attention", "qgemm")


def all_cases() -> dict[str, Case]:
    cases = {}
    for family in FAMILIES:
        try:
            mod = importlib.import_module(f"bench.{family}")
        except ModuleNotFoundError as e:
            if e.name != f"bench.{family}":
                raise
            continue
        cases.update(mod.CASES)
    return cases


def parse_shape(text: str) -> tuple:
    """An argparse type: comma-separated sizes (0 allowed: the attention cases' causal flag and window)."""
    try:
        shape = tuple(int(x) for x in text.split(","))
    except ValueError:
        shape = ()
    if not shape or min(shape) < 0:
        raise argparse.ArgumentTypeError(f"give comma-separated integers >= 0, not {text!r}")
    return shape


def misfit(name: str, case: Case, path: str | None, shapes: list[tuple]) -> str | None:
    """Why kernel `name` cannot run --path or one of --shape; None when it can."""
    if path and path not in case.paths:
        return f"--path {path}: {name} has " + (f"only {', '.join(case.paths)}" if case.paths else "no --path variants")
    arities = sorted({len(s) for s in case.shapes})
    for shape in shapes:
        if len(shape) not in arities:
            return (f"--shape {','.join(map(str, shape))}: {name} takes {' or '.join(map(str, arities))} numbers "
                    f"({case.shape_names})")
    return None


def run(args, cases: dict[str, Case], names: list[str]) -> None:
    check_json(args.json)
    if not torch.cuda.is_available():
        raise MinferError("benchmark needs a CUDA GPU")
    attention.PAGE = args.block_size
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    copy_gbs = copy_bandwidth_gbs()
    print(f"# {torch.cuda.get_device_name(0)} | copy bandwidth {copy_gbs:.0f} GB/s (read + write)")
    hold = not args.host_latency
    rows = []
    for name in names:
        case = cases[name]
        dtypes = [getattr(torch, args.dtype)] if args.dtype else list(case.dtypes)
        mine = case.paths[args.path] if args.path else case.minfer
        flags = (f" --path {args.path}" if args.path else "") + (" --host-latency" if args.host_latency else "") + \
            (f" --min-calls {args.min_calls}" if args.min_calls != MIN_CALLS else "") + \
            (f" --block-size {args.block_size}" if args.block_size != DEFAULT_PAGE_SIZE else "")
        print(f"\n## {name}{flags}  ({case.shape_names})")
        print(f"{'dtype':>9} {'shape':>22} {'ref us':>10} {'minfer us':>10} {'speedup':>8} {'GB/s':>8} "
              f"{'%copy':>6} {'TFLOP/s':>8} {'%ref':>6}")
        for dtype in dtypes:
            for shape in args.shape or case.shapes:
                sets = input_sets(case, shape, dtype, l2)
                # both: ref and minfer take turns rep by rep (time_many), so neither gets the cooler GPU.
                fns = {"ref": [case.ref], "minfer": [mine], "both": [case.ref, mine]}[args.which]
                us = time_many(fns, sets, args.reps, hold=hold, min_calls=args.min_calls)
                ref_us = us[0] if args.which != "minfer" else float("nan")
                our_us = us[-1] if args.which != "ref" else float("nan")
                best = our_us if args.which != "ref" else ref_us
                gbs = case.bytes(shape, dtype) / (best * 1e-6) / 1e9
                tflops = case.flops(shape) / (best * 1e-6) / 1e12 if case.flops else float("nan")
                row = dict(kernel=name, path=args.path or "auto", dtype=str(dtype).replace("torch.", ""),
                           shape=list(shape), ref_us=ref_us, minfer_us=our_us, speedup=ref_us / our_us,
                           gbs=gbs, pct_copy=100 * gbs / copy_gbs, tflops=tflops, pct_ref=100 * ref_us / our_us,
                           copy_gbs=copy_gbs)
                rows.append(row)
                print(f"{row['dtype']:>9} {'x'.join(map(str, shape)):>22} {ref_us:10.2f} {our_us:10.2f} "
                      f"{row['speedup']:8.2f} {gbs:8.0f} {row['pct_copy']:6.1f} {tflops:8.1f} {row['pct_ref']:6.1f}",
                      flush=True)
                del sets
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def main(argv=None) -> int:
    cases = all_cases()
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernel", required=True, choices=sorted(cases) + ["all"])
    p.add_argument("--which", choices=["ref", "minfer", "both"], default="both")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--shape", action="append", type=parse_shape,
                   help="comma-separated; repeatable (with --kernel all: the kernels that take that many numbers)")
    p.add_argument("--path", help="time one kernel path by itself (e.g. wmma, sm80, sm90, gemv; with --kernel all: "
                                  "the kernels that have it)")
    p.add_argument("--reps", type=int_range(1), default=20)
    p.add_argument("--min-calls", type=int_range(1), default=MIN_CALLS,
                   help="fewest calls per graph replay, cycling the input sets (1: each set once per replay)")
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("--host-latency", action="store_true",
                   help="leave the host's launch latency inside the timed region (no GPU hold before it)")
    p.add_argument("--block-size", "--page-size", type=int_range(1), default=DEFAULT_PAGE_SIZE,
                   help=f"keys a KV page in the paged attention cases (default {DEFAULT_PAGE_SIZE}, the engine's)")
    args = p.parse_args(argv)
    if args.kernel == "all":
        names = [n for n in sorted(cases) if misfit(n, cases[n], args.path, args.shape or []) is None]
        if not names:
            wanted = ([f"has --path {args.path}"] if args.path else []) + \
                [f"takes --shape {','.join(map(str, s))}" for s in args.shape or []]
            p.error(f"--kernel all: no kernel {' and '.join(wanted)}")
    else:
        names = [args.kernel]
        problem = misfit(args.kernel, cases[args.kernel], args.path, args.shape or [])
        if problem:
            p.error(problem)
    return run_cli(lambda: run(args, cases, names))


if __name__ == "__main__":
    sys.exit(main())
