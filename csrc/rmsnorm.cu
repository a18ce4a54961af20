// RMSNorm and the fused residual-add + RMSNorm.
//   rms_norm:           out[t] = x[t] * rsqrt(mean(x[t]^2) + eps) * weight
//   fused_add_rms_norm: residual[t] += x[t] (rounded to the storage dtype); x[t] = rms_norm(residual[t])
//     with x_weight (a sandwich norm, Gemma's post-attention / post-MLP): x[t] = rms_norm(x[t], x_weight)
//     (rounded) first, one launch for the three steps.
//
// One row is read once: each thread keeps its share of the row in registers (VPT packs of W elements)
// between the sum-of-squares and the write pass. Rows short enough for a group of <= 32 lanes are
// handled by lane groups (several rows per block, shuffle-only reduction); longer rows get a block
// each, of one pack a thread at decode rows (kDecodeRows). Rows too long for the registers fall back to a
// second read (L2-resident for any real hidden).
// W = 16 bytes of elements when the rows allow it, else 1 (any hidden, any alignment).
// With records, the output is also written as the Q4_K linears' x records (qgemm/q4k_x.cuh): a warp holds
// whole 256-element chunks there when hidden is a multiple of 256 and a row has at least 32 threads.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "common/checks.h"
#include "common/dispatch.h"
#include "common/launch.h"
#include "common/ptx.cuh"
#include "common/reduce.h"
#include "common/rms.cuh"
#include "common/vec.h"
#include "qgemm/q4k_x.cuh"

namespace minfer {

namespace {

constexpr int kGroupBlock = 128;  // threads per block when rows are handled by lane groups
constexpr int kPrefetchRows = 64;  // up to here the weights are prefetched (decode batches)
// Up to here a row's block takes one pack a thread: at decode rows the kernel is a chain of round trips, and a
// thread's VPT packs (each with its record) ran in series (8B Q4_K_M decode, H200, ms a step, 4 packs a thread / 1:
// batch 1 2.372 / 2.217, batch 16 3.643 / 3.536).
constexpr int kDecodeRows = 16;

// Sum over the threads of one row: a lane group (blockDim.x <= 32, a power of two) or the block.
template <bool kGroupRows>
__device__ __forceinline__ float row_sum(float x) {
  if constexpr (kGroupRows) {
    for (int offset = blockDim.x >> 1; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffff, x, offset);
    return x;
  } else {
    return block_sum(x);
  }
}

// in/out/residual are deliberately not __restrict__: the fused op passes x as both `in` and `out`.
// blockDim = (threads per row, rows per block); with kGroupRows every lane reaches the shuffles,
// rows past the end only skip their memory accesses.
// Launch bounds: long rows launch 1024-thread blocks, which need <= 64 registers per thread; lane groups
// launch kGroupBlock threads.
template <typename T, int W, int VPT, bool kFused, bool kNormX, bool kGroupRows, bool kCached>
__global__ void __launch_bounds__(kGroupRows ? kGroupBlock : 1024)
    rms_norm_kernel(T* out, int64_t out_stride,         // [rows, hidden]
                    T* residual, int64_t res_stride,    // [rows, hidden], kFused only
                    const T* in, int64_t in_stride,     // [rows, hidden]
                    const T* __restrict__ weight,       // [hidden]
                    const T* __restrict__ x_weight,     // [hidden], kNormX only
                    uint8_t* records,                   // [rows, hidden / 256 * kRecord] or null
                    bool i8,                            // records in the int8 form (q4k_x::int8_form)
                    int hidden, int64_t rows, float eps, bool early) {
  static_assert(kFused || !kNormX, "x_weight comes with the residual add");
  using P = Pack<T, W>;
  const int packs = hidden / W;
  const int tpr = blockDim.x;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool valid = row < rows;
  const T* in_row = in + (valid ? row : 0) * in_stride;
  T* out_row = out + (valid ? row : 0) * out_stride;
  T* res_row = kFused ? residual + (valid ? row : 0) * res_stride : nullptr;

  // At a few rows (decode) the kernel is a chain of DRAM round trips. With one pack a thread the weights' pack,
  // static, comes into registers before the wait, so that the chain after it is x's (and the residual's) round
  // trip, the reductions and the stores (8B Q4_K_M batch-1 step, H200, one build, a switch, two rounds, with rope's
  // one pass: 2.082 / 2.083 -> 2.072 / 2.070 ms). Else the weights' lines are fetched into L2 while x loads, read
  // after the reductions; many rows share them through L2 anyway (a prefetch in every block made 2048-row calls up
  // to 1.8x slower).
  constexpr bool kWeightsAhead = kCached && VPT == 1;
  const int lines = !kWeightsAhead && rows <= kPrefetchRows ? static_cast<int>((hidden * sizeof(T) + 127) / 128) : 0;
  for (int l = threadIdx.x; valid && threadIdx.y == 0 && l < lines; l += tpr) {
    ptx::prefetch_l2(reinterpret_cast<const char*>(weight) + l * 128);
    if constexpr (kNormX) ptx::prefetch_l2(reinterpret_cast<const char*>(x_weight) + l * 128);
  }
  P w_ahead, xw_ahead;
  if constexpr (kWeightsAhead) {
    if (valid && static_cast<int>(threadIdx.x) < packs) {
      w_ahead.load(weight + threadIdx.x * W);
      if constexpr (kNormX) xw_ahead.load(x_weight + threadIdx.x * W);
    }
  }
  // Launched early (programmatic dependent launch): the weights are static, everything else may be the
  // previous kernel's. At one row, or up to 16 writing records, the next kernel (a linear) may start now and
  // stream its first weights meanwhile; else once the previous kernel is done (pdl_early).
  ptx::griddep_enter(early);

  float ss = 0.f;
  if constexpr (kCached) {
    P v[VPT];
    if constexpr (kFused) {
      P r[VPT];
      // All loads first, so that VPT * 2 loads are in flight before the first store.
#pragma unroll
      for (int i = 0; i < VPT; ++i) {
        const int p = threadIdx.x + i * tpr;
        if (valid && p < packs) {
          v[i].load(in_row + p * W);
          r[i].load(res_row + p * W);
        }
      }
      if constexpr (kNormX) {
        float ssx = 0.f;
#pragma unroll
        for (int i = 0; i < VPT; ++i) {
          const int p = threadIdx.x + i * tpr;
          if (valid && p < packs) ssx = add_squares(v[i], ssx);
        }
        const float sx = rms_scale(row_sum<kGroupRows>(ssx), hidden, eps);
#pragma unroll
        for (int i = 0; i < VPT; ++i) {
          const int p = threadIdx.x + i * tpr;
          if (valid && p < packs) {
            P w;
            if constexpr (kWeightsAhead) w = xw_ahead;
            else w.load(x_weight + p * W);
            v[i] = rms_apply(v[i], sx, w);
          }
        }
      }
#pragma unroll
      for (int i = 0; i < VPT; ++i) {
        const int p = threadIdx.x + i * tpr;
        if (valid && p < packs) {
#pragma unroll
          for (int e = 0; e < W; ++e) v[i].v[e] = from_float<T>(to_float(r[i].v[e]) + to_float(v[i].v[e]));
          v[i].store(res_row + p * W);
        }
      }
    } else {
#pragma unroll
      for (int i = 0; i < VPT; ++i) {
        const int p = threadIdx.x + i * tpr;
        if (valid && p < packs) v[i].load(in_row + p * W);
      }
    }
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int p = threadIdx.x + i * tpr;
      if (valid && p < packs) ss = add_squares(v[i], ss);
    }
    const float scale = rms_scale(row_sum<kGroupRows>(ss), hidden, eps);
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int p = threadIdx.x + i * tpr;
      if (valid && p < packs) {
        P w;
        if constexpr (kWeightsAhead) w = w_ahead;
        else w.load(weight + p * W);
        const P o = rms_apply(v[i], scale, w);
        o.store(out_row + p * W);
        if constexpr (sizeof(T) == 2 && W == 8) {
          if (records != nullptr)  // warp-uniform: the warp's 32 packs are one chunk of this row
            q4k_x::write_record<T>(*reinterpret_cast<const uint4*>(o.v), threadIdx.x % 32,
                                   records + (row * (hidden / 256) + p / 32) * q4k_x::kRecord, i8);
        }
      }
    }
  } else {
    // Long rows: (with x_weight, pass 0: x's sum of squares), pass 1 (add, store residual, sum of squares),
    // pass 2 re-reads what this thread wrote.
    float sx = 1.f;
    if constexpr (kNormX) {
      float ssx = 0.f;
      for (int p = threadIdx.x; valid && p < packs; p += tpr) {
        P v;
        v.load(in_row + p * W);
        ssx = add_squares(v, ssx);
      }
      sx = rms_scale(row_sum<kGroupRows>(ssx), hidden, eps);
    }
    for (int p = threadIdx.x; valid && p < packs; p += tpr) {
      P v;
      v.load(in_row + p * W);
      if constexpr (kNormX) {
        P w;
        w.load(x_weight + p * W);
        v = rms_apply(v, sx, w);
      }
      if constexpr (kFused) {
        P r;
        r.load(res_row + p * W);
#pragma unroll
        for (int e = 0; e < W; ++e) v.v[e] = from_float<T>(to_float(r.v[e]) + to_float(v.v[e]));
        v.store(res_row + p * W);
      }
      ss = add_squares(v, ss);
    }
    const float scale = rms_scale(row_sum<kGroupRows>(ss), hidden, eps);
    const T* src = kFused ? res_row : in_row;
    for (int p = threadIdx.x; valid && p < packs; p += tpr) {
      P v, w;
      v.load(src + p * W);
      w.load(weight + p * W);
      rms_apply(v, scale, w).store(out_row + p * W);
    }
  }
}

int next_pow2(int x) {
  int p = 1;
  while (p < x) p <<= 1;
  return p;
}

// Picks the layout from hidden: lane groups, block per row (cached), or block per row (two reads).
template <typename T, int W, bool kFused, bool kNormX = false>
void launch_rms_norm(T* out, int64_t out_stride, T* residual, int64_t res_stride, const T* in, int64_t in_stride,
                     const T* weight, const T* x_weight, uint8_t* records, int hidden, int64_t rows, float eps,
                     cudaStream_t stream) {
  constexpr int VPT = W > 1 ? 4 : 8;  // packs per thread kept in registers
  const int packs = hidden / W;
  const bool i8 = q4k_x::int8_form(rows);
  const int threads_needed = (packs + VPT - 1) / VPT;
  if (threads_needed <= 32) {
    const int tpr = next_pow2(threads_needed);
    const dim3 block(tpr, kGroupBlock / tpr);
    const int64_t grid = (rows + block.y - 1) / block.y;
    launch_pdl(rms_norm_kernel<T, W, VPT, kFused, kNormX, true, true>, dim3(grid), block, 0, stream, out, out_stride,
             residual, res_stride, in, in_stride, weight, x_weight, records, i8, hidden, rows, eps,
             pdl_early(rows, records != nullptr));
  } else if (W > 1 && rows <= kDecodeRows && packs <= 1024) {
    launch_pdl(rms_norm_kernel<T, W, 1, kFused, kNormX, false, true>, dim3(rows), dim3(round_up(packs, 32)), 0, stream,
               out, out_stride, residual, res_stride, in, in_stride, weight, x_weight, records, i8, hidden, rows, eps,
               pdl_early(rows, records != nullptr));
  } else if (threads_needed <= 1024) {
    const int tpr = round_up(threads_needed, 32);
    launch_pdl(rms_norm_kernel<T, W, VPT, kFused, kNormX, false, true>, dim3(rows), dim3(tpr), 0, stream, out,
             out_stride, residual, res_stride, in, in_stride, weight, x_weight, records, i8, hidden, rows, eps,
             pdl_early(rows, records != nullptr));
  } else {
    launch_pdl(rms_norm_kernel<T, W, VPT, kFused, kNormX, false, false>, dim3(rows), dim3(1024), 0, stream, out,
             out_stride, residual, res_stride, in, in_stride, weight, x_weight, records, i8, hidden, rows, eps,
             pdl_early(rows, records != nullptr));
  }
}

void check_norm_args(const at::Tensor& x, const at::Tensor& weight, double eps, const char* op) {
  MINFER_CHECK_CUDA(x);
  MINFER_CHECK_FLOAT(x);
  MINFER_CHECK(x.dim() == 2, op, ": x must be [tokens, hidden], got shape ", x.sizes());
  MINFER_CHECK_LAST_DIM_CONTIGUOUS(x);
  check_norm_weight(op, "weight", weight, "x", x, "hidden", x.size(1), eps);
  MINFER_CHECK(x.size(1) > 0 && x.size(1) <= (1 << 24), op, ": hidden must be in [1, 2^24], got ", x.size(1));
  MINFER_CHECK(x.size(0) < (int64_t(1) << 31), op, ": too many rows (", x.size(0), ")");
}

// records (q4k_x.cuh) for the [rows, hidden] output: checked, and the layout that writes them (16-byte packs,
// >= 32 threads a row, registers) must be the one taken. Returns their pointer, or null.
uint8_t* norm_records(const std::optional<at::Tensor>& records, const at::Tensor& x, bool wide, const char* op) {
  if (!records) return nullptr;
  q4k_x::check_records(op, *records, x);
  const int64_t hidden = x.size(1);
  MINFER_CHECK(wide, op, ": records need x, residual and the weights 16-byte aligned (rows in 16-byte packs)");
  MINFER_CHECK(hidden >= 768 && hidden <= 32768, op, ": records need hidden in [768, 32768], got ", hidden);
  return records->data_ptr<uint8_t>();
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                    const std::optional<at::Tensor>& records) {
  check_norm_args(x, weight, eps, "rms_norm");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.size(0), hidden = x.size(1);
  auto out = x.new_empty({rows, hidden});
  if (rows == 0) return out;
  auto stream = c10::cuda::getCurrentCUDAStream();
  MINFER_DISPATCH_FLOAT(x.scalar_type(), "rms_norm", [&] {
    constexpr int N = 16 / sizeof(scalar_t);
    auto* o = reinterpret_cast<scalar_t*>(out.data_ptr());
    auto* in = reinterpret_cast<const scalar_t*>(x.data_ptr());
    auto* w = reinterpret_cast<const scalar_t*>(weight.data_ptr());
    const bool wide = rows_aligned16(in, hidden, x.stride(0), sizeof(scalar_t)) && is_aligned16(o) && is_aligned16(w);
    uint8_t* r = norm_records(records, x, wide, "rms_norm");
    if (wide)
      launch_rms_norm<scalar_t, N, false>(o, hidden, nullptr, 0, in, x.stride(0), w, nullptr, r, hidden, rows, eps,
                                          stream);
    else
      launch_rms_norm<scalar_t, 1, false>(o, hidden, nullptr, 0, in, x.stride(0), w, nullptr, nullptr, hidden, rows,
                                          eps, stream);
  });
  return out;
}

void fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                        double eps, const std::optional<at::Tensor>& x_weight,
                        const std::optional<at::Tensor>& records) {
  check_norm_args(x, weight, eps, "fused_add_rms_norm");
  if (x_weight) check_norm_weight("fused_add_rms_norm", "x_weight", *x_weight, "x", x, "hidden", x.size(1), eps);
  MINFER_CHECK_CUDA(residual);
  MINFER_CHECK_SAME_DEVICE(x, residual);
  MINFER_CHECK_SAME_DTYPE(x, residual);
  MINFER_CHECK(residual.sizes() == x.sizes(), "fused_add_rms_norm: residual must have x's shape ", x.sizes(),
              ", got ", residual.sizes());
  MINFER_CHECK_LAST_DIM_CONTIGUOUS(residual);
  const int64_t rows = x.size(0), hidden = x.size(1);
  // In place: overlapping rows would race.
  MINFER_CHECK(rows <= 1 || (x.stride(0) >= hidden && residual.stride(0) >= hidden),
              "fused_add_rms_norm: rows of x and residual must not overlap (stride(0) >= hidden)");
  if (rows == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  MINFER_DISPATCH_FLOAT(x.scalar_type(), "fused_add_rms_norm", [&] {
    constexpr int N = 16 / sizeof(scalar_t);
    auto* xp = reinterpret_cast<scalar_t*>(x.data_ptr());
    auto* rp = reinterpret_cast<scalar_t*>(residual.data_ptr());
    auto* w = reinterpret_cast<const scalar_t*>(weight.data_ptr());
    auto* xw = x_weight ? reinterpret_cast<const scalar_t*>(x_weight->data_ptr()) : nullptr;
    const bool wide = rows_aligned16(xp, hidden, x.stride(0), sizeof(scalar_t)) &&
                      rows_aligned16(rp, hidden, residual.stride(0), sizeof(scalar_t)) && is_aligned16(w) &&
                      (!xw || is_aligned16(xw));
    uint8_t* r = norm_records(records, x, wide, "fused_add_rms_norm");
    auto launch = [&](auto norm_x) {
      constexpr bool kNormX = decltype(norm_x)::value;
      if (wide)
        launch_rms_norm<scalar_t, N, true, kNormX>(xp, x.stride(0), rp, residual.stride(0), xp, x.stride(0), w, xw, r,
                                                   hidden, rows, eps, stream);
      else
        launch_rms_norm<scalar_t, 1, true, kNormX>(xp, x.stride(0), rp, residual.stride(0), xp, x.stride(0), w, xw,
                                                   nullptr, hidden, rows, eps, stream);
    };
    if (xw)
      launch(std::true_type{});
    else
      launch(std::false_type{});
  });
}

}  // namespace minfer
