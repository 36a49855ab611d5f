// UniqueHandle<Traits> — the one move-only owner of an OS or driver resource. Every RAII class
// that owns one handle (an fd, a VMM handle, a VA range, a mapping, a stream, an event, a pinned
// buffer, a module, a primary-context reference) is this template with its own traits, so
// moving, resetting and releasing are written once.
//
// Traits supply:
//   using Handle  = ...;                     // a value type with operator==; may be a struct
//                                            // (e.g. {ptr, size} when the release needs both)
//   using Context = ...;                     // what the release needs besides the handle, e.g.
//                                            // `const cuda::DriverApi*`; NoContext if nothing
//   static constexpr Handle Null();          // the empty value; never a live resource
//   static void Close(const Context&, const Handle&) noexcept;  // release; never fails (logs)
//   static bool IsValid(const Handle&);      // optional: which values are live (default: all
//                                            // but Null(); fds: every value >= 0)
//
// Contract: a UniqueHandle owns at most one live handle. Destruction, Reset and move-assignment
// release the owned handle (if any) exactly once; a moved-from UniqueHandle is empty. Release()
// gives the handle up without closing it. Not thread-safe per object.
#pragma once

#include <utility>

namespace weightcache {

// The Context of traits whose release needs nothing but the handle.
struct NoContext {
  friend bool operator==(NoContext, NoContext) { return true; }
};

template <typename Traits>
class UniqueHandle {
 public:
  using Handle = typename Traits::Handle;
  using Context = typename Traits::Context;

  UniqueHandle() = default;
  // Takes ownership of `handle`, released with `context`.
  UniqueHandle(Context context, Handle handle)
      : context_(std::move(context)), handle_(std::move(handle)) {}
  // For context-free traits: UniqueFd fd(raw).
  explicit UniqueHandle(Handle handle) : handle_(std::move(handle)) {}

  UniqueHandle(const UniqueHandle&) = delete;
  UniqueHandle& operator=(const UniqueHandle&) = delete;
  UniqueHandle(UniqueHandle&& other) noexcept
      : context_(other.context_), handle_(other.Release()) {}
  UniqueHandle& operator=(UniqueHandle&& other) noexcept {
    if (this != &other) {
      Reset();
      context_ = other.context_;
      handle_ = other.Release();
    }
    return *this;
  }
  ~UniqueHandle() { Reset(); }

  Handle get() const { return handle_; }
  const Context& context() const { return context_; }
  bool valid() const { return IsValid(handle_); }
  explicit operator bool() const { return valid(); }

  // Give up ownership without releasing.
  Handle Release() { return std::exchange(handle_, Traits::Null()); }
  // Release the owned handle (if any), then own `handle` (same context).
  void Reset(Handle handle = Traits::Null()) {
    Handle old = std::exchange(handle_, std::move(handle));
    if (IsValid(old)) Traits::Close(context_, old);
  }

 private:
  static bool IsValid(const Handle& handle) {
    if constexpr (requires { Traits::IsValid(handle); }) {
      return Traits::IsValid(handle);
    } else {
      return !(handle == Traits::Null());
    }
  }

  [[no_unique_address]] Context context_{};
  Handle handle_ = Traits::Null();
};

}  // namespace weightcache
