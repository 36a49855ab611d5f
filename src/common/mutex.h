// Mutex, MutexLock, CondVar — std::mutex and std::condition_variable_any with clang's
// thread-safety annotations (https://clang.llvm.org/docs/ThreadSafetyAnalysis.html), so that
// a member declared WEIGHTCACHE_GUARDED_BY(mu_) is checked at compile time to be touched only
// with mu_ held. libstdc++'s std::mutex carries no annotations, hence this thin wrapper.
//
// The analysis runs where the compiler is clang (-Wthread-safety is added by the top-level
// CMakeLists.txt; CI's TSan tier builds with clang and makes its findings errors). Under GCC the
// macros expand to nothing.
//
// Thread-safety: Mutex and CondVar are what synchronise; MutexLock is a scope, not shared.
#pragma once

#include <condition_variable>
#include <mutex>

#if defined(__clang__)
#define WEIGHTCACHE_THREAD_ANNOTATION_(x) __attribute__((x))
#else
#define WEIGHTCACHE_THREAD_ANNOTATION_(x)
#endif

#define WEIGHTCACHE_CAPABILITY(name) WEIGHTCACHE_THREAD_ANNOTATION_(capability(name))
#define WEIGHTCACHE_SCOPED_CAPABILITY WEIGHTCACHE_THREAD_ANNOTATION_(scoped_lockable)
#define WEIGHTCACHE_GUARDED_BY(mu) WEIGHTCACHE_THREAD_ANNOTATION_(guarded_by(mu))
#define WEIGHTCACHE_PT_GUARDED_BY(mu) WEIGHTCACHE_THREAD_ANNOTATION_(pt_guarded_by(mu))
#define WEIGHTCACHE_REQUIRES(...) WEIGHTCACHE_THREAD_ANNOTATION_(requires_capability(__VA_ARGS__))
#define WEIGHTCACHE_EXCLUDES(...) WEIGHTCACHE_THREAD_ANNOTATION_(locks_excluded(__VA_ARGS__))
#define WEIGHTCACHE_ACQUIRE(...) WEIGHTCACHE_THREAD_ANNOTATION_(acquire_capability(__VA_ARGS__))
#define WEIGHTCACHE_RELEASE(...) WEIGHTCACHE_THREAD_ANNOTATION_(release_capability(__VA_ARGS__))

namespace weightcache {

class WEIGHTCACHE_CAPABILITY("mutex") Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  // BasicLockable spelling, so CondVar (std::condition_variable_any) can release and retake it.
  void lock() WEIGHTCACHE_ACQUIRE() { mu_.lock(); }
  void unlock() WEIGHTCACHE_RELEASE() { mu_.unlock(); }

 private:
  std::mutex mu_;
};

// Holds `mu` for its scope.
class WEIGHTCACHE_SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex& mu) WEIGHTCACHE_ACQUIRE(mu) : mu_(mu) { mu_.lock(); }
  ~MutexLock() WEIGHTCACHE_RELEASE() { mu_.unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex& mu_;
};

// A condition variable over Mutex. Callers loop on their condition themselves
// (`while (!ready_) cv_.Wait(mu_);`), so the analysis sees every guarded read under the lock.
class CondVar {
 public:
  // Releases `mu` while blocked and holds it again on return (spurious wake-ups included).
  void Wait(Mutex& mu) WEIGHTCACHE_REQUIRES(mu) { cv_.wait(mu); }
  void NotifyOne() { cv_.notify_one(); }
  void NotifyAll() { cv_.notify_all(); }

 private:
  std::condition_variable_any cv_;
};

}  // namespace weightcache
