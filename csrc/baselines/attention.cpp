// Launchers of the attention baselines on q [batch, heads, seq_q, head_dim] and k, v
// [batch, kv_heads, seq_k, head_dim]: naive_attention (naive_attention.cu), tiled_attention
// (tiled_attention.cu) and flash_attention, which runs the engine's flash prefill kernels
// (attention/flash_prefill.cu) with bottom-right causal masking. Validate at the boundary, then dispatch.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "attention/attention.h"
#include "baselines/baselines.h"
#include "common/checks.h"
#include "ops.h"

namespace minfer {

namespace {

void check_seed(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const char* name) {
  constexpr int64_t kIntMax = std::numeric_limits<int>::max();
  MINFER_CHECK_CUDA(q);
  MINFER_CHECK_CUDA(k);
  MINFER_CHECK_CUDA(v);
  MINFER_CHECK_SAME_DEVICE(q, k);
  MINFER_CHECK_SAME_DEVICE(q, v);
  MINFER_CHECK_FLOAT(q);
  MINFER_CHECK_SAME_DTYPE(q, k);
  MINFER_CHECK_SAME_DTYPE(q, v);
  MINFER_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, name,
              ": q, k, v must be [batch, heads, seq, head_dim], got ", q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  MINFER_CHECK(k.sizes() == v.sizes(), name, ": k and v must have the same shape, got ", k.sizes(), " and ", v.sizes());
  MINFER_CHECK(q.size(0) == k.size(0) && q.size(3) == k.size(3), name,
              ": q and k must agree in batch and head_dim, got ", q.sizes(), " and ", k.sizes());
  MINFER_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, name, ": q heads (", q.size(1),
              ") must be a multiple of kv heads (", k.size(1), ")");
  MINFER_CHECK(q.size(2) <= kIntMax && k.size(2) <= kIntMax && q.numel() / std::max<int64_t>(q.size(3), 1) <= kIntMax,
              name, ": sizes too large");
}

double seed_scale(const at::Tensor& q, std::optional<double> scale) {
  return scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(q.size(3)));
}

}  // namespace

at::Tensor naive_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           std::optional<double> scale, bool is_causal) {
  check_seed(q, k, v, "naive_attention");
  const c10::cuda::CUDAGuard guard(q.device());
  return baselines::naive_attention_impl(q.contiguous(), k.contiguous(), v.contiguous(), seed_scale(q, scale),
                                         is_causal);
}

at::Tensor tiled_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           std::optional<double> scale, bool is_causal) {
  check_seed(q, k, v, "tiled_attention");
  const c10::cuda::CUDAGuard guard(q.device());
  return baselines::tiled_attention_impl(q.contiguous(), k.contiguous(), v.contiguous(), seed_scale(q, scale),
                                         is_causal);
}

at::Tensor flash_attention(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                           std::optional<double> scale, bool is_causal) {
  check_seed(q_in, k_in, v_in, "flash_attention");
  const c10::cuda::CUDAGuard guard(q_in.device());
  const int64_t head_dim = q_in.size(3);
  // Tensor cores take 16-bit inputs and the kernel is built for head_dim 64/128/256: anything else
  // (fp32 inputs included) runs on the CUDA-core tiled kernel.
  if (q_in.scalar_type() == at::kFloat || (head_dim != 64 && head_dim != 128 && head_dim != 256))
    return baselines::tiled_attention_impl(q_in.contiguous(), k_in.contiguous(), v_in.contiguous(),
                                           seed_scale(q_in, scale), is_causal);
  auto aligned = [](const at::Tensor& t) { return rows_aligned16(t) ? t : t.clone(at::MemoryFormat::Contiguous); };
  const at::Tensor q = aligned(q_in), k = aligned(k_in), v = aligned(v_in);
  const int64_t batch = q.size(0), heads = q.size(1), seq_q = q.size(2);
  auto out = q.new_empty({batch, heads, seq_q, head_dim});  // [batch, heads, seq_q, head_dim]
  if (out.numel() == 0) return out;
  MINFER_CHECK(batch <= 65535 && heads <= 65535, "flash_attention: batch and heads must be <= 65535");
  attn::FlashParams p{};
  p.q = q.data_ptr(), p.k = k.data_ptr(), p.v = v.data_ptr(), p.o = out.data_ptr();
  p.q_bs = q.stride(0), p.q_hs = q.stride(1), p.q_ss = q.stride(2);
  p.k_bs = k.stride(0), p.k_hs = k.stride(1), p.k_ss = k.stride(2);
  p.v_bs = v.stride(0), p.v_hs = v.stride(1), p.v_ss = v.stride(2);
  p.o_bs = out.stride(0), p.o_hs = out.stride(1), p.o_ss = out.stride(2);
  p.seq_q = seq_q, p.seq_k = k.size(2), p.group = heads / k.size(1);
  p.start_pos = nullptr;
  p.scale_log2 = static_cast<float>(seed_scale(q, scale)) * attn::kLog2e;
  attn::flash_prefill(p, q.scalar_type(), head_dim, is_causal, batch, heads, c10::cuda::getCurrentCUDAStream());
  return out;
}

}  // namespace minfer
