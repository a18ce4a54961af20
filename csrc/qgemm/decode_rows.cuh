// decode_rows_kernel: rows of a quantized W [n, k] (ggml blocks, uint8 [n, k / elems * bytes]) decoded
// to fp16/bf16, the whole weight (dequantize.cu) or the rows named by ids (qembedding.cu). Memory-bound.
//
// A CTA takes kTile outputs of one row: it copies the bytes of their blocks into shared memory in
// 16-byte loads (from the aligned piece holding the first byte, so that a row start anywhere works),
// then each thread decodes 8 outputs and stores them with one 16-byte store.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

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

// out row r = W row (ids ? ids[r] : r), or NaN where that id is outside [0, n) (nothing is read then).
// grid = (rows, ceil(k / kDecodeTile)); out 16-byte aligned, w 16-byte aligned.
template <int QT, typename T>
__global__ void __launch_bounds__(kDecodeThreads) decode_rows_kernel(T* __restrict__ out,              // [rows, k]
                                                                     const uint8_t* __restrict__ w,    // [n, row bytes]
                                                                     const int64_t* __restrict__ ids,  // [rows] or null
                                                                     int64_t n, int k) {
  using F = Format<QT>;
  constexpr int kPieces = (kDecodeTile / F::kElems * F::kBytes + 15 + 15) / 16;  // the tile's bytes at any alignment
  __shared__ __align__(16) uint8_t tile[16 * kPieces];
  const int64_t r = blockIdx.x, id = ids ? ids[r] : r;
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
  const int64_t row_bytes = int64_t(k / F::kElems) * F::kBytes, total = n * row_bytes;
  const int64_t start = id * row_bytes + e0 / F::kElems * F::kBytes, a0 = start & ~int64_t(15);
  const int pieces = int((start + elems / F::kElems * F::kBytes - a0 + 15) / 16);
  for (int p = threadIdx.x; p < pieces; p += kDecodeThreads) {
    const int64_t a = a0 + 16 * p;
    if (a + 16 <= total) {
      *reinterpret_cast<uint4*>(tile + 16 * p) = ptx::ld_nc_stream_v4(reinterpret_cast<const uint4*>(w + a), true);
    } else {  // the weight's last piece: byte by byte, nothing read past it
      for (int i = 0; i < 16 && a + i < total; ++i) tile[16 * p + i] = w[a + i];
    }
  }
  __syncthreads();
  if (e >= elems) return;
  float v[8];
  decode8<QT>(tile + (start - a0) + e / F::kElems * F::kBytes, (e % F::kElems) / 8, v);
  *reinterpret_cast<uint4*>(dst + e) = pack8<T>(v);
}

}  // namespace minfer::qgemm
