// Building blocks of the small-M (decode) kernels: D[m, n] = sum_k A[m, k] * W[n, k], W streamed once
// at HBM speed (gemv_tiles.cuh, gemv_ring.cuh, gemv_m1.cuh; launched by gemv.cu).
//
// Tensor cores with the operands swapped: 16 rows of W are the A operand of mma.sync m16n8k16 and
// up to 8 (NT = 1) or 16 (NT = 2) activation rows are the B operand, so the math costs nothing and
// the kernel is a pure W stream. A dot product may take its k terms in any order, so every thread
// loads W and X straight from global into registers in 16-byte chunks under one k permutation: in a
// 32-wide k step, thread (g = lane / 4, t = lane % 4) holds W rows g and g + 8 and X row g at
// k = 8t .. 8t + 7; the low and high halves of those uint4 feed two mma k-steps (see mma_step).
// A round's W loads (U steps) go out in one burst ahead of its mmas, then its X: all of it, or one
// step ahead of each mma where the round's X would not fit the register cap. W goes through the
// non-allocating L1 path; X (a few KB) stays resident in L1/L2 and is re-read per tile.
//
// Fixed costs (a 32 MB W streams in 8 us): on Hopper the kernels are launched as programmatic
// dependents of the previous kernel in the stream and let their own dependents launch at once, so
// their CTAs can be resident while the previous grid drains. Before griddep_wait, which returns once
// the previous grid is complete and its writes are visible, a CTA reads nothing, unless the caller
// says W is static (linear's static_weight, the engine's weights): then each warp loads its first
// round of W into registers (the rings: fills them) before the wait, and X after it. Back to back on
// H200 (fp16): 1 x 3072 x 2048 5.22 -> 4.71 us, 1 x 16384 x 2048 18.4 -> 17.5, 16 x 16384 x 2048
// 19.2 -> 18.3, 8 x 28672 x 4096 57.6 -> 56.7; 16 x 6144 x 4096 15.6 -> 15.9 and 8 x 2048 x 8192
// 11.1 -> 11.4 lose a little. An L2 prefetch of that round instead measures equal or slower: the
// loads must land somewhere.
// Needs K % 8 == 0, row strides % 8 == 0 and 16-byte aligned bases (checked by the dispatcher) and
// sm_80 (mma.sync with bf16).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/ptx.cuh"
#include "gemm/epilogue.h"

namespace minfer::gemm_impl {
namespace {

using namespace ::minfer::ptx;

constexpr int kThreads = 256, kWarps = kThreads / 32;

// One 32-wide k step as two m16n8k16 mmas. wa / wb: W rows g / g + 8, x: X row g (n index), all at
// physical k = 8t .. 8t + 7, i.e. registers r = 0..3 hold k = 8t + 2r, +1. Half j takes r = 2j and
// 2j + 1, which the fragment layouts call k = 2t (+1) and 2t + 8 (+1): W and X see the same mapping.
template <typename T, int NT>
__device__ __forceinline__ void mma_step(float (&acc)[NT][4], const uint4& wa, const uint4& wb, const uint4 (&x)[NT]) {
  const uint32_t a[2][4] = {{wa.x, wb.x, wa.y, wb.y}, {wa.z, wb.z, wa.w, wb.w}};
#pragma unroll
  for (int j = 0; j < 2; ++j) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const uint32_t b[2] = {j ? x[nt].z : x[nt].x, j ? x[nt].w : x[nt].y};
      mma_m16n8k16<T>(acc[nt], a[j], b);
    }
  }
}

template <int NT>
__device__ __forceinline__ void zero(float (&acc)[NT][4]) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
}

// With p.act (linear_act: W is gate [N / 2] | up [N / 2]) the kernels walk W's rows in an order whose 16-row
// tiles are 8 gate rows and their 8 up rows: row n of that order is gate row 8 (n / 16) + n % 8 for n % 16 < 8,
// else up row N / 2 + 8 (n / 16) + n % 8. A thread's mma rows g and g + 8 are then the two halves of output
// 8 (n / 16) + g. The dispatcher fuses at 8 rows and fewer only where N / 2 is a multiple of 8, so that the
// order is a permutation of whole tiles. `act`: p.act, or a kernel's compile-time flag for it (the stream and
// ring kernels of one n8 tile are built both ways, so that the plain linear's code stays as it is without the
// epilogue's registers: 2% on 1 x 20480 x 2560 and 16 x 128256 x 4096, H200).
template <typename T>
__device__ __forceinline__ int w_row(const Params<T, T>& p, int n, bool act) {
  return act ? ((n & 8) ? p.N / 2 : 0) + 8 * (n >> 4) + (n & 7) : n;
}

// One warp's 16-row tile of D from its accumulators: acc[nt][2h + e] is D[m = 8 nt + 2t + e][n = n0 + 8h]
// (n0 = the tile's first row + g); rows from n_end on are not stored. With act, rows n0 and n0 + 8 of
// w_row's order are one output's gate and up.
template <typename T, int NT>
__device__ __forceinline__ void store_tile(const Params<T, T>& p, const float (&acc)[NT][4], int n0, int n_end, int t,
                                           bool act) {
  if (act) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int m = nt * 8 + 2 * t + e;
        if (m < p.M && n0 < n_end) store_gated(p, m, 8 * (n0 >> 4) + (n0 & 7), acc[nt][e], acc[nt][2 + e]);
      }
    return;
  }
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int m = nt * 8 + 2 * t + (i & 1), n = n0 + 8 * (i >> 1);
      if (m < p.M && n < n_end) store_out(p, m, n, acc[nt][i]);
    }
}

// acc += W rows . X rows over k steps [s_begin, s_end) of STEP 8-element chunks, in rounds of U steps
// whose loads are all issued before the first mma. wa / wb / xp point at this thread's chunk c of
// step 0 (c = t: four chunks per step, W rows n0 and n0 + 8; c = 4g + t: see gemv_m1_kernel); rows
// that are off (a_ok, b_ok, x_ok false) read nothing and give zeros.
template <int U, int STEP = 4>
__device__ __forceinline__ void load_w_round(uint4 (&va)[U], uint4 (&vb)[U], const uint4* wa, const uint4* wb,
                                             bool a_ok, bool b_ok, int s0, int s_end, int chunks, int c) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int s = s0 + u;
    const bool ok = s < s_end && STEP * s + c < chunks;  // past the warp's slice or K's tail: zeros
    va[u] = ld_nc_stream_v4(wa + STEP * (int64_t)s, ok && a_ok);
    vb[u] = ld_nc_stream_v4(wb + STEP * (int64_t)s, ok && b_ok);
  }
}

// The round at s0 once its W is in va / vb: X, then the mmas. X_AHEAD: X one step ahead of each mma
// instead of the whole round's up front (fewer registers).
template <typename T, int NT, int U, int STEP = 4, bool X_AHEAD = (NT * U > 8)>
__device__ __forceinline__ void mma_round(float (&acc)[NT][4], const uint4 (&va)[U], const uint4 (&vb)[U],
                                          const uint4* const (&xp)[NT], const bool (&x_ok)[NT], int s0, int s_end,
                                          int chunks, int c) {
  auto load_x = [&](int u, uint4 (&x)[NT]) {
    const int s = s0 + u;
    const bool ok = s < s_end && STEP * s + c < chunks;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) x[nt] = ld_nc_v4(xp[nt] + STEP * (int64_t)s, ok && x_ok[nt]);
  };
  if constexpr (!X_AHEAD) {  // the round's X up front too: its registers wait under W's latency
    uint4 vx[U][NT];
#pragma unroll
    for (int u = 0; u < U; ++u) load_x(u, vx[u]);
#pragma unroll
    for (int u = 0; u < U; ++u) mma_step<T, NT>(acc, va[u], vb[u], vx[u]);
  } else {  // longer rounds of two X rows: X one step ahead of the mmas (L1 hits), not NT * U * 4 registers
    uint4 vx[2][NT];
    load_x(0, vx[0]);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (u + 1 < U) load_x(u + 1, vx[(u + 1) & 1]);
      mma_step<T, NT>(acc, va[u], vb[u], vx[u & 1]);
    }
  }
}

template <typename T, int NT, int U, int STEP = 4, bool X_AHEAD = (NT * U > 8)>
__device__ __forceinline__ void accumulate(float (&acc)[NT][4], const uint4* wa, const uint4* wb, bool a_ok, bool b_ok,
                                           const uint4* const (&xp)[NT], const bool (&x_ok)[NT], int s_begin,
                                           int s_end, int chunks, int c) {
  for (int s0 = s_begin; s0 < s_end; s0 += U) {
    uint4 va[U], vb[U];
    load_w_round<U, STEP>(va, vb, wa, wb, a_ok, b_ok, s0, s_end, chunks, c);  // W first: it carries the latency
    mma_round<T, NT, U, STEP, X_AHEAD>(acc, va, vb, xp, x_ok, s0, s_end, chunks, c);
  }
}

// The same, with the first round's W already in va0 / vb0 (loaded before griddep_wait; see the
// kernels). A separate function, so that accumulate's loop carries no preloaded round.
template <typename T, int NT, int U, int STEP = 4, bool X_AHEAD = (NT * U > 8)>
__device__ __forceinline__ void accumulate_from(float (&acc)[NT][4], const uint4 (&va0)[U], const uint4 (&vb0)[U],
                                                const uint4* wa, const uint4* wb, bool a_ok, bool b_ok,
                                                const uint4* const (&xp)[NT], const bool (&x_ok)[NT], int s_begin,
                                                int s_end, int chunks, int c) {
  mma_round<T, NT, U, STEP, X_AHEAD>(acc, va0, vb0, xp, x_ok, s_begin, s_end, chunks, c);
  accumulate<T, NT, U, STEP, X_AHEAD>(acc, wa, wb, a_ok, b_ok, xp, x_ok, s_begin + U, s_end, chunks, c);
}

// This thread's X rows m_base + 8 nt + g at chunk t of step 0; rows from M on read nothing.
template <typename T, int NT>
__device__ __forceinline__ void x_rows(const Params<T, T>& p, int m_base, int g, int t, const uint4* (&xp)[NT],
                                       bool (&x_ok)[NT]) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int m = m_base + nt * 8 + g;
    x_ok[nt] = m < p.M;
    xp[nt] = reinterpret_cast<const uint4*>(p.A + (int64_t)(x_ok[nt] ? m : 0) * p.sam) + t;
  }
}

// Hopper kernel boundary (see the top of the file): nothing is read before the previous grid is done.
__device__ __forceinline__ void wait_for_previous_grid() {
  griddep_wait();  // the previous kernel's writes are visible from here
  griddep_launch_dependents();
}

}  // namespace
}  // namespace minfer::gemm_impl
