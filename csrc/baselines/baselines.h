// The baseline kernels' API (naive / tiled / flash attention on [batch, heads, seq, head_dim], gemm,
// tensor_core_gemm, gemm_int8): kernels and launchers that the engine never calls, kept exposed and
// benchmarked as baselines. Launchers: attention.cpp and gemm.cpp here; declared in ops.h.
#pragma once
#include "common/tensor.h"

namespace minfer::baselines {

// naive_attention.cu: one thread per query row, scores in global memory. Contiguous q, k, v.
at::Tensor naive_attention_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                double scale, bool is_causal);
// tiled_attention.cu: the CUDA-core tiled kernel (also the fp32 path of flash_attention). Contiguous q, k, v.
at::Tensor tiled_attention_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                double scale, bool is_causal);

}  // namespace minfer::baselines
