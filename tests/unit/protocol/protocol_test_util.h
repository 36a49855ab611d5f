// Helpers shared by the protocol unit tests.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "weightcache/status.h"

namespace weightcache::protocol {

// `s` is a protocol error whose message names `needle`.
inline void ExpectProtocolError(const Status& s, const std::string& needle) {
  EXPECT_EQ(s.code(), StatusCode::kProtocol) << s.ToString();
  EXPECT_NE(s.message().find(needle), std::string::npos) << s.message();
}

}  // namespace weightcache::protocol
