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


@dataclass
class QuantizedWeight:
    """A weight kept in its GGUF block format: the op seam's `linear` and `embedding` take it where
    they take a dense [out_features, in_features] tensor."""
    kind: str  # GGUF type name, one of QUANTIZED
    blocks: torch.Tensor  # uint8 [out_features, in_features / BLOCK_ELEMS * BLOCK_BYTES]: row n's blocks
    shape: tuple[int, int]  # logical (out_features, in_features)

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

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    def nbytes(self) -> int:
        return self.blocks.numel()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """-> [out_features, in_features] in dtype, on the blocks' device."""
        return dequantize(self.kind, self.blocks.reshape(-1), self.shape[0] * self.shape[1]).view(self.shape).to(dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` [n] dequantized -> [n, in_features]: an embedding lookup that reads only those rows."""
        picked = self.blocks[ids.long()]  # [n, row_bytes]
        n = picked.shape[0] * self.shape[1]
        return dequantize(self.kind, picked.reshape(-1), n).view(-1, self.shape[1]).to(dtype)
