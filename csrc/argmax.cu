// Greedy sampling's argmax: out[r] = the index of the largest logits[r, :], the first among equals, NaN counting as
// the largest (torch.argmax's rule). It reads the logits in their own dtype, so that a greedy step needs no fp32
// copy of [rows, vocab] (8B shape, 64 rows: the copy and torch's argmax over it took ~60 µs of a 7.3 ms step).
//
// gumbel_argmax, the random draw: the argmax of logits[r, i] x (1 / temperature[r]) + g, g = -log(-log(u)) and u the
// counter-based uniform of (seeds[r], positions[r], i) (minfer/ops/reference.py's uniform_noise, bit for bit), made in
// registers, where the reference's torch ops make [rows, vocab] int64 hashes in ~30 launches (~1 GB of traffic, 64 rows
// of 49k ids). A row of temperature 0 takes its plain argmax (greedy); no temperature: 1 for every row. With the
// division here a sampled step reads the lm_head's output as it is, in one launch (no fp32 copy, no divided copy).
//
// A grid of (splits, rows): each CTA reduces its slice of a row to one key, the value's order bits above the index
// reversed, so that one unsigned max picks the largest value and then the smallest index; the last of a row's CTAs
// to arrive (split_counters) reduces the row's partial keys.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "common/checks.h"
#include "common/dispatch.h"
#include "common/draw.cuh"
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

__device__ __forceinline__ Key key_max(Key a, Key b) { return max(a, b); }

// kGumbel: the argmax of logits x (1 / temperature) + gumbel(key of (seeds[row], positions[row]), index), the plain
// argmax where the row's temperature is 0.
template <typename T, int W, bool kGumbel>
__global__ void __launch_bounds__(kThreads)
    argmax_kernel(int64_t* __restrict__ out,         // [rows]
                  const T* __restrict__ logits,      // [rows, row_stride]
                  int64_t row_stride, int vocab,
                  int slice,                         // elements a CTA, a multiple of W
                  Key* __restrict__ partials,   // [rows, splits]
                  int* __restrict__ counters,        // [rows], zero, left zero
                  const int64_t* __restrict__ seeds,       // [rows] (kGumbel)
                  const int64_t* __restrict__ positions,   // [rows] (kGumbel)
                  const float* __restrict__ temperature) { // [rows] (kGumbel), or null: 1
  using P = Pack<T, W>;
  const int row = blockIdx.y, split = blockIdx.x, splits = gridDim.x;
  const T* src = logits + row * row_stride;
  const int begin = split * slice, end = min(vocab, begin + slice);
  ptx::griddep_wait();  // the logits are the previous kernel's
  ptx::griddep_launch_dependents();
  const uint32_t key = kGumbel ? noise_key(seeds[row], positions[row]) : 0;
  const float t = kGumbel && temperature ? temperature[row] : 1.f;
  const bool noise = kGumbel && t != 0.f;
  const float inverse = noise ? __frcp_rn(t) : 1.f;
  auto value = [&](T v, int i) {
    // x times 1 / t, each rounded as the reference's torch ops (no fused multiply-add): a row draws the same here and
    // in draw_filtered
    if constexpr (kGumbel) return noise ? __fmul_rn(to_float(v), inverse) + gumbel(key, i) : to_float(v);
    return to_float(v);
  };

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
          best = max(best, argmax_key(value(i + W <= end ? v[u].v[e] : src[i + e], i + e), i + e));
      }
    }
  }
  best = block_reduce(best, key_max, Key{0});
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
    best = warp_reduce(best, key_max);
    if (threadIdx.x == 0) counters[row] = 0;
  }
  if (threadIdx.x == 0) out[row] = argmax_index(best);
}

// seeds, positions: the draw's (gumbel_argmax), else undefined (argmax); temperature: the draw's, or undefined (1).
at::Tensor launch_argmax(const at::Tensor& logits, const at::Tensor& seeds, const at::Tensor& positions,
                         const at::Tensor& temperature) {
  const bool noise = seeds.defined();
  const int64_t rows = logits.size(0), vocab = logits.size(1);
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
    const int64_t* seed = noise ? seeds.data_ptr<int64_t>() : nullptr;
    const int64_t* position = noise ? positions.data_ptr<int64_t>() : nullptr;
    const float* temp = temperature.defined() ? temperature.data_ptr<float>() : nullptr;
    auto go = [&](auto kernel) {
      launch_pdl(kernel, grid, dim3(kThreads), 0, stream, out.data_ptr<int64_t>(), src, logits.stride(0),
                 static_cast<int>(vocab), slice, part, counters, seed, position, temp);
    };
    if (noise)
      wide ? go(argmax_kernel<scalar_t, N, true>) : go(argmax_kernel<scalar_t, 1, true>);
    else
      wide ? go(argmax_kernel<scalar_t, N, false>) : go(argmax_kernel<scalar_t, 1, false>);
  });
  return out;
}

void check_logits(const at::Tensor& logits, const char* op) {
  MINFER_CHECK_CUDA(logits);
  MINFER_CHECK_FLOAT(logits);
  MINFER_CHECK_DIM(logits, 2);
  MINFER_CHECK(logits.stride(1) == 1, op, ": logits' rows must be contiguous, got strides ", logits.strides());
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  MINFER_CHECK(vocab > 0 && vocab < (int64_t(1) << 31), op, ": logits' row length must be in [1, 2^31), got ", vocab);
  MINFER_CHECK(rows < 65536, op, ": at most 65535 rows, got ", rows);
}

}  // namespace

at::Tensor argmax(const at::Tensor& logits) {
  check_logits(logits, "argmax");
  return launch_argmax(logits, at::Tensor(), at::Tensor(), at::Tensor());
}

at::Tensor gumbel_argmax(const at::Tensor& logits, const at::Tensor& seeds, const at::Tensor& positions,
                         const std::optional<at::Tensor>& temperature) {
  check_logits(logits, "gumbel_argmax");
  const at::Tensor temp = temperature.value_or(at::Tensor());
  for (const at::Tensor* t : {&seeds, &positions, &temp}) {
    if (!t->defined()) continue;
    const char* name = t == &seeds ? "seeds" : t == &positions ? "positions" : "temperature";
    MINFER_CHECK(t->device() == logits.device(), name, " must be on the logits' device ", logits.device(), ", got ",
                 t->device());
    const auto dtype = t == &temp ? at::kFloat : at::kLong;
    MINFER_CHECK(t->scalar_type() == dtype, name, " must be ", dtype == at::kFloat ? "float32" : "int64", ", got ",
                 t->scalar_type());
    MINFER_CHECK(t->dim() == 1 && t->size(0) == logits.size(0), name, " must be [rows] (", logits.size(0),
                 "), got shape ", t->sizes());
    MINFER_CHECK(t->is_contiguous(), name, " must be contiguous");
  }
  return launch_argmax(logits, seeds, positions, temp);
}

}  // namespace minfer
