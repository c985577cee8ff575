// `vqad op attention`: runs one attention backend on tensors from a safetensors
// file and writes the output (and gradients) for comparing attention numerics
// across implementations. The VSA backends take the token grid (--grid T,H,W), the
// sparsity and the selection, an optional `gate` input (dgate out) and write the
// selected KV cubes per (batch, head, query cube) as sel_index / sel_count.
#include <torch/torch.h>

#include <array>
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
#include "vqad/ops/vsa_attention.h"

namespace vqad::cli {
namespace {

struct OpAttentionArgs {
  std::string input, output, backend, bwd_mode = "consistent", device = "cpu";
  int block_n = 128;
  bool no_quant_p = false, no_quant_v = false, no_quant_qk = false;
  // VSA
  std::string grid, selection = "top-k";
  double sparsity = -1.0, top_p = 1.0;
  bool strict = false;
};

// "T,H,W" -> three positive integers.
std::array<int64_t, 3> parse_grid(const std::string& s) {
  std::array<int64_t, 3> g{0, 0, 0};
  size_t pos = 0;
  for (int i = 0; i < 3; ++i) {
    const size_t end = i < 2 ? s.find(',', pos) : s.size();
    bool ok = end != std::string::npos && end > pos;
    if (ok) {
      const std::string part = s.substr(pos, end - pos);
      ok = part.find_first_not_of("0123456789") == std::string::npos && part.size() < 10;
      if (ok) g[i] = std::stoll(part);
      ok = ok && g[i] >= 1;
    }
    VQAD_CHECK(ok, "--grid: expected T,H,W (three positive integers, the token grid after patchify), found '",
               s, "'");
    pos = end + 1;
  }
  return g;
}

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
  const bool vsa = ops::is_vsa_backend(*backend);
  VQAD_CHECK(vsa || *backend == AttentionBackend::kAttnQatTrain || *backend == AttentionBackend::kTorchSdpa,
             "--backend ", a.backend,
             ": `vqad op attention` runs ATTN_QAT_TRAIN, TORCH_SDPA (dense reference math) and the VSA "
             "backends (VSA_TRAIN, VSA_TRAIN_C64, VSA_TRAIN_C128, VSA_QAT_TRAIN_C64, VSA_QAT_TRAIN_C128)");
  std::array<int64_t, 3> grid{0, 0, 0};
  ops::VsaOptions vopts;
  if (vsa) {
    VQAD_CHECK(!a.grid.empty(), "--backend ", a.backend, " needs --grid T,H,W (the token grid of q, k, v)");
    grid = parse_grid(a.grid);
    VQAD_CHECK(a.sparsity >= 0.0, "--backend ", a.backend, " needs --sparsity S (fraction of KV cubes skipped, in [0, 1))");
    VQAD_CHECK(a.sparsity < 1.0, "--sparsity: must be in [0, 1), found ", a.sparsity);
    VQAD_CHECK(a.top_p > 0.0 && a.top_p <= 1.0, "--top-p: must be in (0, 1], found ", a.top_p);
    VQAD_CHECK(a.block_n == 128, "--block-n: not used by the VSA backends (their KV tile is one 64-token "
               "physical block)");
    VQAD_CHECK(!a.no_quant_qk, "--no-quant-qk: not available for the VSA backends (VSA_TRAIN_* is the unquantized one)");
    vopts.sparsity = a.sparsity;
    vopts.selection = ops::parse_vsa_selection(a.selection, "--selection");
    vopts.top_p = a.top_p;
    vopts.quant_p = !a.no_quant_p;
    vopts.quant_v = !a.no_quant_v;
    vopts.bwd_mode = ops::parse_attn_qat_bwd_mode(a.bwd_mode);
  } else {
    VQAD_CHECK(a.grid.empty() && a.sparsity < 0.0, "--grid / --sparsity: only for the VSA backends (found --backend ",
               a.backend, ")");
  }
  VQAD_CHECK(a.device == "cpu" || a.device == "cuda", "--device: expected cpu or cuda, found '",
             a.device, "'");

  std::map<std::string, std::string> in_meta;
  auto tensors = io::load_safetensors(a.input, &in_meta);
  torch::Tensor q = take(tensors, "q", a.input, true);
  torch::Tensor k = take(tensors, "k", a.input, true);
  torch::Tensor v = take(tensors, "v", a.input, true);
  torch::Tensor d_o = take(tensors, "do", a.input, false);
  torch::Tensor gate = take(tensors, "gate", a.input, false);
  VQAD_CHECK(!gate.defined() || vsa, a.input, ": tensor 'gate' is only used by the VSA backends (found --backend ",
             a.backend, ")");
  if (gate.defined()) {
    VQAD_CHECK(gate.sizes() == q.sizes(), a.input, ": tensor 'gate' must have q's shape ", shape_str(q),
               ", found ", shape_str(gate));
  }
  check_finite_inputs(a.input, {{"q", q}, {"k", k}, {"v", v}, {"do", d_o}, {"gate", gate}}, a.strict);
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
  torch::Tensor gd = gate.defined() ? prep(gate) : torch::Tensor();

  ops::AttnQatOptions opts;
  opts.block_n = a.block_n;
  opts.bwd_mode = ops::parse_attn_qat_bwd_mode(a.bwd_mode);
  opts.quant_p = !a.no_quant_p;
  opts.quant_v = !a.no_quant_v;
  opts.quant_qk = !a.no_quant_qk;

  torch::Tensor o;
  vsa_ref::SelectionLists selection;
  if (vsa) {
    o = ops::vsa_attention(qd, kd, vd, gd, grid, *backend, vopts, &selection);
  } else if (*backend == AttentionBackend::kAttnQatTrain) {
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
    if (gd.defined()) out.emplace_back("dgate", gd.grad().to(torch::kCPU, torch::kFloat32));
  }
  if (vsa) {
    const auto& s = selection;
    out.emplace_back("sel_index", torch::from_blob(const_cast<int32_t*>(s.index.data()),
                                                   {s.batch, s.heads, s.num_q_cubes, s.max_kv}, torch::kInt32)
                                      .clone());
    out.emplace_back("sel_count",
                     torch::from_blob(const_cast<int32_t*>(s.count.data()), {s.batch, s.heads, s.num_q_cubes},
                                      torch::kInt32)
                         .clone());
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
  if (vsa) {
    const auto cube = ops::vsa_cube_of(*backend);
    meta["grid"] = std::to_string(grid[0]) + "," + std::to_string(grid[1]) + "," + std::to_string(grid[2]);
    meta["cube"] = std::to_string(cube.t) + "x" + std::to_string(cube.h) + "x" + std::to_string(cube.w);
    meta["sparsity"] = std::to_string(vopts.sparsity);
    meta["selection"] = ops::vsa_selection_name(vopts.selection);
    meta["top_p"] = std::to_string(vopts.top_p);
    meta["gate"] = gate.defined() ? "input" : "zero";
    if (ops::vsa_quantized(*backend)) {
      meta["bwd_mode"] = a.bwd_mode;
      meta["quant_p"] = vopts.quant_p ? "true" : "false";
      meta["quant_v"] = vopts.quant_v ? "true" : "false";
    }
  }
  io::save_safetensors(a.output, out, meta);
  std::string what = d_o.defined() ? "o, dq, dk, dv" : "o";
  if (d_o.defined() && gd.defined()) what += ", dgate";
  if (vsa) what += ", sel_index, sel_count";
  std::printf("%s: q %s k %s -> %s (%s)\n", attention_backend_name(*backend), shape_str(q).c_str(),
              shape_str(k).c_str(), a.output.c_str(), what.c_str());
  return 0;
}

}  // namespace

void register_op_attention_commands(CLI::App& app) {
  CLI::App* op = op_command(app);
  auto args = std::make_shared<OpAttentionArgs>();
  auto* sub = op->add_subcommand(
      "attention",
      "Run an attention backend on q, k, v [B, L, H, D] (and optional do) from a safetensors file; "
      "writes o (and dq, dk, dv) as F32; VSA backends also take an optional gate (dgate out) and write "
      "the selected cubes (sel_index [B, H, cubes, max_kv], sel_count [B, H, cubes], int32)");
  sub->add_option("input", args->input,
                  "input .safetensors with q, k, v (F32 or BF16), optional do and (VSA) gate")
      ->required();
  sub->add_option("output", args->output, "output .safetensors")->required();
  sub->add_option("--backend", args->backend,
                  "ATTN_QAT_TRAIN, TORCH_SDPA, VSA_TRAIN (= VSA_TRAIN_C64), VSA_TRAIN_C128, VSA_QAT_TRAIN_C64 or "
                  "VSA_QAT_TRAIN_C128")
      ->required();
  sub->add_option("--grid", args->grid, "VSA: token grid T,H,W of q, k, v (raster order, L = T*H*W)");
  sub->add_option("--sparsity", args->sparsity, "VSA: fraction of KV cubes skipped, in [0, 1)");
  sub->add_option("--selection", args->selection, "VSA: top-k | top-p")->capture_default_str();
  sub->add_option("--top-p", args->top_p, "VSA top-p: cumulative coarse probability to reach, (0, 1]")
      ->capture_default_str();
  sub->add_option("--block-n", args->block_n, "ATTN_QAT_TRAIN KV tile of the P quantization (multiple of 16)")
      ->capture_default_str();
  sub->add_option("--bwd-mode", args->bwd_mode, "ATTN_QAT_TRAIN dV mode: consistent | fastvideo")
      ->capture_default_str();
  sub->add_option("--device", args->device, "cpu | cuda")->capture_default_str();
  sub->add_flag("--no-quant-p", args->no_quant_p, "ATTN_QAT_TRAIN / VSA_QAT_TRAIN_*: do not quantize P");
  sub->add_flag("--no-quant-v", args->no_quant_v, "ATTN_QAT_TRAIN / VSA_QAT_TRAIN_*: do not quantize V");
  sub->add_flag("--no-quant-qk", args->no_quant_qk, "ATTN_QAT_TRAIN: do not quantize Q and K");
  sub->add_flag("--strict", args->strict, "refuse inputs holding NaN/Inf (default: warn)");
  set_action(sub, [args] { return run_op_attention(*args); });
}

}  // namespace vqad::cli
