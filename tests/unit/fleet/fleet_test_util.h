// Helpers of the fleet tests: a Status matcher and a bounded poll.
#pragma once

#include <gmock/gmock.h>

#include <chrono>
#include <functional>
#include <thread>

#include "weightcache/status.h"

namespace weightcache::fleet {

// Matches a Status, or a Result's status, with this code and a message matching `message`.
MATCHER_P2(StatusIs, code, message, "") {
  const Status status = [&] {
    if constexpr (std::is_same_v<std::decay_t<decltype(arg)>, Status>) {
      return arg;
    } else {
      return arg.status();
    }
  }();
  *result_listener << "status " << status.ToString();
  return status.code() == code &&
         ::testing::ExplainMatchResult(message, status.message(), result_listener);
}

// Calls `done` every 50 ms until it is true (true) or 30 s have passed (false). For states
// that etcd reaches on its own (a lease's expiry), never a timing assertion.
inline bool PollUntil(const std::function<bool()>& done,
                      std::chrono::seconds limit = std::chrono::seconds(30)) {
  const auto until = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < until) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return done();
}

}  // namespace weightcache::fleet
