// Gated activations: out[t, i] = act(x[t, i]) * x[t, inter + i], computed in fp32.
//   silu_and_mul (SwiGLU):      act(a) = a / (1 + exp(-a))
//   gelu_tanh_and_mul (GeGLU):  act(a) = 0.5 a (1 + tanh(sqrt(2/pi) (a + 0.044715 a^3)))
// One kernel over an activation functor. Grid x walks packs of one row, grid y walks tokens (looping when
// there are more than 65535). Each thread moves one pack of the gate, one of the up half, and writes one pack.
// With records, the output is also written as the Q4_K linears' x records (qgemm/q4k_x.cuh): with 16-byte
// packs and inter a multiple of 256, each warp's 32 packs are one 256-element chunk of a row.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "common/activation.cuh"
#include "common/checks.h"
#include "common/dispatch.h"
#include "common/launch.h"
#include "common/ptx.cuh"
#include "common/vec.h"
#include "qgemm/q4k_x.cuh"

namespace minfer {

namespace {

template <typename Act, typename T, int W>
__global__ void act_and_mul_kernel(T* __restrict__ out,        // [tokens, inter], contiguous
                                   const T* __restrict__ x,    // [tokens, 2 * inter], row stride x_stride
                                   uint8_t* __restrict__ records,  // [tokens, inter / 256 * kRecord] or null
                                   bool i8,                        // records in the int8 form (q4k_x::int8_form)
                                   int64_t x_stride, int inter, int64_t tokens, bool early) {
  using P = Pack<T, W>;
  ptx::griddep_enter(early);  // launched early: x may be the previous kernel's
  const int p = blockIdx.x * blockDim.x + threadIdx.x;
  if (p >= inter / W) return;
  for (int64_t t = blockIdx.y; t < tokens; t += gridDim.y) {
    const T* gate = x + t * x_stride + p * W;
    P g, u, o;
    g.load(gate);
    u.load(gate + inter);
#pragma unroll
    for (int e = 0; e < W; ++e) o.v[e] = gated<T, Act>(g.v[e], u.v[e]);
    o.store(out + t * inter + p * W);
    if constexpr (sizeof(T) == 2 && W == 8) {
      if (records != nullptr)  // warp-uniform (inter / W packs a row, a multiple of 32)
        q4k_x::write_record<T>(*reinterpret_cast<const uint4*>(o.v), threadIdx.x % 32,
                               records + (t * (inter / 256) + p / 32) * q4k_x::kRecord, i8);
    }
  }
}

template <typename Act, typename T, int W>
void launch_act_and_mul(T* out, const T* x, uint8_t* records, int64_t x_stride, int inter, int64_t tokens,
                        cudaStream_t stream) {
  const int packs = inter / W;
  const int threads = std::min(256, round_up(packs, 32));
  const dim3 grid((packs + threads - 1) / threads, static_cast<unsigned>(std::min<int64_t>(tokens, 65535)));
  launch_pdl(act_and_mul_kernel<Act, T, W>, grid, dim3(threads), 0, stream, out, x, records, q4k_x::int8_form(tokens),
             x_stride, inter, tokens, pdl_early(tokens, records != nullptr));
}

// The launcher of both ops; `name` prefixes its error messages.
template <typename Act>
at::Tensor act_and_mul(const at::Tensor& x, const std::optional<at::Tensor>& records, const char* name) {
  MINFER_CHECK_CUDA(x);
  MINFER_CHECK_FLOAT(x);
  MINFER_CHECK(x.dim() == 2, name, ": x must be [tokens, 2 * inter], got shape ", x.sizes());
  MINFER_CHECK_LAST_DIM_CONTIGUOUS(x);
  MINFER_CHECK(x.size(1) % 2 == 0, name, ": x's last dim must be even (gate | up), got ", x.size(1));
  MINFER_CHECK(x.size(1) < (int64_t(1) << 31), name, ": rows too long (", x.size(1), ")");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t tokens = x.size(0), inter = x.size(1) / 2;
  auto out = x.new_empty({tokens, inter});
  if (tokens == 0 || inter == 0) return out;
  auto stream = c10::cuda::getCurrentCUDAStream();
  MINFER_DISPATCH_FLOAT(x.scalar_type(), name, [&] {
    constexpr int N = 16 / sizeof(scalar_t);
    auto* o = reinterpret_cast<scalar_t*>(out.data_ptr());
    const auto* in = reinterpret_cast<const scalar_t*>(x.data_ptr());
    // inter % N == 0 also puts the up half (offset inter) on a 16-byte boundary.
    const bool wide = rows_aligned16(in, inter, x.stride(0), sizeof(scalar_t)) && is_aligned16(o);
    uint8_t* r = nullptr;
    if (records) {
      q4k_x::check_records(name, *records, out);
      MINFER_CHECK(wide, name, ": records need x 16-byte aligned (rows in 16-byte packs)");
      r = records->data_ptr<uint8_t>();
    }
    if (wide)
      launch_act_and_mul<Act, scalar_t, N>(o, in, r, x.stride(0), static_cast<int>(inter), tokens, stream);
    else
      launch_act_and_mul<Act, scalar_t, 1>(o, in, nullptr, x.stride(0), static_cast<int>(inter), tokens, stream);
  });
  return out;
}

}  // namespace

at::Tensor silu_and_mul(const at::Tensor& x, const std::optional<at::Tensor>& records) {
  return act_and_mul<Silu>(x, records, "silu_and_mul");
}

at::Tensor gelu_tanh_and_mul(const at::Tensor& x, const std::optional<at::Tensor>& records) {
  return act_and_mul<GeluTanh>(x, records, "gelu_tanh_and_mul");
}

}  // namespace minfer
