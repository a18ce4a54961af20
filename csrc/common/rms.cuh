// RMSNorm's arithmetic, shared by its kernels (rmsnorm.cu) and the linears that norm their own x (qgemm): the same
// expressions round the same, so a norm in a linear's launch equals rms_norm's output bit for bit wherever its sums
// meet in rms_norm's order.
#pragma once
#include "common/vec.h"

namespace minfer {

// ss + the squares of v's elements, in order.
template <typename T, int W>
__device__ __forceinline__ float add_squares(const Pack<T, W>& v, float ss) {
#pragma unroll
  for (int e = 0; e < W; ++e) {
    const float f = to_float(v.v[e]);
    ss += f * f;
  }
  return ss;
}

// 1 / rms from a row's sum of squares.
__device__ __forceinline__ float rms_scale(float sum, int hidden, float eps) { return rsqrtf(sum / hidden + eps); }

// v's elements normed: v * scale * w, rounded to T.
template <typename T, int W>
__device__ __forceinline__ Pack<T, W> rms_apply(const Pack<T, W>& v, float scale, const Pack<T, W>& w) {
  Pack<T, W> o;
#pragma unroll
  for (int e = 0; e < W; ++e) o.v[e] = from_float<T>(to_float(v.v[e]) * scale * to_float(w.v[e]));
  return o;
}

}  // namespace minfer
