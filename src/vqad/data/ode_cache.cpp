#include "vqad/data/ode_cache.h"

#include <signal.h>

#include <bit>
#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "vqad/core/error.h"
#include "vqad/core/safetensors.h"
#include "vqad/io/tensors.h"
#include "vqad/sample/schedule.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace vqad::data {
namespace {

constexpr const char* kSchema = "vqad.ode_cache";
constexpr int kSchemaVersion = 2;

void write_json_atomic(const std::string& path, const json& j) {
  const std::string text = j.dump(2) + "\n";
  st::write_file_atomic(path, {std::string_view(text)});
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

// The identity of a cache: everything but the runtime of the session that created it.
json identity_of(const json& j) {
  json id = j;
  id.erase("runtime");
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

std::string shape_text(const std::vector<int64_t>& s) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << "]";
  return os.str();
}

void validate(const OdeCacheMeta& m, const std::string& where) {
  const auto& s = m.schedule;
  VQAD_CHECK(s.teacher_steps > 0, where, ": schedule.teacher_steps must be positive, found ", s.teacher_steps);
  VQAD_CHECK(s.flow_shift > 0, where, ": schedule.flow_shift must be positive, found ", s.flow_shift);
  VQAD_CHECK(int64_t(s.sigmas.size()) == s.teacher_steps + 1, where, ": schedule.sigmas needs ",
             s.teacher_steps + 1, " values (teacher_steps + 1), found ", s.sigmas.size());
  VQAD_CHECK(int64_t(s.timesteps.size()) == s.teacher_steps, where, ": schedule.timesteps needs ", s.teacher_steps,
             " values (teacher_steps), found ", s.timesteps.size());
  // The schedule must be the shifted schedule of its shift and step count, bit for bit.
  const auto ref = sample::shifted_schedule(s.flow_shift, int(s.teacher_steps));
  for (size_t i = 0; i < s.sigmas.size(); ++i)
    VQAD_CHECK(std::bit_cast<uint32_t>(s.sigmas[i]) == std::bit_cast<uint32_t>(ref.sigmas[i]), where,
               ": schedule.sigmas[", i, "] = ", double(s.sigmas[i]), " disagrees with the shifted schedule (shift ",
               s.flow_shift, ", ", s.teacher_steps, " steps), which has ", double(ref.sigmas[i]));
  for (size_t i = 0; i < s.timesteps.size(); ++i)
    VQAD_CHECK(std::bit_cast<uint32_t>(s.timesteps[i]) == std::bit_cast<uint32_t>(ref.timesteps[i]), where,
               ": schedule.timesteps[", i, "] = ", double(s.timesteps[i]),
               " disagrees with the shifted schedule (shift ", s.flow_shift, ", ", s.teacher_steps,
               " steps), which has ", double(ref.timesteps[i]));
  VQAD_CHECK(s.solver == "shifted_euler_bf16_state", where, ": schedule.solver '", s.solver,
             "' is not known to vqad (shifted_euler_bf16_state)");
  VQAD_CHECK(!s.student_indices.empty(), where, ": schedule.student_indices is empty");
  for (size_t i = 0; i < s.student_indices.size(); ++i) {
    VQAD_CHECK(s.student_indices[i] >= 0 && s.student_indices[i] < s.teacher_steps, where,
               ": schedule.student_indices: student index ", s.student_indices[i], " is outside [0, ",
               s.teacher_steps, ")");
    VQAD_CHECK(i == 0 || s.student_indices[i] > s.student_indices[i - 1], where,
               ": schedule.student_indices must be strictly increasing");
  }
  const auto& g = m.geometry;
  VQAD_CHECK(g.latent_shape.size() == 4, where, ": geometry.latent_shape must be [C, T, H, W], found ",
             shape_text(g.latent_shape));
  for (auto d : g.latent_shape)
    VQAD_CHECK(d > 0, where, ": geometry.latent_shape ", shape_text(g.latent_shape), " has a non-positive size");
  const auto wan = OdeGeometry::wan(g.num_frames, g.num_height, g.num_width);
  VQAD_CHECK(g.latent_shape == wan.latent_shape && g.num_latent_t == wan.num_latent_t, where,
             ": geometry.latent_shape ", shape_text(g.latent_shape), " / num_latent_t ", g.num_latent_t,
             " disagree with num_frames ", g.num_frames, ", num_height ", g.num_height, ", num_width ", g.num_width,
             " (the Wan VAE gives ", shape_text(wan.latent_shape), ", num_latent_t ", wan.num_latent_t, ")");
  VQAD_CHECK(m.text_len > 0 && m.text_dim > 0, where, ": text.text_len and text.text_dim must be positive");
  VQAD_CHECK(m.teacher.cfg_forward == "separate" || m.teacher.cfg_forward == "batched", where,
             ": teacher.cfg_forward must be separate or batched, found '", m.teacher.cfg_forward, "'");
  latent_scalar(m.latent_dtype, where);
}

std::vector<int64_t> dims(const torch::Tensor& t) { return t.sizes().vec(); }

// ".<name>.tmp.<pid>.<random>" of st::write_file_atomic whose process is gone.
bool stale_temporary(const std::string& fname) {
  if (fname.empty() || fname[0] != '.') return false;
  const size_t tmp = fname.find(".tmp.");
  if (tmp == std::string::npos) return false;
  const size_t dot = fname.find('.', tmp + 5);
  if (dot == std::string::npos) return false;
  long pid = 0;
  try {
    pid = std::stol(fname.substr(tmp + 5, dot - tmp - 5));
  } catch (const std::exception&) {
    return false;
  }
  if (pid <= 0) return false;
  return ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
}

void remove_stale_temporaries(const fs::path& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return;
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (e.is_regular_file() && stale_temporary(e.path().filename().string())) fs::remove(e.path(), ec);
}

}  // namespace

OdeSchedule OdeSchedule::shifted(float flow_shift, int64_t teacher_steps, std::vector<int64_t> student_indices) {
  VQAD_CHECK(teacher_steps > 0 && flow_shift > 0, "ODE schedule: teacher_steps and flow_shift must be positive");
  const auto ref = sample::shifted_schedule(flow_shift, int(teacher_steps));
  OdeSchedule s;
  s.flow_shift = flow_shift;
  s.teacher_steps = teacher_steps;
  s.sigmas = ref.sigmas;
  s.timesteps = ref.timesteps;
  s.student_indices = std::move(student_indices);
  return s;
}

OdeGeometry OdeGeometry::wan(int64_t num_frames, int64_t height, int64_t width) {
  OdeGeometry g;
  g.num_frames = num_frames;
  g.num_height = height;
  g.num_width = width;
  g.num_latent_t = num_frames >= 1 ? (num_frames - 1) / 4 + 1 : 0;
  g.latent_shape = {16, g.num_latent_t, height / 8, width / 8};
  return g;
}

uint64_t trajectory_seed(int64_t seed, int64_t index) {
  auto splitmix = [](uint64_t x) {
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
  };
  // 63 bits, so that the seed is also a non-negative int64 in the metadata.
  return splitmix(splitmix(static_cast<uint64_t>(seed)) + static_cast<uint64_t>(index)) >> 1;
}

json OdeCacheMeta::to_json() const {
  json j;
  j["metadata_schema"] = kSchema;
  j["metadata_schema_version"] = kSchemaVersion;
  j["conditioning"] = conditioning;
  j["pair_sampling"] = pair_sampling;
  j["source_kind"] = source_kind;
  j["source"] = source;
  j["seed"] = seed;
  j["noise"] = noise;
  j["geometry"] = {{"num_frames", geometry.num_frames},
                   {"num_height", geometry.num_height},
                   {"num_width", geometry.num_width},
                   {"num_latent_t", geometry.num_latent_t},
                   {"latent_shape", geometry.latent_shape}};
  std::vector<double> sig(schedule.sigmas.begin(), schedule.sigmas.end());
  std::vector<double> ts(schedule.timesteps.begin(), schedule.timesteps.end());
  j["schedule"] = {{"flow_shift", double(schedule.flow_shift)},
                   {"teacher_steps", schedule.teacher_steps},
                   {"sigmas", sig},
                   {"timesteps", ts},
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
                  {"negative_prompt_embedding", teacher.negative_prompt_embedding},
                  {"negative_prompt_embedding_sha256", teacher.negative_prompt_embedding_sha256},
                  {"cfg_forward", teacher.cfg_forward},
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
  std::string field;
  auto at = [&](const json& parent, const char* key, const std::string& path) -> const json& {
    field = path;
    return parent.at(key);
  };
  auto fp32 = [&](const std::vector<double>& v, const std::string& name) {
    std::vector<float> out;
    for (size_t i = 0; i < v.size(); ++i) {
      const float f = static_cast<float>(v[i]);
      VQAD_CHECK(double(f) == v[i], where, ": ", name, "[", i, "] = ", v[i], " is not an fp32 value");
      out.push_back(f);
    }
    return out;
  };
  try {
    m.conditioning = at(j, "conditioning", "conditioning").get<std::string>();
    m.pair_sampling = at(j, "pair_sampling", "pair_sampling").get<std::string>();
    m.source_kind = j.value("source_kind", "");
    m.source = j.value("source", json::object());
    m.seed = at(j, "seed", "seed").get<int64_t>();
    m.noise = at(j, "noise", "noise").get<std::string>();
    const auto& g = at(j, "geometry", "geometry");
    m.geometry.num_frames = at(g, "num_frames", "geometry.num_frames").get<int64_t>();
    m.geometry.num_height = at(g, "num_height", "geometry.num_height").get<int64_t>();
    m.geometry.num_width = at(g, "num_width", "geometry.num_width").get<int64_t>();
    m.geometry.num_latent_t = at(g, "num_latent_t", "geometry.num_latent_t").get<int64_t>();
    m.geometry.latent_shape = at(g, "latent_shape", "geometry.latent_shape").get<std::vector<int64_t>>();
    const auto& s = at(j, "schedule", "schedule");
    m.schedule.flow_shift = fp32({at(s, "flow_shift", "schedule.flow_shift").get<double>()}, "schedule.flow_shift")[0];
    m.schedule.teacher_steps = at(s, "teacher_steps", "schedule.teacher_steps").get<int64_t>();
    m.schedule.sigmas = fp32(at(s, "sigmas", "schedule.sigmas").get<std::vector<double>>(), "schedule.sigmas");
    m.schedule.timesteps =
        fp32(at(s, "timesteps", "schedule.timesteps").get<std::vector<double>>(), "schedule.timesteps");
    m.schedule.student_indices =
        at(s, "student_indices", "schedule.student_indices").get<std::vector<int64_t>>();
    m.schedule.solver = at(s, "solver", "schedule.solver").get<std::string>();
    const auto& t = at(j, "teacher", "teacher");
    m.teacher.model_kind = at(t, "model_kind", "teacher.model_kind").get<std::string>();
    m.teacher.init_from = at(t, "init_from", "teacher.init_from").get<std::string>();
    m.teacher.backend = at(t, "backend", "teacher.backend").get<std::string>();
    m.teacher.compute_dtype = at(t, "compute_dtype", "teacher.compute_dtype").get<std::string>();
    m.teacher.state_dtype = at(t, "state_dtype", "teacher.state_dtype").get<std::string>();
    m.teacher.guidance_scale = at(t, "guidance_scale", "teacher.guidance_scale").get<double>();
    m.teacher.negative_prompt = at(t, "negative_prompt", "teacher.negative_prompt").get<std::string>();
    m.teacher.negative_prompt_embedding = t.value("negative_prompt_embedding", "");
    m.teacher.negative_prompt_embedding_sha256 = t.value("negative_prompt_embedding_sha256", "");
    m.teacher.cfg_forward = t.value("cfg_forward", "separate");
    m.teacher.architecture = at(t, "architecture", "teacher.architecture");
    m.teacher.file_sha256 = at(t, "files", "teacher.files").get<std::map<std::string, std::string>>();
    m.text_len = at(at(j, "text", "text"), "text_len", "text.text_len").get<int64_t>();
    m.text_dim = at(at(j, "text", "text"), "text_dim", "text.text_dim").get<int64_t>();
    m.latent_dtype = at(j, "latent_dtype", "latent_dtype").get<std::string>();
    m.runtime = j.value("runtime", json::object());
  } catch (const json::exception& e) {
    fail(where, ": malformed ODE cache metadata at '", field, "': ", e.what());
  }
  validate(m, where);
  return m;
}

// ---------------------------------------------------------------------------

OdeCacheWriter::OdeCacheWriter(std::string directory, OdeCacheMeta meta, int64_t trajectories)
    : dir_(std::move(directory)), meta_(std::move(meta)), trajectories_(trajectories) {
  const std::string where = "ODE cache '" + dir_ + "'";
  validate(meta_, where);
  VQAD_CHECK(trajectories_ > 0, where, ": the number of trajectories must be positive, found ", trajectories_);
  const fs::path root(dir_);
  const std::string meta_path = (root / "cache.json").string();
  VQAD_CHECK(!fs::exists(root / "COMPLETE"), where, " is already complete; write a new cache to another directory");
  std::error_code ec;
  fs::create_directories(root / "trajectories", ec);
  VQAD_CHECK(!ec, "ODE cache: cannot create '", (root / "trajectories").string(), "': ", ec.message());
  remove_stale_temporaries(root);
  remove_stale_temporaries(root / "trajectories");
  json mine = meta_.to_json();
  mine["trajectories"] = trajectories_;
  mine["pairs"] = trajectories_ * int64_t(meta_.schedule.student_indices.size());
  if (fs::exists(meta_path)) {
    json theirs = read_json(meta_path);
    const json mine_id = identity_of(mine), theirs_id = identity_of(theirs);
    if (theirs_id != mine_id) {
      // Name the first top-level field that differs (iterate a named object: items() of a
      // temporary would dangle).
      std::string diff;
      // "pairs" follows from trajectories x anchors: name the cause, not the consequence.
      for (const auto& [k, v] : mine_id.items())
        if (k != "pairs" && (!theirs_id.contains(k) || theirs_id[k] != v)) {
          diff = k + " (existing " + (theirs_id.contains(k) ? theirs_id[k].dump() : std::string("(none)")) +
                 ", requested " + v.dump() + ")";
          break;
        }
      if (diff.empty()) diff = "fields only the existing cache has";
      fail(where, " holds an unfinished cache of a different identity; first difference: ", diff,
           ". Use a new directory, or rerun with the recipe that created it");
    }
    meta_.runtime = theirs.value("runtime", json::object());  // the creator's runtime stays recorded
  } else {
    write_json_atomic(meta_path, mine);
  }
}

bool OdeCacheWriter::has(int64_t index) const { return fs::exists(fs::path(dir_) / traj_name(index)); }

std::vector<int64_t> OdeCacheWriter::missing(int64_t rank, int64_t world) const {
  VQAD_CHECK(world >= 1 && rank >= 0 && rank < world, "ODE cache: rank ", rank, " is outside a world of ", world);
  std::vector<int64_t> out;
  for (int64_t i = rank; i < trajectories_; i += world)
    if (!has(i)) out.push_back(i);
  return out;
}

void OdeCacheWriter::write(int64_t index, const OdeTrajectory& t) {
  const std::string where = "ODE cache '" + dir_ + "', trajectory " + std::to_string(index) + " ('" + t.id + "')";
  VQAD_CHECK(index >= 0 && index < trajectories_, where, ": index outside [0, ", trajectories_, ")");
  VQAD_CHECK(!has(index), where, ": the file '", traj_name(index), "' already exists");
  const auto& ls = meta_.geometry.latent_shape;
  const auto dtype = latent_scalar(meta_.latent_dtype, where);
  std::vector<int64_t> start_shape = {int64_t(meta_.schedule.student_indices.size())};
  start_shape.insert(start_shape.end(), ls.begin(), ls.end());
  VQAD_CHECK(t.start_latents.defined() && dims(t.start_latents) == start_shape, where,
             ": start_latents must have shape [anchors, C, T, H, W] = ", shape_text(start_shape), ", found ",
             t.start_latents.defined() ? shape_text(dims(t.start_latents)) : std::string("(undefined)"));
  VQAD_CHECK(t.final_latent.defined() && dims(t.final_latent) == ls, where, ": final_latent must have shape ",
             shape_text(ls), ", found ",
             t.final_latent.defined() ? shape_text(dims(t.final_latent)) : std::string("(undefined)"));
  VQAD_CHECK(t.start_latents.scalar_type() == dtype && t.final_latent.scalar_type() == dtype, where,
             ": latents must be stored as ", meta_.latent_dtype, " (the cache's latent_dtype), found ",
             t.start_latents.scalar_type(), " / ", t.final_latent.scalar_type());
  VQAD_CHECK(t.prompt_embedding.defined() && t.prompt_embedding.dim() == 2 && t.prompt_embedding.size(0) >= 1 &&
                 t.prompt_embedding.size(0) <= meta_.text_len && t.prompt_embedding.size(1) == meta_.text_dim,
             where, ": prompt_embedding must be [L, ", meta_.text_dim, "] with 1 <= L <= ", meta_.text_len,
             ", found ", t.prompt_embedding.defined() ? shape_text(dims(t.prompt_embedding)) : std::string("(undefined)"));
  VQAD_CHECK(t.prompt_embedding.scalar_type() == torch::kFloat32, where,
             ": prompt_embedding must be float32, found ", t.prompt_embedding.scalar_type());
  io::save_safetensors((fs::path(dir_) / traj_name(index)).string(),
                       {{"start_latents", t.start_latents},
                        {"final_latent", t.final_latent},
                        {"prompt_embedding", t.prompt_embedding}},
                       {{"id", t.id},
                        {"caption", t.caption},
                        {"seed", std::to_string(t.seed)},
                        {"source_row", std::to_string(t.source_row)},
                        {"index", std::to_string(index)}});
}

bool OdeCacheWriter::finalize_if_complete() {
  const fs::path root(dir_);
  if (fs::exists(root / "COMPLETE")) return true;
  for (int64_t i = 0; i < trajectories_; ++i)
    if (!has(i)) return false;
  const std::string text = std::to_string(trajectories_) + "\n";
  st::write_file_atomic((root / "COMPLETE").string(), {std::string_view(text)});
  return true;
}

void OdeCacheWriter::write_session_record(int64_t rank, const json& record) {
  const fs::path dir = fs::path(dir_) / "sessions";
  std::error_code ec;
  fs::create_directories(dir, ec);
  VQAD_CHECK(!ec, "ODE cache: cannot create '", dir.string(), "': ", ec.message());
  for (int n = 0;; ++n) {
    const fs::path p = dir / ("rank" + std::to_string(rank) + "-" + std::to_string(n) + ".json");
    if (fs::exists(p)) continue;
    write_json_atomic(p.string(), record);
    return;
  }
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
  c.meta_ = OdeCacheMeta::from_json(c.json_, "ODE cache '" + meta_path + "'");
  c.trajectories_ = c.json_.value("trajectories", int64_t(0));
  VQAD_CHECK(c.trajectories_ > 0, "ODE cache '", meta_path, "': field 'trajectories' lists no trajectories");
  VQAD_CHECK(c.json_.value("pairs", int64_t(-1)) == c.num_pairs(), "ODE cache '", meta_path, "': field 'pairs' = ",
             c.json_.value("pairs", int64_t(-1)), " but trajectories x anchors = ", c.num_pairs());
  for (int64_t i = 0; i < c.trajectories_; ++i)
    VQAD_CHECK(fs::exists(root / traj_name(i)), "ODE cache '", directory, "': trajectory file '", traj_name(i),
               "' is missing (cache.json lists ", c.trajectories_, ")");
  return c;
}

std::string OdeCache::trajectory_path(int64_t i) const {
  VQAD_CHECK(i >= 0 && i < trajectories_, "ODE cache '", dir_, "': trajectory ", i, " is out of range (",
             trajectories_, " trajectories)");
  return (fs::path(dir_) / traj_name(i)).string();
}

int64_t OdeCache::anchor_of_teacher_step(int64_t teacher_step) const {
  const auto& a = meta_.schedule.student_indices;
  for (size_t k = 0; k < a.size(); ++k)
    if (a[k] == teacher_step) return int64_t(k);
  return -1;
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
  try {
    t.seed = md.count("seed") ? std::stoll(md["seed"]) : 0;
    t.source_row = md.count("source_row") ? std::stoll(md["source_row"]) : -1;
  } catch (const std::exception&) {
    fail("ODE cache: '", path, "': malformed __metadata__ seed / source_row");
  }
  const auto& ls = meta_.geometry.latent_shape;
  std::vector<int64_t> start_shape = {num_anchors()};
  start_shape.insert(start_shape.end(), ls.begin(), ls.end());
  VQAD_CHECK(dims(t.start_latents) == start_shape, "ODE cache: '", path, "' tensor 'start_latents': expected shape ",
             shape_text(start_shape), " (anchors x geometry.latent_shape), found ", shape_text(dims(t.start_latents)));
  VQAD_CHECK(dims(t.final_latent) == ls, "ODE cache: '", path, "' tensor 'final_latent': expected shape ",
             shape_text(ls), " (geometry.latent_shape), found ", shape_text(dims(t.final_latent)));
  VQAD_CHECK(t.prompt_embedding.dim() == 2 && t.prompt_embedding.size(1) == meta_.text_dim &&
                 t.prompt_embedding.size(0) >= 1 && t.prompt_embedding.size(0) <= meta_.text_len,
             "ODE cache: '", path, "' tensor 'prompt_embedding': expected [L <= ", meta_.text_len, ", ",
             meta_.text_dim, "], found ", shape_text(dims(t.prompt_embedding)));
  return t;
}

OdePair OdeCache::pair(int64_t trajectory_index, int64_t anchor) const {
  VQAD_CHECK(trajectory_index >= 0 && trajectory_index < trajectories_ && anchor >= 0 && anchor < num_anchors(),
             "ODE cache '", dir_, "': pair (trajectory ", trajectory_index, ", anchor ", anchor,
             ") is out of range (", trajectories_, " trajectories x ", num_anchors(), " anchors)");
  OdePair out;
  out.trajectory = trajectory_index;
  out.anchor = anchor;
  std::shared_ptr<OdeTrajectory> t;
  {
    std::lock_guard<std::mutex> lock(last_->mu);
    if (last_->index == trajectory_index) t = last_->trajectory;
  }
  if (!t) {
    t = std::make_shared<OdeTrajectory>(trajectory(trajectory_index));
    std::lock_guard<std::mutex> lock(last_->mu);
    last_->index = trajectory_index;
    last_->trajectory = t;
  }
  out.teacher_step = meta_.schedule.student_indices[size_t(anchor)];
  out.sigma = meta_.schedule.sigmas[size_t(out.teacher_step)];
  out.timestep = meta_.schedule.timesteps[size_t(out.teacher_step)];
  out.start_latent = t->start_latents[anchor];
  out.target_latent = t->final_latent;
  out.prompt_embedding = t->prompt_embedding;
  out.id = t->id;
  out.caption = t->caption;
  return out;
}

OdeCacheReport OdeCache::verify() const {
  OdeCacheReport r;
  r.trajectories = trajectories_;
  r.anchors = num_anchors();
  r.pairs = num_pairs();
  r.complete = fs::exists(fs::path(dir_) / "COMPLETE");
  const auto& ls = meta_.geometry.latent_shape;
  std::vector<int64_t> start_shape = {num_anchors()};
  start_shape.insert(start_shape.end(), ls.begin(), ls.end());
  const st::DType latent_dt = meta_.latent_dtype == "bfloat16" ? st::DType::BF16 : st::DType::F32;
  for (int64_t i = 0; i < trajectories_; ++i) {
    const std::string path = trajectory_path(i);
    VQAD_CHECK(fs::exists(path), "ODE cache: trajectory file '", path, "' is missing (cache.json lists ",
               trajectories_, ")");
    st::File f = [&] {
      try {
        return st::File::open(path);
      } catch (const Error& e) {
        fail("ODE cache: trajectory file '", path, "' is unreadable (truncated or corrupt): ", e.what());
      }
    }();
    auto check = [&](const char* name, st::DType dt, const std::vector<int64_t>* shape, const char* field) {
      VQAD_CHECK(f.contains(name), "ODE cache: trajectory file '", path, "' has no tensor '", name, "'");
      const auto& info = f.info(name);
      VQAD_CHECK(info.dtype == dt, "ODE cache: trajectory file '", path, "' tensor '", name, "': dtype ",
                 st::dtype_name(info.dtype), ", expected ", st::dtype_name(dt));
      if (shape)
        VQAD_CHECK(info.shape == *shape, "ODE cache: trajectory file '", path, "' tensor '", name, "': shape ",
                   shape_text(info.shape), " disagrees with ", field, " ", shape_text(*shape));
      return info.shape;
    };
    check("start_latents", latent_dt, &start_shape, "anchors x geometry.latent_shape");
    check("final_latent", latent_dt, &ls, "geometry.latent_shape");
    auto ps = check("prompt_embedding", st::DType::F32, nullptr, "");
    VQAD_CHECK(ps.size() == 2 && ps[0] >= 1 && ps[0] <= meta_.text_len && ps[1] == meta_.text_dim,
               "ODE cache: trajectory file '", path, "' tensor 'prompt_embedding': shape ", shape_text(ps),
               " disagrees with text.text_len ", meta_.text_len, " / text.text_dim ", meta_.text_dim);
    const auto& md = f.metadata();
    auto it = md.find("index");
    VQAD_CHECK(it != md.end() && it->second == std::to_string(i), "ODE cache: trajectory file '", path,
               "': __metadata__ index is ", it == md.end() ? std::string("(none)") : it->second, ", expected ", i);
    const int64_t bytes = int64_t(fs::file_size(path));
    r.total_bytes += bytes;
    r.min_bytes = i == 0 ? bytes : std::min(r.min_bytes, bytes);
    r.max_bytes = std::max(r.max_bytes, bytes);
  }
  return r;
}

}  // namespace vqad::data
