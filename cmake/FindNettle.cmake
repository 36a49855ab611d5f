# FindNettle — GNU Nettle's libnettle (Debian: nettle-dev): SHA-256 for the identities and
# digests (src/common/hash.cc), base64 for etcd's JSON gateway (src/fleet). Chosen over
# OpenSSL's libcrypto because its hashing needs no process-wide initialisation: OpenSSL's first
# digest in a process costs 0.6–1.4 ms (configuration file, providers, algorithm fetch), paid by
# every fresh client for a few hundred bytes of digests (docs/benchmarks.md).
#
# Defines Nettle::Nettle. NETTLE_INCLUDE_DIR and NETTLE_LIBRARY may be given (e.g. the
# libnettle.a of a carried sysroot, which links into shared objects: Debian builds it PIC).
find_path(NETTLE_INCLUDE_DIR nettle/sha2.h)
find_library(NETTLE_LIBRARY NAMES nettle)
include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(Nettle REQUIRED_VARS NETTLE_LIBRARY NETTLE_INCLUDE_DIR)
if(Nettle_FOUND AND NOT TARGET Nettle::Nettle)
  add_library(Nettle::Nettle UNKNOWN IMPORTED)
  set_target_properties(Nettle::Nettle PROPERTIES
    IMPORTED_LOCATION "${NETTLE_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${NETTLE_INCLUDE_DIR}")
endif()
