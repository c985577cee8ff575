// ATTN_QAT_TRAIN forward (attn_qat_fwd_sm90.cu) over a visit list of 64-row KV blocks
// instead of the contiguous key range: the KV-source policy of the same wgmma pipeline
// that serves the dense forward (the VSA fine stage, spec/attention.md "VSA", runs on it).
//
// Each 128-row query tile m_block of (b, h) has its own list of physical 64-row blocks of
// K / V (rows blk * 64 .. blk * 64 + 63 of that (b, h) in the k / v views). A 128-key KV
// tile of the kernel is two consecutive list entries, gathered into the tile's halves
// (rows 0-63, 64-127); a last odd entry leaves the second half empty (zeros). Rows of a
// block at and past its valid-token count are masked (P = 0) but loaded as they are, so
// they must hold finite values (the VSA tiling writes zeros there). The running max,
// the 16-key P quantization groups and the row sums restart per pair of visited blocks:
// ATTN_QAT_TRAIN at BLOCK_N = 128 over the gathered keys with each block's groups
// starting at its first key (vsa_ref tile_blocks = 2).
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "vqad/kernels/attention/attention_qat.h"

namespace vqad::kernels::attention {

// The head dimension of the visit-list kernels (forward and backward).
inline constexpr int kAttnQatVisitHeadDim = 128;
// Visited 64-row blocks per 128-key tile of the visit-list forward.
inline constexpr int kAttnQatVisitBlockRows = 64;
inline constexpr int kAttnQatVisitTileBlocks = kAttnQatBlockN / kAttnQatVisitBlockRows;

// Entry of a visit list: (block << 7) | valid_rows, valid_rows in [1, 64].
inline constexpr int kAttnQatVisitCountBits = 7;
constexpr int32_t attn_qat_visit_entry(int32_t block, int32_t valid_rows) {
  return (block << kAttnQatVisitCountBits) | valid_rows;
}
// Largest block index an entry holds.
inline constexpr int32_t kAttnQatVisitMaxBlock = (1 << (31 - kAttnQatVisitCountBits)) - 1;

struct AttnQatFwdVisit {
  // [B * H * q_tiles, stride] entries of each query tile's list, in visiting order, where
  // q_tiles = ceil(len_q / kAttnQatBlockM) and row = (b * H + h) * q_tiles + m_block.
  const int32_t* entries = nullptr;
  const int32_t* counts = nullptr;  // [B * H * q_tiles]: entries per list, >= 1
  int stride = 0;
  // [ceil(len_q / 64)] valid rows of each 64-row query block (the same for every b, h),
  // or null. A warpgroup whose 64 rows hold none skips its MMAs and writes nothing
  // (o, o_hp, m, l of those rows are left as they were).
  const int32_t* q_block_rows = nullptr;
};

// As launch_attn_qat_fwd (same params, numerics per tile, outputs for every query row
// < len_q), with the KV tiles taken from the lists; len_kv bounds the block rows.
void launch_attn_qat_fwd_visit(const AttnQatFwdParams& p, const AttnQatFwdVisit& visit, cudaStream_t stream);

}  // namespace vqad::kernels::attention
