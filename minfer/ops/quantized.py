"""Quantized weights on the GPU (csrc/qgemm/): thin wrappers over torch.ops.minfer.{dequantize,
dequantize_into, qlinear, qlinear_act, qembedding}, plus their fake (meta) implementations.

A weight stays in its GGUF blocks (quant.QuantizedWeight: uint8 [n, k / elems * bytes], ggml's layout, or for
Q4_K and Q6_K linears each 16 rows' blocks chunk-major: quant.tile_rows).
Decode (x of at most 32 rows, or 64 on wide Q4_K and Q6_K: takes_rows) streams the blocks and dequantizes in
registers (qlinear); prefill dequantizes the weight into a scratch buffer and runs the dense GEMM (linear).
"""
from __future__ import annotations

import functools

import torch

import minfer._C  # noqa: F401  registers torch.ops.minfer

from ..quant import LayerBlocks, QuantizedWeight

_ops = torch.ops.minfer

# ggml's type ids, the kernels' qtype (csrc/qgemm/formats.cuh).
QTYPE = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
TILED = 256  # qtype | TILED: the blocks are tiled (csrc/qgemm/checks.h, kTiled)
QLINEAR_MAX_ROWS = 32  # qlinear's range on every weight (more on some: takes_rows); more rows take dequantize + linear
# x records (csrc/qgemm/q4k_x.cuh): the Q4_K kernels' form of x, a record of this many bytes a row and 256-k
# chunk, read up to this many rows
Q4K_RECORD_BYTES, Q4K_RECORD_ROWS = 816, 16


# ---- fake implementations: shapes and dtypes only ----

@torch.library.register_fake("minfer::dequantize")
def _dequantize_fake(blocks, qtype, n, k, dtype):
    return blocks.new_empty((n, k), dtype=dtype)


@torch.library.register_fake("minfer::dequantize_into")
def _dequantize_into_fake(out, blocks, qtype, static_weight=False):
    return None


@torch.library.register_fake("minfer::qlinear")
def _qlinear_fake(x, blocks, qtype, n, k, bias=None, static_weight=False, x_records=None, norm_weight=None, eps=0.0):
    return x.new_empty((x.shape[0], n))


@torch.library.register_fake("minfer::qlinear_into")
def _qlinear_into_fake(out, x, blocks, qtype, bias=None, static_weight=False, x_records=None, accumulate=False):
    return None


@torch.library.register_fake("minfer::qlinear_act")
def _qlinear_act_fake(x, blocks, qtype, n, k, act, static_weight=False, x_records=None, records=None,
                      norm_weight=None, eps=0.0):
    return x.new_empty((x.shape[0], n // 2))


@torch.library.register_fake("minfer::qembedding")
def _qembedding_fake(ids, blocks, qtype, n, k, dtype):
    return blocks.new_empty((*ids.shape, k), dtype=dtype)


# ---- the ops ----

def qtype(w: QuantizedWeight) -> int:
    """The kernels' qtype of w's blocks."""
    return QTYPE[w.kind] | (TILED if w.tiled else 0)


def dequantize(w: QuantizedWeight, dtype: torch.dtype, out: torch.Tensor | None = None,
               static_weight: bool = False) -> torch.Tensor:
    """w -> [n, k] in dtype (fp16/bf16); into `out` (contiguous [n, k]) when given, e.g. a reused scratch.
    static_weight (with out): no kernel that may still be running writes w, as in linear."""
    n, k = w.shape
    if out is None:
        return _ops.dequantize(w.blocks, qtype(w), n, k, dtype)
    _ops.dequantize_into(out, w.blocks, qtype(w), static_weight)
    return out


def dequantize_layer(layer: LayerBlocks, out: torch.Tensor) -> torch.Tensor:
    """A layer group's matrices (quant.group_layer) -> out, a contiguous [values] of fp16/bf16, in one launch."""
    _ops.dequantize_into(out.view(1, -1), layer.blocks, QTYPE[layer.kind], True)
    return out


def _qlinear_rows(x: torch.Tensor) -> torch.Tensor:
    """x [rows, k] as qlinear reads it: contiguous, from a 16-byte aligned address (its 16-byte loads)."""
    x = x.contiguous()
    return x.clone() if x.data_ptr() % 16 else x


def takes_rows(rows: int, w: QuantizedWeight) -> bool:
    """Whether qlinear takes [rows, k] of x on w (csrc/qgemm/qlinear.h, max_rows): up to 32 rows, and up to 64 for
    Q4_K and Q6_K on W of 4096 x 4096 and more (a Q4_K_M file's linears: W read once, where the dequantize path
    writes and reads it in fp16 / bf16). A layer group's linears stay at 32: past it the group's first decodes them
    all (quant.group_layer)."""
    return rows <= QLINEAR_MAX_ROWS or (w.layer is None and rows <= _max_rows(QTYPE[w.kind], *w.shape))


@functools.cache
def _max_rows(qt: int, n: int, k: int) -> int:
    return _ops.qlinear_max_rows(qt, n, k)


def takes_norm(rows: int, w: QuantizedWeight, device: torch.device) -> bool:
    """Whether qlinear on [rows, k] of x takes norm and accumulate in its kernel's launch (regs_kernel): a small
    model's 4- and 5-bit legacy formats up to 8 rows. Elsewhere linear runs the norm or the add apart."""
    return w.kind in QTYPE and _takes_norm(rows, QTYPE[w.kind], *w.shape, device)


@functools.cache
def _takes_norm(rows: int, qt: int, n: int, k: int, device: torch.device) -> bool:
    return _ops.qlinear_takes_norm(torch.empty((rows, k), dtype=torch.bfloat16, device=device), qt, n)


def linear(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None, static_weight: bool = True,
           scratch: torch.Tensor | None = None, out: torch.Tensor | None = None,
           x_records: torch.Tensor | None = None, norm: tuple[torch.Tensor, float] | None = None,
           accumulate: bool = False) -> torch.Tensor:
    """x [..., k] @ W^T (+ bias) -> [..., n]. Where takes_rows: qlinear; more rows: W dequantized (into `scratch`,
    a contiguous [n, k] of x's dtype, when given) and the dense linear. static_weight: no kernel that may
    still be running writes w (as for the engine's weights; see README). out: a [rows, n] view to write into
    (rows contiguous, e.g. columns of a wider tensor), 2-D x only. x_records: x's records from the kernel
    before (ops.cuda.records_for), read by Q4_K at up to 16 rows in place of its own conversion launch.
    norm (weight [k], eps), up to 32 rows: x is read as rms_norm(x, weight, eps); accumulate (with out), up to 32
    rows: out += the product. In the kernel's launch where takes_norm, else qlinear runs the norm or the add apart."""
    n, k = w.shape
    x2 = x if x.dim() == 2 else x.reshape(-1, k)
    if (norm is not None or accumulate) and (x2.shape[0] > QLINEAR_MAX_ROWS or (accumulate and out is None)):
        raise ValueError("quantized.linear: norm and accumulate take at most 32 rows, accumulate an out")
    if takes_rows(x2.shape[0], w):
        x2 = _qlinear_rows(x2)
        if norm is not None:
            y = _ops.qlinear(x2, w.blocks, qtype(w), n, k, bias, static_weight, x_records, norm[0], norm[1])
            if out is not None:
                return out.add_(y) if accumulate else out.copy_(y)
        elif out is not None:
            _ops.qlinear_into(out, x2, w.blocks, qtype(w), bias, static_weight, x_records, accumulate)
            return out
        else:
            y = _ops.qlinear(x2, w.blocks, qtype(w), n, k, bias, static_weight, x_records)
    else:
        dense = dequantize(w, x.dtype, scratch, static_weight)
        y = _ops.linear(x2, dense, bias, "auto", False)  # the scratch is rewritten by the kernel just before
        if out is not None:
            return out.copy_(y)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], n)


def linear_act(x: torch.Tensor, w: QuantizedWeight, act: str, static_weight: bool = True,
               x_records: torch.Tensor | None = None, records: torch.Tensor | None = None,
               norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """x [rows, k] (takes_rows) @ W^T = gate | up -> act(gate) * up [rows, n / 2], act silu | gelu_tanh. The
    4- and 5-bit legacy formats of a small model's shapes write it from the linear's epilogue, and so does Q4_K up
    to 16 rows on x_records (x's records, as qlinear's) on sm_90; the others run qlinear, then the activation.
    records: room for the output's records (the down projection's x), written beside it. norm: as linear's."""
    n, k = w.shape
    norm_weight, eps = norm if norm is not None else (None, 0.0)
    return _ops.qlinear_act(_qlinear_rows(x), w.blocks, qtype(w), n, k, act, static_weight, x_records, records,
                            norm_weight, eps)


def embedding(ids: torch.Tensor, w: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of w dequantized -> [*ids.shape, k]; out-of-range ids give NaN rows."""
    n, k = w.shape
    w = w.untiled()  # qembedding reads blocks by rows
    return _ops.qembedding(ids.contiguous(), w.blocks, QTYPE[w.kind], n, k, dtype)
