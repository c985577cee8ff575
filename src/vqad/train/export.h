// Export of a trainer checkpoint's role as the next stage's init_from.
#pragma once
#include <string>

namespace vqad::train {

// A trainer checkpoint (or its role directory) -> a Diffusers transformer directory
// with metadata (checkpoint_state inference_export) usable as the next stage's init_from.
// (trainer.h redeclares it with the defaults role = "student", overwrite = false.)
std::string export_checkpoint(const std::string& checkpoint_dir, const std::string& out_dir, const std::string& role,
                              bool overwrite);

}  // namespace vqad::train
