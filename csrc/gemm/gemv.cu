// Small-M (decode) path: stream W once at HBM speed. D[m, n] = sum_k A[m, k] * W[n, k].
//
// Tensor cores with the operands swapped: 16 rows of W are the A operand of mma.sync m16n8k16 and
// up to 8 (NT = 1) or 16 (NT = 2) activation rows are the B operand, so the math costs nothing and
// the kernel is a pure W stream. A dot product may take its k terms in any order, so every thread
// loads W and X straight from global into registers in 16-byte chunks under one k permutation: in a
// 32-wide k step, thread (g = lane / 4, t = lane % 4) holds W rows g and g + 8 and X row g at
// k = 8t .. 8t + 7; the low and high halves of those uint4 feed two mma k-steps (see mma_step).
//
// A warp owns a 16-row tile of W and a slice of K; KS = 1..8 warps of a CTA split one tile's K and
// meet in shared memory, where the 8 / KS tiles of the CTA go through store_out. A round's W loads (U
// steps) go out in one burst ahead of its mmas, then its X: all of it, or at NT * U > 8 one step
// ahead of each mma, which keeps 8-step rounds within 128 registers. U = 8 puts 8 KB of W in flight
// per warp, two CTAs of 8 warps per SM 128 KB (U = 4 with three CTAs: 96 KB), well past what HBM
// latency times bandwidth needs (~4.2 TB/s x ~1 us / 132 SMs ~ 32 KB per SM). (Under the register cap
// ptxas places the first mmas before the last step's loads, which then leave one latency late; a fake
// dependency that kept every load ahead measured no better: M = 1 from 5% faster to 4% slower, the
// lm_heads at M = 8 3% slower.)
// Which U and K split a shape gets is launch_best's choice: all CTAs resident at once, equal shares
// per SM. W goes through the non-allocating L1 path; X (a few KB) stays resident in L1/L2 and is
// re-read per tile. Larger M (forced path) walks 16-row blocks of A along grid.y, re-reading W once
// per block.
//
// M = 1 on small W (every warp one row pair, or a K slice of one) runs gemv_m1_kernel instead: two
// W rows per warp in 512-byte runs, the mma's 16 rows being 8 segments of each (see there). M <= 16 on
// many tiles with K >= 4096 (or 2048 on the largest W; the lm_heads, 28672 x 4096) runs
// gemv_ring_kernel: the same mma, with W staged through per-warp shared-memory rings that cp.async
// keeps full (see there).
//
// Fixed costs (a 32 MB W streams in 8 us): on Hopper the kernel is launched as a programmatic
// dependent of the previous kernel in the stream and lets its own dependents launch at once, so
// its CTAs can be resident while the previous grid drains. Before griddepcontrol.wait, which
// returns once the previous grid is complete and its writes are visible, a CTA reads nothing, unless
// the caller says W is static (linear's static_weight, the engine's weights): then each warp loads
// its first round of W into registers (the rings: fills them) before the wait, and X after it.
// Back to back on H200 (fp16, perf/gemm.md "Session 14"): 1 x 3072 x 2048 5.22 -> 4.71 us,
// 1 x 16384 x 2048 18.4 -> 17.5, 16 x 16384 x 2048 19.2 -> 18.3, 8 x 28672 x 4096 57.6 -> 56.7;
// 16 x 6144 x 4096 15.6 -> 15.9 and 8 x 2048 x 8192 11.1 -> 11.4 lost. (An L2 prefetch of the same
// round, in the ninth session, measured equal or slower: the loads must land somewhere.)
// Needs K % 8 == 0, row strides % 8 == 0 and 16-byte aligned bases (checked by the dispatcher) and
// sm_80 (mma.sync with bf16).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <string>
#include <type_traits>

#include "common/launch.h"
#include "gemm/epilogue.h"
#include "gemm/ptx.h"

namespace minfer::gemm_impl {
namespace {

constexpr int kThreads = 256, kWarps = kThreads / 32;

// 16 bytes of W, read once: skip L1, let L2 fetch 256 bytes (the rest of the row's run comes next).
// pred false: zeros, nothing read.
__device__ __forceinline__ uint4 ld_w(const uint4* ptr, bool pred) {
  uint4 v;
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %5, 0;\n"
      " mov.b32 %0, 0;\n mov.b32 %1, 0;\n mov.b32 %2, 0;\n mov.b32 %3, 0;\n"
      " @p ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];\n}\n"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(ptr), "r"((int)pred));
  return v;
}

// 16 bytes of X: every tile re-reads them, so they stay in L1.
__device__ __forceinline__ uint4 ld_x(const uint4* ptr, bool pred) {
  uint4 v;
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %5, 0;\n"
      " mov.b32 %0, 0;\n mov.b32 %1, 0;\n mov.b32 %2, 0;\n mov.b32 %3, 0;\n"
      " @p ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n}\n"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(ptr), "r"((int)pred));
  return v;
}

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
      mma<T>(acc[nt], a[j], b);
    }
  }
}

template <int NT>
__device__ __forceinline__ void zero(float (&acc)[NT][4]) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
}

// One warp's 16-row tile of D from its accumulators: acc[nt][2h + e] is D[m = 8 nt + 2t + e][n = n0 + 8h]
// (n0 = the tile's first row + g); rows from n_end on are not stored.
template <typename T, int NT>
__device__ __forceinline__ void store_tile(const Params<T, T>& p, const float (&acc)[NT][4], int n0, int n_end, int t) {
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
    va[u] = ld_w(wa + STEP * (int64_t)s, ok && a_ok);
    vb[u] = ld_w(wb + STEP * (int64_t)s, ok && b_ok);
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
    for (int nt = 0; nt < NT; ++nt) x[nt] = ld_x(xp[nt] + STEP * (int64_t)s, ok && x_ok[nt]);
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

// The same, with the first round's W already in va0 / vb0 (loaded before griddepcontrol.wait; see the
// kernels). Kept apart from accumulate so that the loop above compiles as it did without it.
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
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");  // the previous kernel's writes are visible from here
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
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
  const int n0 = tile * 16 + g;  // this thread's W rows: n0, n0 + 8

  // K in 32-wide steps (4 chunks of 8), split in whole pairs of steps so that warps meet on 128-byte lines.
  const int chunks = p.K / 8, steps = (chunks + 3) / 4, pairs = (steps + 1) / 2;
  const int s_begin = min(steps, 2 * ((split * pairs) >> ks_log2));
  const int s_end = tile * 16 < p.N ? min(steps, 2 * (((split + 1) * pairs) >> ks_log2)) : s_begin;

  const bool a_ok = n0 < p.N, b_ok = n0 + 8 < p.N;
  const uint4* wa = reinterpret_cast<const uint4*>(p.B + (int64_t)(a_ok ? n0 : 0) * p.sbn) + t;
  const uint4* wb = reinterpret_cast<const uint4*>(p.B + (int64_t)(b_ok ? n0 + 8 : 0) * p.sbn) + t;

  __shared__ float red[kWarps][NT * 4][32];  // each warp's accumulator fragments
  uint4 pre_a[U], pre_b[U];
  // W's first round loads before the wait where W is static (the condition is the same for the whole
  // CTA, which meets at the barrier below; a warp with no K range loads nothing and adds zeros).
  // One block of A rows per CTA; the host launches more grids past 65535 blocks. (A loop over blocks
  // here, with a second copy of the block code for the blocks after the first, held registers that
  // spilled at 3 CTAs per SM and slowed every configuration: H200, fp16, us, 16 x 6144 x 4096 15.8 ->
  // 14.2, 8 x 6144 x 4096 14.2 -> 12.7, 16 x 16384 x 2048 18.9 -> 18.6, 1 x 960 x 576 1.82 -> 1.67;
  // perf/gemm.md "Session 20".)
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
template <typename T, int NT, int U, int MIN_BLOCKS>
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
    const int n0 = tile * 16 + g;
    const bool a_ok = n0 < p.N, b_ok = n0 + 8 < p.N;
    const uint4* wa = reinterpret_cast<const uint4*>(p.B + (int64_t)(a_ok ? n0 : 0) * p.sbn) + t;
    const uint4* wb = reinterpret_cast<const uint4*>(p.B + (int64_t)(b_ok ? n0 + 8 : 0) * p.sbn) + t;
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
    store_tile(p, acc, n0, p.N, t);
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

// W through per-warp shared-memory rings (the way flash decode streams K/V): a stage is R W rows x
// 4096 / R k (8 KB; R = 16: 256 k, R = 32: 128 k), each lane copying 16-byte chunks with cp.async, so
// one instruction of the warp reads 512 contiguous bytes of one row (R = 16) or 256 of each of two
// (R = 32). A warp's ring holds kRingStages stages, all in flight before the first is used and
// refilled as each is consumed, so the bytes in flight never drop to zero between rounds as they do
// with register loads. Each CTA takes an equal contiguous range of W rows in units of `granule` rows
// (R: whole tiles; 1: to the row, so that SMs finish together where whole tiles would leave some with
// one more, e.g. 13 or 14 per SM at 1 x 28672 x 4096), tiled by R from its first row; its warps split
// the CTA's (tile, k chunk) stages evenly. A tile that two or more warps share is summed in warp order
// through shared memory (the rings' space, once they are drained; deterministic);
// whole tiles are stored by their warp.
// - A warp copies its stage's W fragments into registers and refills the slot before its mmas, so the
//   slot is back in flight while X's loads land: at M > 4, X (64 KB at M = 8 and K = 4096) no longer
//   fits in the ~30 KB of L1 that the rings leave and comes from L2 at DRAM-queue latency (H200, fp16,
//   us, refilled after against before the mmas: 8 x 128256 x 4096 245.9 -> 241.6, 8 x 28672 x 4096
//   55.5 -> 54.5, 4 x 128256 x 4096 241.2 -> 237.4, 1 x 28672 x 4096 53.9 -> 53.3).
// - R = 32 at M > 4 halves X's reads per W byte (each X chunk serves 32 rows): 8 x 128256 x 4096
//   245.4 -> 241.6, 8 x 128256 x 2048 124.6 -> 122.3; at M = 1 it is level or slower (232.9 against
//   231.8), and R = 64 (128 bytes of a row per stage) streamed W slower everywhere (M = 1: 238 -> 262).
// - One tile per stage (R = 16) keeps two mma accumulators (even and odd k steps) to halve the
//   dependent chain (1 x 28672 x 4096: 59.4 -> 58.6 us); R = 32 has two tiles for that.
// Four warps with two stages each (64 KB of rings, three CTAs per SM: 192 KB in flight) measured
// best of 4 x 3 (two CTAs per SM), 6 x 2 and 4 x 6 / 8 x 3 (one CTA per SM) on H200 where W has many
// tiles. Where it has fewer 16-row tiles than the resident warps (N < 16896), three CTAs per SM would
// each hold a tile or two and read all of X for it; one CTA of 12 warps per SM (the same 192 KB) holds
// three times the rows, and wins on a large W (see launch_ring).
constexpr int kStageBytes = 8192, kStageVecs = kStageBytes / 16;
constexpr int kRingStages = 2;
// Shared memory of a CTA of `warps` rings; the partials reuse it at the end.
constexpr int ring_smem_bytes(int warps) { return warps * kRingStages * kStageBytes; }

// R: W rows per stage (16 or 32); NT: n8 tiles of X rows (M <= 8 NT); WARPS: 4 (three CTAs per SM) or
// 12 (one).
template <typename T, int R, int NT, int WARPS>
__global__ void __launch_bounds__(WARPS * 32, WARPS == 4 ? 3 : 1) gemv_ring_kernel(const Params<T, T> p, int granule) {
  constexpr int kRowChunks = kStageVecs / R;     // 16-byte chunks of a row in a stage: 32 or 16
  constexpr int kRowsPerCopy = 32 / kRowChunks;  // rows one copy instruction of the warp covers
  constexpr int kSub = R / 16;                   // 16-row mma tiles in a stage
  constexpr int kPar = kSub == 1 ? 2 : 1;        // mma chains per tile
  // The slot refills before the mmas, except with 16 rows and two n8 tiles: the stage's W fragments
  // and X's then need 196 registers against the 170 that 384 threads per SM leave.
  constexpr bool kRefillFirst = !(R == 16 && NT == 2);
  static_assert((R == 16 || R == 32) && (NT == 1 || NT == 2), "stage shape");
  static_assert(WARPS * 2 * kSub * NT * 4 * 32 * 4 <= ring_smem_bytes(WARPS), "partials fit in the rings");
  extern __shared__ __align__(16) uint4 smem_ring[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  // This CTA's W rows [row0, row1), cut into R-row tiles from row0 (the last one may be short).
  const int64_t units = (p.N + granule - 1) / granule;
  const int row0 = (int)min((int64_t)p.N, blockIdx.x * units / gridDim.x * granule);
  const int row1 = (int)min((int64_t)p.N, (blockIdx.x + 1) * units / gridDim.x * granule);
  const int chunks = p.K / 8, kc = (chunks + kRowChunks - 1) / kRowChunks;  // stages per tile
  const int stages = (row1 - row0 + R - 1) / R * kc;
  auto first_stage = [&](int w) { return (int)((int64_t)w * stages / WARPS); };
  const int s_begin = first_stage(warp), s_end = first_stage(warp + 1);
  uint4* ring = smem_ring + warp * kRingStages * kStageVecs;  // [stage][R rows][kRowChunks], swizzled

  // Chunk c of row r sits at c ^ 4 (r & 1): the 8 lanes of a quarter warp read rows g, g + 1 at
  // chunks 4j + t, which then fall in 8 different bank groups.
  auto load = [&](int s, int slot) {
    const int n_base = row0 + s / kc * R, cl = lane % kRowChunks, c = (s % kc) * kRowChunks + cl;
    const uint32_t dst = smem_addr(ring + slot * kStageVecs);
#pragma unroll
    for (int i = 0; i < R / kRowsPerCopy; ++i) {
      const int r = i * kRowsPerCopy + lane / kRowChunks;
      const bool ok = c < chunks && n_base + r < row1;  // past the range or K: zeros, nothing read
      cp_async16(dst + 16 * (r * kRowChunks + (cl ^ ((r & 1) << 2))),
                 p.B + (ok ? (int64_t)(n_base + r) * p.sbn + 8 * c : 0), ok ? 16 : 0);
    }
    cp_async_commit();
  };
  if (!p.static_b) wait_for_previous_grid();
#pragma unroll
  for (int i = 0; i < kRingStages; ++i) {
    if (s_begin + i < s_end) load(s_begin + i, i);
    else cp_async_commit();  // one group per stage: the waits count groups
  }
  if (p.static_b) wait_for_previous_grid();  // a static W fills the rings first

  bool x_ok[NT];
  const uint4* xp[NT];
  x_rows(p, 0, g, t, xp, x_ok);
  // A warp's first and last tiles may be shared with its neighbours, the ones between are its own.
  // The first one's sums wait in `first` and the last one's in acc[0] until the rings are drained.
  // `each` visits every accumulator (mma tile i, n8 tile nt, element e) of one tile.
  auto each = [](auto&& f) {
#pragma unroll
    for (int i = 0; i < kSub; ++i)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) f(i, nt, e);
  };
  float acc[kPar][kSub][NT][4], first[kSub][NT][4];
  auto zero_acc = [&] {
#pragma unroll
    for (int q = 0; q < kPar; ++q) each([&](int i, int nt, int e) { acc[q][i][nt][e] = 0.f; });
  };
  zero_acc();
  auto whole = [&](int tile_local) { return s_begin <= tile_local * kc && s_end >= (tile_local + 1) * kc; };
  auto flush = [&](int tile_local) {
#pragma unroll
    for (int q = 1; q < kPar; ++q) each([&](int i, int nt, int e) { acc[0][i][nt][e] += acc[q][i][nt][e]; });
    if (whole(tile_local)) {
#pragma unroll
      for (int i = 0; i < kSub; ++i) store_tile(p, acc[0][i], row0 + tile_local * R + 16 * i + g, row1, t);
    } else if (tile_local == s_begin / kc) {
      each([&](int i, int nt, int e) { first[i][nt][e] = acc[0][i][nt][e]; });
    }
  };

  int cur = s_begin < s_end ? s_begin / kc : -1, slot = 0;
  for (int s = s_begin; s < s_end; ++s) {
    const int tile_local = s / kc, c0 = (s % kc) * kRowChunks;
    if (tile_local != cur) {
      flush(cur);
      cur = tile_local;
      zero_acc();
    }
    uint4 vx[kRowChunks / 4][NT];  // X first: L1 hits at small M, and in flight across the wait
#pragma unroll
    for (int j = 0; j < kRowChunks / 4; ++j)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) vx[j][nt] = ld_x(xp[nt] + c0 + 4 * j, x_ok[nt] && c0 + 4 * j + t < chunks);
    cp_async_wait<kRingStages - 1>();  // stage s has landed (this lane's copies) ...
    __syncwarp();                      // ... and every lane's
    const uint4* st = ring + slot * kStageVecs;
    uint4 w[kRowChunks / 4][kSub][2];  // this thread's W fragments of the stage: rows 16 i + g and + 8
#pragma unroll
    for (int j = 0; j < kRowChunks / 4; ++j) {
      const int c = (4 * j + t) ^ ((g & 1) << 2);
#pragma unroll
      for (int i = 0; i < kSub; ++i)
        w[j][i][0] = st[(16 * i + g) * kRowChunks + c], w[j][i][1] = st[(16 * i + g + 8) * kRowChunks + c];
    }
    auto refill = [&] {
      __syncwarp();  // every lane is done with the slot
      if (s + kRingStages < s_end) load(s + kRingStages, slot);
      else cp_async_commit();
      if (++slot == kRingStages) slot = 0;
    };
    if constexpr (kRefillFirst) refill();  // every lane has its fragments: refill before waiting for X
#pragma unroll
    for (int j = 0; j < kRowChunks / 4; ++j)
#pragma unroll
      for (int i = 0; i < kSub; ++i) mma_step<T, NT>(acc[j % kPar][i], w[j][i][0], w[j][i][1], vx[j]);
    if constexpr (!kRefillFirst) refill();
  }
  if (cur >= 0) flush(cur);
  cp_async_wait<0>();

  // Shared tiles: the partials go where the rings were; the first warp that touched a tile sums every
  // toucher's partial, in warp order.
  auto partial = reinterpret_cast<float(*)[2][kSub][NT][4][32]>(smem_ring);  // [warp][first / last tile]
  const int t_first = s_begin / kc, t_last = (s_end - 1) / kc;
  __syncthreads();  // every ring is drained
  if (s_begin < s_end) {
    auto put = [&](int side, const float (&a)[kSub][NT][4]) {
      each([&](int i, int nt, int e) { partial[warp][side][i][nt][e][lane] = a[i][nt][e]; });
    };
    if (!whole(t_first)) put(0, first);
    if (t_last != t_first && !whole(t_last)) put(1, acc[0]);
  }
  __syncthreads();
  if (s_begin == s_end) return;
  for (int side = 0; side < 2; ++side) {
    const int tile_local = side == 0 ? t_first : t_last;
    if (side == 1 && tile_local == t_first) break;
    const int t_begin = tile_local * kc, t_end = t_begin + kc;
    if (whole(tile_local)) continue;  // stored above
    if (s_begin > t_begin) continue;  // an earlier warp sums it
    float sum[kSub][NT][4];
    each([&](int i, int nt, int e) { sum[i][nt][e] = 0.f; });
    for (int w = warp; w < WARPS && first_stage(w) < t_end; ++w) {
      if (first_stage(w) == first_stage(w + 1)) continue;  // no stages
      const int w_side = tile_local == first_stage(w) / kc ? 0 : 1;
      each([&](int i, int nt, int e) { sum[i][nt][e] += partial[w][w_side][i][nt][e][lane]; });
    }
#pragma unroll
    for (int i = 0; i < kSub; ++i) store_tile(p, sum[i], row0 + tile_local * R + 16 * i + g, row1, t);
  }
}

// M = 1: W rows in pairs, each read in long runs. The 16 A rows of the mma are two W rows cut into
// 8 segments of 32 elements (fragment rows g and g + 8: segment g of rows n0 and n0 + 1), and the 8 B
// columns are the same 8 segments of x, so the wanted sums are the diagonals D[g][g] and D[g + 8][g]
// (the other 112 products are wasted; the tensor cores have the room). A k step is then 256 elements:
// each load instruction of the warp reads 512 contiguous bytes of one row, and a round of U steps
// 4 KB of each of two rows, where the 16-row tiles read 512 bytes of each of 16 rows. Warps in
// groups of KS = 2^ks_log2 split K; the groups of the grid take equal contiguous ranges of pairs
// (at most one pair apart), and a group meets in shared memory per pair. MIN_BLOCKS caps the registers
// so that that many CTAs fit on an SM.
template <typename T, int U, int MIN_BLOCKS>
__global__ void __launch_bounds__(kThreads, MIN_BLOCKS) gemv_m1_kernel(const Params<T, T> p, int ks_log2) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int ks = 1 << ks_log2, split = warp & (ks - 1), group_in_cta = warp >> ks_log2;
  const int64_t groups = (int64_t)gridDim.x * (kWarps >> ks_log2);
  const int64_t group = (int64_t)blockIdx.x * (kWarps >> ks_log2) + group_in_cta, pairs = (p.N + 1) / 2;
  const int pr_begin = (int)(group * pairs / groups), pr_end = (int)((group + 1) * pairs / groups);
  const int chunks = p.K / 8, steps = (chunks + 31) / 32, c = 4 * g + t;  // c: this thread's chunk of a step
  const int s_begin = (split * steps) >> ks_log2, s_end = ((split + 1) * steps) >> ks_log2;

  const uint4* const xp[1] = {reinterpret_cast<const uint4*>(p.A) + c};
  const bool x_ok[1] = {true};
  __shared__ float partial[2][kWarps][2];  // [pair parity][warp][row of the pair]
  uint4 pre_a[U], pre_b[U];
  // One pair of W rows; `preloaded`: its first round is in pre_a / pre_b (then it waits for the grid).
  auto w_pair = [&](int pr, int parity, auto preloaded) {
    const int n0 = 2 * pr;
    const bool b_ok = n0 + 1 < p.N;
    const uint4* wa = reinterpret_cast<const uint4*>(p.B + (int64_t)n0 * p.sbn) + c;
    const uint4* wb = reinterpret_cast<const uint4*>(p.B + (int64_t)(b_ok ? n0 + 1 : n0) * p.sbn) + c;
    float acc[1][4] = {{0.f, 0.f, 0.f, 0.f}};
    if constexpr (decltype(preloaded)::value) {
      load_w_round<U, 32>(pre_a, pre_b, wa, wb, true, b_ok, s_begin, s_end, chunks, c);
      wait_for_previous_grid();
      accumulate_from<T, 1, U, 32>(acc, pre_a, pre_b, wa, wb, true, b_ok, xp, x_ok, s_begin, s_end, chunks, c);
    } else {
      accumulate<T, 1, U, 32>(acc, wa, wb, true, b_ok, xp, x_ok, s_begin, s_end, chunks, c);
    }
    // Thread (g, t) holds D[g][2t + e] in acc[e] and D[g + 8][2t + e] in acc[2 + e]: the diagonal is
    // at t = g / 2, e = g % 2.
    const bool diag = t == (g >> 1), odd = g & 1;
    float r0 = diag ? (odd ? acc[0][1] : acc[0][0]) : 0.f, r1 = diag ? (odd ? acc[0][3] : acc[0][2]) : 0.f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      r0 += __shfl_xor_sync(0xffffffffu, r0, o);
      r1 += __shfl_xor_sync(0xffffffffu, r1, o);
    }
    if (ks > 1) {
      // Alternate buffers per pair: a warp writes this parity again only after the next pair's
      // barrier, which the group's first warp reaches after reading it.
      if (lane == 0) partial[parity][warp][0] = r0, partial[parity][warp][1] = r1;
      asm volatile("bar.sync %0, %1;\n" ::"r"(1 + group_in_cta), "r"(32 * ks) : "memory");
      if (split != 0) return;
      r0 = r1 = 0.f;
      for (int w = 0; w < ks; ++w) r0 += partial[parity][warp + w][0], r1 += partial[parity][warp + w][1];
    }
    if (lane == 0) {
      store_out(p, 0, n0, r0);
      if (b_ok) store_out(p, 0, n0 + 1, r1);
    }
  };
  // A static W: the first pair's first round loads before the wait (the same for the warps of a
  // group, which meet at a barrier per pair; a warp with no K slice loads nothing).
  int pr = pr_begin, parity = 0;
  if (p.static_b && pr < pr_end) {
    w_pair(pr++, parity, std::true_type{});
    parity ^= 1;
  } else {
    wait_for_previous_grid();
  }
  for (; pr < pr_end; ++pr, parity ^= 1) w_pair(pr, parity, std::false_type{});
}

// Work per SM, average over heaviest: `per_sm` units spread over the SMs, whole units each.
inline double sm_balance(double per_sm) { return per_sm / std::ceil(per_sm); }

// CTAs per SM of a configuration built for MIN_BLOCKS: what fits, but no more than that. A build that
// needs fewer registers than its cap would otherwise let more in and change the grid (4 per SM
// measured slower where 3 were designed, perf/gemm.md "Session 13").
template <int MIN_BLOCKS, typename Kernel>
int ctas_per_sm(Kernel kernel) {
  int n = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, 0));
  return std::clamp(n, 1, MIN_BLOCKS);
}

// A configuration's name in a plan: kernel, steps per round, CTAs per SM it is built for.
inline std::string config(const char* kernel, int u, int ctas_per_sm) {
  return std::string(kernel) + " U=" + std::to_string(u) + " " + std::to_string(ctas_per_sm) + "/SM";
}

// Launches a kernel as a programmatic dependent or, given a plan to fill (linear_plan: tests check which
// configuration a shape gets), only describes the launch; `what` makes the text only then.
template <typename What, typename Kernel, typename... Args>
void launch_or_describe(std::string* plan, What what, Kernel kernel, dim3 grid, dim3 block, size_t smem,
                        cudaStream_t stream, Args... args) {
  if (plan != nullptr) {
    *plan = what() + " grid=" + std::to_string(grid.x) + (grid.y > 1 ? "x" + std::to_string(grid.y) : "");
    return;
  }
  launch_pdl(kernel, grid, block, smem, stream, args...);
}

// One compiled shape of gemv_kernel, with how many of its CTAs an SM holds.
template <typename T>
struct Variant {
  void (*launch)(const Params<T, T>&, int ks_log2, dim3 grid, cudaStream_t, std::string* plan);
  int u, per_sm;
};

template <typename T, int NT, int U, int MIN_BLOCKS>
void launch_variant(const Params<T, T>& p, int ks_log2, dim3 grid, cudaStream_t stream, std::string* plan) {
  auto what = [&] { return config("tiles", U, MIN_BLOCKS) + " ks=" + std::to_string(1 << ks_log2); };
  launch_or_describe(plan, what, gemv_kernel<T, NT, U, MIN_BLOCKS>, grid, dim3(kThreads), 0, stream, p, ks_log2);
}

template <typename T, int NT, int U, int MIN_BLOCKS>
Variant<T> variant() {
  static const int per_sm = ctas_per_sm<MIN_BLOCKS>(gemv_kernel<T, NT, U, MIN_BLOCKS>);
  return {&launch_variant<T, NT, U, MIN_BLOCKS>, U, per_sm};
}

// Far more tiles than resident warps (the lm_heads, 28672 x 4096): gemv_stream_kernel<NT, U>, one
// wave whose warps split the tiles evenly, where CTAs of whole tiles would leave SMs with one CTA
// more than others. Returns false where it does not apply: fewer tiles than half the warps, or SMs
// more than ~10% apart.
template <typename T, int NT, int U, int MIN_BLOCKS>
bool launch_stream(const Params<T, T>& p, int sms, cudaStream_t stream, std::string* plan) {
  static const int per_sm = ctas_per_sm<MIN_BLOCKS>(gemv_stream_kernel<T, NT, U, MIN_BLOCKS>);
  const int64_t grid = int64_t(per_sm) * sms, tiles = (p.N + 15) / 16;
  if (tiles * 2 < grid * kWarps || sm_balance(double(tiles) / sms) < 0.9) return false;
  launch_or_describe(plan, [] { return config("stream", U, MIN_BLOCKS); }, gemv_stream_kernel<T, NT, U, MIN_BLOCKS>,
                     dim3((unsigned)grid), dim3(kThreads), 0, stream, p);
  return true;
}

// The stream runs fastest when every CTA is resident from the start and the SMs carry equal shares:
// a second, partial wave runs with a fraction of the bytes in flight, and an SM with one CTA more
// than its neighbours finishes last (6144 x 4096 took 17.3 us as 384 CTAs on 264 slots, 14.5 us
// on 396).
// - Where it applies (M <= 8 * NT), gemv_stream_kernel comes first. Its round is U_BIG or U_SMALL
//   steps, whichever leaves fewer slots idle in a tile's last round (U_BIG on a tie): K = 576 is 18
//   steps, 3 rounds of 6 where rounds of 8 idle 6 of 24 slots (1 x 49152 x 576, fp16, H200: CTAs
//   of 4-step rounds 17.3 us, stream of 8-step rounds 17.5, of 6-step rounds 16.1). M 9..16 takes
//   the same rounds with X one step ahead (same call, H200, fp16, against {6, 4} with all of X up
//   front: 16 x 128256 x 4096 264.4 -> 254.6 us, 16 x 128256 x 2048 139.7 -> 134.3, 16 x 49152 x 576
//   19.5 -> 18.9; the CTA variants lost with it and keep short rounds). That is at 2 CTAs per SM;
//   at K <= 1024 (a tile in a few rounds) rounds of 6 or 4 at 3 CTAs per SM come first (H200, fp16,
//   two passes: 16 x 49152 x 576 17.05-17.15 -> 15.79-15.84 us, 1 x 49152 x 576 15.43 -> 15.08-15.11;
//   at K >= 2048 they were equal or slower, 8 x 128256 x 2048 127.0-127.6 -> 136.0-136.4,
//   8 x 28672 x 4096 57.4-57.7 -> 62.0-62.4).
// - Otherwise, among the variants (first = preferred) and K splits, keep the configurations whose
//   CTAs all fit at once, whose heaviest SM carries at most ~10% more than the average and whose
//   warps get at least one full round; take the one with the most CTAs (on a tie, the longer rounds).
// - The rest (too few tiles to balance) take the smallest K split that gives every SM about two CTAs,
//   on the first variant whose CTAs then all fit at once: 3072 x 2048 takes KS = 8 (192 CTAs of one
//   tile); three 16-row blocks of 3072 x 576 take 288 CTAs of 3 per SM in one wave, where 2 per SM
//   ran 264 + 24 (H200, fp16: 37 x 3072 x 576 6.9 -> 5.5 us, M = 33..48 alike; no other shape of the
//   decode sweep or of M 17..64 on small W moved).
template <typename T, int NT, int U_BIG, int U_SMALL>
void launch_best(const Params<T, T>& p, int sms, std::initializer_list<Variant<T>> variants, cudaStream_t stream,
                 std::string* plan) {
  const int64_t grid_y = (p.M + 8 * NT - 1) / (8 * NT);  // gemv_kernel: a CTA per 8 * NT rows of A
  if (grid_y > 65535) {  // more blocks of A rows than grid.y holds: one launch per 65535 of them
    for (int64_t m0 = 0; m0 < p.M; m0 += 65535 * 8 * NT) {
      Params<T, T> part = p;
      part.A += m0 * p.sam, part.D += m0 * p.ldd, part.C = p.C ? p.C + m0 * p.ldc : nullptr;
      part.M = (int)std::min<int64_t>(p.M - m0, 65535 * 8 * NT);
      launch_best<T, NT, U_BIG, U_SMALL>(part, sms, variants, stream, plan);
    }
    return;
  }
  const int64_t tiles = (p.N + 15) / 16, steps = (p.K / 8 + 3) / 4;  // 16-row tiles, 32-wide k steps
  if (grid_y == 1) {
    auto idle = [&](int u) { return (steps + u - 1) / u * u - steps; };
    if (steps <= 32 && (idle(6) <= idle(4) ? launch_stream<T, NT, 6, 3>(p, sms, stream, plan)
                                           : launch_stream<T, NT, 4, 3>(p, sms, stream, plan)))
      return;
    if (idle(U_BIG) <= idle(U_SMALL) ? launch_stream<T, NT, U_BIG, 2>(p, sms, stream, plan)
                                     : launch_stream<T, NT, U_SMALL, 2>(p, sms, stream, plan))
      return;
  }
  auto ctas = [&](int l) { return (tiles + (kWarps >> l) - 1) / (kWarps >> l) * grid_y; };
  const Variant<T>* best = nullptr;
  int best_ks = 0;
  int64_t best_ctas = 0;
  for (const Variant<T>& v : variants) {
    for (int l = 0; (kWarps >> l) >= 1; ++l) {
      const int64_t n = ctas(l);
      if (n > int64_t(v.per_sm) * sms || sm_balance(double(n) / sms) < 0.9 || (steps >> l) < v.u) continue;
      if (n > best_ctas || (n == best_ctas && v.u > best->u)) best = &v, best_ks = l, best_ctas = n;
    }
  }
  if (best == nullptr) {  // the first variant whose CTAs then all fit at once, else the first
    while (best_ks < 3 && ctas(best_ks) < 2 * sms) ++best_ks;
    best = variants.begin();
    for (const Variant<T>& v : variants)
      if (ctas(best_ks) <= int64_t(v.per_sm) * sms) {
        best = &v;
        break;
      }
  }
  const int64_t grid_x = (tiles + (kWarps >> best_ks) - 1) / (kWarps >> best_ks);
  best->launch(p, best_ks, dim3((unsigned)grid_x, (unsigned)grid_y), stream, plan);
}

// Many tiles (8 or more per SM, where gemv_stream_kernel would run) at M <= 16 with K >= 4096, or
// K >= 2048 where CTAs take whole tiles (the lm_heads, 28672 x 4096): gemv_ring_kernel, one wave.
// Against gemv_stream_kernel, same runs (H200, fp16, us): 1 x 128256 x 4096 249.6 -> 237.6-243,
// 1 x 28672 x 4096 60.7-61.2 -> 57.6-58.5, 1 x 25344 x 4096 54.6 -> 52.1-52.4, 1 x 16896 x 4096
// 38.4 -> 36.4, 4 x 28672 x 4096 60.8 -> 59.2-60.1, 1 x 128256 x 2048 127.0-127.3 -> 123.7-125.9;
// since the slot refills before the mmas and R = 32 above M = 4 (session 18): 8 x 128256 x 4096
// 247.1 -> 239.8, 8 x 28672 x 4096 57.0 -> 54.0, 8 x 128256 x 2048 127.3 -> 122.8, 16 x 128256 x 2048
// 132.6 -> 128.5, 16 x 128256 x 4096 254.5 -> 253.2, 16 x 28672 x 4096 58.8 -> 58.0.
// Not at K = 2048 with row ranges (8 stages per tile: 16896 rows 19.4 -> 20.3, 21120 rows 23.4 ->
// 23.8-24.1, 32768 rows 35.3-35.5 -> 35.6), K = 576 (16.1 -> 17.4), nor on the few-tile shapes, where
// a CTA holds a tile or two and reads all of X for it (16 x 6144 x 4096 16.0 -> 17.3, 16 x 4096 x 14336
// 32.9 -> 47.7). There, one 12-warp CTA per SM on W of 2^25 elements or more, up to M = 8 or at
// K >= 8192 (H200, fp16, us, against the tiles kernel in the same run: 1 x 16384 x 2048 17.7 -> 16.8,
// 8 x 16384 x 2048 18.3 -> 17.7, 8 x 4096 x 14336 30.6 -> 29.5, 8 x 14336 x 4096 32.0 -> 29.1,
// 16 x 4096 x 14336 33.0 -> 31.7; slower at 16 x 16384 x 2048 18.3 -> 19.4, 6144 x 4096 (M = 1, 8, 16)
// 13.5 -> 14.0, 14.0 -> 14.7, 15.9 -> 16.4, and 19-60% on the 34 MB and smaller shapes), which keep the
// other kernels. Returns false where the ring does not apply.
template <typename T, int R, int NT, int WARPS>
bool launch_ring_with(const Params<T, T>& p, int sms, cudaStream_t stream, std::string* plan) {
  auto kernel = gemv_ring_kernel<T, R, NT, WARPS>;
  constexpr int smem = ring_smem_bytes(WARPS);
  static const int per_sm = [&] {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    int n = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, WARPS * 32, smem));
    return std::max(n, 1);
  }();
  const int64_t grid = std::min<int64_t>((p.N + 15) / 16, int64_t(per_sm) * sms), tiles = (p.N + R - 1) / R;
  // CTA ranges in whole tiles where a CTA has 8 or more (one tile more or less is then at most an
  // eighth of a CTA's work), else to the row, which costs every CTA one short tile whose stages hold
  // fewer bytes (H200, us, tiles / rows: 1 x 128256 x 4096 243 / 249, 1 x 28672 x 4096 58.7 / 58.3,
  // 4 x 28672 x 4096 60.6 / 59.7).
  const int granule = tiles >= 8 * grid ? R : 1;
  if (WARPS == 4 && p.K < 4096 && granule == 1) return false;  // K = 2048 gains only in whole tiles (see above)
  auto what = [&] {
    return "ring R=" + std::to_string(R) + (WARPS == 4 ? "" : " 12 warps") + " granule=" + std::to_string(granule);
  };
  launch_or_describe(plan, what, kernel, dim3((unsigned)grid), dim3(WARPS * 32), smem, stream, p, granule);
  return true;
}

// Whether a 12-warp CTA's rings fit in one block's shared memory (Hopper: 227 KB; sm_80 164 KB, sm_86 /
// sm_89 99 KB), looked up once like the configurations above.
inline bool twelve_warp_rings_fit() {
  static const bool fit = [] {
    int device = 0, optin = 0;
    C10_CUDA_CHECK(cudaGetDevice(&device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    return optin >= ring_smem_bytes(12);
  }();
  return fit;
}

template <typename T>
bool launch_ring(const Params<T, T>& p, int sms, cudaStream_t stream, std::string* plan) {
  if (p.M > 16 || p.K < 2048) return false;
  if ((p.N + 15) / 16 >= int64_t(kWarps) * sms) {  // many tiles: three 4-warp CTAs per SM
    if (p.M <= 4) return launch_ring_with<T, 16, 1, 4>(p, sms, stream, plan);
    if (p.M <= 8) return launch_ring_with<T, 32, 1, 4>(p, sms, stream, plan);
    return launch_ring_with<T, 32, 2, 4>(p, sms, stream, plan);
  }
  // Few tiles on a large W (2^25 elements, 64 MB at 16 bits, or more), up to M = 8 or with K >= 8192:
  // one 12-warp CTA per SM.
  if (int64_t(p.N) * p.K < (int64_t{1} << 25) || (p.M > 8 && p.K < 8192) || !twelve_warp_rings_fit()) return false;
  if (p.M <= 8) return launch_ring_with<T, 16, 1, 12>(p, sms, stream, plan);
  return launch_ring_with<T, 16, 2, 12>(p, sms, stream, plan);
}

}  // namespace

// M = 1 and few rows: gemv_m1_kernel when every resident warp can take one pair (or one K slice of
// one) in at most two rounds, with the smallest K split that keeps 90% of the warps busy while each
// still gets a full round. Measured against the 16-row tiles (H200, fp16, us): 4096 x 4096 10.5 ->
// 10.2, 2048 x 8192 11.4 -> 10.7, 3072 x 2048 5.8 -> 5.4; but where warps take several pairs or
// long slices the 16-row tiles stream faster (6144 x 4096 13.9 -> 14.6, 4096 x 14336 30.3 -> 30.9,
// 128256 x 4096 246 -> 257), so those keep them.
// Two configurations: 4-step rounds at 4 CTAs per SM (<= 64 registers) where 90% of those warps each
// get two full rounds (the 34 MB shapes: 4096 x 4096 10.32 -> 9.78 us, 2048 x 8192 10.45 -> 9.89,
// H200, fp16, two passes in one call: the same bytes in flight per SM as 8-step rounds at 2 CTAs per
// SM, in twice as many warps, so the bytes in flight dip less while a warp turns a round around);
// otherwise 8-step rounds at 2 CTAs per SM (at one 4-step round per warp the 4-CTA form was equal or
// slower: 2048 x 2048 3.61 -> 3.80, 4096 x 2048 5.66 -> 5.78). Returns false where it does not apply.
template <typename T, int U, int MIN_BLOCKS, bool TWO_FULL_ROUNDS>
bool launch_gemv_m1(const Params<T, T>& p, int sms, cudaStream_t stream, std::string* plan) {
  if (p.M != 1) return false;
  static const int per_sm = ctas_per_sm<MIN_BLOCKS>(gemv_m1_kernel<T, U, MIN_BLOCKS>);
  const int64_t resident = int64_t(per_sm) * sms, pairs = (p.N + 1) / 2, steps = (p.K / 8 + 31) / 32;
  int l = 0;
  while (l < 3 && (pairs << l) * 10 < resident * kWarps * 9 && (steps >> (l + 1)) >= U) ++l;
  if (steps < U || (pairs << l) > resident * kWarps || (steps >> l) > 2 * U) return false;
  if (TWO_FULL_ROUNDS && ((steps >> l) != 2 * U || (pairs << l) * 10 < resident * kWarps * 9)) return false;
  const int64_t grid = std::min<int64_t>(resident, ((pairs << l) + kWarps - 1) / kWarps);
  auto what = [&] { return config("m1", U, MIN_BLOCKS) + " ks=" + std::to_string(1 << l); };
  launch_or_describe(plan, what, gemv_m1_kernel<T, U, MIN_BLOCKS>, dim3((unsigned)grid), dim3(kThreads), 0, stream, p,
                     l);
  return true;
}

template <typename T>
void launch_gemv(const Params<T, T>& p, cudaStream_t s, int sms, std::string* plan) {
  // Per warp in flight: U steps of 16 rows x 64 bytes. U = 8 (<= 128 registers): 2 CTAs per SM;
  // U = 4 (<= 80): 3. (16-warp CTAs, one per SM, gained nothing at 2048 x 8192: 11.6 us either way.)
  if (launch_gemv_m1<T, 4, 4, true>(p, sms, s, plan) || launch_gemv_m1<T, 8, 2, false>(p, sms, s, plan)) return;
  if (launch_ring<T>(p, sms, s, plan)) return;
  if (p.M <= 8)
    launch_best<T, 1, 8, 6>(p, sms, {variant<T, 1, 8, 2>(), variant<T, 1, 4, 3>()}, s, plan);
  else  // two n8 tiles: shorter rounds for the X registers, except in the stream (see launch_best). 4-step
        // rounds at 3 CTAs per SM (X one step ahead, within 80 registers) where 2-step rounds were
        // the only ones whose CTAs all fit (384 CTAs of KS = 8 at 6144 x 4096; H200, fp16, us: 16 x 6144 x 4096
        // 16.05-16.09 -> 15.76-15.82, 12 x 6144 x 4096 15.46-15.50 -> 15.23-15.33); no other decode shape moves.
    launch_best<T, 2, 8, 6>(p, sms, {variant<T, 2, 4, 2>(), variant<T, 2, 2, 3>(), variant<T, 2, 4, 3>()}, s, plan);
}
template void launch_gemv<__half>(const Params<__half, __half>&, cudaStream_t, int, std::string*);
template void launch_gemv<__nv_bfloat16>(const Params<__nv_bfloat16, __nv_bfloat16>&, cudaStream_t, int, std::string*);

}  // namespace minfer::gemm_impl
