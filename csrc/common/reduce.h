// Warp and block reductions (shuffles, then one shared-memory hop), by any associative op.
#pragma once

namespace minfer {

template <typename T, typename Op>
__device__ __forceinline__ T warp_reduce(T x, Op op) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x = op(x, __shfl_xor_sync(0xffffffff, x, offset));
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
  return warp_reduce(x, [](float a, float b) { return a + b; });
}

__device__ __forceinline__ float warp_max(float x) {
  return warp_reduce(x, [](float a, float b) { return fmaxf(a, b); });
}

// Every thread of the block gets the reduction of x by op; identity stands in for the warps the block lacks.
// blockDim.x must be a multiple of 32, at most 1024.
template <typename T, typename Op>
__device__ __forceinline__ T block_reduce(T x, Op op, T identity) {
  __shared__ T partial[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  x = warp_reduce(x, op);
  __syncthreads();  // partial[] may still be read by a previous call
  if (lane == 0) partial[warp] = x;
  __syncthreads();
  x = lane < static_cast<int>(blockDim.x >> 5) ? partial[lane] : identity;
  return warp_reduce(x, op);
}

__device__ __forceinline__ float block_sum(float x) {
  return block_reduce(x, [](float a, float b) { return a + b; }, 0.f);
}

}  // namespace minfer
