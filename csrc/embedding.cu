// Embedding lookup: out[t, :] = weight[ids[t], :].
// One block per token row, 16-byte copies when the rows allow them, else element by element.
// An id outside [0, vocab) never reads the table: its row is filled with NaN so that the error cannot
// pass silently.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include "common/checks.h"
#include "common/dispatch.h"
#include "common/launch.h"
#include "common/ptx.cuh"
#include "common/vec.h"

namespace minfer {

// Each thread issues up to kUnroll independent loads before its stores, so that enough bytes are in
// flight per SM to reach HBM bandwidth.
template <typename T, int W, typename index_t>
__global__ void embedding_kernel(T* __restrict__ out,              // [tokens, hidden]
                                 const index_t* __restrict__ ids,  // [tokens]
                                 const T* __restrict__ weight,     // [vocab, hidden]
                                 int64_t vocab, int hidden) {
  constexpr int kUnroll = 4;
  using P = Pack<T, W>;
  const int64_t token = blockIdx.x;
  ptx::griddep_enter(true);  // launched early: ids may be the previous kernel's; first in a step, it releases at entry
  const int64_t id = static_cast<int64_t>(ids[token]);
  T* dst = out + token * hidden;
  if (id < 0 || id >= vocab) {
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = from_float<T>(nan_f());
    return;
  }
  const T* src = weight + id * hidden;
  const int packs = hidden / W;
  for (int base = threadIdx.x; base < packs; base += blockDim.x * kUnroll) {
    P v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int p = base + u * blockDim.x;
      if (p < packs) v[u].load(src + p * W);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int p = base + u * blockDim.x;
      if (p < packs) v[u].store(dst + p * W);
    }
  }
}

at::Tensor embedding(const at::Tensor& ids, const at::Tensor& weight) {
  MINFER_CHECK_CUDA(ids);
  MINFER_CHECK_CUDA(weight);
  MINFER_CHECK_SAME_DEVICE(ids, weight);
  MINFER_CHECK_FLOAT(weight);
  MINFER_CHECK_DIM(weight, 2);
  MINFER_CHECK_CONTIGUOUS(weight);
  MINFER_CHECK_CONTIGUOUS(ids);
  MINFER_CHECK_INDEX(ids);
  MINFER_CHECK(weight.size(1) > 0 && weight.size(1) < (int64_t(1) << 31), "embedding: hidden must be in [1, 2^31), got ",
              weight.size(1));
  MINFER_CHECK(ids.numel() < (int64_t(1) << 31), "embedding: too many ids (", ids.numel(), ")");
  const c10::cuda::CUDAGuard guard(weight.device());
  const int64_t vocab = weight.size(0), hidden = weight.size(1);
  auto out_sizes = ids.sizes().vec();
  out_sizes.push_back(hidden);
  auto out = weight.new_empty(out_sizes);
  const int64_t tokens = ids.numel();
  if (tokens == 0) return out;
  auto stream = c10::cuda::getCurrentCUDAStream();
  MINFER_DISPATCH_FLOAT(weight.scalar_type(), "embedding", [&] {
    MINFER_DISPATCH_INDEX(ids.scalar_type(), "embedding", [&] {
      constexpr int N = 16 / sizeof(scalar_t);
      auto* o = reinterpret_cast<scalar_t*>(out.data_ptr());
      auto* w = reinterpret_cast<const scalar_t*>(weight.data_ptr());
      const bool wide = rows_aligned16(w, hidden, hidden, sizeof(scalar_t)) && is_aligned16(o);
      const int64_t packs = wide ? hidden / N : hidden;
      // About two packs per thread; the kernel unrolls by four beyond that.
      const int threads = std::min<int64_t>(256, round_up((packs + 1) / 2, 32));
      if (wide)
        launch_pdl(embedding_kernel<scalar_t, N, index_t>, dim3(tokens), dim3(threads), 0, stream, o,
                   ids.data_ptr<index_t>(), w, vocab, hidden);
      else
        launch_pdl(embedding_kernel<scalar_t, 1, index_t>, dim3(tokens), dim3(threads), 0, stream, o,
                   ids.data_ptr<index_t>(), w, vocab, hidden);
    });
  });
  return out;
}

}  // namespace minfer
