// The checks of numeric flags, the one home of their messages (issue 39 §11); a library of its
// own, so that the flag tables tests link (identity_flags, registry_flags) carry the same checks
// as the CLI. Pure: each check parses the flag's text and keeps no state.
//
// The value must be a number (NaN and ±inf are refused: "nan is not a finite number") within
// the bound; CLI11 prefixes the flag, so a refusal reads "--tp-size: 0 is not ≥ 1", "--wait: -1
// is not ≥ 0", "--timeout: 0 is not > 0", "--threads: 300 is not in 1 … 256" (exit 2). Every
// numeric flag of tools/ uses one of these (never CLI11's PositiveNumber, NonNegativeNumber or
// Range, whose messages print DBL_MAX's 309 digits and which let NaN through).
#pragma once

#include <CLI/CLI.hpp>

namespace weightcache::cli {

CLI::Validator AtLeast(double min);              // min ≤ value (counts, ranks, fds, seconds)
CLI::Validator Positive();                       // 0 < value (durations)
CLI::Validator InRange(double min, double max);  // min ≤ value ≤ max

}  // namespace weightcache::cli
