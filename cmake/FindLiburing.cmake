# FindLiburing — liburing (Debian: liburing-dev), the io_uring interface the load pipeline's
# ReadMode::kUring reads through (src/os/uring_read.h).
#
# Defines Liburing::Liburing. LIBURING_INCLUDE_DIR and LIBURING_LIBRARY may be given (e.g. the
# liburing.a of a carried sysroot: scripts/stage-device-deps.sh).
find_path(LIBURING_INCLUDE_DIR liburing.h)
find_library(LIBURING_LIBRARY NAMES uring)
include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(Liburing REQUIRED_VARS LIBURING_LIBRARY LIBURING_INCLUDE_DIR)
if(Liburing_FOUND AND NOT TARGET Liburing::Liburing)
  add_library(Liburing::Liburing UNKNOWN IMPORTED)
  set_target_properties(Liburing::Liburing PROPERTIES
    IMPORTED_LOCATION "${LIBURING_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${LIBURING_INCLUDE_DIR}")
endif()
