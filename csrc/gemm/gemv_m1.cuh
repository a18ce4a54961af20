// gemv_m1_kernel: M = 1 on small W, two W rows per warp read in 512-byte runs (see launch_gemv_m1 in
// gemv.cu); with p.act a gate row and its up row, so that the warp stores act(gate) * up.
#pragma once
#include <type_traits>

#include "gemm/gemv_common.cuh"

namespace minfer::gemm_impl {
namespace {

// M = 1: W rows in pairs, each read in long runs. The 16 A rows of the mma are two W rows cut into
// 8 segments of 32 elements (fragment rows g and g + 8: segment g of rows n0 and n0 + 1), and the 8 B
// columns are the same 8 segments of x, so the wanted sums are the diagonals D[g][g] and D[g + 8][g]
// (the other 112 products are wasted; the tensor cores have the room). A k step is then 256 elements:
// each load instruction of the warp reads 512 contiguous bytes of one row, and a round of U steps
// 4 KB of each of two rows, where the 16-row tiles read 512 bytes of each of 16 rows. Warps in
// groups of KS = 2^ks_log2 split K; the groups of the grid take equal contiguous ranges of pairs
// (at most one pair apart), and a group meets in shared memory per pair. MIN_BLOCKS caps the registers
// so that that many CTAs fit on an SM.
template <typename T, int U, int MIN_BLOCKS>
__global__ void __launch_bounds__(kThreads, MIN_BLOCKS) gemv_m1_kernel(const Params<T, T> p, int ks_log2) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int ks = 1 << ks_log2, split = warp & (ks - 1), group_in_cta = warp >> ks_log2;
  const int64_t groups = (int64_t)gridDim.x * (kWarps >> ks_log2);
  const int64_t group = (int64_t)blockIdx.x * (kWarps >> ks_log2) + group_in_cta;
  const int half = p.N / 2;
  const int64_t pairs = p.act ? half : (p.N + 1) / 2;
  const int pr_begin = (int)(group * pairs / groups), pr_end = (int)((group + 1) * pairs / groups);
  const int chunks = p.K / 8, steps = (chunks + 31) / 32, c = 4 * g + t;  // c: this thread's chunk of a step
  const int s_begin = (split * steps) >> ks_log2, s_end = ((split + 1) * steps) >> ks_log2;

  const uint4* const xp[1] = {reinterpret_cast<const uint4*>(p.A) + c};
  const bool x_ok[1] = {true};
  __shared__ float partial[2][kWarps][2];  // [pair parity][warp][row of the pair]
  uint4 pre_a[U], pre_b[U];
  // One pair of W rows (with p.act gate row pr and its up row, half rows on); `preloaded`: its first round is
  // in pre_a / pre_b (then it waits for the grid).
  auto w_pair = [&](int pr, int parity, auto preloaded) {
    const int n0 = p.act ? pr : 2 * pr, n1 = p.act ? half + pr : n0 + 1;
    const bool b_ok = n1 < p.N;
    const uint4* wa = reinterpret_cast<const uint4*>(p.B + (int64_t)n0 * p.sbn) + c;
    const uint4* wb = reinterpret_cast<const uint4*>(p.B + (int64_t)(b_ok ? n1 : n0) * p.sbn) + c;
    float acc[1][4] = {{0.f, 0.f, 0.f, 0.f}};
    if constexpr (decltype(preloaded)::value) {
      load_w_round<U, 32>(pre_a, pre_b, wa, wb, true, b_ok, s_begin, s_end, chunks, c);
      wait_for_previous_grid();
      accumulate_from<T, 1, U, 32>(acc, pre_a, pre_b, wa, wb, true, b_ok, xp, x_ok, s_begin, s_end, chunks, c);
    } else {
      accumulate<T, 1, U, 32>(acc, wa, wb, true, b_ok, xp, x_ok, s_begin, s_end, chunks, c);
    }
    // Thread (g, t) holds D[g][2t + e] in acc[e] and D[g + 8][2t + e] in acc[2 + e]: the diagonal is
    // at t = g / 2, e = g % 2.
    const bool diag = t == (g >> 1), odd = g & 1;
    float r0 = diag ? (odd ? acc[0][1] : acc[0][0]) : 0.f, r1 = diag ? (odd ? acc[0][3] : acc[0][2]) : 0.f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      r0 += __shfl_xor_sync(0xffffffffu, r0, o);
      r1 += __shfl_xor_sync(0xffffffffu, r1, o);
    }
    if (ks > 1) {
      // Alternate buffers per pair: a warp writes this parity again only after the next pair's
      // barrier, which the group's first warp reaches after reading it.
      if (lane == 0) partial[parity][warp][0] = r0, partial[parity][warp][1] = r1;
      named_bar_sync(1 + group_in_cta, 32 * ks);
      if (split != 0) return;
      r0 = r1 = 0.f;
      for (int w = 0; w < ks; ++w) r0 += partial[parity][warp + w][0], r1 += partial[parity][warp + w][1];
    }
    if (lane == 0) {
      if (p.act) {
        store_gated(p, 0, pr, r0, r1);
        return;
      }
      store_out(p, 0, n0, r0);
      if (b_ok) store_out(p, 0, n1, r1);
    }
  };
  // A static W: the first pair's first round loads before the wait (the same for the warps of a
  // group, which meet at a barrier per pair; a warp with no K slice loads nothing).
  int pr = pr_begin, parity = 0;
  if (p.static_b && pr < pr_end) {
    w_pair(pr++, parity, std::true_type{});
    parity ^= 1;
  } else {
    wait_for_previous_grid();
  }
  for (; pr < pr_end; ++pr, parity ^= 1) w_pair(pr, parity, std::false_type{});
}

}  // namespace
}  // namespace minfer::gemm_impl
