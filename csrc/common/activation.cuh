// The gated activations' functions of the gate, in fp32: SwiGLU's SiLU and GeGLU's GeLU (tanh approximation),
// and gated(), their one rule for act(gate) * up. activation.cu applies it in its own launch; qlinear_act and
// linear_act in the gate | up linear's epilogue.
#pragma once
#include <cuda_runtime.h>

#include "common/vec.h"

namespace minfer {

// expf and tanhf (not the fast intrinsics) to match torch closely.
struct Silu {
  __device__ __forceinline__ float operator()(float a) const { return a / (1.f + expf(-a)); }
};

struct GeluTanh {
  __device__ __forceinline__ float operator()(float a) const {
    constexpr float kSqrt2OverPi = 0.7978845608f, kCubic = 0.044715f;
    return 0.5f * a * (1.f + tanhf(kSqrt2OverPi * (a + kCubic * (a * a * a))));
  }
};

// act(gate) * up in fp32, rounded to T, from gate and up as T: a fused epilogue rounds its fp32 sums to T first,
// as the linear's store would, so that it gives the bits of the linear followed by the activation's launch.
template <typename T, typename Act>
__device__ __forceinline__ T gated(T gate, T up) {
  return from_float<T>(Act()(to_float(gate)) * to_float(up));
}

}  // namespace minfer
