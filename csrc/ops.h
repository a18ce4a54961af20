// Host launchers of every op, implemented in the kernel files and registered in bindings.cpp.
#pragma once
#include "common/tensor.h"

namespace minfer {

// ---- engine ops ----
// embedding.cu
at::Tensor embedding(const at::Tensor& ids, const at::Tensor& weight);

// argmax.cu: greedy sampling, and the random draw's Gumbel-max
at::Tensor argmax(const at::Tensor& logits);
at::Tensor gumbel_argmax(const at::Tensor& logits, const at::Tensor& seeds, const at::Tensor& positions,
                         const std::optional<at::Tensor>& temperature);
// draw_filtered.cu: the random draw after each row's top-k, min-p and top-p (up to 8 CTAs a row, a cluster)
at::Tensor draw_filtered(const at::Tensor& logits, const at::Tensor& seeds, const at::Tensor& positions,
                         const at::Tensor& temperature, const at::Tensor& top_k, const at::Tensor& top_p,
                         const at::Tensor& min_p);
// token_bitmask.cu: structured outputs' mask, in place
void apply_token_bitmask(const at::Tensor& logits, const at::Tensor& bitmask);

// memory-bound kernels: rmsnorm.cu, rope.cu, activation.cu
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                    const std::optional<at::Tensor>& records);
void fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                        double eps, const std::optional<at::Tensor>& x_weight,
                        const std::optional<at::Tensor>& records);
void rope(const at::Tensor& q, const at::Tensor& k, const at::Tensor& positions,
          const at::Tensor& cos_sin, bool is_neox, const std::optional<at::Tensor>& q_weight,
          const std::optional<at::Tensor>& k_weight, double eps, const std::optional<at::Tensor>& v,
          const std::optional<at::Tensor>& k_cache, const std::optional<at::Tensor>& v_cache,
          const std::optional<at::Tensor>& slot_mapping);
at::Tensor silu_and_mul(const at::Tensor& x, const std::optional<at::Tensor>& records);
at::Tensor gelu_tanh_and_mul(const at::Tensor& x, const std::optional<at::Tensor>& records);
// gemm family (gemm/dispatch.cpp)
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                  const std::string& path, bool static_weight);
at::Tensor linear_act(const at::Tensor& x, const at::Tensor& weight, const std::string& act,
                      bool static_weight);
std::string linear_plan(const at::Tensor& x, const at::Tensor& weight, const std::string& path,
                        const std::string& act);
// attention family (attention/attention.cu)
// k_new, v_new, cos_sin (decode only): the newest key's rope and cache write in the call (attention.cu)
at::Tensor attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& start_pos, double scale, bool stable_prefix, int64_t window,
                     const std::optional<at::Tensor>& k_new, const std::optional<at::Tensor>& v_new,
                     const std::optional<at::Tensor>& cos_sin);
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_table, const at::Tensor& seq_lens,
                           const at::Tensor& cu_seqlens_q, int64_t max_seqlen_q, int64_t max_seqlen_k,
                           double scale, bool stable_prefix, int64_t window, const std::optional<at::Tensor>& k_new,
                           const std::optional<at::Tensor>& v_new, const std::optional<at::Tensor>& cos_sin);
void paged_attention_into(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const at::Tensor& block_table, const at::Tensor& seq_lens,
                          const at::Tensor& cu_seqlens_q, int64_t max_seqlen_q, int64_t max_seqlen_k, double scale,
                          bool stable_prefix, int64_t window, const std::optional<at::Tensor>& k_new,
                          const std::optional<at::Tensor>& v_new, const std::optional<at::Tensor>& cos_sin);
std::string attention_decode_plan(const at::Tensor& q, const at::Tensor& k_cache, int64_t length,
                                  int64_t window);
// quantized weights (csrc/qgemm/): W [n, k] as ggml blocks, uint8 [n, k / elems * bytes]; qtype = ggml's type id
at::Tensor dequantize(const at::Tensor& blocks, int64_t qtype, int64_t n, int64_t k, at::ScalarType dtype);
void dequantize_into(const at::Tensor& out, const at::Tensor& blocks, int64_t qtype, bool static_weight);
// norm_weight: x is read as rms_norm(x, norm_weight, eps); accumulate: out += x @ W^T (the residual add)
at::Tensor qlinear(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype, int64_t n, int64_t k,
                   const std::optional<at::Tensor>& bias, bool static_weight,
                   const std::optional<at::Tensor>& x_records, const std::optional<at::Tensor>& norm_weight,
                   double eps);
void qlinear_into(const at::Tensor& out, const at::Tensor& x, const at::Tensor& blocks, int64_t qtype,
                  const std::optional<at::Tensor>& bias, bool static_weight,
                  const std::optional<at::Tensor>& x_records, bool accumulate);
// whether qlinear on x [rows, k] reads x_records
bool qlinear_reads_records(const at::Tensor& x, int64_t qtype);
// the most rows of x qlinear takes on W [n, k] of qtype
int64_t qlinear_max_rows(int64_t qtype, int64_t n, int64_t k);
// whether qlinear on x [rows, k] with n outputs takes norm_weight and accumulate in its kernel's launch
bool qlinear_takes_norm(const at::Tensor& x, int64_t qtype, int64_t n);
// act(gate) * up of x @ W^T, W = gate | up [n, k] (n / 2 rows each) -> [M, n / 2]; act: silu | gelu_tanh
at::Tensor qlinear_act(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype, int64_t n, int64_t k,
                       const std::string& act, bool static_weight, const std::optional<at::Tensor>& x_records,
                       const std::optional<at::Tensor>& records, const std::optional<at::Tensor>& norm_weight,
                       double eps);
at::Tensor qembedding(const at::Tensor& ids, const at::Tensor& blocks, int64_t qtype, int64_t n, int64_t k,
                      at::ScalarType dtype);
// ---- baselines: baselines/gemm.cpp, baselines/attention.cpp ----
at::Tensor gemm(const at::Tensor& a, const at::Tensor& b, double alpha, double beta,
                const std::optional<at::Tensor>& c, bool trans_a, bool trans_b, const std::string& path);
at::Tensor tensor_core_gemm(const at::Tensor& a, const at::Tensor& b);
at::Tensor gemm_int8(const at::Tensor& a, const at::Tensor& b);
at::Tensor naive_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           std::optional<double> scale, bool is_causal);
at::Tensor tiled_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           std::optional<double> scale, bool is_causal);
at::Tensor flash_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           std::optional<double> scale, bool is_causal);

}  // namespace minfer
