// Hopper flash prefill (sm_90a): FlashAttention-3 style, wgmma + TMA, warp-specialized.
//
// CTA = 3 warpgroups (384 threads) for BM = 128 query rows of one (batch, q head):
//   warpgroup 0 = producer: one warp issues every TMA copy (Q once, then K and V tiles of BN keys through
//     2-stage mbarrier rings); it gives most of its registers away (setmaxnreg 24).
//   warpgroups 1, 2 = consumers (setmaxnreg 240), each owns 64 of the 128 rows:
//     S = Q K^T    wgmma m64nBNk16, Q and K K-major in shared memory;
//     online softmax on the S accumulators in registers (scale * log2 e folded into one FFMA before ex2);
//     O += P V     wgmma m64nDk16 with P from registers (the S accumulator converted pairwise to 16 bit IS
//                  the A fragment: k-slice j = S columns 16 j .. 16 j + 15) and V MN-major in shared memory.
//   Within a consumer, S of tile t+1 is issued before P V of tile t and the softmax of tile t+1 runs while
//   P V of tile t is still on the tensor cores. Between the consumers, ping-pong: they take turns issuing
//   these GEMM pairs (named barriers), so one's softmax overlaps the other's GEMMs.
//
// Shared memory tiles are TMA boxes of 64 columns (128 bytes, one 128-byte swizzle row) x rows, with the
// 128-byte swizzle: 16-byte chunk c of row r lands at chunk c ^ (r % 8), within 1024-byte-aligned 8-row
// groups. head_dim 128 is two such 64-column "halves" stored one after the other, 256 four. Descriptor math:
//   Q [BM, D] and K [BN, D] are K-major operands (K = head_dim contiguous): rows 128 B apart, 8-row
//   groups SBO = 1024 B apart; k-step kk (16 columns) = half kk / 4 at byte offset 32 * (kk % 4).
//   V [BN keys, D] is B of O = P V with K = keys and N = head_dim contiguous: "MN-major". PTX's canonical
//   MN-major SW128 layout is ((8, 8, m), (8, k)) : ((1, 8, LBO), (64, SBO)) in elements, swizzled on the
//   address: N runs 64 elements along a 128-byte row, one row per key, 8-key groups SBO apart and 64-wide
//   N blocks LBO apart. Here a row is one key (128 B), so SBO = 1024 B, LBO = the distance between two
//   64-column halves (BN * 128 B), and k-step kk (16 keys) starts at + kk * 16 * 128 = 2048 kk bytes,
//   a multiple of 1024, so the address-based swizzle of TMA and of wgmma agree. (Element (key, d):
//   half * BN*128 + key * 128 + ((d / 8 % 8) ^ (key % 8)) * 16 + (d % 8) * 2 in both views.)
//
// Semantics as flash_prefill.cu (FlashParams): queries of sequence b at start_pos[b] + s (causal over
// start_pos[b] + seq_q keys) or, without start_pos, bottom-right causal / plain over seq_k keys; GQA by
// head / group. Key tiles entirely above the diagonal are never loaded, only tiles crossing the diagonal
// or the kv length are masked (at head_dim 128, a warpgroup's diagonal tile whose upper 64 keys it cannot
// see runs both GEMMs on the lower 64 only), and query blocks run heaviest-first. TMA zero-fills rows past
// the tensor (seq_q, seq_k); cache slots in [kv_len, seq_k) may hold anything (NaN), so their scores are
// masked (a select, not an add) and the producer zeroes those V rows in shared memory (0 * NaN would
// poison O).
// Sliding window (p.window = w > 0: the row at position p sees keys p - w < key <= p): a CTA's tiles start
// at t_lo, the tile holding its first row's first visible key, so a windowed prefill costs O(seq * w);
// tiles reaching below a warpgroup's last row's window get the window mask as well. The keys of tile t_lo
// before the window are the sequence's own (written, finite) cache rows: masked, never zeroed.
// Key tiles: BN = 128 at head_dim 64 and 128. At 256, O is 64 x 256 fp32 a warpgroup (128 registers a
// thread), so BN = 80 (S 40 registers; FlashAttention-3's d 256 tile): shared memory is Q 64 KB + 2 stages of
// K and V at 40 KB, 225 KB of the 227. 80-key tiles against 64 (H200, 1 x 4096 x 8 / 4): not causal 240 -> 229
// us, causal 120 -> 112; at 64 the per-tile work (barriers, O's rescale) weighed on 25% more tiles.
#include <c10/cuda/CUDAException.h>

#include <cmath>

#include "attention/attention.h"
#include "attention/mma.cuh"
#include "common/checks.h"
#include "common/dispatch.h"
#include "common/launch.h"
#include "common/ptx.cuh"
#include "common/sm90.cuh"
#include "common/vec.h"

namespace minfer::attn {

namespace {

constexpr int kBM = 128, kThreads = 384, kStages = 2;

template <int D>
constexpr int block_n() {  // keys a tile
  return D == 256 ? 80 : 128;
}

template <int D>
constexpr int smem_bytes() {
  return (kBM + 2 * kStages * block_n<D>()) * D * 2 + 1024;  // Q + K ring + V ring (16-bit) + alignment slack
}

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
using namespace sm90;

// op over N values as a tree: depth ~log2 N instead of an (N - 1)-long dependency chain.
template <int N, typename Op>
__device__ __forceinline__ float tree(float (&v)[N], Op op) {
  if constexpr (N == 1) {
    return v[0];
  } else {
#pragma unroll
    for (int j = 0; j < N / 2; ++j) v[j] = op(v[j], v[j + N / 2]);
    if constexpr (N % 2 == 1) v[0] = op(v[0], v[N - 1]);
    return tree(reinterpret_cast<float(&)[N / 2]>(v), op);
  }
}

#endif

template <typename T, int D, bool CAUSAL>
__global__ void __launch_bounds__(kThreads, 1)
    flash_prefill_sm90_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                              const __grid_constant__ CUtensorMap tm_v, const FlashParams p) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kBN = block_n<D>();
  constexpr int HALVES = D / 64;              // 64-column TMA boxes per row
  constexpr int kQBytes = kBM * D * 2;        // every box is counted whole by TMA, zero-filled parts too
  constexpr int kTileBytes = kBN * D * 2;
  extern __shared__ uint8_t smem_raw[];
  __shared__ __align__(8) uint64_t bar_q, full_k[kStages], empty_k[kStages], full_v[kStages], empty_v[kStages],
      bar_vfix;
  const uint32_t sQ = (ptx::smem_addr(smem_raw) + 1023) & ~1023u;  // swizzled tiles need 1024-byte alignment
  const uint32_t sK = sQ + kQBytes;                          // stage s at sK + s * kTileBytes
  const uint32_t sV = sK + kStages * kTileBytes;

  // Grid (heads, query blocks, batch): CTAs of one GQA group are neighbours, and a wave holds several
  // blocks of one sequence rather than one block of every sequence, so the K/V tiles its CTAs stream
  // (from key 0 up) stay in L2 for all of them. Within a sequence the heaviest blocks launch first.
  const int head = blockIdx.x, b = blockIdx.z;
  const int m_start = (gridDim.y - 1 - blockIdx.y) * kBM;
  const int kvh = head / p.group;
  int q_off, kv_len;
  query_window(p, b, q_off, kv_len);
  int kv_end = kv_len;  // keys past kv_end are invisible to every row of this block
  if (CAUSAL) kv_end = min(kv_len, q_off + min(m_start + kBM, p.seq_q));
  // Keys before the first row's window are invisible to every row: the block runs key tiles t_lo ..
  // t_lo + n_tiles - 1 (the rings count them from 0). The window is causal (flash_prefill checks).
  const int t_lo = CAUSAL && p.window > 0 ? max(q_off + m_start - p.window + 1, 0) / kBN : 0;
  const int n_tiles = kv_end > t_lo * kBN ? (kv_end + kBN - 1) / kBN - t_lo : 0;

  if (threadIdx.x == 0) {
    ptx::mbar_init(ptx::smem_addr(&bar_q), 1);
    ptx::mbar_init(ptx::smem_addr(&bar_vfix), 1);
    for (int s = 0; s < kStages; ++s) {
      ptx::mbar_init(ptx::smem_addr(&full_k[s]), 1);   // the producer's expect_tx arrival (+ the TMA bytes)
      ptx::mbar_init(ptx::smem_addr(&full_v[s]), 1);
      ptx::mbar_init(ptx::smem_addr(&empty_k[s]), 2);  // one arrival per consumer warpgroup
      ptx::mbar_init(ptx::smem_addr(&empty_v[s]), 2);
    }
    ptx::mbar_init_fence();
  }
  __syncthreads();

  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    // ---------------- producer ----------------
    setmaxnreg_dec<24>();
    if (threadIdx.x >= 32 || n_tiles == 0) return;  // one warp; nothing is loaded for a block that sees no key
    const bool leader = threadIdx.x == 0;
    if (leader) {
      ptx::mbar_expect_tx(ptx::smem_addr(&bar_q), kQBytes);
#pragma unroll
      for (int h = 0; h < HALVES; ++h)
        ptx::tma_load_4d(sQ + h * kBM * 128, &tm_q, ptx::smem_addr(&bar_q), h * 64, head, m_start, b);
    }
    for (int t = 0; t < n_tiles; ++t) {
      const int s = t % kStages;
      const uint32_t phase = (t / kStages) & 1;
      const int n_start = (t_lo + t) * kBN;
      const uint32_t dk = sK + s * kTileBytes, dv = sV + s * kTileBytes;
      ptx::mbar_wait(ptx::smem_addr(&empty_k[s]), phase ^ 1);  // first pass: a fresh barrier's parity 1 counts as done
      if (leader) {
        ptx::mbar_expect_tx(ptx::smem_addr(&full_k[s]), kTileBytes);
#pragma unroll
        for (int h = 0; h < HALVES; ++h)
          ptx::tma_load_4d(dk + h * kBN * 128, &tm_k, ptx::smem_addr(&full_k[s]), h * 64, kvh, n_start, b);
      }
      ptx::mbar_wait(ptx::smem_addr(&empty_v[s]), phase ^ 1);
      const int valid = kv_len - n_start;  // >= 1: tile t starts below kv_end <= kv_len
      if (valid < kBN && kv_len < p.seq_k) {
        // The last tile reaches into cache slots past this sequence: load it, zero those rows, then
        // publish it. Only the last tile can, so this waits on bar_vfix at most once (parity 0).
        if (leader) {
          ptx::mbar_expect_tx(ptx::smem_addr(&bar_vfix), kTileBytes);
#pragma unroll
          for (int h = 0; h < HALVES; ++h)
            ptx::tma_load_4d(dv + h * kBN * 128, &tm_v, ptx::smem_addr(&bar_vfix), h * 64, kvh, n_start, b);
        }
        ptx::mbar_wait(ptx::smem_addr(&bar_vfix), 0);
        const int lane = threadIdx.x;
#pragma unroll
        for (int h = 0; h < HALVES; ++h)  // whole 128-byte rows: the swizzle only permutes chunks in a row
          for (int off = valid * 128 + lane * 16; off < kBN * 128; off += 32 * 16)
            ptx::st_shared_v4(dv + h * kBN * 128 + off, 0);
        ptx::fence_proxy_async();  // generic-proxy stores, read next by wgmma (async proxy)
        __syncwarp();
        if (leader) ptx::mbar_arrive(ptx::smem_addr(&full_v[s]));
      } else if (leader) {
        ptx::mbar_expect_tx(ptx::smem_addr(&full_v[s]), kTileBytes);
#pragma unroll
        for (int h = 0; h < HALVES; ++h)
          ptx::tma_load_4d(dv + h * kBN * 128, &tm_v, ptx::smem_addr(&full_v[s]), h * 64, kvh, n_start, b);
      }
    }
    return;
  }

  // ---------------- consumers ----------------
  setmaxnreg_inc<240>();
  const int c = wg - 1;  // rows [64 c, 64 c + 64) of the block
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t4 = lane % 4;
  // Accumulator layout (m64nNk16, f32): this thread holds rows r0 = 16 warp + g (registers 4 j + 0, 1) and
  // r0 + 8 (4 j + 2, 3) of the warpgroup's 64, columns 8 j + 2 t4 + {0, 1}.
  const int row0 = m_start + 64 * c + 16 * warp + g;  // query index in the sequence; row1 = row0 + 8
  const int pos0 = q_off + row0;  // row1's is pos0 + 8
  const int wg_first_pos = q_off + m_start + 64 * c;
  // Causal: keys at or past wg_kv_end are invisible to all 64 rows of this warpgroup. A tile whose upper
  // half lies there (consumer 0's diagonal tile) is a "half tile": both GEMMs run on its lower 64 keys
  // only. The mask has set the upper scores to -inf, so their P is 0 and P V loses nothing. Only the last
  // tile can be one: wg_kv_end is at most 64 keys short of the block's kv_end, which lies in the last
  // tile. At head_dim 128 this gains ~1%; at 64, where the softmax outweighs the GEMMs, the extra code
  // cost 4-5%, so the d = 64 kernels do not have it.
  const int wg_kv_end = min(kv_len, wg_first_pos + 64);
  const bool last_is_half =
      CAUSAL && D == 128 && n_tiles > 1 && (t_lo + n_tiles - 1) * kBN + kBN / 2 >= wg_kv_end;
  // Keys before wg_win_key are outside the window of this warpgroup's last row: tiles starting there are
  // masked (no tile starts below 0 without a window).
  const int wg_win_key = CAUSAL && p.window > 0 ? wg_first_pos + 64 - p.window : 0;
  constexpr std::false_type kFull{};
  constexpr std::true_type kHalf{};

  float o[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
  float sacc[kBN / 2];
  uint32_t pf[kBN / 16][4];

  // Issues S = Q K^T for tile t (async; the caller commits and waits). A half tile computes keys 0 .. 63:
  // m64n64 writes the first 32 accumulators, which are the m64n128 layout's columns 0 .. 63.
  auto issue_s = [&](int t, auto half) {
    constexpr int N = decltype(half)::value ? kBN / 2 : kBN;
    const uint32_t dk = sK + (t % kStages) * kTileBytes;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const uint32_t qa = sQ + (kk / 4) * kBM * 128 + c * 64 * 128 + (kk % 4) * 32;
      const uint32_t kb = dk + (kk / 4) * kBN * 128 + (kk % 4) * 32;
      wgmma_ss<T, N>(reinterpret_cast<float(&)[N / 2]>(sacc), desc_sw128(qa, 16, 1024), desc_sw128(kb, 16, 1024),
                     kk > 0);
    }
  };
  // Issues O += P V for tile t from pf (a half tile: keys 0 .. 63 only).
  auto issue_pv = [&](int t, auto half) {
    const uint32_t dv = sV + (t % kStages) * kTileBytes;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < (decltype(half)::value ? kBN / 32 : kBN / 16); ++kk)
      wgmma_rs_tb<T, D>(o, pf[kk], desc_sw128(dv + kk * 2048, kBN * 128, 1024), 1);
  };
  // Online softmax of tile t, first half: masks sacc (diagonal / kv-length / window tiles only; a row masked
  // whole keeps a -inf max, which base guards), updates the running max (raw scores: scale > 0 commutes
  // with max) and sum, leaves P = exp2(s * scale - max * scale)
  // (unnormalised, one FFMA + one MUFU per score) in sacc and returns the factors that rescale the older
  // output. Touches neither o nor pf, so it runs while P V of the previous tile is in flight. 2^x on the
  // SFU alone (ex2_approx; exp2f adds a range fix-up): x <= 0 here, and a weight below 2^-126 may flush to 0.
  auto softmax = [&](int t, float (&alpha)[2]) {
    const int n_start = (t_lo + t) * kBN;
    if (n_start + kBN > kv_len || (CAUSAL && n_start + kBN - 1 > wg_first_pos) || n_start < wg_win_key) {
      // Row h sees columns <= last[h]; compared relative to this thread's first column 2 t4 of the tile,
      // so each score costs one compare against a constant and one select (masked NaN keys vanish too).
      int rel[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) rel[h] = (CAUSAL ? min(kv_len - 1, pos0 + 8 * h) : kv_len - 1) - n_start - 2 * t4;
#pragma unroll
      for (int i = 0; i < kBN / 2; ++i)
        if (8 * (i / 4) + (i & 1) > rel[(i >> 1) & 1]) sacc[i] = -INFINITY;
      if (n_start < wg_win_key) {  // (so first[] cannot overflow, whatever the window)
        // Row h sees columns >= first[h] = pos - window + 1, relative likewise.
        int first[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) first[h] = pos0 + 8 * h - p.window + 1 - n_start - 2 * t4;
#pragma unroll
        for (int i = 0; i < kBN / 2; ++i)
          if (8 * (i / 4) + (i & 1) < first[(i >> 1) & 1]) sacc[i] = -INFINITY;
      }
    }
    // Row h of this thread = registers 4 j + 2 h + {0, 1}: max and sum as trees, not 32-long chains.
    float mx[2][kBN / 8];
#pragma unroll
    for (int j = 0; j < kBN / 8; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) mx[h][j] = fmaxf(sacc[4 * j + 2 * h], sacc[4 * j + 2 * h + 1]);
    float base[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float m = tree(mx[h], [](float a, float b) { return fmaxf(a, b); });
      m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, 1));
      m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, 2));
      const float m_new = fmaxf(m_run[h], m);
      base[h] = m_new == -INFINITY ? 0.f : m_new * p.scale_log2;  // nothing visible yet: avoid inf - inf
      alpha[h] = ptx::ex2_approx(fmaf(m_run[h], p.scale_log2, -base[h]));  // 0 while m_run is still -inf
      m_run[h] = m_new;
    }
#pragma unroll
    for (int i = 0; i < kBN / 2; ++i) sacc[i] = ptx::ex2_approx(fmaf(sacc[i], p.scale_log2, -base[(i >> 1) & 1]));
    // Row sums: this thread's columns only; the quad is summed at the end.
    float sm[2][kBN / 8];
#pragma unroll
    for (int j = 0; j < kBN / 8; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) sm[h][j] = sacc[4 * j + 2 * h] + sacc[4 * j + 2 * h + 1];
#pragma unroll
    for (int h = 0; h < 2; ++h)
      l_run[h] = fmaf(l_run[h], alpha[h], tree(sm[h], [](float a, float b) { return a + b; }));
  };
  // Second half, once P V of the previous tile is done: rescale o, P -> 16-bit A fragments.
  auto rescale_and_pack = [&](const float (&alpha)[2]) {
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] *= alpha[(i >> 1) & 1];
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk) {
      pf[kk][0] = pack2<T>(sacc[8 * kk + 0], sacc[8 * kk + 1]);  // row g,     keys 16 kk + 2 t4
      pf[kk][1] = pack2<T>(sacc[8 * kk + 2], sacc[8 * kk + 3]);  // row g + 8, keys 16 kk + 2 t4
      pf[kk][2] = pack2<T>(sacc[8 * kk + 4], sacc[8 * kk + 5]);  // row g,     keys 16 kk + 8 + 2 t4
      pf[kk][3] = pack2<T>(sacc[8 * kk + 6], sacc[8 * kk + 7]);  // row g + 8, keys 16 kk + 8 + 2 t4
    }
  };

  // Ping-pong between the consumers: their GEMM issues alternate (named barrier 1 + c = "consumer c may
  // issue"), so one consumer's softmax runs while the other's GEMMs hold the tensor cores. Both run the
  // same n_tiles + 1 issue turns (a CTA's tile count is shared), so each sync meets exactly one arrival
  // of the other; consumer 1's last arrival is left pending at exit.
  auto my_turn = [&] { ptx::named_bar_sync(1 + c, 256); };
  auto your_turn = [&] { ptx::named_bar_arrive(2 - c, 256); };
  // Software pipeline: S(t) = Q K[t]^T and O += P(t-1) V[t-1] are issued back to back; the softmax of S(t)
  // runs while P V is still on the tensor cores. wgmma groups complete in order, so wait<1> means S(t) is
  // done. The fence_regs keep the compiler from touching sacc / o before their waits. Each stage below
  // ends with nothing in flight, so the half / full choice is a branch between whole stages: a branch
  // between a wgmma's issue and its wait makes ptxas serialize every wgmma.
  float alpha[2];
  auto first = [&] {  // S(0), always whole (a block's only tile is never taken as a half tile)
    ptx::mbar_wait(ptx::smem_addr(&bar_q), 0);
    ptx::mbar_wait(ptx::smem_addr(&full_k[0]), 0);
    my_turn();
    issue_s(0, kFull);
    wgmma_commit();
    your_turn();
    wgmma_wait<0>();
    fence_regs(sacc);
    if (tid == 0) ptx::mbar_arrive(ptx::smem_addr(&empty_k[0]));
    softmax(0, alpha);
    rescale_and_pack(alpha);
  };
  auto step = [&](int t, auto half) {  // S(t) (t may be the half tile) and P(t-1) V[t-1] (never half)
    const int s = t % kStages, sp = (t - 1) % kStages;
    ptx::mbar_wait(ptx::smem_addr(&full_k[s]), (t / kStages) & 1);
    my_turn();
    issue_s(t, half);
    wgmma_commit();
    ptx::mbar_wait(ptx::smem_addr(&full_v[sp]), ((t - 1) / kStages) & 1);
    issue_pv(t - 1, kFull);
    wgmma_commit();
    your_turn();
    fence_regs(o);
    wgmma_wait<1>();  // S(t) is done
    fence_regs(sacc);
    if (tid == 0) ptx::mbar_arrive(ptx::smem_addr(&empty_k[s]));  // K[t] is consumed: the slot can be refilled
    softmax(t, alpha);
    wgmma_wait<0>();  // P(t-1) V[t-1] is done: o and pf may change
    fence_regs(o);
    fence_regs(sacc);  // the new pf is packed from sacc only after this point
    if (tid == 0) ptx::mbar_arrive(ptx::smem_addr(&empty_v[sp]));
    rescale_and_pack(alpha);
  };
  auto last_pv = [&](auto half) {  // P(n_tiles-1) V[n_tiles-1]
    const int sl = (n_tiles - 1) % kStages;
    ptx::mbar_wait(ptx::smem_addr(&full_v[sl]), ((n_tiles - 1) / kStages) & 1);
    my_turn();
    issue_pv(n_tiles - 1, half);
    wgmma_commit();
    your_turn();
    wgmma_wait<0>();
    fence_regs(o);
    if (tid == 0) ptx::mbar_arrive(ptx::smem_addr(&empty_v[sl]));
  };
  if (n_tiles > 0) {
    if (c == 1) your_turn();  // consumer 0 goes first
    first();
    for (int t = 1; t < n_tiles - last_is_half; ++t) step(t, kFull);
    if constexpr (CAUSAL && D == 128) {  // the only kernels with half tiles
      if (last_is_half) {
        step(n_tiles - 1, kHalf);
        last_pv(kHalf);
      } else {
        last_pv(kFull);
      }
    } else {
      last_pv(kFull);
    }
  }

  // Epilogue: normalise by the row sums, convert, store the rows inside the sequence.
  T* o_base = reinterpret_cast<T*>(p.o) + b * p.o_bs + head * p.o_hs;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float l = l_run[h];
    l += __shfl_xor_sync(0xffffffff, l, 1);
    l += __shfl_xor_sync(0xffffffff, l, 2);
    const float inv = l > 0.f ? 1.f / l : 0.f;  // a row that sees no key gets zeros
    const int row = row0 + 8 * h;
    if (row >= p.seq_q) continue;
    T* orow = o_base + int64_t(row) * p.o_ss;
#pragma unroll
    for (int j = 0; j < D / 8; ++j)
      *reinterpret_cast<uint32_t*>(orow + 8 * j + 2 * t4) = pack2<T>(o[4 * j + 2 * h] * inv, o[4 * j + 2 * h + 1] * inv);
  }
#else
  __trap();  // built without sm_90a; the dispatcher only launches this on compute capability 9.x
#endif
}

template <typename T, int D, bool CAUSAL>
bool launch(const FlashParams& p, int batch, int heads, cudaStream_t stream) {
  constexpr int kBN = block_n<D>();
  const int kv_heads = heads / p.group;
  CUtensorMap tm_q, tm_k, tm_v;
  if (!sm90::make_rows_map<T>(&tm_q, p.q, D, heads, p.seq_q, batch, p.q_hs, p.q_ss, p.q_bs, kBM) ||
      !sm90::make_rows_map<T>(&tm_k, p.k, D, kv_heads, p.seq_k, batch, p.k_hs, p.k_ss, p.k_bs, kBN) ||
      !sm90::make_rows_map<T>(&tm_v, p.v, D, kv_heads, p.seq_k, batch, p.v_hs, p.v_ss, p.v_bs, kBN))
    return false;
  constexpr auto kernel = flash_prefill_sm90_kernel<T, D, CAUSAL>;
  allow_smem<kernel, smem_bytes<D>()>();
  const dim3 grid(heads, (p.seq_q + kBM - 1) / kBM, batch);
  kernel<<<grid, kThreads, smem_bytes<D>(), stream>>>(tm_q, tm_k, tm_v, p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return true;
}

bool is_hopper() {
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  return cc_major(device) == 9;
}

}  // namespace

bool flash_prefill_sm90(const FlashParams& p, at::ScalarType dtype, int head_dim, bool causal, int batch, int heads,
                        cudaStream_t stream) {
  if (p.cu_seqlens_q != nullptr || p.paged.block_table != nullptr) return false;  // ragged / paged: sm80 kernel
  if (dtype != at::kHalf && dtype != at::kBFloat16) return false;
  if (!is_aligned16(p.q) || !is_aligned16(p.k) || !is_aligned16(p.v)) return false;
  if ((p.seq_q + kBM - 1) / kBM > 65535 || batch > 65535) return false;
  if (!is_hopper()) return false;
  return MINFER_DISPATCH_HALF(dtype, "flash prefill", [&] {
    return MINFER_DISPATCH_HEAD_DIM(head_dim, D, [&] {
      return causal ? launch<scalar_t, D, true>(p, batch, heads, stream)
                    : launch<scalar_t, D, false>(p, batch, heads, stream);
    });
  });
}

}  // namespace minfer::attn
