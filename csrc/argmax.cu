// Greedy sampling's argmax: out[r] = the index of the largest logits[r, :], the first among equals, NaN counting as
// the largest (torch.argmax's rule). It reads the logits in their own dtype, so that a greedy step needs no fp32
// copy of [rows, vocab] (8B shape, 64 rows: the copy and torch's argmax over it took ~60 µs of a 7.3 ms step).
//
// A grid of (splits, rows): each CTA reduces its slice of a row to one key, the value's order bits above the index
// reversed, so that one unsigned max picks the largest value and then the smallest index; the last of a row's CTAs
// to arrive (split_counters) reduces the row's partial keys.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "common/checks.h"
#include "common/dispatch.h"
#include "common/launch.h"
#include "common/ptx.cuh"
#include "common/reduce.h"
#include "common/split_counters.h"
#include "common/vec.h"

namespace minfer {

namespace {

using Key = unsigned long long;
constexpr int kThreads = 256;
constexpr int kUnroll = 4;               // packs a thread has in flight
constexpr int64_t kMinSlice = 4096;      // elements a CTA takes at least
constexpr int kCtasPerSm = 2;            // the grid aimed at

// Unsigned order of v (NaN above +inf, -0 equal to +0), then the index reversed.
__device__ __forceinline__ Key argmax_key(float v, uint32_t index) {
  const uint32_t u = __float_as_uint(v);
  const uint32_t order = v != v ? 0xffffffffu : v == 0.f ? 0x80000000u : (u >> 31) ? ~u : u | 0x80000000u;
  return (static_cast<Key>(order) << 32) | (0xffffffffu - index);
}

// Every thread of warp 0 gets the block's max.
__device__ __forceinline__ Key block_max_u64(Key x) {
  __shared__ Key partial[kThreads / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  x = warp_max(x);
  if (lane == 0) partial[warp] = x;
  __syncthreads();
  return warp_max(lane < kThreads / 32 ? partial[lane] : 0);
}

template <typename T, int W>
__global__ void __launch_bounds__(kThreads)
    argmax_kernel(int64_t* __restrict__ out,         // [rows]
                  const T* __restrict__ logits,      // [rows, row_stride]
                  int64_t row_stride, int vocab,
                  int slice,                         // elements a CTA, a multiple of W
                  Key* __restrict__ partials,   // [rows, splits]
                  int* __restrict__ counters) {      // [rows], zero, left zero
  using P = Pack<T, W>;
  const int row = blockIdx.y, split = blockIdx.x, splits = gridDim.x;
  const T* src = logits + row * row_stride;
  const int begin = split * slice, end = min(vocab, begin + slice);
  ptx::griddep_wait();  // the logits are the previous kernel's
  ptx::griddep_launch_dependents();

  Key best = 0;
  for (int base = begin + threadIdx.x * W; base < end; base += kThreads * W * kUnroll) {
    P v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * kThreads * W;
      if (i + W <= end) v[u].load(src + i);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * kThreads * W;
#pragma unroll
      for (int e = 0; e < W; ++e) {
        if (i + W <= end || i + e < end)  // the row's last pack may be partial: its elements one by one
          best = max(best, argmax_key(to_float(i + W <= end ? v[u].v[e] : src[i + e]), i + e));
      }
    }
  }
  best = block_max_u64(best);
  if (threadIdx.x >= 32) return;
  if (splits > 1) {
    __shared__ bool last;
    if (threadIdx.x == 0) {
      partials[static_cast<int64_t>(row) * splits + split] = best;
      __threadfence();
      last = atomicAdd(&counters[row], 1) == splits - 1;
    }
    __syncwarp();
    if (!last) return;
    __threadfence();
    best = 0;
    for (int s = threadIdx.x; s < splits; s += 32) best = max(best, __ldcg(&partials[static_cast<int64_t>(row) * splits + s]));
    best = warp_max(best);
    if (threadIdx.x == 0) counters[row] = 0;
  }
  if (threadIdx.x == 0) out[row] = 0xffffffffu - static_cast<uint32_t>(best);
}

}  // namespace

at::Tensor argmax(const at::Tensor& logits) {
  MINFER_CHECK_CUDA(logits);
  MINFER_CHECK_FLOAT(logits);
  MINFER_CHECK_DIM(logits, 2);
  MINFER_CHECK(logits.stride(1) == 1, "argmax: logits' rows must be contiguous, got strides ", logits.strides());
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  MINFER_CHECK(vocab > 0 && vocab < (int64_t(1) << 31), "argmax: logits' row length must be in [1, 2^31), got ", vocab);
  MINFER_CHECK(rows < 65536, "argmax: at most 65535 rows, got ", rows);
  const c10::cuda::CUDAGuard guard(logits.device());
  auto out = logits.new_empty({rows}, at::kLong);
  if (rows == 0) return out;
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int device = logits.get_device();
  const int64_t target = std::max<int64_t>(1, kCtasPerSm * sm_count(device) / rows);
  const int64_t splits = std::clamp<int64_t>(vocab / kMinSlice, 1, target);
  at::Tensor partials, own_counters;
  int* counters = nullptr;
  if (splits > 1) {
    partials = logits.new_empty({rows * splits}, at::kLong);
    counters = split_counters(rows, device, stream, logits, own_counters);
  }
  MINFER_DISPATCH_FLOAT(logits.scalar_type(), "argmax", [&] {
    constexpr int N = 16 / sizeof(scalar_t);
    const auto* src = reinterpret_cast<const scalar_t*>(logits.data_ptr());
    const bool wide = rows_aligned16(src, 0, logits.stride(0), sizeof(scalar_t));
    const int w = wide ? N : 1;
    const int slice = static_cast<int>((vocab + splits - 1) / splits + w - 1) / w * w;
    auto* part = splits > 1 ? reinterpret_cast<Key*>(partials.data_ptr()) : nullptr;
    const dim3 grid(static_cast<unsigned>(splits), static_cast<unsigned>(rows));
    if (wide)
      launch_pdl(argmax_kernel<scalar_t, N>, grid, dim3(kThreads), 0, stream, out.data_ptr<int64_t>(), src,
                 logits.stride(0), static_cast<int>(vocab), slice, part, counters);
    else
      launch_pdl(argmax_kernel<scalar_t, 1>, grid, dim3(kThreads), 0, stream, out.data_ptr<int64_t>(), src,
                 logits.stride(0), static_cast<int>(vocab), slice, part, counters);
  });
  return out;
}

}  // namespace minfer
