// The kernel boundary's cost on Hopper: a chain of L small kernels, each reading what the one before wrote,
// joined by (0) programmatic dependent launch and griddepcontrol.wait, (1) programmatic launch and a
// release / acquire counter that each CTA bumps once its stores are done (no griddepcontrol.wait), or (2)
// plain launches; each kernel first reads `reads` floats a thread from a 1 GiB buffer, independent of the
// chain (as a linear's weights). Prints the median microseconds a link over a CUDA graph of the chain.
//   nvcc -O3 -arch=sm_90a -std=c++17 -o /tmp/kernel_boundary perf/kernel_boundary.cu && /tmp/kernel_boundary
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                                        \
  do {                                                                               \
    cudaError_t e = (x);                                                             \
    if (e != cudaSuccess) {                                                          \
      printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e));               \
      exit(1);                                                                       \
    }                                                                                \
  } while (0)

__device__ __forceinline__ void gd_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void gd_launch() { asm volatile("griddepcontrol.launch_dependents;" :::); }
__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v; asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v; }
__device__ __forceinline__ void red_release(unsigned* p, unsigned v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory"); }

// A link: `reads` floats a thread from big before the wait, then one element of in, one of out.
template <int MODE>
__global__ void __launch_bounds__(256) link(const float* in, float* out, int n, unsigned* flags, int k,
                                            unsigned expect, int reads, const float* big, long big_n) {
  if (MODE != 2) gd_launch();
  // pre-wait work (stands for a weight prefetch): independent of the previous kernel
  float pre = 0.f;
  const long tid = long(blockIdx.x) * blockDim.x + threadIdx.x, nth = long(gridDim.x) * blockDim.x;
  for (int r = 0; r < reads; ++r) { long j = (tid + r * nth + long(k) * 7919) % big_n; pre += __ldg(big + j); }
  if (MODE == 0) gd_wait();
  if (MODE == 1) {
    if (k > 0 && threadIdx.x == 0) { while (ld_acquire(flags + k - 1) < expect) __nanosleep(20); }
    __syncthreads();
  }
  if (tid < n) out[tid] = in[(tid * 17) % n] * 0.5f + pre * 1e-30f + 1.f;
  if (MODE == 1) {
    __syncthreads();
    if (threadIdx.x == 0) { __threadfence(); red_release(flags + k, 1u); }
  }
}

template <int MODE>
float run(int L, int G, int reads, float* a, float* b, unsigned* flags, const float* big, long big_n, cudaStream_t s) {
  cudaGraph_t g; cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  if (MODE == 1) CK(cudaMemsetAsync(flags, 0, sizeof(unsigned) * L, s));
  for (int k = 0; k < L; ++k) {
    cudaLaunchConfig_t cfg = {}; cudaLaunchAttribute at[1];
    cfg.gridDim = G; cfg.blockDim = 256; cfg.stream = s;
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization; at[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = at; cfg.numAttrs = MODE == 2 ? 0 : 1;
    const float* in = k % 2 ? b : a; float* out = k % 2 ? a : b;
    CK(cudaLaunchKernelEx(&cfg, link<MODE>, in, out, G * 256, flags, k, unsigned(G), reads, big, big_n));
  }
  CK(cudaStreamEndCapture(s, &g));
  CK(cudaGraphInstantiate(&ge, g, 0));
  for (int i = 0; i < 3; ++i) CK(cudaGraphLaunch(ge, s));
  cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  std::vector<float> ts;
  for (int rep = 0; rep < 7; ++rep) {
    CK(cudaEventRecord(e0, s)); CK(cudaGraphLaunch(ge, s)); CK(cudaEventRecord(e1, s)); CK(cudaEventSynchronize(e1));
    float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); ts.push_back(ms);
  }
  std::sort(ts.begin(), ts.end());
  CK(cudaGraphExecDestroy(ge)); CK(cudaGraphDestroy(g));
  return ts[ts.size() / 2] * 1000.f / L;  // us per link
}

int main() {
  const int L = 512; const long big_n = 1L << 28;  // 1 GiB of floats to read from
  float *a, *b, *big; unsigned* flags; cudaStream_t s;
  CK(cudaMalloc(&a, 4 << 20)); CK(cudaMalloc(&b, 4 << 20));
  CK(cudaMalloc(&big, big_n * 4)); CK(cudaMalloc(&flags, 4 * L));
  CK(cudaMemset(a, 0, 4 << 20)); CK(cudaMemset(b, 0, 4 << 20)); CK(cudaMemset(big, 0, big_n * 4));
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  printf("%6s %6s %12s %12s %12s\n", "CTAs", "reads", "pdl+wait", "pdl+flag", "plain");
  for (int G : {1, 16, 132, 264}) for (int reads : {0, 4, 32}) {
    float t0 = run<0>(L, G, reads, a, b, flags, big, big_n, s);
    float t1 = run<1>(L, G, reads, a, b, flags, big, big_n, s);
    float t2 = run<2>(L, G, reads, a, b, flags, big, big_n, s);
    float t0b = run<0>(L, G, reads, a, b, flags, big, big_n, s);
    float t1b = run<1>(L, G, reads, a, b, flags, big, big_n, s);
    printf("%6d %6d %6.3f/%5.3f %6.3f/%5.3f %12.3f   us a link\n", G, reads, t0, t0b, t1, t1b, t2);
  }
  return 0;
}
