// `vqad demo`, `vqad train`, `vqad lineage` (`vqad export` is in cmd_export.cpp).
#include <chrono>
#include <cstdlib>
#include <iostream>

#include "vqad/cli/commands.h"
#include "vqad/cli/suggest.h"
#include "vqad/core/error.h"
#include "vqad/core/log.h"
#include "vqad/core/signals.h"
#include "vqad/dist/env.h"
#include "vqad/dist/process_group.h"
#include "vqad/io/device.h"
#include "vqad/train/config.h"
#include "vqad/train/demo.h"
#include "vqad/train/metadata.h"
#include "vqad/train/trainer.h"

namespace vqad::cli {

void register_train_commands(CLI::App& app) {
  {
    auto* sub = app.add_subcommand(
        "demo", "Run the QAD recipe at tiny scale on synthetic data (dense: teacher -> Attn-QAT + NVFP4 stage 1 -> DMD2 "
                "stage 2 -> report; --recipe sparse: teacher -> ODE cache -> S0 layer_recon -> S1 recon_ode -> S2 DMD2 "
                "-> report)");
    auto o = std::make_shared<train::DemoOptions>();
    auto device = std::make_shared<std::string>("cpu");
    sub->add_option("--out", o->out, "output directory (default vqad-demo)");
    sub->add_option("--recipe", o->recipe, std::string("dense (default, the QAD recipe) | sparse (the sparse QAD lineage)"));
    sub->add_option("--stage0-steps", o->stage0_steps, "--recipe sparse: override S0's (layer_recon) step count");
    sub->add_option("--ode-trajectories", o->ode_trajectories, "--recipe sparse: ODE-cache trajectories");
    sub->add_option("--heldout-rows", o->heldout_rows, "held-out synthetic rows (default 16)");
    sub->add_option("--eval-noises", o->eval_noises, "initial noises per held-out prompt in the sample comparison (default 4)");
    sub->add_option("--device", *device, "cpu (default) | cuda | auto");
    sub->add_option("--teacher-steps", o->teacher_steps, "override the teacher's step count");
    sub->add_option("--stage1-steps", o->stage1_steps, "override stage 1's step count");
    sub->add_option("--stage2-steps", o->stage2_steps, "override stage 2's (DMD2) step count");
    sub->add_flag("!--no-stage2", o->stage2, "stop after stage 1");
    sub->add_option("--stage1-set", o->stage1_set,
                    "override a stage-1 recipe value (sparse: S1 recon_ode): key.path=value (repeatable)");
    sub->add_option("--stage2-set", o->stage2_set, "override a stage-2 recipe value: key.path=value (repeatable)");
    sub->add_flag("--reuse", o->reuse, "keep --out and skip stages whose export exists (delete an export to re-run it)");
    sub->add_option("--train-rows", o->train_rows, "synthetic training rows (default 64)");
    set_action(sub, [=] {
      train::check_demo_recipe(o->recipe);
      o->device = io::parse_device(*device);
      auto report = train::run_demo(*o);
      std::cout << train::demo_report_text(report);
      return report.lineage_verified ? 0 : 1;
    });
  }
  {
    auto* sub = app.add_subcommand("train", "Train from a FastVideo-style YAML recipe (--a.b value overrides)");
    auto config = std::make_shared<std::string>();
    auto device = std::make_shared<std::string>("auto");
    auto dry = std::make_shared<bool>(false);
    auto no_progress = std::make_shared<bool>(false);
    auto opts = std::make_shared<train::TrainerOptions>();
    auto sync_ckpt = std::make_shared<bool>(false);
    sub->add_flag("--overwrite-run", opts->overwrite_run,
                  "start a new run in an output_dir that holds another run (deletes that run's checkpoints and metrics)");
    auto nondet = std::make_shared<bool>(false);
    sub->add_flag("--nondeterministic", *nondet,
                  "GPU: torch's default (faster, not bitwise reproducible) algorithms instead of deterministic ones");
    sub->add_flag("--sync-checkpoints", *sync_ckpt, "write checkpoints on the training thread (default: in the background)");
    sub->add_option("--log-every-steps", opts->log_every_steps,
                    "progress line on stdout every N steps when stdout is not a terminal (default 10; 0: off)");
    sub->add_option("--log-every-seconds", opts->log_every_s,
                    "... or every S seconds, whichever comes first (default 60; 0: off)");
    auto dist_timeout = std::make_shared<double>(600.0);
    sub->add_option("config", *config, "recipe YAML")->required();
    sub->add_option("--dist-timeout", *dist_timeout,
                    "seconds the rendezvous and every collective may take in a launched job (default 600): a rank "
                    "that died or hangs fails every rank after this, naming it");
    sub->add_option("--device", *device, "cpu | cuda | cuda:N | auto (default)");
    sub->add_flag("--dry-run", *dry, "validate, build every role, print the resolved config, quant plan and memory estimate");
    sub->add_flag("--no-progress", *no_progress, "no progress bar");
    sub->allow_extras();  // --a.b.c value overrides
    set_action(sub, [=] {
      // A misspelt flag of `vqad train` would otherwise be read as a config override.
      for (const auto& tok : sub->remaining()) {
        if (tok.rfind("--", 0) != 0 || tok.find('.') != std::string::npos) continue;
        std::vector<std::string> flags;
        for (const CLI::Option* opt : sub->get_options())
          for (const auto& n : opt->get_lnames()) flags.push_back("--" + n);
        const std::string best = closest(tok.substr(0, tok.find('=')), flags);
        fail("unknown flag '", tok, "' of 'vqad train'", best.empty() ? "" : "; did you mean '" + best + "'?",
             best.empty() ? " (config overrides are --section.key value)" : "");
      }
      // Overrides are validated with the config before anything is built or loaded.
      auto run = train::load_run_config(*config, sub->remaining());
      train::TrainerOptions o = *opts;
      o.async_checkpoints = !*sync_ckpt;
      o.deterministic = !*nondet;
      o.device = io::parse_device(*device);
      o.dry_run = *dry;
      o.progress = !*no_progress;
      // A rank of a launched job (vqad launch, torchrun, srun): join the world first.
      const auto env = dist::launch_env();
      std::shared_ptr<dist::ProcessGroup> pg;
      if (env.distributed() && !*dry) {
        if (o.device.is_cuda()) o.device = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(env.local_rank));
        VQAD_CHECK(*dist_timeout > 0, "--dist-timeout must be > 0 seconds, found ", *dist_timeout);
        const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(*dist_timeout * 1000.0));
        pg = dist::ProcessGroup::init(env, {timeout, o.device});
        if (env.rank != 0) {
          o.progress = false;
          if (!std::getenv("VQAD_LOG")) log::set_level(log::Level::kWarn);  // rank 0 logs
        }
      }
      train::TrainSummary s;
      try {
        train::Trainer trainer(run, o);
        if (*dry) {
          trainer.print_dry_run();
          return 0;
        }
        install_run_signal_handlers();
        s = trainer.run();
      } catch (const std::exception& e) {
        if (pg) pg->report_failure(e.what());
        throw;
      }
      // A stop by signal: rank 0 reports it and where to resume.
      if (s.stop_signal) {
        if (env.rank != 0) return 128 + s.stop_signal;
        std::cout << "stopped by " << signal_name(s.stop_signal) << " after step " << s.last_step;
        if (!s.checkpoints.empty())
          std::cout << "; checkpoint " << s.checkpoints.back()
                    << " (resume with --training.checkpoint.resume_from_checkpoint latest)";
        std::cout << "\n";
        return 128 + s.stop_signal;
      }
      if (env.rank != 0) return 0;
      std::cout << "trained steps " << s.first_step << ".." << s.last_step << " in " << s.seconds << " s";
      if (!s.losses.empty()) std::cout << ", final loss " << s.losses.back();
      std::cout << "\n";
      for (const auto& c : s.checkpoints) std::cout << "checkpoint " << c << "\n";
      return 0;
    });
  }
  {
    auto* sub = app.add_subcommand("lineage", "Print (and verify) the lineage of a checkpoint or export");
    auto path = std::make_shared<std::string>();
    auto verify = std::make_shared<bool>(false);
    sub->add_option("path", *path, "checkpoint or export directory, or a metadata JSON file (vqad's or "
                                   "FastVideo's schema)")->required();
    sub->add_flag("--verify", *verify, "check ids, parents and stage inits at every level; for a directory also "
                                       "the file hashes and the parent exports on disk");
    set_action(sub, [=] {
      auto meta = train::read_metadata_path(*path);
      std::cout << train::lineage_text(meta);
      if (!*verify) return 0;
      auto problems = train::verify_lineage(*path);
      if (problems.empty()) {
        std::cout << "lineage verified\n";
        return 0;
      }
      for (const auto& p : problems) std::cout << "FAILED: " << p << "\n";
      return 1;
    });
  }
}

}  // namespace vqad::cli
