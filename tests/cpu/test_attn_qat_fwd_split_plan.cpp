// The forward's key-split plan (kernels/attention/attn_qat_fwd_split.h): which of the
// grid's last tiles split and where, from the makespan model of the last wave.
#include <gtest/gtest.h>

#include "vqad/kernels/attention/attn_qat_fwd_split.h"

namespace ka = vqad::kernels::attention;

namespace {

constexpr int kSms = 132;  // H100 / H200

TEST(AttnQatFwdSplitPlan, ThreeHeadsOf31200Tokens) {
  // 732 query tiles: 5 waves and 72 tiles; 144 parts on 132 SMs, 12 SMs run two earlier
  // parts: x near 1 / (3 - q) of the 244 KV tiles.
  const ka::AttnQatFwdSplit p = ka::attn_qat_fwd_split_plan(3 * 244, 244, kSms);
  EXPECT_EQ(p.tiles, 72);
  EXPECT_NEAR(p.key_tile, 244.0 / (3.0 - ka::kAttnQatFwdMaxOnlyCost), 1.0);
  EXPECT_NEAR(p.makespan, 1.0 - (1.0 - ka::kAttnQatFwdMaxOnlyCost) / (3.0 - ka::kAttnQatFwdMaxOnlyCost), 0.01);
  EXPECT_LT(p.makespan, 0.75);
}

TEST(AttnQatFwdSplitPlan, TwelveHeadsOf31200Tokens) {
  // 2928 tiles: a last wave of 24, whose 48 parts each get an SM: x near 1 / (2 - q).
  const ka::AttnQatFwdSplit p = ka::attn_qat_fwd_split_plan(12 * 244, 244, kSms);
  EXPECT_EQ(p.tiles, 24);
  EXPECT_NEAR(p.key_tile, 244.0 / (2.0 - ka::kAttnQatFwdMaxOnlyCost), 1.0);
  EXPECT_NEAR(p.makespan, 1.0 / (2.0 - ka::kAttnQatFwdMaxOnlyCost), 0.01);
}

TEST(AttnQatFwdSplitPlan, NoSplitWhereItWouldNotHelp) {
  // 768 tiles: a last wave of 108 would need 216 parts, three earlier parts on some SMs.
  EXPECT_EQ(ka::attn_qat_fwd_split_plan(12 * 64, 64, kSms).tiles, 0);
  EXPECT_EQ(ka::attn_qat_fwd_split_plan(2 * kSms, 64, kSms).tiles, 0);  // whole waves
  EXPECT_EQ(ka::attn_qat_fwd_split_plan(5, 1, kSms).tiles, 0);          // one KV tile
  EXPECT_EQ(ka::attn_qat_fwd_split_plan(0, 8, kSms).tiles, 0);
}

TEST(AttnQatFwdSplitPlan, SmallGridsSplitEveryTile) {
  // 16 tiles over 7 KV tiles (the benchmarks' reference check): each part has its SM.
  const ka::AttnQatFwdSplit p = ka::attn_qat_fwd_split_plan(16, 7, kSms);
  EXPECT_EQ(p.tiles, 16);
  EXPECT_EQ(p.key_tile, 4);  // 4/7 = 0.571: earlier 0.571, later 1 - 0.75 * 0.571 = 0.571
  EXPECT_NEAR(p.makespan, 4.0 / 7.0, 1e-9);
  // Two KV tiles: split at 1, earlier 0.5, later 0.625.
  const ka::AttnQatFwdSplit q = ka::attn_qat_fwd_split_plan(10, 2, kSms);
  EXPECT_EQ(q.tiles, 10);
  EXPECT_EQ(q.key_tile, 1);
  EXPECT_NEAR(q.makespan, 0.625, 1e-9);
}

TEST(AttnQatFwdSplitPlan, TheModel) {
  // One part per SM: the longer of the two parts.
  EXPECT_NEAR(ka::attn_qat_fwd_split_makespan(10, kSms, 50, 100, 0.25), 0.625, 1e-12);
  // 12 of 132 SMs run two earlier parts.
  EXPECT_NEAR(ka::attn_qat_fwd_split_makespan(72, kSms, 40, 100, 0.25), 0.8, 1e-12);
  EXPECT_NEAR(ka::attn_qat_fwd_split_makespan(72, kSms, 30, 100, 0.25), 0.775, 1e-12);
  // The plan picks the best of the KV tiles around the optimum, and never one above 1.
  for (int64_t tiles : {1, 17, 100, 131, 133, 200, 300, 732, 1000, 2928})
    for (int64_t kv : {2, 3, 7, 64, 244}) {
      const ka::AttnQatFwdSplit p = ka::attn_qat_fwd_split_plan(tiles, kv, kSms);
      if (p.tiles == 0) continue;
      EXPECT_EQ(p.tiles, tiles % kSms);
      EXPECT_GE(p.key_tile, 1);
      EXPECT_LT(p.key_tile, kv);
      EXPECT_LT(p.makespan, 1.0) << tiles << " x " << kv;
      EXPECT_NEAR(p.makespan, ka::attn_qat_fwd_split_makespan(p.tiles, kSms, p.key_tile, kv), 1e-12);
    }
}

}  // namespace
