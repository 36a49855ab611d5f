// The content anchor of a checkpoint (docs/fleet.md "The content anchor"): each shard file's
// SHA-256 as the checkpoint itself records it, found without reading any tensor data. A fill
// from other nodes proves the bytes it received against it before the cache is ready
// (daemon/peer_fill.h ProveFillContent), and the fleet key holds it (identity::CacheConfig::
// FleetDigest), so that a node whose files differ from ours is never taken for a source.
//
// Where a shard's digest comes from, the first that applies:
//  1. --fill-content-sha256 FILE (pinned by the operator, sha256sum format); when given, it is
//     the only place looked at, and it must name every shard;
//  2. a Hugging Face hub cache: snapshots/<rev>/<name> is a symlink whose final target is
//     <repo>/blobs/<64 hex>, and an LFS file's blob is named by its SHA-256;
//  3. a `huggingface-cli download --local-dir` directory: .cache/huggingface/download/
//     <name>.metadata holds the commit, the etag (an LFS file's SHA-256) and the time it was
//     written, and is believed only while the file's mtime is not newer than that time (with
//     huggingface_hub's one second of slack for coarse timestamps).
// Every input is untrusted: a blob name that is not 64 lowercase hex, a symlink loop, a link
// whose blob lies outside the snapshot's own repository, a metadata file that is not a regular
// file, too long, or holds junk: each is no digest for that shard (the reason is kept), never
// a crash or a guess.
//
// Contract: pure functions over the filesystem (lstat, readlink, realpath, stat, bounded reads
// of small files); no tensor byte is read. Thread-safe.
#pragma once

#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "weightcache/status.h"

namespace weightcache::checkpoint {

enum class AnchorSource { kPinned, kHubBlob, kLocalDirMetadata };
// "--fill-content-sha256", "hub cache blob name", "local-dir download metadata".
std::string_view AnchorSourceName(AnchorSource source);

struct ShardDigest {
  std::string file_name;
  std::string sha256;  // 64 lowercase hex
  AnchorSource source = AnchorSource::kPinned;
};

struct ContentAnchor {
  std::vector<ShardDigest> shards;  // one per shard file, in file name order

  // The sha256sum-format lines "<sha256>  <file name>\n" of every shard in order: what the
  // fleet key holds (its SHA-256 hex is Digest()).
  std::string Text() const;
  std::string Digest() const;
  // nullptr when `file_name` is no shard of the anchor.
  const ShardDigest* Find(std::string_view file_name) const;
  // "hub cache blob name" when every shard's digest came from one place, else the places
  // joined with " + ".
  std::string Describe() const;
};

// One shard file to anchor: its name in the checkpoint and the path it is read at.
struct AnchorFile {
  std::string file_name;
  std::string path;
};

// Bounds on the untrusted files read here.
inline constexpr size_t kMaxPinnedSumsBytes = size_t{1} << 20;
inline constexpr size_t kMaxDownloadMetadataBytes = 4096;

// The lines of a sha256sum file: "<64 hex>  <name>" or "<64 hex> *<name>" (binary mode), the
// digest in either case (kept lowercase), blank lines and "#" comments skipped. A name is
// matched by its last path component (so `sha256sum shards/*` output works). kInvalidArgument
// naming the line for a malformed one, and for a name listed twice with different digests.
Result<std::vector<std::pair<std::string, std::string>>> ParseSha256Sums(std::string_view text);

// The digest the checkpoint records of one file without a pinned list: the hub blob name, else
// the local-dir metadata. kNotFound saying why neither gives one.
Result<ShardDigest> RecordedDigest(const AnchorFile& file);

// The anchor of `files`. With `pinned_file` non-empty, that file alone: kInvalidArgument when it
// cannot be read, is malformed or has no line for a shard (an operator's error: serve refuses
// to start). Else each file's RecordedDigest: kNotFound naming the first shard without one and
// why (a checkpoint without an anchor: the caller decides what that means).
Result<ContentAnchor> FindContentAnchor(std::span<const AnchorFile> files,
                                        const std::string& pinned_file);
// The same over the shard files of the checkpoint at `checkpoint_path` (CheckpointShardFiles).
Result<ContentAnchor> FindContentAnchor(const std::string& checkpoint_path,
                                        const std::string& pinned_file);

}  // namespace weightcache::checkpoint
