// qlinear's Q4_K kernels up to 16 rows (and Q5_K's at one row, on Q4_K's int8 kernel): prepare_x, rows_kernel,
// i8_kernel, tile_kernel (qlinear_kernels.cuh: the format-generic pieces and kernels).
#pragma once
#include "qgemm/qlinear_kernels.cuh"

namespace minfer::qgemm {
namespace {

// ---- Q4_K at M <= 16: each sub-block's scale folded into its quants, in fp16 ----
// A Q4_K weight is d sc q - dmin mn (sc, mn: 6 bits a 32-element sub-block; q: 4 bits). sc q is an integer
// up to 945, exact in fp16, made from a quant pair by one HFMA2: (1024 + q) sc - 1024 sc. So a chunk
// (one super-block) needs no fp32 work per sub-block: dot = sum sc q x runs through the whole chunk,
// the min's term sum mn X_s comes from x's sub-block sums X_s in one mma, and the chunk ends with
// acc += 2^-e (d dot - dmin msum).
//
// The mma takes fp16 x as records (q4k_x.cuh), written once a call per row and chunk by prepare_x_kernel or by
// the kernel before (RMSNorm, the activations): fp16 times 2^e, e putting the largest |x| in [2^14, 2^15)
// (bf16 values, 8-bit significands, are then exact down to 2^-38 of it), with the sub-block sums. Lane t
// takes elements 8t .. 8t + 7 of a sub-block: the low nibbles of its 8 quant bytes for sub-block 2p, the high
// ones for 2p + 1; the fragment pair "k 2t, 2t + 1" of mma j holds elements 8t + 4j + {0, 2}, "2t + 8, 2t + 9"
// + {1, 3}, and x is stored in that order ([x0 x2 x1 x3 x4 x6 x5 x7] a lane).
namespace q4k {

using namespace ::minfer::q4k_x;

__device__ __forceinline__ uint32_t h2_add(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("add.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
__device__ __forceinline__ uint32_t h2_mul(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
__device__ __forceinline__ uint32_t h2_fma(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t r;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}

// (a & mask) | bits in one LOP3 (as C, the two constants make two: one of them must sit in a register).
template <uint32_t kMask, uint32_t kBits>
__device__ __forceinline__ uint32_t and_or(uint32_t a) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(a), "n"(kMask), "n"(kBits));
  return r;
}

// The fp16 pair (v, v) for byte i of w (v < 64), over 16 (high) or not: PRMT puts the byte under the
// exponent of 1024 (ulp 1) or of 64 (ulp 1/16), one HADD2 takes that base off. exp: 0x64 or 0x54 in a
// register, so that the selector is PRMT's immediate.
template <int i, bool kHigh>
__device__ __forceinline__ uint32_t byte_pair(uint32_t w, uint32_t exp) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(w), "r"(exp), "n"(0x4040 | (i * 0x0101)));
  return h2_add(r, kHigh ? 0xD400D400u : 0xE400E400u);
}

// x [M, K] (T) -> records [M][K / 256]: one warp a row's chunk.
template <typename T>
__global__ void __launch_bounds__(kThreads) prepare_x_kernel(const T* x, uint8_t* records, int M, int K, bool i8) {
  griddep_launch_dependents();  // the qlinear after it streams its first weights meanwhile
  griddep_wait();
  const int chunks = K / 256, lane = threadIdx.x % 32;
  const int64_t i = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;  // m * chunks + c
  if (i >= int64_t(M) * chunks) return;
  const uint4 v = ld_nc_v4(reinterpret_cast<const uint4*>(x + i * 256 + 8 * lane), true);
  write_record<T>(v, lane, records + i * kRecord, i8);
}

// The weights of a chunk: rows g and g + 8 of the stage, their packed 6-bit scales and mins, and the
// exponents byte_pair puts the scales under.
struct Chunk {
  const uint8_t *row_a, *row_b;
  uint32_t sc_a[2], mn_a[2], sc_b[2], mn_b[2];
  uint32_t exp_lo, exp_hi;
};

// QT: Q4_K, or Q5_K (the same header: d, dmin, the packed scales and mins).
template <int QT = kQ4_K>
__device__ __forceinline__ Chunk chunk_at(const uint8_t* stage, uint32_t exps, int g) {
  using R = Ring<QT>;
  Chunk c;
  c.row_a = stage + g * R::kRowStride;  // Q4_K and Q5_K chunks start 16-byte aligned (144, 176 = 16 x 9, 11)
  c.row_b = stage + (g + 8) * R::kRowStride;
  k_scales_mins(c.row_a + 4, c.sc_a, c.mn_a);
  k_scales_mins(c.row_b + 4, c.sc_b, c.mn_b);
  c.exp_lo = exps & 0xFF, c.exp_hi = exps >> 8;
  return c;
}

// Sub-blocks 2P and 2P + 1 of one row as A fragment halves: lo[j] (2P) and hi[j] (2P + 1) = sc q of
// elements 8t + 4j + {0, 2} ([0]) and {1, 3} ([1]); q: the row's 8 quant bytes for this lane.
template <int P>
__device__ __forceinline__ void row_quants(uint2 q, const uint32_t (&sc)[2], uint32_t exp_lo, uint32_t exp_hi,
                                           uint32_t (&lo)[2][2], uint32_t (&hi)[2][2]) {
  constexpr uint32_t kMagic = 0x64006400u, kMinus1024 = 0xE400E400u;
  const uint32_t s_lo = byte_pair<(2 * P) % 4, false>(sc[P / 2], exp_lo);
  const uint32_t s_hi = byte_pair<(2 * P + 1) % 4, true>(sc[P / 2], exp_hi);
  const uint32_t b_lo = h2_mul(s_lo, kMinus1024), b_hi = h2_mul(s_hi, kMinus1024);
  const uint32_t w[2] = {q.x, q.y};
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const uint32_t odd = w[j] >> 8;  // bytes 1 and 3 into 0 and 2
    lo[j][0] = h2_fma(and_or<0x000F000Fu, kMagic>(w[j]), s_lo, b_lo);
    lo[j][1] = h2_fma(and_or<0x000F000Fu, kMagic>(odd), s_lo, b_lo);
    hi[j][0] = h2_fma(and_or<0x00F000F0u, kMagic>(w[j]), s_hi, b_hi);
    hi[j][1] = h2_fma(and_or<0x00F000F0u, kMagic>(odd), s_hi, b_hi);
  }
}

// Sub-blocks 2P and 2P + 1 of the chunk: dot[nt] += sc q . x of x row tile nt, whose lane parts of the two
// sub-blocks are x_lo[nt] and x_hi[nt] (a record's 16 bytes at 128 P and 128 P + 64).
template <int P, int NT>
__device__ __forceinline__ void mma_step(float (&dot)[NT][4], const Chunk& c, const uint4 (&x_lo)[NT],
                                         const uint4 (&x_hi)[NT], int t) {
  const uint2 qa = *reinterpret_cast<const uint2*>(c.row_a + 16 + 32 * P + 8 * t);
  const uint2 qb = *reinterpret_cast<const uint2*>(c.row_b + 16 + 32 * P + 8 * t);
  uint32_t lo_a[2][2], hi_a[2][2], lo_b[2][2], hi_b[2][2];
  row_quants<P>(qa, c.sc_a, c.exp_lo, c.exp_hi, lo_a, hi_a);
  row_quants<P>(qb, c.sc_b, c.exp_lo, c.exp_hi, lo_b, hi_b);
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const uint32_t xl[4] = {x_lo[nt].x, x_lo[nt].y, x_lo[nt].z, x_lo[nt].w};
    const uint32_t xh[4] = {x_hi[nt].x, x_hi[nt].y, x_hi[nt].z, x_hi[nt].w};
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      mma_m16n8k16<__half>(dot[nt], {lo_a[j][0], lo_b[j][0], lo_a[j][1], lo_b[j][1]}, xl[2 * j], xl[2 * j + 1]);
      mma_m16n8k16<__half>(dot[nt], {hi_a[j][0], hi_b[j][0], hi_a[j][1], hi_b[j][1]}, xh[2 * j], xh[2 * j + 1]);
    }
  }
}

// The chunk's end for x row tile nt: msum = sum_s mn_s X_s / 32 in one mma (A's k 2t, 2t + 1 and 2t + 8,
// 2t + 9 both hold sub-blocks 2t and 2t + 1's mn; B's the sums' hi and lo halves: sums_hi / sums_lo, the
// record's 8 bytes at kSumsAt + 8t), then acc += d 2^-e dot - dmin 2^-e msum. inv[e]: 2^-e of x
// row 8 nt + 2t + e (0 past M). C fragment: dot[i] is W row g (i < 2) or g + 8, x row 8 nt + 2t + (i & 1).
__device__ __forceinline__ void finish(float (&acc)[4], const float (&dot)[4], const Chunk& c, uint32_t sums_hi,
                                       uint32_t sums_lo, const float (&inv)[2], int t) {
  const uint32_t sel = 0x4040 | ((2 * t) % 4) | (((2 * t + 1) % 4) << 8);
  const uint32_t m_a = h2_add(__byte_perm(t < 2 ? c.mn_a[0] : c.mn_a[1], c.exp_lo, sel), 0xE400E400u);
  const uint32_t m_b = h2_add(__byte_perm(t < 2 ? c.mn_b[0] : c.mn_b[1], c.exp_lo, sel), 0xE400E400u);
  float msum[4] = {};
  mma_m16n8k16<__half>(msum, {m_a, m_b, m_a, m_b}, sums_hi, sums_lo);
  const float d[2] = {f16_at(c.row_a), f16_at(c.row_b)}, dmin[2] = {f16_at(c.row_a + 2), f16_at(c.row_b + 2)};
#pragma unroll
  for (int i = 0; i < 4; ++i)
    acc[i] = __fmaf_rn(d[i >> 1] * inv[i & 1], dot[i], __fmaf_rn(-32.f * dmin[i >> 1] * inv[i & 1], msum[i], acc[i]));
}

// A lane's x for one chunk of NT row tiles from the prepared records (zeros past M). The first kAhead steps
// (P; 2 sub-blocks each), the sums and 2^-e are loaded before the chunk's weights are waited for (volatile
// loads), so that the two latencies overlap; each later step kAhead steps before it is used. 4 ahead
// (32 registers a tile) spilled under 2 CTAs an SM at NT = 2: 2 ahead at NT = 1, 1 at NT = 2.
template <int NT>
struct XFrags {
  const uint8_t* row[NT];  // x row 8 nt + g's record of the chunk (row 0's past M but where kZeroed)
  uint4 v[4][2][NT];       // [P][lo, hi][nt]
  uint32_t sums[NT][2];
  float inv[NT][2];
};

template <int NT>
constexpr int kAheadSteps = NT == 1 ? 2 : 1;

// kShared: the records sit in shared memory (tile_kernel), rows past M read where load_frags points them (row 0,
// whose sums are never stored, or the zeros a TMA box put there); else in global memory, read as zeros past M.
template <int P, int NT, bool kShared>
__device__ __forceinline__ void load_step(XFrags<NT>& xf, int M, int g, int t) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint4* p = reinterpret_cast<const uint4*>(xf.row[nt] + 128 * P + 64 * h + 16 * t);
      xf.v[P][h][nt] = kShared ? *p : ld_nc_v4(p, 8 * nt + g < M);
    }
}

// chunk0: row 0's record of this chunk; stride: a row's records. kZeroed: the rows past M are zeros there (a TMA
// box's fill), read as they are.
template <int NT, int kAhead, bool kShared = false, bool kZeroed = false>
__device__ __forceinline__ void load_frags(XFrags<NT>& xf, const uint8_t* chunk0, int64_t stride, int M, int g,
                                           int t) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int m = 8 * nt + g;
    xf.row[nt] = chunk0 + (kZeroed || m < M ? m : 0) * stride;
  }
  load_step<0, NT, kShared>(xf, M, g, t);
  if constexpr (kAhead == 2) load_step<1, NT, kShared>(xf, M, g, t);  // the steps ahead of the wait
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const uint2* sums_at = reinterpret_cast<const uint2*>(xf.row[nt] + kSumsAt + 8 * t);
    const uint2 sums = kShared ? *sums_at : ld_nc_v2(sums_at, 8 * nt + g < M);
    xf.sums[nt][0] = sums.x, xf.sums[nt][1] = sums.y;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int mi = 8 * nt + 2 * t + e;
      const float* inv_at = reinterpret_cast<const float*>(chunk0 + (kZeroed || mi < M ? mi : 0) * stride + kInvAt);
      xf.inv[nt][e] = kShared ? *inv_at : ld_nc_f32(inv_at, mi < M);
    }
  }
}

// acc[tile] += W[n0 + 16 tile .. + 15, chunk] . x[:, chunk]^T from the stage (kTiles tiles of 16 rows, one
// after another) and the chunk's x fragments, which every tile uses.
template <int NT, int kAhead, int kTiles, bool kShared = false>
__device__ __forceinline__ void mma_chunk(float (&acc)[kTiles][NT][4], const uint8_t* stage, XFrags<NT>& xf, int M,
                                          uint32_t exps, int g, int t) {
  Chunk c[kTiles];
#pragma unroll
  for (int w = 0; w < kTiles; ++w) c[w] = chunk_at(stage + w * Ring<kQ4_K>::kStageBytes, exps, g);
  float dot[kTiles][NT][4] = {};
  // step P's x is loaded kAhead steps before it
  if constexpr (kAhead < 4) load_step<kAhead, NT, kShared>(xf, M, g, t);
#pragma unroll
  for (int w = 0; w < kTiles; ++w) mma_step<0, NT>(dot[w], c[w], xf.v[0][0], xf.v[0][1], t);
  if constexpr (kAhead + 1 < 4) load_step<kAhead + 1, NT, kShared>(xf, M, g, t);
#pragma unroll
  for (int w = 0; w < kTiles; ++w) mma_step<1, NT>(dot[w], c[w], xf.v[1][0], xf.v[1][1], t);
  if constexpr (kAhead + 2 < 4) load_step<kAhead + 2, NT, kShared>(xf, M, g, t);
#pragma unroll
  for (int w = 0; w < kTiles; ++w) mma_step<2, NT>(dot[w], c[w], xf.v[2][0], xf.v[2][1], t);
#pragma unroll
  for (int w = 0; w < kTiles; ++w) mma_step<3, NT>(dot[w], c[w], xf.v[3][0], xf.v[3][1], t);
#pragma unroll
  for (int w = 0; w < kTiles; ++w)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
      finish(acc[w][nt], dot[w][nt], c[w], xf.sums[nt][0], xf.sums[nt][1], xf.inv[nt], t);
}

// ---- M = 1 on x's int8 records: the quants as they are, on m16n8k32 (u8 x s8) ----
// Lane (g, t) takes bytes 8t .. 8t + 7 of each 32-byte quant group p of rows g and g + 8: their low nibbles
// are sub-block 2p's elements 8t .. 8t + 7 (A's k 4t .. 4t + 3 and 16 + 4t .. 16 + 4t + 3), their high
// nibbles, kept in place as 16 q (one LOP3 a word), sub-block 2p + 1's. Q5_K (the same super-block with qh's
// 5th bits ahead of the quants) shifts the high nibbles down and puts each element's 5th bit above both. B
// column n holds x's his, mids and los (n = 0, 1, 2; the int8 form, q4k_x.cuh): C's columns 0, 1 (lane t = 0)
// and 2 (t = 1), to which each sub-block's scale applies in int32, exactly. ncu on 1 x 28672 x 4096 (H200):
// rows_kernel on the fp16 form issues ~590 instructions a chunk and warp, at 2.5 an SM and cycle.
struct I8X {
  uint32_t v[16];             // this lane's part of x: sub-block s at v[2s], v[2s + 1]
  uint32_t sums_hi, sums_lo;  // the min's B fragment
  float inv;                  // 2^-e
};

__device__ __forceinline__ I8X load_i8x(const uint8_t* record, int g, int t) {
  I8X x;
  const uint4* p = reinterpret_cast<const uint4*>(record + 256 * min(g, 2) + 64 * t);  // g > 2: columns unread
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint4 w = ld_nc_v4(p + j, true);
    x.v[4 * j] = w.x, x.v[4 * j + 1] = w.y, x.v[4 * j + 2] = w.z, x.v[4 * j + 3] = w.w;
  }
  const uint2 sums = ld_nc_v2(reinterpret_cast<const uint2*>(record + kI8SumsAt + 8 * t), true);
  x.sums_hi = sums.x, x.sums_lo = sums.y;
  x.inv = ld_nc_f32(reinterpret_cast<const float*>(record + kI8InvAt), true);
  return x;
}

// Q5_K's quant words of sub-blocks 2p (lo) and 2p + 1 (hi) from q (4 quant bytes: their low and high nibbles)
// and h (the 4 qh bytes of the same elements: bit j the 5th bit of sub-block j), as bytes 0 .. 31.
// (p is a constant where the loops are unrolled.)
__device__ __forceinline__ uint32_t fifth_bits(uint32_t h, int j) {
  return (j <= 4 ? h << (4 - j) : h >> (j - 4)) & 0x10101010u;  // bit j of each byte to its bit 4
}
__device__ __forceinline__ void q5_words(uint32_t q, uint32_t h, int p, uint32_t& lo, uint32_t& hi) {
  lo = (q & 0x0F0F0F0Fu) | fifth_bits(h, 2 * p);
  hi = ((q >> 4) & 0x0F0F0F0Fu) | fifth_bits(h, 2 * p + 1);
}

// acc += W[n0 .. n0 + 15, chunk] . x[0, chunk] in lane t = 0 (acc[0]: row g, acc[2]: row g + 8; the other
// lanes' and [1], [3] are x rows past M). Per part P of v (hi, mid, lo): sum_s sc_s (q . P)_s = (16 E + O) / 16,
// E summing sc_s dot_s over the even sub-blocks (quants q), O over the odd ones (Q4_K: 16 q, in place; Q5_K: q,
// and the sum 16 (E + O)): |16 E + O| < 2^29, |16 (E + O)| < 2^30.
template <int QT>
__device__ __forceinline__ void mma_chunk_i8(float (&acc)[4], const uint8_t* stage, const I8X& x, uint32_t exps, int g,
                                             int t) {
  constexpr bool kQ5 = QT == kQ5_K;
  constexpr int kQs = kQ5 ? 48 : 16;  // the quants' offset in a super-block (Q5_K: qh[32] at 16 before them)
  const Chunk c = chunk_at<QT>(stage, exps, g);
  uint2 ha{}, hb{};  // Q5_K: rows g and g + 8's qh bytes 8t .. 8t + 7, the 5th bits of this lane's elements
  if constexpr (kQ5) {
    ha = *reinterpret_cast<const uint2*>(c.row_a + 16 + 8 * t);
    hb = *reinterpret_cast<const uint2*>(c.row_b + 16 + 8 * t);
  }
  int even[4] = {}, odd[4] = {};
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    const uint2 qa = *reinterpret_cast<const uint2*>(c.row_a + kQs + 32 * p + 8 * t);
    const uint2 qb = *reinterpret_cast<const uint2*>(c.row_b + kQs + 32 * p + 8 * t);
    // A fragments: rows g, g + 8 at k 4t .. 4t + 3, then at k 16 + 4t ..
    const uint32_t q[4] = {qa.x, qb.x, qa.y, qb.y}, h[4] = {ha.x, hb.x, ha.y, hb.y};
    uint32_t a_lo[4], a_hi[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if constexpr (kQ5)
        q5_words(q[i], h[i], p, a_lo[i], a_hi[i]);
      else
        a_lo[i] = q[i] & 0x0F0F0F0Fu, a_hi[i] = q[i] & 0xF0F0F0F0u;
    }
    int lo[4] = {}, hi[4] = {};
    mma_m16n8k32_u8s8(lo, a_lo, x.v[4 * p], x.v[4 * p + 1]);
    mma_m16n8k32_u8s8(hi, a_hi, x.v[4 * p + 2], x.v[4 * p + 3]);
    const int sa = byte_i(c.sc_a, 2 * p), sb = byte_i(c.sc_b, 2 * p);  // the 6-bit scales
    const int sa1 = byte_i(c.sc_a, 2 * p + 1), sb1 = byte_i(c.sc_b, 2 * p + 1);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      even[i] += (i < 2 ? sa : sb) * lo[i];
      odd[i] += (i < 2 ? sa1 : sb1) * hi[i];
    }
  }
  float part[4];  // 16 sum_s sc_s (q . P)_s: columns 2t, 2t + 1 of rows g, g + 8
#pragma unroll
  for (int i = 0; i < 4; ++i) part[i] = kQ5 ? 16.f * float(even[i] + odd[i]) : float(16 * even[i] + odd[i]);
  const float lo_a = __shfl_down_sync(0xFFFFFFFFu, part[0], 1), lo_b = __shfl_down_sync(0xFFFFFFFFu, part[2], 1);
  // v = 2^14 hi + 2^7 mid + lo; finish's inv (2^-e) also scales the min's sums (v's / 2^12): 2^-12 here
  const float dot_a = (16384.f * part[0] + 128.f * part[1] + lo_a) * (1.f / (16 * 128));
  const float dot_b = (16384.f * part[2] + 128.f * part[3] + lo_b) * (1.f / (16 * 128));
  const float inv = x.inv * 128;
  finish(acc, {dot_a, dot_a, dot_b, dot_b}, c, x.sums_hi, x.sums_lo, {inv, inv}, t);
}

// x prepared once a call (prepare_x_kernel, launched just before; staged in every CTA, x cost ~40
// instructions a row and chunk, which lost to qlinear_kernel from M = 2 on). NT tiles of 8 x rows (M <= 8,
// 16); a CTA owns kTiles tiles of 16 W rows (x read once for all of them), whose weights stream through S
// stages a warp, 2 CTAs an SM (1 with 2 tiles: 220 registers, and their stages fill shared memory).
template <typename T, int NT, int S, int kTiles>
__global__ void __launch_bounds__(kThreads, kTiles == 1 ? 2 : 1) rows_kernel(const Args a, const uint8_t* records) {
  using R = Ring<kQ4_K>;
  constexpr int kStage = kTiles * R::kStageBytes;
  extern __shared__ __align__(16) uint8_t smem[];  // [kWarps][S][kTiles][kStageBytes]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int n0 = blockIdx.x * 16 * kTiles, chunks = a.K / 256;
  const int mine = warp < chunks ? (chunks - 1 - warp) / kWarps + 1 : 0;  // this warp's chunks: warp + kWarps i
  uint8_t* ring = smem + warp * S * kStage;
  griddep_launch_dependents();
  if (!a.static_weight) griddep_wait();
#pragma unroll
  for (int i = 0; i < S - 1; ++i) {
    if (i < mine)
#pragma unroll
      for (int w = 0; w < kTiles; ++w)
        load_chunk<kQ4_K, true>(ring + i * kStage + w * R::kStageBytes, a, n0 + 16 * w, warp + kWarps * i, lane);
    cp_async_commit();
  }
  if (a.static_weight) griddep_wait();  // the records, bias and out may be the previous kernels'
  float acc[kTiles][NT][4] = {};
  for (int i = 0; i < mine; ++i) {
    const int ahead = i + S - 1;  // refills the stage that chunk i - 1 left
    if (ahead < mine)
#pragma unroll
      for (int w = 0; w < kTiles; ++w)
        load_chunk<kQ4_K, true>(ring + (ahead % S) * kStage + w * R::kStageBytes, a, n0 + 16 * w,
                                warp + kWarps * ahead, lane);
    cp_async_commit();
    XFrags<NT> xf;
    load_frags<NT, kAheadSteps<NT>>(xf, records + int64_t(warp + kWarps * i) * kRecord, int64_t(chunks) * kRecord,
                                    a.M, g, t);
    cp_async_wait<S - 1>();  // chunk i's group is done (for this lane) ...
    __syncwarp();            // ... and for every lane
    mma_chunk<NT, kAheadSteps<NT>, kTiles>(acc, ring + (i % S) * kStage, xf, a.M, a.pair_exps, g, t);
    __syncwarp();  // every lane is done with the stage before it is refilled
  }
  cp_async_wait<0>();
#pragma unroll
  for (int w = 0; w < kTiles; ++w) reduce_store<T, NT>(acc[w], smem, a, n0 + 16 * w, warp, lane);
}

// The M = 1 int8-form kernels' walk (Q4_K below, Q6_K in q6::, i8_kernels.cuh), the weights through ChunkRing (on sm_90
// the TMA's boxes or bulk copies). A CTA takes tiles blockIdx.x, + gridDim.x, ... (the grid at most the CTAs an SM
// holds), its warps' rings running on across them: each warp's chunks of tile j follow those of tile j - 1, so the
// stages stay full where a CTA a tile drained its rings and waited a DRAM round trip for the next CTA's first stages.
// The 8B Q4_K_M batch-1 step (gate | up: 1792 tiles), a CTA a tile -> looping: 2.529-2.531 -> 2.504-2.510 ms (H200, one
// build, a switch, two rounds). kEarly: the next kernel may launch at entry, else once x may be read. mma(acc, stage,
// n0, c, x, g, t) adds chunk c of the tile at n0 from its stage and x's records (lane = 4 g + t); store(acc, n0, warp,
// lane) ends the tile, its sums meeting in the kernel's own shared memory, not the rings.
template <int QT, int S, bool kBox, bool kEarly, bool kPair, bool kXRegs, typename Mma, typename Store>
__device__ __forceinline__ void i8_walk(const Args& a, const uint8_t* records, const CUtensorMap* w_map, Mma mma,
                                        Store store) {
  using R = Ring<QT, 256>;
  extern __shared__ __align__(128) uint8_t smem_raw[];
  // [kWarps][S][kStageBytes]
  uint8_t* smem = aligned_128(smem_raw);
  __shared__ __align__(8) uint64_t bars[kWarps][S];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  TileWalk w(a, warp);
  uint8_t* ring = smem + warp * S * R::kStageBytes;
  static_assert(S <= 4, "i8_walk: ChunkRing's cp.async wait keeps at most 3 groups in flight");
  const ChunkRing<QT, S, kBox, kPair, true> stages(ring, bars[warp], w_map, lane);
  if (kEarly) griddep_launch_dependents();
  if (!a.static_weight) griddep_wait();
#pragma unroll
  for (int i = 0; i < S - 1; ++i) {
    if (i < w.total) stages.load(i, w.ahead_n0, warp + kWarps * w.ahead_i, a);
    w.advance();
  }
  if (a.static_weight) griddep_wait();  // the records, bias and out may be the previous kernels'
  if (!kEarly) griddep_launch_dependents();
  auto step = [&](float (&acc)[4], int n0, int i, int j, const I8X& xf) {
    if (j + S - 1 < w.total) stages.refill(j + S - 1, w.ahead_n0, warp + kWarps * w.ahead_i, a);  // j - 1's stage
    w.advance();
    stages.wait(j, min(w.total, j + S));
    mma(acc, ring + (j % S) * R::kStageBytes, n0, warp + kWarps * i, xf, lane / 4, lane % 4);
    __syncwarp();
  };
  if constexpr (kXRegs) {  // a warp's (at most 2) chunks are the same in every tile: x read once
    I8X held[2];
#pragma unroll
    for (int i = 0; i < 2; ++i)
      held[i] = load_i8x(records + int64_t(i < w.mine ? warp + kWarps * i : 0) * kRecord, lane / 4, lane % 4);
    for (int tile = 0, j = 0; tile < w.tiles; ++tile) {
      const int n0 = w.n0(tile);
      float acc[1][4] = {};
#pragma unroll
      for (int i = 0; i < 2; ++i)
        if (i < w.mine) step(acc[0], n0, i, j++, held[i]);
      store(acc, n0, warp, lane);
    }
  } else {
    for (int tile = 0, j = 0; tile < w.tiles; ++tile) {
      const int n0 = w.n0(tile);
      float acc[1][4] = {};
      for (int i = 0; i < w.mine; ++i, ++j)
        step(acc[0], n0, i, j, load_i8x(records + int64_t(warp + kWarps * i) * kRecord, lane / 4, lane % 4));
      store(acc, n0, warp, lane);
    }
  }
}

// Act (with kBox): W is gate | up (N = 2 inter rows), out [1, inter] = act(gate) * up, a tile of 16 rows being 8 gate
// rows and their up rows (ChunkRing's kPair). QT: Q4_K, or Q5_K (no Act).
template <typename T, int S, int kCTAs, bool kBox, typename Act = void, bool kXRegs = false, int QT = kQ4_K>
__global__ void __launch_bounds__(kThreads, kCTAs)
    i8_kernel(const Args a, const uint8_t* records, const __grid_constant__ CUtensorMap w_map) {
  constexpr bool kAct = !std::is_void_v<Act>;
  static_assert(!kAct || kBox, "i8_kernel: the activation's tiles come as pair boxes");
  static_assert(QT == kQ4_K || !kAct, "i8_kernel: Q5_K takes no activation");
  __shared__ __align__(16) uint8_t red[kWarps * 4 * 32 * sizeof(float)];
  i8_walk<QT, S, kBox, true, kAct, kXRegs>(
      a, records, &w_map,
      [&](float (&acc)[4], const uint8_t* stage, int, int, const I8X& x, int g, int t) {
        mma_chunk_i8<QT>(acc, stage, x, a.pair_exps, g, t);
      },
      [&](float (&acc)[1][4], int n0, int warp, int lane) {
        reduce_store<T, 1, Act>(acc, red, a, kAct ? n0 / 2 : n0, warp, lane);
      });
}

// ---- M 2-16 in CTAs of 96-128 rows: each chunk's records read into shared memory once a CTA ----
// rows_kernel's warps split K, so each warp reads its own chunks' records from L2: M x 560 bytes against its
// 2304 bytes of weights, 3.9x them at M = 16. Here warp w owns rows 16 w .. 16 w + 15 of a tile of 6-8 warps'
// rows (tile_warps), and all walk the same chunks, whose records come into shared memory once for the CTA (0.5x
// the weights at M = 16 and 8 warps). Where the tiles alone leave SMs idle, the grid's y splits the chunks: each
// CTA writes its fp32 sums to ws, and the last of a tile's CTAs to arrive adds them in split order and stores.
constexpr int kMinTileWarps = 6;  // tile_kernel's CTAs: 16 rows a warp, 6 to 8 warps (shared memory for 8) ...
constexpr int kWideTileWarps = 14;  // ... or 14, one CTA an SM (qlinear_launch.cuh: q4k_wide_tiles)
constexpr int kXStride = 576;  // a record in shared memory, padded: rows g and g + 1 of a 16-byte fragment
                               // load fall in different banks

__host__ __device__ constexpr int tile_smem(int nt, int stages, int warps = kWarps) {
  return stages * warps * Ring<kQ4_K>::kStageBytes + (stages + 1) * 8 * nt * kXStride;
}

// This thread's 16-byte pieces of a chunk's records (x rows 0 .. M - 1, the fp16 form): piece threadIdx.x +
// kThreads j of M x kF16Bytes / 16, its source in chunk 0 and its offset in a slot worked out once a call, so that
// a chunk's copies cost an add each (the division by 35 pieces a row took ~20 instructions a piece). H200, us,
// division / pieces: 8 x 28672 x 4096 29.2 / 28.3, 2 x 28672 x 4096 27.3 / 26.4, 16 x 4096 x 14336 20.7 / 21.0.
template <int NT>
struct RecordPieces {
  static constexpr int kMinThreads = 32 * kMinTileWarps;
  static constexpr int kPieces = kF16Bytes / 16, kPer = (8 * NT * kPieces + kMinThreads - 1) / kMinThreads;
  const uint8_t* src[kPer];
  uint32_t dst[kPer];
  int n;  // pieces this thread copies

  __device__ RecordPieces(const uint8_t* records, int M, int chunks) {
    n = 0;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int i = threadIdx.x + blockDim.x * j, m = i / kPieces, p = i % kPieces;
      src[j] = records + int64_t(m) * chunks * kRecord + 16 * p;
      dst[j] = m * kXStride + 16 * p;
      n += i < M * kPieces;
    }
  }
  // Chunk c's records into the slot at shared address slot (cp.async).
  __device__ __forceinline__ void load(uint32_t slot, int c) const {
    const int64_t at = int64_t(c) * kRecord;
#pragma unroll
    for (int j = 0; j < kPer; ++j)
      if (j < n) cp_async16(slot + dst[j], src[j] + at, 16);
  }
};

// Grid (tiles of 16 x warps rows, splits of the chunks); ws and counters as sum_splits takes them where splits > 1.
// S stages of weights a warp, S + 1 slots of records: on sm_90 by XSlots, below it by every thread's cp.async and
// one CTA barrier a chunk (tile_pipeline). XSlots against that pipeline, 8 warps (H200, one build, a switch, two
// rounds, us): 16 x 28672 x 4096 35.5 / 33.6, 16 x 5120 x 4096 10.85 / 10.28, 16 x 6144 x 4096 12.3 / 11.4,
// 16 x 4096 x 14336 19.7 / 18.4, 8 x 28672 x 4096 28.8 / 28.9; 99 registers -> 89 (NT = 2), the chunk loop 537
// SASS instructions -> 483. On sm_90 a weight stage is one TMA box by lane 0 (ChunkRing), where load_chunk's
// cp.async took 4.5 pieces a lane and their addresses (H200, us, pieces / box: 16 x 28672 x 4096 40.5 / 35.8,
// 16 x 4096 x 14336 22.0 / 20.7, 8 x 28672 x 4096 31.1 / 29.3; 8 x 6144 x 4096, 3-4 chunks a warp, 11.7 / 12.2).
// The records by bulk copies, 16 lanes of warp 0 with an mbarrier a slot, lost (16 x 28672 x 4096 35.3 -> 40.3).
// Act: W is gate | up and out [M, inter] = act(gate) * up, a warp's 16 rows being 8 gate rows and their up rows
// (ChunkRing's kPair; sm_90 only). W: the most warps a CTA, 2 CTAs an SM up to kWarps, else one.
template <typename T, int NT, int S, typename Act = void, int W = kWarps>
__global__ void __launch_bounds__(32 * W, W > kWarps ? 1 : 2)
    tile_kernel(const Args a, const uint8_t* records, float* ws, int* counters,
                const __grid_constant__ CUtensorMap w_map, const __grid_constant__ CUtensorMap x_map) {
  using R = Ring<kQ4_K>;
  constexpr bool kAct = !std::is_void_v<Act>;
  constexpr int kXStage = 8 * NT * kXStride;
  extern __shared__ __align__(128) uint8_t smem_raw[];
  // [W][S][kStageBytes], then [S + 1][8 NT][kXStride]
  uint8_t* smem = aligned_128(smem_raw);
  __shared__ __align__(8) uint64_t bars[W][S];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int warps = blockDim.x / 32;  // kMinTileWarps .. W
  const int n0 = blockIdx.x * 16 * warps + 16 * warp, chunks = a.K / 256;
  const int c0 = int(int64_t(blockIdx.y) * chunks / gridDim.y);
  const int mine = int(int64_t(blockIdx.y + 1) * chunks / gridDim.y) - c0;
  const bool has_rows = n0 < a.N;
  uint8_t* ring = smem + warp * S * R::kStageBytes;
  uint8_t* xs = smem + warps * S * R::kStageBytes;
  constexpr bool kXByTma = kXSlotsArch;  // else RecordPieces, which copy rows 0 .. M - 1 only
  const ChunkRing<kQ4_K, S, true, kAct> stages(ring, bars[warp], &w_map, lane);
  float acc[1][NT][4] = {};
  auto load_w = [&](int stage, int i) {
    if (has_rows) stages.template tile_refill<true>(stage, i, n0, c0 + i, a);  // stage == i % S
  };
  auto mma = [&](int stage, int slot, int i) {
    if (!has_rows) return;
    stages.tile_wait(i);
    XFrags<NT> xf;
    load_frags<NT, kAheadSteps<NT>, true, kXByTma>(xf, xs + slot * kXStage, kXStride, a.M, g, t);
    mma_chunk<NT, kAheadSteps<NT>, 1, true>(acc, ring + stage * R::kStageBytes, xf, a.M, a.pair_exps, g, t);
  };
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __shared__ __align__(8) uint64_t x_bars[2][S + 1];
  const XSlots<S, kXStage, kRecord / 8> slots(xs, x_bars, &x_map);
  tile_pipeline_tma<S, false>(mine, a.static_weight, slots, c0, load_w, mma);
#else
  const RecordPieces<NT> pieces(records, a.M, chunks);
  tile_pipeline<S>(mine, a.static_weight, load_w,
                   [&](int slot, int i) { pieces.load(smem_addr(xs + slot * kXStage), c0 + i); }, mma);
#endif
  float sum[NT * 4];
#pragma unroll
  for (int i = 0; i < NT * 4; ++i) sum[i] = acc[0][i / 4][i % 4];
  if (!sum_splits<NT>(sum, ws, counters, warp, lane)) return;
  if constexpr (kAct)
    store_act<T, NT, Act>(sum, a, n0 / 2, g, t);
  else
    store_rows<T, NT>(sum, a, n0, g, t);
}

}  // namespace q4k

}  // namespace
}  // namespace minfer::qgemm
