// Precomputed text embeddings outside a training dataset (negative prompts, validation
// prompts): vqad has no text encoder, so prompts arrive as embeddings, either a
// .safetensors file holding one [L, D] / [1, L, D] tensor, or the rows of a preprocessed
// parquet dataset (t2v or text_only schema). Embeddings are zero-padded or cropped to
// text_len like the training data. Errors start with `where` (the config key and path).
#pragma once
#include <torch/torch.h>

#include <string>
#include <vector>

namespace vqad::data {

struct TextEmbeddings {
  std::vector<std::string> captions;
  torch::Tensor text;  // [N, text_len, D] fp32
};

// [L, D] or [1, L, D] -> [text_len, D] fp32 (D must equal text_dim).
torch::Tensor fit_text_embedding(const torch::Tensor& t, int64_t text_len, int64_t text_dim, const std::string& where);
// One embedding from a .safetensors file with exactly one tensor -> [text_len, D].
torch::Tensor read_text_embedding_file(const std::string& path, int64_t text_len, int64_t text_dim,
                                       const std::string& where);
// Every row of a parquet dataset (its text embeddings and captions).
TextEmbeddings read_text_embedding_rows(const std::string& path, int64_t text_len, int64_t text_dim,
                                        const std::string& where);

}  // namespace vqad::data
