// 16-byte vector loads/stores and float conversion for float, half and bf16.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace minfer {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// W elements of T in registers. A 16-byte pack moves with one LDG.128 / STG.128 (the caller guarantees
// 16-byte alignment); any other width moves element by element and assumes nothing about alignment.
template <typename T, int W>
struct alignas(W * sizeof(T) == 16 ? 16 : alignof(T)) Pack {
  static constexpr bool kWide = W * sizeof(T) == 16;
  T v[W];
  __device__ __forceinline__ void load(const T* p) {
    if constexpr (kWide) {
      *reinterpret_cast<uint4*>(v) = *reinterpret_cast<const uint4*>(p);
    } else {
#pragma unroll
      for (int e = 0; e < W; ++e) v[e] = p[e];
    }
  }
  __device__ __forceinline__ void store(T* p) const {
    if constexpr (kWide) {
      *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(v);
    } else {
#pragma unroll
      for (int e = 0; e < W; ++e) p[e] = v[e];
    }
  }
};

__host__ __device__ inline bool is_aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// A row of `elems` elements of T with this row stride (elements) can move in 16-byte packs.
__host__ inline bool rows_aligned16(const void* base, int64_t elems, int64_t row_stride, int64_t elem_size) {
  return is_aligned16(base) && (elems * elem_size) % 16 == 0 && (row_stride * elem_size) % 16 == 0;
}

#ifdef __CUDACC__
__device__ __forceinline__ float nan_f() { return __int_as_float(0x7fc00000); }
#endif

__host__ inline int round_up(int64_t x, int m) { return static_cast<int>((x + m - 1) / m * m); }

}  // namespace minfer
