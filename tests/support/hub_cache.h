// Test checkpoints laid out as the Hugging Face hub cache lays them out, so that they carry a
// content anchor (checkpoint/content_anchor.h): <hub>/models--<repo>/blobs/<sha256 of the file>
// holds each *.safetensors file, and <hub>/models--<repo>/snapshots/<rev>/<name> is a relative
// symlink to ../../blobs/<sha256>, as huggingface_hub writes them. Other files (the index,
// config.json) are copied into the snapshot as regular files.
#pragma once

#include <string>

namespace weightcache::testing {

// The SHA-256 hex of the file at `path` (read whole).
std::string FileSha256(const std::string& path);

// Moves the *.safetensors files of `checkpoint_dir` into a hub cache under `hub_root` (repo
// `repo`, revision `rev`) and copies the rest; returns the snapshot directory (the path to serve).
// `checkpoint_dir` is left without its *.safetensors files.
std::string LayOutAsHubCache(const std::string& checkpoint_dir, const std::string& hub_root,
                             const std::string& repo = "tiny",
                             const std::string& rev = "0123456789abcdef0123456789abcdef01234567");

}  // namespace weightcache::testing
