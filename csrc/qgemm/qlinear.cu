// The qlinear ops (ops.h): argument checks and outputs, then each format's kernels (qlinear_launch.cuh, compiled a
// format a translation unit) through qgemm::run and qgemm::run_act.
//
// qlinear_into writes a row-strided out (a fused output's columns: Q4_K_M's q|k in Q4_K beside v in Q6_K).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "common/checks.h"
#include "common/dispatch.h"
#include "common/launch.h"
#include "ops.h"
#include "qgemm/checks.h"
#include "qgemm/formats.cuh"
#include "qgemm/q4k_x.cuh"
#include "qgemm/qlinear.h"

namespace minfer {

namespace {

// Validates x [M, k], blocks (W [n, k]), bias [n] and x's records for op; returns W's row bytes.
int64_t check_qlinear(const char* op, const at::Tensor& x, const at::Tensor& blocks, int64_t qtype, int64_t n,
                      int64_t k, const std::optional<at::Tensor>& bias,
                      const std::optional<at::Tensor>& x_records) {
  const int64_t row_bytes = qgemm::check_blocks(op, blocks, qtype, n, k);
  MINFER_CHECK_CUDA(x);
  MINFER_CHECK_SAME_DEVICE(x, blocks);
  MINFER_CHECK_DIM(x, 2);
  qgemm::check_half_dtype(op, "x", x.scalar_type());
  MINFER_CHECK(x.size(1) == k, op, ": x must have k = ", k, " columns, got shape ", x.sizes());
  MINFER_CHECK(x.size(0) <= qgemm::max_rows(qgemm::base_qtype(qtype), n, k), op,
               ": x must have at most 32 rows (64 for Q4_K and Q6_K on W of 4096 x 4096 and more; dequantize + linear "
               "for more), got ", x.size(0));
  MINFER_CHECK_CONTIGUOUS(x);
  MINFER_CHECK(is_aligned16(x.data_ptr()), op, ": x must be 16-byte aligned");
  if (bias) {
    MINFER_CHECK_SAME_DEVICE(x, *bias);
    MINFER_CHECK_SAME_DTYPE(x, *bias);
    MINFER_CHECK(bias->dim() == 1 && bias->size(0) == n, op, ": bias must have shape [", n, "], got ", bias->sizes());
    MINFER_CHECK(bias->is_contiguous(), op, ": bias must be contiguous");
  }
  if (x_records) q4k_x::check_records(op, *x_records, x);
  return row_bytes;
}

// Validates norm_weight, the RMSNorm weight qlinear reads x through: [k] of x's dtype, contiguous, 16-byte aligned.
void check_norm(const char* op, const at::Tensor& x, const at::Tensor& norm_weight, double eps) {
  check_norm_weight(op, "norm_weight", norm_weight, "x", x, "hidden", x.size(1), eps);
  MINFER_CHECK(is_aligned16(norm_weight.data_ptr()), op, ": norm_weight must be 16-byte aligned");
}

// Whether regs_kernel takes x [M, k] @ W^T (n rows) with a norm or accumulate: else the ops run them apart.
bool kernel_takes_norm(const at::Tensor& x, int64_t qtype, int64_t n) {
  return qgemm::takes_norm(qgemm::base_qtype(qtype), x.size(0), n, x.size(1), sm_count(x.get_device()));
}

// The kernels' arguments: W [n, k] (row_bytes a row), x [M, k], out's rows out.stride(0) apart.
qgemm::Args make_args(const at::Tensor& out, const at::Tensor& x, const at::Tensor& blocks, int64_t qtype, int64_t n,
                      int64_t k, int64_t row_bytes, const std::optional<at::Tensor>& bias, bool static_weight) {
  return {blocks.data_ptr<uint8_t>(), x.data_ptr(),   bias ? bias->data_ptr() : nullptr, out.data_ptr(),
          (int)x.size(0),             (int)n,         (int)k,                             row_bytes,
          static_weight,              row_bytes % 16 == 0 && 16 * row_bytes < (int64_t(1) << 31),
          0x5464u,                    out.stride(0),  qgemm::is_tiled(qtype)};
}

// out [M, n] = x [M, k] @ W^T (+ bias), out's rows possibly strided (qlinear_into's slice); arguments checked.
// norm_weight / accumulate only where kernel_takes_norm.
void run_qlinear(const at::Tensor& out, const at::Tensor& x, const at::Tensor& blocks, int64_t qtype,
                 int64_t n, int64_t k, int64_t row_bytes, const std::optional<at::Tensor>& bias,
                 bool static_weight, const std::optional<at::Tensor>& x_records,
                 const std::optional<at::Tensor>& norm_weight = std::nullopt, double eps = 0.0,
                 bool accumulate = false) {
  if (x.size(0) == 0 || n == 0) return;
  // x's records (q4k_x.cuh) spare the kernels that read them (reads_records) their prepare_x launch; the others
  // ignore them
  const uint8_t* records = x_records ? x_records->data_ptr<uint8_t>() : nullptr;
  const c10::cuda::CUDAGuard guard(x.device());
  qgemm::Args a = make_args(out, x, blocks, qtype, n, k, row_bytes, bias, static_weight);
  a.norm_w = norm_weight ? norm_weight->data_ptr() : nullptr;
  a.eps = static_cast<float>(eps);
  a.accumulate = accumulate;
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int sms = sm_count(x.get_device()), cc = cc_major(x.get_device());
  MINFER_DISPATCH_QTYPE(qgemm::base_qtype(qtype), QT, [&] {
    MINFER_DISPATCH_HALF(x.scalar_type(), "qlinear", [&] { qgemm::run<QT, scalar_t>(a, records, x, sms, cc, stream); });
  });
}

}  // namespace

at::Tensor qlinear(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype, int64_t n, int64_t k,
                   const std::optional<at::Tensor>& bias, bool static_weight,
                   const std::optional<at::Tensor>& x_records, const std::optional<at::Tensor>& norm_weight,
                   double eps) {
  const int64_t row_bytes = check_qlinear("qlinear", x, blocks, qtype, n, k, bias, x_records);
  if (norm_weight) {
    check_norm("qlinear", x, *norm_weight, eps);
    if (!kernel_takes_norm(x, qtype, n))  // the norm's own launch
      return qlinear(rms_norm(x, *norm_weight, eps, std::nullopt), blocks, qtype, n, k, bias, static_weight,
                     std::nullopt, std::nullopt, 0.0);
  }
  auto out = x.new_empty({x.size(0), n});  // [M, n]
  run_qlinear(out, x, blocks, qtype, n, k, row_bytes, bias, static_weight, x_records, norm_weight, eps);
  return out;
}

void qlinear_into(const at::Tensor& out, const at::Tensor& x, const at::Tensor& blocks, int64_t qtype,
                  const std::optional<at::Tensor>& bias, bool static_weight,
                  const std::optional<at::Tensor>& x_records, bool accumulate) {
  MINFER_CHECK_CUDA(out);
  MINFER_CHECK_DIM(out, 2);
  MINFER_CHECK_DIM(x, 2);
  MINFER_CHECK_SAME_DEVICE(x, out);
  MINFER_CHECK_SAME_DTYPE(x, out);
  MINFER_CHECK(out.size(0) == x.size(0), "qlinear_into: out must have x's ", x.size(0), " rows, got shape ",
               out.sizes());
  MINFER_CHECK(out.stride(1) == 1 && out.stride(0) >= out.size(1),
               "qlinear_into: out must have contiguous rows (stride(1) == 1, stride(0) >= n), got strides ",
               out.strides());
  const int64_t n = out.size(1), k = x.size(1);
  const int64_t row_bytes = check_qlinear("qlinear_into", x, blocks, qtype, n, k, bias, x_records);
  if (accumulate && !kernel_takes_norm(x, qtype, n)) {  // the add's own launch
    auto y = out.new_empty({x.size(0), n});  // [M, n]
    run_qlinear(y, x, blocks, qtype, n, k, row_bytes, bias, static_weight, x_records);
    out.add_(y);
    return;
  }
  run_qlinear(out, x, blocks, qtype, n, k, row_bytes, bias, static_weight, x_records, std::nullopt, 0.0, accumulate);
}

bool qlinear_reads_records(const at::Tensor& x, int64_t qtype) {
  MINFER_CHECK_CUDA(x);
  MINFER_CHECK_DIM(x, 2);
  bool reads = false;
  const int cc = cc_major(x.get_device());
  MINFER_DISPATCH_QTYPE(qgemm::base_qtype(qtype), QT, [&] { reads = qgemm::reads_records(QT, x.size(0), x.size(1), cc); });
  return reads;
}

int64_t qlinear_max_rows(int64_t qtype, int64_t n, int64_t k) {
  qgemm::block_size(qgemm::base_qtype(qtype));  // an unknown id fails here
  return qgemm::max_rows(qgemm::base_qtype(qtype), n, k);
}

bool qlinear_takes_norm(const at::Tensor& x, int64_t qtype, int64_t n) {
  MINFER_CHECK_CUDA(x);
  MINFER_CHECK_DIM(x, 2);
  return kernel_takes_norm(x, qtype, n);
}

at::Tensor qlinear_act(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype, int64_t n, int64_t k,
                       const std::string& act, bool static_weight, const std::optional<at::Tensor>& x_records,
                       const std::optional<at::Tensor>& records, const std::optional<at::Tensor>& norm_weight,
                       double eps) {
  MINFER_CHECK(act == "silu" || act == "gelu_tanh", "qlinear_act: act must be silu or gelu_tanh, got ", act);
  MINFER_CHECK(n % 2 == 0, "qlinear_act: n must be even (the gate rows, then as many up rows), got ", n);
  MINFER_CHECK(!qgemm::is_tiled(qtype) || n % 32 == 0, "qlinear_act: tiled blocks need n a multiple of 32 (gate and up "
               "whole 16-row groups), got ", n);
  const int64_t row_bytes = check_qlinear("qlinear_act", x, blocks, qtype, n, k, std::nullopt, x_records);
  if (norm_weight) {
    check_norm("qlinear_act", x, *norm_weight, eps);
    if (records || !kernel_takes_norm(x, qtype, n))  // the norm's own launch
      return qlinear_act(rms_norm(x, *norm_weight, eps, std::nullopt), blocks, qtype, n, k, act, static_weight,
                         std::nullopt, records, std::nullopt, 0.0);
  }
  auto out = x.new_empty({x.size(0), n / 2});  // [M, n / 2]
  if (records) q4k_x::check_records("qlinear_act", *records, out);
  if (x.size(0) == 0 || n == 0) return out;
  const c10::cuda::CUDAGuard guard(x.device());
  qgemm::Args a = make_args(out, x, blocks, qtype, n, k, row_bytes, std::nullopt, static_weight);
  a.norm_w = norm_weight ? norm_weight->data_ptr() : nullptr;
  a.eps = static_cast<float>(eps);
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int sms = sm_count(x.get_device()), cc = cc_major(x.get_device());
  bool fused = false;
  MINFER_DISPATCH_QTYPE(qgemm::base_qtype(qtype), QT, [&] {
    MINFER_DISPATCH_HALF(x.scalar_type(), "qlinear_act", [&] {
      fused = qgemm::run_act<QT, scalar_t>(a, act == "silu", x_records ? x_records->data_ptr<uint8_t>() : nullptr,
                                           records ? records->data_ptr<uint8_t>() : nullptr, x, sms, cc, stream);
    });
  });
  if (fused) return out;
  // the other formats and sizes: the linear, then the activation's own launch
  auto gate_up = x.new_empty({x.size(0), n});  // [M, n]
  run_qlinear(gate_up, x, blocks, qtype, n, k, row_bytes, std::nullopt, static_weight, x_records);
  return act == "silu" ? silu_and_mul(gate_up, records) : gelu_tanh_and_mul(gate_up, records);
}

}  // namespace minfer
