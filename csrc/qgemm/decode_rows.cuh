// A quantized W [n, k] (ggml blocks, uint8 [n, k / elems * bytes]) decoded to fp16/bf16: the rows named by ids
// (decode_rows_kernel, qembedding.cu) or the whole weight (decode_all_kernel, dequantize.cu). Memory-bound.
//
// A CTA takes kDecodeTile outputs: it copies the bytes of their blocks into shared memory in 16-byte loads,
// then each thread decodes 8 outputs and stores them with one 16-byte store.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <algorithm>
#include <type_traits>

#include "common/ptx.cuh"
#include "common/vec.h"
#include "qgemm/formats.cuh"

namespace minfer::qgemm {

constexpr int kDecodeThreads = 256, kDecodeTile = 8 * kDecodeThreads;  // outputs per CTA: 8 a thread

// 8 floats rounded to T, packed in memory order (the low 16 bits of each word: the even element).
template <typename T>
__device__ __forceinline__ uint4 pack8(const float (&v)[8]) {
  uint4 r;
  uint32_t* w = reinterpret_cast<uint32_t*>(&r);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (std::is_same_v<T, __half>) {
      const __half2 h = __floats2half2_rn(v[2 * i], v[2 * i + 1]);
      w[i] = *reinterpret_cast<const uint32_t*>(&h);
    } else {
      const __nv_bfloat162 h = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
      w[i] = *reinterpret_cast<const uint32_t*>(&h);
    }
  }
  return r;
}

// A tile's blocks (its `elems` outputs from the block starting at byte `start` of w, `total` bytes) into smem in
// 16-byte loads, from the aligned piece holding start (a row start anywhere works). Returns start's offset there.
template <int QT>
__device__ __forceinline__ int load_tile(uint8_t* tile, const uint8_t* __restrict__ w, int64_t start, int elems,
                                         int64_t total) {
  using F = Format<QT>;
  const int64_t a0 = start & ~int64_t(15);
  const int pieces = int((start + elems / F::kElems * F::kBytes - a0 + 15) / 16);
  for (int p = threadIdx.x; p < pieces; p += kDecodeThreads) {
    const int64_t a = a0 + 16 * p;
    if (a + 16 <= total) {
      *reinterpret_cast<uint4*>(tile + 16 * p) = ptx::ld_nc_stream_v4(reinterpret_cast<const uint4*>(w + a), true);
    } else {  // the weight's last piece: byte by byte, nothing read past it
      for (int i = 0; i < 16 && a + i < total; ++i) tile[16 * p + i] = w[a + i];
    }
  }
  return int(start - a0);
}

// Outputs e .. e + 7 of a tile (its blocks at `blocks`) decoded into dst[e ..] in one 16-byte store.
template <int QT, typename T>
__device__ __forceinline__ void decode_store(T* dst, const uint8_t* blocks, int e) {
  using F = Format<QT>;
  float v[8];
  decode8<QT>(blocks + e / F::kElems * F::kBytes, (e % F::kElems) / 8, v);
  *reinterpret_cast<uint4*>(dst + e) = pack8<T>(v);
}

template <int QT>
constexpr int kTilePieces = (kDecodeTile / Format<QT>::kElems * Format<QT>::kBytes + 15 + 15) / 16;  // any alignment

// out row r = W row ids[r], or NaN where that id is outside [0, n) (nothing is read then).
// grid = (rows, ceil(k / kDecodeTile)); out 16-byte aligned, w 16-byte aligned.
template <int QT, typename T>
__global__ void __launch_bounds__(kDecodeThreads) decode_rows_kernel(T* __restrict__ out,              // [rows, k]
                                                                     const uint8_t* __restrict__ w,    // [n, row bytes]
                                                                     const int64_t* __restrict__ ids,  // [rows]
                                                                     int64_t n, int k) {
  using F = Format<QT>;
  __shared__ __align__(16) uint8_t tile[16 * kTilePieces<QT>];
  const int64_t r = blockIdx.x, id = ids[r];
  const int e0 = blockIdx.y * kDecodeTile, elems = min(kDecodeTile, k - e0);  // this tile: row elements e0 ..
  T* dst = out + r * k + e0;
  const int e = 8 * threadIdx.x;  // this thread's 8 outputs, from e0
  if (id < 0 || id >= n) {
    float v[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = nan_f();
    if (e < elems) *reinterpret_cast<uint4*>(dst + e) = pack8<T>(v);
    return;
  }
  const int64_t row_bytes = int64_t(k / F::kElems) * F::kBytes;
  const int at = load_tile<QT>(tile, w, id * row_bytes + e0 / F::kElems * F::kBytes, elems, n * row_bytes);
  __syncthreads();
  if (e < elems) decode_store<QT, T>(dst, tile + at, e);
}

// A tiled W (chunks 256-k chunks a row; checks.h, kTiled): output block b (row b / chunks, chunk b % chunks) lies in
// its 16-row group's chunk-major run. Its first byte in W:
__device__ __forceinline__ int64_t tiled_block_byte(int64_t b, int chunks, int block_bytes) {
  const int64_t n = b / chunks, c = b % chunks;
  return ((n & ~int64_t(15)) * chunks + 16 * c + (n & 15)) * block_bytes;
}

// A tile's blocks from a tiled W in the outputs' order (8 consecutive blocks of out, each from its row group's run)
// into slots of kSlotBytes: each block in 16-byte loads from the aligned piece holding its first byte, which lies at
// that byte's offset mod 16 in the slot (Q6_K's 210-byte blocks are 2-byte aligned; the pieces end at the block's
// last one). Against decoding runs of W's bytes as they lie (8 blocks of one row group, written to 8 rows), a CTA
// writes one 4 KB run of out (H200, dequantize + cuBLAS, us: Q4_K 512 x 28672 x 4096 314 -> 297).
template <int QT>
constexpr int kSlotBytes = Format<QT>::kBytes % 16 == 0 ? Format<QT>::kBytes : (Format<QT>::kBytes + 14 + 15) / 16 * 16;

template <int QT>
__device__ __forceinline__ void load_tiled(uint8_t* tile, const uint8_t* __restrict__ w, int64_t e0, int elems,
                                           int chunks) {
  using F = Format<QT>;
  constexpr int kPieces = kSlotBytes<QT> / 16;
  for (int p = threadIdx.x; p < elems / F::kElems * kPieces; p += kDecodeThreads) {
    const int j = p / kPieces, piece = p % kPieces;
    const int64_t first = tiled_block_byte(e0 / F::kElems + j, chunks, F::kBytes);
    const int64_t a = (first & ~int64_t(15)) + 16 * piece;
    if (a < first + F::kBytes)
      *reinterpret_cast<uint4*>(tile + 16 * p) = ptx::ld_nc_stream_v4(reinterpret_cast<const uint4*>(w + a), true);
  }
}

template <int QT>  // decode_all_kernel's shared memory: a run of W's bytes, or a tiled W's 8 slots
constexpr int kTileBytes = Format<QT>::kElems == 256
                               ? std::max(16 * kTilePieces<QT>, kDecodeTile / 256 * kSlotBytes<QT>)
                               : 16 * kTilePieces<QT>;

// out = the whole W, `values` = n * k outputs, in tiles of kDecodeTile outputs: rows are contiguous in both, so a tile
// may span rows, and a short-K weight fills whole CTAs (a 960 x 576 weight: 270 CTAs, not 960 of 72 busy threads); a
// tiled W's blocks are gathered into the outputs' order (load_tiled). Launched as a programmatic dependent: the tile's
// blocks load before griddep_wait where W is static (no kernel just ahead writes it); out (a reused scratch) is written
// only after it. H200, dequantize + linear against the per-row grid launched plainly, us: 64 x 960 x 576 5.5 -> 3.8,
// 64 x 3072 x 576 10.5 -> 7.0.
template <int QT, typename T>
__global__ void __launch_bounds__(kDecodeThreads) decode_all_kernel(T* __restrict__ out,            // [n * k]
                                                                    const uint8_t* __restrict__ w,  // [n, row bytes]
                                                                    int64_t values, bool static_weight,
                                                                    int tiled_chunks) {  // 0: W not tiled
  using F = Format<QT>;
  __shared__ __align__(16) uint8_t tile[kTileBytes<QT>];
  const int64_t e0 = int64_t(blockIdx.x) * kDecodeTile;
  const int elems = int(min(int64_t(kDecodeTile), values - e0));
  const int64_t start = e0 / F::kElems * F::kBytes, total = values / F::kElems * F::kBytes;
  const bool tiled = F::kElems == 256 && tiled_chunks > 0;
  int at = 0;
  auto load = [&] {
    if constexpr (F::kElems == 256) {
      if (tiled) {
        load_tiled<QT>(tile, w, e0, elems, tiled_chunks);
        return;
      }
    }
    at = load_tile<QT>(tile, w, start, elems, total);
  };
  if (static_weight) load();
  ptx::griddep_wait();
  ptx::griddep_launch_dependents();
  if (!static_weight) load();
  __syncthreads();
  const int e = 8 * threadIdx.x;
  if (e >= elems) return;
  const int j = e / F::kElems;  // the tile's block of this thread's outputs
  const uint8_t* block = tile + at + j * F::kBytes;
  if (tiled) block = tile + j * kSlotBytes<QT> + (tiled_block_byte(e0 / F::kElems + j, tiled_chunks, F::kBytes) & 15);
  float v[8];
  decode8<QT>(block, (e % F::kElems) / 8, v);
  *reinterpret_cast<uint4*>(out + e0 + e) = pack8<T>(v);
}

}  // namespace minfer::qgemm
