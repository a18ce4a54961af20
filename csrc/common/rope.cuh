// The rotary embedding's rotation of one pair, shared by the rope kernel (rope.cu) and the decode kernel's
// folded rotation (attention/decode_stream.cuh), so that both write the same bits to the KV cache.
#pragma once
#include <cuda_runtime.h>

namespace minfer {

// (x1, x2) <- (x1 cos - x2 sin, x2 cos + x1 sin) in fp32, each product and sum rounded on its own (no FMA
// contraction): torch's reference computes it so, and a kernel that fused one product into the sum would write
// cache bits one rounding away from the other kernel's.
__device__ __forceinline__ void rotate_pair(float& x1, float& x2, float c, float s) {
  const float a = __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s));
  const float b = __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s));
  x1 = a, x2 = b;
}

}  // namespace minfer
