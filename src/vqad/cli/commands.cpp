#include "vqad/cli/commands.h"

#include <map>

namespace vqad::cli {
namespace {
std::map<CLI::App*, Action>& actions() {
  static std::map<CLI::App*, Action> a;
  return a;
}
}  // namespace

void set_action(CLI::App* sub, Action action) {
  actions()[sub] = std::move(action);
  sub->callback([sub] {
    int rc = actions()[sub]();
    if (rc != 0) throw CLI::RuntimeError(rc);
  });
}

}  // namespace vqad::cli
