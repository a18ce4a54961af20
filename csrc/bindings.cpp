// The one place where minfer's ops are declared (schemas) and bound to their CUDA launchers.
// Fake (meta) implementations live in minfer/ops/cuda.py.
#include <Python.h>
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(minfer, m) {
  m.def("embedding(Tensor ids, Tensor weight) -> Tensor");
  // attention family
  m.def("attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor start_pos, float scale) -> Tensor");
  m.def("naive_attention(Tensor q, Tensor k, Tensor v, float? scale=None, bool is_causal=False) -> Tensor");
  m.def("tiled_attention(Tensor q, Tensor k, Tensor v, float? scale=None, bool is_causal=False) -> Tensor");
  m.def("flash_attention(Tensor q, Tensor k, Tensor v, float? scale=None, bool is_causal=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(minfer, CUDA, m) {
  m.impl("embedding", &minfer::embedding);
  // attention family
  m.impl("attention", &minfer::attention);
  m.impl("naive_attention", &minfer::naive_attention);
  m.impl("tiled_attention", &minfer::tiled_attention);
  m.impl("flash_attention", &minfer::flash_attention);
}

// Importing minfer._C loads the library above; the module itself has no Python functions.
extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
