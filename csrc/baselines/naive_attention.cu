// Seed baseline: one thread per output row, scores materialised in an fp32 [rows, seq_k] buffer in
// global memory (O(N^2) memory, the exposed baseline). Three passes over the row: scores + max,
// exp + sum, then P V one output element at a time.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cmath>

#include "baselines/baselines.h"
#include "common/dispatch.h"
#include "common/vec.h"

namespace minfer::baselines {

namespace {

// q [batch, heads, seq_q, D], k/v [batch, kv_heads, seq_k, D], all contiguous; one thread per q row.
template <typename T>
__global__ void naive_attention_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                       T* __restrict__ out, float* __restrict__ scores, int64_t rows, int heads,
                                       int group, int seq_q, int seq_k, int D, float scale, bool causal) {
  const int64_t row = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (row >= rows) return;
  const int i = row % seq_q;
  const int64_t bh = row / seq_q;
  const int64_t b = bh / heads, kvh = (bh % heads) / group;
  const T* qr = q + row * D;
  const T* kb = k + (b * (heads / group) + kvh) * seq_k * D;
  const T* vb = v + (b * (heads / group) + kvh) * seq_k * D;
  float* s = scores + row * seq_k;
  const int last = causal ? i + seq_k - seq_q : seq_k - 1;  // last visible key

  float mx = -INFINITY;
  for (int j = 0; j < seq_k; ++j) {
    float x = -INFINITY;
    if (j <= last) {
      x = 0.f;
      for (int d = 0; d < D; ++d) x += to_float(qr[d]) * to_float(kb[j * D + d]);
      x *= scale;
    }
    s[j] = x;
    mx = fmaxf(mx, x);
  }
  float sum = 0.f;
  for (int j = 0; j < seq_k; ++j) {
    const float e = mx == -INFINITY ? 0.f : expf(s[j] - mx);
    s[j] = e;
    sum += e;
  }
  const float inv = sum > 0.f ? 1.f / sum : 0.f;  // a row that sees no key gets zeros
  for (int d = 0; d < D; ++d) {
    float o = 0.f;
    for (int j = 0; j < seq_k; ++j) o += s[j] * to_float(vb[j * D + d]);
    out[row * D + d] = from_float<T>(o * inv);
  }
}

}  // namespace

at::Tensor naive_attention_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                double scale, bool is_causal) {
  const int64_t batch = q.size(0), heads = q.size(1), seq_q = q.size(2), D = q.size(3);
  const int64_t kv_heads = k.size(1), seq_k = k.size(2);
  auto out = q.new_empty(q.sizes());
  const int64_t rows = batch * heads * seq_q;
  if (rows == 0) return out;
  auto scores = q.new_empty({rows, std::max<int64_t>(seq_k, 1)}, at::kFloat);
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int threads = 128;
  const int64_t blocks = (rows + threads - 1) / threads;
  MINFER_DISPATCH_FLOAT(q.scalar_type(), "naive_attention", [&] {
    naive_attention_kernel<scalar_t><<<blocks, threads, 0, stream>>>(
        reinterpret_cast<const scalar_t*>(q.data_ptr()), reinterpret_cast<const scalar_t*>(k.data_ptr()),
        reinterpret_cast<const scalar_t*>(v.data_ptr()), reinterpret_cast<scalar_t*>(out.data_ptr()),
        scores.data_ptr<float>(), rows, heads, heads / kv_heads, seq_q, seq_k, D, static_cast<float>(scale),
        is_causal);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace minfer::baselines
