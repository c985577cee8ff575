#include "vqad/media/video_writer.h"

#include <filesystem>

#include "vqad/core/error.h"

#ifdef VQAD_WITH_FFMPEG
extern "C" {
#include <libavcodec/avcodec.h>
#include <libavformat/avformat.h>
#include <libavutil/imgutils.h>
#include <libavutil/opt.h>
#include <libswscale/swscale.h>
}
#endif

namespace vqad::media {
namespace fs = std::filesystem;

#ifdef VQAD_WITH_FFMPEG
namespace {

std::string av_error(int code) {
  char buf[AV_ERROR_MAX_STRING_SIZE] = {0};
  av_strerror(code, buf, sizeof buf);
  return buf;
}

struct Encoder {
  AVFormatContext* fmt = nullptr;
  AVCodecContext* codec = nullptr;
  AVFrame* frame = nullptr;
  AVPacket* packet = nullptr;
  SwsContext* sws = nullptr;
  bool io_open = false;
  ~Encoder() {
    if (sws) sws_freeContext(sws);
    if (packet) av_packet_free(&packet);
    if (frame) av_frame_free(&frame);
    if (codec) avcodec_free_context(&codec);
    if (fmt) {
      if (io_open) avio_closep(&fmt->pb);
      avformat_free_context(fmt);
    }
  }
};

void drain(Encoder& e, AVStream* stream, const std::string& path) {
  while (true) {
    int rc = avcodec_receive_packet(e.codec, e.packet);
    if (rc == AVERROR(EAGAIN) || rc == AVERROR_EOF) return;
    VQAD_CHECK(rc >= 0, "video ", path, ": avcodec_receive_packet failed (", av_error(rc), ")");
    av_packet_rescale_ts(e.packet, e.codec->time_base, stream->time_base);
    e.packet->stream_index = stream->index;
    rc = av_interleaved_write_frame(e.fmt, e.packet);
    VQAD_CHECK(rc >= 0, "video ", path, ": writing a packet failed (", av_error(rc), ")");
  }
}

}  // namespace

bool video_writer_available() { return avcodec_find_encoder(AV_CODEC_ID_H264) != nullptr; }

void write_mp4(const std::string& path, const std::vector<uint8_t>& rgb, int num_frames, const VideoSpec& spec) {
  VQAD_CHECK(spec.width > 0 && spec.height > 0 && num_frames > 0 && spec.fps > 0, "video ", path,
             ": expected positive width, height, frame count and fps, found ", spec.width, "x", spec.height, ", ",
             num_frames, " frames, ", spec.fps, " fps");
  const size_t frame_bytes = size_t(spec.width) * spec.height * 3;
  VQAD_CHECK(rgb.size() == frame_bytes * num_frames, "video ", path, ": expected ", frame_bytes * num_frames,
             " RGB bytes for ", num_frames, " frames of ", spec.width, "x", spec.height, ", found ", rgb.size());
  const AVCodec* h264 = avcodec_find_encoder(AV_CODEC_ID_H264);
  VQAD_CHECK(h264 != nullptr, "video ", path, ": this ffmpeg build has no H.264 encoder");
  const int out_w = spec.width + (spec.width & 1), out_h = spec.height + (spec.height & 1);
  const fs::path final_path(path);
  const fs::path tmp = final_path.parent_path() / (".tmp-" + final_path.filename().string());

  Encoder e;
  int rc = avformat_alloc_output_context2(&e.fmt, nullptr, "mp4", tmp.c_str());
  VQAD_CHECK(rc >= 0 && e.fmt, "video ", path, ": cannot create an MP4 container (", av_error(rc), ")");
  AVStream* stream = avformat_new_stream(e.fmt, nullptr);
  VQAD_CHECK(stream, "video ", path, ": cannot add a stream");
  e.codec = avcodec_alloc_context3(h264);
  e.codec->width = out_w;
  e.codec->height = out_h;
  e.codec->pix_fmt = AV_PIX_FMT_YUV420P;
  e.codec->time_base = AVRational{1, spec.fps};
  e.codec->framerate = AVRational{spec.fps, 1};
  e.codec->gop_size = 12;
  if (e.fmt->oformat->flags & AVFMT_GLOBALHEADER) e.codec->flags |= AV_CODEC_FLAG_GLOBAL_HEADER;
  av_opt_set(e.codec->priv_data, "crf", std::to_string(spec.crf).c_str(), 0);
  av_opt_set(e.codec->priv_data, "preset", "medium", 0);
  rc = avcodec_open2(e.codec, h264, nullptr);
  VQAD_CHECK(rc >= 0, "video ", path, ": cannot open the H.264 encoder (", av_error(rc), ")");
  rc = avcodec_parameters_from_context(stream->codecpar, e.codec);
  VQAD_CHECK(rc >= 0, "video ", path, ": codec parameters (", av_error(rc), ")");
  stream->time_base = e.codec->time_base;
  rc = avio_open(&e.fmt->pb, tmp.c_str(), AVIO_FLAG_WRITE);
  VQAD_CHECK(rc >= 0, "video ", path, ": cannot open ", tmp.string(), " for writing (", av_error(rc), ")");
  e.io_open = true;
  rc = avformat_write_header(e.fmt, nullptr);
  VQAD_CHECK(rc >= 0, "video ", path, ": writing the header failed (", av_error(rc), ")");

  e.frame = av_frame_alloc();
  e.frame->format = AV_PIX_FMT_YUV420P;
  e.frame->width = out_w;
  e.frame->height = out_h;
  rc = av_frame_get_buffer(e.frame, 0);
  VQAD_CHECK(rc >= 0, "video ", path, ": frame buffer (", av_error(rc), ")");
  e.packet = av_packet_alloc();
  e.sws = sws_getContext(out_w, out_h, AV_PIX_FMT_RGB24, out_w, out_h, AV_PIX_FMT_YUV420P, SWS_BICUBIC, nullptr,
                         nullptr, nullptr);
  VQAD_CHECK(e.sws, "video ", path, ": cannot create the RGB -> YUV converter");
  std::vector<uint8_t> padded(size_t(out_w) * out_h * 3);
  for (int f = 0; f < num_frames; ++f) {
    const uint8_t* src = rgb.data() + frame_bytes * f;
    for (int y = 0; y < out_h; ++y) {
      const int sy = std::min(y, spec.height - 1);
      uint8_t* dst = padded.data() + size_t(y) * out_w * 3;
      std::copy(src + size_t(sy) * spec.width * 3, src + size_t(sy + 1) * spec.width * 3, dst);
      if (out_w != spec.width) std::copy(dst + (spec.width - 1) * 3, dst + spec.width * 3, dst + spec.width * 3);
    }
    rc = av_frame_make_writable(e.frame);
    VQAD_CHECK(rc >= 0, "video ", path, ": frame not writable (", av_error(rc), ")");
    const uint8_t* in_data[1] = {padded.data()};
    const int in_stride[1] = {out_w * 3};
    sws_scale(e.sws, in_data, in_stride, 0, out_h, e.frame->data, e.frame->linesize);
    e.frame->pts = f;
    rc = avcodec_send_frame(e.codec, e.frame);
    VQAD_CHECK(rc >= 0, "video ", path, ": encoding frame ", f, " failed (", av_error(rc), ")");
    drain(e, stream, path);
  }
  rc = avcodec_send_frame(e.codec, nullptr);
  VQAD_CHECK(rc >= 0, "video ", path, ": flushing the encoder failed (", av_error(rc), ")");
  drain(e, stream, path);
  rc = av_write_trailer(e.fmt);
  VQAD_CHECK(rc >= 0, "video ", path, ": writing the trailer failed (", av_error(rc), ")");
  avio_closep(&e.fmt->pb);
  e.io_open = false;
  std::error_code ec;
  fs::rename(tmp, final_path, ec);
  VQAD_CHECK(!ec, "video ", path, ": cannot rename ", tmp.string(), " into place (", ec.message(), ")");
}

#else  // no ffmpeg libraries in this build

bool video_writer_available() { return false; }

void write_mp4(const std::string& path, const std::vector<uint8_t>&, int, const VideoSpec&) {
  fail("video ", path, ": this vqad build has no MP4 writer (the ffmpeg development libraries libavcodec, "
       "libavformat, libswscale were not found when it was configured; scripts/bootstrap.sh installs them)");
}

#endif

}  // namespace vqad::media
