// The random draw with each row's filters, in one launch: x = logits x (1 / temperature), then top-k, min-p and
// top-p, each on what the one before kept (minfer/ops/reference.py's filter_rows), then gumbel_argmax's Gumbel-max
// draw over the ids kept. A row of temperature 0 takes its argmax. Where filter_rows sorts every row (a [rows, vocab]
// sort, softmax, cumsum and scatter: ~1.4 ms of host time a step at 128 rows of 49k ids, H100), a row's CTAs find
// each filter's cutoff by radix selection over the order keys of x, 8 bits a pass: the k-th largest by counts, the
// nucleus' last value by mass. Each pass reads the row again (from L2 where the rows fit); a pass is ~30
// instructions an id, so a row takes a cluster of up to 8 CTAs (sm_90) where the rows leave SMs idle, their
// histograms and reductions summed over the cluster's shared memory in rank order.
//
// Mass is exp(x - max) in fixed point (2^40 for 1): integer sums are exact in any order, so a row's cutoff does not
// depend on the order of its CTAs' atomics, and a seeded row draws the same in any batch, run after run. A cutoff
// keeps every id of its value, where filter_rows' sort may keep only some of the ids tied at it.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "common/checks.h"
#include "common/dispatch.h"
#include "common/draw.cuh"
#include "common/launch.h"
#include "common/ptx.cuh"
#include "common/reduce.h"
#include "common/sm90.cuh"
#include "common/vec.h"

namespace minfer {

namespace {

using u64 = unsigned long long;
constexpr int kThreads = 1024;  // a CTA: its 32 warps reduce through one hop of 32 partials
constexpr float kMassScale = 1099511627776.f;  // 2^40: a row's mass sums to at most 2^58 (vocab < 2^18)

constexpr int kMaxCluster = 8;  // CTAs a row at most (the portable cluster size)

// The row's CTAs: a cluster on sm_90, one CTA elsewhere.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ int cta_rank() { return static_cast<int>(sm90::cluster_ctarank()); }
__device__ __forceinline__ int cta_count() { return static_cast<int>(sm90::cluster_nctarank()); }
__device__ __forceinline__ void row_sync() { sm90::cluster_sync(); }
__device__ __forceinline__ u64 load_from(const u64* p, int rank) {
  return sm90::ld_cluster_u64(ptx::smem_addr(p), rank);
}
#else
__device__ __forceinline__ int cta_rank() { return 0; }
__device__ __forceinline__ int cta_count() { return 1; }
__device__ __forceinline__ void row_sync() { __syncthreads(); }
__device__ __forceinline__ u64 load_from(const u64* p, int) { return *p; }
#endif

// Every thread of the row's CTAs gets the reduction of x over them by op, whose identity is given (the CTAs' results in
// rank order). U: 64 bits.
template <typename U, typename Op>
__device__ __forceinline__ U row_reduce(U x, Op op, U identity) {
  static_assert(sizeof(U) == sizeof(u64));
  __shared__ u64 slot;
  x = block_reduce(x, op, identity);
  if (threadIdx.x == 0) slot = *reinterpret_cast<u64*>(&x);
  row_sync();  // every CTA's slot written
  u64 first = load_from(&slot, 0);
  U total = *reinterpret_cast<U*>(&first);
  for (int rank = 1; rank < cta_count(); ++rank) {
    u64 bits = load_from(&slot, rank);
    total = op(total, *reinterpret_cast<U*>(&bits));
  }
  row_sync();  // every slot read before any is written again
  return total;
}

// A radix selection's state: each digit's weight among the ids whose key matches the digits chosen so far.
struct Radix {
  u64 hist[256];   // this CTA's ids
  u64 total[256];  // the row's: every CTA's hist, summed in rank order
  u64 above;  // the weight of the ids whose key is past the chosen digits' range
  int digit;  // the digit chosen at this pass; -1: the row's whole weight falls short of the target
};

// Warp 0: the largest digit d with above + hist[d] + ... + hist[255] >= target; above grows by hist[d + 1..255].
__device__ __forceinline__ void choose_digit(Radix& r, u64 target) {
  const int lane = threadIdx.x;
  u64 h[8], mine = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) mine += h[j] = r.total[8 * lane + j];
  u64 suffix = mine;  // this lane's digits and every higher lane's
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const u64 v = __shfl_down_sync(0xffffffff, suffix, o);
    if (lane + o < 32) suffix += v;
  }
  const u64 above = r.above;
  const unsigned reached = __ballot_sync(0xffffffff, above + suffix >= target);  // lanes 0..L
  if (reached == 0) {
    if (lane == 0) r.digit = -1;
    return;
  }
  if (lane == 31 - __clz(reached)) {
    u64 acc = above + suffix - mine;
    int digit = 8 * lane;
    bool found = false;
#pragma unroll
    for (int j = 7; j > 0; --j) {  // static indices: h stays in registers
      if (!found && acc + h[j] >= target) digit += j, found = true;
      if (!found) acc += h[j];
    }
    r.digit = digit;
    r.above = acc;
  }
}

// A thread's last few digits and their weights, added to the histogram once: a key's top 8 bits are its sign and
// exponent, so at the first pass a row's ids fall into a handful of digits, and one atomic an id would queue tens of
// thousands on each (a CTA's atomics on one shared address run one at a time).
struct DigitCache {
  int d0 = -1, d1 = -1, d2 = -1, d3 = -1;  // newest first; registers, not an array (which went to the stack)
  u64 w0 = 0, w1 = 0, w2 = 0, w3 = 0;

  __device__ __forceinline__ void add(int d, u64 w, u64* hist) {
    if (d == d0) w0 += w;
    else if (d == d1) w1 += w;
    else if (d == d2) w2 += w;
    else if (d == d3) w3 += w;
    else {
      if (d3 >= 0) atomicAdd(&hist[d3], w3);
      d3 = d2, w3 = w2, d2 = d1, w2 = w1, d1 = d0, w1 = w0, d0 = d, w0 = w;
    }
  }

  __device__ __forceinline__ void flush(u64* hist) {
    if (d0 >= 0) atomicAdd(&hist[d0], w0);
    if (d1 >= 0) atomicAdd(&hist[d1], w1);
    if (d2 >= 0) atomicAdd(&hist[d2], w2);
    if (d3 >= 0) atomicAdd(&hist[d3], w3);
  }
};

// The largest order key v whose ids (those `item` lets in) weigh at least target at keys >= v, found 8 bits a pass
// from the top; 0 (every key) where their whole weight falls short. item(i, key, weight) -> whether id i is in.
template <typename Item>
__device__ uint32_t radix_select(int begin, int vocab, int step, u64 target, Radix& r, Item item) {
  uint32_t prefix = 0, mask = 0;
  if (threadIdx.x == 0) r.above = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    row_sync();  // every CTA has summed the last pass' hist before it is cleared
    if (threadIdx.x < 256) r.hist[threadIdx.x] = 0;
    __syncthreads();
    DigitCache cache;
    for (int i = begin; i < vocab; i += step) {
      uint32_t key;
      u64 weight;
      if (item(i, key, weight) && weight && ((key ^ prefix) & mask) == 0)
        cache.add(static_cast<int>((key >> shift) & 255), weight, r.hist);
    }
    cache.flush(r.hist);
    row_sync();  // every CTA's hist complete
    if (threadIdx.x < 256) {
      u64 sum = 0;
      for (int rank = 0; rank < cta_count(); ++rank) sum += load_from(&r.hist[threadIdx.x], rank);
      r.total[threadIdx.x] = sum;
    }
    __syncthreads();
    if (threadIdx.x < 32) choose_digit(r, target);
    __syncthreads();
    const int digit = r.digit;
    if (digit < 0) return 0;
    prefix |= static_cast<uint32_t>(digit) << shift;
    mask |= 0xffu << shift;
  }
  return prefix;
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    draw_filtered_kernel(int64_t* __restrict__ out,               // [rows]
                         const T* __restrict__ logits,            // [rows, row_stride]
                         int64_t row_stride, int vocab,
                         const int64_t* __restrict__ seeds,       // [rows]
                         const int64_t* __restrict__ positions,   // [rows]
                         const float* __restrict__ temperature,   // [rows], 0: greedy
                         const int64_t* __restrict__ top_k,       // [rows], >= vocab or <= 0: off
                         const float* __restrict__ top_p,         // [rows], 1: off
                         const float* __restrict__ min_p) {       // [rows], 0: off
  __shared__ Radix r;
  const int row = blockIdx.y;
  const T* src = logits + row * row_stride;
  const int begin = cta_rank() * kThreads + threadIdx.x, step = cta_count() * kThreads;  // this thread's ids
  ptx::griddep_wait();  // the logits are the previous kernel's
  ptx::griddep_launch_dependents();
  const float t = temperature[row], p = top_p[row], mp = min_p[row];
  const int64_t k = top_k[row];
  const bool draws = t != 0.f, use_k = draws && k > 0 && k < vocab, use_p = draws && p < 1.f,
             use_min = draws && mp > 0.f;
  // x times 1 / t, each rounded as the reference's torch ops; a greedy row's logits as they are
  const float inverse = draws ? __frcp_rn(t) : 1.f;
  auto x = [&](int i) { return __fmul_rn(to_float(src[i]), inverse); };

  // top-k: the ids at or above the k-th largest key
  const uint32_t kth = !use_k ? 0 : radix_select(begin, vocab, step, k, r, [&](int i, uint32_t& key, u64& w) {
    key = order_key(x(i));
    w = 1;
    return true;
  });
  float top = 0.f;  // the largest x (its probability is the largest: min-p's scale, and exp's offset)
  if (use_min || use_p) {
    float local = -INFINITY;
    for (int i = begin; i < vocab; i += step) local = fmaxf(local, x(i));
    top = static_cast<float>(row_reduce(static_cast<double>(local), [](double a, double b) { return fmax(a, b); },
                                       -static_cast<double>(INFINITY)));
    if (top == -INFINITY) top = 0.f;  // every logit -inf: no mass, every id stays
  }
  // exp(x - top), in (0, 1]: a probability over the largest's (the filters' cutoffs are within its rounding anyway)
  auto relative = [&](float v) { return __expf(v - top); };
  // min-p: probability at least min_p times the largest
  auto in = [&](float e, uint32_t key) { return key >= kth && (!use_min || e >= mp); };

  uint32_t cut = kth;
  if (use_p) {  // top-p: the fewest largest ids whose mass reaches top_p of what top-k and min-p kept (at least one)
    auto item = [&](int i, uint32_t& key, u64& w) {
      const float v = x(i), e = relative(v);
      key = order_key(v);
      w = __float2ull_rn(e * kMassScale);
      return in(e, key);
    };
    u64 local = 0;
    for (int i = begin; i < vocab; i += step) {
      uint32_t key;
      u64 w;
      if (item(i, key, w)) local += w;
    }
    const u64 kept = row_reduce(local, [](u64 a, u64 b) { return a + b; }, u64{0});
    const u64 target = max(1ull, static_cast<u64>(ceil(static_cast<double>(p) * static_cast<double>(kept))));
    cut = max(cut, radix_select(begin, vocab, step, target, r, item));
  }

  const uint32_t noise = noise_key(seeds[row], positions[row]);
  u64 best = 0;
  for (int i = begin; i < vocab; i += step) {
    const float v = x(i);
    if (order_key(v) >= cut && (!use_min || relative(v) >= mp))
      best = max(best, argmax_key(draws ? v + gumbel(noise, i) : v, i));
  }
  best = row_reduce(best, [](u64 a, u64 b) { return max(a, b); }, u64{0});
  if (cta_rank() == 0 && threadIdx.x == 0) out[row] = argmax_index(best);
}

}  // namespace

at::Tensor draw_filtered(const at::Tensor& logits, const at::Tensor& seeds, const at::Tensor& positions,
                         const at::Tensor& temperature, const at::Tensor& top_k, const at::Tensor& top_p,
                         const at::Tensor& min_p) {
  MINFER_CHECK_CUDA(logits);
  MINFER_CHECK_FLOAT(logits);
  MINFER_CHECK_DIM(logits, 2);
  MINFER_CHECK(logits.stride(1) == 1, "draw_filtered: logits' rows must be contiguous, got strides ", logits.strides());
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  MINFER_CHECK(vocab > 0 && vocab < (int64_t(1) << 18), "draw_filtered: logits' row length must be in [1, 2^18), got ",
               vocab);
  MINFER_CHECK(rows < 65536, "draw_filtered: at most 65535 rows, got ", rows);
  const std::pair<const at::Tensor*, const char*> params[] = {
      {&seeds, "seeds"}, {&positions, "positions"}, {&temperature, "temperature"},
      {&top_k, "top_k"}, {&top_p, "top_p"},         {&min_p, "min_p"}};
  for (const auto& [t, name] : params) {
    MINFER_CHECK(t->device() == logits.device(), name, " must be on the logits' device ", logits.device(), ", got ",
                 t->device());
    const bool ints = t == &seeds || t == &positions || t == &top_k;
    MINFER_CHECK(t->scalar_type() == (ints ? at::kLong : at::kFloat), name, " must be ", ints ? "int64" : "float32",
                 ", got ", t->scalar_type());
    MINFER_CHECK(t->dim() == 1 && t->size(0) == rows, name, " must be [rows] (", rows, "), got shape ", t->sizes());
    MINFER_CHECK(t->is_contiguous(), name, " must be contiguous");
  }
  const c10::cuda::CUDAGuard guard(logits.device());
  auto out = logits.new_empty({rows}, at::kLong);
  if (rows == 0) return out;
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int device = logits.get_device();
  // CTAs a row: as many as the rows leave SMs for (a power of two up to 8), on sm_90
  int cluster = 1;
  if (cc_major(device) >= 9)
    while (cluster < kMaxCluster && rows * cluster * 2 <= sm_count(device)) cluster *= 2;
  MINFER_DISPATCH_FLOAT(logits.scalar_type(), "draw_filtered", [&] {
    launch_pdl_cluster(draw_filtered_kernel<scalar_t>, cluster, dim3(cluster, static_cast<unsigned>(rows)),
                       dim3(kThreads), 0, stream,
                       out.data_ptr<int64_t>(), reinterpret_cast<const scalar_t*>(logits.data_ptr()),
                       logits.stride(0), static_cast<int>(vocab), seeds.data_ptr<int64_t>(),
                       positions.data_ptr<int64_t>(), temperature.data_ptr<float>(), top_k.data_ptr<int64_t>(),
                       top_p.data_ptr<float>(), min_p.data_ptr<float>());
  });
  return out;
}

}  // namespace minfer
