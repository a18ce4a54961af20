// Argument checks shared by every launcher. Each message names the argument and the rule.
#pragma once
#include <torch/all.h>

#define MINFER_CHECK_CUDA(t) TORCH_CHECK((t).is_cuda(), #t " must be a CUDA tensor, got device ", (t).device())
#define MINFER_CHECK_CONTIGUOUS(t) TORCH_CHECK((t).is_contiguous(), #t " must be contiguous")
#define MINFER_CHECK_LAST_DIM_CONTIGUOUS(t) \
  TORCH_CHECK((t).stride(-1) == 1, #t " must have a contiguous last dimension (stride 1), got stride ", (t).stride(-1))
#define MINFER_CHECK_DIM(t, n) TORCH_CHECK((t).dim() == (n), #t " must have ", n, " dimensions, got shape ", (t).sizes())
#define MINFER_CHECK_FLOAT(t)                                                                                  \
  TORCH_CHECK((t).scalar_type() == at::kFloat || (t).scalar_type() == at::kHalf ||                             \
                  (t).scalar_type() == at::kBFloat16,                                                          \
              #t " must be float32, float16 or bfloat16, got ", (t).scalar_type())
#define MINFER_CHECK_SAME_DTYPE(a, b) \
  TORCH_CHECK((a).scalar_type() == (b).scalar_type(), #a " and " #b " must have the same dtype, got ", (a).scalar_type(), " and ", (b).scalar_type())
#define MINFER_CHECK_SAME_DEVICE(a, b) \
  TORCH_CHECK((a).device() == (b).device(), #a " and " #b " must be on the same device, got ", (a).device(), " and ", (b).device())
#define MINFER_CHECK_INDEX(t)                                                                                  \
  TORCH_CHECK((t).scalar_type() == at::kInt || (t).scalar_type() == at::kLong, #t " must be int32 or int64, got ", \
              (t).scalar_type())
