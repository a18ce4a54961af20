// Where key j's K (or V) row of one (sequence, kv head) lies, for both cache layouts:
//   dense  [batch, capacity, kv_heads, D]:  base + j * ss
//   paged  [num_pages, page_size, kv_heads, D]: row j % page_size of page table[j / page_size]
// A page id outside the pool is clamped into it: a bad block table reads wrong rows, never out of bounds.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

namespace minfer::attn {

// The paged fields of a kernel's parameters: block_table == nullptr means the dense layout.
struct PagedKv {
  const int* block_table = nullptr;  // [batch, max_pages] int32, row stride bt_stride
  int64_t bt_stride = 0, k_ps = 0, v_ps = 0;  // page strides of the K and V pools (elements)
  int page_size = 0, num_pages = 0;
};

#ifdef __CUDACC__
// kShift: a key's page and row by a shift and a mask where the page size is a power of two (H200, paged decode
// 1 x 4k 7.10 -> 6.46 us, a 32-query chunk over 16k keys 53.2 -> 44.0), else by division. The d 256 kernels keep
// the division: the shift's register spilled there (16 x 8k x 8 / 4 heads, window 512: 18.6 -> 23.4 us dense).
template <typename T, bool kShift>
struct KvRows {
  const T* base;     // dense: key 0 of (b, kvh); paged: row 0 of page 0 at kvh
  int64_t ss;        // row stride (elements)
  const int* table;  // this sequence's pages, or nullptr (dense)
  int64_t ps;        // page stride (elements)
  int page_size;
  int page_shift;    // kShift: log2(page_size) where it is a power of two, else -1 (a division by a runtime value
                     // is ~20 dependent instructions)
  int last_page;     // num_pages - 1

  // paged: the page holding key j, and key j's row given its page
  __device__ __forceinline__ int entry_of(int j) const {
    return kShift && page_shift >= 0 ? j >> page_shift : j / page_size;
  }
  __device__ __forceinline__ unsigned page_of(int j) const {
    return min(static_cast<unsigned>(__ldg(table + entry_of(j))), static_cast<unsigned>(last_page));
  }
  __device__ __forceinline__ const T* in_page(unsigned page, int j) const {
    return base + page * ps + (kShift && page_shift >= 0 ? j & (page_size - 1) : j % page_size) * ss;
  }
  __device__ __forceinline__ const T* row(int j) const { return table == nullptr ? base + j * ss : in_page(page_of(j), j); }
};

// Whether the kernels of head_dim D take KvRows' shift.
template <int D>
constexpr bool kPageShift = D <= 128;

// The rows of (sequence b, kv head kvh) of one cache (bs: the dense layout's batch stride, ps: the pool's
// page stride).
template <typename T, bool kShift>
__device__ __forceinline__ KvRows<T, kShift> kv_rows(const PagedKv& pk, const void* cache, int64_t bs, int64_t ss,
                                                     int64_t hs, int64_t ps, int b, int kvh) {
  const T* base = reinterpret_cast<const T*>(cache) + kvh * hs;
  if (pk.block_table == nullptr) return {base + b * bs, ss, nullptr, 0, 1, 0, 0};
  const bool pow2 = (pk.page_size & (pk.page_size - 1)) == 0;
  return {base, ss, pk.block_table + b * pk.bt_stride, ps, pk.page_size, pow2 ? __ffs(pk.page_size) - 1 : -1,
          pk.num_pages - 1};
}
#endif

}  // namespace minfer::attn
