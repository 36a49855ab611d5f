// Which files a checkpoint path stands for, and the digest of their stat identities: the rules
// Checkpoint::Open (checkpoint.h) chooses its files and computes files_digest() by, exposed for
// the fingerprint cache (identity/fingerprint_cache.h), which checks an entry against them
// without opening any file.
//
// Thread-safety: reentrant; ListCheckpoint does filesystem I/O (stat, readdir) only.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "weightcache/status.h"

namespace weightcache::checkpoint {

// One file of a checkpoint by its base name and stat identity.
struct NamedFileIdentity {
  std::string name;
  FileIdentity identity;
  bool operator==(const NamedFileIdentity&) const = default;
};

// SHA-256 hex over each file's (name, FileIdentity) in the given order: the one rule behind
// Checkpoint::files_digest() and CheckpointFilesDigest (docs/identity.md, checkpoint_files).
std::string FilesDigest(std::span<const NamedFileIdentity> files);

// From stat and readdir alone: the path's own device and inode, whether it is a directory and,
// for a directory, whether it holds the index and its *.safetensors entries (sorted). Open
// takes its files from the index when has_index, else from the one *.safetensors entry, else
// (a file) the path itself.
struct CheckpointListing {
  uint64_t dev = 0;
  uint64_t ino = 0;
  bool directory = false;
  bool has_index = false;
  std::vector<std::string> safetensors;  // directories only
  bool operator==(const CheckpointListing&) const = default;
};

// kIo naming the path when it cannot be stat-ed or listed; kInvalidCheckpoint when it is
// neither a regular file nor a directory.
Result<CheckpointListing> ListCheckpoint(const std::string& path);

// The path of the file `file_name` of the checkpoint at `path`: `path` itself for a file
// checkpoint, else `path`/`file_name`.
std::string CheckpointFilePath(const std::string& path, const CheckpointListing& listing,
                               const std::string& file_name);

}  // namespace weightcache::checkpoint
