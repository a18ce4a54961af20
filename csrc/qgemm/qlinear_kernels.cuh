// qlinear's kernels: out[m, n] = sum_k x[m, k] W[n, k] (+ bias[n]) for M <= 32 (decode), W kept as ggml blocks
// (uint8 [N, K / elems * bytes]). Decode is bound by W's bytes, so the kernel must spend few
// instructions per weight: it multiplies the quants themselves, exact small integers in fp16/bf16, on
// the tensor cores, and applies each run's scale (and min) to the fp32 partial sums.
//
// A CTA owns 16 rows of W; its 8 warps split K in chunks (one super-block, or 2 legacy blocks), warp w
// taking chunks w, w + 8, ... Each warp streams its chunks through a ring of shared-memory stages with
// 16-byte cp.async (a row's chunk starts anywhere: the copy starts at the aligned piece holding its first
// byte). Per 32-wide k step, W rows are the A operand of two mma.sync m16n8k16 (one per 16 k), 8 NT rows of
// x (NT = 1, 2, 4: M up to 8, 16, 32) the B operand: a weight is decoded once for all of them. A dot
// product may take its k terms in any order: lane (g = lane / 4, t = lane % 4) takes k = 16 j + 4 t .. + 3
// of mma j, whose four quants sit in one word of the block (step_quants); the fragment register "k 2t,
// 2t + 1" holds physical k 4t, 4t + 2 and "2t + 8, 2t + 9" holds 4t + 1, 4t + 3, for W (int_pairs) and x
// (x_pairs) alike. A step's sums per scale run are then scaled in fp32: acc += a dot(q - offset, x) +
// b sum(x), sum(x) from one more mma against ones where the format has a min. The warps' partial sums meet
// in shared memory at the end (NT x 4 KB, within every format's rings).
//
// Q8_0 and Q6_K at M <= 8 on small grids load a chunk's x before waiting for its weights (XAhead); at M = 1
// the CTA stages x's whole row in shared memory once instead (kXRow), where the int8 kernels do not take it.
// The 4- and 5-bit legacy formats with K up to 2048 on small grids (a small model) skip the rings:
// regs_kernel loads each lane's words of W straight into registers.
// Q4_K up to M = 16 takes its own kernels (q4k below): at M = 1 the quants as they are against x as 22-bit
// integers in three int8 parts (m16n8k32), above it the sub-block scales folded into fp16 quants. At M = 1 Q5_K
// takes Q4_K's int8 kernel with its 5th bits, on the records given or its own; Q6_K takes that int8 form too (q6
// below) where x's records are given, and past 2 CTAs an SM on records of its own; Q8_0, Q4_0 and Q4_1 on sm_90 (b32
// below) on the records given or their own, where K is whole chunks, 8 and more (Q4_0, Q4_1: past 8).
// At M 2-32 on large W (4096 x 4096 and more) every format runs CTAs of 16-row warps (8, or 6-8 for Q4_K up to 16
// rows: qtile_kernel, q4k::tile_kernel) that walk the same 256-k chunks, reading each chunk's x into shared memory
// once a CTA.
//
// Programmatic dependent launch (Hopper): with static_weight (no kernel that may still run writes W),
// the first stages of W are in flight before griddep_wait; x, bias and out only after it.
#pragma once
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>

#include <algorithm>
#include <type_traits>

#include "common/activation.cuh"
#include "common/checks.h"
#include "common/launch.h"
#include "common/ptx.cuh"
#include "common/sm90.cuh"
#include "common/split_counters.h"
#include "common/vec.h"
#include "qgemm/formats.cuh"
#include "qgemm/q4k_x.cuh"
#include "qgemm/qlinear.h"

namespace minfer::qgemm {
namespace {  // the kernels and their launchers: each format's translation unit has its own

using namespace ::minfer::ptx;

// One warp's ring of stages; a stage holds one chunk of 16 rows, row r at r * kRowStride. The 4- and
// 5-bit legacy formats take 64 k a chunk in qlinear_kernel, so that the small K of small models still spreads
// over the 8 warps; Q8_0 (8B Q8_0 decode: 11% slower at 64) and the super-blocks take 256, as every format does
// in ChunkRing (x's records are 256-k chunks).
template <int QT, int kK = Format<QT>::kElems == 256 || QT == kQ8_0 ? 256 : 64>
struct Ring {
  static constexpr int kChunk = kK;  // k per stage
  static constexpr int kBytes = kChunk / Format<QT>::kElems * Format<QT>::kBytes;  // a row's chunk
  static constexpr int kPieces = (kBytes + 15 + 15) / 16;  // 16-byte pieces that cover it at any alignment
  static constexpr int kRowStride = 16 * kPieces, kStageBytes = 16 * kRowStride;
  static constexpr int kStages = 4 * kWarps * kStageBytes <= 32 * 1024   ? 4
                                 : 3 * kWarps * kStageBytes <= 80 * 1024 ? 3
                                                                         : 2;  // 2 for Q6_K
  static constexpr int kSmem = kStages * kWarps * kStageBytes;  // the CTA's rings
};

// Where row n0 + r's chunk c starts in W (bytes): the stage holds it from offset start & 15.
__device__ __forceinline__ int64_t chunk_start(const Args& a, int n0, int r, int c, int chunk_bytes) {
  return int64_t(n0 + r) * a.row_bytes + int64_t(c) * chunk_bytes;
}

// Starts the copy of chunk c of rows n0 .. n0 + 15 into stage, in the 16-byte pieces that hold it (the
// last one of W only up to W's end); the rest of the stage, and rows from N on, get zeros (decoded: 0).
// kOffsets: the aligned case on 32-bit offsets, with no extra piece (Q8_0 16 x 4096 x 4096: 20.2 -> 15.7 us;
// the compiler keeps them in ~10 registers across chunks, which lost 10% on Q4_K at M = 16).
template <int QT, bool kOffsets, int kK = Ring<QT>::kChunk>
__device__ __forceinline__ void load_chunk(uint8_t* stage, const Args& a, int n0, int c, int lane) {
  using R = Ring<QT, kK>;
  if (n0 + 16 < a.N && int64_t(c + 1) * R::kBytes <= a.row_bytes) {  // whole, and W goes on past it: no checks
    const int64_t base = int64_t(n0) * a.row_bytes + int64_t(c) * R::kBytes;  // row n0's chunk
    if (kOffsets && R::kBytes % 16 == 0 && a.aligned) {  // every row's chunk starts aligned: no extra piece
      constexpr int kPerRow = R::kBytes / 16;
#pragma unroll
      for (int i = lane; i < 16 * kPerRow; i += 32) {
        const int r = i / kPerRow, p = i % kPerRow;
        cp_async16(smem_addr(stage + r * R::kRowStride + 16 * p), a.w + base + (r * int(a.row_bytes) + 16 * p), 16);
      }
      return;
    }
#pragma unroll
    for (int i = lane; i < 16 * R::kPieces; i += 32) {
      const int r = i / R::kPieces, p = i % R::kPieces;
      const int64_t piece = ((base + r * a.row_bytes) & ~int64_t(15)) + 16 * p;
      cp_async16(smem_addr(stage + r * R::kRowStride + 16 * p), a.w + piece, 16);
    }
    return;
  }
  const int64_t left = a.row_bytes - int64_t(c) * R::kBytes, len = left < R::kBytes ? left : R::kBytes;  // last: less
  const int64_t total = int64_t(a.N) * a.row_bytes;
#pragma unroll 2
  for (int i = lane; i < 16 * R::kPieces; i += 32) {
    const int r = i / R::kPieces, p = i % R::kPieces;
    const int64_t start = chunk_start(a, n0, r, c, R::kBytes), piece = (start & ~int64_t(15)) + 16 * p;
    const bool ok = n0 + r < a.N && piece < start + len;
    const int bytes = !ok ? 0 : total - piece < 16 ? int(total - piece) : 16;
    cp_async16(smem_addr(stage + r * R::kRowStride + 16 * p), ok ? a.w + piece : a.w, bytes);
  }
}

// The first 128-byte boundary of dynamic shared memory (a TMA box's destination); launches add 128 bytes for it.
__device__ __forceinline__ uint8_t* aligned_128(uint8_t* smem) {
  return smem + ((128 - (smem_addr(smem) & 127)) & 127);
}

// A TMA box row is at most 256 elements: W's bytes are seen as 2-byte elements where a slot's row is wider (Q8_0's
// 288).
template <int QT>
constexpr int kBoxElem = Ring<QT, 256>::kRowStride > 256 ? 2 : 1;

// A warp's S stages of a format's chunks (Q4_K, Q6_K, Q8_0), each row's at its slot's offset chunk_start & 15 (0 for
// Q4_K). On sm_90 the TMA fills them, each stage's bytes counted on its mbarrier:
// - kBox: lane 0 copies the tile's chunk as one [16, kRowStride] box of a tensor map from the 16-byte boundary at
//   or before it (a box from an unaligned start raised an illegal instruction); for Q4_K ~120 fewer instructions
//   a chunk than the per-lane copies below, which the compiler issues one lane at a time;
// - else Q4_K: lane r < 16 copies row n0 + r's chunk (144 bytes, 16-byte aligned: a Q4_K row is a multiple of
//   144 = 9 x 16 bytes) into the row's slot, one bulk copy a lane where load_chunk's cp.async takes 5 16-byte
//   pieces a lane (H200, i8_kernel at 3 CTAs an SM: 1 x 28672 x 4096 27.2 -> 25.5 us). Rows past N are left as
//   they are: their sums are never stored.
// Other formats without the box, and the sm_80 build, take load_chunk, one cp.async group a chunk.
// - kPair (with kBox): W is gate | up and a tile's rows are gate rows n0 / 2 .. + 7, then the same up rows, one
//   [2, 8, kRowStride] box of pair_map.
template <int QT, int S, bool kBox, bool kPair = false>
struct ChunkRing {
  using R = Ring<QT, 256>;
  static constexpr bool kBulk = kBox || QT == kQ4_K;  // on sm_90: TMA and mbarriers, not cp.async
  uint8_t* stages;  // [S][kStageBytes], 128-byte aligned
  const CUtensorMap* map;  // with kBox: W as bytes [N, row_bytes], boxes of [16, kRowStride] (chunk_map)
  uint32_t bar0, dst;  // the stages' mbarriers; this lane's row slot in stage 0
  int lane;

  // bars: S mbarriers (8 bytes each) of this warp; initialized here.
  __device__ ChunkRing(uint8_t* ring, uint64_t* bars, const CUtensorMap* map_, int lane_)
      : stages(ring), map(map_), lane(lane_) {
    bar0 = smem_addr(bars), dst = smem_addr(ring) + lane * R::kRowStride;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if constexpr (kBulk) {
      if (lane < S) mbar_init(bar0 + 8 * lane, 1);
      mbar_init_fence();
      __syncwarp();
    }
#endif
  }
  // Row r of chunk c (tile at n0) in stage.
  __device__ __forceinline__ static const uint8_t* row(const uint8_t* stage, const Args& a, int n0, int r, int c) {
    return stage + r * R::kRowStride + (QT == kQ4_K ? 0 : int(chunk_start(a, n0, r, c, R::kBytes) & 15));
  }
  // Chunk c of the 16-row tile at n0 into stage i % S, empty so far: with kBox one TMA copy by lane 0 of the
  // tile's [16, kRowStride] box from the 16-byte boundary at or before the chunk (the bytes around it ride along;
  // rows past N and bytes past a row's end arrive as zeros, all counted in the box's bytes); else a bulk copy a
  // row (Q4_K) or load_chunk's pieces.
  __device__ __forceinline__ void load(int i, int n0, int c, const Args& a) const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const uint32_t bar = bar0 + 8 * (i % S);
    if constexpr (kBox) {
      if (lane == 0) {
        mbar_expect_tx(bar, R::kStageBytes);
        const int x0 = ((c * R::kBytes) & ~15) / kBoxElem<QT>;
        if constexpr (kPair)
          ptx::tma_load_3d(dst + (i % S) * R::kStageBytes, map, bar, x0, n0 / 2, 0);
        else
          ptx::tma_load_2d(dst + (i % S) * R::kStageBytes, map, bar, x0, n0);
      }
      return;
    } else if constexpr (QT == kQ4_K) {
      const int rows = min(16, a.N - n0);
      if (lane == 0) mbar_expect_tx(bar, rows * R::kBytes);
      if (lane < rows)
        bulk_load(dst + (i % S) * R::kStageBytes, a.w + int64_t(n0 + lane) * a.row_bytes + int64_t(c) * R::kBytes,
                  R::kBytes, bar);
      return;
    }
#endif
    load_chunk<QT, QT == kQ4_K, 256>(stages + (i % S) * R::kStageBytes, a, n0, c, lane);
    cp_async_commit();
  }
  // Chunk c into stage i % S, whose chunk every lane has read (__syncwarp since).
  __device__ __forceinline__ void refill(int i, int n0, int c, const Args& a) const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if constexpr (kBulk) fence_proxy_async();  // those reads (generic proxy) before the copy's writes (async proxy)
#endif
    load(i, n0, c, a);
  }
  // Within tile_pipeline, which commits and waits for the cp.async groups itself: chunk c into stage i % S (as
  // refill on sm_90, else load_chunk's pieces with kOffsets, uncommitted), and the wait for chunk i's TMA bytes.
  template <bool kOffsets>
  __device__ __forceinline__ void tile_refill(int stage, int i, int n0, int c, const Args& a) const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if constexpr (kBulk) return refill(i, n0, c, a);
#endif
    load_chunk<QT, kOffsets, 256>(stages + stage * R::kStageBytes, a, n0, c, lane);
  }
  __device__ __forceinline__ void tile_wait(int i) const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if constexpr (kBulk) mbar_wait(bar0 + 8 * (i % S), (i / S) & 1);
#endif
  }
  // Waits for chunk i, of the `loaded` chunks whose loads were issued in order.
  __device__ __forceinline__ void wait(int i, int loaded) const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if constexpr (kBulk) {
      mbar_wait(bar0 + 8 * (i % S), (i / S) & 1);
      return;
    }
#endif
    const int later = loaded - i - 1;  // groups that may stay in flight
    if (later >= 3) cp_async_wait<3>();
    else if (later == 2) cp_async_wait<2>();
    else if (later == 1) cp_async_wait<1>();
    else cp_async_wait<0>();
    __syncwarp();
  }
};

// T pairs (lo: bytes 0 and 2 of q, hi: bytes 1 and 3) of each byte minus kOffset, exactly. fp16 holds
// 1024 + b as the bits 0x6400 | b (b < 1024), bf16 128 + b as 0x4300 | b (b < 128): one LOP3 and one
// subtraction a pair. bf16 with bytes up to 255 (Q8_0) goes through fp32 2^23 + b instead, whose high
// 16 bits are the bf16 of the small integer b - kOffset.
template <typename T, int kOffset, bool kWide>
__device__ __forceinline__ uint2 int_pairs(uint32_t q) {
  constexpr bool kHalf = std::is_same_v<T, __half>;
  if constexpr (!kHalf && kWide) {
    uint32_t f[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
      f[i] = __float_as_uint(__int_as_float(__byte_perm(q, 0x4B000000u, 0x7440 + i)) - (8388608.f + kOffset));
    return make_uint2(__byte_perm(f[0], f[2], 0x7632), __byte_perm(f[1], f[3], 0x7632));
  } else {
    constexpr uint32_t kMagic = (kHalf ? 0x6400u : 0x4300u) * 0x10001u, kBase = kMagic | (kOffset * 0x10001u);
    uint32_t p[2] = {(q & 0x00FF00FFu) | kMagic, ((q >> 8) & 0x00FF00FFu) | kMagic}, base = kBase;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      if constexpr (kHalf) {
        const __half2 v = __hsub2(*reinterpret_cast<const __half2*>(&p[i]), *reinterpret_cast<const __half2*>(&base));
        p[i] = *reinterpret_cast<const uint32_t*>(&v);
      } else {
        const __nv_bfloat162 v = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&p[i]),
                                         *reinterpret_cast<const __nv_bfloat162*>(&base));
        p[i] = *reinterpret_cast<const uint32_t*>(&v);
      }
    }
    return make_uint2(p[0], p[1]);
  }
}

// x[0 .. 3] (4 consecutive T, 8-byte aligned; zeros where !ok), as loaded. kPinned: issued where it stands
// (a volatile load), else where the compiler schedules it (it hoists a chunk's loads to the chunk's start).
template <bool kPinned, typename T>
__device__ __forceinline__ uint2 x_raw(const T* x, bool ok) {
  if constexpr (kPinned) return ld_nc_v2(reinterpret_cast<const uint2*>(x), ok);
  return ok ? __ldg(reinterpret_cast<const uint2*>(x)) : make_uint2(0, 0);
}
// x[0 .. 3] as loaded, as the pairs (x0, x2), (x1, x3).
__device__ __forceinline__ uint2 x_pairs(uint2 v) {
  return make_uint2(__byte_perm(v.x, v.y, 0x5410), __byte_perm(v.x, v.y, 0x7632));
}

// With kAhead, this lane's x for a whole chunk ([step][x row tile][mma j]), loaded before the chunk's
// weights are waited for, so that the two latencies overlap: x comes from L2, and at M = 1 on 256 CTAs
// waiting for it was 39% of the stalls. Its 32 registers (8 for the 64-k chunks of the legacy 4- and 5-bit
// formats) cost a CTA an SM, which loses on large grids (Q6_K 1 x 128256 x 4096: 164 -> 192 us): qlinear
// takes it on grids of at most 2 CTAs an SM, for every format but Q4_K (its own kernels) and Q5_K (not
// measured). 1 x 4096 x 14336: Q8_0 37.2 -> 27.1 us, Q6_K 31.3 -> 24.3 (H100); Q4_1 42.9 -> 36.6, Q5_0 53.4 ->
// 41.7; Q4_1 1 x 4096 x 4096 13.5 -> 11.3, 1 x 576 x 1536 3.13 -> 2.71 (H200).
template <int QT>
constexpr bool kXAheadFormat = QT != kQ4_K && QT != kQ5_K;
// The formats that take load_chunk's kOffsets.
template <int QT>
constexpr bool kOffsetsFormat = QT == kQ8_0;

template <int QT, int NT, bool kAhead>
struct XAhead {
  static_assert(!kAhead || NT == 1, "XAhead: the registers of NT = 2 would spill");
  static constexpr int kSteps = kAhead ? Ring<QT>::kChunk / 32 : 0;
  uint2 v[kSteps > 0 ? kSteps : 1][NT][2];
};

// x[:, chunk c] into registers: v[s][nt][j] is row 8 nt + g, k = kChunk c + 32 s + 16 j + 4t .. + 3 (volatile
// loads, issued where they stand; zeros past M and K, and everywhere where !ok).
template <int QT, typename T, int NT>
__device__ __forceinline__ void load_x_regs(uint2 (&v)[Ring<QT>::kChunk / 32][NT][2], const Args& a, int c, int g,
                                            int t, bool ok = true) {
#pragma unroll
  for (int s = 0; s < Ring<QT>::kChunk / 32; ++s)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int k = c * Ring<QT>::kChunk + 32 * s + 16 * j + 4 * t, m = 8 * nt + g;
        v[s][nt][j] = x_raw<true>(static_cast<const T*>(a.x) + int64_t(m) * a.K + k, ok && m < a.M && k < a.K);
      }
}
// x[:, chunk c] ahead (nothing without kAhead).
template <int QT, typename T, int NT, bool kAhead>
__device__ __forceinline__ void load_x_ahead(XAhead<QT, NT, kAhead>& xa, const Args& a, int c, int g, int t) {
  if constexpr (kAhead) load_x_regs<QT, T, NT>(xa.v, a, c, g, t);
}

// qtile_kernel's x stage: 8 NT rows of a 256-k chunk of x (2-byte values), each padded by 32 bytes so that the
// 8-byte loads of rows g .. g + 3 fall in different banks.
constexpr int kXTileRow = 256 * 2 + 32;

// acc += one 32-wide step: rows g and g + 8's quants qa / qb ([mma j], step_quants' form) with their runs'
// scales s and mins m, against x row tile nt's pairs xp[nt][j].
template <int QT, typename T, int NT>
__device__ __forceinline__ void mma_quants(float (&acc)[NT][4], const uint32_t (&qa)[2], const uint32_t (&qb)[2],
                                           const float (&sa)[2], const float (&sb)[2], const float (&ma)[2],
                                           const float (&mb)[2], const uint2 (&xp)[NT][2]) {
  constexpr int kRuns = kScalePer16<QT> ? 2 : 1;  // scale runs a step
  constexpr uint32_t kOnes = std::is_same_v<T, __half> ? 0x3C003C00u : 0x3F803F80u;
  const uint32_t ones[4] = {kOnes, kOnes, kOnes, kOnes};
  float dot[NT][kRuns][4] = {}, xsum[NT][4] = {};
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const uint2 pa = int_pairs<T, kQuantOffset<QT>, QT == kQ8_0>(qa[j]);
    const uint2 pb = int_pairs<T, kQuantOffset<QT>, QT == kQ8_0>(qb[j]);
    const uint32_t w[4] = {pa.x, pb.x, pa.y, pb.y};
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      mma_m16n8k16<T>(dot[nt][kRuns == 2 ? j : 0], w, xp[nt][j].x, xp[nt][j].y);
      if constexpr (kHasMin<QT>) mma_m16n8k16<T>(xsum[nt], ones, xp[nt][j].x, xp[nt][j].y);
    }
  }
  // dot[nt][r][i]: row g (i < 2) or g + 8, column 8 nt + 2t + (i & 1) (the C fragment layout)
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int r = 0; r < kRuns; ++r) acc[nt][i] = __fmaf_rn(i < 2 ? sa[r] : sb[r], dot[nt][r][i], acc[nt][i]);
      if constexpr (kHasMin<QT>) acc[nt][i] = __fmaf_rn(i < 2 ? ma[0] : mb[0], xsum[nt][i], acc[nt][i]);
    }
}

// acc += W[n0 .. n0 + 15, chunk c] . x[:, chunk c]^T from the stage (chunks of kK); with kSharedX, x's chunk from
// xs (a qtile_kernel x stage; rows past M read as row 0, whose sums are never stored).
template <int QT, typename T, int NT, bool kAhead, bool kSharedX = false, bool kOnce = kAhead,
          int kK = Ring<QT>::kChunk>
__device__ __forceinline__ void mma_chunk(float (&acc)[NT][4], const uint8_t* stage, const XAhead<QT, NT, kAhead>& xa,
                                          const Args& a, int n0, int c, int g, int t, const uint8_t* xs = nullptr) {
  using R = Ring<QT, kK>;
  const uint8_t* row_a = stage + g * R::kRowStride + (chunk_start(a, n0, g, c, R::kBytes) & 15);
  const uint8_t* row_b = stage + (g + 8) * R::kRowStride + (chunk_start(a, n0, g + 8, c, R::kBytes) & 15);
  const ChunkHead<QT, kOnce> head_a(row_a), head_b(row_b);  // kOnce: the scales once a chunk
  const T* x = static_cast<const T*>(a.x) + int64_t(c) * R::kChunk + 4 * t;
  const int steps = (a.K - c * R::kChunk < R::kChunk ? a.K - c * R::kChunk : R::kChunk) / 32;  // K % 32 == 0
  const uint8_t* xrow[NT];
  if constexpr (kSharedX)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) xrow[nt] = xs + (8 * nt + g < a.M ? 8 * nt + g : 0) * kXTileRow + 8 * t;
#pragma unroll
  for (int s = 0; s < R::kChunk / 32; ++s) {
    if (Format<QT>::kElems == 32 && s >= steps) break;  // a super-block's chunk is always whole
    uint2 xp[NT][2];  // [x row tile][mma j]
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        uint2 v;
        if constexpr (kAhead)
          v = xa.v[s][nt][j];
        else if constexpr (kSharedX)
          v = *reinterpret_cast<const uint2*>(xrow[nt] + 2 * (32 * s + 16 * j));
        else
          v = x_raw<false>(x + int64_t(8 * nt + g) * a.K + 32 * s + 16 * j, 8 * nt + g < a.M);
        xp[nt][j] = x_pairs(v);
      }
    uint32_t qa[2], qb[2];
    float sa[2], sb[2], ma[2], mb[2];  // rows g and g + 8: scale and min of each run
    step_quants<QT>(row_a, s, t, head_a, qa, sa, ma);
    step_quants<QT>(row_b, s, t, head_b, qb, sb, mb);
    mma_quants<QT, T, NT>(acc, qa, qb, sa, sb, ma, mb, xp);
  }
}

// out[:, n0 .. n0 + 15] (+ bias) from a warp's sums (C fragments: acc[4 nt + 2h + e] is x row 8 nt + 2t + e,
// W row n0 + g + 8h).
template <typename T, int NT>
__device__ __forceinline__ void store_rows(const float (&acc)[NT * 4], const Args& a, int n0, int g, int t) {
  const T* bias = static_cast<const T*>(a.bias);
  T* out = static_cast<T*>(a.out);
#pragma unroll
  for (int i = 0; i < NT * 4; ++i) {
    const int m = 8 * (i / 4) + 2 * t + (i & 1), n = n0 + g + 8 * ((i % 4) >> 1);
    if (m < a.M && n < a.N) out[int64_t(m) * a.out_stride + n] = from_float<T>(bias ? acc[i] + to_float(bias[n]) : acc[i]);
  }
}

// qlinear_act's out[:, n0 .. n0 + 7] = act(gate) * up (gated), a tile's rows g being gate row n0 + g and rows g + 8
// its up row.
template <typename T, int NT, typename Act>
__device__ __forceinline__ void store_act(const float (&acc)[NT * 4], const Args& a, int n0, int g, int t) {
  T* out = static_cast<T*>(a.out);
  const int n = n0 + g;
#pragma unroll
  for (int i = 0; i < NT * 4; ++i) {
    if ((i % 4) >> 1) continue;  // acc[i + 2] is the up row of acc[i]'s gate row
    const int m = 8 * (i / 4) + 2 * t + (i & 1);
    if (m < a.M && n < a.N / 2)
      out[int64_t(m) * a.out_stride + n] = gated<T, Act>(from_float<T>(acc[i]), from_float<T>(acc[i + 2]));
  }
}

// Split-K over the grid's y (tile_kernel, qtile_kernel): every CTA writes its warps' sums (fp32) to ws
// [tiles][splits][kWarps][NT * 4][32] and counts itself in (counters: one a tile, zero at entry and left zero);
// the last of a tile's CTAs to arrive adds them in split order into sum and returns true, the others false.
// Writers fence before the count, the last one after it; it reads the partials from L2 (__ldcg).
template <int NT>
__device__ __forceinline__ bool sum_splits(float (&sum)[NT * 4], float* ws, int* counters, int warp, int lane) {
  if (gridDim.y == 1) return true;
  __shared__ int s_last;
  constexpr int kWarpFloats = NT * 4 * 32;
  const int warps = blockDim.x / 32;
  const int64_t tile0 = int64_t(blockIdx.x) * gridDim.y * warps * kWarpFloats + warp * kWarpFloats + lane;
  float* mine = ws + tile0 + int64_t(blockIdx.y) * warps * kWarpFloats;
#pragma unroll
  for (int i = 0; i < NT * 4; ++i) __stcg(mine + 32 * i, sum[i]);
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    s_last = atomicAdd(counters + blockIdx.x, 1) == int(gridDim.y) - 1;
    if (s_last) atomicExch(counters + blockIdx.x, 0);  // every split has arrived: ready for the next launch
  }
  __syncthreads();
  if (!s_last) return false;
  __threadfence();
#pragma unroll
  for (int i = 0; i < NT * 4; ++i) sum[i] = 0.f;
  for (int s = 0; s < int(gridDim.y); ++s)  // split order, this CTA's own included
#pragma unroll
    for (int i = 0; i < NT * 4; ++i) sum[i] += __ldcg(ws + tile0 + int64_t(s) * warps * kWarpFloats + 32 * i);
  return true;
}

// out[:, n0 .. n0 + 15] (+ bias) from the warps' partial sums acc (C fragments), met through the (now idle)
// rings: red[warp][i][lane]. Every cp.async of the CTA must be complete.
template <typename T, int NT, typename Act = void>
__device__ __forceinline__ void reduce_store(const float (&acc)[NT][4], uint8_t* smem, const Args& a, int n0, int warp,
                                             int lane) {
  const int g = lane / 4, t = lane % 4;
  __syncthreads();
  float* red = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int i = 0; i < NT * 4; ++i) red[(warp * NT * 4 + i) * 32 + lane] = acc[i / 4][i % 4];
  __syncthreads();
  if (warp != 0) return;
  float sum[NT * 4];
#pragma unroll
  for (int i = 0; i < NT * 4; ++i) {
    sum[i] = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum[i] += red[(w * NT * 4 + i) * 32 + lane];
  }
  if constexpr (std::is_void_v<Act>)
    store_rows<T, NT>(sum, a, n0, g, t);
  else
    store_act<T, NT, Act>(sum, a, n0, g, t);
}

// The (tile, chunk) items that a warp of a CTA looping over 16-row tiles walks, in order: its chunks warp + kWarps i
// of tile blockIdx.x, then those of tile blockIdx.x + gridDim.x, ...; ahead_* follow the next item to load.
struct TileWalk {
  int mine, tiles, total;  // a tile's chunks of this warp, this CTA's tiles, the items
  int ahead_n0, ahead_i;   // the next item to load: its tile's first row, its chunk warp + kWarps ahead_i

  __device__ TileWalk(const Args& a, int warp) {
    const int chunks = a.K / 256, all = (a.N + 15) / 16;
    mine = warp < chunks ? (chunks - 1 - warp) / kWarps + 1 : 0;
    tiles = (all - 1 - int(blockIdx.x)) / int(gridDim.x) + 1;
    total = tiles * mine;
    ahead_n0 = 16 * int(blockIdx.x), ahead_i = 0;
  }
  __device__ __forceinline__ int n0(int tile) const { return 16 * (int(blockIdx.x) + int(gridDim.x) * tile); }
  __device__ __forceinline__ void advance() {
    if (++ahead_i == mine) ahead_i = 0, ahead_n0 += 16 * int(gridDim.x);
  }
};

// x's row in shared memory (kXRow; Q6_K and Q8_0 at M = 1 on small grids): with x ahead a warp still waits on L2
// for x once a chunk (loaded ahead of the weight wait, used right after it). With kXRow the CTA copies x's whole
// row into shared memory once, behind its rings (chunk c at 2 kChunk c bytes), while the first weight stages
// stream, and the scales are read once a chunk. H200, one build, a switch, µs, x ahead / row in shared memory:
// Q6_K 1 x 4096 x 14336 24.9 / 22.4, 1 x 1024 x 4096 4.9 / 4.3, 1 x 4096 x 4096 8.8 / 8.0; Q8_0 24.9 / 23.6,
// 5.3 / 4.9, 9.4 / 8.7.
template <int QT>
constexpr bool kXRowFormat = QT == kQ6_K || QT == kQ8_0;
constexpr int kXRowMaxK = 16384;  // 32 KB of x: with Q8_0's rings, 106 KB a CTA, 2 CTAs an SM

// x's row [K] (16-byte pieces, K % 8 == 0) into xs, every thread of the CTA, 8 pieces a thread in flight.
__device__ __forceinline__ void stage_x_row(uint8_t* xs, const void* x_row, int K) {
  const uint4* x = static_cast<const uint4*>(x_row);
  const int pieces = K / 8;
  constexpr int kBatch = 8;
  for (int i0 = 0; i0 < pieces; i0 += kBatch * kThreads) {
    uint4 v[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int i = i0 + b * kThreads + threadIdx.x;
      v[b] = ld_nc_v4(x + (i < pieces ? i : 0), i < pieces);
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int i = i0 + b * kThreads + threadIdx.x;
      if (i < pieces) reinterpret_cast<uint4*>(xs)[i] = v[b];
    }
  }
}

// No minimum of CTAs an SM: the compiler's choice (an explicit 1 lets it take up to 255 registers: Q4_K
// 80 -> 115, M = 1 qlinear 11-25% slower).
template <int QT, typename T, int NT, bool kAhead, bool kXRow = false>
__global__ void __launch_bounds__(kThreads)
    qlinear_kernel(const Args a) {
  using R = Ring<QT>;
  static_assert(kWarps * NT * 4 * 32 * sizeof(float) <= R::kSmem, "the partial sums must fit the rings");
  // At NT = 2, with x ahead and with kXRow. Not at NT = 1 without x ahead (the large grids): its offsets took 112
  // registers there, or spilled under a bound of 3 CTAs an SM (Q8_0 1 x 28672 x 4096: 49.7 -> 54.4 us);
  // NT = 4 (M 17-32) was not measured with them.
  constexpr bool kOffsets = kOffsetsFormat<QT> && (NT == 2 || kAhead || kXRow);
  static_assert(!kXRow || (NT == 1 && !kAhead), "kXRow: one row of x, not loaded ahead");
  extern __shared__ __align__(16) uint8_t smem[];  // [kWarps][kStages][kStageBytes], then with kXRow x [K] (T)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int n0 = blockIdx.x * 16, chunks = (a.K + R::kChunk - 1) / R::kChunk;
  const int mine = warp < chunks ? (chunks - 1 - warp) / kWarps + 1 : 0;  // this warp's chunks: warp + kWarps i
  uint8_t* ring = smem + warp * R::kStages * R::kStageBytes;
  if (!a.static_weight) griddep_wait();
#pragma unroll
  for (int i = 0; i < R::kStages - 1; ++i) {
    if (i < mine) load_chunk<QT, kOffsets>(ring + i * R::kStageBytes, a, n0, warp + kWarps * i, lane);
    cp_async_commit();  // one group per chunk, empty past the last: the wait below counts groups
  }
  if (a.static_weight) griddep_wait();  // x, bias and out may be the previous kernel's
  // The next grid launches only now: released at entry, its CTAs took the SMs' slots while this one's 16-row
  // tiles ran (H200, us: Q4_1 1 x 3072 x 576 2.93 -> 2.62, 1 x 576 x 1536 2.75 -> 2.53, 16 x 960 x 576 3.14 -> 2.62).
  griddep_launch_dependents();
  uint8_t* xs = smem + R::kSmem;
  if constexpr (kXRow) {
    stage_x_row(xs, a.x, a.K);
    __syncthreads();
  }
  // 64-k chunks (8 registers of x at NT = 1): chunk i + 1's x is loaded before chunk i's mmas, so that a warp
  // of several chunks pays one L2 round trip for x, not one a chunk
  constexpr bool kNextX = kAhead && R::kChunk == 64;
  float acc[NT][4] = {};
  XAhead<QT, NT, kAhead> xa;
  if (kNextX && mine > 0) load_x_ahead<QT, T, NT, kAhead>(xa, a, warp, g, t);
  for (int i = 0; i < mine; ++i) {
    const int ahead = i + R::kStages - 1;  // refills the stage that chunk i - 1 left
    if (ahead < mine)
      load_chunk<QT, kOffsets>(ring + (ahead % R::kStages) * R::kStageBytes, a, n0, warp + kWarps * ahead, lane);
    cp_async_commit();
    XAhead<QT, NT, kAhead> next{};
    if (!kNextX)
      load_x_ahead<QT, T, NT, kAhead>(xa, a, warp + kWarps * i, g, t);
    else if (i + 1 < mine)
      load_x_ahead<QT, T, NT, kAhead>(next, a, warp + kWarps * (i + 1), g, t);
    cp_async_wait<R::kStages - 1>();  // chunk i's group is done (for this lane) ...
    __syncwarp();                     // ... and for every lane
    const int c = warp + kWarps * i;
    if constexpr (kXRow)
      mma_chunk<QT, T, NT, false, true, true>(acc, ring + (i % R::kStages) * R::kStageBytes, xa, a, n0, c, g, t,
                                              xs + 2 * R::kChunk * c);
    else
      mma_chunk<QT, T, NT, kAhead>(acc, ring + (i % R::kStages) * R::kStageBytes, xa, a, n0, c, g, t);
    __syncwarp();  // every lane is done with the stage before it is refilled
    if (kNextX) xa = next;
  }
  cp_async_wait<0>();
  reduce_store<T, NT>(acc, smem, a, n0, warp, lane);
}

// ---- The 4- and 5-bit legacy formats, short K, small grids: W straight into registers ----
// A small model's linears (K <= 2048: at most kRegChunks chunks a warp, grids of at most 2 CTAs an SM) are
// bound by latency, not bytes: each lane loads the words it decodes (block_words: rows g and g + 8, every
// block of its warp's chunks) in one burst, before griddep_wait where W is static, and decodes them from
// registers; no ring, no cp.async groups, shared memory only for the warps' sums.
constexpr int kRegChunks = 4;
template <int QT>
constexpr bool kRegsFormat = QT == kQ4_0 || QT == kQ4_1 || QT == kQ5_0 || QT == kQ5_1;

// Act (Silu, GeluTanh; void for none): W is gate | up (N = 2 inter rows) and a CTA's 16 rows are gate rows n0 ..
// n0 + 7 and their up rows inter + n0 .., so that its epilogue writes act(gate) * up (store_act), [M, inter].
// Past 8 NT rows of x the grid's y takes them in blocks of 8 NT: each CTA reads its W rows again, from L2.
template <int QT, typename T, int NT, typename Act = void>
__global__ void __launch_bounds__(kThreads) regs_kernel(Args a) {
  using F = Format<QT>;
  constexpr bool kAct = !std::is_void_v<Act>;
  constexpr int kSteps = Ring<QT>::kChunk / 32;  // blocks a chunk
  __shared__ __align__(16) uint8_t red[kWarps * NT * 4 * 32 * sizeof(float)];  // reduce_store's partial sums
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int m0 = blockIdx.y * 8 * NT;  // this CTA's x rows: m0 .. m0 + 8 NT - 1
  a.x = static_cast<const T*>(a.x) + int64_t(m0) * a.K;
  a.out = static_cast<T*>(a.out) + int64_t(m0) * a.out_stride;
  a.M = min(a.M - m0, 8 * NT);
  const int n0 = blockIdx.x * (kAct ? 8 : 16), blocks = a.K / 32, chunks = (blocks + kSteps - 1) / kSteps;
  const int mine = warp < chunks ? (chunks - 1 - warp) / kWarps + 1 : 0;  // this warp's chunks, <= kRegChunks
  const int inter = a.N / 2;
  const bool ok_a = n0 + g < (kAct ? inter : a.N), ok_b = kAct ? ok_a : n0 + g + 8 < a.N;
  const uint8_t* row_a = a.w + int64_t(ok_a ? n0 + g : 0) * a.row_bytes;
  const uint8_t* row_b = a.w + int64_t(ok_b ? (kAct ? inter : 8) + n0 + g : 0) * a.row_bytes;
  BlockWords wa[kRegChunks][kSteps], wb[kRegChunks][kSteps];  // [warp's chunk i][step]: rows g, g + 8
  auto load_w = [&] {
#pragma unroll
    for (int i = 0; i < kRegChunks; ++i)
#pragma unroll
      for (int s = 0; s < kSteps; ++s) {
        const int b = (warp + kWarps * i) * kSteps + s;  // block along K
        const bool ok = i < mine && b < blocks;
        wa[i][s] = ok && ok_a ? block_words<QT>(row_a + b * F::kBytes, t) : BlockWords{};
        wb[i][s] = ok && ok_b ? block_words<QT>(row_b + b * F::kBytes, t) : BlockWords{};
      }
  };
  if (a.static_weight) load_w();
  griddep_wait();  // x, bias and out may be the previous kernel's
  griddep_launch_dependents();
  if (!a.static_weight) load_w();
  // x of chunk i ([step][x row tile][mma j]: row 8 nt + g, k = 64 c + 32 s + 16 j + 4t .. + 3): at NT = 1 every
  // chunk's in one burst (one L2 round trip), at NT = 2 (twice the registers) chunk i + 1's before chunk i's mmas
  constexpr int kXSlots = NT == 1 ? kRegChunks : 2;
  uint2 xv[kXSlots][kSteps][NT][2];
  auto load_x = [&](int i, uint2 (&v)[kSteps][NT][2]) {
    load_x_regs<QT, T, NT>(v, a, warp + kWarps * i, g, t, i < mine);
  };
#pragma unroll
  for (int i = 0; i < (NT == 1 ? kRegChunks : 1); ++i) load_x(i, xv[i]);
  float acc[NT][4] = {};
#pragma unroll
  for (int i = 0; i < kRegChunks; ++i) {
    if (i >= mine) break;
    if (NT > 1 && i + 1 < mine) load_x(i + 1, xv[(i + 1) % kXSlots]);
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
      if ((warp + kWarps * i) * kSteps + s >= blocks) break;  // K's last chunk may hold one block
      uint32_t qa[2], qb[2];
      float sa[2], sb[2], ma[2], mb[2];
      block_quants<QT>(wa[i][s], t, qa, sa, ma);
      block_quants<QT>(wb[i][s], t, qb, sb, mb);
      uint2 xp[NT][2];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int j = 0; j < 2; ++j) xp[nt][j] = x_pairs(xv[i % kXSlots][s][nt][j]);
      mma_quants<QT, T, NT>(acc, qa, qb, sa, sb, ma, mb, xp);
    }
  }
  reduce_store<T, NT, Act>(acc, red, a, n0, warp, lane);
}

// In a pipeline of S stages that commits chunks 0 .. S - 2's weights one group each, then their x in one group,
// then one group a chunk (chunk S - 1 on): waits until chunk i has landed, min(i + 1, S - 1) groups pending.
template <int S>
__device__ __forceinline__ void wait_for_chunk(int i) {
  if (i == 0)
    cp_async_wait<1>();
  else if (S == 4 && i == 1)
    cp_async_wait<2>();
  else
    cp_async_wait<S - 1>();
}

// The tile kernels' pipeline (qtile_kernel, q4k::tile_kernel) over a CTA's chunks 0 .. mine - 1: S weight
// stages a warp, S + 1 x slots, one barrier a chunk (the slot a refill takes was read two chunks before, before
// the last barrier). load_w(stage, i): chunk i's weights (this warp's cp.async); load_x(slot, i): chunk i's x
// (every thread's); mma(stage, slot, i): consumes them. Weights stream before griddep_wait where static.
template <int S, typename LoadW, typename LoadX, typename Mma>
__device__ __forceinline__ void tile_pipeline(int mine, bool static_weight, LoadW load_w, LoadX load_x, Mma mma) {
  static_assert(S >= 2 && S <= 4, "tile_pipeline: the waits below count S - 1 weight groups, then x's");
  griddep_launch_dependents();
  if (!static_weight) griddep_wait();
#pragma unroll
  for (int i = 0; i < S - 1; ++i) {
    if (i < mine) load_w(i, i);
    cp_async_commit();
  }
  if (static_weight) griddep_wait();  // x, bias, out and ws may be the previous kernels'
#pragma unroll
  for (int i = 0; i < S - 1; ++i)
    if (i < mine) load_x(i, i);
  cp_async_commit();
  for (int i = 0; i < mine; ++i) {
    const int ahead = i + S - 1;
    if (ahead < mine) {
      load_w(ahead % S, ahead);
      load_x(ahead % (S + 1), ahead);
    }
    cp_async_commit();
    wait_for_chunk<S>(i);
    __syncthreads();  // chunk i's x (every thread's copies) has landed
    mma(i % S, i % (S + 1), i);
    __syncwarp();  // every lane is done with the stage before it is refilled
  }
}

// ---- M 2-32 in CTAs of 128 rows (Q4_K past 16): x's chunk read into shared memory once a CTA ----
// qlinear_kernel's warps split K and each reads its chunks' x from L2: at M = 16, 16 rows x 512 bytes against a
// Q6_K warp's 3.4 KB of weights a chunk. Here warp w owns rows 16 w .. 16 w + 15 of a 128-row tile and all 8
// walk the same 256-k chunks (the legacy 4- and 5-bit formats too, whose qlinear_kernel chunk is 64 k), whose x
// comes into shared memory once for the CTA; narrow W splits K over the grid's y. H200, us, qlinear_kernel /
// qtile_kernel: Q4_0 16 x 28672 x 4096 77.2 / 44.8, 16 x 4096 x 14336 46.6 / 22.7, 8 x 28672 x 4096 50.5 / 36.3;
// Q5_K 16 x 28672 x 4096 70.8 / 59.6; Q8_0 8 x 28672 x 4096 72.1 / 52.3; Q6_K 4 x 4096 x 14336 25.4 / 20.8; at 32
// rows Q4_K 32 x 28672 x 4096 152.7 / 81.3, Q4_0 119.3 / 59.5, Q8_0 123.8 / 93.5. Slower: the K-quants at 8 x 4096 x
// 4096 (1-5%), Q8_0 at 17 x 4096 x 4096 (16.3 / 18.2: its 2 stages of 288-byte rows and 4 x tiles fit one CTA an
// SM). On sm_90 Q6_K's stages come by ChunkRing's TMA boxes where its rows are multiples of 16 bytes (H200, us,
// pieces / boxes: 16 x 4096 x 14336 28.1 / 24.6, 16 x 128256 x 4096 231 / 199, 16 x 6144 x 4096 15.7 / 13.8, 16 x
// 4096 x 4096 11.1 / 11.3); Q8_0's chunk (272 bytes) is wider than a box row may be (256 elements).
template <int QT>
constexpr int qtile_smem(int nt, int stages) {
  return stages * kWarps * Ring<QT, 256>::kStageBytes + (stages + 1) * 8 * nt * kXTileRow;
}
// The most weight stages (2-4) that keep 2 CTAs an SM; 2 where none does (Q6_K and Q8_0 at NT = 4).
template <int QT, int NT>
constexpr int kQTileStages = qtile_smem<QT>(NT, 4) <= 110 * 1024 ? 4 : qtile_smem<QT>(NT, 3) <= 110 * 1024 ? 3 : 2;

// 256-k chunk c of x's rows 0 .. M - 1 into xs (cp.async, every thread of the CTA; zeros past K).
template <typename T>
__device__ __forceinline__ void load_x_chunk(uint8_t* xs, const Args& a, int c) {
  constexpr int kPieces = 256 / 8;
  const T* x = static_cast<const T*>(a.x);
  for (int i = threadIdx.x; i < a.M * kPieces; i += kThreads) {
    const int m = i / kPieces, p = i % kPieces, k = c * 256 + 8 * p;
    const bool ok = k < a.K;  // K % 32 == 0: a piece lies wholly before K or past it
    cp_async16(smem_addr(xs + m * kXTileRow + 16 * p), ok ? x + int64_t(m) * a.K + k : x, ok ? 16 : 0);
  }
}

template <int QT, typename T, int NT, int S, bool kBox>
__global__ void __launch_bounds__(kThreads, 2)
    qtile_kernel(const Args a, float* ws, int* counters, const __grid_constant__ CUtensorMap w_map) {
  using R = Ring<QT, 256>;
  constexpr int kXStage = 8 * NT * kXTileRow;
  constexpr bool kOffsets = kOffsetsFormat<QT>;
  extern __shared__ __align__(128) uint8_t smem_raw[];
  // [kWarps][S][kStageBytes], then [S + 1][8 NT][kXTileRow]
  uint8_t* smem = aligned_128(smem_raw);
  __shared__ __align__(8) uint64_t bars[kWarps][S];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int n0 = blockIdx.x * 16 * kWarps + 16 * warp, chunks = (a.K + R::kChunk - 1) / R::kChunk;
  const int c0 = int(int64_t(blockIdx.y) * chunks / gridDim.y);
  const int mine = int(int64_t(blockIdx.y + 1) * chunks / gridDim.y) - c0;
  const bool has_rows = n0 < a.N;
  uint8_t* ring = smem + warp * S * R::kStageBytes;
  uint8_t* xs = smem + kWarps * S * R::kStageBytes;
  const ChunkRing<QT, S, kBox> stages(ring, bars[warp], &w_map, lane);
  float acc[NT][4] = {};
  const XAhead<QT, NT, false> none{};
  tile_pipeline<S>(
      mine, a.static_weight,
      [&](int stage, int i) {
        if (has_rows) stages.template tile_refill<kOffsets>(stage, i, n0, c0 + i, a);  // stage == i % S
      },
      [&](int slot, int i) { load_x_chunk<T>(xs + slot * kXStage, a, c0 + i); },
      [&](int stage, int slot, int i) {
        if (!has_rows) return;
        stages.tile_wait(i);
        mma_chunk<QT, T, NT, false, true, false, 256>(acc, ring + stage * R::kStageBytes, none, a, n0, c0 + i, g, t,
                                                      xs + slot * kXStage);
      });
  float sum[NT * 4];
#pragma unroll
  for (int i = 0; i < NT * 4; ++i) sum[i] = acc[i / 4][i % 4];
  if (sum_splits<NT>(sum, ws, counters, warp, lane)) store_rows<T, NT>(sum, a, n0, g, t);
}

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
  const uint8_t* row[NT];  // x row 8 nt + g's record of the chunk (row 0's past M)
  uint4 v[4][2][NT];       // [P][lo, hi][nt]
  uint32_t sums[NT][2];
  float inv[NT][2];
};

template <int NT>
constexpr int kAheadSteps = NT == 1 ? 2 : 1;

// kShared: the records sit in shared memory (tile_kernel), rows past M read as row 0 (their sums are never
// stored); else in global memory, read as zeros past M.
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

// chunk0: row 0's record of this chunk; stride: a row's records.
template <int NT, int kAhead, bool kShared = false>
__device__ __forceinline__ void load_frags(XFrags<NT>& xf, const uint8_t* chunk0, int64_t stride, int M, int g,
                                           int t) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int m = 8 * nt + g;
    xf.row[nt] = chunk0 + (m < M ? m : 0) * stride;
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
      const float* inv_at = reinterpret_cast<const float*>(chunk0 + (mi < M ? mi : 0) * stride + kInvAt);
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

// The M = 1 int8-form kernels' walk (Q4_K below, Q6_K in q6::), the weights through ChunkRing (on sm_90 the TMA's
// boxes or bulk copies). A CTA takes tiles blockIdx.x, + gridDim.x, ... (the grid at most the CTAs an SM holds),
// its warps' rings running on across them: each warp's chunks of tile j follow those of tile j - 1, so the stages
// stay full where a CTA a tile drained its rings and waited a DRAM round trip for the next CTA's first stages.
// The 8B Q4_K_M batch-1 step (gate | up: 1792 tiles), a CTA a tile -> looping: 2.529-2.531 -> 2.504-2.510 ms (H200,
// one build, a switch, two rounds). kEarly: the next kernel may launch at entry, else once x may be read.
// mma(acc, stage, n0, c, x, g, t) adds chunk c of the tile at n0 from its stage and x's records (lane = 4 g + t);
// store(acc, n0, warp, lane) ends the tile, its sums meeting in the kernel's own shared memory, not the rings.
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
  const ChunkRing<QT, S, kBox, kPair> stages(ring, bars[warp], w_map, lane);
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
constexpr int kMinTileWarps = 6;  // tile_kernel's CTAs: 16 rows a warp, 6 to 8 warps (shared memory for 8)
constexpr int kXStride = 576;  // a record in shared memory, padded: rows g and g + 1 of a 16-byte fragment
                               // load fall in different banks

__host__ __device__ constexpr int tile_smem(int nt, int stages) {
  return stages * kWarps * Ring<kQ4_K>::kStageBytes + (stages + 1) * 8 * nt * kXStride;
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

// x's records on sm_90 (tile_kernel): S + 1 slots of [8 NT][kXStride] bytes, chunk i's in slot i % (S + 1), each
// one TMA box of x_map (the records as [M][chunks kRecord / 8] 8-byte elements, boxes of [8 NT][kXStride / 8]: a
// record's fp16 form and the 16 bytes after it; rows past M arrive as zeros) issued by thread 0 on the slot's full
// mbarrier. Each warp, done with a slot, arrives on its empty mbarrier (one arrival a warp), which thread 0 waits
// for before the slot's next box: the warps meet at no CTA barrier between chunks. sm_90 only (tile_kernel's
// other path is tile_pipeline's cp.async).
template <int NT, int S>
struct XSlots {
  static constexpr int kSlots = S + 1, kBytes = 8 * NT * kXStride;
  uint32_t xs, full0, empty0;  // the slots; the full and the empty mbarriers (8 bytes apart)
  const CUtensorMap* map;

  // bars: [2][kSlots] mbarriers, initialized here (every thread of the CTA calls it; a CTA barrier follows).
  __device__ XSlots(uint8_t* slots, uint64_t (*bars)[kSlots], const CUtensorMap* map_)
      : xs(smem_addr(slots)), full0(smem_addr(bars[0])), empty0(smem_addr(bars[1])), map(map_) {
    if (threadIdx.x < kSlots) mbar_init(full0 + 8 * threadIdx.x, 1);
    else if (threadIdx.x < 2 * kSlots) mbar_init(empty0 + 8 * (threadIdx.x - kSlots), blockDim.x / 32);
    mbar_init_fence();
    __syncthreads();
  }
  // Thread 0: chunk c (the CTA's i-th) into slot i % kSlots, once its chunk i - kSlots has been released.
  __device__ __forceinline__ void fill(int i, int c) const {
    const int slot = i % kSlots;
    if (i >= kSlots) mbar_wait(empty0 + 8 * slot, (i / kSlots - 1) & 1);
    fence_proxy_async();  // the warps' reads of the slot (generic proxy) before the box's writes (async proxy)
    const uint32_t bar = full0 + 8 * slot;
    mbar_expect_tx(bar, kBytes);
    tma_load_2d(xs + slot * kBytes, map, bar, c * (kRecord / 8), 0);
  }
  __device__ __forceinline__ void wait(int i) const {
    mbar_wait(full0 + 8 * (i % kSlots), (i / kSlots) & 1);
  }
  // Every lane of the warp is done with chunk i's slot (__syncwarp since).
  __device__ __forceinline__ void release(int i, int lane) const {
    if (lane == 0) mbar_arrive(empty0 + 8 * (i % kSlots));
  }
};

// tile_pipeline with x's records by XSlots (sm_90): the weights as there (S stages a warp, S - 1 ahead, before
// griddep_wait where static), x's chunks S - 1 ahead by thread 0; a warp waits for its chunk's weights and x only.
template <int S, int NT, typename LoadW, typename Mma>
__device__ __forceinline__ void tile_pipeline_tma(int mine, bool static_weight, const XSlots<NT, S>& x, int c0,
                                                  LoadW load_w, Mma mma) {
  const int lane = threadIdx.x % 32;
  griddep_launch_dependents();
  if (!static_weight) griddep_wait();
#pragma unroll
  for (int i = 0; i < S - 1; ++i)
    if (i < mine) load_w(i, i);
  if (static_weight) griddep_wait();  // x, bias, out and ws may be the previous kernels'
  if (threadIdx.x == 0)
#pragma unroll
    for (int i = 0; i < S - 1; ++i)
      if (i < mine) x.fill(i, c0 + i);
  for (int i = 0; i < mine; ++i) {
    const int ahead = i + S - 1;
    if (ahead < mine) {
      load_w(ahead % S, ahead);
      if (threadIdx.x == 0) x.fill(ahead, c0 + ahead);
    }
    x.wait(i);
    mma(i % S, i % (S + 1), i);
    __syncwarp();  // every lane is done with the weight stage and the x slot
    x.release(i, lane);
  }
}

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
// (ChunkRing's kPair; sm_90 only).
template <typename T, int NT, int S, typename Act = void>
__global__ void __launch_bounds__(kThreads, 2)
    tile_kernel(const Args a, const uint8_t* records, float* ws, int* counters,
                const __grid_constant__ CUtensorMap w_map, const __grid_constant__ CUtensorMap x_map) {
  using R = Ring<kQ4_K>;
  constexpr bool kAct = !std::is_void_v<Act>;
  constexpr int kXStage = 8 * NT * kXStride;
  extern __shared__ __align__(128) uint8_t smem_raw[];
  // [kWarps][S][kStageBytes], then [S + 1][8 NT][kXStride]
  uint8_t* smem = aligned_128(smem_raw);
  __shared__ __align__(8) uint64_t bars[kWarps][S];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int warps = blockDim.x / 32;  // kMinTileWarps .. kWarps
  const int n0 = blockIdx.x * 16 * warps + 16 * warp, chunks = a.K / 256;
  const int c0 = int(int64_t(blockIdx.y) * chunks / gridDim.y);
  const int mine = int(int64_t(blockIdx.y + 1) * chunks / gridDim.y) - c0;
  const bool has_rows = n0 < a.N;
  uint8_t* ring = smem + warp * S * R::kStageBytes;
  uint8_t* xs = smem + warps * S * R::kStageBytes;
  const ChunkRing<kQ4_K, S, true, kAct> stages(ring, bars[warp], &w_map, lane);
  float acc[1][NT][4] = {};
  auto load_w = [&](int stage, int i) {
    if (has_rows) stages.template tile_refill<true>(stage, i, n0, c0 + i, a);  // stage == i % S
  };
  auto mma = [&](int stage, int slot, int i) {
    if (!has_rows) return;
    stages.tile_wait(i);
    XFrags<NT> xf;
    load_frags<NT, kAheadSteps<NT>, true>(xf, xs + slot * kXStage, kXStride, a.M, g, t);
    mma_chunk<NT, kAheadSteps<NT>, 1, true>(acc, ring + stage * R::kStageBytes, xf, a.M, a.pair_exps, g, t);
  };
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __shared__ __align__(8) uint64_t x_bars[2][S + 1];
  const XSlots<NT, S> slots(xs, x_bars, &x_map);
  tile_pipeline_tma<S>(mine, a.static_weight, slots, c0, load_w, mma);
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

// Whether a grid of 16-row CTAs is at most 2 CTAs an SM: there the kernels are bound by latency, not issue.
inline bool small_grid(const Args& a, int sms) { return (a.N + 15) / 16 <= 2 * sms; }

// kXRow: x's row (K <= kXRowMaxK) in shared memory behind the rings.
template <int QT, typename T, int NT, bool kAhead = false, bool kXRow = false>
void launch(const Args& a, cudaStream_t stream) {
  constexpr auto kernel = qlinear_kernel<QT, T, NT, kAhead, kXRow>;
  constexpr int kChunk = Ring<QT>::kChunk;
  allow_smem<kernel, Ring<QT>::kSmem + (kXRow ? 2 * kXRowMaxK : 0)>();
  const int smem = Ring<QT>::kSmem + (kXRow ? 2 * ((a.K + kChunk - 1) / kChunk * kChunk) : 0);
  launch_pdl(kernel, dim3((unsigned)((a.N + 15) / 16)), dim3(kThreads), smem, stream, a);
}

// Whether regs_kernel takes the call (a 4- or 5-bit legacy format whose K gives a warp at most kRegChunks chunks,
// on a grid of 16-row tiles of at most 2 CTAs an SM), and launches it if so. H200, us, qlinear_kernel ->
// regs_kernel: Q4_1 1 x 576 x 1536 2.45 -> 1.84, 1 x 960 x 576 1.85 -> 1.42, 16 x 576 x 1536 4.30 -> 2.91,
// 1 x 2048 x 2048 4.07 -> 2.83; Q4_0 / Q5_0 16 x 2048 x 2048 7.65 / 7.94 -> 5.77 / 6.25. At M 17-32 two blocks of
// 16 x rows over the grid's y, against qlinear_kernel's NT = 4: 32 x 960 x 576 3.49 -> 2.30, 32 x 576 x 1536 5.72
// -> 3.45, 32 x 3072 x 576 4.90 -> 5.45 (the default model's batch-32 step 1.009 -> 0.907 ms with the activation
// fused).
// With Act, a.N = 2 inter rows of gate | up and a.out [M, inter]: a CTA for 8 outputs (regs_kernel).
template <int QT, typename T, typename Act = void>
bool launch_if_regs(const Args& a, int sms, cudaStream_t stream) {
  if constexpr (kRegsFormat<QT>) {
    if ((a.K / 32 + 1) / 2 <= kWarps * kRegChunks && small_grid(a, sms)) {
      const unsigned tiles = (unsigned)(std::is_void_v<Act> ? (a.N + 15) / 16 : (a.N / 2 + 7) / 8);
      if (a.M <= 8)
        launch_pdl(regs_kernel<QT, T, 1, Act>, dim3(tiles), dim3(kThreads), 0, stream, a);
      else
        launch_pdl(regs_kernel<QT, T, 2, Act>, dim3(tiles, (unsigned)((a.M + 15) / 16)), dim3(kThreads), 0, stream, a);
      return true;
    }
  }
  return false;
}

// qtile_kernel's (and q4k::tile_kernel's) splits of K over tiles of 16 x warps rows: until the tiles fill 2 CTAs an
// SM, at least 2 chunks a CTA.
inline int tile_splits(int N, int chunks, int sms, int warps = kWarps) {
  const int tiles = (N + 16 * warps - 1) / (16 * warps);
  return std::max(1, std::min(chunks / 2, 2 * sms / tiles));
}

// q4k::tile_kernel's warps a CTA (16 rows each, kMinTileWarps .. kWarps): the fewest chunk rounds on the busiest SM,
// CTAs on it x warps x (chunks a CTA + 1.5 for the pipeline's fill and the split's sum), 2 CTAs an SM; within 3%
// the most warps (x's records are read once a CTA). H200, us, 8 / 7 / 6 warps: 16 x 28672 x 4096 33.6 / 31.8 /
// 43.7 (224 / 256 / 299 CTAs), 16 x 5120 x 4096 10.3 / 10.8 / 9.2, 16 x 6144 x 4096 11.4 / 10.8 / 9.95, 16 x 4096 x
// 14336 18.4 / 18.7 / 18.9, 8 x 28672 x 4096 28.9 / 27.3 / 37.1.
inline int tile_warps(int N, int chunks, int sms) {
  int best = kWarps;
  double best_cost = 0;
  for (int w = kWarps; w >= q4k::kMinTileWarps; --w) {
    const int tiles = (N + 16 * w - 1) / (16 * w), splits = tile_splits(N, chunks, sms, w);
    const int per_sm = (tiles * splits + sms - 1) / sms, per_cta = (chunks + splits - 1) / splits;
    const double cost = double(per_sm) * w * (per_cta + 1.5);
    if (w == kWarps || cost < 0.97 * best_cost) best = w, best_cost = cost;
  }
  return best;
}

// W's bytes as a rank-D tensor for TMA (dims and strides innermost first, strides past the first dim, in bytes),
// boxes of box, of 1- or 2-byte elements (elem: dims[0] and box[0] count them), no swizzle, out-of-bounds bytes as
// zeros.
template <int D>
CUtensorMap w_byte_map(const Args& a, const cuuint64_t (&dims)[D], const cuuint64_t (&strides)[D - 1],
                       const cuuint32_t (&box)[D], int elem = 1) {
  CUtensorMap map{};
  cuuint32_t elem_strides[D];
  for (int i = 0; i < D; ++i) elem_strides[i] = 1;
  const auto type = elem == 2 ? CU_TENSOR_MAP_DATA_TYPE_UINT16 : CU_TENSOR_MAP_DATA_TYPE_UINT8;
  const CUresult r = sm90::tensor_map_encoder()(&map, type, D, const_cast<uint8_t*>(a.w), dims,
                                                strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                                CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  MINFER_CHECK(r == CUDA_SUCCESS, "qlinear: cuTensorMapEncodeTiled failed with error ", int(r), " (n=", a.N,
               ", row bytes=", a.row_bytes, ")");
  return map;
}

// W [N, row_bytes] as a 2D tensor of elem-byte elements (kBoxElem), boxes of box_bytes x 16 rows; zeros (an unused
// map) without the box.
CUtensorMap chunk_map(const Args& a, int box_bytes, bool box, int elem = 1) {
  if (!box) return CUtensorMap{};
  return w_byte_map<2>(a, {(cuuint64_t)(a.row_bytes / elem), (cuuint64_t)a.N}, {(cuuint64_t)a.row_bytes},
                       {(cuuint32_t)(box_bytes / elem), 16}, elem);
}

// W = gate | up [2 inter, row_bytes] as a 3D byte tensor [2][inter][row_bytes], boxes of [2, 8, box_bytes]: a
// 16-row tile of gate rows j .. j + 7, then up's (ChunkRing's kPair).
CUtensorMap pair_map(const Args& a, int box_bytes) {
  const cuuint64_t inter = a.N / 2;
  return w_byte_map<3>(a, {(cuuint64_t)a.row_bytes, inter, 2}, {(cuuint64_t)a.row_bytes, inter * a.row_bytes},
                       {(cuuint32_t)box_bytes, 8, 2});
}

// x's records [M, chunks x kRecord] as a 2D tensor of 8-byte elements, boxes of [rows, kXStride / 8] from a
// chunk's first byte (q4k::XSlots): rows past M arrive as zeros.
CUtensorMap records_map(const uint8_t* records, int M, int chunks, int rows) {
  CUtensorMap map{};
  const cuuint64_t dims[2] = {cuuint64_t(chunks) * (q4k::kRecord / 8), cuuint64_t(M)};
  const cuuint64_t strides[1] = {cuuint64_t(chunks) * q4k::kRecord};
  const cuuint32_t box[2] = {q4k::kXStride / 8, cuuint32_t(rows)}, elem_strides[2] = {1, 1};
  const CUresult r = sm90::tensor_map_encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_UINT64, 2, const_cast<uint8_t*>(records),
                                                dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                                CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  MINFER_CHECK(r == CUDA_SUCCESS, "qlinear: cuTensorMapEncodeTiled failed for x's records with error ", int(r),
               " (rows=", M, ", chunks=", chunks, ")");
  return map;
}

// A tile kernel's grid (tiles of 16 x warps rows, tile_splits of the chunks) and, where it splits, sum_splits' fp32
// workspace (from the caching allocator) and arrival counters.
struct TileGrid {
  dim3 dims;
  at::Tensor ws_tensor, own_counters;
  float* ws = nullptr;
  int* counters = nullptr;
  TileGrid(int N, int chunks, int nt, int sms, const at::Tensor& x, cudaStream_t stream, int warps = kWarps) {
    const int tiles = (N + 16 * warps - 1) / (16 * warps), splits = tile_splits(N, chunks, sms, warps);
    dims = dim3((unsigned)tiles, (unsigned)splits);
    if (splits == 1) return;
    ws_tensor = x.new_empty({int64_t(tiles) * splits * warps * nt * 4 * 32}, at::kFloat);
    ws = ws_tensor.data_ptr<float>();
    counters = split_counters(tiles, x.get_device(), stream, x, own_counters);
  }
};

template <int QT, typename T, int NT>
void launch_qtile(const Args& a, const at::Tensor& x, int sms, cudaStream_t stream) {
  constexpr int S = kQTileStages<QT, NT>;
  // W's blocks are 16-byte aligned (check_blocks)
  const bool box = QT == kQ6_K && cc_major(c10::cuda::current_device()) >= 9 && a.row_bytes % 16 == 0;
  const CUtensorMap map = chunk_map(a, Ring<QT, 256>::kRowStride, box);
  TileGrid grid(a.N, (a.K + 255) / 256, NT, sms, x, stream);
  auto go = [&](auto use_box) {
    constexpr auto kernel = qtile_kernel<QT, T, NT, S, decltype(use_box)::value>;
    constexpr int smem = qtile_smem<QT>(NT, S) + 128;
    allow_smem<kernel, smem>();
    launch_pdl(kernel, grid.dims, dim3(kThreads), smem, stream, a, grid.ws, grid.counters, map);
  };
  if constexpr (QT == kQ6_K) {
    if (box) return go(std::true_type{});
  }
  go(std::false_type{});
}

template <typename T, int NT, int S, int kTiles = 1>
void launch_q4k_rows(const Args& a, const uint8_t* records, cudaStream_t stream) {
  constexpr auto kernel = q4k::rows_kernel<T, NT, S, kTiles>;
  constexpr int smem = S * kWarps * kTiles * Ring<kQ4_K>::kStageBytes;
  allow_smem<kernel, smem>();
  launch_pdl(kernel, dim3((unsigned)((a.N + 16 * kTiles - 1) / (16 * kTiles))), dim3(kThreads), smem, stream, a,
             records);
}

// An M = 1 int8-form kernel (its CTAs loop over W's 16-row tiles: i8_walk) on the CTAs the SMs hold at once, or one a
// tile where there are fewer tiles; kSmem: its rings and 128 bytes to align them.
template <auto kKernel, int kSmem>
void launch_i8_walk(const Args& a, const uint8_t* records, const CUtensorMap& map, int sms, cudaStream_t stream) {
  allow_smem<kKernel, kSmem>();
  const int grid = std::min((a.N + 15) / 16, resident_ctas<kKernel, kThreads, kSmem>() * sms);
  launch_pdl(kKernel, dim3((unsigned)grid), dim3(kThreads), kSmem, stream, a, records, map);
}

// Whether an int8-form kernel holds x's chunks in registers across a warp's tiles (i8_walk's kXRegs): at most 2 a
// warp, and the grid looping over several tiles a CTA; its 19 more registers take 2 CTAs an SM. H200, us, Q4_K 3
// CTAs / held: 1 x 28672 x 4096 23.1 / 20.6; on one or two tiles a CTA it lost (1 x 4096 x 4096 5.3 / 5.6, 1 x 6144
// x 4096 6.7 / 7.1).
inline bool held_x(const Args& a, int sms) { return a.K / 256 <= 2 * kWarps && (a.N + 15) / 16 > 4 * sms; }

// x [M, K]'s records (q4k_x.cuh; the int8 form at M = 1) into records, a warp a row's chunk.
template <typename T>
void write_records(const T* x, uint8_t* records, int M, int K, cudaStream_t stream) {
  const int64_t warps = int64_t(M) * (K / 256);
  launch_pdl(q4k::prepare_x_kernel<T>, dim3((unsigned)((warps + kWarps - 1) / kWarps)), dim3(kThreads), 0, stream, x,
             records, M, K, q4k_x::int8_form(M));
}

// x's records: those given (written by the kernel before x's linear), else prepare_x_kernel's into own.
template <typename T>
const uint8_t* records_or_own(const Args& a, const uint8_t* records, const at::Tensor& x, at::Tensor& own,
                              cudaStream_t stream) {
  if (records != nullptr) return records;
  own = x.new_empty({a.M, a.K / 256 * q4k::kRecord}, at::kByte);
  write_records(static_cast<const T*>(a.x), own.data_ptr<uint8_t>(), a.M, a.K, stream);
  return own.data_ptr<uint8_t>();
}

// Q6_K at M = 1 on int8 records (those given, else prepare_x_kernel's): 3 stages a warp where the grid is at most
// 2 CTAs an SM (92 KB each), else 2. On sm_90, with rows a multiple of 16 bytes (K a multiple of 2048), the stages
// come by TMA boxes: the 8B Q4_K_M batch-1 step (16 down projections, 16 v) 2.406-2.408 ms on load_chunk's pieces,
// 2.347-2.348 by boxes (H200).
template <typename T>
void launch_q6_i8(const Args& a, const uint8_t* records, const at::Tensor& x, int sms, cudaStream_t stream) {
  at::Tensor own;
  records = records_or_own<T>(a, records, x, own, stream);
  // W's blocks are 16-byte aligned (check_blocks)
  const bool box = cc_major(c10::cuda::current_device()) >= 9 && a.row_bytes % 16 == 0;
  const CUtensorMap map = chunk_map(a, Ring<kQ6_K>::kRowStride, box);
  auto go = [&](auto stages, auto use_box) {
    constexpr int S = decltype(stages)::value;
    launch_i8_walk<q6::i8_kernel<T, S, decltype(use_box)::value>, S * kWarps * Ring<kQ6_K>::kStageBytes + 128>(
        a, records, map, sms, stream);
  };
  auto with_stages = [&](auto use_box) {
    if (small_grid(a, sms))
      go(std::integral_constant<int, 3>{}, use_box);
    else
      go(std::integral_constant<int, 2>{}, use_box);
  };
  if (box)
    with_stages(std::true_type{});
  else
    with_stages(std::false_type{});
}

// Q8_0, Q4_0 and Q4_1 at M = 1 on int8 records (those given, else prepare_x_kernel's), x's chunks held across tiles
// as Q4_K's (launch_q4k_i8). Q8_0: 3 stages a warp, 2 CTAs an SM (110 KB each); Q4_0, Q4_1 as Q4_K: 4 stages at 2
// CTAs an SM on small grids and held, else 3 at 3. Against qlinear_kernel on bf16 x (H200, one build, a switch, us,
// with the prepare_x launch): Q8_0 (two rounds) 1 x 6144 x 4096 13.7 -> 9.4, 1 x 4096 x 4096 8.7 -> 8.0, 1 x 28672 x
// 4096 48.0 -> 32.9 (62 -> 91% of copy), 1 x 4096 x 14336 23.6 -> 18.4, 1 x 128256 x 4096 180-182 -> 139; Q4_0 12.4 ->
// 9.1, 9.0 -> 6.5, 41.7 -> 21.7 (38 -> 72%), 25.6 -> 14.8, 161.6 -> 87.9; Q4_1 12.8 -> 8.6, 9.1 -> 6.5, 44.0 -> 22.6,
// 26.9 -> 15.1, 175.9 -> 96.5. The 8B batch-1 step: Q8_0 3.460 / 3.463 -> 2.683 / 2.683 ms, Q4_0 3.583 / 3.583 ->
// 2.052 / 2.051.
template <int QT, typename T>
void launch_b32_i8(const Args& a, const uint8_t* records, const at::Tensor& x, int sms, cudaStream_t stream) {
  at::Tensor own;
  records = records_or_own<T>(a, records, x, own, stream);
  const CUtensorMap map = chunk_map(a, Ring<QT, 256>::kRowStride, true, kBoxElem<QT>);
  auto go = [&](auto stages, auto ctas, auto held) {
    constexpr int S = decltype(stages)::value;
    launch_i8_walk<b32::i8_kernel<QT, T, S, decltype(ctas)::value, decltype(held)::value>,
                   S * kWarps * Ring<QT, 256>::kStageBytes + 128>(a, records, map, sms, stream);
  };
  using Two = std::integral_constant<int, 2>;
  using Deep = std::integral_constant<int, QT == kQ8_0 ? 3 : 4>;  // Q8_0's 4.6 KB stages: 3
  if (held_x(a, sms))
    go(Deep{}, Two{}, std::true_type{});
  else if (QT == kQ8_0 || small_grid(a, sms))
    go(Deep{}, Two{}, std::false_type{});
  else if constexpr (QT != kQ8_0)
    go(std::integral_constant<int, 3>{}, std::integral_constant<int, 3>{}, std::false_type{});
}

// On sm_90 a warp's stages come by one TMA box copy each where its ring runs over at least 4 chunks; with 2-3 (a
// single DRAM round trip a warp, as at 4096 or 6144 x 4096) the 16 lanes' bulk copies start sooner. H200, us,
// lanes / box: 1 x 28672 x 4096 26.13 / 21.48, 1 x 128256 x 4096 99.12 / 94.19, 1 x 4096 x 14336 13.87 / 13.36
// (7 chunks a warp); 1 x 4096 x 4096 5.39 / 5.93, 1 x 6144 x 4096 6.91 / 7.79 (2).
// With Act (the activation's pairs, sm_90 only): always the pair box.
// QT: Q4_K, or Q5_K (launch_q5k_i8).
template <typename T, int S, int kCTAs = 2, typename Act = void, int QT = kQ4_K>
void launch_q4k_i8(const Args& a, const uint8_t* records, int sms, cudaStream_t stream) {
  const int tiles = (a.N + 15) / 16;
  auto go = [&](auto use_box, const CUtensorMap& map) {
    auto run = [&](auto stages, auto ctas, auto held) {
      constexpr int kS = decltype(stages)::value;
      launch_i8_walk<q4k::i8_kernel<T, kS, decltype(ctas)::value, decltype(use_box)::value, Act,
                                    decltype(held)::value, QT>,
                     kS * kWarps * Ring<QT>::kStageBytes + 128>(a, records, map, sms, stream);
    };
    if (held_x(a, sms))  // 4 stages at 2 CTAs an SM
      run(std::integral_constant<int, 4>{}, std::integral_constant<int, 2>{}, std::true_type{});
    else
      run(std::integral_constant<int, S>{}, std::integral_constant<int, kCTAs>{}, std::false_type{});
  };
  if constexpr (!std::is_void_v<Act>) {
    go(std::true_type{}, pair_map(a, Ring<kQ4_K>::kRowStride));
  } else {
    const int ctas = std::min(tiles, kCTAs * sms);
    const int warp_chunks = (tiles + ctas - 1) / ctas * ((a.K / 256 + kWarps - 1) / kWarps);
    if (cc_major(c10::cuda::current_device()) >= 9 && warp_chunks >= 4)
      go(std::true_type{}, chunk_map(a, Ring<QT>::kRowStride, true));
    else
      go(std::false_type{}, CUtensorMap{});
  }
}

// Q5_K at M = 1 on int8 records (those given, else prepare_x_kernel's): Q4_K's kernel and walk with the 5th bits;
// 4 stages a warp where the grid is at most 2 CTAs an SM (98 KB each), else 2 at 3 CTAs an SM (3 of 3 KB stages
// leave room for 2). Against qlinear_kernel on bf16 x (H200, one build, a switch, two rounds, us, with the prepare_x
// launch): 1 x 6144 x 4096 14.5 -> 8.4, 1 x 4096 x 4096 8.5 -> 6.6, 1 x 28672 x 4096 46.2 -> 23.4 (42 -> 83% of
// copy), 1 x 4096 x 14336 24.5 -> 15.2, 1 x 128256 x 4096 182.8 -> 97.9; the 8B Q5_K_M batch-1 step 3.386 -> 2.295 ms.
template <typename T>
void launch_q5k_i8(const Args& a, const uint8_t* records, const at::Tensor& x, int sms, cudaStream_t stream) {
  at::Tensor own;
  const uint8_t* r = records_or_own<T>(a, records, x, own, stream);
  if (small_grid(a, sms))
    launch_q4k_i8<T, 4, 2, void, kQ5_K>(a, r, sms, stream);
  else
    launch_q4k_i8<T, 2, 3, void, kQ5_K>(a, r, sms, stream);
}

// Whether Q4_K at M 2-16 takes tile_kernel (after prepare_x_kernel) rather than rows_kernel: where the tiles
// fill the SMs alone, or past M = 4 where its CTAs take more than 2 chunks each. H200, one build, two
// rounds, us, rows / tile: 16 x 28672 x 4096 56.5 / 41.5, 16 x 4096 x 14336 25.5 / 22.5, 16 x 5120 x 4096
// 15.7 / 12.1, 16 x 6144 x 4096 15.8 / 13.5, 2 x 28672 x 4096 32.4 / 28.8; 2 chunks a CTA lose (16 x 4096 x
// 4096 9.6 / 11.8, 8 x 4096 x 4096 7.4 / 9.2, 16 x 1024 x 4096 7.5 / 8.7), and so do M = 2 on narrow
// grids (2 x 5120 x 4096 9.7 / 10.1, 2 x 6144 x 4096 10.3 / 10.9).
inline bool q4k_tile(const Args& a, int sms) {
  const int splits = tile_splits(a.N, a.K / 256, sms);
  return splits == 1 || (a.M > 4 && 2 * (a.K / 256) > 5 * splits);
}

// With Act (sm_90 only): the pair boxes, out [M, N / 2] = act(gate) * up.
template <typename T, int NT, int S, typename Act = void>
void launch_q4k_tile(const Args& a, const uint8_t* records, const at::Tensor& x, int sms, cudaStream_t stream) {
  constexpr int smem = q4k::tile_smem(NT, S) + 128;
  const bool sm90 = cc_major(c10::cuda::current_device()) >= 9;
  const CUtensorMap map = std::is_void_v<Act> ? chunk_map(a, Ring<kQ4_K>::kRowStride, sm90)
                                              : pair_map(a, Ring<kQ4_K>::kRowStride);
  const CUtensorMap x_map = sm90 ? records_map(records, a.M, a.K / 256, 8 * NT) : CUtensorMap{};
  const int warps = tile_warps(a.N, a.K / 256, sms);
  TileGrid grid(a.N, a.K / 256, NT, sms, x, stream, warps);
  constexpr auto kernel = q4k::tile_kernel<T, NT, S, Act>;
  allow_smem<kernel, smem>();
  launch_pdl(kernel, grid.dims, dim3(32 * warps), smem, stream, a, records, grid.ws, grid.counters, map, x_map);
}

// Q4_K at M <= 16: i8_kernel at M = 1 (the int8 form), else rows_kernel or tile_kernel (q4k_tile) on x's records (uint8 [M,
// K / 256 * kRecord]): those given (written by the kernel before, q4k_x.cuh), or prepare_x_kernel's into the
// caching allocator. rows_kernel: 4 stages a warp where the grid is at most 2 CTAs an SM, else 3.
// At M = 1 the int8 form against the fp16 one (H200, one build, a switch, two rounds, us; the fp16 form's
// staged_kernel, which converted x in each CTA, on grids of one 3-CTA wave): 1 x 4096 x 4096 6.97 -> 5.77 (with
// its prepare_x launch), 1 x 6144 x 4096 9.95 -> 8.71, 1 x 28672 x 4096 29.75 -> 27.1, 1 x 4096 x 14336 16.25 ->
// 14.34, 1 x 128256 x 4096 123 -> 104.
// 3 CTAs an SM (80 registers) spilled ~100 bytes at NT = 1 and lost to 2 (H100, us, 1 x 28672 x 4096
// 40.7 / 32.0, 8 x 28672 x 4096 47.7 / 35.4, 1 x 128256 x 4096 160 / 121). At M > 8 a CTA of 32 rows reads
// x's records once for both of its tiles, which pays where it keeps every SM busy or its warps take many
// chunks (H100, us, 16 rows / 32: 16 x 4096 x 14336 32.3 / 29.8, 16 x 28672 x 4096 60.8 / 57.5, 16 x 128256
// x 4096 261 / 234, 16 x 5120 x 4096 16.2 / 15.9; 16 x 4096 x 4096, 128 CTAs of 32 rows, 9.9 / 10.6).
template <typename T>
void launch_q4k(const Args& a, const uint8_t* records, const at::Tensor& x, int sms, cudaStream_t stream) {
  const bool i8 = q4k_x::int8_form(a.M);
  at::Tensor own;
  const uint8_t* r = records_or_own<T>(a, records, x, own, stream);
  if (i8) {  // 3 CTAs an SM (71 registers) where the grid fills more than 2, but past 4 (launch_q4k_i8's held)
    if (small_grid(a, sms))
      launch_q4k_i8<T, 4>(a, r, sms, stream);
    else
      launch_q4k_i8<T, 3, 3>(a, r, sms, stream);
    return;
  }
  if (a.M > 1 && q4k_tile(a, sms)) {
    if (a.M > 8)
      launch_q4k_tile<T, 2, 3>(a, r, x, sms, stream);
    else
      launch_q4k_tile<T, 1, 4>(a, r, x, sms, stream);
    return;
  }
  if (a.M > 8 && ((a.N + 31) / 32 >= sms || a.K >= 8192))  // 32 rows a CTA: see launch_q4k's comment
    launch_q4k_rows<T, 2, 3, 2>(a, r, stream);
  else if (a.M > 8)
    launch_q4k_rows<T, 2, 3>(a, r, stream);
  else if (small_grid(a, sms))
    launch_q4k_rows<T, 1, 4>(a, r, stream);
  else
    launch_q4k_rows<T, 1, 3>(a, r, stream);
}

// The kernels that read x's records (reads_records), on those given or, where records is null, on records of their
// own (a prepare_x launch).
template <int QT, typename T>
void launch_on_records(const Args& a, const uint8_t* records, const at::Tensor& x, int sms, cudaStream_t stream) {
  if constexpr (QT == kQ4_K)
    launch_q4k<T>(a, records, x, sms, stream);
  else if constexpr (QT == kQ6_K)
    launch_q6_i8<T>(a, records, x, sms, stream);
  else if constexpr (QT == kQ5_K)
    launch_q5k_i8<T>(a, records, x, sms, stream);
  else if constexpr (QT == kQ8_0 || QT == kQ4_0 || QT == kQ4_1)
    launch_b32_i8<QT, T>(a, records, x, sms, stream);
  else
    MINFER_CHECK(false, "qlinear: no records kernel for this type");
}

// Whether qlinear takes qtile_kernel, and launches it if so (NT = 1, 2, 4 tiles of 8 x rows):
// - M 2-32 (Q4_K: 17-32) from 4096 x 4096 on (measured at its section). H200, one run, us, qlinear_kernel /
//   qtile_kernel at 16 rows: Q8_0 16 x 28672 x 4096 88.4 / 58.6, 16 x 4096 x 4096 14.9 / 11.8; Q6_K 16 x 128256 x
//   4096 262.7 / 233.2. Smaller W lost (Q6_K 16 x 1024 x 4096 9.1 / 9.6; Q4_1 at SmolLM2's shapes, 2-3 chunks a
//   CTA, 2.6-4.4 / 5.1-7.1).
// - Q6_K and Q8_0 up to 16 rows with K of fewer chunks than a CTA has warps (a small model's tied lm_head), on
//   grids past 2 CTAs an SM: there qlinear_kernel idles most warps (3 of 8 busy at K = 576) in CTAs of 16 rows.
//   H200, two rounds, us: Q8_0 1 x 49152 x 576 24.2 / 16.0, 16 x 49152 x 576 41.6 / 19.0, 1 x 262144 x 640 110.4 /
//   74.9, 16 x 262144 x 640 200.4 / 90.4; on a grid of 32 tiles it lost (1 x 4096 x 576 3.1 / 6.5).
template <int QT, typename T>
bool launch_if_qtile(const Args& a, const at::Tensor& x, int sms, cudaStream_t stream) {
  const bool wide = a.M > (QT == kQ4_K ? 16 : 1) && a.N >= 4096 && a.K >= 4096;  // Q4_K to 16 rows: q4k's kernels
  const bool short_k = (QT == kQ6_K || QT == kQ8_0) && a.M <= 16 && a.K < kWarps * 256 && !small_grid(a, sms);
  if (!wide && !short_k) return false;
  if (a.M > 16)
    launch_qtile<QT, T, 4>(a, x, sms, stream);
  else if (a.M > 8)
    launch_qtile<QT, T, 2>(a, x, sms, stream);
  else
    launch_qtile<QT, T, 1>(a, x, sms, stream);
  return true;
}

}  // namespace
}  // namespace minfer::qgemm

namespace minfer::qgemm {

template <int QT, typename T>
void run(const Args& a, const uint8_t* records, const at::Tensor& x, int sms, int cc, cudaStream_t stream) {
  // Q6_K at one row without records: below, by its grid
  if (reads_records(QT, a.M, a.K, cc) && (records != nullptr || QT != kQ6_K))
    launch_on_records<QT, T>(a, records, x, sms, stream);
  else if (launch_if_qtile<QT, T>(a, x, sms, stream))
    return;
  // Q6_K at M = 1 past 2 CTAs an SM (a Q4_K_M lm_head; short K took qtile_kernel above) on records of its own: the
  // int8 form and its prepare_x launch beat qlinear_kernel (H200, 1 x 128256 x 4096: 163.5 -> 127.1 us; the 8B
  // Q4_K_M batch-1 step 2.073 / 2.081 -> 2.043 / 2.040 ms, one build, a switch, two rounds)
  else if (QT == kQ6_K && a.M == 1 && !small_grid(a, sms))
    launch_q6_i8<T>(a, nullptr, x, sms, stream);
  else if (launch_if_regs<QT, T>(a, sms, stream))
    return;
  // x ahead where the grid is at most 2 CTAs an SM (latency-bound; see XAhead)
  else if (kXAheadFormat<QT> && a.M <= 8 && small_grid(a, sms)) {
    if constexpr (kXRowFormat<QT>) {
      if (a.M == 1 && a.K <= kXRowMaxK) {
        launch<QT, T, 1, false, true>(a, stream);
        return;
      }
    }
    launch<QT, T, 1, kXAheadFormat<QT>>(a, stream);
  }
  else if (a.M <= 8)
    launch<QT, T, 1>(a, stream);
  else if (a.M <= 16)
    launch<QT, T, 2>(a, stream);
  else
    launch<QT, T, 4>(a, stream);
}

template <int QT, typename T>
bool run_act(const Args& a, bool silu, const uint8_t* x_records, uint8_t* out_records, const at::Tensor& x, int sms,
             int cc, cudaStream_t stream) {
  if constexpr (QT == kQ4_K) {
    // up to 16 rows on x's records (sm_90), where the kernel is i8_kernel (one row) or tile_kernel: their pair tiles,
    // then out's records in a launch of their own
    if (a.M <= 16 && x_records != nullptr && cc >= 9 && (a.M == 1 || q4k_tile(a, sms))) {
      auto go = [&](auto act) {
        using Act = decltype(act);
        if (a.M > 8)
          launch_q4k_tile<T, 2, 3, Act>(a, x_records, x, sms, stream);
        else if (a.M > 1)
          launch_q4k_tile<T, 1, 4, Act>(a, x_records, x, sms, stream);
        else if (small_grid(a, sms))
          launch_q4k_i8<T, 4, 2, Act>(a, x_records, sms, stream);
        else
          launch_q4k_i8<T, 3, 3, Act>(a, x_records, sms, stream);
      };
      if (silu)
        go(Silu{});
      else
        go(GeluTanh{});
      if (out_records != nullptr) write_records(static_cast<const T*>(a.out), out_records, a.M, a.N / 2, stream);
      return true;
    }
  }
  if (out_records != nullptr) return false;  // regs_kernel's epilogue writes no records
  return silu ? launch_if_regs<QT, T, Silu>(a, sms, stream) : launch_if_regs<QT, T, GeluTanh>(a, sms, stream);
}

}  // namespace minfer::qgemm

// One format's instantiations, for both activation dtypes (qlinear_<format>.cu).
#define MINFER_QLINEAR_FORMAT(QT)                                                                                    \
  namespace minfer::qgemm {                                                                                          \
  template void run<QT, __half>(const Args&, const uint8_t*, const at::Tensor&, int, int, cudaStream_t);             \
  template void run<QT, __nv_bfloat16>(const Args&, const uint8_t*, const at::Tensor&, int, int, cudaStream_t);      \
  template bool run_act<QT, __half>(const Args&, bool, const uint8_t*, uint8_t*, const at::Tensor&, int, int,        \
                                    cudaStream_t);                                                                   \
  template bool run_act<QT, __nv_bfloat16>(const Args&, bool, const uint8_t*, uint8_t*, const at::Tensor&, int, int, \
                                           cudaStream_t);                                                            \
  }
