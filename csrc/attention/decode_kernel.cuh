// The split-KV flash decode kernel (one query per sequence): each CTA streams its split's keys
// (decode_stream.cuh) and merges (decode_merge.cuh); decode_plan.h lays the call out. Decode reads every
// K/V byte once and does ~1 FLOP per byte: it is bound by HBM bandwidth, and at small batch by fixed
// costs (ramp-up, the combine). So: many bytes in flight from the first cycle, little issue work per
// byte, one launch.
//
// Launched as a programmatic dependent (common/launch.h), the kernel's setup overlaps the previous
// kernel's tail. With stable_prefix (the engine's call: start_pos and the cache rows before it are final
// before the previous kernel runs), more happens before griddep_wait:
// - not speculating: the split is laid out, and a warp with at most 8 tiles loads its first kEarlyTiles
//   there, as far as they lie wholly before the newest key (which the previous kernel, rope, may be
//   writing);
// - speculating (the SPECULATE kernel where `speculates`): q is read before the wait too, while the
//   previous kernel may still be writing it, every tile but the newest key's is streamed and consumed
//   there, and the next kernel is released at entry. After the wait q is read again: the same bits, and
//   the work stands (it is the work of the final q); else it is done again with the final q. Nothing is
//   written before the wait. So back to back one call's streams run while the previous call ends, and
//   the newest key's row and the combine are all that is left after the wait.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

#include "attention/decode_merge.cuh"
#include "attention/decode_params.h"
#include "attention/decode_plan.h"
#include "attention/decode_stream.cuh"
#include "common/ptx.cuh"

namespace minfer::attn::decode {

constexpr int kEarlyTiles = 3;             // tiles a warp may load before the wait (not speculating) ...
constexpr int kEarlyPieceBytes = 4 << 10;  // ... one piece of this size in flight at a time (a tile's K or V
                                           // half where the tile is larger: 8 KB at d 256)
constexpr int kSpecThrottleTiles = 8;      // a speculating warp of up to this many tiles keeps one tile in
                                           // flight before the wait and splits the newest key's tile

// Not speculating, stable_prefix: this warp's first tiles before the wait (filled: how many). They are
// throttled, one piece of kEarlyPieceBytes in flight per warp, the next issued once it has landed: they
// run while the previous call's last tiles stream and its combine makes its round trips through L2, which
// queue behind whatever is in flight (1 x 4k: 6.68 us throttled, 7.39 issued all at once). A one-split
// small call fills its rings at once instead: so few bytes hardly slow the previous call, while the
// throttle's round trips outlast a call this short (H100, 1 x 192: 3.12 us against 3.78 throttled). With
// two pieces a tile both groups are in flight; the stream's waits then wait for a little more than they
// need, never less.
template <typename T, int D>
__device__ __forceinline__ void load_early(const WarpRing<T, D>& w, int& filled) {
  constexpr int STAGES = kStages<T, D>, EARLY = kEarlyTiles < STAGES ? kEarlyTiles : STAGES;  // 2 at d 256
  const Range& r = w.r;
  // (The call's K/V is counted with every sequence at this one's range's length.)
  const bool at_once = r.n_active == 1 && small_call<T, D>(grid_pairs(), r.seq.tiles());
  const int early = at_once ? min(STAGES, r.n_my) : r.n_my <= 8 ? min(EARLY, r.n_my) : 0;
  while (filled < early && min(w.key0(filled) + kTK, r.s1) <= r.len - 1) {
    if (filled >= 1 && !at_once) ptx::cp_async_wait<0>();
    if constexpr (kTileBytes<T, D> > kEarlyPieceBytes) {
      w.load_half(filled, filled, false);
      if (!at_once) ptx::cp_async_wait<0>();
      w.load_half(filled, filled, true), ++filled;
    } else {
      w.load_tile(filled, filled), ++filled;
    }
  }
}

// Speculation (see above) streams the tiles before the newest key's before the wait: one tile in flight for
// a warp of up to kSpecThrottleTiles (1 x 8k 10.9 -> 9.3 us against the whole ring), the whole depth past
// that. In such a short warp the newest key's tile is split: its older rows load into slot 0 before the
// wait (load_all_but_newest_row), and after it only the newest row is read (load_newest_row), issued
// before q's check so that the two round trips overlap (1 x 4k 5.83 -> 5.62 us). Longer warps keep the
// whole tile for after the wait (1 x 16k 15.2 us against 16.6 split).

// Tile n_pre (the newest key's) into slot 0 but its newest row (zero-filled), and that row's lines to L2:
// a prefetch returns no data, so it is safe while the previous kernel writes them.
template <typename T, int D>
__device__ __forceinline__ void load_all_but_newest_row(const WarpRing<T, D>& w, int n_pre) {
  const DecodeParams& p = w.p;
  const int len = w.r.len, r_new = len - 1 - w.row0(n_pre);
#pragma unroll
  for (int j = 0; j < kTK * (D / 8) / 32; ++j) {
    w.copy_chunk(w.ring, w.tile_rows(w.k, n_pre), p.k_ss, r_new, j);
    w.copy_chunk(w.ring + WarpRing<T, D>::TILE, w.tile_rows(w.v, n_pre), p.v_ss, r_new, j);
  }
  ptx::cp_async_commit();
  constexpr int kLines = D * int(sizeof(T)) / 128;  // 128-byte lines of a row
  if (w.lane < 2 * kLines)
    ptx::prefetch_l2(reinterpret_cast<const char*>(w.lane < kLines ? w.k.row(len - 1) : w.v.row(len - 1)) +
                     128 * (w.lane % kLines));
}

// After the wait: the newest row into slot 0, once every lane's zero-filled copy of it has landed. A lane a
// 16-byte chunk of its K and V rows (two rounds at d 256).
template <typename T, int D>
__device__ __forceinline__ void load_newest_row(const WarpRing<T, D>& w, int n_pre) {
  constexpr int CH = D / 8;
  const int len = w.r.len;
  ptx::cp_async_wait<0>();
  __syncwarp();
  const int r_new = len - 1 - w.row0(n_pre);
#pragma unroll
  for (int j = 0; j < (2 * CH + 31) / 32; ++j) {
    const int i = w.lane + 32 * j, c = i % CH;  // chunk c of the K row (i < CH) or of the V row
    if (i < 2 * CH)
      ptx::cp_async16((i >= CH ? w.ring + WarpRing<T, D>::TILE : w.ring) + tile_off(r_new, c),
                      (i >= CH ? w.v.row(len - 1) : w.k.row(len - 1)) + c * 8, true);
  }
  ptx::cp_async_commit();
}

// Whether q's pieces read after the wait differ from those read before it: q_pre, or where kQInSmem, this
// thread's pieces of them in s_q (so that they hold no registers through the stream).
template <typename T, int D>
__device__ __forceinline__ bool q_changed(const uint4 (&q_final)[kQPieces<D>], const uint4 (&q_pre)[kQPieces<D>],
                                          const T* s_q, int tid) {
  constexpr int QCH = D / 8;
  bool changed = false;
#pragma unroll
  for (int j = 0; j < kQPieces<D>; ++j) {
    const int i = tid + j * kThreads;
    const uint4 a = q_final[j],
                e = kQInSmem<D> ? *reinterpret_cast<const uint4*>(s_q + (i / QCH) * kQStride<D> + (i % QCH) * 8)
                                : q_pre[j];
    changed = changed || a.x != e.x || a.y != e.y || a.z != e.z || a.w != e.w;
  }
  return changed;
}

template <typename T, int D, bool FULL_GRID, bool SPECULATE>
__global__ void __launch_bounds__(kThreads, 2) flash_decode_kernel(const DecodeParams p) {
  static_assert(kStages<T, D> >= 2 && kRows * kWarpOStride<D> * 4 <= kRingBytes<D>, "ring too small");
  static_assert(kRows * kQStride<D> * int(sizeof(T)) <= kSpecSmemBytes<D> - kSmemBytes<D>,
                "q's stage must fit past the rings");
  extern __shared__ unsigned char smem_raw[];  // kWarps rings of kRingBytes<D>, from a 1024-byte boundary
  __shared__ float s_m[kWarps][kRows], s_l[kWarps][kRows];
  __shared__ int s_last;
  unsigned char* smem = smem_raw + ((1024 - ptx::smem_addr(smem_raw) % 1024) % 1024);

  const Cta c = cta_of(p);
  prefetch_q<T, D>(p, c);
  int len = 0, n_active = 1, s0 = 0, s1 = 0, n_my = 0, lane_page = 0;
  Split seq_split{};
  const Range r{len, n_active, s0, s1, n_my, seq_split};
  const WarpRing<T, D> w{p, r, reinterpret_cast<T*>(smem + c.warp * kRingBytes<D>),
                         kv_rows<T, kPageShift<D>>(p.paged, p.k, p.k_bs, p.k_ss, p.k_hs, p.paged.k_ps, c.b, c.kvh),
                         kv_rows<T, kPageShift<D>>(p.paged, p.v, p.v_bs, p.v_ss, p.v_hs, p.paged.v_ps, c.b, c.kvh),
                         c.warp, c.lane, lane_page};
  T* s_q = reinterpret_cast<T*>(smem + kWarps * kRingBytes<D>);  // the speculating kernel's q (kQInSmem: every
                                                                 // kernel's): [kRows][kQStride]
  uint32_t qf[D / 16][4];                    // Q's A fragments (kQInSmem: unused, read from s_q)
  float l_row[2], m_row[2], acc[D / 8][4];  // the softmax state of rows g, g + 8, O's C fragments
  const Heads<T, D> h{qf, acc, m_row, l_row, q_frag_lane<T, D>(s_q, c.lane)};

  bool spec = false, row_split = false;
  uint4 q_pre[kQPieces<D>];  // speculative: q as read before the wait
  int n_pre = 0;             // speculative: the tiles consumed before the wait
  int filled = 0;            // otherwise: the tiles loaded before the wait
  if (p.stable_prefix) {
    take_range<T, D>(r, p, c);
    if (c.split >= n_active) return;
    w.load_pages();
    if constexpr (SPECULATE)
      spec = speculates<T, D>(seq_split, merge_of<D>(n_active, c.rows, p.rows, p.all_resident), grid_pairs(),
                              seq_split.tiles());
    if (spec) {
      ptx::griddep_launch_dependents();
      read_q<T, D>(q_pre, p, c);
      stage_q<T, D>(qf, s_q, q_pre, c);
      n_pre = n_my;
      if (n_my > 0 && min(w.key0(n_my - 1) + kTK, s1) > len - 1) --n_pre;  // holds the newest key
      stream<FULL_GRID>(w, h, 0, n_pre, n_my <= kSpecThrottleTiles, 0);
      row_split = n_pre < n_my && n_my <= kSpecThrottleTiles;
      if (row_split) load_all_but_newest_row(w, n_pre);
    } else {
      load_early(w, filled);
    }
  }

  // q, start_pos, the caches, the counters and the workspace may be the previous kernel's outputs
  // (start_pos and the cache prefix not, with stable_prefix). The next kernel is released right after the
  // wait: its CTAs take the SMs' free slots and wait in their own griddep_wait (a grid with CTAs still to
  // place triggers only once they all have run it, so they never compete with it); 16 x 16k 239.6 us
  // against 280.9 released after the stream. A speculating CTA released it at entry, where it has work
  // before the wait; the other kernel has too little there to gain from it (H200, 1 x 4k 6.40 -> 6.84 us).
  ptx::griddep_wait();
  if (!spec) ptx::griddep_launch_dependents();

  int from = 0;  // the first tile still to stream
  if (!spec) {
    if constexpr (kQInSmem<D>) {
      uint4 q_now[kQPieces<D>];
      read_q<T, D>(q_now, p, c);
      stage_q<T, D>(qf, s_q, q_now, c);
    } else {
      load_q<T, D>(qf, p, c);
    }
    if (!p.stable_prefix) {
      take_range<T, D>(r, p, c);
      if (c.split >= n_active) return;
      w.load_pages();
    }
  } else if constexpr (SPECULATE) {
    if (row_split) load_newest_row(w, n_pre);
    uint4 q_final[kQPieces<D>];
    read_q<T, D>(q_final, p, c);
    if (__syncthreads_or(q_changed<T, D>(q_final, q_pre, s_q, c.tid))) {  // start over with the final q
      ptx::cp_async_wait<0>();  // nothing of the first pass lands in the ring from here on
      stage_q<T, D>(qf, s_q, q_final, c);
    } else if (row_split) {
      ptx::cp_async_wait<0>();
      __syncwarp();
      h.consume(w.ring, w.ring + WarpRing<T, D>::TILE, w.valid(n_pre), c.lane, p);
      from = n_my;
    } else {
      from = n_pre;
    }
  }
  stream<FULL_GRID>(w, h, from, n_my, false, filled);
  ptx::cp_async_wait<0>();
  __syncwarp();

  write_warp_partial<D>(reinterpret_cast<float*>(w.ring), s_m, s_l, acc, m_row, l_row, c.warp, c.g, c.t);
  __syncthreads();
  const int64_t pair = static_cast<int64_t>(c.b) * gridDim.y + c.blk;  // (batch, kv block)
  const PairOut<T> po{pair, pair * p.num_splits,
                      reinterpret_cast<T*>(p.o) + (static_cast<int64_t>(c.b) * p.heads + c.head0) * D,
                      c.rows * (D / 4)};
  merge_warps<T, D>(p, po, smem, s_m, s_l, c.split, n_active, c.tid);
  if (n_active == 1) return;

  const Merge merge = merge_of<D>(n_active, c.rows, p.rows, p.all_resident);
  arrive(p, pair, n_active, merge == Merge::kSpread, c.tid, s_last);
  if (merge == Merge::kSpread) return merge_spread<T, D>(p, po, smem, c.split, n_active, c.tid);
  if (!s_last) return;
  if (merge == Merge::kLastInSmem) return merge_last_in_smem<T, D>(p, po, smem, n_active, c.tid);
  merge_last_from_l2<T, D>(p, po, n_active, c.tid);
}

}  // namespace minfer::attn::decode
