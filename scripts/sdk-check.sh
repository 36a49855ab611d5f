#!/usr/bin/env bash
# The SDK end to end (docs/sdk.md), against an already built tree: install it into a temporary
# prefix, check what was installed (files, SONAME, exported symbols, self-contained headers),
# serve a checkpoint written by the `safetensors` library from the INSTALLED `weightcache
# serve` (host tier), then build and run the out-of-tree consumers of tests/sdk/ against the
# prefix: a C program with pkg-config, a C++ program with find_package (shared and static),
# and a Python ctypes smoke test of the C ABI. Each checks the tensors' bytes.
#   BUILD_DIR=build scripts/sdk-check.sh       (scripts/test.sh runs it after ctest)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-build}
work=$(mktemp -d)
prefix=$work/prefix
runtime=$work/run
daemon_pid=
cleanup() {
  if [[ -n $daemon_pid ]]; then
    kill "$daemon_pid" 2>/dev/null || true
    wait "$daemon_pid" 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT
fail() {
  echo "sdk-check: $*" >&2
  exit 1
}

echo "== sdk-check: install $build into a fresh prefix"
cmake --install "$build" --prefix "$prefix" >"$work/install.log" ||
  { cat "$work/install.log"; fail "cmake --install failed"; }
for f in include/weightcache/{c_api,client,export,identity_options,publisher,status,tier}.h \
    lib/libweightcache.so lib/libweightcache.so.1 lib/libweightcache.a \
    lib/cmake/weightcache/weightcacheConfig.cmake \
    lib/cmake/weightcache/weightcacheConfigVersion.cmake \
    lib/cmake/weightcache/weightcacheTargets.cmake lib/pkgconfig/weightcache.pc bin/weightcache; do
  [[ -e $prefix/$f ]] || fail "not installed: $f"
done
soname=$(objdump -p "$prefix/lib/libweightcache.so" | awk '$1 == "SONAME" {print $2}')
[[ $soname == libweightcache.so.1 ]] || fail "SONAME is '$soname', not libweightcache.so.1"

# Exported: the C ABI and the public C++ classes and functions, nothing of src/.
nm -DC --defined-only "$prefix/lib/libweightcache.so" | awk '{ $1 = $2 = ""; print substr($0, 3) }' \
  >"$work/exports.txt"
api='^(wc_[a-z_]+|WEIGHTCACHE_1|weightcache::(Attachment|Publisher|Status)::|weightcache::(AttachSourceName|StatusCodeName|InvalidArgument|NotFound|PermissionDenied|InvalidCheckpoint|ProtocolError|InternalError|IoError)\()'
if grep -Ev "$api" "$work/exports.txt" >"$work/extra.txt"; then
  head -n 20 "$work/extra.txt" >&2
  fail "libweightcache.so exports $(wc -l <"$work/extra.txt") symbols outside the public API"
fi
for sym in wc_attach wc_attachment_find wc_publish_begin wc_status_code_name \
    'weightcache::Attachment::Attach(' 'weightcache::Publisher::Begin(' \
    'weightcache::Status::ToString'; do
  grep -qF "$sym" "$work/exports.txt" || fail "libweightcache.so does not export $sym"
done

# Every installed header compiles on its own against the prefix (no private include).
for h in "$prefix"/include/weightcache/*.h; do
  echo "#include <weightcache/$(basename "$h")>" |
    c++ -std=c++20 -fsyntax-only -Wall -Werror -I"$prefix/include" -x c++ - ||
    fail "$(basename "$h") does not compile on its own"
done
for h in c_api.h export.h; do
  echo "#include <weightcache/$h>" | cc -std=c99 -fsyntax-only -Wall -Werror -I"$prefix/include" -x c - ||
    fail "$h does not compile as C99"
done

echo "== sdk-check: serve a checkpoint from the installed CLI (host tier)"
python3 tests/sdk/make_sdk_checkpoint.py "$work/model"
ident=(--model "$work/model" --tier host --runtime-dir "$runtime")
"$prefix/bin/weightcache" serve "${ident[@]}" >"$work/serve.log" 2>&1 &
daemon_pid=$!
socket=$("$prefix/bin/weightcache" paths "${ident[@]}" --json |
  python3 -c 'import json,sys; print(json.load(sys.stdin)["socket"])')
for _ in $(seq 300); do
  [[ -S $socket ]] && break
  kill -0 "$daemon_pid" 2>/dev/null || { cat "$work/serve.log"; fail "the daemon exited"; }
  sleep 0.1
done
[[ -S $socket ]] || { cat "$work/serve.log"; fail "no socket at $socket"; }

echo "== sdk-check: C consumer, pkg-config (shared and static)"
cp -r tests/sdk/c "$work/c"
PKG_CONFIG_PATH=$prefix/lib/pkgconfig make -s -C "$work/c" >"$work/c.log" 2>&1 ||
  { cat "$work/c.log"; fail "building the C consumer failed"; }
grep -q 'NEEDED.*libweightcache.so.1' <<<"$(readelf -d "$work/c/attach_check")" ||
  fail "the C consumer does not link libweightcache.so.1"
if grep -q 'NEEDED.*libweightcache' <<<"$(readelf -d "$work/c/attach_check_static")"; then
  fail "the static C consumer links libweightcache.so"
fi
"$work/c/attach_check" "$work/model" "$runtime"
"$work/c/attach_check_static" "$work/model" "$runtime"

echo "== sdk-check: C++ consumer, find_package (shared and static)"
if ! { cmake -S tests/sdk/cxx -B "$work/cxx" -G Ninja -DCMAKE_PREFIX_PATH="$prefix" &&
  cmake --build "$work/cxx"; } >"$work/cxx.log" 2>&1; then
  cat "$work/cxx.log"
  fail "building the C++ consumer failed"
fi
grep -q 'NEEDED.*libweightcache.so.1' <<<"$(readelf -d "$work/cxx/attach_check")" ||
  fail "the C++ consumer does not link libweightcache.so.1"
if grep -q 'NEEDED.*libweightcache' <<<"$(readelf -d "$work/cxx/attach_check_static")"; then
  fail "the static C++ consumer links libweightcache.so"
fi
"$work/cxx/attach_check" "$work/model" "$runtime"
"$work/cxx/attach_check_static" "$work/model" "$runtime"

echo "== sdk-check: Python ctypes, C ABI only"
mkdir -m 700 "$work/empty-run"
python3 tests/sdk/ctypes_smoke.py "$prefix/lib/libweightcache.so.1" "$work/model" "$runtime" \
  "$work/empty-run"

"$prefix/bin/weightcache" stop "${ident[@]}" >/dev/null
wait "$daemon_pid" || fail "the daemon exited with $? after stop"
daemon_pid=
echo "sdk-check: OK"
