// KV-cache write: k_cache[b, positions[b, s]] <- k[b, s] (and v likewise).
// A token's [kv_heads, head_dim] slice is one contiguous row of `row` elements on both sides, so the
// write is a row copy. Grid x walks packs of a row, grid y walks tokens (b, s). A position outside
// [0, capacity) is skipped: the cache is never written out of bounds.
// On Hopper it is launched as a programmatic dependent and lets its own dependent in at once: decode
// attention, next in the engine, starts reading the older cache rows while this waits for its inputs
// and writes the newest.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "common/checks.h"
#include "common/dispatch.h"
#include "common/launch.h"
#include "common/ptx.cuh"
#include "common/vec.h"

namespace minfer {

namespace {

struct KvStrides {
  int64_t k_batch, k_seq, v_batch, v_seq;  // element strides of k/v in their batch and seq dims
};

template <typename T, int W, typename index_t>
__global__ void kv_cache_write_kernel(T* __restrict__ k_cache,           // [cache_batch, capacity, kv_heads, head_dim]
                                      T* __restrict__ v_cache,           // same
                                      const T* __restrict__ k,           // [batch, seq, kv_heads, head_dim], strided
                                      const T* __restrict__ v,           // same
                                      const index_t* __restrict__ positions,  // [batch, seq], contiguous
                                      KvStrides st, int64_t seq, int64_t capacity, int row, int64_t tokens) {
  using P = Pack<T, W>;
  // The dependent may launch before this waits: it too waits for this grid (and so for the one before)
  // to complete before it touches anything that either writes.
  ptx::griddep_launch_dependents();
  ptx::griddep_wait();  // k, v and positions may be the previous kernel's
  const int p = blockIdx.x * blockDim.x + threadIdx.x;
  if (p >= row / W) return;
  for (int64_t t = blockIdx.y; t < tokens; t += gridDim.y) {
    const int64_t pos = static_cast<int64_t>(positions[t]);
    if (pos < 0 || pos >= capacity) continue;
    const int64_t b = t / seq, s = t - b * seq;
    P kp, vp;
    kp.load(k + b * st.k_batch + s * st.k_seq + p * W);
    vp.load(v + b * st.v_batch + s * st.v_seq + p * W);
    const int64_t dst = (b * capacity + pos) * row + p * W;
    kp.store(k_cache + dst);
    vp.store(v_cache + dst);
  }
}

void check_kv(const torch::Tensor& t, const char* name) {
  MINFER_CHECK_CUDA(t);
  MINFER_CHECK(t.dim() == 4, "kv_cache_write: ", name, " must be [batch, seq, kv_heads, head_dim], got shape ",
              t.sizes());
  MINFER_CHECK(t.stride(3) == 1 && (t.size(2) <= 1 || t.stride(2) == t.size(3)), "kv_cache_write: ", name,
              " must have contiguous [kv_heads, head_dim] (strides head_dim, 1); only batch and seq may be strided, "
              "got strides ", t.strides());
}

}  // namespace

void kv_cache_write(const torch::Tensor& k_cache, const torch::Tensor& v_cache, const torch::Tensor& k,
                    const torch::Tensor& v, const torch::Tensor& positions) {
  MINFER_CHECK_CUDA(k_cache);
  MINFER_CHECK_CUDA(v_cache);
  MINFER_CHECK_CUDA(positions);
  check_kv(k, "k");
  check_kv(v, "v");
  MINFER_CHECK_SAME_DEVICE(k_cache, v_cache);
  MINFER_CHECK_SAME_DEVICE(k_cache, k);
  MINFER_CHECK_SAME_DEVICE(k_cache, v);
  MINFER_CHECK_SAME_DEVICE(k_cache, positions);
  MINFER_CHECK_FLOAT(k_cache);
  MINFER_CHECK_SAME_DTYPE(k_cache, v_cache);
  MINFER_CHECK_SAME_DTYPE(k, k_cache);
  MINFER_CHECK_SAME_DTYPE(v, v_cache);
  MINFER_CHECK(k_cache.dim() == 4, "kv_cache_write: k_cache must be [batch, capacity, kv_heads, head_dim], got shape ",
              k_cache.sizes());
  MINFER_CHECK(v_cache.sizes() == k_cache.sizes(), "kv_cache_write: v_cache must have k_cache's shape ",
              k_cache.sizes(), ", got ", v_cache.sizes());
  MINFER_CHECK_CONTIGUOUS(k_cache);
  MINFER_CHECK_CONTIGUOUS(v_cache);
  MINFER_CHECK(v.sizes() == k.sizes(), "kv_cache_write: v must have k's shape ", k.sizes(), ", got ", v.sizes());
  const int64_t batch = k.size(0), seq = k.size(1), kv_heads = k.size(2), head_dim = k.size(3);
  MINFER_CHECK(batch <= k_cache.size(0) && kv_heads == k_cache.size(2) && head_dim == k_cache.size(3),
              "kv_cache_write: k [batch, seq, kv_heads, head_dim] = ", k.sizes(),
              " does not fit k_cache [batch, capacity, kv_heads, head_dim] = ", k_cache.sizes());
  MINFER_CHECK(positions.dim() == 2 && positions.size(0) == batch && positions.size(1) == seq,
              "kv_cache_write: positions must be [batch, seq] = [", batch, ", ", seq, "], got shape ",
              positions.sizes());
  MINFER_CHECK_CONTIGUOUS(positions);
  MINFER_CHECK_INDEX(positions);
  const int64_t tokens = batch * seq, row = kv_heads * head_dim;
  if (tokens == 0 || row == 0) return;
  MINFER_CHECK(row < (int64_t(1) << 31), "kv_cache_write: kv_heads * head_dim too large (", row, ")");
  const c10::cuda::CUDAGuard guard(k_cache.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  const KvStrides st{k.stride(0), k.stride(1), v.stride(0), v.stride(1)};
  MINFER_DISPATCH_FLOAT(k_cache.scalar_type(), "kv_cache_write", [&] {
    MINFER_DISPATCH_INDEX(positions.scalar_type(), "kv_cache_write", [&] {
      constexpr int N = 16 / sizeof(scalar_t);
      auto* kc = reinterpret_cast<scalar_t*>(k_cache.data_ptr());
      auto* vc = reinterpret_cast<scalar_t*>(v_cache.data_ptr());
      const auto* kp = reinterpret_cast<const scalar_t*>(k.data_ptr());
      const auto* vp = reinterpret_cast<const scalar_t*>(v.data_ptr());
      const auto* pos = positions.data_ptr<index_t>();
      const int64_t es = sizeof(scalar_t);
      const bool wide = rows_aligned16(kc, row, row, es) && rows_aligned16(vc, row, row, es) &&
                        rows_aligned16(kp, row, st.k_batch, es) && (st.k_seq * es) % 16 == 0 &&
                        rows_aligned16(vp, row, st.v_batch, es) && (st.v_seq * es) % 16 == 0;
      const int w = wide ? N : 1;
      const int packs = static_cast<int>(row / w);
      const int threads = std::min(256, round_up(packs, 32));
      const dim3 grid((packs + threads - 1) / threads, static_cast<unsigned>(std::min<int64_t>(tokens, 65535)));
      auto kernel = wide ? kv_cache_write_kernel<scalar_t, N, index_t> : kv_cache_write_kernel<scalar_t, 1, index_t>;
      launch_pdl(kernel, grid, dim3(threads), 0, stream, kc, vc, kp, vp, pos, st, seq, k_cache.size(1),
                 static_cast<int>(row), tokens);
    });
  });
}

}  // namespace minfer
