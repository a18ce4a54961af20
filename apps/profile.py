"""Run one benchmark case's kernel under NVTX ranges, for Nsight Compute / Nsight Systems.

    python apps/profile.py --kernel rmsnorm --which minfer [--shape 16384,4096] [--dtype bfloat16] [--iters 5]

Profile only the timed launches (the warm-up and input setup stay outside the ranges):

    ncu --set full --clock-control none --nvtx --nvtx-include "minfer/" python apps/profile.py --kernel rmsnorm --which minfer

The N iterations sit inside one push/pop range named "minfer" (what `--nvtx-include "minfer/"` selects),
and each iteration inside its own range "minfer/<kernel>/<which>", so a timeline (nsys) shows them by name.
Cases come from apps/benchmark.py's all_cases(); the shape defaults to the case's largest.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.append(HERE)  # after the stdlib, whose `profile` this file would shadow
sys.path.insert(1, os.path.dirname(HERE))  # the repo root, for `import minfer` without an install
from bench.cli import int_range  # noqa: E402
from benchmark import all_cases, misfit, parse_shape  # noqa: E402

from minfer.errors import ArgumentParser, MinferError, run_cli  # noqa: E402


def run(args, case) -> None:
    if not torch.cuda.is_available():
        raise MinferError("profile needs a CUDA GPU")
    dtype = getattr(torch, args.dtype) if args.dtype else case.dtypes[0]
    shape = args.shape or max(case.shapes, key=lambda s: case.bytes(s, dtype))
    fn = case.ref if args.which == "ref" else (case.paths[args.path] if args.path else case.minfer)
    inputs = case.make_inputs(shape, dtype)

    for _ in range(args.warmup):
        fn(**inputs)
    torch.cuda.synchronize()

    name = f"minfer/{args.kernel}/{args.which}"
    torch.cuda.nvtx.range_push("minfer")
    for _ in range(args.iters):
        torch.cuda.nvtx.range_push(name)
        fn(**inputs)
        torch.cuda.nvtx.range_pop()
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    print(f"profile: {name} shape {'x'.join(map(str, shape))} {str(dtype).replace('torch.', '')}, "
          f"{args.iters} iterations")


def main(argv=None) -> int:
    cases = all_cases()
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernel", required=True, choices=sorted(cases))
    p.add_argument("--which", choices=["ref", "minfer"], default="minfer")
    p.add_argument("--shape", type=parse_shape, help="comma-separated; default: the case's largest shape")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--path", help="one kernel path by itself (see the case's paths)")
    p.add_argument("--iters", type=int_range(1), default=5)
    p.add_argument("--warmup", type=int_range(0), default=3)
    args = p.parse_args(argv)
    case = cases[args.kernel]
    problem = misfit(args.kernel, case, args.path, [args.shape] if args.shape else [])
    if problem:
        p.error(problem)
    return run_cli(lambda: run(args, case))


if __name__ == "__main__":
    sys.exit(main())
