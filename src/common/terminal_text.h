// EscapeForTerminal — the one rule for printing untrusted text (tensor names, metadata, model
// ids, paths, a daemon's failure reason) in human-readable CLI output: a name holding
// "\x1b[31m" must print as those characters, never recolour or rewrite the user's terminal.
// JSON output needs none of this (the JSON encoder escapes control characters).
//
// Rule: printable ASCII stays as is, except the backslash, which doubles ("\\"), so an escape
// in the output is never ambiguous; every other ASCII byte (C0 controls, DEL) becomes \xNN;
// a well-formed UTF-8 sequence of a code point >= U+00A0 stays as is (names in any script);
// every byte of a C1 control (U+0080..U+009F, e.g. the 8-bit CSI) or of malformed UTF-8
// becomes \xNN. Pure function, thread-safe.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace weightcache {

std::string EscapeForTerminal(std::string_view text);

// The one rule for naming untrusted text (a tensor name, a metadata key) inside an error
// message: its first kQuotedPrefix bytes in single quotes, "..." marking a cut, so a 1 MiB
// name cannot make a 1 MiB message. The bytes are not escaped here (EscapeForTerminal is
// applied where a message meets a terminal).
inline constexpr size_t kQuotedPrefix = 128;
std::string QuoteBounded(std::string_view text);

// The one rule for a CLI table (`fleet ls`): the first row is the header; every column is as
// wide as its widest cell (in code points), columns are two spaces apart, the last one is not
// padded, every row ends in '\n'. A cell never runs into the next column whatever its length.
// Cells are printed as given: escape untrusted ones first (EscapeForTerminal). Rows shorter
// than the header leave their last columns empty.
std::string FormatTable(const std::vector<std::vector<std::string>>& rows);

}  // namespace weightcache
