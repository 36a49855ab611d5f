// DaemonWatcher — keeps the connection to the daemon open after attach and tells the client
// when the daemon's end closes (the daemon exited, crashed or was killed: the kernel closes
// its sockets either way, so EOF is the one reliable signal; no pid polling).
//
// Contract:
//  * Owns the connection fd. The daemon sends nothing unsolicited after an AttachReply; if it
//    does, the bytes are read and discarded (fds that ride along are closed) so the socket
//    never fills up.
//  * alive() is a non-blocking check (an atomic flag plus a zero-timeout poll for
//    POLLHUP/POLLRDHUP) callable from any thread.
//  * OnGone(cb): callbacks run once each, on the watcher thread, which is started on the first
//    registration (no thread for clients that never ask). A callback registered once the
//    daemon is known gone runs at once on the registering thread. Callbacks must not destroy
//    the watcher: the destructor wakes the thread through an eventfd and joins it.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "common/mutex.h"
#include "common/unique_fd.h"
#include "weightcache/status.h"

namespace weightcache::client {

class DaemonWatcher {
 public:
  static Result<std::unique_ptr<DaemonWatcher>> Create(UniqueFd connection);
  DaemonWatcher(const DaemonWatcher&) = delete;
  DaemonWatcher& operator=(const DaemonWatcher&) = delete;
  ~DaemonWatcher();

  bool alive() const;
  void OnGone(std::function<void()> callback);

 private:
  DaemonWatcher(UniqueFd connection, UniqueFd wake);
  void Run();
  // Reads whatever is pending; true when the peer closed (EOF, HUP, error).
  bool DrainAndCheckClosed();

  UniqueFd connection_;
  UniqueFd wake_;  // eventfd: written by the destructor to stop the thread
  std::atomic<bool> gone_{false};
  Mutex mu_;
  std::vector<std::function<void()>> callbacks_ WEIGHTCACHE_GUARDED_BY(mu_);
  bool thread_started_ WEIGHTCACHE_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace weightcache::client
