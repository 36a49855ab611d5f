#include "unit/client/scripted_daemon.h"

#include <gtest/gtest.h>
#include <poll.h>

#include <chrono>

#include "os/fd_passing.h"
#include "os/unix_socket.h"

namespace weightcache::testing {

using namespace std::chrono_literals;

ScriptedDaemon::ScriptedDaemon(const identity::CachePaths& paths, Script script, FdScript fds,
                               CloseAfter close_after)
    : script_(std::move(script)), fds_(std::move(fds)), close_after_(std::move(close_after)) {
  auto lock = os::LockFile::TryAcquire(paths.lock);
  EXPECT_TRUE(lock.ok()) << lock.status().ToString();
  if (lock.ok()) lock_.emplace(std::move(lock).value());
  auto listener = os::ListenUnix(paths.socket);
  EXPECT_TRUE(listener.ok()) << listener.status().ToString();
  if (listener.ok()) listener_ = std::move(listener).value();
  thread_ = std::thread([this] { Loop(); });
}

ScriptedDaemon::~ScriptedDaemon() {
  stop_ = true;
  thread_.join();
}

void ScriptedDaemon::Loop() {
  while (!stop_) {
    pollfd p{listener_.get(), POLLIN, 0};
    if (::poll(&p, 1, 20) <= 0) continue;
    auto conn = os::AcceptConnection(listener_.get());
    if (!conn.ok() || !conn->has_value()) continue;
    UniqueFd fd = std::move(**conn);
    while (!stop_) {
      auto frame =
          protocol::ReadFrame(fd.get(), protocol::Expect::kRequest, os::Deadline::After(5s));
      if (!frame.ok()) break;
      std::vector<uint8_t> out = script_(*frame);
      if (out.empty()) break;
      std::vector<int> fds = fds_ ? fds_(*frame) : std::vector<int>{};
      if (!os::SendMessage(fd.get(), out, fds, os::Deadline::After(5s)).ok()) break;
      if (close_after_ && close_after_(*frame)) break;
    }
  }
}

}  // namespace weightcache::testing
