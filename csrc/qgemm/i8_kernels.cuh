// qlinear's other int8-records kernels at one row: Q6_K (q6) and the 32-element blocks Q8_0, Q4_0, Q4_1 (b32).
#pragma once
#include "qgemm/q4k_kernels.cuh"

namespace minfer::qgemm {
namespace {

// ---- Q6_K at M = 1 on x's int8 records: the 6-bit quants as unsigned bytes, on m16n8k32 (u8 x s8) ----
// Element 128 h + 32 gg + l of a super-block: low 4 bits in nibble gg / 2 of ql byte 64 h + 32 (gg % 2) + l, high 2
// in bits 2 gg of qh byte 128 + 32 h + l, scale sc[(128 h + 32 gg + l) / 16] (int8), w = d sc (q - 32). In the
// records' order lane t takes l = 8t .. 8t + 7 of each 32-element group s = 4 h + gg: lanes t < 2 hold sub-block
// 2s, t >= 2 sub-block 2s + 1, so each sub-block is a pair of mmas whose B keeps only its lanes' x (the others
// zero): q . x (u8 x s8), then -32 . x (s8 x s8) into the same sums; sc applies to them in int32, exactly.
// ~680 instructions a chunk against qlinear_kernel's 932 (fp16 x); the 8B Q4_K_M batch-1 step, whose down
// projections are Q6_K in half the layers, 2.517 -> 2.469-2.471 ms (H200, one build, a switch, two rounds).
namespace q6 {

// Quant words w0, w1 (l = 8t .. 8t + 3, 8t + 4 .. 8t + 7) of group gg from the half's ql and qh words.
template <int gg>
__device__ __forceinline__ uint32_t quants(uint32_t ql, uint32_t qh) {
  return ((ql >> (4 * (gg / 2))) & 0x0F0F0F0Fu) | (((qh >> (2 * gg)) & 0x03030303u) << 4);
}

__device__ __forceinline__ int scale_at(const uint32_t (&sc)[4], int j) { return int(int8_t(sc[j / 4] >> (8 * (j % 4)))); }

// acc[0] (row a) and acc[2] (row b) += d 2^-e sum over the chunk of sc (q - 32) . x in lane t's columns of B
// (x's hi, mid and lo parts: lane t = 0 sums 128 hi + mid, t = 1 lo; column 3, a copy of lo, is dropped; the two
// meet once, at the end). row_a, row_b: the rows' chunks (2-byte aligned).
__device__ __forceinline__ void mma_chunk(float (&acc)[4], const uint8_t* row_a, const uint8_t* row_b,
                                          const q4k::I8X& x, int t) {
  const uint32_t mine = t < 2 ? 0xFFFFFFFFu : 0u;  // this lane's x belongs to sub-block 2s (else 2s + 1)
  constexpr uint32_t kMinus32 = 0xE0E0E0E0u;
  const uint32_t m32[4] = {kMinus32, kMinus32, kMinus32, kMinus32};
  uint32_t sc_a[4], sc_b[4];
#pragma unroll
  for (int w = 0; w < 4; ++w) sc_a[w] = u32_at(row_a + 192 + 4 * w), sc_b[w] = u32_at(row_b + 192 + 4 * w);
  int ea[4] = {};
  auto group = [&](auto h_, auto gg_, const uint32_t (&ql_a)[2], const uint32_t (&qh_a)[2], const uint32_t (&ql_b)[2],
                   const uint32_t (&qh_b)[2]) {
    constexpr int h = decltype(h_)::value, gg = decltype(gg_)::value, s = 4 * h + gg;
    const uint32_t a[4] = {quants<gg>(ql_a[0], qh_a[0]), quants<gg>(ql_b[0], qh_b[0]), quants<gg>(ql_a[1], qh_a[1]),
                           quants<gg>(ql_b[1], qh_b[1])};
    const uint32_t lo[2] = {x.v[2 * s] & mine, x.v[2 * s + 1] & mine};
    const uint32_t hi[2] = {x.v[2 * s] & ~mine, x.v[2 * s + 1] & ~mine};
    int cl[4] = {}, ch[4] = {};
    mma_m16n8k32_u8s8(cl, a, lo[0], lo[1]);
    mma_m16n8k32_s8(cl, m32, lo);
    mma_m16n8k32_u8s8(ch, a, hi[0], hi[1]);
    mma_m16n8k32_s8(ch, m32, hi);
    const int la = scale_at(sc_a, 2 * s), ha = scale_at(sc_a, 2 * s + 1);
    const int lb = scale_at(sc_b, 2 * s), hb = scale_at(sc_b, 2 * s + 1);
    ea[0] += la * cl[0] + ha * ch[0], ea[1] += la * cl[1] + ha * ch[1];
    ea[2] += lb * cl[2] + hb * ch[2], ea[3] += lb * cl[3] + hb * ch[3];
  };
  auto half = [&](auto h_) {
    constexpr int h = decltype(h_)::value;
    uint32_t ql_a[2][2], ql_b[2][2], qh_a[2], qh_b[2];  // [gg % 2][word]
#pragma unroll
    for (int w = 0; w < 2; ++w) {
#pragma unroll
      for (int odd = 0; odd < 2; ++odd) {
        ql_a[odd][w] = u32_at(row_a + 64 * h + 32 * odd + 8 * t + 4 * w);
        ql_b[odd][w] = u32_at(row_b + 64 * h + 32 * odd + 8 * t + 4 * w);
      }
      qh_a[w] = u32_at(row_a + 128 + 32 * h + 8 * t + 4 * w);
      qh_b[w] = u32_at(row_b + 128 + 32 * h + 8 * t + 4 * w);
    }
    group(h_, std::integral_constant<int, 0>{}, ql_a[0], qh_a, ql_b[0], qh_b);
    group(h_, std::integral_constant<int, 1>{}, ql_a[1], qh_a, ql_b[1], qh_b);
    group(h_, std::integral_constant<int, 2>{}, ql_a[0], qh_a, ql_b[0], qh_b);
    group(h_, std::integral_constant<int, 3>{}, ql_a[1], qh_a, ql_b[1], qh_b);
  };
  half(std::integral_constant<int, 0>{});
  half(std::integral_constant<int, 1>{});
  // |ea| < 16 sub-blocks x 128 x 16 x 32 x 128 = 2^27; the parts combine in fp32
  const float fa = t == 0 ? 128.f * float(ea[0]) + float(ea[1]) : float(ea[0]);
  const float fb = t == 0 ? 128.f * float(ea[2]) + float(ea[3]) : float(ea[2]);
  acc[0] = __fmaf_rn(f16_at(row_a + 208) * x.inv, fa, acc[0]);
  acc[2] = __fmaf_rn(f16_at(row_b + 208) * x.inv, fb, acc[2]);
}

// x's records in the int8 form; S stages a warp through ChunkRing (TMA boxes with kBox, else load_chunk's pieces),
// the rows' chunks at any even offset; the walk of q4k::i8_walk.
template <typename T, int S, bool kBox>
__global__ void __launch_bounds__(kThreads, 2)
    i8_kernel(const Args a, const uint8_t* records, const __grid_constant__ CUtensorMap w_map) {
  using Stages = ChunkRing<kQ6_K, S, kBox>;
  __shared__ __align__(16) uint8_t red[kWarps * 4 * 32 * sizeof(float)];
  q4k::i8_walk<kQ6_K, S, kBox, false, false, false>(
      a, records, &w_map,
      [&](float (&acc)[4], const uint8_t* stage, int n0, int c, const q4k::I8X& x, int g, int t) {
        mma_chunk(acc, Stages::row(stage, a, n0, g, c), Stages::row(stage, a, n0, g + 8, c), x, t);
      },
      [&](float (&acc)[1][4], int n0, int warp, int lane) {
#pragma unroll
        for (int i = 0; i < 4; i += 2) acc[0][i] = 128.f * acc[0][i] + __shfl_down_sync(0xFFFFFFFFu, acc[0][i], 1);
        reduce_store<T, 1>(acc, red, a, n0, warp, lane);
      });
}

}  // namespace q6

// ---- Q8_0, Q4_0 and Q4_1 at M = 1 on x's int8 records: a 32-element block, one m16n8k32 ----
// A 256-k chunk is 8 blocks (Q8_0: d, 32 int8 quants; Q4_0: d, 16 bytes of nibbles, element j low in byte j and
// j + 16 high; Q4_1: d, m, the nibbles). In the records' order lane t takes elements 8t .. 8t + 7 of each block s
// (x's v[2s], v[2s + 1]), so block s is one mma whose A words are quants 8t .. 8t + 3 and 8t + 4 .. 8t + 7 of rows g
// and g + 8: Q8_0's as they are (s8), the 4-bit ones as u8 nibbles (bytes 8 (t % 2) .., their high nibbles for t >=
// 2), -8 x (Q4_0) by a second mma into the same sums, m x (Q4_1) by a mma of ones. Per block and row, C's hi and mid
// columns (lane t = 0) meet in int32 as 128 hi + mid (|.| < 2^26), lane t = 1 keeps lo (column 3 repeats it), and d
// (m) scales them in fp32; 2^-e applies once a chunk, and the store adds 128 x lane 0's sums to lane 1's.
namespace b32 {

template <int QT>
constexpr int kQuantsAt = QT == kQ4_1 ? 4 : 2;  // in a block, after d (and m)

// The 8 bytes at p as two words, p 2-byte aligned and p % 4 == mis (0 or 2; a constant where the loops are
// unrolled): aligned words, or two byte_perms of the three words around them.
__device__ __forceinline__ uint2 words_at(const uint8_t* p, int mis) {
  const uint32_t* w = reinterpret_cast<const uint32_t*>(p - mis);
  if (mis == 0) return {w[0], w[1]};
  return {__byte_perm(w[0], w[1], 0x5432), __byte_perm(w[1], w[2], 0x5432)};
}

// acc[0] (row a) and acc[2] (row b) += 2^-e sum over the chunk's blocks of w . x in lane t's columns of B; row_a,
// row_b: the rows' chunks (16-byte aligned).
template <int QT>
__device__ __forceinline__ void mma_chunk(float (&acc)[4], const uint8_t* row_a, const uint8_t* row_b,
                                          const q4k::I8X& x, int t) {
  constexpr int kBlock = Format<QT>::kBytes;
  constexpr uint32_t kMinus8 = 0xF8F8F8F8u, kOnes = 0x01010101u;
  const int hi = t == 0 ? 128 : 0;  // lane 0: 128 hi + mid; lane 1: lo + 0 x lo
  const int lane_at = QT == kQ8_0 ? 8 * t : 8 * (t % 2), nibble = 4 * (t / 2);
  float fa = 0.f, fb = 0.f;
#pragma unroll
  for (int s = 0; s < 8; ++s) {
    const int at = kBlock * s + kQuantsAt<QT>;
    const uint2 qa = words_at(row_a + at + lane_at, at % 4), qb = words_at(row_b + at + lane_at, at % 4);
    const uint32_t xb[2] = {x.v[2 * s], x.v[2 * s + 1]};
    int c[4] = {};
    if constexpr (QT == kQ8_0) {
      mma_m16n8k32_s8(c, {qa.x, qb.x, qa.y, qb.y}, xb);
    } else {
      const uint32_t q[4] = {(qa.x >> nibble) & 0x0F0F0F0Fu, (qb.x >> nibble) & 0x0F0F0F0Fu,
                             (qa.y >> nibble) & 0x0F0F0F0Fu, (qb.y >> nibble) & 0x0F0F0F0Fu};
      mma_m16n8k32_u8s8(c, q, xb[0], xb[1]);
      if constexpr (QT == kQ4_0) mma_m16n8k32_s8(c, {kMinus8, kMinus8, kMinus8, kMinus8}, xb);
    }
    fa = __fmaf_rn(f16_at(row_a + kBlock * s), float(hi * c[0] + c[1]), fa);
    fb = __fmaf_rn(f16_at(row_b + kBlock * s), float(hi * c[2] + c[3]), fb);
    if constexpr (QT == kQ4_1) {  // + m sum(x): the same sums for both rows
      int o[4] = {};
      mma_m16n8k32_s8(o, {kOnes, kOnes, kOnes, kOnes}, xb);
      const float sum = float(hi * o[0] + o[1]);
      fa = __fmaf_rn(f16_at(row_a + kBlock * s + 2), sum, fa);
      fb = __fmaf_rn(f16_at(row_b + kBlock * s + 2), sum, fb);
    }
  }
  acc[0] = __fmaf_rn(x.inv, fa, acc[0]);
  acc[2] = __fmaf_rn(x.inv, fb, acc[2]);
}

// x's records in the int8 form; S stages a warp by TMA boxes (sm_90; K a multiple of 256, so every row's chunk starts
// 16-byte aligned, at its slot's start: [16 x 144] 2-byte elements for Q8_0's 288-byte slot rows, [16 x 160] and
// [16 x 176] bytes for Q4_0 and Q4_1); the walk of q4k::i8_walk, kXRegs as there.
template <int QT, typename T, int S, int kCTAs, bool kXRegs>
__global__ void __launch_bounds__(kThreads, kCTAs)
    i8_kernel(const Args a, const uint8_t* records, const __grid_constant__ CUtensorMap w_map) {
  constexpr int kRow = Ring<QT, 256>::kRowStride;
  __shared__ __align__(16) uint8_t red[kWarps * 4 * 32 * sizeof(float)];
  q4k::i8_walk<QT, S, true, false, false, kXRegs>(
      a, records, &w_map,
      [&](float (&acc)[4], const uint8_t* stage, int, int, const q4k::I8X& x, int g, int t) {
        mma_chunk<QT>(acc, stage + g * kRow, stage + (g + 8) * kRow, x, t);
      },
      [&](float (&acc)[1][4], int n0, int warp, int lane) {
#pragma unroll
        for (int i = 0; i < 4; i += 2) acc[0][i] = 128.f * acc[0][i] + __shfl_down_sync(0xFFFFFFFFu, acc[0][i], 1);
        reduce_store<T, 1>(acc, red, a, n0, warp, lane);
      });
}

}  // namespace b32

}  // namespace
}  // namespace minfer::qgemm
