// Device memory of the kernel-level GPU tests (tests/gpu/test_attention_qat_fwd,
// test_attention_qat_bwd, test_vsa_cuda, test_nvfp4_cuda, test_fp4_blackwell) and the
// attention playgrounds (bench/playground): raw CUDA runtime, no torch, no gtest.
//   DeviceBuffer<T>  n elements filled with a poison byte (0xFF: NaN as fp32 and bf16, an
//                    invalid NVFP4 code or scale), plus an optional sentinel zone past the
//                    end that must keep the poison;
//   DeviceBlhd       a BF16 [B, L, H, D] tensor whose storage has poisoned gaps (after each
//                    head row, after each L row, past the end), so that the kernels see
//                    strides other than the contiguous ones and a write outside the
//                    tensor's elements shows; it gives the kernels' BlhdIn / BlhdOut view.
// Both report what was overwritten (poison_damage, sentinel_damage) instead of asserting,
// so tests state the expectation and playgrounds print it. metrics.h has rel-L2, the
// BF16 noise floor and the printed seeds.
#pragma once
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "tests/support/metrics.h"
#include "vqad/kernels/common/cuda_check.h"
#include "vqad/kernels/common/launch.h"

namespace vqad::test {

inline constexpr uint8_t kPoisonByte = 0xFF;
inline constexpr uint16_t kBf16Poison = 0xFFFF;

template <typename T>
class DeviceBuffer {
 public:
  // `count` elements and `sentinel_bytes` after them, every byte set to `fill`.
  explicit DeviceBuffer(size_t count, uint8_t fill = kPoisonByte, size_t sentinel_bytes = 0)
      : n_(count), sentinel_(sentinel_bytes), fill_(fill) {
    VQAD_CUDA_CHECK(cudaMalloc(&ptr_, std::max<size_t>(total_bytes(), 1)));
    this->fill(fill);
  }
  // host.size() elements holding `host`; the sentinel zone holds the poison.
  explicit DeviceBuffer(const std::vector<T>& host, size_t sentinel_bytes = 0)
      : DeviceBuffer(host.size(), kPoisonByte, sentinel_bytes) {
    upload(host);
  }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* get() const { return static_cast<T*>(ptr_); }
  template <typename U>
  U* as() const {
    return static_cast<U*>(ptr_);
  }
  size_t size() const { return n_; }
  size_t bytes() const { return n_ * sizeof(T); }

  // Every byte (elements and sentinel) back to `byte`; the sentinel then expects it.
  void fill(uint8_t byte) {
    fill_ = byte;
    VQAD_CUDA_CHECK(cudaMemset(ptr_, byte, std::max<size_t>(total_bytes(), 1)));
  }
  void upload(const std::vector<T>& host) { upload(host.data(), std::min(host.size(), n_) * sizeof(T)); }
  void upload(const void* src, size_t n_bytes) {
    VQAD_CUDA_CHECK(cudaMemcpy(ptr_, src, std::min(n_bytes, bytes()), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const { return download_as<T>(n_); }
  // The first `count` values of type U (after the device has finished its work).
  template <typename U>
  std::vector<U> download_as(size_t count) const {
    std::vector<U> out(count);
    VQAD_CUDA_CHECK(cudaDeviceSynchronize());
    VQAD_CUDA_CHECK(cudaMemcpy(out.data(), ptr_, std::min(count * sizeof(U), bytes()), cudaMemcpyDeviceToHost));
    return out;
  }
  // Bytes of the sentinel zone that no longer hold the fill byte (0: untouched); *first
  // gets the offset past the end of the first such byte.
  size_t sentinel_damage(size_t* first = nullptr) const {
    if (sentinel_ == 0) return 0;
    std::vector<uint8_t> tail(sentinel_);
    VQAD_CUDA_CHECK(cudaDeviceSynchronize());
    VQAD_CUDA_CHECK(cudaMemcpy(tail.data(), static_cast<uint8_t*>(ptr_) + bytes(), sentinel_, cudaMemcpyDeviceToHost));
    size_t bad = 0;
    for (size_t i = 0; i < sentinel_; ++i) {
      if (tail[i] != fill_) {
        if (bad == 0 && first != nullptr) *first = i;
        ++bad;
      }
    }
    return bad;
  }

 private:
  size_t total_bytes() const { return bytes() + sentinel_; }
  void* ptr_ = nullptr;
  size_t n_, sentinel_;
  uint8_t fill_;
};

// A BF16 [B, L, H, D] tensor in a storage of element strides
//   h = D + head_gap, l = H * h + row_pad, b = L * l,
// and `tail` elements past the last batch; the gaps, pads and tail hold kBf16Poison (NaN).
// The gaps must keep the 16-byte row alignment of the kernels (multiples of 8 elements).
class DeviceBlhd {
 public:
  DeviceBlhd(int64_t B, int64_t L, int64_t H, int64_t D, int64_t head_gap = 0, int64_t row_pad = 0, int64_t tail = 0)
      : B_(B), L_(L), H_(H), D_(D), sh_(D + head_gap), sl_(H * (D + head_gap) + row_pad), sb_(L * sl_),
        tail_(tail), buf_(static_cast<size_t>(B * sb_ + tail)) {}

  uint16_t* get() const { return buf_.get(); }
  kernels::BlhdStrides strides() const { return {sb_, sl_, sh_, 1}; }
  kernels::BlhdIn in() const { return {buf_.get(), strides()}; }
  kernels::BlhdOut out() const { return {buf_.get(), strides()}; }
  size_t elems() const { return static_cast<size_t>(B_ * L_ * H_ * D_); }  // of the tensor
  size_t storage_elems() const { return buf_.size(); }
  // Storage index of (b, l, h, d); contiguous index of the same element: ((b L + l) H + h) D + d.
  size_t index(int64_t b, int64_t l, int64_t h, int64_t d) const {
    return static_cast<size_t>(b * sb_ + l * sl_ + h * sh_ + d);
  }

  void poison() { buf_.fill(kPoisonByte); }
  // Contiguous [B, L, H, D] values (rounded to bf16) into the tensor; the gaps keep the poison.
  void upload(const std::vector<float>& x) {
    std::vector<uint16_t> h(storage_elems(), kBf16Poison);
    for_each([&](size_t dev, size_t host) { h[dev] = bf16_bits(x[host]); });
    buf_.upload(h);
  }
  std::vector<uint16_t> raw() const { return buf_.download(); }  // the whole storage
  // Contiguous [B, L, H, D] values of a raw() copy.
  std::vector<float> values(const std::vector<uint16_t>& raw) const {
    std::vector<float> x(elems());
    for_each([&](size_t dev, size_t host) { x[host] = bf16_value(raw[dev]); });
    return x;
  }
  std::vector<float> values() const { return values(raw()); }
  // Elements of a raw() copy outside the tensor (gaps, pads, tail) that no longer hold the
  // poison (0: nothing was written outside); *first gets the storage index of the first.
  size_t poison_damage(const std::vector<uint16_t>& raw, int64_t* first = nullptr) const {
    std::vector<uint8_t> inside(storage_elems(), 0);
    for_each([&](size_t dev, size_t) { inside[dev] = 1; });
    size_t bad = 0;
    for (size_t i = 0; i < raw.size(); ++i) {
      if (!inside[i] && raw[i] != kBf16Poison) {
        if (bad == 0 && first != nullptr) *first = static_cast<int64_t>(i);
        ++bad;
      }
    }
    return bad;
  }

 private:
  template <typename F>
  void for_each(F&& f) const {
    for (int64_t b = 0; b < B_; ++b)
      for (int64_t l = 0; l < L_; ++l)
        for (int64_t h = 0; h < H_; ++h)
          for (int64_t d = 0; d < D_; ++d) f(index(b, l, h, d), static_cast<size_t>(((b * L_ + l) * H_ + h) * D_ + d));
  }
  int64_t B_, L_, H_, D_, sh_, sl_, sb_, tail_;
  DeviceBuffer<uint16_t> buf_;
};

}  // namespace vqad::test
