// qlinear: out[m, n] = sum_k x[m, k] W[n, k] (+ bias[n]) for M <= 16 (decode), W kept as ggml blocks
// (uint8 [N, K / elems * bytes]) and dequantized in registers. Decode is bound by W's bytes.
//
// A CTA owns 16 rows of W; its 8 warps split K in chunks of 256 (one super-block, or 8 legacy blocks),
// warp w taking chunks w, w + 8, ... Each warp streams its chunks through a ring of shared-memory
// stages with 16-byte cp.async (a row's chunk starts anywhere: the copy starts at the aligned piece
// holding its first byte), decodes W into registers and multiplies on the tensor cores, with the
// operands swapped as in csrc/gemm/gemv_common.cuh: 16 rows of W are the A operand of mma.sync
// m16n8k16, up to 8 (NT = 1) or 16 (NT = 2) rows of x the B operand. A dot product may take its k terms
// in any order, so in a 32-wide k step, lane (g = lane / 4, t = lane % 4) decodes the 8 consecutive
// elements k = 8t .. 8t + 7 of W rows g and g + 8 (decode8: one run of 8 of a block) and loads x row g
// at the same 8 k with one 16-byte load; mma_step feeds both through the same k permutation. The warps'
// partial sums meet in shared memory at the end.
//
// Programmatic dependent launch (Hopper): with static_weight (no kernel that may still run writes W),
// the first stages of W are in flight before griddep_wait; x, bias and out only after it.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "common/checks.h"
#include "common/dispatch.h"
#include "common/launch.h"
#include "common/ptx.cuh"
#include "common/vec.h"
#include "ops.h"
#include "qgemm/checks.h"
#include "qgemm/decode_rows.cuh"
#include "qgemm/formats.cuh"

namespace minfer::qgemm {
namespace {

using namespace ::minfer::ptx;

constexpr int kWarps = 8, kThreads = 32 * kWarps, kChunk = 256;  // k per stage

// One warp's ring of stages; a stage holds one chunk of 16 rows, row r at r * kRowStride.
template <int QT>
struct Ring {
  static constexpr int kBytes = kChunk / Format<QT>::kElems * Format<QT>::kBytes;  // a row's chunk
  static constexpr int kPieces = (kBytes + 15 + 15) / 16;  // 16-byte pieces that cover it at any alignment
  static constexpr int kRowStride = 16 * kPieces, kStageBytes = 16 * kRowStride;
  static constexpr int kStages = 3 * kWarps * kStageBytes <= 80 * 1024 ? 3 : 2;  // 2 for Q8_0 and Q6_K
  static constexpr int kSmem = kStages * kWarps * kStageBytes;  // the CTA's rings
};

struct Args {
  const uint8_t* w;  // [N, row_bytes]
  const void* x;     // [M, K]
  const void* bias;  // [N] or null
  void* out;         // [M, N]
  int M, N, K;
  int64_t row_bytes;
  bool static_weight;
};

// Where row n0 + r's chunk c starts in W (bytes): the stage holds it from offset start & 15.
__device__ __forceinline__ int64_t chunk_start(const Args& a, int n0, int r, int c, int chunk_bytes) {
  return int64_t(n0 + r) * a.row_bytes + int64_t(c) * chunk_bytes;
}

// Starts the copy of chunk c of rows n0 .. n0 + 15 into stage, in the 16-byte pieces that hold it (the
// last one of W only up to W's end); the rest of the stage, and rows from N on, get zeros (decoded: 0).
template <int QT>
__device__ __forceinline__ void load_chunk(uint8_t* stage, const Args& a, int n0, int c, int lane) {
  using R = Ring<QT>;
  const int64_t left = a.row_bytes - int64_t(c) * R::kBytes, len = left < R::kBytes ? left : R::kBytes;  // last: less
  const int64_t total = int64_t(a.N) * a.row_bytes;
#pragma unroll 2
  for (int i = lane; i < 16 * R::kPieces; i += 32) {
    const int r = i / R::kPieces, p = i % R::kPieces;
    const int64_t start = chunk_start(a, n0, r, c, R::kBytes), piece = (start & ~int64_t(15)) + 16 * p;
    const bool ok = n0 + r < a.N && piece < start + len;
    const int bytes = !ok ? 0 : total - piece < 16 ? int(total - piece) : 16;
    cp_async16(smem_addr(stage + r * R::kRowStride + 16 * p), ok ? a.w + piece : a.w, bytes);
  }
}

// One 32-wide k step as two m16n8k16 mmas. wa / wb: W rows g / g + 8, x[nt]: x row 8 nt + g, all at
// physical k = 8t .. 8t + 7, register r holding k = 8t + 2r, +1. The fragment layouts (common/ptx.cuh)
// call A's registers (g, 2t), (g + 8, 2t), (g, 2t + 8), (g + 8, 2t + 8) and B's (2t, g), (2t + 8, g):
// mma j takes registers 2j and 2j + 1 as logical k 2t and 2t + 8 of both, so W and x see one mapping,
// a permutation of the step's 32 k.
template <typename T, int NT>
__device__ __forceinline__ void mma_step(float (&acc)[NT][4], const uint4& wa, const uint4& wb, const uint4 (&x)[NT]) {
  const uint32_t a[2][4] = {{wa.x, wb.x, wa.y, wb.y}, {wa.z, wb.z, wa.w, wb.w}};
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) mma_m16n8k16<T>(acc[nt], a[j], j ? x[nt].z : x[nt].x, j ? x[nt].w : x[nt].y);
}

// acc += W[n0 .. n0 + 15, chunk c] . x[:, chunk c]^T from the stage.
template <int QT, typename T, int NT>
__device__ __forceinline__ void mma_chunk(float (&acc)[NT][4], const uint8_t* stage, const Args& a, int n0, int c,
                                          int g, int t) {
  using F = Format<QT>;
  using R = Ring<QT>;
  const uint8_t* row_a = stage + g * R::kRowStride + (chunk_start(a, n0, g, c, R::kBytes) & 15);
  const uint8_t* row_b = stage + (g + 8) * R::kRowStride + (chunk_start(a, n0, g + 8, c, R::kBytes) & 15);
  const T* x = static_cast<const T*>(a.x) + int64_t(c) * kChunk + 8 * t;
  const int steps = (a.K - c * kChunk < kChunk ? a.K - c * kChunk : kChunk) / 32;  // K % 32 == 0
#pragma unroll
  for (int s = 0; s < kChunk / 32; ++s) {
    if (s >= steps) break;
    const int e = 32 * s + 8 * t, blk = e / F::kElems * F::kBytes, j = (e % F::kElems) / 8;  // chunk element e
    uint4 xv[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int m = 8 * nt + g;
      xv[nt] = ld_nc_v4(reinterpret_cast<const uint4*>(x + int64_t(m) * a.K + 32 * s), m < a.M);
    }
    float v[8];
    decode8<QT, false>(row_a + blk, j, v);
    const uint4 wa = pack8<T>(v);
    decode8<QT, false>(row_b + blk, j, v);
    const uint4 wb = pack8<T>(v);
    mma_step<T, NT>(acc, wa, wb, xv);
  }
}

template <int QT, typename T, int NT>
__global__ void __launch_bounds__(kThreads) qlinear_kernel(const Args a) {
  using R = Ring<QT>;
  extern __shared__ __align__(16) uint8_t smem[];  // [kWarps][kStages][kStageBytes]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int n0 = blockIdx.x * 16, chunks = (a.K + kChunk - 1) / kChunk;
  const int mine = warp < chunks ? (chunks - 1 - warp) / kWarps + 1 : 0;  // this warp's chunks: warp + kWarps i
  uint8_t* ring = smem + warp * R::kStages * R::kStageBytes;
  griddep_launch_dependents();  // they wait (griddep_wait) for this grid to complete before reading out
  if (!a.static_weight) griddep_wait();
#pragma unroll
  for (int i = 0; i < R::kStages - 1; ++i) {
    if (i < mine) load_chunk<QT>(ring + i * R::kStageBytes, a, n0, warp + kWarps * i, lane);
    cp_async_commit();  // one group per chunk, empty past the last: the wait below counts groups
  }
  if (a.static_weight) griddep_wait();  // x, bias and out may be the previous kernel's
  float acc[NT][4] = {};
  for (int i = 0; i < mine; ++i) {
    const int ahead = i + R::kStages - 1;  // refills the stage that chunk i - 1 left
    if (ahead < mine) load_chunk<QT>(ring + (ahead % R::kStages) * R::kStageBytes, a, n0, warp + kWarps * ahead, lane);
    cp_async_commit();
    cp_async_wait<R::kStages - 1>();  // chunk i's group is done (for this lane) ...
    __syncwarp();                     // ... and for every lane
    mma_chunk<QT, T, NT>(acc, ring + (i % R::kStages) * R::kStageBytes, a, n0, warp + kWarps * i, g, t);
    __syncwarp();  // every lane is done with the stage before it is refilled
  }
  // The warps' partial sums, through the (now idle) rings: red[warp][i][lane].
  cp_async_wait<0>();
  __syncthreads();
  float* red = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int i = 0; i < NT * 4; ++i) red[(warp * NT * 4 + i) * 32 + lane] = acc[i / 4][i % 4];
  __syncthreads();
  if (warp != 0) return;
  const T* bias = static_cast<const T*>(a.bias);
  T* out = static_cast<T*>(a.out);
#pragma unroll
  for (int i = 0; i < NT * 4; ++i) {
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += red[(w * NT * 4 + i) * 32 + lane];
    // acc[nt][2h + e]: out[m = 8 nt + 2t + e][n = n0 + g + 8h] (the C fragment layout)
    const int m = 8 * (i / 4) + 2 * t + (i & 1), n = n0 + g + 8 * ((i % 4) >> 1);
    if (m < a.M && n < a.N) out[int64_t(m) * a.N + n] = from_float<T>(bias ? sum + to_float(bias[n]) : sum);
  }
}

template <int QT, typename T, int NT>
void launch(const Args& a, cudaStream_t stream) {
  auto kernel = qlinear_kernel<QT, T, NT>;
  static const bool attr = [&] {  // shared memory past 48 KB needs the opt-in
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Ring<QT>::kSmem));
    return true;
  }();
  (void)attr;
  launch_pdl(kernel, dim3((unsigned)((a.N + 15) / 16)), dim3(kThreads), Ring<QT>::kSmem, stream, a);
}

}  // namespace
}  // namespace minfer::qgemm

namespace minfer {

torch::Tensor qlinear(const torch::Tensor& x, const torch::Tensor& blocks, int64_t qtype, int64_t n, int64_t k,
                      const std::optional<torch::Tensor>& bias, bool static_weight) {
  const int64_t row_bytes = qgemm::check_blocks("qlinear", blocks, qtype, n, k);
  MINFER_CHECK_CUDA(x);
  MINFER_CHECK_SAME_DEVICE(x, blocks);
  MINFER_CHECK_DIM(x, 2);
  qgemm::check_half_dtype("qlinear", "x", x.scalar_type());
  MINFER_CHECK(x.size(1) == k, "qlinear: x must have k = ", k, " columns, got shape ", x.sizes());
  MINFER_CHECK(x.size(0) <= 16, "qlinear: x must have at most 16 rows (decode; dequantize + linear for more), got ",
               x.size(0));
  MINFER_CHECK_CONTIGUOUS(x);
  MINFER_CHECK(is_aligned16(x.data_ptr()), "qlinear: x must be 16-byte aligned");
  if (bias) {
    MINFER_CHECK_SAME_DEVICE(x, *bias);
    MINFER_CHECK_SAME_DTYPE(x, *bias);
    MINFER_CHECK(bias->dim() == 1 && bias->size(0) == n, "qlinear: bias must have shape [", n, "], got ", bias->sizes());
    MINFER_CHECK(bias->is_contiguous(), "qlinear: bias must be contiguous");
  }
  const c10::cuda::CUDAGuard guard(x.device());
  auto out = torch::empty({x.size(0), n}, x.options());  // [M, n]
  if (x.size(0) == 0 || n == 0) return out;
  const qgemm::Args a{blocks.data_ptr<uint8_t>(), x.data_ptr(),   bias ? bias->data_ptr() : nullptr, out.data_ptr(),
                      (int)x.size(0),             (int)n,         (int)k,                             row_bytes,
                      static_weight};
  auto stream = c10::cuda::getCurrentCUDAStream();
  MINFER_DISPATCH_QTYPE(qtype, QT, [&] {
    MINFER_DISPATCH_HALF(x.scalar_type(), "qlinear", [&] {
      if (a.M <= 8)
        qgemm::launch<QT, scalar_t, 1>(a, stream);
      else
        qgemm::launch<QT, scalar_t, 2>(a, stream);
    });
  });
  return out;
}

}  // namespace minfer
