#include "support/hub_cache.h"

#include <filesystem>
#include <fstream>
#include <vector>

#include "common/hash.h"

namespace weightcache::testing {

std::string FileSha256(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  Sha256 sha;
  std::vector<char> buffer(1 << 20);
  while (in) {
    in.read(buffer.data(), static_cast<std::streamsize>(buffer.size()));
    sha.Update(buffer.data(), static_cast<size_t>(in.gcount()));
  }
  return sha.FinalHex();
}

std::string LayOutAsHubCache(const std::string& checkpoint_dir, const std::string& hub_root,
                             const std::string& repo, const std::string& rev) {
  namespace fs = std::filesystem;
  const fs::path root = fs::path(hub_root) / ("models--" + repo);
  const fs::path blobs = root / "blobs";
  const fs::path snapshot = root / "snapshots" / rev;
  fs::create_directories(blobs);
  fs::create_directories(snapshot);
  for (const auto& entry : fs::directory_iterator(checkpoint_dir)) {
    const fs::path name = entry.path().filename();
    if (entry.path().extension() == ".safetensors") {
      const std::string sha = FileSha256(entry.path().string());
      fs::rename(entry.path(), blobs / sha);
      fs::create_symlink(fs::path("../../blobs") / sha, snapshot / name);
    } else if (entry.is_regular_file()) {
      fs::copy_file(entry.path(), snapshot / name);
    }
  }
  return snapshot.string();
}

}  // namespace weightcache::testing
