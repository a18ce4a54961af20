// The split-KV decode kernel's arguments and CTA geometry, shared by its host planning (decode_plan.h)
// and its device code (decode_stream.cuh, decode_merge.cuh, flash_decode.cu).
//
// Grid (split, kv block, batch). A kv block is up to 16 q heads of one kv group (heads / kv_heads of them;
// more than 16 take several blocks), so each K/V byte is read once for all of them: the heads are the 16
// rows of the A operand of mma.sync m16n8k16 (rows past the group are zeros). Each of the CTA's 4 warps
// streams its own 16-key tiles through its own ring of shared memory.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

#include "attention/kv_rows.cuh"

namespace minfer::attn::decode {

constexpr int kWarps = 4, kThreads = kWarps * 32;
constexpr int kTK = 16;               // keys per warp tile (the k of the P V mma)
constexpr int kRows = 16;             // q heads per CTA (the m of the mma)
// Per warp: 3 tiles of K+V at head_dim 128, 6 at 64; 2 at 256 (a ring needs two tiles to stream, and the
// CTA's 129 KB then fit one CTA an SM, as the grid plans anyway).
template <int D>
constexpr int kRingBytes = D <= 128 ? 24 << 10 : 32 << 10;
// d 64's short ring (4 tiles a warp, 65 KB a CTA: 3 CTAs an SM against 2), for grids of more than 2 and at
// most 6 CTAs an SM, which the long ring runs in more waves (H200, paged, 9 q / 3 kv heads at ~824 keys: 89
// sequences 22.7 -> 19.6 us, 128 26.9 -> 22.1, 256 45.2 -> 43.7). On grids that fit 2 an SM a warp's shorter
// ring streams slower (32 x 824 8.58 -> 9.10 us), and so it does at 8 an SM (128 x 824, 32 q / 8 kv heads:
// 58.8 -> 59.2-60.2). The kernels take the ring's bytes as a template argument (RING).
constexpr int kShortRingBytes = 16 << 10;
template <int D>
constexpr bool kHasShortRing = D == 64;
// + slack to start the rings on a 1024-byte boundary. The XOR swizzle is conflict-free from any 16-byte
// aligned base, but the streams are not: rings right after the static shared memory ran 10-17% slower
// (H200, bf16: 16 x 16k 234.8 -> 274.1 us); a 256-byte boundary is as fast.
template <int D, int RING = kRingBytes<D>>
constexpr int kSmemBytes = kWarps * RING + 1024;
// At d 256 the kernel stages q in shared memory after the rings, [kRows][D + 8] 16-bit values (a padded row, so
// that ldmatrix reads it without bank conflicts), and each k-step of S = Q K^T reads its A fragment by ldmatrix:
// held in registers, the fragments take 64 beside O's 128 (ptxas spilled 150-1300 bytes a thread).
template <int D>
constexpr bool kQInSmem = D > 128;
template <int D>
constexpr int kQSmemBytes = kSmemBytes<D> + kRows * (D + 8) * 2;
// A kernel's dynamic shared memory: the rings, and q's stage where it stages q.
template <int D, int RING = kRingBytes<D>>
constexpr int kDecodeSmemBytes = kQInSmem<D> ? kQSmemBytes<D> : kSmemBytes<D, RING>;

template <typename T, int D>
constexpr int kTileBytes = 2 * kTK * D * int(sizeof(T));  // K + V of one 16-key tile
template <typename T, int D, int RING = kRingBytes<D>>
constexpr int kStages = RING / kTileBytes<T, D>;  // K+V tiles a warp's ring holds: 3 at d 128, 6 at d 64 (short: 4)

// The newest key's rotation folded into the call (decode, whole-head NeoX rope; cos_sin == nullptr: none): q is
// rotated in registers at position len - 1 (q in memory is left as it is), and the CTA whose split holds key
// len - 1 rotates k_new and writes it and v_new to that cache row before it streams, so that a decode step needs no
// rope launch. Nothing is written past a dense cache's capacity (the newest position is then not len - 1) or onto a
// page outside the pool.
struct RopeIn {
  const void* k_new = nullptr;  // [batch, kv_heads, D]: k_new[b, kvh, :] at b*k_bs + kvh*k_hs (unrotated)
  const void* v_new = nullptr;  // likewise
  int64_t k_bs = 0, k_hs = 0, v_bs = 0, v_hs = 0;
  const float* cos_sin = nullptr;  // [max_position, D] fp32: cos | sin halves of each position
  int max_position = 0;
};

struct DecodeParams {
  const void* q;  // q[b, h, :] at b*q_bs + h*q_hs
  const void* k;  // dense: k[b, j, kvh, :] at b*k_bs + j*k_ss + kvh*k_hs; paged: see `paged`
  const void* v;
  void* o;          // [batch, heads, D] contiguous
  float* ws_o;      // [batch * kv_blocks, num_splits, rows, D] unnormalised partial outputs
  float4* ws_ml;    // [batch * kv_blocks, num_splits, rows] (max in log2 units, sum, -, -)
  int* counters;    // [batch * kv_blocks], zero between launches
  const int* start_pos;  // [batch]: sequence b has start_pos[b] + len_offset keys (dense: its newest
                         // position, offset 1; paged: its length, offset 0)
  int len_offset;
  int window;            // > 0: sequence b reads only its last `window` keys (sliding window); 0: all
  PagedKv paged;         // the paged layout's block table (pages of a multiple of kTK keys), or none
  RopeIn rope;           // the newest key's rope and cache write, or none
  int64_t q_bs, q_hs, k_bs, k_ss, k_hs, v_bs, v_ss, v_hs;
  int heads, group;
  int hblocks;      // kv blocks per kv head: ceil(group / 16)
  int rows;         // q heads per kv block: min(group, 16) (the last block of a group may have fewer)
  int capacity, num_splits;
  int stable_prefix;  // start_pos and the cache rows before start_pos[b] may be read before the wait
  int all_resident;   // the grid fits on the GPU at once: the splits of a pair may wait for each other
  float scale_log2;
};

}  // namespace minfer::attn::decode
