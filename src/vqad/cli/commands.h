// The `vqad` subcommands. Each module that offers a command provides one
// register_* function; main.cpp calls them all. A subcommand is registered only
// when it works (no placeholders).
#pragma once
#include <CLI/CLI.hpp>
#include <functional>

namespace vqad::cli {

// Subcommands set their action here; main runs the one that was parsed.
using Action = std::function<int()>;
void set_action(CLI::App* sub, Action action);

// --- registration functions (one per module; add yours here and in main.cpp) ---
void register_version_commands(CLI::App& app);
void register_train_commands(CLI::App& app);
void register_config_commands(CLI::App& app);
void register_op_attention_commands(CLI::App& app);
void register_nvfp4_commands(CLI::App& app);
void register_bench_quant_commands(CLI::App& app);
void register_bench_linear_commands(CLI::App& app);
void register_bench_wan_commands(CLI::App& app);
void register_data_commands(CLI::App& app);
void register_bench_attention_commands(CLI::App& app);
void register_bench_vsa_commands(CLI::App& app);
void register_bench_step_commands(CLI::App& app);
void register_bench_dmd2_commands(CLI::App& app);
void register_plot_commands(CLI::App& app);
void register_ode_cache_commands(CLI::App& app);
void register_bench_ode_cache_commands(CLI::App& app);

// The `vqad op` parent (op-level tools); created on first use, shared by modules.
CLI::App* op_command(CLI::App& app);
// The `vqad bench` parent (benchmarks on a GPU machine); created on first use, shared by modules.
CLI::App* bench_command(CLI::App& app);

}  // namespace vqad::cli
