#include "checkpoint/content_anchor.h"

#include <limits.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>

#include "checkpoint/checkpoint.h"
#include "common/hash.h"
#include "common/terminal_text.h"
#include "os/read_file.h"

namespace weightcache::checkpoint {

namespace {

bool IsLowerHex64(std::string_view s) {
  return s.size() == 64 && s.find_first_not_of("0123456789abcdef") == std::string_view::npos;
}

std::string_view LastComponent(std::string_view path) {
  const size_t slash = path.rfind('/');
  return slash == std::string_view::npos ? path : path.substr(slash + 1);
}

std::string_view ParentOf(std::string_view path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string_view::npos) return ".";
  return slash == 0 ? std::string_view("/") : path.substr(0, slash);
}

// realpath(3): every symlink followed; kNotFound naming the path and why (ELOOP: a loop).
Result<std::string> RealPath(const std::string& path) {
  std::unique_ptr<char, decltype(&std::free)> real(::realpath(path.c_str(), nullptr), &std::free);
  if (real == nullptr) {
    const int err = errno;
    return NotFound(QuoteBounded(path) +
                    (err == ELOOP ? ": a symlink loop" : std::string(": ") + std::strerror(err)));
  }
  return std::string(real.get());
}

// The hub cache's record: `path` is a symlink whose final target is <repo>/blobs/<64 hex>, with
// the file's own directory inside <repo>/snapshots/.
Result<std::string> HubBlobDigest(const AnchorFile& file) {
  struct stat st {};
  if (::lstat(file.path.c_str(), &st) != 0) {
    return NotFound(QuoteBounded(file.path) + ": " + std::strerror(errno));
  }
  if (!S_ISLNK(st.st_mode)) return NotFound("not a symlink into a hub cache's blobs");
  WEIGHTCACHE_ASSIGN_OR_RETURN(const std::string blob, RealPath(file.path));
  const std::string_view name = LastComponent(blob);
  if (!IsLowerHex64(name)) {
    return NotFound("its blob " + QuoteBounded(name) +
                    " is not named by a SHA-256 (64 lowercase hex: an LFS file's)");
  }
  const std::string_view blobs = ParentOf(blob);
  if (LastComponent(blobs) != "blobs") {
    return NotFound("its target " + QuoteBounded(blob) + " is not in a hub cache's blobs/");
  }
  const std::string repo(ParentOf(blobs));
  // The link must lie in the same repository's snapshots/: a link pointing outside names
  // another repository's (or anyone's) file.
  WEIGHTCACHE_ASSIGN_OR_RETURN(const std::string dir, RealPath(std::string(ParentOf(file.path))));
  const std::string snapshots = (repo == "/" ? std::string() : repo) + "/snapshots/";
  if (dir.rfind(snapshots, 0) != 0) {
    return NotFound("its blob " + QuoteBounded(blob) + " is outside the repository of " +
                    QuoteBounded(dir) + " (no " + QuoteBounded(snapshots) + " above it)");
  }
  struct stat target {};
  if (::stat(blob.c_str(), &target) != 0 || !S_ISREG(target.st_mode)) {
    return NotFound("its blob " + QuoteBounded(blob) + " is not a regular file");
  }
  return std::string(name);
}

// The local-dir record: <dir>/.cache/huggingface/download/<name>.metadata, three lines (commit,
// etag, timestamp), believed while the file's mtime is at most the timestamp + 1 s (what
// huggingface_hub's read_download_metadata allows).
Result<std::string> LocalDirDigest(const AnchorFile& file) {
  const std::string metadata = std::string(ParentOf(file.path)) + "/.cache/huggingface/download/" +
                               file.file_name + ".metadata";
  auto text = os::ReadSmallFile(metadata, kMaxDownloadMetadataBytes);
  if (!text.ok()) {
    if (text.status().code() == StatusCode::kNotFound) return NotFound("no download metadata");
    return NotFound("its download metadata: " + text.status().message());
  }
  std::vector<std::string_view> lines;
  std::string_view rest = *text;
  while (!rest.empty() && lines.size() < 4) {
    const size_t nl = rest.find('\n');
    lines.push_back(rest.substr(0, nl));
    rest = nl == std::string_view::npos ? std::string_view() : rest.substr(nl + 1);
  }
  const auto trim = [](std::string_view s) {
    while (!s.empty() && (s.back() == '\r' || s.back() == ' ')) s.remove_suffix(1);
    while (!s.empty() && s.front() == ' ') s.remove_prefix(1);
    return s;
  };
  if (lines.size() < 3 || trim(lines[0]).empty()) {
    return NotFound("its download metadata " + QuoteBounded(metadata) +
                    " is not \"commit\\netag\\ntimestamp\"");
  }
  const std::string_view etag = trim(lines[1]);
  if (!IsLowerHex64(etag)) {
    return NotFound("its download metadata's etag " + QuoteBounded(etag) +
                    " is not a SHA-256 (64 lowercase hex: an LFS file's)");
  }
  const std::string stamp(trim(lines[2]));
  char* end = nullptr;
  errno = 0;
  const double timestamp = std::strtod(stamp.c_str(), &end);
  if (stamp.empty() || end != stamp.c_str() + stamp.size() || errno != 0 ||
      !std::isfinite(timestamp)) {
    return NotFound("its download metadata's timestamp " + QuoteBounded(stamp) +
                    " is not a number");
  }
  struct stat st {};
  if (::stat(file.path.c_str(), &st) != 0) {
    return NotFound(QuoteBounded(file.path) + ": " + std::strerror(errno));
  }
  const double mtime =
      static_cast<double>(st.st_mtim.tv_sec) + static_cast<double>(st.st_mtim.tv_nsec) * 1e-9;
  if (mtime - 1 > timestamp) {
    return NotFound("its download metadata is older than the file (modified since download)");
  }
  return std::string(etag);
}

}  // namespace

std::string_view AnchorSourceName(AnchorSource source) {
  switch (source) {
    case AnchorSource::kPinned:
      return "--fill-content-sha256";
    case AnchorSource::kHubBlob:
      return "hub cache blob name";
    case AnchorSource::kLocalDirMetadata:
      return "local-dir download metadata";
  }
  return "?";
}

std::string ContentAnchor::Text() const {
  std::string text;
  for (const ShardDigest& s : shards) text += s.sha256 + "  " + s.file_name + "\n";
  return text;
}

std::string ContentAnchor::Digest() const { return Sha256Hex(Text()); }

const ShardDigest* ContentAnchor::Find(std::string_view file_name) const {
  for (const ShardDigest& s : shards) {
    if (s.file_name == file_name) return &s;
  }
  return nullptr;
}

std::string ContentAnchor::Describe() const {
  std::vector<AnchorSource> seen;
  for (const ShardDigest& s : shards) {
    if (std::find(seen.begin(), seen.end(), s.source) == seen.end()) seen.push_back(s.source);
  }
  std::string out;
  for (const AnchorSource source : seen) {
    out += (out.empty() ? "" : " + ") + std::string(AnchorSourceName(source));
  }
  return out;
}

Result<std::vector<std::pair<std::string, std::string>>> ParseSha256Sums(std::string_view text) {
  std::map<std::string, std::string, std::less<>> digests;
  std::vector<std::pair<std::string, std::string>> out;
  size_t line_number = 0;
  while (!text.empty()) {
    ++line_number;
    const size_t nl = text.find('\n');
    std::string_view line = text.substr(0, nl);
    text = nl == std::string_view::npos ? std::string_view() : text.substr(nl + 1);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.find_first_not_of(" \t") == std::string_view::npos || line.front() == '#') continue;
    const auto bad = [&](const std::string& why) {
      return InvalidArgument("line " + std::to_string(line_number) + " (" + QuoteBounded(line) +
                             "): " + why + "; expected \"<sha256>  <file name>\"");
    };
    if (line.size() < 67 || (line[64] != ' ') || (line[65] != ' ' && line[65] != '*')) {
      return bad("not a sha256sum line");
    }
    std::string digest(line.substr(0, 64));
    std::transform(digest.begin(), digest.end(), digest.begin(),
                   [](char c) { return (c >= 'A' && c <= 'F') ? static_cast<char>(c + 32) : c; });
    if (!IsLowerHex64(digest)) return bad("the digest is not 64 hex characters");
    const std::string_view name = LastComponent(line.substr(66));
    if (name.empty()) return bad("no file name");
    const auto [it, inserted] = digests.emplace(std::string(name), digest);
    if (!inserted) {
      if (it->second != digest) return bad(QuoteBounded(name) + " is listed with two digests");
      continue;
    }
    out.emplace_back(std::string(name), std::move(digest));
  }
  return out;
}

Result<ShardDigest> RecordedDigest(const AnchorFile& file) {
  auto hub = HubBlobDigest(file);
  if (hub.ok()) return ShardDigest{file.file_name, *hub, AnchorSource::kHubBlob};
  auto local = LocalDirDigest(file);
  if (local.ok()) return ShardDigest{file.file_name, *local, AnchorSource::kLocalDirMetadata};
  return NotFound(QuoteBounded(file.file_name) + ": no SHA-256 recorded (hub cache: " +
                  hub.status().message() + "; local dir: " + local.status().message() + ")");
}

Result<ContentAnchor> FindContentAnchor(std::span<const AnchorFile> files,
                                        const std::string& pinned_file) {
  ContentAnchor anchor;
  if (!pinned_file.empty()) {
    auto text = os::ReadSmallFile(pinned_file, kMaxPinnedSumsBytes);
    if (!text.ok()) {
      return InvalidArgument("--fill-content-sha256 " + pinned_file + ": " +
                             text.status().message());
    }
    auto sums = ParseSha256Sums(*text);
    if (!sums.ok()) {
      return InvalidArgument("--fill-content-sha256 " + pinned_file + ": " +
                             sums.status().message());
    }
    for (const AnchorFile& file : files) {
      const auto it = std::find_if(sums->begin(), sums->end(),
                                   [&](const auto& s) { return s.first == file.file_name; });
      if (it == sums->end()) {
        return InvalidArgument("--fill-content-sha256 " + pinned_file + " has no line for shard " +
                               QuoteBounded(file.file_name));
      }
      anchor.shards.push_back({file.file_name, it->second, AnchorSource::kPinned});
    }
  } else {
    for (const AnchorFile& file : files) {
      WEIGHTCACHE_ASSIGN_OR_RETURN(ShardDigest digest, RecordedDigest(file));
      anchor.shards.push_back(std::move(digest));
    }
  }
  std::sort(anchor.shards.begin(), anchor.shards.end(),
            [](const ShardDigest& a, const ShardDigest& b) { return a.file_name < b.file_name; });
  if (anchor.shards.empty()) return NotFound("the checkpoint has no shard file");
  return anchor;
}

Result<ContentAnchor> FindContentAnchor(const std::string& checkpoint_path,
                                        const std::string& pinned_file) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(auto listed, CheckpointShardFiles(checkpoint_path));
  std::vector<AnchorFile> files;
  files.reserve(listed.size());
  for (auto& [path, name] : listed) files.push_back({std::move(name), std::move(path)});
  return FindContentAnchor(files, pinned_file);
}

}  // namespace weightcache::checkpoint
