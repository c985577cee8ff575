#include "vqad/data/ode_cache.h"

#include <chrono>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>

#include "vqad/core/error.h"
#include "vqad/io/tensors.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace vqad::data {
namespace {

constexpr const char* kSchema = "vqad.ode_cache";
constexpr int kSchemaVersion = 1;

std::string utc_now() {
  std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

void write_json_atomic(const std::string& path, const json& j) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::trunc);
    VQAD_CHECK(f.good(), "ODE cache: cannot write '", tmp, "'");
    f << j.dump(2) << "\n";
    f.flush();
    VQAD_CHECK(f.good(), "ODE cache: write to '", tmp, "' failed");
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  VQAD_CHECK(!ec, "ODE cache: rename '", tmp, "' -> '", path, "' failed: ", ec.message());
}

json read_json(const std::string& path) {
  std::ifstream f(path);
  VQAD_CHECK(f.good(), "ODE cache: cannot read '", path, "'");
  try {
    return json::parse(f);
  } catch (const std::exception& e) {
    fail("ODE cache: '", path, "' is not valid JSON: ", e.what());
  }
}

json identity_of(const json& j) {
  json id = j;
  for (const char* k : {"runtime", "trajectories", "pairs", "created_at", "completed_at",
                        "generation_seconds"})
    id.erase(k);
  return id;
}

std::string traj_name(int64_t i) {
  char buf[48];
  std::snprintf(buf, sizeof(buf), "trajectories/%08lld.safetensors", static_cast<long long>(i));
  return buf;
}

torch::ScalarType latent_scalar(const std::string& name, const std::string& where) {
  if (name == "bfloat16") return torch::kBFloat16;
  if (name == "float32") return torch::kFloat32;
  fail(where, ": latent_dtype must be bfloat16 or float32, found '", name, "'");
}

void validate(const OdeCacheMeta& m, const std::string& where) {
  const auto& s = m.schedule;
  VQAD_CHECK(s.teacher_steps > 0, where, ": schedule.teacher_steps must be positive");
  VQAD_CHECK(int64_t(s.sigmas.size()) == s.teacher_steps + 1, where, ": schedule.sigmas needs ",
             s.teacher_steps + 1, " values (teacher_steps + 1), found ", s.sigmas.size());
  VQAD_CHECK(!s.student_indices.empty(), where, ": schedule.student_indices is empty");
  for (size_t i = 0; i < s.student_indices.size(); ++i) {
    VQAD_CHECK(s.student_indices[i] >= 0 && s.student_indices[i] < s.teacher_steps, where,
               ": student index ", s.student_indices[i], " is outside [0, ", s.teacher_steps, ")");
    VQAD_CHECK(i == 0 || s.student_indices[i] > s.student_indices[i - 1], where,
               ": student_indices must be strictly increasing");
  }
  VQAD_CHECK(m.geometry.latent_shape.size() == 4, where,
             ": geometry.latent_shape must be [C, T, H, W], found ", m.geometry.latent_shape.size(),
             " dims");
  VQAD_CHECK(m.text_len > 0 && m.text_dim > 0, where, ": text_len and text_dim must be positive");
  latent_scalar(m.latent_dtype, where);
}

std::vector<int64_t> dims(const torch::Tensor& t) { return t.sizes().vec(); }

}  // namespace

OdeSchedule OdeSchedule::shifted(double flow_shift, int64_t teacher_steps,
                                 std::vector<int64_t> student_indices) {
  VQAD_CHECK(teacher_steps > 0 && flow_shift > 0, "ODE schedule: teacher_steps and flow_shift must be positive");
  OdeSchedule s;
  s.flow_shift = flow_shift;
  s.teacher_steps = teacher_steps;
  s.student_indices = std::move(student_indices);
  for (int64_t i = 0; i <= teacher_steps; ++i) {
    const double u = 1.0 - double(i) / double(teacher_steps);
    s.sigmas.push_back(flow_shift * u / (1.0 + (flow_shift - 1.0) * u));
  }
  return s;
}

std::vector<double> OdeSchedule::timesteps() const {
  std::vector<double> t;
  for (int64_t i = 0; i < teacher_steps && i < int64_t(sigmas.size()); ++i) t.push_back(1000.0 * sigmas[size_t(i)]);
  return t;
}

json OdeCacheMeta::to_json() const {
  json j;
  j["metadata_schema"] = kSchema;
  j["metadata_schema_version"] = kSchemaVersion;
  j["conditioning"] = conditioning;
  j["pair_sampling"] = pair_sampling;
  j["source_kind"] = source_kind;
  j["geometry"] = {{"num_frames", geometry.num_frames},
                   {"num_height", geometry.num_height},
                   {"num_width", geometry.num_width},
                   {"num_latent_t", geometry.num_latent_t},
                   {"latent_shape", geometry.latent_shape}};
  j["schedule"] = {{"flow_shift", schedule.flow_shift},
                   {"teacher_steps", schedule.teacher_steps},
                   {"sigmas", schedule.sigmas},
                   {"timesteps", schedule.timesteps()},
                   {"student_indices", schedule.student_indices},
                   {"solver", schedule.solver},
                   {"timestep_parameterization", "sigma_times_1000"}};
  j["teacher"] = {{"model_kind", teacher.model_kind},
                  {"init_from", teacher.init_from},
                  {"backend", teacher.backend},
                  {"compute_dtype", teacher.compute_dtype},
                  {"state_dtype", teacher.state_dtype},
                  {"guidance_scale", teacher.guidance_scale},
                  {"negative_prompt", teacher.negative_prompt},
                  {"architecture", teacher.architecture},
                  {"files", teacher.file_sha256}};
  j["text"] = {{"text_len", text_len}, {"text_dim", text_dim}};
  j["latent_dtype"] = latent_dtype;
  j["runtime"] = runtime;
  return j;
}

OdeCacheMeta OdeCacheMeta::from_json(const json& j, const std::string& where) {
  VQAD_CHECK(j.is_object() && j.value("metadata_schema", "") == kSchema, where,
             ": expected metadata_schema '", kSchema, "', found ",
             j.is_object() ? j.value("metadata_schema", "(none)") : std::string("(not an object)"));
  VQAD_CHECK(j.value("metadata_schema_version", 0) == kSchemaVersion, where,
             ": unsupported metadata_schema_version ", j.value("metadata_schema_version", 0),
             " (this build reads version ", kSchemaVersion, ")");
  OdeCacheMeta m;
  try {
    m.conditioning = j.at("conditioning").get<std::string>();
    m.pair_sampling = j.at("pair_sampling").get<std::string>();
    m.source_kind = j.value("source_kind", "");
    const auto& g = j.at("geometry");
    m.geometry.num_frames = g.at("num_frames").get<int64_t>();
    m.geometry.num_height = g.at("num_height").get<int64_t>();
    m.geometry.num_width = g.at("num_width").get<int64_t>();
    m.geometry.num_latent_t = g.at("num_latent_t").get<int64_t>();
    m.geometry.latent_shape = g.at("latent_shape").get<std::vector<int64_t>>();
    const auto& s = j.at("schedule");
    m.schedule.flow_shift = s.at("flow_shift").get<double>();
    m.schedule.teacher_steps = s.at("teacher_steps").get<int64_t>();
    m.schedule.sigmas = s.at("sigmas").get<std::vector<double>>();
    m.schedule.student_indices = s.at("student_indices").get<std::vector<int64_t>>();
    m.schedule.solver = s.at("solver").get<std::string>();
    const auto& t = j.at("teacher");
    m.teacher.model_kind = t.at("model_kind").get<std::string>();
    m.teacher.init_from = t.at("init_from").get<std::string>();
    m.teacher.backend = t.at("backend").get<std::string>();
    m.teacher.compute_dtype = t.at("compute_dtype").get<std::string>();
    m.teacher.state_dtype = t.at("state_dtype").get<std::string>();
    m.teacher.guidance_scale = t.at("guidance_scale").get<double>();
    m.teacher.negative_prompt = t.at("negative_prompt").get<std::string>();
    m.teacher.architecture = t.at("architecture");
    m.teacher.file_sha256 = t.at("files").get<std::map<std::string, std::string>>();
    m.text_len = j.at("text").at("text_len").get<int64_t>();
    m.text_dim = j.at("text").at("text_dim").get<int64_t>();
    m.latent_dtype = j.at("latent_dtype").get<std::string>();
    m.runtime = j.value("runtime", json::object());
  } catch (const json::exception& e) {
    fail(where, ": malformed ODE cache metadata: ", e.what());
  }
  validate(m, where);
  return m;
}

// ---------------------------------------------------------------------------

OdeCacheWriter::OdeCacheWriter(std::string directory, OdeCacheMeta meta)
    : dir_(std::move(directory)), meta_(std::move(meta)) {
  validate(meta_, "ODE cache '" + dir_ + "'");
  const fs::path root(dir_);
  const std::string meta_path = (root / "cache.json").string();
  VQAD_CHECK(!fs::exists(root / "COMPLETE"), "ODE cache '", dir_,
             "' is already complete; write a new cache to another directory");
  std::error_code ec;
  fs::create_directories(root / "trajectories", ec);
  VQAD_CHECK(!ec, "ODE cache: cannot create '", (root / "trajectories").string(), "': ", ec.message());
  json mine = meta_.to_json();
  if (fs::exists(meta_path)) {
    json theirs = read_json(meta_path);
    VQAD_CHECK(identity_of(theirs) == identity_of(mine), "ODE cache '", dir_,
               "' holds an unfinished cache of a different identity (geometry, schedule, teacher, "
               "conditioning or dtype differ); use a new directory. Existing: ",
               identity_of(theirs).dump(), " requested: ", identity_of(mine).dump());
    while (fs::exists(root / traj_name(next_))) ++next_;
    mine["created_at"] = theirs.value("created_at", utc_now());
  } else {
    mine["created_at"] = utc_now();
  }
  mine["trajectories"] = next_;
  mine["pairs"] = next_ * int64_t(meta_.schedule.student_indices.size());
  write_json_atomic(meta_path, mine);
}

void OdeCacheWriter::add(const OdeTrajectory& t) {
  VQAD_CHECK(!finalized_, "ODE cache '", dir_, "': add after finalize");
  const std::string where = "ODE cache '" + dir_ + "', trajectory " + std::to_string(next_) + " ('" + t.id + "')";
  const auto& ls = meta_.geometry.latent_shape;
  const auto dtype = latent_scalar(meta_.latent_dtype, where);
  std::vector<int64_t> start_shape = {int64_t(meta_.schedule.student_indices.size())};
  start_shape.insert(start_shape.end(), ls.begin(), ls.end());
  VQAD_CHECK(t.start_latents.defined() && dims(t.start_latents) == start_shape, where,
             ": start_latents must have shape [anchors, C, T, H, W] = ", torch::IntArrayRef(start_shape),
             ", found ", t.start_latents.defined() ? t.start_latents.sizes() : torch::IntArrayRef{});
  VQAD_CHECK(t.final_latent.defined() && dims(t.final_latent) == ls, where,
             ": final_latent must have shape ", torch::IntArrayRef(ls), ", found ",
             t.final_latent.defined() ? t.final_latent.sizes() : torch::IntArrayRef{});
  VQAD_CHECK(t.start_latents.scalar_type() == dtype && t.final_latent.scalar_type() == dtype, where,
             ": latents must be stored as ", meta_.latent_dtype, " (the cache's latent_dtype), found ",
             t.start_latents.scalar_type(), " / ", t.final_latent.scalar_type());
  VQAD_CHECK(t.prompt_embedding.defined() && t.prompt_embedding.dim() == 2 &&
                 t.prompt_embedding.size(0) >= 1 && t.prompt_embedding.size(0) <= meta_.text_len &&
                 t.prompt_embedding.size(1) == meta_.text_dim,
             where, ": prompt_embedding must be [L, ", meta_.text_dim, "] with 1 <= L <= ",
             meta_.text_len, ", found ",
             t.prompt_embedding.defined() ? t.prompt_embedding.sizes() : torch::IntArrayRef{});
  VQAD_CHECK(t.prompt_embedding.is_floating_point(), where, ": prompt_embedding must be floating point");
  const fs::path path = fs::path(dir_) / traj_name(next_);
  io::save_safetensors(path.string(),
                       {{"start_latents", t.start_latents},
                        {"final_latent", t.final_latent},
                        {"prompt_embedding", t.prompt_embedding}},
                       {{"id", t.id},
                        {"caption", t.caption},
                        {"seed", std::to_string(t.seed)},
                        {"index", std::to_string(next_)}});
  ++next_;
}

void OdeCacheWriter::finalize(double generation_seconds) {
  VQAD_CHECK(!finalized_, "ODE cache '", dir_, "': finalize called twice");
  VQAD_CHECK(next_ > 0, "ODE cache '", dir_, "': no trajectories were written");
  const fs::path root(dir_);
  json j = read_json((root / "cache.json").string());
  j["runtime"] = meta_.runtime;
  j["trajectories"] = next_;
  j["pairs"] = next_ * int64_t(meta_.schedule.student_indices.size());
  j["generation_seconds"] = j.value("generation_seconds", 0.0) + generation_seconds;
  j["completed_at"] = utc_now();
  write_json_atomic((root / "cache.json").string(), j);
  std::ofstream((root / "COMPLETE").string()) << next_ << "\n";
  finalized_ = true;
}

// ---------------------------------------------------------------------------

OdeCache OdeCache::open(const std::string& directory) {
  const fs::path root(directory);
  VQAD_CHECK(fs::is_directory(root), "ODE cache: '", directory, "' is not a directory");
  const std::string meta_path = (root / "cache.json").string();
  VQAD_CHECK(fs::exists(meta_path), "ODE cache '", directory, "': missing cache.json");
  VQAD_CHECK(fs::exists(root / "COMPLETE"), "ODE cache '", directory,
             "' is incomplete (no COMPLETE marker): generation did not finish; rerun it to "
             "continue the cache");
  OdeCache c;
  c.dir_ = directory;
  c.json_ = read_json(meta_path);
  c.meta_ = OdeCacheMeta::from_json(c.json_, "ODE cache '" + directory + "'");
  c.trajectories_ = c.json_.value("trajectories", int64_t(0));
  VQAD_CHECK(c.trajectories_ > 0, "ODE cache '", directory, "': cache.json lists no trajectories");
  for (int64_t i = 0; i < c.trajectories_; ++i)
    VQAD_CHECK(fs::exists(root / traj_name(i)), "ODE cache '", directory, "': trajectory file '",
               traj_name(i), "' is missing (cache.json lists ", c.trajectories_, ")");
  return c;
}

std::string OdeCache::trajectory_path(int64_t i) const {
  VQAD_CHECK(i >= 0 && i < trajectories_, "ODE cache '", dir_, "': trajectory ", i,
             " is out of range (", trajectories_, " trajectories)");
  return (fs::path(dir_) / traj_name(i)).string();
}

OdeTrajectory OdeCache::trajectory(int64_t i) const {
  const std::string path = trajectory_path(i);
  std::map<std::string, std::string> md;
  auto tensors = io::load_safetensors(path, &md);
  auto need = [&](const char* name) -> torch::Tensor {
    auto it = tensors.find(name);
    VQAD_CHECK(it != tensors.end(), "ODE cache: '", path, "' has no tensor '", name, "'");
    return it->second;
  };
  OdeTrajectory t;
  t.start_latents = need("start_latents");
  t.final_latent = need("final_latent");
  t.prompt_embedding = need("prompt_embedding");
  t.id = md.count("id") ? md["id"] : "";
  t.caption = md.count("caption") ? md["caption"] : "";
  t.seed = md.count("seed") ? std::stoll(md["seed"]) : 0;
  const auto& ls = meta_.geometry.latent_shape;
  std::vector<int64_t> start_shape = {num_anchors()};
  start_shape.insert(start_shape.end(), ls.begin(), ls.end());
  VQAD_CHECK(dims(t.start_latents) == start_shape, "ODE cache: '", path,
             "' tensor 'start_latents': expected shape ", torch::IntArrayRef(start_shape), ", found ",
             t.start_latents.sizes());
  VQAD_CHECK(dims(t.final_latent) == ls, "ODE cache: '", path, "' tensor 'final_latent': expected shape ",
             torch::IntArrayRef(ls), ", found ", t.final_latent.sizes());
  VQAD_CHECK(t.prompt_embedding.dim() == 2 && t.prompt_embedding.size(1) == meta_.text_dim &&
                 t.prompt_embedding.size(0) <= meta_.text_len,
             "ODE cache: '", path, "' tensor 'prompt_embedding': expected [L <= ", meta_.text_len, ", ",
             meta_.text_dim, "], found ", t.prompt_embedding.sizes());
  return t;
}

OdePair OdeCache::pair(int64_t p) const {
  VQAD_CHECK(p >= 0 && p < num_pairs(), "ODE cache '", dir_, "': pair ", p, " is out of range (",
             num_pairs(), " pairs)");
  const int64_t A = num_anchors();
  OdePair out;
  out.trajectory = p / A;
  out.anchor = p % A;
  std::shared_ptr<OdeTrajectory> t;
  {
    std::lock_guard<std::mutex> lock(last_->mu);
    if (last_->index == out.trajectory) t = last_->trajectory;
  }
  if (!t) {
    t = std::make_shared<OdeTrajectory>(trajectory(out.trajectory));
    std::lock_guard<std::mutex> lock(last_->mu);
    last_->index = out.trajectory;
    last_->trajectory = t;
  }
  out.teacher_step = meta_.schedule.student_indices[size_t(out.anchor)];
  out.sigma = meta_.schedule.sigmas[size_t(out.teacher_step)];
  out.timestep = 1000.0 * out.sigma;
  out.start_latent = t->start_latents[out.anchor];
  out.target_latent = t->final_latent;
  const int64_t L = t->prompt_embedding.size(0);
  out.text = torch::zeros({meta_.text_len, meta_.text_dim}, torch::kFloat32);
  out.text.narrow(0, 0, L).copy_(t->prompt_embedding.to(torch::kFloat32));
  out.text_mask = torch::zeros({meta_.text_len}, torch::kFloat32);
  out.text_mask.narrow(0, 0, L).fill_(1.0f);
  out.caption = t->caption;
  return out;
}

}  // namespace vqad::data
