#include "vqad/cli/commands.h"

#include <map>

namespace vqad::cli {
namespace {
std::map<CLI::App*, Action>& actions() {
  static std::map<CLI::App*, Action> a;
  return a;
}
}  // namespace

CLI::App* op_command(CLI::App& app) {
  for (CLI::App* sub : app.get_subcommands([](CLI::App* s) { return s->get_name() == "op"; }))
    return sub;
  CLI::App* op = app.add_subcommand("op", "Run single ops (attention, quantization) on safetensors files");
  op->require_subcommand(1);
  return op;
}

CLI::App* bench_command(CLI::App& app) {
  for (CLI::App* sub : app.get_subcommands([](CLI::App* s) { return s->get_name() == "bench"; }))
    return sub;
  CLI::App* bench = app.add_subcommand("bench", "Benchmarks (GPU machine): table on stdout, JSON under --out");
  bench->require_subcommand(1);
  return bench;
}

void set_action(CLI::App* sub, Action action) {
  actions()[sub] = std::move(action);
  sub->callback([sub] {
    int rc = actions()[sub]();
    if (rc != 0) throw CLI::RuntimeError(rc);
  });
}

}  // namespace vqad::cli
