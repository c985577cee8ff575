// vqad: quantization-aware training and distillation of video diffusion
// transformers to NVFP4. Entry point: parses the command line and runs one
// subcommand; every vqad::Error becomes a one-line message and exit code 1.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>

#include "vqad/cli/commands.h"
#include "vqad/core/error.h"
#include "vqad/version.h"

namespace vqad::cli {
// Registered here rather than in commands.h (adding a module rebuilds only main.cpp):
// cli/cmd_media.cpp, cli/cmd_export.cpp, cli/cmd_sample.cpp.
void register_media_commands(CLI::App& app);
void register_export_commands(CLI::App& app);
void register_sample_commands(CLI::App& app);
void register_bench_vae_commands(CLI::App& app);  // bench/bench_vae.cpp
void register_launch_commands(CLI::App& app);  // cmd_launch.cpp: `vqad launch`, `vqad dist check`
}  // namespace vqad::cli

int main(int argc, char** argv) {
  CLI::App app{
      "vqad - NVFP4 quantization-aware training and distillation for video diffusion "
      "transformers (Wan2.1)"};
  app.set_version_flag("--version", std::string("vqad ") + VQAD_VERSION);
  app.require_subcommand(1);
  vqad::cli::register_version_commands(app);
  vqad::cli::register_train_commands(app);
  vqad::cli::register_export_commands(app);
  vqad::cli::register_sample_commands(app);
  vqad::cli::register_launch_commands(app);
  vqad::cli::register_plot_commands(app);
  vqad::cli::register_media_commands(app);
  vqad::cli::register_bench_vae_commands(app);
  vqad::cli::register_config_commands(app);
  vqad::cli::register_op_attention_commands(app);
  vqad::cli::register_nvfp4_commands(app);
  vqad::cli::register_bench_quant_commands(app);
  vqad::cli::register_bench_linear_commands(app);
  vqad::cli::register_bench_wan_commands(app);
  vqad::cli::register_data_commands(app);
  vqad::cli::register_bench_attention_commands(app);
  vqad::cli::register_bench_vsa_commands(app);
  vqad::cli::register_bench_step_commands(app);
  vqad::cli::register_bench_dmd2_commands(app);
  vqad::cli::register_ode_cache_commands(app);
  vqad::cli::register_bench_ode_cache_commands(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const vqad::Error& e) {
    std::fprintf(stderr, "vqad: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "vqad: internal error: %s\n", e.what());
    return 2;
  }
  return 0;
}
