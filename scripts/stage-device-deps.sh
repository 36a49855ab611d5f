#!/usr/bin/env bash
# Stage the build dependencies the GPU machine lacks (it has nvcc, cmake, ninja, gcc and
# Python, but no Debian -dev packages and no network) into .deps/, which is git-ignored and
# carried to the device machine. Header-only libraries and static archives only, so nothing
# is needed there at run time; and one wheel, CUDA-enabled UCX (below).
set -euo pipefail
cd "$(dirname "$0")/.."
pkgs=(nlohmann-json3-dev libcli11-dev libxxhash-dev nettle-dev libgtest-dev libgmock-dev liburing-dev)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && apt-get download "${pkgs[@]}" >/dev/null)
rm -rf .deps && mkdir -p .deps
for deb in "$work"/*.deb; do dpkg-deb -x "$deb" .deps; done
# Keep what the build needs: headers, static archives, CMake package files.
rm -rf .deps/usr/share/doc .deps/usr/share/man .deps/usr/lib/x86_64-linux-gnu/*.so*
# The fleet's gpu-tier fill needs a UCX with CUDA transports (Debian's has none): PyPI's
# libucx-cu13 wheel (UCX 1.22, cuda_copy/cuda_ipc, headers and pkg-config files), unpacked by
# scripts/gpu-suite.sh on the device. 43 MB of the 64 MiB the device tool carries.
python3 -m pip download --quiet --no-deps --only-binary=:all: --dest .deps/wheels \
  "libucx-cu13==${UCX_WHEEL_VERSION:-1.22.0}"
du -sh .deps
