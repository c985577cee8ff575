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

}  // namespace vqad::cli
