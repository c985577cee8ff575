#include "vqad/sample/ode_generate.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <set>

#include "vqad/build_info.h"
#include "vqad/core/error.h"
#include "vqad/core/log.h"
#include "vqad/core/progress.h"
#include "vqad/core/sha256.h"
#include "vqad/data/parquet_dataset.h"
#include "vqad/data/text_embeddings.h"
#include "vqad/io/device.h"
#include "vqad/model/wan/weights.h"
#include "vqad/ops/attention.h"
#include "vqad/version.h"

#ifdef VQAD_WITH_TORCH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <cuda_runtime_api.h>
#endif

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;

namespace vqad::sample {
namespace {

// ---------------------------------------------------------------------------
// Recipe reading: strict, errors name the key.
// ---------------------------------------------------------------------------
struct Reader {
  const Json& obj;
  std::string prefix, source;
  std::set<std::string> used;

  std::string key(const std::string& k) const { return prefix.empty() ? k : prefix + "." + k; }
  [[noreturn]] void bad(const std::string& k, const std::string& what) const {
    fail("ode-cache recipe ", source, ": ", key(k), ": ", what);
  }
  const Json* get(const std::string& k) {
    used.insert(k);
    auto it = obj.find(k);
    if (it == obj.end() || it->is_null()) return nullptr;
    return &*it;
  }
  std::string str(const std::string& k, const std::string& def, bool required = false) {
    const Json* v = get(k);
    if (!v) {
      if (required) bad(k, "missing (required)");
      return def;
    }
    if (!v->is_string()) bad(k, "expected a string, found " + v->dump());
    return v->get<std::string>();
  }
  int64_t i64(const std::string& k, int64_t def, bool required = false) {
    const Json* v = get(k);
    if (!v) {
      if (required) bad(k, "missing (required)");
      return def;
    }
    if (!v->is_number_integer()) bad(k, "expected an integer, found " + v->dump());
    return v->get<int64_t>();
  }
  double f64(const std::string& k, double def) {
    const Json* v = get(k);
    if (!v) return def;
    if (!v->is_number()) bad(k, "expected a number, found " + v->dump());
    return v->get<double>();
  }
  bool boolean(const std::string& k, bool def) {
    const Json* v = get(k);
    if (!v) return def;
    if (!v->is_boolean()) bad(k, "expected true or false, found " + v->dump());
    return v->get<bool>();
  }
  std::vector<int64_t> i64_list(const std::string& k) {
    const Json* v = get(k);
    if (!v) return {};
    if (!v->is_array()) bad(k, "expected a list of integers, found " + v->dump());
    std::vector<int64_t> out;
    for (const auto& e : *v) {
      if (!e.is_number_integer()) bad(k, "expected a list of integers, found " + v->dump());
      out.push_back(e.get<int64_t>());
    }
    return out;
  }
  void finish() const {
    std::vector<std::string> valid(used.begin(), used.end());
    for (auto it = obj.begin(); it != obj.end(); ++it) {
      if (used.count(it.key())) continue;
      std::string list;
      for (const auto& v : valid) list += (list.empty() ? "" : ", ") + v;
      fail("ode-cache recipe ", source, ": unknown key '", key(it.key()), "' (valid: ", list, ")");
    }
  }
};

std::string sha256_of_path(const std::string& path) {
  if (fs::is_regular_file(path)) return sha256_file(path);
  std::vector<fs::path> files;
  for (const auto& e : fs::recursive_directory_iterator(path))
    if (e.is_regular_file()) files.push_back(e.path());
  std::sort(files.begin(), files.end());
  std::string all;
  for (const auto& f : files) all += fs::relative(f, path).string() + " " + sha256_file(f.string()) + "\n";
  return sha256_hex(all);
}

}  // namespace

// ---------------------------------------------------------------------------

OdeRecipe parse_ode_recipe(const Json& root, const std::string& source) {
  VQAD_CHECK(root.is_object(), "ode-cache recipe ", source, ": expected a mapping at the top level");
  OdeRecipe r;
  r.source = source;
  Reader top{root, "", source, {}};
  const Json* models = top.get("models");
  const Json* oc = top.get("ode_cache");
  top.finish();
  VQAD_CHECK(models && models->is_object(), "ode-cache recipe ", source, ": models.teacher is required");
  VQAD_CHECK(oc && oc->is_object(), "ode-cache recipe ", source, ": the ode_cache section is required");
  {
    Reader m{*models, "models", source, {}};
    const Json* t = m.get("teacher");
    m.finish();
    VQAD_CHECK(t && t->is_object(), "ode-cache recipe ", source, ": models.teacher is required");
    Reader tr{*t, "models.teacher", source, {}};
    r.teacher.target = tr.str("_target_", "");
    r.teacher.init_from = tr.str("init_from", "", true);
    const std::string backend = tr.str("attention_backend", "TORCH_SDPA");
    auto b = parse_attention_backend(backend);
    if (!b) tr.bad("attention_backend", "unknown backend '" + backend + "' (valid: " + attention_backend_choices() + ")");
    if (*b != AttentionBackend::kTorchSdpa && *b != AttentionBackend::kFlashAttn)
      tr.bad("attention_backend", "the teacher of an ODE cache is dense: TORCH_SDPA or FLASH_ATTN, found " + backend);
    r.teacher.attention_backend = *b;
    if (tr.boolean("trainable", false)) tr.bad("trainable", "the teacher of an ODE cache is frozen (false)");
    const std::string quant = tr.str("quant_config", "none");
    if (quant != "none") tr.bad("quant_config", "the teacher of an ODE cache is not quantized (none), found " + quant);
    const double fs_ = tr.f64("flow_shift", -1.0);
    tr.finish();
    Reader o{*oc, "ode_cache", source, {}};
    r.output_dir = o.str("output_dir", "", true);
    r.data_path = o.str("data_path", "", true);
    r.data_kind = o.str("preprocessed_data_type", "text_only");
    if (r.data_kind != "text_only" && r.data_kind != "t2v")
      o.bad("preprocessed_data_type", "expected text_only or t2v, found '" + r.data_kind + "'");
    r.negative_prompt_embedding = o.str("negative_prompt_embedding", "", true);
    r.negative_prompt = o.str("negative_prompt", "");
    r.source_kind = o.str("source_kind", "");
    r.num_frames = o.i64("num_frames", 0, true);
    r.num_height = o.i64("num_height", 0, true);
    r.num_width = o.i64("num_width", 0, true);
    r.teacher_steps = o.i64("teacher_steps", 48);
    r.flow_shift = static_cast<float>(o.f64("flow_shift", 8.0));
    r.guidance_scale = o.f64("guidance_scale", 6.0);
    r.anchors = o.i64_list("anchors");
    r.trajectories = o.i64("trajectories", 0, true);
    r.seed = o.i64("seed", 0);
    r.cfg_forward = o.str("cfg_forward", "separate");
    r.device = o.str("device", "auto");
    o.finish();
    if (r.num_frames < 1 || (r.num_frames - 1) % 4 != 0)
      o.bad("num_frames", "must be 4k + 1 (Wan VAE), found " + std::to_string(r.num_frames));
    if (r.num_height <= 0 || r.num_height % 16 != 0)
      o.bad("num_height", "must be a positive multiple of 16 (VAE 8 x patch 2), found " + std::to_string(r.num_height));
    if (r.num_width <= 0 || r.num_width % 16 != 0)
      o.bad("num_width", "must be a positive multiple of 16 (VAE 8 x patch 2), found " + std::to_string(r.num_width));
    if (r.teacher_steps < 1) o.bad("teacher_steps", "must be >= 1");
    if (!(r.flow_shift > 0.0f)) o.bad("flow_shift", "must be > 0");
    if (fs_ >= 0 && static_cast<float>(fs_) != r.flow_shift)
      tr.bad("flow_shift", "= " + std::to_string(fs_) + " disagrees with ode_cache.flow_shift " +
                               std::to_string(r.flow_shift));
    if (!(r.guidance_scale >= 1.0)) o.bad("guidance_scale", "must be >= 1");
    if (r.trajectories < 1) o.bad("trajectories", "must be >= 1");
    if (r.cfg_forward != "separate" && r.cfg_forward != "batched")
      o.bad("cfg_forward", "expected separate or batched, found '" + r.cfg_forward + "'");
    if (r.anchors.empty()) {
      // Every fourth teacher step below the last: [0, 4, ..., 44] for 48 steps.
      for (int64_t i = 0; i < r.teacher_steps; i += 4) r.anchors.push_back(i);
    }
    for (size_t i = 0; i < r.anchors.size(); ++i) {
      if (r.anchors[i] < 0 || r.anchors[i] >= r.teacher_steps)
        o.bad("anchors", "teacher step " + std::to_string(r.anchors[i]) + " is outside [0, " +
                             std::to_string(r.teacher_steps) + ")");
      if (i > 0 && r.anchors[i] <= r.anchors[i - 1]) o.bad("anchors", "must be strictly increasing");
    }
  }
  return r;
}

LoadedTeacher load_ode_teacher(const OdeTeacherSpec& spec, torch::Device device, uint64_t seed) {
  LoadedTeacher t;
  model::WanModelOptions mopt;
  mopt.device = torch::kCPU;
  mopt.compute_dtype = torch::kBFloat16;
  {
    ops::AttentionBackendScope scope(spec.attention_backend);
    const std::string random_prefix = "random:";
    if (spec.init_from.rfind(random_prefix, 0) == 0) {
      model::WanConfig wc;
      try {
        wc = model::WanConfig::preset(spec.init_from.substr(random_prefix.size()));
      } catch (const Error& e) {
        fail("models.teacher.init_from: '", spec.init_from, "': ", e.what());
      }
      torch::manual_seed(seed);
      t.model = std::make_shared<model::WanModel>(wc, mopt);
      t.init_kind = "random";
    } else {
      VQAD_CHECK(fs::exists(spec.init_from), "models.teacher.init_from: '", spec.init_from,
                 "' is not a local path (vqad does not download models: give a local Diffusers directory, a vqad "
                 "export, or random:<preset> with preset tiny, tiny-hd128, tiny-4head, 1.3B or 14B)");
      t.model = model::wan_from_pretrained(spec.init_from, mopt);
      const auto src = model::locate_weights(spec.init_from);
      const fs::path root = fs::is_directory(spec.init_from) ? fs::path(spec.init_from) : fs::path(spec.init_from).parent_path();
      for (const auto& e : fs::recursive_directory_iterator(src.transformer_dir))
        if (e.is_regular_file()) t.file_sha256[fs::relative(e.path(), root).string()] = sha256_file(e.path().string());
      if (fs::is_regular_file(root / "vae" / "config.json"))
        t.file_sha256["vae/config.json"] = sha256_file((root / "vae" / "config.json").string());
      t.init_kind = fs::exists(root / "metadata.json") || fs::exists(root.parent_path() / "metadata.json")
                        ? "vqad_export"
                        : "diffusers";
    }
  }
  t.model->to(device);
  for (auto& p : t.model->parameters()) p.set_requires_grad(false);
  t.model->train(false);
  t.model_kind = t.model->config().kind();
  t.architecture = t.model->config().to_json();
  return t;
}

torch::Tensor trajectory_noise(const std::vector<int64_t>& latent_shape, int64_t seed, int64_t index) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(data::trajectory_seed(seed, index));
  return at::randn(latent_shape, gen, torch::TensorOptions(torch::kFloat32)).to(torch::kBFloat16);
}

OdeSolveResult solve_ode_trajectory(model::WanModel& m, const torch::Tensor& x0, const torch::Tensor& text,
                                    const torch::Tensor& uncond, const ShiftedSchedule& s, double guidance,
                                    const std::vector<int64_t>& anchors, bool batched_cfg,
                                    const std::function<void()>& after_step) {
  torch::NoGradGuard ng;
  VQAD_CHECK(x0.dim() == 4 && x0.scalar_type() == torch::kBFloat16, "ODE solver: x0 must be a bf16 [C, T, H, W] "
             "tensor, found ", x0.sizes(), " ", x0.scalar_type());
  const bool cfg = guidance != 1.0;
  const auto dev = x0.device();
  auto x = x0.unsqueeze(0);  // [1, C, T, H, W] bf16
  std::vector<torch::Tensor> kept;
  size_t next_anchor = 0;
  torch::Tensor text2 = cfg && batched_cfg ? torch::cat({text, uncond}, 0) : torch::Tensor();
  for (int k = 0; k < s.steps; ++k) {
    if (next_anchor < anchors.size() && anchors[next_anchor] == k) {
      kept.push_back(x[0].clone());
      ++next_anchor;
    }
    torch::Tensor v;
    if (!cfg) {
      v = m.forward(x, torch::full({1}, s.timesteps[size_t(k)], torch::TensorOptions(dev)), text).to(torch::kFloat32);
    } else if (batched_cfg) {
      auto out = m.forward(torch::cat({x, x}, 0), torch::full({2}, s.timesteps[size_t(k)], torch::TensorOptions(dev)),
                           text2)
                     .to(torch::kFloat32);
      auto vc = out.narrow(0, 0, 1), vu = out.narrow(0, 1, 1);
      v = vu + guidance * (vc - vu);
    } else {
      auto t = torch::full({1}, s.timesteps[size_t(k)], torch::TensorOptions(dev));
      auto vc = m.forward(x, t, text).to(torch::kFloat32);
      auto vu = m.forward(x, t, uncond).to(torch::kFloat32);
      v = vu + guidance * (vc - vu);
    }
    const float dsigma = s.sigmas[size_t(k) + 1] - s.sigmas[size_t(k)];
    x = (x.to(torch::kFloat32) + dsigma * v).to(torch::kBFloat16);
    if (after_step) after_step();
  }
  VQAD_CHECK(next_anchor == anchors.size(), "ODE solver: anchors must be increasing teacher steps below ", s.steps);
  OdeSolveResult r;
  r.anchors = torch::stack(kept);
  r.final_latent = x[0];
  return r;
}

nlohmann::json runtime_record(torch::Device device) {
  nlohmann::json r;
  r["device_type"] = device.is_cuda() ? "cuda" : "cpu";
  r["torch"] = TORCH_VERSION;
  r["vqad_version"] = VQAD_VERSION;
  r["vqad_commit"] = build_info::kGitCommit;
  r["vqad_dirty"] = build_info::kGitDirty;
#ifdef VQAD_WITH_TORCH_CUDA
  if (device.is_cuda()) {
    const int index = device.has_index() ? device.index() : at::cuda::current_device();
    cudaDeviceProp prop{};
    cudaGetDeviceProperties(&prop, index);
    int rt = 0;
    cudaRuntimeGetVersion(&rt);
    r["device_name"] = prop.name;
    r["capability"] = {prop.major, prop.minor};
    r["cuda"] = std::to_string(rt / 1000) + "." + std::to_string((rt % 1000) / 10);
  }
#endif
  return r;
}

std::pair<int64_t, int64_t> rank_and_world_from_env() {
  auto read = [](const char* name, int64_t def) -> int64_t {
    const char* v = std::getenv(name);
    if (!v || !*v) return def;
    char* end = nullptr;
    const long long x = std::strtoll(v, &end, 10);
    VQAD_CHECK(end && *end == '\0', "environment variable ", name, "='", v, "' is not an integer");
    return x;
  };
  const int64_t world = read("WORLD_SIZE", 1), rank = read("RANK", 0);
  VQAD_CHECK(world >= 1, "environment variable WORLD_SIZE=", world, " must be >= 1");
  VQAD_CHECK(rank >= 0 && rank < world, "environment variable RANK=", rank, " must lie in [0, WORLD_SIZE=", world, ")");
  return {rank, world};
}

void check_cache_against_recipe(const data::OdeCacheMeta& m, int64_t trajectories, const OdeRecipe& r,
                                const std::string& where) {
  auto differ = [&](const std::string& field, const std::string& cache, const std::string& recipe) {
    fail(where, ": field '", field, "' = ", cache, " disagrees with the recipe ", r.source, " (", recipe, ")");
  };
  const auto g = data::OdeGeometry::wan(r.num_frames, r.num_height, r.num_width);
  auto js = [](const auto& v) { return nlohmann::json(v).dump(); };
  if (m.geometry.num_frames != g.num_frames) differ("geometry.num_frames", js(m.geometry.num_frames), js(g.num_frames));
  if (m.geometry.num_height != g.num_height) differ("geometry.num_height", js(m.geometry.num_height), js(g.num_height));
  if (m.geometry.num_width != g.num_width) differ("geometry.num_width", js(m.geometry.num_width), js(g.num_width));
  if (m.geometry.latent_shape != g.latent_shape)
    differ("geometry.latent_shape", js(m.geometry.latent_shape), js(g.latent_shape));
  if (m.schedule.flow_shift != r.flow_shift) differ("schedule.flow_shift", js(m.schedule.flow_shift), js(r.flow_shift));
  if (m.schedule.teacher_steps != r.teacher_steps)
    differ("schedule.teacher_steps", js(m.schedule.teacher_steps), js(r.teacher_steps));
  const auto ref = shifted_schedule(r.flow_shift, int(r.teacher_steps));
  for (size_t i = 0; i < ref.sigmas.size() && i < m.schedule.sigmas.size(); ++i)
    if (m.schedule.sigmas[i] != ref.sigmas[i])
      differ("schedule.sigmas[" + std::to_string(i) + "]", js(m.schedule.sigmas[i]), js(ref.sigmas[i]));
  if (m.schedule.student_indices != r.anchors)
    differ("schedule.student_indices", js(m.schedule.student_indices), js(r.anchors));
  if (m.teacher.guidance_scale != r.guidance_scale)
    differ("teacher.guidance_scale", js(m.teacher.guidance_scale), js(r.guidance_scale));
  if (m.teacher.init_from != r.teacher.init_from) differ("teacher.init_from", m.teacher.init_from, r.teacher.init_from);
  if (m.teacher.backend != attention_backend_name(r.teacher.attention_backend))
    differ("teacher.backend", m.teacher.backend, attention_backend_name(r.teacher.attention_backend));
  if (m.teacher.cfg_forward != r.cfg_forward) differ("teacher.cfg_forward", m.teacher.cfg_forward, r.cfg_forward);
  if (m.seed != r.seed) differ("seed", js(m.seed), js(r.seed));
  if (trajectories != r.trajectories) differ("trajectories", js(trajectories), js(r.trajectories));
}

OdeGenerateSummary generate_ode_cache(const OdeRecipe& r, const OdeGenerateOptions& o) {
  const auto t_start = std::chrono::steady_clock::now();
  VQAD_CHECK(o.world >= 1 && o.rank >= 0 && o.rank < o.world, "ode-cache generate: rank ", o.rank,
             " is outside a world of ", o.world);
  OdeGenerateSummary sum;
  sum.directory = r.output_dir;
  sum.trajectories = r.trajectories;
  if (fs::exists(fs::path(r.output_dir) / "COMPLETE")) {
    auto cache = data::OdeCache::open(r.output_dir);
    check_cache_against_recipe(cache.meta(), cache.num_trajectories(), r,
                               "ODE cache '" + (fs::path(r.output_dir) / "cache.json").string() + "'");
    log::info("ode-cache: '", r.output_dir, "' is already complete (", cache.num_trajectories(),
              " trajectories); nothing to do");
    sum.complete = true;
    return sum;
  }
  const torch::Device device = io::parse_device(r.device, "ode_cache.device");
  LoadedTeacher teacher = load_ode_teacher(r.teacher, device, static_cast<uint64_t>(r.seed));
  const auto& mc = teacher.model->config();
  VQAD_CHECK(mc.in_channels == 16 && mc.out_channels == 16, "models.teacher: the ODE cache stores Wan VAE latents "
             "(16 channels), the teacher has in/out channels ", mc.in_channels, "/", mc.out_channels);

  // Prompts and the negative prompt.
  data::DatasetOptions dopt;
  dopt.kind = r.data_kind == "t2v" ? data::DataKind::T2V : data::DataKind::TextOnly;
  dopt.text_len = mc.text_len;
  dopt.text_dim = mc.text_dim;
  dopt.normalize_latents = false;
  auto prompts = data::ParquetDataset::open(r.data_path, dopt);
  VQAD_CHECK(prompts->size() > 0, "ode_cache.data_path '", r.data_path, "': no rows");
  const std::string nwhere = "ode_cache.negative_prompt_embedding '" + r.negative_prompt_embedding + "'";
  VQAD_CHECK(fs::exists(r.negative_prompt_embedding), nwhere, ": no such file or directory");
  torch::Tensor negative =
      fs::is_regular_file(r.negative_prompt_embedding) && r.negative_prompt_embedding.ends_with(".safetensors")
          ? data::read_text_embedding_file(r.negative_prompt_embedding, mc.text_len, mc.text_dim, nwhere).unsqueeze(0)
          : data::read_text_embedding_rows(r.negative_prompt_embedding, mc.text_len, mc.text_dim, nwhere)
                .text.narrow(0, 0, 1);
  const auto uncond = negative.to(device, torch::kBFloat16);

  // Identity.
  data::OdeCacheMeta meta;
  meta.geometry = data::OdeGeometry::wan(r.num_frames, r.num_height, r.num_width);
  meta.schedule = data::OdeSchedule::shifted(r.flow_shift, r.teacher_steps, r.anchors);
  meta.teacher.model_kind = teacher.model_kind;
  meta.teacher.init_from = r.teacher.init_from;
  meta.teacher.backend = attention_backend_name(r.teacher.attention_backend);
  meta.teacher.guidance_scale = r.guidance_scale;
  meta.teacher.negative_prompt = r.negative_prompt;
  meta.teacher.negative_prompt_embedding = r.negative_prompt_embedding;
  meta.teacher.negative_prompt_embedding_sha256 = sha256_of_path(r.negative_prompt_embedding);
  meta.teacher.cfg_forward = r.cfg_forward;
  meta.teacher.architecture = teacher.architecture;
  meta.teacher.file_sha256 = teacher.file_sha256;
  meta.pair_sampling = r.anchors.size() == 12 ? "all_twelve_teacher_anchors_to_clean" : "all_anchors_to_clean";
  meta.source_kind = r.source_kind;
  meta.source = {{"data_path", r.data_path}, {"preprocessed_data_type", r.data_kind}, {"rows", prompts->size()},
                 {"prompt_of_trajectory", "row index % rows"}};
  meta.seed = r.seed;
  meta.text_len = mc.text_len;
  meta.text_dim = mc.text_dim;
  meta.runtime = runtime_record(device);
  data::OdeCacheWriter writer(r.output_dir, meta, r.trajectories);

  const auto todo = writer.missing(o.rank, o.world);
  int64_t mine = 0;
  for (int64_t i = o.rank; i < r.trajectories; i += o.world) ++mine;
  sum.present = mine - int64_t(todo.size());
  log::info("ode-cache: ", r.output_dir, ": rank ", o.rank, " of ", o.world, " owns ", mine, " of ", r.trajectories,
            " trajectories, ", sum.present, " already present, ", todo.size(), " to generate; teacher ",
            teacher.model_kind, " (", teacher.init_kind, ", ", meta.teacher.backend, ") on ", device.str(),
            ", latents ", nlohmann::json(meta.geometry.latent_shape).dump(), ", ", r.teacher_steps,
            " steps, shift ", r.flow_shift, ", guidance ", r.guidance_scale, ", cfg ", r.cfg_forward);

  const ShiftedSchedule sched = shifted_schedule(r.flow_shift, int(r.teacher_steps));
  std::unique_ptr<Progress> bar;
  if (o.progress && !todo.empty()) {
    Progress::Options po;
    po.tty = o.tty;
    po.plain_interval_s = o.log_interval_s;
    bar = std::make_unique<Progress>("ode-cache", int64_t(todo.size()) * r.teacher_steps, "step", po);
  }
  int64_t done_steps = 0;
  for (size_t n = 0; n < todo.size(); ++n) {
    const int64_t i = todo[n];
    const auto t_traj = std::chrono::steady_clock::now();
    const int64_t row = i % prompts->size();
    data::Sample s = prompts->get(row);
    const int64_t keep = std::min(s.text_tokens, mc.text_len);
    VQAD_CHECK(keep >= 1, "ode_cache.data_path: row ", row, " ('", s.id, "') has an empty text embedding");
    auto text = s.text.unsqueeze(0).to(device, torch::kBFloat16);
    auto x0 = trajectory_noise(meta.geometry.latent_shape, r.seed, i).to(device);
    if (bar) bar->set_postfix("trajectory " + std::to_string(n + 1) + "/" + std::to_string(todo.size()));
    auto res = solve_ode_trajectory(*teacher.model, x0, text, uncond, sched, r.guidance_scale, r.anchors,
                                    r.cfg_forward == "batched", [&] {
                                      ++done_steps;
                                      if (bar) bar->set(done_steps);
                                    });
    data::OdeTrajectory t;
    t.id = s.id;
    t.caption = s.caption;
    t.seed = static_cast<int64_t>(data::trajectory_seed(r.seed, i));
    t.source_row = row;
    t.start_latents = res.anchors.cpu();
    t.final_latent = res.final_latent.cpu();
    t.prompt_embedding = s.text.narrow(0, 0, keep).contiguous();
    writer.write(i, t);
    ++sum.generated;
    sum.trajectory_seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t_traj).count());
  }
  if (bar) bar->finish();
  sum.complete = writer.finalize_if_complete();
  sum.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
  writer.write_session_record(o.rank, {{"rank", o.rank},
                                       {"world", o.world},
                                       {"generated", sum.generated},
                                       {"already_present", sum.present},
                                       {"seconds", sum.seconds},
                                       {"seconds_per_trajectory", sum.generated ? sum.seconds / double(sum.generated) : 0.0},
                                       {"runtime", runtime_record(device)}});
  log::info("ode-cache: rank ", o.rank, " generated ", sum.generated, " trajectories in ", format_duration(sum.seconds),
            sum.complete ? "; the cache is complete" : "; other ranks' trajectories are still missing");
  return sum;
}

}  // namespace vqad::sample
