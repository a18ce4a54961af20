// The one place where minfer's ops are declared (schemas) and bound to their CUDA launchers.
// Fake (meta) implementations live in minfer/ops/cuda.py.
#include <Python.h>
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(minfer, m) {
  m.def("embedding(Tensor ids, Tensor weight) -> Tensor");
  // gemm family (csrc/gemm/): path = auto | wmma | sm80 | sm90 | gemv | simt
  m.def("linear(Tensor x, Tensor w, Tensor? bias=None, str path=\"auto\") -> Tensor");
  m.def("gemm(Tensor a, Tensor b, float alpha=1.0, float beta=0.0, Tensor? c=None, bool trans_a=False, "
        "bool trans_b=False, str path=\"auto\") -> Tensor");
  m.def("tensor_core_gemm(Tensor a, Tensor b) -> Tensor");
  m.def("gemm_int8(Tensor a, Tensor b) -> Tensor");
}

TORCH_LIBRARY_IMPL(minfer, CUDA, m) {
  m.impl("embedding", &minfer::embedding);
  // gemm family
  m.impl("linear", &minfer::linear);
  m.impl("gemm", &minfer::gemm);
  m.impl("tensor_core_gemm", &minfer::tensor_core_gemm);
  m.impl("gemm_int8", &minfer::gemm_int8);
}

// Importing minfer._C loads the library above; the module itself has no Python functions.
extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
