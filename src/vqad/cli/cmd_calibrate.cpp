// `vqad calibrate CONFIG [--a.b value overrides] --out FILE`: the nvfp4_qad calibration
// pass (train/calibrate.h); the table it writes is training.linear_quantization.act_amax_json.
#include <chrono>
#include <cstdlib>
#include <iostream>

#include "vqad/cli/commands.h"
#include "vqad/core/error.h"
#include "vqad/core/log.h"
#include "vqad/dist/env.h"
#include "vqad/dist/process_group.h"
#include "vqad/io/device.h"
#include "vqad/train/calibrate.h"
#include "vqad/train/config.h"
#include "vqad/train/trainer.h"

namespace vqad::cli {

void register_calibrate_commands(CLI::App& app) {
  auto* sub = app.add_subcommand(
      "calibrate", "nvfp4_qad: run the recipe's data through the student and write the static linears' amax table "
                   "(the file training.linear_quantization.act_amax_json loads)");
  auto config = std::make_shared<std::string>();
  auto out = std::make_shared<std::string>();
  auto device = std::make_shared<std::string>("auto");
  auto batches = std::make_shared<int64_t>(0);
  auto dist_timeout = std::make_shared<double>(600.0);
  sub->add_option("config", *config, "recipe YAML")->required();
  sub->add_option("--out", *out, "the amax table to write (JSON {\"b<block>.<sub>\": amax})")->required();
  sub->add_option("--batches", *batches,
                  "batches per rank (default training.linear_quantization.calibration_batches)");
  sub->add_option("--device", *device, "cpu | cuda | cuda:N | auto (default)");
  sub->add_option("--dist-timeout", *dist_timeout, "seconds the rendezvous and every collective may take (default 600)");
  sub->allow_extras();  // --a.b.c value overrides
  set_action(sub, [=] {
    for (const auto& tok : sub->remaining())
      if (tok.rfind("--", 0) == 0 && tok.find('.') == std::string::npos)
        fail("unknown flag '", tok, "' of 'vqad calibrate' (config overrides are --section.key value)");
    auto run = train::load_run_config(*config, sub->remaining());
    train::CalibrateOptions o;
    o.device = io::parse_device(*device);
    o.out = *out;
    o.batches = *batches;
    const auto env = dist::launch_env();
    // training.distributed.num_gpus > 1 is the world the recipe runs on (as for `vqad train`): a
    // single process calibrating it would record the maxima of one rank's share of the data.
    // (num_gpus 1, the default, under a launcher: the launched ranks are the world.)
    const int64_t num_gpus = run.training.distributed.num_gpus;
    if (num_gpus > 1 && num_gpus != env.world_size) {
      if (env.world_size == 1)
        fail("training.distributed.num_gpus = ", num_gpus, " but vqad calibrate runs as a single process; start "
             "the ranks with `vqad launch --nproc ", num_gpus, " calibrate ", *config, " --out ", *out,
             "` (or torchrun / srun), or calibrate on one device with --training.distributed.num_gpus 1");
      fail("training.distributed.num_gpus = ", num_gpus, " but this process is one of ", env.world_size,
           " launched ranks; launch ", num_gpus, " ranks or set --training.distributed.num_gpus ", env.world_size);
    }
    std::shared_ptr<dist::ProcessGroup> pg;
    if (env.distributed()) {
      if (o.device.is_cuda()) o.device = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(env.local_rank));
      VQAD_CHECK(*dist_timeout > 0, "--dist-timeout must be > 0 seconds, found ", *dist_timeout);
      pg = dist::ProcessGroup::init(env, {std::chrono::milliseconds(static_cast<int64_t>(*dist_timeout * 1000.0)),
                                          o.device});
      if (env.rank != 0 && !std::getenv("VQAD_LOG")) log::set_level(log::Level::kWarn);
    }
    train::CalibrateSummary s;
    try {
      s = train::calibrate_run(run, o);
    } catch (const std::exception& e) {
      if (pg) pg->report_failure(e.what());
      throw;
    }
    if (env.rank != 0) return 0;
    std::cout << "calibrated " << s.amax.size() << " static linear(s) over " << s.samples << " sample(s) ("
              << s.batches << " batch(es) x " << s.world_size << " rank(s), MAX across ranks); wrote " << s.out
              << "\n";
    return 0;
  });
}

}  // namespace vqad::cli
