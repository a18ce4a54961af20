// Attention's helpers around the tensor-core PTX of common/ptx.cuh (cp.async, ldmatrix, mma.sync
// m16n8k16; fragment layouts there): P's packing from fp32 scores into an A fragment (and back: unpack2), and the XOR swizzle
// of K/V tiles. In the attention kernels, with g = lane / 4 and t = lane % 4, a thread's C fragment of
// S = Q K^T holds rows g and g + 8 of a 16-row block, columns 2t, 2t + 1 of each 8-wide tile; two such
// tiles, packed pairwise to 16 bit, are exactly the A fragment of P for one 16-key k-step of O += P V.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <type_traits>

#include "common/ptx.cuh"

namespace minfer::attn {

// Two floats -> one 32-bit register of two 16-bit values, `lo` in the low half (the lower column).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<T, __half>) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  } else {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
}

// pack2's inverse: one 32-bit register of two 16-bit values -> (low, high) as floats.
template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t u) {
  if constexpr (std::is_same_v<T, __half>) return __half22float2(*reinterpret_cast<const __half2*>(&u));
  else return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u));
}

// Element offset of 16-byte chunk `chunk` of row `row` in a [rows, D] tile whose chunks are XOR-swizzled
// with the row (mod 8): the 8 rows one ldmatrix reads hit 8 different bank groups.
template <int D>
__device__ __forceinline__ int swz(int row, int chunk) {
  return row * D + ((chunk ^ (row & 7)) << 3);
}

}  // namespace minfer::attn
