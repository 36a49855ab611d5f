#!/usr/bin/env bash
# The include graph between modules (issue 11 §6): every `#include "<area>/..."` in src/,
# tools/ and python/src must point down (or within its own area) in this order:
#
#   common → os → cuda → checkpoint → sharding → identity → protocol → keeper → fleet
#          → daemon | client → launcher → serve → tools | python
#
# serve (the composition root of `weightcache serve`, docs/design.md "Target layout") puts the
# daemon, the client's discovery and the launcher's child processes together for one serving
# process; the CLI parses flags into it.
#
# fleet (the cross-node registry and transport, docs/fleet.md) sits under the daemon, which
# registers its caches and fills from other nodes through it.
#
# keeper (the process that holds a cache's fds past its daemon, docs/keeper.md) has no CUDA
# and no checkpoint code: it may include only common, os and protocol, whatever its rank.
#
# tools (the CLI) may include everything below it but cuda: it reaches the driver only through
# the library's functions (src/cuda/ is the one CUDA seam; docs/design.md "Target layout").
#
# daemon and client are siblings (neither includes the other), and so are tools and python.
# The Python extension is a client like any engine: it includes the public API only
# ("weightcache/...", include/; CMake gives it no other include dir, weightcache::client).
# Public headers may be included from anywhere; includes
# without an area prefix (a tool's own "cli_common.h") are the file's own area's.
# Exit 1, listing every upward edge as file:line: from → to, when there is one.
set -euo pipefail
cd "$(dirname "$0")/.."

declare -A rank=([common]=0 [os]=1 [cuda]=2 [checkpoint]=3 [sharding]=4 [identity]=5
                 [protocol]=6 [keeper]=7 [fleet]=8 [daemon]=9 [client]=9 [launcher]=10
                 [serve]=11 [tools]=12 [python]=12)
# Modules restricted to a list of modules below them (beyond the rank order).
declare -A only=([keeper]="common os protocol")
# Modules barred from a module below them (beyond the rank order).
declare -A never=([tools]="cuda")

area_of() {  # the module a source file belongs to
  case $1 in
    src/*) local rest=${1#src/}; echo "${rest%%/*}" ;;
    tools/*) echo tools ;;
    python/*) echo python ;;
  esac
}

bad=0
while IFS=: read -r file line text; do
  from=$(area_of "$file")
  to=$(sed -E 's/^[[:space:]]*#[[:space:]]*include[[:space:]]+"([A-Za-z0-9_]+)\/.*/\1/' <<<"$text")
  [[ $to == weightcache ]] && continue
  if [[ $from == python ]]; then
    echo "check-includes: $file:$line: the Python extension includes a module header" \
         "(public API only, include/weightcache/): $text" >&2
    bad=1; continue
  fi
  if [[ -z ${rank[$from]+x} ]]; then
    echo "check-includes: $file is in no known module ($from)" >&2; bad=1; continue
  fi
  if [[ -z ${rank[$to]+x} ]]; then
    echo "check-includes: $file:$line includes \"$to/...\", which is no module" >&2; bad=1
    continue
  fi
  [[ $to == "$from" ]] && continue
  if [[ -n ${only[$from]+x} && " ${only[$from]} " != *" $to "* ]]; then
    echo "check-includes: $file:$line: $from may include only ${only[$from]}: $text" >&2
    bad=1; continue
  fi
  if [[ -n ${never[$from]+x} && " ${never[$from]} " == *" $to "* ]]; then
    echo "check-includes: $file:$line: $from may not include $to: $text" >&2
    bad=1; continue
  fi
  if (( rank[$to] >= rank[$from] )); then
    echo "check-includes: $file:$line: $from → $to is an upward (or sibling) edge: $text" >&2
    bad=1
  fi
done < <(grep -rnE '^[[:space:]]*#[[:space:]]*include[[:space:]]+"[A-Za-z0-9_]+/' \
           --include='*.h' --include='*.cc' --include='*.cu' --include='*.cuh' \
           src tools python/src)

if (( bad )); then
  echo "check-includes: the include graph has upward or barred edges (order: common → os →" \
       "cuda → checkpoint → sharding → identity → protocol → keeper → fleet → daemon|client →" \
       "launcher → serve → tools|python; keeper: common, os, protocol only; tools: not cuda)" >&2
  exit 1
fi
echo "check-includes: ok"
