// attention_decode_plan's answer: what flash_decode would launch (decode_plan.h), launching nothing.
#include <string>

#include "attention/attention.h"
#include "attention/decode_plan.h"
#include "common/dispatch.h"
#include "common/launch.h"

namespace minfer::attn {

std::string flash_decode_plan(const at::Tensor& q, const at::Tensor& k_cache, int length, int window) {
  if (q.size(0) == 0 || q.size(2) == 0) return "none (empty output)";
  decode::DecodeParams p = decode::shape_params(q.size(2), k_cache.size(2), k_cache.size(1));
  p.window = window;
  const int64_t pairs = q.size(0) * k_cache.size(2) * p.hblocks;  // (batch, kv block) pairs
  return MINFER_DISPATCH_HALF(q.scalar_type(), "attention_decode_plan", [&] {
    return MINFER_DISPATCH_HEAD_DIM(q.size(3), D, [&] {
      const int device = q.get_device();
      const decode::Launch l = decode::plan_launch<D>(p, pairs, sm_count(device), thin_dram(device));
      return decode::describe<scalar_t, D>(p, l, pairs, length);
    });
  });
}

}  // namespace minfer::attn
