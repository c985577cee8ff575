// ATTN_QAT_TRAIN CPU reference (spec/attention.md): NVFP4 fake-quantized
// attention forward and its straight-through backward, on plain float arrays.
//
// This is the definition every fast path (CUDA kernels, the autograd op) is
// compared with. It is torch-free and deliberately simple: one query row at a
// time, fp32 accumulation in a fixed order, bf16 rounding exactly where the
// spec puts it.
//
// Layout: q [B, Lq, H, D], k/v/o/grads [B, L*, H, D] with explicit element
// strides for b, l and h; the head dimension D is contiguous. Row statistics
// m and l are [B, H, Lq], contiguous.
//
// Inputs are BF16 values carried as float. The reference rounds every input
// (q, k, v, dO) to bf16 first, so passing bf16-valued floats is a no-op and
// passing arbitrary floats gives what the training op computes after its cast.
#pragma once
#include <cstdint>
#include <vector>

namespace vqad::attn_qat_ref {

enum class BwdMode {
  kConsistent,  // Pb = FQ(exp2(s - m)) / l : quantized relative to the row max (default)
  kFastVideo,   // Pb = FQ(exp2(s - m) / l) : FastVideo's absolute-scale flush, parity only
};
const char* bwd_mode_name(BwdMode m);

struct Options {
  int block_n = 128;      // KV tile of the running-max P quantization; multiple of 16
  bool quant_p = true;    // P fake-quantized (forward acc, backward dV)
  bool quant_v = true;    // V fake-quantized
  bool quant_qk = true;   // Q and K fake-quantized
  BwdMode bwd_mode = BwdMode::kConsistent;
  float softmax_scale = 0.0f;  // 0 -> 1/sqrt(D)
  int num_threads = 0;         // 0 -> all hardware threads
};

struct Dims {
  int64_t batch = 0, len_q = 0, len_kv = 0, heads = 0, head_dim = 0;
};

// BLHD views; element strides, d contiguous.
struct ConstView {
  const float* data = nullptr;
  int64_t stride_b = 0, stride_l = 0, stride_h = 0;
  const float* row(int64_t b, int64_t l, int64_t h) const {
    return data + b * stride_b + l * stride_l + h * stride_h;
  }
};
struct View {
  float* data = nullptr;
  int64_t stride_b = 0, stride_l = 0, stride_h = 0;
  float* row(int64_t b, int64_t l, int64_t h) const {
    return data + b * stride_b + l * stride_l + h * stride_h;
  }
  operator ConstView() const { return {data, stride_b, stride_l, stride_h}; }
};
// Views of a contiguous [B, L, H, D] buffer.
ConstView contiguous_view(const float* data, int64_t len, int64_t heads, int64_t head_dim);
View contiguous_view(float* data, int64_t len, int64_t heads, int64_t head_dim);

// --- scalar helpers (shared with tests and the kernels' test harnesses) -----------
// float -> bf16 -> float, round-to-nearest-even; NaN stays NaN, Inf stays Inf.
float bf16_round(float x);
// Unit-scale NVFP4 fake quantization of one P row of n keys in 16-key groups
// starting at key 0; a final partial group is quantized over its valid keys only
// (absent keys do not influence its scale). y may alias x.
void fake_quantize_p_row(const float* x, float* y, int64_t n);

// --- forward ---------------------------------------------------------------------------
// Writes o (returned output, quantized P path). o_hp (high-precision path),
// m (final running max of s = c * Q^.K^, log2 domain) and l (sum of bf16(P)
// relative to m) are optional (null data / pointer skips them). Throws
// vqad::Error on invalid dims or options.
void forward(const Dims& dims, ConstView q, ConstView k, ConstView v, const Options& opts,
             View o, View o_hp, float* m, float* l);

// --- forward over key ranges (the reference of a forward that splits a row's keys) -------
// Every row's state after the KV tiles [key_begin, key_end) (key_begin a multiple of
// block_n; key_end one too, or len_kv), continuing from the running max m0 (one per row,
// [B * H, Lq]): acc and acch not normalised, l and m as the recurrence leaves them. Started
// from forward_prefix_max(key_begin), the running max the unsplit row has at key_begin,
// every P tile is quantized against the same maximum as in forward(), so the combined parts
// give forward()'s m bit for bit and o, o_hp, l up to the fp32 rounding of the rescale (one
// exp2(m_part - m) per part instead of one alpha per later tile).
struct ForwardPart {
  int64_t key_begin = 0, key_end = 0;
  std::vector<float> acc, acch;  // [B * H, Lq, D]
  std::vector<float> m, l;       // [B * H, Lq]
};
// max over the keys [0, key_end) of s = c * Q^.K^, per row ([B * H, Lq]; -inf for 0).
std::vector<float> forward_prefix_max(const Dims& dims, ConstView q, ConstView k, const Options& opts,
                                      int64_t key_end);
ForwardPart forward_part(const Dims& dims, ConstView q, ConstView k, ConstView v, const Options& opts,
                         int64_t key_begin, int64_t key_end, const std::vector<float>& m0);
// Parts that cover [0, len_kv) in key order, combined into what forward() writes:
// m = max of the parts' m; acc = sum over the parts, in order, of acc_part * exp2(m_part - m)
// (acch and l the same); o = acc / l, o_hp = acch / l. o_hp, m and l optional as in forward().
void forward_combine(const Dims& dims, const std::vector<ForwardPart>& parts, View o, View o_hp, float* m,
                     float* l);

// --- backward --------------------------------------------------------------------------
// Straight-through backward. o_hp, m and l are the forward's saved outputs for
// the same q, k, v and options. Writes dq, dk, dv (gradients with respect to
// the original q, k, v).
void backward(const Dims& dims, ConstView q, ConstView k, ConstView v, ConstView o_hp,
              ConstView d_o, const float* m, const float* l, const Options& opts, View dq,
              View dk, View dv);

}  // namespace vqad::attn_qat_ref
