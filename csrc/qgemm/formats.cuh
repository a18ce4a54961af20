// GGUF block formats on the device: the type ids (ggml's, shared with minfer/ops/quantized.py), each
// format's block size, and decode8<QT>(block, j, v): elements 8j .. 8j + 7 of one block as fp32.
//
// Layouts (ggml's, as in minfer/quant.py), per block; fp16 fields little-endian, at even offsets:
//   Q8_0  d@0, q:int8[32]@2                                       x = d q
//   Q4_0  d@0, q:u4[32]@2                                         x = d (q - 8)
//   Q4_1  d@0, m@2, q:u4[32]@4                                    x = d q + m
//   Q5_0  d@0, qh:u32@2, q:u4[32]@6                               x = d (q + 16 hbit - 16)
//   Q5_1  d@0, m@2, qh:u32@4, q:u4[32]@8                          x = d (q + 16 hbit) + m
//   Q4_K  d@0, dmin@2, scales@4 (12 bytes), q:u4[256]@16          x = d sc q - dmin mn
//   Q5_K  as Q4_K with qh:u8[32]@16, q:u4[256]@48
//   Q6_K  ql:u4[256]@0, qh:u2[256]@128, sc:int8[16]@192, d@208    x = d sc (q - 32)
// The legacy (32-element) formats keep elements 0-15 in the low nibbles of their 16 quant bytes, 16-31
// in the high ones: a run of 8 elements is 8 consecutive bytes, one nibble each.
//
// decode8 computes every value in fp32 in the reference's order (quant.dequantize_blocks) with no fused
// multiply-add, so that rounding it to fp16/bf16 gives exactly quant.dequantize(...).to(dtype).
// step_quants gives qlinear the quants themselves, as small integers, with each run's scale and min.
// Block pointers need only 2-byte alignment (every block size is even): bytes are read as u16 pairs.
#pragma once
#include <cuda_fp16.h>
#include <stdint.h>

namespace minfer::qgemm {

// ggml's type ids.
enum QType : int { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

// kElems, kBytes: one block. kAlign: the alignment of every block in a row of blocks that starts
// 16-byte aligned (the largest power of two dividing kBytes, at most 16).
template <int QT> struct Format;
template <int E, int B> struct Block {
  static constexpr int kElems = E, kBytes = B, kAlign = B % 16 == 0 ? 16 : B % 8 == 0 ? 8 : B % 4 == 0 ? 4 : 2;
};
template <> struct Format<kQ4_0> : Block<32, 18> {};
template <> struct Format<kQ4_1> : Block<32, 20> {};
template <> struct Format<kQ5_0> : Block<32, 22> {};
template <> struct Format<kQ5_1> : Block<32, 24> {};
template <> struct Format<kQ8_0> : Block<32, 34> {};
template <> struct Format<kQ4_K> : Block<256, 144> {};
template <> struct Format<kQ5_K> : Block<256, 176> {};
template <> struct Format<kQ6_K> : Block<256, 210> {};

#ifdef __CUDACC__
// The fp16 at p (2-byte aligned) as fp32.
__device__ __forceinline__ float f16_at(const uint8_t* p) { return __half2float(*reinterpret_cast<const __half*>(p)); }

// 4 / 8 little-endian bytes at p (2-byte aligned), as u16 pairs: blocks are only 2-byte aligned.
__device__ __forceinline__ uint32_t u32_at(const uint8_t* p) {
  const uint16_t* h = reinterpret_cast<const uint16_t*>(p);
  return uint32_t(h[0]) | (uint32_t(h[1]) << 16);
}
__device__ __forceinline__ void bytes8_at(const uint8_t* p, uint32_t (&w)[2]) { w[0] = u32_at(p), w[1] = u32_at(p + 4); }

// An integer below 2^23 as fp32, exactly, without I2F (a quarter-rate instruction): 2^23 + q, minus 2^23.
__device__ __forceinline__ float u2f(uint32_t q) { return __int_as_float(0x4B000000u | q) - 8388608.f; }

// Byte i (0..7) of q, minus bias, as fp32: one PRMT puts the byte under 2^23's exponent (the float
// 2^23 + byte), one FADD takes 2^23 + bias off; exact (integers below 2^24).
__device__ __forceinline__ float byte_f(const uint32_t (&q)[2], int i, float bias) {
  return __int_as_float(__byte_perm(q[i >> 2], 0x4B000000u, 0x7440 + (i & 3))) - (8388608.f + bias);
}

// Byte i (0..7) of q as an int.
__device__ __forceinline__ int byte_i(const uint32_t (&q)[2], int i) {
  return __byte_perm(q[i >> 2], 0, 0x4440 + (i & 3));
}

// Bits 0..3 of h to bit 4 of bytes 0..3 (the 5th bit of 4 elements): the product moves bit i to bit 8i
// (sums of distinct bits, no carries), the mask keeps those.
__device__ __forceinline__ uint32_t bit4_of_bytes(uint32_t h) { return (((h & 0xF) * 0x00204081u) & 0x01010101u) << 4; }

// Q4_K / Q5_K: the 6-bit scale and min of sub-block s (0..7) from the 12 scale bytes at sc. Sub-blocks
// 0-3 keep theirs in the low 6 bits of bytes s / s + 4; 4-7 take 4 bits from byte s + 4 and the top 2
// of bytes s - 4 / s.
__device__ __forceinline__ void k_scale_min(const uint8_t* sc, int s, float& scale, float& min) {
  if (s < 4) {
    scale = u2f(sc[s] & 63), min = u2f(sc[s + 4] & 63);
  } else {
    scale = u2f((sc[s + 4] & 0xF) | ((sc[s - 4] >> 6) << 4));
    min = u2f((sc[s + 4] >> 4) | ((sc[s] >> 6) << 4));
  }
}

// d q + m, rounded as the reference: two roundings, no FFMA.
__device__ __forceinline__ float scale_add(float d, float q, float m) { return __fadd_rn(__fmul_rn(d, q), m); }

// v[i] = element 8j + i of the block at b (j < kElems / 8). The 8 quants are gathered as bytes of q
// (two words, four at a time), then each becomes fp32 (byte_f) and is scaled as quant.dequantize does.
template <int QT>
__device__ __forceinline__ void decode8(const uint8_t* b, int j, float (&v)[8]) {
  uint32_t w[2], q[2];
  if constexpr (QT == kQ8_0) {
    const float d = f16_at(b);
    bytes8_at(b + 2 + 8 * j, w);
    q[0] = w[0] ^ 0x80808080u, q[1] = w[1] ^ 0x80808080u;  // int8 + 128
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = __fmul_rn(d, byte_f(q, i, 128.f));
  } else if constexpr (QT == kQ4_0 || QT == kQ4_1) {
    const int shift = 4 * (j >> 1);  // elements 16-31: the high nibbles
    const float d = f16_at(b);
    bytes8_at(b + (QT == kQ4_0 ? 2 : 4) + 8 * (j & 1), w);
    q[0] = (w[0] >> shift) & 0x0F0F0F0Fu, q[1] = (w[1] >> shift) & 0x0F0F0F0Fu;
#pragma unroll
    for (int i = 0; i < 8; ++i)
      v[i] = QT == kQ4_0 ? __fmul_rn(d, byte_f(q, i, 8.f)) : scale_add(d, byte_f(q, i, 0.f), f16_at(b + 2));
  } else if constexpr (QT == kQ5_0 || QT == kQ5_1) {
    const int qh_at = QT == kQ5_0 ? 2 : 4, shift = 4 * (j >> 1);
    const float d = f16_at(b);
    const uint32_t qh = u32_at(b + qh_at) >> (8 * j);  // bit i: the 5th bit of element 8j + i
    bytes8_at(b + qh_at + 4 + 8 * (j & 1), w);
    q[0] = ((w[0] >> shift) & 0x0F0F0F0Fu) | bit4_of_bytes(qh);
    q[1] = ((w[1] >> shift) & 0x0F0F0F0Fu) | bit4_of_bytes(qh >> 4);
#pragma unroll
    for (int i = 0; i < 8; ++i)
      v[i] = QT == kQ5_0 ? __fmul_rn(d, byte_f(q, i, 16.f)) : scale_add(d, byte_f(q, i, 0.f), f16_at(b + 2));
  } else if constexpr (QT == kQ4_K || QT == kQ5_K) {
    const int s = j >> 2, l0 = 8 * (j & 3);  // sub-block s, its elements l0 .. l0 + 7
    float sc, mn;
    k_scale_min(b + 4, s, sc, mn);
    const float ds = __fmul_rn(f16_at(b), sc), dm = __fmul_rn(f16_at(b + 2), mn);
    // Sub-blocks 2p and 2p + 1 share 32 quant bytes: low nibbles, then high ones.
    bytes8_at(b + (QT == kQ4_K ? 16 : 48) + 32 * (s >> 1) + l0, w);
    q[0] = (w[0] >> (4 * (s & 1))) & 0x0F0F0F0Fu, q[1] = (w[1] >> (4 * (s & 1))) & 0x0F0F0F0Fu;
    if constexpr (QT == kQ5_K) {  // qh byte l, bit s: the 5th bit of element l of sub-block s
      uint32_t h[2];
      bytes8_at(b + 16 + l0, h);
      q[0] |= ((h[0] >> s) & 0x01010101u) << 4, q[1] |= ((h[1] >> s) & 0x01010101u) << 4;
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = scale_add(ds, byte_f(q, i, 0.f), -dm);
  } else {
    static_assert(QT == kQ6_K, "decode8: unknown format");
    // Element 8j: half h (128 elements), group g (32) of it, l0 within the group.
    const int h = j >> 4, g = (j >> 2) & 3, l0 = 8 * (j & 3);
    const float ds = __fmul_rn(f16_at(b + 208), float(int8_t(b[192 + 8 * h + 2 * g + (l0 >> 4)])));  // 16 a scale
    uint32_t hw[2];
    bytes8_at(b + 64 * h + 32 * (g & 1) + l0, w);  // groups 0, 1: low nibbles of two 32-byte runs; 2, 3: high
    bytes8_at(b + 128 + 32 * h + l0, hw);          // bits 2g, 2g + 1: the high 2 bits
#pragma unroll
    for (int k = 0; k < 2; ++k) q[k] = ((w[k] >> (4 * (g >> 1))) & 0x0F0F0F0Fu) | (((hw[k] >> (2 * g)) & 0x03030303u) << 4);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = __fmul_rn(ds, byte_f(q, i, 32.f));
  }
}

// ---- step_quants: the quants of 32 elements as small integers, for qlinear's tensor cores ----

// The integer each quant is stored above (element = a (quant - offset) + b), whether a block has a min
// (b != 0), and whether the scale changes every 16 elements (else every 32 or more).
template <int QT>
constexpr int kQuantOffset = QT == kQ4_0 ? 8 : QT == kQ5_0 ? 16 : QT == kQ8_0 ? 128 : QT == kQ6_K ? 32 : 0;
template <int QT>
constexpr bool kHasMin = QT == kQ4_1 || QT == kQ5_1 || QT == kQ4_K || QT == kQ5_K;
template <int QT>
constexpr bool kScalePer16 = QT == kQ6_K;

// The 4 little-endian bytes at p, p aligned to A (a power of two >= 2).
template <int A>
__device__ __forceinline__ uint32_t word_at(const uint8_t* p) {
  if constexpr (A >= 4) return *reinterpret_cast<const uint32_t*>(p);
  return u32_at(p);
}

// Q4_K / Q5_K: the 6-bit scales (sc) and mins (mn) of sub-blocks 0-3 (word 0) and 4-7 (word 1), one a
// byte, from the 12 bytes at p (4-byte aligned); the bit layout is k_scale_min's.
__device__ __forceinline__ void k_scales_mins(const uint8_t* p, uint32_t (&sc)[2], uint32_t (&mn)[2]) {
  const uint32_t w0 = word_at<4>(p), w1 = word_at<4>(p + 4), w2 = word_at<4>(p + 8);
  sc[0] = w0 & 0x3F3F3F3Fu, mn[0] = w1 & 0x3F3F3F3Fu;
  sc[1] = (w2 & 0x0F0F0F0Fu) | ((w0 >> 2) & 0x30303030u);
  mn[1] = ((w2 >> 4) & 0x0F0F0F0Fu) | ((w1 >> 2) & 0x30303030u);
}

// What the steps of a row chunk share: the K-quants' super-block scales (d, dmin and the packed 6-bit
// scales and mins; Q6_K's d and 16 int8 scales). kOnce: read once a chunk into registers (a win where
// registers are free: qlinear's NT = 1), else from shared memory at each step. Unused by the legacy
// formats, whose every step is a block of its own.
template <int QT, bool kOnce>
struct ChunkHead {
  const uint8_t* c;
  float d = 0.f, dmin = 0.f;
  uint32_t sc[2] = {}, mn[2] = {}, q6[4] = {};
  __device__ __forceinline__ explicit ChunkHead(const uint8_t* chunk) : c(chunk) {
    if constexpr (kOnce && (QT == kQ4_K || QT == kQ5_K)) {
      d = f16_at(c), dmin = f16_at(c + 2);
      k_scales_mins(c + 4, sc, mn);
    } else if constexpr (kOnce && QT == kQ6_K) {
      d = f16_at(c + 208);
#pragma unroll
      for (int i = 0; i < 4; ++i) q6[i] = word_at<Format<QT>::kAlign>(c + 192 + 4 * i);
    }
  }
  // Q4_K / Q5_K: sub-block s's scale d sc and negated min -dmin mn.
  __device__ __forceinline__ void scale_min(int s, float& a, float& b) const {
    if constexpr (kOnce) {
      a = __fmul_rn(d, byte_f(sc, s, 0.f)), b = -__fmul_rn(dmin, byte_f(mn, s, 0.f));
    } else {
      uint32_t w_sc[2], w_mn[2];
      k_scales_mins(c + 4, w_sc, w_mn);
      a = __fmul_rn(f16_at(c), byte_f(w_sc, s, 0.f)), b = -__fmul_rn(f16_at(c + 2), byte_f(w_mn, s, 0.f));
    }
  }
  // Q6_K: d times int8 scale i (0..15).
  __device__ __forceinline__ float q6_scale(int i) const {
    if constexpr (kOnce) return __fmul_rn(d, float(int8_t(q6[i >> 2] >> (8 * (i & 3)))));
    return __fmul_rn(f16_at(c + 208), float(int8_t(c[192 + i])));
  }
};

// What lane t reads of one legacy (32-element) block for a step: head (d, and m above it where the
// format has a min), qh (the 5-bit formats' high bits) and the quant words (Q8_0: two, else one).
struct BlockWords {
  uint32_t head, qh, qs[2];
};
template <int QT>
__device__ __forceinline__ BlockWords block_words(const uint8_t* blk, int t) {
  constexpr int A = Format<QT>::kAlign, qs = QT == kQ4_1 ? 4 : QT == kQ5_0 ? 6 : QT == kQ5_1 ? 8 : 2;  // Q4_0, Q8_0: 2
  BlockWords w{};
  if constexpr (kHasMin<QT>)
    w.head = word_at<A>(blk);  // d, m
  else
    w.head = *reinterpret_cast<const uint16_t*>(blk);  // d
  if constexpr (QT == kQ5_0 || QT == kQ5_1) w.qh = word_at<A>(blk + qs - 4);  // qh sits just before qs
  w.qs[0] = word_at<A>(blk + qs + 4 * t);
  if constexpr (QT == kQ8_0) w.qs[1] = word_at<A>(blk + qs + 16 + 4 * t);  // elements 16-31
  return w;
}
// block_words' words as step_quants gives them (see there).
template <int QT>
__device__ __forceinline__ void block_quants(const BlockWords& w, int t, uint32_t (&q)[2], float (&a)[2],
                                             float (&b)[2]) {
  a[0] = __half2float(__ushort_as_half(uint16_t(w.head)));
  if constexpr (kHasMin<QT>) b[0] = __half2float(__ushort_as_half(uint16_t(w.head >> 16)));
  if constexpr (QT == kQ8_0) {
    q[0] = w.qs[0] ^ 0x80808080u, q[1] = w.qs[1] ^ 0x80808080u;
  } else {  // elements 0-15 in the low nibbles, 16-31 the high
    q[0] = w.qs[0] & 0x0F0F0F0Fu, q[1] = (w.qs[0] >> 4) & 0x0F0F0F0Fu;
    if constexpr (QT == kQ5_0 || QT == kQ5_1)  // bit i of qh: element i's 5th bit
      q[0] |= bit4_of_bytes(w.qh >> (4 * t)), q[1] |= bit4_of_bytes(w.qh >> (16 + 4 * t));
  }
}

// Step s (elements 32 s .. 32 s + 31) of the row chunk at c (2 legacy blocks or one super-block, from a
// block boundary), as lane t (0..3) takes it: byte i of q[j] is the quant of element 32 s + 16 j + 4 t + i,
// unsigned and below 128 (256 for Q8_0), and the element is a[j] (quant - kQuantOffset) + b[j]. Only
// kScalePer16 formats set a[1]; only kHasMin ones set b. head: the chunk's ChunkHead.
template <int QT, bool kOnce>
__device__ __forceinline__ void step_quants(const uint8_t* c, int s, int t, const ChunkHead<QT, kOnce>& head,
                                            uint32_t (&q)[2], float (&a)[2], float (&b)[2]) {
  using F = Format<QT>;
  constexpr int A = F::kAlign;
  if constexpr (F::kElems == 32) {  // one block a step
    block_quants<QT>(block_words<QT>(c + s * F::kBytes, t), t, q, a, b);
  } else if constexpr (QT == kQ4_K || QT == kQ5_K) {  // sub-block s: low nibbles for even s, high for odd
    const uint8_t* qs = c + (QT == kQ4_K ? 16 : 48) + 32 * (s >> 1) + 4 * t;
    q[0] = (word_at<A>(qs) >> (4 * (s & 1))) & 0x0F0F0F0Fu;
    q[1] = (word_at<A>(qs + 16) >> (4 * (s & 1))) & 0x0F0F0F0Fu;
    if constexpr (QT == kQ5_K) {  // qh byte l, bit s: the 5th bit of element l of sub-block s
      q[0] |= ((word_at<A>(c + 16 + 4 * t) >> s) & 0x01010101u) << 4;
      q[1] |= ((word_at<A>(c + 32 + 4 * t) >> s) & 0x01010101u) << 4;
    }
    head.scale_min(s, a[0], b[0]);
  } else {
    static_assert(QT == kQ6_K, "step_quants: unknown format");
    const int h = s >> 2, g = s & 3;  // half h (128 elements), group g (32) of it; one scale per 16
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int l = 16 * j + 4 * t, i = 8 * h + 2 * g + j;  // i: the int8 scale's index
      const uint32_t lo = word_at<A>(c + 64 * h + 32 * (g & 1) + l), hi = word_at<A>(c + 128 + 32 * h + l);
      q[j] = ((lo >> (4 * (g >> 1))) & 0x0F0F0F0Fu) | (((hi >> (2 * g)) & 0x03030303u) << 4);
      a[j] = head.q6_scale(i);
    }
  }
}
#endif  // __CUDACC__

}  // namespace minfer::qgemm

// Compile-time dispatch on a qtype: the body sees `QT` as a constexpr int; an unknown id fails a check
// that names the argument.
#define MINFER_DISPATCH_QTYPE(qtype, QT, ...)                                                                   \
  [&] {                                                                                                       \
    switch (qtype) {                                                                                          \
      case ::minfer::qgemm::kQ4_0: { constexpr static int QT = ::minfer::qgemm::kQ4_0; return __VA_ARGS__(); } \
      case ::minfer::qgemm::kQ4_1: { constexpr static int QT = ::minfer::qgemm::kQ4_1; return __VA_ARGS__(); } \
      case ::minfer::qgemm::kQ5_0: { constexpr static int QT = ::minfer::qgemm::kQ5_0; return __VA_ARGS__(); } \
      case ::minfer::qgemm::kQ5_1: { constexpr static int QT = ::minfer::qgemm::kQ5_1; return __VA_ARGS__(); } \
      case ::minfer::qgemm::kQ8_0: { constexpr static int QT = ::minfer::qgemm::kQ8_0; return __VA_ARGS__(); } \
      case ::minfer::qgemm::kQ4_K: { constexpr static int QT = ::minfer::qgemm::kQ4_K; return __VA_ARGS__(); } \
      case ::minfer::qgemm::kQ5_K: { constexpr static int QT = ::minfer::qgemm::kQ5_K; return __VA_ARGS__(); } \
      case ::minfer::qgemm::kQ6_K: { constexpr static int QT = ::minfer::qgemm::kQ6_K; return __VA_ARGS__(); } \
      default: MINFER_CHECK(false, #qtype " must be a GGUF type id of Q4_0 (2), Q4_1 (3), Q5_0 (6), Q5_1 (7), " \
                                   "Q8_0 (8), Q4_K (12), Q5_K (13) or Q6_K (14), got ", qtype);                 \
    }                                                                                                         \
  }()
