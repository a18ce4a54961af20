// The split-KV flash decode kernel (one query per sequence): each CTA streams its split's keys
// (decode_stream.cuh) and merges (decode_merge.cuh); decode_plan.h lays the call out. Decode reads every
// K/V byte once and does ~1 FLOP per byte: it is bound by HBM bandwidth, and at small batch by fixed
// costs (ramp-up, the combine). So: many bytes in flight from the first cycle, little issue work per
// byte, one launch.
//
// Launched as a programmatic dependent (common/launch.h), the kernel's setup overlaps the previous
// kernel's tail. With stable_prefix (the engine's call: start_pos and the cache rows before it are final
// before the previous kernel runs), the split is laid out before griddep_wait, and a warp with at most 8
// tiles (any, at d 256, or at d 128 where every CTA is resident at once) loads its first tiles there, as far
// as they lie wholly before the newest key (which the previous kernel, rope, may be writing, or this call writes
// itself: DecodeParams::rope). q is read after the wait: in the engine the kernel just before writes it.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

#include "attention/decode_merge.cuh"
#include "attention/decode_params.h"
#include "attention/decode_plan.h"
#include "attention/decode_stream.cuh"
#include "common/ptx.cuh"

namespace minfer::attn::decode {

constexpr int kEarlyTiles = 3;             // tiles a warp may load before the wait ...
constexpr int kEarlyPieceBytes = 4 << 10;  // ... one piece of this size in flight at a time (a tile's K or V
                                           // half where the tile is larger: 8 KB at d 256)

// stable_prefix: this warp's first tiles before the wait (filled: how many), in a warp of at most 8 tiles.
// They are throttled, one piece of kEarlyPieceBytes in flight per warp, the next issued once it has landed: they
// run while the previous call's last tiles stream and its combine makes its round trips through L2, which
// queue behind whatever is in flight (1 x 4k: 6.68 us throttled, 7.39 issued all at once). A one-split
// small call fills its rings at once instead: so few bytes hardly slow the previous call, while the
// throttle's round trips outlast a call this short (H100, 1 x 192: 3.12 us against 3.78 throttled). A paged warp
// of 2-8 tiles keeps a tile's K and V pieces in flight together, which makes up for its pages' lookup before them
// (H100: paged 1 x 4k 8.05 -> 7.81-7.84 us against the dense call's 7.58-7.63; the Qwen3-0.6B-shaped continuous
// step at ~4k keys, batch 1, 1.085-1.086 -> 1.065-1.078 ms); the dense kernel keeps one piece (with both, the 8B
// bf16 step at ~4k keys, dense cache, went 5.588 -> 5.627 ms). With two pieces a tile both groups are in
// flight; the stream's waits then wait for a little more than they need, never less.
// At d 128 a warp of more than 8 tiles in a grid of at most a CTA an SM (all_resident) fills its ring at once too: in
// the engine the kernel before is rope, whose short tail leaves HBM idle (the 8B bf16 step, H200, ms: 16 x 1k 5.370 ->
// 5.317, 8 x 2k 4.983 -> 4.916, 4 x 4k 4.924 -> 4.887), where such warps took no early tiles. Back to back
// (apps/benchmark.py) the same calls lose 1-5% (1 x 16k 19.37 -> 20.27 us, 16 x 1k 17.49 -> 18.40): each call's early
// bytes land in the previous call's stream, not in an idle tail. At d 64 it lost in the engine too (the SmolLM2-135M
// shape's step at 16 x 2k 0.959 -> 0.976 ms). A full grid's shallow long stream (stream()) loads none early.
template <int D>
constexpr bool kLongEarly = D == 128;
// At d 256 a CTA (137 KB of shared memory) holds its SM alone: no CTA of the previous call streams beside it, and
// its rings fill at once, long streams too (H200, bf16, us, throttled / at once: 16 x 8k x 8 / 4 heads, window
// 512 12.45 / 11.26, 64 x 32k x 4 / 1, window 512 13.00 / 11.90, 16 x 4k 65.5 / 63.2; 1 x 32k 36.7 / 37.3).
template <int D>
constexpr bool kEarlyAtOnce = D > 128;
template <int RING, bool FULL_GRID, typename T, int D>
__device__ __forceinline__ void load_early(const WarpRing<T, D>& w, int& filled) {
  constexpr int STAGES = kStages<T, D, RING>, EARLY = kEarlyTiles < STAGES ? kEarlyTiles : STAGES;  // 2 at d 256
  static_assert(!kEarlyAtOnce<D> || kFullGridStages<T, D> == STAGES, "a long stream's early tiles fill its ring");
  const Range& r = w.r;
  // (The call's K/V is counted with every sequence at this one's range's length.)
  const bool at_once = kEarlyAtOnce<D> || (r.n_active == 1 && small_call<T, D>(grid_pairs(), r.seq.tiles())) ||
                       (kLongEarly<D> && w.p.all_resident && r.n_my > 8 && !(FULL_GRID && long_stream(r.n_my)));
  const int early = at_once ? min(STAGES, r.n_my) : r.n_my <= 8 ? min(EARLY, r.n_my) : 0;
  const bool tile_at_once = at_once || (w.k.table != nullptr && r.n_my >= 2);  // both halves of a tile in flight
  while (filled < early && min(w.key0(filled) + kTK, r.s1) <= r.len - 1) {
    if (filled >= 1 && !at_once) ptx::cp_async_wait<0>();
    if constexpr (kTileBytes<T, D> > kEarlyPieceBytes) {
      w.load_half(filled, filled, false);
      if (!tile_at_once) ptx::cp_async_wait<0>();
      w.load_half(filled, filled, true), ++filled;
    } else {
      w.load_tile(filled, filled), ++filled;
    }
  }
}

// RING: a warp's ring in bytes (kRingBytes<D>, or d 64's kShortRingBytes, 3 CTAs an SM).
template <typename T, int D, bool FULL_GRID, int RING>
__global__ void __launch_bounds__(kThreads, RING < kRingBytes<D> ? 3 : 2) flash_decode_kernel(const DecodeParams p) {
  static_assert(kStages<T, D, RING> >= 2 && kRows * kWarpOStride<D> * 4 <= RING, "ring too small");
  static_assert(kRows * kQStride<D> * int(sizeof(T)) <= kQSmemBytes<D> - kSmemBytes<D>,
                "q's stage must fit past the rings");
  extern __shared__ unsigned char smem_raw[];  // kWarps rings of RING bytes, from a 1024-byte boundary
  __shared__ float s_m[kWarps][kRows], s_l[kWarps][kRows];
  __shared__ int s_last;
  unsigned char* smem = smem_raw + ((1024 - ptx::smem_addr(smem_raw) % 1024) % 1024);

  const Cta c = cta_of(p);
  prefetch_q<T, D>(p, c);
  int len = 0, n_active = 1, s0 = 0, s1 = 0, n_my = 0, lane_page = 0, next_page = 0;
  Split seq_split{};
  const Range r{len, n_active, s0, s1, n_my, seq_split};
  const WarpRing<T, D> w{p, r, reinterpret_cast<T*>(smem + c.warp * RING),
                         kv_rows<T, kPageShift<D>>(p.paged, p.k, p.k_bs, p.k_ss, p.k_hs, p.paged.k_ps, c.b, c.kvh),
                         kv_rows<T, kPageShift<D>>(p.paged, p.v, p.v_bs, p.v_ss, p.v_hs, p.paged.v_ps, c.b, c.kvh),
                         c.warp, c.lane, lane_page, next_page};
  T* s_q = reinterpret_cast<T*>(smem + kWarps * RING);  // kQInSmem: q, [kRows][kQStride]
  uint32_t qf[D / 16][4];                    // Q's A fragments (kQInSmem: unused, read from s_q)
  float l_row[2], m_row[2], acc[D / 8][4];  // the softmax state of rows g, g + 8, O's C fragments
  const Heads<T, D> h{qf, acc, m_row, l_row, q_frag_lane<T, D>(s_q, c.lane)};

  int filled = 0;  // the tiles loaded before the wait
  if (p.stable_prefix) {
    take_range<T, D, RING>(r, p, c);
    if (c.split >= n_active) return;
    w.load_pages();
    load_early<RING, FULL_GRID>(w, filled);
  }

  // q, start_pos, the caches, the counters and the workspace may be the previous kernel's outputs
  // (start_pos and the cache prefix not, with stable_prefix). The next kernel is released right after the
  // wait: its CTAs take the SMs' free slots and wait in their own griddep_wait (a grid with CTAs still to
  // place triggers only once they all have run it, so they never compete with it); 16 x 16k 239.6 us
  // against 280.9 released after the stream.
  ptx::griddep_wait();
  ptx::griddep_launch_dependents();

  if constexpr (kQInSmem<D>) {
    uint4 q_now[kQPieces<D>];
    read_q<T, D>(q_now, p, c);
    stage_q<T, D>(s_q, q_now, c);
  } else {
    load_q<T, D>(qf, p, c);
  }
  if (!p.stable_prefix) {
    take_range<T, D, RING>(r, p, c);
    if (c.split >= n_active) return;
    w.load_pages();
  }
  if constexpr (!kQInSmem<D>) {
    if (p.rope.cos_sin != nullptr) {  // the newest key's rope, folded in (decode_params.h)
      const int pos = p.start_pos[c.b] + p.len_offset - 1;
      const RopeRow row = rope_row(p, pos, D);
      rotate_q<T, D>(qf, row, c.t);
      write_newest<T, D>(p, c, r, row, pos, w.k, w.v);
    }
  }
  stream<FULL_GRID, RING>(w, h, 0, n_my, filled);
  ptx::cp_async_wait<0>();
  __syncwarp();

  write_warp_partial<D>(reinterpret_cast<float*>(w.ring), s_m, s_l, acc, m_row, l_row, c.warp, c.g, c.t);
  __syncthreads();
  const int64_t pair = static_cast<int64_t>(c.b) * gridDim.y + c.blk;  // (batch, kv block)
  const PairOut<T> po{pair, pair * p.num_splits,
                      reinterpret_cast<T*>(p.o) + (static_cast<int64_t>(c.b) * p.heads + c.head0) * D,
                      c.rows * (D / 4)};
  merge_warps<T, D, RING>(p, po, smem, s_m, s_l, c.split, n_active, c.tid);
  if (n_active == 1) return;

  const Merge merge = merge_of<D, RING>(n_active, c.rows, p.rows, p.all_resident);
  arrive(p, pair, n_active, merge == Merge::kSpread, c.tid, s_last);
  if (merge == Merge::kSpread) return merge_spread<T, D>(p, po, smem, c.split, n_active, c.tid);
  if (!s_last) return;
  if (merge == Merge::kLastInSmem) return merge_last_in_smem<T, D>(p, po, smem, n_active, c.tid);
  merge_last_from_l2<T, D>(p, po, n_active, c.tid);
}

}  // namespace minfer::attn::decode
