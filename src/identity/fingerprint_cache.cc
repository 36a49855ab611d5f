#include "identity/fingerprint_cache.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <utility>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "checkpoint/listing.h"
#include "common/hash.h"
#include "common/unique_fd.h"
#include "identity/paths.h"
#include "os/strided_read.h"

namespace weightcache::identity {
namespace {

using checkpoint::CheckpointListing;
using checkpoint::FileIdentity;
using checkpoint::NamedFileIdentity;
using Json = nlohmann::json;

constexpr std::string_view kEntryFormat = "weightcache-fingerprint-cache-v1";
constexpr std::string_view kEntrySuffix = ".json";

// What one entry records: everything the fingerprint was computed from, and the fingerprint.
struct Entry {
  CheckpointListing listing;
  std::optional<FileIdentity> index;
  std::vector<NamedFileIdentity> shards;
  std::string fingerprint;
};

int64_t RealtimeNs() {
  struct timespec ts {};
  ::clock_gettime(CLOCK_REALTIME, &ts);
  return int64_t{ts.tv_sec} * 1'000'000'000 + ts.tv_nsec;
}

std::string EntryName(const CheckpointListing& listing) {
  char name[64];
  std::snprintf(name, sizeof(name), "%llx-%llx", static_cast<unsigned long long>(listing.dev),
                static_cast<unsigned long long>(listing.ino));
  return std::string(name) + std::string(kEntrySuffix);
}

Json IdentityJson(const FileIdentity& id) {
  return {{"dev", id.dev},
          {"ino", id.ino},
          {"size", id.size},
          {"mtime_ns", id.mtime_ns},
          {"ctime_ns", id.ctime_ns}};
}

// Strict: every field present with its type, or nullopt (the entry is then ignored).
std::optional<FileIdentity> IdentityFrom(const Json& j) {
  if (!j.is_object()) return std::nullopt;
  for (const char* key : {"dev", "ino", "size"}) {
    if (!j.contains(key) || !j[key].is_number_unsigned()) return std::nullopt;
  }
  for (const char* key : {"mtime_ns", "ctime_ns"}) {
    if (!j.contains(key) || !j[key].is_number_integer()) return std::nullopt;
  }
  FileIdentity id;
  id.dev = j["dev"].get<uint64_t>();
  id.ino = j["ino"].get<uint64_t>();
  id.size = j["size"].get<uint64_t>();
  id.mtime_ns = j["mtime_ns"].get<int64_t>();
  id.ctime_ns = j["ctime_ns"].get<int64_t>();
  return id;
}

bool IsHex64(const std::string& s) {
  return s.size() == 64 && std::all_of(s.begin(), s.end(), [](char c) {
           return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
         });
}

// "<sha256 hex of body>\n<body>", the body one JSON object.
std::string Serialize(const Entry& e) {
  Json shards = Json::array();
  for (const NamedFileIdentity& s : e.shards) {
    Json j = IdentityJson(s.identity);
    j["name"] = s.name;
    shards.push_back(std::move(j));
  }
  const Json body = {{"format", kEntryFormat},
                     {"listing",
                      {{"dev", e.listing.dev},
                       {"ino", e.listing.ino},
                       {"directory", e.listing.directory},
                       {"has_index", e.listing.has_index},
                       {"safetensors", e.listing.safetensors}}},
                     {"index", e.index ? IdentityJson(*e.index) : Json(nullptr)},
                     {"shards", std::move(shards)},
                     {"fingerprint", e.fingerprint}};
  const std::string text = body.dump(-1, ' ', /*ensure_ascii=*/true);
  return Sha256Hex(text) + "\n" + text;
}

std::optional<Entry> Parse(std::string_view bytes) {
  const size_t newline = bytes.find('\n');
  if (newline != 64) return std::nullopt;
  const std::string_view body = bytes.substr(65);
  if (Sha256Hex(body) != bytes.substr(0, 64)) return std::nullopt;
  const Json j = Json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || j.value("format", "") != kEntryFormat) return std::nullopt;
  Entry e;
  const Json& listing = j.value("listing", Json());
  if (!listing.is_object() || !listing.contains("dev") || !listing["dev"].is_number_unsigned() ||
      !listing.contains("ino") || !listing["ino"].is_number_unsigned() ||
      !listing.contains("directory") || !listing["directory"].is_boolean() ||
      !listing.contains("has_index") || !listing["has_index"].is_boolean() ||
      !listing.contains("safetensors") || !listing["safetensors"].is_array()) {
    return std::nullopt;
  }
  e.listing.dev = listing["dev"].get<uint64_t>();
  e.listing.ino = listing["ino"].get<uint64_t>();
  e.listing.directory = listing["directory"].get<bool>();
  e.listing.has_index = listing["has_index"].get<bool>();
  for (const Json& name : listing["safetensors"]) {
    if (!name.is_string()) return std::nullopt;
    e.listing.safetensors.push_back(name.get<std::string>());
  }
  if (!j.contains("index")) return std::nullopt;
  if (!j["index"].is_null()) {
    e.index = IdentityFrom(j["index"]);
    if (!e.index) return std::nullopt;
  }
  if (!j.contains("shards") || !j["shards"].is_array() || j["shards"].empty()) {
    return std::nullopt;
  }
  for (const Json& s : j["shards"]) {
    std::optional<FileIdentity> id = IdentityFrom(s);
    if (!id || !s.contains("name") || !s["name"].is_string()) return std::nullopt;
    const std::string name = s["name"].get<std::string>();
    // A shard is a plain name in the checkpoint's directory (or the checkpoint file itself).
    if (name.empty() || name.find('/') != std::string::npos || name == "." || name == "..") {
      return std::nullopt;
    }
    e.shards.push_back({name, *id});
  }
  if (!j.contains("fingerprint") || !j["fingerprint"].is_string()) return std::nullopt;
  e.fingerprint = j["fingerprint"].get<std::string>();
  if (!IsHex64(e.fingerprint)) return std::nullopt;
  return e;
}

// The entry's bytes, when the file may be trusted as ours: a regular file (never followed
// through a symlink) owned by `uid`, writable by nobody else, of a bounded size.
std::optional<std::string> ReadEntry(const std::string& path, uid_t uid) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC | O_NOCTTY));
  if (!fd.valid()) return std::nullopt;
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != uid ||
      (st.st_mode & (S_IWGRP | S_IWOTH)) != 0 || st.st_size <= 0 ||
      static_cast<uint64_t>(st.st_size) > kMaxEntryBytes) {
    return std::nullopt;
  }
  std::string bytes(static_cast<size_t>(st.st_size), '\0');
  if (!os::PreadExact(fd.get(), path, 0, bytes.size(), bytes.data()).ok()) return std::nullopt;
  return bytes;
}

std::optional<FileIdentity> StatIdentity(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return std::nullopt;
  return checkpoint::FileIdentityOf(st);
}

// The identity from a verified entry: every file still stats as recorded. The files digest
// is computed from these stats (equal to the recorded ones, by the check).
std::optional<CheckpointIdentity> Verify(const std::string& path, const CheckpointListing& listing,
                                         const Entry& e) {
  if (!(e.listing == listing)) return std::nullopt;
  if (listing.has_index != e.index.has_value()) return std::nullopt;
  if (!listing.directory && e.shards.size() != 1) return std::nullopt;
  if (e.index) {
    const std::optional<FileIdentity> now = StatIdentity(
        checkpoint::CheckpointFilePath(path, listing, std::string(checkpoint::kIndexFileName)));
    if (!now || !(*now == *e.index)) return std::nullopt;
  }
  for (const NamedFileIdentity& s : e.shards) {
    const std::optional<FileIdentity> now =
        StatIdentity(checkpoint::CheckpointFilePath(path, listing, s.name));
    if (!now || !(*now == s.identity)) return std::nullopt;
  }
  return CheckpointIdentity{e.fingerprint, checkpoint::FilesDigest(e.shards),
                            FingerprintSource::kCache};
}

bool Racy(const FileIdentity& id, int64_t listed_at_ns) {
  const int64_t limit = listed_at_ns - kRacyWindowNs;
  return id.mtime_ns >= limit || id.ctime_ns >= limit;
}

// Drops the least recently written entries beyond kMaxEntries - 1 (room for one more).
void Trim(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return;
  std::vector<std::pair<int64_t, std::string>> entries;  // (mtime ns, name)
  while (const struct dirent* ent = ::readdir(d)) {
    const std::string name = ent->d_name;
    if (name == "." || name == "..") continue;
    struct stat st {};
    if (::fstatat(::dirfd(d), ent->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
    entries.emplace_back(int64_t{st.st_mtim.tv_sec} * 1'000'000'000 + st.st_mtim.tv_nsec, name);
  }
  ::closedir(d);
  if (entries.size() < kMaxEntries) return;
  std::sort(entries.begin(), entries.end());
  for (size_t i = 0; i + kMaxEntries - 1 < entries.size(); ++i) {
    ::unlink((dir + "/" + entries[i].second).c_str());
  }
}

// Temp file + rename in the cache dir; any failure leaves no entry (and no temp file).
void Store(const std::string& dir, const std::string& name, const Entry& e) {
  const std::string text = Serialize(e);
  if (text.size() > kMaxEntryBytes) return;
  Trim(dir);
  std::string tmp = dir + "/." + name + ".XXXXXX";
  UniqueFd fd(::mkostemp(tmp.data(), O_CLOEXEC));  // mode 0600
  if (!fd.valid()) return;
  size_t written = 0;
  while (written < text.size()) {
    const ssize_t n = ::write(fd.get(), text.data() + written, text.size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    written += static_cast<size_t>(n);
  }
  fd.Reset();
  if (written != text.size() || ::rename(tmp.c_str(), (dir + "/" + name).c_str()) != 0) {
    ::unlink(tmp.c_str());
  }
}

// The cache dir, created 0700 and owner-checked inside an existing, owner-checked runtime
// dir; "" when unusable. A missing runtime dir is not created: resolving an identity (`paths`)
// creates nothing where no daemon or client has been.
std::string UsableDir(const FingerprintCacheOptions& options) {
  if (options.runtime_dir.empty()) return "";
  struct stat st {};
  if (::lstat(options.runtime_dir.c_str(), &st) != 0) return "";
  if (!EnsurePrivateDir(options.runtime_dir, options.uid).ok()) return "";
  std::string dir = FingerprintCacheDir(options.runtime_dir);
  if (!EnsurePrivateDir(dir, options.uid).ok()) return "";
  return dir;
}

// The identity a verified entry gives, or nullopt (no entry, an untrusted one, a mismatch).
std::optional<CheckpointIdentity> Lookup(const std::string& path, const std::string& dir,
                                         const std::string& name, const CheckpointListing& listing,
                                         uid_t uid) {
  std::optional<std::string> bytes = ReadEntry(dir + "/" + name, uid);
  if (!bytes) return std::nullopt;
  std::optional<Entry> entry = Parse(*bytes);
  if (!entry) return std::nullopt;
  return Verify(path, listing, *entry);
}

}  // namespace

Result<std::string> CheckpointFilesDigestOf(const std::string& path,
                                            const FingerprintCacheOptions& options) {
  const std::string dir = UsableDir(options);
  if (!dir.empty()) {
    if (Result<CheckpointListing> listing = checkpoint::ListCheckpoint(path); listing.ok()) {
      if (std::optional<CheckpointIdentity> hit =
              Lookup(path, dir, EntryName(*listing), *listing, options.uid)) {
        return hit->files_digest;
      }
    }
  }
  return checkpoint::CheckpointFilesDigest(path);
}

std::string FingerprintCacheDir(const std::string& runtime_dir) {
  std::string dir = runtime_dir;
  if (dir.empty() || dir.back() != '/') dir += '/';
  return dir + std::string(kFingerprintCacheDirName);
}

Result<CheckpointIdentity> CheckpointIdentityOf(const std::string& path,
                                                const FingerprintCacheOptions& options) {
  const int64_t listed_at = options.now_ns.value_or(RealtimeNs());
  const std::string dir = UsableDir(options);
  Result<CheckpointListing> listing = checkpoint::ListCheckpoint(path);
  std::string name;
  if (!dir.empty() && listing.ok()) {
    name = EntryName(*listing);
    if (std::optional<CheckpointIdentity> hit = Lookup(path, dir, name, *listing, options.uid)) {
      return *hit;
    }
  }
  // A miss: the headers, as every identity was computed before this cache. The index is
  // stat-ed before and after Open: equal (and not racy), it is the index Open read.
  std::optional<FileIdentity> index_before;
  if (listing.ok() && listing->has_index) {
    index_before = StatIdentity(
        checkpoint::CheckpointFilePath(path, *listing, std::string(checkpoint::kIndexFileName)));
  }
  WEIGHTCACHE_ASSIGN_OR_RETURN(checkpoint::Checkpoint ckpt, checkpoint::Checkpoint::Open(path));
  CheckpointIdentity id{ckpt.fingerprint(), ckpt.files_digest(), FingerprintSource::kComputed};
  if (name.empty() || !ckpt.CheckUnchanged().ok()) return id;
  Entry entry;
  entry.listing = *listing;
  if (listing->has_index) {
    if (!index_before || Racy(*index_before, listed_at)) return id;
    entry.index = index_before;
  }
  for (const checkpoint::ShardInfo& shard : ckpt.shards()) {
    if (Racy(shard.identity, listed_at)) return id;
    entry.shards.push_back({shard.file_name, shard.identity});
  }
  // The listing and the index once more: a file added, removed or replaced while the headers
  // were read is another checkpoint; the next call computes it afresh.
  Result<CheckpointListing> after = checkpoint::ListCheckpoint(path);
  if (!after.ok() || !(*after == entry.listing)) return id;
  if (entry.index) {
    const std::optional<FileIdentity> index_after = StatIdentity(
        checkpoint::CheckpointFilePath(path, *after, std::string(checkpoint::kIndexFileName)));
    if (!index_after || !(*index_after == *entry.index)) return id;
  }
  entry.fingerprint = id.fingerprint;
  Store(dir, name, entry);
  return id;
}

}  // namespace weightcache::identity
