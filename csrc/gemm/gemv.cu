// Small-M (decode) GEMV launch heuristics: which kernel, steps per round (U), CTAs per SM and K split a
// shape gets. The kernels: gemv_tiles.cuh (gemv_kernel, gemv_stream_kernel), gemv_ring.cuh, gemv_m1.cuh.
//
// - M = 1 on small W (every warp one row pair, or a K slice of one): gemv_m1_kernel.
// - M <= 16 on many tiles with K >= 4096 (or 2048 on the largest W; the lm_heads, 28672 x 4096):
//   gemv_ring_kernel.
// - Otherwise the 16-row tiles, launch_best's choice: all CTAs resident at once, equal shares per SM.
// U = 8 puts 8 KB of W in flight per warp, two CTAs of 8 warps per SM 128 KB (U = 4 with three CTAs:
// 96 KB), well past what HBM latency times bandwidth needs (~4.2 TB/s x ~1 us / 132 SMs ~ 32 KB per SM).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <string>
#include <type_traits>

#include "common/checks.h"
#include "common/launch.h"
#include "gemm/gemv_m1.cuh"
#include "gemm/gemv_ring.cuh"
#include "gemm/gemv_tiles.cuh"

namespace minfer::gemm_impl {

// At 9-16 rows of a wide model's W (K and N of 4096 and more) on a card of thin DRAM an SM (thin_dram, under 30 GB/s):
// the 12-warp ring where the tiles are fewer than the many-tiles ring takes (the 8B q | k | v and o), and linear_act's
// activation in the many-tiles ring's epilogue (its gate | up). Alone the ring is slower (H100, 16 x 4096 x 4096 11.6
// -> 13.9 us back to back), but its deep fill before the wait overlaps the kernel before it in the step, and only
// the pair gains there: the 8B bf16 step at 16 x ~1k (bench_throughput), H100, ms, two rounds: 6.837 / 6.841 as
// before, the ring alone 6.808 / 6.797, the activation alone 6.901 / 6.885, both 6.743 / 6.746; on another H100 6.729
// / 6.748 -> 6.613 / 6.620 (85.2-85.4 -> 86.8-87.0% of its roofline). Not on narrower W: the Llama-3.2-1B shape's
// step (its down 2048 x 8192 on the ring, its gate | up's activation in the tiles' epilogue) went 1.202 -> 1.236-1.247
// ms. The H200 (36.5 GB/s an SM) keeps the CTA variants, on which the ring had lost (6144 x 4096 at 16 rows 15.9 ->
// 16.4 us), and the activation's own launch (the Gemma-3-4B step 3.117 -> 3.156 ms fused).
bool gemv_wide_rows(int M, int N, int K, int device) {
  return M > 8 && M <= 16 && K >= 4096 && N >= 4096 && thin_dram(device);
}
bool gemv_act_in_ring(int M, int N, int K, int device, int sms) {  // launch_ring's many tiles, in whole 16-row pairs
  return gemv_wide_rows(M, N, K, device) && (N + 15) / 16 >= int64_t(kWarps) * sms && (N / 2) % 8 == 0;
}

namespace {

// Work per SM, average over heaviest: `per_sm` units spread over the SMs, whole units each.
inline double sm_balance(double per_sm) { return per_sm / std::ceil(per_sm); }

// CTAs per SM of a configuration built for MIN_BLOCKS: what fits, but no more than that. A build that
// needs fewer registers than its cap would otherwise let more in and change the grid (4 per SM
// measures slower where 3 are designed).
template <auto kKernel, int MIN_BLOCKS>
int ctas_per_sm() {
  return std::min(resident_ctas<kKernel, kThreads, 0>(), MIN_BLOCKS);
}

// A configuration's name in a plan: kernel, steps per round, CTAs per SM it is built for.
inline std::string config(const char* kernel, int u, int ctas_per_sm) {
  return std::string(kernel) + " U=" + std::to_string(u) + " " + std::to_string(ctas_per_sm) + "/SM";
}

// Launches a kernel as a programmatic dependent or, given a plan to fill (linear_plan: tests check which
// configuration a shape gets), only describes the launch; `what` makes the text only then.
template <typename What, typename Kernel, typename... Args>
void launch_or_describe(std::string* plan, What what, Kernel kernel, dim3 grid, dim3 block, size_t smem,
                        cudaStream_t stream, Args... args) {
  if (plan != nullptr) {
    *plan = what() + " grid=" + std::to_string(grid.x) + (grid.y > 1 ? "x" + std::to_string(grid.y) : "");
    return;
  }
  launch_pdl(kernel, grid, block, smem, stream, args...);
}

// One compiled shape of gemv_kernel, with how many of its CTAs an SM holds.
template <typename T>
struct Variant {
  void (*launch)(const Params<T, T>&, int ks_log2, dim3 grid, cudaStream_t, std::string* plan);
  int u, per_sm;
};

template <typename T, int NT, int U, int MIN_BLOCKS>
void launch_variant(const Params<T, T>& p, int ks_log2, dim3 grid, cudaStream_t stream, std::string* plan) {
  auto what = [&] { return config("tiles", U, MIN_BLOCKS) + " ks=" + std::to_string(1 << ks_log2); };
  launch_or_describe(plan, what, gemv_kernel<T, NT, U, MIN_BLOCKS>, grid, dim3(kThreads), 0, stream, p, ks_log2);
}

template <typename T, int NT, int U, int MIN_BLOCKS>
Variant<T> variant() {
  static const int per_sm = ctas_per_sm<gemv_kernel<T, NT, U, MIN_BLOCKS>, MIN_BLOCKS>();
  return {&launch_variant<T, NT, U, MIN_BLOCKS>, U, per_sm};
}

// Far more tiles than resident warps (the lm_heads, 28672 x 4096): gemv_stream_kernel<NT, U>, one
// wave whose warps split the tiles evenly, where CTAs of whole tiles would leave SMs with one CTA
// more than others. Returns false where it does not apply: fewer tiles than half the warps, or SMs
// more than ~10% apart.
template <typename T, int NT, int U, int MIN_BLOCKS>
bool launch_stream(const Params<T, T>& p, int sms, cudaStream_t stream, std::string* plan) {
  constexpr auto kernel = gemv_stream_kernel<T, NT, U, MIN_BLOCKS, false>;
  constexpr auto act_kernel = gemv_stream_kernel<T, NT, U, MIN_BLOCKS, NT == 1>;  // up to 8 rows (linear_or_plan)
  static const int per_sm = ctas_per_sm<kernel, MIN_BLOCKS>();
  const int64_t grid = int64_t(per_sm) * sms, tiles = (p.N + 15) / 16;
  if (tiles * 2 < grid * kWarps || sm_balance(double(tiles) / sms) < 0.9) return false;
  MINFER_CHECK(!p.act || NT == 1, "linear_act: the gemv stream applies the activation up to 8 rows");
  launch_or_describe(plan, [] { return config("stream", U, MIN_BLOCKS); }, p.act ? act_kernel : kernel,
                     dim3((unsigned)grid), dim3(kThreads), 0, stream, p);
  return true;
}

// The stream runs fastest when every CTA is resident from the start and the SMs carry equal shares:
// a second, partial wave runs with a fraction of the bytes in flight, and an SM with one CTA more
// than its neighbours finishes last (6144 x 4096 took 17.3 us as 384 CTAs on 264 slots, 14.5 us
// on 396).
// - Where it applies (M <= 8 * NT), gemv_stream_kernel comes first. Its round is U_BIG or U_SMALL
//   steps, whichever leaves fewer slots idle in a tile's last round (U_BIG on a tie): K = 576 is 18
//   steps, 3 rounds of 6 where rounds of 8 idle 6 of 24 slots (1 x 49152 x 576, fp16, H200: CTAs
//   of 4-step rounds 17.3 us, stream of 8-step rounds 17.5, of 6-step rounds 16.1). M 9..16 takes
//   the same rounds with X one step ahead (same call, H200, fp16, against {6, 4} with all of X up
//   front: 16 x 128256 x 4096 264.4 -> 254.6 us, 16 x 128256 x 2048 139.7 -> 134.3, 16 x 49152 x 576
//   19.5 -> 18.9; the CTA variants are slower with it and keep short rounds). That is at 2 CTAs per SM;
//   at K <= 1024 (a tile in a few rounds) rounds of 6 or 4 at 3 CTAs per SM come first (H200, fp16,
//   two passes: 16 x 49152 x 576 17.05-17.15 -> 15.79-15.84 us, 1 x 49152 x 576 15.43 -> 15.08-15.11;
//   at K >= 2048 they are equal or slower, 8 x 128256 x 2048 127.0-127.6 -> 136.0-136.4,
//   8 x 28672 x 4096 57.4-57.7 -> 62.0-62.4).
// - Otherwise, among the variants (first = preferred) and K splits, keep the configurations whose
//   CTAs all fit at once, whose heaviest SM carries at most ~10% more than the average and whose
//   warps get at least one full round; take the one with the most CTAs (on a tie, the longer rounds).
// - The rest (too few tiles to balance) take the smallest K split that gives every SM about two CTAs,
//   on the first variant whose CTAs then all fit at once: 3072 x 2048 takes KS = 8 (192 CTAs of one
//   tile); three 16-row blocks of 3072 x 576 take 288 CTAs of 3 per SM in one wave, where 2 per SM
//   run 264 + 24 (H200, fp16: 37 x 3072 x 576 6.9 -> 5.5 us, M = 33..48 alike; no other shape of the
//   decode sweep or of M 17..64 on small W moved).
// With p.act (linear_act: up to 8 rows, past 16 on small W, or gemv_act_in_ring) every kernel here applies it in
// its epilogue (see w_row).
template <typename T, int NT, int U_BIG, int U_SMALL>
void launch_best(const Params<T, T>& p, int sms, std::initializer_list<Variant<T>> variants, cudaStream_t stream,
                 std::string* plan) {
  const int64_t grid_y = (p.M + 8 * NT - 1) / (8 * NT);  // gemv_kernel: a CTA per 8 * NT rows of A
  if (grid_y > 65535) {  // more blocks of A rows than grid.y holds: one launch per 65535 of them
    for (int64_t m0 = 0; m0 < p.M; m0 += 65535 * 8 * NT) {
      Params<T, T> part = p;
      part.A += m0 * p.sam, part.D += m0 * p.ldd, part.C = p.C ? p.C + m0 * p.ldc : nullptr;
      part.M = (int)std::min<int64_t>(p.M - m0, 65535 * 8 * NT);
      launch_best<T, NT, U_BIG, U_SMALL>(part, sms, variants, stream, plan);
    }
    return;
  }
  const int64_t tiles = (p.N + 15) / 16, steps = (p.K / 8 + 3) / 4;  // 16-row tiles, 32-wide k steps
  if (grid_y == 1) {
    auto idle = [&](int u) { return (steps + u - 1) / u * u - steps; };
    if (steps <= 32 && (idle(6) <= idle(4) ? launch_stream<T, NT, 6, 3>(p, sms, stream, plan)
                                           : launch_stream<T, NT, 4, 3>(p, sms, stream, plan)))
      return;
    if (idle(U_BIG) <= idle(U_SMALL) ? launch_stream<T, NT, U_BIG, 2>(p, sms, stream, plan)
                                     : launch_stream<T, NT, U_SMALL, 2>(p, sms, stream, plan))
      return;
  }
  auto ctas = [&](int l) { return (tiles + (kWarps >> l) - 1) / (kWarps >> l) * grid_y; };
  const Variant<T>* best = nullptr;
  int best_ks = 0;
  int64_t best_ctas = 0;
  for (const Variant<T>& v : variants) {
    for (int l = 0; (kWarps >> l) >= 1; ++l) {
      const int64_t n = ctas(l);
      if (n > int64_t(v.per_sm) * sms || sm_balance(double(n) / sms) < 0.9 || (steps >> l) < v.u) continue;
      if (n > best_ctas || (n == best_ctas && v.u > best->u)) best = &v, best_ks = l, best_ctas = n;
    }
  }
  if (best == nullptr) {  // the first variant whose CTAs then all fit at once, else the first
    while (best_ks < 3 && ctas(best_ks) < 2 * sms) ++best_ks;
    best = variants.begin();
    for (const Variant<T>& v : variants)
      if (ctas(best_ks) <= int64_t(v.per_sm) * sms) {
        best = &v;
        break;
      }
  }
  const int64_t grid_x = (tiles + (kWarps >> best_ks) - 1) / (kWarps >> best_ks);
  best->launch(p, best_ks, dim3((unsigned)grid_x, (unsigned)grid_y), stream, plan);
}

// Many tiles (8 or more per SM, where gemv_stream_kernel would run) at M <= 16 with K >= 4096, or
// K >= 2048 where CTAs take whole tiles (the lm_heads, 28672 x 4096): gemv_ring_kernel, one wave.
// Against gemv_stream_kernel, same runs (H200, fp16, us): 1 x 128256 x 4096 249.6 -> 237.6-243,
// 1 x 28672 x 4096 60.7-61.2 -> 57.6-58.5, 1 x 25344 x 4096 54.6 -> 52.1-52.4, 1 x 16896 x 4096
// 38.4 -> 36.4, 4 x 28672 x 4096 60.8 -> 59.2-60.1, 1 x 128256 x 2048 127.0-127.3 -> 123.7-125.9;
// with the slot refilled before the mmas and R = 32 above M = 4: 8 x 128256 x 4096
// 247.1 -> 239.8, 8 x 28672 x 4096 57.0 -> 54.0, 8 x 128256 x 2048 127.3 -> 122.8, 16 x 128256 x 2048
// 132.6 -> 128.5, 16 x 128256 x 4096 254.5 -> 253.2, 16 x 28672 x 4096 58.8 -> 58.0.
// Not at K = 2048 with row ranges (8 stages per tile: 16896 rows 19.4 -> 20.3, 21120 rows 23.4 ->
// 23.8-24.1, 32768 rows 35.3-35.5 -> 35.6), K = 576 (16.1 -> 17.4), nor on the few-tile shapes, where
// a CTA holds a tile or two and reads all of X for it (16 x 6144 x 4096 16.0 -> 17.3, 16 x 4096 x 14336
// 32.9 -> 47.7). There, one 12-warp CTA per SM on W of 2^25 elements or more, up to M = 8 or at
// K >= 8192 (H200, fp16, us, against the tiles kernel in the same run: 1 x 16384 x 2048 17.7 -> 16.8,
// 8 x 16384 x 2048 18.3 -> 17.7, 8 x 4096 x 14336 30.6 -> 29.5, 8 x 14336 x 4096 32.0 -> 29.1,
// 16 x 4096 x 14336 33.0 -> 31.7; slower at 16 x 16384 x 2048 18.3 -> 19.4, 6144 x 4096 (M = 1, 8, 16)
// 13.5 -> 14.0, 14.0 -> 14.7, 15.9 -> 16.4, and 19-60% on the 34 MB and smaller shapes), which keep the
// other kernels. Returns false where the ring does not apply.
template <typename T, int R, int NT, int WARPS>
bool launch_ring_with(const Params<T, T>& p, int sms, cudaStream_t stream, std::string* plan) {
  // The activation in the epilogue up to 8 rows (NT = 1), and at 9-16 in the many-tiles ring (R = 32, 4 warps) where
  // gemv_act_in_ring says so (see linear_or_plan): no kAct build of the others.
  constexpr bool kActBuild = NT == 1 || (R == 32 && WARPS == 4);
  constexpr auto kernel = gemv_ring_kernel<T, R, NT, WARPS, false>;
  constexpr auto act_kernel = gemv_ring_kernel<T, R, NT, WARPS, kActBuild>;
  constexpr int smem = ring_smem_bytes(WARPS);
  static const int per_sm = [&] {
    allow_smem<kernel, smem>();
    allow_smem<act_kernel, smem>();
    int n = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, WARPS * 32, smem));
    return std::max(n, 1);
  }();
  const int64_t grid = std::min<int64_t>((p.N + 15) / 16, int64_t(per_sm) * sms), tiles = (p.N + R - 1) / R;
  // CTA ranges in whole tiles where a CTA has 8 or more (one tile more or less is then at most an
  // eighth of a CTA's work), else to the row, which costs every CTA one short tile whose stages hold
  // fewer bytes (H200, us, tiles / rows: 1 x 128256 x 4096 243 / 249, 1 x 28672 x 4096 58.7 / 58.3,
  // 4 x 28672 x 4096 60.6 / 59.7).
  const int granule = tiles >= 8 * grid ? R : 1;
  if (WARPS == 4 && p.K < 4096 && granule == 1) return false;  // K = 2048 gains only in whole tiles (see above)
  const int range_granule = p.act ? std::max(granule, 16) : granule;  // whole tiles of w_row's order
  auto what = [&] {
    return "ring R=" + std::to_string(R) + (WARPS == 4 ? "" : " 12 warps") + " granule=" +
           std::to_string(range_granule);
  };
  MINFER_CHECK(!p.act || kActBuild, "linear_act: the gemv ring applies the activation up to 8 rows, and at 9-16 in ",
               "the many-tiles ring");
  launch_or_describe(plan, what, p.act ? act_kernel : kernel, dim3((unsigned)grid), dim3(WARPS * 32), smem, stream, p,
                     range_granule);
  return true;
}

// Whether a 12-warp CTA's rings fit in one block's shared memory (Hopper: 227 KB; sm_80 164 KB, sm_86 /
// sm_89 99 KB), looked up once like the configurations above.
inline bool twelve_warp_rings_fit() {
  static const bool fit = [] {
    int device = 0, optin = 0;
    C10_CUDA_CHECK(cudaGetDevice(&device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    return optin >= ring_smem_bytes(12);
  }();
  return fit;
}

template <typename T>
bool launch_ring(const Params<T, T>& p, int sms, cudaStream_t stream, std::string* plan) {
  if (p.M > 16 || p.K < 2048) return false;
  if ((p.N + 15) / 16 >= int64_t(kWarps) * sms) {  // many tiles: three 4-warp CTAs per SM
    if (p.M <= 4) return launch_ring_with<T, 16, 1, 4>(p, sms, stream, plan);
    if (p.M <= 8) return launch_ring_with<T, 32, 1, 4>(p, sms, stream, plan);
    return launch_ring_with<T, 32, 2, 4>(p, sms, stream, plan);
  }
  if (gemv_wide_rows(p.M, p.N, p.K, c10::cuda::current_device()) && twelve_warp_rings_fit())
    return launch_ring_with<T, 16, 2, 12>(p, sms, stream, plan);
  // Few tiles on a large W (2^25 elements, 64 MB at 16 bits, or more), up to M = 8 or with K >= 8192:
  // one 12-warp CTA per SM.
  if (int64_t(p.N) * p.K < (int64_t{1} << 25) || (p.M > 8 && p.K < 8192) || !twelve_warp_rings_fit()) return false;
  if (p.M <= 8) return launch_ring_with<T, 16, 1, 12>(p, sms, stream, plan);
  return launch_ring_with<T, 16, 2, 12>(p, sms, stream, plan);
}

}  // namespace

// M = 1 and few rows: gemv_m1_kernel when every resident warp can take one pair (or one K slice of
// one) in at most two rounds, with the smallest K split that keeps 90% of the warps busy while each
// still gets a full round. Measured against the 16-row tiles (H200, fp16, us): 4096 x 4096 10.5 ->
// 10.2, 2048 x 8192 11.4 -> 10.7, 3072 x 2048 5.8 -> 5.4; but where warps take several pairs or
// long slices the 16-row tiles stream faster (6144 x 4096 13.9 -> 14.6, 4096 x 14336 30.3 -> 30.9,
// 128256 x 4096 246 -> 257), so those keep them.
// Two configurations: 4-step rounds at 4 CTAs per SM (<= 64 registers) where 90% of those warps each
// get two full rounds (the 34 MB shapes: 4096 x 4096 10.32 -> 9.78 us, 2048 x 8192 10.45 -> 9.89,
// H200, fp16, two passes in one call: the same bytes in flight per SM as 8-step rounds at 2 CTAs per
// SM, in twice as many warps, so the bytes in flight dip less while a warp turns a round around);
// otherwise 8-step rounds at 2 CTAs per SM (at one 4-step round per warp the 4-CTA form is equal or
// slower: 2048 x 2048 3.61 -> 3.80, 4096 x 2048 5.66 -> 5.78). Returns false where it does not apply.
template <typename T, int U, int MIN_BLOCKS, bool TWO_FULL_ROUNDS>
bool launch_gemv_m1(const Params<T, T>& p, int sms, cudaStream_t stream, std::string* plan) {
  if (p.M != 1) return false;
  static const int per_sm = ctas_per_sm<gemv_m1_kernel<T, U, MIN_BLOCKS>, MIN_BLOCKS>();
  const int64_t resident = int64_t(per_sm) * sms, steps = (p.K / 8 + 31) / 32;
  const int64_t pairs = p.act ? p.N / 2 : (p.N + 1) / 2;  // with p.act a gate row and its up row
  int l = 0;
  while (l < 3 && (pairs << l) * 10 < resident * kWarps * 9 && (steps >> (l + 1)) >= U) ++l;
  if (steps < U || (pairs << l) > resident * kWarps || (steps >> l) > 2 * U) return false;
  if (TWO_FULL_ROUNDS && ((steps >> l) != 2 * U || (pairs << l) * 10 < resident * kWarps * 9)) return false;
  const int64_t grid = std::min<int64_t>(resident, ((pairs << l) + kWarps - 1) / kWarps);
  auto what = [&] { return config("m1", U, MIN_BLOCKS) + " ks=" + std::to_string(1 << l); };
  launch_or_describe(plan, what, gemv_m1_kernel<T, U, MIN_BLOCKS>, dim3((unsigned)grid), dim3(kThreads), 0, stream, p,
                     l);
  return true;
}

template <typename T>
void launch_gemv(const Params<T, T>& p, cudaStream_t s, int sms, std::string* plan) {
  // Per warp in flight: U steps of 16 rows x 64 bytes. U = 8 (<= 128 registers): 2 CTAs per SM;
  // U = 4 (<= 80): 3. (16-warp CTAs, one per SM, gain nothing at 2048 x 8192: 11.6 us either way.)
  if (launch_gemv_m1<T, 4, 4, true>(p, sms, s, plan) || launch_gemv_m1<T, 8, 2, false>(p, sms, s, plan)) return;
  if (launch_ring<T>(p, sms, s, plan)) return;
  if (p.M <= 8)
    launch_best<T, 1, 8, 6>(p, sms, {variant<T, 1, 8, 2>(), variant<T, 1, 4, 3>()}, s, plan);
  else  // two n8 tiles: shorter rounds for the X registers, except in the stream (see launch_best). 4-step
        // rounds at 3 CTAs per SM (X one step ahead, within 80 registers) where 2-step rounds would be
        // the only ones whose CTAs all fit (384 CTAs of KS = 8 at 6144 x 4096; H200, fp16, us: 16 x 6144 x 4096
        // 16.05-16.09 -> 15.76-15.82, 12 x 6144 x 4096 15.46-15.50 -> 15.23-15.33).
    launch_best<T, 2, 8, 6>(p, sms, {variant<T, 2, 4, 2>(), variant<T, 2, 2, 3>(), variant<T, 2, 4, 3>()}, s, plan);
}
template void launch_gemv<__half>(const Params<__half, __half>&, cudaStream_t, int, std::string*);
template void launch_gemv<__nv_bfloat16>(const Params<__nv_bfloat16, __nv_bfloat16>&, cudaStream_t, int, std::string*);

}  // namespace minfer::gemm_impl
