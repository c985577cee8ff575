// `vqad export`: a checkpoint's role as a Diffusers transformer directory, dense or
// packed NVFP4 in ModelOpt's layout (export/packed.h).
#include <cstdio>
#include <iostream>

#include "vqad/cli/commands.h"
#include "vqad/export/packed.h"

namespace vqad::cli {

void register_export_commands(CLI::App& app) {
  auto* sub = app.add_subcommand(
      "export", "Export a role of a checkpoint (or an export) as a Diffusers transformer directory, dense or packed NVFP4");
  auto o = std::make_shared<deploy::ExportOptions>();
  auto src = std::make_shared<std::string>();
  auto out = std::make_shared<std::string>();
  sub->add_option("checkpoint", *src, "checkpoint-<step> directory, or an export directory (--format nvfp4)")
      ->required();
  sub->add_option("out_dir", *out, "output directory (transformer/ + metadata.json)")->required();
  sub->add_option("--format", o->format,
                  "diffusers (default: the trained weights) | nvfp4 (the quant plan's linears packed in "
                  "ModelOpt's NVFP4 layout)");
  sub->add_option("--role", o->role, "role to export (default student)");
  sub->add_flag("--swizzled-scales", o->swizzled_scales,
                "nvfp4: also write <m>.weight_scale_swizzled in the 128x4 layout FP4 GEMMs consume");
  sub->add_option("--act-amax", o->act_amax_json,
                  "nvfp4: activation-amax table (JSON) for static linears, instead of the checkpoint's");
  sub->add_flag("--overwrite", o->overwrite, "replace an existing output directory");
  set_action(sub, [=] {
    const deploy::ExportSummary s = deploy::export_model(*src, *out, *o);
    std::cout << "exported " << o->role << " of " << *src << " to " << s.out_dir << " (" << s.format << ")\n";
    if (s.format == deploy::kPackedFormat) {
      char line[160];
      std::snprintf(line, sizeof(line), "packed %lld linears, %lld parameters in %lld bytes (%.4f bytes/parameter)\n",
                    static_cast<long long>(s.quantized_linears), static_cast<long long>(s.quantized_parameters),
                    static_cast<long long>(s.quantized_bytes), s.bytes_per_parameter());
      std::cout << line;
    }
    return 0;
  });
}

}  // namespace vqad::cli
