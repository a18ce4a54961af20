// The gemm family's host seam, shared by its launchers (linear in dispatch.cpp; gemm, tensor_core_gemm
// and gemm_int8 in baselines/gemm.cpp): argument checks whose messages name the argument, and `run`,
// which picks a kernel path for a problem and launches it.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>

#include "common/checks.h"
#include "common/tensor.h"
#include "gemm/gemm.h"

namespace minfer::gemm_impl {

// Messages are built from strings only: numbers go through std::to_string (see common/checks.h).
inline std::string num(int64_t v) { return std::to_string(v); }
inline std::string shape(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + num(t.size(i));
  return s + "]";
}
inline void check_dim2(const at::Tensor& t, const char* name, const char* op) {
  MINFER_CHECK(t.dim() == 2, op, ": ", name, " must have 2 dimensions, got shape ", shape(t));
}
inline void check_cuda(const at::Tensor& t, const at::Tensor& ref, const char* name, const char* op) {
  MINFER_CHECK(t.is_cuda(), op, ": ", name, " must be a CUDA tensor, got a ", t.device().type() == at::kCPU ? "CPU" : "non-CUDA", " tensor");
  MINFER_CHECK(t.get_device() == ref.get_device(), op, ": ", name, " must be on the same device as the first input");
}
inline void check_int_range(int64_t v, const char* what, const char* op) {
  MINFER_CHECK(v < (int64_t(1) << 31), op, ": ", what, " = " + num(v) + " is too large (must fit in int32)");
}

template <typename T>
const T* ptr(const at::Tensor& t) {
  return t.defined() ? reinterpret_cast<const T*>(t.data_ptr()) : nullptr;
}

// The kernel paths (str path): auto | wmma | sm80 | sm90 | gemv | simt; see dispatch.cpp.
enum class Path { kAuto, kWmma, kSm80, kSm90, kGemv, kSimt };
Path parse_path(const std::string& name, const char* op);

// Runs D = alpha * A . B^T (+ bias, + beta * C) on `path` (kAuto: the fastest path for the shape), or
// with plan != nullptr launches nothing and says in *plan which path (for gemv, which kernel) would run.
// `op` names the caller in error messages.
void run(const Params<__half, __half>& p, Path path, const at::Device& device, const char* op,
         std::string* plan = nullptr);
void run(const Params<__nv_bfloat16, __nv_bfloat16>& p, Path path, const at::Device& device, const char* op,
         std::string* plan = nullptr);
void run(const Params<float, float>& p, Path path, const at::Device& device, const char* op,
         std::string* plan = nullptr);

}  // namespace minfer::gemm_impl
