"""How fast can any kernel read HBM here? A plain one-pass read (Triton, sum into per-program partials)
timed by the benchmark's own harness, beside the copy ceiling that apps/benchmark.py reports.

    python perf/read_ceiling.py

Questions for decode (perf/attention.md): the read rate of a large stream (the wall that batch 16 at
16k / 32k meets, ours and SDPA alike); what a plain read of batch 1 x 4k's 16.8 MB achieves back to back
in a graph (64 calls, input sets rotated past L2), i.e. the fixed cost of one launch over that many bytes
with no attention work and no split merge; the same read launched as a programmatic dependent, as the
decode is, waiting for the previous call before it reads (as a decode must before it reads q) or only
before its store (no dependency at all); and whether the decode's access pattern (one kv head's 256-byte
slice of each 2 KB key row of a [batch, seq, kv_heads, head_dim] cache) reads slower than whole rows.
"""
from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "apps"))
from bench.common import Case, copy_bandwidth_gbs, input_sets, time_us  # noqa: E402


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr, PDL: tl.constexpr = 0):
    # PDL (launched as a programmatic dependent): 0 no; 1 a dependent read: wait for the previous call,
    # let the next one launch, then read; 2 an independent read: let the next call launch, read, and wait
    # only before the store.
    pid = tl.program_id(0)
    if PDL == 1:
        tl.extra.cuda.gdc_wait()
    if PDL != 0:
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(ITERS):
        offs = (pid * ITERS + i) * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    if PDL == 2:
        tl.extra.cuda.gdc_wait()
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


# The decode's layout: [batch, seq, 8 kv heads, 128] bf16, a key row of 2 KB.
HEADS, HEAD_DIM = 8, 128


@triton.jit
def _head_slice_kernel(x_ptr, out_ptr, seq, n_chunks, ROWS: tl.constexpr, ITERS: tl.constexpr,
                       HEADS_ADJACENT: tl.constexpr, NH: tl.constexpr, HD: tl.constexpr):
    # One kv head's slice of ROWS * ITERS consecutive keys. HEADS_ADJACENT: the NH programs of a key
    # chunk are neighbours in launch order (they read one row's slices at about the same time);
    # otherwise a head's chunks are.
    pid = tl.program_id(0)
    if HEADS_ADJACENT:
        h = pid % NH
        c = (pid // NH) % n_chunks
        b = pid // (NH * n_chunks)
    else:
        c = pid % n_chunks
        h = (pid // n_chunks) % NH
        b = pid // (n_chunks * NH)
    base = x_ptr + b.to(tl.int64) * seq * (NH * HD) + h * HD
    acc = tl.zeros([ROWS, HD], dtype=tl.float32)
    for i in range(ITERS):
        r = ((c * ITERS + i) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
        acc += tl.load(base + r[:, None] * (NH * HD) + tl.arange(0, HD)[None, :]).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc))


def head_slice_case(rows: int, iters: int, warps: int, heads_adjacent: bool) -> Case:
    """A [batch, seq, 8, 128] cache of `shape[0]` bytes (batch 16) read one kv head's slices at a time."""
    def make_inputs(shape, dtype):
        batch = 16
        seq = shape[0] // (dtype.itemsize * batch * HEADS * HEAD_DIM)
        n_chunks = seq // (rows * iters)
        return dict(x=torch.randn(batch, seq, HEADS, HEAD_DIM, device="cuda", dtype=dtype),
                    out=torch.empty(batch * HEADS * n_chunks, device="cuda", dtype=torch.float32))

    def run(x, out):
        batch, seq = x.shape[0], x.shape[1]
        n_chunks = seq // (rows * iters)
        _head_slice_kernel[(batch * HEADS * n_chunks,)](x, out, seq, n_chunks, ROWS=rows, ITERS=iters,
                                                        HEADS_ADJACENT=heads_adjacent, NH=HEADS, HD=HEAD_DIM,
                                                        num_warps=warps)
    return Case(shapes=[], make_inputs=make_inputs, ref=None, minfer=run, bytes=lambda shape, dtype: shape[0])


def read_fn(block: int, iters: int, warps: int, pdl: int = 0):
    def run(x, out):
        n = x.numel()
        extra = dict(PDL=pdl, launch_pdl=True) if pdl else {}
        _read_kernel[(triton.cdiv(n, block * iters),)](x, out, n, BLOCK=block, ITERS=iters, num_warps=warps, **extra)
    return run


def read_case(block: int, iters: int, warps: int, pdl: int = 0) -> Case:
    """One read configuration as a benchmark case, so input_sets rotates enough sets past L2."""
    def make_inputs(shape, dtype):
        n = shape[0] // dtype.itemsize
        return dict(x=torch.randn(n, device="cuda", dtype=dtype),
                    out=torch.empty(triton.cdiv(n, block * iters), device="cuda", dtype=torch.float32))
    return Case(shapes=[], make_inputs=make_inputs, ref=None, minfer=read_fn(block, iters, warps, pdl),
                bytes=lambda shape, dtype: shape[0])


def main() -> int:
    copy = copy_bandwidth_gbs()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print(f"# {torch.cuda.get_device_name(0)} | copy bandwidth {copy:.0f} GB/s (read + write)")
    configs = [(4096, 4, 8), (4096, 8, 8), (8192, 4, 8), (2048, 4, 4), (8192, 8, 16)]
    sizes = [("1 GiB (16 x 16k's K+V)", 1 << 30), ("16.8 MB (1 x 4k's K+V)", 16 << 20)]
    print(f"{'size':>24} {'block x iters, warps':>22} {'us':>9} {'GB/s':>7} {'%copy':>6}")

    def report(name, config, case, nbytes):
        sets = input_sets(case, (nbytes,), torch.bfloat16, l2)
        case.minfer(**sets[0])
        torch.testing.assert_close(sets[0]["out"].sum(), sets[0]["x"].float().sum(), rtol=1e-3, atol=4.0)
        us = time_us(case.minfer, sets, reps=10)
        gbs = nbytes / (us * 1e-6) / 1e9
        print(f"{name:>24} {config:>22} {us:9.2f} {gbs:7.0f} {100 * gbs / copy:6.1f}", flush=True)

    for name, nbytes in sizes:
        for block, iters, warps in configs:
            report(name, f"{block} x {iters}, {warps}", read_case(block, iters, warps), nbytes)
    # 1 x 4k's bytes as a programmatic dependent, as the decode launches: a read that waits for the
    # previous call first (the decode's q and newest key are the previous kernel's outputs), and one that
    # waits for nothing until its store (the floor of any overlap of one call's reads with the last's).
    for pdl, kind in ((1, "PDL, wait first"), (2, "PDL, wait last")):
        for block, iters, warps in configs:
            try:
                report(f"16.8 MB, {kind}", f"{block} x {iters}, {warps}", read_case(block, iters, warps, pdl), 16 << 20)
            except Exception as e:  # a Triton without launch_pdl / gdc
                print(f"16.8 MB, {kind}: not run ({type(e).__name__}: {e})".splitlines()[0], flush=True)
                break
    # The same 1 GiB as a [16, 32k, 8, 128] cache, read a kv head's 256-byte slices at a time (keys x
    # iters per program, heads or chunks adjacent in launch order).
    for rows, iters, warps in [(64, 4, 8), (32, 8, 4), (128, 2, 8)]:
        for adjacent in (True, False):
            config = f"{rows} x {iters}, {warps}, {'heads' if adjacent else 'chunks'}"
            report("1 GiB, kv-head slices", config, head_slice_case(rows, iters, warps, adjacent), 1 << 30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
