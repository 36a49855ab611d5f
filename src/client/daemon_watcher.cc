#include "client/daemon_watcher.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <array>
#include <cerrno>

#include "common/logging.h"
#include "common/mutex.h"
#include "os/fd_passing.h"

namespace weightcache::client {
namespace {
constexpr short kClosedEvents = POLLHUP | POLLRDHUP | POLLERR | POLLNVAL;
}  // namespace

Result<std::unique_ptr<DaemonWatcher>> DaemonWatcher::Create(UniqueFd connection) {
  UniqueFd wake(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake.valid()) return IoError("eventfd for the daemon watcher", errno);
  return std::unique_ptr<DaemonWatcher>(new DaemonWatcher(std::move(connection), std::move(wake)));
}

DaemonWatcher::DaemonWatcher(UniqueFd connection, UniqueFd wake)
    : connection_(std::move(connection)), wake_(std::move(wake)) {}

DaemonWatcher::~DaemonWatcher() {
  if (thread_.joinable()) {
    uint64_t one = 1;
    // eventfd writes of 8 bytes cannot be short; EAGAIN only if the counter would overflow.
    (void)!::write(wake_.get(), &one, sizeof(one));
    thread_.join();
  }
}

bool DaemonWatcher::alive() const {
  if (gone_.load(std::memory_order_acquire)) return false;
  pollfd p{connection_.get(), POLLRDHUP, 0};
  int n = ::poll(&p, 1, 0);
  return !(n > 0 && (p.revents & kClosedEvents) != 0);
}

void DaemonWatcher::OnGone(std::function<void()> callback) {
  {
    MutexLock lock(mu_);
    if (!gone_.load(std::memory_order_acquire)) {
      callbacks_.push_back(std::move(callback));
      if (!thread_started_) {
        thread_started_ = true;
        thread_ = std::thread([this] { Run(); });
      }
      return;
    }
  }
  callback();
}

bool DaemonWatcher::DrainAndCheckClosed() {
  std::array<uint8_t, 4096> buffer;
  for (;;) {
    auto chunk = os::RecvSome(connection_.get(), buffer, /*max_fds=*/0);
    if (!chunk.ok()) {
      // Unexpected fds (closed by RecvSome) are a protocol violation but not a death; a
      // socket error is.
      if (chunk.status().code() == StatusCode::kProtocol) continue;
      LOG_WARN << "daemon connection: " << chunk.status().ToString();
      return true;
    }
    if (chunk->eof) return true;
    if (chunk->would_block) return false;
    LOG_WARN << "daemon sent " << chunk->bytes << " unsolicited bytes after attach; ignored";
  }
}

void DaemonWatcher::Run() {
  for (;;) {
    std::array<pollfd, 2> fds{pollfd{connection_.get(), POLLIN | POLLRDHUP, 0},
                              pollfd{wake_.get(), POLLIN, 0}};
    int n = ::poll(fds.data(), fds.size(), -1);
    if (n < 0) {
      if (errno == EINTR) continue;
      LOG_WARN << "daemon watcher poll failed: " << IoError("poll", errno).ToString();
      return;
    }
    if (fds[1].revents != 0) return;  // destructor
    if (fds[0].revents == 0) continue;
    bool closed = (fds[0].revents & (kClosedEvents & ~POLLRDHUP)) != 0 || DrainAndCheckClosed();
    if (!closed) continue;
    std::vector<std::function<void()>> callbacks;
    {
      MutexLock lock(mu_);
      gone_.store(true, std::memory_order_release);
      callbacks.swap(callbacks_);
    }
    LOG_INFO << "the daemon closed its connection; mappings stay valid";
    for (auto& cb : callbacks) cb();
    return;
  }
}

}  // namespace weightcache::client
