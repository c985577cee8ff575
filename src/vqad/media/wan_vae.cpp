#include "vqad/media/wan_vae.h"

#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>

#include "vqad/core/error.h"
#include "vqad/data/latent_norm.h"
#include "vqad/io/tensors.h"

namespace vqad::media {
namespace fs = std::filesystem;
namespace F = torch::nn::functional;
using torch::indexing::Slice;

namespace {

// The causal convolutions keep this many trailing input frames between chunks.
constexpr int64_t kCacheFrames = 2;

std::string join_ints(const std::vector<int>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s + "]";
}

// Per-convolution cache slot of one decode: empty (first chunk), the "replicate" marker
// of the temporal upsamplers' first chunk, or the last input frames.
struct CacheSlot {
  enum class State { kEmpty, kReplicate, kFrames } state = State::kEmpty;
  torch::Tensor frames;
};
struct FeatureCache {
  std::vector<CacheSlot> slots;
  size_t next = 0;
  CacheSlot& take() {
    if (next == slots.size()) slots.emplace_back();
    return slots[next++];
  }
};

}  // namespace

// ---------------------------------------------------------------------------------------
// config
WanVaeConfig WanVaeConfig::wan21() {
  WanVaeConfig c;
  c.latents_mean.assign(data::kWanLatentMean.begin(), data::kWanLatentMean.end());
  c.latents_std.assign(data::kWanLatentStd.begin(), data::kWanLatentStd.end());
  return c;
}

WanVaeConfig WanVaeConfig::from_json_file(const std::string& path) {
  std::ifstream in(path);
  VQAD_CHECK(in.good(), "VAE config ", path, ": cannot open");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const std::exception& e) {
    fail("VAE config ", path, ": not valid JSON (", e.what(), ")");
  }
  VQAD_CHECK(j.is_object(), "VAE config ", path, ": expected a JSON object");
  WanVaeConfig c = wan21();
  auto num = [&](const char* key, int& out) {
    if (!j.contains(key)) return;
    VQAD_CHECK(j[key].is_number_integer(), "VAE config ", path, ": key ", key, " expected an integer, found ",
               j[key].dump());
    out = j[key].get<int>();
  };
  num("base_dim", c.base_dim);
  num("z_dim", c.z_dim);
  num("num_res_blocks", c.num_res_blocks);
  if (j.contains("decoder_base_dim") && !j["decoder_base_dim"].is_null()) {
    VQAD_CHECK(j["decoder_base_dim"].is_number_integer(), "VAE config ", path,
               ": key decoder_base_dim expected an integer or null");
    c.base_dim = j["decoder_base_dim"].get<int>();
  }
  if (j.contains("dim_mult")) c.dim_mult = j["dim_mult"].get<std::vector<int>>();
  if (j.contains("temperal_downsample")) c.temperal_downsample = j["temperal_downsample"].get<std::vector<bool>>();
  if (j.contains("latents_mean")) c.latents_mean = j["latents_mean"].get<std::vector<float>>();
  if (j.contains("latents_std")) c.latents_std = j["latents_std"].get<std::vector<float>>();
  // Options of other architectures: accepted only at the Wan2.1 value.
  auto require = [&](const char* key, const nlohmann::json& wan21_value) {
    if (!j.contains(key) || j[key] == wan21_value) return;
    fail("VAE config ", path, ": key ", key, " = ", j[key].dump(), " is not supported (the Wan2.1 decoder needs ",
         wan21_value.dump(), ")");
  };
  require("attn_scales", nlohmann::json::array());
  require("is_residual", false);
  require("patch_size", nullptr);
  require("in_channels", 3);
  require("out_channels", 3);
  require("scale_factor_spatial", 8);
  require("scale_factor_temporal", 4);
  require("clip_output", true);
  VQAD_CHECK(c.base_dim > 0 && c.z_dim > 0 && c.num_res_blocks >= 0, "VAE config ", path,
             ": base_dim, z_dim must be positive and num_res_blocks >= 0");
  VQAD_CHECK(c.dim_mult.size() >= 2, "VAE config ", path, ": dim_mult expected at least 2 entries, found ",
             join_ints(c.dim_mult));
  VQAD_CHECK(c.temperal_downsample.size() == c.dim_mult.size() - 1, "VAE config ", path,
             ": temperal_downsample expected ", c.dim_mult.size() - 1, " entries, found ",
             c.temperal_downsample.size());
  VQAD_CHECK(int(c.latents_mean.size()) == c.z_dim && int(c.latents_std.size()) == c.z_dim, "VAE config ", path,
             ": latents_mean / latents_std expected ", c.z_dim, " values each, found ", c.latents_mean.size(), " / ",
             c.latents_std.size());
  return c;
}

// ---------------------------------------------------------------------------------------
// layout of the decoder's tensors
namespace {

struct Layout {
  std::vector<int> dims;  // channel widths: [top] + reversed mults
  struct Up {
    int in_dim, out_dim;
    std::string upsample;  // "", "upsample2d", "upsample3d"
  };
  std::vector<Up> ups;
};

Layout layout_of(const WanVaeConfig& c) {
  Layout l;
  l.dims.push_back(c.base_dim * c.dim_mult.back());
  for (auto it = c.dim_mult.rbegin(); it != c.dim_mult.rend(); ++it) l.dims.push_back(c.base_dim * *it);
  // The decoder upsamples in time where the encoder downsampled, in reverse order.
  std::vector<bool> temporal_up(c.temperal_downsample.rbegin(), c.temperal_downsample.rend());
  const int n = int(c.dim_mult.size());
  for (int i = 0; i + 1 < int(l.dims.size()); ++i) {
    Layout::Up u;
    u.in_dim = i > 0 ? l.dims[i] / 2 : l.dims[i];  // the upsampler before halves the width
    u.out_dim = l.dims[i + 1];
    if (i != n - 1) u.upsample = temporal_up[i] ? "upsample3d" : "upsample2d";
    l.ups.push_back(u);
  }
  return l;
}

void add_conv3d(std::map<std::string, std::vector<int64_t>>& m, const std::string& p, int in, int out, int k) {
  m[p + ".weight"] = {out, in, k, k, k};
  m[p + ".bias"] = {out};
}
void add_resblock(std::map<std::string, std::vector<int64_t>>& m, const std::string& p, int in, int out) {
  m[p + ".norm1.gamma"] = {in, 1, 1, 1};
  add_conv3d(m, p + ".conv1", in, out, 3);
  m[p + ".norm2.gamma"] = {out, 1, 1, 1};
  add_conv3d(m, p + ".conv2", out, out, 3);
  if (in != out) add_conv3d(m, p + ".conv_shortcut", in, out, 1);
}

}  // namespace

std::map<std::string, std::vector<int64_t>> WanVaeDecoder::expected_shapes(const WanVaeConfig& c) {
  std::map<std::string, std::vector<int64_t>> m;
  const Layout l = layout_of(c);
  add_conv3d(m, "post_quant_conv", c.z_dim, c.z_dim, 1);
  add_conv3d(m, "decoder.conv_in", c.z_dim, l.dims[0], 3);
  const int d0 = l.dims[0];
  add_resblock(m, "decoder.mid_block.resnets.0", d0, d0);
  add_resblock(m, "decoder.mid_block.resnets.1", d0, d0);
  m["decoder.mid_block.attentions.0.norm.gamma"] = {d0, 1, 1};
  m["decoder.mid_block.attentions.0.to_qkv.weight"] = {3 * d0, d0, 1, 1};
  m["decoder.mid_block.attentions.0.to_qkv.bias"] = {3 * d0};
  m["decoder.mid_block.attentions.0.proj.weight"] = {d0, d0, 1, 1};
  m["decoder.mid_block.attentions.0.proj.bias"] = {d0};
  for (size_t i = 0; i < l.ups.size(); ++i) {
    const auto& u = l.ups[i];
    const std::string p = "decoder.up_blocks." + std::to_string(i);
    int cur = u.in_dim;
    for (int r = 0; r <= c.num_res_blocks; ++r) {
      add_resblock(m, p + ".resnets." + std::to_string(r), cur, u.out_dim);
      cur = u.out_dim;
    }
    if (!u.upsample.empty()) {
      m[p + ".upsamplers.0.resample.1.weight"] = {u.out_dim / 2, u.out_dim, 3, 3};
      m[p + ".upsamplers.0.resample.1.bias"] = {u.out_dim / 2};
      if (u.upsample == "upsample3d") {
        m[p + ".upsamplers.0.time_conv.weight"] = {2 * u.out_dim, u.out_dim, 3, 1, 1};
        m[p + ".upsamplers.0.time_conv.bias"] = {2 * u.out_dim};
      }
    }
  }
  const int last = l.dims.back();
  m["decoder.norm_out.gamma"] = {last, 1, 1, 1};
  add_conv3d(m, "decoder.conv_out", last, 3, 3);
  return m;
}

// ---------------------------------------------------------------------------------------
// loading
WanVaeDecoder::WanVaeDecoder(WanVaeConfig config, const std::map<std::string, torch::Tensor>& state,
                             torch::Device device, torch::ScalarType dtype, const std::string& where)
    : config_(std::move(config)), device_(device), dtype_(dtype) {
  VQAD_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16, "VAE ", where,
             ": decoder dtype must be float32 or bfloat16");
  const auto expected = expected_shapes(config_);
  std::vector<std::string> missing, unexpected, misshaped;
  for (const auto& [key, shape] : expected) {
    auto it = state.find(key);
    if (it == state.end()) {
      missing.push_back(key);
      continue;
    }
    if (it->second.sizes().vec() != shape) {
      misshaped.push_back(key + " " + std::string(c10::str(it->second.sizes())) + " (expected " +
                          std::string(c10::str(c10::IntArrayRef(shape))) + ")");
      continue;
    }
    VQAD_CHECK(it->second.is_floating_point(), "VAE ", where, ": tensor ", key, " is not floating point");
    w_[key] = it->second.to(device, dtype).contiguous();
  }
  for (const auto& [key, t] : state) {
    if (expected.count(key)) continue;
    if (key.rfind("encoder.", 0) == 0 || key.rfind("quant_conv.", 0) == 0) continue;  // the encoder half
    unexpected.push_back(key);
  }
  if (!missing.empty() || !unexpected.empty() || !misshaped.empty()) {
    std::string msg = "VAE " + where + ": weights do not match the decoder of its config:";
    auto list = [&](const char* what, const std::vector<std::string>& v) {
      if (v.empty()) return;
      msg += std::string(" ") + what + " (" + std::to_string(v.size()) + "): ";
      for (size_t i = 0; i < v.size() && i < 6; ++i) msg += (i ? ", " : "") + v[i];
      if (v.size() > 6) msg += ", ...";
      msg += ";";
    };
    list("missing", missing);
    list("unexpected", unexpected);
    list("wrong shape", misshaped);
    fail(msg);
  }
}

WanVaeDecoder WanVaeDecoder::load(const std::string& path, torch::Device device, torch::ScalarType dtype) {
  fs::path dir(path);
  if (fs::is_directory(dir / "vae")) dir /= "vae";
  VQAD_CHECK(fs::is_directory(dir), "VAE ", path, ": expected a directory holding config.json and "
             "diffusion_pytorch_model.safetensors (or a model root with vae/)");
  const fs::path cfg = dir / "config.json";
  VQAD_CHECK(fs::exists(cfg), "VAE ", dir.string(), ": config.json is missing");
  WanVaeConfig config = WanVaeConfig::from_json_file(cfg.string());
  std::map<std::string, torch::Tensor> state;
  const fs::path single = dir / "diffusion_pytorch_model.safetensors";
  const fs::path index = dir / "diffusion_pytorch_model.safetensors.index.json";
  if (fs::exists(single)) {
    state = io::load_safetensors(single.string());
  } else if (fs::exists(index)) {
    state = io::load_sharded(index.string());
  } else {
    fail("VAE ", dir.string(), ": diffusion_pytorch_model.safetensors (or its .index.json) is missing");
  }
  return WanVaeDecoder(std::move(config), state, device, dtype, dir.string());
}

// ---------------------------------------------------------------------------------------
// forward
namespace {

class Forward {
 public:
  Forward(const std::map<std::string, torch::Tensor>& w, const Layout& layout, int num_res_blocks)
      : w_(w), layout_(layout), num_res_blocks_(num_res_blocks) {}

  // x: one latent frame [B, z, 1, H, W] after post_quant_conv.
  torch::Tensor decoder(torch::Tensor x, FeatureCache& cache) {
    cache.next = 0;
    x = cached_conv("decoder.conv_in", x, cache);
    x = resblock("decoder.mid_block.resnets.0", x, cache);
    x = attention("decoder.mid_block.attentions.0", x);
    x = resblock("decoder.mid_block.resnets.1", x, cache);
    for (size_t i = 0; i < layout_.ups.size(); ++i) {
      const std::string p = "decoder.up_blocks." + std::to_string(i);
      for (int r = 0; r <= num_res_blocks_; ++r) x = resblock(p + ".resnets." + std::to_string(r), x, cache);
      if (!layout_.ups[i].upsample.empty()) x = resample(p + ".upsamplers.0", layout_.ups[i].upsample, x, cache);
    }
    x = torch::silu(rms_norm("decoder.norm_out", x, /*images=*/false));
    return cached_conv("decoder.conv_out", x, cache);
  }

  torch::Tensor conv1x1x1(const std::string& p, const torch::Tensor& x) {
    return torch::conv3d(x, w(p + ".weight"), w(p + ".bias"));
  }

 private:
  const torch::Tensor& w(const std::string& key) const { return w_.at(key); }

  // Causal 3D convolution (kernel k, padding k/2): (k - 1) frames of zeros, or the cached
  // frames, in front; symmetric zero padding in height and width.
  torch::Tensor causal_conv(const std::string& p, torch::Tensor x, const torch::Tensor& cached) {
    const auto& weight = w(p + ".weight");
    const int64_t kt = weight.size(2), kh = weight.size(3), kw = weight.size(4);
    int64_t front = kt - 1;
    if (cached.defined() && front > 0) {
      x = torch::cat({cached.to(x.dtype()), x}, 2);
      front -= cached.size(2);
    }
    const int64_t ph = kh / 2, pw = kw / 2;
    if (front > 0 || ph > 0 || pw > 0) x = F::pad(x, F::PadFuncOptions({pw, pw, ph, ph, front, 0}));
    return torch::conv3d(x, weight, w(p + ".bias"));
  }

  // A convolution whose last input frames are carried to the next chunk.
  torch::Tensor cached_conv(const std::string& p, const torch::Tensor& x, FeatureCache& cache) {
    CacheSlot& slot = cache.take();
    torch::Tensor carry = x.index({Slice(), Slice(), Slice(-kCacheFrames, torch::indexing::None)}).clone();
    if (carry.size(2) < kCacheFrames && slot.state == CacheSlot::State::kFrames)
      carry = torch::cat({slot.frames.index({Slice(), Slice(), Slice(-1, torch::indexing::None)}), carry}, 2);
    torch::Tensor y = causal_conv(p, x, slot.state == CacheSlot::State::kFrames ? slot.frames : torch::Tensor());
    slot.state = CacheSlot::State::kFrames;
    slot.frames = carry;
    return y;
  }

  // Diffusers' WanRMS_norm: L2-normalise over channels (eps 1e-12), * sqrt(C) * gamma.
  torch::Tensor rms_norm(const std::string& p, const torch::Tensor& x, bool images) {
    const auto& gamma = w(p + ".gamma");
    const double scale = std::sqrt(double(gamma.size(0)));
    (void)images;  // gamma's shape already broadcasts over [C, 1, 1(, 1)]
    return F::normalize(x, F::NormalizeFuncOptions().dim(1).eps(1e-12)) * scale * gamma;
  }

  torch::Tensor resblock(const std::string& p, torch::Tensor x, FeatureCache& cache) {
    torch::Tensor h = w_.count(p + ".conv_shortcut.weight") ? conv1x1x1(p + ".conv_shortcut", x) : x;
    x = torch::silu(rms_norm(p + ".norm1", x, false));
    x = cached_conv(p + ".conv1", x, cache);
    x = torch::silu(rms_norm(p + ".norm2", x, false));
    x = cached_conv(p + ".conv2", x, cache);
    return x + h;
  }

  // Single-head self-attention over the pixels of each frame.
  torch::Tensor attention(const std::string& p, const torch::Tensor& x) {
    const int64_t b = x.size(0), c = x.size(1), t = x.size(2), hh = x.size(3), ww = x.size(4);
    torch::Tensor y = x.permute({0, 2, 1, 3, 4}).reshape({b * t, c, hh, ww});
    y = rms_norm(p + ".norm", y, true);
    torch::Tensor qkv = torch::conv2d(y, w(p + ".to_qkv.weight"), w(p + ".to_qkv.bias"));
    qkv = qkv.reshape({b * t, 1, c * 3, hh * ww}).permute({0, 1, 3, 2}).contiguous();
    auto parts = qkv.chunk(3, -1);
    torch::Tensor o = at::scaled_dot_product_attention(parts[0], parts[1], parts[2]);
    o = o.squeeze(1).permute({0, 2, 1}).reshape({b * t, c, hh, ww});
    o = torch::conv2d(o, w(p + ".proj.weight"), w(p + ".proj.bias"));
    return o.view({b, t, c, hh, ww}).permute({0, 2, 1, 3, 4}) + x;
  }

  torch::Tensor resample(const std::string& p, const std::string& mode, torch::Tensor x, FeatureCache& cache) {
    const int64_t b = x.size(0), c = x.size(1), t = x.size(2);
    if (mode == "upsample3d") {
      CacheSlot& slot = cache.take();
      if (slot.state == CacheSlot::State::kEmpty) {
        // First chunk: the frame is not doubled in time.
        slot.state = CacheSlot::State::kReplicate;
      } else {
        torch::Tensor carry = x.index({Slice(), Slice(), Slice(-kCacheFrames, torch::indexing::None)}).clone();
        if (carry.size(2) < kCacheFrames) {
          torch::Tensor before = slot.state == CacheSlot::State::kFrames
                                     ? slot.frames.index({Slice(), Slice(), Slice(-1, torch::indexing::None)})
                                     : torch::zeros_like(carry);
          carry = torch::cat({before, carry}, 2);
        }
        torch::Tensor y = causal_conv(p + ".time_conv", x,
                                      slot.state == CacheSlot::State::kFrames ? slot.frames : torch::Tensor());
        slot.state = CacheSlot::State::kFrames;
        slot.frames = carry;
        const int64_t h = y.size(3), wd = y.size(4);
        y = y.reshape({b, 2, c, t, h, wd});
        y = torch::stack({y.select(1, 0), y.select(1, 1)}, 3);  // [b, c, t, 2, h, w]
        x = y.reshape({b, c, t * 2, h, wd});
      }
    }
    const int64_t tt = x.size(2), h = x.size(3), wd = x.size(4);
    torch::Tensor y = x.permute({0, 2, 1, 3, 4}).reshape({b * tt, c, h, wd});
    // nearest-exact at scale 2 repeats every pixel twice in each direction (in fp32, cast back).
    y = y.to(torch::kFloat32).repeat_interleave(2, 2).repeat_interleave(2, 3).to(x.dtype());
    y = torch::conv2d(y, w(p + ".resample.1.weight"), w(p + ".resample.1.bias"), 1, 1);
    return y.view({b, tt, y.size(1), y.size(2), y.size(3)}).permute({0, 2, 1, 3, 4});
  }

  const std::map<std::string, torch::Tensor>& w_;
  const Layout& layout_;
  int num_res_blocks_;
};

}  // namespace

torch::Tensor WanVaeDecoder::decode(const torch::Tensor& latents, bool normalized) const {
  VQAD_CHECK(latents.dim() == 5 && latents.size(1) == config_.z_dim, "VAE decode: latents expected [B, ",
             config_.z_dim, ", T, H, W], found ", c10::str(latents.sizes()));
  VQAD_CHECK(latents.size(2) >= 1 && latents.size(3) >= 1 && latents.size(4) >= 1,
             "VAE decode: latents have an empty dimension ", c10::str(latents.sizes()));
  torch::NoGradGuard no_grad;
  torch::Tensor z = latents.to(device_, torch::kFloat32);
  if (normalized) {
    auto opts = torch::TensorOptions().dtype(torch::kFloat32).device(device_);
    torch::Tensor mean = torch::tensor(config_.latents_mean, opts).view({1, -1, 1, 1, 1});
    torch::Tensor std = torch::tensor(config_.latents_std, opts).view({1, -1, 1, 1, 1});
    z = z * std + mean;
  }
  z = z.to(dtype_);
  const Layout layout = layout_of(config_);
  Forward fwd(w_, layout, config_.num_res_blocks);
  z = fwd.conv1x1x1("post_quant_conv", z);
  FeatureCache cache;
  std::vector<torch::Tensor> chunks;
  for (int64_t i = 0; i < z.size(2); ++i) {
    torch::Tensor out = fwd.decoder(z.index({Slice(), Slice(), Slice(i, i + 1)}), cache);
    chunks.push_back(out.to(torch::kFloat32));
  }
  return torch::cat(chunks, 2).clamp(-1.0, 1.0);
}

std::vector<uint8_t> video_to_rgb8(const torch::Tensor& video) {
  VQAD_CHECK(video.dim() == 4 && video.size(0) == 3, "video expected [3, F, H, W], found ",
             c10::str(video.sizes()));
  torch::Tensor v = ((video.to(torch::kCPU, torch::kFloat32) / 2 + 0.5).clamp(0, 1) * 255).round();
  v = v.to(torch::kUInt8).permute({1, 2, 3, 0}).contiguous();  // [F, H, W, 3]
  const uint8_t* p = v.data_ptr<uint8_t>();
  return std::vector<uint8_t>(p, p + v.numel());
}

}  // namespace vqad::media
