// Rotary position embedding, in place on q and k (both may be strided views into a fused qkv tensor).
//   is_neox:  pairs (i, i + rot/2)  (rotate-half);   else pairs (2i, 2i + 1)  (GPT-J, interleaved)
//   (x1, x2) <- (x1 cos - x2 sin, x2 cos + x1 sin), cos/sin = cos_sin[pos, i] / cos_sin[pos, rot/2 + i], fp32.
// Only the first rot dims of each head rotate (partial rotary); the rest are not touched.
//
// One block per token: the token's cos|sin row is staged once in shared memory, then the threads walk
// (head, pack) items over q's and k's heads; where every item has a thread (decode), each thread reads its own
// cos|sin from global memory instead, and writes its rotated k packs to the cache (rope_one_pass). A NeoX item
// is two packs of W elements (first and second half); a GPT-J item is one pack of W elements = W/2 pairs.
// W = 16 bytes when the layout allows it.
// A position outside [0, max_position) never reads the table: its rotated dims become NaN.
// With q_weight and k_weight (Gemma 3's and Qwen3's q/k norms), every head is first RMS-normalised over
// head_dim (rounded to the storage dtype, as a separate rms_norm's output), then rotated, one warp a head: where
// the rotation is whole and a head is at most a pack a lane, the head stays in the warp's registers
// (qk_norm_rope_one_pass); else a pass for the sum of squares, one that writes the normalised head, and the
// rotation, which reads the pairs back (other lanes wrote them: L1-hot, ordered by __syncwarp).
// With a paged cache (k_cache, v_cache, slot_mapping), the block then copies its token's rotated k row and
// its v row to cache row slot_mapping[token] (skipped outside the pool), so that the decode step needs no
// separate cache-write launch.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "common/checks.h"
#include "common/dispatch.h"
#include "common/launch.h"
#include "common/ptx.cuh"
#include "common/reduce.h"
#include "common/rope.cuh"
#include "common/vec.h"

namespace minfer {

namespace {

// cs[0 .. rot) = cos | sin of position pos (NaN outside [0, max_position): the table is never read there).
template <typename index_t>
__device__ __forceinline__ void load_cos_sin(float* cs, const float* cos_sin, index_t position, int64_t max_position,
                                             int rot) {
  const int64_t pos = static_cast<int64_t>(position);
  const bool ok = pos >= 0 && pos < max_position;
  for (int i = threadIdx.x; i < rot; i += blockDim.x) cs[i] = ok ? cos_sin[pos * rot + i] : nan_f();
}

// The paged cache write folded into rope: k_cache == nullptr means none.
template <typename T>
struct CacheRows {
  T* k_cache;         // [slots, kv_heads, head_dim]: the pool's pages seen as rows
  T* v_cache;         // same
  const T* v;         // [tokens, kv_heads, head_dim], token stride v_stride
  int64_t v_stride;
  const int64_t* slots;  // [tokens]
  int64_t num_slots;
  int64_t num_heads_dim;  // a cache row: kv_heads x head_dim
};

// After the rotation: the token's k row (rotated in place by the block's threads) and its v row to
// cache row slots[token]. Every thread of the block reaches it (it holds a barrier).
template <typename T, int W>
__device__ __forceinline__ void write_cache_rows(const CacheRows<T>& c, const T* k_row, int64_t token, int row) {
  if (c.k_cache == nullptr) return;
  __syncthreads();  // other threads rotated k's packs; global writes are visible to the block after it
  const int64_t slot = c.slots[token];
  if (slot < 0 || slot >= c.num_slots) return;
  constexpr int CW = W * sizeof(T) == 16 ? W : 1;  // the launcher checked 16-byte rows for the wide form only
  using P = Pack<T, CW>;
  const T* v_row = c.v + token * c.v_stride;
  for (int p = threadIdx.x; p < row / CW; p += blockDim.x) {
    P kp, vp;
    kp.load(k_row + p * CW);
    vp.load(v_row + p * CW);
    kp.store(c.k_cache + slot * row + p * CW);
    vp.store(c.v_cache + slot * row + p * CW);
  }
}

// Item p of a head: NeoX, packs p of both halves (a at p W, b at half + p W); GPT-J, pack p (a: W / 2 pairs).
template <typename T, int W, bool kNeox>
struct Item {
  Pack<T, W> a, b;
  __device__ __forceinline__ void load(const T* head, int p, int half) {
    a.load(head + p * W);
    if constexpr (kNeox) b.load(head + half + p * W);
  }
  __device__ __forceinline__ void store(T* head, int p, int half) const {
    a.store(head + p * W);
    if constexpr (kNeox) b.store(head + half + p * W);
  }
  // Rotates it, cs_at(i) giving element i of the position's cos | sin.
  template <typename CsAt>
  __device__ __forceinline__ void rotate(int p, int half, CsAt cs_at) {
    if constexpr (kNeox) {
#pragma unroll
      for (int e = 0; e < W; ++e) {
        float x1 = to_float(a.v[e]), x2 = to_float(b.v[e]);
        rotate_pair(x1, x2, cs_at(p * W + e), cs_at(half + p * W + e));
        a.v[e] = from_float<T>(x1), b.v[e] = from_float<T>(x2);
      }
    } else {
#pragma unroll
      for (int e = 0; e < W / 2; ++e) {
        const int i = p * (W / 2) + e;
        float x1 = to_float(a.v[2 * e]), x2 = to_float(a.v[2 * e + 1]);
        rotate_pair(x1, x2, cs_at(i), cs_at(half + i));
        a.v[2 * e] = from_float<T>(x1), a.v[2 * e + 1] = from_float<T>(x2);
      }
    }
  }
};

// Rotates item p of one head in place, cos | sin from cs.
template <typename T, int W, bool kNeox>
__device__ __forceinline__ void rotate_item(T* head, int p, const float* cs, int half) {
  Item<T, W, kNeox> it;
  it.load(head, p, half);
  it.rotate(p, half, [&](int i) { return cs[i]; });
  it.store(head, p, half);
}

// A token whose items each have a thread (decode), where a cache row, if any, is rotated in full (rot == head_dim):
// the item's packs, its v packs and the slot load beside the position, cos | sin right after it from global memory,
// and the rotated k packs go to the cache from registers. After the wait that is two dependent L2 round trips
// (position, then cos | sin), where the staged form below takes five (position, cos | sin, the packs, the slot,
// k's row read back). The same values, in the same order: the same bits. 8B Q4_K_M batch-1 step, H200, one build, a
// switch, two rounds: 2.100 / 2.103 -> 2.082 / 2.083 ms.
template <typename T, int W, bool kNeox, typename index_t>
__device__ __forceinline__ void rope_one_pass(T* q, int64_t q_stride, T* k, int64_t k_stride, index_t position,
                                             const float* cos_sin, int64_t max_position, int heads, int head_dim,
                                             int rot, int per_head, const CacheRows<T>& cache, int64_t token) {
  const int h = threadIdx.x / per_head, p = threadIdx.x - h * per_head, half = rot / 2;
  const bool is_k = h >= heads, to_cache = is_k && cache.k_cache != nullptr;
  T* head = !is_k ? q + token * q_stride + static_cast<int64_t>(h) * head_dim
                  : k + token * k_stride + static_cast<int64_t>(h - heads) * head_dim;
  const int64_t slot = to_cache ? cache.slots[token] : -1;
  Item<T, W, kNeox> it, v;
  it.load(head, p, half);
  const int64_t in_row = static_cast<int64_t>(h - heads) * head_dim;  // k's head in a cache row
  if (to_cache) v.load(cache.v + token * cache.v_stride + in_row, p, half);
  const int64_t pos = static_cast<int64_t>(position);
  const bool ok = pos >= 0 && pos < max_position;
  const float* cs = cos_sin + (ok ? pos : 0) * rot;
  it.rotate(p, half, [&](int i) { return ok ? cs[i] : nan_f(); });
  it.store(head, p, half);
  if (!to_cache || slot < 0 || slot >= cache.num_slots) return;
  const int64_t at = slot * cache.num_heads_dim + in_row;
  it.store(cache.k_cache + at, p, half);
  v.store(cache.v_cache + at, p, half);
}

// q and k are not __restrict__: they are usually views of the same qkv buffer (disjoint elements).
template <typename T, int W, bool kNeox, typename index_t>
__global__ void rope_kernel(T* q, int64_t q_stride,                 // [tokens, heads, head_dim], token stride
                            T* k, int64_t k_stride,                 // [tokens, kv_heads, head_dim]
                            const index_t* __restrict__ positions,  // [tokens]
                            const float* __restrict__ cos_sin,      // [max_position, rot]
                            int64_t max_position, int heads, int kv_heads, int head_dim, int rot,
                            CacheRows<T> cache, bool early) {
  extern __shared__ float cs[];  // [rot]: cos | sin at this token's position
  const int64_t token = blockIdx.x;
  const int per_head = (kNeox ? rot / 2 : rot) / W;
  const int items = (heads + kv_heads) * per_head;
  ptx::griddep_enter(early);  // launched early: q, k and positions may be the previous kernel's
  if (items <= int(blockDim.x) && (cache.k_cache == nullptr || rot == head_dim)) {
    if (int(threadIdx.x) < items)
      rope_one_pass<T, W, kNeox>(q, q_stride, k, k_stride, positions[token], cos_sin, max_position, heads, head_dim,
                                 rot, per_head, cache, token);
    return;
  }
  load_cos_sin(cs, cos_sin, positions[token], max_position, rot);
  __syncthreads();

  for (int it = threadIdx.x; it < items; it += blockDim.x) {
    const int h = it / per_head, p = it - h * per_head;
    T* head = h < heads ? q + token * q_stride + static_cast<int64_t>(h) * head_dim
                        : k + token * k_stride + static_cast<int64_t>(h - heads) * head_dim;
    rotate_item<T, W, kNeox>(head, p, cs, rot / 2);
  }
  write_cache_rows<T, W>(cache, k + token * k_stride, token, kv_heads * head_dim);
}

// A pack moved from lane src of the warp (every lane calls it).
template <typename T, int W>
__device__ __forceinline__ Pack<T, W> shfl_pack(const Pack<T, W>& p, int src) {
  Pack<T, W> r;
  if constexpr (sizeof(p) % 4 == 0) {
    const uint32_t* in = reinterpret_cast<const uint32_t*>(p.v);
    uint32_t* out = reinterpret_cast<uint32_t*>(r.v);
#pragma unroll
    for (int i = 0; i < int(sizeof(p) / 4); ++i) out[i] = __shfl_sync(0xffffffffu, in[i], src);
  } else {
    static_assert(sizeof(T) == 2, "a pack of under 4 bytes holds 2-byte elements");
#pragma unroll
    for (int e = 0; e < W; ++e) {
      uint16_t bits;
      memcpy(&bits, &p.v[e], 2);
      bits = static_cast<uint16_t>(__shfl_sync(0xffffffffu, static_cast<uint32_t>(bits), src));
      memcpy(&r.v[e], &bits, 2);
    }
  }
  return r;
}

// q/k norm and rope where a warp holds a head as a pack a lane (rot == head_dim, head_dim / W <= 32): the head, its
// norm weight, the slot and v's pack load together with the position, cos | sin right after it from global memory;
// the sum of squares is the warp's shuffles, a NeoX pair's other half comes from lane p +- packs / 2 by shuffle, and
// k goes to the cache from registers. After the wait that is two dependent L2 round trips (position, then cos | sin)
// where the staged form below takes about six (position, cos | sin, the head, its weight, the slot, k's
// row after the block's barrier). The same values in the same order as the staged form.
template <typename T, int W, bool kNeox, typename index_t>
__device__ __forceinline__ void qk_norm_rope_one_pass(T* q, int64_t q_stride, T* k, int64_t k_stride, index_t position,
                                                      const float* cos_sin, const T* q_weight, const T* k_weight,
                                                      float eps, int64_t max_position, int heads, int kv_heads,
                                                      int head_dim, const CacheRows<T>& cache, int64_t token) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  const int packs = head_dim / W, half_packs = packs / 2, half = head_dim / 2;
  const bool mine = lane < packs;
  const bool first = lane < half_packs;                          // NeoX: this lane's pack is in the first half
  const int partner = first ? lane + half_packs : lane - half_packs;  // the pack it pairs with
  const int64_t slot = cache.k_cache != nullptr ? cache.slots[token] : -1;
  const bool slot_ok = slot >= 0 && slot < cache.num_slots;
  const int64_t pos = static_cast<int64_t>(position);
  const bool ok = pos >= 0 && pos < max_position;
  const float* cs = cos_sin + (ok ? pos : 0) * head_dim;
  for (int h = warp; h < heads + kv_heads; h += warps) {
    const bool is_k = h >= heads, to_cache = is_k && slot_ok;
    T* head = !is_k ? q + token * q_stride + static_cast<int64_t>(h) * head_dim
                    : k + token * k_stride + static_cast<int64_t>(h - heads) * head_dim;
    const int64_t in_row = static_cast<int64_t>(h - heads) * head_dim + lane * W;  // k's pack in a cache row
    Pack<T, W> x{}, g{}, v{};
    if (mine) {
      x.load(head + lane * W);
      g.load((is_k ? k_weight : q_weight) + lane * W);
      if (to_cache) v.load(cache.v + token * cache.v_stride + in_row);
    }
    float ss = 0.f;
#pragma unroll
    for (int e = 0; e < W; ++e) ss += to_float(x.v[e]) * to_float(x.v[e]);
    const float scale = rsqrtf(warp_sum(ss) / head_dim + eps);
#pragma unroll
    for (int e = 0; e < W; ++e) x.v[e] = from_float<T>(to_float(x.v[e]) * scale * to_float(g.v[e]));
    Item<T, W, kNeox> it;
    auto cs_at = [&](int i) { return ok ? cs[i] : nan_f(); };
    if constexpr (kNeox) {
      const Pack<T, W> other = shfl_pack(x, partner);
      it.a = first ? x : other, it.b = first ? other : x;
      it.rotate(first ? lane : partner, half, cs_at);
      x = first ? it.a : it.b;
    } else {
      it.a = x;
      it.rotate(lane, half, cs_at);
      x = it.a;
    }
    if (!mine) continue;
    x.store(head + lane * W);
    if (!to_cache) continue;
    x.store(cache.k_cache + slot * cache.num_heads_dim + in_row);
    v.store(cache.v_cache + slot * cache.num_heads_dim + in_row);
  }
}

// q/k norm, then rope: one warp a head (see the top).
template <typename T, int W, bool kNeox, typename index_t>
__global__ void qk_norm_rope_kernel(T* q, int64_t q_stride,                 // [tokens, heads, head_dim]
                                    T* k, int64_t k_stride,                 // [tokens, kv_heads, head_dim]
                                    const index_t* __restrict__ positions,  // [tokens]
                                    const float* __restrict__ cos_sin,      // [max_position, rot]
                                    const T* __restrict__ q_weight,         // [head_dim]
                                    const T* __restrict__ k_weight,         // [head_dim]
                                    float eps, int64_t max_position, int heads, int kv_heads, int head_dim, int rot,
                                    CacheRows<T> cache, bool early) {
  extern __shared__ float cs[];  // [rot]: cos | sin at this token's position
  const int64_t token = blockIdx.x;
  ptx::griddep_enter(early);  // launched early: q, k and positions may be the previous kernel's
  if (rot == head_dim && head_dim / W <= 32) {
    qk_norm_rope_one_pass<T, W, kNeox>(q, q_stride, k, k_stride, positions[token], cos_sin, q_weight, k_weight, eps,
                                       max_position, heads, kv_heads, head_dim, cache, token);
    return;
  }
  load_cos_sin(cs, cos_sin, positions[token], max_position, rot);
  __syncthreads();

  using P = Pack<T, W>;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  const int packs = head_dim / W, per_head = (kNeox ? rot / 2 : rot) / W;
  for (int h = warp; h < heads + kv_heads; h += warps) {
    T* head = h < heads ? q + token * q_stride + static_cast<int64_t>(h) * head_dim
                        : k + token * k_stride + static_cast<int64_t>(h - heads) * head_dim;
    const T* weight = h < heads ? q_weight : k_weight;
    float ss = 0.f;
    for (int p = lane; p < packs; p += 32) {
      P v;
      v.load(head + p * W);
#pragma unroll
      for (int e = 0; e < W; ++e) ss += to_float(v.v[e]) * to_float(v.v[e]);
    }
    const float scale = rsqrtf(warp_sum(ss) / head_dim + eps);
    for (int p = lane; p < packs; p += 32) {
      P v, g;
      v.load(head + p * W);
      g.load(weight + p * W);
#pragma unroll
      for (int e = 0; e < W; ++e) v.v[e] = from_float<T>(to_float(v.v[e]) * scale * to_float(g.v[e]));
      v.store(head + p * W);
    }
    __syncwarp();  // the rotation's pairs were written by other lanes
    for (int p = lane; p < per_head; p += 32) rotate_item<T, W, kNeox>(head, p, cs, rot / 2);
    __syncwarp();  // the lanes start the next head together (heads are disjoint: no data hazard)
  }
  write_cache_rows<T, W>(cache, k + token * k_stride, token, kv_heads * head_dim);
}

template <typename T, int W, bool kNeox, typename index_t>
void launch_rope(T* q, int64_t q_stride, T* k, int64_t k_stride, const index_t* positions, const float* cos_sin,
                 const T* q_weight, const T* k_weight, float eps, int64_t max_position, int64_t tokens, int heads,
                 int kv_heads, int head_dim, int rot, const CacheRows<T>& cache, cudaStream_t stream) {
  if (q_weight != nullptr) {
    const int threads = 32 * std::min(heads + kv_heads, 16);  // a warp a head
    launch_pdl(qk_norm_rope_kernel<T, W, kNeox, index_t>, dim3(tokens), dim3(threads), rot * sizeof(float), stream, q,
             q_stride, k, k_stride, positions, cos_sin, q_weight, k_weight, eps, max_position, heads, kv_heads,
             head_dim, rot, cache, pdl_early(tokens, true));
  } else {
    const int items = (heads + kv_heads) * ((kNeox ? rot / 2 : rot) / W);
    // Up to 16 tokens an item a thread: a decode token's 320 items (32 + 8 heads x 8 packs) in one pass, not two of
    // 256 (the 8B Q4_K_M step -0.5%). Past that, 256: 1024 lost at 16384 tokens (perf/memory.md).
    const int threads = std::min(tokens <= 16 ? 1024 : 256, round_up(items, 32));
    launch_pdl(rope_kernel<T, W, kNeox, index_t>, dim3(tokens), dim3(threads), rot * sizeof(float), stream, q, q_stride,
             k, k_stride, positions, cos_sin, max_position, heads, kv_heads, head_dim, rot, cache,
             pdl_early(tokens, true));
  }
}

void check_heads(const at::Tensor& t, const char* name) {
  MINFER_CHECK(t.dim() == 3, "rope: ", name, " must be [tokens, heads, head_dim], got shape ", t.sizes());
  MINFER_CHECK(t.stride(2) == 1, "rope: ", name, " must have a contiguous head_dim (stride(2) == 1), got stride ",
              t.stride(2));
  MINFER_CHECK(t.size(1) <= 1 || t.stride(1) == t.size(2), "rope: ", name,
              " must have its heads packed (stride(1) == head_dim); only the token stride may be arbitrary, got "
              "strides ", t.strides());
}

// The paged cache write's arguments: v [tokens, kv_heads, head_dim] like k, the caches [num_pages,
// page_size, kv_heads, head_dim] contiguous in k's dtype, slot_mapping [tokens] int64.
void check_cache_rows(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                      const at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  MINFER_CHECK_SAME_DEVICE(k, v);
  MINFER_CHECK_SAME_DEVICE(k, k_cache);
  MINFER_CHECK_SAME_DEVICE(k, v_cache);
  MINFER_CHECK_SAME_DEVICE(k, slot_mapping);
  MINFER_CHECK_SAME_DTYPE(k, v);
  MINFER_CHECK_SAME_DTYPE(k, k_cache);
  MINFER_CHECK_SAME_DTYPE(k, v_cache);
  check_heads(v, "v");
  MINFER_CHECK(v.sizes() == k.sizes(), "rope: v must have k's shape ", k.sizes(), ", got ", v.sizes());
  MINFER_CHECK(k_cache.dim() == 4 && k_cache.size(2) == k.size(1) && k_cache.size(3) == k.size(2),
               "rope: k_cache must be [num_pages, page_size, kv_heads, head_dim] = [*, *, ", k.size(1), ", ", k.size(2),
               "], got shape ", k_cache.sizes());
  MINFER_CHECK(v_cache.sizes() == k_cache.sizes(), "rope: v_cache must have k_cache's shape ", k_cache.sizes(),
               ", got ", v_cache.sizes());
  MINFER_CHECK_CONTIGUOUS(k_cache);
  MINFER_CHECK_CONTIGUOUS(v_cache);
  MINFER_CHECK(slot_mapping.scalar_type() == at::kLong, "rope: slot_mapping must be int64, got ",
               slot_mapping.scalar_type());
  MINFER_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == k.size(0), "rope: slot_mapping must be [tokens] = [",
               k.size(0), "], got shape ", slot_mapping.sizes());
  MINFER_CHECK_CONTIGUOUS(slot_mapping);
}

}  // namespace

void rope(const at::Tensor& q, const at::Tensor& k, const at::Tensor& positions,
          const at::Tensor& cos_sin, bool is_neox, const std::optional<at::Tensor>& q_weight,
          const std::optional<at::Tensor>& k_weight, double eps, const std::optional<at::Tensor>& v,
          const std::optional<at::Tensor>& k_cache, const std::optional<at::Tensor>& v_cache,
          const std::optional<at::Tensor>& slot_mapping) {
  MINFER_CHECK_CUDA(q);
  MINFER_CHECK_CUDA(k);
  MINFER_CHECK_CUDA(positions);
  MINFER_CHECK_CUDA(cos_sin);
  MINFER_CHECK_SAME_DEVICE(q, k);
  MINFER_CHECK_SAME_DEVICE(q, positions);
  MINFER_CHECK_SAME_DEVICE(q, cos_sin);
  MINFER_CHECK_FLOAT(q);
  MINFER_CHECK_SAME_DTYPE(q, k);
  check_heads(q, "q");
  check_heads(k, "k");
  const int64_t tokens = q.size(0), head_dim = q.size(2);
  MINFER_CHECK(k.size(0) == tokens && k.size(2) == head_dim, "rope: k must be [tokens, kv_heads, head_dim] = [",
              tokens, ", *, ", head_dim, "] like q, got shape ", k.sizes());
  MINFER_CHECK(positions.dim() == 1 && positions.size(0) == tokens, "rope: positions must be [tokens] = [", tokens,
              "], got shape ", positions.sizes());
  MINFER_CHECK_CONTIGUOUS(positions);
  MINFER_CHECK_INDEX(positions);
  MINFER_CHECK(cos_sin.scalar_type() == at::kFloat, "rope: cos_sin must be float32, got ", cos_sin.scalar_type());
  MINFER_CHECK(cos_sin.dim() == 2, "rope: cos_sin must be [max_position, rotary_dim], got shape ", cos_sin.sizes());
  MINFER_CHECK_CONTIGUOUS(cos_sin);
  const int64_t rot = cos_sin.size(1), max_position = cos_sin.size(0);
  MINFER_CHECK(rot >= 2 && rot % 2 == 0 && rot <= head_dim, "rope: rotary_dim (cos_sin.size(1)) must be even and in [2, ",
              "head_dim = ", head_dim, "], got ", rot);
  MINFER_CHECK(head_dim <= 4096, "rope: head_dim must be at most 4096, got ", head_dim);
  MINFER_CHECK(tokens < (int64_t(1) << 31), "rope: too many tokens (", tokens, ")");
  MINFER_CHECK(q_weight.has_value() == k_weight.has_value(), "rope: q_weight and k_weight come together");
  for (const auto* w : {&q_weight, &k_weight})
    if (w->has_value())
      check_norm_weight("rope", w == &q_weight ? "q_weight" : "k_weight", **w, "q", q, "head_dim", head_dim, eps);
  MINFER_CHECK(!q_weight || is_neox || head_dim % 2 == 0,
               "rope: q/k norms with GPT-J pairs need an even head_dim, got ", head_dim);
  const int cache_args = v.has_value() + k_cache.has_value() + v_cache.has_value() + slot_mapping.has_value();
  MINFER_CHECK(cache_args == 0 || cache_args == 4, "rope: v, k_cache, v_cache and slot_mapping come together (the "
               "paged cache write), got ", cache_args, " of them");
  if (cache_args) check_cache_rows(k, *v, *k_cache, *v_cache, *slot_mapping);
  const int64_t heads = q.size(1), kv_heads = k.size(1);
  if (tokens == 0 || heads + kv_heads == 0) return;
  MINFER_CHECK(heads + kv_heads <= (1 << 16), "rope: too many heads (", heads, " + ", kv_heads, ")");
  const c10::cuda::CUDAGuard guard(q.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  MINFER_DISPATCH_FLOAT(q.scalar_type(), "rope", [&] {
    MINFER_DISPATCH_INDEX(positions.scalar_type(), "rope", [&] {
      constexpr int N = 16 / sizeof(scalar_t);
      auto* qp = reinterpret_cast<scalar_t*>(q.data_ptr());
      auto* kp = reinterpret_cast<scalar_t*>(k.data_ptr());
      const auto* pos = positions.data_ptr<index_t>();
      const auto* cs = cos_sin.data_ptr<float>();
      const auto* qw = q_weight ? reinterpret_cast<const scalar_t*>(q_weight->data_ptr()) : nullptr;
      const auto* kw = k_weight ? reinterpret_cast<const scalar_t*>(k_weight->data_ptr()) : nullptr;
      const float e = static_cast<float>(eps);
      CacheRows<scalar_t> cache{};
      if (k_cache) {
        cache = {reinterpret_cast<scalar_t*>(k_cache->data_ptr()), reinterpret_cast<scalar_t*>(v_cache->data_ptr()),
                 reinterpret_cast<const scalar_t*>(v->data_ptr()), v->stride(0), slot_mapping->data_ptr<int64_t>(),
                 k_cache->size(0) * k_cache->size(1), kv_heads * head_dim};
      }
      const int64_t row = kv_heads * head_dim;
      // 16-byte packs need every pack start aligned: base pointers, token strides, head_dim, and the
      // rotated span ((rot/2) for NeoX's second half, rot for GPT-J) a multiple of the pack.
      const bool wide = rows_aligned16(qp, head_dim, q.stride(0), sizeof(scalar_t)) &&
                        rows_aligned16(kp, head_dim, k.stride(0), sizeof(scalar_t)) &&
                        (is_neox ? (rot / 2) % N == 0 : rot % N == 0) &&
                        (!qw || (is_aligned16(qw) && is_aligned16(kw))) &&
                        (!cache.k_cache || (rows_aligned16(cache.v, row, cache.v_stride, sizeof(scalar_t)) &&
                                            rows_aligned16(cache.k_cache, row, row, sizeof(scalar_t)) &&
                                            rows_aligned16(cache.v_cache, row, row, sizeof(scalar_t))));
      const int h = static_cast<int>(heads), kvh = static_cast<int>(kv_heads);
      const int hd = static_cast<int>(head_dim), r = static_cast<int>(rot);
      auto launch = [&](auto w, auto neox) {
        launch_rope<scalar_t, decltype(w)::value, decltype(neox)::value, index_t>(
            qp, q.stride(0), kp, k.stride(0), pos, cs, qw, kw, e, max_position, tokens, h, kvh, hd, r, cache, stream);
      };
      using Neox = std::true_type;
      using GptJ = std::false_type;
      if (is_neox) {
        if (wide)
          launch(std::integral_constant<int, N>{}, Neox{});
        else
          launch(std::integral_constant<int, 1>{}, Neox{});
      } else {
        if (wide)
          launch(std::integral_constant<int, N>{}, GptJ{});
        else
          launch(std::integral_constant<int, 2>{}, GptJ{});
      }
    });
  });
}

}  // namespace minfer
