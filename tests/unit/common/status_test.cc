#include "weightcache/status.h"

#include <gtest/gtest.h>

#include <cerrno>

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

}  // namespace
}  // namespace weightcache
