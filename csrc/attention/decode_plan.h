// How a split-KV decode call is laid out: how many splits, which of them get keys, how they merge and how
// deep the rings stream. The rules are __host__ __device__: the launcher picks
// the grid and the kernel with them, each CTA applies them to its sequence's actual length (start_pos[b],
// read on the device: no host sync), and attention_decode_plan reports them.
#pragma once
#include <stdint.h>

#include <algorithm>
#include <string>

#include "attention/decode_params.h"

namespace minfer::attn::decode {

constexpr int kMinChunk = 2 * kTK;    // fewest keys worth a split
constexpr int kMaxSplits = 128;
constexpr int kBurstBytes = 3 << 19;  // a call of at most this much K/V is small (1.5 MiB): see small_call
constexpr int kOneSplitKeys = 384;    // the longest length that is one split (no combine) in a small call ...
constexpr int kSecondRoundBytes = 24 << 10;  // ... and the most K/V a warp streams past its ring's first fill there
constexpr int kMergeUnroll = 16;      // splits whose partials the last CTA's merge keeps in flight per thread

// A grid that fills the GPU streams its long ranges with fewer tiles in flight than the ring holds: about
// 12 KB a warp and at least two tiles (2 at d 128 and 256, 3 at d 64), on a card whose DRAM gives an SM under
// 30 GB/s (thin_dram, common/launch.h). With every SM streaming, the bytes in flight that cover DRAM's latency
// grow with its bandwidth: on the H100 (25 GB/s an SM) the whole rings streamed slower than two tiles (16 x 16k, bf16,
// 347.0 -> 342.3 us; 340.1 -> 336.9 later), on the H200 (36.5 GB/s an SM) two tiles streamed slower (234.2 -> 235.0
// us). A grid of few CTAs needs each one's whole ring on either (H100, 9 x 16k: 193.6 -> 209.3 us with two tiles).
// Long means over 64 tiles a warp: at 17-64 the shallow warps lose their ring's fill before the wait, which in the
// engine's step overlaps rope (H100, the 8B bf16 step, ms, over 16 / over 64: 16 x ~1k 6.800-6.803 / 6.707-6.718, 8
// x ~2k 6.430 / 6.338 (never shallow), 64 x ~1k 9.144-9.167 / 9.092-9.106, 256 x ~1k 19.890-19.903 / 19.743-19.758;
// 16 x 2k and 4k level).
constexpr int kFullGridRingBytes = 12 << 10;
constexpr int kLongStreamTiles = 64;
template <typename T, int D>
constexpr int kFullGridStages = kFullGridRingBytes / kTileBytes<T, D> > 2 ? kFullGridRingBytes / kTileBytes<T, D> : 2;

// A sliding window's range: a sequence of len keys reads only keys [first, len), first = max(0, len - window)
// (0 without a window), in 16-key tiles from the one holding `first`; the keys before `first` in that tile
// are not read, and masked. Splits and merges follow the range's length from that tile on,
// not the context's, so a call past the window costs what one at the window does.
__host__ __device__ __forceinline__ int window_first(int len, int window) {
  return window > 0 ? max(0, len - window) : 0;
}
__host__ __device__ __forceinline__ int range_len(int len, int window) {
  return len - window_first(len, window) / kTK * kTK;
}
// The longest range at any length up to the capacity, which the launcher plans for: with a window, the
// window and up to kTK - 1 keys before it in its first tile.
inline int range_capacity(const DecodeParams& p) {
  return p.window > 0 ? static_cast<int>(std::min<int64_t>(p.capacity, int64_t{p.window} + kTK - 1)) : p.capacity;
}

// Whether a launch of `ctas` CTAs takes the shallow full-grid kernel: it fills the GPU (7/10 of the SMs),
// its capacity gives a warp more than kLongStreamTiles tiles, and the card's DRAM is thin an SM (thin_dram,
// common/launch.h). The FULL_GRID kernel then checks each warp's actual tiles (long_stream).
__host__ __forceinline__ bool full_grid(int64_t ctas, int sms, int capacity, int64_t splits, bool thin_dram) {
  return thin_dram && 10 * ctas >= 7 * int64_t{sms} && capacity > splits * kWarps * kTK * kLongStreamTiles;
}
__host__ __device__ __forceinline__ bool long_stream(int warp_tiles) { return warp_tiles > kLongStreamTiles; }

// Whether a call is small: K/V of at most kBurstBytes (every sequence counted at this one's length).
template <typename T, int D>
__host__ __device__ __forceinline__ bool small_call(int64_t pairs, int n_tiles) {
  return pairs * n_tiles * kTileBytes<T, D> <= kBurstBytes;
}

// One sequence's split, in a call of `pairs` (batch, kv block) pairs: how many splits get keys, and their
// whole tiles, dealt evenly: each active split takes `base` tiles, the first `extra` one more, and every
// split gets at least kMinChunk / kTK whole tiles. So every launched split is active once the length has
// kMinChunk keys per split: a CTA with no keys exits at once, and back to back the next call's CTAs then
// double up on SMs (1 x 32k, 32 q / 2 kv heads, 64 of 66 splits active: 16.4 us, all 66: 14.8).
// A length that one CTA's rings hold at once (192 keys at d 128, 384 at d 64) is one split, since a
// combine costs more than such a stream (H200, 1 x 128, 32 q / 8 kv heads: 4.13 -> 2.72 us); in a small
// call so is a length up to kOneSplitKeys, its second round streaming after the wait (H100, 1 x 384:
// 6.33 -> 4.72 us; at 1 x 512 one split lost, 4.49 -> 5.92), and that second round at most kSecondRoundBytes a
// warp: a whole ring at d 128 (three 8 KB tiles), one 16 KB tile at d 256, so 192 keys there (H200, 8 q / 4 kv
// heads, one split against split, us: 1 x 208 6.49 / 5.14, 1 x 240 6.64 / 5.14; 4 q / 1 kv, 1 x 176 4.97 /
// 5.51; the Gemma-3-4B shape's batch-1 step 2.492 -> 2.482 ms from 256 keys one split to 192).
struct Split {
  int n_active, base, extra;
  __host__ __device__ __forceinline__ int tiles() const { return n_active * base + extra; }  // of the sequence
};
template <typename T, int D, int RING>
__host__ __device__ __forceinline__ Split split_of(int len, int num_splits, int64_t pairs) {
  constexpr int ring_keys = kWarps * kStages<T, D, RING> * kTK;
  constexpr int second_keys = kWarps * (kSecondRoundBytes / kTileBytes<T, D>) * kTK;
  constexpr int one_keys = kOneSplitKeys < ring_keys + second_keys ? kOneSplitKeys : ring_keys + second_keys;
  const int n_tiles = (len + kTK - 1) / kTK;
  const bool one = len <= ring_keys || (len <= one_keys && small_call<T, D>(pairs, n_tiles));
  const int n_active = one ? 1 : min(num_splits, n_tiles / (kMinChunk / kTK));
  return {n_active, n_tiles / n_active, n_tiles % n_active};
}

// How a (batch, kv block)'s splits combine, the same choice in every CTA of the pair (H200, bf16, us):
// - kLastFromL2, up to 16 splits: the last CTA, a thread per (row, 4 dims), reads them from L2 in one pass
//   and folds them max first; a split's (max, sum) and O are independent loads, so a round keeps all 16 in
//   flight, predicated past the count (16 rather than 8 a round: 1 x 1k 6.17 -> 6.01).
// - kLastInSmem, more that shared memory holds at once (few, small rows: 9 q / 3 kv heads at d 64 has 44
//   splits of 48 (row, 4 dims) items): the last CTA copies them in by every thread's cp.async, one round
//   trip, and merges there (1 x 8k 8.22 -> 6.30; for 16 splits of 32 q / 8 kv heads it lost, 7.42 -> 7.96).
// - kSpread, more than two rounds' worth otherwise (32 q / 2 kv heads at d 128 has 66 splits of 16 rows,
//   540 KB of partials): every split waits for the last arrival and merges its slice of the outputs from
//   all splits (1 x 4k 15.82 -> 7.51). That needs every split of the pair resident at once: the grid is at
//   most one CTA per SM where it splits, and two fit.
// The last CTA's merge from L2 also takes more splits, in rounds of 16, where spreading is not allowed, or
// where a split would have more than a thread an item to merge (d 256 with under 8 splits).
enum class Merge { kNone, kLastFromL2, kLastInSmem, kSpread };
template <int D, int RING>
__host__ __device__ __forceinline__ Merge merge_of(int n_active, int rows, int block_rows, bool all_resident) {
  if (n_active == 1) return Merge::kNone;
  const int items = rows * (D / 4);             // (row, 4 dims) outputs of the pair
  const int per_split = block_rows * (D + 4);  // floats of a split's partial: O, then (max, sum, -, -) per row
  if (n_active > kMergeUnroll && n_active * per_split * 4 <= kWarps * RING) return Merge::kLastInSmem;
  if (all_resident && items * n_active > 2 * kMergeUnroll * kThreads && items <= n_active * kThreads)
    return Merge::kSpread;
  return Merge::kLastFromL2;
}

// The fields of DecodeParams that follow from the shapes: q [batch, 1, heads, D], caches
// [batch, capacity, kv_heads, D].
inline DecodeParams shape_params(int heads, int kv_heads, int capacity) {
  DecodeParams p{};
  p.heads = heads, p.group = heads / kv_heads, p.capacity = capacity;
  p.hblocks = (p.group + kRows - 1) / kRows, p.rows = std::min(p.group, kRows);
  return p;
}

// The launcher's choices for one call (host-only).
struct Launch {
  int num_splits;
  bool all_resident;  // every CTA resident at once (one per SM at most; two fit)
  bool full;          // the shallow full-grid kernel (full_grid)
  bool short_ring;    // d 64's short ring (kShortRingBytes): 2-6 CTAs an SM (then one split a pair)
};

// One CTA per SM: enough splits that every SM streams (each CTA streams its range with a deep pipeline,
// so more, shorter CTAs only add ramp-ups and combine work; two CTAs per SM streamed slower everywhere
// measured: H200, 1 x 16k 23.6 -> 22.3 us with one). Bounded by the capacity (no split under kMinChunk
// keys of the longest range) and a 256 MB workspace. sms: the device's SM count; thin_dram: whether its DRAM
// gives an SM under 30 GB/s (common/launch.h).
template <int D>
inline Launch plan_launch(const DecodeParams& p, int64_t pairs, int sms, bool thin_dram) {
  const int keys = range_capacity(p);
  int64_t splits = std::max<int64_t>(1, sms / pairs);
  splits = std::min<int64_t>({splits, (keys + kMinChunk - 1) / kMinChunk, kMaxSplits});
  const int64_t per_split = pairs * p.rows * (D + 4) * static_cast<int64_t>(sizeof(float));
  splits = std::max<int64_t>(1, std::min<int64_t>(splits, (int64_t{256} << 20) / per_split));
  Launch l;
  l.num_splits = static_cast<int>(splits);
  l.all_resident = splits * pairs <= sms;
  l.full = full_grid(splits * pairs, sms, keys, splits, thin_dram);
  l.short_ring = kHasShortRing<D> && splits * pairs > 2 * int64_t{sms} && splits * pairs <= 6 * int64_t{sms};
  return l;
}

// What a call launched as `l` does with sequences of `length` keys: "splits=.. active=.. merge=..
// depth=.." (attention_decode_plan's answer).
template <typename T, int D, int RING>
inline std::string describe_ring(const DecodeParams& p, const Launch& l, int64_t pairs, int length) {
  const int len = range_len(std::min(length, p.capacity), p.window);
  const Split sp = split_of<T, D, RING>(len, l.num_splits, pairs);
  const int warp_tiles = (sp.base + (sp.extra > 0) + kWarps - 1) / kWarps;  // split 0's warp 0
  const int depth = l.full && long_stream(warp_tiles) ? kFullGridStages<T, D> : kStages<T, D, RING>;
  const char* names[] = {"none", "last from L2", "last in smem", "spread"};
  return "splits=" + std::to_string(l.num_splits) + " active=" + std::to_string(sp.n_active) +
         " merge=" + names[static_cast<int>(merge_of<D, RING>(sp.n_active, p.rows, p.rows, l.all_resident))] +
         " depth=" + std::to_string(depth);
}
template <typename T, int D>
inline std::string describe(const DecodeParams& p, const Launch& l, int64_t pairs, int length) {
  if constexpr (kHasShortRing<D>)
    if (l.short_ring) return describe_ring<T, D, kShortRingBytes>(p, l, pairs, length);
  return describe_ring<T, D, kRingBytes<D>>(p, l, pairs, length);
}

}  // namespace minfer::attn::decode
