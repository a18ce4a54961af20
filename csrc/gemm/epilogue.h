// The shared epilogue: alpha, bias and beta * C applied to one accumulator in fp32.
#pragma once
#include <type_traits>

#include "common/vec.h"
#include "gemm/gemm.h"

namespace minfer::gemm_impl {

template <typename T, typename Out, typename Acc>
__device__ __forceinline__ void store_out(const Params<T, Out>& p, int m, int n, Acc acc) {
  if constexpr (std::is_same_v<Out, int32_t>) {
    p.D[(int64_t)m * p.ldd + n] = acc;
  } else {
    float v = p.alpha * static_cast<float>(acc);
    if (p.bias) v += to_float(p.bias[n]);
    if (p.C) v += p.beta * to_float(p.C[(int64_t)m * p.ldc + n]);  // C is null when beta == 0
    p.D[(int64_t)m * p.ldd + n] = from_float<Out>(v);
  }
}

}  // namespace minfer::gemm_impl
