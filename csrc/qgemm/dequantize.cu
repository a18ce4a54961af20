// dequantize / dequantize_into: a whole quantized weight -> fp16/bf16 [n, k], the path of more than 32 rows
// (one weight into a reused scratch buffer, then the dense GEMM). The kernel: qgemm/decode_rows.cuh.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "common/checks.h"
#include "common/dispatch.h"
#include "common/launch.h"
#include "ops.h"
#include "qgemm/checks.h"
#include "qgemm/decode_rows.cuh"

namespace minfer {
namespace {

// out [n, k] (contiguous, 16-byte aligned) <- W's rows, in order (tiled W: each value to its row). static_weight: no kernel just ahead of this
// one writes the blocks (a model's weights), which then load before the previous kernel completes.
void launch_dequantize(const at::Tensor& out, const at::Tensor& blocks, int64_t qtype, bool static_weight) {
  const int64_t values = out.numel(), tiles = (values + qgemm::kDecodeTile - 1) / qgemm::kDecodeTile;
  if (values == 0) return;
  MINFER_CHECK(tiles < (int64_t(1) << 31), "dequantize: too many values (", values, ")");
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int tiled_chunks = qgemm::is_tiled(qtype) ? int(out.size(1) / 256) : 0;
  MINFER_DISPATCH_QTYPE(qgemm::base_qtype(qtype), QT, [&] {
    MINFER_DISPATCH_HALF(out.scalar_type(), "dequantize", [&] {
      auto* dst = reinterpret_cast<scalar_t*>(out.data_ptr());
      launch_pdl(qgemm::decode_all_kernel<QT, scalar_t>, dim3((unsigned)tiles), dim3(qgemm::kDecodeThreads), 0, stream,
                 dst, static_cast<const uint8_t*>(blocks.data_ptr<uint8_t>()), values, static_weight, tiled_chunks);
    });
  });
}

}  // namespace

at::Tensor dequantize(const at::Tensor& blocks, int64_t qtype, int64_t n, int64_t k, at::ScalarType dtype) {
  qgemm::check_blocks("dequantize", blocks, qtype, n, k);
  qgemm::check_half_dtype("dequantize", "dtype", dtype);
  const c10::cuda::CUDAGuard guard(blocks.device());
  auto out = blocks.new_empty({n, k}, dtype);  // [n, k]
  launch_dequantize(out, blocks, qtype, false);
  return out;
}

void dequantize_into(const at::Tensor& out, const at::Tensor& blocks, int64_t qtype, bool static_weight) {
  MINFER_CHECK_CUDA(out);
  MINFER_CHECK_DIM(out, 2);
  qgemm::check_blocks("dequantize_into", blocks, qtype, out.size(0), out.size(1));
  MINFER_CHECK_SAME_DEVICE(out, blocks);
  qgemm::check_half_dtype("dequantize_into", "out", out.scalar_type());
  MINFER_CHECK_CONTIGUOUS(out);
  MINFER_CHECK(is_aligned16(out.data_ptr()), "dequantize_into: out must be 16-byte aligned");
  const c10::cuda::CUDAGuard guard(blocks.device());
  launch_dequantize(out, blocks, qtype, static_weight);
}

}  // namespace minfer
