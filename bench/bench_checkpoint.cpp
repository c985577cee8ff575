// `vqad bench checkpoint`: trainer checkpoint save and load against a plain write and read
// of the same bytes on the same disk in the same run, and the training stall a save causes.
//
// The state is a Wan model of the chosen preset on the chosen device with a populated AdamW
// state (weights + two moments: ~16 GB at 1.3B), saved by the trainer's CheckpointWriter.
// Reported: the plain sequential write (write + one fsync, like dd conv=fsync) and read
// (after evicting the file from the page cache); the save's blocking time on the training
// thread, its background write time and rate as a % of the plain write; how much slower a
// stand-in training step (matmuls on the device) runs while the write is in flight; the load
// (integrity verification + weights + optimizer state) rate as a % of the plain read.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <torch/torch.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <atomic>
#include <vector>

#include "bench/bench_util.h"
#include "vqad/cli/commands.h"
#include "vqad/core/error.h"
#include "vqad/core/file_io.h"
#include "vqad/core/sha256.h"
#include "vqad/io/device.h"
#include "vqad/model/wan/model.h"
#include "vqad/train/checkpoint_dir.h"
#include "vqad/train/checkpoint_writer.h"
#include "vqad/train/integrity.h"
#include "vqad/train/trainer.h"

namespace fs = std::filesystem;

namespace vqad::cli {
namespace {

struct BenchCheckpointArgs {
  std::string model = "tiny";
  std::string device = "auto";
  std::string dir = "bench-checkpoint";  // where checkpoints go (the disk measured)
  std::string out = "bench-results";
  int saves = 3;
  int work_steps = 20;  // stand-in training steps timed while each save is written
  bool keep = false;
};

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void evict(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return;
  ::fdatasync(fd);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

void evict_tree(const std::string& dir) {
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file()) evict(e.path().string());
}

double plain_read_s(const std::string& path) {
  evict(path);
  const double t0 = now_s();
  const int fd = ::open(path.c_str(), O_RDONLY);
  VQAD_CHECK(fd >= 0, "bench checkpoint: cannot open ", path);
  std::vector<char> buf(size_t(64) << 20);
  while (::read(fd, buf.data(), buf.size()) > 0) {
  }
  ::close(fd);
  return now_s() - t0;
}

int run_bench_checkpoint(const BenchCheckpointArgs& a) {
  VQAD_CHECK(a.saves >= 1, "--saves must be >= 1");
  const torch::Device device = io::parse_device(a.device);
  torch::manual_seed(1);
  auto role = std::make_shared<train::Role>();
  role->name = "student";
  role->config.trainable = true;
  model::WanModelOptions mo;
  mo.device = torch::kCPU;
  role->model = std::make_shared<model::WanModel>(model::WanConfig::preset(a.model), mo);
  role->model->to(device);
  std::vector<torch::Tensor> params;
  for (auto& p : role->model->parameters()) params.push_back(p);
  train::RoleOptimizers optimizers;
  optimizers["student"].params = params;
  optimizers["student"].adamw = std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(1e-4));
  {
    torch::NoGradGuard ng;
    for (auto& p : params) {
      auto st = std::make_unique<torch::optim::AdamWParamState>();
      st->step(10);
      st->exp_avg(torch::randn_like(p) * 1e-3);
      st->exp_avg_sq(torch::rand_like(p) * 1e-6);
      optimizers["student"].adamw->state()[p.unsafeGetTensorImpl()] = std::move(st);
    }
  }
  std::map<std::string, std::shared_ptr<train::Role>> roles{{"student", role}};
  int64_t numel = 0;
  for (auto& p : params) numel += p.numel();
  const double state_bytes = static_cast<double>(numel) * 12.0;

  const fs::path dir = fs::absolute(a.dir);
  VQAD_CHECK(!fs::exists(dir) || fs::is_empty(dir), "bench checkpoint: --dir ", dir.string(),
             " must be new or empty (the bench deletes what it writes there)");
  train::create_dir_or_fail(dir.string(), "bench checkpoint --dir");

  // Plain write of the same bytes: one file, large writes, one fsync.
  const std::string plain = (dir / "plain.bin").string();
  std::vector<char> host(static_cast<size_t>(std::min<double>(state_bytes, 1ull << 30)), 1);
  std::vector<std::string_view> parts;
  for (double left = state_bytes; left > 0; left -= static_cast<double>(host.size()))
    parts.emplace_back(host.data(), static_cast<size_t>(std::min<double>(left, static_cast<double>(host.size()))));
  double t0 = now_s();
  {
    const int fd = ::open(plain.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    VQAD_CHECK(fd >= 0, "bench checkpoint: cannot create ", plain);
    for (auto part : parts)
      for (size_t off = 0; off < part.size();) {
        const ssize_t w = ::write(fd, part.data() + off, std::min<size_t>(part.size() - off, size_t(64) << 20));
        VQAD_CHECK(w > 0, "bench checkpoint: write to ", plain, " failed: ", write_error_text(errno));
        off += static_cast<size_t>(w);
      }
    VQAD_CHECK(::fsync(fd) == 0, "bench checkpoint: fsync of ", plain, " failed");
    ::close(fd);
  }
  const double plain_write_s = now_s() - t0;
  const double plain_read = plain_read_s(plain);
  fs::remove(plain);

  // The stand-in training step.
  auto x = torch::randn({1024, 1024}, torch::TensorOptions().device(device));
  auto work = [&] {
    const double s = now_s();
    auto y = x;
    for (int i = 0; i < 8; ++i) y = torch::mm(y, x) * 1e-3;
    if (device.is_cuda()) y.cpu();
    (void)y.sum().item<float>();
    return now_s() - s;
  };
  std::vector<double> idle;
  for (int i = 0; i < a.work_steps; ++i) idle.push_back(work());
  const double idle_step = bench::median(idle);

  train::CheckpointWriter writer((dir / "run").string(), 2, true);
  // As the trainer does: host buffers are allocated in the background before the first save
  // (timed here while stand-in steps run, so its cost to training shows as well).
  double prepare_s = 0, prepare_step = idle_step;
  {
    const double tp = now_s();
    std::vector<double> during;
    std::thread waiter;
    std::atomic<bool> done{false};
    writer.prepare(roles, {"student"}, optimizers);
    waiter = std::thread([&] {
      writer.wait_prepared();
      prepare_s = now_s() - tp;
      done = true;
    });
    while (!done && during.size() < 100000) during.push_back(work());
    waiter.join();
    if (!during.empty()) prepare_step = bench::median(during);
  }
  std::printf("host buffers allocated in the background in %.3f s (stand-in step %.4f s meanwhile, %.4f s idle)\n",
              prepare_s, prepare_step, idle_step);
  std::vector<double> stall, write_s, busy_step;
  for (int s = 1; s <= a.saves; ++s) {
    stall.push_back(writer.save(s, roles, {"student"}, optimizers, nlohmann::json{{"step", s}, {"data", nlohmann::json::object()},
                                                                     {"generator_state", ""}},
                                "bench: true\n", nlohmann::json{{"metadata_schema", "vqad.bench_checkpoint"}}));
    std::vector<double> during;
    while (writer.busy() && static_cast<int>(during.size()) < 100000) {
      during.push_back(work());
      if (static_cast<int>(during.size()) >= a.work_steps) break;
    }
    writer.wait();
    const auto ti = writer.last_timings();
    std::printf("save %d: blocked %.3f s (wait %.3f, finite scan %.3f, stage %.3f with %.2f GB of new host buffers), "
                "write %.3f s (copy wait %.3f, files %.3f, publish %.3f)\n",
                s, stall.back(), ti.wait_previous_s, ti.finite_scan_s, ti.stage_s, ti.new_host_bytes / 1e9,
                writer.last_write_seconds(), ti.copy_wait_s, ti.files_s, ti.publish_s);
    write_s.push_back(writer.last_write_seconds());
    if (!during.empty()) busy_step.push_back(bench::median(during));
  }
  const double saved_bytes = static_cast<double>(writer.last_bytes());
  const train::SaveTimings tim = writer.last_timings();
  const std::string last = writer.last_good();

  // Load: integrity verification + weights + AdamW state, from a cold page cache.
  evict_tree(last);
  t0 = now_s();
  train::LoadTimings lt;
  train::load_checkpoint_state(last, roles, {"student"}, optimizers, &lt);
  if (device.is_cuda()) torch::cuda::synchronize();
  const double load_s = now_s() - t0;
  // SHA-256 from memory (the hash every save computes and every load verifies).
  double sha_gbps = 0;
  {
    std::vector<char> buf(size_t(1) << 30, 3);
    const double ts = now_s();
    (void)sha256_hex(std::string_view(buf.data(), buf.size()));
    sha_gbps = static_cast<double>(buf.size()) / (now_s() - ts) / 1e9;
  }

  const double med_write = bench::median(write_s);
  const double plain_w_gbps = state_bytes / plain_write_s / 1e9, save_gbps = saved_bytes / med_write / 1e9;
  const double plain_r_gbps = state_bytes / plain_read / 1e9, load_gbps = saved_bytes / load_s / 1e9;
  bench::Table t({"measure", "seconds", "GB/s", "% of plain"});
  t.add({"plain write (write + fsync)", bench::fmt(plain_write_s, 3), bench::fmt(plain_w_gbps), "100"});
  t.add({"checkpoint save: background write", bench::fmt(med_write, 3), bench::fmt(save_gbps),
         bench::fmt(100.0 * save_gbps / plain_w_gbps, 1)});
  t.add({"checkpoint save: training thread blocked (median)", bench::fmt(bench::median(stall), 3), "", ""});
  t.add({"checkpoint save: training thread blocked (max)", bench::fmt(*std::max_element(stall.begin(), stall.end()), 3),
         "", ""});
  t.add({"host buffers, allocated in the background", bench::fmt(prepare_s, 3), "", ""});
  t.add({"  last save: wait for previous / finite scan / stage", bench::fmt(tim.wait_previous_s, 3) + " / " +
         bench::fmt(tim.finite_scan_s, 3) + " / " + bench::fmt(tim.stage_s, 3), "", ""});
  t.add({"  last save: copy wait / files / publish", bench::fmt(tim.copy_wait_s, 3) + " / " +
         bench::fmt(tim.files_s, 3) + " / " + bench::fmt(tim.publish_s, 3), "", ""});
  t.add({"plain read (cold)", bench::fmt(plain_read, 3), bench::fmt(plain_r_gbps), "100"});
  t.add({"checkpoint load (verify + load, cold)", bench::fmt(load_s, 3), bench::fmt(load_gbps),
         bench::fmt(100.0 * load_gbps / plain_r_gbps, 1)});
  t.add({"  load: verify / weights / optimizer", bench::fmt(lt.verify_s, 3) + " / " + bench::fmt(lt.weights_s, 3) +
         " / " + bench::fmt(lt.optimizer_s, 3), "", ""});
  t.add({"sha256 from memory (1 GiB, one thread)", "", bench::fmt(sha_gbps), ""});
  std::printf("vqad bench checkpoint: %s on %s, %.2f GB of trainer state, %d saves into %s\n%s", a.model.c_str(),
              device.str().c_str(), saved_bytes / 1e9, a.saves, dir.c_str(), t.str().c_str());
  const double busy = busy_step.empty() ? idle_step : bench::median(busy_step);
  std::printf("stand-in training step: %.4f s idle, %.4f s while a save is written (%.1f%% slower)\n", idle_step, busy,
              100.0 * (busy / idle_step - 1.0));
  nlohmann::json j = {{"model", a.model},
                      {"device", device.str()},
                      {"state_bytes", saved_bytes},
                      {"plain_write_s", plain_write_s},
                      {"plain_read_s", plain_read},
                      {"save_write_s", write_s},
                      {"save_stall_s", stall},
                      {"load_s", load_s},
                      {"save_pct_of_plain_write", 100.0 * save_gbps / plain_w_gbps},
                      {"load_pct_of_plain_read", 100.0 * load_gbps / plain_r_gbps},
                      {"work_step_idle_s", idle_step},
                      {"work_step_during_save_s", busy},
                      {"last_save", {{"wait_previous_s", tim.wait_previous_s}, {"finite_scan_s", tim.finite_scan_s},
                                     {"stage_s", tim.stage_s}, {"new_host_bytes", tim.new_host_bytes},
                                     {"copy_wait_s", tim.copy_wait_s}, {"files_s", tim.files_s},
                                     {"publish_s", tim.publish_s}}},
                      {"load", {{"verify_s", lt.verify_s}, {"weights_s", lt.weights_s}, {"optimizer_s", lt.optimizer_s}}},
                      {"sha256_gbps", sha_gbps},
                      {"prepare_s", prepare_s}};
  std::printf("wrote %s\n", bench::write_json(a.out, "checkpoint.json", j).c_str());
  if (!a.keep) fs::remove_all(dir);
  return 0;
}

}  // namespace

void register_bench_checkpoint_commands(CLI::App& app) {
  auto a = std::make_shared<BenchCheckpointArgs>();
  auto* sub = bench_command(app)->add_subcommand(
      "checkpoint", "trainer checkpoint save/load vs a plain write/read of the same bytes, and the training stall");
  sub->add_option("--model", a->model, "Wan preset: tiny | tiny-hd128 | 1.3B | 14B")->capture_default_str();
  sub->add_option("--device", a->device, "cpu | cuda | auto")->capture_default_str();
  sub->add_option("--dir", a->dir, "new or empty directory on the disk to measure (removed afterwards)")
      ->capture_default_str();
  sub->add_option("--saves", a->saves, "checkpoint saves (median reported)")->capture_default_str();
  sub->add_option("--work-steps", a->work_steps, "stand-in training steps timed per save")->capture_default_str();
  sub->add_option("--out", a->out, "directory for checkpoint.json")->capture_default_str();
  sub->add_flag("--keep", a->keep, "keep the checkpoints under --dir");
  set_action(sub, [a] { return run_bench_checkpoint(*a); });
}

}  // namespace vqad::cli
