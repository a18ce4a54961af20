// Host-side checks shared by the quantized-weight launchers: the qtype's block size and the blocks tensor
// of a W [n, k] kept as ggml blocks (row r = its k / elems blocks, uint8 [n, k / elems * bytes]).
#pragma once
#include "common/checks.h"
#include "common/tensor.h"
#include "common/vec.h"
#include "qgemm/formats.cuh"

namespace minfer::qgemm {

struct BlockSize {
  int elems, bytes;
};

// The block size of a qtype; an unknown id fails a check that names `arg`.
inline BlockSize block_size(int64_t qtype) {
  switch (qtype) {
    case kQ4_0: return {32, 18};
    case kQ4_1: return {32, 20};
    case kQ5_0: return {32, 22};
    case kQ5_1: return {32, 24};
    case kQ8_0: return {32, 34};
    case kQ4_K: return {256, 144};
    case kQ5_K: return {256, 176};
    case kQ6_K: return {256, 210};
    default:
      MINFER_CHECK(false, "qtype must be a GGUF type id of Q4_0 (2), Q4_1 (3), Q5_0 (6), Q5_1 (7), Q8_0 (8), Q4_K (12), "
                          "Q5_K (13) or Q6_K (14), got ", qtype);
  }
  return {0, 0};
}

// kTiled in a qtype: W's rows are stored in groups of 16, each group chunk-major (quant.py, tile_rows): row 16 t + r's
// 256-k chunk c at byte 16 t row_bytes + (16 c + r) chunk_bytes, so that a 16-row tile's chunk is one run of bytes
// (Q4_K or Q6_K, n a multiple of 16).
constexpr int64_t kTiled = 256;
inline int64_t base_qtype(int64_t qtype) { return qtype & ~kTiled; }
inline bool is_tiled(int64_t qtype) { return (qtype & kTiled) != 0; }

// blocks: uint8 [n, k / elems * bytes], contiguous, 16-byte aligned (the kernels read it in aligned
// 16-byte pieces), on CUDA; k a positive multiple of the block's elements; qtype possibly with kTiled. Returns the
// bytes of a row.
inline int64_t check_blocks(const char* op, const at::Tensor& blocks, int64_t qtype, int64_t n, int64_t k) {
  MINFER_CHECK(!is_tiled(qtype) || ((base_qtype(qtype) == kQ4_K || base_qtype(qtype) == kQ6_K) && n % 16 == 0), op,
               ": tiled blocks (qtype | 256) must be Q4_K or Q6_K with n a multiple of 16, got qtype ", qtype, ", n ", n);
  const BlockSize f = block_size(base_qtype(qtype));
  MINFER_CHECK_CUDA(blocks);
  MINFER_CHECK(blocks.scalar_type() == at::kByte, op, ": blocks must be uint8, got ", blocks.scalar_type());
  MINFER_CHECK(n >= 0 && n < (int64_t(1) << 31), op, ": n must be in [0, 2^31), got ", n);
  MINFER_CHECK(k > 0 && k % f.elems == 0 && k < (int64_t(1) << 31), op, ": k must be a positive multiple of ", f.elems,
               " for qtype ", qtype, ", got ", k);
  const int64_t row_bytes = k / f.elems * f.bytes;
  MINFER_CHECK(blocks.dim() == 2 && blocks.size(0) == n && blocks.size(1) == row_bytes, op, ": blocks must have shape [",
               n, ", ", row_bytes, "] (n, k / ", f.elems, " * ", f.bytes, "), got ", blocks.sizes());
  MINFER_CHECK(blocks.is_contiguous(), op, ": blocks must be contiguous");
  MINFER_CHECK(is_aligned16(blocks.data_ptr()), op, ": blocks must be 16-byte aligned");
  return row_bytes;
}

// The output dtype of a dequantizing op: fp16 or bf16.
inline void check_half_dtype(const char* op, const char* arg, at::ScalarType dtype) {
  MINFER_CHECK(dtype == at::kHalf || dtype == at::kBFloat16, op, ": ", arg, " must be float16 or bfloat16, got ", dtype);
}

}  // namespace minfer::qgemm
