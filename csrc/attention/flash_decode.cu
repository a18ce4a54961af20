// Split-KV flash decode (one query per sequence) on tensor cores, with the split combine fused in.
// Decode reads every K/V byte once and does ~1 FLOP per byte: it is bound by HBM bandwidth, and at
// small batch by fixed costs (ramp-up, the combine). So: many bytes in flight from the first cycle,
// little issue work per byte, one launch.
//
// Grid (split, kv block, batch). A kv block is up to 16 q heads of one kv group (heads / kv_heads of
// them; more than 16 take several blocks), so each K/V byte is read once for all of them. The heads are
// the 16 rows of the A operand of mma.sync m16n8k16 (rows past the group are zeros): per 16 keys a warp
// does S = Q K^T (head_dim/8 MMAs), an online softmax on the S fragments, and O += P V (head_dim/8
// MMAs), with K/V fragments from ldmatrix on XOR-swizzled shared memory.
//
// Each of the 4 warps streams its own tiles of 16 keys (tiles of the CTA's key range dealt round robin)
// through its own ring of STAGES tiles (24 KB): no CTA barrier in the main loop, and the whole ring is in
// flight before the first tile is used (in a grid that fills the GPU of a card with less DRAM bandwidth
// per SM, a long stream keeps only part of it in flight: kFullGridStages). The warps merge through shared
// memory at the end.
// Loads: 16-byte cp.async by every lane of the warp. (Per-warp TMA boxes of {64 columns, 16 keys} were
// slower on H200 from batch 16 up, 16 x 16k context 267 against 248-254 us, equal at batch 1.) A tile is
// D/64 column halves of [16 keys][128 bytes], 16-byte chunk c of row r at chunk c ^ (r % 8), so the 8
// rows one ldmatrix reads hit 8 different bank groups.
//
// Splits: chosen on the host from the capacity and the SM count (no sync); each CTA reads
// start_pos[b] and divides the ACTUAL kv length evenly (whole tiles), so CTAs past the end exit at once;
// a length that one CTA's rings hold is one split. With one active split the CTA writes the output.
// Otherwise each split writes its partial (max, sum, unnormalised O) to a workspace and bumps a
// per-(batch, kv block) counter; the CTA that arrives last merges all partials by log-sum-exp (or, with
// many big partials, releases the others to merge a slice each), writes the output and resets the
// counter to zero, so the counters are zero again after every launch (CUDA-graph replay included).
// stable_prefix (the engine's call): start_pos and the cache rows before it are final before the
// previous kernel runs, so the split is laid out, and short streams start loading, before the wait.
// Streams of more than 2 tiles a warp speculate (a second kernel instance, `speculates`): they read q
// before the wait too (once a CTA, into shared memory), stream and consume every tile but the newest
// key's there, and release the next kernel at entry; after the wait q is read again, and only if it
// changed is the work done again. So back to back, one call's streams run while the previous call ends,
// and the newest key's row and the combine are all that is left after the wait.
#include "common/checks.h"
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cmath>
#include <string>
#include <utility>

#include "attention/attention.h"
#include "attention/mma.cuh"
#include "common/launch.h"
#include "common/split_counters.h"
#include "common/vec.h"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define MINFER_DECODE_PDL 1  // this device pass has griddepcontrol (programmatic dependent launch)
#else
#define MINFER_DECODE_PDL 0
#endif

namespace minfer::attn {

namespace {

constexpr int kWarps = 4, kThreads = kWarps * 32;
constexpr int kTK = 16;               // keys per warp tile (the k of the P V mma)
constexpr int kRows = 16;             // q heads per CTA (the m of the mma)
constexpr int kRingBytes = 24 << 10;  // per warp: 3 tiles of K+V at head_dim 128, 6 at 64
constexpr int kMinChunk = 2 * kTK;    // fewest keys worth a split
constexpr int kMaxSplits = 128;
constexpr int kEarlyTiles = 3;       // tiles a warp may load before griddepcontrol.wait (stable_prefix)
constexpr int kEarlyPieceBytes = 4 << 10;  // ... one piece of this size in flight at a time
constexpr int kSpecTiles = 2;          // a warp with more tiles than this speculates (the SPECULATE kernel) ...
constexpr int kSpecThrottleTiles = 8;  // ... keeping one tile in flight before the wait, and splitting the
                                       // newest key's tile, up to this many
constexpr int kBurstBytes = 3 << 19;  // a call of at most this much K/V is small (1.5 MiB): see small_call
constexpr int kOneSplitKeys = 384;    // the longest length that is one split (no combine) in a small call
constexpr int kMergeUnroll = 16;      // splits whose partials the last CTA's merge keeps in flight per thread
// + slack to start the rings on an aligned boundary. The bank mapping alone would not need it (the XOR
// swizzle is conflict-free from any 16-byte aligned base), but the streams do: rings right after the
// static shared memory (16-byte aligned) ran 10-17% slower (H200, bf16: 16 x 16k 234.8 -> 274.1 us,
// 1 x 4k 6.71 -> 7.34), a 256-byte boundary as fast as this one (perf/attention.md "Session 26").
constexpr int kSmemBytes = kWarps * kRingBytes + 1024;
// The speculating kernel stages q in shared memory after the rings: [kRows][D + 8] 16-bit values (a padded
// row, so that ldmatrix reads it without bank conflicts), sized for the largest head_dim.
constexpr int kSpecSmemBytes = kSmemBytes + kRows * (128 + 8) * 2;

template <typename T, int D>
constexpr int kTileBytes = 2 * kTK * D * int(sizeof(T));  // K + V of one 16-key tile
template <typename T, int D>
constexpr int kStages = kRingBytes / kTileBytes<T, D>;  // K+V tiles a warp's ring holds: 3 at d 128, 6 at d 64

// A grid that fills the GPU streams its long ranges with fewer tiles in flight than the ring holds: about
// 12 KB a warp and at least two tiles (2 at d 128, 3 at d 64), on a card whose DRAM gives an SM less than
// kShallowBelowGBps. With every SM streaming, the bytes in flight that cover DRAM's latency grow with its
// bandwidth: on the H100 (3.35 TB/s, 25 GB/s an SM) the whole rings (12 MB over the GPU at d 128)
// streamed slower than two tiles (8 MB); on the H200 (4.8 TB/s, 36.5 GB/s an SM) two tiles streamed slower.
// A grid of few CTAs needs each one's whole ring on either. Back to back, bf16, 32 q / 8 kv heads, us,
// whole ring -> two tiles. H100: 16 x 16k 347.0 -> 342.3, 16 x 32k 692.0 -> 676.3, 14 x 16k 319.2 ->
// 300.6, 12 x 16k (96 CTAs) 265.0 -> 260.9, 1 x 32k 47.4 -> 46.7, d 64 16 x 16k 180.1 -> 172.0 (three);
// but 9 x 16k (72 CTAs) 193.6 -> 209.3, and 16 x 1k (16 tiles a warp) 24.3 -> 24.6 (perf/attention.md
// "Session 30"). H200, one machine, two passes: 16 x 16k 234.2 -> 235.0, 16 x 32k 464.8-465.0 ->
// 466.7-466.8, 14 x 16k 208.3-208.6 -> 212.5, d 64 16 x 16k 119.6 -> 124.6-124.8, 16 x 4k 60.6 -> 61.2,
// 1 x 32k 33.6-33.7 -> 34.2; 9 x 16k level ("Session 35").
constexpr int kFullGridRingBytes = 12 << 10;
constexpr int kLongStreamTiles = 16;
constexpr double kShallowBelowGBps = 30.0;  // DRAM bandwidth per SM
template <typename T, int D>
constexpr int kFullGridStages = kFullGridRingBytes / kTileBytes<T, D> > 2 ? kFullGridRingBytes / kTileBytes<T, D> : 2;

// Whether a launch of `ctas` CTAs takes the shallow full-grid kernel: it fills the GPU (7/10 of the SMs),
// its capacity gives a warp more than kLongStreamTiles tiles, and the card's DRAM bandwidth per SM is
// under kShallowBelowGBps (-1, unknown, counts as under). The FULL_GRID kernel then checks each warp's
// actual tiles (long_stream).
// (H100, 32 q / 8 kv heads at 16k keys, full-grid depth against the whole ring: 88 CTAs lost, 241.2 ->
// 244.8 us at d 128 and 124.5 -> 128.2 at d 64; 96 CTAs gained, 265.4 -> 262.9 and 147.2 -> 136.8.)
__host__ __forceinline__ bool full_grid(int64_t ctas, int sms, int capacity, int64_t splits, double dram_per_sm) {
  return 10 * ctas >= 7 * int64_t{sms} && capacity > splits * kWarps * kTK * kLongStreamTiles &&
         dram_per_sm < kShallowBelowGBps;
}
__host__ __device__ __forceinline__ bool long_stream(int warp_tiles) { return warp_tiles > kLongStreamTiles; }

// One sequence's split, in a call of `pairs` (batch, kv block) pairs (host and device: the plan query
// makes the kernel's choice): how many splits get keys, and their whole tiles, dealt evenly: each active
// split takes `base` tiles, the first `extra` one more, and every split gets at least kMinChunk / kTK
// whole tiles. So every launched split is active once the length has kMinChunk keys per split. That
// matters beyond the split's own share: a CTA with no keys exits at once, and back to back the next
// call's CTAs then double up on SMs (two of one call on an SM stream at about half the rate each). Until
// the twenty-second session the chunk was rounded up to whole tiles instead, which left splits empty (1 x
// 32k, 32 q / 2 kv heads: 64 of 66 active, 33 SMs with two CTAs of one call; 16.4 -> 14.8 us with all 66
// active; perf/attention.md).
// A length that one CTA's rings hold at once (192 keys at d 128, 384 at d 64) is one split, since a
// combine costs more than such a stream (H200, bf16, us, back to back: 1 x 128 ctx, 9 q / 3 kv heads,
// d 64: 3.67 -> 2.19; 32 / 8, d 128: 4.13 -> 2.72; 1 x 256, 32 / 8, d 64: 4.75 -> 2.70). In a small call
// (small_call: its rings filled at once, below) so is a length up to kOneSplitKeys, the second round
// streaming after the wait (H100, 32 / 8, d 128: 1 x 256 5.36 -> 3.55, 1 x 320 5.92 -> 4.15, 1 x 384
// 6.33 -> 4.72; at 1 x 512 one split lost, 4.49 -> 5.92, and so did 4 x 256, 4.94 -> 5.23, with the
// early loads throttled).
struct Split {
  int n_active, base, extra;
};
template <typename T, int D>
__host__ __device__ __forceinline__ bool small_call(int64_t pairs, int n_tiles) {  // K/V of at most kBurstBytes
  return pairs * n_tiles * kTileBytes<T, D> <= kBurstBytes;
}
template <typename T, int D>
__host__ __device__ __forceinline__ Split split_of(int len, int num_splits, int64_t pairs) {
  constexpr int ring_keys = kWarps * kStages<T, D> * kTK;
  const int n_tiles = (len + kTK - 1) / kTK;
  const bool one = len <= ring_keys || (len <= kOneSplitKeys && small_call<T, D>(pairs, n_tiles));
  const int n_active = one ? 1 : min(num_splits, n_tiles / (kMinChunk / kTK));
  return {n_active, n_tiles / n_active, n_tiles % n_active};
}

// How a (batch, kv block)'s splits combine, the same choice in every CTA of the pair (H200, bf16, us,
// back to back):
// - Up to 16 splits: the last CTA, a thread per (row, 4 dims), reads them from L2 in one pass and folds
//   them max first (fold_partials); a split's (max, sum) and O are independent loads, so a round keeps
//   all 16 in flight, predicated past the count. (16 rather than 8: 1 x 1k 6.17-6.36 -> 6.01-6.07, 1 x 8k
//   with 4 kv heads 13.35 -> 13.0. Until the twenty-ninth session a count under 16 was a remainder loop, one round trip
//   a split: H100, 1 x 448 keys, 14 splits 6.66 -> 4.24 us; 2 x 4k, 8 splits 14.07 -> 12.93.)
// - More that shared memory holds at once (few, small rows: 9 q / 3 kv heads at d 64 has 44 splits of
//   48 (row, 4 dims) items): the last CTA copies them in by every thread's cp.async, one round trip,
//   and merges there: 1 x 2k 7.07 -> 5.13, 1 x 8k 8.22 -> 6.30, 1 x 32k 13.47 -> 10.79. (For 16 splits
//   of 32 q / 8 kv heads it lost: 1 x 4k 7.42 -> 7.96.)
// - More than two such rounds' worth otherwise (many splits of big rows: 32 q / 2 kv heads at d 128
//   has 66 splits of 16 rows, 540 KB of partials), spread: every split waits for the last arrival and
//   merges its slice of the outputs from all splits, one round each: 1 x 4k 15.82 -> 7.51, 1 x 32k
//   25.17 -> 16.58; 12 q / 2 kv heads at 4k 9.72 -> 7.00. That needs every split of the pair
//   resident at once: the grid is at most one CTA per SM where it splits, and two fit.
// The last CTA's merge from L2 also takes more splits in rounds of 16 where spreading is not allowed.
enum class Merge { kNone, kLastFromL2, kLastInSmem, kSpread };
template <int D>
__host__ __device__ __forceinline__ Merge merge_of(int n_active, int rows, int block_rows, bool all_resident) {
  if (n_active == 1) return Merge::kNone;
  const int items = rows * (D / 4);             // (row, 4 dims) outputs of the pair
  const int per_split = block_rows * (D + 4);  // floats of a split's partial: O, then (max, sum, -, -) per row
  if (n_active > kMergeUnroll && n_active * per_split * 4 <= kWarps * kRingBytes) return Merge::kLastInSmem;
  if (all_resident && items * n_active > 2 * kMergeUnroll * kThreads) return Merge::kSpread;
  return Merge::kLastFromL2;
}

// Whether a sequence's splits speculate (in the SPECULATE kernel, with stable_prefix; host and device, the
// same rule): a warp has more than kSpecTiles tiles, the splits do not combine by spreading, and the call
// is not a small call's one split. Measured in the forty-third session (H200, bf16, back to back, us,
// the other kernel -> speculating, SDPA in brackets): 1 x 16k 19.3 -> 16.1 (22.9), 1 x 32k 34.0 -> 30.4,
// 2 x 4k 10.2 -> 9.1, 16 x 4k 61.9 -> 58.1 (63.4), 16 x 16k 240.3 -> 232.3 (239.5), 16 x 32k 476.1 ->
// 466.8 (473.7), 64 x 16k 955 -> 940; spread combines lost (32 q / 2 kv heads at 32k, 13.95 -> 16.9).
// At 3-4 tiles a warp it lost then (1 x 4k 6.4 -> 7.1) and wins since q is read once a CTA (the forty-
// fourth session: 1 x 4k 6.37 -> 5.62, d 64 4.94 -> 4.30, with the newest key's tile split); at one tile
// a warp it does not pay (1 x 1k 4.48 -> 5.27).
template <typename T, int D>
__host__ __device__ __forceinline__ bool speculates(const Split& sp, Merge merge, int64_t pairs, int n_tiles) {
  const bool small_one = sp.n_active == 1 && small_call<T, D>(pairs, n_tiles);
  return (sp.base + kWarps - 1) / kWarps > kSpecTiles && merge != Merge::kSpread && !small_one;
}

struct DecodeParams {
  const void* q;  // q[b, h, :] at b*q_bs + h*q_hs
  const void* k;  // k[b, j, kvh, :] at b*k_bs + j*k_ss + kvh*k_hs
  const void* v;
  void* o;          // [batch, heads, D] contiguous
  float* ws_o;      // [batch * kv_blocks, num_splits, rows, D] unnormalised partial outputs
  float4* ws_ml;    // [batch * kv_blocks, num_splits, rows] (max in log2 units, sum, -, -)
  int* counters;    // [batch * kv_blocks], zero between launches
  const int* start_pos;
  int64_t q_bs, q_hs, k_bs, k_ss, k_hs, v_bs, v_ss, v_hs;
  int heads, group;
  int hblocks;      // kv blocks per kv head: ceil(group / 16)
  int rows;         // q heads per kv block: min(group, 16) (the last block of a group may have fewer)
  int capacity, num_splits;
  int stable_prefix;  // start_pos and the cache rows before start_pos[b] may be read before the wait
  int all_resident;   // the grid fits on the GPU at once: the splits of a pair may wait for each other
  float scale_log2;
};

// Element offset of 16-byte chunk `chunk` of row `row` in a [kTK, D] tile: column half chunk / 8 is a
// [kTK][64] block, chunks XOR-swizzled with the row (mod 8).
// The 8 rows one ldmatrix reads hit 8 different bank groups.
__device__ __forceinline__ int tile_off(int row, int chunk) {
  return (chunk >> 3) * (kTK * 64) + row * 64 + (((chunk & 7) ^ (row & 7)) << 3);
}

template <typename T>
__device__ __forceinline__ void store4(T* dst, float4 x) {  // 4 elements, 8-byte aligned
  uint2 u;
  u.x = pack2<T>(x.x, x.y);
  u.y = pack2<T>(x.z, x.w);
  *reinterpret_cast<uint2*>(dst) = u;
}

__device__ __forceinline__ void fma4(float4& o, float4 x, float w) {
  o.x = fmaf(x.x, w, o.x), o.y = fmaf(x.y, w, o.y), o.z = fmaf(x.z, w, o.z), o.w = fmaf(x.w, w, o.w);
}

__device__ __forceinline__ float4 scale4(float4 x, float w) { return make_float4(x.x * w, x.y * w, x.z * w, x.w * w); }

// *ptr through L2 (ld.global.cg) where `live`, else `fallback`: a predicated load, no branch, so an
// unrolled run of them issues back to back whatever the count.
__device__ __forceinline__ float4 ldcg4_if(const float4* ptr, bool live, float4 fallback) {
  float4 v = fallback;
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %5, 0;\n @p ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];\n}"
               : "+f"(v.x), "+f"(v.y), "+f"(v.z), "+f"(v.w)
               : "l"(ptr), "r"(static_cast<int>(live))
               : "memory");
  return v;
}

// Folds N partials (max in .x, sum in .y of ml; unnormalised O in os) into a running (mx, sum, o), which
// starts at (-inf, 0, 0). Their max first, so that the N weights are independent of each other, where
// one partial at a time chains N max / exp2 / rescale steps (the last CTA's merge from L2 folds 16 at a
// time; H200, bf16, back to back, us: 1 x 1k 4.68 -> 4.52, 1 x 16k 16.2-16.6 -> 15.7-16.0, 1 x 32k
// 30.0-30.3 -> 29.6; perf/attention.md "Session 44"). At least one partial must be a real split's
// (finite max); predicated-off ones (max -inf) weigh 0.
template <int N>
__device__ __forceinline__ void fold_partials(float& mx, float& sum, float4& o, const float4 (&ml)[N],
                                              const float4 (&os)[N]) {
  float m = mx;
#pragma unroll
  for (int i = 0; i < N; ++i) m = fmaxf(m, ml[i].x);
  const float a = exp2f(mx - m);  // 0 while mx is -inf
  sum *= a;
  o = scale4(o, a);
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const float w = exp2f(ml[i].x - m);
    sum = fmaf(ml[i].y, w, sum);
    fma4(o, os[i], w);
  }
  mx = m;
}

template <typename T, int D, bool FULL_GRID, bool SPECULATE>
__global__ void __launch_bounds__(kThreads, 2)
    flash_decode_kernel(const DecodeParams p) {
  constexpr int KD = D / 16;  // k-steps of Q K^T
  constexpr int DT = D / 8;   // 8-wide output tiles
  constexpr int CH = D / 8;   // 16-byte chunks per row
  constexpr int TILE = kTK * D;                                         // elements of one K (or V) tile
  constexpr int STAGES = kStages<T, D>;
  constexpr int OS = D + 8;   // float row stride of the warp partials (conflict-free float2 stores)
  static_assert(STAGES >= 2 && kRows * OS * 4 <= kRingBytes, "ring too small");
  extern __shared__ unsigned char smem_raw[];  // kWarps rings of kRingBytes, from a 1024-byte boundary
  __shared__ float s_m[kWarps][kRows], s_l[kWarps][kRows];
  __shared__ int s_last;
  unsigned char* smem = smem_raw + ((1024 - smem_addr(smem_raw) % 1024) % 1024);

  const int split = blockIdx.x, blk = blockIdx.y, b = blockIdx.z;
  const int kvh = blk / p.hblocks, hb = blk % p.hblocks;
  const int head0 = kvh * p.group + hb * kRows;
  const int rows = min(kRows, p.group - hb * kRows);  // valid q heads of this block
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;

  // q's lines go to L2 first thing, before the wait: a prefetch returns no data, so it is safe while the
  // previous kernel may still be writing q (L2 is where its stores land), and a q that is not in L2
  // (the benchmark's rotated inputs) is no longer a DRAM round trip after the wait. (H200, bf16, 32 q /
  // 8 kv heads, back to back, us: 1 x 2k 5.08 -> 5.00, 1 x 4k 6.53 -> 6.38, 1 x 8k 10.93 -> 10.52,
  // 2 x 4k 10.44 -> 10.21, 1 x 16k 19.65 -> 19.25; batch 16 level; the H100 gains at batch 1-2 too;
  // perf/attention.md "Session 36".)
  {
    // 128-byte lines of a q row (a row that starts off a line boundary keeps its tail out of the prefetch)
    constexpr int kLines = D * int(sizeof(T)) / 128;
    if (warp == 0 && lane < rows * kLines) {
      const T* qr = reinterpret_cast<const T*>(p.q) + b * p.q_bs + (head0 + lane / kLines) * p.q_hs;
      prefetch_l2(reinterpret_cast<const char*>(qr) + 128 * (lane % kLines));
    }
  }
  // This split's keys [s0, s1) of the actual length (split_of). Its warp `warp` takes tiles warp,
  // warp + 4, ... of them (n_my).
  int len = 0, n_active = 1, s0 = 0, s1 = 0, n_my = 0;
  Split seq_split{};  // the sequence's split (split_of)
  auto take_range = [&] {
    len = max(0, min(p.start_pos[b] + 1, p.capacity));
    const Split sp = split_of<T, D>(len, p.num_splits, static_cast<int64_t>(gridDim.y) * gridDim.z);
    n_active = sp.n_active, seq_split = sp;
    const int n_tiles = sp.base + (split < sp.extra), tile0 = split * sp.base + min(split, sp.extra);
    s0 = tile0 * kTK, s1 = min(s0 + n_tiles * kTK, len);
    n_my = n_tiles > warp ? (n_tiles - warp + kWarps - 1) / kWarps : 0;
  };

  T* ring = reinterpret_cast<T*>(smem + warp * kRingBytes);  // [STAGES][K tile, V tile], tile_off layout
  const T* kg = reinterpret_cast<const T*>(p.k) + b * p.k_bs + kvh * p.k_hs;
  const T* vg = reinterpret_cast<const T*>(p.v) + b * p.v_bs + kvh * p.v_hs;
  auto tile_key0 = [&](int i) { return s0 + (warp + i * kWarps) * kTK; };  // this warp's tile i
  // Keys >= s1 are zero-filled, never read (a cache slot past the length may hold anything, NaN
  // included); the consumer masks their scores.
  // Chunk j of this lane's share of a [kTK, D] tile: rows from src (stride ss) into dst, zero-filled
  // from row `valid` on.
  auto copy_chunk = [&](T* dst, const T* src, int64_t ss, int valid, int j) {
    const int idx = lane + 32 * j, r = idx / CH, c = idx % CH;
    const bool ok = r < valid;
    cp_async16(dst + tile_off(r, c), src + (ok ? r : 0) * ss + c * 8, ok);
  };
  auto load_tile = [&](int i, int st) {
    const int key0 = tile_key0(i);
    T* dk = ring + st * 2 * TILE;
    T* dv = dk + TILE;
    const int valid = s1 - key0;
    const T* gk = kg + key0 * p.k_ss;
    const T* gv = vg + key0 * p.v_ss;
#pragma unroll
    for (int j = 0; j < kTK * CH / 32; ++j) {
      copy_chunk(dk, gk, p.k_ss, valid, j);
      copy_chunk(dv, gv, p.v_ss, valid, j);
    }
    cp_async_commit();
  };

  // The K rows (v_half false) or the V rows of this warp's tile i as one cp.async group: the pieces of
  // the early loads below where a whole tile is more than kEarlyPieceBytes.
  auto load_half = [&](int i, int st, bool v_half) {
    const int key0 = tile_key0(i);
    T* dst = ring + st * 2 * TILE + (v_half ? TILE : 0);
    const int64_t ss = v_half ? p.v_ss : p.k_ss;
    const T* src = (v_half ? vg : kg) + key0 * ss;
    const int valid = s1 - key0;
#pragma unroll
    for (int j = 0; j < kTK * CH / 32; ++j) copy_chunk(dst, src, ss, valid, j);
    cp_async_commit();
  };

  // Q as A fragments (rows = heads head0 .. head0 + 15, zeros past `rows`), straight from global memory
  // (the previous kernel may have written it).
  uint32_t qf[KD][4];
  auto load_q = [&](uint32_t (&f)[KD][4]) {
    const T* qb = reinterpret_cast<const T*>(p.q) + b * p.q_bs + head0 * p.q_hs + 2 * t;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = g + 8 * half;
      const T* qr = qb + r * p.q_hs;
#pragma unroll
      for (int kk = 0; kk < KD; ++kk) {
        f[kk][half] = r < rows ? *reinterpret_cast<const uint32_t*>(qr + kk * 16) : 0u;
        f[kk][2 + half] = r < rows ? *reinterpret_cast<const uint32_t*>(qr + kk * 16 + 8) : 0u;
      }
    }
  };

  // The speculating kernel's q: read once a CTA in 16-byte pieces (attention() passes rows 16-byte
  // aligned) through L2 (ld.global.cg, so that the read after the wait cannot be answered by a stale L1
  // line), staged in shared memory, and taken as fragments by ldmatrix. Each warp reading its own
  // fragments, as the other kernel does, sent 16 times the requests (four warps, 4 bytes each) to the same
  // few lines, twice a call: speculating at 1 x 4k took 7.10 us that way (session 43), 5.83 this way, and
  // 1 x 16k 16.2 -> 15.2 (H200, bf16, back to back; perf/attention.md "Session 44").
  constexpr int QS = D + 8, QCH = D / 8, QPT = (kRows * QCH + kThreads - 1) / kThreads;
  static_assert(kRows * QS * int(sizeof(T)) <= kSpecSmemBytes - kSmemBytes, "q's stage must fit past the rings");
  T* s_q = reinterpret_cast<T*>(smem + kWarps * kRingBytes);  // [kRows][QS]
  auto read_q = [&](uint4 (&v)[QPT]) {  // this thread's 16-byte pieces of the rows (zeros past the end)
#pragma unroll
    for (int j = 0; j < QPT; ++j) {
      const int i = tid + j * kThreads, r = min(i / QCH, rows - 1), c = i % QCH;
      const T* src = reinterpret_cast<const T*>(p.q) + b * p.q_bs + (head0 + r) * p.q_hs + c * 8;
      v[j] = i < rows * QCH ? __ldcg(reinterpret_cast<const uint4*>(src)) : make_uint4(0u, 0u, 0u, 0u);
    }
  };
  auto stage_q = [&](const uint4 (&v)[QPT]) {  // into s_q and the fragments; every thread of the CTA
#pragma unroll
    for (int j = 0; j < QPT; ++j) {
      const int i = tid + j * kThreads;
      if (i < rows * QCH) *reinterpret_cast<uint4*>(s_q + (i / QCH) * QS + (i % QCH) * 8) = v[j];
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < KD; ++kk) {
      ldsm_x4(qf[kk], s_q + ((lane % 8) + ((lane / 8) % 2) * 8) * QS + kk * 16 + (lane / 16) * 8);
      if (g >= rows) qf[kk][0] = qf[kk][2] = 0u;  // rows past the group: never staged
      if (g + 8 >= rows) qf[kk][1] = qf[kk][3] = 0u;
    }
  };

  // Per thread: rows g (index 0) and g + 8 (index 1) of the 16 heads.
  float acc[DT][4], m_row[2], l_row[2];
  auto reset = [&] {
#pragma unroll
    for (int i = 0; i < DT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
    m_row[0] = m_row[1] = -INFINITY, l_row[0] = l_row[1] = 0.f;
  };

  // One 16-key tile (K at tk, V at tv, keys from `valid` on masked) into acc, m_row and l_row.
  auto consume = [&](const T* tk, const T* tv, int valid) {
    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};  // keys 0-7, 8-15 of the tile
#pragma unroll
    for (int kk = 0; kk < KD; ++kk) {
      uint32_t bf[4];
      ldsm_x4(bf, tk + tile_off((lane % 8) + (lane / 16) * 8, kk * 2 + (lane / 8) % 2));
      mma_16816<T>(s[0], qf[kk], bf[0], bf[1]);
      mma_16816<T>(s[1], qf[kk], bf[2], bf[3]);
    }

    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = s[j][e] * p.scale_log2;  // log2 units: exp2f below
        if (j * 8 + 2 * t + (e & 1) >= valid) x = -INFINITY;  // a select: NaN scores of stray keys vanish
        s[j][e] = x;
        mx[e / 2] = fmaxf(mx[e / 2], x);
      }
    }
    float alpha[2], base[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffff, mx[h], 1));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffff, mx[h], 2));
      const float m_new = fmaxf(m_row[h], mx[h]);  // finite: key 0 of the tile is valid
      base[h] = m_new;
      alpha[h] = exp2f(m_row[h] - m_new);  // 0 on the first tile (m_row = -inf)
      m_row[h] = m_new;
      l_row[h] *= alpha[h];
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[j][e] = exp2f(s[j][e] - base[e / 2]);
        l_row[e / 2] += s[j][e];  // this thread's columns; the quad is summed at the end
      }
    }
#pragma unroll
    for (int d = 0; d < DT; ++d) {
      acc[d][0] *= alpha[0], acc[d][1] *= alpha[0];
      acc[d][2] *= alpha[1], acc[d][3] *= alpha[1];
    }
    // The C fragments of the two score tiles are the A fragment of P (16 heads x 16 keys).
    uint32_t pf[4];
    pf[0] = pack2<T>(s[0][0], s[0][1]);
    pf[1] = pack2<T>(s[0][2], s[0][3]);
    pf[2] = pack2<T>(s[1][0], s[1][1]);
    pf[3] = pack2<T>(s[1][2], s[1][3]);
#pragma unroll
    for (int dd = 0; dd < DT / 2; ++dd) {
      uint32_t vf[4];
      ldsm_x4_trans(vf, tv + tile_off((lane % 8) + ((lane / 8) % 2) * 8, dd * 2 + lane / 16));
      mma_16816<T>(acc[2 * dd], pf, vf[0], vf[1]);
      mma_16816<T>(acc[2 * dd + 1], pf, vf[2], vf[3]);
    }
  };

  // This warp's tiles [i0, n) through its ring, tile i0 + j in slot j % depth, loading nothing past n; the
  // first `issued` of them are in flight already. In flight: one tile (`one`), or the whole ring, or in a
  // full grid's long stream SHALLOW of its slots (such a warp loads nothing before the wait).
  constexpr int SHALLOW = kFullGridStages<T, D>;
  static_assert(SHALLOW <= STAGES, "the shallow depth is part of the ring");
  static_assert(kLongStreamTiles >= 8 && kLongStreamTiles * kWarps * kTK >= kOneSplitKeys,
                "a long stream must not have loaded tiles early (warps with at most 8 tiles, or a small call, do)");
  auto stream = [&](int i0, int n, bool one, int issued) {
    const bool shallow = FULL_GRID && long_stream(n_my);
    const int depth = one ? 1 : shallow ? SHALLOW : STAGES;
    for (int j = issued; j < depth; ++j) {
      if (i0 + j < n) load_tile(i0 + j, j);
      else cp_async_commit();  // keep one group per stage: the waits count groups
    }
    if (i0 == 0) reset();  // a stream from the first tile starts the softmax state afresh
    int st = 0;
    for (int i = i0; i < n; ++i) {
      T* tk = ring + st * 2 * TILE;
      T* tv = tk + TILE;
      const int valid = s1 - tile_key0(i);  // >= 1
      if (one) cp_async_wait<0>();  // tile i has landed (this lane's copies) ...
      else if (shallow) cp_async_wait<SHALLOW - 1>();
      else cp_async_wait<STAGES - 1>();
      __syncwarp();  // ... and every lane's
      consume(tk, tv, valid);
      __syncwarp();  // every lane is done with slot st: refill it
      if (i + depth < n) load_tile(i + depth, st);
      else cp_async_commit();
      if (++st == depth) st = 0;
    }
  };

  // Not speculating: with a stable prefix the length is read and the split laid out before
  // griddepcontrol.wait, while the previous kernel runs, and a warp with at most 8 tiles loads its first
  // kEarlyTiles there too, as far as they lie wholly before the newest key (start_pos[b], which the
  // previous kernel, kv_cache_write in the engine, may be writing). Tiles fill in order, so the cp.async groups keep
  // their count whichever side of the wait a tile was issued on (a tile loaded in two pieces is two
  // groups, both complete but the last).
  // The early loads are throttled: one piece of kEarlyPieceBytes in flight per warp, the next issued
  // once it has landed. They run while the previous call's last tiles stream and its split combine
  // makes its round trips through L2, and those queue behind whatever is in flight: issued all at once
  // (12.6 MB over the GPU at 1 x 4k), they held the previous call up by more than they saved. H200,
  // bf16, 32 q / 8 kv heads, back to back, us: the rule until the twenty-fourth session (all tiles but
  // the last of a warp with at most 4, issued at once) -> kEarlyTiles of a warp with at most 8, one
  // tile in flight -> one half tile in flight (this code), d 128: 1 x 1k 4.90 -> 4.91 -> 4.73; 1 x 2k
  // 5.89 -> 5.52 -> 5.28; 1 x 4k 7.39 -> 7.00 -> 6.68; 1 x 8k 12.08 -> 11.36 -> 10.70; 2 x 4k 13.0 ->
  // 12.2 -> 11.65. At d 64 a whole tile is 4 KB: 1 x 4k 5.52 -> 5.04 (halves: 5.29). Early tiles for
  // warps with up to 16 tiles lost (1 x 16k 19.86 -> 20.44). perf/attention.md "Session 24".
  // A one-split call of at most kBurstBytes of K/V fills its rings at once instead: so few bytes hardly
  // slow the previous call, while the throttle's round trips, one per piece, outlast a call this short
  // (H100, bf16, back to back, us: 32 q / 8 kv heads, d 128, 1 x 192 3.78 -> 3.12; 9 / 3 and 32 / 8
  // heads, d 64, 1 x 384 3.42 -> 3.20 and 3.45 -> 3.26; split calls at once were level or slower, 1 x 512
  // 4.49 -> 4.62 at 2 MiB). With two pieces a tile, both groups are in flight; the loop's waits then
  // wait for a little more than they need, never less.
  // More bytes before the wait lost in every form tried (a whole-split ring without co-residence, L2
  // fills of the tile past the early ones; 1 x 4k 6.39 -> 6.84-7.79 us, perf/attention.md sessions 39-40).
  //
  // Speculating (the SPECULATE kernel, with stable_prefix, where `speculates`): q is read before
  // griddepcontrol.wait, while the previous kernel may still be writing it, and every tile wholly before
  // the newest key is streamed and consumed there (one tile in flight for a warp of up to
  // kSpecThrottleTiles, as the early loads above; the whole depth past that); the next kernel is released
  // at entry, so that its CTAs stream while this grid ends. After the wait q is read again: the same bits,
  // and the work stands (it is the work of the final q); else it is done again with the final q. Nothing
  // is written before the wait. (One tile in flight there rather than the ring: 1 x 8k 10.9 -> 9.3 us, 2 x
  // 4k 10.4 -> 9.1; the next kernel released after the wait instead of at entry: 1 x 32k 30.1 -> 36.1, 16 x 16k
  // 243.5 -> 277.1; perf/attention.md "Session 43".)
  // In a warp of up to kSpecThrottleTiles tiles the newest key's tile is split: its older rows load before
  // the wait, the newest row's lines are prefetched to L2 (no data returns: safe while the previous kernel
  // writes them), and after the wait only that row is read, issued before q's check so that the two round
  // trips overlap. (H200, bf16, us, the whole tile after the check -> split, -> issued before the check:
  // 1 x 4k 5.83 -> 5.72 -> 5.62, d 64 4.39 -> 4.54 -> 4.29. Longer warps lost with the split, 1 x 16k 15.2 ->
  // 16.6-16.9, and keep the whole tile; perf/attention.md "Session 44".)
  bool spec = false, row_split = false;
  uint4 q_pre[QPT];  // speculative: q as read before the wait
  int n_pre = 0;  // speculative: the tiles consumed before the wait
  int filled = 0;  // otherwise: the tiles loaded before the wait
  if (p.stable_prefix) {
    take_range();
    if (split >= n_active) return;
    if constexpr (SPECULATE)
      spec = speculates<T, D>(seq_split, merge_of<D>(n_active, rows, p.rows, p.all_resident),
                              static_cast<int64_t>(gridDim.y) * gridDim.z, (len + kTK - 1) / kTK);
    if (spec) {
#if MINFER_DECODE_PDL
      asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
      read_q(q_pre);
      stage_q(q_pre);
      n_pre = n_my;
      if (n_my > 0 && min(tile_key0(n_my - 1) + kTK, s1) > len - 1) --n_pre;  // holds the newest key
      stream(0, n_pre, n_my <= kSpecThrottleTiles, 0);
      row_split = n_pre < n_my && n_my <= kSpecThrottleTiles;
      if (row_split) {  // the newest key's tile into slot 0 but its newest row (zero-filled); that row to L2
        const int key0 = tile_key0(n_pre), r_new = len - 1 - key0;
#pragma unroll
        for (int j = 0; j < kTK * CH / 32; ++j) {
          copy_chunk(ring, kg + key0 * p.k_ss, p.k_ss, r_new, j);
          copy_chunk(ring + TILE, vg + key0 * p.v_ss, p.v_ss, r_new, j);
        }
        cp_async_commit();
        constexpr int kLines = D * int(sizeof(T)) / 128;  // 128-byte lines of a row
        if (lane < 2 * kLines)
          prefetch_l2(reinterpret_cast<const char*>(lane < kLines ? kg + (len - 1) * p.k_ss : vg + (len - 1) * p.v_ss) +
                      128 * (lane % kLines));
      }
    } else {
      static_assert(kEarlyTiles <= STAGES, "early tiles must fit the ring");
      // (The call's K/V is counted with every sequence at this one's length.)
      const bool at_once =
          n_active == 1 && small_call<T, D>(static_cast<int64_t>(gridDim.y) * gridDim.z, (len + kTK - 1) / kTK);
      const int early = at_once ? min(STAGES, n_my) : n_my <= 8 ? min(kEarlyTiles, n_my) : 0;
      while (filled < early && min(tile_key0(filled) + kTK, s1) <= len - 1) {
        if (filled >= 1 && !at_once) cp_async_wait<0>();
        if constexpr (kTileBytes<T, D> > kEarlyPieceBytes) {
          load_half(filled, filled, false);
          if (!at_once) cp_async_wait<0>();
          load_half(filled, filled, true), ++filled;
        } else {
          load_tile(filled, filled), ++filled;
        }
      }
    }
  }

#if MINFER_DECODE_PDL
  // Launched as a programmatic dependent: the launch and the index setup above overlapped the previous
  // kernel's tail; q, start_pos, the caches, the counters and the workspace may be its outputs (start_pos
  // and the cache prefix not, with stable_prefix).
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  // The next kernel may launch now: its CTAs take the SMs' free slots and wait in their own
  // griddepcontrol.wait, which returns only once this grid is complete. (A grid with CTAs still to
  // place triggers only once they all have run this line, so they never compete with it.) Released
  // here rather than after the stream: back to back at batch 16 x 4k 71.8 -> 62.4 us, 16 x 16k
  // 280.9 -> 239.6, batch 1 x 4k 9.5 -> 8.8 (H200, bf16, perf/attention.md "Session 13"). Released at
  // kernel entry it lost on the H200 at d 128, batch 1 and 16 (sessions 21, 40-41), where the next
  // call's CTAs had nothing to do before their wait; a speculating CTA has released it at entry.
  if (!spec) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif

  int from = 0;  // the first tile still to stream
  if (!spec) {
    load_q(qf);
    if (!p.stable_prefix) {
      take_range();
      if (split >= n_active) return;
    }
  } else if constexpr (SPECULATE) {
    if (row_split) {  // the newest row into slot 0, once every lane's zero-filled copy of it has landed
      cp_async_wait<0>();
      __syncwarp();
      const int r_new = len - 1 - tile_key0(n_pre), c = lane % CH;
      if (lane < 2 * CH) {
        const bool v_row = lane >= CH;
        cp_async16((v_row ? ring + TILE : ring) + tile_off(r_new, c),
                   (v_row ? vg + (len - 1) * p.v_ss : kg + (len - 1) * p.k_ss) + c * 8, true);
      }
      cp_async_commit();
    }
    uint4 q_final[QPT];
    read_q(q_final);
    bool changed = false;
#pragma unroll
    for (int j = 0; j < QPT; ++j) {
      const uint4 a = q_final[j], e = q_pre[j];
      changed = changed || a.x != e.x || a.y != e.y || a.z != e.z || a.w != e.w;
    }
    if (__syncthreads_or(changed)) {  // q changed after the first read: start over with the final q
      cp_async_wait<0>();             // nothing of the first pass lands in the ring from here on
      stage_q(q_final);
    } else if (row_split) {
      cp_async_wait<0>();
      __syncwarp();
      consume(ring, ring + TILE, s1 - tile_key0(n_pre));
      from = n_my;
    } else {
      from = n_pre;
    }
  }
  stream(from, n_my, false, filled);
  cp_async_wait<0>();
  __syncwarp();

  // Warp partials into the warp's own ring: O [16][OS] floats, max and sum per row.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l_row[h] += __shfl_xor_sync(0xffffffff, l_row[h], 1);
    l_row[h] += __shfl_xor_sync(0xffffffff, l_row[h], 2);
  }
  float* so = reinterpret_cast<float*>(ring);
#pragma unroll
  for (int d = 0; d < DT; ++d) {
    *reinterpret_cast<float2*>(so + g * OS + d * 8 + 2 * t) = make_float2(acc[d][0], acc[d][1]);
    *reinterpret_cast<float2*>(so + (g + 8) * OS + d * 8 + 2 * t) = make_float2(acc[d][2], acc[d][3]);
  }
  if (t == 0) {
    s_m[warp][g] = m_row[0], s_m[warp][g + 8] = m_row[1];
    s_l[warp][g] = l_row[0], s_l[warp][g + 8] = l_row[1];
  }
  __syncthreads();

  // Merge the warps: thread per (row, 4 dims). Idle warps have max -inf and weigh 0.
  const int64_t pair = static_cast<int64_t>(b) * gridDim.y + blk;  // (batch, kv block)
  const int64_t slot0 = pair * p.num_splits;                        // its split 0 in the workspace
  T* out = reinterpret_cast<T*>(p.o) + (static_cast<int64_t>(b) * p.heads + head0) * D;
  const int items = rows * (D / 4);  // (row, 4 dims) outputs of the pair
  for (int qi = tid; qi < items; qi += kThreads) {
    const int h = qi / (D / 4), d = (qi % (D / 4)) * 4;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, s_m[w][h]);
    const float mb = mx == -INFINITY ? 0.f : mx;  // no key at all (len 0): avoid inf - inf
    float sum = 0.f;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float wt = exp2f(s_m[w][h] - mb);
      sum += s_l[w][h] * wt;
      fma4(o, *reinterpret_cast<const float4*>(reinterpret_cast<const float*>(smem + w * kRingBytes) + h * OS + d),
           wt);
    }
    if (n_active == 1) {
      store4(out + h * D + d, scale4(o, sum > 0.f ? 1.f / sum : 0.f));
    } else {
      const int64_t r = (slot0 + split) * p.rows + h;
      *reinterpret_cast<float4*>(p.ws_o + r * D + d) = o;
      if (d == 0) p.ws_ml[r] = make_float4(mx, sum, 0.f, 0.f);
    }
  }
  if (n_active == 1) return;

  const Merge merge = merge_of<D>(n_active, rows, p.rows, p.all_resident);
  const bool in_smem = merge == Merge::kLastInSmem, spread = merge == Merge::kSpread;

  // The CTA that arrives last merges the splits, reading the partials from L2 (__ldcg); or, spread,
  // every CTA waits for that arrival and merges a slice. The count is one acquire-release atomic by
  // thread 0 between two CTA barriers: the barrier before orders the CTA's partial stores ahead of its
  // release, and the one after orders the reads behind its acquire. (Two __threadfence around a relaxed
  // atomicAdd cost 0.25-0.35 us more at batch 1: 4k 7.53 -> 7.24, 2k 6.30 -> 6.05, d 64 4k 6.27 -> 5.91;
  // H200, bf16.) The last arrival resets the count to zero for the next launch. Spread, it does so with
  // a release store, and the others wait with acquire loads for the count to read zero: after their own
  // arrival it is at least one until then, and no later launch can touch it before this grid ends.
  // (Until the twenty-second session a separate generation word was bumped instead; its read before
  // the release atomic and the reset's atomic before the release store were two more round trips
  // through L2 on the chain: 1 x 4k, 32 q / 2 kv heads, 7.60 -> 7.39 us.)
  __syncthreads();
  if (tid == 0) {
    int* count = p.counters + pair;
    int prev;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;\n" : "=r"(prev) : "l"(count) : "memory");
    s_last = prev == n_active - 1;
    if (s_last) {  // every split has arrived
      if (spread) asm volatile("st.release.gpu.global.s32 [%0], 0;\n" ::"l"(count) : "memory");
      else *count = 0;  // nobody waits on it in this launch
    } else if (spread) {
      // Every split of the pair is resident (all_resident), so this ends; a bug would hang, so after
      // ~2^28 polls (minutes) the kernel traps instead.
      for (int c = 1, polls = 0; c != 0; ++polls) {
        if (polls == (1 << 28)) __trap();
        asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(c) : "l"(count) : "memory");
      }
    }
  }
  __syncthreads();

  if (spread) {
    // Split `split` merges outputs [split * per, + per) of the pair from every split; its threads are
    // `groups` groups of `per`, a group taking every groups-th split, and the groups meet in shared
    // memory (the rings are free).
    const int per = (items + n_active - 1) / n_active, groups = kThreads / per;
    const int li = tid % per, sg = tid / per, qi = split * per + li;
    float mx = -INFINITY, sum = 0.f;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
    if (sg < groups && qi < items) {
      const int h = qi / (D / 4), d = (qi % (D / 4)) * 4;
      const float4* ml_src = p.ws_ml + slot0 * p.rows + h;
      const float* o_src = p.ws_o + (slot0 * p.rows + h) * D + d;
#pragma unroll 4
      for (int s = sg; s < n_active; s += groups) {
        const float4 ml[1] = {__ldcg(ml_src + s * p.rows)};
        const float4 os[1] = {__ldcg(reinterpret_cast<const float4*>(o_src + static_cast<int64_t>(s) * p.rows * D))};
        fold_partials(mx, sum, o, ml, os);
      }
    }
    float4* g_o = reinterpret_cast<float4*>(smem);  // [groups][per]
    float2* g_ml = reinterpret_cast<float2*>(g_o + kThreads);
    if (sg < groups) g_o[tid] = o, g_ml[tid] = make_float2(mx, sum);
    __syncthreads();
    if (sg == 0 && qi < items) {
      const int h = qi / (D / 4), d = (qi % (D / 4)) * 4;
      float m = -INFINITY;
      for (int gi = 0; gi < groups; ++gi) m = fmaxf(m, g_ml[gi * per + li].x);  // finite: group 0 has split 0
      float total = 0.f;
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
      for (int gi = 0; gi < groups; ++gi) {
        const float w = exp2f(g_ml[gi * per + li].x - m);  // 0 for a group without splits
        total += g_ml[gi * per + li].y * w;
        fma4(acc, g_o[gi * per + li], w);
      }
      store4(out + h * D + d, scale4(acc, 1.f / total));
    }
    return;
  }
  if (!s_last) return;

  if (in_smem) {
    constexpr int QPT = kRows * (D / 4) / kThreads;  // (row, 4 dims) items per thread at most
    float* s_o = reinterpret_cast<float*>(smem);     // [n_active][rows][D]
    float4* s_ml = reinterpret_cast<float4*>(s_o + n_active * p.rows * D);  // [n_active][rows]
    const float* src_o = p.ws_o + slot0 * p.rows * D;  // the pair's splits are contiguous
    const float4* src_ml = p.ws_ml + slot0 * p.rows;
    for (int i = tid; i < n_active * p.rows * (D / 4); i += kThreads) cp_async16(s_o + 4 * i, src_o + 4 * i, true);
    for (int i = tid; i < n_active * p.rows; i += kThreads) cp_async16(s_ml + i, src_ml + i, true);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
#pragma unroll
    for (int j = 0; j < QPT; ++j) {
      const int qi = tid + j * kThreads;
      if (qi < items) {
        const int h = qi / (D / 4), d = (qi % (D / 4)) * 4;
        float mx = -INFINITY;  // the max first: the weights below are then independent of each other
        for (int s = 0; s < n_active; ++s) mx = fmaxf(mx, s_ml[s * p.rows + h].x);  // finite: no split is empty
        float sum = 0.f;
        float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
        for (int s = 0; s < n_active; ++s) {
          const float4 ml = s_ml[s * p.rows + h];
          const float w = exp2f(ml.x - mx);
          sum += ml.y * w;
          fma4(o, *reinterpret_cast<const float4*>(s_o + (s * p.rows + h) * D + d), w);
        }
        store4(out + h * D + d, scale4(o, 1.f / sum));
      }
    }
    return;
  }
  for (int qi = tid; qi < items; qi += kThreads) {
    const int h = qi / (D / 4), d = (qi % (D / 4)) * 4;
    const float4* ml_src = p.ws_ml + slot0 * p.rows + h;
    const float* o_src = p.ws_o + (slot0 * p.rows + h) * D + d;
    float mx = -INFINITY, sum = 0.f;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
    // Whole rounds of kMergeUnroll splits, the loads past n_active predicated off (they fold with weight
    // 0), so every load of a round is in flight at once. A loop unrolled over the count itself ran its
    // remainder as load, fold, next load: one L2 round trip a split for any count under 16.
    for (int s0 = 0; s0 < n_active; s0 += kMergeUnroll) {
      float4 ml[kMergeUnroll], os[kMergeUnroll];
#pragma unroll
      for (int i = 0; i < kMergeUnroll; ++i) {
        const int s = s0 + i;
        const bool live = s < n_active;
        ml[i] = ldcg4_if(ml_src + s * p.rows, live, make_float4(-INFINITY, 0.f, 0.f, 0.f));
        os[i] = ldcg4_if(reinterpret_cast<const float4*>(o_src + static_cast<int64_t>(s) * p.rows * D), live,
                         make_float4(0.f, 0.f, 0.f, 0.f));
      }
      fold_partials(mx, sum, o, ml, os);  // split s0 is live
    }
    store4(out + h * D + d, scale4(o, sum > 0.f ? 1.f / sum : 0.f));
  }
}

template <typename T, int D>
void launch(DecodeParams p, int batch, int kv_heads, const torch::Tensor& q, cudaStream_t stream,
            std::string* plan = nullptr, int plan_length = 0) {
  static const bool configured = [&] {
    for (auto kernel : {flash_decode_kernel<T, D, false, false>, flash_decode_kernel<T, D, true, false>})
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
    for (auto kernel : {flash_decode_kernel<T, D, false, true>, flash_decode_kernel<T, D, true, true>})
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSpecSmemBytes));
    return true;
  }();
  (void)configured;
  const int device = q.get_device();
  const int kv_blocks = kv_heads * p.hblocks;
  const int64_t pairs = static_cast<int64_t>(batch) * kv_blocks;
  // One CTA per SM: enough splits that every SM streams (each CTA streams its range with a deep
  // pipeline, so more, shorter CTAs only add ramp-ups and combine work). Two CTAs per SM fit, but with
  // one the streams ran faster everywhere measured (H200, 32 q / 8 kv heads, d 128: batch 1 at 16k
  // 23.6 -> 22.3 us, 32k 40.0 -> 38.5, batch 16 at 4k 70.6 -> 67.7, at 16k 245.6 -> 240.0; batch 64
  // equal). Bounded by the capacity (no split under kMinChunk keys) and a 256 MB workspace.
  int64_t splits = std::max<int64_t>(1, sm_count(device) / pairs);
  splits = std::min<int64_t>({splits, (p.capacity + kMinChunk - 1) / kMinChunk, kMaxSplits});
  const int64_t per_split = pairs * p.rows * (D + 4) * static_cast<int64_t>(sizeof(float));
  splits = std::max<int64_t>(1, std::min<int64_t>(splits, (int64_t{256} << 20) / per_split));
  p.num_splits = static_cast<int>(splits);
  p.all_resident = splits * pairs <= sm_count(device);  // one CTA per SM at most, and two fit
  const bool full = full_grid(splits * pairs, sm_count(device), p.capacity, splits, dram_gbps_per_sm(device));
  auto speculates_at = [&](int length) {  // a sequence of this length, in a stable_prefix call
    const Split sp = split_of<T, D>(length, p.num_splits, pairs);
    const Merge merge = merge_of<D>(sp.n_active, p.rows, p.rows, p.all_resident);
    return speculates<T, D>(sp, merge, pairs, (length + kTK - 1) / kTK);
  };
  if (plan) {  // describe, for sequences of plan_length keys, and launch nothing
    const Split sp = split_of<T, D>(std::min(plan_length, p.capacity), p.num_splits, pairs);
    const int warp_tiles = (sp.base + (sp.extra > 0) + kWarps - 1) / kWarps;  // split 0's warp 0
    const int depth = full && long_stream(warp_tiles) ? kFullGridStages<T, D> : kStages<T, D>;
    const char* names[] = {"none", "last from L2", "last in smem", "spread"};
    *plan = "splits=" + std::to_string(p.num_splits) + " active=" + std::to_string(sp.n_active) +
            " merge=" + names[static_cast<int>(merge_of<D>(sp.n_active, p.rows, p.rows, p.all_resident))] +
            " depth=" + std::to_string(depth) + " speculate=" +
            (speculates_at(p.capacity) && speculates_at(std::min(plan_length, p.capacity)) ? "yes" : "no");
    return;
  }
  torch::Tensor ws, own_counters;
  if (splits > 1) {
    const int64_t n_o = pairs * splits * p.rows * D;
    ws = torch::empty({n_o + 4 * pairs * splits * p.rows}, q.options().dtype(torch::kFloat32));
    p.ws_o = ws.data_ptr<float>();
    p.ws_ml = reinterpret_cast<float4*>(p.ws_o + n_o);  // n_o is a multiple of 4: 16-byte aligned
    p.counters = split_counters(pairs, device, stream, q.options(), own_counters);
  }
  // Programmatic dependent launch where the code that runs waits for it (the sm_90 build): launch
  // and setup overlap the previous kernel.
  // The speculating kernel where a warp has more than kSpecTiles tiles at the capacity's length (the
  // kernel decides per sequence at the actual length).
  const bool speculate = p.stable_prefix && speculates_at(p.capacity);
  auto kernel = speculate ? (full ? flash_decode_kernel<T, D, true, true> : flash_decode_kernel<T, D, false, true>)
                          : (full ? flash_decode_kernel<T, D, true, false> : flash_decode_kernel<T, D, false, false>);
  launch_pdl(kernel, dim3(p.num_splits, kv_blocks, batch), dim3(kThreads), speculate ? kSpecSmemBytes : kSmemBytes,
             stream, p);
}

// The fields of DecodeParams that follow from the shapes: q [batch, 1, heads, D], caches
// [batch, capacity, kv_heads, D].
DecodeParams shape_params(const torch::Tensor& q, const torch::Tensor& k_cache) {
  DecodeParams p{};
  p.heads = q.size(2), p.group = p.heads / k_cache.size(2), p.capacity = k_cache.size(1);
  p.hblocks = (p.group + kRows - 1) / kRows, p.rows = std::min(p.group, kRows);
  return p;
}

// launch<T, D>(args...) for q's dtype and head_dim.
template <typename... Args>
void launch_for(const torch::Tensor& q, Args&&... args) {
  auto by_dim = [&](auto t_tag) {
    using T = decltype(t_tag);
    const int head_dim = q.size(3);
    if (head_dim == 64) launch<T, 64>(std::forward<Args>(args)...);
    else if (head_dim == 128) launch<T, 128>(std::forward<Args>(args)...);
    else MINFER_CHECK(false, "attention: head_dim must be 64 or 128, got ", head_dim);
  };
  if (q.scalar_type() == at::kHalf) by_dim(__half{});
  else by_dim(__nv_bfloat16{});
}

}  // namespace

void flash_decode(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                  const torch::Tensor& start_pos, double scale, bool stable_prefix, torch::Tensor& out) {
  const int batch = q.size(0);
  if (batch == 0 || q.size(2) == 0) return;
  DecodeParams p = shape_params(q, k_cache);
  p.q = q.data_ptr(), p.k = k_cache.data_ptr(), p.v = v_cache.data_ptr(), p.o = out.data_ptr();
  p.start_pos = start_pos.data_ptr<int>();
  p.q_bs = q.stride(0), p.q_hs = q.stride(2);
  p.k_bs = k_cache.stride(0), p.k_ss = k_cache.stride(1), p.k_hs = k_cache.stride(2);
  p.v_bs = v_cache.stride(0), p.v_ss = v_cache.stride(1), p.v_hs = v_cache.stride(2);
  p.scale_log2 = static_cast<float>(scale) * kLog2e;
  p.stable_prefix = stable_prefix;
  launch_for(q, p, batch, static_cast<int>(k_cache.size(2)), q, c10::cuda::getCurrentCUDAStream());
}

std::string flash_decode_plan(const torch::Tensor& q, const torch::Tensor& k_cache, int length) {
  if (q.size(0) == 0 || q.size(2) == 0) return "none (empty output)";
  std::string plan;
  launch_for(q, shape_params(q, k_cache), static_cast<int>(q.size(0)), static_cast<int>(k_cache.size(2)), q,
             c10::cuda::getCurrentCUDAStream(), &plan, length);
  return plan;
}

}  // namespace minfer::attn
