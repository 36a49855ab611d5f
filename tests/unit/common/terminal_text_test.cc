#include "common/terminal_text.h"

#include <gtest/gtest.h>

namespace weightcache {
namespace {

TEST(EscapeForTerminalTest, ControlCharactersBecomeHexEscapes) {
  EXPECT_EQ(EscapeForTerminal("\x1b[31mevil"), "\\x1b[31mevil");
  EXPECT_EQ(EscapeForTerminal(std::string("a\0b\n\r\t\x7f", 7)), "a\\x00b\\x0a\\x0d\\x09\\x7f");
}

TEST(EscapeForTerminalTest, PrintableTextIsUnchangedAndBackslashesDouble) {
  EXPECT_EQ(EscapeForTerminal("model.layers.0.weight"), "model.layers.0.weight");
  EXPECT_EQ(EscapeForTerminal("a\\x1b"), "a\\\\x1b");
  EXPECT_EQ(EscapeForTerminal("\xe6\xa8\xa1\xe5\x9e\x8b"), "\xe6\xa8\xa1\xe5\x9e\x8b");  // 模型
}

TEST(EscapeForTerminalTest, C1ControlsAndMalformedUtf8AreEscapedBytewise) {
  EXPECT_EQ(EscapeForTerminal("\xc2\x9b"
                              "31m"),
            "\\xc2\\x9b31m");  // U+009B, the 8-bit CSI
  EXPECT_EQ(EscapeForTerminal("\xff\xc3"), "\\xff\\xc3");
  EXPECT_EQ(EscapeForTerminal("\xc0\xaf"), "\\xc0\\xaf");           // overlong '/'
  EXPECT_EQ(EscapeForTerminal("\xed\xa0\x80"), "\\xed\\xa0\\x80");  // a surrogate
}

// `fleet ls` (issue 39 §11): a 17-character RANKS cell under a 5-character header must not run
// into the next column; every column is as wide as its widest cell, two spaces apart.
TEST(FormatTableTest, ColumnsAreSizedToTheirWidestCell) {
  EXPECT_EQ(FormatTable({{"RANKS", "ENDPOINT", "PID"},
                         {"tp0/1 pp0/1 ep0/1", "127.0.0.1:7000", "42"},
                         {"tp1/2", "-", "7"}}),
            "RANKS              ENDPOINT        PID\n"
            "tp0/1 pp0/1 ep0/1  127.0.0.1:7000  42\n"
            "tp1/2              -               7\n");
  // Widths count code points, not bytes: a UTF-8 name aligns like an ASCII one.
  EXPECT_EQ(FormatTable({{"MODEL", "X"}, {"\xe6\xa8\xa1\xe5\x9e\x8b", "1"}}),
            "MODEL  X\n"
            "\xe6\xa8\xa1\xe5\x9e\x8b     1\n");
}

}  // namespace
}  // namespace weightcache
