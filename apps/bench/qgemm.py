"""Quantized-weight linear (csrc/qgemm/): x [M, K] @ W^T with W kept in GGUF blocks, shape (M, N, K).

minfer: the seam's call (minfer.ops.quantized.linear): qlinear where it takes M (quantized.takes_rows: 32, 64 for
Q4_K and Q6_K on W of 4096 x 4096 and more), else dequantize into a scratch
+ minfer's dense linear. ref: W dequantized to x's dtype, then F.linear (cuBLAS); the dequantize is
minfer's kernel, as torch's (minfer.quant) copies a host tensor to the GPU, which graph capture forbids.
Paths: `dense` = cuBLAS on W already dense in x's dtype (the unquantized model's cost, its 2-byte W not
counted in the bytes); `prefill` = dequantize + linear at any M; `records` = qlinear given x's records, written
(untimed) by rms_norm as the engine's norms write them before Q4_K up to 16 rows, Q5_K and Q6_K at one row, and
Q8_0, Q4_0 and Q4_1 at one row (sm_90); `norm` = qlinear reading x through an RMSNorm (the norm in the linear's
launch where its kernel takes it, a small model's 4- and 5-bit linears), `norm_apart` = rms_norm's launch, then qlinear.
Bytes: the quantized W + x + out.
One case per format: qgemm (Q4_K), qgemm_q6_k, qgemm_q8_0, ...; Llama-3-8B's linear shapes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from minfer import quant

from .common import Case
from .gemm import model_shapes

SHAPES = model_shapes("llama-3-8b", (1, 8, 16, 64, 512, 4096))
# Byte offsets of each format's fp16 scales (set to small finite values; random bytes can spell NaN).
SCALES = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2],
          "Q6_K": [208]}

try:
    from minfer.ops import quantized  # registers torch.ops.minfer's quantized ops
    from minfer.ops.cuda import records_for
except ImportError:  # extension not built: the ref side still runs
    quantized = None


def _weight(kind: str, n: int, k: int) -> quant.QuantizedWeight:
    elems, size = quant.BLOCK_ELEMS[kind], quant.BLOCK_BYTES[kind]
    raw = torch.randint(0, 256, (n, k // elems, size), device="cuda", dtype=torch.uint8)
    for at in SCALES[kind]:
        raw[..., at:at + 2] = (torch.randn(n, k // elems, 1, device="cuda") * 1e-3).half().view(torch.uint8)
    return quant.tile_rows(quant.QuantizedWeight(kind, raw.view(n, -1), (n, k)))  # as the loader keeps a linear's


def _case(kind: str) -> Case:
    def inputs(shape, dtype):
        m, n, k = shape
        w = _weight(kind, n, k)
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        rec = None
        if quantized is not None and (rec := records_for(x, w)) is not None:
            x = torch.ops.minfer.rms_norm(x, torch.ones(k, device="cuda", dtype=dtype), 1e-5, rec)
        nw = torch.rand(k, device="cuda").to(dtype) + 0.5  # [k], the norm's weight
        return {"x": x, "w": w, "dense": w.dequantize(dtype), "scratch": torch.empty(n, k, device="cuda", dtype=dtype),
                "rec": rec, "nw": nw}

    def ref(x, w, dense, scratch, rec, nw):
        return F.linear(x, quantized.dequantize(w, x.dtype, out=scratch))

    def ours(x, w, dense, scratch, rec, nw):
        return quantized.linear(x, w, None, static_weight=True, scratch=scratch)

    def with_records(x, w, dense, scratch, rec, nw):
        return quantized.linear(x, w, None, static_weight=True, scratch=scratch, x_records=rec)

    def prefill(x, w, dense, scratch, rec, nw):
        return torch.ops.minfer.linear(x, quantized.dequantize(w, x.dtype, out=scratch), None, "auto", False)

    def norm(x, w, dense, scratch, rec, nw):
        return quantized.linear(x, w, None, static_weight=True, norm=(nw, 1e-5))

    def norm_apart(x, w, dense, scratch, rec, nw):
        return quantized.linear(torch.ops.minfer.rms_norm(x, nw, 1e-5, None), w, None, static_weight=True)

    def nbytes(shape, dtype):
        m, n, k = shape
        return n * k // quant.BLOCK_ELEMS[kind] * quant.BLOCK_BYTES[kind] + (m * k + m * n) * dtype.itemsize

    return Case(
        shapes=SHAPES,
        make_inputs=inputs,
        ref=ref,
        minfer=ours,
        bytes=nbytes,
        flops=lambda shape: 2 * shape[0] * shape[1] * shape[2],
        shape_names=f"M x N x K (x [M, K] @ W[N, K]^T, W {kind})",
        paths={"dense": lambda x, w, dense, scratch, rec, nw: F.linear(x, dense), "prefill": prefill,
               "records": with_records, "norm": norm, "norm_apart": norm_apart},
        dtypes=(torch.bfloat16,),
    )


CASES = {"qgemm": _case("Q4_K")}
CASES.update({f"qgemm_{kind.lower()}": _case(kind) for kind in quant.QUANTIZED if kind != "Q4_K"})
