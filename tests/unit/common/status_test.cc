#include "weightcache/status.h"

#include <gtest/gtest.h>

#include <cerrno>
#include <utility>

namespace weightcache {
namespace {

Result<int> Half(int v) {
  if (v % 2 != 0) return InvalidArgument("odd value " + std::to_string(v));
  return v / 2;
}

Result<int> Quarter(int v) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(int h, Half(v));
  WEIGHTCACHE_ASSIGN_OR_RETURN(int q, Half(h));
  return q;
}

TEST(StatusTest, AssignOrReturnPropagatesTheFirstError) {
  EXPECT_EQ(*Quarter(8), 2);
  Result<int> r = Quarter(6);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(), "odd value 3");
}

TEST(StatusTest, ContextPrefixesAndKeepsCode) {
  Status s = IoError("open /x", ENOENT);
  s.Context("reading shard 2");
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_EQ(s.sys_errno(), ENOENT);
  EXPECT_EQ(s.message(), "reading shard 2: open /x: No such file or directory");
  EXPECT_EQ(s.ToString(), "not found: reading shard 2: open /x: No such file or directory");
}

TEST(StatusTest, OkStatusIgnoresContext) {
  Status s;
  s.Context("anything");
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.ToString(), "ok");
}

// The integer values travel in Error frames (docs/protocol.md §3): a daemon and a client of
// different builds must agree on them, so every one is pinned here.
TEST(StatusTest, StatusCodeWireValuesArePinned) {
  const std::pair<StatusCode, int> pinned[] = {
      {StatusCode::kOk, 0},
      {StatusCode::kInvalidArgument, 1},
      {StatusCode::kNotFound, 2},
      {StatusCode::kPermissionDenied, 3},
      {StatusCode::kInvalidCheckpoint, 4},
      {StatusCode::kNoDaemon, 5},
      {StatusCode::kMismatch, 6},
      {StatusCode::kTimeout, 7},
      {StatusCode::kAlreadyServed, 8},
      {StatusCode::kProtocol, 9},
      {StatusCode::kIo, 10},
      {StatusCode::kCuda, 11},
      {StatusCode::kUnavailable, 12},
      {StatusCode::kOutOfMemory, 13},
      {StatusCode::kInternal, 14},
  };
  for (const auto& [code, value] : pinned) {
    EXPECT_EQ(static_cast<int>(code), value) << StatusCodeName(code);
  }
}

}  // namespace
}  // namespace weightcache
