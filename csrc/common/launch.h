// Launch helpers: the SM count, the DRAM bandwidth per SM, and programmatic dependent launch (Hopper),
// where the kernel may start while the previous kernel in the stream is still running; it must execute
// griddepcontrol.wait before touching anything that kernel writes (or reads: our outputs), and may
// execute griddepcontrol.launch_dependents to let the next kernel in. Host-only.
#pragma once
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

namespace minfer {

// Number of SMs of a device, looked up once (launch configurations are sized from it on the host,
// without a sync). 132 (H100/H200) for an out-of-range index.
inline int sm_count(int device) {
  static int cached[64] = {};
  if (device < 0 || device >= 64) return 132;
  if (cached[device] == 0) {
    int n = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
    cached[device] = n > 0 ? n : 132;
  }
  return cached[device];
}

// Compute capability major of a device, looked up once (0 for an out-of-range index).
inline int cc_major(int device) {
  static int cached[64] = {};
  if (device < 0 || device >= 64) return 0;
  if (cached[device] == 0)
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&cached[device], cudaDevAttrComputeCapabilityMajor, device));
  return cached[device];
}

// Peak DRAM bandwidth of a device per SM, in GB/s: memory clock x bus width, two transfers a clock
// (HBM), looked up once. -1 where the driver does not report the memory clock or the bus width.
inline double dram_gbps_per_sm(int device) {
  static double cached[64] = {};  // 0: not looked up yet
  if (device < 0 || device >= 64) return -1.0;
  if (cached[device] == 0.0) {
    int clock_khz = 0, bus_bits = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, device));
    const double gbps = 2.0 * clock_khz * 1e3 * (bus_bits / 8) / 1e9 / sm_count(device);
    cached[device] = gbps > 0.0 ? gbps : -1.0;
  }
  return cached[device];
}

// Whether a device's DRAM gives an SM under 30 GB/s (the H100: 25; the H200: 36.5; unknown counts as under). Where
// the bytes in flight an SM decide a plan, such cards take their own: the decode's shallow long streams
// (attention/decode_plan.h), gemv's wide-rows ring (gemm/gemv.cu) and Q4_K's wide tiles (qgemm/qlinear_launch.cuh).
constexpr double kThinDramGBpsPerSm = 30.0;
inline bool thin_dram(int device) { return dram_gbps_per_sm(device) < kThinDramGBpsPerSm; }

// Whether a small kernel of `rows` rows (RMSNorm, the activation, rope) lets the next kernel launch before
// its own griddep_wait (ptx::griddep_enter): at one row (batch-1 decode), where the next GEMV's first weights
// then load beside the previous GEMV's tail; and up to 16 rows where next_streams, the next kernel streams reads
// of its own before its wait: rope before decode attention (the cache's prefix), a norm or the activation
// writing records for a quantized linear (its weights). Up to 16 rows for every small kernel, the bf16 model
// lost (8B decode at 16 rows, H200, ms a step: bf16 all 5.29 against one row 5.19; in another call one row 5.24
// against next_streams 5.17; Q4_K_M all 3.63, one row 3.72, next_streams 3.63-3.65).
inline bool pdl_early(int64_t rows, bool next_streams) { return rows <= 1 || (rows <= 16 && next_streams); }

// Lets kKernel take kBytes of dynamic shared memory (past 48 KB needs the opt-in), once per kernel.
template <auto kKernel, int kBytes>
void allow_smem() {
  static const bool done = [] {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes));
    return true;
  }();
  (void)done;
}

// CTAs of kKernel (kThreads threads, kBytes of dynamic shared memory) an SM holds at once, looked up once per
// kernel: the grid of a kernel whose CTAs loop over its tiles.
template <auto kKernel, int kThreads, int kBytes>
int resident_ctas() {
  static const int n = [] {
    int ctas = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, kKernel, kThreads, kBytes));
    return ctas > 1 ? ctas : 1;
  }();
  return n;
}

// Launch with programmatic stream serialization where the code that runs waits for it: the virtual
// arch it was compiled for (a compute_80 PTX JIT-compiled for Hopper has no griddepcontrol.wait).
// The version is looked up once per kernel signature: every kernel of a signature is built for the
// same archs.
// cluster > 1: CTAs in clusters of that many along x (the grid a multiple of it). pdl = false: a plain
// (cluster) launch, for kernels that do not wait on the previous one.
template <typename Kernel, typename... Args>
void launch_ex(Kernel kernel, bool pdl, int cluster, dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
               Args... args) {
  static const int ptx_version = [&] {
    cudaFuncAttributes attr;
    C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
    return attr.ptxVersion;
  }();
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attrs[2];
  unsigned n = 0;
  if (pdl && ptx_version >= 90) {
    attrs[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster > 1) {
    attrs[n].id = cudaLaunchAttributeClusterDimension;
    attrs[n++].val.clusterDim = {unsigned(cluster), 1, 1};
  }
  config.attrs = attrs;
  config.numAttrs = n;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, args...));
}
template <typename Kernel, typename... Args>
void launch_pdl_cluster(Kernel kernel, int cluster, dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                        Args... args) {
  launch_ex(kernel, true, cluster, grid, block, smem, stream, args...);
}
template <typename Kernel, typename... Args>
void launch_pdl(Kernel kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t stream, Args... args) {
  launch_ex(kernel, true, 1, grid, block, smem, stream, args...);
}

// Clusters of `cluster` CTAs of kKernel (kThreads threads, kBytes of dynamic shared memory) the device holds at
// once, looked up once per kernel and cluster size (2..8): whether a grid of clusters runs in one wave.
template <auto kKernel, int kThreads, int kBytes>
int resident_clusters(int cluster) {
  static int cached[9] = {};
  if (cluster < 2 || cluster > 8) return 0;
  if (cached[cluster] == 0) {
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(cluster);
    config.blockDim = dim3(kThreads);
    config.dynamicSmemBytes = kBytes;
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim = {unsigned(cluster), 1, 1};
    config.attrs = &attr;
    config.numAttrs = 1;
    int n = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&n, kKernel, &config));
    cached[cluster] = n > 0 ? n : -1;
  }
  return cached[cluster];
}

}  // namespace minfer
