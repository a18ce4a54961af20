// Compile-time dispatch on the activation dtype: the body sees `scalar_t` as float, half or __nv_bfloat16.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/all.h>

#include "checks.h"

#define MINFER_DISPATCH_FLOAT(dtype, name, ...)                                               \
  [&] {                                                                                       \
    switch (dtype) {                                                                          \
      case at::kFloat: { using scalar_t = float; return __VA_ARGS__(); }                      \
      case at::kHalf: { using scalar_t = __half; return __VA_ARGS__(); }                      \
      case at::kBFloat16: { using scalar_t = __nv_bfloat16; return __VA_ARGS__(); }           \
      default: MINFER_CHECK(false, name, ": unsupported dtype ", dtype, " (float32, float16 or bfloat16)"); \
    }                                                                                         \
  }()

#define MINFER_DISPATCH_HALF(dtype, name, ...)                                                \
  [&] {                                                                                       \
    switch (dtype) {                                                                          \
      case at::kHalf: { using scalar_t = __half; return __VA_ARGS__(); }                      \
      case at::kBFloat16: { using scalar_t = __nv_bfloat16; return __VA_ARGS__(); }           \
      default: MINFER_CHECK(false, name, ": unsupported dtype ", dtype, " (float16 or bfloat16)"); \
    }                                                                                         \
  }()

#define MINFER_DISPATCH_INDEX(dtype, name, ...)                                               \
  [&] {                                                                                       \
    switch (dtype) {                                                                          \
      case at::kInt: { using index_t = int32_t; return __VA_ARGS__(); }                       \
      case at::kLong: { using index_t = int64_t; return __VA_ARGS__(); }                      \
      default: MINFER_CHECK(false, name, ": ids must be int32 or int64, got ", dtype);         \
    }                                                                                         \
  }()
