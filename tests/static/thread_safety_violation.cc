// Must NOT compile under clang's -Werror=thread-safety: scripts/tidy.sh checks that it fails,
// proving the analysis that lints src/ (clang-tidy --extra-arg=-Wthread-safety) is live and
// sees through common/mutex.h. Not part of any build.
#include "common/mutex.h"

namespace weightcache {

class Counter {
 public:
  void Add() { ++count_; }  // the violation: count_ is guarded by mu_, which is not held here
  int Get() {
    MutexLock lock(mu_);
    return count_;
  }

 private:
  Mutex mu_;
  int count_ WEIGHTCACHE_GUARDED_BY(mu_) = 0;
};

}  // namespace weightcache
