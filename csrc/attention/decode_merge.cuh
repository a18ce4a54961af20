// The split-KV decode kernel's merges, all by log-sum-exp (SoftmaxState): the CTA's 4 warps through shared
// memory, then, where a sequence has several active splits, the splits through a workspace of partials
// (max, sum, unnormalised O) in global memory. Each CTA writes its partial and bumps a per-(batch, kv
// block) counter; the CTA that arrives last merges all partials (from L2, or copied into shared memory),
// or, spread, releases the others to merge a slice each; the last arrival resets the counter to zero, so
// the counters are zero again after every launch (CUDA-graph replay included). merge_of picks the kind.
// A thread handles (row, 4 dims) items of the pair's outputs.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

#include "attention/decode_params.h"
#include "attention/decode_plan.h"
#include "attention/mma.cuh"
#include "attention/softmax.cuh"
#include "common/ptx.cuh"

namespace minfer::attn::decode {

template <typename T>
__device__ __forceinline__ void store4(T* dst, float4 x) {  // 4 elements, 8-byte aligned
  uint2 u;
  u.x = pack2<T>(x.x, x.y);
  u.y = pack2<T>(x.z, x.w);
  *reinterpret_cast<uint2*>(dst) = u;
}

// Float row stride of a warp's partial O in its ring (conflict-free float2 stores).
template <int D>
constexpr int kWarpOStride = D + 8;

// A warp's partial into shared memory: O [16][kWarpOStride] floats into its own ring (so), max and sum of
// row r at s_m[warp][r], s_l[warp][r]. acc, m_row and l_row as Heads keeps them; the quad sums its row sums
// here.
template <int D>
__device__ __forceinline__ void write_warp_partial(float* so, float (*s_m)[kRows], float (*s_l)[kRows],
                                                   const float (&acc)[D / 8][4], const float (&m_row)[2],
                                                   float (&l_row)[2], int warp, int g, int t) {
  constexpr int OS = kWarpOStride<D>;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l_row[h] += __shfl_xor_sync(0xffffffff, l_row[h], 1);
    l_row[h] += __shfl_xor_sync(0xffffffff, l_row[h], 2);
  }
#pragma unroll
  for (int d = 0; d < D / 8; ++d) {
    *reinterpret_cast<float2*>(so + g * OS + d * 8 + 2 * t) = make_float2(acc[d][0], acc[d][1]);
    *reinterpret_cast<float2*>(so + (g + 8) * OS + d * 8 + 2 * t) = make_float2(acc[d][2], acc[d][3]);
  }
  if (t == 0) {
    s_m[warp][g] = m_row[0], s_m[warp][g + 8] = m_row[1];
    s_l[warp][g] = l_row[0], s_l[warp][g + 8] = l_row[1];
  }
}

// Where the splits of this CTA's (batch, kv block) pair meet: their partials in the workspace from slot0
// (split s of row h at (slot0 + s) * p.rows + h), the pair's output rows at `out`, items (row, 4 dims) of it.
template <typename T>
struct PairOut {
  int64_t pair, slot0;
  T* out;  // [rows][D]
  int items;
};

// The warps' partials merged (a thread per item; idle warps have max -inf and weigh 0) into the output
// (one active split) or into this split's partial in the workspace. smem holds the warps' rings, RING bytes each.
template <typename T, int D, int RING>
__device__ __forceinline__ void merge_warps(const DecodeParams& p, const PairOut<T>& po, const unsigned char* smem,
                                            const float (*s_m)[kRows], const float (*s_l)[kRows], int split,
                                            int n_active, int tid) {
  for (int qi = tid; qi < po.items; qi += kThreads) {
    const int h = qi / (D / 4), d = (qi % (D / 4)) * 4;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, s_m[w][h]);
    SoftmaxState s{mx == -INFINITY ? 0.f : mx, 0.f};  // no key at all (len 0): avoid inf - inf
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float wt = s.weight(s_m[w][h]);
      s.add(s_l[w][h], wt);
      fma4(o, *reinterpret_cast<const float4*>(reinterpret_cast<const float*>(smem + w * RING) +
                                               h * kWarpOStride<D> + d),
           wt);
    }
    if (n_active == 1) {
      store4(po.out + h * D + d, scale4(o, s.l > 0.f ? 1.f / s.l : 0.f));
    } else {
      const int64_t r = (po.slot0 + split) * p.rows + h;
      *reinterpret_cast<float4*>(p.ws_o + r * D + d) = o;
      if (d == 0) p.ws_ml[r] = make_float4(mx, s.l, 0.f, 0.f);
    }
  }
}

// Counts this CTA's arrival at the pair (its partial is written) and returns, through s_last, whether
// it arrived last. One acquire-release atomic by thread 0 between two CTA barriers: the barrier before
// orders the CTA's partial stores ahead of its release, the one after orders the reads behind its
// acquire (two __threadfence around a relaxed atomicAdd cost 0.25-0.35 us more at batch 1). The last
// arrival resets the count to zero for the next launch; spread, it does so with a release store, and the
// others wait with acquire loads for the count to read zero: after their own arrival it is at least one
// until then, and no later launch can touch it before this grid ends.
__device__ __forceinline__ void arrive(const DecodeParams& p, int64_t pair, int n_active, bool spread, int tid,
                                       int& s_last) {
  __syncthreads();
  if (tid == 0) {
    int* count = p.counters + pair;
    const int prev = ptx::atom_add_acq_rel_gpu<1>(count);
    s_last = prev == n_active - 1;
    if (s_last) {  // every split has arrived
      if (spread) ptx::st_release_gpu<0>(count);
      else *count = 0;  // nobody waits on it in this launch
    } else if (spread) {
      // Every split of the pair is resident (all_resident), so this ends; a bug would hang, so after
      // ~2^28 polls (minutes) the kernel traps instead.
      for (int c = 1, polls = 0; c != 0; ++polls) {
        if (polls == (1 << 28)) __trap();
        c = ptx::ld_acquire_gpu(count);
      }
    }
  }
  __syncthreads();
}

// Spread: split `split` merges items [split * per, + per) of the pair from every split; its threads are
// `groups` groups of `per`, a group taking every groups-th split, and the groups meet in shared memory
// (smem: the rings are free).
template <typename T, int D>
__device__ __forceinline__ void merge_spread(const DecodeParams& p, const PairOut<T>& po, unsigned char* smem,
                                             int split, int n_active, int tid) {
  const int per = (po.items + n_active - 1) / n_active, groups = kThreads / per;
  const int li = tid % per, sg = tid / per, qi = split * per + li;
  float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
  SoftmaxState s{-INFINITY, 0.f};
  if (sg < groups && qi < po.items) {
    const int h = qi / (D / 4), d = (qi % (D / 4)) * 4;
    const float4* ml_src = p.ws_ml + po.slot0 * p.rows + h;
    const float* o_src = p.ws_o + (po.slot0 * p.rows + h) * D + d;
#pragma unroll 4
    for (int sp = sg; sp < n_active; sp += groups) {
      const float4 ml[1] = {__ldcg(ml_src + sp * p.rows)};
      const float4 os[1] = {__ldcg(reinterpret_cast<const float4*>(o_src + static_cast<int64_t>(sp) * p.rows * D))};
      fold(s, o, ml, os);
    }
  }
  float4* g_o = reinterpret_cast<float4*>(smem);  // [groups][per]
  float2* g_ml = reinterpret_cast<float2*>(g_o + kThreads);
  if (sg < groups) g_o[tid] = o, g_ml[tid] = make_float2(s.m, s.l);
  __syncthreads();
  if (sg == 0 && qi < po.items) {
    const int h = qi / (D / 4), d = (qi % (D / 4)) * 4;
    float m = -INFINITY;
    for (int gi = 0; gi < groups; ++gi) m = fmaxf(m, g_ml[gi * per + li].x);  // finite: group 0 has split 0
    SoftmaxState total{m, 0.f};
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int gi = 0; gi < groups; ++gi) {
      const float w = total.weight(g_ml[gi * per + li].x);  // 0 for a group without splits
      total.add(g_ml[gi * per + li].y, w);
      fma4(acc, g_o[gi * per + li], w);
    }
    store4(po.out + h * D + d, scale4(acc, 1.f / total.l));
  }
}

// The last CTA merges in shared memory (smem): the pair's partials (contiguous in the workspace) copied in
// by every thread's cp.async, one round trip.
template <typename T, int D>
__device__ __forceinline__ void merge_last_in_smem(const DecodeParams& p, const PairOut<T>& po, unsigned char* smem,
                                                   int n_active, int tid) {
  constexpr int QPT = kRows * (D / 4) / kThreads;  // items per thread at most
  float* s_o = reinterpret_cast<float*>(smem);     // [n_active][rows][D]
  float4* s_ml = reinterpret_cast<float4*>(s_o + n_active * p.rows * D);  // [n_active][rows]
  const float* src_o = p.ws_o + po.slot0 * p.rows * D;
  const float4* src_ml = p.ws_ml + po.slot0 * p.rows;
  for (int i = tid; i < n_active * p.rows * (D / 4); i += kThreads) ptx::cp_async16(s_o + 4 * i, src_o + 4 * i, true);
  for (int i = tid; i < n_active * p.rows; i += kThreads) ptx::cp_async16(s_ml + i, src_ml + i, true);
  ptx::cp_async_commit();
  ptx::cp_async_wait<0>();
  __syncthreads();
#pragma unroll
  for (int j = 0; j < QPT; ++j) {
    const int qi = tid + j * kThreads;
    if (qi < po.items) {
      const int h = qi / (D / 4), d = (qi % (D / 4)) * 4;
      float mx = -INFINITY;  // the max first: the weights below are then independent of each other
      for (int sp = 0; sp < n_active; ++sp) mx = fmaxf(mx, s_ml[sp * p.rows + h].x);  // finite: no split is empty
      SoftmaxState s{mx, 0.f};
      float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
      for (int sp = 0; sp < n_active; ++sp) {
        const float4 ml = s_ml[sp * p.rows + h];
        const float w = s.weight(ml.x);
        s.add(ml.y, w);
        fma4(o, *reinterpret_cast<const float4*>(s_o + (sp * p.rows + h) * D + d), w);
      }
      store4(po.out + h * D + d, scale4(o, 1.f / s.l));
    }
  }
}

// The last CTA merges from L2 (ld.global.cg), in whole rounds of kMergeUnroll splits, the loads past
// n_active predicated off (they fold with weight 0), so every load of a round is in flight at once: a loop
// unrolled over the count itself ran its remainder as load, fold, next load, one L2 round trip a split
// (H100, 1 x 448 keys, 14 splits: 6.66 -> 4.24 us this way).
template <typename T, int D>
__device__ __forceinline__ void merge_last_from_l2(const DecodeParams& p, const PairOut<T>& po, int n_active, int tid) {
  for (int qi = tid; qi < po.items; qi += kThreads) {
    const int h = qi / (D / 4), d = (qi % (D / 4)) * 4;
    const float4* ml_src = p.ws_ml + po.slot0 * p.rows + h;
    const float* o_src = p.ws_o + (po.slot0 * p.rows + h) * D + d;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
    SoftmaxState s{-INFINITY, 0.f};
    for (int s0 = 0; s0 < n_active; s0 += kMergeUnroll) {
      float4 ml[kMergeUnroll], os[kMergeUnroll];
#pragma unroll
      for (int i = 0; i < kMergeUnroll; ++i) {
        const int sp = s0 + i;
        const bool live = sp < n_active;
        ml[i] = ptx::ld_cg_v4f32_if(ml_src + sp * p.rows, live, make_float4(-INFINITY, 0.f, 0.f, 0.f));
        os[i] = ptx::ld_cg_v4f32_if(reinterpret_cast<const float4*>(o_src + static_cast<int64_t>(sp) * p.rows * D),
                                    live, make_float4(0.f, 0.f, 0.f, 0.f));
      }
      fold(s, o, ml, os);  // split s0 is live
    }
    store4(po.out + h * D + d, scale4(o, s.l > 0.f ? 1.f / s.l : 0.f));
  }
}

}  // namespace minfer::attn::decode
