// MP4 (H.264, yuv420p) writer over the ffmpeg libraries (libavformat / libavcodec /
// libswscale from the system packages). A build without them has no writer:
// video_writer_available() is false and write_mp4 throws a vqad::Error saying so, so a
// run that asked for videos never silently produces none.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace vqad::media {

bool video_writer_available();

struct VideoSpec {
  int width = 0, height = 0;  // pixels; H.264 with yuv420p needs even sizes (odd ones are padded by one)
  int fps = 16;
  int crf = 18;               // x264 quality (lower is better)
};

// frames: F x height x width x 3 RGB bytes, frame-major. Written atomically (temporary
// file + rename); errors name the path and the ffmpeg call.
void write_mp4(const std::string& path, const std::vector<uint8_t>& rgb_frames, int num_frames,
               const VideoSpec& spec);

}  // namespace vqad::media
