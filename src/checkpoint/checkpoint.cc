#include "checkpoint/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <exception>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <utility>

#include "checkpoint/limits.h"
#include "checkpoint/listing.h"
#include "checkpoint/safetensors.h"
#include "common/hash.h"
#include "common/mutex.h"
#include "common/terminal_text.h"
#include "os/regular_file.h"
#include "os/strided_read.h"

namespace weightcache::checkpoint {
namespace {

constexpr std::string_view kFingerprintTag = "weightcache-checkpoint-fingerprint-v1";
constexpr int kMaxReadThreads = 256;
// One pread never asks for more than this (Linux caps a read at ~2 GiB anyway).

// Every file the checkpoint module reads is opened here (os/regular_file.h: never blocks on
// a FIFO, refuses anything but a regular file).
Result<os::RegularFile> OpenCheckpointFile(const std::string& path) {
  return os::OpenRegularFile(path, StatusCode::kInvalidCheckpoint);
}

struct OpenedShard {
  ShardInfo info;
  ParsedHeader header;
  UniqueFd fd;
};

Result<OpenedShard> OpenShard(const std::string& path, const std::string& file_name) {
  OpenedShard shard;
  WEIGHTCACHE_ASSIGN_OR_RETURN(os::RegularFile file, OpenCheckpointFile(path));
  shard.fd = std::move(file.fd);
  shard.info.identity = FileIdentityOf(file.st);
  shard.info.file_size = shard.info.identity.size;
  std::vector<uint8_t> bytes(kHeaderPrefixBytes);
  const uint64_t prefix = std::min<uint64_t>(kHeaderPrefixBytes, shard.info.file_size);
  WEIGHTCACHE_RETURN_IF_ERROR(os::PreadExact(shard.fd.get(), path, 0, prefix, bytes.data()));
  Result<uint64_t> n = ParseHeaderLength(std::span(bytes.data(), prefix), shard.info.file_size);
  if (!n.ok()) return n.status().Context(path);
  bytes.resize(kHeaderPrefixBytes + *n);
  WEIGHTCACHE_RETURN_IF_ERROR(os::PreadExact(shard.fd.get(), path, kHeaderPrefixBytes, *n,
                                             bytes.data() + kHeaderPrefixBytes));
  Result<ParsedHeader> header = ParseSafetensorsHeader(bytes, shard.info.file_size);
  if (!header.ok()) return header.status().Context(path);
  shard.header = std::move(header).value();
  shard.info.path = path;
  shard.info.file_name = file_name;
  shard.info.header_len = shard.header.header_len;
  shard.info.data_start = shard.header.data_start;
  shard.info.metadata = shard.header.metadata;
  return shard;
}

// A shard file name from the index must name a file in the checkpoint directory itself.
Status CheckShardFileName(const std::string& tensor, const std::string& file) {
  if (file.empty() || file == "." || file == ".." || file.find('/') != std::string::npos ||
      file.find('\0') != std::string::npos) {
    return InvalidCheckpoint(std::string(kIndexFileName) + " maps tensor " + QuoteBounded(tensor) +
                             " to " + QuoteBounded(file) +
                             ": a shard must be a plain file name in the checkpoint directory "
                             "(no '/', '.' or '..')");
  }
  return Status::Ok();
}

// The index's JSON, checked while nlohmann parses it (SAX: no DOM, so memory stays linear in
// the file and a deep document cannot build a deep tree). It accepts an object whose
// "weight_map" member is an object of strings; every other member is skipped, nested at most
// kMaxIndexDepth deep. Duplicate weight_map keys are seen (a DOM would keep the last one).
class IndexSax {
 public:
  using Json = nlohmann::json;
  using number_integer_t = Json::number_integer_t;
  using number_unsigned_t = Json::number_unsigned_t;
  using number_float_t = Json::number_float_t;
  using string_t = Json::string_t;
  using binary_t = Json::binary_t;

  bool null() { return Value(nullptr); }
  bool boolean(bool) { return Value(nullptr); }
  bool number_integer(number_integer_t) { return Value(nullptr); }
  bool number_unsigned(number_unsigned_t) { return Value(nullptr); }
  bool number_float(number_float_t, const string_t&) { return Value(nullptr); }
  bool binary(binary_t&) { return Value(nullptr); }
  bool string(string_t& v) { return Value(&v); }

  bool start_object(std::size_t) { return Open(/*object=*/true); }
  bool start_array(std::size_t) { return Open(/*object=*/false); }
  bool end_object() { return Close(); }
  bool end_array() { return Close(); }

  bool key(string_t& k) {
    if (depth_ == 1) {
      in_weight_map_key_ = (k == "weight_map");
      if (in_weight_map_key_ && saw_weight_map_) return Fail("lists \"weight_map\" twice");
    } else if (depth_ == 2 && in_weight_map_) {
      current_key_ = std::move(k);
    }
    return true;
  }

  bool parse_error(std::size_t, const std::string&, const Json::exception& ex) {
    return Fail(std::string("is not valid JSON: ") + ex.what());
  }

  std::map<std::string, std::string>& weight_map() { return weight_map_; }
  bool saw_weight_map() const { return saw_weight_map_; }
  bool root_is_object() const { return root_is_object_; }
  const std::string& error() const { return error_; }

 private:
  bool Open(bool object) {
    if (depth_ == 0) root_is_object_ = object;
    if (depth_ == 1 && in_weight_map_key_) {
      if (!object) return Fail("has no \"weight_map\" object");
      in_weight_map_ = true;
      saw_weight_map_ = true;
    } else if (depth_ == 2 && in_weight_map_) {
      return NotAString();
    }
    if (++depth_ > kMaxIndexDepth) {
      return Fail("nests JSON deeper than " + std::to_string(kMaxIndexDepth) + " levels");
    }
    return true;
  }
  bool Close() {
    --depth_;
    if (depth_ == 1) in_weight_map_ = false;
    return true;
  }
  bool Value(string_t* v) {
    if (depth_ == 1 && in_weight_map_key_) return Fail("has no \"weight_map\" object");
    if (depth_ != 2 || !in_weight_map_) return true;
    if (v == nullptr) return NotAString();
    if (weight_map_.size() >= kMaxTensorCount) {
      return Fail(": weight_map lists more than " + std::to_string(kMaxTensorCount) +
                  " tensors, over the limit of " + std::to_string(kMaxTensorCount) +
                  " tensors per checkpoint");
    }
    Status s = CheckShardFileName(current_key_, *v);
    if (!s.ok()) return Fail(": " + s.message());
    if (!weight_map_.try_emplace(current_key_, std::move(*v)).second) {
      return Fail(": weight_map lists tensor " + QuoteBounded(current_key_) + " twice");
    }
    return true;
  }
  bool NotAString() {
    return Fail(": weight_map entry for " + QuoteBounded(current_key_) + " is not a string");
  }
  bool Fail(std::string message) {
    if (error_.empty()) error_ = std::move(message);
    return false;
  }

  int depth_ = 0;
  bool root_is_object_ = false;
  bool in_weight_map_key_ = false;  // the current root member is "weight_map"
  bool in_weight_map_ = false;      // inside its object
  bool saw_weight_map_ = false;
  std::string current_key_;
  std::map<std::string, std::string> weight_map_;
  std::string error_;
};

// weight_map of the index: tensor name -> shard file name, duplicates refused. Linear in the
// file: one pass of a SAX parse into the map.
Result<std::map<std::string, std::string>> ReadIndex(const std::string& index_path) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(os::RegularFile file, OpenCheckpointFile(index_path));
  const auto size = static_cast<uint64_t>(file.st.st_size);
  if (size > kMaxIndexBytes) {
    return InvalidCheckpoint(index_path + " is " + std::to_string(size) +
                             " bytes, over the limit of " + std::to_string(kMaxIndexBytes));
  }
  std::string text(size, '\0');
  WEIGHTCACHE_RETURN_IF_ERROR(os::PreadExact(file.fd.get(), index_path, 0, size, text.data()));
  file.fd.Reset();

  IndexSax sax;
  bool parsed = false;
  try {
    parsed = nlohmann::json::sax_parse(text, &sax, nlohmann::json::input_format_t::json,
                                       /*strict=*/true);
  } catch (const std::exception& e) {
    // nlohmann reports errors through parse_error; this only guards its allocation paths.
    return InvalidCheckpoint(index_path + " is not valid JSON: " + e.what());
  }
  if (!parsed) {
    const std::string& e = sax.error();
    return InvalidCheckpoint(index_path + (e.starts_with(":") ? "" : " ") +
                             (e.empty() ? "is not valid JSON" : e));
  }
  if (!sax.root_is_object() || !sax.saw_weight_map()) {
    return InvalidCheckpoint(index_path + " has no \"weight_map\" object");
  }
  if (sax.weight_map().empty()) return InvalidCheckpoint(index_path + ": weight_map is empty");
  return std::move(sax.weight_map());
}

std::string JoinPath(const std::string& dir, const std::string& name) {
  if (!dir.empty() && dir.back() == '/') return dir + name;
  return dir + "/" + name;
}

std::string BaseName(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

void AppendLe64(Sha256& sha, uint64_t v) {
  uint8_t bytes[8];
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<uint8_t>(v >> (8 * i));
  sha.Update(bytes, sizeof(bytes));
}

constexpr std::string_view kFilesDigestTag = "weightcache-checkpoint-files-v1";

// The files a checkpoint path stands for, before any of them is opened.
struct FileList {
  CheckpointListing listing;
  std::vector<std::pair<std::string, std::string>> files;  // (path, file name)
  std::map<std::string, std::string> weight_map;           // indexed directories only
  bool indexed = false;
};

Result<FileList> ListFiles(const std::string& path) {
  FileList list;
  WEIGHTCACHE_ASSIGN_OR_RETURN(list.listing, ListCheckpoint(path));
  const CheckpointListing& listing = list.listing;
  if (!listing.directory) {
    list.files.emplace_back(path, BaseName(path));
  } else if (listing.has_index) {
    list.indexed = true;
    WEIGHTCACHE_ASSIGN_OR_RETURN(list.weight_map,
                                 ReadIndex(JoinPath(path, std::string(kIndexFileName))));
    std::set<std::string> names;
    for (const auto& [tensor, file] : list.weight_map) names.insert(file);
    for (const auto& name : names) list.files.emplace_back(JoinPath(path, name), name);
  } else {
    const std::vector<std::string>& found = listing.safetensors;
    if (found.empty()) return NotFound("no .safetensors file in " + path);
    if (found.size() > 1) {
      std::string listed;
      for (size_t i = 0; i < found.size() && i < 4; ++i) listed += (i ? ", " : "") + found[i];
      if (found.size() > 4) listed += ", ...";
      return InvalidCheckpoint(path + " holds " + std::to_string(found.size()) +
                               " .safetensors files (" + listed + ") but no " +
                               std::string(kIndexFileName) + " saying which form the model");
    }
    list.files.emplace_back(JoinPath(path, found[0]), found[0]);
  }
  return list;
}

Status MissingShard(const FileList& list, const std::string& path, const std::string& file_name,
                    Status status) {
  if (list.indexed && status.code() == StatusCode::kNotFound) {
    return InvalidCheckpoint("shard " + QuoteBounded(file_name) + " named by " +
                             std::string(kIndexFileName) + " in " + path + " does not exist");
  }
  return status;
}

void AppendIdentity(Sha256& sha, const std::string& file_name, const FileIdentity& id) {
  AppendLe64(sha, file_name.size());
  sha.Update(file_name);
  AppendLe64(sha, id.dev);
  AppendLe64(sha, id.ino);
  AppendLe64(sha, id.size);
  AppendLe64(sha, static_cast<uint64_t>(id.mtime_ns));
  AppendLe64(sha, static_cast<uint64_t>(id.ctime_ns));
}

std::string TimeText(int64_t ns) {
  constexpr int64_t kNsPerS = 1'000'000'000;
  std::string frac = std::to_string(ns % kNsPerS);
  return std::to_string(ns / kNsPerS) + "." + std::string(9 - frac.size(), '0') + frac;
}

}  // namespace

std::string FilesDigest(std::span<const NamedFileIdentity> files) {
  Sha256 sha;
  sha.Update(kFilesDigestTag);
  for (const NamedFileIdentity& f : files) AppendIdentity(sha, f.name, f.identity);
  return sha.FinalHex();
}

Result<CheckpointListing> ListCheckpoint(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return IoError("open checkpoint " + path, errno);
  CheckpointListing listing;
  listing.dev = static_cast<uint64_t>(st.st_dev);
  listing.ino = static_cast<uint64_t>(st.st_ino);
  if (S_ISREG(st.st_mode)) return listing;
  if (!S_ISDIR(st.st_mode)) {
    return InvalidCheckpoint("checkpoint " + path + " is a " +
                             std::string(os::FileTypeName(st.st_mode)) +
                             ", not a regular file or a directory");
  }
  listing.directory = true;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(path, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name == kIndexFileName) listing.has_index = true;
    if (name.size() > 12 && name.ends_with(".safetensors")) listing.safetensors.push_back(name);
  }
  if (ec) return IoError("list " + path, ec.value());
  std::sort(listing.safetensors.begin(), listing.safetensors.end());
  return listing;
}

std::string CheckpointFilePath(const std::string& path, const CheckpointListing& listing,
                               const std::string& file_name) {
  return listing.directory ? JoinPath(path, file_name) : path;
}

FileIdentity FileIdentityOf(const struct stat& st) {
  FileIdentity id;
  id.dev = static_cast<uint64_t>(st.st_dev);
  id.ino = static_cast<uint64_t>(st.st_ino);
  id.size = static_cast<uint64_t>(st.st_size);
  id.mtime_ns = int64_t{st.st_mtim.tv_sec} * 1'000'000'000 + st.st_mtim.tv_nsec;
  id.ctime_ns = int64_t{st.st_ctim.tv_sec} * 1'000'000'000 + st.st_ctim.tv_nsec;
  return id;
}

std::string DescribeIdentityChange(const FileIdentity& before, const FileIdentity& after) {
  std::string out;
  auto add = [&](const char* field, const std::string& a, const std::string& b) {
    if (a == b) return;
    out += (out.empty() ? "" : ", ") + std::string(field) + " " + a + " -> " + b;
  };
  add("device", std::to_string(before.dev), std::to_string(after.dev));
  add("inode", std::to_string(before.ino), std::to_string(after.ino));
  add("size", std::to_string(before.size), std::to_string(after.size));
  add("mtime", TimeText(before.mtime_ns), TimeText(after.mtime_ns));
  add("ctime", TimeText(before.ctime_ns), TimeText(after.ctime_ns));
  return out;
}

Result<std::string> CheckpointFilesDigest(const std::string& path) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(FileList list, ListFiles(path));
  std::vector<NamedFileIdentity> files;
  for (const auto& [file_path, file_name] : list.files) {
    Result<os::RegularFile> file = OpenCheckpointFile(file_path);
    if (!file.ok()) return MissingShard(list, path, file_name, file.status());
    files.push_back({file_name, FileIdentityOf(file->st)});
  }
  return FilesDigest(files);
}

Result<std::vector<std::pair<std::string, std::string>>> CheckpointShardFiles(
    const std::string& path) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(FileList list, ListFiles(path));
  std::sort(list.files.begin(), list.files.end(),
            [](const auto& a, const auto& b) { return a.second < b.second; });
  return std::move(list.files);
}

Status Checkpoint::CheckUnchanged() const {
  for (size_t s = 0; s < shards_.size(); ++s) {
    const ShardInfo& shard = shards_[s];
    const std::string what = "shard " + QuoteBounded(shard.file_name) + " (" + shard.path + ")";
    struct stat st {};
    if (::fstat(fds_[s].get(), &st) != 0) return IoError("fstat " + shard.path, errno);
    std::string change = DescribeIdentityChange(shard.identity, FileIdentityOf(st));
    if (!change.empty()) {
      return InvalidCheckpoint(what + " was rewritten in place while it was read (" + change +
                               "): its bytes may be a mix of old and new");
    }
    if (::stat(shard.path.c_str(), &st) != 0) {
      if (errno == ENOENT) {
        return InvalidCheckpoint(what + " was removed or renamed since it was opened");
      }
      return IoError("stat " + shard.path, errno);
    }
    change = DescribeIdentityChange(shard.identity, FileIdentityOf(st));
    if (!change.empty()) {
      return InvalidCheckpoint(what + " was replaced by another file since it was opened (" +
                               change + ")");
    }
  }
  return Status::Ok();
}

Result<Checkpoint> Checkpoint::Open(const std::string& path) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(FileList list, ListFiles(path));
  const auto& files = list.files;
  const auto& weight_map = list.weight_map;
  const bool indexed = list.indexed;

  Checkpoint ckpt;
  ckpt.path_ = path;
  std::vector<ParsedHeader> headers;
  for (const auto& [file_path, file_name] : files) {
    Result<OpenedShard> shard = OpenShard(file_path, file_name);
    if (!shard.ok()) return MissingShard(list, path, file_name, shard.status());
    ckpt.shards_.push_back(std::move(shard->info));
    ckpt.fds_.push_back(std::move(shard->fd));
    headers.push_back(std::move(shard->header));
  }

  // The limits hold for each header (checked while parsing); here for the shards together.
  uint64_t tensor_count = 0;
  uint64_t name_bytes = 0;
  for (const ParsedHeader& h : headers) {
    tensor_count += h.tensors.size();
    for (const ParsedTensor& t : h.tensors) name_bytes += t.name.size();
  }
  if (tensor_count > kMaxTensorCount) {
    return InvalidCheckpoint("checkpoint " + path + " has " + std::to_string(tensor_count) +
                             " tensors, over the limit of " + std::to_string(kMaxTensorCount) +
                             " tensors per checkpoint");
  }
  if (name_bytes > kMaxTensorNameBytesTotal) {
    return InvalidCheckpoint("checkpoint " + path + ": tensor names total " +
                             std::to_string(name_bytes) + " bytes, over the limit of " +
                             std::to_string(kMaxTensorNameBytesTotal));
  }

  // Cross-check shards against each other and against the index.
  std::unordered_map<std::string, uint32_t> owner;  // tensor -> shard
  for (uint32_t s = 0; s < headers.size(); ++s) {
    const std::string& file = ckpt.shards_[s].file_name;
    for (ParsedTensor& t : headers[s].tensors) {
      auto [it, inserted] = owner.emplace(t.name, s);
      if (!inserted) {
        return InvalidCheckpoint("tensor " + QuoteBounded(t.name) + " is in both shard " +
                                 QuoteBounded(ckpt.shards_[it->second].file_name) + " and shard " +
                                 QuoteBounded(file));
      }
      if (indexed) {
        auto entry = weight_map.find(t.name);
        if (entry == weight_map.end()) {
          return InvalidCheckpoint("tensor " + QuoteBounded(t.name) + " of shard " +
                                   QuoteBounded(file) + " is not listed in " +
                                   std::string(kIndexFileName));
        }
        if (entry->second != file) {
          return InvalidCheckpoint("tensor " + QuoteBounded(t.name) + " is in shard " +
                                   QuoteBounded(file) + " but " + std::string(kIndexFileName) +
                                   " maps it to " + QuoteBounded(entry->second));
        }
      }
      TensorInfo info;
      info.name = std::move(t.name);
      info.dtype = t.dtype;
      info.shape = std::move(t.shape);
      info.nbytes = t.end - t.begin;
      info.shard = s;
      info.offset = headers[s].data_start + t.begin;
      ckpt.total_bytes_ += info.nbytes;
      ckpt.tensors_.push_back(std::move(info));
    }
  }
  for (const auto& [tensor, file] : weight_map) {
    if (owner.find(tensor) == owner.end()) {
      return InvalidCheckpoint(std::string(kIndexFileName) + " maps tensor " +
                               QuoteBounded(tensor) + " to shard " + QuoteBounded(file) +
                               ", which does not contain it");
    }
  }
  std::sort(ckpt.tensors_.begin(), ckpt.tensors_.end(),
            [](const TensorInfo& a, const TensorInfo& b) { return a.name < b.name; });

  for (const ShardInfo& shard : ckpt.shards_) {
    for (const auto& [k, v] : shard.metadata) ckpt.metadata_.emplace(k, v);  // first one wins
  }

  Sha256 sha;
  sha.Update(kFingerprintTag);
  for (size_t s = 0; s < headers.size(); ++s) {
    const ShardInfo& shard = ckpt.shards_[s];
    AppendLe64(sha, shard.file_name.size());
    sha.Update(shard.file_name);
    AppendLe64(sha, shard.file_size);
    AppendLe64(sha, headers[s].header_json.size());
    sha.Update(headers[s].header_json);
  }
  ckpt.fingerprint_ = sha.FinalHex();

  std::vector<NamedFileIdentity> identities;
  identities.reserve(ckpt.shards_.size());
  for (const ShardInfo& shard : ckpt.shards_) {
    identities.push_back({shard.file_name, shard.identity});
  }
  ckpt.files_digest_ = FilesDigest(identities);
  return ckpt;
}

const TensorInfo* Checkpoint::Find(std::string_view name) const {
  auto it = std::lower_bound(tensors_.begin(), tensors_.end(), name,
                             [](const TensorInfo& t, std::string_view n) { return t.name < n; });
  return it != tensors_.end() && it->name == name ? &*it : nullptr;
}

Status ReadRanges(const Checkpoint& checkpoint, std::span<const ReadRequest> requests,
                  const ReadOptions& options) {
  if (options.threads < 1 || options.threads > kMaxReadThreads) {
    return InvalidArgument("ReadOptions.threads must be in [1, " + std::to_string(kMaxReadThreads) +
                           "], got " + std::to_string(options.threads));
  }
  if (options.chunk_bytes == 0) return InvalidArgument("ReadOptions.chunk_bytes must be > 0");

  // first_chunk[i]: index of request i's first chunk; chunks are numbered across requests so
  // workers can claim them with one atomic counter without materialising a chunk list.
  std::vector<uint64_t> first_chunk(requests.size() + 1, 0);
  for (size_t i = 0; i < requests.size(); ++i) {
    const ReadRequest& r = requests[i];
    if (r.shard >= checkpoint.shards().size()) {
      return InvalidArgument("read request " + std::to_string(i) + ": shard " +
                             std::to_string(r.shard) + " does not exist (checkpoint has " +
                             std::to_string(checkpoint.shards().size()) + ")");
    }
    const ShardInfo& shard = checkpoint.shards()[r.shard];
    uint64_t end = 0;
    if (__builtin_add_overflow(r.offset, r.length, &end) || end > shard.file_size) {
      return InvalidArgument("read request " + std::to_string(i) + ": [" +
                             std::to_string(r.offset) + ", +" + std::to_string(r.length) +
                             ") is outside " + shard.file_name + " (" +
                             std::to_string(shard.file_size) + " bytes)");
    }
    if (r.length > 0 && r.dest == nullptr) {
      return InvalidArgument("read request " + std::to_string(i) + ": null destination");
    }
    first_chunk[i + 1] =
        first_chunk[i] + (r.length + options.chunk_bytes - 1) / options.chunk_bytes;
  }
  const uint64_t total_chunks = first_chunk.back();
  if (total_chunks == 0) return Status::Ok();

  std::atomic<uint64_t> next_chunk{0};
  std::atomic<bool> stop{false};
  Mutex mu;  // guards first_error and bytes_done, and serialises progress calls
  Status first_error;
  uint64_t bytes_done = 0;

  auto worker = [&] {
    while (!stop.load(std::memory_order_relaxed)) {
      const uint64_t c = next_chunk.fetch_add(1, std::memory_order_relaxed);
      if (c >= total_chunks) return;
      const size_t i = static_cast<size_t>(
          std::upper_bound(first_chunk.begin(), first_chunk.end(), c) - first_chunk.begin() - 1);
      const ReadRequest& r = requests[i];
      const uint64_t within = (c - first_chunk[i]) * options.chunk_bytes;
      const uint64_t length = std::min(options.chunk_bytes, r.length - within);
      Status s = os::PreadExact(checkpoint.shard_fd(r.shard), checkpoint.shards()[r.shard].path,
                                r.offset + within, length, static_cast<uint8_t*>(r.dest) + within);
      MutexLock lock(mu);
      if (!s.ok()) {
        if (first_error.ok()) first_error = std::move(s);
        stop.store(true, std::memory_order_relaxed);
        return;
      }
      bytes_done += length;
      if (options.progress) options.progress(bytes_done);
    }
  };

  const uint64_t helpers =
      std::min<uint64_t>(static_cast<uint64_t>(options.threads), total_chunks) - 1;
  std::vector<std::thread> threads;
  threads.reserve(helpers);
  for (uint64_t t = 0; t < helpers; ++t) {
    try {
      threads.emplace_back(worker);
    } catch (const std::system_error&) {
      break;  // out of threads: the ones started, and this one, still finish the work
    }
  }
  worker();
  for (auto& t : threads) t.join();
  return first_error;
}

Status ReadTensor(const Checkpoint& checkpoint, const TensorInfo& tensor, void* dest,
                  const ReadOptions& options) {
  const ReadRequest request{tensor.shard, tensor.offset, tensor.nbytes, dest};
  Status s = ReadRanges(checkpoint, std::span(&request, 1), options);
  return s.Context("reading tensor " + QuoteBounded(tensor.name));
}

}  // namespace weightcache::checkpoint
