// Launchers of the attention family: validation at the boundary, then dispatch.
//   attention (engine op, dense cache): seq > 1 -> flash prefill (flash_prefill.cu), seq == 1 -> split-KV
//   decode (flash_decode.cu), which may also rotate the newest key and write it to the caches (rope_in).
//   paged_attention (engine op, paged cache): one query per sequence -> the same split-KV decode through the
//   block table; else ragged prefill chunks (and decodes mixed in) -> the sm80 flash prefill kernel. The baselines' API on [batch, heads, seq, head_dim] is in csrc/baselines/attention.cpp.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cmath>
#include <limits>

#include "attention/attention.h"
#include "common/checks.h"
#include "common/vec.h"
#include "ops.h"

namespace minfer {

namespace {

constexpr int64_t kIntMax = std::numeric_limits<int>::max();

// The engine op's checks on q [batch, seq, heads, head_dim] and k_cache [batch, capacity, kv_heads, head_dim].
void check_q_and_cache(const at::Tensor& q, const at::Tensor& k_cache) {
  MINFER_CHECK_CUDA(q);
  MINFER_CHECK_CUDA(k_cache);
  MINFER_CHECK_SAME_DEVICE(q, k_cache);
  MINFER_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16,
              "attention: q must be float16 or bfloat16, got ", q.scalar_type());
  MINFER_CHECK_SAME_DTYPE(q, k_cache);
  MINFER_CHECK(q.dim() == 4, "attention: q must be [batch, seq, heads, head_dim], got ", q.sizes());
  MINFER_CHECK(k_cache.dim() == 4, "attention: k_cache must be [batch, capacity, kv_heads, head_dim], got ",
              k_cache.sizes());
  const int64_t batch = q.size(0), heads = q.size(2), head_dim = q.size(3), kv_heads = k_cache.size(2);
  MINFER_CHECK(head_dim == 64 || head_dim == 128 || head_dim == 256, "attention: head_dim must be 64, 128 or 256, got ",
              head_dim);
  MINFER_CHECK(k_cache.size(0) == batch && k_cache.size(3) == head_dim,
              "attention: k_cache must be [batch, capacity, kv_heads, head_dim] = [", batch, ", *, *, ", head_dim,
              "], got ", k_cache.sizes());
  MINFER_CHECK(kv_heads > 0 && heads % kv_heads == 0, "attention: q heads (", heads,
              ") must be a multiple of kv_heads (", kv_heads, ")");
}

// The newest key's rope folded into a decode call (decode_params.h): k_new, v_new and cos_sin come together.
// k_new, v_new [batch, kv_heads, head_dim] in q's dtype with a contiguous head_dim (views into the fused qkv are
// fine); cos_sin [max_position, head_dim] fp32 contiguous, cos | sin halves (the whole head rotates in NeoX pairs).
// One query per sequence, head_dim 64 or 128 (d 256 keeps q in shared memory, where the fold is not built).
attn::decode::RopeIn rope_in(const char* op, const at::Tensor& q, bool decode, int64_t batch, int64_t kv_heads,
                             const std::optional<at::Tensor>& k_new, const std::optional<at::Tensor>& v_new,
                             const std::optional<at::Tensor>& cos_sin) {
  const int given = k_new.has_value() + v_new.has_value() + cos_sin.has_value();
  MINFER_CHECK(given == 0 || given == 3, op, ": k_new, v_new and cos_sin come together (the newest key's rope), got ",
               given, " of them");
  if (given == 0) return {};
  const int64_t head_dim = q.size(-1);
  MINFER_CHECK(decode, op, ": k_new, v_new and cos_sin are for decode calls (one query per sequence), got q ",
               q.sizes());
  MINFER_CHECK(head_dim == 64 || head_dim == 128, op, ": the newest key's rope needs head_dim 64 or 128, got ",
               head_dim);
  for (const at::Tensor* t : {&*k_new, &*v_new}) {
    const char* name = t == &*k_new ? "k_new" : "v_new";
    MINFER_CHECK(t->device() == q.device() && t->scalar_type() == q.scalar_type(), op, ": ", name,
                 " must have q's device and dtype (", q.device(), ", ", q.scalar_type(), "), got ", t->device(), ", ",
                 t->scalar_type());
    MINFER_CHECK(t->dim() == 3 && t->size(0) == batch && t->size(1) == kv_heads && t->size(2) == head_dim &&
                     t->stride(2) == 1,
                 op, ": ", name, " must be [batch, kv_heads, head_dim] = [", batch, ", ", kv_heads, ", ", head_dim,
                 "] with a contiguous head_dim, got ", t->sizes(), " with strides ", t->strides());
  }
  const at::Tensor& cs = *cos_sin;
  MINFER_CHECK(cs.device() == q.device() && cs.scalar_type() == at::kFloat, op,
               ": cos_sin must be float32 on q's device, got ", cs.scalar_type(), " on ", cs.device());
  MINFER_CHECK(cs.dim() == 2 && cs.size(1) == head_dim && cs.is_contiguous() && cs.size(0) <= kIntMax &&
                   reinterpret_cast<uintptr_t>(cs.data_ptr()) % 8 == 0,
               op, ": cos_sin must be a contiguous [max_position, head_dim = ", head_dim,
               "] tensor with 8-byte aligned data (the whole head rotates), got ", cs.sizes());
  attn::decode::RopeIn r;
  r.k_new = k_new->data_ptr(), r.v_new = v_new->data_ptr();
  r.k_bs = k_new->stride(0), r.k_hs = k_new->stride(1), r.v_bs = v_new->stride(0), r.v_hs = v_new->stride(1);
  r.cos_sin = cs.data_ptr<float>(), r.max_position = static_cast<int>(cs.size(0));
  return r;
}

}  // namespace

at::Tensor attention(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& start_pos, double scale, bool stable_prefix, int64_t window,
                     const std::optional<at::Tensor>& k_new, const std::optional<at::Tensor>& v_new,
                     const std::optional<at::Tensor>& cos_sin) {
  MINFER_CHECK(k_cache.sizes() == v_cache.sizes(), "attention: k_cache and v_cache must have the same shape, got ",
              k_cache.sizes(), " and ", v_cache.sizes());
  check_q_and_cache(q_in, k_cache);
  MINFER_CHECK_CUDA(v_cache);
  MINFER_CHECK_CUDA(start_pos);
  MINFER_CHECK_SAME_DEVICE(q_in, v_cache);
  MINFER_CHECK_SAME_DEVICE(q_in, start_pos);
  MINFER_CHECK_SAME_DTYPE(q_in, v_cache);
  MINFER_CHECK(start_pos.scalar_type() == at::kInt, "attention: start_pos must be int32, got ", start_pos.scalar_type());
  MINFER_CHECK(scale > 0 && std::isfinite(scale), "attention: scale must be positive and finite, got ", scale);
  const int64_t batch = q_in.size(0), seq = q_in.size(1), heads = q_in.size(2), head_dim = q_in.size(3);
  const int64_t capacity = k_cache.size(1), kv_heads = k_cache.size(2);
  MINFER_CHECK(start_pos.dim() == 1 && start_pos.size(0) == batch && start_pos.is_contiguous(),
              "attention: start_pos must be a contiguous [batch] = [", batch, "] tensor, got ", start_pos.sizes());
  MINFER_CHECK(rows_aligned16(k_cache) && rows_aligned16(v_cache),
              "attention: k_cache and v_cache must have a contiguous head_dim, strides that are multiples of 8 "
              "elements and 16-byte aligned data (the contiguous KV cache layout)");
  MINFER_CHECK(window >= 0 && window <= kIntMax, "attention: window must be in [0, 2^31) (0: none), got ", window);
  MINFER_CHECK(seq <= kIntMax && capacity <= kIntMax && batch <= 65535 && heads <= 65535,
              "attention: sizes too large, got q ", q_in.sizes(), " and cache ", k_cache.sizes());
  const attn::decode::RopeIn rope = rope_in("attention", q_in, seq == 1, batch, kv_heads, k_new, v_new, cos_sin);
  const c10::cuda::CUDAGuard guard(q_in.device());
  // q may be a strided view into the fused qkv projection; copy only when its rows are not 16-byte aligned.
  const at::Tensor q = rows_aligned16(q_in) ? q_in : q_in.clone(at::MemoryFormat::Contiguous);
  auto out = q.new_empty({batch, seq, heads, head_dim});  // [batch, seq, heads, head_dim]
  if (out.numel() == 0) return out;
  if (seq == 1) {
    attn::flash_decode(q, k_cache, v_cache, start_pos, scale, stable_prefix, static_cast<int>(window), rope, out);
    return out;
  }
  attn::FlashParams p{};
  p.q = q.data_ptr(), p.k = k_cache.data_ptr(), p.v = v_cache.data_ptr(), p.o = out.data_ptr();
  p.q_bs = q.stride(0), p.q_ss = q.stride(1), p.q_hs = q.stride(2);
  p.k_bs = k_cache.stride(0), p.k_ss = k_cache.stride(1), p.k_hs = k_cache.stride(2);
  p.v_bs = v_cache.stride(0), p.v_ss = v_cache.stride(1), p.v_hs = v_cache.stride(2);
  p.o_bs = out.stride(0), p.o_ss = out.stride(1), p.o_hs = out.stride(2);
  p.seq_q = seq, p.seq_k = capacity, p.group = heads / kv_heads;
  p.start_pos = start_pos.data_ptr<int>();
  p.window = static_cast<int>(window);
  p.scale_log2 = static_cast<float>(scale) * attn::kLog2e;
  attn::flash_prefill(p, q.scalar_type(), head_dim, /*causal=*/true, batch, heads,
                      c10::cuda::getCurrentCUDAStream());
  return out;
}

namespace {

// paged_attention into out (nullptr: a new [tokens, heads, head_dim] tensor), which it returns.
at::Tensor paged_attention_impl(const at::Tensor* out_in, const at::Tensor& q_in, const at::Tensor& k_cache,
                                const at::Tensor& v_cache, const at::Tensor& block_table, const at::Tensor& seq_lens,
                                const at::Tensor& cu_seqlens_q, int64_t max_seqlen_q, int64_t max_seqlen_k,
                                double scale, bool stable_prefix, int64_t window,
                                const std::optional<at::Tensor>& k_new, const std::optional<at::Tensor>& v_new,
                                const std::optional<at::Tensor>& cos_sin) {
  MINFER_CHECK_CUDA(q_in);
  for (const at::Tensor* t : {&k_cache, &v_cache, &block_table, &seq_lens, &cu_seqlens_q}) {
    MINFER_CHECK_CUDA(*t);
    MINFER_CHECK_SAME_DEVICE(q_in, *t);
  }
  MINFER_CHECK(q_in.scalar_type() == at::kHalf || q_in.scalar_type() == at::kBFloat16,
              "paged_attention: q must be float16 or bfloat16, got ", q_in.scalar_type());
  MINFER_CHECK_SAME_DTYPE(q_in, k_cache);
  MINFER_CHECK_SAME_DTYPE(q_in, v_cache);
  MINFER_CHECK(q_in.dim() == 3, "paged_attention: q must be [tokens, heads, head_dim], got ", q_in.sizes());
  MINFER_CHECK(scale > 0 && std::isfinite(scale), "paged_attention: scale must be positive and finite, got ", scale);
  MINFER_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "paged_attention: k_cache and v_cache must both be [num_pages, page_size, kv_heads, head_dim], got ",
              k_cache.sizes(), " and ", v_cache.sizes());
  const int64_t tokens = q_in.size(0), heads = q_in.size(1), head_dim = q_in.size(2);
  const int64_t num_pages = k_cache.size(0), page_size = k_cache.size(1), kv_heads = k_cache.size(2);
  MINFER_CHECK(head_dim == 64 || head_dim == 128 || head_dim == 256,
              "paged_attention: head_dim must be 64, 128 or 256, got ", head_dim);
  MINFER_CHECK(k_cache.size(3) == head_dim, "paged_attention: the caches' head_dim must be q's (", head_dim, "), got ",
              k_cache.sizes());
  MINFER_CHECK(kv_heads > 0 && heads % kv_heads == 0, "paged_attention: q heads (", heads,
              ") must be a multiple of kv_heads (", kv_heads, ")");
  MINFER_CHECK(page_size % 16 == 0, "paged_attention: page_size must be a multiple of 16 (the kernels' key tile), got ",
              page_size);
  MINFER_CHECK(rows_aligned16(k_cache) && rows_aligned16(v_cache) && k_cache.stride(1) == v_cache.stride(1),
              "paged_attention: k_cache and v_cache must be contiguous pools with 16-byte aligned data");
  MINFER_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 2 && block_table.stride(1) == 1,
              "paged_attention: block_table must be int32 [batch, max_pages] with contiguous rows, got ",
              block_table.scalar_type(), " ", block_table.sizes());
  const int64_t batch = block_table.size(0);
  MINFER_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1 && seq_lens.size(0) == batch &&
                   seq_lens.is_contiguous(),
              "paged_attention: seq_lens must be a contiguous int32 [batch] = [", batch, "] tensor, got ",
              seq_lens.scalar_type(), " ", seq_lens.sizes());
  MINFER_CHECK(cu_seqlens_q.scalar_type() == at::kInt && cu_seqlens_q.dim() == 1 &&
                   cu_seqlens_q.size(0) == batch + 1 && cu_seqlens_q.is_contiguous(),
              "paged_attention: cu_seqlens_q must be a contiguous int32 [batch + 1] = [", batch + 1, "] tensor, got ",
              cu_seqlens_q.scalar_type(), " ", cu_seqlens_q.sizes());
  MINFER_CHECK(max_seqlen_q >= 0 && max_seqlen_q <= tokens, "paged_attention: max_seqlen_q must be in [0, tokens = ",
              tokens, "], got ", max_seqlen_q);
  MINFER_CHECK(max_seqlen_k >= max_seqlen_q && max_seqlen_k <= kIntMax,
              "paged_attention: max_seqlen_k must be in [max_seqlen_q, 2^31), got ", max_seqlen_k);
  MINFER_CHECK(window >= 0 && window <= kIntMax, "paged_attention: window must be in [0, 2^31) (0: none), got ",
              window);
  MINFER_CHECK(tokens <= kIntMax && batch <= 65535 && heads <= 65535 && num_pages * page_size <= kIntMax,
              "paged_attention: sizes too large, got q ", q_in.sizes(), ", caches ", k_cache.sizes(),
              " and block_table ", block_table.sizes());
  const bool decode = max_seqlen_q == 1 && tokens == batch;  // one query per sequence
  const attn::decode::RopeIn rope = rope_in("paged_attention", q_in, decode, batch, kv_heads, k_new, v_new, cos_sin);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = rows_aligned16(q_in) ? q_in : q_in.clone(at::MemoryFormat::Contiguous);
  if (out_in != nullptr) {
    MINFER_CHECK(out_in->device() == q_in.device(), "paged_attention_into: out must be on q's device (", q_in.device(),
                "), got ", out_in->device());
    MINFER_CHECK(out_in->scalar_type() == q_in.scalar_type(), "paged_attention_into: out must have q's dtype (",
                q_in.scalar_type(), "), got ", out_in->scalar_type());
    MINFER_CHECK(out_in->sizes() == q_in.sizes() && out_in->is_contiguous(),
                "paged_attention_into: out must be a contiguous [tokens, heads, head_dim] = ", q_in.sizes(),
                " tensor, got ", out_in->sizes(), " with strides ", out_in->strides());
  }
  at::Tensor out = out_in != nullptr ? *out_in : q.new_empty({tokens, heads, head_dim});  // [tokens, heads, head_dim]
  if (out.numel() == 0 || batch == 0) return out;
  if (decode) {
    attn::flash_decode_paged(q, k_cache, v_cache, block_table, seq_lens, static_cast<int>(max_seqlen_k), scale,
                             stable_prefix, static_cast<int>(window), rope, out);
    return out;
  }
  attn::FlashParams p{};
  p.q = q.data_ptr(), p.k = k_cache.data_ptr(), p.v = v_cache.data_ptr(), p.o = out.data_ptr();
  p.q_ss = q.stride(0), p.q_hs = q.stride(1);
  p.k_ss = k_cache.stride(1), p.k_hs = k_cache.stride(2);
  p.v_ss = v_cache.stride(1), p.v_hs = v_cache.stride(2);
  p.o_ss = out.stride(0), p.o_hs = out.stride(1);
  p.seq_q = static_cast<int>(max_seqlen_q);
  p.seq_k = static_cast<int>(std::min<int64_t>(max_seqlen_k, block_table.size(1) * page_size));
  p.group = heads / kv_heads;
  p.cu_seqlens_q = cu_seqlens_q.data_ptr<int>(), p.seq_lens = seq_lens.data_ptr<int>();
  p.total_q = static_cast<int>(tokens);
  p.paged.block_table = block_table.data_ptr<int>(), p.paged.bt_stride = block_table.stride(0);
  p.paged.k_ps = k_cache.stride(0), p.paged.v_ps = v_cache.stride(0);
  p.paged.page_size = static_cast<int>(page_size), p.paged.num_pages = static_cast<int>(num_pages);
  p.window = static_cast<int>(window);
  p.scale_log2 = static_cast<float>(scale) * attn::kLog2e;
  attn::flash_prefill(p, q.scalar_type(), head_dim, /*causal=*/true, batch, heads, c10::cuda::getCurrentCUDAStream());
  return out;
}

}  // namespace

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_table, const at::Tensor& seq_lens,
                           const at::Tensor& cu_seqlens_q, int64_t max_seqlen_q, int64_t max_seqlen_k,
                           double scale, bool stable_prefix, int64_t window, const std::optional<at::Tensor>& k_new,
                           const std::optional<at::Tensor>& v_new, const std::optional<at::Tensor>& cos_sin) {
  return paged_attention_impl(nullptr, q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, max_seqlen_q,
                              max_seqlen_k, scale, stable_prefix, window, k_new, v_new, cos_sin);
}

void paged_attention_into(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const at::Tensor& block_table, const at::Tensor& seq_lens,
                          const at::Tensor& cu_seqlens_q, int64_t max_seqlen_q, int64_t max_seqlen_k, double scale,
                          bool stable_prefix, int64_t window, const std::optional<at::Tensor>& k_new,
                          const std::optional<at::Tensor>& v_new, const std::optional<at::Tensor>& cos_sin) {
  paged_attention_impl(&out, q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, max_seqlen_q, max_seqlen_k,
                       scale, stable_prefix, window, k_new, v_new, cos_sin);
}

std::string attention_decode_plan(const at::Tensor& q, const at::Tensor& k_cache, int64_t length,
                                  int64_t window) {
  check_q_and_cache(q, k_cache);
  MINFER_CHECK(q.size(1) == 1, "attention_decode_plan: q must be [batch, 1, heads, head_dim], got ", q.sizes());
  MINFER_CHECK(length >= 0 && length <= kIntMax, "attention_decode_plan: length must be in [0, 2^31), got ", length);
  MINFER_CHECK(window >= 0 && window <= kIntMax, "attention_decode_plan: window must be in [0, 2^31), got ", window);
  MINFER_CHECK(k_cache.size(1) <= kIntMax, "attention_decode_plan: capacity must be below 2^31, got ", k_cache.size(1));
  const c10::cuda::CUDAGuard guard(q.device());
  return attn::flash_decode_plan(q, k_cache, static_cast<int>(length), static_cast<int>(window));
}

}  // namespace minfer
