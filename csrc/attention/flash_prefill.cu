// FlashAttention-2 style prefill on tensor cores (mma.sync m16n8k16, fp16/bf16, head_dim 64/128/256): the
// sm_80 path, and the fallback on Hopper where flash_prefill_sm90.cu does not take the case (ragged / paged,
// operands TMA cannot describe).
// One CTA owns BM = 64 * MT query rows of one (batch, head), or of one kv head's q heads (GQA packing); each
// of its 4 warps owns 16 * MT rows and keeps their softmax state (max, sum) and output accumulator in fp32
// registers. K/V tiles of BN = 64 keys stream through a ring of R [BN, D] slots in shared memory with cp.async,
// in the order K[0], V[0], K[1], V[1], ...: while one piece is consumed, the next R - 1 are in flight (R = 2:
// V[t] loads while S = Q K^T runs, K[t+1] while softmax and O += P V run). Scores are prescaled by
// scale * log2(e) so that exp2f does the softmax.
//
// One kernel serves both APIs (FlashParams says where each sequence's queries sit):
//   engine attention: queries at positions start_pos[b] + s, keys 0 .. start_pos[b] + s visible;
//   seed flash_attention: q_off = seq_k - seq_q (bottom-right causal) or no mask but the kv length.
// Sliding window (p.window = w > 0): the row at position p sees keys p - w < key <= p. A CTA's tile loop
// starts at the tile holding its first row's first key, so a windowed prefill costs O(seq * w); keys
// before that are never read (in the paged layout, neither are their block-table entries: the engine
// frees those pages).
// GQA packing (ragged steps): a CTA's rows are (token, q head) pairs of one kv head, token-major, so that every
// q head of the group shares each K/V tile it loads, and a chunk of 32 tokens fills a 128-row block with its
// 4 heads where one head's rows would fill a quarter of 4 blocks, each loading every tile.
// Split-KV: a ragged step of few queries over long contexts (a chunk of a long prompt beside decodes: 128
// queries x 32 heads are 32 CTAs, each over up to 32k keys) cuts each query block's key tiles into kv_splits
// contiguous ranges, one CTA each; every CTA writes its rows' unnormalized output and (max, sum), and
// prefill_combine_kernel merges them.
// Memory is O(N): no score matrix exists outside registers.
#include "common/checks.h"
#include <ATen/ops/empty.h>  // the workspace, which no tensor at hand gives options for
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <utility>

#include "attention/attention.h"
#include "attention/mma.cuh"
#include "common/dispatch.h"
#include "common/launch.h"
#include "common/ptx.cuh"
#include "common/reduce.h"
#include "common/vec.h"

namespace minfer::attn {

namespace {

constexpr int kThreads = 128, kBN = 64;

// The query rows of a block: packed row R is token R / pack of the sequence and q head head0 + R % pack.
struct QueryRows {
  int row0, pack, head0;
  __device__ __forceinline__ int token(int r) const { return r / pack; }
  __device__ __forceinline__ int head(int r) const { return head0 + r % pack; }
  // Element offset of row r's head_dim vector in a [.., tokens, heads, D] tensor of strides (ss, hs).
  __device__ __forceinline__ int64_t at(int r, int64_t ss, int64_t hs) const {
    return (row0 + token(r)) * ss + head(r) * hs;
  }
};

// Copies packed rows [m_start, m_start + ROWS) of q (its batch's base qb) into a swizzled [ROWS, D] tile;
// rows at or past n_rows are zero-filled and never read.
template <typename T, int D, int ROWS>
__device__ __forceinline__ void load_q_tile(T* s, const T* qb, const FlashParams& p, const QueryRows& qr, int m_start,
                                            int n_rows) {
  constexpr int CH = D / 8;
  for (int i = threadIdx.x; i < ROWS * CH; i += kThreads) {
    const int r = i / CH, c = i % CH;
    const bool ok = m_start + r < n_rows;
    ptx::cp_async16(s + swz<D>(r, c), ok ? qb + qr.at(m_start + r, p.q_ss, p.q_hs) + c * 8 : qb, ok);
  }
}

// Keys [n_start + rows_lo, n_start + rows_valid) of a [kBN, D] K or V tile from either cache layout (a
// paged tile may span pages: each row is located by itself); the other rows are zero-filled, as their
// scores are masked and 0 * V must stay 0 (rows_lo > 0: keys before the window, whose pages may be gone).
template <typename T, int D>
__device__ __forceinline__ void load_kv_tile(T* s, const KvRows<T, kPageShift<D>>& kv, int n_start, int rows_lo,
                                             int rows_valid) {
  constexpr int CH = D / 8;
  for (int i = threadIdx.x; i < kBN * CH; i += kThreads) {
    const int r = i / CH, c = i % CH;
    const bool ok = static_cast<unsigned>(r - rows_lo) < static_cast<unsigned>(rows_valid - rows_lo);  // one compare
    ptx::cp_async16(s + swz<D>(r, c), ok ? kv.row(n_start + r) + c * 8 : kv.base, ok);
  }
}

// MT: 16-row m-tiles per warp (BM = 64 * MT). Each K/V fragment read from shared memory feeds MT
// MMAs, so MT = 2 halves the shared-memory traffic per FLOP (ldmatrix bandwidth is what bounds
// MT = 1); it costs registers, so it is used where they fit (head_dim 64).
// R: the K/V ring's slots; MIN_CTAS: the CTAs an SM must hold (registers a thread: 65536 / 128 / MIN_CTAS).
template <typename T, int D, int MT, int R, int MIN_CTAS, bool CAUSAL>
__global__ void __launch_bounds__(kThreads, MIN_CTAS) flash_prefill_kernel(const FlashParams p) {
  constexpr int BM = 64 * MT;
  constexpr int KD = D / 16;   // k-steps of Q K^T
  constexpr int NT = kBN / 8;  // 8-wide score tiles
  constexpr int DT = D / 8;    // 8-wide output tiles
  // Q's A fragments stay in registers for the whole tile loop up to head_dim 128; at 256 the accumulator
  // alone is 128 registers and 64 more would spill, so each k-step reloads its fragment from sQ, and the
  // k-steps of S = Q K^T are unrolled by 2 only (fully unrolled, ptxas hoists their loads and spills).
  constexpr bool kQInRegs = D <= 128;
  constexpr int kUnrollS = kQInRegs ? KD : 2;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);  // [BM, D]
  T* sKV = sQ + BM * D;                    // [R, BN, D]: piece i (K[i / 2] or V[i / 2]) in slot i % R

  // Heaviest (last) query blocks first: causal blocks near the end see the most keys. A block's kv_splits
  // CTAs are neighbours in x.
  const int splits = p.kv_splits, split = blockIdx.x % splits;
  const int m_block = gridDim.x / splits - 1 - blockIdx.x / splits;
  const int b = blockIdx.z, heads = gridDim.y * p.pack;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int m_start = m_block * BM;

  const SeqRows sr = seq_rows(p, b);
  const QueryRows qr{sr.row0, p.pack, static_cast<int>(blockIdx.y) * p.pack};
  const int kvh = qr.head0 / p.group;
  const int n_rows = sr.n_q * p.pack;
  if (m_start >= n_rows) return;  // a ragged batch's shorter sequence
  const int q_off = sr.q_off, kv_len = sr.kv_len;
  // Positions of the block's first and last tokens.
  const int first_pos = q_off + qr.token(m_start), last_pos = q_off + qr.token(min(m_start + BM, n_rows) - 1);
  // Keys past kv_end are invisible to every row of this block.
  int kv_end = kv_len;
  if (CAUSAL) kv_end = min(kv_len, last_pos + 1);
  const int n_tiles = kv_end > 0 ? (kv_end + kBN - 1) / kBN : 0;
  // Window: keys before key_lo are invisible to every row (the first row's window starts there), so the
  // tile loop starts at t_lo; keys before win_key are outside the last row's window, so tiles starting
  // there need the per-row window mask. Without a window: key_lo = 0, and no tile starts below win_key = 0.
  // The window is causal (flash_prefill checks): the non-causal kernel has none.
  // (Capped at kv_end, so that a tile's rows [key_lo, kv_end) are never a reversed range.)
  const int key_lo = CAUSAL && p.window > 0 ? max(min(first_pos - p.window + 1, kv_end), 0) : 0;
  const int win_key = CAUSAL && p.window > 0 ? last_pos + 1 - p.window : 0;
  const int t_lo = key_lo / kBN;
  // This CTA's share of the block's tiles [t_lo, n_tiles): all of them without split-KV; maybe none.
  const int per_split = (n_tiles - t_lo + splits - 1) / splits;
  const int t_begin = t_lo + split * per_split, t_end = min(n_tiles, t_begin + per_split);

  const auto kr = kv_rows<T, kPageShift<D>>(p.paged, p.k, p.k_bs, p.k_ss, p.k_hs, p.paged.k_ps, b, kvh);
  const auto vr = kv_rows<T, kPageShift<D>>(p.paged, p.v, p.v_bs, p.v_ss, p.v_hs, p.paged.v_ps, b, kvh);

  // Piece i of this CTA's tiles is K of tile t_begin + i / 2 for even i, its V for odd, in ring slot i % R;
  // one commit group each (empty past the last tile: the wait counts stay uniform). Whether a piece is K is
  // a constant at each call: a runtime choice between kr and vr spills at d 256.
  auto load_piece = [&](int i, auto is_k) {
    const int n_start = (t_begin + i / 2) * kBN;
    if (n_start < t_end * kBN)
      load_kv_tile<T, D>(sKV + (i % R) * kBN * D, is_k ? kr : vr, n_start, key_lo - n_start, kv_end - n_start);
    ptx::cp_async_commit();
  };
  load_q_tile<T, D, BM>(sQ, reinterpret_cast<const T*>(p.q) + b * p.q_bs, p, qr, m_start, n_rows);
  ptx::cp_async_commit();
  [&]<int... I>(std::integer_sequence<int, I...>) {
    (load_piece(I, std::bool_constant<I % 2 == 0>{}), ...);
  }(std::make_integer_sequence<int, R - 1>{});
  ptx::cp_async_wait<R - 1>();  // Q has landed (the first pieces may still be in flight)
  __syncthreads();
  // Before piece i is read: every warp is done with piece i - 1, whose slot piece i + R - 1 refills; then
  // piece i has landed (R - 1 groups may still be in flight) and is visible to every warp.
  auto next_piece = [&](int i, auto i_is_k) {
    __syncthreads();
    load_piece(i + R - 1, std::bool_constant<(decltype(i_is_k)::value == (R % 2 == 1))>{});
    ptx::cp_async_wait<R - 1>();
    __syncthreads();
  };

  // Row block of m-tile mt of this warp: rows wrow + mt * 16 .. + 15 of the CTA's BM rows.
  const int wrow = warp * 16 * MT;
  // The A fragment of Q for m-tile mt, k-step kk.
  auto load_q = [&](uint32_t (&f)[4], int mt, int kk) {
    ptx::ldmatrix_x4(f, sQ + swz<D>(wrow + mt * 16 + (lane % 8) + ((lane / 8) % 2) * 8, kk * 2 + lane / 16));
  };
  uint32_t qf[MT][kQInRegs ? KD : 1][4];  // all k-steps, or the current one's (reloaded)
  if constexpr (kQInRegs) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int kk = 0; kk < KD; ++kk) load_q(qf[mt][kk], mt, kk);
  }

  // Per thread: rows (mt, half) = m_start + wrow + mt * 16 + half * 8 + lane / 4, index h = 2 mt + half.
  float acc[MT][DT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < DT; ++i) acc[mt][i][0] = acc[mt][i][1] = acc[mt][i][2] = acc[mt][i][3] = 0.f;
  float m_row[2 * MT], l_row[2 * MT];
  int pos[2 * MT];  // positions of this thread's query rows
#pragma unroll
  for (int h = 0; h < 2 * MT; ++h) {
    m_row[h] = -INFINITY, l_row[h] = 0.f;
    pos[h] = q_off + qr.token(m_start + wrow + (h / 2) * 16 + (h % 2) * 8 + lane / 4);
  }

  for (int t = t_begin; t < t_end; ++t) {
    const int n_start = t * kBN, piece = 2 * (t - t_begin);
    const T* sK = sKV + (piece % R) * kBN * D;
    const T* sV = sKV + ((piece + 1) % R) * kBN * D;
    next_piece(piece, std::true_type{});  // K[t]

    float s[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int j = 0; j < NT; ++j) s[mt][j][0] = s[mt][j][1] = s[mt][j][2] = s[mt][j][3] = 0.f;
#pragma unroll(kUnrollS)
    for (int kk = 0; kk < KD; ++kk) {
      if constexpr (!kQInRegs) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) load_q(qf[mt][0], mt, kk);
      }
      const int qk = kQInRegs ? kk : 0;  // this k-step's fragment in qf
#pragma unroll
      for (int nn = 0; nn < NT / 2; ++nn) {
        uint32_t bf[4];
        ptx::ldmatrix_x4(bf, sK + swz<D>(nn * 16 + (lane % 8) + (lane / 16) * 8, kk * 2 + (lane / 8) % 2));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          ptx::mma_m16n8k16<T>(s[mt][2 * nn], qf[mt][qk], bf[0], bf[1]);
          ptx::mma_m16n8k16<T>(s[mt][2 * nn + 1], qf[mt][qk], bf[2], bf[3]);
        }
      }
    }

    // Mask only the tiles that cross the kv length, the diagonal or the window's lower edge, in a loop of its
    // own behind one branch (a test per score compiles to selects that every tile runs: ~580 of an unmasked
    // tile's ~1250 instructions a warp at d 64). A row whose keys in this tile are all masked keeps a -inf max
    // here, which the base below guards.
    const bool need_mask =
        n_start + kBN > kv_len || (CAUSAL && (n_start + kBN - 1 > first_pos || n_start < win_key));
    if (need_mask) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int h = 2 * mt + e / 2;
            const int col = n_start + j * 8 + (lane % 4) * 2 + (e & 1);
            // Window: col <= pos - window, as col + window in unsigned (no overflow, and no pos - window
            // per row kept in registers).
            const bool outside = p.window > 0 && unsigned(col) + p.window <= unsigned(pos[h]);
            if (col >= kv_len || (CAUSAL && (col > pos[h] || outside))) s[mt][j][e] = -INFINITY;
          }
    }
    // The max of the raw scores, then scaled (the ops check scale > 0, which keeps the order); exp2 of
    // score * scale - max in one FMA.
    float mx[2 * MT];
#pragma unroll
    for (int h = 0; h < 2 * MT; ++h) mx[h] = -INFINITY;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) mx[2 * mt + e / 2] = fmaxf(mx[2 * mt + e / 2], s[mt][j][e]);
    float alpha[2 * MT], base[2 * MT];
#pragma unroll
    for (int h = 0; h < 2 * MT; ++h) {
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffff, mx[h], 1));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffff, mx[h], 2));
      const float m_new = fmaxf(m_row[h], mx[h] * p.scale_log2);
      base[h] = m_new == -INFINITY ? 0.f : m_new;  // a row with nothing visible yet (Check_inf): avoid inf - inf
      alpha[h] = exp2f(m_row[h] - base[h]);
      m_row[h] = m_new;
      l_row[h] *= alpha[h];
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int j = 0; j < NT; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int h = 2 * mt + e / 2;
          s[mt][j][e] = exp2f(fmaf(s[mt][j][e], p.scale_log2, -base[h]));
          l_row[h] += s[mt][j][e];  // this thread's columns only; the quad is summed at the end
        }
      }
#pragma unroll
      for (int i = 0; i < DT; ++i) {
        acc[mt][i][0] *= alpha[2 * mt], acc[mt][i][1] *= alpha[2 * mt];
        acc[mt][i][2] *= alpha[2 * mt + 1], acc[mt][i][3] *= alpha[2 * mt + 1];
      }
    }

    next_piece(piece + 1, std::false_type{});  // V[t]
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk) {
      // The C fragments of score tiles 2kk and 2kk+1 are exactly the A fragment of P for this k-step.
      uint32_t pf[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        pf[mt][0] = pack2<T>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        pf[mt][1] = pack2<T>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        pf[mt][2] = pack2<T>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        pf[mt][3] = pack2<T>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
      }
#pragma unroll
      for (int dd = 0; dd < DT / 2; ++dd) {
        uint32_t vf[4];
        ptx::ldmatrix_x4_trans(vf, sV + swz<D>(kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8, dd * 2 + lane / 16));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          ptx::mma_m16n8k16<T>(acc[mt][2 * dd], pf[mt], vf[0], vf[1]);
          ptx::mma_m16n8k16<T>(acc[mt][2 * dd + 1], pf[mt], vf[2], vf[3]);
        }
      }
    }
  }
  ptx::cp_async_wait<0>();

  T* o_base = reinterpret_cast<T*>(p.o) + b * p.o_bs;
#pragma unroll
  for (int h = 0; h < 2 * MT; ++h) {
    float l = l_row[h];
    l += __shfl_xor_sync(0xffffffff, l, 1);
    l += __shfl_xor_sync(0xffffffff, l, 2);
    const int row = m_start + wrow + (h / 2) * 16 + (h % 2) * 8 + lane / 4;  // packed
    if (row >= n_rows) continue;
    if (splits > 1) {  // the partial: unnormalized output, and (max, sum) once per row
      const int64_t at = (int64_t(split) * p.total_q + sr.row0 + qr.token(row)) * heads + qr.head(row);
      float* po = p.part_o + at * D + (lane % 4) * 2;
      const int mt = h / 2, e0 = (h % 2) * 2;
#pragma unroll
      for (int i = 0; i < DT; ++i)
        *reinterpret_cast<float2*>(po + i * 8) = make_float2(acc[mt][i][e0], acc[mt][i][e0 + 1]);
      if (lane % 4 == 0) *reinterpret_cast<float2*>(p.part_ml + 2 * at) = make_float2(m_row[h], l);
      continue;
    }
    const float inv = l > 0.f ? 1.f / l : 0.f;  // a row that sees no key gets zeros
    T* orow = o_base + qr.at(row, p.o_ss, p.o_hs);
    const int mt = h / 2, e0 = (h % 2) * 2;
#pragma unroll
    for (int i = 0; i < DT; ++i) {
      const uint32_t v = pack2<T>(acc[mt][i][e0] * inv, acc[mt][i][e0 + 1] * inv);
      *reinterpret_cast<uint32_t*>(orow + i * 8 + (lane % 4) * 2) = v;
    }
  }
}

// The most splits a query block takes: the combine reads two splits' (max, sum) a lane.
constexpr int kMaxSplits = 64;

// Merges the kv_splits partials of each (query row, head), a warp each: with m the largest partial max,
// o = sum_s 2^(m_s - m) o_s / sum_s 2^(m_s - m) l_s (zeros for a row that sees no key). The splits' (max, sum)
// are read at once, a split a lane (two each), and each split's weight is shuffled from its
// lane into the output pass, whose loads are unrolled (H200, a 32-query chunk over 16k keys in 32 splits,
// attention and merge: 43.8 us with one split's (max, sum) read at a time, 42.4 so).
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) prefill_combine_kernel(const FlashParams p, int heads) {
  const int64_t rows = int64_t(p.total_q) * heads;
  const int64_t row = int64_t(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32;  // token * heads + head
  if (row >= rows) return;
  const int lane = threadIdx.x % 32, splits = p.kv_splits;
  float2 ml[2];
  float m = -INFINITY;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int s = lane + 32 * j;
    ml[j] = s < splits ? *reinterpret_cast<const float2*>(p.part_ml + 2 * (s * rows + row)) : make_float2(-INFINITY, 0.f);
    m = fmaxf(m, ml[j].x);
  }
  m = warp_max(m);
  float w[2], l = 0.f;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    w[j] = ml[j].x == -INFINITY ? 0.f : exp2f(ml[j].x - m);  // a split that saw no key weighs 0
    l += w[j] * ml[j].y;
  }
  l = warp_sum(l);
  float acc[D / 32] = {};
  const float* po = p.part_o + row * D + lane;
#pragma unroll 8
  for (int s = 0; s < splits; ++s) {
    const float ws = __shfl_sync(0xffffffff, s < 32 ? w[0] : w[1], s & 31);
#pragma unroll
    for (int j = 0; j < D / 32; ++j) acc[j] = fmaf(ws, po[s * rows * D + j * 32], acc[j]);
  }
  const float inv = l > 0.f ? 1.f / l : 0.f;
  T* out = reinterpret_cast<T*>(p.o) + (row / heads) * p.o_ss + (row % heads) * p.o_hs;
#pragma unroll
  for (int j = 0; j < D / 32; ++j) out[j * 32 + lane] = from_float<T>(acc[j] * inv);
}

// Split-KV for a ragged step whose query blocks fill less than one wave of resident CTAs (slots: the kernel's
// CTAs an SM times the SMs; its registers hold it to 2-4 an SM): as many splits as keep the grid within that
// wave, each of at least min_tiles of the longest sequence's tiles. A grid just past a wave runs a last wave
// of a few CTAs: a 128-token chunk over 16k keys (d 64, 32 CTAs of rows) split 17 ways took 154 us on an
// H200, split 8 ways 143.
int prefill_kv_splits(const FlashParams& p, int64_t ctas, int64_t slots, int min_tiles) {
  if (p.cu_seqlens_q == nullptr || ctas >= slots) return 1;
  const int64_t tiles = (int64_t(p.seq_k) + kBN - 1) / kBN;
  return static_cast<int>(std::clamp<int64_t>(std::min(slots / ctas, tiles / min_tiles), 1, kMaxSplits));
}

// One variant of the kernel: MT m-tiles a warp, R ring slots. d 64 with one m-tile a warp is held to 128
// registers, 4 CTAs an SM (at 2 ring slots its causal kernel spilled there, at 4 not).
template <typename T, int D, int MT, bool CAUSAL>
struct Variant {
  static constexpr int BM = 64 * MT, R = D == 64 && MT == 1 ? 4 : 2;
  static constexpr int smem = (BM + R * kBN) * D * sizeof(T);  // Q + the K/V ring
  static constexpr auto kernel = flash_prefill_kernel<T, D, MT, R, D == 64 && MT == 1 ? 4 : 1, CAUSAL>;
  static int64_t slots() {
    allow_smem<kernel, smem>();
    static const int per_sm = [] {
      int n = 0;
      C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, smem));
      return std::max(n, 1);
    }();
    return int64_t(per_sm) * sm_count(c10::cuda::current_device());
  }
  // A ragged step's CTAs of query rows that have work (before splits): its total_q queries' rows in blocks.
  static int64_t row_blocks(const FlashParams& p, int heads) {
    return (int64_t(p.total_q) * p.pack + BM - 1) / BM * (heads / p.pack);
  }
  static void run(FlashParams p, int heads, int batch, cudaStream_t stream) {
    at::Tensor ws;
    if (p.kv_splits > 1) {
      const int64_t rows = int64_t(p.kv_splits) * p.total_q * heads;
      ws = at::empty({rows * (D + 2)}, at::dtype(at::kFloat).device(at::kCUDA, c10::cuda::current_device()));
      p.part_o = ws.data_ptr<float>(), p.part_ml = p.part_o + rows * D;
    }
    const dim3 grid((int64_t(p.seq_q) * p.pack + BM - 1) / BM * p.kv_splits, heads / p.pack, batch);
    kernel<<<grid, kThreads, smem, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (p.kv_splits > 1) {
      const int64_t warps = int64_t(p.total_q) * heads;
      prefill_combine_kernel<T, D><<<(warps + kThreads / 32 - 1) / (kThreads / 32), kThreads, 0, stream>>>(p, heads);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  }
};

// Key tiles a split takes at least (half that for d 64's narrow variant, whose CTAs are twice as many).
constexpr int kMinSplitTiles = 8;

template <typename T, int D, bool CAUSAL>
void launch(const FlashParams& p, int batch, int heads, cudaStream_t stream) {
  FlashParams sp = p;
  sp.pack = p.cu_seqlens_q != nullptr ? p.group : 1;
  using Wide = Variant<T, D, D <= 64 ? 2 : 1, CAUSAL>;
  const bool ragged = p.cu_seqlens_q != nullptr;
  const int64_t wide_blocks = ragged ? Wide::row_blocks(sp, heads) : 0, wide_slots = Wide::slots();
  sp.kv_splits = prefill_kv_splits(sp, wide_blocks, wide_slots, kMinSplitTiles);
  if constexpr (D == 64 && CAUSAL) {  // (the engine's ragged steps are causal; any other keeps the wide kernel)
    // A ragged grid under half a wave (few query rows over a short context) goes to 16 rows a warp and 4 CTAs
    // an SM, twice the CTAs, each streaming half as many rows: H200, a 32-query chunk over 4k keys 36 -> 21 us
    // (over 16k keys, a wave either way, 44.1 against 44.4; 128 queries over 16k 131 against 139).
    if (ragged && wide_blocks * sp.kv_splits * 2 < wide_slots) {
      using Narrow = Variant<T, D, 1, CAUSAL>;
      sp.kv_splits = prefill_kv_splits(sp, Narrow::row_blocks(sp, heads), Narrow::slots(), kMinSplitTiles / 2);
      return Narrow::run(sp, heads, batch, stream);
    }
  }
  Wide::run(sp, heads, batch, stream);
}

}  // namespace

void flash_prefill(const FlashParams& p, at::ScalarType dtype, int head_dim, bool causal, int batch, int heads,
                   cudaStream_t stream) {
  if (p.seq_q == 0 || batch == 0 || heads == 0) return;
  MINFER_CHECK(causal || p.window == 0, "flash prefill: a sliding window needs causal attention");
  // MINFER_PREFILL_PATH: auto (default: the sm90 kernel where it takes the case), sm80 (this kernel
  // always), sm90 (an error where it cannot run: the tests use it so that Hopper never falls back silently).
  const char* env = std::getenv("MINFER_PREFILL_PATH");
  const std::string path = env != nullptr && env[0] != '\0' ? env : "auto";
  MINFER_CHECK(path == "auto" || path == "sm80" || path == "sm90", "flash prefill: MINFER_PREFILL_PATH must be auto, "
               "sm80 or sm90, got '", path, "'");
  // Ragged queries and paged K/V (the continuous engine's steps) have only this kernel.
  const bool ragged_or_paged = p.cu_seqlens_q != nullptr || p.paged.block_table != nullptr;
  if (path != "sm80" && !ragged_or_paged) {
    if (flash_prefill_sm90(p, dtype, head_dim, causal, batch, heads, stream)) return;  // Hopper: wgmma + TMA
    MINFER_CHECK(path != "sm90", "flash prefill: MINFER_PREFILL_PATH=sm90 but the sm90 kernel cannot take this case "
                 "(it needs compute capability 9.x, float16/bfloat16 and TMA-describable operands: "
                 "16-byte aligned base and row strides)");
  }
  MINFER_DISPATCH_HALF(dtype, "flash prefill", [&] {
    MINFER_DISPATCH_HEAD_DIM(head_dim, D, [&] {
      if (causal) launch<scalar_t, D, true>(p, batch, heads, stream);
      else launch<scalar_t, D, false>(p, batch, heads, stream);
    });
  });
}

}  // namespace minfer::attn
