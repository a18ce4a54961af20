// Shared host/device declarations of the attention family (csrc/attention/*.cu).
#pragma once
#include <cuda_runtime.h>

#include "attention/decode_params.h"
#include "attention/kv_rows.cuh"
#include "common/tensor.h"

namespace minfer::attn {

// Where the flash prefill kernel finds its operands. Strides are in elements; head_dim is contiguous.
struct FlashParams {
  const void* q;  // rows (batch b, query s, head h) at b*q_bs + s*q_ss + h*q_hs
  const void* k;  // rows (b, key j, kv head) likewise
  const void* v;
  void* o;
  int64_t q_bs, q_ss, q_hs;
  int64_t k_bs, k_ss, k_hs;
  int64_t v_bs, v_ss, v_hs;
  int64_t o_bs, o_ss, o_hs;
  int seq_q;
  int seq_k;               // keys per sequence; with start_pos: the cache capacity (an upper bound)
  int group;               // q heads per kv head
  const int* start_pos;    // [batch] or nullptr. Set: query s sits at start_pos[b] + s, causal, kv length
                           // start_pos[b] + seq_q. Null: bottom-right causal (if asked) over seq_k keys.
  float scale_log2;        // softmax scale * log2(e)
  // Ragged queries (the paged engine's steps; sm80 kernel only): sequence b's queries are rows
  // cu_seqlens_q[b] .. cu_seqlens_q[b + 1] (b stride 0), the last of its seq_lens[b] positions; seq_q is
  // then the largest count (the grid's), seq_k a bound on every seq_lens[b], total_q the rows of q and o.
  const int* cu_seqlens_q = nullptr;
  const int* seq_lens = nullptr;
  int total_q = 0;
  PagedKv paged;           // K/V in pages (k_bs, v_bs unused), or the dense layout
  int window = 0;          // > 0: a query at position p sees only keys p - window < key <= p (sliding window)
  // Split-KV (ragged only, chosen by flash_prefill): kv_splits CTAs share each query block's key tiles, each
  // writing its rows' unnormalized fp32 output to part_o [kv_splits, total_q, heads, head_dim] and their
  // (max, sum) to part_ml [kv_splits, total_q, heads, 2]; a combine kernel merges them into o.
  int kv_splits = 1;
  float* part_o = nullptr;
  float* part_ml = nullptr;
  // GQA packing (ragged only, chosen by flash_prefill): pack = group puts a kv head's q heads in one CTA, its
  // rows (token, head) pairs, token-major; 1: a CTA's rows are one head's tokens.
  int pack = 1;
};

#ifdef __CUDACC__
// Where sequence b's queries sit (query s at position q_off + s) and how many keys it has, for both
// prefill kernels: after start_pos[b] in the cache (capped at the capacity seq_k), or bottom-right.
__device__ __forceinline__ void query_window(const FlashParams& p, int b, int& q_off, int& kv_len) {
  if (p.start_pos != nullptr) {
    q_off = p.start_pos[b];
    kv_len = min(q_off + p.seq_q, p.seq_k);  // seq_k is the cache capacity: never read past it
  } else {
    q_off = p.seq_k - p.seq_q;
    kv_len = p.seq_k;
  }
}
// Sequence b's queries: n_q rows from row0 (of the s stride, after b * the b stride), at positions q_off + s,
// over kv_len keys.
struct SeqRows {
  int row0, n_q, q_off, kv_len;
};
__device__ __forceinline__ SeqRows seq_rows(const FlashParams& p, int b) {
  SeqRows r{0, p.seq_q, 0, 0};
  if (p.cu_seqlens_q == nullptr) {
    query_window(p, b, r.q_off, r.kv_len);
    return r;
  }
  // Clamped into q's rows and the grid: a bad cu_seqlens_q drops rows, never reads or writes out of bounds.
  r.row0 = min(max(p.cu_seqlens_q[b], 0), p.total_q);
  r.n_q = min(max(min(p.cu_seqlens_q[b + 1], p.total_q) - r.row0, 0), p.seq_q);
  r.kv_len = min(p.seq_lens[b], p.seq_k);
  r.q_off = r.kv_len - r.n_q;
  return r;
}

#endif

// flash_prefill.cu: fp16/bf16, head_dim 64, 128 or 256. On Hopper it runs flash_prefill_sm90 when that takes
// the case, else the mma.sync kernel (the sm_80 path).
void flash_prefill(const FlashParams& p, at::ScalarType dtype, int head_dim, bool causal, int batch, int heads,
                   cudaStream_t stream);

// flash_prefill_sm90.cu: the wgmma + TMA kernel. Returns false (launching nothing) when the device is not
// compute capability 9.x or TMA cannot describe the operands (16-byte aligned bases and strides needed).
bool flash_prefill_sm90(const FlashParams& p, at::ScalarType dtype, int head_dim, bool causal, int batch, int heads,
                        cudaStream_t stream);

// flash_decode.cu: the engine op for seq == 1. q [batch, 1, heads, head_dim] (strided batch),
// caches [batch, capacity, kv_heads, head_dim]; out [batch, 1, heads, head_dim] contiguous.
// stable_prefix: start_pos and the cache rows before start_pos[b] are not written by any kernel that may
// still be running when this one starts (the engine's decode step: they were written by earlier steps),
// so the kernel may start reading them before the previous kernel in the stream is done.
// window > 0: the query at position p sees only keys p - window < key <= p, and only they are read.
// rope: the newest key's rope and cache write (decode_params.h; cos_sin == nullptr: none).
void flash_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& start_pos, double scale, bool stable_prefix, int window,
                  const decode::RopeIn& rope, at::Tensor& out);
// flash_decode.cu, the paged layout: q [batch, heads, head_dim] (strided batch), caches [num_pages, page_size,
// kv_heads, head_dim] with page_size a multiple of 16, block_table [batch, max_pages] int32, seq_lens [batch]
// int32 (keys of each sequence, its newest last), max_seqlen_k >= every seq_lens[b]; out [batch, heads,
// head_dim] contiguous. stable_prefix as above, of seq_lens, the block table and the rows before the newest.
void flash_decode_paged(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_table, const at::Tensor& seq_lens, int max_seqlen_k,
                        double scale, bool stable_prefix, int window, const decode::RopeIn& rope, at::Tensor& out);
// decode_plan.cu: what flash_decode would launch for sequences of `length` keys (the split count, the
// splits that get keys, how they merge, the ring depth), launching nothing.
std::string flash_decode_plan(const at::Tensor& q, const at::Tensor& k_cache, int length, int window);

constexpr float kLog2e = 1.4426950408889634f;

}  // namespace minfer::attn
