// Embedding lookup: out[t, :] = weight[ids[t], :].
// One block per token row, 16-byte copies. An id outside [0, vocab) never reads the table:
// its row is filled with NaN so that the error cannot pass silently.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include "common/checks.h"
#include "common/dispatch.h"
#include "common/vec.h"

namespace minfer {

template <typename T, typename index_t, bool kVectorized>
__global__ void embedding_kernel(T* __restrict__ out,              // [tokens, hidden]
                                 const index_t* __restrict__ ids,  // [tokens]
                                 const T* __restrict__ weight,     // [vocab, hidden]
                                 int64_t vocab, int hidden) {
  const int64_t token = blockIdx.x;
  const int64_t id = static_cast<int64_t>(ids[token]);
  T* dst = out + token * hidden;
  if (id < 0 || id >= vocab) {
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = from_float<T>(__int_as_float(0x7fc00000));
    return;
  }
  const T* src = weight + id * hidden;
  if constexpr (kVectorized) {
    constexpr int N = Vec<T>::N;
    for (int i = threadIdx.x * N; i < hidden; i += blockDim.x * N) {
      Vec<T> v;
      v.load(src + i);
      v.store(dst + i);
    }
  } else {
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = src[i];
  }
}

torch::Tensor embedding(const torch::Tensor& ids, const torch::Tensor& weight) {
  MINFER_CHECK_CUDA(ids);
  MINFER_CHECK_CUDA(weight);
  MINFER_CHECK_SAME_DEVICE(ids, weight);
  MINFER_CHECK_FLOAT(weight);
  MINFER_CHECK_DIM(weight, 2);
  MINFER_CHECK_CONTIGUOUS(weight);
  MINFER_CHECK_CONTIGUOUS(ids);
  const c10::cuda::CUDAGuard guard(weight.device());
  const int64_t vocab = weight.size(0), hidden = weight.size(1);
  auto out_sizes = ids.sizes().vec();
  out_sizes.push_back(hidden);
  auto out = torch::empty(out_sizes, weight.options());
  const int64_t tokens = ids.numel();
  if (tokens == 0) return out;
  auto stream = c10::cuda::getCurrentCUDAStream();
  MINFER_DISPATCH_FLOAT(weight.scalar_type(), "embedding", [&] {
    MINFER_DISPATCH_INDEX(ids.scalar_type(), "embedding", [&] {
      constexpr int N = Vec<scalar_t>::N;
      const bool vectorized = hidden % N == 0 && is_aligned16(weight.data_ptr()) && is_aligned16(out.data_ptr());
      const int threads = std::min<int64_t>(256, std::max<int64_t>(32, (hidden / (vectorized ? N : 1) + 31) / 32 * 32));
      auto* o = reinterpret_cast<scalar_t*>(out.data_ptr());
      auto* w = reinterpret_cast<const scalar_t*>(weight.data_ptr());
      if (vectorized)
        embedding_kernel<scalar_t, index_t, true><<<tokens, threads, 0, stream>>>(o, ids.data_ptr<index_t>(), w, vocab, hidden);
      else
        embedding_kernel<scalar_t, index_t, false><<<tokens, threads, 0, stream>>>(o, ids.data_ptr<index_t>(), w, vocab, hidden);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return out;
}

}  // namespace minfer
