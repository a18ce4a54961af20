// Rotary position embedding, in place on q and k (both may be strided views into a fused qkv tensor).
//   is_neox:  pairs (i, i + rot/2)  (rotate-half);   else pairs (2i, 2i + 1)  (GPT-J, interleaved)
//   (x1, x2) <- (x1 cos - x2 sin, x2 cos + x1 sin), cos/sin = cos_sin[pos, i] / cos_sin[pos, rot/2 + i], fp32.
// Only the first rot dims of each head rotate (partial rotary); the rest are not touched.
//
// One block per token: the token's cos|sin row is staged once in shared memory, then the threads walk
// (head, pack) items over q's and k's heads. A NeoX item is two packs of W elements (first and second
// half); a GPT-J item is one pack of W elements = W/2 pairs. W = 16 bytes when the layout allows it.
// A position outside [0, max_position) never reads the table: its rotated dims become NaN.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "common/checks.h"
#include "common/dispatch.h"
#include "common/vec.h"

namespace minfer {

namespace {

// q and k are not __restrict__: they are usually views of the same qkv buffer (disjoint elements).
template <typename T, int W, bool kNeox, typename index_t>
__global__ void rope_kernel(T* q, int64_t q_stride,                 // [tokens, heads, head_dim], token stride
                            T* k, int64_t k_stride,                 // [tokens, kv_heads, head_dim]
                            const index_t* __restrict__ positions,  // [tokens]
                            const float* __restrict__ cos_sin,      // [max_position, rot]
                            int64_t max_position, int heads, int kv_heads, int head_dim, int rot) {
  extern __shared__ float cs[];  // [rot]: cos | sin at this token's position
  const int64_t token = blockIdx.x;
  const int64_t pos = static_cast<int64_t>(positions[token]);
  const bool ok = pos >= 0 && pos < max_position;
  for (int i = threadIdx.x; i < rot; i += blockDim.x) cs[i] = ok ? cos_sin[pos * rot + i] : nan_f();
  __syncthreads();

  using P = Pack<T, W>;
  const int half = rot / 2;
  const int per_head = (kNeox ? half : rot) / W;
  const int items = (heads + kv_heads) * per_head;
  for (int it = threadIdx.x; it < items; it += blockDim.x) {
    const int h = it / per_head, p = it - h * per_head;
    T* head = h < heads ? q + token * q_stride + static_cast<int64_t>(h) * head_dim
                        : k + token * k_stride + static_cast<int64_t>(h - heads) * head_dim;
    if constexpr (kNeox) {
      P a, b;
      a.load(head + p * W);
      b.load(head + half + p * W);
#pragma unroll
      for (int e = 0; e < W; ++e) {
        const float c = cs[p * W + e], s = cs[half + p * W + e];
        const float x1 = to_float(a.v[e]), x2 = to_float(b.v[e]);
        a.v[e] = from_float<T>(x1 * c - x2 * s);
        b.v[e] = from_float<T>(x2 * c + x1 * s);
      }
      a.store(head + p * W);
      b.store(head + half + p * W);
    } else {
      P a;
      a.load(head + p * W);
#pragma unroll
      for (int e = 0; e < W / 2; ++e) {
        const int i = p * (W / 2) + e;
        const float c = cs[i], s = cs[half + i];
        const float x1 = to_float(a.v[2 * e]), x2 = to_float(a.v[2 * e + 1]);
        a.v[2 * e] = from_float<T>(x1 * c - x2 * s);
        a.v[2 * e + 1] = from_float<T>(x2 * c + x1 * s);
      }
      a.store(head + p * W);
    }
  }
}

template <typename T, int W, bool kNeox, typename index_t>
void launch_rope(T* q, int64_t q_stride, T* k, int64_t k_stride, const index_t* positions, const float* cos_sin,
                 int64_t max_position, int64_t tokens, int heads, int kv_heads, int head_dim, int rot,
                 cudaStream_t stream) {
  const int items = (heads + kv_heads) * ((kNeox ? rot / 2 : rot) / W);
  const int threads = std::min(256, round_up(items, 32));
  rope_kernel<T, W, kNeox, index_t><<<tokens, threads, rot * sizeof(float), stream>>>(
      q, q_stride, k, k_stride, positions, cos_sin, max_position, heads, kv_heads, head_dim, rot);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void check_heads(const torch::Tensor& t, const char* name) {
  MINFER_CHECK(t.dim() == 3, "rope: ", name, " must be [tokens, heads, head_dim], got shape ", t.sizes());
  MINFER_CHECK(t.stride(2) == 1, "rope: ", name, " must have a contiguous head_dim (stride(2) == 1), got stride ",
              t.stride(2));
  MINFER_CHECK(t.size(1) <= 1 || t.stride(1) == t.size(2), "rope: ", name,
              " must have its heads packed (stride(1) == head_dim); only the token stride may be arbitrary, got "
              "strides ", t.strides());
}

}  // namespace

void rope(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& positions,
          const torch::Tensor& cos_sin, bool is_neox) {
  MINFER_CHECK_CUDA(q);
  MINFER_CHECK_CUDA(k);
  MINFER_CHECK_CUDA(positions);
  MINFER_CHECK_CUDA(cos_sin);
  MINFER_CHECK_SAME_DEVICE(q, k);
  MINFER_CHECK_SAME_DEVICE(q, positions);
  MINFER_CHECK_SAME_DEVICE(q, cos_sin);
  MINFER_CHECK_FLOAT(q);
  MINFER_CHECK_SAME_DTYPE(q, k);
  check_heads(q, "q");
  check_heads(k, "k");
  const int64_t tokens = q.size(0), head_dim = q.size(2);
  MINFER_CHECK(k.size(0) == tokens && k.size(2) == head_dim, "rope: k must be [tokens, kv_heads, head_dim] = [",
              tokens, ", *, ", head_dim, "] like q, got shape ", k.sizes());
  MINFER_CHECK(positions.dim() == 1 && positions.size(0) == tokens, "rope: positions must be [tokens] = [", tokens,
              "], got shape ", positions.sizes());
  MINFER_CHECK_CONTIGUOUS(positions);
  MINFER_CHECK_INDEX(positions);
  MINFER_CHECK(cos_sin.scalar_type() == at::kFloat, "rope: cos_sin must be float32, got ", cos_sin.scalar_type());
  MINFER_CHECK(cos_sin.dim() == 2, "rope: cos_sin must be [max_position, rotary_dim], got shape ", cos_sin.sizes());
  MINFER_CHECK_CONTIGUOUS(cos_sin);
  const int64_t rot = cos_sin.size(1), max_position = cos_sin.size(0);
  MINFER_CHECK(rot >= 2 && rot % 2 == 0 && rot <= head_dim, "rope: rotary_dim (cos_sin.size(1)) must be even and in [2, ",
              "head_dim = ", head_dim, "], got ", rot);
  MINFER_CHECK(head_dim <= 4096, "rope: head_dim must be at most 4096, got ", head_dim);
  MINFER_CHECK(tokens < (int64_t(1) << 31), "rope: too many tokens (", tokens, ")");
  const int64_t heads = q.size(1), kv_heads = k.size(1);
  if (tokens == 0 || heads + kv_heads == 0) return;
  MINFER_CHECK(heads + kv_heads <= (1 << 16), "rope: too many heads (", heads, " + ", kv_heads, ")");
  const c10::cuda::CUDAGuard guard(q.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  MINFER_DISPATCH_FLOAT(q.scalar_type(), "rope", [&] {
    MINFER_DISPATCH_INDEX(positions.scalar_type(), "rope", [&] {
      constexpr int N = 16 / sizeof(scalar_t);
      auto* qp = reinterpret_cast<scalar_t*>(q.data_ptr());
      auto* kp = reinterpret_cast<scalar_t*>(k.data_ptr());
      const auto* pos = positions.data_ptr<index_t>();
      const auto* cs = cos_sin.data_ptr<float>();
      // 16-byte packs need every pack start aligned: base pointers, token strides, head_dim, and the
      // rotated span ((rot/2) for NeoX's second half, rot for GPT-J) a multiple of the pack.
      const bool wide = rows_aligned16(qp, head_dim, q.stride(0), sizeof(scalar_t)) &&
                        rows_aligned16(kp, head_dim, k.stride(0), sizeof(scalar_t)) &&
                        (is_neox ? (rot / 2) % N == 0 : rot % N == 0);
      const int h = static_cast<int>(heads), kvh = static_cast<int>(kv_heads);
      const int hd = static_cast<int>(head_dim), r = static_cast<int>(rot);
      if (is_neox) {
        if (wide)
          launch_rope<scalar_t, N, true, index_t>(qp, q.stride(0), kp, k.stride(0), pos, cs, max_position, tokens, h,
                                                  kvh, hd, r, stream);
        else
          launch_rope<scalar_t, 1, true, index_t>(qp, q.stride(0), kp, k.stride(0), pos, cs, max_position, tokens, h,
                                                  kvh, hd, r, stream);
      } else {
        if (wide)
          launch_rope<scalar_t, N, false, index_t>(qp, q.stride(0), kp, k.stride(0), pos, cs, max_position, tokens,
                                                   h, kvh, hd, r, stream);
        else
          launch_rope<scalar_t, 2, false, index_t>(qp, q.stride(0), kp, k.stride(0), pos, cs, max_position, tokens,
                                                   h, kvh, hd, r, stream);
      }
    });
  });
}

}  // namespace minfer
