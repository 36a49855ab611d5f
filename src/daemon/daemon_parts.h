// The daemon's private parts, shared by daemon.cc (the assembly: creation, the event loop, the
// drain) and the files of its parts, each a slice of the one Daemon class by what it does:
//   daemon_loader.cc   the loader thread, adoption of a kept store, the keeper deposit
//   daemon_server.cc   accepting, the connections' flow control, the requests
//   daemon_mover.cc    demotion, pinning and promotion between the tiers (docs/budget.md)
//   daemon_upgrade.cc  the handover to a successor (docs/upgrade.md)
//   daemon_publish.cc  a publisher's arena and its commit (docs/publish.md)
// Included by those files only.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <optional>
#include <string>

#include "daemon/daemon.h"
#include "os/unix_socket.h"
#include "protocol/frame.h"

namespace weightcache::daemon {

using Clock = std::chrono::steady_clock;

struct Daemon::Connection {
  Connection(UniqueFd socket, os::PeerCred cred, Clock::time_point now, os::SysCalls& sys)
      : fd(std::move(socket)),
        peer(cred),
        reader(protocol::Expect::kRequest, sys),
        last_request(now) {}

  // What its last Hello said (HandleHello): an Attach or a publish needs one that matched.
  enum class Greeting : uint8_t {
    kNone,             // no Hello yet
    kMatched,          // its config is this cache's
    kMismatched,       // another config, not counted as a mismatch in the metrics (yet)
    kMismatchCounted,  // another config, counted: once per Hello
  };
  // Whether its reading is stopped because its peer leaves our replies unread (Readable,
  // Sweep). A request that arrives while held is a cue to look at once whether its peer has
  // read our replies (it usually has: a publisher reads the arena's fds before it sends its
  // commit); if it has not, nothing is read, and no event is asked for, until Sweep sees the
  // peer catch up. At most one early look per hold.
  enum class Hold : uint8_t {
    kNone,
    kHeld,        // its one early look still to come
    kHeldLooked,  // looked early, still unread: no events until Sweep sees it caught up
  };
  // What else a connection may wait for is the daemon's own state, read through IsPublisher,
  // IsCommitting, IsUpgrading and AwaitsPromotion (daemon.h): one record of each, there.

  UniqueFd fd;
  os::PeerCred peer;
  protocol::FrameReader reader;
  std::deque<protocol::FrameWriter> outbox;
  Greeting greeting = Greeting::kNone;
  Clock::time_point hello_at;      // the last Hello (the attach duration's start)
  bool attached = false;           // counted among the daemon's clients
  uint64_t id = 0;                 // unique for the daemon's life (fd numbers are reused)
  bool closing = false;            // after a reply that ends it: flushed, then closed; unread
  uint32_t armed = 0;              // the epoll mask currently registered
  Clock::time_point last_request;  // the accept, then each complete request
  bool fds_sent = false;           // an AttachReply went out: its fds may be unread
  Hold hold = Hold::kNone;
  std::optional<Clock::time_point> backed_up_since;  // replies queued or unread since

  std::string Describe() const {
    return "peer pid " + std::to_string(peer.pid) + " uid " + std::to_string(peer.uid);
  }
};

// epoll_ctl of `fd` for `events` (EPOLL_CTL_ADD or _MOD); its failure is an error naming the fd.
Status EpollCtl(int epoll, int op, int fd, uint32_t events);
// One wakeup of the event loop through its eventfd.
void Wake(int eventfd);
double SecondsSince(Clock::time_point start);

}  // namespace weightcache::daemon
