#include "common/strict_json.h"

#include <gtest/gtest.h>

#include <string>

namespace weightcache {
namespace {

TEST(StrictJsonTest, AWellFormedDocumentParses) {
  nlohmann::json doc;
  EXPECT_EQ(ParseStrictJson(R"({"a": [1, {"b": "c"}], "d": {"a": 2}})", doc), "");
  EXPECT_EQ(doc["a"][1]["b"], "c");
  EXPECT_EQ(doc["d"]["a"], 2);  // the same key in two objects is no duplicate
}

TEST(StrictJsonTest, ADuplicateKeyAtAnyDepthIsRefused) {
  nlohmann::json doc;
  EXPECT_EQ(ParseStrictJson(R"({"a": 1, "a": 2})", doc), "duplicate key \"a\"");
  EXPECT_EQ(ParseStrictJson(R"({"x": [{"k": 1, "j": 0, "k": 1}]})", doc), "duplicate key \"k\"");
  EXPECT_TRUE(doc.is_null());  // nothing of a refused document is handed out
}

TEST(StrictJsonTest, NestingDeeperThanTheLimitIsRefused) {
  nlohmann::json doc;
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  EXPECT_EQ(ParseStrictJson(deep, doc), "JSON nested deeper than 64 levels");
  EXPECT_EQ(ParseStrictJson("[[[1]]]", doc, {.max_depth = 2}), "JSON nested deeper than 2 levels");
  EXPECT_EQ(ParseStrictJson("[[1]]", doc, {.max_depth = 2}), "");
}

TEST(StrictJsonTest, TextOverTheSizeLimitIsRefusedUnread) {
  nlohmann::json doc;
  EXPECT_EQ(ParseStrictJson("[1, 2, 3]", doc, {.max_bytes = 8}),
            "JSON of 9 bytes, over the limit of 8");
  EXPECT_EQ(ParseStrictJson("[1, 2, 3]", doc, {.max_bytes = 9}), "");
}

TEST(StrictJsonTest, MalformedTextIsNotValidJson) {
  nlohmann::json doc;
  EXPECT_EQ(ParseStrictJson(R"({"a": )", doc), kNotValidJson);
  EXPECT_EQ(ParseStrictJson("{} trailing", doc), kNotValidJson);
  EXPECT_EQ(ParseStrictJson("\"\xff\"", doc), kNotValidJson);  // invalid UTF-8
  EXPECT_EQ(ParseStrictJson("", doc), kNotValidJson);
}

}  // namespace
}  // namespace weightcache
