// The random draw's device primitives (argmax.cu, draw_filtered.cu): the counter-based RNG of
// minfer/ops/reference.py (_mix32, uniform_noise, unit_interval), bit for bit, and the order keys of an argmax.
#pragma once
#include <cstdint>

namespace minfer {

// The unsigned order of v: larger values give larger keys, NaN above +inf, -0 equal to +0.
__device__ __forceinline__ uint32_t order_key(float v) {
  const uint32_t u = __float_as_uint(v);
  return v != v ? 0xffffffffu : v == 0.f ? 0x80000000u : (u >> 31) ? ~u : u | 0x80000000u;
}

// v's order, then the index reversed: one unsigned max picks the largest value, then the smallest index
// (torch.argmax's rule).
__device__ __forceinline__ unsigned long long argmax_key(float v, uint32_t index) {
  return (static_cast<unsigned long long>(order_key(v)) << 32) | (0xffffffffu - index);
}

__device__ __forceinline__ uint32_t argmax_index(unsigned long long key) {
  return 0xffffffffu - static_cast<uint32_t>(key);
}

// A bijective 32-bit mixer (Wellons' lowbias32).
__device__ __forceinline__ uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  return x ^ (x >> 16);
}

// A row's key: its seed's two halves and its position mixed.
__device__ __forceinline__ uint32_t noise_key(int64_t seed, int64_t position) {
  const uint64_t s = static_cast<uint64_t>(seed);
  return mix32(mix32(mix32(static_cast<uint32_t>(s >> 32)) ^ static_cast<uint32_t>(s)) ^
               static_cast<uint32_t>(position));
}

// -log(-log(u)), u in (0, 1) from the hash of (key, index): its top 23 bits at the middles of 2^23 steps.
__device__ __forceinline__ float gumbel(uint32_t key, uint32_t index) {
  const float u = (static_cast<float>(mix32(mix32(index) ^ key) >> 9) + 0.5f) * (1.0f / 8388608.0f);
  return -logf(-logf(u));
}

}  // namespace minfer
