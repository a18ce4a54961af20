// x in the form the Q4_K decode kernels take (csrc/qgemm/q4k_kernels.cuh): per row and 256-k chunk a record,
// written by one warp whose lane l holds elements 8l .. 8l + 7 of the chunk. qlinear's prepare_x_kernel writes
// them, and so do RMSNorm and the gated activations beside their output (the records argument), which spares
// the Q4_K linear after them a launch.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <type_traits>

#include "common/checks.h"
#include "common/tensor.h"

namespace minfer::q4k_x {

// An x row's chunk (256 k) as a record, in one of two forms by x's rows (int8_form):
// - fp16 (M > 1: rows_kernel, tile_kernel; the first kF16Bytes): 256 fp16 values scaled by 2^e in the fragment
//   order, then the 8 sub-block sums / 32 as fp16 hi + lo pairs (sub-blocks 2t, 2t + 1's his, then their los:
//   the min's B fragment of lane t) at kSumsAt, and 2^-e (f32) at kInvAt;
// - int8 (M = 1: i8_kernel): v = x 2^e rounded to a 22-bit integer 2^14 hi + 2^7 mid + lo (hi in
//   [-128, 127], mid and lo in [0, 127]), e putting the chunk's largest |x| in [2^20, 2^21); the 256 his, mids
//   and los as int8, each in the order lane t of the mma reads them (element 32 s + 8 t + i at 64 t + 8 s + i),
//   then the sub-block sums of v / 2^12 as above at kI8SumsAt, and 2^-e at kI8InvAt (NaN where x is not finite).
constexpr int kSumsAt = 512, kInvAt = 544, kF16Bytes = 560;
constexpr int kI8SumsAt = 768, kI8InvAt = 800, kRecord = 816;  // room for either form

// The form of x's records at `rows` rows: int8 at one row (batch-1 decode: the Q4_K kernel multiplies the
// quants as they are; ncu, H200, on one cp.async ring: 434 instructions a chunk and warp against 590 on fp16),
// fp16 above.
inline bool int8_form(int64_t rows) { return rows == 1; }

// A warp's x row chunk in fp16, 8 elements a lane: v = elements 8 lane .. 8 lane + 7 (T, as loaded) times 2^e
// into f (fp32, exact) and h (fp16, in the fragment order); returns e. e puts the chunk's largest |x| in
// [2^14, 2^15): bf16's 8-bit significands are then exact down to 2^-38 of it. fp16 and bf16 magnitudes order
// as their bits.
template <typename T>
__device__ __forceinline__ int to_fp16(uint4 v, float (&f)[8], uint4& h) {
  constexpr bool kHalf = std::is_same_v<T, __half>;
  constexpr uint32_t kAbs = 0x7FFF7FFFu;
  uint32_t mx = __vmaxu2(__vmaxu2(v.x & kAbs, v.y & kAbs), __vmaxu2(v.z & kAbs, v.w & kAbs));
  mx = __reduce_max_sync(0xFFFFFFFFu, max(mx & 0xFFFFu, mx >> 16));
  // 2^(E - bias) 2^e = 2^14 for the top exponent E
  const int e = min(max(kHalf ? 29 - int(mx >> 10) : 141 - int(mx >> 7), -126), 126);
  const float s = __int_as_float((127 + e) << 23);
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (kHalf) {
      const float2 pair = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
      f[2 * i] = pair.x * s, f[2 * i + 1] = pair.y * s;
    } else {
      f[2 * i] = __uint_as_float(w[i] << 16) * s, f[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u) * s;
    }
  }
  uint32_t p[4];
  const int order[8] = {0, 2, 1, 3, 4, 6, 5, 7};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __half2 pair = __floats2half2_rn(f[order[2 * i]], f[order[2 * i + 1]]);
    p[i] = *reinterpret_cast<const uint32_t*>(&pair);
  }
  h = make_uint4(p[0], p[1], p[2], p[3]);
  return e;
}

// 4 ints' low bytes as one word.
__device__ __forceinline__ uint32_t low_bytes(int a, int b, int c, int d) {
  return __byte_perm(__byte_perm(a, b, 0x0040), __byte_perm(c, d, 0x0040), 0x5410);
}

// One lane's part of a record from v (as to_fp16), in the int8 form or the fp16 one: its elements, (lanes 4s)
// sub-block s's sum, (lane 0) 2^-e. The sums, scaled under 2^15, fit fp16 as hi + lo (to ~2^-22 of them).
template <typename T>
__device__ __forceinline__ void write_record(uint4 v, int lane, uint8_t* record, bool i8) {
  float f[8];
  uint4 h;
  const int e = to_fp16<T>(v, f, h);
  float sum;
  bool finite = true;
  if (i8) {
    int q[8], isum = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      q[i] = min(__float2int_rn(64.f * f[i]), (1 << 21) - 1);  // exact for all but the smallest |x|
      isum += q[i];
      finite = finite && isfinite(f[i]);
    }
    uint8_t* at = record + 64 * (lane % 4) + 8 * (lane / 4);
    for (int part = 0; part < 3; ++part) {
      const int shift = 14 - 7 * part, mask = part == 0 ? 0xFF : 0x7F;
      uint32_t w[2];
#pragma unroll
      for (int j = 0; j < 2; ++j)
        w[j] = low_bytes(q[4 * j] >> shift, q[4 * j + 1] >> shift, q[4 * j + 2] >> shift, q[4 * j + 3] >> shift) &
               (mask * 0x01010101u);
      *reinterpret_cast<uint2*>(at + 256 * part) = make_uint2(w[0], w[1]);
    }
    sum = float(isum) * (32.f / 4096);  // / 32 below: the sub-block's sum / 2^12, under 2^14
    finite = __all_sync(0xFFFFFFFFu, finite);
  } else {
    *reinterpret_cast<uint4*>(record + 16 * lane) = h;
    sum = ((f[0] + f[1]) + (f[2] + f[3])) + ((f[4] + f[5]) + (f[6] + f[7]));
  }
  sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 1);
  sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 2);
  sum *= 1.f / 32;
  const __half hi = __float2half_rn(sum), lo = __float2half_rn(sum - __half2float(hi));
  if (lane % 4 == 0) {  // sub-block s at [s / 2][hi, lo][s % 2]: the min's B fragment of lane s / 2, 8 bytes
    __half* sums = reinterpret_cast<__half*>(record + (i8 ? kI8SumsAt : kSumsAt)) + 4 * (lane / 8) + (lane / 4) % 2;
    sums[0] = hi, sums[2] = lo;
  }
  const float inv = __int_as_float((127 - e) << 23) * (i8 ? 1.f / 64 : 1.f);  // 2^-e, 2^-(e + 6)
  if (lane == 0)
    *reinterpret_cast<float*>(record + (i8 ? kI8InvAt : kInvAt)) = finite ? inv : __int_as_float(0x7FC00000);
}

// Host: records for x [rows, k] (fp16/bf16, k a multiple of 256): uint8 [rows, k / 256 * kRecord], contiguous,
// on x's device.
inline void check_records(const char* op, const at::Tensor& records, const at::Tensor& x) {
  MINFER_CHECK(x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16, op,
               ": records are written for float16 or bfloat16 x, got ", x.scalar_type());
  MINFER_CHECK(x.size(-1) % 256 == 0, op, ": records need a width that is a multiple of 256, got ", x.size(-1));
  MINFER_CHECK(records.device() == x.device(), op, ": records must be on x's device ", x.device(), ", got ",
               records.device());
  MINFER_CHECK(records.scalar_type() == at::kByte, op, ": records must be uint8, got ", records.scalar_type());
  const int64_t width = x.size(-1) / 256 * kRecord;
  MINFER_CHECK(records.dim() == 2 && records.size(0) == x.size(0) && records.size(1) == width, op,
               ": records must have shape [", x.size(0), ", ", width, "] (rows, width / 256 * ", kRecord, "), got ",
               records.sizes());
  MINFER_CHECK(records.is_contiguous(), op, ": records must be contiguous");
  MINFER_CHECK(reinterpret_cast<uintptr_t>(records.data_ptr()) % 16 == 0, op, ": records must be 16-byte aligned");
}

}  // namespace minfer::q4k_x
