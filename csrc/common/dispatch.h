// Compile-time dispatch on the activation dtype: the body sees `scalar_t` as float, half or __nv_bfloat16.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/checks.h"
#include "common/tensor.h"

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

// Compile-time dispatch on a head dimension (in the style of flash-attention's static_switch.h): the body
// sees `HEAD_DIM` as a constexpr int, 64, 128 or 256, the sizes the attention kernels are built for; any
// other value fails a check that names the argument.
//   MINFER_DISPATCH_HEAD_DIM(head_dim, D, [&] { launch<T, D>(p, stream); });
#define MINFER_DISPATCH_HEAD_DIM(head_dim, HEAD_DIM, ...)                                      \
  [&] {                                                                                       \
    if ((head_dim) == 64) {                                                                   \
      constexpr static int HEAD_DIM = 64;                                                     \
      return __VA_ARGS__();                                                                   \
    }                                                                                         \
    if ((head_dim) == 128) {                                                                  \
      constexpr static int HEAD_DIM = 128;                                                    \
      return __VA_ARGS__();                                                                   \
    }                                                                                         \
    MINFER_CHECK((head_dim) == 256, #head_dim " must be 64, 128 or 256, got ", (head_dim));   \
    constexpr static int HEAD_DIM = 256;                                                      \
    return __VA_ARGS__();                                                                     \
  }()
