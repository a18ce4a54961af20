// The GEMM family's internal interface: one problem description shared by every kernel path.
//
// Every path computes D[M, N] = alpha * A . B^T + bias[n] + beta * C[m, n]
// with A(m, k) = A[m * sam + k * sak] and B(n, k) = B[n * sbn + k * sbk] (B is "weight-like":
// linear's W [out, in] is B with sbn = in, sbk = 1). Accumulation is fp32 (int32 for int8).
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

#include <string>

namespace minfer::gemm_impl {

// A gated activation in the epilogue (linear_act; the gemv kernels up to 8 rows or past 16, the sm90 small-M
// kernel at 32-64): B's rows are gate [N / 2] then up [N / 2], and D is [M, N / 2] = act(gate) * up, each
// rounded to Out first as a separate launch would.
enum Act : int { kActNone = 0, kActSilu = 1, kActGeluTanh = 2 };

template <typename T, typename Out>
struct Params {
  const T* A;
  int64_t sam, sak;
  const T* B;
  int64_t sbn, sbk;
  Out* D;  // [M, N], row stride ldd
  int64_t ldd;
  const Out* bias;  // [N] or nullptr
  const Out* C;     // [M, N] row stride ldc, or nullptr (then beta is ignored)
  int64_t ldc;
  float alpha, beta;
  int M, N, K;
  // B is not written by any kernel that may still be running when this one starts (a model's weights):
  // the gemv and sm90 small-M kernels then start loading it before griddepcontrol.wait.
  bool static_b = false;
  int act = kActNone;  // Act
};

// Host launchers, one per path (explicitly instantiated in their .cu files).
// T is __half or __nv_bfloat16 unless said otherwise.
template <typename T, typename Out> void launch_wmma(const Params<T, Out>& p, cudaStream_t s);  // any strides
// sak = sbk = 1, 16B rows. splits > 1: split-K through ws (fp32, splits * M * N), see sm80_split_k.
template <typename T> void launch_sm80(const Params<T, T>& p, cudaStream_t s, float* ws, int splits);
int sm80_split_k(int M, int N, int K, int sms);
void launch_sm80_int8(const Params<int8_t, int32_t>& p, cudaStream_t s);      // K % 16 == 0, 16B rows
// sak = sbk = 1, 16B rows. plan != nullptr: nothing runs; *plan says which kernel and configuration would.
template <typename T> void launch_gemv(const Params<T, T>& p, cudaStream_t s, int sms, std::string* plan = nullptr);
// gemv at 9-16 rows of a wide model's W (K and N of 4096 and more) on a card whose DRAM gives an SM under 30 GB/s (the
// H100; see gemv.cu): the 12-warp ring where the tiles are fewer than the many-tiles ring takes (gemv_wide_rows), and
// linear_act's activation in the many-tiles ring's epilogue (gemv_act_in_ring; N: gate | up's rows).
bool gemv_wide_rows(int M, int N, int K, int device);
bool gemv_act_in_ring(int M, int N, int K, int device, int sms);
constexpr int kSm90SmallMAll = 128, kSm90SmallM = 192;
// Whether launch_sm90 runs the small-M kernel: every M <= kSm90SmallMAll, and M <= kSm90SmallM where K is
// long (see there).
bool sm90_small_m(int M, int N, int K);
// Whether the small-M kernel applies linear_act's activation: M 32-64 rows, gate | up of N / 2 % 8 == 0 rows.
bool sm90_small_m_act(int M, int N);
struct Sm90SmallM {
  int bn;              // activation rows per tile: the smallest of 8, 16, 32, 64, 128, 144, 192 >= M
  int grid;            // CTAs, one per SM at most
  int64_t tiles;       // tiles of W: the counters needed
  int64_t ws_floats;   // workspace: grid x 2 partial tiles of 128 x bn (0 where a tile is one cluster)
  int splits;          // split-K: CTAs a tile (grid = tiles x splits); 1: stream-K
  int cluster;         // split-K in clusters of this many CTAs summing through shared memory (splits, or 2); 1: none
  int w_rows = 128;    // W rows a tile: 128, or 64 (one consumer warpgroup, a whole tile a CTA or split K in whole
                       // clusters, no workspace; bn 16 at least)
};
// plain: a plan for the plain linear's epilogue (no activation, no C), which alone takes 64-row W tiles.
Sm90SmallM sm90_small_m_plan(int M, int N, int K, int sms, bool plain = false);
// The persistent sm90 kernel's tiles (M > 128 outside sm90_small_m): 128 x bn, one CTA an SM at most; where they
// fill at most half the SMs, split-K in clusters of `splits` CTAs a tile summing through shared memory.
struct Sm90Persistent {
  int bn;         // 128, 144 or 256
  int64_t tiles;  // 128 x bn output tiles
  int splits;     // CTAs a tile (grid = tiles x splits, clusters of splits); 1: none
  int grid;
};
Sm90Persistent sm90_persistent_plan(int M, int N, int K, int sms);
// sm90, sak = sbk = 1, 16B rows. small (sm90_small_m_plan's, where sm90_small_m): W as the wgmma M operand,
// stream-K (or split-K) over at most sms CTAs, with the fp32 workspace and the zeroed per-tile counters the plan
// sizes (split-K in clusters needs neither); null: persistent (sm90_persistent_plan; ws and counters unused).
template <typename T>
void launch_sm90(const Params<T, T>& p, cudaStream_t s, int sms, const Sm90SmallM* small, float* ws, int* counters);
void launch_simt(const Params<float, float>& p, cudaStream_t s);               // any strides

}  // namespace minfer::gemm_impl
