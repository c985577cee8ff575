// `vqad data synth | inspect | bench` end to end through the executable.
#include <gtest/gtest.h>

#include "test_data_util.h"

namespace fs = std::filesystem;
using namespace vqad::test_data;

TEST(DataCli, SynthInspectBench) {
  auto dir = fresh_dir("cli");
  const std::string bin = VQAD_BINARY;
  const std::string root = (dir / "ds").string();
  auto r = run_command(bin + " data synth " + root +
                       " --rows 6 --latent-t 2 --latent-h 4 --latent-w 6 --text-dim 16 --rows-per-file 4 --seed 3");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("wrote 6 rows in 2 files"), std::string::npos) << r.output;

  r = run_command(bin + " data inspect " + root + " --rows 2");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("t2v schema"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("vae_latent_shape"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("files 2, row groups 2, rows 6"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("id=synth_00000001 latent=[16, 2, 4, 6]"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("moving"), std::string::npos) << r.output;  // a caption

  const std::string json = (dir / "bench.json").string();
  r = run_command(bin + " data bench " + root + " --batch-size 2 --json " + json);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("read 6 rows in 3 batches"), std::string::npos) << r.output;
  EXPECT_TRUE(fs::exists(json));

  r = run_command(bin + " data inspect " + (dir / "nothing").string());
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("does not exist"), std::string::npos) << r.output;
  fs::remove_all(dir);
}
