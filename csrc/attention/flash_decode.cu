// Split-KV flash decode (one query per sequence). Decode reads every K/V byte once and does ~1 FLOP
// per byte, so it is bound by HBM bandwidth; the work is to keep enough loads in flight on every SM.
//
// Grid (split, q-head block, batch). A CTA owns HP q heads that share one kv head, so each K/V row
// is loaded once for all of them, and streams its split of the cache with 16-byte loads: a key row
// is read by LPK = head_dim / 8 lanes (8 elements each), a warp covers 32 / LPK keys per step and R
// steps per iteration (all loads issued before any math). Each warp keeps an online softmax state;
// the warps merge through shared memory. The number of splits comes from the capacity and the SM
// count (host side, no sync); each CTA divides the actual kv length (start_pos[b] + 1, read on the
// device) evenly, so splits past the end are empty and write (max -inf, sum 0). A second kernel
// merges the splits with log-sum-exp; with one split the first kernel writes the output itself.
#include "common/checks.h"
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cmath>

#include "attention/attention.h"
#include "common/vec.h"

namespace minfer::attn {

namespace {

constexpr int kThreads = 128, kWarps = kThreads / 32;
constexpr int kMinChunk = 64;  // fewest keys worth a split

struct DecodeParams {
  const void* q;  // q[b, h, :] at b*q_bs + h*q_hs
  const void* k;  // k[b, j, kvh, :] at b*k_bs + j*k_ss + kvh*k_hs
  const void* v;
  void* o;        // final output [batch, heads, D] (contiguous), written when num_splits == 1
  float* ws_o;    // [batch, heads, num_splits, D] unnormalised partial outputs
  float* ws_ml;   // [batch, heads, num_splits, 2] (max in log2 units, sum)
  const int* start_pos;
  int64_t q_bs, q_hs, k_bs, k_ss, k_hs, v_bs, v_ss, v_hs;
  int heads, group, capacity, num_splits;
  float scale_log2;
};

template <typename T, int D, int HP>
__global__ void __launch_bounds__(kThreads) flash_decode_kernel(const DecodeParams p) {
  constexpr int LPK = D / 8;               // lanes per key row
  constexpr int KPS = 32 / LPK;            // keys per warp step
  constexpr int R = HP >= 8 ? 4 : 8;       // steps per iteration (loads in flight per lane: 2R)
  constexpr int KPI = KPS * R;             // keys per warp iteration
  __shared__ float s_m[kWarps][HP], s_l[kWarps][HP];
  __shared__ float s_acc[kWarps][HP][D];

  const int split = blockIdx.x, hblk = blockIdx.y, b = blockIdx.z;
  const int head0 = hblk * HP, kvh = head0 / p.group;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int c = lane % LPK, kg = lane / LPK;  // this lane's 8-element chunk and key slot

  const int kv_len = max(0, min(p.start_pos[b] + 1, p.capacity));
  int chunk = (kv_len + p.num_splits - 1) / p.num_splits;
  chunk = max(kMinChunk, (chunk + 15) / 16 * 16);
  const int s0 = split * chunk, s1 = min(s0 + chunk, kv_len);  // this split's keys [s0, s1); may be empty

  float qr[HP][8];
#pragma unroll
  for (int h = 0; h < HP; ++h) {
    const T* qh = reinterpret_cast<const T*>(p.q) + b * p.q_bs + (head0 + h) * p.q_hs + c * 8;
#pragma unroll
    for (int e = 0; e < 8; ++e) qr[h][e] = to_float(qh[e]) * p.scale_log2;  // scores come out in log2 units
  }
  float m[HP], l[HP], acc[HP][8];
#pragma unroll
  for (int h = 0; h < HP; ++h) {
    m[h] = -INFINITY, l[h] = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[h][e] = 0.f;
  }

  const T* kb = reinterpret_cast<const T*>(p.k) + b * p.k_bs + kvh * p.k_hs + c * 8;
  const T* vb = reinterpret_cast<const T*>(p.v) + b * p.v_bs + kvh * p.v_hs + c * 8;
  for (int base = s0 + warp * KPI; base < s1; base += kWarps * KPI) {
    Vec<T> kr[R], vr[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int key = base + r * KPS + kg;
      if (key < s1) {
        kr[r].load(kb + key * p.k_ss);
        vr[r].load(vb + key * p.v_ss);
      } else {
#pragma unroll
        for (int e = 0; e < Vec<T>::N; ++e) kr[r].v[e] = vr[r].v[e] = from_float<T>(0.f);
      }
    }
    float sc[HP][R];
#pragma unroll
    for (int h = 0; h < HP; ++h) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        float dot = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) dot = fmaf(qr[h][e], to_float(kr[r].v[e]), dot);
#pragma unroll
        for (int off = 1; off < LPK; off <<= 1) dot += __shfl_xor_sync(0xffffffff, dot, off);
        sc[h][r] = base + r * KPS + kg < s1 ? dot : -INFINITY;
      }
    }
#pragma unroll
    for (int h = 0; h < HP; ++h) {
      float mx = sc[h][0];
#pragma unroll
      for (int r = 1; r < R; ++r) mx = fmaxf(mx, sc[h][r]);
#pragma unroll
      for (int off = LPK; off < 32; off <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, off));
      // mx is finite: key `base` (< s1) is in this iteration.
      const float m_new = fmaxf(m[h], mx);
      const float alpha = exp2f(m[h] - m_new);
      m[h] = m_new;
      l[h] *= alpha;
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[h][e] *= alpha;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float pr = exp2f(sc[h][r] - m_new);
        l[h] += pr;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[h][e] = fmaf(pr, to_float(vr[r].v[e]), acc[h][e]);
      }
    }
  }

  // Sum over the key slots of the warp (m is already uniform across the warp), then merge the warps.
#pragma unroll
  for (int h = 0; h < HP; ++h) {
#pragma unroll
    for (int off = LPK; off < 32; off <<= 1) {
      l[h] += __shfl_xor_sync(0xffffffff, l[h], off);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[h][e] += __shfl_xor_sync(0xffffffff, acc[h][e], off);
    }
    if (lane == 0) s_m[warp][h] = m[h], s_l[warp][h] = l[h];
    if (kg == 0) {
#pragma unroll
      for (int e = 0; e < 8; ++e) s_acc[warp][h][c * 8 + e] = acc[h][e];
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < HP * D; i += kThreads) {
    const int h = i / D, d = i % D;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, s_m[w][h]);
    float sum = 0.f, o = 0.f;
    if (mx != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float wt = exp2f(s_m[w][h] - mx);  // 0 for an idle warp (max -inf)
        sum += s_l[w][h] * wt;
        o += s_acc[w][h][d] * wt;
      }
    }
    const int64_t bh = static_cast<int64_t>(b) * p.heads + head0 + h;
    if (p.num_splits == 1) {
      reinterpret_cast<T*>(p.o)[bh * D + d] = from_float<T>(sum > 0.f ? o / sum : 0.f);
    } else {
      const int64_t slot = bh * p.num_splits + split;
      p.ws_o[slot * D + d] = o;
      if (d == 0) p.ws_ml[slot * 2] = mx, p.ws_ml[slot * 2 + 1] = sum;
    }
  }
}

// out[b, h, :] = sum_s exp2(m_s - M) acc_s / sum_s exp2(m_s - M) l_s over the non-empty splits.
// Grid: batch * heads; block: D threads.
template <typename T, int D>
__global__ void __launch_bounds__(D) flash_decode_combine_kernel(const float* __restrict__ ws_o,
                                                                 const float* __restrict__ ws_ml,
                                                                 T* __restrict__ out, int num_splits) {
  const int64_t bh = blockIdx.x;
  const int d = threadIdx.x;
  const float* ml = ws_ml + bh * num_splits * 2;
  float mx = -INFINITY;
  for (int s = 0; s < num_splits; ++s) mx = fmaxf(mx, ml[2 * s]);
  float sum = 0.f, o = 0.f;
  if (mx != -INFINITY) {
    for (int s = 0; s < num_splits; ++s) {
      const float ms = ml[2 * s];
      if (ms == -INFINITY) continue;  // empty split: its partial output is zeros but skip it anyway
      const float wt = exp2f(ms - mx);
      sum += ml[2 * s + 1] * wt;
      o += ws_o[(bh * num_splits + s) * D + d] * wt;
    }
  }
  out[bh * D + d] = from_float<T>(sum > 0.f ? o / sum : 0.f);
}

int sm_count(int device) {
  static int cached[64] = {0};
  if (device < 0 || device >= 64) return 132;
  if (cached[device] == 0) {
    int n = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
    cached[device] = n > 0 ? n : 132;
  }
  return cached[device];
}

template <typename T, int D, int HP>
void launch(DecodeParams p, int batch, const torch::Tensor& q, torch::Tensor& out, cudaStream_t stream) {
  const int ctas = batch * (p.heads / HP);
  // Enough CTAs to fill the GPU ~4 times over at batch 1; no split shorter than kMinChunk keys of the
  // capacity; a bounded workspace.
  int splits = (4 * sm_count(q.get_device()) + ctas - 1) / ctas;
  splits = std::min({splits, (p.capacity + kMinChunk - 1) / kMinChunk, 128});
  const int64_t per_split = static_cast<int64_t>(batch) * p.heads * (D + 2) * sizeof(float);
  splits = static_cast<int>(std::min<int64_t>(splits, (int64_t{256} << 20) / per_split));
  splits = std::max(splits, 1);
  p.num_splits = splits;
  torch::Tensor ws;
  if (splits > 1) {
    ws = torch::empty({static_cast<int64_t>(batch) * p.heads * splits * (D + 2)},
                      q.options().dtype(torch::kFloat32));
    p.ws_o = ws.data_ptr<float>();
    p.ws_ml = p.ws_o + static_cast<int64_t>(batch) * p.heads * splits * D;
  }
  const dim3 grid(splits, p.heads / HP, batch);
  flash_decode_kernel<T, D, HP><<<grid, kThreads, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (splits > 1) {
    flash_decode_combine_kernel<T, D><<<batch * p.heads, D, 0, stream>>>(
        p.ws_o, p.ws_ml, reinterpret_cast<T*>(out.data_ptr()), splits);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace

void flash_decode(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                  const torch::Tensor& start_pos, double scale, torch::Tensor& out) {
  const int batch = q.size(0), heads = q.size(2), head_dim = q.size(3);
  const int kv_heads = k_cache.size(2);
  DecodeParams p{};
  p.q = q.data_ptr(), p.k = k_cache.data_ptr(), p.v = v_cache.data_ptr(), p.o = out.data_ptr();
  p.start_pos = start_pos.data_ptr<int>();
  p.q_bs = q.stride(0), p.q_hs = q.stride(2);
  p.k_bs = k_cache.stride(0), p.k_ss = k_cache.stride(1), p.k_hs = k_cache.stride(2);
  p.v_bs = v_cache.stride(0), p.v_ss = v_cache.stride(1), p.v_hs = v_cache.stride(2);
  p.heads = heads, p.group = heads / kv_heads, p.capacity = k_cache.size(1);
  p.scale_log2 = static_cast<float>(scale) * kLog2e;
  if (batch == 0 || heads == 0) return;
  auto stream = c10::cuda::getCurrentCUDAStream();
  // HP: the most q heads of one group a CTA can share K/V loads across (1, 2, 4 or 8).
  const int hp = p.group % 8 == 0 ? 8 : p.group % 4 == 0 ? 4 : p.group % 2 == 0 ? 2 : 1;
  auto go = [&](auto t_tag, auto d_tag) {
    using T = decltype(t_tag);
    constexpr int D = decltype(d_tag)::value;
    switch (hp) {
      case 8: launch<T, D, 8>(p, batch, q, out, stream); break;
      case 4: launch<T, D, 4>(p, batch, q, out, stream); break;
      case 2: launch<T, D, 2>(p, batch, q, out, stream); break;
      default: launch<T, D, 1>(p, batch, q, out, stream); break;
    }
  };
  auto by_dim = [&](auto t_tag) {
    if (head_dim == 64) go(t_tag, std::integral_constant<int, 64>{});
    else if (head_dim == 128) go(t_tag, std::integral_constant<int, 128>{});
    else MINFER_CHECK(false, "attention: head_dim must be 64 or 128, got ", head_dim);
  };
  if (q.scalar_type() == at::kHalf) by_dim(__half{});
  else by_dim(__nv_bfloat16{});
}

}  // namespace minfer::attn
