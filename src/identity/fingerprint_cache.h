// The checkpoint part of an identity (checkpoint_fingerprint, checkpoint_files) of a model dir,
// with a verified per-user cache of the fingerprint so that a client that names only the model
// dir does not parse every shard header on each attach.
//
// Contract:
//  * CheckpointIdentityOf(path, options) returns what checkpoint::Checkpoint::Open(path) would
//    give as fingerprint() and files_digest(). On a cache hit nothing is opened: a stat of the
//    path, a readdir of the directory, a stat of the index and of every shard.
//  * An entry is used only when everything it was computed from still stats the same: the
//    listing (checkpoint::CheckpointListing: the path's device and inode, the index's presence,
//    the *.safetensors names), the index's and every shard's FileIdentity (device, inode, size,
//    mtime ns, ctime ns). checkpoint_files is always computed from the stats taken now, so the
//    identity changes whenever a file's stat identity does, cache or not.
//  * Entries live in <options.runtime_dir>/fingerprints, one file per checkpoint path
//    (named by the path's device and inode). The directory is created 0700 and owner-checked
//    like the rest of the runtime dir (identity::EnsurePrivateDir), inside a runtime dir that
//    exists already (a daemon or an earlier attach made it): the cache never creates the
//    runtime dir itself, so resolving an identity where nothing ran creates nothing. An entry is
//    read only when it is a regular file (not a symlink) owned by us and writable by nobody else,
//    at most kMaxEntryBytes, and its SHA-256 line matches its body; anything else (corrupt,
//    truncated, foreign, of another format) is ignored and rewritten. Entries are written to a temp
//    file in the same directory and renamed over the old one, so a reader never sees half of one.
//    At most kMaxEntries entries are kept (the least recently written go first).
//  * An entry is written only after a full Open whose files stat the same afterwards and whose
//    files' mtime and ctime are all at least kRacyWindowNs older than the moment the listing
//    was taken: a file changed within the filesystem's timestamp granularity of an earlier stat
//    could change again without its stat identity changing (git's "racily clean" case), so
//    such a checkpoint is recomputed on each call until it has aged.
//  * Nothing is ever written next to the checkpoint. Failing to create, read or write the
//    cache is never an error: the identity is computed from the headers instead.
//  * Thread-safety: reentrant; concurrent writers of one entry each rename a complete file.
#pragma once

#include <sys/types.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "weightcache/status.h"

namespace weightcache::identity {

inline constexpr std::string_view kFingerprintCacheDirName = "fingerprints";
inline constexpr size_t kMaxEntryBytes = size_t{1} << 20;
inline constexpr size_t kMaxEntries = 64;
inline constexpr int64_t kRacyWindowNs = 1'000'000'000;

struct FingerprintCacheOptions {
  // The runtime dir (identity::ResolveRuntimeDir); the cache is its kFingerprintCacheDirName
  // subdirectory. "" disables the cache (compute every time, write nothing).
  std::string runtime_dir;
  uid_t uid = ::geteuid();
  // The wall clock (CLOCK_REALTIME ns) the racy-window rule compares file times with; unset
  // means the real clock. Tests set it to model a checkpoint that has aged.
  std::optional<int64_t> now_ns;
};

// How CheckpointIdentityOf got the fingerprint: from the headers, or from this cache.
enum class FingerprintSource { kComputed, kCache };

struct CheckpointIdentity {
  std::string fingerprint;   // checkpoint::Checkpoint::fingerprint()
  std::string files_digest;  // checkpoint::Checkpoint::files_digest()
  FingerprintSource source = FingerprintSource::kComputed;
};

// <runtime_dir>/fingerprints.
std::string FingerprintCacheDir(const std::string& runtime_dir);

// Checkpoint::Open's errors (kInvalidCheckpoint, kNotFound, kIo naming the path) when the
// entry misses and the checkpoint does not open.
Result<CheckpointIdentity> CheckpointIdentityOf(const std::string& path,
                                                const FingerprintCacheOptions& options);

// checkpoint::CheckpointFilesDigest(path) (for a caller that was given the fingerprint) through
// the same cache: on a verified entry, from the stats that checked it (no index parse); else
// computed, and nothing is stored (no fingerprint was computed to store).
Result<std::string> CheckpointFilesDigestOf(const std::string& path,
                                            const FingerprintCacheOptions& options);

}  // namespace weightcache::identity
