// The shared epilogue: alpha, bias and beta * C applied to one accumulator in fp32.
#pragma once
#include <type_traits>

#include "common/activation.cuh"
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

// alpha * acc + bias[n] + beta * C[m, n] in fp32, before the one rounding to Out; bias and C are read
// only inside [M, N] (the value outside is never stored). kWithC = false (the caller knows C is null,
// as in every linear) compiles the C term out: kept in, its address arithmetic is issued for every
// value under a false predicate, and the sm90 epilogue costs as much as a K = 576 mainloop.
template <bool kWithC, typename T, typename Out>
__device__ __forceinline__ float epilogue_value(const Params<T, Out>& p, int m, int n, float acc) {
  float v = p.alpha * acc;
  if (p.bias && n < p.N) v += to_float(p.bias[n]);
  if constexpr (kWithC) {
    if (p.C && m < p.M && n < p.N) v += p.beta * to_float(p.C[(int64_t)m * p.ldc + n]);
  }
  return v;
}

// Two neighbouring columns (n even) of one row: one 4-byte store for 16-bit outputs when aligned,
// so a warp writes whole 16-byte runs instead of 2-byte scatters.
template <typename T, typename Out>
__device__ __forceinline__ void store_out2(const Params<T, Out>& p, int m, int n, float a0, float a1) {
  if constexpr (sizeof(Out) == 2) {
    const bool paired = n + 1 < p.N && (p.ldd & 1) == 0 && (reinterpret_cast<uintptr_t>(p.D) & 3) == 0;
    if (paired) {
      float v0 = p.alpha * a0, v1 = p.alpha * a1;
      if (p.bias) v0 += to_float(p.bias[n]), v1 += to_float(p.bias[n + 1]);
      if (p.C) {
        const Out* c = p.C + (int64_t)m * p.ldc + n;
        v0 += p.beta * to_float(c[0]);
        v1 += p.beta * to_float(c[1]);
      }
      Out pair[2] = {from_float<Out>(v0), from_float<Out>(v1)};
      *reinterpret_cast<uint32_t*>(p.D + (int64_t)m * p.ldd + n) = *reinterpret_cast<const uint32_t*>(pair);
      return;
    }
  }
  if (n < p.N) store_out(p, m, n, a0);
  if (n + 1 < p.N) store_out(p, m, n + 1, a1);
}

// D[m, n] = act(gate) * up (p.act), each half rounded to T first, as the linear's store and the activation's own
// launch would (the gemv and sm90 small-M kernels' linear_act epilogue).
template <typename T>
__device__ __forceinline__ void store_gated(const Params<T, T>& p, int m, int n, float gate, float up) {
  const T a = from_float<T>(gate), u = from_float<T>(up);
  p.D[(int64_t)m * p.ldd + n] = p.act == kActSilu ? gated<T, Silu>(a, u) : gated<T, GeluTanh>(a, u);
}

}  // namespace minfer::gemm_impl
