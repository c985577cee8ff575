#include "vqad/dist/ulysses.h"

#include "vqad/core/error.h"

namespace vqad::dist {
namespace {

torch::Tensor s2h(const torch::Tensor& x, ProcessGroup& g, const std::string& what) {
  const int64_t P = g.size();
  VQAD_CHECK(x.dim() == 4, "ulysses ", what, ": expected [B, S/P, H, D], found ", x.sizes());
  const int64_t B = x.size(0), S = x.size(1), H = x.size(2), D = x.size(3);
  VQAD_CHECK(H % P == 0, "ulysses ", what, ": ", H, " heads are not divisible by sp_size ", P);
  if (P == 1) return x;
  auto in = x.reshape({B, S, P, H / P, D}).permute({2, 0, 1, 3, 4}).contiguous();  // [P dest, B, S, H/P, D]
  auto out = g.all_to_all(in, what + " seq->heads");                                // [P src, B, S, H/P, D]
  return out.permute({1, 0, 2, 3, 4}).reshape({B, P * S, H / P, D});
}

torch::Tensor h2s(const torch::Tensor& y, ProcessGroup& g, const std::string& what) {
  const int64_t P = g.size();
  VQAD_CHECK(y.dim() == 4, "ulysses ", what, ": expected [B, S, H/P, D], found ", y.sizes());
  const int64_t B = y.size(0), S = y.size(1), Hp = y.size(2), D = y.size(3);
  VQAD_CHECK(S % P == 0, "ulysses ", what, ": sequence ", S, " is not divisible by sp_size ", P,
             " (pad it at the shard point)");
  if (P == 1) return y;
  auto in = y.reshape({B, P, S / P, Hp, D}).permute({1, 0, 2, 3, 4}).contiguous();  // [P dest, B, S/P, H/P, D]
  auto out = g.all_to_all(in, what + " heads->seq");                                 // [P src, B, S/P, H/P, D]
  return out.permute({1, 2, 0, 3, 4}).reshape({B, S / P, P * Hp, D});
}

struct Exchange : torch::autograd::Function<Exchange> {
  // direction 0: seq -> heads, 1: heads -> seq. The group pointer outlives the graph (the
  // process's groups live as long as the trainer).
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, int64_t group,
                               int64_t direction, const std::string& what) {
    ctx->saved_data["group"] = group;
    ctx->saved_data["direction"] = direction;
    ctx->saved_data["what"] = what;
    auto& g = *reinterpret_cast<ProcessGroup*>(group);
    return direction == 0 ? s2h(x, g, what) : h2s(x, g, what);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto& g = *reinterpret_cast<ProcessGroup*>(ctx->saved_data["group"].toInt());
    const auto what = ctx->saved_data["what"].toStringRef() + " (backward)";
    auto gx = ctx->saved_data["direction"].toInt() == 0 ? h2s(grads[0], g, what) : s2h(grads[0], g, what);
    return {gx, torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

struct GatherSequence : torch::autograd::Function<GatherSequence> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, int64_t group,
                               const std::string& what) {
    auto& g = *reinterpret_cast<ProcessGroup*>(group);
    ctx->saved_data["rank"] = static_cast<int64_t>(g.rank());
    ctx->saved_data["local"] = x.size(1);
    // all_gather concatenates along dim 0: move the sequence there and back.
    auto full = g.all_gather(x.transpose(0, 1).contiguous(), what + " gather sequence");  // [P S/P, B, ...]
    return full.transpose(0, 1).contiguous();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const int64_t r = ctx->saved_data["rank"].toInt(), n = ctx->saved_data["local"].toInt();
    return {grads[0].narrow(1, r * n, n).contiguous(), torch::Tensor(), torch::Tensor()};
  }
};

thread_local ProcessGroup* t_sp_group = nullptr;

}  // namespace

SequenceParallelScope::SequenceParallelScope(ProcessGroup* group) : previous_(t_sp_group) {
  t_sp_group = group && group->size() > 1 ? group : nullptr;
}
SequenceParallelScope::~SequenceParallelScope() { t_sp_group = previous_; }
ProcessGroup* sequence_parallel_group() { return t_sp_group; }

torch::Tensor shard_sequence(const torch::Tensor& x, ProcessGroup& g, const std::string& what) {
  const int64_t P = g.size();
  VQAD_CHECK(x.dim() >= 2, "sequence parallel ", what, ": expected [B, S, ...], found ", x.sizes());
  const int64_t S = x.size(1);
  VQAD_CHECK(S % P == 0, "sequence parallel ", what, ": the sequence of ", S, " tokens is not divisible by sp_size ",
             P);
  if (P == 1) return x;
  return x.narrow(1, g.rank() * (S / P), S / P);
}

torch::Tensor gather_sequence(const torch::Tensor& x, ProcessGroup& g, const std::string& what) {
  VQAD_CHECK(x.dim() >= 2, "sequence parallel ", what, ": expected [B, S/P, ...], found ", x.sizes());
  if (g.size() == 1) return x;
  return GatherSequence::apply(x, reinterpret_cast<int64_t>(&g), what);
}

torch::Tensor seq_to_heads(const torch::Tensor& x, ProcessGroup& g, const std::string& what) {
  if (g.size() == 1) return x;
  return Exchange::apply(x, reinterpret_cast<int64_t>(&g), int64_t{0}, what);
}

torch::Tensor heads_to_seq(const torch::Tensor& x, ProcessGroup& g, const std::string& what) {
  if (g.size() == 1) return x;
  return Exchange::apply(x, reinterpret_cast<int64_t>(&g), int64_t{1}, what);
}

}  // namespace vqad::dist
