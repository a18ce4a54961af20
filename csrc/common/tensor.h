// The slice of torch the launchers use: at::Tensor and its methods (outputs come from new_empty / new_zeros),
// TORCH_CHECK, the scalar types. Not <torch/all.h>: parsing it cost every .cu ~2.5 minutes of CPU on two
// architectures (cudafe++, one cicc a target, gcc), most of the extension's build.
#pragma once
#include <ATen/core/Tensor.h>
