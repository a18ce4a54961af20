// The 16-row-tile GEMV kernels (see gemv_common.cuh): a warp owns a 16-row tile of W and a slice of K.
// gemv_kernel: KS = 1..8 warps of a CTA split one tile's K and meet in shared memory; larger M walks
// 16-row blocks of A along grid.y, re-reading W once per block. With p.act (gate | up rows) a tile is 8 gate
// rows and their 8 up rows, so that the meeting in shared memory has both halves of each output.
// gemv_stream_kernel: many tiles, every warp of a one-wave grid takes an equal range of whole tiles (kAct:
// p.act, tiles of w_row's order).
// launch_best (gemv.cu) picks U and KS.
#pragma once
#include <type_traits>

#include "gemm/gemv_common.cuh"

namespace minfer::gemm_impl {
namespace {

// gemv_kernel's outputs with p.act: the CTA's tiles' sums (red, as the kernel leaves them: fragment j of
// warp w at lane l) met over the ks warps of each tile, gate and up the fragments two on (store_gated);
// consecutive threads take consecutive outputs of one row.
template <typename T, int NT>
__device__ __forceinline__ void store_act_tiles(const Params<T, T>& p, const float (*red)[NT * 4][32], int tiles,
                                                int ks, int m_base) {
  const int half = p.N / 2;
  for (int i = threadIdx.x; i < tiles * 8 * 8 * NT; i += kThreads) {
    const int tl = i / (8 * 8 * NT), r = i % (8 * 8 * NT), ml = r / 8, nl = r % 8;
    const int n = (blockIdx.x * tiles + tl) * 8 + nl, m = m_base + ml;
    if (n < half && m < p.M) {
      const int src_lane = 4 * nl + ((ml & 7) >> 1), j = (ml >> 3) * 4 + (ml & 1);  // gate; up at j + 2
      float gate = 0.f, up = 0.f;
      for (int w = 0; w < ks; ++w) gate += red[tl * ks + w][j][src_lane], up += red[tl * ks + w][j + 2][src_lane];
      store_gated(p, m, n, gate, up);
    }
  }
}

// Block: 8 / KS tiles of 16 W rows, each split over KS = 2^ks_log2 warps along K; blockIdx.y picks its
// block of 8 * NT rows of A (launch_best launches a grid per 65535 blocks). MIN_BLOCKS caps the registers
// so that that many CTAs fit on an SM (see launch_best). A round's X comes up front where W and X fit the
// cap (U * NT <= 4 at 3 CTAs per SM, 80 registers; <= 8 at 2), else one step ahead of each mma.
template <typename T, int NT, int U, int MIN_BLOCKS>
__global__ void __launch_bounds__(kThreads, MIN_BLOCKS) gemv_kernel(const Params<T, T> p, int ks_log2) {
  constexpr bool kXAhead = NT * U * MIN_BLOCKS > 16;
  const int ks = 1 << ks_log2, tiles = kWarps >> ks_log2;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int split = warp & (ks - 1), tile = blockIdx.x * tiles + (warp >> ks_log2);
  // This thread's W rows: na, nb = na + 8; with p.act gate row 8 tile + g and its up row, half rows on (w_row).
  const int half = p.N / 2;
  const int na = w_row(p, tile * 16 + g, p.act), nb = w_row(p, tile * 16 + g + 8, p.act);

  // K in 32-wide steps (4 chunks of 8), split in whole pairs of steps so that warps meet on 128-byte lines.
  const int chunks = p.K / 8, steps = (chunks + 3) / 4, pairs = (steps + 1) / 2;
  const int s_begin = min(steps, 2 * ((split * pairs) >> ks_log2));
  const int s_end = tile * 16 < p.N ? min(steps, 2 * (((split + 1) * pairs) >> ks_log2)) : s_begin;

  const bool a_ok = p.act ? na < half : na < p.N, b_ok = p.act ? a_ok : nb < p.N;
  const uint4* wa = reinterpret_cast<const uint4*>(p.B + (int64_t)(a_ok ? na : 0) * p.sbn) + t;
  const uint4* wb = reinterpret_cast<const uint4*>(p.B + (int64_t)(b_ok ? nb : 0) * p.sbn) + t;

  __shared__ float red[kWarps][NT * 4][32];  // each warp's accumulator fragments
  uint4 pre_a[U], pre_b[U];
  // W's first round loads before the wait where W is static (the condition is the same for the whole
  // CTA, which meets at the barrier below; a warp with no K range loads nothing and adds zeros).
  // One block of A rows per CTA; the host launches more grids past 65535 blocks (a loop over blocks
  // here holds registers that spill at 3 CTAs per SM).
  auto load_first_round = [&] { load_w_round<U>(pre_a, pre_b, wa, wb, a_ok, b_ok, s_begin, s_end, chunks, t); };
  if (p.static_b) load_first_round();
  wait_for_previous_grid();
  if (!p.static_b) load_first_round();

  // This CTA's block of 8 * NT rows of A, W's first round in pre_a / pre_b.
  const int m_base = blockIdx.y * 8 * NT;
  bool x_ok[NT];
  const uint4* xp[NT];
  x_rows(p, m_base, g, t, xp, x_ok);
  float acc[NT][4];
  zero(acc);

  accumulate_from<T, NT, U, 4, kXAhead>(acc, pre_a, pre_b, wa, wb, a_ok, b_ok, xp, x_ok, s_begin, s_end, chunks, t);

  // acc[nt][2h + e] is D[m = m_base + 8 nt + 2t + e][n = tile * 16 + g + 8h].
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) red[warp][nt * 4 + i][lane] = acc[nt][i];
  __syncthreads();
  if (p.act) return store_act_tiles<T, NT>(p, red, tiles, ks, m_base);
  // Consecutive threads take consecutive n of one output row.
  for (int i = threadIdx.x; i < tiles * 16 * 8 * NT; i += kThreads) {
    const int tl = i / (16 * 8 * NT), r = i % (16 * 8 * NT), ml = r / 16, nl = r % 16;
    const int n = (blockIdx.x * tiles + tl) * 16 + nl, m = m_base + ml;
    if (n < p.N && m < p.M) {
      const int src_lane = 4 * (nl & 7) + ((ml & 7) >> 1), j = (ml >> 3) * 4 + (nl >> 3) * 2 + (ml & 1);
      float s = 0.f;
      for (int w = 0; w < ks; ++w) s += red[tl * ks + w][j][src_lane];
      store_out(p, m, n, s);
    }
  }
}

// Many tiles (far more than warps resident): every warp of a one-wave grid takes an equal, contiguous
// range of whole tiles (all of K, no split, no shared memory) and writes its outputs itself. Each SM
// then carries the same number of tiles within one, where CTAs of whole tiles would leave a partial
// last wave (28672 x 4096: 448 CTAs of 4 tiles on 264 slots). M <= 8 * NT.
template <typename T, int NT, int U, int MIN_BLOCKS, bool kAct>
__global__ void __launch_bounds__(kThreads, MIN_BLOCKS) gemv_stream_kernel(const Params<T, T> p) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int64_t warps = (int64_t)gridDim.x * kWarps, gw = (int64_t)blockIdx.x * kWarps + (threadIdx.x >> 5);
  const int64_t tiles = (p.N + 15) / 16;
  const int t_begin = (int)(gw * tiles / warps), t_end = (int)((gw + 1) * tiles / warps);
  const int chunks = p.K / 8, steps = (chunks + 3) / 4;
  bool x_ok[NT];
  const uint4* xp[NT];
  // One tile of 16 W rows; `preloaded`: its first round is in pre_a / pre_b.
  uint4 pre_a[U], pre_b[U];
  auto w_tile = [&](int tile, auto preloaded) {
    const int n0 = tile * 16 + g;  // rows n0 and n0 + 8 in w_row's order
    const bool a_ok = n0 < p.N, b_ok = n0 + 8 < p.N;
    const uint4* wa = reinterpret_cast<const uint4*>(p.B + (int64_t)(a_ok ? w_row(p, n0, kAct) : 0) * p.sbn) + t;
    const uint4* wb = reinterpret_cast<const uint4*>(p.B + (int64_t)(b_ok ? w_row(p, n0 + 8, kAct) : 0) * p.sbn) + t;
    float acc[NT][4];
    zero(acc);
    if constexpr (decltype(preloaded)::value) {
      load_w_round<U>(pre_a, pre_b, wa, wb, a_ok, b_ok, 0, steps, chunks, t);
      wait_for_previous_grid();
      x_rows(p, 0, g, t, xp, x_ok);
      accumulate_from<T, NT, U>(acc, pre_a, pre_b, wa, wb, a_ok, b_ok, xp, x_ok, 0, steps, chunks, t);
    } else {
      accumulate<T, NT, U>(acc, wa, wb, a_ok, b_ok, xp, x_ok, 0, steps, chunks, t);
    }
    store_tile(p, acc, n0, p.N, t, kAct);
  };
  // A static W: the first tile's first round loads before the wait, where the registers allow (6-step
  // rounds at 3 CTAs per SM, 80 registers, spilled holding it).
  int tile = t_begin;
  if (U * MIN_BLOCKS <= 16 && p.static_b && tile < t_end) {
    w_tile(tile++, std::true_type{});
  } else {
    wait_for_previous_grid();
    x_rows(p, 0, g, t, xp, x_ok);
  }
  for (; tile < t_end; ++tile) w_tile(tile, std::false_type{});
}

}  // namespace
}  // namespace minfer::gemm_impl
