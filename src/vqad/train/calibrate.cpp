#include "vqad/train/calibrate.h"

#include <ATen/CPUGeneratorImpl.h>

#include <filesystem>

#include "vqad/core/error.h"
#include "vqad/core/log.h"
#include "vqad/data/dataset.h"
#include "vqad/data/loader.h"
#include "vqad/data/sampler.h"
#include "vqad/dist/batch_random.h"
#include "vqad/dist/process_group.h"
#include "vqad/model/quant_plan.h"
#include "vqad/ops/nvfp4_linear.h"
#include "vqad/train/dataset_spec.h"
#include "vqad/train/methods/registry.h"
#include "vqad/train/role_quant.h"
#include "vqad/config/linear_quantization.h"

namespace fs = std::filesystem;

namespace vqad::train {

CalibrateSummary calibrate_run(const RunConfig& run_in, const CalibrateOptions& o) {
  VQAD_CHECK(!o.out.empty(), "vqad calibrate: --out FILE is required (the amax table to write)");
  const RoleConfig& sc = run_in.role("student");
  VQAD_CHECK(sc.quant_config == "nvfp4_qad", "vqad calibrate: models.student.quant_config is '", sc.quant_config,
             "'; calibration records the static activation scales of nvfp4_qad (set "
             "--pipeline.dit_config.quant_config nvfp4_qad)");
  // The table is what this pass produces: an existing one is not loaded (every static
  // linear is calibrated afresh).
  RunConfig run = run_in;
  if (run.resolved["training"].contains("linear_quantization"))
    run.resolved["training"]["linear_quantization"]["act_amax_json"] = "";
  const auto& tc = run.training;
  const int64_t batches = o.batches > 0 ? o.batches : linear_quantization_config(run).calibration_batches;
  VQAD_CHECK(batches >= 1, "vqad calibrate: --batches must be >= 1, found ", batches);
  VQAD_CHECK(!tc.data.data_path.empty(), "training.data.data_path: no dataset path given");
  VQAD_CHECK(tc.data.preprocessed_data_type != "text_only", "vqad calibrate: training.data.preprocessed_data_type "
             "text_only has no latents to run through the student; calibrate with a t2v dataset "
             "(--training.data.data_path ... --training.data.preprocessed_data_type t2v)");

  auto world = dist::world();
  const int world_size = world ? world->size() : 1;
  const int rank = world ? world->rank() : 0;
  VQAD_CHECK(tc.distributed.sp_size == 1, "training.distributed.sp_size = ", tc.distributed.sp_size,
             ": vqad calibrate runs data-parallel ranks only (sp_size 1)");

  // The student exactly as `vqad train` builds it (same seed for a random init: the trainer
  // seeds the roles data.seed, data.seed + 1, ... in the method's build order).
  RoleBuildOptions ro;
  ro.device = o.device;
  uint64_t seed = static_cast<uint64_t>(tc.data.seed);
  for (const auto& name : run.method.roles()) {
    if (name == "student") break;
    ++seed;
  }
  ro.seed = seed;
  auto student = build_role_for_calibration(run, "student", ro);
  const auto layers = model::qad_linears(student->quants);
  student->model->train(false);

  auto dataset = data::make_dataset(training_dataset_spec(run, student->model->config()));
  log::info("calibrate: ", dataset->description(), ", ", batches, " batch(es) per rank, ", world_size, " rank(s)");
  dist::set_batch_shard({rank, world_size});
  auto sopt = data::sampler_options_for_rank(dataset->size(), tc.data.train_batch_size, world_size, 1, rank,
                                             tc.data.seed);
  data::PrefetchLoader loader(dataset, data::DpSpBatchSampler(sopt), 2);
  torch::Generator gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(tc.data.seed));

  ops::AmaxReducer reducer;
  if (world && world_size > 1) {
    reducer = [world](torch::Tensor& maxima) {
      torch::Tensor buf = maxima.to(world->device());
      world->all_reduce(buf, dist::ReduceOp::kMax, "calibration amax (MAX over ranks)");
      maxima.copy_(buf.cpu());
    };
  }
  CalibrateSummary summary;
  summary.world_size = world_size;
  summary.batches = batches;
  {
    ops::CalibrationScope scope(layers, reducer, /*recalibrate=*/true);
    VQAD_CHECK(!scope.pending_names().empty(), "vqad calibrate: the student's nvfp4_qad plan has no static linears "
               "(training.linear_quantization.quantize_ffn false?); nothing to calibrate");
    torch::NoGradGuard no_grad;
    const auto dtype = student->model->options().compute_dtype;
    int64_t samples = 0;
    for (int64_t b = 0; b < batches; ++b) {
      data::Batch batch = loader.next();
      torch::Tensor x, t;
      if (batch.latent.defined()) {
        auto x0 = batch.latent.to(o.device, dtype);
        auto noise =
            dist::randn_batch(batch.latent.sizes(), gen, torch::TensorOptions(torch::kFloat32)).to(o.device, dtype);
        const int64_t B = x0.size(0);
        auto u = dist::rand_batch({B}, gen, torch::TensorOptions(torch::kFloat64));
        auto acc = u.accessor<double, 1>();
        std::vector<double> tv(B);
        for (int64_t i = 0; i < B; ++i) tv[i] = student->grid.timestep(student->grid.index_from_uniform(acc[i]));
        t = torch::tensor(tv, torch::kFloat64);
        x = student->grid.add_noise(x0, noise, t);
      } else {
        VQAD_CHECK(batch.ode_start.defined() && batch.ode_sigma.defined(), "vqad calibrate: batch ", b,
                   " holds neither latents nor ODE pairs");
        x = batch.ode_start.to(o.device, dtype);
        t = batch.ode_sigma.to(torch::kFloat64) * 1000.0;
      }
      student->model->forward(x, t.to(o.device, torch::kFloat32), batch.text.to(o.device, dtype));
      samples += x.size(0);
    }
    summary.samples = samples;
    if (reducer) {
      torch::Tensor n = torch::full({1}, static_cast<double>(samples), torch::kFloat64);
      torch::Tensor buf = n.to(world->device());
      world->all_reduce(buf, dist::ReduceOp::kSum, "calibration sample count");
      summary.samples = static_cast<int64_t>(buf.cpu().item<double>());
    }
    summary.amax = scope.finish();
  }
  summary.table = model::export_amax_table(layers);
  summary.out = o.out;
  if (rank == 0) {
    const fs::path parent = fs::absolute(o.out).parent_path();
    VQAD_CHECK(fs::is_directory(parent), "vqad calibrate: --out ", o.out, ": directory ", parent.string(),
               " does not exist");
    model::save_amax_table(layers, o.out);
  }
  if (world && world_size > 1) world->barrier("calibration table written");
  return summary;
}

}  // namespace vqad::train
