// Host launchers of every op, implemented in the kernel files and registered in bindings.cpp.
#pragma once
#include <torch/all.h>

namespace minfer {

// embedding.cu
torch::Tensor embedding(const torch::Tensor& ids, const torch::Tensor& weight);

// gemm family (csrc/gemm/dispatch.cpp)
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight, const std::optional<torch::Tensor>& bias,
                     const std::string& path);
torch::Tensor gemm(const torch::Tensor& a, const torch::Tensor& b, double alpha, double beta,
                   const std::optional<torch::Tensor>& c, bool trans_a, bool trans_b, const std::string& path);
torch::Tensor tensor_core_gemm(const torch::Tensor& a, const torch::Tensor& b);
torch::Tensor gemm_int8(const torch::Tensor& a, const torch::Tensor& b);

}  // namespace minfer
