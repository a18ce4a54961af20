// The one home of minfer's inline PTX: every kernel reaches these instructions through minfer::ptx.
// Device-only. Provides:
//   addresses      smem_addr(p)                         generic -> 32-bit shared address
//   L2 policy      evict_first_policy() (weight streams: the *_stream copies and ld_nc_stream_v4 take it)
//   async copy     cp_async16(dst, src, src_bytes | pred), cp_async16_stream, cp_async_commit(), cp_async_wait<N>()
//   ldmatrix       ldmatrix_x4(r, addr | ptr), ldmatrix_x4_trans(r, addr | ptr)
//   mma.sync       mma_m16n8k16<T>(d, a, b0, b1 | b[2]) (T = __half / __nv_bfloat16, fp32 accumulate),
//                  mma_m16n8k32_s8(d, a, b) (int8, int32 accumulate), mma_m16n8k32_u8s8 (u8 A, s8 B)
//   loads          ld_nc_stream_v4(p, pred) (read once: no L1 allocation, evict_first, 256-byte L2 fetch),
//                  ld_nc_v4 / ld_nc_v2 / ld_nc_f32(p, pred) (read-only, L1-resident; v2 and f32 volatile),
//                  ld_cg_v4f32_if(p, pred, fallback),
//                  prefetch_l2(p), st_shared_v4(addr, x)
//   math           ex2_approx(x)
//   memory order   ld_acquire_gpu(p), st_release_gpu<V>(p), atom_add_acq_rel_gpu<V>(p) (V an immediate),
//                  fence_proxy_async()
//   barriers       named_bar_sync(id, count), named_bar_arrive(id, count)
//   sm_90          griddep_wait(), griddep_launch_dependents() (programmatic dependent launch; no-ops
//                  below sm_90, where nothing launches early), mbar_init, mbar_init_fence, mbar_expect_tx,
//                  mbar_arrive, mbar_wait, bulk_load, tma_load_2d, tma_load_3d, tma_load_4d and their
//                  *_stream forms for weights
// The wgmma instructions and setmaxnreg (sm_90a only) live in common/sm90.cuh, which includes this.
//
// m16n8k16 fragment layouts (PTX ISA), with g = lane / 4, t = lane % 4:
//   A (16x16, row): a0 = (row g, k 2t..2t+1), a1 = (g+8, 2t), a2 = (g, 2t+8), a3 = (g+8, 2t+8)
//   B (16x8, col):  b0 = (k 2t..2t+1, col g), b1 = (k 2t+8.., col g)
//   C (16x8, f32):  c0,c1 = (row g, cols 2t, 2t+1), c2,c3 = (row g+8, same cols)
// m16n8k32 (s8) has the same layout with 4 int8 per register.
#pragma once
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <type_traits>

namespace minfer::ptx {

// ---- addresses ----
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- L2 policy ----
// The L2 policy of a weight stream: a decode step reads each weight once, so its lines are the first to go,
// and what the step reads again (the residual, x's records, the KV cache, norm weights, rope tables) can stay
// in L2 instead of following ~5-16 GB of weights through it (the step gains; L2 hit rates not measured).
__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t policy;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}

// ---- cp.async (sm_80) ----
// 16-byte global -> shared copy; src_bytes = 0 reads nothing and zero-fills (tile edges).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
// The same to a shared pointer; when !pred nothing is read and the 16 bytes are zero-filled.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool pred) {
  cp_async16(smem_addr(dst), src, pred ? 16 : 0);
}
// cp_async16 for a weight stream: its L2 lines evict_first (evict_first_policy). Whole pieces or none: with the
// hint a src-size of 1-15 bytes raised an illegal instruction (H200), and so did qlinear_kernel's whole pieces
// (load_chunk, not understood), which keep cp_async16.
__device__ __forceinline__ void cp_async16_stream(uint32_t dst, const void* src, bool pred) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(dst), "l"(src),
               "r"(pred ? 16 : 0), "l"(evict_first_policy()));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Blocks until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// ---- ldmatrix ----
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) { ldmatrix_x4(r, smem_addr(p)); }
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  ldmatrix_x4_trans(r, smem_addr(p));
}

// ---- mma.sync ----
// d += a . b for one 16 x 8 tile, fp32 accumulate; A row-major, B "col" (k contiguous per n).
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  static_assert(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>, "mma_m16n8k16: f16 or bf16");
  if constexpr (std::is_same_v<T, __half>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  mma_m16n8k16<T>(d, a, b[0], b[1]);
}
// int8: exact int32 accumulation.
__device__ __forceinline__ void mma_m16n8k32_s8(int (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// u8 A against s8 B (Q4_K's quants against int8 x), exact int32 accumulation.
__device__ __forceinline__ void mma_m16n8k32_u8s8(int (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---- loads and stores ----
// 16 bytes of a weight stream: not kept in L1, evict_first in L2, which fetches the 256-byte run around them.
// pred false: zeros, nothing read.
__device__ __forceinline__ uint4 ld_nc_stream_v4(const uint4* ptr, bool pred) {
  uint4 v;
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %5, 0;\n"
      " mov.b32 %0, 0;\n mov.b32 %1, 0;\n mov.b32 %2, 0;\n mov.b32 %3, 0;\n"
      " @p ld.global.nc.L1::no_allocate.L2::cache_hint.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4], %6;\n}\n"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(ptr), "r"((int)pred), "l"(evict_first_policy()));
  return v;
}
// 16 read-only bytes that are read again soon (they stay in L1). pred false: zeros, nothing read.
__device__ __forceinline__ uint4 ld_nc_v4(const uint4* ptr, bool pred) {
  uint4 v;
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %5, 0;\n"
      " mov.b32 %0, 0;\n mov.b32 %1, 0;\n mov.b32 %2, 0;\n mov.b32 %3, 0;\n"
      " @p ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n}\n"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(ptr), "r"((int)pred));
  return v;
}
// 8 read-only bytes (as ld_nc_v4). Volatile, so that a load placed before a wait (cp_async_wait) is issued
// before it and its latency overlaps the wait's.
__device__ __forceinline__ uint2 ld_nc_v2(const uint2* ptr, bool pred) {
  uint2 v;
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %3, 0;\n mov.b32 %0, 0;\n mov.b32 %1, 0;\n"
      " @p ld.global.nc.v2.u32 {%0, %1}, [%2];\n}\n"
      : "=r"(v.x), "=r"(v.y)
      : "l"(ptr), "r"((int)pred));
  return v;
}
// 4 read-only bytes as ld_nc_v2 (volatile). pred false: 0, nothing read.
__device__ __forceinline__ float ld_nc_f32(const float* ptr, bool pred) {
  float v;
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n mov.b32 %0, 0;\n @p ld.global.nc.f32 %0, [%1];\n}\n"
               : "=f"(v)
               : "l"(ptr), "r"((int)pred));
  return v;
}
// *ptr through L2 (ld.global.cg) where `pred`, else `fallback`: a predicated load, no branch, so an
// unrolled run of them issues back to back whatever the count.
__device__ __forceinline__ float4 ld_cg_v4f32_if(const float4* ptr, bool pred, float4 fallback) {
  float4 v = fallback;
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %5, 0;\n @p ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];\n}"
               : "+f"(v.x), "+f"(v.y), "+f"(v.z), "+f"(v.w)
               : "l"(ptr), "r"(static_cast<int>(pred))
               : "memory");
  return v;
}
// Brings the 128-byte line holding p into L2: a hint that changes what no load returns, so it may run
// before griddep_wait even on a line the previous kernel writes.
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p)); }
// Four copies of x into the 16 shared bytes at addr.
__device__ __forceinline__ void st_shared_v4(uint32_t addr, uint32_t x) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(addr), "r"(x) : "memory");
}

// ---- math ----
// 2^x on the SFU alone (exp2f wraps MUFU.EX2 in a range fix-up); results below 2^-126 flush to zero.
__device__ __forceinline__ float ex2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// ---- memory order (gpu scope) ----
__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}
// *p = V (an immediate: no register for it), release.
template <int V>
__device__ __forceinline__ void st_release_gpu(int* p) {
  asm volatile("st.release.gpu.global.s32 [%0], %1;\n" ::"l"(p), "n"(V) : "memory");
}
// *p += V, acquire and release; returns the value before the add.
template <int V>
__device__ __forceinline__ int atom_add_acq_rel_gpu(int* p) {
  int prev;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;\n" : "=r"(prev) : "l"(p), "n"(V) : "memory");
  return prev;
}
// Orders this thread's ordinary shared-memory stores before later async-proxy reads (wgmma, TMA).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// ---- named barriers (ids 1..15; 0 is __syncthreads) over `count` threads, a multiple of 32 ----
// sync blocks until `count` threads have arrived (this one included); arrive only counts this thread.
__device__ __forceinline__ void named_bar_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

// ---- programmatic dependent launch (sm_90; see common/launch.h) ----
// Returns once the previous grid in the stream is complete and its writes are visible.
__device__ __forceinline__ void griddep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
// Lets the next grid in the stream launch; it too waits (griddep_wait) before touching what this writes.
__device__ __forceinline__ void griddep_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
// The entry of a small kernel launched as a programmatic dependent: it waits for the previous grid and lets
// the next one launch, before its wait (early: the next kernel's CTAs may start beside the previous grid's)
// or after it. The host chooses (common/launch.h, pdl_early).
__device__ __forceinline__ void griddep_enter(bool early) {
  if (early) griddep_launch_dependents();
  griddep_wait();
  if (!early) griddep_launch_dependents();
}

// ---- mbarriers (sm_90) ----
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
// Makes the inits visible to the async proxy (TMA) before any copy signals them.
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Blocks until the phase with the given parity has completed (a fresh barrier: parity 1 counts as done).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// ---- TMA loads (sm_90: global -> shared, completion counted in bytes on an mbarrier) ----
// bytes (a multiple of 16) contiguous from src (16-byte aligned) to dst (16-byte aligned), as a bulk copy.
__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, int bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}
// The same copies of a weight stream: their L2 lines evict_first (evict_first_policy).
__device__ __forceinline__ void bulk_load_stream(uint32_t dst, const void* src, int bytes, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], "
      "%4;\n" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(bar), "l"(evict_first_policy())
      : "memory");
}
__device__ __forceinline__ void tma_load_2d_stream(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1, {%3, "
      "%4}], [%2], %5;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "l"(evict_first_policy())
      : "memory");
}
__device__ __forceinline__ void tma_load_3d_stream(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1,
                                                   int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1, {%3, %4, "
      "%5}], [%2], %6;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "l"(evict_first_policy())
      : "memory");
}
__device__ __forceinline__ void tma_load_4d_stream(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1,
                                                   int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1, {%3, %4, "
      "%5, %6}], [%2], %7;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "l"(evict_first_policy())
      : "memory");
}
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n" ::"r"(
          dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1)
      : "memory");
}
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];\n" ::"r"(
          dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1, int c2,
                                            int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(
          dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

}  // namespace minfer::ptx
