// `vqad config CONFIG [--a.b value ...] [--dump]`: load, override, validate and
// show what a run would use, with the two hashes recorded in checkpoint metadata.
// `vqad config --keys`: every key of the schema with its type, default, status and help.
#include <cstdio>
#include <string>
#include <vector>

#include "vqad/cli/commands.h"
#include "vqad/core/attention_backend.h"
#include "vqad/core/error.h"
#include "vqad/train/config.h"

namespace vqad::cli {

void register_config_commands(CLI::App& app) {
  auto* sub = app.add_subcommand(
      "config",
      "Validate a run config (YAML + --dotted.key value overrides); print a summary, or with "
      "--dump the resolved config, and the sha256 of the source file and of the resolved config");
  auto path = std::make_shared<std::string>();
  auto dump = std::make_shared<bool>(false);
  auto keys = std::make_shared<bool>(false);
  sub->add_option("config", *path, "YAML run config (FastVideo schema)");
  sub->add_flag("--dump", *dump, "Print the resolved config (every value, defaults filled in) as YAML");
  sub->add_flag("--keys", *keys,
                "Print every config key: type, default, status (implemented / not_supported_yet / planned) "
                "and help");
  sub->allow_extras();
  sub->footer("Overrides follow the config path: vqad config run.yaml --training.loop.max_train_steps 10");
  set_action(sub, [sub, path, dump, keys] {
    if (*keys) {
      for (const auto* schema : train::run_config_schemas()) {
        std::printf("%s\n", schema->path.c_str());
        for (const auto& k : schema->keys) {
          std::string status = config::key_status_name(k.status);
          if (!k.planned_by.empty()) status += " (" + k.planned_by + ")";
          std::printf("  %-36s %-15s default %-12s %s\n      %s\n", k.key.c_str(), config::key_type_name(k.type),
                      k.default_value.is_null() ? "-" : k.default_value.dump().c_str(), status.c_str(),
                      k.help.c_str());
        }
      }
      return 0;
    }
    VQAD_CHECK(!path->empty(), "vqad config: give a config file (or --keys)");
    std::vector<std::string> overrides = sub->remaining();
    train::RunConfig cfg = train::load_run_config(*path, overrides);
    if (*dump) {
      std::fputs(cfg.resolved_yaml.c_str(), stdout);
      std::printf("# source_sha256: %s\n# resolved_sha256: %s\n", cfg.source_sha256.c_str(),
                  cfg.resolved_sha256.c_str());
      return 0;
    }
    std::printf("config: %s (valid)\n", path->c_str());
    if (!overrides.empty()) {
      std::printf("overrides:");
      for (const auto& o : overrides) std::printf(" %s", o.c_str());
      std::printf("\n");
    }
    std::printf("method: %s (%s)\n", train::method_name(cfg.method.kind), cfg.method.target.c_str());
    for (const auto& role : cfg.method.roles()) {
      const auto& r = cfg.role(role);
      std::printf("role %-8s %s, attention %s, linears %s, flow_shift %g, init_from %s\n", role.c_str(),
                  r.trainable ? "trainable" : "frozen", attention_backend_name(r.attention_backend),
                  r.quant_config.c_str(), r.flow_shift, r.init_from.c_str());
    }
    const auto& d = cfg.training.distributed;
    std::printf("distributed: num_gpus %lld, sp %lld, dp %lld, replicate %lld x shard %lld\n",
                (long long)d.num_gpus, (long long)d.sp_size, (long long)d.dp_size(),
                (long long)d.hsdp_replicate_dim, (long long)d.hsdp_shard_dim);
    std::printf("steps: %lld, lr %g (%s)\n", (long long)cfg.training.loop.max_train_steps,
                cfg.training.optimizer.learning_rate,
                train::lr_schedule_name(cfg.training.optimizer.lr_scheduler));
    std::printf("source_sha256: %s\nresolved_sha256: %s\n", cfg.source_sha256.c_str(),
                cfg.resolved_sha256.c_str());
    return 0;
  });
}

}  // namespace vqad::cli
