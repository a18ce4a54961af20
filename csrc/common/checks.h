// Argument checks shared by every launcher. Each message names the argument and the rule.
#pragma once
#include <cmath>
#include <string>
#include <type_traits>

#include "common/tensor.h"
#include "common/vec.h"

namespace minfer::detail {
// Messages are assembled from std::string pieces here rather than streamed by c10::str: on the GPU
// machine (torch 2.11) a failing TORCH_CHECK that streamed an integer crashed the process instead of
// raising, while plain-string messages raise cleanly.
inline std::string piece(const std::string& s) { return s; }
inline std::string piece(const char* s) { return s; }
inline std::string piece(char c) { return std::string(1, c); }
inline std::string piece(bool b) { return b ? "true" : "false"; }
template <typename T>
  requires std::is_integral_v<T>
std::string piece(T v) { return std::to_string(v); }
template <typename T>
  requires std::is_floating_point_v<T>
std::string piece(T v) { return std::to_string(v); }
inline std::string piece(c10::ScalarType t) { return c10::toString(t); }
inline std::string piece(const caffe2::TypeMeta& t) { return std::string(t.name()); }
inline std::string piece(const c10::Device& d) { return d.str(); }
inline std::string piece(c10::IntArrayRef sizes) {
  std::string out = "[";
  for (size_t i = 0; i < sizes.size(); ++i) out += (i ? ", " : "") + std::to_string(sizes[i]);
  return out + "]";
}
template <typename... Args>
std::string msg(const Args&... args) {
  std::string out;
  (out += ... += piece(args));
  return out;
}
}  // namespace minfer::detail

#define MINFER_CHECK(cond, ...) TORCH_CHECK(cond, ::minfer::detail::msg(__VA_ARGS__))

#define MINFER_CHECK_CUDA(t) MINFER_CHECK((t).is_cuda(), #t " must be a CUDA tensor, got device ", (t).device())
#define MINFER_CHECK_CONTIGUOUS(t) MINFER_CHECK((t).is_contiguous(), #t " must be contiguous")
#define MINFER_CHECK_LAST_DIM_CONTIGUOUS(t) \
  MINFER_CHECK((t).stride(-1) == 1, #t " must have a contiguous last dimension (stride 1), got stride ", (t).stride(-1))
#define MINFER_CHECK_DIM(t, n) MINFER_CHECK((t).dim() == (n), #t " must have ", n, " dimensions, got shape ", (t).sizes())
#define MINFER_CHECK_FLOAT(t)                                                                                  \
  MINFER_CHECK((t).scalar_type() == at::kFloat || (t).scalar_type() == at::kHalf ||                             \
                  (t).scalar_type() == at::kBFloat16,                                                          \
              #t " must be float32, float16 or bfloat16, got ", (t).scalar_type())
#define MINFER_CHECK_SAME_DTYPE(a, b) \
  MINFER_CHECK((a).scalar_type() == (b).scalar_type(), #a " and " #b " must have the same dtype, got ", (a).scalar_type(), " and ", (b).scalar_type())
#define MINFER_CHECK_SAME_DEVICE(a, b) \
  MINFER_CHECK((a).device() == (b).device(), #a " and " #b " must be on the same device, got ", (a).device(), " and ", (b).device())
#define MINFER_CHECK_INDEX(t)                                                                                  \
  MINFER_CHECK((t).scalar_type() == at::kInt || (t).scalar_type() == at::kLong, #t " must be int32 or int64, got ", \
              (t).scalar_type())

namespace minfer {
// A norm's weight: a contiguous [n] tensor of `like`'s dtype and device (n: hidden, or head_dim for the per-head
// norms; `dim` names it), and the norm's eps finite and >= 0.
inline void check_norm_weight(const char* op, const char* name, const at::Tensor& w, const char* like_name,
                              const at::Tensor& like, const char* dim, int64_t n, double eps) {
  MINFER_CHECK(w.device() == like.device() && w.scalar_type() == like.scalar_type() && w.dim() == 1 &&
                   w.size(0) == n && w.is_contiguous(),
               op, ": ", name, " must be a contiguous [", dim, "] = [", n, "] tensor of ", like_name,
               "'s dtype and device, got ", w.sizes(), " ", w.scalar_type(), " on ", w.device());
  MINFER_CHECK(std::isfinite(eps) && eps >= 0, op, ": eps must be finite and >= 0, got ", eps);
}

// 16-byte rows for cp.async / vector loads: every stride but the last a multiple of 8 elements (16-bit
// types), the last stride 1, and the base pointer 16-byte aligned.
inline bool rows_aligned16(const at::Tensor& t) {
  if (t.stride(-1) != 1 || !is_aligned16(t.data_ptr())) return false;
  for (int i = 0; i + 1 < t.dim(); ++i)
    if (t.size(i) > 1 && t.stride(i) % 8 != 0) return false;
  return true;
}
}  // namespace minfer
