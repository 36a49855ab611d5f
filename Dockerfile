# syntax=docker/dockerfile:1
# The weightcache image: the `weightcache` CLI (daemon, launcher, ls, ...) and the Python package,
# on a slim CUDA base. docs/deploy.md "Container image".
#
#   docker build -t weightcache:0.1.0 .
#   docker run --rm --runtime=nvidia --gpus all -v /run/weightcache:/run/weightcache \
#     -v /models:/models:ro weightcache:0.1.0 serve --model /models/llama-3-8b --device 0
#
# Stage 1 builds on the CUDA devel image (nvcc: `pip install .` compiles the GPU checksum kernel
# whenever nvcc is found, so `verify` and `attach --verify` work on the gpu tier). Stage 2 keeps
# only the virtual environment: the CLI links libnettle, libsystemd and libstdc++ dynamically, and
# finds the CUDA driver (libcuda.so.1) at run time, which the NVIDIA container toolkit mounts
# from the host; the base image brings no CUDA libraries the binary would use.
ARG CUDA_VERSION=13.0.0
ARG UBUNTU_VERSION=24.04

FROM nvidia/cuda:${CUDA_VERSION}-devel-ubuntu${UBUNTU_VERSION} AS build
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# The build dependencies of scripts/setup-deps.sh, as Ubuntu names them (the devel image has the
# CUDA toolkit). Versions come from the pinned base image's release, not pinned one by one.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
       cmake ninja-build g++ pkg-config nlohmann-json3-dev libcli11-dev libxxhash-dev \
       nettle-dev libsystemd-dev libucx-dev libcurl4-openssl-dev python3 python3-dev python3-venv \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# nanobind pinned to the release the committed stubs were generated with (setup-deps.sh).
RUN python3 -m venv /opt/weightcache \
    && /opt/weightcache/bin/pip install --no-cache-dir scikit-build-core==1.1.2 nanobind==3.1.0 \
    && CMAKE_ARGS="-DWEIGHTCACHE_SYSTEMD=ON" \
       /opt/weightcache/bin/pip install --no-cache-dir --no-build-isolation . \
    && /opt/weightcache/bin/weightcache --help >/dev/null

FROM nvidia/cuda:${CUDA_VERSION}-base-ubuntu${UBUNTU_VERSION} AS runtime
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 libnettle8t64 libsystemd0 libucx0 libcurl4t64 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 weightcache \
    && useradd --system --uid 10001 --gid 10001 --home-dir /run/weightcache --no-create-home \
       --shell /usr/sbin/nologin weightcache
COPY --from=build /opt/weightcache /opt/weightcache
# The venv's python is the distribution's /usr/bin/python3: the same release in both stages.
RUN /opt/weightcache/bin/weightcache --help >/dev/null \
    && /opt/weightcache/bin/python3 -c 'import weightcache'
ENV PATH=/opt/weightcache/bin:$PATH \
    WEIGHTCACHE_RUNTIME_DIR=/run/weightcache \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
# The service user, uid 10001: engines that attach name it in WEIGHTCACHE_TRUSTED_UIDS, or run
# as the same uid (deploy/examples/engine-pod.yaml).
USER 10001:10001
ENTRYPOINT ["weightcache"]
CMD ["--help"]
