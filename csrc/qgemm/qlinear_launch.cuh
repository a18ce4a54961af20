// qlinear's launchers: which kernel takes a call (by format, rows, shape and GPU), and qgemm::run / run_act, the
// entry points that qlinear.cu calls (qlinear.h), instantiated one format a translation unit (qlinear_<format>.cu).
#pragma once
#include <c10/cuda/CUDAFunctions.h>

#include "qgemm/i8_kernels.cuh"

namespace minfer::qgemm {
namespace {

// Whether a grid of 16-row CTAs is at most 2 CTAs an SM: there the kernels are bound by latency, not issue.
inline bool small_grid(const Args& a, int sms) { return (a.N + 15) / 16 <= 2 * sms; }

// kXRow: x's row (K <= kXRowMaxK) in shared memory behind the rings.
template <int QT, typename T, int NT, bool kAhead = false, bool kXRow = false>
void launch(const Args& a, cudaStream_t stream) {
  constexpr auto kernel = qlinear_kernel<QT, T, NT, kAhead, kXRow>;
  constexpr int kChunk = Ring<QT>::kChunk;
  allow_smem<kernel, Ring<QT>::kSmem + (kXRow ? 2 * kXRowMaxK : 0)>();
  const int smem = Ring<QT>::kSmem + (kXRow ? 2 * ((a.K + kChunk - 1) / kChunk * kChunk) : 0);
  launch_pdl(kernel, dim3((unsigned)((a.N + 15) / 16)), dim3(kThreads), smem, stream, a);
}

// Whether regs_kernel takes the call (a 4- or 5-bit legacy format whose K gives a warp at most kRegChunks chunks,
// on a grid of 16-row tiles of at most 2 CTAs an SM), and launches it if so. H200, us, qlinear_kernel ->
// regs_kernel: Q4_1 1 x 576 x 1536 2.45 -> 1.84, 1 x 960 x 576 1.85 -> 1.42, 16 x 576 x 1536 4.30 -> 2.91,
// 1 x 2048 x 2048 4.07 -> 2.83; Q4_0 / Q5_0 16 x 2048 x 2048 7.65 / 7.94 -> 5.77 / 6.25. At M 17-32 two blocks of
// 16 x rows over the grid's y, against qlinear_kernel's NT = 4: 32 x 960 x 576 3.49 -> 2.30, 32 x 576 x 1536 5.72
// -> 3.45, 32 x 3072 x 576 4.90 -> 5.45 (the default model's batch-32 step 1.009 -> 0.907 ms with the activation
// fused).
// With Act, a.N = 2 inter rows of gate | up and a.out [M, inter]: a CTA for 8 outputs (regs_kernel).
// With a.norm_w, kNorm's instance (its rows in dynamic shared memory); with a.accumulate, kAdd's (no Act); both at
// NT = 1.
template <int QT, typename T, typename Act = void>
bool launch_if_regs(const Args& a, int sms, cudaStream_t stream) {
  if constexpr (kRegsFormat<QT>) {
    if (regs_shape(a.N, a.K, sms)) {
      const unsigned tiles = (unsigned)(std::is_void_v<Act> ? (a.N + 15) / 16 : (a.N / 2 + 7) / 8);
      auto go = [&](auto nt, auto fuse) {
        constexpr int NT = decltype(nt)::value;
        constexpr Fuse kFuse = decltype(fuse)::value;
        constexpr auto kernel = regs_kernel<QT, T, NT, Act, kFuse>;
        const int smem = kFuse == Fuse::kNorm ? norm_smem_bytes(a.K) : 0;
        if constexpr (kFuse == Fuse::kNorm) allow_smem<kernel, norm_smem_bytes(kRegMaxK)>();
        const int blocks = (a.M + 8 * NT - 1) / (8 * NT), y = regs_y_blocks(tiles, a.M, NT, sms);
        if constexpr (NT == 2 && kFuse == Fuse::kNone) {
          if (y < blocks && a.K <= kWarps * kLoopChunks * 64)
            return launch_pdl(regs_kernel<QT, T, NT, Act, kFuse, true>, dim3(tiles, (unsigned)y), dim3(kThreads), 0,
                              stream, a);
        }
        launch_pdl(kernel, dim3(tiles, (unsigned)blocks), dim3(kThreads), smem, stream, a);
      };
      using One = std::integral_constant<int, 1>;
      using Two = std::integral_constant<int, 2>;
      using None = std::integral_constant<Fuse, Fuse::kNone>;
      if (a.norm_w != nullptr || a.accumulate) {  // up to 8 rows (takes_norm)
        TORCH_CHECK(a.M <= 8, "qlinear: norm_w and accumulate take at most 8 rows, got ", a.M);
        if (a.norm_w != nullptr)
          go(One{}, std::integral_constant<Fuse, Fuse::kNorm>{});
        else if constexpr (std::is_void_v<Act>)
          go(One{}, std::integral_constant<Fuse, Fuse::kAdd>{});
        else
          TORCH_CHECK(false, "qlinear_act: no accumulate");
      } else if (a.M <= 8) {
        go(One{}, None{});
      } else {
        go(Two{}, None{});
      }
      return true;
    }
  }
  return false;
}

// qtile_kernel's (and q4k::tile_kernel's) splits of K over tiles of 16 x warps rows: until the tiles fill 2 CTAs an
// SM, at least 2 chunks a CTA.
inline int tile_splits(int N, int chunks, int sms, int warps = kWarps, int per_sm = 2) {
  const int tiles = (N + 16 * warps - 1) / (16 * warps);
  return std::max(1, std::min(chunks / 2, per_sm * sms / tiles));
}

// q4k::tile_kernel's warps a CTA (16 rows each, kMinTileWarps .. kWarps): the fewest chunk rounds on the busiest SM,
// CTAs on it x warps x (chunks a CTA + 1.5 for the pipeline's fill and the split's sum), 2 CTAs an SM; within 3%
// the most warps (x's records are read once a CTA). H200, us, 8 / 7 / 6 warps: 16 x 28672 x 4096 33.6 / 31.8 /
// 43.7 (224 / 256 / 299 CTAs), 16 x 5120 x 4096 10.3 / 10.8 / 9.2, 16 x 6144 x 4096 11.4 / 10.8 / 9.95, 16 x 4096 x
// 14336 18.4 / 18.7 / 18.9, 8 x 28672 x 4096 28.9 / 27.3 / 37.1.
inline int tile_warps(int N, int chunks, int sms) {
  int best = kWarps;
  double best_cost = 0;
  for (int w = kWarps; w >= q4k::kMinTileWarps; --w) {
    const int tiles = (N + 16 * w - 1) / (16 * w), splits = tile_splits(N, chunks, sms, w);
    const int per_sm = (tiles * splits + sms - 1) / sms, per_cta = (chunks + splits - 1) / splits;
    const double cost = double(per_sm) * w * (per_cta + 1.5);
    if (w == kWarps || cost < 0.97 * best_cost) best = w, best_cost = cost;
  }
  return best;
}

// W's bytes as a rank-D tensor for TMA (dims and strides innermost first, strides past the first dim, in bytes),
// boxes of box, of 1- or 2-byte elements (elem: dims[0] and box[0] count them), no swizzle, out-of-bounds bytes as
// zeros.
template <int D>
CUtensorMap w_byte_map(const Args& a, const cuuint64_t (&dims)[D], const cuuint64_t (&strides)[D - 1],
                       const cuuint32_t (&box)[D], int elem = 1) {
  CUtensorMap map{};
  cuuint32_t elem_strides[D];
  for (int i = 0; i < D; ++i) elem_strides[i] = 1;
  const auto type = elem == 2 ? CU_TENSOR_MAP_DATA_TYPE_UINT16 : CU_TENSOR_MAP_DATA_TYPE_UINT8;
  const CUresult r = sm90::tensor_map_encoder()(&map, type, D, const_cast<uint8_t*>(a.w), dims,
                                                strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                                CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  MINFER_CHECK(r == CUDA_SUCCESS, "qlinear: cuTensorMapEncodeTiled failed with error ", int(r), " (n=", a.N,
               ", row bytes=", a.row_bytes, ")");
  return map;
}

// W [N, row_bytes] as a 2D tensor of elem-byte elements (kBoxElem), boxes of box_bytes x 16 rows; zeros (an unused
// map) without the box. Tiled (Q4_K): W as [N x chunks, chunk bytes], a 16-row tile's chunk 16 consecutive rows of it
// (tiled_row), one box.
CUtensorMap chunk_map(const Args& a, int box_bytes, bool box, int elem = 1) {
  if (!box) return CUtensorMap{};
  if (a.tiled) {
    const cuuint64_t chunks = a.K / 256, chunk = a.row_bytes / chunks;
    return w_byte_map<2>(a, {chunk, a.N * chunks}, {chunk}, {(cuuint32_t)box_bytes, 16});
  }
  return w_byte_map<2>(a, {(cuuint64_t)(a.row_bytes / elem), (cuuint64_t)a.N}, {(cuuint64_t)a.row_bytes},
                       {(cuuint32_t)(box_bytes / elem), 16}, elem);
}

// W = gate | up [2 inter, row_bytes] as a 3D byte tensor [2][inter][row_bytes], boxes of [2, 8, box_bytes]: a
// 16-row tile of gate rows j .. j + 7, then up's (ChunkRing's kPair); tiled, each half as chunk_map's view.
CUtensorMap pair_map(const Args& a, int box_bytes) {
  const cuuint64_t inter = a.N / 2;
  if (a.tiled) {  // [2][inter x chunks][chunk bytes]: gate's tiled view, then up's (inter a multiple of 16)
    const cuuint64_t chunks = a.K / 256, chunk = a.row_bytes / chunks;
    return w_byte_map<3>(a, {chunk, inter * chunks, 2}, {chunk, inter * a.row_bytes}, {(cuuint32_t)box_bytes, 8, 2});
  }
  return w_byte_map<3>(a, {(cuuint64_t)a.row_bytes, inter, 2}, {(cuuint64_t)a.row_bytes, inter * a.row_bytes},
                       {(cuuint32_t)box_bytes, 8, 2});
}

// [rows, width] 8-byte elements at base, row_bytes apart, as a 2D tensor map, boxes of [box_rows, box_width]; rows
// past the tensor's and elements past width arrive as zeros. what: the tensor, for the error.
CUtensorMap u64_rows_map(const void* base, int64_t width, int64_t rows, int64_t row_bytes, int box_width, int box_rows,
                         const char* what) {
  CUtensorMap map{};
  const cuuint64_t dims[2] = {cuuint64_t(width), cuuint64_t(rows)}, strides[1] = {cuuint64_t(row_bytes)};
  const cuuint32_t box[2] = {cuuint32_t(box_width), cuuint32_t(box_rows)}, elem_strides[2] = {1, 1};
  const CUresult r = sm90::tensor_map_encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_UINT64, 2, const_cast<void*>(base), dims,
                                                strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                                CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  MINFER_CHECK(r == CUDA_SUCCESS, "qlinear: cuTensorMapEncodeTiled failed for ", what, " with error ", int(r),
               " (rows=", rows, ", row bytes=", row_bytes, ")");
  return map;
}

// x's records [M, chunks x kRecord], boxes of [rows, kXStride / 8] from a chunk's first byte (q4k::tile_kernel's
// XSlots).
CUtensorMap records_map(const uint8_t* records, int M, int chunks, int rows) {
  const int64_t row_bytes = int64_t(chunks) * q4k::kRecord;
  return u64_rows_map(records, row_bytes / 8, M, row_bytes, q4k::kXStride / 8, rows, "x's records");
}

// x [M, K] (2-byte values, contiguous, 16-byte aligned, K % 8 == 0), boxes of [rows, kXTileRow / 8] from a 256-k
// chunk's first value (qtile_kernel's XSlots): a chunk's 512 bytes and the 32 after them.
CUtensorMap x_tile_map(const Args& a, int rows) {
  return u64_rows_map(a.x, int64_t(a.K) * 2 / 8, a.M, int64_t(a.K) * 2, kXTileRow / 8, rows, "x");
}

// A tile kernel's grid (tiles of 16 x warps rows, tile_splits of the chunks) and, where it splits, sum_splits' fp32
// workspace (from the caching allocator) and arrival counters.
struct TileGrid {
  dim3 dims;
  at::Tensor ws_tensor, own_counters;
  float* ws = nullptr;
  int* counters = nullptr;
  TileGrid(int N, int chunks, int nt, int sms, const at::Tensor& x, cudaStream_t stream, int warps = kWarps,
           int per_sm = 2) {
    const int tiles = (N + 16 * warps - 1) / (16 * warps), splits = tile_splits(N, chunks, sms, warps, per_sm);
    dims = dim3((unsigned)tiles, (unsigned)splits);
    if (splits == 1) return;
    ws_tensor = x.new_empty({int64_t(tiles) * splits * warps * nt * 4 * 32}, at::kFloat);
    ws = ws_tensor.data_ptr<float>();
    counters = split_counters(tiles, x.get_device(), stream, x, own_counters);
  }
};

template <int QT, typename T, int NT>
void launch_qtile(const Args& a, const at::Tensor& x, int sms, cudaStream_t stream) {
  constexpr int S = kQTileStages<QT, NT>;
  // W's blocks are 16-byte aligned (check_blocks)
  const bool sm90 = cc_major(c10::cuda::current_device()) >= 9;
  const bool box = QT == kQ6_K && sm90 && (a.tiled || a.row_bytes % 16 == 0);
  const CUtensorMap map = chunk_map(a, Ring<QT, 256>::kRowStride, box && !a.tiled);  // tiled: bulk copies
  const bool x_box = kQTileXBox<NT> && sm90;
  const CUtensorMap x_map = x_box ? x_tile_map(a, 8 * NT) : CUtensorMap{};
  TileGrid grid(a.N, (a.K + 255) / 256, NT, sms, x, stream, kWarps, qtile_ctas(NT));
  auto go = [&](auto use_box) {
    constexpr auto kernel = qtile_kernel<QT, T, NT, S, decltype(use_box)::value>;
    constexpr int smem = qtile_smem<QT>(NT, S) + 128;
    allow_smem<kernel, smem>();
    launch_pdl(kernel, grid.dims, dim3(kThreads), smem, stream, a, grid.ws, grid.counters, map, x_map);
  };
  if constexpr (QT == kQ6_K) {
    if (box) return go(std::true_type{});
  }
  go(std::false_type{});
}

template <typename T, int NT, int S, int kTiles = 1>
void launch_q4k_rows(const Args& a, const uint8_t* records, cudaStream_t stream) {
  constexpr auto kernel = q4k::rows_kernel<T, NT, S, kTiles>;
  constexpr int smem = S * kWarps * kTiles * Ring<kQ4_K>::kStageBytes;
  allow_smem<kernel, smem>();
  launch_pdl(kernel, dim3((unsigned)((a.N + 16 * kTiles - 1) / (16 * kTiles))), dim3(kThreads), smem, stream, a,
             records);
}

// An M = 1 int8-form kernel (its CTAs loop over W's 16-row tiles: i8_walk) on the CTAs the SMs hold at once, or one a
// tile where there are fewer tiles; kSmem: its rings and 128 bytes to align them.
template <auto kKernel, int kSmem>
void launch_i8_walk(const Args& a, const uint8_t* records, const CUtensorMap& map, int sms, cudaStream_t stream) {
  allow_smem<kKernel, kSmem>();
  const int grid = std::min((a.N + 15) / 16, resident_ctas<kKernel, kThreads, kSmem>() * sms);
  launch_pdl(kKernel, dim3((unsigned)grid), dim3(kThreads), kSmem, stream, a, records, map);
}

// Whether an int8-form kernel holds x's chunks in registers across a warp's tiles (i8_walk's kXRegs): at most 2 a
// warp, and the grid looping over several tiles a CTA; its 19 more registers take 2 CTAs an SM. H200, us, Q4_K 3
// CTAs / held: 1 x 28672 x 4096 23.1 / 20.6; on one or two tiles a CTA it lost (1 x 4096 x 4096 5.3 / 5.6, 1 x 6144
// x 4096 6.7 / 7.1).
inline bool held_x(const Args& a, int sms) { return a.K / 256 <= 2 * kWarps && (a.N + 15) / 16 > 4 * sms; }

// x [M, K]'s records (q4k_x.cuh; the int8 form at M = 1) into records, a warp a row's chunk.
template <typename T>
void write_records(const T* x, uint8_t* records, int M, int K, cudaStream_t stream) {
  const int64_t warps = int64_t(M) * (K / 256);
  launch_pdl(q4k::prepare_x_kernel<T>, dim3((unsigned)((warps + kWarps - 1) / kWarps)), dim3(kThreads), 0, stream, x,
             records, M, K, q4k_x::int8_form(M));
}

// x's records: those given (written by the kernel before x's linear), else prepare_x_kernel's into own.
template <typename T>
const uint8_t* records_or_own(const Args& a, const uint8_t* records, const at::Tensor& x, at::Tensor& own,
                              cudaStream_t stream) {
  if (records != nullptr) return records;
  own = x.new_empty({a.M, a.K / 256 * q4k::kRecord}, at::kByte);
  write_records(static_cast<const T*>(a.x), own.data_ptr<uint8_t>(), a.M, a.K, stream);
  return own.data_ptr<uint8_t>();
}

// Q6_K at M = 1 on int8 records (those given, else prepare_x_kernel's): 3 stages a warp where the grid is at most
// 2 CTAs an SM (92 KB each), else 2. On sm_90, with rows a multiple of 16 bytes (K a multiple of 2048), the stages
// come by TMA boxes: the 8B Q4_K_M batch-1 step (16 down projections, 16 v) 2.406-2.408 ms on load_chunk's pieces,
// 2.347-2.348 by boxes (H200).
template <typename T>
void launch_q6_i8(const Args& a, const uint8_t* records, const at::Tensor& x, int sms, cudaStream_t stream) {
  at::Tensor own;
  records = records_or_own<T>(a, records, x, own, stream);
  // W's blocks are 16-byte aligned (check_blocks); tiled, a tile's chunk is one bulk copy (ChunkRing)
  const bool box = cc_major(c10::cuda::current_device()) >= 9 && (a.tiled || a.row_bytes % 16 == 0);
  const CUtensorMap map = chunk_map(a, Ring<kQ6_K>::kRowStride, box && !a.tiled);
  auto go = [&](auto stages, auto use_box) {
    constexpr int S = decltype(stages)::value;
    launch_i8_walk<q6::i8_kernel<T, S, decltype(use_box)::value>, S * kWarps * Ring<kQ6_K>::kStageBytes + 128>(
        a, records, map, sms, stream);
  };
  auto with_stages = [&](auto use_box) {
    if (small_grid(a, sms))
      go(std::integral_constant<int, 3>{}, use_box);
    else
      go(std::integral_constant<int, 2>{}, use_box);
  };
  if (box)
    with_stages(std::true_type{});
  else
    with_stages(std::false_type{});
}

// Q8_0, Q4_0 and Q4_1 at M = 1 on int8 records (those given, else prepare_x_kernel's), x's chunks held across tiles
// as Q4_K's (launch_q4k_i8). Q8_0: 3 stages a warp, 2 CTAs an SM (110 KB each); Q4_0, Q4_1 as Q4_K: 4 stages at 2
// CTAs an SM on small grids and held, else 3 at 3. Against qlinear_kernel on bf16 x (H200, one build, a switch, us,
// with the prepare_x launch): Q8_0 (two rounds) 1 x 6144 x 4096 13.7 -> 9.4, 1 x 4096 x 4096 8.7 -> 8.0, 1 x 28672 x
// 4096 48.0 -> 32.9 (62 -> 91% of copy), 1 x 4096 x 14336 23.6 -> 18.4, 1 x 128256 x 4096 180-182 -> 139; Q4_0 12.4 ->
// 9.1, 9.0 -> 6.5, 41.7 -> 21.7 (38 -> 72%), 25.6 -> 14.8, 161.6 -> 87.9; Q4_1 12.8 -> 8.6, 9.1 -> 6.5, 44.0 -> 22.6,
// 26.9 -> 15.1, 175.9 -> 96.5. The 8B batch-1 step: Q8_0 3.460 / 3.463 -> 2.683 / 2.683 ms, Q4_0 3.583 / 3.583 ->
// 2.052 / 2.051.
template <int QT, typename T>
void launch_b32_i8(const Args& a, const uint8_t* records, const at::Tensor& x, int sms, cudaStream_t stream) {
  at::Tensor own;
  records = records_or_own<T>(a, records, x, own, stream);
  const CUtensorMap map = chunk_map(a, Ring<QT, 256>::kRowStride, true, kBoxElem<QT>);
  auto go = [&](auto stages, auto ctas, auto held) {
    constexpr int S = decltype(stages)::value;
    launch_i8_walk<b32::i8_kernel<QT, T, S, decltype(ctas)::value, decltype(held)::value>,
                   S * kWarps * Ring<QT, 256>::kStageBytes + 128>(a, records, map, sms, stream);
  };
  using Two = std::integral_constant<int, 2>;
  using Deep = std::integral_constant<int, QT == kQ8_0 ? 3 : 4>;  // Q8_0's 4.6 KB stages: 3
  if (held_x(a, sms))
    go(Deep{}, Two{}, std::true_type{});
  else if (QT == kQ8_0 || small_grid(a, sms))
    go(Deep{}, Two{}, std::false_type{});
  else if constexpr (QT != kQ8_0)
    go(std::integral_constant<int, 3>{}, std::integral_constant<int, 3>{}, std::false_type{});
}

// On sm_90 a warp's stages come by one TMA box copy each where its ring runs over at least 4 chunks; with 2-3 (a
// single DRAM round trip a warp, as at 4096 or 6144 x 4096) the 16 lanes' bulk copies start sooner. H200, us,
// lanes / box: 1 x 28672 x 4096 26.13 / 21.48, 1 x 128256 x 4096 99.12 / 94.19, 1 x 4096 x 14336 13.87 / 13.36
// (7 chunks a warp); 1 x 4096 x 4096 5.39 / 5.93, 1 x 6144 x 4096 6.91 / 7.79 (2).
// With Act (the activation's pairs, sm_90 only): always the pair box.
// QT: Q4_K, or Q5_K (launch_q5k_i8).
template <typename T, int S, int kCTAs = 2, typename Act = void, int QT = kQ4_K>
void launch_q4k_i8(const Args& a, const uint8_t* records, int sms, cudaStream_t stream) {
  const int tiles = (a.N + 15) / 16;
  auto go = [&](auto use_box, const CUtensorMap& map) {
    auto run = [&](auto stages, auto ctas, auto held) {
      constexpr int kS = decltype(stages)::value;
      launch_i8_walk<q4k::i8_kernel<T, kS, decltype(ctas)::value, decltype(use_box)::value, Act,
                                    decltype(held)::value, QT>,
                     kS * kWarps * Ring<QT>::kStageBytes + 128>(a, records, map, sms, stream);
    };
    if (held_x(a, sms))  // 4 stages at 2 CTAs an SM
      run(std::integral_constant<int, 4>{}, std::integral_constant<int, 2>{}, std::true_type{});
    else
      run(std::integral_constant<int, S>{}, std::integral_constant<int, kCTAs>{}, std::false_type{});
  };
  if constexpr (!std::is_void_v<Act>) {
    go(std::true_type{}, pair_map(a, Ring<kQ4_K>::kRowStride));
  } else {
    const int ctas = std::min(tiles, kCTAs * sms);
    const int warp_chunks = (tiles + ctas - 1) / ctas * ((a.K / 256 + kWarps - 1) / kWarps);
    if (cc_major(c10::cuda::current_device()) >= 9 && warp_chunks >= 4)
      go(std::true_type{}, chunk_map(a, Ring<QT>::kRowStride, true));
    else
      go(std::false_type{}, CUtensorMap{});
  }
}

// Q5_K at M = 1 on int8 records (those given, else prepare_x_kernel's): Q4_K's kernel and walk with the 5th bits;
// 4 stages a warp where the grid is at most 2 CTAs an SM (98 KB each), else 2 at 3 CTAs an SM (3 of 3 KB stages
// leave room for 2). Against qlinear_kernel on bf16 x (H200, one build, a switch, two rounds, us, with the prepare_x
// launch): 1 x 6144 x 4096 14.5 -> 8.4, 1 x 4096 x 4096 8.5 -> 6.6, 1 x 28672 x 4096 46.2 -> 23.4 (42 -> 83% of
// copy), 1 x 4096 x 14336 24.5 -> 15.2, 1 x 128256 x 4096 182.8 -> 97.9; the 8B Q5_K_M batch-1 step 3.386 -> 2.295 ms.
template <typename T>
void launch_q5k_i8(const Args& a, const uint8_t* records, const at::Tensor& x, int sms, cudaStream_t stream) {
  at::Tensor own;
  const uint8_t* r = records_or_own<T>(a, records, x, own, stream);
  if (small_grid(a, sms))
    launch_q4k_i8<T, 4, 2, void, kQ5_K>(a, r, sms, stream);
  else
    launch_q4k_i8<T, 2, 3, void, kQ5_K>(a, r, sms, stream);
}

// Whether Q4_K at M 2-16 takes tile_kernel (after prepare_x_kernel) rather than rows_kernel: where the tiles
// fill the SMs alone, past M = 4 where its CTAs take more than 2 chunks each, and past M = 8 from 4096 rows on.
// H200, one build, two rounds, us, rows / tile: 16 x 28672 x 4096 56.5 / 41.5, 16 x 4096 x 14336 25.5 / 22.5,
// 16 x 5120 x 4096 15.7 / 12.1, 16 x 6144 x 4096 15.8 / 13.5, 2 x 28672 x 4096 32.4 / 28.8; on 2 chunks a CTA
// narrow grids lose (8 x 4096 x 4096 7.4 / 9.2, 16 x 1024 x 4096 7.5 / 8.7; H100 16 x 1024 x 4096 6.0 / 7.8), and
// so do M = 2 (2 x 5120 x 4096 9.7 / 10.1, 2 x 6144 x 4096 10.3 / 10.9). 16 x 4096 x 4096 alone loses too (H100
// 8.55 / 9.02 us), but in the 8B Q4_K_M batch-16 step, whose o it is, tile_kernel takes the step from 3.118-3.144
// to 3.055-3.067 ms (H100, one build, a switch, two rounds; why the chain and the call alone differ is open).
inline bool q4k_tile(const Args& a, int sms) {
  const int splits = tile_splits(a.N, a.K / 256, sms);
  return splits == 1 || (a.M > 4 && 2 * (a.K / 256) > 5 * splits) || (a.M > 8 && a.N >= 4096);
}

// Whether tile_kernel at 9-16 rows takes one CTA of kWideTileWarps an SM: where those tiles (224 rows) fill 90-100% of
// the SMs with K unsplit, on a card of thin DRAM an SM. Each SM then reads x's records once a chunk, not once for
// each of 2 CTAs: the warps stall mostly on x's slots (ncu, source counters, 16 x 28672 x 4096: 26-33% of the
// samples on that wait). H100, us, 2 CTAs / one: 16 x 28672 x 4096 31.3-31.5 / 29.3-29.8, 12 x 28672 x 4096
// 32.0-32.5 / 28.7-29.4; lost where K splits or the tiles leave SMs idle (16 x 4096 x 14336 18.1-18.4 / 19.6-20.3,
// 16 x 5120 x 4096 9.9 / 11.4), and with 4 or 5 weight stages in place of 3 (16 x 28672 x 4096 30.0-30.2, 31.1-31.5).
// sm_90 only: its 134 KB of shared memory a CTA is past what sm_86/89 give one.
inline bool q4k_wide_tiles(const Args& a, int sms, int device) {
  constexpr int kRows = 16 * q4k::kWideTileWarps;
  const int tiles = (a.N + kRows - 1) / kRows;
  return a.M > 8 && tiles <= sms && 10 * tiles >= 9 * sms && cc_major(device) >= 9 && thin_dram(device);
}

// With Act (sm_90 only): the pair boxes, out [M, N / 2] = act(gate) * up. W: the CTA's warps where one CTA an SM
// (kWideTileWarps), else kWarps (tile_warps picks 6-8, 2 CTAs an SM).
template <typename T, int NT, int S, typename Act = void, int W = kWarps>
void launch_tile_kernel(const Args& a, const uint8_t* records, const at::Tensor& x, int sms, cudaStream_t stream) {
  constexpr bool kWide = W > kWarps;
  constexpr int smem = q4k::tile_smem(NT, S, W) + 128;
  const bool sm90 = cc_major(c10::cuda::current_device()) >= 9;
  const CUtensorMap map = std::is_void_v<Act> ? chunk_map(a, Ring<kQ4_K>::kRowStride, sm90)
                                              : pair_map(a, Ring<kQ4_K>::kRowStride);
  const CUtensorMap x_map = sm90 ? records_map(records, a.M, a.K / 256, 8 * NT) : CUtensorMap{};
  const int warps = kWide ? W : tile_warps(a.N, a.K / 256, sms);
  TileGrid grid(a.N, a.K / 256, NT, sms, x, stream, warps, kWide ? 1 : 2);
  constexpr auto kernel = q4k::tile_kernel<T, NT, S, Act, W>;
  allow_smem<kernel, smem>();
  launch_pdl(kernel, grid.dims, dim3(32 * warps), smem, stream, a, records, grid.ws, grid.counters, map, x_map);
}

template <typename T, int NT, int S, typename Act = void>
void launch_q4k_tile(const Args& a, const uint8_t* records, const at::Tensor& x, int sms, cudaStream_t stream) {
  if constexpr (NT == 2)
    if (q4k_wide_tiles(a, sms, c10::cuda::current_device()))
      return launch_tile_kernel<T, NT, S, Act, q4k::kWideTileWarps>(a, records, x, sms, stream);
  launch_tile_kernel<T, NT, S, Act>(a, records, x, sms, stream);
}

// Q4_K at M <= 16: i8_kernel at M = 1 (the int8 form), else rows_kernel or tile_kernel (q4k_tile) on x's records (uint8 [M,
// K / 256 * kRecord]): those given (written by the kernel before, q4k_x.cuh), or prepare_x_kernel's into the
// caching allocator. rows_kernel: 4 stages a warp where the grid is at most 2 CTAs an SM, else 3.
// At M = 1 the int8 form against the fp16 one (H200, one build, a switch, two rounds, us; the fp16 form's
// staged_kernel, which converted x in each CTA, on grids of one 3-CTA wave): 1 x 4096 x 4096 6.97 -> 5.77 (with
// its prepare_x launch), 1 x 6144 x 4096 9.95 -> 8.71, 1 x 28672 x 4096 29.75 -> 27.1, 1 x 4096 x 14336 16.25 ->
// 14.34, 1 x 128256 x 4096 123 -> 104.
// 3 CTAs an SM (80 registers) spilled ~100 bytes at NT = 1 and lost to 2 (H100, us, 1 x 28672 x 4096
// 40.7 / 32.0, 8 x 28672 x 4096 47.7 / 35.4, 1 x 128256 x 4096 160 / 121). At M > 8 a CTA of 32 rows reads
// x's records once for both of its tiles, which pays where it keeps every SM busy or its warps take many
// chunks (H100, us, 16 rows / 32: 16 x 4096 x 14336 32.3 / 29.8, 16 x 28672 x 4096 60.8 / 57.5, 16 x 128256
// x 4096 261 / 234, 16 x 5120 x 4096 16.2 / 15.9; 16 x 4096 x 4096, 128 CTAs of 32 rows, 9.9 / 10.6).
template <typename T>
void launch_q4k(const Args& a, const uint8_t* records, const at::Tensor& x, int sms, cudaStream_t stream) {
  const bool i8 = q4k_x::int8_form(a.M);
  at::Tensor own;
  const uint8_t* r = records_or_own<T>(a, records, x, own, stream);
  if (i8) {  // 3 CTAs an SM (71 registers) where the grid fills more than 2, but past 4 (launch_q4k_i8's held)
    if (small_grid(a, sms))
      launch_q4k_i8<T, 4>(a, r, sms, stream);
    else
      launch_q4k_i8<T, 3, 3>(a, r, sms, stream);
    return;
  }
  if (a.M > 1 && q4k_tile(a, sms)) {
    if (a.M > 8)
      launch_q4k_tile<T, 2, 3>(a, r, x, sms, stream);
    else
      launch_q4k_tile<T, 1, 4>(a, r, x, sms, stream);
    return;
  }
  if (a.M > 8 && ((a.N + 31) / 32 >= sms || a.K >= 8192))  // 32 rows a CTA: see launch_q4k's comment
    launch_q4k_rows<T, 2, 3, 2>(a, r, stream);
  else if (a.M > 8)
    launch_q4k_rows<T, 2, 3>(a, r, stream);
  else if (small_grid(a, sms))
    launch_q4k_rows<T, 1, 4>(a, r, stream);
  else
    launch_q4k_rows<T, 1, 3>(a, r, stream);
}

// The kernels that read x's records (reads_records), on those given or, where records is null, on records of their
// own (a prepare_x launch).
template <int QT, typename T>
void launch_on_records(const Args& a, const uint8_t* records, const at::Tensor& x, int sms, cudaStream_t stream) {
  if constexpr (QT == kQ4_K)
    launch_q4k<T>(a, records, x, sms, stream);
  else if constexpr (QT == kQ6_K)
    launch_q6_i8<T>(a, records, x, sms, stream);
  else if constexpr (QT == kQ5_K)
    launch_q5k_i8<T>(a, records, x, sms, stream);
  else if constexpr (QT == kQ8_0 || QT == kQ4_0 || QT == kQ4_1)
    launch_b32_i8<QT, T>(a, records, x, sms, stream);
  else
    MINFER_CHECK(false, "qlinear: no records kernel for this type");
}

// Q8_0 at M = 1 with K of fewer chunks than a CTA's warps and N whole 16-row tiles (a small model's tied lm_head), on
// sm_90 past 2 CTAs an SM where qtile_kernel would not split K: short_k_kernel, one CTA an SM with as many warps as
// 2 stages of 16 rows each leave room for (8 at K <= 640), at least 2. Launches it and returns true, else false.
// H200, us, qtile_kernel / it: 1 x 49152 x 576 15.7 / 10.8, 1 x 262144 x 640 78.1 / 49.8; at 3 warps (K = 2016) level.
template <int QT, typename T>
bool launch_if_short_k(const Args& a, int sms, int cc, cudaStream_t stream) {
  constexpr int64_t kSmem = 232448 - 1024;  // the 227 KB a CTA may have on sm_90, less room for its static barriers
  if (QT != kQ8_0 || a.M != 1 || cc < 9 || a.K >= kWarps * 256 || a.N % 16 != 0 || small_grid(a, sms) ||
      tile_splits(a.N, (a.K + 255) / 256, sms) != 1 || reinterpret_cast<uintptr_t>(a.w) % 16 != 0)
    return false;
  const int64_t per_warp = short_k_smem(a.K, 1) - short_k_smem(a.K, 0);
  const int warps = int(std::min<int64_t>(kWarps, (kSmem - short_k_smem(a.K, 0)) / per_warp));
  if (warps < 2) return false;
  constexpr auto kernel = short_k_kernel<T>;
  allow_smem<kernel, int(kSmem)>();
  const int grid = std::min((a.N / 16 + warps - 1) / warps, sms);
  launch_pdl(kernel, dim3((unsigned)grid), dim3(32 * warps), int(short_k_smem(a.K, warps)), stream, a);
  return true;
}

// Whether qlinear takes qtile_kernel, and launches it if so (NT = 1, 2, 4 tiles of 8 x rows, and 8 past 32 rows):
// - M 2-32 (Q4_K: 17-32) from 4096 x 4096 on (measured at its section). H200, one run, us, qlinear_kernel /
//   qtile_kernel at 16 rows: Q8_0 16 x 28672 x 4096 88.4 / 58.6, 16 x 4096 x 4096 14.9 / 11.8; Q6_K 16 x 128256 x
//   4096 262.7 / 233.2. Smaller W lost (Q6_K 16 x 1024 x 4096 9.1 / 9.6; Q4_1 at SmolLM2's shapes, 2-3 chunks a
//   CTA, 2.6-4.4 / 5.1-7.1).
// - Q6_K and Q8_0 up to 32 rows with K of fewer chunks than a CTA has warps (a small model's tied lm_head), on
//   grids past 2 CTAs an SM: there qlinear_kernel idles most warps (3 of 8 busy at K = 576) in CTAs of 16 rows.
//   H200, two rounds, us: Q8_0 1 x 49152 x 576 24.2 / 16.0, 16 x 49152 x 576 41.6 / 19.0, 1 x 262144 x 640 110.4 /
//   74.9, 16 x 262144 x 640 200.4 / 90.4; on a grid of 32 tiles it lost (1 x 4096 x 576 3.1 / 6.5). H100, two
//   rounds: 24 x 49152 x 576 44.5 / 27.3, 32 x 49152 x 576 47.1 / 27.7, 32 x 262144 x 640 239-240 / 135.
template <int QT, typename T>
bool launch_if_qtile(const Args& a, const at::Tensor& x, int sms, cudaStream_t stream) {
  const bool wide = a.M > (QT == kQ4_K ? 16 : 1) && a.N >= 4096 && a.K >= 4096;  // Q4_K to 16 rows: q4k's kernels
  const bool short_k = (QT == kQ6_K || QT == kQ8_0) && a.M <= kMaxRows && a.K < kWarps * 256 && !small_grid(a, sms);
  if (!wide && !short_k) return false;
  if (a.M > kMaxRows) {  // Q4_K and Q6_K on wide W only (max_rows)
    if constexpr (wide_rows_format(QT)) launch_qtile<QT, T, 8>(a, x, sms, stream);
    else TORCH_CHECK(false, "qlinear: no kernel takes ", a.M, " rows here");
  } else if (a.M > 16)
    launch_qtile<QT, T, 4>(a, x, sms, stream);
  else if (a.M > 8)
    launch_qtile<QT, T, 2>(a, x, sms, stream);
  else
    launch_qtile<QT, T, 1>(a, x, sms, stream);
  return true;
}

}  // namespace
}  // namespace minfer::qgemm

namespace minfer::qgemm {

template <int QT, typename T>
void run(const Args& a, const uint8_t* records, const at::Tensor& x, int sms, int cc, cudaStream_t stream) {
  if (a.norm_w != nullptr || a.accumulate) {  // the caller checked takes_norm
    const bool taken = launch_if_regs<QT, T>(a, sms, stream);
    TORCH_CHECK(taken, "qlinear: no kernel takes norm_w or accumulate here");
    return;
  }
  // Q6_K at one row without records: below, by its grid
  if (reads_records(QT, a.M, a.K, cc) && (records != nullptr || QT != kQ6_K))
    launch_on_records<QT, T>(a, records, x, sms, stream);
  else if (launch_if_short_k<QT, T>(a, sms, cc, stream))
    return;
  else if (launch_if_qtile<QT, T>(a, x, sms, stream))
    return;
  // Q6_K at M = 1 past 2 CTAs an SM (a Q4_K_M lm_head; short K took qtile_kernel above) on records of its own: the
  // int8 form and its prepare_x launch beat qlinear_kernel (H200, 1 x 128256 x 4096: 163.5 -> 127.1 us; the 8B
  // Q4_K_M batch-1 step 2.073 / 2.081 -> 2.043 / 2.040 ms, one build, a switch, two rounds)
  else if (QT == kQ6_K && a.M == 1 && !small_grid(a, sms))
    launch_q6_i8<T>(a, nullptr, x, sms, stream);
  else if (launch_if_regs<QT, T>(a, sms, stream))
    return;
  // x ahead where the grid is at most 2 CTAs an SM (latency-bound; see XAhead)
  else if (kXAheadFormat<QT> && a.M <= 8 && small_grid(a, sms)) {
    if constexpr (kXRowFormat<QT>) {
      if (a.M == 1 && a.K <= kXRowMaxK) {
        launch<QT, T, 1, false, true>(a, stream);
        return;
      }
    }
    launch<QT, T, 1, kXAheadFormat<QT>>(a, stream);
  }
  else if (a.M <= 8)
    launch<QT, T, 1>(a, stream);
  else if (a.M <= 16)
    launch<QT, T, 2>(a, stream);
  else
    launch<QT, T, 4>(a, stream);
}

template <int QT, typename T>
bool run_act(const Args& a, bool silu, const uint8_t* x_records, uint8_t* out_records, const at::Tensor& x, int sms,
             int cc, cudaStream_t stream) {
  if (a.norm_w != nullptr) {  // the caller checked takes_norm
    const bool taken = out_records == nullptr && (silu ? launch_if_regs<QT, T, Silu>(a, sms, stream)
                                                       : launch_if_regs<QT, T, GeluTanh>(a, sms, stream));
    TORCH_CHECK(taken, "qlinear_act: no kernel takes norm_w here");
    return true;
  }
  if constexpr (QT == kQ4_K) {
    // up to 16 rows on x's records (sm_90), where the kernel is i8_kernel (one row) or tile_kernel: their pair tiles,
    // then out's records in a launch of their own
    if (a.M <= 16 && x_records != nullptr && cc >= 9 && (a.M == 1 || q4k_tile(a, sms))) {
      auto go = [&](auto act) {
        using Act = decltype(act);
        if (a.M > 8)
          launch_q4k_tile<T, 2, 3, Act>(a, x_records, x, sms, stream);
        else if (a.M > 1)
          launch_q4k_tile<T, 1, 4, Act>(a, x_records, x, sms, stream);
        else if (small_grid(a, sms))
          launch_q4k_i8<T, 4, 2, Act>(a, x_records, sms, stream);
        else
          launch_q4k_i8<T, 3, 3, Act>(a, x_records, sms, stream);
      };
      if (silu)
        go(Silu{});
      else
        go(GeluTanh{});
      if (out_records != nullptr) write_records(static_cast<const T*>(a.out), out_records, a.M, a.N / 2, stream);
      return true;
    }
  }
  if (out_records != nullptr) return false;  // regs_kernel's epilogue writes no records
  return silu ? launch_if_regs<QT, T, Silu>(a, sms, stream) : launch_if_regs<QT, T, GeluTanh>(a, sms, stream);
}

}  // namespace minfer::qgemm

// One format's instantiations, for both activation dtypes (qlinear_<format>.cu).
#define MINFER_QLINEAR_FORMAT(QT)                                                                                    \
  namespace minfer::qgemm {                                                                                          \
  template void run<QT, __half>(const Args&, const uint8_t*, const at::Tensor&, int, int, cudaStream_t);             \
  template void run<QT, __nv_bfloat16>(const Args&, const uint8_t*, const at::Tensor&, int, int, cudaStream_t);      \
  template bool run_act<QT, __half>(const Args&, bool, const uint8_t*, uint8_t*, const at::Tensor&, int, int,        \
                                    cudaStream_t);                                                                   \
  template bool run_act<QT, __nv_bfloat16>(const Args&, bool, const uint8_t*, uint8_t*, const at::Tensor&, int, int, \
                                           cudaStream_t);                                                            \
  }
