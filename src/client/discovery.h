// Discovery (docs/design.md "Failure semantics"): from a resolved identity (identity/resolve.h:
// CacheConfig, device key, socket path) to a live, matching, ready daemon — or to a reason why
// there is none.
//
// The table of docs/design.md "Discovery outcomes", as implemented here (docs/client.md has the
// long form):
//   socket absent, or stale (its .lock not held)  → missing (then the sibling scan below)
//   lstat: not a socket / owned by an untrusted uid → error (kIo / kPermissionDenied)
//   peer credentials of an untrusted uid          → error (kPermissionDenied)
//   (trusted: ResolvedIdentity::trusted_uids, the rule of identity::TrustedUids)
//   no answer by the deadline (a hung daemon)     → missing (kTimeout), the reason naming it
//   the daemon goes away at any step (EOF before  → missing (kNoDaemon), "went away during the
//   or inside a frame, EPIPE, ECONNRESET)           attach (<step>)": killed, never an error
//   Hello → failed / draining                     → missing, with the daemon's reason (and
//                                                   failed: its failure_code)
//   Hello → config differs (our own comparison of → kMismatch naming every field, both values
//           the daemon's config; its `match` flag
//           is never trusted)
//   Hello → loading                               → Status polls until ready, failed or the
//                                                   deadline (→ missing, kTimeout)
//   Hello → ready, same config                    → AttachReply (manifest memfd + fds); the
//                                                   Attach is sent with the Hello (pipelined)
//   bad frame / unexpected reply                  → error (kProtocol)
// When our exact socket is missing and it is a layout path (not an explicit --socket), every
// other live cache under the same device key is asked Hello with our config; if one holds the
// same model_id, the closest (fewest differing fields) is reported as kMismatch.
// Every kMismatch is also available as data (MismatchDetails, weightcache/client.h): its
// message and its fields are built from the same values.
//
// Thread-safety: every function is reentrant. Ownership: a DaemonSession owns the connection.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/unique_fd.h"
#include "identity/cache_config.h"
#include "identity/device_inventory.h"
#include "identity/env.h"
#include "identity/paths.h"
#include "identity/resolve.h"
#include "protocol/messages.h"
#include "weightcache/client.h"
#include "weightcache/status.h"

namespace weightcache::client {

// The identity discovery looks for: resolved by identity::ResolveIdentity (identity/resolve.h).
using identity::ResolvedIdentity;

// A live daemon that matched and sent its AttachReply. The connection stays open (the
// DaemonWatcher learns of the daemon's death by EOF).
struct DaemonSession {
  UniqueFd connection;
  // Header and allocations checked; the manifest's records are NOT yet (RecordCheck::kDeferred):
  // the consumer runs reply.manifest.ValidateRecords() before reading one.
  protocol::AttachReply reply;
  int64_t pid = 0;
};

struct Discovery {
  std::optional<DaemonSession> session;  // set when a daemon is ready to be mapped
  std::string missing_reason;            // why not, when session is empty
  std::string note;  // with a session: how it was reached ("promoted from host RAM in N ms")
  // The code an on_missing=error caller fails with: kNoDaemon (absent, stale, draining),
  // kTimeout (still loading at the deadline, or no answer by it: a hung daemon), or the failed
  // daemon's own failure code (its HelloReply/StatusReply failure_code).
  StatusCode missing_code = StatusCode::kNoDaemon;
};

// One deadline for the whole discovery (docs/client.md "Deadlines"): connect, Hello, the wait
// for a loading daemon, each Status poll, the Attach reply and the sibling scan over every
// other daemon all end `wait_timeout` after `start`. There is no other timeout, with one
// floor: a daemon's answers are awaited until at least `min_answer_wait` after `start`, so that
// wait_timeout 0 (do not wait for a loading daemon) still reads a ready daemon's answers. A
// daemon that has not answered by then is treated as absent (kTimeout), like one still loading.
struct DiscoveryPolicy {
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  std::chrono::milliseconds wait_timeout{std::chrono::seconds(60)};
  std::chrono::milliseconds min_answer_wait{std::chrono::seconds(1)};
  bool wait_for_publisher = true;  // AttachOptions::wait_for_publisher
  std::string client_name = "weightcache-client";
};

// Errors are returned as statuses (kMismatch, kPermissionDenied, kProtocol, kIo, …); "no
// daemon" is not an error here (Discovery::missing_reason) — the caller applies on_missing.
// On kMismatch, *mismatch (when not null) receives the differing fields and the daemon that
// holds the other config; it is left alone otherwise. Every socket syscall goes through
// env.syscalls.
Result<Discovery> Discover(const ResolvedIdentity& identity, const DiscoveryPolicy& policy,
                           MismatchDetails* mismatch = nullptr,
                           const identity::Env& env = identity::Env::Default());

// A live daemon of our identity whose config matched our Hello, for a publisher
// (docs/publish.md): the same checks as Discover (trusted socket owner and daemon uid, stale
// lock, our own comparison of the daemon's config) but no Attach and no wait. A publisher
// never falls back: no live daemon is kNoDaemon naming the socket, one that did not answer by
// policy's deadline kTimeout, a different config kMismatch naming every field.
struct PublisherSession {
  UniqueFd connection;
  int64_t pid = 0;
  protocol::HelloReply hello;
};
Result<PublisherSession> ConnectPublisher(const ResolvedIdentity& identity,
                                          const DiscoveryPolicy& policy,
                                          const identity::Env& env = identity::Env::Default());

// A kMismatch status naming `where` and every field of `details` ("<where> holds a different
// config (f1, f2): f1: ours=<client_text> theirs=<daemon_text>; …"), the message the
// discovery and the attach report.
Status MismatchStatus(const std::string& where, const MismatchDetails& details);

// A public field difference from an identity::FieldDiff (ours = the client): the texts as
// given, the values decoded (a JSON string literal to its contents; anything else as is).
ConfigFieldDiff ToConfigFieldDiff(const identity::FieldDiff& diff);

}  // namespace weightcache::client
