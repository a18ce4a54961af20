"""How fast can any kernel read HBM here? A plain one-pass read (Triton, sum into per-program partials)
timed by the benchmark's own harness, beside the copy ceiling that apps/benchmark.py reports.

    python perf/read_ceiling.py

Two questions for decode (perf/attention.md): the read rate of a large stream (the wall that batch 16
at 16k / 32k meets, ours and SDPA alike), and what a plain read of batch 1 x 4k's 16.8 MB achieves back to
back in a graph (64 calls, input sets rotated past L2), i.e. the fixed cost of one launch over that many
bytes with no attention work, no split merge and no dependency on the previous call.
"""
from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "apps"))
from bench.common import copy_bandwidth_gbs, time_us  # noqa: E402


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(ITERS):
        offs = (pid * ITERS + i) * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


def read_fn(block: int, iters: int, warps: int):
    def run(x, out):
        n = x.numel()
        _read_kernel[(triton.cdiv(n, block * iters),)](x, out, n, BLOCK=block, ITERS=iters, num_warps=warps)
    return run


def sets_of(nbytes: int, count: int, block: int, iters: int) -> list[dict]:
    n = nbytes // 2
    return [dict(x=torch.randn(n, device="cuda", dtype=torch.bfloat16),
                 out=torch.empty(triton.cdiv(n, block * iters), device="cuda", dtype=torch.float32))
            for _ in range(count)]


def main() -> int:
    copy = copy_bandwidth_gbs()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print(f"# {torch.cuda.get_device_name(0)} | copy bandwidth {copy:.0f} GB/s (read + write)")
    configs = [(4096, 4, 8), (4096, 8, 8), (8192, 4, 8), (2048, 4, 4), (8192, 8, 16)]
    # size name, bytes, input sets (rotated so that every call reads from HBM)
    sizes = [("1 GiB (16 x 16k's K+V)", 1 << 30, 2), ("16.8 MB (1 x 4k's K+V)", 16 << 20, -(-2 * l2 // (16 << 20)))]
    print(f"{'size':>24} {'block x iters, warps':>22} {'us':>9} {'GB/s':>7} {'%copy':>6}")
    for name, nbytes, count in sizes:
        for block, iters, warps in configs:
            fn = read_fn(block, iters, warps)
            sets = sets_of(nbytes, count, block, iters)
            ref = sets[0]["x"].float().view(-1)
            fn(**sets[0])
            torch.testing.assert_close(sets[0]["out"].sum(), ref.sum(), rtol=1e-3, atol=1.0)  # it really reads
            us = time_us(fn, sets, reps=10)
            gbs = nbytes / (us * 1e-6) / 1e9
            print(f"{name:>24} {f'{block} x {iters}, {warps}':>22} {us:9.2f} {gbs:7.0f} {100 * gbs / copy:6.1f}",
                  flush=True)
            del sets, ref
    return 0


if __name__ == "__main__":
    sys.exit(main())
