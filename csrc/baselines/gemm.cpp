// Launchers of the gemm baselines: gemm (every path of the family, any transpose; fp32 on the
// simt path), tensor_core_gemm (the WMMA kernel, fp16 -> fp32) and gemm_int8 (mma.sync m16n8k32 on the
// sm80 kernel). Validate at the boundary, then run through the family's dispatch (gemm/launcher.h).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cuda_fp16.h>

#include <type_traits>

#include "common/checks.h"
#include "common/dispatch.h"
#include "common/vec.h"
#include "gemm/gemm.h"
#include "gemm/launcher.h"
#include "ops.h"

namespace minfer {

// alpha * op(A) @ op(B) + beta * C. op(A) [M, K], op(B) [K, N]; C broadcastable to [M, N]; beta == 0 ignores C.
at::Tensor gemm(const at::Tensor& a, const at::Tensor& b, double alpha, double beta,
                const std::optional<at::Tensor>& c, bool trans_a, bool trans_b, const std::string& path_name) {
  using namespace gemm_impl;
  const Path path = parse_path(path_name, "gemm");
  check_cuda(a, a, "a", "gemm");
  check_cuda(b, a, "b", "gemm");
  MINFER_CHECK_FLOAT(a);
  MINFER_CHECK_SAME_DTYPE(a, b);
  check_dim2(a, "a", "gemm");
  check_dim2(b, "b", "gemm");
  // opA [M, K]; opBt = op(B)^T [N, K]: the kernels read B weight-like.
  at::Tensor opA = trans_a ? a.t() : a, opBt = trans_b ? b : b.t();
  const int64_t M = opA.size(0), K = opA.size(1), N = opBt.size(0);
  MINFER_CHECK(opBt.size(1) == K, "gemm: op(A) is [M, K] = " + shape(opA) + " but op(B) is [K, N] = [" +
                                     num(opBt.size(1)) + ", " + num(N) + "]: the K dimensions differ");
  check_int_range(M, "M", "gemm");
  check_int_range(N, "N", "gemm");
  check_int_range(K, "K", "gemm");
  const c10::cuda::CUDAGuard guard(a.device());
  at::Tensor cc;
  if (beta != 0.0 && c.has_value() && c->defined()) {
    check_cuda(*c, a, "c", "gemm");
    MINFER_CHECK_FLOAT((*c));
    MINFER_CHECK(c->dim() <= 2, "gemm: c must be broadcastable to [M, N] = [" + num(M) + ", " + num(N) + "], got " +
                                   shape(*c));
    cc = c->to(a.scalar_type()).expand({M, N}).contiguous();
  }
  auto out = a.new_empty({M, N});
  if (M == 0 || N == 0) return out;
  MINFER_DISPATCH_FLOAT(a.scalar_type(), "gemm", [&] {
    if constexpr (!std::is_same_v<scalar_t, float>) {
      // Tensor-core paths other than wmma read 16-byte K chunks: give them K-contiguous operands.
      if (path != Path::kWmma) {
        if (opA.stride(1) != 1 && K > 1) opA = opA.contiguous();
        if (opBt.stride(1) != 1 && K > 1) opBt = opBt.contiguous();
      }
    }
    // A size-1 dimension's stride is arbitrary in torch: replace it by the one a packed tensor has.
    auto row_stride = [](const at::Tensor& t) { return t.size(0) == 1 ? t.size(1) : t.stride(0); };
    auto col_stride = [](const at::Tensor& t) { return t.size(1) == 1 ? int64_t(1) : t.stride(1); };
    Params<scalar_t, scalar_t> p{ptr<scalar_t>(opA), row_stride(opA), col_stride(opA), ptr<scalar_t>(opBt),
                                 row_stride(opBt), col_stride(opBt), reinterpret_cast<scalar_t*>(out.data_ptr()), N,
                                 nullptr, ptr<scalar_t>(cc), N, (float)alpha, (float)beta, (int)M, (int)N, (int)K};
    run(p, path, a.device(), "gemm");
  });
  return out;
}

// WMMA baseline: fp16 A [M, K] @ B [K, N] -> fp32 [M, N].
at::Tensor tensor_core_gemm(const at::Tensor& a, const at::Tensor& b) {
  using namespace gemm_impl;
  check_cuda(a, a, "a", "tensor_core_gemm");
  check_cuda(b, a, "b", "tensor_core_gemm");
  MINFER_CHECK(a.scalar_type() == at::kHalf && b.scalar_type() == at::kHalf,
              "tensor_core_gemm: a and b must be float16, got ", a.scalar_type(), " and ", b.scalar_type());
  check_dim2(a, "a", "tensor_core_gemm");
  check_dim2(b, "b", "tensor_core_gemm");
  MINFER_CHECK(a.size(1) == b.size(0), "tensor_core_gemm: a is [M, K] = " + shape(a) + " and b is [K, N] = " + shape(b) +
                                          ": the K dimensions differ");
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  check_int_range(M, "M", "tensor_core_gemm");
  check_int_range(N, "N", "tensor_core_gemm");
  check_int_range(K, "K", "tensor_core_gemm");
  const c10::cuda::CUDAGuard guard(a.device());
  auto out = a.new_empty({M, N}, at::kFloat);
  if (M == 0 || N == 0) return out;
  Params<__half, float> p{ptr<__half>(a), a.stride(0), a.stride(1), ptr<__half>(b), b.stride(1), b.stride(0),
                          out.data_ptr<float>(), N, nullptr, nullptr, 0, 1.f, 0.f, (int)M, (int)N, (int)K};
  launch_wmma<__half, float>(p, c10::cuda::getCurrentCUDAStream());
  return out;
}

// int8 A [M, K] @ int8 B [K, N] -> int32 [M, N], exact (mma.sync m16n8k32, int32 accumulation).
at::Tensor gemm_int8(const at::Tensor& a, const at::Tensor& b) {
  using namespace gemm_impl;
  check_cuda(a, a, "a", "gemm_int8");
  check_cuda(b, a, "b", "gemm_int8");
  MINFER_CHECK(a.scalar_type() == at::kChar && b.scalar_type() == at::kChar, "gemm_int8: a and b must be int8, got ",
              a.scalar_type(), " and ", b.scalar_type());
  check_dim2(a, "a", "gemm_int8");
  check_dim2(b, "b", "gemm_int8");
  MINFER_CHECK(a.size(1) == b.size(0), "gemm_int8: a is [M, K] = " + shape(a) + " and b is [K, N] = " + shape(b) +
                                          ": the K dimensions differ");
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  check_int_range(M, "M", "gemm_int8");
  check_int_range(N, "N", "gemm_int8");
  MINFER_CHECK(K <= (int64_t(1) << 17), "gemm_int8: K = " + num(K) + " could overflow the int32 accumulator (K <= 131072)");
  const c10::cuda::CUDAGuard guard(a.device());
  int major = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, a.device().index()));
  MINFER_CHECK(major >= 8, "gemm_int8: needs compute capability >= 8.0 (mma.sync m16n8k32 s8)");
  auto out = a.new_empty({M, N}, at::kInt);
  if (M == 0 || N == 0) return out;
  // The kernel reads K in 16-byte chunks from K-contiguous rows: B is transposed to [N, Kp] and both
  // operands are zero-padded to Kp = K rounded up to 16 when needed (zeros add nothing).
  const int64_t Kp = (K + 15) / 16 * 16;
  at::Tensor ap = a;
  if (Kp != K || a.stride(1) != 1 || a.stride(0) % 16 != 0 || !is_aligned16(a.data_ptr())) {
    ap = a.new_zeros({M, Kp});
    ap.narrow(1, 0, K).copy_(a);
  }
  at::Tensor bt = b.new_zeros({N, Kp});
  bt.narrow(1, 0, K).copy_(b.t());
  Params<int8_t, int32_t> p{ptr<int8_t>(ap), ap.stride(0), 1, ptr<int8_t>(bt), Kp, 1, out.data_ptr<int32_t>(), N,
                            nullptr, nullptr, 0, 1.f, 0.f, (int)M, (int)N, (int)Kp};
  launch_sm80_int8(p, c10::cuda::getCurrentCUDAStream());
  return out;
}

}  // namespace minfer
