// `vqad ode-cache generate RECIPE [--a.b value ...]`: teacher trajectories into an
// ODE-trajectory cache (sample/ode_generate.h). Resumable: rerun the same command after
// an interruption. Several processes: set RANK and WORLD_SIZE; each rank generates the
// trajectories i with i % WORLD_SIZE == RANK into the same directory.
#include "vqad/cli/cmd_ode_cache.h"

#include <cstdio>
#include <fstream>
#include <sstream>

#include "vqad/cli/commands.h"
#include "vqad/core/error.h"
#include "vqad/train/config.h"

namespace vqad::cli {

sample::OdeRecipe load_ode_recipe(const std::string& path, const std::vector<std::string>& overrides) {
  std::ifstream f(path);
  VQAD_CHECK(f.good(), "ode-cache recipe: cannot read '", path, "'");
  std::stringstream ss;
  ss << f.rdbuf();
  train::Json root = train::yaml_to_json(ss.str(), path);
  for (const auto& [key, value] : train::parse_overrides(overrides)) train::apply_override(root, key, value);
  return sample::parse_ode_recipe(root, path);
}

void register_ode_cache_commands(CLI::App& app) {
  auto* oc = app.add_subcommand("ode-cache", "ODE-trajectory caches: teacher trajectories for layer_recon / recon_ode");
  oc->require_subcommand(1);
  auto* sub = oc->add_subcommand(
      "generate",
      "Generate (or continue) an ODE-trajectory cache from a recipe (models.teacher + ode_cache; --a.b value "
      "overrides). RANK / WORLD_SIZE split the trajectories over processes");
  auto config = std::make_shared<std::string>();
  auto no_progress = std::make_shared<bool>(false);
  auto interval = std::make_shared<double>(30.0);
  sub->add_option("config", *config, "recipe YAML")->required();
  sub->add_flag("--no-progress", *no_progress, "no progress output");
  sub->add_option("--log-interval", *interval, "seconds between progress lines when stderr is not a terminal (default 30)");
  sub->allow_extras();
  set_action(sub, [=] {
    auto recipe = load_ode_recipe(*config, sub->remaining());
    sample::OdeGenerateOptions o;
    std::tie(o.rank, o.world) = sample::rank_and_world_from_env();
    o.progress = !*no_progress;
    o.log_interval_s = *interval;
    auto s = sample::generate_ode_cache(recipe, o);
    std::printf("ode-cache %s: rank %lld/%lld generated %lld trajectories in %.1f s (%lld were present), %s\n",
                s.directory.c_str(), (long long)o.rank, (long long)o.world, (long long)s.generated, s.seconds,
                (long long)s.present, s.complete ? "cache complete" : "cache incomplete (other ranks pending)");
    return 0;
  });
}

}  // namespace vqad::cli
