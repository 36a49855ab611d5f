#include "checkpoint/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <exception>
#include <filesystem>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <utility>

#include "checkpoint/safetensors.h"
#include "common/hash.h"

namespace weightcache::checkpoint {
namespace {

constexpr std::string_view kFingerprintTag = "weightcache-checkpoint-fingerprint-v1";
constexpr int kMaxReadThreads = 256;
// One pread never asks for more than this (Linux caps a read at ~2 GiB anyway).
constexpr uint64_t kMaxPreadBytes = 1ull << 30;

std::string Quote(std::string_view s) {
  constexpr size_t kShown = 128;
  std::string out = "'";
  out.append(s.substr(0, kShown));
  if (s.size() > kShown) out += "...";
  return out + "'";
}

// Reads exactly `length` bytes at `offset`, resuming after EINTR and short reads. End of file
// before `length` bytes is an error naming the file and offset.
Status PreadExact(int fd, void* dest, uint64_t length, uint64_t offset, const std::string& path) {
  auto* out = static_cast<uint8_t*>(dest);
  while (length > 0) {
    const size_t want = static_cast<size_t>(std::min(length, kMaxPreadBytes));
    const ssize_t n = ::pread(fd, out, want, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return IoError("pread " + path + " at offset " + std::to_string(offset), errno);
    }
    if (n == 0) {
      return Status(StatusCode::kIo, "unexpected end of file in " + path + " at offset " +
                                         std::to_string(offset) + " (" + std::to_string(length) +
                                         " more bytes expected): the file shrank since it was "
                                         "opened");
    }
    out += n;
    offset += static_cast<uint64_t>(n);
    length -= static_cast<uint64_t>(n);
  }
  return Status::Ok();
}

Result<UniqueFd> OpenRegularFile(const std::string& path, uint64_t* size) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) return IoError("open " + path, errno);
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return IoError("fstat " + path, errno);
  if (!S_ISREG(st.st_mode)) return InvalidArgument(path + " is not a regular file");
  *size = static_cast<uint64_t>(st.st_size);
  return fd;
}

struct OpenedShard {
  ShardInfo info;
  ParsedHeader header;
  UniqueFd fd;
};

Result<OpenedShard> OpenShard(const std::string& path, const std::string& file_name) {
  OpenedShard shard;
  WEIGHTCACHE_ASSIGN_OR_RETURN(shard.fd, OpenRegularFile(path, &shard.info.file_size));
  std::vector<uint8_t> bytes(kHeaderPrefixBytes);
  const uint64_t prefix = std::min<uint64_t>(kHeaderPrefixBytes, shard.info.file_size);
  WEIGHTCACHE_RETURN_IF_ERROR(PreadExact(shard.fd.get(), bytes.data(), prefix, 0, path));
  Result<uint64_t> n = ParseHeaderLength(std::span(bytes.data(), prefix), shard.info.file_size);
  if (!n.ok()) return n.status().Context(path);
  bytes.resize(kHeaderPrefixBytes + *n);
  WEIGHTCACHE_RETURN_IF_ERROR(
      PreadExact(shard.fd.get(), bytes.data() + kHeaderPrefixBytes, *n, kHeaderPrefixBytes, path));
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
    return InvalidCheckpoint(std::string(kIndexFileName) + " maps tensor " + Quote(tensor) +
                             " to " + Quote(file) +
                             ": a shard must be a plain file name in the checkpoint directory "
                             "(no '/', '.' or '..')");
  }
  return Status::Ok();
}

// weight_map of the index: tensor name -> shard file name, duplicates refused.
Result<std::map<std::string, std::string>> ReadIndex(const std::string& index_path) {
  uint64_t size = 0;
  WEIGHTCACHE_ASSIGN_OR_RETURN(UniqueFd fd, OpenRegularFile(index_path, &size));
  if (size > kMaxIndexBytes) {
    return InvalidCheckpoint(index_path + " is " + std::to_string(size) +
                             " bytes, over the limit of " + std::to_string(kMaxIndexBytes));
  }
  std::string text(size, '\0');
  WEIGHTCACHE_RETURN_IF_ERROR(PreadExact(fd.get(), text.data(), size, 0, index_path));

  // nlohmann keeps the last of duplicate keys; the callback sees each one as it is parsed.
  std::string root_key;
  std::set<std::string> seen;
  std::string duplicate;
  auto callback = [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    if (event == nlohmann::json::parse_event_t::key && parsed.is_string()) {
      const auto& k = parsed.get_ref<const std::string&>();
      if (depth == 1) root_key = k;
      if (depth == 2 && root_key == "weight_map" && !seen.insert(k).second && duplicate.empty()) {
        duplicate = k;
      }
    }
    return true;
  };
  nlohmann::json doc;
  try {
    doc = nlohmann::json::parse(text, callback, /*allow_exceptions=*/true);
  } catch (const nlohmann::json::exception& e) {
    return InvalidCheckpoint(index_path + " is not valid JSON: " + e.what());
  }
  if (!duplicate.empty()) {
    return InvalidCheckpoint(index_path + ": weight_map lists tensor " + Quote(duplicate) +
                             " twice");
  }
  if (!doc.is_object() || !doc.contains("weight_map") || !doc["weight_map"].is_object()) {
    return InvalidCheckpoint(index_path + " has no \"weight_map\" object");
  }
  if (doc["weight_map"].empty()) return InvalidCheckpoint(index_path + ": weight_map is empty");
  std::map<std::string, std::string> weight_map;
  for (const auto& [tensor, file] : doc["weight_map"].items()) {
    if (!file.is_string()) {
      return InvalidCheckpoint(index_path + ": weight_map entry for " + Quote(tensor) +
                               " is not a string");
    }
    const auto& name = file.get_ref<const std::string&>();
    Status s = CheckShardFileName(tensor, name);
    if (!s.ok()) return s.Context(index_path);
    weight_map.emplace(tensor, name);
  }
  return weight_map;
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

}  // namespace

Result<Checkpoint> Checkpoint::Open(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return IoError("open checkpoint " + path, errno);

  // The shards to open, (path, file name), and for an indexed directory the weight_map.
  std::vector<std::pair<std::string, std::string>> files;
  std::map<std::string, std::string> weight_map;
  bool indexed = false;
  if (S_ISDIR(st.st_mode)) {
    const std::string index_path = JoinPath(path, std::string(kIndexFileName));
    struct stat index_st {};
    if (::stat(index_path.c_str(), &index_st) == 0) {
      indexed = true;
      WEIGHTCACHE_ASSIGN_OR_RETURN(weight_map, ReadIndex(index_path));
      std::set<std::string> names;
      for (const auto& [tensor, file] : weight_map) names.insert(file);
      for (const auto& name : names) files.emplace_back(JoinPath(path, name), name);
    } else {
      std::vector<std::string> found;
      std::error_code ec;
      for (std::filesystem::directory_iterator it(path, ec), end; !ec && it != end;
           it.increment(ec)) {
        const std::string name = it->path().filename().string();
        if (name.size() > 12 && name.ends_with(".safetensors")) found.push_back(name);
      }
      if (ec) return IoError("list " + path, ec.value());
      std::sort(found.begin(), found.end());
      if (found.empty()) return NotFound("no .safetensors file in " + path);
      if (found.size() > 1) {
        std::string listed;
        for (size_t i = 0; i < found.size() && i < 4; ++i) listed += (i ? ", " : "") + found[i];
        if (found.size() > 4) listed += ", ...";
        return InvalidCheckpoint(path + " holds " + std::to_string(found.size()) +
                                 " .safetensors files (" + listed + ") but no " +
                                 std::string(kIndexFileName) + " saying which form the model");
      }
      files.emplace_back(JoinPath(path, found[0]), found[0]);
    }
  } else if (S_ISREG(st.st_mode)) {
    files.emplace_back(path, BaseName(path));
  } else {
    return InvalidArgument("checkpoint " + path + " is neither a file nor a directory");
  }

  Checkpoint ckpt;
  ckpt.path_ = path;
  std::vector<ParsedHeader> headers;
  for (const auto& [file_path, file_name] : files) {
    Result<OpenedShard> shard = OpenShard(file_path, file_name);
    if (!shard.ok()) {
      if (indexed && shard.status().code() == StatusCode::kNotFound) {
        return InvalidCheckpoint("shard " + Quote(file_name) + " named by " +
                                 std::string(kIndexFileName) + " in " + path + " does not exist");
      }
      return shard.status();
    }
    ckpt.shards_.push_back(std::move(shard->info));
    ckpt.fds_.push_back(std::move(shard->fd));
    headers.push_back(std::move(shard->header));
  }

  // Cross-check shards against each other and against the index.
  std::unordered_map<std::string, uint32_t> owner;  // tensor -> shard
  for (uint32_t s = 0; s < headers.size(); ++s) {
    const std::string& file = ckpt.shards_[s].file_name;
    for (ParsedTensor& t : headers[s].tensors) {
      auto [it, inserted] = owner.emplace(t.name, s);
      if (!inserted) {
        return InvalidCheckpoint("tensor " + Quote(t.name) + " is in both shard " +
                                 Quote(ckpt.shards_[it->second].file_name) + " and shard " +
                                 Quote(file));
      }
      if (indexed) {
        auto entry = weight_map.find(t.name);
        if (entry == weight_map.end()) {
          return InvalidCheckpoint("tensor " + Quote(t.name) + " of shard " + Quote(file) +
                                   " is not listed in " + std::string(kIndexFileName));
        }
        if (entry->second != file) {
          return InvalidCheckpoint("tensor " + Quote(t.name) + " is in shard " + Quote(file) +
                                   " but " + std::string(kIndexFileName) + " maps it to " +
                                   Quote(entry->second));
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
      return InvalidCheckpoint(std::string(kIndexFileName) + " maps tensor " + Quote(tensor) +
                               " to shard " + Quote(file) + ", which does not contain it");
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
  std::mutex mu;  // guards first_error and bytes_done, and serialises progress calls
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
      Status s = PreadExact(checkpoint.shard_fd(r.shard), static_cast<uint8_t*>(r.dest) + within,
                            length, r.offset + within, checkpoint.shards()[r.shard].path);
      std::lock_guard<std::mutex> lock(mu);
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
  return s.Context("reading tensor " + Quote(tensor.name));
}

}  // namespace weightcache::checkpoint
