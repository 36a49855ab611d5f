// Minimal leveled logging to stderr. Thread-safe (one write(2) per line).
// Level from WEIGHTCACHE_LOG_LEVEL (error|warn|info|debug), default info.
#pragma once

#include <sstream>
#include <string>

namespace weightcache {

enum class LogLevel : int { kError = 0, kWarn = 1, kInfo = 2, kDebug = 3 };

LogLevel CurrentLogLevel();
void SetLogLevel(LogLevel level);
void LogLine(LogLevel level, const std::string& line);

namespace internal {
class LogMessage {
 public:
  explicit LogMessage(LogLevel level) : level_(level) {}
  ~LogMessage() { LogLine(level_, stream_.str()); }
  std::ostringstream& stream() { return stream_; }

 private:
  LogLevel level_;
  std::ostringstream stream_;
};
}  // namespace internal

}  // namespace weightcache

#define WEIGHTCACHE_LOG(level)                                             \
  if (::weightcache::LogLevel::level > ::weightcache::CurrentLogLevel()) { \
  } else                                                                   \
    ::weightcache::internal::LogMessage(::weightcache::LogLevel::level).stream()
#define LOG_ERROR WEIGHTCACHE_LOG(kError)
#define LOG_WARN WEIGHTCACHE_LOG(kWarn)
#define LOG_INFO WEIGHTCACHE_LOG(kInfo)
#define LOG_DEBUG WEIGHTCACHE_LOG(kDebug)
