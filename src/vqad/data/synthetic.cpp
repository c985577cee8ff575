#include "vqad/data/synthetic.h"

#include <torch/torch.h>

#include <ATen/CPUGeneratorImpl.h>

#include <array>
#include <cmath>
#include <sstream>

#include "vqad/core/error.h"
#include "vqad/core/fnv1a.h"
#include "vqad/data/latent_norm.h"

namespace vqad::data {
namespace {

constexpr std::array<const char*, 6> kColours = {"red", "green", "blue", "yellow", "white", "purple"};
constexpr std::array<const char*, 4> kDirections = {"left", "right", "up", "down"};
constexpr std::array<const char*, 3> kBackgrounds = {"dark", "bright", "striped"};

uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

at::Generator gen_for(uint64_t key) { return at::make_generator<at::CPUGeneratorImpl>(mix(key)); }

constexpr int64_t kCaptionCombos = int64_t(kColours.size() * kDirections.size() * kBackgrounds.size() * 3);

uint64_t row_key_of(const SynthOptions& o, int64_t g) { return mix(uint64_t(o.seed) * 1000003ULL + uint64_t(g)); }

}  // namespace

SynthMode synth_mode_of(const SynthOptions& o, int64_t g) {
  VQAD_CHECK(o.modes > 0, "synthetic data: synth_mode_of needs modes > 0, found ", o.modes);
  VQAD_CHECK(o.captions >= 1 && o.captions <= kCaptionCombos, "synthetic data: captions must be in [1, ",
             kCaptionCombos, "], found ", o.captions);
  const uint64_t key = row_key_of(o, g);
  return {int64_t(key % uint64_t(o.captions)), int64_t(mix(key ^ 0x5eedULL) % uint64_t(o.modes))};
}

ParquetRecord synth_record(const SynthOptions& o, int64_t g) {
  VQAD_CHECK(o.latent_t > 0 && o.latent_h > 0 && o.latent_w > 0 && o.text_dim > 0,
             "synthetic data: latent T/H/W and text_dim must be positive");
  VQAD_CHECK(o.modes >= 0, "synthetic data: modes must be >= 0, found ", o.modes);
  VQAD_CHECK(o.detail >= 0, "synthetic data: detail must be >= 0, found ", o.detail);
  const uint64_t row_key = row_key_of(o, g);
  size_t colour = row_key % kColours.size();
  size_t dir = (row_key / 7) % kDirections.size();
  size_t bg = (row_key / 31) % kBackgrounds.size();
  int64_t blobs = 1 + int64_t((row_key / 101) % 3);
  SynthMode sm;
  if (o.modes > 0) {
    // Caption c is combination (97 c) mod 216 (97 is prime to 216: distinct captions).
    sm = synth_mode_of(o, g);
    const int64_t k = (sm.caption * 97) % kCaptionCombos;
    colour = size_t(k % 6);
    dir = size_t((k / 6) % 4);
    bg = size_t((k / 24) % 3);
    blobs = 1 + (k / 72);
  }

  std::ostringstream cap;
  cap << (blobs == 1 ? "a " : blobs == 2 ? "two " : "three ") << kColours[colour]
      << (blobs == 1 ? " ball" : " balls") << " moving " << kDirections[dir] << " over a "
      << kBackgrounds[bg] << " background";
  ParquetRecord r;
  char id[32];
  std::snprintf(id, sizeof(id), "synth_%08lld", static_cast<long long>(g));
  r.id = id;
  r.caption = cap.str();
  r.file_name = r.id + ".mp4";

  if (o.kind == DataKind::T2V) {
    torch::NoGradGuard ng;
    const int64_t C = kWanLatentChannels, T = o.latent_t, H = o.latent_h, W = o.latent_w;
    auto gen = gen_for(row_key);
    auto ty = torch::linspace(-1, 1, H).view({1, H, 1});
    auto tx = torch::linspace(-1, 1, W).view({1, 1, W});
    auto tt = torch::linspace(0, 1, T).view({T, 1, 1});
    // Background: per-channel level plus an optional stripe pattern.
    auto chan_level = torch::randn({C, 1, 1, 1}, gen) * 0.3;
    // Multi-modal rows: the channel levels belong to the caption (a row does not shift them).
    if (o.modes > 0) chan_level = torch::randn({C, 1, 1, 1}, gen_for(uint64_t(sm.caption) ^ 0xC0DEULL)) * 0.3;
    auto frame = torch::zeros({T, H, W});
    if (bg == 2) frame = frame + 0.5 * torch::sin(tx * 12.0).expand({T, H, W});
    if (bg == 1) frame = frame + 0.8;
    if (bg == 0) frame = frame - 0.8;
    auto vid = chan_level + frame.unsqueeze(0).expand({C, T, H, W}) * 0.5;
    const double dx = dir == 0 ? -1.0 : dir == 1 ? 1.0 : 0.0;
    const double dy = dir == 2 ? -1.0 : dir == 3 ? 1.0 : 0.0;
    // The colour word selects which channels the blobs light up.
    auto colour_gain = torch::randn({C, 1, 1, 1}, gen_for(colour + 17)) * 1.5;
    if (o.modes == 0) {
      for (int64_t b = 0; b < blobs; ++b) {
        auto p = torch::rand({3}, gen);
        const double x0 = p[0].item<double>() * 1.2 - 0.6, y0 = p[1].item<double>() * 1.2 - 0.6;
        const double radius = 0.15 + 0.15 * p[2].item<double>();
        auto cx = x0 + dx * 0.8 * tt, cy = y0 + dy * 0.8 * tt;
        auto d2 = (tx - cx).pow(2) + (ty - cy).pow(2);
        auto blob = torch::exp(-d2 / (2 * radius * radius));  // [T, H, W]
        vid = vid + colour_gain * blob.unsqueeze(0);
      }
    } else {
      // Mode m of caption c: its own blob start positions (mode m's blobs start in the
      // sector of angle 2 pi m / modes), speed and colour layout; a row only jitters them.
      auto mgen = gen_for((uint64_t(sm.caption) << 20) ^ uint64_t(sm.mode) ^ 0xA11CEULL);
      const auto mode_gain = colour_gain * 0.5 + torch::randn({C, 1, 1, 1}, mgen) * 1.5;
      const double speed = 0.3 + 0.6 * torch::rand({1}, mgen).item<double>();
      const double angle0 = 6.283185307179586 * double(sm.mode) / double(o.modes);
      for (int64_t b = 0; b < blobs; ++b) {
        auto p = torch::rand({3}, mgen);
        auto j = torch::randn({3}, gen) * 0.03;
        const double a = angle0 + (p[0].item<double>() - 0.5) * 3.14159 / double(o.modes);
        const double r = 0.35 + 0.3 * p[1].item<double>();
        const double x0 = r * std::cos(a) - dx * 0.4 * speed + j[0].item<double>();
        const double y0 = r * std::sin(a) - dy * 0.4 * speed + j[1].item<double>();
        const double radius = 0.2 + 0.1 * p[2].item<double>();
        auto cx = x0 + dx * speed * tt, cy = y0 + dy * speed * tt;
        auto d2 = (tx - cx).pow(2) + (ty - cy).pow(2);
        auto blob = torch::exp(-d2 / (2 * radius * radius));  // [T, H, W]
        vid = vid + mode_gain * (1.0 + j[2].item<double>()) * blob.unsqueeze(0);
      }
    }
    vid = vid + o.detail * torch::randn({C, T, H, W}, gen);
    r.latent = denormalize_wan_latents(vid).contiguous();
    r.width = W * 8;
    r.height = H * 8;
    r.num_frames = T;
    r.fps = 16.0;
    r.duration_sec = double((T - 1) * 4 + 1) / 16.0;
  }

  // Text: one deterministic vector per word, plus an end token.
  std::vector<std::string> words;
  {
    std::istringstream is(r.caption);
    for (std::string w; is >> w;) words.push_back(w);
  }
  const int64_t real = int64_t(words.size()) + 1;
  const int64_t L = o.text_tokens > 0 ? o.text_tokens : real;
  auto text = o.dense_text ? torch::randn({L, o.text_dim}, gen_for(row_key ^ 0xD7ULL)) * 0.05
                           : torch::zeros({L, o.text_dim});
  for (int64_t k = 0; k < std::min(L, real); ++k) {
    uint64_t key = k + 1 < real ? fnv1a(words[size_t(k)].data(), words[size_t(k)].size()) : 0xE05ULL;
    text[k] = torch::randn({o.text_dim}, gen_for(key ^ 0x7e47ULL)) * 0.2;
  }
  r.text = text;
  return r;
}

std::vector<std::string> write_synthetic_dataset(const std::string& directory, int64_t rows,
                                                 const SynthOptions& options,
                                                 const WriterOptions& writer_options) {
  VQAD_CHECK(rows > 0, "synthetic data: rows must be positive, found ", rows);
  WriterOptions w = writer_options;
  w.kind = options.kind;
  ParquetDatasetWriter writer(directory, w);
  for (int64_t g = 0; g < rows; ++g) writer.add(synth_record(options, g));
  return writer.close();
}

SyntheticDataset::SyntheticDataset(int64_t rows, SynthOptions synth, DatasetOptions options)
    : rows_(rows), synth_(synth), options_(options) {
  VQAD_CHECK(rows_ > 0, "synthetic dataset: rows must be positive, found ", rows_);
  VQAD_CHECK(synth_.kind == options_.kind, "synthetic dataset: generator kind ", to_string(synth_.kind),
             " differs from the reader kind ", to_string(options_.kind));
  VQAD_CHECK(options_.text_len > 0, "synthetic dataset: text_len must be positive, found ", options_.text_len);
  VQAD_CHECK(options_.text_dim <= 0 || options_.text_dim == synth_.text_dim, "synthetic dataset: text_dim ",
             synth_.text_dim, " differs from the expected ", options_.text_dim);
  VQAD_CHECK(options_.num_latent_t >= 0 && options_.num_latent_t <= synth_.latent_t,
             "synthetic dataset: num_latent_t = ", options_.num_latent_t, " exceeds the generated ", synth_.latent_t,
             " latent frames");
  VQAD_CHECK(options_.cfg_rate >= 0.0 && options_.cfg_rate <= 1.0,
             "synthetic dataset: training_cfg_rate must lie in [0, 1], found ", options_.cfg_rate);
}

Sample SyntheticDataset::get(int64_t index) const {
  VQAD_CHECK(index >= 0 && index < rows_, "synthetic dataset: row ", index, " is out of range (", rows_, " rows)");
  ParquetRecord r = synth_record(synth_, index);
  Sample s;
  s.index = index;
  s.id = r.id;
  s.caption = r.caption;
  s.info.file_name = r.file_name;
  s.info.media_type = r.media_type;
  if (options_.kind == DataKind::T2V) {
    s.info.width = r.width;
    s.info.height = r.height;
    s.info.num_frames = r.num_frames;
    s.info.duration_sec = r.duration_sec;
    s.info.fps = r.fps;
    const int64_t Tk = options_.num_latent_t > 0 ? options_.num_latent_t : r.latent.size(1);
    auto raw = r.latent.to(torch::kFloat32).narrow(1, 0, Tk).contiguous().clone();
    s.latent = finish_latent(raw, options_);
  }
  auto text = r.text.to(torch::kFloat32).contiguous();
  fill_text(s, text.data_ptr<float>(), text.size(0), text.size(1), options_);
  return s;
}

Batch SyntheticDataset::get_batch(const std::vector<int64_t>& indices) const {
  std::vector<Sample> samples;
  samples.reserve(indices.size());
  for (auto i : indices) samples.push_back(get(i));
  return collate(std::move(samples));
}

std::string SyntheticDataset::root() const { return "synthetic://" + std::to_string(rows_); }

std::string SyntheticDataset::description() const {
  return "synthetic " + to_string(options_.kind) + ", " + std::to_string(rows_) + " rows in memory, latents [16, " +
         std::to_string(synth_.latent_t) + ", " + std::to_string(synth_.latent_h) + ", " +
         std::to_string(synth_.latent_w) + "]";
}

nlohmann::json SyntheticDataset::identity() const {
  return {{"kind", "synthetic"},
          {"schema", to_string(options_.kind)},
          {"root", root()},
          {"rows", rows_},
          {"latent", {synth_.latent_t, synth_.latent_h, synth_.latent_w}},
          {"text_dim", synth_.text_dim},
          {"synth_seed", synth_.seed},
          {"text_len", options_.text_len},
          {"num_latent_t", options_.num_latent_t},
          {"cfg_rate", options_.cfg_rate},
          {"seed", options_.seed}};
}

}  // namespace vqad::data
