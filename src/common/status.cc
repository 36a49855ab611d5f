#include "weightcache/status.h"

#include <cstring>

namespace weightcache {

std::string_view StatusCodeName(StatusCode code) { return InfoFor(code).name; }

Status& Status::WithErrno(int err) {
  sys_errno_ = err;
  return *this;
}

Status& Status::WithDriverError(int cu_result) {
  driver_error_ = cu_result;
  return *this;
}

Status& Status::Context(std::string_view what) {
  if (!ok()) message_ = std::string(what) + ": " + message_;
  return *this;
}

std::string Status::ToString() const {
  if (ok()) return "ok";
  std::string out = std::string(StatusCodeName(code_)) + ": " + message_;
  if (driver_error_ != 0) out += " (CUresult " + std::to_string(driver_error_) + ")";
  return out;
}

Status InvalidArgument(std::string message) {
  return Status(StatusCode::kInvalidArgument, std::move(message));
}
Status NotFound(std::string message) { return Status(StatusCode::kNotFound, std::move(message)); }
Status PermissionDenied(std::string message) {
  return Status(StatusCode::kPermissionDenied, std::move(message));
}
Status InvalidCheckpoint(std::string message) {
  return Status(StatusCode::kInvalidCheckpoint, std::move(message));
}
Status ProtocolError(std::string message) {
  return Status(StatusCode::kProtocol, std::move(message));
}
Status InternalError(std::string message) {
  return Status(StatusCode::kInternal, std::move(message));
}
Status IoError(std::string what, int err) {
  // The errno text goes into the message so that every printer shows it.
  Status s(err == ENOENT
               ? StatusCode::kNotFound
               : (err == EACCES || err == EPERM ? StatusCode::kPermissionDenied : StatusCode::kIo),
           std::move(what) + ": " + std::strerror(err));
  s.WithErrno(err);
  return s;
}

}  // namespace weightcache
