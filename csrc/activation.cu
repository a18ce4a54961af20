// SwiGLU gate: out[t, i] = silu(x[t, i]) * x[t, inter + i], computed in fp32.
// Grid x walks packs of one row, grid y walks tokens (looping when there are more than 65535).
// Each thread moves one pack of the gate, one of the up half, and writes one pack.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "common/checks.h"
#include "common/dispatch.h"
#include "common/vec.h"

namespace minfer {

namespace {

template <typename T, int W>
__global__ void silu_and_mul_kernel(T* __restrict__ out,        // [tokens, inter], contiguous
                                    const T* __restrict__ x,    // [tokens, 2 * inter], row stride x_stride
                                    int64_t x_stride, int inter, int64_t tokens) {
  using P = Pack<T, W>;
  const int p = blockIdx.x * blockDim.x + threadIdx.x;
  if (p >= inter / W) return;
  for (int64_t t = blockIdx.y; t < tokens; t += gridDim.y) {
    const T* gate = x + t * x_stride + p * W;
    P g, u, o;
    g.load(gate);
    u.load(gate + inter);
#pragma unroll
    for (int e = 0; e < W; ++e) {
      const float a = to_float(g.v[e]);
      o.v[e] = from_float<T>(a / (1.f + expf(-a)) * to_float(u.v[e]));
    }
    o.store(out + t * inter + p * W);
  }
}

template <typename T, int W>
void launch_silu_and_mul(T* out, const T* x, int64_t x_stride, int inter, int64_t tokens, cudaStream_t stream) {
  const int packs = inter / W;
  const int threads = std::min(256, round_up(packs, 32));
  const dim3 grid((packs + threads - 1) / threads, static_cast<unsigned>(std::min<int64_t>(tokens, 65535)));
  silu_and_mul_kernel<T, W><<<grid, threads, 0, stream>>>(out, x, x_stride, inter, tokens);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

torch::Tensor silu_and_mul(const torch::Tensor& x) {
  MINFER_CHECK_CUDA(x);
  MINFER_CHECK_FLOAT(x);
  MINFER_CHECK(x.dim() == 2, "silu_and_mul: x must be [tokens, 2 * inter], got shape ", x.sizes());
  MINFER_CHECK_LAST_DIM_CONTIGUOUS(x);
  MINFER_CHECK(x.size(1) % 2 == 0, "silu_and_mul: x's last dim must be even (gate | up), got ", x.size(1));
  MINFER_CHECK(x.size(1) < (int64_t(1) << 31), "silu_and_mul: rows too long (", x.size(1), ")");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t tokens = x.size(0), inter = x.size(1) / 2;
  auto out = torch::empty({tokens, inter}, x.options());
  if (tokens == 0 || inter == 0) return out;
  auto stream = c10::cuda::getCurrentCUDAStream();
  MINFER_DISPATCH_FLOAT(x.scalar_type(), "silu_and_mul", [&] {
    constexpr int N = 16 / sizeof(scalar_t);
    auto* o = reinterpret_cast<scalar_t*>(out.data_ptr());
    const auto* in = reinterpret_cast<const scalar_t*>(x.data_ptr());
    // inter % N == 0 also puts the up half (offset inter) on a 16-byte boundary.
    const bool wide = rows_aligned16(in, inter, x.stride(0), sizeof(scalar_t)) && is_aligned16(o);
    if (wide)
      launch_silu_and_mul<scalar_t, N>(o, in, x.stride(0), static_cast<int>(inter), tokens, stream);
    else
      launch_silu_and_mul<scalar_t, 1>(o, in, x.stride(0), static_cast<int>(inter), tokens, stream);
  });
  return out;
}

}  // namespace minfer
