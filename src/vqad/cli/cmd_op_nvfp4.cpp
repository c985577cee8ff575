// `vqad op nvfp4-quantize`: NVFP4-quantizes every F32/BF16 tensor of a
// safetensors file and writes codes, scale bytes and dequantized values, so
// users can check their own NVFP4 implementations against vqad's.
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "vqad/cli/commands.h"
#include "vqad/cli/op_inputs.h"
#include "vqad/core/error.h"
#include "vqad/core/safetensors.h"
#include "vqad/io/tensors.h"
#include "vqad/numerics/nvfp4.h"
#include "vqad/ops/nvfp4_fake_quant.h"

namespace vqad::cli {
namespace {

struct Nvfp4QuantizeArgs {
  std::string input, output, mode, device = "cpu";
  double amax = std::nan("");
  bool strict = false;
};

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

std::string float_str(float v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.9g", static_cast<double>(v));
  return buf;
}

torch::Device pick_device(const std::string& name) {
  if (name == "cpu") return torch::Device(torch::kCPU);
  VQAD_CHECK(name == "cuda", "--device: unknown device '", name, "' (valid: cpu, cuda)");
#ifdef VQAD_WITH_TORCH_CUDA
  VQAD_CHECK(torch::cuda::is_available(), "--device cuda: no CUDA device is visible");
  return torch::Device(torch::kCUDA, 0);
#else
  fail("--device cuda: this vqad build has no LibTorch CUDA support (build it on a GPU machine)");
#endif
}

int run_nvfp4_quantize(const Nvfp4QuantizeArgs& a) {
  const nvfp4::ScaleMode mode = nvfp4::parse_scale_mode(a.mode.c_str(), "--mode");
  float static_s_enc = 1.0f;
  if (mode == nvfp4::ScaleMode::kStatic) {
    VQAD_CHECK(!std::isnan(a.amax), "--mode static needs --amax A (the calibrated amax)");
    VQAD_CHECK(std::isfinite(a.amax) && a.amax > 0, "--amax: expected a finite value > 0, got ", a.amax);
    static_s_enc = nvfp4::encode_scale_from_amax(static_cast<float>(a.amax));
  } else {
    VQAD_CHECK(std::isnan(a.amax), "--amax is only used with --mode static (got --mode ", a.mode, ")");
  }
  const torch::Device device = pick_device(a.device);

  const st::File in = st::File::open(a.input);
  std::vector<std::pair<std::string, torch::Tensor>> out;
  std::map<std::string, std::string> meta = {{"format", "vqad nvfp4-quantize"},
                                             {"mode", nvfp4::scale_mode_name(mode)}};
  int quantized = 0;
  for (const std::string& name : in.names()) {
    const st::TensorInfo& info = in.info(name);
    if (info.dtype != st::DType::F32 && info.dtype != st::DType::BF16) {
      std::fprintf(stderr, "vqad: %s: skipping tensor '%s' (dtype %s; only F32 and BF16 are quantized)\n",
                   a.input.c_str(), name.c_str(), st::dtype_name(info.dtype));
      continue;
    }
    VQAD_CHECK(!info.shape.empty() && info.shape.back() % nvfp4::kBlock == 0, a.input, ": tensor '",
               name, "' has shape ", shape_str(info.shape),
               ": its last dim must be a multiple of 16 (NVFP4 blocks run along the last dim)");
    // BF16 -> F32 is exact, so quantizing in F32 gives the BF16 input's results.
    const torch::Tensor x = io::tensor_from(in, name).to(device, torch::kFloat).contiguous();
    check_finite_inputs(a.input, {{name, x}}, a.strict);
    const float s_enc = mode == nvfp4::ScaleMode::kStatic ? static_s_enc : 1.0f;
    const ops::Nvfp4Quantized q = ops::nvfp4_quantize(x, mode, s_enc);
    const torch::Tensor codes = ops::nvfp4_unpack_codes(q.packed_codes).view(x.sizes());
    const torch::Tensor values = ops::nvfp4_dequantize(q, torch::kFloat).view(x.sizes());
    out.emplace_back(name + ".codes", codes.to(torch::kCPU));
    out.emplace_back(name + ".scales", q.scales.to(torch::kCPU));
    out.emplace_back(name + ".dequant", values.to(torch::kCPU));
    const float used = q.s_enc.item<float>();
    meta["s_enc." + name] = float_str(used);
    std::printf("%s %s: s_enc %s\n", name.c_str(), shape_str(info.shape).c_str(), float_str(used).c_str());
    ++quantized;
  }
  VQAD_CHECK(quantized > 0, a.input, ": no F32 or BF16 tensor to quantize");
  io::save_safetensors(a.output, out, meta);
  std::printf("wrote %d tensors (%d quantized) to %s\n", static_cast<int>(out.size()), quantized,
              a.output.c_str());
  return 0;
}

}  // namespace

void register_nvfp4_commands(CLI::App& app) {
  CLI::App* op = op_command(app);
  auto args = std::make_shared<Nvfp4QuantizeArgs>();
  auto* sub = op->add_subcommand(
      "nvfp4-quantize",
      "NVFP4-quantize every F32/BF16 tensor along its last dim; writes <t>.codes (U8, one code per "
      "element, bit 3 = sign), <t>.scales (U8 E4M3 bytes, one per 16-block) and <t>.dequant (F32)");
  sub->add_option("input", args->input, "input .safetensors")->required();
  sub->add_option("output", args->output, "output .safetensors")->required();
  sub->add_option("--mode", args->mode,
                  "scale mode: unit (s_enc = 1) | dynamic (s_enc = 2688 / amax of each tensor) | "
                  "static (s_enc = 2688 / --amax)")
      ->required();
  sub->add_option("--amax", args->amax, "calibrated amax for --mode static");
  sub->add_option("--device", args->device, "cpu | cuda")->capture_default_str();
  sub->add_flag("--strict", args->strict, "refuse inputs holding NaN/Inf (default: warn)");
  set_action(sub, [args] { return run_nvfp4_quantize(*args); });
}

}  // namespace vqad::cli
