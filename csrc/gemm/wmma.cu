// WMMA baseline (nvcuda::wmma), simply tiled: 64 x 64 x 32 block tile, 4 warps of 32 x 32.
// Loads are scalar and bounds-checked with arbitrary strides, so this path takes any shape,
// stride and alignment: it is also the fallback when the cp.async paths' alignment rules fail.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#include <c10/cuda/CUDAException.h>

#include "gemm/epilogue.h"

namespace minfer::gemm_impl {
namespace {

constexpr int kBM = 64, kBN = 64, kBK = 32, kThreads = 128;
constexpr int kLd = kBK + 8;   // halves; a multiple of 8 as wmma requires, and staggers banks
constexpr int kLdc = kBN + 4;  // floats

template <typename T, typename Out>
__global__ void __launch_bounds__(kThreads) wmma_kernel(const Params<T, Out> p) {
  using namespace nvcuda;
  __shared__ __align__(32) T As[kBM][kLd];  // [m][k]
  __shared__ __align__(32) T Bs[kBN][kLd];  // [n][k]: B as a col-major K x N operand
  __shared__ __align__(32) float Cs[kBM][kLdc];

  const int tid = threadIdx.x, warp = tid >> 5;
  const int wm = warp >> 1, wn = warp & 1;
  const int m0 = blockIdx.y * kBM, n0 = blockIdx.x * kBN;
  // Walk the contiguous direction of each operand fastest, so global reads coalesce.
  const bool a_k_fast = p.sak == 1, b_k_fast = p.sbk == 1;

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.f);

  for (int k0 = 0; k0 < p.K; k0 += kBK) {
    for (int i = tid; i < kBM * kBK; i += kThreads) {
      const int r = a_k_fast ? i / kBK : i % kBM, kk = a_k_fast ? i % kBK : i / kBM;
      const int m = m0 + r, k = k0 + kk;
      As[r][kk] = (m < p.M && k < p.K) ? p.A[(int64_t)m * p.sam + (int64_t)k * p.sak] : from_float<T>(0.f);
    }
    for (int i = tid; i < kBN * kBK; i += kThreads) {
      const int r = b_k_fast ? i / kBK : i % kBN, kk = b_k_fast ? i % kBK : i / kBN;
      const int n = n0 + r, k = k0 + kk;
      Bs[r][kk] = (n < p.N && k < p.K) ? p.B[(int64_t)n * p.sbn + (int64_t)k * p.sbk] : from_float<T>(0.f);
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kBK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a[2];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> b[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) wmma::load_matrix_sync(a[i], &As[wm * 32 + i * 16][kk], kLd);
#pragma unroll
      for (int j = 0; j < 2; ++j) wmma::load_matrix_sync(b[j], &Bs[wn * 32 + j * 16][kk], kLd);
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], a[i], b[j], acc[i][j]);
    }
    __syncthreads();  // the tiles are overwritten next iteration
  }

#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j)
      wmma::store_matrix_sync(&Cs[wm * 32 + i * 16][wn * 32 + j * 16], acc[i][j], kLdc, wmma::mem_row_major);
  __syncthreads();
  for (int i = tid; i < kBM * kBN; i += kThreads) {
    const int r = i / kBN, c = i % kBN, m = m0 + r, n = n0 + c;
    if (m < p.M && n < p.N) store_out(p, m, n, Cs[r][c]);
  }
}

}  // namespace

template <typename T, typename Out>
void launch_wmma(const Params<T, Out>& p, cudaStream_t stream) {
  const dim3 grid((p.N + kBN - 1) / kBN, (p.M + kBM - 1) / kBM);
  wmma_kernel<T, Out><<<grid, kThreads, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
template void launch_wmma<__half, __half>(const Params<__half, __half>&, cudaStream_t);
template void launch_wmma<__half, float>(const Params<__half, float>&, cudaStream_t);
template void launch_wmma<__nv_bfloat16, __nv_bfloat16>(const Params<__nv_bfloat16, __nv_bfloat16>&, cudaStream_t);

}  // namespace minfer::gemm_impl
