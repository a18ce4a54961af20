// The gemm family's engine launcher, linear: validate at the boundary, pick a path, fill Params. Host-only
// (compiled by the C++ compiler).
//
// Paths (str path): "auto"; "wmma" (any layout); "sm80" (mma.sync + cp.async pipeline);
// "sm90" (wgmma + TMA, Hopper only); "gemv" (weight streaming, small M); "simt" (fp32).
// auto: fp32 -> simt; fp16/bf16 -> gemv for M <= 16, and up to M = 256 on small W (blocks of 16 rows x N x
// K <= 2^24); on Hopper sm90 above M = 128 and its small-M kernel for M 32..128 on large W; else sm80;
// wmma when the cp.async rules (K % 8 == 0, row strides % 8 == 0, 16-byte aligned bases) fail.
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>

#include "common/checks.h"
#include "common/dispatch.h"
#include "common/launch.h"
#include "common/split_counters.h"
#include "common/vec.h"
#include "gemm/gemm.h"
#include "gemm/launcher.h"
#include "ops.h"

namespace minfer {
namespace gemm_impl {

Path parse_path(const std::string& name, const char* op) {
  if (name == "auto") return Path::kAuto;
  if (name == "wmma") return Path::kWmma;
  if (name == "sm80") return Path::kSm80;
  if (name == "sm90") return Path::kSm90;
  if (name == "gemv") return Path::kGemv;
  if (name == "simt") return Path::kSimt;
  MINFER_CHECK(false, op, ": unknown path '", name, "' (auto, wmma, sm80, sm90, gemv, simt)");
}

namespace {

// The cp.async / TMA / 16-byte-load paths read A and B in 16-byte chunks along K.
template <typename T, typename Out>
bool chunk_aligned(const Params<T, Out>& p) {
  constexpr int e = 16 / sizeof(T);
  return p.sak == 1 && p.sbk == 1 && p.K % e == 0 && p.sam % e == 0 && p.sbn % e == 0 && is_aligned16(p.A) &&
         is_aligned16(p.B);
}

int capability(const at::Device& device, cudaDeviceAttr which) {
  int v = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&v, which, device.index()));
  return v;
}

// The path auto takes for p on a device of compute capability `major`.
template <typename T>
Path auto_path(const Params<T, T>& p, int major) {
  const bool aligned = chunk_aligned(p);
  // gemv streams W once for up to 16 activation rows (two n8 mma tiles) at the cost of M = 1; from
  // M = 17 it streams W once per 16 rows, where sm90's small-M kernel (Hopper) and split-K sm80 read
  // it once. The repeats come from L2 and cost little while W is small: up to M = 256, gemv wins while
  // blocks of 16 rows x N x K stays within 2^24 (H200, fp16: 64 x 576 x 576 3.1 against
  // sm80's 7.9 us, 64 x 3072 x 576 5.7 against 9.6, 64 x 2048 x 2048 9.6 against sm90's 13.5; at twice
  // that, 32 x 4096 x 4096, level with sm90 at 17.6; 64 x 4096 x 4096 28.7 against 19.7; bf16: 128 x 576
  // x 576 2.8 against sm80's 11.3, 128 x 3072 x 576 8.0 against 14.8, 256 x 576 x 1536 8.5 against sm90's
  // 10.8, 256 x 960 x 576 5.7 against 6.4; past the budget 192 x 3072 x 576 11.5 against 6.6). Measured
  // (H200): small-M beats sm80 from M = 32 on W of 4M elements and more (64 x 4096 x 4096:
  // 20.9 against 25.4 us; 64 x 28672 x 4096: 72 against 106) and loses at M = 17 (18.9 against 17.9).
  const int64_t row_blocks = (p.M + 15) / 16;
  const bool gemv_wins = p.M <= 16 || (p.M <= 256 && row_blocks * p.N * p.K <= (int64_t(1) << 24));
  const bool sm90_small_m_wins = p.M >= 32 && int64_t(p.N) * p.K >= (int64_t(1) << 22);
  if (aligned && major >= 8 && gemv_wins) return Path::kGemv;
  if (aligned && major == 9 && (p.M > kSm90SmallMAll || sm90_small_m_wins)) return Path::kSm90;
  if (aligned && major >= 8) return Path::kSm80;
  return Path::kWmma;
}

// plan != nullptr: launch nothing, say in *plan which path (and for gemv, which kernel) would run.
template <typename T>
void run_lowp(const Params<T, T>& p, Path path, const at::Device& device, const char* op, std::string* plan) {
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int major = cc_major(device.index());
  // "major.minor", for the errors
  const auto version = [&] { return num(major) + "." + num(capability(device, cudaDevAttrComputeCapabilityMinor)); };
  const bool aligned = chunk_aligned(p);
  const char* rule = "K % 8 == 0, row strides % 8 == 0 (elements), K-contiguous rows and 16-byte aligned base pointers";
  if (path == Path::kAuto) path = auto_path(p, major);
  switch (path) {
    case Path::kWmma:
      if (plan) *plan = "wmma";
      else launch_wmma<T, T>(p, stream);
      return;
    case Path::kGemv:
      MINFER_CHECK(major >= 8, op, ": path gemv needs compute capability >= 8.0, got " + version());
      MINFER_CHECK(aligned, op, ": path gemv needs ", rule, " (got K=" + num(p.K) + ")");
      launch_gemv<T>(p, stream, sm_count(device.index()), plan);
      if (plan) *plan = "gemv: " + *plan;
      return;
    case Path::kSm80:
      MINFER_CHECK(major >= 8, op, ": path sm80 needs compute capability >= 8.0, got " + version());
      MINFER_CHECK(aligned, op, ": path sm80 needs ", rule, " (got K=" + num(p.K) + ")");
      {
        const int splits = sm80_split_k(p.M, p.N, p.K, sm_count(device.index()));
        if (plan) {
          *plan = "sm80 split_k=" + num(splits);
          return;
        }
        at::Tensor ws;
        if (splits > 1)
          ws = at::empty({(int64_t)splits * p.M * p.N}, at::TensorOptions().dtype(at::kFloat).device(device));
        launch_sm80<T>(p, stream, splits > 1 ? ws.data_ptr<float>() : nullptr, splits);
      }
      return;
    case Path::kSm90:
      MINFER_CHECK(major == 9, op, ": path sm90 needs compute capability 9.x (Hopper), got " + version());
      MINFER_CHECK(aligned, op, ": path sm90 needs ", rule, " (got K=" + num(p.K) + ")");
      {
        const int sms = sm_count(device.index());
        const bool small_m = sm90_small_m(p.M, p.N, p.K);
        const bool plain = p.act == kActNone && !p.C;
        const Sm90SmallM small = small_m ? sm90_small_m_plan(p.M, p.N, p.K, sms, plain) : Sm90SmallM{};
        if (plan) {
          *plan = !small_m ? "sm90" : "sm90 small-M";
          if (small_m && small.splits > 1) *plan += " split=" + num(small.splits) + " cluster=" + num(small.cluster);
          if (small_m && small.w_rows == 64) *plan += " w_rows=64";
          const int splits = small_m ? 1 : sm90_persistent_plan(p.M, p.N, p.K, sms).splits;
          if (splits > 1) *plan += " split=" + num(splits) + " cluster=" + num(splits);
          return;
        }
        at::Tensor ws, own_counters;
        float* ws_ptr = nullptr;
        int* counters = nullptr;
        if (small_m && small.ws_floats > 0) {
          ws = at::empty({small.ws_floats}, at::TensorOptions().dtype(at::kFloat).device(device));
          ws_ptr = ws.data_ptr<float>();
          counters = split_counters(small.tiles, device.index(), stream, ws, own_counters);
        }
        launch_sm90<T>(p, stream, sms, small_m ? &small : nullptr, ws_ptr, counters);
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

}  // namespace

void run(const Params<__half, __half>& p, Path path, const at::Device& device, const char* op, std::string* plan) {
  run_lowp(p, path, device, op, plan);
}
void run(const Params<__nv_bfloat16, __nv_bfloat16>& p, Path path, const at::Device& device, const char* op,
         std::string* plan) {
  run_lowp(p, path, device, op, plan);
}
void run(const Params<float, float>& p, Path path, const at::Device&, const char* op, std::string* plan) {
  run_fp32(p, path, op, plan);
}

namespace {

Act parse_act(const std::string& name) {
  if (name == "none") return kActNone;
  if (name == "silu") return kActSilu;
  if (name == "gelu_tanh") return kActGeluTanh;
  MINFER_CHECK(false, "linear_act: unknown act '", name, "' (silu, gelu_tanh)");
}

// linear, or with plan != nullptr only the choice of kernel it would make (see linear_plan). With act, weight
// is gate | up and the result act(gate) * up: in the gemv kernels' epilogue where auto takes them for up to 8
// rows or more than 16, and in the sm90 small-M kernel's at 32-64 rows (the activation's launch spared), else
// the linear and then the activation's own launch.
at::Tensor linear_or_plan(const at::Tensor& x, const at::Tensor& weight,
                          const std::optional<at::Tensor>& bias, const std::string& path_name,
                          bool static_weight, std::string* plan, Act act = kActNone) {
  const char* op = act == kActNone ? "linear" : "linear_act";
  const Path path = parse_path(path_name, op);
  check_cuda(x, x, "x", op);
  check_cuda(weight, x, "weight", op);
  MINFER_CHECK_FLOAT(x);
  MINFER_CHECK_SAME_DTYPE(x, weight);
  check_dim2(x, "x", op);
  check_dim2(weight, "weight", op);
  MINFER_CHECK(x.size(1) == weight.size(1), op, ": x is [tokens, in] = " + shape(x) + " and weight is [out, in] = " +
              shape(weight) + ": the in dimensions differ");
  const int64_t M = x.size(0), N = weight.size(0), K = x.size(1);
  MINFER_CHECK(x.stride(1) == 1 || K <= 1, op, ": x must have a contiguous last dimension (stride 1)");
  MINFER_CHECK(weight.stride(1) == 1 || K <= 1, op, ": weight must have a contiguous last dimension (stride 1)");
  MINFER_CHECK(act == kActNone || N % 2 == 0, op,
               ": weight must be gate | up, an even number of rows, got " + shape(weight));
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = *bias;
    check_cuda(b, x, "bias", op);
    MINFER_CHECK_SAME_DTYPE(x, b);
    MINFER_CHECK(b.dim() == 1 && b.size(0) == N, op, ": bias must be [out] = [" + num(N) + "], got " + shape(b));
    b = b.contiguous();
  }
  check_int_range(M, "tokens", op);
  check_int_range(N, "out", op);
  check_int_range(K, "in", op);
  const c10::cuda::CUDAGuard guard(x.device());
  // Up to 8 rows the kernels walk gate | up in tiles of 8 gate and 8 up rows (w_row): N / 2 in whole 8s. At
  // 9-16 rows the two launches stay: the fused stream kernel took 1.4 us a call more and the down projection
  // after it waited the activation's launch out (Gemma-3-4B shape, batch 16, H200: 3.117 -> 3.16 ms a step);
  // but for a wide model's gate | up on the H100's many-tiles ring (gemv_act_in_ring, gemv.cu).
  // The sm90 small-M kernel's tiles pair them alike at 32-64 rows (sm90_small_m_act).
  const Path fused_path = act == kActNone || path != Path::kAuto || x.scalar_type() == at::kFloat ? Path::kAuto : [&] {
    return MINFER_DISPATCH_HALF(x.scalar_type(), "linear_act", [&] {
      const Params<scalar_t, scalar_t> p{ptr<scalar_t>(x), x.stride(0), 1, ptr<scalar_t>(weight), weight.stride(0), 1,
                                         nullptr, N / 2, nullptr, nullptr, 0, 1.f, 0.f, (int)M, (int)N, (int)K};
      return auto_path(p, cc_major(x.device().index()));
    });
  }();
  const bool fused = (fused_path == Path::kGemv &&
                      (M > 16 || (M <= 8 && (N / 2) % 8 == 0) ||
                       gemv_act_in_ring((int)M, (int)N, (int)K, x.get_device(), sm_count(x.get_device())))) ||
                     (fused_path == Path::kSm90 && sm90_small_m_act(M, N));
  if (act != kActNone && !fused) {  // the linear, then the activation
    const char* act_op = act == kActSilu ? "silu_and_mul" : "gelu_tanh_and_mul";
    std::string linear_plan;
    at::Tensor gate_up = linear_or_plan(x, weight, bias, path_name, static_weight, plan ? &linear_plan : nullptr);
    if (plan) {
      *plan = linear_plan + ", then " + act_op;
      return at::Tensor();
    }
    return act == kActSilu ? silu_and_mul(gate_up, std::nullopt) : gelu_tanh_and_mul(gate_up, std::nullopt);
  }
  const int64_t n_out = fused ? N / 2 : N;
  auto out = plan ? at::Tensor() : x.new_empty({M, n_out});
  if (M == 0 || N == 0) {
    if (plan) *plan = "none (empty output)";
    return out;
  }
  MINFER_DISPATCH_FLOAT(x.scalar_type(), op, [&] {
    scalar_t* d = plan ? nullptr : reinterpret_cast<scalar_t*>(out.data_ptr());
    Params<scalar_t, scalar_t> p{ptr<scalar_t>(x), M == 1 ? K : x.stride(0), 1, ptr<scalar_t>(weight),
                                 N == 1 ? K : weight.stride(0), 1, d, n_out, ptr<scalar_t>(b), nullptr, 0, 1.f, 0.f,
                                 (int)M, (int)N, (int)K};
    p.static_b = static_weight;
    p.act = fused ? act : kActNone;
    run(p, fused ? fused_path : path, x.device(), op, plan);  // fused: auto's choice, made above
  });
  if (plan && fused) *plan += act == kActSilu ? " +silu" : " +gelu_tanh";
  return out;
}

}  // namespace
}  // namespace gemm_impl

// y = x W^T + bias. x [tokens, in] (last dim contiguous), weight [out, in], bias [out] -> [tokens, out].
// static_weight: no kernel that may still be running when this one starts writes weight (a model's
// weights); the gemv and sm90 small-M kernels then start reading it before they wait for the previous kernel.
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                  const std::string& path, bool static_weight) {
  return gemm_impl::linear_or_plan(x, weight, bias, path, static_weight, nullptr);
}

// The gated activation of the gate | up linear: act(x gate^T) * (x up^T), weight [2 inter, in] -> [tokens, inter],
// act silu | gelu_tanh. Equal to linear and then silu_and_mul / gelu_tanh_and_mul, in one launch where the gemv
// kernels run for up to 8 rows (decode), or past 16 on small W (a small model's batched decode), and where the
// sm90 small-M kernel runs 32-64 rows (a large model's batched decode).
at::Tensor linear_act(const at::Tensor& x, const at::Tensor& weight, const std::string& act,
                      bool static_weight) {
  return gemm_impl::linear_or_plan(x, weight, std::nullopt, "auto", static_weight, nullptr, gemm_impl::parse_act(act));
}

// Which path and kernel configuration linear(x, weight, path=path) would launch, as text, e.g.
// "gemv: m1 U=4 4/SM ks=2 grid=512" (with act, linear_act's: "... +silu" fused, "..., then silu_and_mul" not);
// nothing runs. For tests that check a shape reaches the kernel it is meant to exercise.
std::string linear_plan(const at::Tensor& x, const at::Tensor& weight, const std::string& path,
                        const std::string& act) {
  std::string plan;
  gemm_impl::linear_or_plan(x, weight, std::nullopt, path, false, &plan, gemm_impl::parse_act(act));
  return plan;
}

}  // namespace minfer
