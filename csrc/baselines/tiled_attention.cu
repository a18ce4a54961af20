// Seed baseline on CUDA cores: a CTA of 128 threads owns BQ = 16 query rows of one (batch, head) and
// streams K/V tiles of BK = 32 keys through shared memory (fp32) with an online softmax. Thread t
// serves row t / 8; the 8 threads of a row split the tile's keys for the scores (4 each) and the
// head dims for the output (d = t % 8 + 8 i). Rows (pad +1) avoid shared-memory bank conflicts.
// Also the fp32 path of flash_attention (tensor cores take only 16-bit inputs there).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cmath>

#include "attention/attention.h"
#include "baselines/baselines.h"
#include "common/checks.h"
#include "common/dispatch.h"
#include "common/vec.h"

namespace minfer::baselines {

namespace {

constexpr int kBQ = 16, kBK = 32, kThreads = 128;

// q [batch, heads, seq_q, D], k/v [batch, kv_heads, seq_k, D], contiguous. DPT >= D / 8 output dims per thread.
template <typename T, int DPT>
__global__ void __launch_bounds__(kThreads)
    tiled_attention_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                           T* __restrict__ out, int heads, int group, int seq_q, int seq_k, int D, float scale_log2,
                           bool causal) {
  extern __shared__ float smem[];
  const int DP = D + 1;
  float* sQ = smem;               // [BQ, D + 1]
  float* sK = sQ + kBQ * DP;      // [BK, D + 1]
  float* sV = sK + kBK * DP;      // [BK, D]
  float* sP = sV + kBK * D;       // [BQ, BK + 1]

  const int bh = blockIdx.y, b = bh / heads, kvh = (bh % heads) / group;
  const int m0 = blockIdx.x * kBQ;
  const int tid = threadIdx.x, r = tid / 8, sub = tid % 8;
  const T* qb = q + (static_cast<int64_t>(bh) * seq_q + m0) * D;
  const T* kb = k + (static_cast<int64_t>(b) * (heads / group) + kvh) * seq_k * D;
  const T* vb = v + (static_cast<int64_t>(b) * (heads / group) + kvh) * seq_k * D;
  const int q_off = seq_k - seq_q;  // bottom-right causal alignment
  const int pos = q_off + m0 + r;   // last key row r may see (when causal)
  int kv_end = seq_k;
  if (causal) kv_end = max(0, min(seq_k, q_off + min(m0 + kBQ, seq_q)));

  for (int i = tid; i < kBQ * D; i += kThreads) {
    const int rr = i / D, d = i % D;
    sQ[rr * DP + d] = m0 + rr < seq_q ? to_float(qb[i]) * scale_log2 : 0.f;
  }
  float acc[DPT];
#pragma unroll
  for (int i = 0; i < DPT; ++i) acc[i] = 0.f;
  float m_run = -INFINITY, l_run = 0.f;

  for (int n0 = 0; n0 < kv_end; n0 += kBK) {
    __syncthreads();  // previous tile fully consumed (and sQ written, first time round)
    for (int i = tid; i < kBK * D; i += kThreads) {
      const int j = i / D, d = i % D;
      const bool ok = n0 + j < seq_k;
      sK[j * DP + d] = ok ? to_float(kb[static_cast<int64_t>(n0) * D + i]) : 0.f;
      sV[j * D + d] = ok ? to_float(vb[static_cast<int64_t>(n0) * D + i]) : 0.f;
    }
    __syncthreads();
    float s[kBK / 8];
    float mx = -INFINITY;
#pragma unroll
    for (int jj = 0; jj < kBK / 8; ++jj) {
      const int j = sub + 8 * jj, col = n0 + j;
      float x = 0.f;
      for (int d = 0; d < D; ++d) x = fmaf(sQ[r * DP + d], sK[j * DP + d], x);
      if (col >= seq_k || (causal && col > pos)) x = -INFINITY;
      s[jj] = x;
      mx = fmaxf(mx, x);
    }
#pragma unroll
    for (int off = 1; off < 8; off <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, off));
    const float m_new = fmaxf(m_run, mx);
    const float base = m_new == -INFINITY ? 0.f : m_new;
    const float alpha = exp2f(m_run - base);
    m_run = m_new;
    l_run *= alpha;
#pragma unroll
    for (int jj = 0; jj < kBK / 8; ++jj) {
      const float e = exp2f(s[jj] - base);
      l_run += e;
      sP[r * (kBK + 1) + sub + 8 * jj] = e;
    }
    __syncwarp();  // sP row r is written and read by the same 8 lanes
#pragma unroll
    for (int i = 0; i < DPT; ++i) acc[i] *= alpha;
    for (int j = 0; j < kBK; ++j) {
      const float pj = sP[r * (kBK + 1) + j];
#pragma unroll
      for (int i = 0; i < DPT; ++i) {
        const int d = sub + 8 * i;
        if (d < D) acc[i] = fmaf(pj, sV[j * D + d], acc[i]);
      }
    }
  }
#pragma unroll
  for (int off = 1; off < 8; off <<= 1) l_run += __shfl_xor_sync(0xffffffff, l_run, off);
  if (m0 + r >= seq_q) return;
  const float inv = l_run > 0.f ? 1.f / l_run : 0.f;
  T* orow = out + (static_cast<int64_t>(bh) * seq_q + m0 + r) * D;
#pragma unroll
  for (int i = 0; i < DPT; ++i) {
    const int d = sub + 8 * i;
    if (d < D) orow[d] = from_float<T>(acc[i] * inv);
  }
}

template <typename T, int DPT>
void launch(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, float scale,
            bool causal) {
  const int batch = q.size(0), heads = q.size(1), seq_q = q.size(2), D = q.size(3);
  const int kv_heads = k.size(1), seq_k = k.size(2);
  const int smem = (kBQ * (D + 1) + kBK * (D + 1) + kBK * D + kBQ * (kBK + 1)) * sizeof(float);
  auto kernel = tiled_attention_kernel<T, DPT>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const dim3 grid((seq_q + kBQ - 1) / kBQ, batch * heads);
  kernel<<<grid, kThreads, smem, c10::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const T*>(q.data_ptr()), reinterpret_cast<const T*>(k.data_ptr()),
      reinterpret_cast<const T*>(v.data_ptr()), reinterpret_cast<T*>(out.data_ptr()), heads, heads / kv_heads, seq_q,
      seq_k, D, scale * attn::kLog2e, causal);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

at::Tensor tiled_attention_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                double scale, bool is_causal) {
  auto out = q.new_empty(q.sizes());
  const int64_t D = q.size(3);
  MINFER_CHECK(D >= 1 && D <= 256, "tiled_attention: head_dim must be in [1, 256], got ", D);
  if (out.numel() == 0) return out;
  MINFER_DISPATCH_FLOAT(q.scalar_type(), "tiled_attention", [&] {
    if (D <= 64) launch<scalar_t, 8>(q, k, v, out, scale, is_causal);
    else if (D <= 128) launch<scalar_t, 16>(q, k, v, out, scale, is_causal);
    else launch<scalar_t, 32>(q, k, v, out, scale, is_causal);
  });
  return out;
}

}  // namespace minfer::baselines
