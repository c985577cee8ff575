// Attention backend names (spec/attention.md "Backends and role scopes").
// Torch-free so that config validation can name the valid choices before any
// model or kernel is touched.
#pragma once
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace vqad {

enum class AttentionBackend {
  kTorchSdpa,        // TORCH_SDPA: dense BF16; CPU math reference, GPU LibTorch SDPA
  kFlashAttn,        // FLASH_ATTN: fastest dense BF16 available
  kAttnQatTrain,     // ATTN_QAT_TRAIN: NVFP4 fake-quantized Q, K, V and P
  kVsaTrain,         // VSA_TRAIN = VSA_TRAIN_C64: video sparse attention, 4x4x4 cubes, BF16
  kVsaTrainC128,     // VSA_TRAIN_C128: VSA, 4x4x8 cubes, BF16 fine stage
  kVsaQatTrainC64,   // VSA_QAT_TRAIN_C64: VSA, 4x4x4 cubes, NVFP4 fine stage
  kVsaQatTrainC128,  // VSA_QAT_TRAIN_C128: VSA, 4x4x8 cubes, NVFP4 fine stage
};

// The canonical name (kVsaTrain -> "VSA_TRAIN").
const char* attention_backend_name(AttentionBackend b);
// Accepts every name of attention_backend_names(), aliases included (VSA_TRAIN_C64).
std::optional<AttentionBackend> parse_attention_backend(std::string_view name);
const std::vector<std::string>& attention_backend_names();
// "TORCH_SDPA, FLASH_ATTN, ..." for error messages.
std::string attention_backend_choices();

}  // namespace vqad
