#!/usr/bin/env bash
# The test command. Installs what the tests need when it is missing, then runs every test with
# Debian's restic (on PATH) and kopia 0.22.3, the suites that exercise restic's own behaviour a
# second time with restic 0.18 (Debian trixie's package, unpacked under target/test-tools/), and
# the kopia suites once more with each other pinned kopia (built from the Go module proxy by
# scripts/install-kopia.sh, cached machine-wide).
#
#   scripts/test.sh
#
# Runs as root (the unreadable-file tests run restic as another user through setpriv); on a
# Debian machine without restic, rclone, util-linux or the S3 test server it installs them with
# apt-get (sudo when not root).
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive
started=$(date +%s)
# section <title>: prints the step's heading and remembers it; a failing run ends by naming it,
# so a log cut to its head and tail still says where it stopped.
step="setting up"
section() { step=$1; echo "== $1 =="; }
background_pids=()
finish() {
  local rc=$?
  [ ${#background_pids[@]} -eq 0 ] || kill -- "${background_pids[@]/#/-}" 2>/dev/null || true
  [ "$rc" -eq 0 ] || echo "test.sh: FAILED (status $rc) in: $step ($(($(date +%s) - started)) s into the run)" >&2
}
trap finish EXIT

command -v cargo >/dev/null || { echo "test.sh: cargo is missing (install Rust: https://rustup.rs)" >&2; exit 1; }
command -v go >/dev/null || { echo "test.sh: go is missing (Go 1.26 builds kopia from the Go module proxy)" >&2; exit 1; }

# restic: the uploader under test (Debian's, 0.14 on bookworm). rclone: `rclone serve restic`, a
# real REST repository server. util-linux: setpriv. curl, gpgv, xz-utils, debian-archive-keyring:
# fetching and verifying restic 0.18 (scripts/fetch-restic-trixie.sh).
need=()
command -v restic >/dev/null || need+=(restic)
command -v rclone >/dev/null || need+=(rclone)
command -v setpriv >/dev/null || need+=(util-linux)
# tmux: a real terminal for the kubectl-podvolume live view test (tests/plugin.rs).
command -v tmux >/dev/null || need+=(tmux)
# python3 + venv: moto's S3 server (scripts/install-moto.sh, PyPI). openssl: the tests' own CA
# and server certificate for S3 over TLS.
command -v python3 >/dev/null || need+=(python3 python3-venv)
# PyYAML: scripts/test-helm.py reads what helm and kubectl render.
python3 -c 'import yaml' 2>/dev/null || need+=(python3-yaml)
command -v openssl >/dev/null || need+=(openssl)
command -v curl >/dev/null || need+=(curl ca-certificates)
# The image recipe without a daemon (scripts/build-image.sh --oci).
command -v mmdebstrap >/dev/null || need+=(mmdebstrap)
command -v umoci >/dev/null || need+=(umoci)
command -v gpgv >/dev/null || need+=(gpgv)
command -v xz >/dev/null || need+=(xz-utils)
[ -f /usr/share/keyrings/debian-archive-keyring.gpg ] || need+=(debian-archive-keyring)
# The real node (scripts/install-node.sh, start-node.sh): runc's seccomp support (cgo), the
# workload image's busybox, ip for the node's bridge.
dpkg -s libseccomp-dev >/dev/null 2>&1 || need+=(libseccomp-dev)
command -v pkg-config >/dev/null || need+=(pkg-config)
[ -x /bin/busybox ] || need+=(busybox-static)
command -v ip >/dev/null || need+=(iproute2)
if [ ${#need[@]} -gt 0 ]; then
  section "installing: ${need[*]}"
  sudo=
  [ "$(id -u)" -eq 0 ] || sudo=sudo
  $sudo apt-get install -y "${need[@]}" || { $sudo apt-get update && $sudo apt-get install -y "${need[@]}"; }
fi
# The S3 server of the object-storage tests (moto, in a venv under target/test-tools/).
scripts/install-moto.sh
restic_new=$(scripts/fetch-restic-trixie.sh)

# The real control plane (with the node's kubelet), the node's container runtime, helm and the
# Velero servers 1.18.3 and 1.16.2 (Go builds of many minutes
# the first time on a machine, nothing after; helm after the control plane, whose client-go build
# it reuses; Velero 1.16.2 after 1.18.3, about 3 min more with Go's build cache warm): built
# in the background while the Rust build and the suites that need no API server run; pass 3 waits
# for them below. Not niced: on a cold machine these builds are the longest path of the whole run
# (niced, they took 30 min beside the Rust build and tests instead of about 15).
mkdir -p target/test-tools
tools_log=target/test-tools/real-cluster-tools.log
# In a process group of its own, so that a failing run stops the whole build, go and compilers.
setsid bash -c 'scripts/install-control-plane.sh && scripts/install-node.sh >/dev/null && scripts/install-helm.sh && scripts/install-velero.sh 1.18.3 1.16.2' \
  </dev/null >"$tools_log" 2>&1 &
tools_pid=$!
# The Azure and GCS emulators (Azurite from npm, fake-gcs-server), restic with every backend
# and Velero's Azure and GCP plugins (Go builds, a few minutes the first time): beside them.
cloud_log=target/test-tools/cloud-tools.log
setsid bash -c 'scripts/install-cloud-emulators.sh && scripts/install-restic.sh && scripts/install-velero-cloud-plugins.sh' \
  </dev/null >"$cloud_log" 2>&1 &
cloud_pid=$!
# The image's Debian root filesystem (mmdebstrap: mostly downloading), beside them.
image_log=target/test-tools/image-base.log
setsid scripts/build-image.sh --base-only target/test-tools/image-base.tar </dev/null >"$image_log" 2>&1 &
image_pid=$!
# The CSI parts (external-snapshotter, external-provisioner, the tests' driver: Go builds, about
# 5 minutes cold) once the cloud job is done, so that no more than two Go builds share the cores;
# needed only after the real node's test.
csi_log=target/test-tools/csi-tools.log
setsid bash -c 'while kill -0 "$1" 2>/dev/null; do sleep 2; done; scripts/install-csi.sh' csi "$cloud_pid" \
  </dev/null >"$csi_log" 2>&1 &
csi_pid=$!
background_pids=("$tools_pid" "$image_pid" "$cloud_pid" "$csi_pid")

# Lints (CI runs them through this script): while the tools build in the background.
section "lints: cargo clippy --workspace --all-targets -- -D warnings"
cargo clippy --workspace --all-targets -- -D warnings

# kopia: every pinned version (a few minutes each the first time on a machine, then nothing).
declare -A kopia_at=()
while read -r version path; do kopia_at[$version]=$path; done < <(scripts/install-kopia.sh)
kopia_main=0.22.3 # Velero 1.18's kopia base: the whole suite runs with it
[ -n "${kopia_at[$kopia_main]:-}" ] || { echo "test.sh: kopia $kopia_main was not installed" >&2; exit 1; }
export PODVOLUME_TEST_KOPIA=${kopia_at[$kopia_main]} PODVOLUME_TEST_KOPIA_VERSION=$kopia_main

run() { echo "+ $*"; "$@"; }
# Every cargo invocation is bounded: a hung test must fail this script with a message well
# before any outer CI limit, not use up its time. The e2e harness has its own per-test watchdog
# (PODVOLUME_E2E_TEST_TIMEOUT) that reports what was running; this catches every other suite.
bounded() {
  local limit=$1
  shift
  echo "+ $* (at most ${limit} s)"
  local rc=0
  timeout --kill-after=30 "$limit" "$@" || rc=$?
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "test.sh: '$*' did not finish within ${limit} s; stopped (a hang: see the last tests named above)" >&2
  fi
  return "$rc"
}

# Every test target but those that need an API server: the end-to-end suite, the operations API
# (opsapi), kubectl-podvolume (plugin) and the PVC -> PV lookups (volume_path) run on the real
# API server in pass 3 (their fault cases through a fault-injecting proxy).
not_e2e=(--lib --bins --test cli --test kopia_engine --test kopia_parser --test manifests
  --test restic_engine --test restic_parser --test s3_cli)

# Pass 1: every test but the end-to-end suite, restic from PATH.
section "pass 1: every test with $(restic version) ($(command -v restic)) and kopia $("$PODVOLUME_TEST_KOPIA" --version)"
bounded 2400 cargo test --no-fail-fast "${not_e2e[@]}"
bounded 600 cargo test --doc
run cargo test --test restic_engine --test cli --test s3_cli -- --show-output restic_under_test
run cargo test --test kopia_engine --test kopia_parser --test s3_cli --test cli -- --show-output kopia_under_test

# The kopia suites again with every other pinned kopia: the engine and parser whole, the CLI's
# kopia cases (the end-to-end kopia cases: scripts/test-real-cluster.sh).
for version in "${!kopia_at[@]}"; do
  [ "$version" = "$kopia_main" ] && continue
  export PODVOLUME_TEST_KOPIA=${kopia_at[$version]} PODVOLUME_TEST_KOPIA_VERSION=$version
  section "kopia pass: kopia suites with kopia $("$PODVOLUME_TEST_KOPIA" --version) ($PODVOLUME_TEST_KOPIA)"
  bounded 1200 cargo test --test kopia_engine --test kopia_parser
  bounded 600 cargo test --test s3_cli --test cli -- kopia
  run cargo test --test kopia_engine --test kopia_parser --test s3_cli --test cli -- --show-output kopia_under_test
done
export PODVOLUME_TEST_KOPIA=${kopia_at[$kopia_main]} PODVOLUME_TEST_KOPIA_VERSION=$kopia_main

# Pass 2: what depends on restic's own behaviour, with 0.18: the engine (backup, incremental,
# exit 3, wrong password, missing repository, empty source, cancel, restore, locks) and the CLI
# whole (local and S3 over TLS); its end-to-end cases run on the real API server below. The
# parser's 0.18 fixtures ran in pass 1 (they need no binary); so did the upgrade test, which
# runs both versions itself. The S3 cases of an unknown certificate run with 0.14 only: restic
# 0.18 retries a TLS failure of the backend for minutes before it gives up (seen still
# retrying after 5 minutes), too long for a test run.
section "pass 2: restic suites with $("$restic_new" version) ($restic_new)"
bounded 1200 env PODVOLUME_TEST_RESTIC="$restic_new" PODVOLUME_TEST_RESTIC_VERSION=0.18.0 cargo test --test restic_engine --test cli --test s3_cli -- --skip upgrade_014_to_018 \
  --skip without_the_ca --skip kopia
run env PODVOLUME_TEST_RESTIC="$restic_new" PODVOLUME_TEST_RESTIC_VERSION=0.18.0 cargo test --test restic_engine --test cli --test s3_cli -- --show-output restic_under_test

# Azure Blob and Google Cloud Storage through the one-shot CLI: kopia and restic (built with every
# backend) against Azurite and fake-gcs-server over TLS with a private CA.
section "cloud storage: Azure and GCS with kopia and restic (tests/cloud_cli.rs)"
if ! wait "$cloud_pid"; then
  echo "test.sh: installing the cloud emulators, restic or Velero's cloud plugins failed:" >&2
  tail -n 40 "$cloud_log" >&2
  exit 1
fi
read -r azurite_blob fake_gcs_server < <(scripts/install-cloud-emulators.sh)
read -r cloud_restic_version cloud_restic < <(scripts/install-restic.sh)
echo "azurite $("$azurite_blob" --version), fake-gcs-server $(cat "$(dirname "$fake_gcs_server")/version"), restic $cloud_restic_version ($cloud_restic)"
export PODVOLUME_AZURITE_BLOB=$azurite_blob PODVOLUME_FAKE_GCS_SERVER=$fake_gcs_server PODVOLUME_CLOUD_RESTIC=$cloud_restic
bounded 900 cargo test --test cloud_cli
for version in "${!kopia_at[@]}"; do
  [ "$version" = "$kopia_main" ] && continue
  section "cloud storage with kopia $("${kopia_at[$version]}" --version) (tests/cloud_cli.rs)"
  bounded 600 env PODVOLUME_TEST_KOPIA="${kopia_at[$version]}" PODVOLUME_TEST_KOPIA_VERSION="$version" cargo test --test cloud_cli
done

# Pass 3: the Helm chart on the real kube-apiserver (scripts/test-helm.sh), then the real
# kube-apiserver and Velero server (scripts/test-real-cluster.sh): the whole
# end-to-end suite as the agent's own ServiceAccount with each Velero's CRDs, the kopia e2e cases
# with every pinned kopia, the restic e2e cases with 0.18, the operations API, kubectl-podvolume
# and volume path tests, and the real Velero servers (1.18.3 kopia, 1.16.2 restic) driving the agent.
section "pass 3: waiting for the control plane, helm and Velero builds (log: $tools_log)"
if ! wait "$tools_pid"; then
  echo "test.sh: building the control plane, helm or Velero failed:" >&2
  tail -n 40 "$tools_log" >&2
  exit 1
fi
if ! wait "$image_pid"; then
  echo "test.sh: the image's root filesystem (scripts/build-image.sh --base-only) failed:" >&2
  tail -n 40 "$image_log" >&2
  exit 1
fi
background_pids=("$csi_pid")
grep -E 'built in|building' "$tools_log" || echo "(control plane, helm and Velero were in the tools cache)"
# The image recipe without a daemon: the OCI image assembled (the test build of the agent), its
# entrypoint, restic and kopia run inside it.
section "the image (scripts/build-image.sh --oci, no daemon)"
bounded 600 scripts/build-image.sh --oci target/test-tools/image --agent target/debug/podvolume-agent \
  --base target/test-tools/image-base.tar --check
# The image on a real node: containerd and the kubelet run it as the DaemonSet's pod (applied
# with kubectl, then installed with helm), Ready through its probes; a rollout.
section "the real node (scripts/test-node.sh)"
bounded 900 scripts/test-node.sh --image target/test-tools/image
# CSI storage with snapshots on a real node: the parts CSI snapshot data movement stands on.
section "CSI volumes and snapshots on the real node (scripts/test-csi.sh)"
if ! wait "$csi_pid"; then
  echo "test.sh: building the CSI parts (scripts/install-csi.sh) failed:" >&2
  tail -n 40 "$csi_log" >&2
  exit 1
fi
grep -E 'built in' "$csi_log" || echo "(the CSI parts were in the tools cache)"
bounded 600 scripts/test-csi.sh
# The Helm chart: lint, template, RBAC against daemonset/'s, install on a real kube-apiserver.
section "the Helm chart (scripts/test-helm.sh)"
bounded 600 scripts/test-helm.sh
kopia_others=()
for version in "${!kopia_at[@]}"; do
  [ "$version" = "$kopia_main" ] || kopia_others+=("$version=${kopia_at[$version]}")
done
section "the real kube-apiserver and Velero servers (scripts/test-real-cluster.sh)"
bounded 3600 env PODVOLUME_KOPIA_OTHERS="${kopia_others[*]}" PODVOLUME_RESTIC_NEW="$restic_new" \
  PODVOLUME_IMAGE="$PWD/target/test-tools/image" \
  scripts/test-real-cluster.sh

echo "== all tests passed with restic $(restic version | awk '{print $2}') and 0.18.0, kopia ${!kopia_at[*]}, on a real kube-apiserver, in $(($(date +%s) - started)) s =="
