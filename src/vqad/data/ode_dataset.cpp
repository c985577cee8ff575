#include "vqad/data/ode_dataset.h"

#include <algorithm>

#include "vqad/core/error.h"
#include "vqad/data/py_random.h"

namespace vqad::data {

std::shared_ptr<OdeDataset> OdeDataset::open(const std::string& directory, OdeDatasetOptions options) {
  VQAD_CHECK(options.text_len > 0, "ODE dataset: text_len must be positive, found ", options.text_len);
  VQAD_CHECK(options.cfg_rate >= 0.0 && options.cfg_rate <= 1.0,
             "ODE dataset: training_cfg_rate must lie in [0, 1], found ", options.cfg_rate);
  std::shared_ptr<OdeDataset> ds(new OdeDataset(OdeCache::open(directory), std::move(options)));
  const auto& c = ds->cache_;
  const auto& o = ds->options_;
  VQAD_CHECK(o.text_dim <= 0 || o.text_dim == c.meta().text_dim, "ODE cache '", directory, "': text.text_dim ",
             c.meta().text_dim, " differs from the model's text_dim ", o.text_dim);
  if (o.anchor_teacher_steps.empty()) {
    for (int64_t a = 0; a < c.num_anchors(); ++a) ds->anchors_.push_back(a);
  } else {
    std::vector<int64_t> steps = o.anchor_teacher_steps;
    std::sort(steps.begin(), steps.end());
    VQAD_CHECK(std::adjacent_find(steps.begin(), steps.end()) == steps.end(), o.anchors_key,
               ": a teacher step is listed twice");
    for (auto s : steps) {
      const int64_t a = c.anchor_of_teacher_step(s);
      VQAD_CHECK(a >= 0, o.anchors_key, ": teacher step ", s, " is not an anchor of the ODE cache '", directory,
                 "' (its schedule.student_indices: ", nlohmann::json(c.meta().schedule.student_indices).dump(), ")");
      ds->anchors_.push_back(a);
    }
  }
  return ds;
}

std::vector<int64_t> OdeDataset::anchor_teacher_steps() const {
  std::vector<int64_t> out;
  for (auto a : anchors_) out.push_back(cache_.meta().schedule.student_indices[size_t(a)]);
  return out;
}

OdePair OdeDataset::pair(int64_t index) const {
  VQAD_CHECK(index >= 0 && index < size(), "ODE dataset '", root(), "': pair ", index, " is out of range (",
             size(), " pairs)");
  const int64_t A = int64_t(anchors_.size());
  return cache_.pair(index / A, anchors_[size_t(index % A)]);
}

Batch OdeDataset::get_batch(const std::vector<int64_t>& indices) const {
  VQAD_CHECK(!indices.empty(), "ODE dataset: cannot assemble an empty batch");
  Batch b;
  std::vector<torch::Tensor> start, target, text, mask;
  std::vector<float> sigma, timestep;
  const int64_t D = cache_.meta().text_dim;
  for (auto i : indices) {
    OdePair p = pair(i);
    b.indices.push_back(i);
    b.ids.push_back(p.id);
    b.captions.push_back(p.caption);
    b.infos.emplace_back();
    const bool dropped = cfg_drop(options_.seed, i, options_.cfg_rate);
    b.text_dropped.push_back(dropped);
    start.push_back(p.start_latent);
    target.push_back(p.target_latent);
    sigma.push_back(p.sigma);
    timestep.push_back(p.timestep);
    b.ode_teacher_step.push_back(p.teacher_step);
    const int64_t keep = std::min<int64_t>(p.prompt_embedding.size(0), options_.text_len);
    auto t = torch::zeros({options_.text_len, D}, torch::kFloat32);
    if (!dropped) t.narrow(0, 0, keep).copy_(p.prompt_embedding.narrow(0, 0, keep).to(torch::kFloat32));
    auto m = torch::zeros({options_.text_len}, torch::kFloat32);
    m.narrow(0, 0, keep).fill_(1.0f);
    text.push_back(t);
    mask.push_back(m);
  }
  b.ode_start = torch::stack(start);
  b.ode_target = torch::stack(target);
  b.ode_sigma = torch::tensor(sigma, torch::kFloat32);
  b.ode_timestep = torch::tensor(timestep, torch::kFloat32);
  b.text = torch::stack(text);
  b.text_mask = torch::stack(mask);
  return b;
}

std::string OdeDataset::description() const {
  return "ODE cache, " + std::to_string(cache_.num_trajectories()) + " trajectories x " +
         std::to_string(anchors_.size()) + " anchors (teacher steps " + nlohmann::json(anchor_teacher_steps()).dump() +
         ") = " + std::to_string(size()) + " pairs under " + root();
}

nlohmann::json OdeDataset::identity() const {
  const auto& j = cache_.metadata_json();
  return {{"kind", "ode_cache"},
          {"root", root()},
          {"trajectories", cache_.num_trajectories()},
          {"anchor_teacher_steps", anchor_teacher_steps()},
          {"pairs", size()},
          {"geometry", j.at("geometry")},
          {"schedule", {{"flow_shift", j.at("schedule").at("flow_shift")},
                        {"teacher_steps", j.at("schedule").at("teacher_steps")},
                        {"student_indices", j.at("schedule").at("student_indices")}}},
          {"teacher", {{"init_from", j.at("teacher").at("init_from")},
                       {"model_kind", j.at("teacher").at("model_kind")},
                       {"guidance_scale", j.at("teacher").at("guidance_scale")}}},
          {"text_len", options_.text_len},
          {"cfg_rate", options_.cfg_rate},
          {"seed", options_.seed}};
}

}  // namespace vqad::data
