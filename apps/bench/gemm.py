"""GEMM family benchmark: minfer linear (x W^T) against cuBLAS (F.linear), shape (M, N, K).

Default sweep: squares 1024..8192, Llama-3-8B's linear shapes at M in {1, 8, 64, 512, 4096}, and
SmolLM2-135M's at M in {1, 4096}; --shape M,N,K runs any shape.
gemm_decode: every model's linear shapes at M in {1, 8, 16} (the gemv path's range).
gemm_batch: Llama-3-8B's linear shapes at M in {32, 64, 128, 144, 192, 256} (batched decode; 144 is 16
decodes beside a 128-token prompt chunk), bf16.
linear_act: the gate | up linear with SiLU(gate) * up (ours: one launch where its kernel fuses the activation,
see linear_plan; ref: cuBLAS, then torch's eager SiLU and product), each model's gate | up at M in {1, 8, 16, 32,
64, 128}, bf16.
--path wmma|sm80|sm90|gemv forces one kernel path.
Baselines (minfer/ops/baselines.py), on squares: gemm_baseline (gemm, auto path;
ref: torch.mm), tensor_core_gemm (WMMA, fp16 -> fp32; ref: torch.mm in fp16) and gemm_int8 (int8 -> int32;
ref: torch._int_mm).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from .common import Case

# (hidden, intermediate, heads, kv_heads, head_dim, vocab)
MODELS = {
    "smollm2-135m": (576, 1536, 9, 3, 64, 49152),
    "llama-3.2-1b": (2048, 8192, 32, 8, 64, 128256),
    "llama-3-8b": (4096, 14336, 32, 8, 128, 128256),
}
TOKENS = (1, 8, 64, 512, 4096)


def model_shapes(name: str, tokens=TOKENS) -> list[tuple]:
    """(M, N, K) of fused qkv, o, fused gate_up, down and lm_head."""
    h, inter, heads, kv, hd, vocab = MODELS[name]
    per_m = [((heads + 2 * kv) * hd, h), (h, heads * hd), (2 * inter, h), (h, inter), (vocab, h)]
    return [(m, n, k) for m in tokens for n, k in per_m]


DECODE = [s for name in MODELS for s in model_shapes(name, (1, 8, 16))]
BATCH = model_shapes("llama-3-8b", (32, 64, 128, 144, 192, 256))
DEFAULT = [(s, s, s) for s in (1024, 2048, 4096, 8192)] + model_shapes("llama-3-8b") + \
    model_shapes("smollm2-135m", (1, 4096))


def _inputs(shape, dtype):
    m, n, k = shape
    return {"x": torch.randn(m, k, device="cuda", dtype=dtype),
            "w": torch.randn(n, k, device="cuda", dtype=dtype) / k ** 0.5}


def _ours(path):
    # As the engine calls it: W is a weight, which no kernel writes (static_weight).
    return lambda x, w: torch.ops.minfer.linear(x, w, None, path, True)


def _bytes(shape, dtype):
    m, n, k = shape
    return (m * k + n * k + m * n) * torch.finfo(dtype).bits // 8


try:
    import minfer.ops.cuda  # noqa: F401  registers torch.ops.minfer
except ImportError:  # extension not built: the ref side still runs
    pass


# ---- baselines: A [M, K] @ B [K, N] ----

def _ab_inputs(shape, dtype):
    m, n, k = shape
    if dtype == torch.int8:
        return {"a": torch.randint(-128, 128, (m, k), device="cuda", dtype=torch.int8),
                "b": torch.randint(-128, 128, (n, k), device="cuda", dtype=torch.int8).t()}
    return {"a": torch.randn(m, k, device="cuda", dtype=dtype),
            "b": torch.randn(k, n, device="cuda", dtype=dtype) / k ** 0.5}


def _ab_bytes(out_itemsize=None):
    def fn(shape, dtype):
        m, n, k = shape
        return (m * k + k * n) * dtype.itemsize + m * n * (out_itemsize or dtype.itemsize)
    return fn


def _baseline(name):
    def fn(a, b):
        from minfer.ops import baselines
        return getattr(baselines, name)(a, b)
    return fn


def _baseline_case(name, ref, dtypes, out_itemsize=None):
    return Case(shapes=[(s, s, s) for s in (1024, 2048, 4096)], make_inputs=_ab_inputs, ref=ref,
                minfer=_baseline(name), bytes=_ab_bytes(out_itemsize),
                flops=lambda shape: 2 * shape[0] * shape[1] * shape[2], shape_names="M x N x K (A [M, K] @ B [K, N])",
                dtypes=dtypes)

CASES = {
    "gemm": Case(
        shapes=DEFAULT,
        make_inputs=_inputs,
        ref=lambda x, w: F.linear(x, w),
        minfer=_ours("auto"),
        bytes=_bytes,
        flops=lambda shape: 2 * shape[0] * shape[1] * shape[2],
        shape_names="M x N x K (x [M, K] @ W[N, K]^T)",
        paths={p: _ours(p) for p in ("wmma", "sm80", "sm90", "gemv")},
        dtypes=(torch.float16, torch.bfloat16),
    ),
}
# fp16 only by default (45 shapes); --dtype bfloat16 for the other.
CASES["gemm_decode"] = dataclasses.replace(CASES["gemm"], shapes=DECODE, dtypes=(torch.float16,))
CASES["gemm_batch"] = dataclasses.replace(CASES["gemm"], shapes=BATCH, dtypes=(torch.bfloat16,))
CASES["linear_act"] = Case(
    shapes=[(m, 2 * inter, h) for name, (h, inter, *_) in MODELS.items() for m in (1, 8, 16, 32, 64, 128)],
    make_inputs=_inputs,
    ref=lambda x, w: (lambda gate, up: F.silu(gate) * up)(*F.linear(x, w).chunk(2, dim=-1)),
    minfer=lambda x, w: torch.ops.minfer.linear_act(x, w, "silu", True),
    bytes=lambda shape, dtype: (shape[0] * shape[2] + shape[1] * shape[2] + shape[0] * shape[1] // 2) * dtype.itemsize,
    flops=lambda shape: 2 * shape[0] * shape[1] * shape[2],
    shape_names="M x N x K (x [M, K] @ gate | up [N, K]^T -> [M, N / 2])",
    dtypes=(torch.bfloat16,),
)
CASES["gemm_baseline"] = _baseline_case("gemm", torch.mm, (torch.float16, torch.bfloat16))
CASES["tensor_core_gemm"] = _baseline_case("tensor_core_gemm", torch.mm, (torch.float16,), out_itemsize=4)
CASES["gemm_int8"] = _baseline_case("gemm_int8", torch._int_mm, (torch.int8,), out_itemsize=4)
