// A safetensors checkpoint on disk (one file, or a directory of shards with an index), its
// validated tensor table, its fingerprint, and parallel reads of its bytes.
//
// Contract:
//  * Checkpoint::Open validates every shard header (checkpoint/safetensors.h) and, for a
//    sharded directory, the index against the headers (docs/checkpoint.md lists the rules).
//    Every failure is a Status naming the path, shard or tensor.
//  * Every file (shard, index) is opened once, at Open, through os::OpenRegularFile: a FIFO,
//    directory, device or socket (or a symlink to one) is kInvalidCheckpoint naming the path
//    and its type, at once, never a hang. The Checkpoint owns the shard fds until it is
//    destroyed and never writes to them.
//  * Each shard's stat identity (FileIdentity: dev, inode, size, mtime, ctime, from fstat of
//    the fd that is read) is taken at Open; files_digest() hashes them (the CacheConfig's
//    checkpoint_files) and CheckUnchanged() compares them with the files as they are now, so
//    a file rewritten or replaced during or after a load is detected without reading data.
//  * The bounds of checkpoint/limits.h (rank, name length, tensor count, name bytes) are
//    checked at Open: a checkpoint that opens fits the attach manifest.
//  * Checkpoint is move-only. Its const methods, ReadRanges and ReadTensor are thread-safe:
//    reads use pread on the shared fds and never move a file position.
//  * Pointers returned by Find() and references from tensors()/shards() live as long as
//    the Checkpoint that returned them (moving it moves their storage along, intact).
#pragma once

#include <sys/stat.h>

#include <cstdint>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "checkpoint/dtype.h"
#include "common/unique_fd.h"
#include "weightcache/status.h"

namespace weightcache::checkpoint {

// The index file of a sharded checkpoint, as transformers writes it.
inline constexpr std::string_view kIndexFileName = "model.safetensors.index.json";
// Bound on the index file (it is JSON we parse into memory).
inline constexpr uint64_t kMaxIndexBytes = 100'000'000;
// Bound on the nesting of the index's JSON (weight_map is at depth 2; "metadata" is flat).
inline constexpr int kMaxIndexDepth = 64;

// What identifies the content of one file without reading it: the inode and its size and
// times. ctime is included because anyone can reset mtime (touch -d, utime), but no one can
// reset ctime: a rewrite in place that keeps size and mtime still moves ctime.
struct FileIdentity {
  uint64_t dev = 0;
  uint64_t ino = 0;
  uint64_t size = 0;
  int64_t mtime_ns = 0;
  int64_t ctime_ns = 0;
  bool operator==(const FileIdentity&) const = default;
};
FileIdentity FileIdentityOf(const struct stat& st);
// "size 10 -> 12, mtime 1.5 -> 1.7" over the fields that differ ("" when equal).
std::string DescribeIdentityChange(const FileIdentity& before, const FileIdentity& after);

struct TensorInfo {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<uint64_t> shape;
  uint64_t nbytes = 0;
  uint32_t shard = 0;   // index into Checkpoint::shards()
  uint64_t offset = 0;  // absolute byte offset in its shard file
};

struct ShardInfo {
  std::string path;       // as opened: the directory joined with file_name, or the given file
  std::string file_name;  // base name
  uint64_t file_size = 0;
  FileIdentity identity;                        // fstat of the fd at Open
  uint64_t header_len = 0;                      // N of the 8-byte prefix
  uint64_t data_start = 0;                      // 8 + N
  std::map<std::string, std::string> metadata;  // this shard's "__metadata__"
};

class Checkpoint {
 public:
  // `path` is a .safetensors file, or a directory holding either model.safetensors.index.json
  // and the shards it names, or exactly one *.safetensors file (several without an index is
  // an error: which of them form the model would be a guess).
  static Result<Checkpoint> Open(const std::string& path);

  Checkpoint(Checkpoint&&) noexcept = default;
  Checkpoint& operator=(Checkpoint&&) noexcept = default;
  Checkpoint(const Checkpoint&) = delete;
  Checkpoint& operator=(const Checkpoint&) = delete;
  ~Checkpoint() = default;

  // The path given to Open.
  const std::string& path() const { return path_; }
  // Sorted by file name (byte order); TensorInfo::shard indexes this.
  const std::vector<ShardInfo>& shards() const { return shards_; }
  // Sorted by name (byte order), so listings and digests do not depend on file layout.
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  // Union of the shards' "__metadata__"; for a key present in several shards with different
  // values, the first shard's (in shards() order) wins. Per-shard maps are in ShardInfo.
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // SHA-256 hex, defined in docs/checkpoint.md: over a version tag, then for each shard in
  // shards() order its file name, file size and raw header bytes, each length-prefixed.
  const std::string& fingerprint() const { return fingerprint_; }
  // SHA-256 hex over each shard's (file name, FileIdentity), in shards() order: the
  // CacheConfig's checkpoint_files (docs/identity.md). Never depends on the path used to
  // reach the files, so a bind mount or another container's view of them gives the same.
  const std::string& files_digest() const { return files_digest_; }
  // kInvalidCheckpoint naming the shard and what changed when a shard's fd (fstat) or its
  // path (stat) no longer has the identity taken at Open: the file was rewritten in place,
  // replaced or removed since. Stat calls only.
  Status CheckUnchanged() const;
  // Sum of every tensor's nbytes.
  uint64_t total_bytes() const { return total_bytes_; }
  // nullptr when absent. O(log n).
  const TensorInfo* Find(std::string_view name) const;

  // The read-only fd of shard `shard` (< shards().size()), owned by this object.
  int shard_fd(uint32_t shard) const { return fds_[shard].get(); }

 private:
  Checkpoint() = default;

  std::string path_;
  std::vector<ShardInfo> shards_;
  std::vector<UniqueFd> fds_;  // parallel to shards_
  std::vector<TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
  std::string fingerprint_;
  std::string files_digest_;
  uint64_t total_bytes_ = 0;
};

// The files_digest() that Checkpoint::Open(path) would compute, from the shard list (the
// index or the directory listing) and an open + fstat of each shard, without reading any
// header: for a caller that already knows the fingerprint.
Result<std::string> CheckpointFilesDigest(const std::string& path);

// The shard files of the checkpoint at `path` as (path, file name), in file name order, from
// the index or the directory listing, without opening any of them (checkpoint/content_anchor.h
// looks up what the checkpoint records of each).
Result<std::vector<std::pair<std::string, std::string>>> CheckpointShardFiles(
    const std::string& path);

// One byte range of one shard, read into `dest` (length bytes, caller-owned).
struct ReadRequest {
  uint32_t shard = 0;
  uint64_t offset = 0;  // absolute offset in the shard file
  uint64_t length = 0;
  void* dest = nullptr;
};

struct ReadOptions {
  int threads = 8;                  // reader threads, the calling thread included (1..256)
  uint64_t chunk_bytes = 16 << 20;  // requests are split into pieces of at most this size
  // Called after each chunk with the total bytes read so far (monotonic, ends at the sum of
  // the lengths on success). Calls come from reader threads, one at a time; keep it cheap.
  std::function<void(uint64_t bytes_done_total)> progress;
};

// Reads every request, splitting them into chunks spread over `threads` threads with pread
// (EINTR and short reads resumed). Requests outside their shard's size or with a null dest
// are kInvalidArgument before anything is read. A file that ends before a requested byte
// (it shrank since Open) is kIo naming the file and offset. On error the first failure is
// returned after all threads stopped; dest contents are then unspecified.
Status ReadRanges(const Checkpoint& checkpoint, std::span<const ReadRequest> requests,
                  const ReadOptions& options = {});

// Reads one tensor's bytes (tensor.nbytes) into dest.
Status ReadTensor(const Checkpoint& checkpoint, const TensorInfo& tensor, void* dest,
                  const ReadOptions& options = {});

}  // namespace weightcache::checkpoint
