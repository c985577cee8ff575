#include "vqad/ops/vsa_attention.h"

#include <cstring>
#include <sstream>
#include <vector>

#include "vqad/core/error.h"
#include "vqad/ops/tensor_text.h"

#if defined(VQAD_WITH_CUDA) && defined(VQAD_WITH_TORCH_CUDA)
#include "vqad/ops/vsa_attention_cuda.h"
#define VQAD_VSA_CUDA_PATH 1
#endif

namespace vqad::ops {
namespace {

namespace ref = vqad::vsa_ref;
namespace aq = vqad::attn_qat_ref;

std::string call_text(AttentionBackend b, const torch::Tensor& q, const torch::Tensor& k,
                      const torch::Tensor& v, std::array<int64_t, 3> grid) {
  std::ostringstream os;
  os << "vsa_attention (" << attention_backend_name(b) << "): " << describe_qkv(q, k, v) << ", grid "
     << grid[0] << "x" << grid[1] << "x" << grid[2] << ", device " << q.device();
  return os.str();
}

void check_inputs(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                  const torch::Tensor& gate, std::array<int64_t, 3> grid, AttentionBackend b,
                  const VsaOptions& o) {
  VQAD_CHECK(is_vsa_backend(b), "vsa_attention: backend ", attention_backend_name(b), " is not a VSA backend");
  VQAD_CHECK(q.defined() && k.defined() && v.defined(), "vsa_attention (", attention_backend_name(b),
             "): q, k and v must be defined");
  const std::string what = call_text(b, q, k, v, grid);
  VQAD_CHECK(q.dim() == 4 && q.sizes() == k.sizes() && q.sizes() == v.sizes(), what,
             ": expected q, k, v of one shape [B, L, H, D] (self-attention over the token grid)");
  VQAD_CHECK(q.size(0) >= 1 && q.size(2) >= 1, what, ": empty batch or heads");
  VQAD_CHECK(q.size(3) >= 16 && q.size(3) % 16 == 0, what,
             ": head_dim must be a positive multiple of 16 (NVFP4 blocks along D), found ", q.size(3));
  VQAD_CHECK(grid[0] >= 1 && grid[1] >= 1 && grid[2] >= 1, what,
             ": the token grid (T, H, W after patchify) is not set; a VSA layer needs it");
  VQAD_CHECK(grid[0] * grid[1] * grid[2] == q.size(1), what, ": the grid holds ", grid[0] * grid[1] * grid[2],
             " tokens but L = ", q.size(1));
  for (const auto* t : {&q, &k, &v})
    VQAD_CHECK(t->is_floating_point(), what, ": expected floating-point q, k, v, found ", t->scalar_type());
  VQAD_CHECK(q.device() == k.device() && q.device() == v.device(), what,
             ": q, k and v must be on one device, found ", q.device(), ", ", k.device(), ", ", v.device());
  if (gate.defined()) {
    VQAD_CHECK(gate.sizes() == q.sizes(), what, ": gate must have q's shape, found ", shape_str(gate));
    VQAD_CHECK(gate.device() == q.device(), what, ": gate is on ", gate.device());
    VQAD_CHECK(gate.is_floating_point(), what, ": gate must be floating point, found ", gate.scalar_type());
  }
  VQAD_CHECK(o.sparsity >= 0.0 && o.sparsity < 1.0, what, ": sparsity must be in [0, 1), found ", o.sparsity);
  VQAD_CHECK(o.top_p > 0.0 && o.top_p <= 1.0, what, ": top_p must be in (0, 1], found ", o.top_p);
}

// BF16-valued fp32 copy with d contiguous (training computes in BF16; the reference takes floats).
torch::Tensor as_bf16_valued_float(const torch::Tensor& t) {
  torch::Tensor r = t.to(torch::kBFloat16).to(torch::kFloat32);
  if (r.stride(3) != 1) r = r.contiguous();
  return r;
}
aq::ConstView cview(const torch::Tensor& t) {
  if (!t.defined()) return {};
  return {t.data_ptr<float>(), t.stride(0), t.stride(1), t.stride(2)};
}
aq::View view(torch::Tensor& t) {
  if (!t.defined()) return {};
  return {t.data_ptr<float>(), t.stride(0), t.stride(1), t.stride(2)};
}

torch::Tensor to_tensor(const std::vector<float>& v, std::vector<int64_t> shape) {
  torch::Tensor t = torch::empty(shape, torch::kFloat32);
  if (!v.empty()) std::memcpy(t.data_ptr<float>(), v.data(), v.size() * sizeof(float));
  return t;
}
torch::Tensor to_tensor(const std::vector<int32_t>& v, std::vector<int64_t> shape) {
  torch::Tensor t = torch::empty(shape, torch::kInt32);
  if (!v.empty()) std::memcpy(t.data_ptr<int32_t>(), v.data(), v.size() * sizeof(int32_t));
  return t;
}
template <typename T>
std::vector<T> to_vector(const torch::Tensor& t) {
  const torch::Tensor c = t.contiguous();
  return std::vector<T>(c.data_ptr<T>(), c.data_ptr<T>() + c.numel());
}

// Non-tensor arguments of one call (travel through ctx->saved_data).
struct Call {
  AttentionBackend backend;
  VsaOptions opts;
  std::array<int64_t, 3> grid;
  ref::SelectionLists* selection;
};

void save_call(torch::autograd::AutogradContext* ctx, const Call& c, const torch::Tensor& q,
               const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& gate) {
  auto& s = ctx->saved_data;
  s["backend"] = static_cast<int64_t>(c.backend);
  s["sparsity"] = c.opts.sparsity;
  s["top_p_mode"] = c.opts.selection == ref::Selection::kTopP;
  s["top_p"] = c.opts.top_p;
  s["quant_p"] = c.opts.quant_p;
  s["quant_v"] = c.opts.quant_v;
  s["fastvideo_bwd"] = c.opts.bwd_mode == AttnQatBwdMode::kFastVideo;
  s["grid_t"] = c.grid[0];
  s["grid_h"] = c.grid[1];
  s["grid_w"] = c.grid[2];
  s["q_dtype"] = static_cast<int64_t>(q.scalar_type());
  s["k_dtype"] = static_cast<int64_t>(k.scalar_type());
  s["v_dtype"] = static_cast<int64_t>(v.scalar_type());
  s["gate_dtype"] = static_cast<int64_t>(gate.defined() ? gate.scalar_type() : q.scalar_type());
}

Call load_call(torch::autograd::AutogradContext* ctx) {
  auto& s = ctx->saved_data;
  Call c;
  c.backend = static_cast<AttentionBackend>(s["backend"].toInt());
  c.opts.sparsity = s["sparsity"].toDouble();
  c.opts.selection = s["top_p_mode"].toBool() ? ref::Selection::kTopP : ref::Selection::kTopK;
  c.opts.top_p = s["top_p"].toDouble();
  c.opts.quant_p = s["quant_p"].toBool();
  c.opts.quant_v = s["quant_v"].toBool();
  c.opts.bwd_mode = s["fastvideo_bwd"].toBool() ? AttnQatBwdMode::kFastVideo : AttnQatBwdMode::kConsistent;
  c.grid = {s["grid_t"].toInt(), s["grid_h"].toInt(), s["grid_w"].toInt()};
  c.selection = nullptr;
  return c;
}

torch::ScalarType dtype_of(torch::autograd::AutogradContext* ctx, const char* key) {
  return static_cast<torch::ScalarType>(ctx->saved_data[key].toInt());
}

ref::Tiling tiling_of(const Call& c) {
  return ref::make_tiling(c.grid[0], c.grid[1], c.grid[2], vsa_cube_of(c.backend));
}

// What the forward keeps for the backward, after the inputs (q, k, v, gate): one list
// order per path, packed and unpacked in one place each.
constexpr size_t kSavedInputs = 4;

std::vector<torch::Tensor> pack_saved(const ref::Saved& saved, int64_t B, int64_t L, int64_t H, int64_t D,
                                      int64_t nc) {
  const auto& cs = saved.coarse;
  const auto& sel = saved.selection;
  return {to_tensor(saved.o_fine_hp, {B, L, H, D}),
          to_tensor(saved.m, {B, H, L}),
          to_tensor(saved.l, {B, H, L}),
          to_tensor(sel.index, {B, H, nc, sel.max_kv}),
          to_tensor(sel.count, {B, H, nc}),
          to_tensor(cs.q_c, {B, H, nc, D}),
          to_tensor(cs.k_c, {B, H, nc, D}),
          to_tensor(cs.v_c, {B, H, nc, D}),
          to_tensor(cs.scores, {B, H, nc, nc}),
          to_tensor(cs.probs, {B, H, nc, nc}),
          to_tensor(cs.out_c, {B, H, nc, D})};
}

ref::Saved unpack_saved(const std::vector<torch::Tensor>& sv, int64_t B, int64_t H) {
  const torch::Tensor* t = sv.data() + kSavedInputs;
  ref::Saved saved;
  saved.o_fine_hp = to_vector<float>(t[0]);
  saved.m = to_vector<float>(t[1]);
  saved.l = to_vector<float>(t[2]);
  saved.selection.batch = B;
  saved.selection.heads = H;
  saved.selection.num_q_cubes = t[3].size(2);
  saved.selection.max_kv = t[3].size(3);
  saved.selection.index = to_vector<int32_t>(t[3]);
  saved.selection.count = to_vector<int32_t>(t[4]);
  saved.coarse.q_c = to_vector<float>(t[5]);
  saved.coarse.k_c = to_vector<float>(t[6]);
  saved.coarse.v_c = to_vector<float>(t[7]);
  saved.coarse.scores = to_vector<float>(t[8]);
  saved.coarse.probs = to_vector<float>(t[9]);
  saved.coarse.out_c = to_vector<float>(t[10]);
  return saved;
}

#ifdef VQAD_VSA_CUDA_PATH
std::vector<torch::Tensor> pack_saved(const vsa_cuda::Saved& s) {
  return {s.tiled_q, s.tiled_k, s.tiled_v, s.o_fine_hp, s.m,   s.l,    s.sel_index,
          s.sel_count, s.q_c, s.k_c, s.v_c, s.probs, s.out_c};
}

vsa_cuda::Saved unpack_saved_cuda(const std::vector<torch::Tensor>& sv) {
  const torch::Tensor* t = sv.data() + kSavedInputs;
  vsa_cuda::Saved s;
  s.tiled_q = t[0];
  s.tiled_k = t[1];
  s.tiled_v = t[2];
  s.o_fine_hp = t[3];
  s.m = t[4];
  s.l = t[5];
  s.sel_index = t[6];
  s.sel_count = t[7];
  s.q_c = t[8];
  s.k_c = t[9];
  s.v_c = t[10];
  s.probs = t[11];
  s.out_c = t[12];
  return s;
}
#endif

std::vector<torch::Tensor> with_inputs(std::vector<torch::Tensor> inputs, std::vector<torch::Tensor> rest) {
  inputs.insert(inputs.end(), std::make_move_iterator(rest.begin()), std::make_move_iterator(rest.end()));
  return inputs;
}

class VsaFunction : public torch::autograd::Function<VsaFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& q,
                               const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& gate_arg,
                               const Call& call) {
    // No gate arrives as a 0-element placeholder (autograd inputs must be defined tensors).
    const torch::Tensor gate = gate_arg.numel() == 0 ? torch::Tensor() : gate_arg;
    const ref::Tiling tiling = tiling_of(call);
    const ref::Options ro = vsa_ref_options(call.backend, call.opts);
    save_call(ctx, call, q, k, v, gate);
    if (q.device().is_cpu()) {
      torch::Tensor q32 = as_bf16_valued_float(q), k32 = as_bf16_valued_float(k), v32 = as_bf16_valued_float(v);
      torch::Tensor g32 = gate.defined() ? as_bf16_valued_float(gate) : torch::Tensor();
      const int64_t B = q.size(0), L = q.size(1), H = q.size(2), D = q.size(3), nc = tiling.num_cubes;
      const ref::Dims dims{B, H, D};
      torch::Tensor o = torch::empty({B, L, H, D}, torch::kFloat32);
      ref::Saved saved;
      ref::forward(dims, tiling, cview(q32), cview(k32), cview(v32), cview(g32), ro, view(o), &saved);
      ctx->save_for_backward(with_inputs({q32, k32, v32, g32}, pack_saved(saved, B, L, H, D, nc)));
      if (call.selection != nullptr) *call.selection = saved.selection;
      return o.to(q.scalar_type());
    }
#ifdef VQAD_VSA_CUDA_PATH
    if (q.is_cuda()) {
      // CUDA DISPATCH POINT: the VSA kernels (ops/vsa_attention_cuda.h); they refuse
      // unsupported devices and shapes rather than substitute another path.
      vsa_cuda::Saved s;
      torch::Tensor o = vsa_cuda::forward(q, k, v, gate, tiling, ro, &s);
      ctx->save_for_backward(with_inputs({q, k, v, gate}, pack_saved(s)));
      if (call.selection != nullptr) *call.selection = vsa_cuda::selection_to_host(s);
      return o;
    }
#endif
    fail(call_text(call.backend, q, k, v, call.grid), ": no VSA kernel for device ", q.device(),
         " in this build (the CPU reference runs on CPU tensors; the CUDA path needs a build with "
         "the VSA kernels); VSA never falls back to another attention path");
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const Call call = load_call(ctx);
    const ref::Tiling tiling = tiling_of(call);
    const ref::Options ro = vsa_ref_options(call.backend, call.opts);
    auto sv = ctx->get_saved_variables();
    const auto q_dtype = dtype_of(ctx, "q_dtype"), k_dtype = dtype_of(ctx, "k_dtype");
    const auto v_dtype = dtype_of(ctx, "v_dtype"), g_dtype = dtype_of(ctx, "gate_dtype");
    torch::Tensor d_o = grads[0];
    const torch::Tensor& q0 = sv[0];
    VQAD_CHECK(d_o.defined() && d_o.sizes() == q0.sizes(), "vsa_attention backward: expected dO of shape ",
               shape_str(q0), ", found ", d_o.defined() ? shape_str(d_o) : std::string("undefined"));
#ifdef VQAD_VSA_CUDA_PATH
    if (q0.is_cuda()) {
      const vsa_cuda::Saved s = unpack_saved_cuda(sv);
      vsa_cuda::Grads g = vsa_cuda::backward(sv[0], sv[1], sv[2], sv[3], s, d_o, tiling, ro);
      return {g.dq.to(q_dtype), g.dk.to(k_dtype), g.dv.to(v_dtype),
              sv[3].defined() ? g.dgate.to(g_dtype) : torch::Tensor(), torch::Tensor()};
    }
#endif
    torch::Tensor q32 = sv[0], k32 = sv[1], v32 = sv[2], g32 = sv[3];
    const int64_t B = q32.size(0), L = q32.size(1), H = q32.size(2), D = q32.size(3);
    const ref::Saved saved = unpack_saved(sv, B, H);
    d_o = d_o.to(torch::kCPU).to(torch::kFloat32);
    if (d_o.stride(3) != 1) d_o = d_o.contiguous();
    auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
    torch::Tensor dq = torch::zeros({B, L, H, D}, f32), dk = torch::zeros({B, L, H, D}, f32);
    torch::Tensor dv = torch::zeros({B, L, H, D}, f32);
    torch::Tensor dgate = g32.defined() ? torch::zeros({B, L, H, D}, f32) : torch::Tensor();
    ref::backward(ref::Dims{B, H, D}, tiling, cview(q32), cview(k32), cview(v32), cview(g32), saved, cview(d_o),
                  ro, view(dq), view(dk), view(dv), view(dgate));
    return {dq.to(q_dtype), dk.to(k_dtype), dv.to(v_dtype), g32.defined() ? dgate.to(g_dtype) : torch::Tensor(),
            torch::Tensor()};
  }
};

}  // namespace

bool vsa_cuda_path_built() {
#ifdef VQAD_VSA_CUDA_PATH
  return true;
#else
  return false;
#endif
}

bool is_vsa_backend(AttentionBackend b) {
  switch (b) {
    case AttentionBackend::kVsaTrain:
    case AttentionBackend::kVsaTrainC128:
    case AttentionBackend::kVsaQatTrainC64:
    case AttentionBackend::kVsaQatTrainC128:
      return true;
    default:
      return false;
  }
}

vsa_ref::CubeShape vsa_cube_of(AttentionBackend b) {
  switch (b) {
    case AttentionBackend::kVsaTrain:
    case AttentionBackend::kVsaQatTrainC64:
      return vsa_ref::kCubeC64;
    case AttentionBackend::kVsaTrainC128:
    case AttentionBackend::kVsaQatTrainC128:
      return vsa_ref::kCubeC128;
    default:
      fail("attention backend ", attention_backend_name(b), " is not a VSA backend (no cube shape)");
  }
}

bool vsa_quantized(AttentionBackend b) {
  return b == AttentionBackend::kVsaQatTrainC64 || b == AttentionBackend::kVsaQatTrainC128;
}

vsa_ref::Options vsa_ref_options(AttentionBackend b, const VsaOptions& o) {
  vsa_ref::Options r;
  r.cube = vsa_cube_of(b);
  r.sparsity = o.sparsity;
  r.selection = o.selection;
  r.top_p = o.top_p;
  r.quantize = vsa_quantized(b);
  r.quant_p = o.quant_p;
  r.quant_v = o.quant_v;
  r.bwd_mode = o.bwd_mode == AttnQatBwdMode::kFastVideo ? attn_qat_ref::BwdMode::kFastVideo
                                                         : attn_qat_ref::BwdMode::kConsistent;
  r.tile_blocks = vsa_tile_blocks(r.cube);
  r.softmax_scale = 0.0f;
  return r;
}

vsa_ref::Selection parse_vsa_selection(const std::string& s, const std::string& where) {
  if (s == "top-k") return vsa_ref::Selection::kTopK;
  if (s == "top-p") return vsa_ref::Selection::kTopP;
  fail(where, ": unknown VSA selection '", s, "' (valid: top-k, top-p)");
}

const char* vsa_selection_name(vsa_ref::Selection s) {
  return s == vsa_ref::Selection::kTopP ? "top-p" : "top-k";
}

torch::Tensor vsa_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                            const torch::Tensor& gate, std::array<int64_t, 3> grid, AttentionBackend backend,
                            const VsaOptions& opts, vsa_ref::SelectionLists* selection) {
  check_inputs(q, k, v, gate, grid, backend, opts);
#ifdef VQAD_VSA_CUDA_PATH
  // No graph is recorded (grad mode off, as in the first pass of an activation-checkpointed
  // block, or no input needs a gradient): nothing is kept for a backward, and the fine
  // stage runs without the O_hp product and the m, l statistics that only the backward
  // reads. The output and the selection are the same bits as with a graph (GPU test
  // VsaOpCuda.NoGradForwardIsTheSameBits).
  const bool graph = torch::GradMode::is_enabled() &&
                     (q.requires_grad() || k.requires_grad() || v.requires_grad() ||
                      (gate.defined() && gate.requires_grad()));
  if (q.is_cuda() && !graph && !opts.full_forward_without_grad) {
    const Call call{backend, opts, grid, selection};
    vsa_cuda::Saved s;
    torch::Tensor o =
        vsa_cuda::forward(q, k, v, gate, tiling_of(call), vsa_ref_options(backend, opts), &s, /*for_backward=*/false);
    if (selection != nullptr) *selection = vsa_cuda::selection_to_host(s);
    return o;
  }
#endif
  const torch::Tensor gate_arg = gate.defined() ? gate : torch::empty({0}, q.options().requires_grad(false));
  return VsaFunction::apply(q, k, v, gate_arg, Call{backend, opts, grid, selection});
}

}  // namespace vqad::ops
