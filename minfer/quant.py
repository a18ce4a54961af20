"""GGUF block formats in torch: the reference dequantizers, on any device.

A quantized tensor is a run of blocks; each block holds BLOCK_ELEMS[type] values in BLOCK_BYTES[type]
bytes (little-endian, fp16 scales). `dequantize(kind, raw, n)` takes the raw bytes as uint8 [bytes]
and returns fp32 [n]. These are the formats minfer keeps quantized; tests check each against
`gguf.quants.dequantize`.

Layouts (ggml's), per block:
  Q8_0  d:f16, q:int8[32]                                x = d q
  Q4_0  d:f16, q:u4[32]                                  x = d (q - 8)
  Q4_1  d:f16, m:f16, q:u4[32]                           x = d q + m
  Q5_0  d:f16, qh:u32, q:u4[32]                          x = d (q + 16 hbit - 16)
  Q5_1  d:f16, m:f16, qh:u32, q:u4[32]                   x = d (q + 16 hbit) + m
  Q4_K  d:f16, dmin:f16, scales:u6[8]+mins:u6[8] in 12 bytes, q:u4[256]; 8 sub-blocks of 32
        x = d sc q - dmin mn
  Q5_K  as Q4_K, plus qh:u8[32] (bit k of byte l: the 5th bit of sub-block k's element l)
  Q6_K  ql:u4[256], qh:u2[256], scales:int8[16], d:f16; 16 sub-blocks of 16
        x = d sc (q - 32)
In the legacy (32-element) formats, the low nibbles hold elements 0-15 and the high nibbles 16-31.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import MinferError

BLOCK_ELEMS = {"Q8_0": 32, "Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256}
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
QUANTIZED = tuple(BLOCK_ELEMS)
# Byte offsets of each block's fp16 scales (d, then m or dmin where the format has one): the only fields of a
# block that can be NaN or infinite.
SCALE_OFFSETS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q4_K": (0, 2),
                 "Q5_K": (0, 2), "Q6_K": (208,)}


def _f16(b: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 at byte `at` of each block, as fp32 [blocks, 1]."""
    return b[:, at:at + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[blocks, 16] bytes -> [blocks, 32]: the low nibbles, then the high ones."""
    return torch.cat([packed & 0xF, packed >> 4], dim=-1)


def _bits(packed: torch.Tensor) -> torch.Tensor:
    """[blocks, k] bytes -> [blocks, 8 k] of 0/1, bit j of the little-endian word at index j."""
    shifts = torch.arange(8, device=packed.device, dtype=torch.uint8)
    return ((packed[..., None] >> shifts) & 1).flatten(-2)


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 scale bytes -> 6-bit (scale, min) [blocks, 8] each. Sub-blocks 0-3 keep theirs in
    the low 6 bits of bytes 0-3 / 4-7; sub-blocks 4-7 take 4 bits from bytes 8-11 and 2 from the tops."""
    lo_sc, lo_mn = s[:, 0:4] & 63, s[:, 4:8] & 63
    hi_sc = (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)
    hi_mn = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return torch.cat([lo_sc, hi_sc], 1).float(), torch.cat([lo_mn, hi_mn], 1).float()


def _q4_k_values(qs: torch.Tensor) -> torch.Tensor:
    """[blocks, 128] bytes -> u4 [blocks, 8, 32]: each run of 32 bytes gives a sub-block of low nibbles, then
    one of high nibbles."""
    q = qs.view(-1, 4, 1, 32)
    return torch.cat([q & 0xF, q >> 4], dim=2).view(-1, 8, 32)


def dequantize_blocks(kind: str, b: torch.Tensor) -> torch.Tensor:
    """b: uint8 [blocks, BLOCK_BYTES[kind]] -> fp32 [blocks, BLOCK_ELEMS[kind]]."""
    if kind == "Q8_0":
        return _f16(b, 0) * b[:, 2:].contiguous().view(torch.int8).float()
    if kind == "Q4_0":
        return _f16(b, 0) * (_nibbles(b[:, 2:]).float() - 8)
    if kind == "Q4_1":
        return _f16(b, 0) * _nibbles(b[:, 4:]).float() + _f16(b, 2)
    if kind == "Q5_0":
        q = _nibbles(b[:, 6:]) | (_bits(b[:, 2:6]) << 4)
        return _f16(b, 0) * (q.float() - 16)
    if kind == "Q5_1":
        q = _nibbles(b[:, 8:]) | (_bits(b[:, 4:8]) << 4)
        return _f16(b, 0) * q.float() + _f16(b, 2)
    if kind in ("Q4_K", "Q5_K"):
        sc, mn = _k_scales(b[:, 4:16])  # [blocks, 8]
        if kind == "Q4_K":
            q = _q4_k_values(b[:, 16:144])
        else:  # qh byte l, bit k: the 5th bit of element l of sub-block k
            shifts = torch.arange(8, device=b.device, dtype=torch.uint8)[:, None]
            high = (b[:, None, 16:48] >> shifts) & 1  # [blocks, 8, 32]
            q = _q4_k_values(b[:, 48:176]) | (high << 4)
        x = _f16(b, 0)[:, :, None] * sc[:, :, None] * q.float() - _f16(b, 2)[:, :, None] * mn[:, :, None]
        return x.reshape(-1, 256)
    if kind == "Q6_K":
        ql = b[:, 0:128].view(-1, 2, 2, 32)  # [blocks, half, low|high 32 bytes, l]
        qh = b[:, 128:192].view(-1, 2, 1, 32)  # [blocks, half, 1, l]
        low = torch.cat([ql & 0xF, ql >> 4], dim=2)  # [blocks, half, 4 groups of 32, l]
        high = (qh >> torch.tensor([0, 2, 4, 6], device=b.device, dtype=torch.uint8)[:, None]) & 3
        q = (low | (high << 4)).float() - 32  # element 128 half + 32 group + l
        sc = b[:, 192:208].contiguous().view(torch.int8).float().view(-1, 2, 4, 2, 1)  # 16 elements a scale
        x = _f16(b, 208).view(-1, 1, 1, 1, 1) * sc * q.view(-1, 2, 4, 2, 16)
        return x.reshape(-1, 256)
    raise MinferError(f"no dequantizer for GGUF type {kind}")


def dequantize(kind: str, raw: torch.Tensor, n: int) -> torch.Tensor:
    """raw: uint8 [bytes] (any device) -> fp32 [n] on the same device."""
    size = BLOCK_BYTES[kind]
    if raw.numel() % size or raw.numel() // size * BLOCK_ELEMS[kind] < n:
        raise MinferError(f"{kind}: {raw.numel()} bytes do not hold {n} values in blocks of {size} bytes")
    return dequantize_blocks(kind, raw.view(-1, size)).reshape(-1)[:n]


@dataclass(eq=False)
class LayerBlocks:
    """One layer's linears of one format whose blocks lie back to back in one buffer (group_layer), so that one
    dequantize launch decodes them all into back-to-back [n, k] matrices: the cuda backend's path of more than 32
    rows, a launch a layer instead of one a matrix."""
    blocks: torch.Tensor  # uint8 [1, total bytes]
    kind: str
    values: int  # the values of all of them


@dataclass
class QuantizedWeight:
    """A weight kept in its GGUF block format: the op seam's `linear` and `embedding` take it where
    they take a dense [out_features, in_features] tensor of `dtype`."""
    kind: str  # GGUF type name, one of QUANTIZED
    blocks: torch.Tensor  # uint8 [out_features, in_features / BLOCK_ELEMS * BLOCK_BYTES]: row n's blocks
    shape: tuple[int, int]  # logical (out_features, in_features)
    dtype: torch.dtype = torch.float32  # the compute dtype its values are dequantized to
    layer: LayerBlocks | None = None  # the group whose buffer holds blocks (group_layer), if any
    layer_offset: int = 0  # where its values start among the group's
    tiled: bool = False  # blocks hold each 16 rows' blocks chunk-major (tile_rows), not by rows

    def __post_init__(self):
        rows, cols = self.shape
        if self.kind not in BLOCK_ELEMS:
            raise MinferError(f"no kernel format {self.kind}; kept quantized: {', '.join(QUANTIZED)}")
        if cols % BLOCK_ELEMS[self.kind]:
            raise MinferError(f"{self.kind}: in_features {cols} is not a multiple of {BLOCK_ELEMS[self.kind]}")
        row_bytes = cols // BLOCK_ELEMS[self.kind] * BLOCK_BYTES[self.kind]
        if self.blocks.dtype != torch.uint8 or tuple(self.blocks.shape) != (rows, row_bytes):
            raise MinferError(f"{self.kind} {self.shape}: blocks must be uint8 [{rows}, {row_bytes}], "
                              f"got {self.blocks.dtype} {list(self.blocks.shape)}")
        if self.tiled and (self.kind not in TILED_KINDS or rows % 16 or self.layer is not None):
            raise MinferError(f"{self.kind} {self.shape}: tiled blocks need a kind of {TILED_KINDS}, out_features a "
                              f"multiple of 16 and no layer group")

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    def finite(self) -> torch.Tensor:
        """A bool on the blocks' device: every block's scales are finite (tiling keeps each block whole)."""
        b = self.blocks.reshape(-1, BLOCK_BYTES[self.kind])
        scales = torch.cat([b[:, at:at + 2] for at in SCALE_OFFSETS[self.kind]], 1).view(torch.float16)
        return torch.isfinite(scales.amax()) & torch.isfinite(scales.amin())

    def nbytes(self) -> int:
        return self.blocks.numel()

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """-> [out_features, in_features] in dtype (default: self.dtype), on the blocks' device."""
        n = self.shape[0] * self.shape[1]
        return dequantize(self.kind, self.untiled().blocks.reshape(-1), n).view(self.shape).to(dtype or self.dtype)

    def row_blocks(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [n]'s blocks by rows -> uint8 [n, row_bytes]."""
        ids = ids.long()
        if not self.tiled:
            return self.blocks[ids]
        return self._row_groups()[ids // 16, :, ids % 16].reshape(len(ids), -1)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rows `ids` [n] dequantized -> [n, in_features]: an embedding lookup that reads only those rows."""
        picked = self.row_blocks(ids)  # [n, row_bytes]
        n = picked.shape[0] * self.shape[1]
        return dequantize(self.kind, picked.reshape(-1), n).view(-1, self.shape[1]).to(dtype or self.dtype)

    def select_rows(self, index: torch.Tensor) -> "QuantizedWeight":
        """The weight whose row i is row index[i] of this one (rows are independent runs of blocks), by rows."""
        return QuantizedWeight(self.kind, self.row_blocks(index), (len(index), self.shape[1]), self.dtype)

    def untiled(self) -> "QuantizedWeight":
        """This weight with its blocks by rows (tile_rows undone)."""
        if not self.tiled:
            return self
        blocks = self._row_groups().transpose(1, 2).contiguous().view(self.blocks.shape)
        return QuantizedWeight(self.kind, blocks, self.shape, self.dtype)

    def _row_groups(self) -> torch.Tensor:
        """A tiled weight's blocks as uint8 [row groups, chunks, 16, block bytes]."""
        return self.blocks.view(self.shape[0] // 16, -1, 16, BLOCK_BYTES[self.kind])

    @staticmethod
    def cat(parts: list["QuantizedWeight"]) -> "QuantizedWeight":
        """Parts of one kind stacked by rows: [sum of out_features, in_features]; tiled if every part is."""
        first = parts[0]
        rows = sum(p.shape[0] for p in parts)
        tiled = all(p.tiled for p in parts)
        blocks = torch.cat([p.blocks if tiled else p.untiled().blocks for p in parts])
        return QuantizedWeight(first.kind, blocks, (rows, first.shape[1]), first.dtype, tiled=tiled)


# Kinds whose kernels read tiled blocks (csrc/qgemm/checks.h, kTiled).
TILED_KINDS = ("Q4_K", "Q6_K")


def tile_rows(w: QuantizedWeight) -> QuantizedWeight:
    """w with each 16 rows' blocks chunk-major: row 16 t + r's block c at bytes 16 t row_bytes + (16 c + r) block bytes,
    so that a 16-row tile's chunk is one run of 16 blocks (2304 bytes in Q4_K, 3360 in Q6_K), which the kernels fetch
    by one TMA copy in whole lines where 16 runs of 144 bytes took partial ones (H200, Q4_K, µs: 1 x 28672 x 4096
    18.50 -> 16.75, 16 x 28672 x 4096 30.44 -> 28.24). The same bytes; w as it is where its kind has no tiled
    kernels, its out_features are not a multiple of 32 (gate | up's halves whole groups) or it is in a layer group."""
    rows, size = w.shape[0], BLOCK_BYTES[w.kind]
    if w.tiled or w.kind not in TILED_KINDS or rows % 32 or w.layer is not None:
        return w
    groups = w.blocks.view(rows // 16, 16, -1, size)  # [row groups, 16, chunks, block bytes]
    blocks = groups.transpose(1, 2).contiguous().view(w.blocks.shape)
    return QuantizedWeight(w.kind, blocks, w.shape, w.dtype, tiled=True)


LAYER_VALUES = 1 << 27  # the most values a layer group holds: the cuda backend decodes it into its scratch of this size


def group_layer(weights: list) -> list:
    """A layer's linears, in the order its forward calls them, with their blocks copied back to back into one
    buffer (LayerBlocks) where all are QuantizedWeights of one format and dtype, each a multiple of 16 bytes (every
    view stays 16-byte aligned) and all together at most LAYER_VALUES values. The first (layer_offset 0) then stands
    for the group: its linear decodes them all. Otherwise the weights as they are."""
    first = weights[0]
    if not all(isinstance(w, QuantizedWeight) and w.kind == first.kind and w.dtype == first.dtype
               and w.device == first.device and w.nbytes() % 16 == 0 for w in weights):
        return weights
    values = sum(w.shape[0] * w.shape[1] for w in weights)
    if values > LAYER_VALUES:
        return weights
    buffer = torch.cat([w.untiled().blocks.reshape(-1) for w in weights]).view(1, -1)  # uint8 [1, total bytes]
    layer = LayerBlocks(buffer, first.kind, values)
    grouped, byte, value = [], 0, 0
    for w in weights:
        grouped.append(QuantizedWeight(w.kind, buffer[0, byte:byte + w.nbytes()].view(w.blocks.shape), w.shape,
                                       w.dtype, layer, value))
        byte += w.nbytes()
        value += w.shape[0] * w.shape[1]
    return grouped


# Quantizers: fp32 values -> GGUF blocks, in torch (CPU or GPU). The legacy formats follow
# gguf.quants (ggml's reference C) op for op in fp32, so they match it bit for bit. The K-quants run
# llama.cpp's reference search (quantize_row_q{4,5,6}_K_ref without an importance matrix):
# make_qkx2_quants per 32-element sub-block for Q4_K/Q5_K, make_qx_quants per 16 for Q6_K, each
# batched over all sub-blocks at once; sums run in another order than the C loops, so a rare
# tie may round the other way.

def _f16_bytes(v: torch.Tensor) -> torch.Tensor:
    """fp32 [blocks, 1] -> its fp16 as uint8 [blocks, 2]."""
    return v.to(torch.float16).view(torch.uint8)


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """u4 [blocks, 32] -> [blocks, 16]: elements 0-15 in the low nibbles, 16-31 in the high ones."""
    return (q[:, :16] & 0xF) | (q[:, 16:] << 4)


def _pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """0/1 [blocks, 8 k] -> [blocks, k] bytes, element j at bit j % 8 of byte j // 8 (little-endian)."""
    shifts = torch.arange(8, device=bits.device, dtype=torch.uint8)
    return (bits.view(bits.shape[0], -1, 8) << shifts).sum(-1, dtype=torch.uint8)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1 / d)


def _div(a: torch.Tensor, b: float) -> torch.Tensor:
    """a / b correctly rounded on every device (CUDA multiplies by 1/b for a Python scalar b)."""
    return a / torch.full_like(a, b)


def _roundf(v: torch.Tensor) -> torch.Tensor:
    """C's roundf (halves away from zero), written as gguf.quants.np_roundf so that no fp32 sum rounds."""
    a = v.abs()
    fl = a.floor()
    return torch.sign(v) * (fl + torch.floor(2 * (a - fl)))


def _quantize_legacy(kind: str, x: torch.Tensor) -> torch.Tensor:
    if kind == "Q8_0":  # d = max|x| / 127, q = roundf(x / d)
        d = _div(x.abs().amax(1, keepdim=True), 127)
        q = _roundf(x * _inverse(d)).to(torch.int8).view(torch.uint8)
        return torch.cat([_f16_bytes(d), q], 1)
    if kind in ("Q4_0", "Q5_0"):  # d = (the signed value of largest magnitude) / -2^(bits-1)
        half = 8 if kind == "Q4_0" else 16
        mx = x.gather(1, x.abs().argmax(1, keepdim=True))
        d = _div(mx, -half)
        q = torch.trunc(x * _inverse(d) + (half + 0.5)).clamp(0, 2 * half - 1).to(torch.uint8)
        if kind == "Q4_0":
            return torch.cat([_f16_bytes(d), _pack_nibbles(q)], 1)
        return torch.cat([_f16_bytes(d), _pack_bits(q >> 4), _pack_nibbles(q)], 1)
    # Q4_1, Q5_1: d = (max - min) / (2^bits - 1), m = min
    top = 15 if kind == "Q4_1" else 31
    mx, mn = x.amax(1, keepdim=True), x.amin(1, keepdim=True)
    d = _div(mx - mn, top)
    q = torch.trunc((x - mn) * _inverse(d) + 0.5).clamp(0, top).to(torch.uint8)
    if kind == "Q4_1":
        return torch.cat([_f16_bytes(d), _f16_bytes(mn), _pack_nibbles(q)], 1)
    return torch.cat([_f16_bytes(d), _f16_bytes(mn), _pack_bits(q >> 4), _pack_nibbles(q)], 1)


def _qkx2(x: torch.Tensor, w: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int):
    """llama.cpp's make_qkx2_quants, per row of x [n, k] with weights w [n, k]: x ~ scale L - min, L in
    [0, nmax]. Step i tries L = round((nmax + rmin + rdelta i) / (max - lo) (x - lo)) with lo the best
    offset so far, fits (scale, offset <= 0) to it by weighted least squares, and keeps it if its weighted
    squared error is lower. -> L [n, k], scale [n, 1], min [n, 1] (>= 0)."""
    lo = x.amin(-1, keepdim=True).clamp(max=0)  # the offset is a min <= 0
    mx = x.amax(-1, keepdim=True)
    flat = mx == lo
    span = lambda: torch.where(flat, torch.ones_like(lo), mx - lo)  # noqa: E731
    sum_w, sum_x, sum_xx = w.sum(-1, keepdim=True), torch.linalg.vecdot(w, x).unsqueeze(-1), torch.linalg.vecdot(w * x, x).unsqueeze(-1)
    iscale = nmax / span()
    scale = 1 / iscale
    l = (x - lo).mul_(iscale).round_().clamp_(0, nmax)  # noqa: E741
    best = (w * (scale * l + lo - x) ** 2).sum(-1, keepdim=True)
    used_iscale, used_lo = iscale, lo  # the L of the best fit is round(used_iscale (x - used_lo))
    for i in range(nstep + 1):
        iscale = (rmin + rdelta * i + nmax) / span()
        l = (x - lo).mul_(iscale).round_().clamp_(0, nmax)  # noqa: E741
        wl = w * l
        sum_l, sum_l2, sum_xl = wl.sum(-1, keepdim=True), torch.linalg.vecdot(wl, l).unsqueeze(-1), torch.linalg.vecdot(wl, x).unsqueeze(-1)
        D = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
        pos = this_min > 0  # a positive offset is not allowed: refit the scale alone
        this_scale = torch.where(pos, sum_xl / sum_l2, this_scale)
        this_min = torch.where(pos, torch.zeros_like(this_min), this_min)
        # sum w (s l + m - x)^2, expanded into the sums above
        err = (this_scale * (this_scale * sum_l2 + 2 * this_min * sum_l - 2 * sum_xl)
               + this_min * (this_min * sum_w - 2 * sum_x) + sum_xx)
        better = (D > 0) & (err < best)
        used_iscale, used_lo = torch.where(better, iscale, used_iscale), torch.where(better, lo, used_lo)
        best, scale, lo = torch.where(better, err, best), torch.where(better, this_scale, scale), torch.where(better, this_min, lo)
    L = (x - used_lo).mul_(used_iscale).round_().clamp_(0, nmax)
    L = torch.where(flat, torch.zeros_like(L), L)
    scale = torch.where(flat, torch.zeros_like(scale), scale)
    return L, scale, -lo


def _quantize_q45_k(kind: str, x: torch.Tensor) -> torch.Tensor:
    """quantize_row_q4_K_ref / q5_K_ref: per sub-block of 32 a (scale, min) from _qkx2 weighted by
    rms(x) + |x|, both quantized to 6 bits against the block's largest (fp16 d, dmin), then L redone
    against the quantized scales."""
    nmax, rmin, nstep = (15, -1.0, 20) if kind == "Q4_K" else (31, -0.5, 15)
    xs = x.view(-1, 8, 32)  # [blocks, sub-block, 32]
    w = (xs * xs).mean(-1, keepdim=True).sqrt() + xs.abs()
    L, sc, mn = _qkx2(xs, w, nmax, rmin, 0.1, nstep)  # [blocks, 8, 32], [blocks, 8, 1] x2
    max_sc, max_mn = sc.amax(1, keepdim=True).clamp(min=0), mn.amax(1, keepdim=True).clamp(min=0)  # [blocks, 1, 1]
    ls = torch.round(torch.where(max_sc > 0, 63 / max_sc, torch.zeros_like(max_sc)) * sc).clamp(0, 63)
    lm = torch.round(torch.where(max_mn > 0, 63 / max_mn, torch.zeros_like(max_mn)) * mn).clamp(0, 63)
    d16, dmin16 = (max_sc / 63).to(torch.float16), (max_mn / 63).to(torch.float16)
    d, dm = d16.float() * ls, dmin16.float() * lm  # [blocks, 8, 1]
    redo = torch.round((xs + dm) / torch.where(d == 0, torch.ones_like(d), d)).clamp(0, nmax)
    L = torch.where(d == 0, L, redo).to(torch.uint8)  # a zero scale keeps the search's L, as the C does
    ls, lm = ls.to(torch.uint8).view(-1, 8), lm.to(torch.uint8).view(-1, 8)
    scales = torch.cat([ls[:, :4] | ((ls[:, 4:] >> 4) << 6), lm[:, :4] | ((lm[:, 4:] >> 4) << 6),
                        (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)], 1)  # [blocks, 12]
    pairs = L.view(-1, 4, 2, 32)  # byte l of each 32-byte run: sub-block 2j in the low nibble, 2j+1 high
    qs = ((pairs[:, :, 0] & 0xF) | ((pairs[:, :, 1] & 0xF) << 4)).view(-1, 128)
    head = [d16.view(-1, 1).view(torch.uint8), dmin16.view(-1, 1).view(torch.uint8), scales]
    if kind == "Q5_K":  # qh byte l, bit k: the 5th bit of sub-block k's element l
        shifts = torch.arange(8, device=x.device, dtype=torch.uint8)[:, None]
        head.append(((L >> 4) << shifts).sum(1, dtype=torch.uint8))
    return torch.cat(head + [qs], 1)


def _qx(x: torch.Tensor, nmax: int):
    """llama.cpp's make_qx_quants with rmse_type 1, per row of x [n, k]: x ~ scale l, l in [-nmax, nmax),
    trying l = round(-(nmax + 0.1 i) / max x) for i in 0, -9..9 (max: the signed value of largest
    magnitude) and keeping the best x^2-weighted least-squares fit. -> l + nmax [n, k], scale [n, 1]."""
    mx = x.gather(-1, x.abs().argmax(-1, keepdim=True))  # [n, 1]
    zero = mx.abs() < 1e-15
    mx = torch.where(zero, torch.ones_like(mx), mx)
    w = x * x
    wx = w * x
    best = scale = used = None
    for i in [0] + [i for i in range(-9, 10) if i]:
        iscale = -(nmax + 0.1 * i) / mx
        l = (x * iscale).round_().clamp_(-nmax, nmax - 1)  # noqa: E741
        sumlx, suml2 = torch.linalg.vecdot(wx, l).unsqueeze(-1), torch.linalg.vecdot(w * l, l).unsqueeze(-1)
        this = sumlx / torch.where(suml2 == 0, torch.ones_like(suml2), suml2)
        if best is None:
            best, scale, used = this * sumlx, this, iscale
            continue
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        best, scale, used = torch.where(better, this * sumlx, best), torch.where(better, this, scale), torch.where(better, iscale, used)
    L = (x * used).round_().clamp_(-nmax, nmax - 1) + nmax
    return torch.where(zero, torch.zeros_like(L), L), torch.where(zero, torch.zeros_like(scale), scale)


def _quantize_q6_k(x: torch.Tensor) -> torch.Tensor:
    """quantize_row_q6_K_ref: per sub-block of 16 a scale from _qx, quantized to int8 against the
    block's largest (fp16 d), then L redone against the quantized scales."""
    xs = x.view(-1, 16, 16)  # [blocks, sub-block, 16]
    L, sc = _qx(xs, 32)  # [blocks, 16, 16] in [0, 64), [blocks, 16, 1]
    mx = sc.gather(1, sc.abs().argmax(1, keepdim=True))  # [blocks, 1, 1]
    zero = mx.abs() < 1e-15  # an all-zero block is all zero bytes
    iscale = -128 / torch.where(zero, torch.ones_like(mx), mx)
    d16 = torch.where(zero, torch.zeros_like(mx), 1 / iscale).to(torch.float16)
    sc_q = torch.round(iscale * sc).clamp(max=127)
    sc_q = torch.where(zero, torch.zeros_like(sc_q), sc_q)
    d = d16.float() * sc_q  # [blocks, 16, 1]
    redo = torch.round(xs / torch.where(d == 0, torch.ones_like(d), d)).clamp(-32, 31) + 32
    L = torch.where(d == 0, L, redo).to(torch.uint8).view(-1, 2, 4, 32)  # [blocks, half, group, l]
    ql = torch.cat([(L[:, :, 0] & 0xF) | ((L[:, :, 2] & 0xF) << 4), (L[:, :, 1] & 0xF) | ((L[:, :, 3] & 0xF) << 4)], 2)
    qh = (L[:, :, 0] >> 4) | ((L[:, :, 1] >> 4) << 2) | ((L[:, :, 2] >> 4) << 4) | ((L[:, :, 3] >> 4) << 6)
    return torch.cat([ql.reshape(-1, 128), qh.reshape(-1, 64), sc_q.view(-1, 16).to(torch.int8).view(torch.uint8),
                      d16.view(-1, 1).view(torch.uint8)], 1)


def quantize_blocks(kind: str, x: torch.Tensor) -> torch.Tensor:
    """x: float [blocks, BLOCK_ELEMS[kind]] -> uint8 [blocks, BLOCK_BYTES[kind]], on x's device."""
    if kind not in BLOCK_ELEMS:
        raise MinferError(f"no quantizer for GGUF type {kind}; have: {', '.join(QUANTIZED)}")
    x = x.float().reshape(-1, BLOCK_ELEMS[kind])
    if kind in ("Q4_K", "Q5_K"):
        return _quantize_q45_k(kind, x)
    if kind == "Q6_K":
        return _quantize_q6_k(x)
    return _quantize_legacy(kind, x)


def quantize(kind: str, w: torch.Tensor) -> torch.Tensor:
    """w: float [rows, cols] -> uint8 [rows, cols / BLOCK_ELEMS * BLOCK_BYTES]: each row's blocks, GGUF's layout."""
    rows, cols = w.shape
    if kind not in BLOCK_ELEMS:
        raise MinferError(f"no quantizer for GGUF type {kind}; have: {', '.join(QUANTIZED)}")
    if cols % BLOCK_ELEMS[kind]:
        raise MinferError(f"{kind}: row length {cols} is not a multiple of {BLOCK_ELEMS[kind]}")
    return quantize_blocks(kind, w.reshape(-1, BLOCK_ELEMS[kind])).view(rows, -1)
