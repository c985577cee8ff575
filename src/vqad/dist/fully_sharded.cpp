#include "vqad/dist/fully_sharded.h"

#include <c10/core/StorageImpl.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <sstream>

#include "vqad/core/error.h"

namespace vqad::dist {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr int64_t kBucketElements = int64_t(16) << 20;  // fp32 elements per replicate all-reduce

// What an autograd hook node carries: the model and the unit it reports to.
struct HookRef : torch::CustomClassHolder {
  FullyShardedModel* owner = nullptr;
  size_t unit = 0;
};

HookRef* ref_of(AutogradContext* ctx) { return static_cast<HookRef*>(ctx->saved_data["ref"].toCapsule().get()); }

// Identity in forward; its backward calls `Hook` on the unit, then passes the gradient on.
// On a unit's output (PreBackwardGather): runs before any of the unit's backward, and gathers
// the unit. On a unit's input (PostBackwardReduce): runs once the unit's backward is complete
// (the input's gradient needs every node of the unit; the parameters' gradient accumulation
// runs first, the engine gives it priority), and reduces and releases the unit.
template <void (FullyShardedModel::*Hook)(size_t)>
class UnitHook : public torch::autograd::Function<UnitHook<Hook>> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, c10::intrusive_ptr<HookRef> ref, torch::Tensor x) {
    ctx->saved_data["ref"] = c10::IValue::make_capsule(std::move(ref));
    return x;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto* r = ref_of(ctx);
    if (r->owner) (r->owner->*Hook)(r->unit);
    return {torch::Tensor(), grads[0]};
  }
};
using PreBackwardGather = UnitHook<&FullyShardedModel::pre_backward>;
using PostBackwardReduce = UnitHook<&FullyShardedModel::post_backward>;

// The module parameter's memory: released between uses (shape and autograd identity stay).
void release_storage(const torch::Tensor& p) {
  c10::StorageImpl* s = p.storage().unsafeGetStorageImpl();
  s->set_data_ptr_noswap(c10::DataPtr(nullptr, p.device()));
  s->set_nbytes(0);
}

void allocate_storage(const torch::Tensor& p, const std::string& name) {
  c10::StorageImpl* s = p.storage().unsafeGetStorageImpl();
  const size_t nbytes = static_cast<size_t>(p.numel()) * p.element_size();
  VQAD_CHECK(s->allocator() != nullptr, "sharded data parallel: parameter ", name, " has no allocator");
  s->set_data_ptr_noswap(s->allocator()->allocate(nbytes));
  s->set_nbytes(nbytes);
}

}  // namespace

struct FullyShardedModel::Unit {
  struct Entry {
    std::string name;
    torch::Tensor param;  // the module parameter (memory only while the unit is gathered)
    torch::Tensor shard;  // this rank's [chunk] fp32 elements of the flattened, padded parameter
    int64_t numel = 0, chunk = 0, offset = 0;  // offset: in the unit's row of sum(chunk) elements
    bool trainable = false;
  };
  std::string name;
  std::vector<Entry> entries;
  int64_t row = 0;
  bool gathered = false;
  int pending = 0;  // recorded forwards whose backward has not reached the post-backward hook
  c10::intrusive_ptr<HookRef> ref;
};

namespace {
int64_t group_size(const ShardingOptions& o) { return o.shard->size(); }

// This rank's slice of a full tensor laid out like `e`'s parameter.
torch::Tensor slice_of(const FullyShardedModel::Unit::Entry& e, const torch::Tensor& full, int rank, int64_t S) {
  auto flat = full.detach().reshape({-1}).to(torch::kFloat32);
  if (S * e.chunk > e.numel) flat = torch::constant_pad_nd(flat, {0, S * e.chunk - e.numel});
  return flat.narrow(0, rank * e.chunk, e.chunk).clone();
}
}  // namespace

FullyShardedModel::FullyShardedModel(std::string what, std::vector<ShardUnitSpec> units, ShardingOptions options)
    : what_(std::move(what)), options_(options) {
  VQAD_CHECK(options_.shard != nullptr, "sharded data parallel (", what_, "): no shard group");
  VQAD_CHECK(options_.dp_size >= 1, "sharded data parallel (", what_, "): data-parallel degree ", options_.dp_size);
  const int64_t S = group_size(options_);
  const int rank = options_.shard->rank();
  torch::NoGradGuard ng;
  for (auto& spec : units) {
    auto u = std::make_unique<Unit>();
    u->name = spec.name;
    u->ref = c10::make_intrusive<HookRef>();
    u->ref->owner = this;
    u->ref->unit = units_.size();
    for (auto& [name, p] : spec.params) {
      VQAD_CHECK(p.defined() && p.scalar_type() == torch::kFloat32, "sharded data parallel (", what_, "): parameter ",
                 name, " must be fp32 (the master weights), found ",
                 p.defined() ? std::string(c10::toString(p.scalar_type())) : std::string("undefined"));
      Unit::Entry e;
      e.name = name;
      e.numel = p.numel();
      e.chunk = (e.numel + S - 1) / S;
      e.offset = u->row;
      u->row += e.chunk;
      e.trainable = p.requires_grad();
      // Its own contiguous storage (nothing else may share what gets released).
      p.set_data(p.detach().clone(at::MemoryFormat::Contiguous));
      e.shard = slice_of(e, p, rank, S);
      if (e.trainable) e.shard.requires_grad_(true);
      e.param = p;
      u->entries.push_back(std::move(e));
    }
    u->gathered = true;
    release_unit(*u);
    units_.push_back(std::move(u));
  }
}

FullyShardedModel::~FullyShardedModel() {
  // Nodes of a graph that outlives the model must not call back into it.
  for (auto& u : units_) u->ref->owner = nullptr;
}

size_t FullyShardedModel::num_units() const { return units_.size(); }

namespace {
torch::Tensor unit_send_buffer(const FullyShardedModel::Unit& u) {
  std::vector<torch::Tensor> parts;
  parts.reserve(u.entries.size());
  for (const auto& e : u.entries) parts.push_back(e.shard.detach());
  return torch::cat(parts);
}
}  // namespace

void FullyShardedModel::fill_unit(Unit& u, const torch::Tensor& gathered) {
  auto all = gathered.view({group_size(options_), u.row});
  for (auto& e : u.entries) {
    allocate_storage(e.param, e.name);
    // Written through an alias of the storage with its own version counter: the parameter's
    // version stays what autograd saved in forward (a gather for the backward restores the
    // same values).
    auto dst = torch::from_blob(e.param.storage().mutable_data(), {e.numel}, e.param.options().requires_grad(false));
    dst.copy_(all.narrow(1, e.offset, e.chunk).reshape({-1}).narrow(0, 0, e.numel));
  }
  u.gathered = true;
}

void FullyShardedModel::gather_unit(Unit& u) {
  if (u.gathered) return;
  if (prefetch_.active()) {
    const bool mine = units_[prefetch_unit_].get() == &u;
    complete_prefetch();
    if (mine) return;
  }
  torch::NoGradGuard ng;
  if (u.entries.empty()) {
    u.gathered = true;
    return;
  }
  fill_unit(u, options_.shard->all_gather(unit_send_buffer(u), "gather " + what_ + " " + u.name));
}

void FullyShardedModel::prefetch(size_t unit) {
  if (unit >= units_.size() || prefetch_.active()) return;
  Unit& u = *units_[unit];
  if (u.gathered || u.entries.empty()) return;
  torch::NoGradGuard ng;
  prefetch_ = options_.shard->all_gather_async(unit_send_buffer(u), "prefetch " + what_ + " " + u.name);
  prefetch_unit_ = unit;
}

void FullyShardedModel::complete_prefetch() {
  if (!prefetch_.active()) return;
  torch::NoGradGuard ng;
  auto gathered = prefetch_.wait();
  Unit& u = *units_[prefetch_unit_];
  if (!u.gathered) fill_unit(u, gathered);
}

void FullyShardedModel::release_unit(Unit& u) {
  if (!u.gathered) return;
  for (auto& e : u.entries) release_storage(e.param);
  u.gathered = false;
}

void FullyShardedModel::reduce_unit_grads(Unit& u) {
  torch::NoGradGuard ng;
  std::vector<Unit::Entry*> with;
  for (auto& e : u.entries)
    if (e.trainable && e.param.grad().defined()) with.push_back(&e);
  if (with.empty()) return;
  const int64_t S = group_size(options_);
  auto buf = torch::zeros({S, u.row}, torch::TensorOptions().dtype(torch::kFloat32).device(with[0]->param.device()));
  for (auto* e : with) {
    auto g = e->param.grad().detach().reshape({-1}).to(torch::kFloat32);
    if (S * e->chunk > e->numel) g = torch::constant_pad_nd(g, {0, S * e->chunk - e->numel});
    buf.narrow(1, e->offset, e->chunk).copy_(g.view({S, e->chunk}));
  }
  auto mine = options_.shard->reduce_scatter(buf.view({-1}), ReduceOp::kSum, "grads " + what_ + " " + u.name);
  for (auto* e : with) {
    auto piece = mine.narrow(0, e->offset, e->chunk);
    if (e->shard.grad().defined())
      e->shard.mutable_grad().add_(piece);
    else
      e->shard.mutable_grad() = piece.clone();
    e->param.mutable_grad() = torch::Tensor();
  }
}

void FullyShardedModel::gather(size_t unit) {
  VQAD_CHECK(unit < units_.size(), "sharded data parallel (", what_, "): unit ", unit, " of ", units_.size());
  if (!hooks_idle_) gather_unit(*units_[unit]);
}

torch::Tensor FullyShardedModel::enter_block(size_t unit, bool first, torch::Tensor hidden) {
  VQAD_CHECK(unit < units_.size(), "sharded data parallel (", what_, "): unit ", unit, " of ", units_.size());
  if (hooks_idle_) return hidden;
  Unit& u = *units_[unit];
  gather_unit(u);
  if (first) prefetch(unit + 1);  // the next unit's gather runs while this one computes
  if (first && torch::GradMode::is_enabled() && hidden.requires_grad())
    hidden = PostBackwardReduce::apply(u.ref, hidden);
  return hidden;
}

torch::Tensor FullyShardedModel::leave_block(size_t unit, bool last, torch::Tensor out) {
  VQAD_CHECK(unit < units_.size(), "sharded data parallel (", what_, "): unit ", unit, " of ", units_.size());
  if (hooks_idle_ || !last) return out;
  Unit& u = *units_[unit];
  const bool graph = torch::GradMode::is_enabled() && out.requires_grad();
  if (graph) {
    ++u.pending;
    out = PreBackwardGather::apply(u.ref, out);
  }
  if (!graph || options_.reshard_after_forward) release_unit(u);
  return out;
}

void FullyShardedModel::pre_backward(size_t unit) {
  if (hooks_idle_) return;
  gather_unit(*units_.at(unit));
  if (unit > 1) prefetch(unit - 1);  // the backward reaches the unit before this one next (not the root)
}

void FullyShardedModel::post_backward(size_t unit) {
  if (hooks_idle_) return;
  Unit& u = *units_.at(unit);
  u.pending = std::max(0, u.pending - 1);
  if (u.pending > 0) return;  // another forward's backward still needs the unit
  reduce_unit_grads(u);
  release_unit(u);
}

void FullyShardedModel::finish_backward() {
  VQAD_CHECK(!hooks_idle_, "sharded data parallel (", what_, "): finish_backward inside gather_all");
  complete_prefetch();
  for (auto& u : units_) {
    reduce_unit_grads(*u);
    release_unit(*u);
    u->pending = 0;
  }
}

void FullyShardedModel::finish_step() {
  torch::NoGradGuard ng;
  std::vector<torch::Tensor> grads;
  for (auto& u : units_)
    for (auto& e : u->entries)
      if (e.trainable && e.shard.grad().defined()) grads.push_back(e.shard.grad());
  // One all-reduce SUM per bucket over the replicate group, then the division by the
  // data-parallel degree (the shard group's reduce-scatter summed its part already).
  size_t i = 0;
  int bucket = 0;
  while (i < grads.size()) {
    size_t j = i;
    int64_t n = 0;
    while (j < grads.size() && (j == i || n + grads[j].numel() <= kBucketElements)) n += grads[j++].numel();
    if (options_.replicate && options_.replicate->size() > 1) {
      std::vector<torch::Tensor> flat(grads.begin() + static_cast<long>(i), grads.begin() + static_cast<long>(j));
      auto buf = torch::cat(flat);
      options_.replicate->all_reduce(buf, ReduceOp::kSum, "grads " + what_ + " bucket " + std::to_string(bucket++));
      int64_t off = 0;
      for (size_t k = i; k < j; ++k) {
        grads[k].copy_(buf.narrow(0, off, grads[k].numel()));
        off += grads[k].numel();
      }
    }
    for (size_t k = i; k < j; ++k) grads[k].div_(static_cast<double>(options_.dp_size));
    i = j;
  }
}

std::vector<torch::Tensor> FullyShardedModel::trainable_shards(std::vector<std::string>* names) const {
  std::vector<torch::Tensor> out;
  for (const auto& u : units_)
    for (const auto& e : u->entries)
      if (e.trainable) {
        out.push_back(e.shard);
        if (names) names->push_back(e.name);
      }
  return out;
}

double FullyShardedModel::grad_norm() {
  torch::NoGradGuard ng;
  double local = 0;
  for (const auto& u : units_)
    for (const auto& e : u->entries)
      if (e.trainable && e.shard.grad().defined()) {
        const double n = e.shard.grad().detach().to(torch::kFloat64).norm().item<double>();
        local += n * n;
      }
  auto t = torch::full({1}, local, torch::TensorOptions().dtype(torch::kFloat64).device(options_.shard->device()));
  options_.shard->all_reduce(t, ReduceOp::kSum, "grad norm " + what_);
  return std::sqrt(t.cpu().item<double>());
}

double FullyShardedModel::clip_grad_norm(double max_norm) {
  const double norm = grad_norm();
  const double coef = std::min(1.0, max_norm / (norm + 1e-6));
  torch::NoGradGuard ng;
  for (auto& u : units_)
    for (auto& e : u->entries)
      if (e.trainable && e.shard.grad().defined()) e.shard.mutable_grad().mul_(coef);
  return norm;
}

std::vector<std::string> FullyShardedModel::nonfinite_parameters(bool gradients) {
  torch::NoGradGuard ng;
  std::vector<std::string> local;
  for (const auto& u : units_)
    for (const auto& e : u->entries) {
      if (!e.trainable) continue;
      const torch::Tensor t = gradients ? e.shard.grad() : e.shard;
      if (t.defined() && !torch::isfinite(t).all().item<bool>()) local.push_back(e.name);
    }
  auto n = torch::full({1}, static_cast<double>(local.size()),
                       torch::TensorOptions().dtype(torch::kFloat64).device(options_.shard->device()));
  options_.shard->all_reduce(n, ReduceOp::kSum, std::string("non-finite ") + (gradients ? "grads " : "weights ") + what_);
  if (n.cpu().item<double>() == 0) return {};
  std::ostringstream joined;
  for (const auto& s : local) joined << s << "\n";
  std::set<std::string> seen;
  std::vector<std::string> out;
  for (const auto& part : options_.shard->all_gather_string(joined.str(), "non-finite names " + what_)) {
    std::istringstream lines(part);
    for (std::string l; std::getline(lines, l);)
      if (!l.empty() && seen.insert(l).second) out.push_back(l);
  }
  return out;
}

void FullyShardedModel::gather_all() {
  VQAD_CHECK(!hooks_idle_, "sharded data parallel (", what_, "): gather_all twice");
  complete_prefetch();
  for (auto& u : units_) gather_unit(*u);
  hooks_idle_ = true;
}

void FullyShardedModel::release_all() {
  hooks_idle_ = false;
  complete_prefetch();
  for (auto& u : units_) {
    release_unit(*u);
    u->pending = 0;
  }
}

bool FullyShardedModel::all_gathered() const { return hooks_idle_; }

void FullyShardedModel::full_adamw_state(const torch::optim::AdamW& shard_state, torch::optim::AdamW& full) {
  torch::NoGradGuard ng;
  for (const auto& u : units_)
    for (const auto& e : u->entries) {
      if (!e.trainable) continue;
      auto it = shard_state.state().find(e.shard.unsafeGetTensorImpl());
      if (it == shard_state.state().end()) continue;  // never updated (alike on every rank)
      const auto& st = static_cast<const torch::optim::AdamWParamState&>(*it->second);
      auto whole = [&](const torch::Tensor& piece, const char* m) {
        auto all = options_.shard->all_gather(piece.detach().contiguous(), "adamw " + what_ + " " + e.name + m);
        return all.narrow(0, 0, e.numel).view(e.param.sizes()).clone();
      };
      auto s = std::make_unique<torch::optim::AdamWParamState>();
      s->step(st.step());
      s->exp_avg(whole(st.exp_avg(), ".exp_avg"));
      s->exp_avg_sq(whole(st.exp_avg_sq(), ".exp_avg_sq"));
      if (st.max_exp_avg_sq().defined()) s->max_exp_avg_sq(whole(st.max_exp_avg_sq(), ".max_exp_avg_sq"));
      full.state()[e.param.unsafeGetTensorImpl()] = std::move(s);
    }
}

std::vector<std::pair<std::string, torch::Tensor>> FullyShardedModel::gather_gradients() {
  torch::NoGradGuard ng;
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& u : units_)
    for (const auto& e : u->entries) {
      if (!e.trainable) continue;
      auto piece = e.shard.grad().defined() ? e.shard.grad().detach() : torch::zeros_like(e.shard.detach());
      auto all = options_.shard->all_gather(piece.contiguous(), "gather grad " + what_ + " " + e.name);
      out.emplace_back(e.name, all.narrow(0, 0, e.numel).view(e.param.sizes()).clone());
    }
  return out;
}

void FullyShardedModel::shard_adamw_state(const torch::optim::AdamW& full, torch::optim::AdamW& shards) const {
  torch::NoGradGuard ng;
  const int64_t S = group_size(options_);
  const int rank = options_.shard->rank();
  for (const auto& u : units_)
    for (const auto& e : u->entries) {
      if (!e.trainable) continue;
      auto it = full.state().find(e.param.unsafeGetTensorImpl());
      if (it == full.state().end()) continue;
      const auto& st = static_cast<const torch::optim::AdamWParamState&>(*it->second);
      auto s = std::make_unique<torch::optim::AdamWParamState>();
      s->step(st.step());
      s->exp_avg(slice_of(e, st.exp_avg(), rank, S));
      s->exp_avg_sq(slice_of(e, st.exp_avg_sq(), rank, S));
      if (st.max_exp_avg_sq().defined()) s->max_exp_avg_sq(slice_of(e, st.max_exp_avg_sq(), rank, S));
      shards.state()[e.shard.unsafeGetTensorImpl()] = std::move(s);
    }
}

}  // namespace vqad::dist
