// Warp and block sum reductions (shuffles, then one shared-memory hop).
#pragma once

namespace minfer {

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffff, x, offset);
  return x;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, offset));
  return x;
}

__device__ __forceinline__ unsigned long long warp_max(unsigned long long x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x = max(x, __shfl_xor_sync(0xffffffff, x, offset));
  return x;
}

// Every thread of the block gets the total. blockDim.x must be a multiple of 32, at most 1024.
__device__ __forceinline__ float block_sum(float x) {
  __shared__ float partial[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  x = warp_sum(x);
  __syncthreads();  // partial[] may still be read by a previous call
  if (lane == 0) partial[warp] = x;
  __syncthreads();
  const int num_warps = (blockDim.x + 31) >> 5;
  x = lane < num_warps ? partial[lane] : 0.f;
  return warp_sum(x);
}

}  // namespace minfer
