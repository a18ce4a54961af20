// gemv_ring_kernel: the small-M GEMV with W staged through per-warp shared-memory rings that cp.async
// keeps full (M <= 16 on many tiles with K >= 4096, or 2048 on the largest W; see launch_ring in gemv.cu).
#pragma once
#include "gemm/gemv_common.cuh"

namespace minfer::gemm_impl {
namespace {

// W through per-warp shared-memory rings (the way flash decode streams K/V): a stage is R W rows x
// 4096 / R k (8 KB; R = 16: 256 k, R = 32: 128 k), each lane copying 16-byte chunks with cp.async, so
// one instruction of the warp reads 512 contiguous bytes of one row (R = 16) or 256 of each of two
// (R = 32). A warp's ring holds kRingStages stages, all in flight before the first is used and
// refilled as each is consumed, so the bytes in flight never drop to zero between rounds as they do
// with register loads. Each CTA takes an equal contiguous range of W rows in units of `granule` rows
// (R: whole tiles; 1: to the row, so that SMs finish together where whole tiles would leave some with
// one more, e.g. 13 or 14 per SM at 1 x 28672 x 4096; with kAct 16, whole tiles of w_row's order), tiled
// by R from its first row; its warps split the CTA's (tile, k chunk) stages evenly. A tile that two or
// more warps share is summed in warp order through shared memory (the rings' space, once they are drained;
// deterministic); whole tiles are stored by their warp.
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
// 12 (one); kAct: p.act (see w_row).
template <typename T, int R, int NT, int WARPS, bool kAct>
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
    // With kAct, row n_base + r of w_row's order (n_base a multiple of 16: the launcher's granule) is r % 8
    // rows on from the W row of its 8-row group, whose start r / 8 picks at compile time.
    int group[R / 8];
#pragma unroll
    for (int j = 0; j < R / 8; ++j) group[j] = kAct ? w_row(p, n_base + 8 * j, true) : 0;
#pragma unroll
    for (int i = 0; i < R / kRowsPerCopy; ++i) {
      const int r = i * kRowsPerCopy + lane / kRowChunks;
      const int w = kAct ? group[(i * kRowsPerCopy) / 8] + (r & 7) : n_base + r;
      const bool ok = c < chunks && n_base + r < row1;  // past the range or K: zeros, nothing read
      const auto* src = p.B + (ok ? (int64_t)w * p.sbn + 8 * c : 0);
      cp_async16_stream(dst + 16 * (r * kRowChunks + (cl ^ ((r & 1) << 2))), src, ok);
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
      for (int i = 0; i < kSub; ++i) store_tile(p, acc[0][i], row0 + tile_local * R + 16 * i + g, row1, t, kAct);
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
      for (int nt = 0; nt < NT; ++nt) vx[j][nt] = ld_nc_v4(xp[nt] + c0 + 4 * j, x_ok[nt] && c0 + 4 * j + t < chunks);
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
    for (int i = 0; i < kSub; ++i) store_tile(p, sum[i], row0 + tile_local * R + 16 * i + g, row1, t, kAct);
  }
}

}  // namespace
}  // namespace minfer::gemm_impl
