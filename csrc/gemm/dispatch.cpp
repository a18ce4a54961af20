// The GEMM family's launchers: validate at the boundary, pick a path, fill Params. Host-only, so
// compiled by the C++ compiler (a failing TORCH_CHECK with numbers in its message crashed when nvcc
// compiled it).
//
// Paths (str path): "auto"; "wmma" (baseline, any layout); "sm80" (mma.sync + cp.async pipeline);
// "sm90" (wgmma + TMA, Hopper only); "gemv" (weight streaming, small M); "simt" (fp32).
// auto: fp32 -> simt; fp16/bf16 -> gemv for M <= 16, and up to M = 64 on small W (blocks of 16 rows x N x
// K <= 2^24); on Hopper sm90 above M = 128 and its small-M kernel for M 32..128 on large W; else sm80;
// wmma when the cp.async rules (K % 8 == 0, row strides % 8 == 0, 16-byte aligned bases) fail.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>
#include <type_traits>

#include "common/checks.h"
#include "common/dispatch.h"
#include "common/split_counters.h"
#include "common/launch.h"
#include "common/vec.h"
#include "gemm/gemm.h"

namespace minfer {
namespace gemm_impl {

namespace {

// Messages are built from strings only: numbers go through std::to_string (streaming integers into
// TORCH_CHECK's message crashed the process on the GPU machine when the check failed).
std::string num(int64_t v) { return std::to_string(v); }
std::string shape(const torch::Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + num(t.size(i));
  return s + "]";
}
void check_dim2(const torch::Tensor& t, const char* name, const char* op) {
  MINFER_CHECK(t.dim() == 2, op, ": ", name, " must have 2 dimensions, got shape ", shape(t));
}
void check_cuda(const torch::Tensor& t, const torch::Tensor& ref, const char* name, const char* op) {
  MINFER_CHECK(t.is_cuda(), op, ": ", name, " must be a CUDA tensor, got a ", t.device().type() == at::kCPU ? "CPU" : "non-CUDA", " tensor");
  MINFER_CHECK(t.get_device() == ref.get_device(), op, ": ", name, " must be on the same device as the first input");
}

enum class Path { kAuto, kWmma, kSm80, kSm90, kGemv, kSimt };

Path parse_path(const std::string& name, const char* op) {
  if (name == "auto") return Path::kAuto;
  if (name == "wmma") return Path::kWmma;
  if (name == "sm80") return Path::kSm80;
  if (name == "sm90") return Path::kSm90;
  if (name == "gemv") return Path::kGemv;
  if (name == "simt") return Path::kSimt;
  MINFER_CHECK(false, op, ": unknown path '", name, "' (auto, wmma, sm80, sm90, gemv, simt)");
}

// The cp.async / TMA / 16-byte-load paths read A and B in 16-byte chunks along K.
template <typename T, typename Out>
bool chunk_aligned(const Params<T, Out>& p) {
  constexpr int e = 16 / sizeof(T);
  return p.sak == 1 && p.sbk == 1 && p.K % e == 0 && p.sam % e == 0 && p.sbn % e == 0 && is_aligned16(p.A) &&
         is_aligned16(p.B);
}

// plan != nullptr: launch nothing, say in *plan which path (and for gemv, which kernel) would run.
template <typename T>
void run_lowp(const Params<T, T>& p, Path path, const torch::Device& device, const char* op, std::string* plan) {
  auto stream = c10::cuda::getCurrentCUDAStream();
  int major = 0, minor = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device.index()));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device.index()));
  const bool aligned = chunk_aligned(p);
  const char* rule = "K % 8 == 0, row strides % 8 == 0 (elements), K-contiguous rows and 16-byte aligned base pointers";
  if (path == Path::kAuto) {
    // gemv streams W once for up to 16 activation rows (two n8 mma tiles) at the cost of M = 1; from
    // M = 17 it streams W once per 16 rows, where sm90's small-M kernel (Hopper) and split-K sm80 read
    // it once. The repeats come from L2 and cost little while W is small: up to M = 64, gemv wins while
    // blocks of 16 rows x N x K stays within 2^24 (H200, fp16: 64 x 576 x 576 3.1 against
    // sm80's 7.9 us, 64 x 3072 x 576 5.7 against 9.6, 64 x 2048 x 2048 9.6 against sm90's 13.5; at twice
    // that, 32 x 4096 x 4096, level with sm90 at 17.6; 64 x 4096 x 4096 28.7 against 19.7). Measured
    // (H200): small-M beats sm80 from M = 32 on W of 4M elements and more (64 x 4096 x 4096:
    // 20.9 against 25.4 us; 64 x 28672 x 4096: 72 against 106) and loses at M = 17 (18.9 against 17.9).
    const int64_t row_blocks = (p.M + 15) / 16;
    const bool gemv_wins = p.M <= 16 || (p.M <= 64 && row_blocks * p.N * p.K <= (int64_t(1) << 24));
    const bool sm90_small_m_wins = p.M >= 32 && int64_t(p.N) * p.K >= (int64_t(1) << 22);
    if (aligned && major >= 8 && gemv_wins) path = Path::kGemv;
    else if (aligned && major == 9 && (p.M > kSm90SmallM || sm90_small_m_wins)) path = Path::kSm90;
    else if (aligned && major >= 8) path = Path::kSm80;
    else path = Path::kWmma;
  }
  switch (path) {
    case Path::kWmma:
      if (plan) *plan = "wmma";
      else launch_wmma<T, T>(p, stream);
      return;
    case Path::kGemv:
      MINFER_CHECK(major >= 8, op, ": path gemv needs compute capability >= 8.0, got " + num(major) + "." + num(minor));
      MINFER_CHECK(aligned, op, ": path gemv needs ", rule, " (got K=" + num(p.K) + ")");
      launch_gemv<T>(p, stream, sm_count(device.index()), plan);
      if (plan) *plan = "gemv: " + *plan;
      return;
    case Path::kSm80:
      MINFER_CHECK(major >= 8, op, ": path sm80 needs compute capability >= 8.0, got " + num(major) + "." + num(minor));
      MINFER_CHECK(aligned, op, ": path sm80 needs ", rule, " (got K=" + num(p.K) + ")");
      {
        const int splits = sm80_split_k(p.M, p.N, p.K, sm_count(device.index()));
        if (plan) {
          *plan = "sm80 split_k=" + num(splits);
          return;
        }
        torch::Tensor ws;
        if (splits > 1)
          ws = torch::empty({(int64_t)splits * p.M * p.N}, torch::TensorOptions().dtype(at::kFloat).device(device));
        launch_sm80<T>(p, stream, splits > 1 ? ws.data_ptr<float>() : nullptr, splits);
      }
      return;
    case Path::kSm90:
      MINFER_CHECK(major == 9, op, ": path sm90 needs compute capability 9.x (Hopper), got " + num(major) + "." + num(minor));
      MINFER_CHECK(aligned, op, ": path sm90 needs ", rule, " (got K=" + num(p.K) + ")");
      {
        const int sms = sm_count(device.index());
        if (plan) {
          *plan = p.M <= kSm90SmallM ? "sm90 small-M" : "sm90";
          return;
        }
        torch::Tensor ws, own_counters;
        float* ws_ptr = nullptr;
        int* counters = nullptr;
        if (p.M <= kSm90SmallM) {
          const Sm90SmallM plan = sm90_small_m_plan(p.M, p.N, p.K, sms);
          ws = torch::empty({plan.ws_floats}, torch::TensorOptions().dtype(at::kFloat).device(device));
          ws_ptr = ws.data_ptr<float>();
          counters = split_counters(plan.tiles, device.index(), stream, ws.options(), own_counters);
        }
        launch_sm90<T>(p, stream, sms, ws_ptr, counters);
      }
      return;
    default:
      MINFER_CHECK(false, op, ": path simt is for float32 only; float16/bfloat16 take auto, wmma, sm80, sm90 or gemv");
  }
}

void run_fp32(const Params<float, float>& p, Path path, const char* op, std::string* plan) {
  MINFER_CHECK(path == Path::kAuto || path == Path::kSimt, op,
              ": float32 runs on the simt path only (path auto or simt); wmma/sm80/sm90/gemv need float16 or bfloat16");
  if (plan) *plan = "simt";
  else launch_simt(p, c10::cuda::getCurrentCUDAStream());
}

template <typename T>
void run(const Params<T, T>& p, Path path, const torch::Device& device, const char* op, std::string* plan = nullptr) {
  run_lowp<T>(p, path, device, op, plan);
}
void run(const Params<float, float>& p, Path path, const torch::Device&, const char* op, std::string* plan = nullptr) {
  run_fp32(p, path, op, plan);
}

template <typename T>
const T* ptr(const torch::Tensor& t) {
  return t.defined() ? reinterpret_cast<const T*>(t.data_ptr()) : nullptr;
}

void check_int_range(int64_t v, const char* what, const char* op) {
  MINFER_CHECK(v < (int64_t(1) << 31), op, ": ", what, " = " + num(v) + " is too large (must fit in int32)");
}

}  // namespace
}  // namespace gemm_impl

namespace gemm_impl {
namespace {

// linear, or with plan != nullptr only the choice of kernel it would make (see linear_plan).
torch::Tensor linear_or_plan(const torch::Tensor& x, const torch::Tensor& weight,
                             const std::optional<torch::Tensor>& bias, const std::string& path_name,
                             bool static_weight, std::string* plan) {
  const Path path = parse_path(path_name, "linear");
  check_cuda(x, x, "x", "linear");
  check_cuda(weight, x, "weight", "linear");
  MINFER_CHECK_FLOAT(x);
  MINFER_CHECK_SAME_DTYPE(x, weight);
  check_dim2(x, "x", "linear");
  check_dim2(weight, "weight", "linear");
  MINFER_CHECK(x.size(1) == weight.size(1), "linear: x is [tokens, in] = " + shape(x) + " and weight is [out, in] = " +
              shape(weight) + ": the in dimensions differ");
  const int64_t M = x.size(0), N = weight.size(0), K = x.size(1);
  MINFER_CHECK(x.stride(1) == 1 || K <= 1, "linear: x must have a contiguous last dimension (stride 1)");
  MINFER_CHECK(weight.stride(1) == 1 || K <= 1, "linear: weight must have a contiguous last dimension (stride 1)");
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = *bias;
    check_cuda(b, x, "bias", "linear");
    MINFER_CHECK_SAME_DTYPE(x, b);
    MINFER_CHECK(b.dim() == 1 && b.size(0) == N, "linear: bias must be [out] = [" + num(N) + "], got " + shape(b));
    b = b.contiguous();
  }
  check_int_range(M, "tokens", "linear");
  check_int_range(N, "out", "linear");
  check_int_range(K, "in", "linear");
  const c10::cuda::CUDAGuard guard(x.device());
  auto out = plan ? torch::Tensor() : torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) {
    if (plan) *plan = "none (empty output)";
    return out;
  }
  MINFER_DISPATCH_FLOAT(x.scalar_type(), "linear", [&] {
    scalar_t* d = plan ? nullptr : reinterpret_cast<scalar_t*>(out.data_ptr());
    Params<scalar_t, scalar_t> p{ptr<scalar_t>(x), M == 1 ? K : x.stride(0), 1, ptr<scalar_t>(weight),
                                 N == 1 ? K : weight.stride(0), 1, d, N, ptr<scalar_t>(b), nullptr, 0, 1.f, 0.f,
                                 (int)M, (int)N, (int)K};
    p.static_b = static_weight;
    run(p, path, x.device(), "linear", plan);
  });
  return out;
}

}  // namespace
}  // namespace gemm_impl

// y = x W^T + bias. x [tokens, in] (last dim contiguous), weight [out, in], bias [out] -> [tokens, out].
// static_weight: no kernel that may still be running when this one starts writes weight (a model's
// weights); the gemv kernels then start reading it before they wait for the previous kernel.
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight, const std::optional<torch::Tensor>& bias,
                     const std::string& path, bool static_weight) {
  return gemm_impl::linear_or_plan(x, weight, bias, path, static_weight, nullptr);
}

// Which path and kernel configuration linear(x, weight, path=path) would launch, as text, e.g.
// "gemv: m1 U=4 4/SM ks=2 grid=512"; nothing runs. For tests that check a shape reaches the kernel it
// is meant to exercise.
std::string linear_plan(const torch::Tensor& x, const torch::Tensor& weight, const std::string& path) {
  std::string plan;
  gemm_impl::linear_or_plan(x, weight, std::nullopt, path, false, &plan);
  return plan;
}

// alpha * op(A) @ op(B) + beta * C. op(A) [M, K], op(B) [K, N]; C broadcastable to [M, N]; beta == 0 ignores C.
torch::Tensor gemm(const torch::Tensor& a, const torch::Tensor& b, double alpha, double beta,
                   const std::optional<torch::Tensor>& c, bool trans_a, bool trans_b, const std::string& path_name) {
  using namespace gemm_impl;
  const Path path = parse_path(path_name, "gemm");
  check_cuda(a, a, "a", "gemm");
  check_cuda(b, a, "b", "gemm");
  MINFER_CHECK_FLOAT(a);
  MINFER_CHECK_SAME_DTYPE(a, b);
  check_dim2(a, "a", "gemm");
  check_dim2(b, "b", "gemm");
  // opA [M, K]; opBt = op(B)^T [N, K]: the kernels read B weight-like.
  torch::Tensor opA = trans_a ? a.t() : a, opBt = trans_b ? b : b.t();
  const int64_t M = opA.size(0), K = opA.size(1), N = opBt.size(0);
  MINFER_CHECK(opBt.size(1) == K, "gemm: op(A) is [M, K] = " + shape(opA) + " but op(B) is [K, N] = [" +
                                     num(opBt.size(1)) + ", " + num(N) + "]: the K dimensions differ");
  check_int_range(M, "M", "gemm");
  check_int_range(N, "N", "gemm");
  check_int_range(K, "K", "gemm");
  const c10::cuda::CUDAGuard guard(a.device());
  torch::Tensor cc;
  if (beta != 0.0 && c.has_value() && c->defined()) {
    check_cuda(*c, a, "c", "gemm");
    MINFER_CHECK_FLOAT((*c));
    MINFER_CHECK(c->dim() <= 2, "gemm: c must be broadcastable to [M, N] = [" + num(M) + ", " + num(N) + "], got " +
                                   shape(*c));
    cc = c->to(a.scalar_type()).expand({M, N}).contiguous();
  }
  auto out = torch::empty({M, N}, a.options());
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
    auto row_stride = [](const torch::Tensor& t) { return t.size(0) == 1 ? t.size(1) : t.stride(0); };
    auto col_stride = [](const torch::Tensor& t) { return t.size(1) == 1 ? int64_t(1) : t.stride(1); };
    Params<scalar_t, scalar_t> p{ptr<scalar_t>(opA), row_stride(opA), col_stride(opA), ptr<scalar_t>(opBt),
                                 row_stride(opBt), col_stride(opBt), reinterpret_cast<scalar_t*>(out.data_ptr()), N,
                                 nullptr, ptr<scalar_t>(cc), N, (float)alpha, (float)beta, (int)M, (int)N, (int)K};
    run(p, path, a.device(), "gemm");
  });
  return out;
}

// WMMA baseline: fp16 A [M, K] @ B [K, N] -> fp32 [M, N].
torch::Tensor tensor_core_gemm(const torch::Tensor& a, const torch::Tensor& b) {
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
  auto out = torch::empty({M, N}, a.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return out;
  Params<__half, float> p{ptr<__half>(a), a.stride(0), a.stride(1), ptr<__half>(b), b.stride(1), b.stride(0),
                          out.data_ptr<float>(), N, nullptr, nullptr, 0, 1.f, 0.f, (int)M, (int)N, (int)K};
  launch_wmma<__half, float>(p, c10::cuda::getCurrentCUDAStream());
  return out;
}

// int8 A [M, K] @ int8 B [K, N] -> int32 [M, N], exact (mma.sync m16n8k32, int32 accumulation).
torch::Tensor gemm_int8(const torch::Tensor& a, const torch::Tensor& b) {
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
  auto out = torch::empty({M, N}, a.options().dtype(at::kInt));
  if (M == 0 || N == 0) return out;
  // The kernel reads K in 16-byte chunks from K-contiguous rows: B is transposed to [N, Kp] and both
  // operands are zero-padded to Kp = K rounded up to 16 when needed (zeros add nothing).
  const int64_t Kp = (K + 15) / 16 * 16;
  torch::Tensor ap = a;
  if (Kp != K || a.stride(1) != 1 || a.stride(0) % 16 != 0 || !is_aligned16(a.data_ptr())) {
    ap = torch::zeros({M, Kp}, a.options());
    ap.narrow(1, 0, K).copy_(a);
  }
  torch::Tensor bt = torch::zeros({N, Kp}, b.options());
  bt.narrow(1, 0, K).copy_(b.t());
  Params<int8_t, int32_t> p{ptr<int8_t>(ap), ap.stride(0), 1, ptr<int8_t>(bt), Kp, 1, out.data_ptr<int32_t>(), N,
                            nullptr, nullptr, 0, 1.f, 0.f, (int)M, (int)N, (int)Kp};
  launch_sm80_int8(p, c10::cuda::getCurrentCUDAStream());
  return out;
}

}  // namespace minfer
