#!/usr/bin/env bash
# Stage the build dependencies the GPU machine lacks (it has nvcc, cmake, ninja, gcc and
# Python, but no Debian -dev packages and no network) into .deps/, which is git-ignored and
# carried to the device machine. Header-only libraries and static archives only, so nothing
# is needed there at run time; and a CUDA-enabled UCX (below).
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
# The fleet's gpu-tier fill needs a UCX with CUDA transports (Debian's has none).
#
# Preferred: UCX built here from its source, UCX_SRC=<a checkout of the v1.22.0 tag> (or a
# release tarball's tree), into .deps/ucx-cuda (6 MB stripped; ~12 minutes on 2 cores).
# cuda_ipc needs it to map another process's VMM memory: UCX 1.22 exports such memory as a
# POSIX fd and the peer takes it with pidfd_getfd, which is compiled in only where the
# build's kernel headers declare SYS_pidfd_getfd. PyPI's libucx-cu13 1.22.0 wheel lacks it
# (`strings libuct_cuda.so` has no pidfd_getfd). It is needed, not yet enough: the fill
# source's memory is still packed as no-IPC (docs/fleet.md, "Two daemons on one GPU do not
# reach cuda_ipc yet"). Building needs autoconf, automake, libtool and nvcc here; NVML's
# header comes from PyPI's nvidia-nvml-dev, and a stub libnvidia-ml passes configure's link
# check (UCX loads the driver's real one at run time).
#
# Otherwise: the wheel (UCX 1.22, 42 MB of the 64 MiB the device tool carries), unpacked by
# scripts/gpu-suite.sh on the device.
if [[ -n ${UCX_SRC:-} ]]; then
  prefix=$PWD/.deps/ucx-cuda
  cuda=${CUDA_HOME:-/usr/local/cuda}
  python3 -m pip download --quiet --no-deps --only-binary=:all: --dest "$work/nvml" \
    "nvidia-nvml-dev==13.*"
  mkdir -p "$work/nvml/include" "$work/nvml/lib"
  (cd "$work/nvml" && python3 -m zipfile -e nvidia_nvml_dev-*.whl x >/dev/null)
  cp "$(find "$work/nvml/x" -name nvml.h | head -1)" "$work/nvml/include/"
  grep -oE 'DECLDIR +nvml[A-Za-z0-9_]+ *\(' "$work/nvml/include/nvml.h" |
    sed -E 's/DECLDIR +//; s/ *\(//' | sort -u | awk '{print "void " $1 "(void) {}"}' \
    >"$work/nvml/stub.c"
  gcc -shared -fPIC -Wl,-soname,libnvidia-ml.so.1 -o "$work/nvml/lib/libnvidia-ml.so" \
    "$work/nvml/stub.c"
  build_ucx=$work/ucx
  cp -a "$UCX_SRC" "$build_ucx"
  (
    cd "$build_ucx"
    [[ -x configure ]] || ./autogen.sh >/dev/null
    CPPFLAGS="-I$work/nvml/include" LDFLAGS="-L$work/nvml/lib -L$cuda/lib64/stubs" \
      ./contrib/configure-release --prefix="$prefix" --with-cuda="$cuda" \
      --with-nvcc-gencode="-gencode=arch=compute_90,code=sm_90" --without-verbs \
      --without-rdmacm --without-knem --without-xpmem --without-ugni --without-rocm \
      --without-ze --without-java --without-go --without-gdrcopy --disable-doxygen-doc \
      --enable-mt --enable-cma --disable-static >"$work/ucx-configure.log"
    grep -q 'HAVE_DECL_SYS_PIDFD_GETFD 1' config.h ||
      { echo "UCX configure: SYS_pidfd_getfd not declared (kernel headers too old)" >&2; exit 1; }
    make -j"$(nproc)" >"$work/ucx-make.log" && make install >/dev/null
  )
  # The CUDA runtime it links (13.x, as on the device), then drop what the device never runs.
  cp -a "$cuda"/lib64/libcudart.so.13* "$prefix/lib/"
  rm -rf "$prefix/share" "$prefix/lib"/*.la "$prefix/lib/ucx"/*.la "$prefix/lib/cmake"
  find "$prefix" -type f \( -name '*.so*' -o -path '*/bin/*' \) -exec strip --strip-unneeded {} + \
    2>/dev/null || true
else
  python3 -m pip download --quiet --no-deps --only-binary=:all: --dest .deps/wheels \
    "libucx-cu13==${UCX_WHEEL_VERSION:-1.22.0}"
fi
# InstantTensor's wheel (6.5 MB, for the device's Python 3.12): the anchor that
# scripts/gpu-pagecache.sh measures serve beside (issue 39), installed there from .deps/it.
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --dest .deps/it "instanttensor==${INSTANTTENSOR_VERSION:-0.2.2}"
du -sh .deps
