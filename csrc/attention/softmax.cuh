// The online-softmax (log-sum-exp) state that every attention merge shares. Scores are in log2 units
// (prescaled by scale * log2 e, so that exp2 does the softmax): m is the largest score seen, l the sum of
// exp2(score - m). Partial results (a tile's, a warp's, a split's) merge by their maxes' max, each one's
// sum and output weighted by exp2(m_i - m).
#pragma once
#include <cuda_runtime.h>

#include <cmath>

namespace minfer::attn {

struct SoftmaxState {
  float m, l;

  // Moves the reference max to m_new (>= m) and returns exp2(m - m_new), the factor that rescales what
  // was accumulated against the old max (0 while m is -inf); l is rescaled here.
  __device__ __forceinline__ float rescale(float m_new) {
    const float a = exp2f(m - m_new);
    m = m_new;
    l *= a;
    return a;
  }
  // The weight exp2(mi - m) of a partial with max mi (<= m): the factor of its sum and its output.
  __device__ __forceinline__ float weight(float mi) const { return exp2f(mi - m); }
  // Adds a partial's sum li at its weight w.
  __device__ __forceinline__ void add(float li, float w) { l += li * w; }
};

__device__ __forceinline__ void fma4(float4& o, float4 x, float w) {
  o.x = fmaf(x.x, w, o.x), o.y = fmaf(x.y, w, o.y), o.z = fmaf(x.z, w, o.z), o.w = fmaf(x.w, w, o.w);
}
__device__ __forceinline__ float4 scale4(float4 x, float w) { return make_float4(x.x * w, x.y * w, x.z * w, x.w * w); }

// Folds N partials (max in ml[i].x, sum in ml[i].y, unnormalised output in os[i], 4 dims) into a running
// (s, o), which starts at ({-inf, 0}, 0). Their max first, so that the N weights are independent of each
// other (one partial at a time chains N max / exp2 / rescale steps). At least one partial, or the running
// state, must have a finite max; partials with max -inf weigh 0.
template <int N>
__device__ __forceinline__ void fold(SoftmaxState& s, float4& o, const float4 (&ml)[N], const float4 (&os)[N]) {
  float m = s.m;
#pragma unroll
  for (int i = 0; i < N; ++i) m = fmaxf(m, ml[i].x);
  o = scale4(o, s.rescale(m));
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const float w = s.weight(ml[i].x);
    s.l = fmaf(ml[i].y, w, s.l);  // add(), fused explicitly
    fma4(o, os[i], w);
  }
}

}  // namespace minfer::attn
