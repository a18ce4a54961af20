// Host launchers of every op, implemented in the kernel files and registered in bindings.cpp.
#pragma once
#include <torch/all.h>

namespace minfer {

// embedding.cu
torch::Tensor embedding(const torch::Tensor& ids, const torch::Tensor& weight);

}  // namespace minfer
