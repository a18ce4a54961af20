// sm_90a production path: wgmma (m64n256k16, m64n128k16 or m64n144k16) fed by TMA
// (cp.async.bulk.tensor) through a 4-stage mbarrier pipeline, warp-specialized, persistent.
//
// Block tile 128 (M) x BN (N) x 64 (K), BN = 256 (128 where fewer rounds of tiles result, 144 where
// that tiles N exactly and 256 would pad; see launch_sm90), 384 threads = 3 warpgroups: warpgroup 0
// is the producer (one thread issues the TMA copies; setmaxnreg gives its registers to the others),
// warpgroups 1 and 2 each own 64 rows x BN columns of the tile (BN / 2 fp32 accumulators per thread)
// and run wgmma on shared-memory descriptors. A stage is A 128 x 64 (16 KB) + B BN x 64 (32 KB at 256), 4 stages = 192 KB.
// TMA writes each tile as rows of 128 bytes with the 128-byte swizzle (16-byte chunk c of row r
// stored at c ^ (r % 8)), which is exactly the K-major SWIZZLE_128B layout wgmma reads: core-matrix
// groups of 8 rows x 128 B, 1024 B apart (SBO). Advancing K by 16 elements inside the 64-wide tile
// is a +32 B start address.
// Persistent: min(tiles, SMs) CTAs each walk tiles blockIdx.x, + gridDim.x, ... in a grouped order
// (tile_origin); the mbarrier ring runs on across tiles, so the producer loads the next tile while
// the consumers store this one. Where the tiles fill at most half the SMs (M 129-256 on narrow W), a tile's
// K is split over a cluster of 2-4 CTAs that sum through distributed shared memory (sm90_persistent_plan).
// Epilogue: alpha, bias and beta * C are applied in fp32 in registers (epilogue_value; the C term is
// compiled only into the kernels launched with a C), the rounded outputs go through a small swizzled
// shared buffer per consumer warpgroup (not the pipeline stages, which the producer is already
// refilling) and leave as coalesced 16-byte stores.
// Out-of-bounds rows/columns are zero-filled by TMA; the epilogue stores with bounds checks.
// M <= 128 (decode batches, short prompts), and M <= 192 on long K (sm90_small_m), runs small_m_kernel
// instead: the same pipeline with the weight as the wgmma M operand and the iteration space split over
// the SMs along K (see there).
// Requirements (checked by the dispatcher): K % 8 == 0, row strides % 8 == 0, 16-byte aligned bases.
#include "common/checks.h"
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <string>
#include <type_traits>

#include "common/launch.h"
#include "common/ptx.cuh"
#include "common/sm90.cuh"
#include "gemm/epilogue.h"

namespace minfer::gemm_impl {
namespace {

// BN (the N tile) is 256, or 128 where 256-wide tiles would leave SMs idle (launch_sm90).
constexpr int kBM = 128, kBK = 64, kStages = 4, kThreads = 384;
constexpr int kATileBytes = kBM * kBK * 2;  // 128 rows x 128 B = 16 KB
template <int BN>
constexpr int stage_bytes() {
  return kATileBytes + BN * kBK * 2;  // + B: BN rows x 128 B (32 KB for BN = 256)
}
// Epilogue staging: each consumer warpgroup writes its 64 x BN outputs in chunks of 64 x 64 (8 KB of
// 16-bit values), double-buffered, after the pipeline stages. BN = 256: 4 x 48 + 2 x 2 x 8 = 224 KB
// (+ 1 KB alignment slack) of the 227 KB a block may have.
constexpr int kEpiBufBytes = 64 * 128;
template <int BN>
constexpr int epi_cols() {
  return BN % 64 == 0 ? 64 : 48;  // BN = 144: three chunks of 48 columns (96 B of each 128 B row)
}
template <int BN>
constexpr int smem_bytes() {
  return kStages * stage_bytes<BN>() + 2 * 2 * kEpiBufBytes + 1024;
}
static_assert(smem_bytes<256>() + 64 <= 232448, "over the 227 KB of shared memory a block may have");

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Register split (setmaxnreg): the producer needs few, a consumer thread holds up to 128 accumulators.
// 128 x 40 + 256 x 232 = 64512 = the 168 per thread that __launch_bounds__(384, 1) grants at entry.
constexpr int kProducerRegs = 40, kConsumerRegs = 232;
constexpr int kGroupM = 16;  // tile-order group height in M tiles (see tile_origin)

// The mbarrier / TMA / wgmma / setmaxnreg wrappers (ptx.cuh, sm90.cuh), shared with the attention kernels.
using namespace ::minfer::ptx;
using namespace ::minfer::sm90;

// Shared-memory descriptor of a K-major 128-byte-swizzled tile: 8-row groups 1024 B apart.
__device__ __forceinline__ uint64_t make_desc(uint32_t addr) { return desc_sw128(addr, 16, 1024); }

// D[64 x N] += A[64 x 16] . B[N x 16]^T, both operands from shared memory (scale-d = 1), N = 8 .. 256
// (the wide tiles of the main kernel: 256, 128, 144; the activation tiles of the small-M kernel). Operands:
// the N / 2 accumulators, then the two descriptors, then the scale-d flag (the shared macro, sm90.cuh).
#define MINFER_GEMM_WGMMA(shape, dregs, descs, scale, ...)                                                  \
  MINFER_WGMMA_T(T, shape, dregs, descs, scale, "1, 1, 0, 0", ("l"(desc_a), "l"(desc_b), "r"(1)), __VA_ARGS__)

template <typename T, int N>
__device__ __forceinline__ void wgmma_m64k16(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b) {
  static_assert(N == 8 || N == 16 || N == 32 || N == 64 || N == 128 || N == 144 || N == 192 || N == 256);
  if constexpr (N == 256) { MINFER_GEMM_WGMMA("m64n256k16", MINFER_WGMMA_D128, "%128, %129", "%130", MINFER_WGMMA_ACC128(d)); }
  else if constexpr (N == 192) { MINFER_GEMM_WGMMA("m64n192k16", MINFER_WGMMA_D96, "%96, %97", "%98", MINFER_WGMMA_ACC96(d)); }
  else if constexpr (N == 144) { MINFER_GEMM_WGMMA("m64n144k16", MINFER_WGMMA_D72, "%72, %73", "%74", MINFER_WGMMA_ACC72(d)); }
  else if constexpr (N == 128) { MINFER_GEMM_WGMMA("m64n128k16", MINFER_WGMMA_D64, "%64, %65", "%66", MINFER_WGMMA_ACC64(d)); }
  else if constexpr (N == 64) { MINFER_GEMM_WGMMA("m64n64k16", MINFER_WGMMA_D32, "%32, %33", "%34", MINFER_WGMMA_ACC32(d)); }
  else if constexpr (N == 32) { MINFER_GEMM_WGMMA("m64n32k16", MINFER_WGMMA_D16, "%16, %17", "%18", MINFER_WGMMA_ACC16(d)); }
  else if constexpr (N == 16) { MINFER_GEMM_WGMMA("m64n16k16", MINFER_WGMMA_D8, "%8, %9", "%10", MINFER_WGMMA_ACC8(d)); }
  else { MINFER_GEMM_WGMMA("m64n8k16", MINFER_WGMMA_D4, "%4, %5", "%6", MINFER_WGMMA_ACC4(d)); }
}

// Persistent tile order: groups of kGroupM M-tiles walk their N-tiles with M fastest, so the CTAs
// running at one time cover about 16 x 8 tiles (2048 x 2048 outputs): every A and B panel they read
// is shared by 8-16 of them through L2.
template <int BN>
__device__ __forceinline__ void tile_origin(int t, int num_m, int num_n, int& m0, int& n0) {
  const int per_group = kGroupM * num_n, group = t / per_group, r = t - group * per_group;
  const int first = group * kGroupM, rows = min(kGroupM, num_m - first);
  m0 = (first + r % rows) * kBM;
  n0 = (r / rows) * BN;
}

// One ring position: stage s of an S-stage pipeline and the parity its barriers complete with this pass.
template <int S>
struct Ring {
  int s = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void next() {
    if (++s == S) s = 0, phase ^= 1;
  }
};

#endif  // sm_90a

// splits > 1 (split-K, where the tiles fill at most half the SMs; launch_sm90): the grid is tiles x splits CTAs in
// clusters of `splits`, one unit each; rank q of a tile's cluster runs K steps [q num_k / S, (q + 1) num_k / S), leaves
// its partial sums in its drained ring, and after a cluster barrier sums its own column chunks over the cluster in
// rank order (so the sum does not depend on who adds) and stores them.
template <typename T, int BN, bool kWithC>
__global__ void __launch_bounds__(kThreads, 1)
    wgmma_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                 const Params<T, T> p, const int split_k) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const int splits = BN <= 144 ? split_k : 1;  // BN = 256 is never split (launch_sm90) and has no registers to spare
  extern __shared__ uint8_t smem_raw[];
  __shared__ __align__(8) uint64_t full[kStages], empty[kStages];
  const uint32_t base = (smem_addr(smem_raw) + 1023) & ~1023u;  // swizzled tiles need 1024 B alignment
  const int num_m = (p.M + kBM - 1) / kBM, num_n = (p.N + BN - 1) / BN, num_tiles = num_m * num_n;
  const int num_k = (p.K + kBK - 1) / kBK, num_units = num_tiles * splits;
  const int wg = threadIdx.x / 128, tid_wg = threadIdx.x % 128;

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(smem_addr(&full[s]), 1);   // the producer's expect_tx arrival (+ TMA bytes)
      mbar_init(smem_addr(&empty[s]), 2);  // one arrival per consumer warpgroup
    }
    mbar_init_fence();
  }
  __syncthreads();

  // Producer and consumers walk the same tiles (t = blockIdx.x, + gridDim.x, ...) and the same K
  // steps, so their ring positions stay in step across tiles: the producer fills the next tile's
  // first stages while the consumers are still in this tile's epilogue.
  if (wg == 0) {  // producer
    setmaxnreg_dec<kProducerRegs>();
    if (tid_wg == 0) {
      Ring<kStages> ring;
      for (int u = blockIdx.x; u < num_units; u += gridDim.x) {
        int m0, n0;
        tile_origin<BN>(u / splits, num_m, num_n, m0, n0);
        const int q = u % splits;
        for (int kt = q * num_k / splits; kt < (q + 1) * num_k / splits; ++kt, ring.next()) {
          // First pass over the ring: parity 1 of a fresh barrier counts as complete.
          mbar_wait(smem_addr(&empty[ring.s]), ring.phase ^ 1);
          const uint32_t bar = smem_addr(&full[ring.s]);
          mbar_expect_tx(bar, stage_bytes<BN>());  // TMA counts the whole box, zero-filled parts too
          const uint32_t sa = base + ring.s * stage_bytes<BN>();
          tma_load_2d(sa, &map_a, bar, kt * kBK, m0);
          tma_load_2d(sa + kATileBytes, &map_b, bar, kt * kBK, n0);
        }
      }
    }
  } else {
    // consumers: warpgroup c = wg - 1 owns tile rows [64 c, 64 c + 64) and all BN columns
    setmaxnreg_inc<kConsumerRegs>();
    const int c = wg - 1;
    const int warp = tid_wg / 32, lane = tid_wg % 32, g = lane / 4, t4 = lane % 4;
    uint8_t* epi = smem_raw + (base - smem_addr(smem_raw)) + kStages * stage_bytes<BN>() + c * 2 * kEpiBufBytes;
    const bool vec_ok = p.ldd % 8 == 0 && (reinterpret_cast<uintptr_t>(p.D) & 15) == 0;  // 16-byte row chunks
    Ring<kStages> ring;
    float acc[BN / 2];
    int epi_parity = 0;  // the staging buffer the next chunk writes
    for (int u = blockIdx.x; u < num_units; u += gridDim.x) {
      int m0, n0;
      tile_origin<BN>(u / splits, num_m, num_n, m0, n0);
      const int rank = u % splits;
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;
      int prev = -1;  // the stage whose wgmmas may still be reading it
      for (int kt = rank * num_k / splits; kt < (rank + 1) * num_k / splits; ++kt, ring.next()) {
        mbar_wait(smem_addr(&full[ring.s]), ring.phase);
        const uint32_t sa = base + ring.s * stage_bytes<BN>() + c * 64 * 128, sb = base + ring.s * stage_bytes<BN>() + kATileBytes;
        wgmma_fence();  // orders the accumulator registers (zeroed or read back) before the wgmmas
#pragma unroll
        for (int kk = 0; kk < kBK / 16; ++kk) wgmma_m64k16<T, BN>(acc, make_desc(sa + kk * 32), make_desc(sb + kk * 32));
        wgmma_commit();
        wgmma_wait<1>();  // the previous step's wgmmas are done: its stage can be refilled
        if (prev >= 0 && tid_wg == 0) mbar_arrive(smem_addr(&empty[prev]));
        prev = ring.s;
      }
      wgmma_wait<0>();
      fence_regs(acc);
      if (prev >= 0 && tid_wg == 0) mbar_arrive(smem_addr(&empty[prev]));

      constexpr int kCols = epi_cols<BN>(), kChunks = kCols / 8;
      if (splits > 1) {
        // Every partial into the drained ring, thread-major (conflict-free), once both warpgroups' last wgmmas have
        // read it (one unit a CTA: the producer is done). Each rank then sums its chunks' registers over the
        // cluster in rank order into its own copy and reads them back. The loops stay rolled: this code runs once
        // a CTA, and unrolled per register its instruction fetch cost more than the split saved.
        named_bar_sync(3, 256);
        const uint32_t part = base + (threadIdx.x - 128) * 4;
#pragma unroll
        for (int r = 0; r < BN / 2; ++r) st_shared_f32(part + r * 1024, acc[r]);
        cluster_sync();
        for (int q = rank; q < BN / kCols; q += splits)
#pragma unroll 1
          for (int r0 = q * kCols / 2; r0 < (q + 1) * kCols / 2; r0 += 8) {
            float v[8] = {};
            for (int o = 0; o < splits; ++o) {
              float x[8];
#pragma unroll
              for (int e = 0; e < 8; ++e) x[e] = ld_cluster_f32(part + (r0 + e) * 1024, o);
#pragma unroll
              for (int e = 0; e < 8; ++e) v[e] += x[e];
            }
#pragma unroll
            for (int e = 0; e < 8; ++e) st_shared_f32(part + (r0 + e) * 1024, v[e]);
          }
        cluster_sync();  // the sums are in; no CTA leaves while another still reads its ring
#pragma unroll
        for (int r = 0; r < BN / 2; ++r) acc[r] = ld_shared_f32(part + r * 1024);
      }

      // Epilogue, per chunk of kCols (64, or 48 at BN = 144) columns: registers -> shared (final values
      // in T) -> global in 16-byte stores, a warp writing whole row segments at a time.
      // Accumulator layout (m64nNk16, f32): warp w of the warpgroup holds rows 16 w + g and 16 w + g + 8;
      // register 4 j + e holds column 8 j + 2 (lane % 4) + (e & 1), row + 8 when e >= 2.
      // In the buffer (64 rows x 128 B), 16-byte chunk k of row r sits at k ^ (r % 8), so the 8 rows a
      // warp stores to at once fall in different banks. The two buffers alternate chunk by chunk, across
      // tiles too: one is rewritten two chunks later, after every thread of the warpgroup has passed
      // the barrier of the chunk in between.
      static_assert(BN % kCols == 0 && 64 * kChunks % 128 == 0, "whole chunks, whole store rounds");
#pragma unroll
      for (int q = 0; q < BN / kCols; ++q) {
        if (q % splits != rank) continue;  // another rank of the cluster stores it
        uint8_t* buf = epi + epi_parity * kEpiBufBytes;
        epi_parity ^= 1;
#pragma unroll
        for (int jj = 0; jj < kChunks; ++jj)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int j = q * kChunks + jj, r = warp * 16 + g + h * 8;
            const int m = m0 + c * 64 + r, n = n0 + j * 8 + t4 * 2;
            const T pair[2] = {from_float<T>(epilogue_value<kWithC>(p, m, n, acc[4 * j + 2 * h])),
                               from_float<T>(epilogue_value<kWithC>(p, m, n + 1, acc[4 * j + 2 * h + 1]))};
            *reinterpret_cast<uint32_t*>(buf + r * 128 + ((jj ^ g) << 4) + t4 * 4) =
                *reinterpret_cast<const uint32_t*>(pair);
          }
        named_bar_sync(1 + c, 128);  // this warpgroup only
#pragma unroll
        for (int i = 0; i < 64 * kChunks / 128; ++i) {
          const int idx = tid_wg + 128 * i, r = idx / kChunks, k = idx % kChunks;
          const int m = m0 + c * 64 + r, n = n0 + q * kCols + k * 8;
          const uint8_t* src = buf + r * 128 + ((k ^ (r % 8)) << 4);
          if (m < p.M && n < p.N) {
            T* dst = p.D + (int64_t)m * p.ldd + n;
            if (vec_ok && n + 8 <= p.N) {
              *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
            } else {
#pragma unroll
              for (int e = 0; e < 8; ++e)
                if (n + e < p.N) dst[e] = reinterpret_cast<const T*>(src)[e];
            }
          }
        }
      }
    }
  }
#else
  __trap();  // built without sm_90a; the dispatcher only launches this on compute capability 9.x
#endif
}


// ---- Small M (M <= 128, or <= 192 on long K): W is the wgmma M operand, split over the SMs along K ----
// D^T [N, M] = W [N, K] . X [M, K]^T: a tile is 128 rows of W (64 per consumer warpgroup, as above)
// against all BN >= M activation rows (BN = 8 .. 128, 144 or 192, the wgmma N), so W is read once and
// the tensor cores do BN / M times the useful work, which at these M is still far below their rate. A few tiles
// cannot fill 132 SMs, so the work is the iteration space tiles x K steps, cut into one contiguous,
// equal range per CTA (stream-K; split-K where the grid is a whole number of CTAs a tile, see
// sm90_small_m_plan): a CTA runs across tile boundaries with one ring, stores the tiles it
// covers whole, and writes the fp32 partial sums of a tile it shares (at most its first and its last)
// to a workspace; the last sharer to arrive (a per-tile counter) adds the partials in CTA order, so the
// result does not depend on the arrival order, and stores the tile. Split-K launched as clusters of a
// tile's S CTAs (sk.cluster = S) sums through distributed shared memory instead: each CTA leaves its
// partial in its drained ring, and rank q adds registers q, q + S, ... of all S partials in rank (= K)
// order and stores them, so no CTA waits on another's global writes and the tail is spread over S SMs.
// Where clusters of S do not fit at once (32 x 4 on a 132-SM H200: 30 do), S - 1 whole ones may (sm90_small_m_plan);
// else pairs (sk.cluster = 2) sum through shared memory first and each pair's rank 0 goes on through the
// workspace as one of S / 2 sharers.
// (A shared tile's fix-up through the workspace costs ~4.5 us at 64 x 4096 x 4096: 15.8 us against 11.3
// with the partials left unsummed, H200.)
// kAct (linear_act, M 32-64, sm90_small_m_act): W is gate | up, loaded through make_pair_map so that a tile's rows
// are 8 gate rows and their 8 up rows, 8 times over; a thread's registers 4 j + e and 4 j + 2 + e (e < 2) are then
// one output's gate and up, and the epilogue stores act(gate) * up (store_gated): the activation's launch is spared.
// kWG = 1 (the plain linear at M <= 64, sm90_small_m_plan): a tile is 64 rows of W for one consumer warpgroup, one tile
// a CTA over all of K where the tiles fill 7/10 of the SMs or more, else split K in whole clusters (never the workspace).
struct StreamK {
  float* ws;       // [grid][2][kBM * BN] partial tiles: a CTA's first (0) and last (1) tile
  int* counters;   // [tiles], zero between launches (the last sharer of a tile resets it)
  int64_t iters;   // tiles * k_steps
  int k_steps;
  int cluster;     // split-K in clusters of this many CTAs (S: ws and counters unused; 2 of S: pairs); 1: none
};

// kWG consumer warpgroups, each 64 rows of a W tile: 2 (128-row tiles) or 1 (64-row tiles: whole K a CTA, or K split in
// whole clusters).
template <int BN, int kWG = 2>
constexpr int small_m_stage_bytes() {
  return kWG * 64 * kBK * 2 + BN * kBK * 2;  // W 128 (or 64) x 64 + X BN x 64
}
// As many stages as ~200 KB holds, 16 at most: 11 at BN = 8 and 16 (~176 KB of W in flight), 8 at 64, 6 at 128, 5
// at 144 and 192 (64-row tiles: 16 at BN 16 and 32, 12 at 64). Past BN = 128 setmaxnreg moves the producer's
// registers to the consumers, as in wgmma_kernel.
template <int BN, int kWG = 2>
constexpr int small_m_stages() {
  return std::min(16, 200 * 1024 / small_m_stage_bytes<BN, kWG>());
}
template <int BN, int kWG = 2>
constexpr int small_m_smem_bytes() {
  return small_m_stages<BN, kWG>() * small_m_stage_bytes<BN, kWG>() + 1024;
}

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
// First iteration of CTA c, and the CTA whose range holds iteration i (ranges are never empty).
__device__ __forceinline__ int64_t range_begin(int64_t c, int64_t iters, int grid) { return c * iters / grid; }
__device__ __forceinline__ int range_owner(int64_t i, int64_t iters, int grid) {
  return static_cast<int>(((i + 1) * grid - 1) / iters);
}
#endif

template <typename T, int BN, bool kWithC, bool kAct, int kWG = 2>
__global__ void __launch_bounds__(128 * (1 + kWG), 1)
    small_m_kernel(const __grid_constant__ CUtensorMap map_w, const __grid_constant__ CUtensorMap map_x,
                   const Params<T, T> p, const StreamK sk) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(kWG == 2 || (!kAct && !kWithC), "64-row W tiles: the plain linear's epilogue only");
  constexpr int S = small_m_stages<BN, kWG>(), kStage = small_m_stage_bytes<BN, kWG>(), kTile = kBM * BN;
  constexpr int kWRows = 64 * kWG, kWBytes = kWRows * kBK * 2;
  extern __shared__ uint8_t smem_raw[];
  __shared__ __align__(8) uint64_t full[S], empty[S];
  __shared__ int s_last;
  const uint32_t base = (smem_addr(smem_raw) + 1023) & ~1023u;
  const int wg = threadIdx.x / 128, tid_wg = threadIdx.x % 128;
  const int64_t begin = range_begin(blockIdx.x, sk.iters, gridDim.x);
  const int64_t end = range_begin(blockIdx.x + 1, sk.iters, gridDim.x);

  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      mbar_init(smem_addr(&full[s]), 1);
      mbar_init(smem_addr(&empty[s]), kWG);
    }
    mbar_init_fence();
  }
  // Launched as a programmatic dependent (launch_small_m): the previous kernel may still run, so read
  // or write nothing it may write before griddep_wait. A static W (p.static_b) is no such thing: the
  // producer fills the first stages' W halves while that kernel finishes, and their X after the wait.
  // (An L2 prefetch of W here instead cost 1-3 us per call on H200.)
  const int64_t early = p.static_b ? min(int64_t(S), end - begin) : 0;
  // The producer's place in the iteration space, stepped without dividing: a 64-bit division a stage is a
  // long chain of one thread's dependent instructions ahead of each refill (64 x 4096 x 4096 15.3 -> 14.0 us, H200).
  struct Cursor {
    int tile, k;
    __device__ Cursor(int64_t i, const StreamK& sk) : tile(int(i / sk.k_steps)), k(int(i % sk.k_steps)) {}
    __device__ void next(const StreamK& sk) {
      if (++k == sk.k_steps) k = 0, ++tile;
    }
  };
  auto load_w = [&](uint32_t dst, uint32_t bar, const Cursor& at) {  // W tile at.tile: kWRows rows x 64 k
    if constexpr (kAct) tma_load_4d_stream(dst, &map_w, bar, at.k * kBK, 0, 0, at.tile * (kBM / 16));  // 8 pairs of 8
    else tma_load_2d_stream(dst, &map_w, bar, at.k * kBK, at.tile * kWRows);
  };
  if (threadIdx.x == 0) {
    Cursor at(begin, sk);
    for (int s = 0; s < early; ++s, at.next(sk)) {
      const uint32_t bar = smem_addr(&full[s]);
      mbar_expect_tx(bar, kStage);  // the whole stage: the phase completes once X has landed too
      load_w(base + s * kStage, bar, at);
    }
  }
  griddep_wait();
  griddep_launch_dependents();
  __syncthreads();

  if (wg == 0) {  // producer: one thread walks the CTA's range with TMA
    if constexpr (BN > 128) setmaxnreg_dec<kProducerRegs>();
    if (tid_wg == 0) {
      Ring<S> ring;
      Cursor at(begin, sk);
      for (int64_t i = begin; i < end; ++i, ring.next(), at.next(sk)) {
        const uint32_t bar = smem_addr(&full[ring.s]), sa = base + ring.s * kStage;
        if (i >= begin + early) {
          mbar_wait(smem_addr(&empty[ring.s]), ring.phase ^ 1);
          mbar_expect_tx(bar, kStage);  // whole boxes, zero-filled rows (M < BN, the N and K tails) too
          load_w(sa, bar, at);
        }
        tma_load_2d(sa + kWBytes, &map_x, bar, at.k * kBK, 0);
      }
    }
    return;
  }
  if constexpr (BN > 128) setmaxnreg_inc<kConsumerRegs>();  // 72 or 96 accumulators a thread

  // Consumers: warpgroup c owns W rows [64 c, 64 c + 64) of the tile; tc numbers the 256 threads (kWG = 2).
  const int c = wg - 1, tc = threadIdx.x - 128;
  const int warp = tid_wg / 32, lane = tid_wg % 32, g = lane / 4, t4 = lane % 4;
  Ring<S> ring;
  float acc[BN / 2];
  for (int64_t i = begin; i < end;) {
    const int tile = int(i / sk.k_steps);
    const int64_t tile_begin = int64_t(tile) * sk.k_steps, tile_end = tile_begin + sk.k_steps;
    const int64_t seg_end = min(end, tile_end);
    const bool whole = i == tile_begin && seg_end == tile_end, first_seg = i == begin;
#pragma unroll
    for (int r = 0; r < BN / 2; ++r) acc[r] = 0.f;
    int prev = -1;
    for (; i < seg_end; ++i, ring.next()) {
      mbar_wait(smem_addr(&full[ring.s]), ring.phase);
      const uint32_t sa = base + ring.s * kStage + c * 64 * 128, sb = base + ring.s * kStage + kWBytes;
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBK / 16; ++kk) wgmma_m64k16<T, BN>(acc, make_desc(sa + kk * 32), make_desc(sb + kk * 32));
      wgmma_commit();
      wgmma_wait<1>();
      if (prev >= 0 && tid_wg == 0) mbar_arrive(smem_addr(&empty[prev]));
      prev = ring.s;
    }
    wgmma_wait<0>();
    fence_regs(acc);
    if (prev >= 0 && tid_wg == 0) mbar_arrive(smem_addr(&empty[prev]));

    // Register 4 j + e of the m64nBN fragment is W row 16 warp + g (+ 8 for e >= 2) of this warpgroup's 64
    // and activation row 8 j + 2 t4 + (e & 1), i.e. D[m][n] with n along W. Lanes of one t4 write 8
    // neighbouring n (16 bytes); D is M x N, small next to W.
    // With kAct, registers r and r + 2 (r % 4 < 2) are gate and up of output (n_base - g) / 2 + g.
    const int n_base = tile * kWRows + c * 64 + warp * 16 + g;
    auto store = [&](int r, float v) {
      const int n = n_base + 8 * ((r & 3) >> 1), m = 8 * (r >> 2) + 2 * t4 + (r & 1);
      if (m < p.M && n < p.N) p.D[int64_t(m) * p.ldd + n] = from_float<T>(epilogue_value<kWithC>(p, m, n, v));
    };
    auto store_act = [&](int r, float gate, float up) {
      const int n = (n_base - g) / 2 + g, m = 8 * (r >> 2) + 2 * t4 + (r & 1);
      if (m < p.M && n < p.N / 2) store_gated(p, m, n, gate, up);
    };
    // 64-row tiles (kWG = 1) are whole or split in whole clusters (sm90_small_m_plan).
    if (!whole && sk.cluster > 1) {
      // Thread-major partials (conflict-free), once every warpgroup's last wgmmas have read the ring.
      constexpr int kRow = 128 * kWG * 4;  // bytes between a thread's consecutive registers
      named_bar_sync(1, 128 * kWG);
      const uint32_t part = base + tc * 4;
#pragma unroll
      for (int r = 0; r < BN / 2; ++r) st_shared_f32(part + r * kRow, acc[r]);
      cluster_sync();
      const int C = sk.cluster, rank = int(cluster_ctarank());
      auto cluster_sum = [&](int r) {
        float v = 0.f;
#pragma unroll
        for (int o = 0; o < 8; ++o)
          if (o < C) v += ld_cluster_f32(part + r * kRow, o);
        return v;
      };
      if (range_owner(tile_end - 1, sk.iters, gridDim.x) - range_owner(tile_begin, sk.iters, gridDim.x) + 1 == C) {
        if constexpr (kAct) {  // rank q: registers 4 j .. 4 j + 3 for j = q, q + C, ... (gate and up together)
          for (int j = rank; j < BN / 8; j += C)
#pragma unroll
            for (int e = 0; e < 2; ++e) store_act(4 * j + e, cluster_sum(4 * j + e), cluster_sum(4 * j + 2 + e));
        } else {
#pragma unroll 4
          for (int r = rank; r < BN / 2; r += C) store(r, cluster_sum(r));
        }
        cluster_sync();  // no CTA leaves while another still reads its ring
        continue;
      }
      // Pairs (C = 2), several a tile: each pair's rank 0 takes the pair's sum on to the workspace.
      if (rank == 0)
#pragma unroll
        for (int r = 0; r < BN / 2; ++r) acc[r] += ld_cluster_f32(part + r * kRow, 1);
      cluster_sync();
      if (rank != 0) continue;
    }
    if (kWG == 2 && !whole) {
      // A shared tile: write the partial (thread-major, so every access is coalesced), count it in,
      // and only the last sharer goes on. One thread fences for the CTA (the barrier orders the others'
      // writes before it) ahead of the count, and the last one after it; it reads the partials from L2
      // (__ldcg; L1 may hold lines of an earlier launch).
      float* mine = sk.ws + (int64_t(blockIdx.x) * 2 + (first_seg ? 0 : 1)) * kTile + tc;
#pragma unroll
      for (int r = 0; r < BN / 2; ++r) __stcg(mine + r * 256, acc[r]);
      named_bar_sync(1, 256);
      const int first = range_owner(tile_begin, sk.iters, gridDim.x), last = range_owner(tile_end - 1, sk.iters, gridDim.x);
      if (tc == 0) {
        __threadfence();
        s_last = atomicAdd(sk.counters + tile, 1) == (last - first) / sk.cluster;
        if (s_last) {
          atomicExch(sk.counters + tile, 0);  // every sharer has arrived: ready for the next launch
          __threadfence();
        }
      }
      named_bar_sync(1, 256);
      if (!s_last) continue;
      // The sum in CTA order; this CTA's own partial from its registers where a copy fits (BN <= 64).
      constexpr bool kOwn = BN <= 64;
      float own[kOwn ? BN / 2 : 1];
#pragma unroll
      for (int r = 0; r < BN / 2; ++r) {
        if constexpr (kOwn) own[r] = acc[r];
        acc[r] = 0.f;
      }
      for (int o = first; o <= last; o += sk.cluster) {
        if (kOwn && o == int(blockIdx.x)) {
#pragma unroll
          for (int r = 0; r < (kOwn ? BN / 2 : 0); ++r) acc[r] += own[r];
          continue;
        }
        const bool o_first = range_begin(o, sk.iters, gridDim.x) >= tile_begin;  // the tile is o's first
        const float* src = sk.ws + (int64_t(o) * 2 + (o_first ? 0 : 1)) * kTile + tc;
#pragma unroll
        for (int r = 0; r < BN / 2; ++r) acc[r] += __ldcg(src + r * 256);
      }
    }

#pragma unroll
    for (int r = 0; r < BN / 2; ++r) {
      if constexpr (kAct) {
        if ((r & 2) == 0) store_act(r, acc[r], acc[r + 2]);
      } else {
        store(r, acc[r]);
      }
    }
  }
#else
  __trap();  // built without sm_90a; the dispatcher only launches this on compute capability 9.x
#endif
}

// A 2D map over a [rows, K] K-contiguous matrix, boxes of box_rows rows x 64 K with the 128-byte swizzle.
template <typename T>
CUtensorMap make_map(const T* ptr, int rows, int K, int64_t row_stride, int box_rows) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {(cuuint64_t)K, (cuuint64_t)rows};
  const cuuint64_t strides[1] = {(cuuint64_t)row_stride * sizeof(T)};
  const cuuint32_t box[2] = {kBK, (cuuint32_t)box_rows};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r = sm90::tensor_map_encoder()(&map, sm90::tensor_map_dtype<T>(), 2, const_cast<T*>(ptr), dims, strides, box, elem_strides,
                                 CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                 CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  MINFER_CHECK(r == CUDA_SUCCESS, "linear: sm90 path: cuTensorMapEncodeTiled failed with error " + std::to_string(int(r)) +
                                     " (rows=" + std::to_string(rows) + ", K=" + std::to_string(K) +
                                     ", row stride=" + std::to_string(row_stride) + ")");
  return map;
}

// W = gate | up [2 inter, K] for kAct's tiles: a 4D map (K, 8 rows, 2 halves, inter / 8 groups), boxes of 64 K x
// 8 rows x 2 x 8 groups = 128 rows, [gate 8 j .. 8 j + 7, up 8 j .. 8 j + 7] for 8 groups j, with the 128-byte
// swizzle of make_map's boxes (a box row is 128 bytes either way). Needs inter % 8 == 0.
template <typename T>
CUtensorMap make_pair_map(const T* ptr, int inter, int K, int64_t row_stride) {
  CUtensorMap map;
  const cuuint64_t row = (cuuint64_t)row_stride * sizeof(T);
  const cuuint64_t dims[4] = {(cuuint64_t)K, 8, 2, (cuuint64_t)inter / 8};
  const cuuint64_t strides[3] = {row, row * inter, row * 8};
  const cuuint32_t box[4] = {kBK, 8, 2, kBM / 16}, elem_strides[4] = {1, 1, 1, 1};
  const CUresult r = sm90::tensor_map_encoder()(
      &map, sm90::tensor_map_dtype<T>(), 4, const_cast<T*>(ptr), dims, strides, box, elem_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  MINFER_CHECK(r == CUDA_SUCCESS, "linear_act: sm90 path: cuTensorMapEncodeTiled failed with error ", int(r),
               " (inter=", inter, ", K=", K, ", row stride=", row_stride, ")");
  return map;
}

// splits > 1: grid = tiles x splits, in clusters of splits (wgmma_kernel).
template <typename T, int BN, bool kWithC>
void launch(const Params<T, T>& p, cudaStream_t stream, int grid, int splits, const CUtensorMap& map_a) {
  const int k_map = p.K > 0 ? p.K : 8;
  const CUtensorMap map_b = make_map(p.B, p.N, k_map, p.sbn > 0 ? p.sbn : k_map, BN);
  constexpr auto kernel = wgmma_kernel<T, BN, kWithC>;
  allow_smem<kernel, smem_bytes<BN>()>();
  launch_ex(kernel, false, splits, dim3(grid), dim3(kThreads), smem_bytes<BN>(), stream, map_a, map_b, p, splits);
}

// Whether `clusters` clusters of `cluster` persistent-kernel CTAs at BN fit the device at once.
template <int BN>
bool clusters_fit(int cluster, int64_t clusters) {
  constexpr auto kernel = wgmma_kernel<__nv_bfloat16, BN, false>;  // a BN's instances: the same resources
  allow_smem<kernel, smem_bytes<BN>()>();
  return resident_clusters<kernel, kThreads, smem_bytes<BN>()>(cluster) >= clusters;
}

// The small-M kernel, launched as a programmatic dependent of the previous kernel in the stream (its
// launch and barrier setup overlap that kernel's tail; see small_m_kernel).
template <typename T, int BN, bool kWithC, bool kAct = false, int kWG = 2>
void launch_small_m_kernel(const Params<T, T>& p, cudaStream_t stream, const Sm90SmallM& plan, float* ws, int* counters) {
  const int k_map = p.K > 0 ? p.K : 8;  // K = 0: one zero-filled K step (a zero-sized map is invalid)
  const int64_t w_stride = p.sbn > 0 ? p.sbn : k_map;
  const CUtensorMap map_w =
      kAct ? make_pair_map(p.B, p.N / 2, k_map, w_stride) : make_map(p.B, p.N, k_map, w_stride, 64 * kWG);
  const CUtensorMap map_x = make_map(p.A, p.M, k_map, p.sam > 0 ? p.sam : k_map, BN);
  const int k_steps = (k_map + kBK - 1) / kBK;
  const StreamK sk{ws, counters, plan.tiles * k_steps, k_steps, plan.cluster};
  constexpr auto kernel = small_m_kernel<T, BN, kWithC, kAct, kWG>;
  constexpr int smem = small_m_smem_bytes<BN, kWG>();
  allow_smem<kernel, smem>();
  launch_pdl_cluster(kernel, plan.cluster, dim3(plan.grid), dim3(128 * (1 + kWG)), smem, stream, map_w, map_x, p, sk);
}

// f(std::integral_constant<int, BN>) for the small-M kernel's BN = bn (a plan's: 8 .. 128, 144 or 192).
template <typename F>
decltype(auto) with_small_m_bn(int bn, F f) {
  switch (bn) {
    case 8: return f(std::integral_constant<int, 8>{});
    case 16: return f(std::integral_constant<int, 16>{});
    case 32: return f(std::integral_constant<int, 32>{});
    case 64: return f(std::integral_constant<int, 64>{});
    case 128: return f(std::integral_constant<int, 128>{});
    case 144: return f(std::integral_constant<int, 144>{});
    default: return f(std::integral_constant<int, 192>{});
  }
}

// Whether `clusters` clusters of `cluster` small-M CTAs at BN = bn fit the device at once.
bool small_m_clusters_fit(int bn, int cluster, int64_t clusters) {
  return with_small_m_bn(bn, [&](auto b) {
    constexpr int BN = decltype(b)::value;
    constexpr auto kernel = small_m_kernel<__nv_bfloat16, BN, false, false>;  // a BN's instances: the same resources
    allow_smem<kernel, small_m_smem_bytes<BN>()>();
    return resident_clusters<kernel, kThreads, small_m_smem_bytes<BN>()>(cluster) >= clusters;
  });
}

// Whether `clusters` clusters of `cluster` 64-row-tile small-M CTAs (kWG = 1) at BN = bn (16, 32 or 64) fit at once.
bool small_m_w64_clusters_fit(int bn, int cluster, int64_t clusters) {
  auto fit = [&](auto b) {
    constexpr int BN = decltype(b)::value;
    constexpr auto kernel = small_m_kernel<__nv_bfloat16, BN, false, false, 1>;
    allow_smem<kernel, small_m_smem_bytes<BN, 1>()>();
    return resident_clusters<kernel, 128 * 2, small_m_smem_bytes<BN, 1>()>(cluster) >= clusters;
  };
  return bn == 16 ? fit(std::integral_constant<int, 16>{}) : bn == 32 ? fit(std::integral_constant<int, 32>{})
                                                                       : fit(std::integral_constant<int, 64>{});
}

template <typename T, int BN>
void launch_small_m(const Params<T, T>& p, cudaStream_t stream, const Sm90SmallM& plan, float* ws, int* counters) {
  if (plan.w_rows == 64) {  // built for the plain linear at BN 16-64, a tile a CTA or a cluster (sm90_small_m_plan)
    MINFER_CHECK(BN >= 16 && BN <= 64 && p.act == kActNone && !p.C && plan.grid == plan.tiles * plan.splits &&
                     plan.cluster == plan.splits,
                 "linear: the sm90 small-M kernel takes 64-row W tiles only for the plain linear at up to 64 rows, "
                 "split in whole clusters");
    if constexpr (BN >= 16 && BN <= 64) launch_small_m_kernel<T, BN, false, false, 1>(p, stream, plan, ws, counters);
    return;
  }
  if (p.act != kActNone) {  // built for sm90_small_m_act's rows only
    MINFER_CHECK((BN == 32 || BN == 64) && !p.C && p.N % 16 == 0,
                 "linear_act: the sm90 small-M kernel fuses the activation at 32-64 rows, without C, N / 2 % 8 == 0");
    if constexpr (BN == 32 || BN == 64) launch_small_m_kernel<T, BN, false, true>(p, stream, plan, ws, counters);
    return;
  }
  (p.C ? launch_small_m_kernel<T, BN, true> : launch_small_m_kernel<T, BN, false>)(p, stream, plan, ws, counters);
}

}  // namespace

// M 129-192 pads the persistent kernel's second 128-row tile; the small-M kernel (BN 144 or 192) wins
// where K is long enough to spread (H200, one run, us, persistent / small-M: 144 x 4096 x 14336 81.4 / 52.5,
// 192 x 4096 x 14336 80.2 / 58.1, 144 x 2048 x 8192 43.1 / 25.4, 144 x 28672 x 4096 108.9 / 86.0, 144 x 6144
// x 4096 33.4 / 27.3, 192 x 28672 x 4096 110.6 / 96.7) and loses at K = 2048 (144 x 16384 x 2048 28.6 /
// 32.8) and on narrow W past 144 rows (192 x 6144 x 4096 30.9 / 34.8).
bool sm90_small_m(int M, int N, int K) {
  return M <= kSm90SmallMAll || (M <= kSm90SmallM && (K >= 8192 || (K >= 4096 && (M <= 144 || N >= 16384))));
}

// Up to 64 rows: at 65-128 the fused kernel took 2.5-4.5 us a call more than the linear alone and the 8B decode
// step at batch 128 lost (H200, ms, two launches / fused: 11.12-11.13 / 11.17-11.25; batch 32 6.13-6.15 / 6.01-6.04,
// 64 7.57-7.59 / 7.47-7.49).
bool sm90_small_m_act(int M, int N) { return M >= 32 && M <= 64 && N % 16 == 0; }

Sm90SmallM sm90_small_m_plan(int M, int N, int K, int sms, bool plain) {
  Sm90SmallM plan{};
  // 64-row W tiles, whole K a CTA, where they fill 7/10 of the SMs or more (the 8B q | k | v, 96 tiles), against 128-row
  // tiles split over clusters of two (H200, us: 64 x 6144 x 4096 19.1 -> 16.7, 48 rows 18.7 -> 16.6, 32 rows 16.5 ->
  // 15.7). Where 64-row tiles are too few, blocks of the rows (64 tiles x 2 blocks of 32) lost: 64 x 4096 x 4096 14.0 ->
  // 15.3, 64 x 4096 x 14336 34.5 -> 48.9; 16.6 and 51.9 with each pair sharing its tile's W by TMA multicast.
  const int64_t tiles64 = (int64_t(N) + 63) / 64, k_steps64 = std::max<int64_t>(1, (int64_t(K) + kBK - 1) / kBK);
  const int bn64 = M <= 16 ? 16 : M <= 32 ? 32 : 64;  // the 64-row tiles' activation rows
  auto w64_plan = [&](int64_t splits) {  // splits CTAs a tile, one cluster
    plan.bn = bn64, plan.grid = int(tiles64 * splits), plan.tiles = tiles64, plan.ws_floats = 0, plan.w_rows = 64;
    plan.splits = plan.cluster = int(splits);
    return plan;
  };
  if (plain && M <= 64 && tiles64 <= sms && 10 * tiles64 >= 7 * int64_t(sms)) return w64_plan(1);
  // Fewer: S CTAs a 64-row tile, each a contiguous part of K, summed in a cluster of S, where S CTAs a tile fill 7/10 of
  // the SMs or more and the clusters fit at once (the 8B o and down at 64 tiles: 2 a tile on 128 SMs, against 128-row
  // tiles in 32 clusters of 3 on 96, or 4 a tile in pairs through the workspace; H200, us: 32 x 4096 x 4096 12.37 ->
  // 11.88, 64 x 4096 x 4096 14.05 -> 13.89, 64 x 4096 x 14336 33.20 -> 32.66).
  if (plain && M <= 64 && tiles64 <= sms / 2) {
    int64_t s = std::min<int64_t>({sms / tiles64, 8, k_steps64});
    while (s >= 2 && 10 * tiles64 * s >= 7 * int64_t(sms) && !small_m_w64_clusters_fit(bn64, int(s), tiles64)) --s;
    if (s >= 2 && 10 * tiles64 * s >= 7 * int64_t(sms)) return w64_plan(s);
  }
  plan.bn = 8;
  while (plan.bn < M && plan.bn < kSm90SmallMAll) plan.bn *= 2;
  if (M > kSm90SmallMAll) plan.bn = M <= 144 ? 144 : 192;
  plan.tiles = (int64_t(N) + kBM - 1) / kBM;
  const int64_t k_steps = std::max<int64_t>(1, (int64_t(K) + kBK - 1) / kBK);
  plan.grid = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(plan.tiles * k_steps, sms)));
  // Split-K where S CTAs a tile fill at least 9/10 of the SMs: the equal ranges then end on tile
  // boundaries, so each CTA writes one partial and a tile has S sharers, not the S + 1 of ranges that
  // straddle two tiles (H200, us, stream-K over 132 / S a tile: 64 x 4096 x 4096 16.9 / 15.7, 64 x 4096 x
  // 14336 38.8 / 36.5, 128 x 4096 x 14336 46.5 / 43.9, 144 x 2048 x 8192 25.2 / 23.6, and 64 x 16384 x 2048,
  // 128 whole tiles, 24.9 / 19.2).
  // A tile's S CTAs as one cluster where all the clusters fit at once (S <= 8, the portable size): the fix-up
  // then costs little, and split-K pays from 7/10 of the SMs (H200, us, against stream-K over 132 CTAs: 64 x
  // 6144 x 4096, 48 tiles in pairs on 96 SMs, 21.45 / 20.50; 32 x 6144 x 4096 19.3 / 18.0; 64 x 4096 x 4096 in
  // pairs on 64 SMs lost, 15.8 / 18.2). Else split-K in pairs where S is even (64 x 2048 x 8192, 16 tiles x 8,
  // 18.56 / 17.35 through the workspace alone / in pairs; 64 x 4096 x 4096 15.76 / 15.5).
  int64_t splits = std::min<int64_t>(k_steps, sms / plan.tiles);
  plan.splits = 1;
  plan.cluster = 1;
  bool whole_clusters = splits >= 2 && splits <= 8 && small_m_clusters_fit(plan.bn, int(splits), plan.tiles);
  // Where S of them do not fit, S - 1 may (32 tiles: 30 clusters of 4 fit on an H200, 32 of 3 do): an SM in S
  // idles and the workspace fix-up goes, which pays while a CTA streams little W (H200, us, S pairs / S - 1
  // whole: 64 x 4096 x 4096 15.3 / 14.4, 128 x 4096 x 4096 19.2 / 18.2) and not on long streams (64 x 4096 x
  // 14336, 1.2 MB a CTA, 35.7 / 37.1): up to 512 KB of W a CTA.
  if (!whole_clusters && splits - 1 >= 2 && splits - 1 <= 8 && 10 * plan.tiles * (splits - 1) >= 7 * int64_t(sms) &&
      int64_t(N) * K * 2 <= plan.tiles * (splits - 1) * (int64_t(512) << 10) &&
      small_m_clusters_fit(plan.bn, int(splits - 1), plan.tiles)) {
    splits -= 1;
    whole_clusters = true;
  }
  if (splits >= 1 && 10 * plan.tiles * splits >= (whole_clusters ? 7 : 9) * int64_t(sms)) {
    plan.grid = static_cast<int>(plan.tiles * splits);
    plan.splits = static_cast<int>(splits);
    if (whole_clusters) plan.cluster = plan.splits;
    else if (splits % 2 == 0 && small_m_clusters_fit(plan.bn, 2, plan.tiles * splits / 2)) plan.cluster = 2;
  }
  plan.ws_floats = plan.cluster == plan.splits && plan.splits > 1 ? 0 : int64_t(plan.grid) * 2 * kBM * plan.bn;
  return plan;
}

Sm90Persistent sm90_persistent_plan(int M, int N, int K, int sms) {
  // One CTA per SM, or fewer when there are fewer tiles. The busiest CTA runs ceil(tiles / sms) tiles and a
  // tile's time goes about with its width, a narrower one's a bit more per column (its wgmmas read 1.2x the
  // shared-memory bytes per FLOP): cost = rounds x BN x (1 or 1.15). 128 wins where it needs fewer rounds (512 x
  // 4096: one round of 128 tiles against one of 64 twice as long); 144, considered only where it tiles N exactly,
  // where 256 pads and idles SMs (M = 4096, N = 576: 128 tiles in one round, against 96 tiles of 256 with a third
  // of their columns padding).
  const int64_t m_tiles = (int64_t(M) + kBM - 1) / kBM;
  auto tiles_of = [&](int bn) { return m_tiles * ((int64_t(N) + bn - 1) / bn); };
  auto cost = [&](int bn) { return double((tiles_of(bn) + sms - 1) / sms) * bn * (bn == 256 ? 1.0 : 1.15); };
  Sm90Persistent plan{};
  plan.bn = cost(128) < cost(256) ? 128 : 256;
  if (N % 144 == 0 && cost(144) < cost(plan.bn)) plan.bn = 144;
  plan.tiles = tiles_of(plan.bn);
  // Split-K in clusters where the tiles fill at most half the SMs (M 129-256 on a decode step's narrow W): up to
  // 4 CTAs a tile, each at least 8 K steps (K = 0 is one zero-filled step).
  plan.splits = 1;
  if (plan.bn != 256 && plan.tiles * 2 <= sms) {
    const int64_t k_steps = std::max<int64_t>(1, (int64_t(K) + kBK - 1) / kBK);
    int s = static_cast<int>(std::min<int64_t>({sms / plan.tiles, 4, k_steps / 8}));
    auto fit = [&](int c) { return plan.bn == 128 ? clusters_fit<128>(c, plan.tiles) : clusters_fit<144>(c, plan.tiles); };
    while (s > 1 && !fit(s)) --s;
    plan.splits = std::max(s, 1);
  }
  plan.grid = static_cast<int>(plan.splits > 1 ? plan.tiles * plan.splits : std::min<int64_t>(plan.tiles, sms));
  return plan;
}

template <typename T>
void launch_sm90(const Params<T, T>& p, cudaStream_t stream, int sms, const Sm90SmallM* small, float* ws,
                 int* counters) {
  MINFER_CHECK(p.act == kActNone || small != nullptr,
               "linear_act: the persistent sm90 kernel has no activation epilogue");
  if (small != nullptr)
    return with_small_m_bn(small->bn, [&](auto b) {
      launch_small_m<T, decltype(b)::value>(p, stream, *small, ws, counters);
    });
  // K = 0 would give a zero-sized map: treat it as one zero-filled K tile instead.
  const int k_map = p.K > 0 ? p.K : 8;
  const CUtensorMap map_a = make_map(p.A, p.M, k_map, p.sam > 0 ? p.sam : k_map, kBM);
  const Sm90Persistent plan = sm90_persistent_plan(p.M, p.N, p.K, sms);
  MINFER_CHECK(plan.tiles < (int64_t(1) << 31) / plan.splits,
               "linear: sm90 path: too many output tiles (" + std::to_string(plan.tiles) + ")");
  // The C term of the epilogue is compiled in only where there is a C (gemm with beta != 0).
  const int bn = plan.bn, grid = plan.grid, splits = plan.splits;
  if (bn == 128) (p.C ? launch<T, 128, true> : launch<T, 128, false>)(p, stream, grid, splits, map_a);
  else if (bn == 144) (p.C ? launch<T, 144, true> : launch<T, 144, false>)(p, stream, grid, splits, map_a);
  else (p.C ? launch<T, 256, true> : launch<T, 256, false>)(p, stream, grid, splits, map_a);
}
template void launch_sm90<__half>(const Params<__half, __half>&, cudaStream_t, int, const Sm90SmallM*, float*,
                                  int*);
template void launch_sm90<__nv_bfloat16>(const Params<__nv_bfloat16, __nv_bfloat16>&, cudaStream_t, int, const Sm90SmallM*,
                                         float*, int*);

}  // namespace minfer::gemm_impl
