// TMA tensor maps for the sm_90 attention kernels. BLHD views (kernels/common/launch.h): a 4-D tiled map (D, L, H, B), innermost first, whose box is 64 channels
// (128 bytes, the 128-byte swizzle's row) by `box_rows` rows of one (batch, head). A tile
// of R rows x 128 channels is two boxes (channels 0-63 and 64-127) written one after the
// other: the [2][R][64] 128-byte-swizzled layout the attention kernels' wgmma descriptors
// read. Rows past L arrive as zeros.
#pragma once
#include <cuda.h>

#include <string>

#include "vqad/kernels/common/launch.h"

namespace vqad::kernels {

// Fills *map for a BF16 [B, L, H, D] view with D a multiple of 64. Returns an empty string
// on success, else what the driver or the view's layout refused (for the caller's one-line
// launch error).
std::string make_blhd_tensor_map(CUtensorMap* map, const void* data, const BlhdStrides& stride, int batch, int len,
                                 int heads, int head_dim, int box_rows);

// Fills *map for rows of 4 floats (16 bytes), [slices][rows][4] contiguous (the attention
// backward's row statistics): a 3-D tiled map (4, rows, slices) whose box is `box_rows`
// rows of one slice, no swizzle. Rows past `rows` arrive as zeros.
std::string make_f32x4_rows_tensor_map(CUtensorMap* map, const void* data, int rows, int slices, int box_rows);

}  // namespace vqad::kernels
