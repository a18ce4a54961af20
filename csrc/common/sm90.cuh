// Hopper (sm_90a) building blocks shared by the wgmma GEMM (csrc/gemm/wgmma_sm90.cu) and the flash
// prefill (csrc/attention/flash_prefill_sm90.cu): wgmma descriptors and instructions, setmaxnreg; and on
// the host, the driver's tensor-map encoder and a builder for maps over [batch, seq, heads, D] rows.
// The mbarrier, TMA-load and barrier instructions are in common/ptx.cuh (minfer::ptx).
//
// Device code exists only in the sm_90a pass: guard its use with
//   #if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#pragma once
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <type_traits>

#include <c10/cuda/CUDAException.h>

#include "common/checks.h"
#include "common/ptx.cuh"

namespace minfer::sm90 {

// cuTensorMapEncodeTiled from the driver (the runtime has no wrapper; no -lcuda needed this way).
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult status{};
    C10_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &status));
    MINFER_CHECK(status == cudaDriverEntryPointSuccess && ptr, "sm90: cuTensorMapEncodeTiled not found in the driver");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  }();
  return fn;
}

template <typename T>
constexpr CUtensorMapDataType tensor_map_dtype() {
  return std::is_same_v<T, __half> ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
}

// A 4D map {head_dim, heads, seq, batch} over 16-bit rows at the given element strides, boxes of 64
// columns (128 bytes) x `rows` rows of one (head, batch), 128-byte swizzle; rows past seq read as zeros.
// False when TMA cannot describe the tensor (strides must be multiples of 16 bytes, below 2^40).
template <typename T>
bool make_rows_map(CUtensorMap* map, const void* ptr, int D, int64_t heads, int64_t seq, int64_t batch, int64_t hs,
                   int64_t ss, int64_t bs, int rows) {
  const int64_t dims[3] = {heads, seq, batch}, strides[3] = {hs, ss, bs};
  cuuint64_t gdim[4] = {(cuuint64_t)D, 0, 0, 0}, gstride[3];
  int64_t packed = D * int64_t(sizeof(T));  // a stand-in stride for extent-1 dims (never stepped along)
  for (int i = 0; i < 3; ++i) {
    gdim[i + 1] = (cuuint64_t)dims[i];
    int64_t bytes = strides[i] * int64_t(sizeof(T));
    if (dims[i] == 1) bytes = packed;
    if (bytes <= 0 || bytes % 16 != 0 || bytes >= (int64_t(1) << 40)) return false;
    gstride[i] = (cuuint64_t)bytes;
    packed = bytes * dims[i];
  }
  const cuuint32_t box[4] = {64, 1, (cuuint32_t)rows, 1};
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  const CUresult r = tensor_map_encoder()(map, tensor_map_dtype<T>(), 4, const_cast<void*>(ptr), gdim, gstride, box,
                                          elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                          CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS;
}

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)

// ---- register reallocation between warpgroups (needs __launch_bounds__(threads, 1)) ----
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N)); }
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N)); }

// ---- clusters (distributed shared memory) ----
__device__ __forceinline__ uint32_t cluster_ctarank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
// Every non-exited thread of the cluster arrives; the writes before the arrive are visible to the reads after
// the wait, in every CTA of the cluster.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void st_shared_f32(uint32_t addr, float v) {
  asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(addr), "f"(v) : "memory");
}
__device__ __forceinline__ float ld_shared_f32(uint32_t addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(addr) : "memory");
  return v;
}
// The float at shared address addr (this CTA's offset) in the shared memory of cluster CTA `rank`.
__device__ __forceinline__ float ld_cluster_f32(uint32_t addr, uint32_t rank) {
  uint32_t remote;
  float v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(addr), "r"(rank));
  asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(remote) : "memory");
  return v;
}

// The 64-bit integer at shared address addr (this CTA's offset) in the shared memory of cluster CTA `rank`.
__device__ __forceinline__ unsigned long long ld_cluster_u64(uint32_t addr, uint32_t rank) {
  uint32_t remote;
  unsigned long long v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(addr), "r"(rank));
  asm volatile("ld.shared::cluster.u64 %0, [%1];\n" : "=l"(v) : "r"(remote) : "memory");
  return v;
}
__device__ __forceinline__ uint32_t cluster_nctarank() {
  uint32_t n;
  asm volatile("mov.u32 %0, %%cluster_nctarank;\n" : "=r"(n));
  return n;
}

// ---- wgmma ----
// Shared-memory matrix descriptor with the 128-byte swizzle (tiles written by TMA with SWIZZLE_128B,
// 1024-byte aligned). Offsets in bytes:
//   K-major (rows of 64 16-bit K values = 128 B): sbo = distance between 8-row groups (1024 when the
//     rows are packed); lbo unused (1). A 16-wide K step inside the 128-byte row is start + 32 B.
//   MN-major (rows of 64 16-bit M/N values = 128 B, one row per K index): sbo = distance between
//     groups of 8 K rows (1024 when packed), lbo = distance between 64-wide M/N blocks.
__device__ __forceinline__ uint64_t desc_sw128(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  uint64_t d = (addr & 0x3FFFF) >> 4;
  d |= uint64_t((lbo & 0x3FFFF) >> 4) << 16;
  d |= uint64_t((sbo & 0x3FFFF) >> 4) << 32;
  d |= uint64_t(1) << 62;  // SWIZZLE_128B (base offset 0: every pattern starts on a 1024-byte boundary)
  return d;
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

// Keeps the compiler from moving accesses to accumulator registers across wgmma issue/wait points.
template <int N>
__device__ __forceinline__ void fence_regs(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// One wgmma.mma_async in `dtype` ("f16" or "bf16"): `dregs` lists the accumulator operands (%0 ..),
// `ab` the A and B operands, `scale` the scale-d operand, `imm` the immediates after the scale-d
// predicate; `ins` holds the input constraints in parentheses, and the accumulator constraints come
// last (variadic, as they are a comma-separated list).
#define MINFER_UNPAREN(...) __VA_ARGS__
#define MINFER_WGMMA(shape, dtype, dregs, ab, scale, imm, ins, ...)                                        \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " scale ", 0;\n"                                       \
               "wgmma.mma_async.sync.aligned." shape ".f32." dtype "." dtype " {" dregs "}, " ab ", p, " imm \
               ";\n}\n"                                                                                    \
               : __VA_ARGS__                                                                           \
               : MINFER_UNPAREN ins)
// The f16 or bf16 form, by the element type T.
#define MINFER_WGMMA_T(T, shape, dregs, ab, scale, imm, ins, ...)                                        \
  if constexpr (std::is_same_v<T, __half>) MINFER_WGMMA(shape, "f16", dregs, ab, scale, imm, ins, __VA_ARGS__); \
  else MINFER_WGMMA(shape, "bf16", dregs, ab, scale, imm, ins, __VA_ARGS__)
// Accumulator operand lists: the first R registers and their "+f" constraints.
#define MINFER_WGMMA_D4 "%0, %1, %2, %3"
#define MINFER_WGMMA_D8 MINFER_WGMMA_D4 ", %4, %5, %6, %7"
#define MINFER_WGMMA_D16 MINFER_WGMMA_D8 ", %8, %9, %10, %11, %12, %13, %14, %15"
#define MINFER_WGMMA_D32 MINFER_WGMMA_D16 ", " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define MINFER_WGMMA_D40 MINFER_WGMMA_D32 ", " "%32, %33, %34, %35, %36, %37, %38, %39"
#define MINFER_WGMMA_D64 MINFER_WGMMA_D32 ", " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define MINFER_WGMMA_D72 MINFER_WGMMA_D64 ", " "%64, %65, %66, %67, %68, %69, %70, %71"
#define MINFER_WGMMA_D96 \
  MINFER_WGMMA_D64 ", " \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
#define MINFER_WGMMA_D128 \
  MINFER_WGMMA_D96 ", " \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
// The "+f" constraints of accumulators d[i] .. d[i + 7], and of the first R of them.
#define MINFER_WGMMA_ACC8_AT(d, i) \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define MINFER_WGMMA_ACC4(d) "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
#define MINFER_WGMMA_ACC8(d) MINFER_WGMMA_ACC8_AT(d, 0)
#define MINFER_WGMMA_ACC16(d) MINFER_WGMMA_ACC8(d), MINFER_WGMMA_ACC8_AT(d, 8)
#define MINFER_WGMMA_ACC32(d) MINFER_WGMMA_ACC16(d), MINFER_WGMMA_ACC8_AT(d, 16), MINFER_WGMMA_ACC8_AT(d, 24)
#define MINFER_WGMMA_ACC40(d) MINFER_WGMMA_ACC32(d), MINFER_WGMMA_ACC8_AT(d, 32)
#define MINFER_WGMMA_ACC64(d) \
  MINFER_WGMMA_ACC32(d), MINFER_WGMMA_ACC8_AT(d, 32), MINFER_WGMMA_ACC8_AT(d, 40), MINFER_WGMMA_ACC8_AT(d, 48), \
      MINFER_WGMMA_ACC8_AT(d, 56)
#define MINFER_WGMMA_ACC72(d) MINFER_WGMMA_ACC64(d), MINFER_WGMMA_ACC8_AT(d, 64)
#define MINFER_WGMMA_ACC96(d) \
  MINFER_WGMMA_ACC72(d), MINFER_WGMMA_ACC8_AT(d, 72), MINFER_WGMMA_ACC8_AT(d, 80), MINFER_WGMMA_ACC8_AT(d, 88)
#define MINFER_WGMMA_ACC128(d) \
  MINFER_WGMMA_ACC96(d), MINFER_WGMMA_ACC8_AT(d, 96), MINFER_WGMMA_ACC8_AT(d, 104), MINFER_WGMMA_ACC8_AT(d, 112), \
      MINFER_WGMMA_ACC8_AT(d, 120)

// D[64 x N] (= or +=) A[64 x 16] . B[N x 16]^T, A and B K-major in shared memory; scale_d = 0 overwrites D.
template <typename T, int N>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  static_assert(N == 64 || N == 80 || N == 128, "wgmma_ss: N is 64, 80 or 128");
  if constexpr (N == 64) {
    MINFER_WGMMA_T(T, "m64n64k16", MINFER_WGMMA_D32, "%32, %33", "%34", "1, 1, 0, 0",
                   ("l"(desc_a), "l"(desc_b), "r"(scale_d)), MINFER_WGMMA_ACC32(d));
  } else if constexpr (N == 80) {
    MINFER_WGMMA_T(T, "m64n80k16", MINFER_WGMMA_D40, "%40, %41", "%42", "1, 1, 0, 0",
                   ("l"(desc_a), "l"(desc_b), "r"(scale_d)), MINFER_WGMMA_ACC40(d));
  } else {
    MINFER_WGMMA_T(T, "m64n128k16", MINFER_WGMMA_D64, "%64, %65", "%66", "1, 1, 0, 0",
                   ("l"(desc_a), "l"(desc_b), "r"(scale_d)), MINFER_WGMMA_ACC64(d));
  }
}

// D[64 x N] (= or +=) A[64 x 16] . B[16 x N], A from registers (the m16n8k16 A fragment per warp, warp w
// holding rows 16 w .. 16 w + 15), B MN-major in shared memory (transpose bit set).
template <typename T, int N>
__device__ __forceinline__ void wgmma_rs_tb(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b, int scale_d) {
  static_assert(N == 64 || N == 128 || N == 256, "wgmma_rs_tb: N is 64, 128 or 256");
  if constexpr (N == 64) {
    MINFER_WGMMA_T(T, "m64n64k16", MINFER_WGMMA_D32, "{%32, %33, %34, %35}, %36", "%37", "1, 1, 1",
                   ("r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d)), MINFER_WGMMA_ACC32(d));
  } else if constexpr (N == 128) {
    MINFER_WGMMA_T(T, "m64n128k16", MINFER_WGMMA_D64, "{%64, %65, %66, %67}, %68", "%69", "1, 1, 1",
                   ("r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d)), MINFER_WGMMA_ACC64(d));
  } else {
    MINFER_WGMMA_T(T, "m64n256k16", MINFER_WGMMA_D128, "{%128, %129, %130, %131}, %132", "%133", "1, 1, 1",
                   ("r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d)), MINFER_WGMMA_ACC128(d));
  }
}

#endif  // sm_90a

}  // namespace minfer::sm90
