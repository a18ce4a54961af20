"""Runs our kernels that share data through shared memory once on small awkward shapes, for
`compute-sanitizer --tool racecheck`: every attention kernel, the gemv path's K splits (warps of a
CTA meeting in shared memory) and its shared-memory rings.

The tests also launch torch's own kernels (SDPA, cuBLAS) for their references, and racecheck reports
their shared-memory hazards too; this script launches only ours:
    compute-sanitizer --tool racecheck python apps/racecheck.py
"""
import torch

import minfer.ops.baselines as baselines
import minfer.ops.cuda as kernels

torch.manual_seed(0)
opts = dict(device="cuda", dtype=torch.bfloat16)
for hd in (64, 128):
    k_cache, v_cache = torch.randn(2, 300, 2, hd, **opts), torch.randn(2, 300, 2, hd, **opts)  # [batch, cap, kv, hd]
    q = torch.randn(2, 113, 8, hd, **opts)  # [batch, seq, heads, hd]
    kernels.attention(q, k_cache, v_cache, torch.tensor([0, 57], device="cuda", dtype=torch.int32), hd ** -0.5)
    for stable_prefix in (False, True):  # decode: split-KV, fused combine; ring partly filled before the wait
        kernels.attention(q[:, :1].contiguous(), k_cache, v_cache, torch.tensor([150, 299], device="cuda",
                          dtype=torch.int32), hd ** -0.5, stable_prefix=stable_prefix)
    x = torch.randn(1, 4, 200, hd, **opts)  # [batch, heads, seq, hd]
    baselines.flash_attention(x, x, x, is_causal=True)
    baselines.tiled_attention(x, x, x, is_causal=True)
    baselines.naive_attention(x[:, :, :64], x, x)

# decode merges through shared memory: many small partials copied in (9 q / 3 kv heads, d 64: 44 splits),
# and the spread merge's groups meeting there (32 q / 2 kv heads, d 128: 66 splits of 16 rows)
for heads, kv_heads, hd, ctx in ((9, 3, 64, 2048), (32, 2, 128, 4500)):
    k_cache, v_cache = torch.randn(1, ctx, kv_heads, hd, **opts), torch.randn(1, ctx, kv_heads, hd, **opts)
    q = torch.randn(1, 1, heads, hd, **opts)
    kernels.attention(q, k_cache, v_cache, torch.tensor([ctx - 1], device="cuda", dtype=torch.int32), hd ** -0.5,
                      stable_prefix=True)

# gemv: 16-row tiles with K split over 8 warps (M = 3), row pairs with K split over 8 and 2 warps (M = 1).
for m, n, k in ((3, 37, 4104), (1, 37, 16392), (1, 2040, 8200)):
    x, w = torch.randn(m, k, **opts), torch.randn(n, k, **opts)
    for static_weight in (False, True):  # True: the first round of W (or the rings) loads before the wait
        torch.ops.minfer.linear(x, w, None, "gemv", static_weight)
# gemv rings: per-warp cp.async rings, tiles shared between warps summed where the rings were (17003 rows:
# every CTA's range cut to the row); 16-row stages at M = 1, 32-row stages with one and two n8 tiles of X;
# one 12-warp CTA per SM on the few-tile shapes (16381 x 2056, 4093 x 14344).
for m, n, k in ((1, 17003, 4104), (8, 17003, 4104), (16, 17003, 4168), (8, 16381, 2056), (16, 4093, 14344)):
    x, w = torch.randn(m, k, **opts), torch.randn(n, k, **opts)
    torch.ops.minfer.linear(x, w, None, "gemv", True)
torch.cuda.synchronize()
print("racecheck: done")
