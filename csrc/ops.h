// Host launchers of every op, implemented in the kernel files and registered in bindings.cpp.
#pragma once
#include <torch/all.h>

namespace minfer {

// ---- engine ops ----
// embedding.cu
torch::Tensor embedding(const torch::Tensor& ids, const torch::Tensor& weight);

// memory-bound kernels: rmsnorm.cu, rope.cu, activation.cu
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps,
                       const std::optional<torch::Tensor>& records);
void fused_add_rms_norm(const torch::Tensor& x, const torch::Tensor& residual, const torch::Tensor& weight,
                        double eps, const std::optional<torch::Tensor>& x_weight,
                        const std::optional<torch::Tensor>& records);
void rope(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& positions,
          const torch::Tensor& cos_sin, bool is_neox, const std::optional<torch::Tensor>& q_weight,
          const std::optional<torch::Tensor>& k_weight, double eps, const std::optional<torch::Tensor>& v,
          const std::optional<torch::Tensor>& k_cache, const std::optional<torch::Tensor>& v_cache,
          const std::optional<torch::Tensor>& slot_mapping);
torch::Tensor silu_and_mul(const torch::Tensor& x, const std::optional<torch::Tensor>& records);
torch::Tensor gelu_tanh_and_mul(const torch::Tensor& x, const std::optional<torch::Tensor>& records);
// gemm family (gemm/dispatch.cpp)
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight, const std::optional<torch::Tensor>& bias,
                     const std::string& path, bool static_weight);
torch::Tensor linear_act(const torch::Tensor& x, const torch::Tensor& weight, const std::string& act,
                         bool static_weight);
std::string linear_plan(const torch::Tensor& x, const torch::Tensor& weight, const std::string& path,
                        const std::string& act);
// attention family (attention/attention.cu)
torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                        const torch::Tensor& start_pos, double scale, bool stable_prefix, int64_t window);
torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                              const torch::Tensor& block_table, const torch::Tensor& seq_lens,
                              const torch::Tensor& cu_seqlens_q, int64_t max_seqlen_q, int64_t max_seqlen_k,
                              double scale, bool stable_prefix, int64_t window);
std::string attention_decode_plan(const torch::Tensor& q, const torch::Tensor& k_cache, int64_t length,
                                  int64_t window);
// quantized weights (csrc/qgemm/): W [n, k] as ggml blocks, uint8 [n, k / elems * bytes]; qtype = ggml's type id
torch::Tensor dequantize(const torch::Tensor& blocks, int64_t qtype, int64_t n, int64_t k, at::ScalarType dtype);
void dequantize_into(const torch::Tensor& out, const torch::Tensor& blocks, int64_t qtype, bool static_weight);
torch::Tensor qlinear(const torch::Tensor& x, const torch::Tensor& blocks, int64_t qtype, int64_t n, int64_t k,
                      const std::optional<torch::Tensor>& bias, bool static_weight,
                      const std::optional<torch::Tensor>& x_records);
void qlinear_into(const torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& blocks, int64_t qtype,
                  const std::optional<torch::Tensor>& bias, bool static_weight,
                  const std::optional<torch::Tensor>& x_records);
// whether qlinear on x [rows, k] reads x_records
bool qlinear_reads_records(const torch::Tensor& x, int64_t qtype);
// act(gate) * up of x @ W^T, W = gate | up [n, k] (n / 2 rows each) -> [M, n / 2]; act: silu | gelu_tanh
torch::Tensor qlinear_act(const torch::Tensor& x, const torch::Tensor& blocks, int64_t qtype, int64_t n, int64_t k,
                          const std::string& act, bool static_weight, const std::optional<torch::Tensor>& x_records,
                          const std::optional<torch::Tensor>& records);
torch::Tensor qembedding(const torch::Tensor& ids, const torch::Tensor& blocks, int64_t qtype, int64_t n, int64_t k,
                         at::ScalarType dtype);
// ---- baselines (teaching API): baselines/gemm.cpp, baselines/attention.cpp ----
torch::Tensor gemm(const torch::Tensor& a, const torch::Tensor& b, double alpha, double beta,
                   const std::optional<torch::Tensor>& c, bool trans_a, bool trans_b, const std::string& path);
torch::Tensor tensor_core_gemm(const torch::Tensor& a, const torch::Tensor& b);
torch::Tensor gemm_int8(const torch::Tensor& a, const torch::Tensor& b);
torch::Tensor naive_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                              std::optional<double> scale, bool is_causal);
torch::Tensor tiled_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                              std::optional<double> scale, bool is_causal);
torch::Tensor flash_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                              std::optional<double> scale, bool is_causal);

}  // namespace minfer
