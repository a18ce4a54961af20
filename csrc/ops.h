// Host launchers of every op, implemented in the kernel files and registered in bindings.cpp.
#pragma once
#include <torch/all.h>

namespace minfer {

// embedding.cu
torch::Tensor embedding(const torch::Tensor& ids, const torch::Tensor& weight);

// attention/ (attention.cu): engine op + seed API
torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                        const torch::Tensor& start_pos, double scale);
torch::Tensor naive_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                              std::optional<double> scale, bool is_causal);
torch::Tensor tiled_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                              std::optional<double> scale, bool is_causal);
torch::Tensor flash_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                              std::optional<double> scale, bool is_causal);

}  // namespace minfer
