// qembedding: rows `ids` of a quantized table W [n, k] dequantized -> fp16/bf16 [*ids.shape, k]. An id
// outside [0, n) never reads the table: its row is NaN (as in csrc/embedding.cu). The kernel:
// qgemm/decode_rows.cuh.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "common/checks.h"
#include "common/dispatch.h"
#include "ops.h"
#include "qgemm/checks.h"
#include "qgemm/decode_rows.cuh"

namespace minfer {

at::Tensor qembedding(const at::Tensor& ids, const at::Tensor& blocks, int64_t qtype, int64_t n, int64_t k,
                      at::ScalarType dtype) {
  MINFER_CHECK_CUDA(ids);
  qgemm::check_blocks("qembedding", blocks, qtype, n, k);
  MINFER_CHECK(!qgemm::is_tiled(qtype), "qembedding: the table's blocks must be by rows, not tiled (qtype ", qtype, ")");
  MINFER_CHECK_SAME_DEVICE(ids, blocks);
  MINFER_CHECK_INDEX(ids);
  qgemm::check_half_dtype("qembedding", "dtype", dtype);
  MINFER_CHECK(ids.numel() < (int64_t(1) << 31), "qembedding: too many ids (", ids.numel(), ")");
  const int64_t tiles = (k + qgemm::kDecodeTile - 1) / qgemm::kDecodeTile;
  MINFER_CHECK(tiles <= 65535, "qembedding: k must be at most ", 65535 * int64_t(qgemm::kDecodeTile), ", got ", k);
  const c10::cuda::CUDAGuard guard(blocks.device());
  auto out_sizes = ids.sizes().vec();
  out_sizes.push_back(k);
  auto out = blocks.new_empty(out_sizes, dtype);  // [*ids.shape, k]
  const int64_t rows = ids.numel();
  if (rows == 0) return out;
  const auto ids64 = ids.to(at::kLong).contiguous();  // [rows]
  auto stream = c10::cuda::getCurrentCUDAStream();
  MINFER_DISPATCH_QTYPE(qtype, QT, [&] {
    MINFER_DISPATCH_HALF(dtype, "qembedding", [&] {
      qgemm::decode_rows_kernel<QT, scalar_t><<<dim3((unsigned)rows, (unsigned)tiles), qgemm::kDecodeThreads, 0, stream>>>(
          reinterpret_cast<scalar_t*>(out.data_ptr()), blocks.data_ptr<uint8_t>(), ids64.data_ptr<int64_t>(), n, (int)k);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return out;
}

}  // namespace minfer
