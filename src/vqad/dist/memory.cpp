#include "vqad/dist/memory.h"

#include <algorithm>
#include <cstdio>

#include "vqad/core/error.h"

namespace vqad::dist {
namespace {
constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

std::string gib(double v) {
  char b[32];
  std::snprintf(b, sizeof(b), "%.2f GiB", v);
  return b;
}
}  // namespace

int64_t wan_block_parameter_count(const model::WanConfig& c) {
  const int64_t d = c.dim(), f = c.ffn_dim;
  const int64_t attn = 4 * (d * d + d) + 2 * d;  // q, k, v, out (+ bias), RMS norms of q and k
  int64_t n = 2 * attn + 2 * d /*norm2*/ + (d * f + f + f * d + d) /*ffn*/ + 6 * d /*scale_shift_table*/;
  if (c.gate_compress) n += d * d + d;
  return n;
}

int64_t wan_parameter_count(const model::WanConfig& c) {
  const int64_t d = c.dim(), pv = c.patch_volume();
  const int64_t patch = d * c.in_channels * pv + d;
  const int64_t time = (c.freq_dim * d + d) + (d * d + d) + (d * 6 * d + 6 * d);
  const int64_t text = (c.text_dim * d + d) + (d * d + d);
  const int64_t head = d * c.out_channels * pv + c.out_channels * pv + 2 * d;
  return patch + time + text + head + c.num_layers * wan_block_parameter_count(c);
}

MemoryEstimate estimate_memory(const std::vector<RoleFootprint>& roles, const MemoryMesh& m) {
  VQAD_CHECK(m.shard >= 1 && m.sp >= 1 && m.replicate >= 1 && m.batch >= 1, "memory estimate: invalid mesh");
  MemoryEstimate e;
  double gathered = 0;  // bytes, the largest role's
  double unreduced = 0;  // bytes, every sharded trainable role's full gradients
  std::string parts;
  for (const auto& r : roles) {
    const double n = static_cast<double>(wan_parameter_count(r.model));
    const bool sharded = m.shard > 1 && (r.trainable || m.shard_frozen);
    const double s = n * (r.trainable ? 16.0 : 4.0) / static_cast<double>(sharded ? m.shard : 1) / kGiB;
    e.states_gib += s;
    parts += (parts.empty() ? "" : ", ") + r.name + " " + gib(s) + (m.shard > 1 && !sharded ? " replicated" : "");
    if (sharded) {
      const double block = static_cast<double>(wan_block_parameter_count(r.model));
      const double unit = block * static_cast<double>(std::min(m.blocks_per_unit, r.model.num_layers));
      const double root = n - block * static_cast<double>(r.model.num_layers);
      // The unit computing and the next one being prefetched.
      const double params = m.reshard_after_forward ? root + 2.0 * unit : n;
      gathered = std::max(gathered, 4.0 * params + (r.trainable ? 8.0 * unit : 0.0));
      if (r.trainable && m.unreduced_accumulation) unreduced += 4.0 * n;
    }
    if (!r.trainable) continue;
    const double tokens = static_cast<double>(m.batch) * static_cast<double>(m.tokens_per_sample) /
                          static_cast<double>(m.sp);
    const double d = static_cast<double>(r.model.dim()), f = static_cast<double>(r.model.ffn_dim);
    const double working = tokens * (14.0 * d + 2.0 * f) * 2.0;
    const double saved_inputs = tokens * d * 4.0 * static_cast<double>(r.model.num_layers);
    e.activations_gib += (m.activation_checkpointing ? saved_inputs + working
                                                     : working * static_cast<double>(r.model.num_layers)) / kGiB;
  }
  e.gathered_gib = (gathered + unreduced) / kGiB;
  e.text = "states (fp32 masters + grads + AdamW moments of trainable roles, fp32 weights of frozen ones, / shard " +
           std::to_string(m.shard) + (m.shard > 1 && !m.shard_frozen ? " for the trainable ones" : "") + "): " + gib(e.states_gib) + " (" + parts + ")\n" +
           "gathered buffers (fp32 params of the root and " +
           (m.reshard_after_forward ? "two units of " + std::to_string(m.blocks_per_unit) + " block(s)"
                                    : std::string("every block")) +
           ", fp32 grads + reduce buffer of one unit" +
           (unreduced > 0 ? ", full fp32 grads held over the micro-steps " + gib(unreduced / kGiB) : std::string()) +
           "): " + gib(e.gathered_gib) + "\n" +
           "activations (batch " + std::to_string(m.batch) + " x " + std::to_string(m.tokens_per_sample) +
           " tokens / sp " + std::to_string(m.sp) + ", checkpointing " +
           (m.activation_checkpointing ? "per block" : "off") + "): " + gib(e.activations_gib) + "\n" +
           "total per GPU: " + gib(e.total_gib()) + " (not included: CUDA context, allocator slack, text encoder)";
  return e;
}

}  // namespace vqad::dist
