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
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>

namespace weightcache {

// The kinds of failure. The CLI maps these onto the exit codes of SPEC §5 (ExitCodeFor).
//
// The integer values are part of the wire format: a daemon's Error frame carries the code
// as a u32 (docs/protocol.md §3), and a client of another build decodes it back into this
// enum. They are written out and pinned below (and in tests/unit/common/status_test.cc):
// never renumber or reuse a value; add a new code at the end, and widen the range that
// protocol::DecodeError accepts (1 … kInternal today) in the same change.
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

std::string_view StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
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
Status InvalidArgument(std::string message);
Status NotFound(std::string message);
Status PermissionDenied(std::string message);
Status InvalidCheckpoint(std::string message);
Status ProtocolError(std::string message);
Status InternalError(std::string message);
// An I/O failure from the current (or given) errno: "<what>: <strerror>".
Status IoError(std::string what, int err);

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
