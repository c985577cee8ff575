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
    // Gathered as BF16 under gather_bf16 (ShardParam::read_as_bf16). word: the entry's offset
    // in 16-bit words in the row of a BF16-mode gather (the fp32 entries first, 2 words per
    // element, then the BF16 ones, 1 word per element).
    bool bf16 = false;
    int64_t word = 0;
    // The parameter from its padded elements (S x chunk in rank order, any layout that
    // flattens to them): the first numel of them, shaped like the parameter.
    torch::Tensor unpad(const torch::Tensor& padded) const {
      return padded.reshape({-1}).narrow(0, 0, numel).view(param.sizes());
    }
  };
  std::string name;
  std::vector<Entry> entries;
  int64_t row = 0;
  int64_t words = 0;      // 16-bit words per rank of a BF16-mode gather (even)
  bool has_bf16 = false;  // an entry is gathered as BF16 under gather_bf16
  bool gathered = false;
  bool exact = false;     // gathered, and every parameter holds its fp32 value
  int pending = 0;  // recorded forwards whose backward has not reached the post-backward hook
  c10::intrusive_ptr<HookRef> ref;
};

namespace {
int64_t group_size(const ShardingOptions& o) { return o.shard->size(); }

// This rank's slice of a full tensor laid out like `e`'s parameter.
torch::Tensor slice_of(const FullyShardedModel::Unit::Entry& e, const torch::Tensor& full, int rank) {
  // Only the slice is read (`full` may be a view of a checkpoint file); the padding is zeros.
  auto flat = full.detach().reshape({-1});
  const int64_t begin = std::min(rank * e.chunk, e.numel), end = std::min(begin + e.chunk, e.numel);
  auto out = torch::zeros({e.chunk}, flat.options().dtype(torch::kFloat32));
  if (end > begin) out.narrow(0, 0, end - begin).copy_(flat.narrow(0, begin, end - begin));
  return out;
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
    for (auto& [name, p, read_as_bf16] : spec.params) {
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
      e.bf16 = options_.gather_bf16 && read_as_bf16;
      u->has_bf16 = u->has_bf16 || e.bf16;
      // Its own contiguous storage (nothing else may share what gets released).
      p.set_data(p.detach().clone(at::MemoryFormat::Contiguous));
      e.shard = slice_of(e, p, rank);
      if (e.trainable) e.shard.requires_grad_(true);
      e.param = p;
      u->entries.push_back(std::move(e));
    }
    for (const bool bf16 : {false, true})
      for (auto& e : u->entries)
        if (e.bf16 == bf16) {
          e.word = u->words;
          u->words += e.chunk * (bf16 ? 1 : 2);
        }
    u->words += u->words % 2;  // the row is sent as fp32 words
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

// This rank's row of a unit gather: the shards in fp32 (row elements), or with `bf16` the
// 16-bit words of the BF16-mode layout (fp32 entries as two words per element, then
// bf16(shard) of the BF16 entries) viewed as fp32 words for the collective, which only
// copies them.
torch::Tensor FullyShardedModel::send_buffer(const Unit& u, bool bf16) {
  if (!bf16) {
    std::vector<torch::Tensor> parts;
    parts.reserve(u.entries.size());
    for (const auto& e : u.entries) parts.push_back(e.shard.detach());
    return torch::cat(parts);
  }
  auto row = torch::empty({u.words}, u.entries.front().shard.options().dtype(torch::kInt16));
  row.narrow(0, u.words - 1, 1).zero_();  // the pad word, when there is one
  for (const auto& e : u.entries) {
    const auto shard = e.shard.detach();
    const auto words = e.bf16 ? shard.to(torch::kBFloat16).view(torch::kInt16) : shard.view(torch::kInt16);
    row.narrow(0, e.word, words.numel()).copy_(words);
  }
  return row.view(torch::kFloat32);
}

void FullyShardedModel::fill_unit(Unit& u, const torch::Tensor& gathered, bool bf16) {
  const int64_t S = group_size(options_);
  auto all = bf16 ? gathered.view(torch::kInt16).view({S, u.words}) : gathered.view({S, u.row});
  for (auto& e : u.entries) {
    allocate_storage(e.param, e.name);
    // Written through an alias of the storage with its own version counter: the parameter's
    // version stays what autograd saved in forward (a gather for the backward restores the
    // same values).
    auto dst = torch::from_blob(e.param.storage().mutable_data(), e.param.sizes(),
                                e.param.options().requires_grad(false));
    torch::Tensor src;  // [S, chunk]
    if (!bf16)
      src = all.narrow(1, e.offset, e.chunk);
    else if (e.bf16)
      src = all.narrow(1, e.word, e.chunk).view(torch::kBFloat16);
    else
      src = all.narrow(1, e.word, 2 * e.chunk).view(torch::kFloat32);
    dst.copy_(e.unpad(src));  // BF16 -> fp32 is exact
  }
  u.gathered = true;
  u.exact = !bf16;
}

void FullyShardedModel::gather_unit(Unit& u, bool exact) {
  if (u.gathered && (u.exact || !exact)) return;
  if (prefetch_.active()) {
    const bool mine = units_[prefetch_unit_].get() == &u;
    complete_prefetch();
    if (mine && u.gathered && (u.exact || !exact)) return;
  }
  release_unit(u);  // gathered with BF16 entries, wanted exact
  torch::NoGradGuard ng;
  if (u.entries.empty()) {
    u.gathered = u.exact = true;
    return;
  }
  const bool bf16 = u.has_bf16 && !exact;
  auto row = send_buffer(u, bf16);
  if (!exact) gather_bytes_ += row.numel() * 4 * group_size(options_);
  fill_unit(u, options_.shard->all_gather(row, "gather " + what_ + " " + u.name), bf16);
}

void FullyShardedModel::prefetch(size_t unit) {
  if (unit >= units_.size() || prefetch_.active()) return;
  Unit& u = *units_[unit];
  if (u.gathered || u.entries.empty()) return;
  torch::NoGradGuard ng;
  prefetch_bf16_ = u.has_bf16;
  auto row = send_buffer(u, prefetch_bf16_);
  gather_bytes_ += row.numel() * 4 * group_size(options_);
  prefetch_ = options_.shard->all_gather_async(row, "prefetch " + what_ + " " + u.name);
  prefetch_unit_ = unit;
}

void FullyShardedModel::complete_prefetch() {
  if (!prefetch_.active()) return;
  torch::NoGradGuard ng;
  auto gathered = prefetch_.wait();
  Unit& u = *units_[prefetch_unit_];
  if (!u.gathered) fill_unit(u, gathered, prefetch_bf16_);
}

void FullyShardedModel::release_unit(Unit& u) {
  if (!u.gathered) return;
  for (auto& e : u.entries) release_storage(e.param);
  u.gathered = u.exact = false;
}

int64_t FullyShardedModel::parameter_elements() const {
  int64_t n = 0;
  for (const auto& u : units_)
    for (const auto& e : u->entries) n += e.numel;
  return n;
}

int64_t FullyShardedModel::bf16_gathered_elements() const {
  int64_t n = 0;
  for (const auto& u : units_)
    for (const auto& e : u->entries)
      if (e.bf16) n += e.numel;
  return n;
}

void FullyShardedModel::reduce_unit_grads(Unit& u) {
  if (!sync_) return;  // the full gradients accumulate on the parameters until a synced backward
  torch::NoGradGuard ng;
  std::vector<size_t> with;
  for (size_t i = 0; i < u.entries.size(); ++i)
    if (u.entries[i].trainable && u.entries[i].param.grad().defined()) with.push_back(i);
  if (with.empty()) return;
  // One reduce-scatter in flight: the previous unit's completes first (its sums are added to
  // the shard gradients in issue order, so the result does not depend on the overlap).
  complete_reduce();
  const int64_t S = group_size(options_);
  auto buf = torch::zeros({S, u.row},
                          torch::TensorOptions().dtype(torch::kFloat32).device(u.entries[with[0]].param.device()));
  for (size_t i : with) {
    auto* e = &u.entries[i];
    auto g = e->param.grad().detach().reshape({-1}).to(torch::kFloat32);
    if (S * e->chunk > e->numel) g = torch::constant_pad_nd(g, {0, S * e->chunk - e->numel});
    buf.narrow(1, e->offset, e->chunk).copy_(g.view({S, e->chunk}));
    e->param.mutable_grad() = torch::Tensor();
  }
  // Issued now and completed when the next unit's gradients are ready (or at
  // finish_backward): the backward of the unit before this one overlaps it.
  reduce_.work = options_.shard->reduce_scatter_async(buf.view({-1}), "grads " + what_ + " " + u.name);
  ++reduce_scatters_;
  reduce_.unit = u.ref->unit;
  reduce_.entries = std::move(with);
}

void FullyShardedModel::complete_reduce() {
  if (!reduce_.work.active()) return;
  torch::NoGradGuard ng;
  auto mine = reduce_.work.wait();
  Unit& u = *units_[reduce_.unit];
  for (size_t i : reduce_.entries) {
    auto* e = &u.entries[i];
    auto piece = mine.narrow(0, e->offset, e->chunk);
    if (e->shard.grad().defined())
      e->shard.mutable_grad().add_(piece);
    else
      e->shard.mutable_grad() = piece.clone();
  }
  reduce_.entries.clear();
}

void FullyShardedModel::gather(size_t unit) {
  VQAD_CHECK(unit < units_.size(), "sharded data parallel (", what_, "): unit ", unit, " of ", units_.size());
  gather_unit(*units_[unit]);
}

torch::Tensor FullyShardedModel::enter_block(size_t unit, bool first, torch::Tensor hidden) {
  VQAD_CHECK(unit < units_.size(), "sharded data parallel (", what_, "): unit ", unit, " of ", units_.size());
  Unit& u = *units_[unit];
  gather_unit(u);
  if (first) prefetch(unit + 1);  // the next unit's gather runs while this one computes
  if (first && torch::GradMode::is_enabled() && hidden.requires_grad())
    hidden = PostBackwardReduce::apply(u.ref, hidden);
  return hidden;
}

torch::Tensor FullyShardedModel::leave_block(size_t unit, bool last, torch::Tensor out) {
  VQAD_CHECK(unit < units_.size(), "sharded data parallel (", what_, "): unit ", unit, " of ", units_.size());
  if (!last) return out;
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
  gather_unit(*units_.at(unit));
  if (unit > 1) prefetch(unit - 1);  // the backward reaches the unit before this one next (not the root)
}

void FullyShardedModel::post_backward(size_t unit) {
  Unit& u = *units_.at(unit);
  u.pending = std::max(0, u.pending - 1);
  if (u.pending > 0) return;  // another forward's backward still needs the unit
  reduce_unit_grads(u);
  release_unit(u);
}

void FullyShardedModel::finish_backward() {
  complete_prefetch();
  for (auto& u : units_) {
    reduce_unit_grads(*u);
    release_unit(*u);
    u->pending = 0;
  }
  complete_reduce();
}

void FullyShardedModel::finish_step() {
  VQAD_CHECK(sync_, "sharded data parallel (", what_, "): finish_step after a backward without gradient sync "
             "(the last micro-step of a step must reduce)");
  complete_reduce();
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

void FullyShardedModel::release_all() {
  complete_prefetch();
  for (auto& u : units_) {
    release_unit(*u);
    u->pending = 0;
  }
}

std::vector<int> FullyShardedModel::unit_writers() const {
  const int64_t S = group_size(options_);
  std::vector<int64_t> load(static_cast<size_t>(S), 0);
  std::vector<int> out;
  for (const auto& u : units_) {
    int64_t bytes = 0;
    for (const auto& e : u->entries) bytes += e.numel * (e.trainable ? 12 : 4);
    const auto best = std::min_element(load.begin(), load.end());  // the first of equals: deterministic
    *best += bytes;
    out.push_back(static_cast<int>(best - load.begin()));
  }
  return out;
}

std::vector<std::tuple<std::string, std::vector<int64_t>, bool>> FullyShardedModel::written_parameters() const {
  const auto writers = unit_writers();
  const int rank = options_.shard->rank();
  std::vector<std::tuple<std::string, std::vector<int64_t>, bool>> out;
  for (size_t i = 0; i < units_.size(); ++i)
    if (writers[i] == rank)
      for (const auto& e : units_[i]->entries) out.emplace_back(e.name, e.param.sizes().vec(), e.trainable);
  return out;
}

void FullyShardedModel::visit_written_state(const torch::optim::AdamW* shard_state,
                                            const std::function<void(const FullParameter&)>& sink) {
  complete_reduce();
  complete_prefetch();
  const auto writers = unit_writers();
  const int rank = options_.shard->rank();
  const int64_t S = group_size(options_);
  torch::NoGradGuard ng;
  for (size_t ui = 0; ui < units_.size(); ++ui) {
    Unit& u = *units_[ui];
    gather_unit(u, /*exact=*/true);
    // The moments of the unit's updated parameters: one gather of [exp_avg | exp_avg_sq
    // (| max_exp_avg_sq)] pieces (the same parameters have state on every rank).
    struct WithState {
      const Unit::Entry* e;
      const torch::optim::AdamWParamState* st;
    };
    std::vector<WithState> with;
    bool amsgrad = false;
    if (shard_state)
      for (const auto& e : u.entries) {
        if (!e.trainable) continue;
        auto it = shard_state->state().find(e.shard.unsafeGetTensorImpl());
        if (it == shard_state->state().end()) continue;
        const auto* st = static_cast<const torch::optim::AdamWParamState*>(it->second.get());
        with.push_back({&e, st});
        amsgrad = amsgrad || st->max_exp_avg_sq().defined();
      }
    const int64_t kinds = amsgrad ? 3 : 2;
    torch::Tensor moments;  // [S, kinds, sum(chunk)]
    std::vector<int64_t> at;
    if (!with.empty()) {
      std::vector<torch::Tensor> parts[3];
      int64_t n = 0;
      for (const auto& w : with) {
        at.push_back(n);
        n += w.e->chunk;
        parts[0].push_back(w.st->exp_avg().detach().reshape({-1}).to(torch::kFloat32));
        parts[1].push_back(w.st->exp_avg_sq().detach().reshape({-1}).to(torch::kFloat32));
        if (amsgrad)
          parts[2].push_back(w.st->max_exp_avg_sq().defined()
                                 ? w.st->max_exp_avg_sq().detach().reshape({-1}).to(torch::kFloat32)
                                 : torch::zeros({w.e->chunk}, parts[0].back().options()));
      }
      std::vector<torch::Tensor> rows;
      for (int64_t k = 0; k < kinds; ++k) rows.push_back(torch::cat(parts[k]));
      moments = options_.shard->all_gather(torch::cat(rows), "checkpoint adamw " + what_ + " " + u.name)
                    .view({S, kinds, n});
    }
    if (writers[ui] == rank) {
      for (const auto& e : u.entries) {
        FullParameter p;
        p.name = e.name;
        p.weight = e.param.detach();
        for (size_t j = 0; j < with.size(); ++j) {
          if (with[j].e != &e) continue;
          auto whole = [&](int64_t k) { return e.unpad(moments.select(1, k).narrow(1, at[j], e.chunk)).clone(); };
          p.exp_avg = whole(0);
          p.exp_avg_sq = whole(1);
          if (with[j].st->max_exp_avg_sq().defined()) p.max_exp_avg_sq = whole(2);
          p.step = with[j].st->step();
        }
        sink(p);
      }
    }
    release_unit(u);
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
      out.emplace_back(e.name, e.unpad(all).clone());
    }
  return out;
}

void FullyShardedModel::shard_adamw_state(const torch::optim::AdamW& full, torch::optim::AdamW& shards) const {
  torch::NoGradGuard ng;
  const int rank = options_.shard->rank();
  for (const auto& u : units_)
    for (const auto& e : u->entries) {
      if (!e.trainable) continue;
      auto it = full.state().find(e.param.unsafeGetTensorImpl());
      if (it == full.state().end()) continue;
      const auto& st = static_cast<const torch::optim::AdamWParamState&>(*it->second);
      auto s = std::make_unique<torch::optim::AdamWParamState>();
      s->step(st.step());
      // The full moments may be host views of a checkpoint file: only this rank's slice moves.
      const auto dev = e.shard.device();
      s->exp_avg(slice_of(e, st.exp_avg(), rank).to(dev));
      s->exp_avg_sq(slice_of(e, st.exp_avg_sq(), rank).to(dev));
      if (st.max_exp_avg_sq().defined()) s->max_exp_avg_sq(slice_of(e, st.max_exp_avg_sq(), rank).to(dev));
      shards.state()[e.shard.unsafeGetTensorImpl()] = std::move(s);
    }
}

}  // namespace vqad::dist
