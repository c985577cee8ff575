// vqad: quantization-aware training and distillation of video diffusion
// transformers to NVFP4. Entry point: parses the command line and runs one
// subcommand; every vqad::Error becomes a one-line message and exit code 1.
#include <c10/util/Exception.h>
#include <signal.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "vqad/cli/commands.h"
#include "vqad/cli/suggest.h"
#include "vqad/train/determinism.h"
#include "vqad/core/error.h"
#include "vqad/version.h"

namespace vqad::cli {
// Registered here rather than in commands.h (adding a module rebuilds only main.cpp):
// cli/cmd_media.cpp, cli/cmd_export.cpp, cli/cmd_sample.cpp.
void register_media_commands(CLI::App& app);
void register_export_commands(CLI::App& app);
void register_sample_commands(CLI::App& app);
void register_bench_vae_commands(CLI::App& app);  // bench/bench_vae.cpp
void register_bench_fused_commands(CLI::App& app);  // bench/bench_fused.cpp
void register_launch_commands(CLI::App& app);  // cmd_launch.cpp: `vqad launch`, `vqad dist check`
void register_bench_checkpoint_commands(CLI::App& app);  // bench/bench_checkpoint.cpp
void register_calibrate_commands(CLI::App& app);  // cmd_calibrate.cpp: `vqad calibrate`
}  // namespace vqad::cli

namespace {
// One line: torch messages carry a C++ backtrace after the first line.
std::string first_line(std::string s) {
  const auto nl = s.find('\n');
  if (nl != std::string::npos) s.resize(nl);
  return s;
}
}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "vqad - NVFP4 quantization-aware training and distillation for video diffusion "
      "transformers (Wan2.1)"};
  app.set_version_flag("--version", std::string("vqad ") + VQAD_VERSION);
  app.require_subcommand(1);
  vqad::cli::register_version_commands(app);
  vqad::cli::register_train_commands(app);
  vqad::cli::register_export_commands(app);
  vqad::cli::register_calibrate_commands(app);
  vqad::cli::register_sample_commands(app);
  vqad::cli::register_launch_commands(app);
  vqad::cli::register_plot_commands(app);
  vqad::cli::register_media_commands(app);
  vqad::cli::register_bench_vae_commands(app);
  vqad::cli::register_bench_fused_commands(app);
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
  vqad::cli::register_bench_checkpoint_commands(app);
  vqad::set_cublas_workspace_default();  // before any cuBLAS handle exists
  // Exceeding the file size limit becomes a write error (EFBIG) with a message, not a core dump.
  ::signal(SIGXFSZ, SIG_IGN);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const bool help = dynamic_cast<const CLI::CallForHelp*>(&e) || dynamic_cast<const CLI::CallForAllHelp*>(&e) ||
                      dynamic_cast<const CLI::CallForVersion*>(&e) || dynamic_cast<const CLI::Success*>(&e) ||
                      dynamic_cast<const CLI::RuntimeError*>(&e);
    if (!help) {
      const std::string hint = vqad::cli::suggestion_for(app, argc, argv);
      if (!hint.empty()) {
        std::fprintf(stderr, "vqad: error: %s\n", hint.c_str());
        return 1;
      }
    }
    return app.exit(e);
  } catch (const vqad::Error& e) {
    std::fprintf(stderr, "vqad: error: %s\n", e.what());
    return 1;
  } catch (const std::filesystem::filesystem_error& e) {
    // The environment (a path that is a file, a read-only or full filesystem), not a bug.
    std::fprintf(stderr, "vqad: error: %s%s%s%s\n", e.code().message().c_str(), e.path1().empty() ? "" : ": ",
                 e.path1().c_str(), e.path2().empty() ? "" : (" -> " + e.path2().string()).c_str());
    return 1;
  } catch (const nlohmann::json::exception& e) {
    std::fprintf(stderr, "vqad: error: malformed JSON input: %s\n", e.what());
    return 1;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "vqad: error: out of host memory\n");
    return 1;
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "vqad: internal error (torch): %s\n", first_line(e.what_without_backtrace()).c_str());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "vqad: internal error: %s\n", first_line(e.what()).c_str());
    return 2;
  }
  return 0;
}
