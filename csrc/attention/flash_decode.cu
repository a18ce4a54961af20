// Split-KV flash decode (one query per sequence) on tensor cores, with the split combine fused in: the
// launcher. The kernel is decode_kernel.cuh; the layout of a call (splits, merge kind, ring depth) is
// decode_plan.h.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include <string>

#include "attention/attention.h"
#include "attention/decode_kernel.cuh"
#include "attention/decode_plan.h"
#include "common/checks.h"
#include "common/dispatch.h"
#include "common/launch.h"
#include "common/split_counters.h"

namespace minfer::attn {

namespace {

using namespace decode;

template <typename T, int D, int RING>
void launch_ring(const DecodeParams& p, const Launch& l, int batch, int kv_blocks, cudaStream_t stream) {
  allow_smem<flash_decode_kernel<T, D, false, RING>, kDecodeSmemBytes<D, RING>>();
  allow_smem<flash_decode_kernel<T, D, true, RING>, kDecodeSmemBytes<D, RING>>();
  auto kernel = l.full ? flash_decode_kernel<T, D, true, RING> : flash_decode_kernel<T, D, false, RING>;
  launch_pdl(kernel, dim3(p.num_splits, kv_blocks, batch), dim3(kThreads), kDecodeSmemBytes<D, RING>, stream, p);
}

template <typename T, int D>
void launch(DecodeParams p, int batch, int kv_heads, const at::Tensor& q, cudaStream_t stream) {
  const int device = q.get_device();
  const int kv_blocks = kv_heads * p.hblocks;
  const int64_t pairs = static_cast<int64_t>(batch) * kv_blocks;
  const Launch l = plan_launch<D>(p, pairs, sm_count(device), thin_dram(device));
  p.num_splits = l.num_splits;
  p.all_resident = l.all_resident;
  at::Tensor ws, own_counters;
  if (l.num_splits > 1) {
    const int64_t n_o = pairs * l.num_splits * p.rows * D;
    ws = q.new_empty({n_o + 4 * pairs * l.num_splits * p.rows}, at::kFloat);
    p.ws_o = ws.data_ptr<float>();                      // [pairs, splits, rows, D]
    p.ws_ml = reinterpret_cast<float4*>(p.ws_o + n_o);  // [pairs, splits, rows]; n_o is a multiple of 4
    p.counters = split_counters(pairs, device, stream, q, own_counters);
  }
  if constexpr (kHasShortRing<D>)
    if (l.short_ring) return launch_ring<T, D, kShortRingBytes>(p, l, batch, kv_blocks, stream);
  launch_ring<T, D, kRingBytes<D>>(p, l, batch, kv_blocks, stream);
}

// Dispatches p (its layout fields set) for q's dtype and head_dim.
void run(DecodeParams& p, int batch, int kv_heads, const at::Tensor& q, double scale, bool stable_prefix) {
  p.scale_log2 = static_cast<float>(scale) * kLog2e;
  p.stable_prefix = stable_prefix;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  MINFER_DISPATCH_HALF(q.scalar_type(), "attention", [&] {
    MINFER_DISPATCH_HEAD_DIM(q.size(-1), D, [&] { launch<scalar_t, D>(p, batch, kv_heads, q, stream); });
  });
}

}  // namespace

void flash_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& start_pos, double scale, bool stable_prefix, int window, const decode::RopeIn& rope,
                  at::Tensor& out) {
  const int batch = q.size(0);
  if (batch == 0 || q.size(2) == 0) return;
  DecodeParams p = shape_params(q.size(2), k_cache.size(2), k_cache.size(1));
  p.q = q.data_ptr(), p.k = k_cache.data_ptr(), p.v = v_cache.data_ptr(), p.o = out.data_ptr();
  p.start_pos = start_pos.data_ptr<int>(), p.len_offset = 1, p.window = window, p.rope = rope;
  p.q_bs = q.stride(0), p.q_hs = q.stride(2);
  p.k_bs = k_cache.stride(0), p.k_ss = k_cache.stride(1), p.k_hs = k_cache.stride(2);
  p.v_bs = v_cache.stride(0), p.v_ss = v_cache.stride(1), p.v_hs = v_cache.stride(2);
  run(p, batch, k_cache.size(2), q, scale, stable_prefix);
}

void flash_decode_paged(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_table, const at::Tensor& seq_lens, int max_seqlen_k,
                        double scale, bool stable_prefix, int window, const decode::RopeIn& rope, at::Tensor& out) {
  const int batch = q.size(0);
  if (batch == 0 || q.size(1) == 0) return;
  const int page_size = k_cache.size(1);
  // The longest sequence bounds the plan (splits, ring depth) and every length the kernel reads.
  const int capacity = std::min<int64_t>(max_seqlen_k, block_table.size(1) * page_size);
  DecodeParams p = shape_params(q.size(1), k_cache.size(2), capacity);
  p.q = q.data_ptr(), p.k = k_cache.data_ptr(), p.v = v_cache.data_ptr(), p.o = out.data_ptr();
  p.start_pos = seq_lens.data_ptr<int>(), p.len_offset = 0, p.window = window, p.rope = rope;
  p.q_bs = q.stride(0), p.q_hs = q.stride(1);
  p.k_ss = k_cache.stride(1), p.k_hs = k_cache.stride(2);
  p.v_ss = v_cache.stride(1), p.v_hs = v_cache.stride(2);
  p.paged.block_table = block_table.data_ptr<int>(), p.paged.bt_stride = block_table.stride(0);
  p.paged.k_ps = k_cache.stride(0), p.paged.v_ps = v_cache.stride(0);
  p.paged.page_size = page_size, p.paged.num_pages = k_cache.size(0);
  run(p, batch, k_cache.size(2), q, scale, stable_prefix);
}

}  // namespace minfer::attn
