// Gloo for CPU collectives (see backend.h for why this is the only file with gloo types).
#include "vqad/dist/backend.h"

#include "vqad/core/error.h"

#ifdef VQAD_WITH_GLOO
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif

namespace vqad::dist {

#ifdef VQAD_WITH_GLOO
bool gloo_available() { return true; }

c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                    int size, std::chrono::milliseconds timeout, bool loopback) {
  auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname)
    opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
  else if (loopback)
    opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  else
    opts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  opts->threads = 2;
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, opts);
}
#else
bool gloo_available() { return false; }

c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>&, int, int,
                                                    std::chrono::milliseconds, bool) {
  fail("distributed CPU training needs the Gloo backend, which is not part of this vqad build (the gloo headers, "
       "package libgloo-dev, were not found when it was configured; install them and re-run cmake)");
}
#endif

}  // namespace vqad::dist
