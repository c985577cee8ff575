#include "vqad/ops/vsa_attention_cuda.h"

#ifdef VQAD_WITH_TORCH_CUDA

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "vqad/core/error.h"
#include "vqad/kernels/vsa/vsa_kernels.h"
#include "vqad/ops/vsa_attention.h"
#include "vqad/ops/tensor_text.h"

namespace vqad::ops::vsa_cuda {
namespace {

namespace kv = vqad::kernels::vsa;

// The CPU op (ops/vsa_attention.h) and the kernels must agree on tile_blocks per cube.
static_assert(kv::kVsaTileBlocksC128 == kVsaTileBlocksC128 && kv::kVsaTileBlocksC64 == kVsaTileBlocksC64 &&
                  kv::vsa_tile_blocks(2) == kVsaTileBlocksC128 && kv::vsa_tile_blocks(1) == kVsaTileBlocksC64,
              "tile_blocks of the CUDA kernels and of the CPU op differ");

constexpr const char* kOp = "vsa_attention (VSA, CUDA)";

std::string device_str(const torch::Tensor& t) {
  const cudaDeviceProp* prop = at::cuda::getDeviceProperties(t.get_device());
  std::ostringstream os;
  os << t.device() << " (" << prop->name << ", sm_" << prop->major << prop->minor << ")";
  return os.str();
}

std::string grid_str(const vsa_ref::Tiling& t) {
  return std::to_string(t.grid_t) + "x" + std::to_string(t.grid_h) + "x" + std::to_string(t.grid_w) + " cube " +
         std::to_string(t.cube.t) + "x" + std::to_string(t.cube.h) + "x" + std::to_string(t.cube.w);
}

bool layout_ok(const torch::Tensor& t) {
  return t.scalar_type() == torch::kBFloat16 && t.stride(3) == 1 && t.stride(0) % 8 == 0 && t.stride(1) % 8 == 0 &&
         t.stride(2) % 8 == 0 && t.stride(0) >= 0 && t.stride(1) >= 0 && t.stride(2) >= 0 &&
         reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

// The kernels read 16-byte vectors of BF16 rows in place when the layout allows it.
torch::Tensor operand(const torch::Tensor& t) {
  torch::Tensor r = t.scalar_type() == torch::kBFloat16 ? t : t.to(torch::kBFloat16);
  if (!layout_ok(r)) r = r.contiguous();
  if (!layout_ok(r)) r = r.clone(at::MemoryFormat::Contiguous);
  return r;
}

// BLHD views of the launch convention (kernels/common/launch.h); an undefined tensor is
// a view without data.
vqad::kernels::BlhdStrides blhd_strides(const torch::Tensor& t) {
  return vqad::kernels::BlhdStrides{t.stride(0), t.stride(1), t.stride(2), t.stride(3)};
}
vqad::kernels::BlhdIn raster_in(const torch::Tensor& t) {
  if (!t.defined()) return vqad::kernels::BlhdIn{};
  return vqad::kernels::BlhdIn{t.data_ptr(), blhd_strides(t)};
}
vqad::kernels::BlhdOut raster_out(const torch::Tensor& t) {
  if (!t.defined()) return vqad::kernels::BlhdOut{};
  return vqad::kernels::BlhdOut{t.data_ptr(), blhd_strides(t)};
}

void check_inputs(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& gate,
                  const vsa_ref::Tiling& tiling, const vsa_ref::Options& opts) {
  const std::string shapes = describe_qkv(q, k, v) + ", grid " + grid_str(tiling);
  VQAD_CHECK(q.defined() && k.defined() && v.defined(), kOp, ": q, k and v must be defined");
  VQAD_CHECK(q.is_cuda() && k.is_cuda() && v.is_cuda(), kOp, ": expected CUDA tensors, found ", q.device(), ", ",
             k.device(), ", ", v.device(), " (", shapes, ")");
  VQAD_CHECK(q.device() == k.device() && q.device() == v.device(), kOp, ": q, k and v must be on one device, found ",
             q.device(), ", ", k.device(), ", ", v.device());
  VQAD_CHECK(q.dim() == 4 && q.sizes() == k.sizes() && q.sizes() == v.sizes(), kOp,
             ": expected q, k, v of one shape [B, L, H, D], found ", shapes);
  VQAD_CHECK(q.size(1) == tiling.num_tokens(), kOp, ": the grid ", grid_str(tiling), " has ", tiling.num_tokens(),
             " tokens, q has L = ", q.size(1), " (", shapes, ")");
  VQAD_CHECK(q.size(3) == kv::kVsaHeadDim, kOp, ": the CUDA kernels need head_dim ", kv::kVsaHeadDim, ", found ",
             q.size(3), " (", shapes, ") on ", device_str(q), "; there is no fallback to another attention path");
  VQAD_CHECK(q.size(0) <= 65535 && q.size(2) <= 65535 && q.size(1) <= INT32_MAX, kOp,
             ": batch and heads must be <= 65535 and L < 2^31, found ", shapes);
  if (gate.defined()) {
    VQAD_CHECK(gate.sizes() == q.sizes() && gate.device() == q.device(), kOp, ": gate must be [B, L, H, D] ",
               shape_str(q), " on ", q.device(), ", found ", shape_str(gate), " on ", gate.device());
  }
  VQAD_CHECK(opts.cube.t == tiling.cube.t && opts.cube.h == tiling.cube.h && opts.cube.w == tiling.cube.w, kOp,
             ": the options' cube ", opts.cube.t, "x", opts.cube.h, "x", opts.cube.w, " differs from the tiling's (",
             shapes, ")");
  {
    const int want = kv::vsa_tile_blocks(static_cast<int>(tiling.blocks_per_cube));
    VQAD_CHECK(opts.tile_blocks == want, kOp, ": tile_blocks ", opts.tile_blocks,
               " is not supported, the CUDA fine stage for cube ", tiling.cube.t, "x", tiling.cube.h, "x",
               tiling.cube.w, " updates the running max per ", want, " visited 64-key block(s) (set tile_blocks = ",
               want, "), ", shapes);
  }
  VQAD_CHECK(opts.sparsity >= 0.0 && opts.sparsity < 1.0, kOp, ": sparsity must be in [0, 1), found ",
             opts.sparsity);
  VQAD_CHECK(opts.top_p > 0.0 && opts.top_p <= 1.0, kOp, ": top_p must be in (0, 1], found ", opts.top_p);
  const cudaDeviceProp* prop = at::cuda::getDeviceProperties(q.get_device());
  VQAD_CHECK(prop->major == 9 && prop->minor == 0, kOp, ": no kernel for device ", device_str(q),
             "; the VSA kernels are built and validated for sm_90 (Hopper) only, ", shapes,
             "; there is no fallback to another attention path");
}

// Device copies of the tiling tables (int32). They depend on the grid and cube only
// (constants, a few hundred KiB at the Wan grids), so they are uploaded once per
// (device, grid, cube) and kept; no activation or scratch buffer outlives a call.
struct TilingTables {
  torch::Tensor slot_to_token, token_to_slot, cube_tokens, block_tokens;
  kv::TilingDev dev;
};

TilingTables make_tables(const vsa_ref::Tiling& t, const torch::Device& device) {
  VQAD_CHECK(t.padded_len <= INT32_MAX && t.num_tokens() <= INT32_MAX, kOp, ": the grid ", grid_str(t),
             " is too large for int32 slot tables");
  auto to_i32 = [](const auto& v) {
    std::vector<int32_t> out(v.size());
    for (size_t i = 0; i < v.size(); ++i) out[i] = static_cast<int32_t>(v[i]);
    return out;
  };
  auto upload = [&](const std::vector<int32_t>& v) {
    torch::Tensor host = torch::from_blob(const_cast<int32_t*>(v.data()), {static_cast<int64_t>(v.size())},
                                          torch::TensorOptions().dtype(torch::kInt32));
    return host.to(device, /*non_blocking=*/false, /*copy=*/true);
  };
  TilingTables r;
  r.slot_to_token = upload(to_i32(t.slot_to_token));
  r.token_to_slot = upload(to_i32(t.token_to_slot));
  r.cube_tokens = upload(t.cube_tokens);
  r.block_tokens = upload(t.block_tokens);
  int max_tokens = 0;
  for (int32_t n : t.cube_tokens) max_tokens = std::max<int>(max_tokens, n);
  r.dev.len = static_cast<int>(t.num_tokens());
  r.dev.num_cubes = static_cast<int>(t.num_cubes);
  r.dev.blocks_per_cube = static_cast<int>(t.blocks_per_cube);
  r.dev.padded_len = static_cast<int>(t.padded_len);
  r.dev.max_cube_tokens = max_tokens;
  r.dev.slot_to_token = r.slot_to_token.data_ptr<int32_t>();
  r.dev.token_to_slot = r.token_to_slot.data_ptr<int32_t>();
  r.dev.cube_tokens = r.cube_tokens.data_ptr<int32_t>();
  r.dev.block_tokens = r.block_tokens.data_ptr<int32_t>();
  return r;
}

const TilingTables& upload_tiling(const vsa_ref::Tiling& t, const torch::Device& device) {
  using Key = std::tuple<int, int64_t, int64_t, int64_t, int, int, int>;
  static std::mutex mu;
  // Never destroyed: freeing device memory during static destruction can outlive the CUDA context.
  static auto* cache = new std::map<Key, TilingTables>();
  const Key key{device.index(), t.grid_t, t.grid_h, t.grid_w, t.cube.t, t.cube.h, t.cube.w};
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache->find(key);
  if (it == cache->end()) it = cache->emplace(key, make_tables(t, device)).first;
  return it->second;
}

kv::VsaConfig make_config(const torch::Tensor& q, const vsa_ref::Tiling& tiling, const vsa_ref::Options& opts,
                          const kv::TilingDev& dev) {
  kv::VsaConfig c;
  c.batch = static_cast<int>(q.size(0));
  c.heads = static_cast<int>(q.size(2));
  c.head_dim = static_cast<int>(q.size(3));
  c.grid_t = static_cast<int>(tiling.grid_t);
  c.grid_h = static_cast<int>(tiling.grid_h);
  c.grid_w = static_cast<int>(tiling.grid_w);
  c.tiling = dev;
  c.topk = static_cast<int>(vsa_ref::effective_topk(opts.sparsity, tiling.num_cubes));
  c.top_p_mode = opts.selection == vsa_ref::Selection::kTopP && opts.top_p < 1.0;
  c.top_p = static_cast<float>(opts.top_p);
  c.quantize = opts.quantize;
  c.quant_p = opts.quant_p;
  c.quant_v = opts.quant_v;
  c.bwd_fastvideo = opts.bwd_mode == attn_qat_ref::BwdMode::kFastVideo;
  c.softmax_scale = opts.softmax_scale;
  return c;
}

template <class Fn>
void run_launcher(const char* what, const std::string& context, Fn&& fn) {
  try {
    fn();
  } catch (const vqad::Error& e) {
    fail(kOp, " ", what, " (", context, "): ", e.what());
  } catch (const std::exception& e) {
    fail(kOp, " ", what, " (", context, "): ", e.what());
  }
}

torch::Tensor workspace(size_t bytes, const torch::Tensor& like) {
  // The caching allocator hands out blocks aligned to at least 512 bytes.
  return torch::empty({static_cast<int64_t>(std::max<size_t>(bytes, 256))}, like.options().dtype(torch::kUInt8));
}

// The tensors the forward saves for the backward, in one table (name, member, shape,
// dtype): the forward allocates them from it and the backward checks them against it.
struct SavedSpec {
  const char* name;
  torch::Tensor Saved::*member;
  std::vector<int64_t> sizes;
  torch::ScalarType type;
  bool backward_only = false;  // not allocated by a forward without a backward
};
std::vector<SavedSpec> saved_specs(int64_t B, int64_t H, int64_t P, int64_t D, int64_t nc, int64_t topk) {
  const torch::ScalarType bf16 = torch::kBFloat16, f32 = torch::kFloat32, i32 = torch::kInt32;
  return {{"tiled_q", &Saved::tiled_q, {B, H, P, D}, bf16},
          {"tiled_k", &Saved::tiled_k, {B, H, P, D}, bf16},
          {"tiled_v", &Saved::tiled_v, {B, H, P, D}, bf16},
          {"o_fine_hp", &Saved::o_fine_hp, {B, H, P, D}, bf16, true},
          {"m", &Saved::m, {B, H, P}, f32, true},
          {"l", &Saved::l, {B, H, P}, f32, true},
          {"sel_index", &Saved::sel_index, {B, H, nc, topk}, i32},
          {"sel_count", &Saved::sel_count, {B, H, nc}, i32},
          {"q_c", &Saved::q_c, {B, H, nc, D}, f32},
          {"k_c", &Saved::k_c, {B, H, nc, D}, f32},
          {"v_c", &Saved::v_c, {B, H, nc, D}, f32},
          {"probs", &Saved::probs, {B, H, nc, nc}, f32},
          {"out_c", &Saved::out_c, {B, H, nc, D}, f32}};
}

// The kernels' pointers to the saved tensors (VsaForwardArgs: where the forward writes
// them; VsaBackwardArgs: what the backward reads).
// (An undefined o_fine_hp, m, l: null, a forward without a backward.)
template <class Args>
void bind_saved(Args& a, const Saved& s) {
  a.tiled_q = s.tiled_q.data_ptr();
  a.tiled_k = s.tiled_k.data_ptr();
  a.tiled_v = s.tiled_v.data_ptr();
  a.o_fine_hp = s.o_fine_hp.defined() ? s.o_fine_hp.data_ptr() : nullptr;
  a.m = s.m.defined() ? s.m.data_ptr<float>() : nullptr;
  a.l = s.l.defined() ? s.l.data_ptr<float>() : nullptr;
  a.sel_index = s.sel_index.data_ptr<int32_t>();
  a.sel_count = s.sel_count.data_ptr<int32_t>();
  a.q_c = s.q_c.data_ptr<float>();
  a.k_c = s.k_c.data_ptr<float>();
  a.v_c = s.v_c.data_ptr<float>();
  a.probs = s.probs.data_ptr<float>();
  a.out_c = s.out_c.data_ptr<float>();
}

}  // namespace

torch::Tensor forward(const torch::Tensor& q_in, const torch::Tensor& k_in, const torch::Tensor& v_in,
                      const torch::Tensor& gate_in, const vsa_ref::Tiling& tiling, const vsa_ref::Options& opts,
                      Saved* saved, bool for_backward) {
  check_inputs(q_in, k_in, v_in, gate_in, tiling, opts);
  const c10::cuda::CUDAGuard guard(q_in.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream(q_in.get_device()).stream();
  const std::string context = describe_qkv(q_in, k_in, v_in) + ", grid " + grid_str(tiling) + " on " + device_str(q_in);
  const torch::Tensor q = operand(q_in), k = operand(k_in), v = operand(v_in);
  const torch::Tensor gate = gate_in.defined() ? operand(gate_in) : torch::Tensor();
  const TilingTables& tables = upload_tiling(tiling, q.device());
  const kv::VsaConfig c = make_config(q, tiling, opts, tables.dev);
  const int64_t B = q.size(0), L = q.size(1), H = q.size(2), D = q.size(3);
  const int64_t P = tiling.padded_len, nc = tiling.num_cubes;
  const auto bf16 = q.options().dtype(torch::kBFloat16);

  Saved local;
  Saved& s = saved != nullptr ? *saved : local;
  for (const SavedSpec& e : saved_specs(B, H, P, D, nc, c.topk))
    s.*e.member = for_backward || !e.backward_only ? torch::empty(e.sizes, q.options().dtype(e.type)) : torch::Tensor();
  torch::Tensor o = torch::empty({B, L, H, D}, bf16);
  torch::Tensor ws = workspace(kv::vsa_forward_workspace_bytes(c, for_backward), q);

  kv::VsaForwardArgs a;
  a.q = raster_in(q);
  a.k = raster_in(k);
  a.v = raster_in(v);
  a.gate = raster_in(gate);
  a.o = raster_out(o);
  bind_saved(a, s);
  a.workspace = ws.data_ptr();
  run_launcher("forward", context, [&] { kv::vsa_forward(c, a, stream); });
  return q_in.scalar_type() == torch::kBFloat16 ? o : o.to(q_in.scalar_type());
}

Grads backward(const torch::Tensor& q_in, const torch::Tensor& k_in, const torch::Tensor& v_in,
               const torch::Tensor& gate_in, const Saved& s, const torch::Tensor& d_o_in,
               const vsa_ref::Tiling& tiling, const vsa_ref::Options& opts) {
  check_inputs(q_in, k_in, v_in, gate_in, tiling, opts);
  VQAD_CHECK(d_o_in.defined() && d_o_in.sizes() == q_in.sizes() && d_o_in.device() == q_in.device(), kOp,
             ": backward expected dO ", shape_str(q_in), " on ", q_in.device(), ", found ",
             d_o_in.defined() ? shape_str(d_o_in) + " on " + c10::str(d_o_in.device()) : std::string("undefined"));
  const int64_t B = q_in.size(0), L = q_in.size(1), H = q_in.size(2), D = q_in.size(3);
  const int64_t P = tiling.padded_len, nc = tiling.num_cubes;
  const std::string context = describe_qkv(q_in, k_in, v_in) + ", grid " + grid_str(tiling) + " on " + device_str(q_in);
  auto check_saved = [&](const torch::Tensor& t, const char* name, c10::IntArrayRef sizes, torch::ScalarType type) {
    VQAD_CHECK(t.defined() && t.sizes() == sizes && t.scalar_type() == type && t.is_contiguous() &&
                   t.device() == q_in.device(),
               kOp, ": saved tensor ", name, " must be contiguous ", c10::toString(type), " ", shape_str(sizes), " on ",
               q_in.device(), ", found ", t.defined() ? shape_str(t) : std::string("undefined"), " (", context, ")");
  };
  const TilingTables& tables = upload_tiling(tiling, q_in.device());
  const kv::VsaConfig c = make_config(q_in, tiling, opts, tables.dev);
  for (const SavedSpec& e : saved_specs(B, H, P, D, nc, c.topk)) check_saved(s.*e.member, e.name, e.sizes, e.type);

  const c10::cuda::CUDAGuard guard(q_in.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream(q_in.get_device()).stream();
  const torch::Tensor d_o = operand(d_o_in);
  const torch::Tensor gate = gate_in.defined() ? operand(gate_in) : torch::Tensor();
  const auto bf16 = q_in.options().dtype(torch::kBFloat16);
  Grads g;
  g.dq = torch::empty({B, L, H, D}, bf16);
  g.dk = torch::empty({B, L, H, D}, bf16);
  g.dv = torch::empty({B, L, H, D}, bf16);
  if (gate.defined()) g.dgate = torch::empty({B, L, H, D}, bf16);
  torch::Tensor ws = workspace(kv::vsa_backward_workspace_bytes(c), q_in);

  kv::VsaBackwardArgs a;
  a.gate = raster_in(gate);
  a.d_o = raster_in(d_o);
  bind_saved(a, s);
  a.dq = raster_out(g.dq);
  a.dk = raster_out(g.dk);
  a.dv = raster_out(g.dv);
  a.dgate = raster_out(g.dgate);
  a.workspace = ws.data_ptr();
  run_launcher("backward", context, [&] { kv::vsa_backward(c, a, stream); });
  auto cast = [](torch::Tensor t, torch::ScalarType type) { return t.scalar_type() == type ? t : t.to(type); };
  g.dq = cast(g.dq, q_in.scalar_type());
  g.dk = cast(g.dk, k_in.scalar_type());
  g.dv = cast(g.dv, v_in.scalar_type());
  if (g.dgate.defined()) g.dgate = cast(g.dgate, gate_in.scalar_type());
  return g;
}

vsa_ref::SelectionLists selection_to_host(const Saved& saved) {
  VQAD_CHECK(saved.sel_index.defined() && saved.sel_count.defined() && saved.sel_index.dim() == 4 &&
                 saved.sel_count.dim() == 3,
             kOp, ": selection_to_host needs the saved sel_index [B, H, nq, max_kv] and sel_count [B, H, nq]");
  const torch::Tensor idx = saved.sel_index.to(torch::kCPU).contiguous();
  const torch::Tensor cnt = saved.sel_count.to(torch::kCPU).contiguous();
  vsa_ref::SelectionLists s;
  s.batch = idx.size(0);
  s.heads = idx.size(1);
  s.num_q_cubes = idx.size(2);
  s.max_kv = idx.size(3);
  s.index.assign(idx.data_ptr<int32_t>(), idx.data_ptr<int32_t>() + idx.numel());
  s.count.assign(cnt.data_ptr<int32_t>(), cnt.data_ptr<int32_t>() + cnt.numel());
  return s;
}

}  // namespace vqad::ops::vsa_cuda

#endif  // VQAD_WITH_TORCH_CUDA
