// The gated activations' functions of the gate, in fp32: SwiGLU's SiLU and GeGLU's GeLU (tanh approximation).
// activation.cu applies them in their own launch; qlinear_act in the gate | up linear's epilogue.
#pragma once
#include <cuda_runtime.h>

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

}  // namespace minfer
