#include "common/logging.h"

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <ctime>

namespace weightcache {
namespace {

LogLevel LevelFromEnv() {
  const char* env = std::getenv("WEIGHTCACHE_LOG_LEVEL");
  if (env == nullptr) return LogLevel::kInfo;
  if (std::strcmp(env, "error") == 0) return LogLevel::kError;
  if (std::strcmp(env, "warn") == 0) return LogLevel::kWarn;
  if (std::strcmp(env, "debug") == 0) return LogLevel::kDebug;
  return LogLevel::kInfo;
}

std::atomic<int>& Level() {
  static std::atomic<int> level{static_cast<int>(LevelFromEnv())};
  return level;
}

const char* LevelTag(LogLevel level) {
  switch (level) {
    case LogLevel::kError:
      return "E";
    case LogLevel::kWarn:
      return "W";
    case LogLevel::kInfo:
      return "I";
    case LogLevel::kDebug:
      return "D";
  }
  return "?";
}

}  // namespace

LogLevel CurrentLogLevel() {
  return static_cast<LogLevel>(Level().load(std::memory_order_relaxed));
}
void SetLogLevel(LogLevel level) { Level().store(static_cast<int>(level)); }

void LogLine(LogLevel level, const std::string& line) {
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  tm tm_utc{};
  gmtime_r(&ts.tv_sec, &tm_utc);
  char prefix[64];
  int n = std::snprintf(prefix, sizeof(prefix), "%s %02d:%02d:%02d.%03ld weightcache[%d] ",
                        LevelTag(level), tm_utc.tm_hour, tm_utc.tm_min, tm_utc.tm_sec,
                        ts.tv_nsec / 1000000, static_cast<int>(getpid()));
  std::string out(prefix, n > 0 ? static_cast<size_t>(n) : 0);
  out += line;
  out += '\n';
  // One write so concurrent lines never interleave; a failed log write has nowhere to go.
  ssize_t ignored = ::write(STDERR_FILENO, out.data(), out.size());
  (void)ignored;
}

}  // namespace weightcache
