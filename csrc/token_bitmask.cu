// Structured outputs' mask on the logits, in place: logits[r, i] = -inf where bit i % 32 of bitmask[r, i / 32] is 0
// (the ids the row's grammar does not allow next; llguidance's packed masks, 32 ids a word). One launch, where the
// reference's torch ops unpack the words to a bool [rows, vocab] first (six calls: 1.4-2.3 ms of host time a step at
// 60 rows on an H100 host).
//
// A thread an element: the 32 lanes of a warp read one word (a broadcast) and write only the ids it leaves out, so
// the logits are never read. A grid of (chunks of a row, rows), each CTA looping over its row's chunks.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "common/checks.h"
#include "common/dispatch.h"
#include "common/launch.h"
#include "common/ptx.cuh"

namespace minfer {

namespace {

constexpr int kThreads = 256;
constexpr int kCtasPerSm = 4;  // the grid aimed at

template <typename T>
__global__ void __launch_bounds__(kThreads)
    token_bitmask_kernel(T* __restrict__ logits,                // [rows, row_stride]
                         const uint32_t* __restrict__ bitmask,  // [rows, words]
                         int64_t row_stride, int words, int vocab) {
  const int row = blockIdx.y;
  T* dst = logits + row * row_stride;
  const uint32_t* bits = bitmask + static_cast<int64_t>(row) * words;
  ptx::griddep_wait();  // the logits are the previous kernel's
  ptx::griddep_launch_dependents();
  for (int i = blockIdx.x * kThreads + threadIdx.x; i < vocab; i += gridDim.x * kThreads)
    if (!((__ldg(bits + (i >> 5)) >> (i & 31)) & 1u)) dst[i] = static_cast<T>(-INFINITY);
}

}  // namespace

void apply_token_bitmask(const at::Tensor& logits, const at::Tensor& bitmask) {
  MINFER_CHECK_CUDA(logits);
  MINFER_CHECK_FLOAT(logits);
  MINFER_CHECK_DIM(logits, 2);
  MINFER_CHECK_LAST_DIM_CONTIGUOUS(logits);
  MINFER_CHECK_SAME_DEVICE(logits, bitmask);
  MINFER_CHECK(bitmask.scalar_type() == at::kInt, "bitmask must be int32, got ", bitmask.scalar_type());
  MINFER_CHECK_DIM(bitmask, 2);
  MINFER_CHECK_CONTIGUOUS(bitmask);
  const int64_t rows = logits.size(0), vocab = logits.size(1), words = bitmask.size(1);
  MINFER_CHECK(bitmask.size(0) == rows, "bitmask must have a row per logits row (", rows, "), got ", bitmask.size(0));
  MINFER_CHECK(words * 32 >= vocab, "bitmask must have a bit per logit: ", (vocab + 31) / 32, " words a row for ",
               vocab, " logits, got ", words);
  MINFER_CHECK(vocab < (int64_t(1) << 31), "apply_token_bitmask: logits' row length must be below 2^31, got ", vocab);
  MINFER_CHECK(rows < 65536, "apply_token_bitmask: at most 65535 rows, got ", rows);
  if (rows == 0 || vocab == 0) return;
  const c10::cuda::CUDAGuard guard(logits.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int64_t chunks = (vocab + kThreads - 1) / kThreads;
  const int64_t target = std::max<int64_t>(1, kCtasPerSm * sm_count(logits.get_device()) / rows);
  const dim3 grid(static_cast<unsigned>(std::min(chunks, target)), static_cast<unsigned>(rows));
  MINFER_DISPATCH_FLOAT(logits.scalar_type(), "apply_token_bitmask", [&] {
    launch_pdl(token_bitmask_kernel<scalar_t>, grid, dim3(kThreads), 0, stream,
               reinterpret_cast<scalar_t*>(logits.data_ptr()),
               reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>()), logits.stride(0),
               static_cast<int>(words), static_cast<int>(vocab));
  });
}

}  // namespace minfer
