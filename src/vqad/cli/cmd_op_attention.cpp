// `vqad op attention`: runs one attention backend on tensors from a safetensors
// file and writes the output (and gradients) for comparing attention numerics
// across implementations.
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <map>
#include <string>

#include "vqad/cli/commands.h"
#include "vqad/cli/op_inputs.h"
#include "vqad/core/attention_backend.h"
#include "vqad/core/error.h"
#include "vqad/io/tensors.h"
#include "vqad/ops/attention_qat.h"

namespace vqad::cli {
namespace {

struct OpAttentionArgs {
  std::string input, output, backend, bwd_mode = "consistent", device = "cpu";
  int block_n = 128;
  bool no_quant_p = false, no_quant_v = false, no_quant_qk = false;
  bool strict = false;
};

std::string shape_str(const torch::Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + "]";
}

torch::Tensor take(std::map<std::string, torch::Tensor>& tensors, const std::string& name,
                   const std::string& file, bool required) {
  auto it = tensors.find(name);
  if (it == tensors.end()) {
    VQAD_CHECK(!required, file, ": missing tensor '", name, "' (expected q, k, v [B, L, H, D] and optional do)");
    return {};
  }
  const torch::Tensor& t = it->second;
  VQAD_CHECK(t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kBFloat16, file,
             ": tensor '", name, "' must be F32 or BF16, found ", t.scalar_type());
  VQAD_CHECK(t.dim() == 4, file, ": tensor '", name, "' must be [B, L, H, D], found shape ",
             shape_str(t));
  return t;
}

// Dense attention, the CPU math of TORCH_SDPA: bf16 operands, fp32 scores,
// softmax and products.
torch::Tensor dense_bf16(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  auto cast = [](const torch::Tensor& t) {
    return t.to(torch::kBFloat16).to(torch::kFloat32).permute({0, 2, 1, 3});
  };
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
  torch::Tensor p = torch::softmax(torch::matmul(cast(q), cast(k).transpose(-1, -2)) * scale, -1);
  return torch::matmul(p, cast(v)).permute({0, 2, 1, 3});
}

int run_op_attention(const OpAttentionArgs& a) {
  const auto backend = parse_attention_backend(a.backend);
  VQAD_CHECK(backend.has_value(), "--backend: unknown attention backend '", a.backend,
             "' (valid: ", attention_backend_choices(), ")");
  VQAD_CHECK(*backend == AttentionBackend::kAttnQatTrain || *backend == AttentionBackend::kTorchSdpa,
             "--backend ", a.backend,
             ": `vqad op attention` runs ATTN_QAT_TRAIN and TORCH_SDPA (dense reference math)");
  VQAD_CHECK(a.device == "cpu" || a.device == "cuda", "--device: expected cpu or cuda, found '",
             a.device, "'");

  std::map<std::string, std::string> in_meta;
  auto tensors = io::load_safetensors(a.input, &in_meta);
  torch::Tensor q = take(tensors, "q", a.input, true);
  torch::Tensor k = take(tensors, "k", a.input, true);
  torch::Tensor v = take(tensors, "v", a.input, true);
  torch::Tensor d_o = take(tensors, "do", a.input, false);
  check_finite_inputs(a.input, {{"q", q}, {"k", k}, {"v", v}, {"do", d_o}}, a.strict);
  VQAD_CHECK(k.sizes() == v.sizes(), a.input, ": k and v must have the same shape, found k ",
             shape_str(k), ", v ", shape_str(v));
  VQAD_CHECK(q.size(0) == k.size(0) && q.size(2) == k.size(2) && q.size(3) == k.size(3), a.input,
             ": q ", shape_str(q), " and k ", shape_str(k), " must agree in B, H and D");
  if (d_o.defined()) {
    VQAD_CHECK(d_o.sizes() == q.sizes(), a.input, ": tensor 'do' must have q's shape ",
               shape_str(q), ", found ", shape_str(d_o));
  }

  torch::Device device(torch::kCPU);
  if (a.device == "cuda") {
    VQAD_CHECK(torch::cuda::is_available(), "--device cuda: no CUDA device is available to this build");
    device = torch::Device(torch::kCUDA, 0);
  }
  // Computed in BF16 as in training; F32 inputs are rounded once here.
  auto prep = [&](const torch::Tensor& t) {
    return t.to(device).to(torch::kBFloat16).detach().requires_grad_(d_o.defined());
  };
  torch::Tensor qd = prep(q), kd = prep(k), vd = prep(v);

  ops::AttnQatOptions opts;
  opts.block_n = a.block_n;
  opts.bwd_mode = ops::parse_attn_qat_bwd_mode(a.bwd_mode);
  opts.quant_p = !a.no_quant_p;
  opts.quant_v = !a.no_quant_v;
  opts.quant_qk = !a.no_quant_qk;

  torch::Tensor o;
  if (*backend == AttentionBackend::kAttnQatTrain) {
    o = ops::attention_qat(qd, kd, vd, opts);
  } else {
    VQAD_CHECK(device.is_cpu(), "--backend TORCH_SDPA: `vqad op attention` runs the dense CPU math "
               "only; use --device cpu");
    o = dense_bf16(qd, kd, vd);
  }

  std::vector<std::pair<std::string, torch::Tensor>> out;
  out.emplace_back("o", o.detach().to(torch::kCPU, torch::kFloat32));
  if (d_o.defined()) {
    o.backward(d_o.to(device).to(o.scalar_type()));
    out.emplace_back("dq", qd.grad().to(torch::kCPU, torch::kFloat32));
    out.emplace_back("dk", kd.grad().to(torch::kCPU, torch::kFloat32));
    out.emplace_back("dv", vd.grad().to(torch::kCPU, torch::kFloat32));
  }
  std::map<std::string, std::string> meta = {
      {"backend", attention_backend_name(*backend)},
      {"device", a.device},
      {"compute_dtype", "bf16"},
  };
  if (*backend == AttentionBackend::kAttnQatTrain) {
    meta["block_n"] = std::to_string(opts.block_n);
    meta["bwd_mode"] = a.bwd_mode;
    meta["quant_p"] = opts.quant_p ? "true" : "false";
    meta["quant_v"] = opts.quant_v ? "true" : "false";
    meta["quant_qk"] = opts.quant_qk ? "true" : "false";
  }
  io::save_safetensors(a.output, out, meta);
  std::printf("%s: q %s k %s -> %s (%s%s)\n", attention_backend_name(*backend),
              shape_str(q).c_str(), shape_str(k).c_str(), a.output.c_str(),
              d_o.defined() ? "o, dq, dk, dv" : "o", "");
  return 0;
}

}  // namespace

void register_op_attention_commands(CLI::App& app) {
  CLI::App* op = op_command(app);
  auto args = std::make_shared<OpAttentionArgs>();
  auto* sub = op->add_subcommand(
      "attention",
      "Run an attention backend on q, k, v [B, L, H, D] (and optional do) from a safetensors file; "
      "writes o (and dq, dk, dv) as F32");
  sub->add_option("input", args->input, "input .safetensors with q, k, v (F32 or BF16), optional do")
      ->required();
  sub->add_option("output", args->output, "output .safetensors")->required();
  sub->add_option("--backend", args->backend, "ATTN_QAT_TRAIN or TORCH_SDPA")->required();
  sub->add_option("--block-n", args->block_n, "ATTN_QAT_TRAIN KV tile of the P quantization (multiple of 16)")
      ->capture_default_str();
  sub->add_option("--bwd-mode", args->bwd_mode, "ATTN_QAT_TRAIN dV mode: consistent | fastvideo")
      ->capture_default_str();
  sub->add_option("--device", args->device, "cpu | cuda")->capture_default_str();
  sub->add_flag("--no-quant-p", args->no_quant_p, "ATTN_QAT_TRAIN: do not quantize P");
  sub->add_flag("--no-quant-v", args->no_quant_v, "ATTN_QAT_TRAIN: do not quantize V");
  sub->add_flag("--no-quant-qk", args->no_quant_qk, "ATTN_QAT_TRAIN: do not quantize Q and K");
  sub->add_flag("--strict", args->strict, "refuse inputs holding NaN/Inf (default: warn)");
  set_action(sub, [args] { return run_op_attention(*args); });
}

}  // namespace vqad::cli
