// fp32 GEMM on the CUDA cores, register-tiled: 64 x 64 x 16 block tile, 256 threads each owning a
// 4 x 4 micro-tile (rows ty + 16 i, cols tx + 16 j, so shared reads are conflict-free). Scalar,
// bounds-checked loads with arbitrary strides: any shape, any transpose, no copies.
#include <c10/cuda/CUDAException.h>

#include "gemm/epilogue.h"

namespace minfer::gemm_impl {
namespace {

constexpr int kBM = 64, kBN = 64, kBK = 16, kThreads = 256;

__global__ void __launch_bounds__(kThreads) simt_kernel(const Params<float, float> p) {
  __shared__ float As[kBK][kBM + 4];  // k-major, so a thread's 4 rows are one row of As
  __shared__ float Bs[kBK][kBN + 4];
  const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
  const int m0 = blockIdx.y * kBM, n0 = blockIdx.x * kBN;
  const bool a_k_fast = p.sak == 1, b_k_fast = p.sbk == 1;

  float acc[4][4] = {};
  for (int k0 = 0; k0 < p.K; k0 += kBK) {
#pragma unroll
    for (int i = tid; i < kBM * kBK; i += kThreads) {
      const int r = a_k_fast ? i / kBK : i % kBM, kk = a_k_fast ? i % kBK : i / kBM;
      const int m = m0 + r, k = k0 + kk;
      As[kk][r] = (m < p.M && k < p.K) ? p.A[(int64_t)m * p.sam + (int64_t)k * p.sak] : 0.f;
    }
#pragma unroll
    for (int i = tid; i < kBN * kBK; i += kThreads) {
      const int r = b_k_fast ? i / kBK : i % kBN, kk = b_k_fast ? i % kBK : i / kBN;
      const int n = n0 + r, k = k0 + kk;
      Bs[kk][r] = (n < p.N && k < p.K) ? p.B[(int64_t)n * p.sbn + (int64_t)k * p.sbk] : 0.f;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kBK; ++kk) {
      float a[4], b[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = As[kk][ty + 16 * i];
#pragma unroll
      for (int j = 0; j < 4; ++j) b[j] = Bs[kk][tx + 16 * j];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int m = m0 + ty + 16 * i, n = n0 + tx + 16 * j;
      if (m < p.M && n < p.N) store_out(p, m, n, acc[i][j]);
    }
}

}  // namespace

void launch_simt(const Params<float, float>& p, cudaStream_t stream) {
  const dim3 grid((p.N + kBN - 1) / kBN, (p.M + kBM - 1) / kBM);
  simt_kernel<<<grid, kThreads, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace minfer::gemm_impl
