// Arrival counters for kernels whose last-arriving CTA finishes a piece of work (the split-KV decode's
// combine, the small-M GEMM's shared tiles). Host-only.
//
// The counters must be zero when a launch starts; each launch leaves them zero (the last arrival resets
// its own). One buffer per device, made outside any graph capture and kept for the life of the process,
// so captured graphs keep pointing at it and replays need no memset node. Kernels in one stream never
// overlap in their use of it (a programmatic dependent touches it only after griddepcontrol.wait); a
// device's streams each take a region of their own (at most kRegions streams), since the engine may run a
// linear on a second stream beside the first (ops.beside_stream). Where it cannot serve (first use inside a
// capture, more counters than a region holds, or more streams), the call gets counters of its own in `own`,
// zeroed on the stream (a memset node in a graph).
#pragma once
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <mutex>

#include "common/tensor.h"

namespace minfer {

// like: any tensor on the device (the counters' device and allocator).
inline int* split_counters(int64_t n, int device, cudaStream_t stream, const at::Tensor& like, at::Tensor& own) {
  // 64 streams (torch's pools hold 32 a priority) of 8192 counters (the split decode of 256 rows x 32 kv heads), 2 MB
  constexpr int64_t kRegion = 1 << 13;
  constexpr int kRegions = 64, kMaxDevices = 64;
  static std::mutex mu;
  static at::Tensor* shared[kMaxDevices] = {};
  static cudaStream_t owners[kMaxDevices][kRegions] = {};  // the stream of each region, in order of first use
  static int used[kMaxDevices] = {};                        // regions given (the default stream is null)
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (n <= kRegion && device >= 0 && device < kMaxDevices) {
    std::lock_guard<std::mutex> lock(mu);
    if (shared[device] == nullptr && capture == cudaStreamCaptureStatusNone)
      shared[device] = new at::Tensor(like.new_zeros({kRegions * kRegion}, at::kInt));  // never freed
    if (shared[device] != nullptr)
      for (int r = 0; r < kRegions; ++r) {
        if (r == used[device]) owners[device][used[device]++] = stream;
        if (owners[device][r] == stream) return shared[device]->data_ptr<int>() + r * kRegion;
      }
  }
  own = like.new_empty({n}, at::kInt);
  C10_CUDA_CHECK(cudaMemsetAsync(own.data_ptr(), 0, n * sizeof(int), stream));
  return own.data_ptr<int>();
}

}  // namespace minfer
