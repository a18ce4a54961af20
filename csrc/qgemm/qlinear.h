// qlinear's seam: the ops (qlinear.cu: checks, outputs, the choice of dtype and format) and the kernels
// (qlinear_kernels.cuh, q4k_kernels.cuh, i8_kernels.cuh; chosen in qlinear_launch.cuh), which are instantiated one
// format a translation unit (qlinear_<format>.cu) so that they compile in parallel.
#pragma once
#include <algorithm>
#include <cuda_runtime.h>
#include <stdint.h>

#include "common/tensor.h"
#include "qgemm/formats.cuh"

namespace minfer::qgemm {

constexpr int kWarps = 8, kThreads = 32 * kWarps;

struct Args {
  const uint8_t* w;  // [N, row_bytes]
  const void* x;     // [M, K]
  const void* bias;  // [N] or null
  void* out;         // [M, N]
  int M, N, K;
  int64_t row_bytes;
  bool static_weight;
  bool aligned;  // row_bytes % 16 == 0 and 16 rows < 2^31 bytes: every row's chunk starts 16-byte aligned
                 // where the chunk's size is a multiple of 16
  // q4k::byte_pair's exponent bytes (0x64, 0x54), as an argument: as constants, ptxas made them PRMT's
  // immediate and its selector a register, reloaded ~32 times a chunk.
  uint32_t pair_exps;
  int64_t out_stride;  // elements between rows of out (a slice of a wider tensor when qlinear_into)
  bool tiled;          // W's 16-row groups stored chunk-major (checks.h, kTiled): chunk_start, chunk_map, pair_map
  // regs_kernel only (takes_norm): x read as RMSNorm(x) * norm_w [K] with eps where norm_w is given; out += the
  // product (each rounded as its own op) where accumulate
  const void* norm_w = nullptr;
  float eps = 0.f;
  bool accumulate = false;
};

// Whether qlinear's kernel for qtype at M rows of K reads x's records when it is given them (q4k_x.cuh), on a device
// of compute capability major cc: Q4_K up to 16 rows; at one row Q5_K and Q6_K, and the int8 kernel of the 32-element
// blocks (b32::i8_kernel) where it runs: sm_90 (TMA boxes), K a multiple of 256 (x's records; W's rows and chunks then
// 16-byte aligned) and of a chunk a warp and more, for Q4_0 and Q4_1 past regs_kernel's K (2048: a small model's
// linears). The norms and activations write records only for these (qlinear_reads_records; ops.records_for).
inline bool reads_records(int qt, int64_t M, int64_t K, int cc) {
  if (qt == kQ4_K) return M <= 16;
  if (M != 1) return false;
  if (qt == kQ5_K || qt == kQ6_K) return true;
  const bool b32 = qt == kQ8_0 || qt == kQ4_0 || qt == kQ4_1;
  return b32 && cc >= 9 && K % 256 == 0 && (qt == kQ8_0 ? K >= 256 * kWarps : K > 256 * kWarps);
}

// The most rows of x qlinear takes on W [N, K] of (base) format qt: 32, and 64 for Q4_K and Q6_K (a Q4_K_M file's
// linears) on W of 4096 x 4096 and more, where qtile_kernel's 8 tiles of 8 x rows read W once for 64 rows (past 32
// the others dequantize W into a scratch and run the dense GEMM: W written and read again in fp16 / bf16).
constexpr int kMaxRows = 32, kWideMaxRows = 64;
constexpr bool wide_rows_format(int qt) { return qt == kQ4_K || qt == kQ6_K; }
inline int64_t max_rows(int qt, int64_t N, int64_t K) {
  return wide_rows_format(qt) && N >= 4096 && K >= 4096 ? kWideMaxRows : kMaxRows;
}

// regs_kernel (qlinear_kernels.cuh): the 4- and 5-bit legacy formats with at most kRegChunks 64-k chunks a warp.
constexpr int kRegChunks = 4, kRegMaxK = kWarps * kRegChunks * 64;
constexpr int kLoopChunks = 2;  // regs_kernel walking x's blocks (regs_y_blocks): K up to kWarps * 2 * 64

// Whether regs_kernel's shapes hold: K gives a warp at most kRegChunks chunks, and the grid of 16-row tiles is at
// most 2 CTAs an SM.
inline bool regs_shape(int64_t N, int64_t K, int sms) {
  return (K / 32 + 1) / 2 <= kWarps * kRegChunks && (N + 15) / 16 <= 2 * sms;
}

// regs_kernel's grid along x's blocks of 8 NT rows (of `tiles` CTAs each): every block its CTAs, unless that passes 2
// CTAs an SM, where a CTA walks gridDim.y apart on the same W registers: a second wave's CTAs would start without
// their W (a small model's gate | up at 32 rows: 384 CTAs on the H100's 264 slots).
inline int regs_y_blocks(int64_t tiles, int M, int nt, int sms) {
  const int64_t blocks = (M + 8 * nt - 1) / (8 * nt);
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(blocks, 2 * sms / tiles)));
}

// Whether regs_kernel takes qlinear on M x N x K of (base) format qt with a.norm_w or a.accumulate: up to 8 rows
// (its CTAs' 8 warps norm a row each). At 9-32 rows (two rows a warp) the norm in the launch cost more than its own
// launch (H100, us, norm in the launch / apart: Q4_1 1 x 960 x 576 2.79 / 3.46, 16 x 960 x 576 3.87 / 3.80, 32 x
// 960 x 576 4.21 / 4.02; a SmolLM2-shaped Q4_0 model's batch-32 step 0.845 -> 0.913 ms).
inline bool takes_norm(int qt, int64_t M, int64_t N, int64_t K, int sms) {
  const bool regs_format = qt == kQ4_0 || qt == kQ4_1 || qt == kQ5_0 || qt == kQ5_1;
  return regs_format && M >= 1 && M <= 8 && K % 8 == 0 && regs_shape(N, K, sms);
}

// out = x @ W^T (+ bias) for format QT and activation dtype T, arguments checked (qlinear_launch.cuh).
// records: x's records (q4k_x.cuh) or null.
template <int QT, typename T>
void run(const Args& a, const uint8_t* records, const at::Tensor& x, int sms, int cc, cudaStream_t stream);

// gate | up and its activation (silu, else gelu_tanh) in one launch where a kernel of QT takes it (a.out [M, N / 2];
// out_records: the output's records, or null); false where none does, having launched nothing.
template <int QT, typename T>
bool run_act(const Args& a, bool silu, const uint8_t* x_records, uint8_t* out_records, const at::Tensor& x, int sms,
             int cc, cudaStream_t stream);

}  // namespace minfer::qgemm
