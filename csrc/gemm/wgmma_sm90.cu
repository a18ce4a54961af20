// sm_90a production path: wgmma (m64n128k16) fed by TMA (cp.async.bulk.tensor) through a 4-stage
// mbarrier pipeline, warp-specialized.
//
// Block tile 128 (M) x 128 (N) x 64 (K), 384 threads = 3 warpgroups: warpgroup 0 is the producer
// (one thread issues the TMA copies), warpgroups 1 and 2 each own 64 rows of the tile and run
// wgmma on shared-memory descriptors. TMA writes each 128 x 64 tile as rows of 128 bytes with the
// 128-byte swizzle (16-byte chunk c of row r stored at c ^ (r % 8)), which is exactly the K-major
// SWIZZLE_128B layout wgmma reads: core-matrix groups of 8 rows x 128 B, 1024 B apart (SBO).
// Advancing K by 16 elements inside the 64-wide tile is a +32 B start address.
// Out-of-bounds rows/columns are zero-filled by TMA; the epilogue stores with bounds checks.
// Requirements (checked by the dispatcher): K % 8 == 0, row strides % 8 == 0, 16-byte aligned bases.
#include "common/checks.h"
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <c10/cuda/CUDAException.h>
#include <torch/all.h>

#include <string>

#include "common/sm90.cuh"
#include "gemm/epilogue.h"
#include "gemm/ptx.h"

namespace minfer::gemm_impl {
namespace {

constexpr int kBM = 128, kBN = 128, kBK = 64, kStages = 4, kThreads = 384;
constexpr int kTileBytes = kBM * kBK * 2;  // A and B tiles are both 128 rows x 128 B = 16 KB
constexpr int kStageBytes = 2 * kTileBytes;
constexpr int kSmemBytes = kStages * kStageBytes + 1024;  // + slack to align the tiles to 1024 B

template <typename T>
__global__ void __launch_bounds__(kThreads, 1)
    wgmma_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                 const Params<T, T> p) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace sm90;
  extern __shared__ uint8_t smem_raw[];
  __shared__ __align__(8) uint64_t full[kStages], empty[kStages];
  const uint32_t base = (smem_addr(smem_raw) + 1023) & ~1023u;  // swizzled tiles need 1024 B alignment
  const int m0 = blockIdx.x * kBM, n0 = blockIdx.y * kBN;  // M fastest: W tiles are reused from L2
  const int num_k = (p.K + kBK - 1) / kBK;
  const int wg = threadIdx.x / 128, tid_wg = threadIdx.x % 128;

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(smem_addr(&full[s]), 1);   // the producer's expect_tx arrival (+ TMA bytes)
      mbar_init(smem_addr(&empty[s]), 2);  // one arrival per consumer warpgroup
    }
    mbar_init_fence();
  }
  __syncthreads();

  if (wg == 0) {  // producer
    if (tid_wg == 0) {
      for (int kt = 0; kt < num_k; ++kt) {
        const int s = kt % kStages;
        // First pass over the ring: parity 1 of a fresh barrier counts as complete.
        mbar_wait(smem_addr(&empty[s]), ((kt / kStages) & 1) ^ 1);
        const uint32_t bar = smem_addr(&full[s]);
        mbar_expect_tx(bar, kStageBytes);  // TMA counts the whole box, zero-filled parts too
        const uint32_t sa = base + s * kStageBytes;
        tma_load_2d(sa, &map_a, bar, kt * kBK, m0);
        tma_load_2d(sa + kTileBytes, &map_b, bar, kt * kBK, n0);
      }
    }
    return;
  }

  // consumers: warpgroup c = wg - 1 owns tile rows [64 c, 64 c + 64)
  const int c = wg - 1;
  float acc[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = 0.f;
  for (int kt = 0; kt < num_k; ++kt) {
    const int s = kt % kStages;
    mbar_wait(smem_addr(&full[s]), (kt / kStages) & 1);
    const uint32_t sa = base + s * kStageBytes + c * 64 * 128, sb = base + s * kStageBytes + kTileBytes;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBK / 16; ++kk)  // K-major, 8-row groups 1024 B apart; +32 B per 16-wide K step
      wgmma_ss<T, 128>(acc, desc_sw128(sa + kk * 32, 16, 1024), desc_sw128(sb + kk * 32, 16, 1024), 1);
    wgmma_commit();
    wgmma_wait<1>();  // the previous tile's wgmmas are done: its stage can be refilled
    if (kt > 0 && tid_wg == 0) mbar_arrive(smem_addr(&empty[(kt - 1) % kStages]));
  }
  wgmma_wait<0>();

  // Accumulator layout (m64nNk16, f32): warp w of the warpgroup holds rows 16 w + g and 16 w + g + 8;
  // register 4 j + e holds column 8 j + 2 (lane % 4) + (e & 1), row + 8 when e >= 2.
  const int warp = tid_wg / 32, lane = tid_wg % 32, g = lane / 4, t4 = lane % 4;
#pragma unroll
  for (int j = 0; j < 16; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int m = m0 + c * 64 + warp * 16 + g + h * 8, n = n0 + j * 8 + t4 * 2;
      if (m < p.M) store_out2(p, m, n, acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
    }
#else
  __trap();  // built without sm_90a; the dispatcher only launches this on compute capability 9.x
#endif
}

// A 2D map over a [rows, K] K-contiguous matrix, boxes of 128 rows x 64 K with the 128-byte swizzle.
template <typename T>
CUtensorMap make_map(const T* ptr, int rows, int K, int64_t row_stride) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {(cuuint64_t)K, (cuuint64_t)rows};
  const cuuint64_t strides[1] = {(cuuint64_t)row_stride * sizeof(T)};
  const cuuint32_t box[2] = {kBK, kBM};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r = sm90::tensor_map_encoder()(&map, sm90::tensor_map_dtype<T>(), 2, const_cast<T*>(ptr), dims,
                                                strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  MINFER_CHECK(r == CUDA_SUCCESS, "linear: sm90 path: cuTensorMapEncodeTiled failed with error " + std::to_string(int(r)) +
                                     " (rows=" + std::to_string(rows) + ", K=" + std::to_string(K) +
                                     ", row stride=" + std::to_string(row_stride) + ")");
  return map;
}

}  // namespace

template <typename T>
void launch_sm90(const Params<T, T>& p, cudaStream_t stream) {
  // K = 0 would give a zero-sized map: treat it as one zero-filled K tile instead.
  const int k_map = p.K > 0 ? p.K : 8;
  const CUtensorMap map_a = make_map(p.A, p.M, k_map, p.sam > 0 ? p.sam : k_map);
  const CUtensorMap map_b = make_map(p.B, p.N, k_map, p.sbn > 0 ? p.sbn : k_map);
  auto kernel = wgmma_kernel<T>;
  static bool configured = [&] {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
    return true;
  }();
  (void)configured;
  const dim3 grid((p.M + kBM - 1) / kBM, (p.N + kBN - 1) / kBN);
  kernel<<<grid, kThreads, kSmemBytes, stream>>>(map_a, map_b, p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
template void launch_sm90<__half>(const Params<__half, __half>&, cudaStream_t);
template void launch_sm90<__nv_bfloat16>(const Params<__nv_bfloat16, __nv_bfloat16>&, cudaStream_t);

}  // namespace minfer::gemm_impl
