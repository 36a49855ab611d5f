// weightcache/status.h — the one error model of the project.
//
// Contract:
//  * Every fallible function returns `Status` or `Result<T>`; nothing below `main`, the C ABI
//    and the Python layer throws.
//  * A Status carries a code (what kind of failure, which decides exit codes and client
//    behaviour), a message (what happened, with context added as it travels up: the path,
//    the tensor, the peer pid), and optionally the errno or CUresult that caused it.
//  * Status and Result are values: copyable, movable, not thread-safe to mutate concurrently.
#pragma once

#include <cassert>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>

#include "weightcache/export.h"

namespace weightcache {

// The kinds of failure. The CLI maps these onto the exit codes of docs/design.md "Exit codes"
// (kStatusCodeTable).
//
// The integer values are part of the wire format: a daemon's Error frame carries the code
// as a u32 (docs/protocol.md §3), and a client of another build decodes it back into this
// enum. They are written out and pinned below (and in tests/unit/common/status_test.cc):
// never renumber or reuse a value; add a new code at the end, with its row in
// kStatusCodeTable (the wire accepts exactly the table's error codes, IsErrorCodeValue).
enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument = 1,    // bad flag, bad config value, path too long, bad template
  kNotFound = 2,           // a file or tensor that should exist does not
  kPermissionDenied = 3,   // ownership / mode checks, peer credential checks
  kInvalidCheckpoint = 4,  // a safetensors header or index that fails validation
  kNoDaemon = 5,           // no live daemon for this identity (on_missing=error)
  kMismatch = 6,           // a daemon exists but its CacheConfig differs
  kTimeout = 7,            // waited past a deadline
  kAlreadyServed = 8,      // another daemon holds the identity lock
  kProtocol = 9,           // a malformed, oversize or unexpected frame
  kIo = 10,                // a syscall failed (errno attached)
  kCuda = 11,              // a CUDA driver call failed (CUresult attached)
  kUnavailable = 12,       // a facility is missing on this host (no driver, no GPU)
  kOutOfMemory = 13,       // budget or device memory exhausted
  kInternal = 14,          // a broken invariant: a bug
};
// Every value is pinned by a test; this keeps the wire range at compile time: the error codes
// are exactly 1 … 14, which protocol::DecodeError accepts (docs/protocol.md says so too).
static_assert(static_cast<int>(StatusCode::kInvalidArgument) == 1 &&
                  static_cast<int>(StatusCode::kInternal) == 14,
              "StatusCode values are on the wire (Error frames): never renumber them");

// The exit codes of the `weightcache` CLI (docs/design.md "Exit codes"). Which code a StatusCode
// exits with is decided once, in kStatusCodeTable below.
enum ExitCode : int {
  kExitOk = 0,
  kExitError = 1,  // any other error
  kExitUsage = 2,
  kExitNoDaemon = 3,
  kExitMismatch = 4,
  kExitInvalidCheckpoint = 5,
  kExitTimeout = 6,
  kExitAlreadyServed = 7,
  kExitOutOfMemory = 8,  // no room under the device's memory budget
};

// The one table of what a StatusCode means at every edge: its name (Status::ToString's
// prefix), its key (the C ABI's wc_status_code_name, Python's `WeightcacheError.code`), the
// CLI's exit code and the Python exception class (weightcache.errors.<python_class>, which
// gets this table from the extension, never a copy). Indexed by the code's value.
struct StatusCodeInfo {
  StatusCode code;
  std::string_view name;          // "invalid checkpoint"
  std::string_view key;           // "invalid_checkpoint"
  ExitCode exit_code;             // docs/design.md "Exit codes"
  std::string_view python_class;  // "InvalidCheckpointError"
};

inline constexpr StatusCodeInfo kStatusCodeTable[] = {
    {StatusCode::kOk, "ok", "ok", kExitOk, ""},
    {StatusCode::kInvalidArgument, "invalid argument", "invalid_argument", kExitUsage,
     "InvalidArgumentError"},
    {StatusCode::kNotFound, "not found", "not_found", kExitError, "WeightcacheError"},
    {StatusCode::kPermissionDenied, "permission denied", "permission_denied", kExitError,
     "PermissionDeniedError"},
    {StatusCode::kInvalidCheckpoint, "invalid checkpoint", "invalid_checkpoint",
     kExitInvalidCheckpoint, "InvalidCheckpointError"},
    {StatusCode::kNoDaemon, "no daemon", "no_daemon", kExitNoDaemon, "NoDaemonError"},
    {StatusCode::kMismatch, "config mismatch", "mismatch", kExitMismatch, "MismatchError"},
    {StatusCode::kTimeout, "timeout", "timeout", kExitTimeout, "DaemonTimeoutError"},
    {StatusCode::kAlreadyServed, "already served", "already_served", kExitAlreadyServed,
     "AlreadyServedError"},
    {StatusCode::kProtocol, "protocol error", "protocol", kExitError, "ProtocolError"},
    {StatusCode::kIo, "i/o error", "io", kExitError, "WeightcacheError"},
    {StatusCode::kCuda, "cuda error", "cuda", kExitError, "WeightcacheError"},
    {StatusCode::kUnavailable, "unavailable", "unavailable", kExitError, "UnavailableError"},
    {StatusCode::kOutOfMemory, "out of memory", "out_of_memory", kExitOutOfMemory,
     "OutOfMemoryError"},
    {StatusCode::kInternal, "internal error", "internal", kExitError, "WeightcacheError"},
};
inline constexpr size_t kStatusCodeCount = std::size(kStatusCodeTable);

constexpr bool StatusCodeTableIsIndexedByValue() {
  for (size_t i = 0; i < kStatusCodeCount; ++i) {
    if (static_cast<size_t>(kStatusCodeTable[i].code) != i) return false;
  }
  return true;
}
static_assert(StatusCodeTableIsIndexedByValue() &&
                  kStatusCodeCount == static_cast<size_t>(StatusCode::kInternal) + 1,
              "kStatusCodeTable has one row per StatusCode, in value order");

// An error code as it arrives from the wire (Error.code, failure_code): 1 … kInternal.
constexpr bool IsErrorCodeValue(uint64_t value) { return value >= 1 && value < kStatusCodeCount; }

// The row of `code` (the kInternal row for a value outside the enum).
constexpr const StatusCodeInfo& InfoFor(StatusCode code) {
  const auto i = static_cast<size_t>(code);
  return i < kStatusCodeCount ? kStatusCodeTable[i] : kStatusCodeTable[kStatusCodeCount - 1];
}

WEIGHTCACHE_EXPORT std::string_view StatusCodeName(StatusCode code);
// The CLI's exit code for `code` (docs/design.md "Exit codes").
constexpr ExitCode ExitCodeFor(StatusCode code) { return InfoFor(code).exit_code; }

class [[nodiscard]] WEIGHTCACHE_EXPORT Status {
 public:
  Status() = default;  // OK
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  int sys_errno() const { return sys_errno_; }
  int driver_error() const { return driver_error_; }

  // Attach the errno / CUresult that caused this status (returns *this for chaining).
  Status& WithErrno(int err);
  Status& WithDriverError(int cu_result);

  // Prefix context: "reading shard model-00001.safetensors: " + message.
  Status& Context(std::string_view what);

  // "<code name>: <message>[ (errno N: strerror)][ (CUresult N)]"
  std::string ToString() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
  int sys_errno_ = 0;
  int driver_error_ = 0;
};

// Convenience constructors, one per code, so call sites read as sentences.
WEIGHTCACHE_EXPORT Status InvalidArgument(std::string message);
WEIGHTCACHE_EXPORT Status NotFound(std::string message);
WEIGHTCACHE_EXPORT Status PermissionDenied(std::string message);
WEIGHTCACHE_EXPORT Status InvalidCheckpoint(std::string message);
WEIGHTCACHE_EXPORT Status ProtocolError(std::string message);
WEIGHTCACHE_EXPORT Status InternalError(std::string message);
// An I/O failure from the current (or given) errno: "<what>: <strerror>".
WEIGHTCACHE_EXPORT Status IoError(std::string what, int err);

template <typename T>
class [[nodiscard]] Result {
 public:
  static_assert(!std::is_same_v<std::decay_t<T>, Status>, "Result<Status> is meaningless");

  Result(T value) : v_(std::move(value)) {}        // NOLINT: implicit by design
  Result(Status status) : v_(std::move(status)) {  // NOLINT: implicit by design
    assert(!std::get<Status>(v_).ok() && "Result constructed from an OK status");
  }

  bool ok() const { return std::holds_alternative<T>(v_); }
  // The error; Status::Ok() when this holds a value.
  Status status() const { return ok() ? Status::Ok() : std::get<Status>(v_); }

  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace weightcache

#define WEIGHTCACHE_CONCAT_INNER_(a, b) a##b
#define WEIGHTCACHE_CONCAT_(a, b) WEIGHTCACHE_CONCAT_INNER_(a, b)

// Evaluate `expr` (a Status); return it from the enclosing function if it is an error.
#define WEIGHTCACHE_RETURN_IF_ERROR(expr)      \
  do {                                         \
    ::weightcache::Status wc_status_ = (expr); \
    if (!wc_status_.ok()) return wc_status_;   \
  } while (0)

// `lhs = value of rexpr` (a Result<T>), or return its error from the enclosing function.
#define WEIGHTCACHE_ASSIGN_OR_RETURN(lhs, rexpr) \
  WEIGHTCACHE_ASSIGN_OR_RETURN_IMPL_(WEIGHTCACHE_CONCAT_(wc_result_, __LINE__), lhs, rexpr)
// NOLINTBEGIN(bugprone-macro-parentheses): `tmp` names a variable, `lhs` may declare one.
#define WEIGHTCACHE_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, rexpr) \
  auto tmp = (rexpr);                                       \
  if (!tmp.ok()) return tmp.status();                       \
  lhs = std::move(tmp).value()
// NOLINTEND(bugprone-macro-parentheses)
