// The one place where minfer's ops are declared (schemas) and bound to their CUDA launchers.
// Fake (meta) implementations live in minfer/ops/cuda.py.
#include <Python.h>
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(minfer, m) {
  m.def("embedding(Tensor ids, Tensor weight) -> Tensor");
}

TORCH_LIBRARY_IMPL(minfer, CUDA, m) {
  m.impl("embedding", &minfer::embedding);
}

// Importing minfer._C loads the library above; the module itself has no Python functions.
extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
