// FlashAttention-2 style prefill on tensor cores (mma.sync m16n8k16, fp16/bf16, head_dim 64/128).
// One CTA owns BM = 64 query rows of one (batch, head); each of its 4 warps owns 16 rows and keeps
// their softmax state (max, sum) and output accumulator in fp32 registers. K/V tiles of BN = 64 keys
// stream through shared memory with cp.async: V[t] loads while S = Q K^T runs, K[t+1] while softmax
// and O += P V run. Scores are prescaled by scale * log2(e) so that exp2f does the softmax.
//
// One kernel serves both APIs (FlashParams says where each sequence's queries sit):
//   engine attention: queries at positions start_pos[b] + s, keys 0 .. start_pos[b] + s visible;
//   seed flash_attention: q_off = seq_k - seq_q (bottom-right causal) or no mask but the kv length.
// Memory is O(N): no score matrix exists outside registers.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cmath>

#include "attention/attention.h"
#include "attention/mma.cuh"
#include "common/vec.h"

namespace minfer::attn {

namespace {

constexpr int kBM = 64, kBN = 64, kThreads = 128;

// Copies rows [0, rows_valid) of a [ROWS, D] tile (row stride in elements) into swizzled shared memory;
// rows past rows_valid are zero-filled and never read. g must point at row 0, which must be valid.
template <typename T, int D, int ROWS>
__device__ __forceinline__ void load_tile(T* s, const T* g, int64_t row_stride, int rows_valid) {
  constexpr int CH = D / 8;
  for (int i = threadIdx.x; i < ROWS * CH; i += kThreads) {
    const int r = i / CH, c = i % CH;
    const bool ok = r < rows_valid;
    cp_async16(s + swz<D>(r, c), ok ? g + r * row_stride + c * 8 : g, ok);
  }
}

template <typename T, int D, bool CAUSAL>
__global__ void __launch_bounds__(kThreads) flash_prefill_kernel(const FlashParams p) {
  constexpr int KD = D / 16;   // k-steps of Q K^T
  constexpr int NT = kBN / 8;  // 8-wide score tiles per warp row block
  constexpr int DT = D / 8;    // 8-wide output tiles
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);  // [BM, D]
  T* sK = sQ + kBM * D;                    // [BN, D]
  T* sV = sK + kBN * D;                    // [BN, D]

  // Heaviest (last) query blocks first: causal blocks near the end see the most keys.
  const int m_block = gridDim.x - 1 - blockIdx.x;
  const int head = blockIdx.y, b = blockIdx.z;
  const int kvh = head / p.group;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int m_start = m_block * kBM;

  int q_off, kv_len;
  if (p.start_pos != nullptr) {
    q_off = p.start_pos[b];
    kv_len = min(q_off + p.seq_q, p.seq_k);  // seq_k is the cache capacity: never read past it
  } else {
    q_off = p.seq_k - p.seq_q;
    kv_len = p.seq_k;
  }
  // Keys past kv_end are invisible to every row of this block.
  int kv_end = kv_len;
  if (CAUSAL) kv_end = min(kv_len, q_off + min(m_start + kBM, p.seq_q));
  const int n_tiles = kv_end > 0 ? (kv_end + kBN - 1) / kBN : 0;

  T* o_base = reinterpret_cast<T*>(p.o) + b * p.o_bs + head * p.o_hs;
  const int r0 = m_start + warp * 16 + lane / 4;  // this thread's two rows: r0 and r0 + 8

  const T* qg = reinterpret_cast<const T*>(p.q) + b * p.q_bs + head * p.q_hs + m_start * p.q_ss;
  const T* kg = reinterpret_cast<const T*>(p.k) + b * p.k_bs + kvh * p.k_hs;
  const T* vg = reinterpret_cast<const T*>(p.v) + b * p.v_bs + kvh * p.v_hs;

  load_tile<T, D, kBM>(sQ, qg, p.q_ss, p.seq_q - m_start);
  cp_async_commit();
  if (n_tiles > 0) load_tile<T, D, kBN>(sK, kg, p.k_ss, kv_end);
  cp_async_commit();
  cp_async_wait<1>();  // Q has landed (K[0] may still be in flight)
  __syncthreads();

  uint32_t qf[KD][4];
#pragma unroll
  for (int kk = 0; kk < KD; ++kk)
    ldsm_x4(qf[kk], sQ + swz<D>(warp * 16 + (lane % 8) + ((lane / 8) % 2) * 8, kk * 2 + lane / 16));

  float acc[DT][4];
#pragma unroll
  for (int i = 0; i < DT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  float m_row[2] = {-INFINITY, -INFINITY}, l_row[2] = {0.f, 0.f};
  const int pos0 = q_off + r0, pos1 = pos0 + 8;  // positions of this thread's two query rows

  for (int t = 0; t < n_tiles; ++t) {
    const int n_start = t * kBN;
    load_tile<T, D, kBN>(sV, vg + n_start * p.v_ss, p.v_ss, kv_end - n_start);
    cp_async_commit();
    cp_async_wait<1>();  // K[t] has landed
    __syncthreads();

    float s[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KD; ++kk) {
#pragma unroll
      for (int nn = 0; nn < NT / 2; ++nn) {
        uint32_t bf[4];
        ldsm_x4(bf, sK + swz<D>(nn * 16 + (lane % 8) + (lane / 16) * 8, kk * 2 + (lane / 8) % 2));
        mma_16816<T>(s[2 * nn], qf[kk], bf[0], bf[1]);
        mma_16816<T>(s[2 * nn + 1], qf[kk], bf[2], bf[3]);
      }
    }
    __syncthreads();  // every warp is done with sK: it can be refilled
    if (t + 1 < n_tiles) load_tile<T, D, kBN>(sK, kg + (n_start + kBN) * p.k_ss, p.k_ss, kv_end - n_start - kBN);
    cp_async_commit();  // (possibly empty group: keeps the wait counts uniform)

    // Mask only the tiles that cross the kv length or the diagonal.
    const bool need_mask = n_start + kBN > kv_len || (CAUSAL && n_start + kBN - 1 > q_off + m_start);
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = s[j][e] * p.scale_log2;
        if (need_mask) {
          const int col = n_start + j * 8 + (lane % 4) * 2 + (e & 1);
          const int pos = e < 2 ? pos0 : pos1;
          if (col >= kv_len || (CAUSAL && col > pos)) x = -INFINITY;
        }
        s[j][e] = x;
        mx[e / 2] = fmaxf(mx[e / 2], x);
      }
    }
    float alpha[2], base[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffff, mx[h], 1));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffff, mx[h], 2));
      const float m_new = fmaxf(m_row[h], mx[h]);
      base[h] = m_new == -INFINITY ? 0.f : m_new;  // a row with nothing visible yet: avoid inf - inf
      alpha[h] = exp2f(m_row[h] - base[h]);
      m_row[h] = m_new;
      l_row[h] *= alpha[h];
    }
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[j][e] = exp2f(s[j][e] - base[e / 2]);
        l_row[e / 2] += s[j][e];  // this thread's columns only; the quad is summed at the end
      }
    }
#pragma unroll
    for (int i = 0; i < DT; ++i) {
      acc[i][0] *= alpha[0], acc[i][1] *= alpha[0];
      acc[i][2] *= alpha[1], acc[i][3] *= alpha[1];
    }

    cp_async_wait<1>();  // V[t] has landed (K[t+1] may still be in flight)
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk) {
      // The C fragments of score tiles 2kk and 2kk+1 are exactly the A fragment of P for this k-step.
      const uint32_t pf[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]), pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                              pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                              pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int dd = 0; dd < DT / 2; ++dd) {
        uint32_t vf[4];
        ldsm_x4_trans(vf, sV + swz<D>(kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8, dd * 2 + lane / 16));
        mma_16816<T>(acc[2 * dd], pf, vf[0], vf[1]);
        mma_16816<T>(acc[2 * dd + 1], pf, vf[2], vf[3]);
      }
    }
    __syncthreads();  // every warp is done with sV: it can be refilled
  }
  cp_async_wait<0>();

  float inv[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float l = l_row[h];
    l += __shfl_xor_sync(0xffffffff, l, 1);
    l += __shfl_xor_sync(0xffffffff, l, 2);
    inv[h] = l > 0.f ? 1.f / l : 0.f;  // a row that sees no key gets zeros
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = r0 + h * 8;
    if (row >= p.seq_q) continue;
    T* orow = o_base + row * p.o_ss;
#pragma unroll
    for (int i = 0; i < DT; ++i) {
      const uint32_t v = pack2<T>(acc[i][2 * h] * inv[h], acc[i][2 * h + 1] * inv[h]);
      *reinterpret_cast<uint32_t*>(orow + i * 8 + (lane % 4) * 2) = v;
    }
  }
}

template <typename T, int D, bool CAUSAL>
void launch(const FlashParams& p, int batch, int heads, cudaStream_t stream) {
  constexpr int smem = 3 * kBM * D * sizeof(T);  // Q + K + V tiles (kBM == kBN)
  static_assert(kBM == kBN, "smem size assumes square tiles");
  auto kernel = flash_prefill_kernel<T, D, CAUSAL>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const dim3 grid((p.seq_q + kBM - 1) / kBM, heads, batch);
  kernel<<<grid, kThreads, smem, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void flash_prefill(const FlashParams& p, at::ScalarType dtype, int head_dim, bool causal, int batch, int heads,
                   cudaStream_t stream) {
  if (p.seq_q == 0 || batch == 0 || heads == 0) return;
  auto go = [&](auto t_tag, auto d_tag) {
    using T = decltype(t_tag);
    constexpr int D = decltype(d_tag)::value;
    if (causal) launch<T, D, true>(p, batch, heads, stream);
    else launch<T, D, false>(p, batch, heads, stream);
  };
  auto by_dim = [&](auto t_tag) {
    if (head_dim == 64) go(t_tag, std::integral_constant<int, 64>{});
    else if (head_dim == 128) go(t_tag, std::integral_constant<int, 128>{});
    else TORCH_CHECK(false, "flash prefill: head_dim must be 64 or 128, got ", head_dim);
  };
  if (dtype == at::kHalf) by_dim(__half{});
  else if (dtype == at::kBFloat16) by_dim(__nv_bfloat16{});
  else TORCH_CHECK(false, "flash prefill: dtype must be float16 or bfloat16, got ", dtype);
}

}  // namespace minfer::attn
