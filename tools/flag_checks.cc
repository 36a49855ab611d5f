#include "flag_checks.h"

#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <sstream>
#include <string>
#include <variant>

namespace weightcache::cli {
namespace {

// A bound as a person writes it: 1048576, not 1.04858e+06; 0.5 as 0.5.
std::string BoundText(double v) {
  if (v == std::floor(v) && std::fabs(v) < 1e15) return std::to_string(static_cast<int64_t>(v));
  std::ostringstream out;
  out << v;
  return out.str();
}

// The parsed value of a numeric flag, or the refusal's text.
std::variant<double, std::string> FiniteNumber(const std::string& text) {
  errno = 0;
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (text.empty() || end == text.c_str() || *end != '\0') return text + " is not a number";
  if (!std::isfinite(v)) return text + " is not a finite number";
  if (errno == ERANGE) return text + " is out of range";
  return v;
}

// `ok(v)` or "<text> is not <bound>".
CLI::Validator NumberCheck(std::string description, std::function<bool(double)> ok,
                           std::string bound) {
  return CLI::Validator(
      [ok = std::move(ok), bound = std::move(bound)](std::string& text) -> std::string {
        auto value = FiniteNumber(text);
        if (const std::string* why = std::get_if<std::string>(&value)) return *why;
        return ok(std::get<double>(value)) ? std::string() : text + " is not " + bound;
      },
      std::move(description));
}

}  // namespace

CLI::Validator AtLeast(double min) {
  return NumberCheck(
      ">= " + BoundText(min), [min](double v) { return v >= min; }, "\u2265 " + BoundText(min));
}

CLI::Validator Positive() {
  return NumberCheck(
      "> 0", [](double v) { return v > 0; }, "> 0");
}

CLI::Validator InRange(double min, double max) {
  return NumberCheck(
      BoundText(min) + " to " + BoundText(max),
      [min, max](double v) { return v >= min && v <= max; },
      "in " + BoundText(min) + " \u2026 " + BoundText(max));
}

}  // namespace weightcache::cli
