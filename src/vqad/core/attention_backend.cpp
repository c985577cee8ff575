#include "vqad/core/attention_backend.h"

namespace vqad {
namespace {
struct Entry {
  AttentionBackend b;
  const char* name;
};
constexpr Entry kEntries[] = {
    {AttentionBackend::kTorchSdpa, "TORCH_SDPA"},
    {AttentionBackend::kFlashAttn, "FLASH_ATTN"},
    {AttentionBackend::kAttnQatTrain, "ATTN_QAT_TRAIN"},
    {AttentionBackend::kVsaTrain, "VSA_TRAIN"},
    {AttentionBackend::kVsaTrain, "VSA_TRAIN_C64"},  // alias: plain VSA_TRAIN is the 4x4x4 cube
    {AttentionBackend::kVsaTrainC128, "VSA_TRAIN_C128"},
    {AttentionBackend::kVsaQatTrainC64, "VSA_QAT_TRAIN_C64"},
    {AttentionBackend::kVsaQatTrainC128, "VSA_QAT_TRAIN_C128"},
};
}  // namespace

const char* attention_backend_name(AttentionBackend b) {
  for (const auto& e : kEntries)
    if (e.b == b) return e.name;
  return "?";
}

std::optional<AttentionBackend> parse_attention_backend(std::string_view name) {
  for (const auto& e : kEntries)
    if (name == e.name) return e.b;
  return std::nullopt;
}

const std::vector<std::string>& attention_backend_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> v;
    for (const auto& e : kEntries) v.emplace_back(e.name);
    return v;
  }();
  return names;
}

std::string attention_backend_choices() {
  std::string s;
  for (const auto& n : attention_backend_names()) s += (s.empty() ? "" : ", ") + n;
  return s;
}

}  // namespace vqad
