// sm_80+ tensor-core GEMM: mma.sync + ldmatrix + a 4-stage cp.async pipeline. The fallback for any
// M, N, K (K % 8 == 0 for 16-bit types, K % 16 == 0 for int8; 16-byte aligned rows).
//
// Block tile BM x 128 x 64 bytes of K (32 halves / 64 int8), 8 warps as 2 (M) x 4 (N), each warp
// (BM/2) x 32. Shared tiles are rows of 4 16-byte chunks; chunk c of row r lives at slot
// c ^ ((r >> 1) & 3), so the 8 rows an ldmatrix phase reads hit 8 distinct 16-byte bank groups.
// Out-of-range rows and K chunks are zero-filled by cp.async (src-size 0); the epilogue bounds-checks.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <algorithm>
#include <type_traits>

#include <c10/cuda/CUDAException.h>

#include "gemm/epilogue.h"
#include "common/launch.h"
#include "common/ptx.cuh"

namespace minfer::gemm_impl {
namespace {

using namespace ::minfer::ptx;

constexpr int kBN = 128, kStages = 4, kThreads = 256;
constexpr int kRowBytes = 64;  // one tile row: 4 chunks of 16 bytes

__device__ __forceinline__ int swz(int r, int c) { return r * 4 + (c ^ ((r >> 1) & 3)); }  // chunk slot

// Split-K: block z of gridDim.z covers K tiles [z * tiles_per_split, ...) and, when ws is set, writes
// raw fp32 partial sums to ws[z][M][N] for splitk_reduce_kernel to finish.
template <typename T, typename Out, typename Acc, int BM>
__global__ void __launch_bounds__(kThreads) mma_sm80_kernel(const Params<T, Out> p, float* ws, int tiles_per_split) {
  constexpr int kElemsPerChunk = 16 / sizeof(T);
  constexpr int kBK = 4 * kElemsPerChunk;             // K elements per tile
  constexpr int kStageBytes = (BM + kBN) * kRowBytes;  // A tile then B tile
  constexpr int MI = BM / 32, NI = 4;                  // 16-row and 8-col mma tiles per warp
  extern __shared__ __align__(128) uint8_t smem[];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp >> 2, wn = warp & 3;
  // blockIdx.x walks M fastest: consecutive blocks share one W tile while the (smaller) activation
  // panel stays in L2, so W is streamed from DRAM about once.
  const int m0 = blockIdx.x * BM, n0 = blockIdx.y * kBN;
  const int total_k = (p.K + kBK - 1) / kBK;
  const int kt_begin = blockIdx.z * tiles_per_split;
  const int num_k = max(0, min(total_k - kt_begin, tiles_per_split));
  const uint32_t smem_base = smem_addr(smem);

  auto load_tile = [&](int stage, int kt) {
    const uint32_t sa = smem_base + stage * kStageBytes, sb = sa + BM * kRowBytes;
    const int k0 = (kt_begin + kt) * kBK;
#pragma unroll
    for (int i = 0; i < BM * 4 / kThreads; ++i) {
      const int id = tid + i * kThreads, r = id >> 2, c = id & 3;
      const int m = m0 + r, k = k0 + c * kElemsPerChunk;
      const bool ok = m < p.M && k < p.K;  // K % chunk == 0: a chunk is all in or all out
      const T* src = ok ? p.A + (int64_t)m * p.sam + k : p.A;
      cp_async16(sa + swz(r, c) * 16, src, ok ? 16 : 0);
    }
#pragma unroll
    for (int i = 0; i < kBN * 4 / kThreads; ++i) {
      const int id = tid + i * kThreads, r = id >> 2, c = id & 3;
      const int n = n0 + r, k = k0 + c * kElemsPerChunk;
      const bool ok = n < p.N && k < p.K;
      const T* src = ok ? p.B + (int64_t)n * p.sbn + k : p.B;
      cp_async16(sb + swz(r, c) * 16, src, ok ? 16 : 0);
    }
  };

  Acc acc[MI][NI][4];
#pragma unroll
  for (int i = 0; i < MI; ++i)
#pragma unroll
    for (int j = 0; j < NI; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = Acc(0);

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < num_k) load_tile(s, s);
    cp_async_commit();  // empty groups keep the wait count uniform
  }

  for (int kt = 0; kt < num_k; ++kt) {
    cp_async_wait<kStages - 2>();  // tile kt has landed (this thread's copies)
    __syncthreads();               // ... everyone's; and everyone is done reading tile kt - 1
    const int next = kt + kStages - 1;
    if (next < num_k) load_tile(next % kStages, next);  // refills the stage read at kt - 1
    cp_async_commit();

    const uint32_t sa = smem_base + (kt % kStages) * kStageBytes, sb = sa + BM * kRowBytes;
#pragma unroll
    for (int ks = 0; ks < 2; ++ks) {  // two mma k-steps (2 chunks each) per tile
      uint32_t a[MI][4], b[NI][2];
#pragma unroll
      for (int i = 0; i < MI; ++i) {
        const int r = wm * (BM / 2) + i * 16 + (lane & 15);
        ldmatrix_x4(a[i], sa + swz(r, ks * 2 + (lane >> 4)) * 16);
      }
#pragma unroll
      for (int j = 0; j < NI / 2; ++j) {
        const int r = wn * 32 + j * 16 + (lane & 7) + ((lane >> 4) << 3);
        uint32_t t[4];
        ldmatrix_x4(t, sb + swz(r, ks * 2 + ((lane >> 3) & 1)) * 16);
        b[2 * j][0] = t[0];
        b[2 * j][1] = t[1];
        b[2 * j + 1][0] = t[2];
        b[2 * j + 1][1] = t[3];
      }
#pragma unroll
      for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < NI; ++j) {
          if constexpr (std::is_same_v<T, int8_t>) mma_m16n8k32_s8(acc[i][j], a[i], b[j]);
          else mma_m16n8k16<T>(acc[i][j], a[i], b[j]);
        }
    }
  }
  cp_async_wait<0>();

  const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int i = 0; i < MI; ++i)
#pragma unroll
    for (int j = 0; j < NI; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // registers 2h, 2h + 1: row g + 8h, columns n, n + 1
        const int m = m0 + wm * (BM / 2) + i * 16 + g + h * 8;
        const int n = n0 + wn * 32 + j * 8 + t4 * 2;
        if (m >= p.M) continue;
        if constexpr (std::is_same_v<Acc, float>) {
          if (ws) {
            float* row = ws + ((int64_t)blockIdx.z * p.M + m) * p.N;
            if (n < p.N) row[n] = acc[i][j][2 * h];
            if (n + 1 < p.N) row[n + 1] = acc[i][j][2 * h + 1];
          } else {
            store_out2(p, m, n, acc[i][j][2 * h], acc[i][j][2 * h + 1]);
          }
        } else {
          if (n < p.N) store_out(p, m, n, acc[i][j][2 * h]);
          if (n + 1 < p.N) store_out(p, m, n + 1, acc[i][j][2 * h + 1]);
        }
      }
}

template <typename T>
__global__ void splitk_reduce_kernel(const Params<T, T> p, const float* __restrict__ ws, int splits) {
  const int64_t total = (int64_t)p.M * p.N;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
    float s = 0.f;
    for (int z = 0; z < splits; ++z) s += ws[z * total + i];
    store_out(p, (int)(i / p.N), (int)(i % p.N), s);
  }
}

template <typename T, typename Out, typename Acc, int BM>
void launch(const Params<T, Out>& p, cudaStream_t stream, float* ws, int splits) {
  constexpr int smem = kStages * (BM + kBN) * kRowBytes;
  constexpr auto kernel = mma_sm80_kernel<T, Out, Acc, BM>;
  allow_smem<kernel, smem>();
  const int total_k = (p.K + 4 * (16 / (int)sizeof(T)) - 1) / (4 * (16 / (int)sizeof(T)));
  const int per_split = (total_k + splits - 1) / splits;
  const dim3 grid((p.M + BM - 1) / BM, (p.N + kBN - 1) / kBN, splits);
  kernel<<<grid, kThreads, smem, stream>>>(p, splits > 1 ? ws : nullptr, per_split);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

int sm80_split_k(int M, int N, int K, int sms) {
  const int bm = M <= 64 ? 64 : 128;
  const int64_t tiles = (int64_t)((M + bm - 1) / bm) * ((N + kBN - 1) / kBN);
  const int k_tiles = (K + 31) / 32;
  // Too few output tiles to fill the GPU (small M): split K so that about 2 blocks run per SM,
  // keeping at least 4 K tiles per split.
  if (tiles >= sms) return 1;
  int splits = (int)((2 * sms + tiles - 1) / tiles);
  splits = std::min(splits, std::max(1, k_tiles / 4));
  return std::max(1, std::min(splits, 16));
}

template <typename T>
void launch_sm80(const Params<T, T>& p, cudaStream_t s, float* ws, int splits) {
  if (p.M <= 64) launch<T, T, float, 64>(p, s, ws, splits);  // small M: half the wasted rows
  else launch<T, T, float, 128>(p, s, ws, splits);
  if (splits > 1) {
    const int64_t total = (int64_t)p.M * p.N;
    const int blocks = (int)std::min<int64_t>((total + 255) / 256, 4096);
    splitk_reduce_kernel<T><<<blocks, 256, 0, s>>>(p, ws, splits);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}
template void launch_sm80<__half>(const Params<__half, __half>&, cudaStream_t, float*, int);
template void launch_sm80<__nv_bfloat16>(const Params<__nv_bfloat16, __nv_bfloat16>&, cudaStream_t, float*, int);

void launch_sm80_int8(const Params<int8_t, int32_t>& p, cudaStream_t s) {
  if (p.M <= 64) launch<int8_t, int32_t, int, 64>(p, s, nullptr, 1);
  else launch<int8_t, int32_t, int, 128>(p, s, nullptr, 1);
}

}  // namespace minfer::gemm_impl
