// The split-KV decode kernel's streaming part: where a CTA and its split sit, q as mma A fragments, and a
// warp's stream of 16-key K/V tiles through its own ring of shared memory (no CTA barrier in the main
// loop), consumed on tensor cores: per tile S = Q K^T (head_dim / 8 MMAs), an online softmax on the S
// fragments, and O += P V (head_dim / 8 MMAs), with K/V fragments from ldmatrix on XOR-swizzled tiles.
//
// Loads are 16-byte cp.async by every lane of the warp. A tile is D/64 column halves of [16 keys][128
// bytes], 16-byte chunk c of row r at chunk c ^ (r % 8), so the 8 rows one ldmatrix reads hit 8 different
// bank groups.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "attention/decode_params.h"
#include "attention/decode_plan.h"
#include "attention/kv_rows.cuh"
#include "attention/mma.cuh"
#include "attention/softmax.cuh"
#include "common/ptx.cuh"
#include "common/rope.cuh"
#include "common/vec.h"

namespace minfer::attn::decode {

// This thread's place: CTA (split, kv block blk, batch b), its q heads head0 .. head0 + rows - 1, and
// within the mma fragments g = lane / 4 (rows g, g + 8) and t = lane % 4.
struct Cta {
  int split, blk, b, kvh, head0, rows;
  int tid, warp, lane, g, t;
};
__device__ __forceinline__ Cta cta_of(const DecodeParams& p) {
  Cta c;
  c.split = blockIdx.x, c.blk = blockIdx.y, c.b = blockIdx.z;
  c.kvh = c.blk / p.hblocks;
  const int hb = c.blk % p.hblocks;
  c.head0 = c.kvh * p.group + hb * kRows;
  c.rows = min(kRows, p.group - hb * kRows);  // valid q heads of this block
  c.tid = threadIdx.x, c.warp = c.tid / 32, c.lane = c.tid % 32, c.g = c.lane / 4, c.t = c.lane % 4;
  return c;
}

// (batch, kv block) pairs of the launch.
__device__ __forceinline__ int64_t grid_pairs() { return static_cast<int64_t>(gridDim.y) * gridDim.z; }

// The split's keys [s0, s1) of the sequence's actual length len: its share (split_of) of the tiles of the
// sequence's range (window_first). s0 is a multiple of kTK but where it is a window's first key (split 0's,
// inside its first tile). Warp w takes tiles w, w + 4, ... of the split (n_my). n_active splits of the
// sequence get keys. The fields refer to the kernel's own variables (which the kernel sets before or after
// the wait), as the streaming code's view of them.
struct Range {
  int &len, &n_active, &s0, &s1, &n_my;
  Split& seq;  // the sequence's split
};
template <typename T, int D, int RING>
__device__ __forceinline__ void take_range(const Range& r, const DecodeParams& p, const Cta& c) {
  r.len = max(0, min(p.start_pos[c.b] + p.len_offset, p.capacity));
  const int first = window_first(r.len, p.window), origin = first / kTK * kTK;  // origin: its tile's first key
  const Split sp = split_of<T, D, RING>(r.len - origin, p.num_splits, grid_pairs());
  r.n_active = sp.n_active, r.seq = sp;
  const int n_tiles = sp.base + (c.split < sp.extra), tile0 = c.split * sp.base + min(c.split, sp.extra);
  const int t0 = origin + tile0 * kTK;
  r.s0 = max(t0, first), r.s1 = min(t0 + n_tiles * kTK, r.len);
  r.n_my = n_tiles > c.warp ? (n_tiles - c.warp + kWarps - 1) / kWarps : 0;
}

// Element offset of 16-byte chunk `chunk` of row `row` in a [kTK, D] tile: column half chunk / 8 is a
// [kTK][64] block, chunks XOR-swizzled with the row (mod 8).
__device__ __forceinline__ int tile_off(int row, int chunk) {
  return (chunk >> 3) * (kTK * 64) + row * 64 + (((chunk & 7) ^ (row & 7)) << 3);
}

// Brings q's rows to L2 (128-byte lines; a row that starts off a line boundary keeps its tail out). A
// prefetch returns no data, so it may run while the previous kernel still writes q, and after the wait q
// is no DRAM round trip (H200, 1 x 4k: 6.53 -> 6.38 us).
template <typename T, int D>
__device__ __forceinline__ void prefetch_q(const DecodeParams& p, const Cta& c) {
  constexpr int kLines = D * int(sizeof(T)) / 128;  // a thread a line: warp 0 up to d 128, warps 0-1 at 256
  if (c.tid < c.rows * kLines) {
    const T* qr = reinterpret_cast<const T*>(p.q) + c.b * p.q_bs + (c.head0 + c.tid / kLines) * p.q_hs;
    ptx::prefetch_l2(reinterpret_cast<const char*>(qr) + 128 * (c.tid % kLines));
  }
}

// Q as A fragments (rows = heads head0 .. head0 + 15, zeros past `rows`), straight from global memory.
template <typename T, int D>
__device__ __forceinline__ void load_q(uint32_t (&f)[D / 16][4], const DecodeParams& p, const Cta& c) {
  const T* qb = reinterpret_cast<const T*>(p.q) + c.b * p.q_bs + c.head0 * p.q_hs + 2 * c.t;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = c.g + 8 * half;
    const T* qr = qb + r * p.q_hs;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      f[kk][half] = r < c.rows ? *reinterpret_cast<const uint32_t*>(qr + kk * 16) : 0u;
      f[kk][2 + half] = r < c.rows ? *reinterpret_cast<const uint32_t*>(qr + kk * 16 + 8) : 0u;
    }
  }
}

// q at d 256 (kQInSmem): read once a CTA in 16-byte pieces (attention() passes rows 16-byte aligned) through
// L2 (ld.global.cg), staged in shared memory ([kRows][kQStride]) and taken as fragments by ldmatrix (each
// warp reading its own fragments sends 16 times the requests to the same few lines).
template <int D>
constexpr int kQStride = D + 8;
template <int D>
constexpr int kQPieces = (kRows * (D / 8) + kThreads - 1) / kThreads;  // 16-byte pieces of q per thread

template <typename T, int D>
__device__ __forceinline__ void read_q(uint4 (&v)[kQPieces<D>], const DecodeParams& p, const Cta& c) {
  constexpr int QCH = D / 8;
#pragma unroll
  for (int j = 0; j < kQPieces<D>; ++j) {  // this thread's pieces of the rows (zeros past the end)
    const int i = c.tid + j * kThreads, r = min(i / QCH, c.rows - 1), ch = i % QCH;
    const T* src = reinterpret_cast<const T*>(p.q) + c.b * p.q_bs + (c.head0 + r) * p.q_hs + ch * 8;
    v[j] = i < c.rows * QCH ? __ldcg(reinterpret_cast<const uint4*>(src)) : make_uint4(0u, 0u, 0u, 0u);
  }
}
// This lane's address in s_q of q's A fragment for k-step 0 (k-step kk at + kk * 16), for ldmatrix.
template <typename T, int D>
__device__ __forceinline__ const T* q_frag_lane(const T* s_q, int lane) {
  return s_q + ((lane % 8) + ((lane / 8) % 2) * 8) * kQStride<D> + (lane / 16) * 8;
}

// q's pieces into s_q, [kRows][kQStride] (rows past the group as zeros), for the consumer's ldmatrix (kQInSmem);
// every thread of the CTA.
template <typename T, int D>
__device__ __forceinline__ void stage_q(T* s_q, const uint4 (&v)[kQPieces<D>], const Cta& c) {
  constexpr int QCH = D / 8;
#pragma unroll
  for (int j = 0; j < kQPieces<D>; ++j) {
    const int i = c.tid + j * kThreads;
    if (i < kRows * QCH) *reinterpret_cast<uint4*>(s_q + (i / QCH) * kQStride<D> + (i % QCH) * 8) = v[j];
  }
  __syncthreads();
}

// ---- the newest key's rope, folded in (DecodeParams::rope) ----

// The position whose cos | sin row rotates q and the newest key: start_pos[b] + len_offset - 1, unclamped (a dense
// sequence past its capacity still rotates at its own position), and that row, NaN outside [0, max_position) as
// the rope kernel makes it.
struct RopeRow {
  const float* cs;
  bool ok;
  __device__ __forceinline__ float2 pair(int i) const {  // elements i, i + 1 (i even: 8-byte aligned)
    return ok ? *reinterpret_cast<const float2*>(cs + i) : make_float2(nan_f(), nan_f());
  }
};
__device__ __forceinline__ RopeRow rope_row(const DecodeParams& p, int pos, int d) {
  const bool ok = pos >= 0 && pos < p.rope.max_position;
  return {p.rope.cos_sin + (ok ? static_cast<int64_t>(pos) * d : 0), ok};
}

// Rotates q's A fragments in registers (NeoX, whole head): fragment k-step kk holds columns kk * 16 + {2t, 2t + 1,
// 2t + 8, 2t + 9} of rows g and g + 8, and their partners (+ D / 2) sit in k-step kk + D / 32 of the same lane.
// Each value is rounded to T, as the rope kernel's q in memory would be.
template <typename T, int D>
__device__ __forceinline__ void rotate_q(uint32_t (&f)[D / 16][4], const RopeRow& row, int t) {
  constexpr int HALF = D / 2, KH = D / 32;
#pragma unroll
  for (int kk = 0; kk < KH; ++kk) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {  // j / 2: columns 2t (0) or 2t + 8 (1); j % 2: row g or g + 8
      const int col = kk * 16 + 2 * t + (j / 2) * 8;
      const float2 c = row.pair(col), s = row.pair(HALF + col);
      float2 x1 = unpack2<T>(f[kk][j]), x2 = unpack2<T>(f[kk + KH][j]);
      rotate_pair(x1.x, x2.x, c.x, s.x);
      rotate_pair(x1.y, x2.y, c.y, s.y);
      f[kk][j] = pack2<T>(x1.x, x1.y), f[kk + KH][j] = pack2<T>(x2.x, x2.y);
    }
  }
}

// The CTA whose split holds key len - 1 (the sequence's last active split): k_new rotated and v_new to that row of
// its kv head's cache, a thread a NeoX pair, then a barrier, so that the split's copies of the row read them.
// Every kv block of a kv head writes the same bits to the row; no other split reads it.
template <typename T, int D>
__device__ __forceinline__ void write_newest(const DecodeParams& p, const Cta& c, const Range& r, const RopeRow& row,
                                             int pos, const KvRows<T, kPageShift<D>>& kr,
                                             const KvRows<T, kPageShift<D>>& vr) {
  if (c.split != r.n_active - 1 || pos != r.len - 1 || pos < 0) return;  // CTA-uniform
  const T *krow = kr.base + static_cast<int64_t>(pos) * kr.ss, *vrow = vr.base + static_cast<int64_t>(pos) * vr.ss;
  if (kr.table != nullptr) {
    const int page = __ldg(kr.table + kr.entry_of(pos));
    if (page < 0 || page > kr.last_page) return;  // outside the pool: nothing written (CTA-uniform)
    krow = kr.in_page(page, pos), vrow = vr.in_page(page, pos);
  }
  constexpr int HALF = D / 2;
  const T* kn = reinterpret_cast<const T*>(p.rope.k_new) + c.b * p.rope.k_bs + c.kvh * p.rope.k_hs;
  const T* vn = reinterpret_cast<const T*>(p.rope.v_new) + c.b * p.rope.v_bs + c.kvh * p.rope.v_hs;
  T* kd = const_cast<T*>(krow);  // the caches are the call's mutable arguments
  T* vd = const_cast<T*>(vrow);
  for (int i = c.tid; i < HALF; i += kThreads) {
    float x1 = to_float(kn[i]), x2 = to_float(kn[HALF + i]);
    const T v1 = vn[i], v2 = vn[HALF + i];
    const float cs = row.ok ? row.cs[i] : nan_f(), sn = row.ok ? row.cs[HALF + i] : nan_f();
    rotate_pair(x1, x2, cs, sn);
    kd[i] = from_float<T>(x1), kd[HALF + i] = from_float<T>(x2);
    vd[i] = v1, vd[HALF + i] = v2;
  }
  __syncthreads();
}

// A warp's ring: its tiles i = 0 .. n_my - 1 of the split (keys key0(i) ..) from K/V in global memory to
// slots of [K tile, V tile], key row0(i) in a slot's row 0. Keys >= s1 are never read (a cache slot past the
// length may hold anything, NaN included), nor a window's keys before s0 (the engine may have freed their
// pages): a slot's rows past the tile's keys that are read (valid) are zero-filled, and the consumer masks
// their scores.
template <typename T, int D>
struct WarpRing {
  static constexpr int CH = D / 8;      // 16-byte chunks per row
  static constexpr int TILE = kTK * D;  // elements of one K (or V) tile
  const DecodeParams& p;
  const Range& r;
  T* ring;      // [stages][K tile, V tile], tile_off layout
  KvRows<T, kPageShift<D>> k;  // K rows of (b, kvh); a tile's 16 rows are contiguous (stride p.k_ss) in either layout
  KvRows<T, kPageShift<D>> v;
  int warp, lane;
  int& lane_page;  // paged: the page of this warp's tile 32 w + lane, w the window of the tiles being loaded
  int& next_page;  // paged: the same for window w + 1, read a window ahead

  // The first key of tile i's 16 (a multiple of kTK).
  __device__ __forceinline__ int key0(int i) const { return (r.s0 & -kTK) + (warp + i * kWarps) * kTK; }
  // Tile i's keys that are read, row0(i) .. row0(i) + valid(i) - 1, into its slot's rows 0 ..: its 16 keys
  // but those before s0 (a window's first key may fall inside the tile) and from s1 on.
  __device__ __forceinline__ int row0(int i) const { return max(key0(i), r.s0); }
  __device__ __forceinline__ int valid(int i) const { return min(key0(i) + kTK, r.s1) - row0(i); }

  // Paged: the pages of a warp's tiles come 32 at a time, a lane each, one window ahead of the tiles loaded, so
  // that no tile's copies wait on its page's lookup (a lookup per tile: 1 x 4k ran 12% slower). At d 256 the
  // next window's register spilled (255 registers): there the first window is read ahead, later tiles look
  // theirs up.
  static constexpr bool kPageWindows = D <= 128;
  __device__ __forceinline__ int lane_page_of(int i) const { return i < r.n_my ? k.page_of(key0(i)) : 0; }
  __device__ __forceinline__ void load_pages() const {
    if (k.table == nullptr) return;
    lane_page = lane_page_of(lane);
    if constexpr (kPageWindows) next_page = lane_page_of(32 + lane);
  }
  // Before tile i's loads, tiles loaded in order, once each: the next window's pages at each window's first tile.
  __device__ __forceinline__ void turn_page_window(int i) const {
    if constexpr (kPageWindows)
      if (k.table != nullptr && i >= 32 && (i & 31) == 0) lane_page = next_page, next_page = lane_page_of(i + 32 + lane);
  }
  // Row row0(i) of K or V (kv: k or v), in tile i's page; every lane of the warp calls it with the same i.
  __device__ __forceinline__ const T* tile_rows(const KvRows<T, kPageShift<D>>& kv, int i) const {
    if (kv.table == nullptr || (!kPageWindows && i >= 32)) return kv.row(row0(i));
    return kv.in_page(__shfl_sync(0xffffffff, lane_page, i & 31), row0(i));
  }
  __device__ __forceinline__ T* k_slot(int st) const { return ring + st * 2 * TILE; }

  // Chunk j of this lane's share of a [kTK, D] tile: rows from src (stride ss) into dst, zero-filled from
  // row `valid` on.
  __device__ __forceinline__ void copy_chunk(T* dst, const T* src, int64_t ss, int valid, int j) const {
    const int idx = lane + 32 * j, row = idx / CH, c = idx % CH;
    const bool ok = row < valid;
    ptx::cp_async16(dst + tile_off(row, c), src + (ok ? row : 0) * ss + c * 8, ok);
  }
  // Tile i into slot st, one cp.async group.
  __device__ __forceinline__ void load_tile(int i, int st) const {
    turn_page_window(i);
    T* dk = k_slot(st);
    T* dv = dk + TILE;
    const int n = valid(i);
    const T* gk = tile_rows(k, i);
    const T* gv = tile_rows(v, i);
#pragma unroll
    for (int j = 0; j < kTK * CH / 32; ++j) {
      copy_chunk(dk, gk, p.k_ss, n, j);
      copy_chunk(dv, gv, p.v_ss, n, j);
    }
    ptx::cp_async_commit();
  }
  // The K rows (v_half false) or the V rows of tile i into slot st, one cp.async group.
  __device__ __forceinline__ void load_half(int i, int st, bool v_half) const {
    if (!v_half) turn_page_window(i);
    T* dst = k_slot(st) + (v_half ? TILE : 0);
    const int64_t ss = v_half ? p.v_ss : p.k_ss;
    const T* src = tile_rows(v_half ? v : k, i);
    const int n = valid(i);
#pragma unroll
    for (int j = 0; j < kTK * CH / 32; ++j) copy_chunk(dst, src, ss, n, j);
    ptx::cp_async_commit();
  }
};

// This thread's share of the 16 heads' attention over the keys consumed so far: Q's A fragments (kQInSmem:
// this lane's ldmatrix address of them in the staged q instead), O's C fragments (rows g: [0], [1]; g + 8:
// [2], [3]) and the softmax state (m, l) of rows g and g + 8. The fields refer to the kernel's registers.
template <typename T, int D>
struct Heads {
  static constexpr int KD = D / 16;  // k-steps of Q K^T
  static constexpr int DT = D / 8;   // 8-wide output tiles
  uint32_t (&qf)[KD][4];
  float (&acc)[DT][4];
  float (&m_row)[2];
  float (&l_row)[2];
  const T* q_lane;  // kQInSmem: k-step kk's A fragment at q_lane + kk * 16

  __device__ __forceinline__ void reset() const {
#pragma unroll
    for (int i = 0; i < DT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
    m_row[0] = m_row[1] = -INFINITY, l_row[0] = l_row[1] = 0.f;
  }

  // One 16-key tile (K at tk, V at tv, keys from `valid` on masked).
  __device__ __forceinline__ void consume(const T* tk, const T* tv, int valid, int lane, const DecodeParams& p) const {
    const int t = lane % 4;
    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};  // keys 0-7, 8-15 of the tile
    // This lane's ldmatrix offsets in K (k-step kk) and V (output pair dd): tile_off's lane part repeats every
    // 4 steps, a 64-column block on. At d 256 they are taken as 4 registers each and a block's constant:
    // ptxas kept one a step there, and spilled them.
    int kb[4], vb[4];
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      kb[m] = tile_off((lane % 8) + (lane / 16) * 8, m * 2 + (lane / 8) % 2);
      vb[m] = tile_off((lane % 8) + ((lane / 8) % 2) * 8, m * 2 + lane / 16);
    }
#pragma unroll
    for (int kk = 0; kk < KD; ++kk) {
      uint32_t bf[4], qa[4];
      ptx::ldmatrix_x4(bf, tk + (D > 128 ? kb[kk % 4] + (kk / 4) * (kTK * 64)
                                         : tile_off((lane % 8) + (lane / 16) * 8, kk * 2 + (lane / 8) % 2)));
      if constexpr (kQInSmem<D>) ptx::ldmatrix_x4(qa, q_lane + kk * 16);
      const uint32_t(&a)[4] = kQInSmem<D> ? qa : qf[kk];
      ptx::mma_m16n8k16<T>(s[0], a, bf[0], bf[1]);
      ptx::mma_m16n8k16<T>(s[1], a, bf[2], bf[3]);
    }

    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = s[j][e] * p.scale_log2;                     // log2 units: exp2f below
        if (j * 8 + 2 * t + (e & 1) >= valid) x = -INFINITY;  // a select: NaN scores of stray keys vanish
        s[j][e] = x;
        mx[e / 2] = fmaxf(mx[e / 2], x);
      }
    }
    float alpha[2], base[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffff, mx[h], 1));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffff, mx[h], 2));
      SoftmaxState row{m_row[h], l_row[h]};
      base[h] = fmaxf(row.m, mx[h]);      // finite: key 0 of the tile is valid
      alpha[h] = row.rescale(base[h]);  // 0 on the first tile (m = -inf)
      m_row[h] = row.m, l_row[h] = row.l;
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[j][e] = exp2f(s[j][e] - base[e / 2]);
        l_row[e / 2] += s[j][e];  // this thread's columns; the quad is summed at the end
      }
    }
#pragma unroll
    for (int d = 0; d < DT; ++d) {
      acc[d][0] *= alpha[0], acc[d][1] *= alpha[0];
      acc[d][2] *= alpha[1], acc[d][3] *= alpha[1];
    }
    // The C fragments of the two score tiles are the A fragment of P (16 heads x 16 keys).
    uint32_t pf[4];
    pf[0] = pack2<T>(s[0][0], s[0][1]);
    pf[1] = pack2<T>(s[0][2], s[0][3]);
    pf[2] = pack2<T>(s[1][0], s[1][1]);
    pf[3] = pack2<T>(s[1][2], s[1][3]);
#pragma unroll
    for (int dd = 0; dd < DT / 2; ++dd) {
      uint32_t vf[4];
      ptx::ldmatrix_x4_trans(vf, tv + (D > 128 ? vb[dd % 4] + (dd / 4) * (kTK * 64)
                                               : tile_off((lane % 8) + ((lane / 8) % 2) * 8, dd * 2 + lane / 16)));
      ptx::mma_m16n8k16<T>(acc[2 * dd], pf, vf[0], vf[1]);
      ptx::mma_m16n8k16<T>(acc[2 * dd + 1], pf, vf[2], vf[3]);
    }
  }
};

// This warp's tiles [i0, n) through its ring, tile i0 + j in slot j % depth, loading nothing past n; the
// first `issued` of them are in flight already. In flight: the whole ring, or, in a full grid's long stream
// (FULL_GRID and long_stream), kFullGridStages of its slots (below d 256 such a warp loads nothing before the wait).
// Tiles fill in order, so the cp.async groups keep their count whichever side of the wait a tile was issued on.
template <bool FULL_GRID, int RING, typename T, int D>
__device__ __forceinline__ void stream(const WarpRing<T, D>& w, const Heads<T, D>& h, int i0, int n, int issued) {
  constexpr int STAGES = kStages<T, D, RING>, SHALLOW = kFullGridStages<T, D>;
  static_assert(SHALLOW <= STAGES, "the shallow depth is part of the ring");
  // At d 64 / 128 a shallow long stream loads no tile early (load_early); at d 256 it does, its shallow depth being
  // its ring's
  static_assert(kLongStreamTiles >= 8 && kLongStreamTiles * kWarps * kTK >= kOneSplitKeys,
                "warps of at most 8 tiles and small calls, which load their ring early, never stream shallow");
  const bool shallow = FULL_GRID && long_stream(w.r.n_my);
  const int depth = shallow ? SHALLOW : STAGES;
  for (int j = issued; j < depth; ++j) {
    if (i0 + j < n) w.load_tile(i0 + j, j);
    else ptx::cp_async_commit();  // keep one group per stage: the waits count groups
  }
  if (i0 == 0) h.reset();  // a stream from the first tile starts the softmax state afresh
  int st = 0;
  for (int i = i0; i < n; ++i) {
    T* tk = w.k_slot(st);
    T* tv = tk + WarpRing<T, D>::TILE;
    const int valid = w.valid(i);      // >= 1
    if (shallow) ptx::cp_async_wait<SHALLOW - 1>();  // tile i has landed (this lane's copies) ...
    else ptx::cp_async_wait<STAGES - 1>();
    __syncwarp();  // ... and every lane's
    h.consume(tk, tv, valid, w.lane, w.p);
    __syncwarp();  // every lane is done with slot st: refill it
    if (i + depth < n) w.load_tile(i + depth, st);
    else ptx::cp_async_commit();
    if (++st == depth) st = 0;
  }
}

}  // namespace minfer::attn::decode
