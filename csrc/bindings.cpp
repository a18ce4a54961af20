// The one place where minfer's ops are declared (schemas) and bound to their launchers (ops.h), in two
// groups: the engine ops, which minfer/model.py calls (and the plan queries its tests ask), and the
// baselines (csrc/baselines/), kept exposed and benchmarked.
// Fake (meta) implementations: minfer/ops/cuda.py (engine ops), minfer/ops/baselines.py (baselines).
#include <Python.h>
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(minfer, m) {
  // ---- engine ops ----
  m.def("embedding(Tensor ids, Tensor weight) -> Tensor");
  // greedy sampling: the index of each row's largest logit (the first among equals; NaN the largest)
  m.def("argmax(Tensor logits) -> Tensor");
  // the random draw: argmax of logits x (1 / temperature[r]) + Gumbel noise from (seeds[r], positions[r], id), the
  // counter-based RNG; a row of temperature 0 takes its argmax (greedy); no temperature: 1
  m.def("gumbel_argmax(Tensor logits, Tensor seeds, Tensor positions, Tensor? temperature=None) -> Tensor");
  // the same draw over the ids each row's top-k, min-p and top-p keep (of logits x (1 / temperature), in that order)
  m.def("draw_filtered(Tensor logits, Tensor seeds, Tensor positions, Tensor temperature, Tensor top_k, Tensor top_p, "
        "Tensor min_p) -> Tensor");
  // structured outputs: logits[r, i] = -inf where bit i of row r's packed mask (int32 words, 32 ids each) is 0
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor bitmask) -> ()");
  // memory-bound kernels
  // records: the output also written as the Q4_K linears' x records (csrc/qgemm/q4k_x.cuh), sparing them a launch
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor(a!)? records=None) -> Tensor");
  // x_weight: x is RMS-normalised by it before the add (a sandwich norm)
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps, Tensor? x_weight=None, "
        "Tensor(c!)? records=None) -> ()");
  // q_weight, k_weight: each head RMS-normalised over head_dim (eps) before the rotation (q/k norms);
  // v, k_cache, v_cache, slot_mapping: then k and v copied to cache row slot_mapping[token] of the paged pool
  m.def("rope(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cos_sin, bool is_neox, Tensor? q_weight=None, "
        "Tensor? k_weight=None, float eps=0.0, Tensor? v=None, Tensor(c!)? k_cache=None, Tensor(d!)? v_cache=None, "
        "Tensor? slot_mapping=None) -> ()");
  m.def("silu_and_mul(Tensor x, Tensor(a!)? records=None) -> Tensor");
  m.def("gelu_tanh_and_mul(Tensor x, Tensor(a!)? records=None) -> Tensor");
  // gemm family (csrc/gemm/): path = auto | wmma | sm80 | sm90 | gemv | simt
  m.def("linear(Tensor x, Tensor w, Tensor? bias=None, str path=\"auto\", bool static_weight=False) -> Tensor");
  // act(gate) * up of the gate | up linear (act: silu | gelu_tanh), in the gemv tiles' epilogue where they run
  m.def("linear_act(Tensor x, Tensor w, str act, bool static_weight=False) -> Tensor");
  // what linear (act: none) or linear_act would launch (tests)
  m.def("linear_plan(Tensor x, Tensor w, str path=\"auto\", str act=\"none\") -> str");
  // attention family (csrc/attention/)
  // k_new, v_new, cos_sin (decode only): the newest key rotated and written to the caches in the call
  m.def("attention(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor start_pos, float scale, "
        "bool stable_prefix=False, int window=0, Tensor? k_new=None, Tensor? v_new=None, Tensor? cos_sin=None) "
        "-> Tensor");
  m.def("paged_attention(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor block_table, Tensor seq_lens, "
        "Tensor cu_seqlens_q, int max_seqlen_q, int max_seqlen_k, float scale, bool stable_prefix=False, int window=0, "
        "Tensor? k_new=None, Tensor? v_new=None, Tensor? cos_sin=None) -> Tensor");
  // the same into a contiguous [tokens, heads, head_dim] out (a mixed step's decodes and chunks into one tensor)
  m.def("paged_attention_into(Tensor(a!) out, Tensor q, Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor block_table, "
        "Tensor seq_lens, Tensor cu_seqlens_q, int max_seqlen_q, int max_seqlen_k, float scale, "
        "bool stable_prefix=False, int window=0, Tensor? k_new=None, Tensor? v_new=None, Tensor? cos_sin=None) -> ()");
  m.def("attention_decode_plan(Tensor q, Tensor k_cache, int length, int window=0) -> str");  // what decode would launch (tests)
  // quantized weights (csrc/qgemm/): W [n, k] as ggml blocks, uint8 [n, k / elems * bytes]; qtype = ggml's
  // type id (minfer/ops/quantized.py), | 256 where each 16 rows' blocks are stored chunk-major (qgemm/checks.h, kTiled)
  m.def("dequantize(Tensor blocks, int qtype, int n, int k, ScalarType dtype) -> Tensor");
  m.def("dequantize_into(Tensor(a!) out, Tensor blocks, int qtype, bool static_weight=False) -> ()");
  // x_records: x already as records (from rms_norm / fused_add_rms_norm / the activations), read by Q4_K
  // norm_weight: x read as rms_norm(x, norm_weight, eps), in the linear's launch where qlinear_takes_norm
  m.def("qlinear(Tensor x, Tensor blocks, int qtype, int n, int k, Tensor? bias=None, bool static_weight=False, "
        "Tensor? x_records=None, Tensor? norm_weight=None, float eps=0.0) -> Tensor");
  // accumulate: out += x @ W^T (+ bias), each rounded as its own op (the residual add)
  m.def("qlinear_into(Tensor(a!) out, Tensor x, Tensor blocks, int qtype, Tensor? bias=None, bool static_weight=False, "
        "Tensor? x_records=None, bool accumulate=False) -> ()");
  // act(gate) * up of the gate | up linear, in its epilogue where the kernel allows (the activation's launch spared)
  // x_records: as qlinear's; records: room for the output's (the down projection's x), written beside it
  m.def("qlinear_act(Tensor x, Tensor blocks, int qtype, int n, int k, str act, bool static_weight=False, "
        "Tensor? x_records=None, Tensor(a!)? records=None, Tensor? norm_weight=None, float eps=0.0) -> Tensor");
  m.def("qembedding(Tensor ids, Tensor blocks, int qtype, int n, int k, ScalarType dtype) -> Tensor");
  // whether qlinear on x [rows, k] reads x_records (rms_norm and the activations write them only then)
  m.def("qlinear_reads_records(Tensor x, int qtype) -> bool");
  // whether qlinear takes norm_weight and accumulate in its kernel's launch on x [rows, k] with n outputs
  m.def("qlinear_takes_norm(Tensor x, int qtype, int n) -> bool");
  // the most rows of x qlinear takes on W [n, k] of qtype (more: dequantize + linear); no tensors, so one impl for all
  m.def("qlinear_max_rows(int qtype, int n, int k) -> int", &minfer::qlinear_max_rows);
  // ---- baselines (csrc/baselines/) ----
  m.def("gemm(Tensor a, Tensor b, float alpha=1.0, float beta=0.0, Tensor? c=None, bool trans_a=False, "
        "bool trans_b=False, str path=\"auto\") -> Tensor");
  m.def("tensor_core_gemm(Tensor a, Tensor b) -> Tensor");
  m.def("gemm_int8(Tensor a, Tensor b) -> Tensor");
  m.def("naive_attention(Tensor q, Tensor k, Tensor v, float? scale=None, bool is_causal=False) -> Tensor");
  m.def("tiled_attention(Tensor q, Tensor k, Tensor v, float? scale=None, bool is_causal=False) -> Tensor");
  m.def("flash_attention(Tensor q, Tensor k, Tensor v, float? scale=None, bool is_causal=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(minfer, CUDA, m) {
  // ---- engine ops ----
  m.impl("embedding", &minfer::embedding);
  m.impl("argmax", &minfer::argmax);
  m.impl("gumbel_argmax", &minfer::gumbel_argmax);
  m.impl("draw_filtered", &minfer::draw_filtered);
  m.impl("apply_token_bitmask", &minfer::apply_token_bitmask);
  // memory-bound kernels
  m.impl("rms_norm", &minfer::rms_norm);
  m.impl("fused_add_rms_norm", &minfer::fused_add_rms_norm);
  m.impl("rope", &minfer::rope);
  m.impl("silu_and_mul", &minfer::silu_and_mul);
  m.impl("gelu_tanh_and_mul", &minfer::gelu_tanh_and_mul);
  // gemm family
  m.impl("linear", &minfer::linear);
  m.impl("linear_act", &minfer::linear_act);
  m.impl("linear_plan", &minfer::linear_plan);
  // attention family
  m.impl("attention", &minfer::attention);
  m.impl("paged_attention", &minfer::paged_attention);
  m.impl("paged_attention_into", &minfer::paged_attention_into);
  m.impl("attention_decode_plan", &minfer::attention_decode_plan);
  // quantized weights (csrc/qgemm/)
  m.impl("dequantize", &minfer::dequantize);
  m.impl("dequantize_into", &minfer::dequantize_into);
  m.impl("qlinear", &minfer::qlinear);
  m.impl("qlinear_into", &minfer::qlinear_into);
  m.impl("qlinear_act", &minfer::qlinear_act);
  m.impl("qembedding", &minfer::qembedding);
  m.impl("qlinear_reads_records", &minfer::qlinear_reads_records);
  m.impl("qlinear_takes_norm", &minfer::qlinear_takes_norm);
  // ---- baselines ----
  m.impl("gemm", &minfer::gemm);
  m.impl("tensor_core_gemm", &minfer::tensor_core_gemm);
  m.impl("gemm_int8", &minfer::gemm_int8);
  m.impl("naive_attention", &minfer::naive_attention);
  m.impl("tiled_attention", &minfer::tiled_attention);
  m.impl("flash_attention", &minfer::flash_attention);
}

// memory-bound kernels: CPU tensors reach the same launchers, whose first check names the CPU argument
// (instead of the dispatcher's generic "could not run ... with arguments from the 'CPU' backend").
TORCH_LIBRARY_IMPL(minfer, CPU, m) {
  m.impl("embedding", &minfer::embedding);
  m.impl("argmax", &minfer::argmax);
  m.impl("gumbel_argmax", &minfer::gumbel_argmax);
  m.impl("draw_filtered", &minfer::draw_filtered);
  m.impl("apply_token_bitmask", &minfer::apply_token_bitmask);
  m.impl("rms_norm", &minfer::rms_norm);
  m.impl("fused_add_rms_norm", &minfer::fused_add_rms_norm);
  m.impl("rope", &minfer::rope);
  m.impl("silu_and_mul", &minfer::silu_and_mul);
  m.impl("gelu_tanh_and_mul", &minfer::gelu_tanh_and_mul);
}

// Importing minfer._C loads the library above; the module itself has no Python functions.
extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
