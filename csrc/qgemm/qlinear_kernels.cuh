// qlinear's kernels (here the format-generic ones; Q4_K's in q4k_kernels.cuh, the other int8-records kernels in
// i8_kernels.cuh, the choice among them in qlinear_launch.cuh):
// out[m, n] = sum_k x[m, k] W[n, k] (+ bias[n]) for M <= 32 (decode), W kept as ggml blocks
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
// Q4_K up to M = 16 takes its own kernels (q4k, q4k_kernels.cuh): at M = 1 the quants as they are against x as
// 22-bit integers in three int8 parts (m16n8k32), above it the sub-block scales folded into fp16 quants. At M = 1
// Q5_K takes Q4_K's int8 kernel with its 5th bits, on the records given or its own; Q6_K takes that int8 form too
// (q6, i8_kernels.cuh) where x's records are given, and past 2 CTAs an SM on records of its own; Q8_0, Q4_0 and
// Q4_1 on sm_90 (b32, i8_kernels.cuh) on the records given or their own, where K is whole chunks, 8 and more (Q4_0,
// Q4_1: past 8).
// At M 2-32 on large W (4096 x 4096 and more) every format runs CTAs of 16-row warps (8, or 6-8 for Q4_K up to 16
// rows: qtile_kernel, q4k::tile_kernel) that walk the same 256-k chunks, reading each chunk's x into shared memory
// once a CTA.
//
// Programmatic dependent launch (Hopper): with static_weight (no kernel that may still run writes W),
// the first stages of W are in flight before griddep_wait; x, bias and out only after it.
#pragma once
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <type_traits>

#include "common/activation.cuh"
#include "common/checks.h"
#include "common/launch.h"
#include "common/ptx.cuh"
#include "common/reduce.h"
#include "common/rms.cuh"
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
  // 16-byte pieces that cover it at any alignment; Q4_K's start aligned (144 = 9 x 16 bytes a chunk and every row a
  // multiple) and its stages are dense, so that a tiled W's chunk is one box of 2304 contiguous bytes (with 16 bytes
  // a row past the chunk the box is 16 runs, and tiles lost: perf/qgemm.md)
  static constexpr int kPieces = QT == kQ4_K ? kBytes / 16 : (kBytes + 15 + 15) / 16;
  static constexpr int kRowStride = 16 * kPieces, kStageBytes = 16 * kRowStride;
  static constexpr int kStages = 4 * kWarps * kStageBytes <= 32 * 1024   ? 4
                                 : 3 * kWarps * kStageBytes <= 80 * 1024 ? 3
                                                                         : 2;  // 2 for Q6_K
  static constexpr int kSmem = kStages * kWarps * kStageBytes;  // the CTA's rings
};

// Where row n0 + r's chunk c starts in W (bytes): the stage holds it from offset start & 15.
__device__ __forceinline__ int64_t chunk_start(const Args& a, int n0, int r, int c, int chunk_bytes) {
  const int n = n0 + r;
  if (a.tiled) return int64_t(n & ~15) * a.row_bytes + int64_t(16 * c + (n & 15)) * chunk_bytes;
  return int64_t(n) * a.row_bytes + int64_t(c) * chunk_bytes;
}

// Row n's chunk c as a row of W's tiled view (a.tiled: [N x chunks, chunk bytes], chunk_map and pair_map).
__device__ __forceinline__ int tiled_row(const Args& a, int n, int c) {
  return (n & ~15) * (a.K / 256) + 16 * c + (n & 15);
}

// Starts the copy of chunk c of rows n0 .. n0 + 15 into stage, in the 16-byte pieces that hold it (the
// last one of W only up to W's end); the rest of the stage, and rows from N on, get zeros (decoded: 0).
// kOffsets: the aligned case on 32-bit offsets, with no extra piece (Q8_0 16 x 4096 x 4096: 20.2 -> 15.7 us;
// the compiler keeps them in ~10 registers across chunks, which lost 10% on Q4_K at M = 16).
template <int QT, bool kOffsets, int kK = Ring<QT>::kChunk>
__device__ __forceinline__ void load_chunk(uint8_t* stage, const Args& a, int n0, int c, int lane) {
  using R = Ring<QT, kK>;
  if (n0 + 16 < a.N && int64_t(c + 1) * R::kBytes <= a.row_bytes) {  // whole, and W goes on past it: no checks
    const int64_t base = chunk_start(a, n0, 0, c, R::kBytes);  // row n0's chunk (n0 a multiple of 16 where tiled)
    const int step = a.tiled ? R::kBytes : int(a.row_bytes);  // from a row's chunk to the next row's
    if (kOffsets && R::kBytes % 16 == 0 && a.aligned) {  // every row's chunk starts aligned: no extra piece
      constexpr int kPerRow = R::kBytes / 16;
#pragma unroll
      for (int i = lane; i < 16 * kPerRow; i += 32) {
        const int r = i / kPerRow, p = i % kPerRow;
        cp_async16(smem_addr(stage + r * R::kRowStride + 16 * p), a.w + base + (r * step + 16 * p), 16);
      }
      return;
    }
#pragma unroll
    for (int i = lane; i < 16 * R::kPieces; i += 32) {
      const int r = i / R::kPieces, p = i % R::kPieces;
      const int64_t piece = ((base + int64_t(r) * step) & ~int64_t(15)) + 16 * p;
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
// - a.tiled: the tile's chunk is one run of 16 chunks' bytes. Q4_K's (16 x 144) is a box of W's tiled view; Q6_K's
//   rows (210 bytes) are no 16-byte multiple, which a tensor map's rows must be, so its run (3360 bytes) comes by one
//   bulk copy, its rows dense in the stage (H200, by rows -> tiled: the 8B Q4_K_M batch-1 step 1.864-1.866 -> 1.826
//   ms, Q6_K 16 x 4096 x 14336 23.38 -> 22.34 us).
// - kPair (with kBox): W is gate | up and a tile's rows are gate rows n0 / 2 .. + 7, then the same up rows, one
//   [2, 8, kRowStride] box of pair_map.
// - kEvictFirst: the TMA copies mark W's lines evict_first in L2 (evict_first_policy). The one-row kernels take it
//   (H200, the 8B batch-1 step: Q4_K_M 2.016 -> 2.006 ms, Q8_0 2.651 -> 2.632); the 16-row tiles lost with it (the
//   Q4_K_M batch-16 step 3.155 -> 3.25-3.30 ms).
template <int QT, int S, bool kBox, bool kPair = false, bool kEvictFirst = false>
struct ChunkRing {
  using R = Ring<QT, 256>;
  static constexpr bool kBulk = kBox || QT == kQ4_K;  // on sm_90: TMA and mbarriers, not cp.async
  static constexpr bool kDenseTiled = kBox && QT != kQ4_K && !kPair;  // a tiled chunk by one bulk copy, rows dense
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
    if (kDenseTiled && a.tiled) return stage + r * R::kBytes;  // the bulk copy's dense rows
    return stage + r * R::kRowStride + (QT == kQ4_K ? 0 : int(chunk_start(a, n0, r, c, R::kBytes) & 15));
  }
  // Chunk c of the 16-row tile at n0 into stage i % S, empty so far: with kBox one TMA copy by lane 0 of the
  // tile's [16, kRowStride] box from the 16-byte boundary at or before the chunk (the bytes around it ride along;
  // rows past N and bytes past a row's end arrive as zeros, all counted in the box's bytes); else a bulk copy a
  // row (Q4_K) or load_chunk's pieces.
  __device__ __forceinline__ void load(int i, int n0, int c, const Args& a) const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const uint32_t bar = bar0 + 8 * (i % S);
    if constexpr (kDenseTiled) {
      if (a.tiled) {  // the tile's chunk, one run of 16 rows' chunks (n0 a multiple of 16, every row in W)
        if (lane == 0) {
          mbar_expect_tx(bar, 16 * R::kBytes);
          const uint8_t* from = a.w + chunk_start(a, n0, 0, c, R::kBytes);
          if constexpr (kEvictFirst) bulk_load_stream(dst + (i % S) * R::kStageBytes, from, 16 * R::kBytes, bar);
          else bulk_load(dst + (i % S) * R::kStageBytes, from, 16 * R::kBytes, bar);
        }
        return;
      }
    }
    if constexpr (kBox) {
      if (lane == 0) {
        mbar_expect_tx(bar, R::kStageBytes);
        const int row = kPair ? n0 / 2 : n0;  // a pair tile's first gate row
        const int x0 = a.tiled ? 0 : ((c * R::kBytes) & ~15) / kBoxElem<QT>, y = a.tiled ? tiled_row(a, row, c) : row;
        const uint32_t to = dst + (i % S) * R::kStageBytes;
        if constexpr (kPair && kEvictFirst) ptx::tma_load_3d_stream(to, map, bar, x0, y, 0);
        else if constexpr (kPair) ptx::tma_load_3d(to, map, bar, x0, y, 0);
        else if constexpr (kEvictFirst) ptx::tma_load_2d_stream(to, map, bar, x0, y);
        else ptx::tma_load_2d(to, map, bar, x0, y);
      }
      return;
    } else if constexpr (QT == kQ4_K) {
      const int rows = min(16, a.N - n0);
      if (lane == 0) mbar_expect_tx(bar, rows * R::kBytes);
      const uint8_t* from = a.w + chunk_start(a, n0, lane, c, R::kBytes);
      if (lane < rows) {
        if constexpr (kEvictFirst) bulk_load_stream(dst + (i % S) * R::kStageBytes, from, R::kBytes, bar);
        else bulk_load(dst + (i % S) * R::kStageBytes, from, R::kBytes, bar);
      }
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

// norm_rows' padding of a row (elements; regs_kernel's kNorm, below).
constexpr int kNormPad = 16;

// x[:, chunk c] into registers: v[s][nt][j] is row 8 nt + g, k = kChunk c + 32 s + 16 j + 4t .. + 3, loaded from
// x (volatile loads, issued where they stand; zeros past M and K), or with xs from norm_rows' rows (zeros past K);
// zeros everywhere where !ok.
template <int QT, typename T, int NT>
__device__ __forceinline__ void load_x_regs(uint2 (&v)[Ring<QT>::kChunk / 32][NT][2], const Args& a, int c, int g,
                                            int t, bool ok = true, const T* xs = nullptr) {
#pragma unroll
  for (int s = 0; s < Ring<QT>::kChunk / 32; ++s)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int k = c * Ring<QT>::kChunk + 32 * s + 16 * j + 4 * t, m = 8 * nt + g;
        if (xs != nullptr)
          v[s][nt][j] = ok && k < a.K ? *reinterpret_cast<const uint2*>(xs + m * (a.K + kNormPad) + k) : uint2{};
        else
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
// xs (a qtile_kernel x stage; rows past M read as row 0, whose sums are never stored, or with kXZeroed as the zeros
// a TMA box put there).
template <int QT, typename T, int NT, bool kAhead, bool kSharedX = false, bool kOnce = kAhead,
          int kK = Ring<QT>::kChunk, bool kXZeroed = false>
__device__ __forceinline__ void mma_chunk(float (&acc)[NT][4], const uint8_t* stage, const XAhead<QT, NT, kAhead>& xa,
                                          const Args& a, int n0, int c, int g, int t, const uint8_t* xs = nullptr,
                                          bool dense = false) {
  using R = Ring<QT, kK>;
  // dense: the stage's rows back to back (ChunkRing's bulk copy of a tiled chunk), else at their pieces' offsets
  const uint8_t* row_a = dense ? stage + g * R::kBytes
                               : stage + g * R::kRowStride + (chunk_start(a, n0, g, c, R::kBytes) & 15);
  const uint8_t* row_b = dense ? stage + (g + 8) * R::kBytes
                               : stage + (g + 8) * R::kRowStride + (chunk_start(a, n0, g + 8, c, R::kBytes) & 15);
  const ChunkHead<QT, kOnce> head_a(row_a), head_b(row_b);  // kOnce: the scales once a chunk
  const T* x = static_cast<const T*>(a.x) + int64_t(c) * R::kChunk + 4 * t;
  const int steps = (a.K - c * R::kChunk < R::kChunk ? a.K - c * R::kChunk : R::kChunk) / 32;  // K % 32 == 0
  const uint8_t* xrow[NT];
  if constexpr (kSharedX)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) xrow[nt] = xs + (kXZeroed || 8 * nt + g < a.M ? 8 * nt + g : 0) * kXTileRow + 8 * t;
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

// A warp's sums are C fragments: acc[i], i = 4 nt + 2h + e, is x row 8 nt + 2t + e and W row n0 + g + 8h.
__device__ __forceinline__ int frag_x_row(int i, int t) { return 8 * (i / 4) + 2 * t + (i & 1); }
__device__ __forceinline__ int frag_w_row(int i, int n0, int g) { return n0 + g + 8 * ((i % 4) >> 1); }

// out[:, n0 .. n0 + 15] (+ bias) from a warp's sums.
// With kPrior (a.accumulate), out = prior (out's values, out_prior) + the product, each rounded as its own op would.
template <typename T, int NT, bool kPrior = false>
__device__ __forceinline__ void store_rows(const float (&acc)[NT * 4], const Args& a, int n0, int g, int t,
                                           const T* prior = nullptr) {
  const T* bias = static_cast<const T*>(a.bias);
  T* out = static_cast<T*>(a.out);
#pragma unroll
  for (int i = 0; i < NT * 4; ++i) {
    const int m = frag_x_row(i, t), n = frag_w_row(i, n0, g);
    if (m < a.M && n < a.N) {
      T y = from_float<T>(bias ? acc[i] + to_float(bias[n]) : acc[i]);
      if constexpr (kPrior) y = from_float<T>(to_float(prior[i]) + to_float(y));
      out[int64_t(m) * a.out_stride + n] = y;
    }
  }
}

// store_rows' out values at this thread's places (zeros outside out), loaded ahead of the sums.
template <typename T, int NT>
__device__ __forceinline__ void out_prior(T (&prior)[NT * 4], const Args& a, int n0, int g, int t) {
  const T* out = static_cast<const T*>(a.out);
#pragma unroll
  for (int i = 0; i < NT * 4; ++i) {
    const int m = frag_x_row(i, t), n = frag_w_row(i, n0, g);
    prior[i] = m < a.M && n < a.N ? out[int64_t(m) * a.out_stride + n] : from_float<T>(0.f);
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
    const int m = frag_x_row(i, t);
    if (m < a.M && n < a.N / 2)
      out[int64_t(m) * a.out_stride + n] = gated<T, Act>(from_float<T>(acc[i]), from_float<T>(acc[i + 2]));
  }
}

// Split-K over the grid's y (tile_kernel, qtile_kernel): every CTA writes its warps' sums (fp32) to ws
// [tiles][splits][kWarps][NT * 4][32] and counts itself in (counters: one a tile, zero at entry and left zero);
// the last of a tile's CTAs to arrive adds them in split order into sum and returns true, the others false. The
// count is one acquire-release atomic by thread 0 between two CTA barriers (as decode_merge.cuh's arrive): the
// barrier before orders the CTA's stores ahead of its release, the one after orders the last CTA's reads (from
// L2, __ldcg) behind its acquire. Every thread's __threadfence around a relaxed count cost ~0.4-1 us a call (H100,
// 16 x 6144 x 4096 10.74 -> 9.75 us; the 8B Q4_K_M batch-16 step 3.050 -> 3.001-3.017 ms).
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
  __syncthreads();
  if (threadIdx.x == 0) {
    int* count = counters + blockIdx.x;
    s_last = ptx::atom_add_acq_rel_gpu<1>(count) == int(gridDim.y) - 1;
    if (s_last) *count = 0;  // every split has arrived: ready for the next launch
  }
  __syncthreads();
  if (!s_last) return false;
#pragma unroll
  for (int i = 0; i < NT * 4; ++i) sum[i] = 0.f;
  for (int s = 0; s < int(gridDim.y); ++s)  // split order, this CTA's own included
#pragma unroll
    for (int i = 0; i < NT * 4; ++i) sum[i] += __ldcg(ws + tile0 + int64_t(s) * warps * kWarpFloats + 32 * i);
  return true;
}

// out[:, n0 .. n0 + 15] (+ bias) from the warps' partial sums acc (C fragments), met through the (now idle)
// rings: red[warp][i][lane]. Every cp.async of the CTA must be complete.
template <typename T, int NT, typename Act = void, bool kPrior = false>
__device__ __forceinline__ void reduce_store(const float (&acc)[NT][4], uint8_t* smem, const Args& a, int n0, int warp,
                                             int lane, const T* prior = nullptr) {
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
    store_rows<T, NT, kPrior>(sum, a, n0, g, t, prior);
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
// registers; no ring, shared memory only for the warps' sums (and with kNorm, below, x's rows and the norm's weight).
template <int QT>
constexpr bool kRegsFormat = QT == kQ4_0 || QT == kQ4_1 || QT == kQ5_0 || QT == kQ5_1;

// What regs_kernel fuses (qlinear's norm_weight and accumulate):
// - kNorm (NT = 1): x is the residual stream, and the linear reads RMSNorm(x) * a.norm_w (a.eps), as rms_norm would
//   write it. The CTA copies its 8 rows of x into shared memory (and the norm's weight, before the wait), then each
//   warp normalizes its row there in place (its sum in a fixed order: a row's result does not depend on the rows
//   beside it; lane l's packs l, l + 32, ... as rms_norm's 32-lane groups sum them at K 520-1024, so that there the
//   normed x is rms_norm's bit for bit, by the same arithmetic: common/rms.cuh). Rows are 2K + 32 bytes apart, so
//   that a warp's 8-byte reads of rows g .. g + 7 take the two wavefronts 256 bytes need. One launch a norm fewer: a
//   small model's step is a chain of ~10 launches a layer.
// - kAdd (NT = 1): out += the product (the residual add), each rounded as its own op; out's values load right after
//   the wait.
enum class Fuse { kNone, kNorm, kAdd };
// kNorm's dynamic shared memory: the rows [8, K + kNormPad], then the norm's weight [K] (2-byte T).
__host__ __device__ constexpr int norm_smem_bytes(int k) { return (8 * (k + kNormPad) + k) * 2; }

// kNorm before the wait: the norm's weight (static) into shared memory behind the rows, one cp.async group.
template <typename T>
__device__ __forceinline__ void norm_weight_to_smem(T* xs, const Args& a) {
  T* ws = xs + 8 * (a.K + kNormPad);
  for (int p = threadIdx.x; p < a.K / 8; p += kThreads)
    cp_async16(ws + 8 * p, static_cast<const T*>(a.norm_w) + 8 * p, true);
  cp_async_commit();
}

// kNorm after the wait: x's 8 rows into xs (zeros past M, one round trip), then each normed in place by its warp.
template <typename T>
__device__ __forceinline__ void norm_rows(T* xs, const Args& a, int warp, int lane) {
  const int packs = a.K / 8, stride = a.K + kNormPad;
  const T* ws = xs + 8 * stride;
  for (int i = threadIdx.x; i < 8 * packs; i += kThreads) {
    const int r = i / packs, p = i % packs;
    cp_async16(xs + r * stride + 8 * p, static_cast<const T*>(a.x) + int64_t(r < a.M ? r : 0) * a.K + 8 * p, r < a.M);
  }
  cp_async_commit();
  cp_async_wait<0>();  // the weight's group and the rows'
  __syncthreads();
  T* row = xs + warp * stride;
  float ss = 0.f;
#pragma unroll 1  // unrolled, ptxas spilled (32 bytes); shared memory reads: no latency to hide here
  for (int p = lane; p < packs; p += 32) {
    Pack<T, 8> v;
    v.load(row + 8 * p);
    ss = add_squares(v, ss);
  }
  const float scale = rms_scale(warp_sum(ss), a.K, a.eps);
#pragma unroll 1
  for (int p = lane; p < packs; p += 32) {
    Pack<T, 8> v, w;
    v.load(row + 8 * p);
    w.load(ws + 8 * p);
    rms_apply(v, scale, w).store(row + 8 * p);
  }
  __syncthreads();
}

// w's words as the compiler sees them: unknown, so that no decode of them moves out of a loop around their use.
template <int QT>
__device__ __forceinline__ void opaque(BlockWords& w) {
  asm volatile("" : "+r"(w.head), "+r"(w.qs[0]));
  if constexpr (QT == kQ5_0 || QT == kQ5_1) asm volatile("" : "+r"(w.qh));
}

// a's rows m0 .. m0 + rows - 1 (x's and out's; M past them clipped).
__device__ __forceinline__ Args rows_from(Args a, int m0, int rows) {
  a.x = static_cast<const uint8_t*>(a.x) + int64_t(m0) * a.K * 2;  // 2-byte T
  a.out = static_cast<uint8_t*>(a.out) + int64_t(m0) * a.out_stride * 2;
  a.M = min(a.M - m0, rows);
  return a;
}

// regs_kernel's block of x rows (a: its rows, rows_from) on the W words that the warp holds.
template <int QT, typename T, int NT, typename Act, Fuse kFuse, int CH>
__device__ __forceinline__ void regs_block(const Args& a, const BlockWords (&wa)[CH][Ring<QT>::kChunk / 32],
                                           const BlockWords (&wb)[CH][Ring<QT>::kChunk / 32], uint8_t* red,
                                           T* xs, int n0, int mine, int blocks, int warp, int lane) {
  constexpr bool kNorm = kFuse == Fuse::kNorm, kAdd = kFuse == Fuse::kAdd;
  constexpr int kSteps = Ring<QT>::kChunk / 32;
  const int g = lane / 4, t = lane % 4;
  T prior[kAdd ? NT * 4 : 1];
  if constexpr (kAdd) {
    if (warp == 0) out_prior<T, NT>(prior, a, n0, g, t);
  }
  if constexpr (kNorm) norm_rows(xs, a, warp, lane);
  // x of chunk i ([step][x row tile][mma j]: row 8 nt + g, k = 64 c + 32 s + 16 j + 4t .. + 3): at NT = 1 every
  // chunk's in one burst (one L2 round trip), at NT = 2 (twice the registers) chunk i + 1's before chunk i's mmas
  constexpr int kXSlots = NT == 1 ? CH : 2;
  uint2 xv[kXSlots][kSteps][NT][2];
  auto load_x = [&](int i, uint2 (&v)[kSteps][NT][2]) {
    load_x_regs<QT, T, NT>(v, a, warp + kWarps * i, g, t, i < mine, kNorm ? xs : nullptr);
  };
#pragma unroll
  for (int i = 0; i < (NT == 1 ? CH : 1); ++i) load_x(i, xv[i]);
  float acc[NT][4] = {};
#pragma unroll
  for (int i = 0; i < CH; ++i) {
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
  reduce_store<T, NT, Act, kAdd>(acc, red, a, n0, warp, lane, prior);
}

// Act (Silu, GeluTanh; void for none): W is gate | up (N = 2 inter rows) and a CTA's 16 rows are gate rows n0 ..
// n0 + 7 and their up rows inter + n0 .., so that its epilogue writes act(gate) * up (store_act), [M, inter].
// Past 8 NT rows, x's blocks of 8 NT rows spread over the grid's y (each CTA reads its W rows again, from L2), and
// where the CTAs would pass 2 an SM each walks several on the same W registers (regs_y_blocks).
template <int QT, typename T, int NT, typename Act = void, Fuse kFuse = Fuse::kNone, bool kYLoop = false>
__global__ void __launch_bounds__(kThreads, kYLoop ? 2 : 0) regs_kernel(Args a) {
  using F = Format<QT>;
  constexpr bool kAct = !std::is_void_v<Act>, kNorm = kFuse == Fuse::kNorm, kAdd = kFuse == Fuse::kAdd;
  static_assert(!(kAct && kAdd), "regs_kernel: the residual add comes without an activation");
  static_assert(kFuse == Fuse::kNone || NT == 1, "regs_kernel: the norm and the add at up to 8 rows");
  constexpr int kSteps = Ring<QT>::kChunk / 32;  // blocks a chunk
  __shared__ __align__(16) uint8_t red[kWarps * NT * 4 * 32 * sizeof(float)];  // reduce_store's partial sums
  extern __shared__ __align__(16) uint8_t normed[];  // kNorm: [8, K + kNormPad] rows, then the weight [K]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int n0 = blockIdx.x * (kAct ? 8 : 16), blocks = a.K / 32, chunks = (blocks + kSteps - 1) / kSteps;
  constexpr int CH = kYLoop ? kLoopChunks : kRegChunks;  // the most chunks a warp
  const int mine = warp < chunks ? (chunks - 1 - warp) / kWarps + 1 : 0;  // this warp's chunks, <= CH
  const int inter = a.N / 2;
  const bool ok_a = n0 + g < (kAct ? inter : a.N), ok_b = kAct ? ok_a : n0 + g + 8 < a.N;
  const uint8_t* row_a = a.w + int64_t(ok_a ? n0 + g : 0) * a.row_bytes;
  const uint8_t* row_b = a.w + int64_t(ok_b ? (kAct ? inter : 8) + n0 + g : 0) * a.row_bytes;
  BlockWords wa[CH][kSteps], wb[CH][kSteps];  // [warp's chunk i][step]: rows g, g + 8
  auto load_w = [&] {
#pragma unroll
    for (int i = 0; i < CH; ++i)
#pragma unroll
      for (int s = 0; s < kSteps; ++s) {
        const int b = (warp + kWarps * i) * kSteps + s;  // block along K
        const bool ok = i < mine && b < blocks;
        wa[i][s] = ok && ok_a ? block_words<QT>(row_a + b * F::kBytes, t) : BlockWords{};
        wb[i][s] = ok && ok_b ? block_words<QT>(row_b + b * F::kBytes, t) : BlockWords{};
      }
  };
  T* xs = reinterpret_cast<T*>(normed);
  if (a.static_weight) {
    load_w();
    if constexpr (kNorm) norm_weight_to_smem(xs, a);
  }
  griddep_wait();  // x, bias and out may be the previous kernel's
  griddep_launch_dependents();
  if (!a.static_weight) {
    load_w();
    if constexpr (kNorm) norm_weight_to_smem(xs, a);
  }
  // x's blocks of 8 NT rows from blockIdx.y on, gridDim.y apart (regs_y_blocks), on the same W registers. Each block
  // decodes them afresh (opaque): decoded once for all blocks they would take ~190 registers, one CTA an SM.
  if constexpr (!kYLoop) {
    regs_block<QT, T, NT, Act, kFuse, CH>(rows_from(a, blockIdx.y * 8 * NT, 8 * NT), wa, wb, red, xs, n0, mine, blocks,
                                      warp, lane);
  } else {
#pragma unroll 1
    for (int m0 = blockIdx.y * 8 * NT; m0 < a.M; m0 += gridDim.y * 8 * NT) {
#pragma unroll
      for (int i = 0; i < CH; ++i)
#pragma unroll
        for (int s = 0; s < kSteps; ++s) opaque<QT>(wa[i][s]), opaque<QT>(wb[i][s]);
      regs_block<QT, T, NT, Act, kFuse, CH>(rows_from(a, m0, 8 * NT), wa, wb, red, xs, n0, mine, blocks, warp, lane);
    }
  }
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

// Whether this compilation's tile kernels take x's chunks by XSlots (sm_90), whose rows past M arrive as zeros.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
constexpr bool kXSlotsArch = true;
#else
constexpr bool kXSlotsArch = false;
#endif

// x's chunks on sm_90 (the tile kernels): S + 1 slots of kBytes, chunk i's in slot i % (S + 1), each one TMA box
// of a 2D map of 8-byte elements, chunk c's box from element c kChunkElems, rows past M as zeros (q4k::tile_kernel:
// the records, a record's fp16 form and the 16 bytes after it; qtile_kernel: x itself, a chunk's 512 bytes and the
// 32 after them as its rows' padding), issued by thread 0 on the slot's full mbarrier. Each warp, done with a
// slot, arrives on its empty mbarrier (one arrival a warp), which thread 0 waits for before the slot's next box:
// the warps meet at no CTA barrier between chunks.
template <int S, int kBytes, int kChunkElems>
struct XSlots {
  static constexpr int kSlots = S + 1;
  static_assert(kBytes % 128 == 0, "XSlots: each slot a TMA destination (128-byte aligned)");
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
    tma_load_2d(xs + slot * kBytes, map, bar, c * kChunkElems, 0);
  }
  __device__ __forceinline__ void wait(int i) const {
    mbar_wait(full0 + 8 * (i % kSlots), (i / kSlots) & 1);
  }
  // Every lane of the warp is done with chunk i's slot (__syncwarp since).
  __device__ __forceinline__ void release(int i, int lane) const {
    if (lane == 0) mbar_arrive(empty0 + 8 * (i % kSlots));
  }
};

// tile_pipeline with x by XSlots (sm_90): the weights as there (S stages a warp, S - 1 ahead, before griddep_wait
// where static), x's chunks S - 1 ahead by thread 0; a warp waits for its chunk's weights and x only. kCpAsyncW:
// load_w's copies are this warp's cp.async, one group a chunk (else they are waited for in mma: TMA).
template <int S, bool kCpAsyncW, typename Slots, typename LoadW, typename Mma>
__device__ __forceinline__ void tile_pipeline_tma(int mine, bool static_weight, const Slots& x, int c0, LoadW load_w,
                                                  Mma mma) {
  const int lane = threadIdx.x % 32;
  griddep_launch_dependents();
  if (!static_weight) griddep_wait();
#pragma unroll
  for (int i = 0; i < S - 1; ++i) {
    if (i < mine) load_w(i, i);
    if constexpr (kCpAsyncW) cp_async_commit();
  }
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
    if constexpr (kCpAsyncW) {
      cp_async_commit();
      cp_async_wait<S - 1>();  // chunk i's group, of the S - 1 + i + 1 committed
      __syncwarp();
    }
    x.wait(i);
    mma(i % S, i % (S + 1), i);
    __syncwarp();  // every lane is done with the weight stage and the x slot
    x.release(i, lane);
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
// The most weight stages (2-4) that keep 2 CTAs an SM; 2 where none does (Q6_K and Q8_0 at NT = 4). At NT = 8 (64
// rows: its sums and fragments alone 128 registers a thread) one CTA an SM, whose shared memory takes 3 stages of Q4_K
// and 2 of Q6_K beside x's 4 or 3 slots of 34 KB.
template <int QT, int NT>
constexpr int kQTileStages = NT > 4 ? (qtile_smem<QT>(NT, 3) <= 220 * 1024 ? 3 : 2)
                             : qtile_smem<QT>(NT, 4) <= 110 * 1024 ? 4
                             : qtile_smem<QT>(NT, 3) <= 110 * 1024 ? 3
                                                                   : 2;
// CTAs an SM of qtile_kernel at NT tiles of 8 x rows (its launch bounds, and TileGrid's splits).
constexpr int qtile_ctas(int nt) { return nt > 4 ? 1 : 2; }

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

// Whether qtile_kernel's x comes by XSlots on sm_90: at 2 and 4 tiles of 8 x rows (see below).
template <int NT>
constexpr bool kQTileXBox = NT >= 2;

// x's chunks: on sm_90 at NT >= 2 by XSlots (x_map: x [M, K] as 8-byte elements, boxes of [8 NT][kXTileRow / 8]),
// else by every thread's cp.async and one CTA barrier a chunk (tile_pipeline). H200, us, cp.async / XSlots: Q6_K
// 16 x 28672 x 4096 49.1 / 46.3, 16 x 128256 x 4096 210-213 / 189-192, 16 x 4096 x 14336 24.9-25.0 / 24.2-24.5,
// 32 x 28672 x 4096 72.0-72.8 / 68.9-70.3; Q8_0 16 x 28672 x 4096 59.3-59.4 / 56.6-56.8, 32 x 28672 x 4096 94.1-94.5 /
// 80.1-81.8; slower at 16 x 6144 x 4096 (Q6_K 13.7 / 14.1) and at NT = 1 (Q6_K 2 x 28672 x 4096 39.1 / 42.1; at 8
// rows 40.2-40.8 / 39.4-39.7), which keeps cp.async.
template <int QT, typename T, int NT, int S, bool kBox>
__global__ void __launch_bounds__(kThreads, qtile_ctas(NT))
    qtile_kernel(const Args a, float* ws, int* counters, const __grid_constant__ CUtensorMap w_map,
                 const __grid_constant__ CUtensorMap x_map) {
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
  using Stages = ChunkRing<QT, S, kBox>;
  const Stages stages(ring, bars[warp], &w_map, lane);
  float acc[NT][4] = {};
  const XAhead<QT, NT, false> none{};
  auto load_w = [&](int stage, int i) {
    if (has_rows) stages.template tile_refill<kOffsets>(stage, i, n0, c0 + i, a);  // stage == i % S
  };
  constexpr bool kXByTma = kXSlotsArch && kQTileXBox<NT>;
  auto mma = [&](int stage, int slot, int i) {
    if (!has_rows) return;
    stages.tile_wait(i);
    mma_chunk<QT, T, NT, false, true, false, 256, kXByTma>(acc, ring + stage * R::kStageBytes, none, a, n0, c0 + i, g,
                                                           t, xs + slot * kXStage, Stages::kDenseTiled && a.tiled);
  };
  auto store = [&](const float (&sums)[NT][4]) {
    float sum[NT * 4];
#pragma unroll
    for (int i = 0; i < NT * 4; ++i) sum[i] = sums[i / 4][i % 4];
    if (sum_splits<NT>(sum, ws, counters, warp, lane)) store_rows<T, NT>(sum, a, n0, g, t);
  };
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (kQTileXBox<NT>) {
    __shared__ __align__(8) uint64_t x_bars[2][S + 1];
    const XSlots<S, kXStage, 256 * 2 / 8> slots(xs, x_bars, &x_map);
    tile_pipeline_tma<S, !Stages::kBulk>(mine, a.static_weight, slots, c0, load_w, mma);
    return store(acc);
  }
#endif
  tile_pipeline<S>(
      mine, a.static_weight, load_w, [&](int slot, int i) { load_x_chunk<T>(xs + slot * kXStage, a, c0 + i); }, mma);
  store(acc);
}


// ---- Q8_0 at M = 1, K of fewer than 8 chunks (a small model's tied lm_head: 49152 x 576, 262144 x 640) ----
// A row is K / 32 x 34 bytes, no 16-byte multiple, so no TMA box fits it and qtile_kernel's chunk ring idles most
// warps at such K; but 16 whole rows are one run of 16 row_bytes bytes, 16-byte aligned where W is and N % 16 == 0,
// which one bulk copy brings. Each warp streams its own 16-row tiles (warp w of the grid's W: tiles w, w + W, ...)
// through kShortStages such stages; x's row sits in shared memory, read once a CTA. Per step the math of
// qtile_kernel (mma_quants) in its order, so a row's outputs equal those of the batched calls that take qtile_kernel
// unsplit: greedy decoding stays batch-invariant.
constexpr int kShortStages = 2;

// Shared memory: x's row (K values of 2 bytes, to 16), warps x stages of 16 rows, 16 bytes past them that the
// 2-byte-aligned word loads may touch, and 128 to align the whole.
__host__ __device__ constexpr int64_t short_k_smem(int K, int warps) {
  return (2 * int64_t(K) + 15) / 16 * 16 + int64_t(warps) * kShortStages * 16 * (K / 32 * 34) + 16 + 128;
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 1) short_k_kernel(const Args a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900  // bulk copies and mbarriers; the launcher takes it on sm_90 only
  constexpr int S = kShortStages, kChunkBytes = 8 * 34;  // a 256-k chunk of a Q8_0 row
  extern __shared__ __align__(128) uint8_t smem_raw[];
  uint8_t* xs = aligned_128(smem_raw);  // [K] of T
  __shared__ __align__(8) uint64_t bars[kWarps][S];
  const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int chunks = (a.K + 255) / 256, tile_bytes = 16 * int(a.row_bytes);
  uint8_t* ring = xs + (2 * a.K + 15) / 16 * 16 + warp * S * tile_bytes;  // [S][16][row_bytes]
  const int tiles = a.N / 16, stride = int(gridDim.x) * warps, first = int(blockIdx.x) * warps + warp;
  const int mine = first < tiles ? (tiles - 1 - first) / stride + 1 : 0;
  const uint32_t bar0 = smem_addr(bars[warp]);
  if (lane < S) mbar_init(bar0 + 8 * lane, 1);
  mbar_init_fence();
  __syncwarp();
  auto load = [&](int i) {  // this warp's tile i into stage i % S
    if (lane != 0) return;
    const uint32_t bar = bar0 + 8 * (i % S);
    mbar_expect_tx(bar, tile_bytes);
    bulk_load(smem_addr(ring + (i % S) * tile_bytes), a.w + int64_t(first + i * stride) * tile_bytes, tile_bytes, bar);
  };
  if (!a.static_weight) griddep_wait();
  for (int i = 0; i < S - 1 && i < mine; ++i) load(i);
  if (a.static_weight) griddep_wait();  // x, bias and out
  griddep_launch_dependents();
  for (int j = threadIdx.x; j < a.K / 8; j += blockDim.x)  // K % 32 == 0; x 16-byte aligned (qlinear's check)
    reinterpret_cast<uint4*>(xs)[j] = reinterpret_cast<const uint4*>(a.x)[j];
  __syncthreads();
  for (int i = 0; i < mine; ++i) {
    if (i + S - 1 < mine) {
      fence_proxy_async();  // the reads of tile i - 1's stage (generic proxy) before the copy's writes (async)
      load(i + S - 1);
    }
    mbar_wait(bar0 + 8 * (i % S), (i / S) & 1);
    const uint8_t* tile = ring + (i % S) * tile_bytes;
    float acc[1][4] = {};
    for (int c = 0; c < chunks; ++c) {
      const uint8_t* row_a = tile + g * a.row_bytes + c * kChunkBytes;  // rows g and g + 8's chunk c
      const uint8_t* row_b = row_a + 8 * a.row_bytes;
      const ChunkHead<kQ8_0, false> head_a(row_a), head_b(row_b);
      const int steps = min(a.K - 256 * c, 256) / 32;
#pragma unroll
      for (int s = 0; s < 8; ++s) {
        if (s >= steps) break;
        uint2 xp[1][2];
#pragma unroll
        for (int j = 0; j < 2; ++j)
          xp[0][j] = x_pairs(*reinterpret_cast<const uint2*>(xs + 2 * (256 * c + 32 * s + 16 * j) + 8 * t));
        uint32_t qa[2], qb[2];
        float sa[2], sb[2], ma[2], mb[2];
        step_quants<kQ8_0>(row_a, s, t, head_a, qa, sa, ma);
        step_quants<kQ8_0>(row_b, s, t, head_b, qb, sb, mb);
        mma_quants<kQ8_0, T, 1>(acc, qa, qb, sa, sb, ma, mb, xp);
      }
    }
    __syncwarp();  // every lane is done with the stage before it is refilled
    const float sum[4] = {acc[0][0], acc[0][1], acc[0][2], acc[0][3]};
    store_rows<T, 1>(sum, a, 16 * (first + i * stride), g, t);
  }
#endif
}

}  // namespace
}  // namespace minfer::qgemm
