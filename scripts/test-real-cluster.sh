#!/usr/bin/env bash
# The tests that run against a real Kubernetes control plane and the real Velero server; part of
# the test command (scripts/test.sh runs it last), runnable alone once the tools are built:
#
#   scripts/test-real-cluster.sh
#
# 1. Builds (once per machine, cached) kube-apiserver, kube-controller-manager, etcd, kubectl
#    (scripts/install-control-plane.sh) and Velero 1.18.3 with velero-plugin-for-aws
#    and Velero 1.16.2 (scripts/install-velero.sh), then starts the control plane in a temporary directory
#    (scripts/start-control-plane.sh), stopped and removed on exit, also on failure.
# 2. The end-to-end suite (tests/e2e) on it, the agent running as daemonset/'s ServiceAccount
#    and RBAC (tests/e2e/identity.rs), with the CRDs each Velero installs:
#      a. Velero 1.16.2's own (`velero install --crds-only`; four phases, no spec.cancel, no
#         incrementalBytes; its PodVolumeBackup/Restore CRDs differ from 1.15's only in
#         descriptions): the `velero_116` cases;
#      b. then Velero 1.18.3's own (`velero install --crds-only`, applied over the old ones as
#         Velero's upgrade instructions do): every case, the API fault cases among them (a
#         fault-injecting proxy between the agent and this server, tests/common/fault_proxy.rs);
#      c. the kopia cases again with each kopia of PODVOLUME_KOPIA_OTHERS ("<version>=<binary>
#         ..."), the restic cases with PODVOLUME_RESTIC_NEW (restic 0.18), as scripts/test.sh
#         gives them.
#    Then, on the same server, the operations API (tests/opsapi.rs: callers are ServiceAccounts
#    of the test with their own RBAC, the server's TokenReview/SubjectAccessReview answer),
#    kubectl-podvolume (tests/plugin.rs) and the PVC -> PV lookups (tests/volume_path.rs): with
#    Velero 1.18.3's CRDs, then the plugin's `_our_crds` tests and the e2e `status_subresource`
#    case with the project's CRDs
#    (daemonset/crds.yaml, status subresource) applied over them.
# 3. scripts/velero-smoke.sh: the real Velero server drives the agent (backup, restore, delete,
#    timeout, restart) on a control plane and a real node of its own, the agent running from its
#    image as the DaemonSet's pod (PODVOLUME_IMAGE: the OCI layout scripts/test.sh built, else
#    built here): Velero 1.18.3 with kopia, then Velero 1.16.2 with restic.
# 4. scripts/velero-cloud-smoke.sh: Velero with its own Azure / GCP plugin against Azurite /
#    fake-gcs-server (azure 1.18.3 kopia, gcp 1.18.3 kopia, gcp 1.16.2 restic).
# 5. scripts/velero-datamover-smoke.sh: Velero 1.18.3's --snapshot-move-data of two CSI claims
#    on the real node with CSI storage; the DataUploads moved by the agent.
#
# Environment: PODVOLUME_TEST_KOPIA (the kopia the suites run; default: install-kopia.sh 0.22.3),
# PODVOLUME_TOOLS_CACHE (the tools cache, as the install scripts).
set -euo pipefail
{
cd "$(dirname "$0")/.."
root=$(pwd)
started=$(date +%s)
say() { echo "test-real-cluster.sh: $*" >&2; }
# section <title>: prints the step's heading and remembers it for the failure message.
section() { step=$1; echo "== $1 =="; }

cp_bin=$(scripts/install-control-plane.sh)
read -r velero_version velero_dir < <(scripts/install-velero.sh 1.18.3)
read -r velero_old_version velero_old_dir < <(scripts/install-velero.sh 1.16.2)
if [ -z "${PODVOLUME_TEST_KOPIA:-}" ]; then
  read -r v PODVOLUME_TEST_KOPIA < <(scripts/install-kopia.sh 0.22.3)
  export PODVOLUME_TEST_KOPIA PODVOLUME_TEST_KOPIA_VERSION=$v
fi
# The Azure and GCS servers of the e2e cloud cases (tests/e2e/cloud_storage.rs).
if [ -z "${PODVOLUME_AZURITE_BLOB:-}" ] || [ -z "${PODVOLUME_FAKE_GCS_SERVER:-}" ]; then
  read -r PODVOLUME_AZURITE_BLOB PODVOLUME_FAKE_GCS_SERVER < <(scripts/install-cloud-emulators.sh)
  export PODVOLUME_AZURITE_BLOB PODVOLUME_FAKE_GCS_SERVER
fi

cp_dir=$(mktemp -d /tmp/podvolume-cp.XXXXXX)
cp_stopped=0
step="starting the control plane"
stop() {
  local rc=$?
  [ "$cp_stopped" = 1 ] || CONTROL_PLANE_BIN=$cp_bin scripts/start-control-plane.sh --stop "$cp_dir" >&2 || true
  if [ "$rc" -ne 0 ]; then
    if [ "$cp_stopped" != 1 ]; then
      for f in kube-apiserver etcd kube-controller-manager; do
        echo "--- last lines of $cp_dir/$f.log" >&2
        tail -n 15 "$cp_dir/$f.log" >&2 || true
      done
    fi
    # Last, so that a log cut to its head and tail still names what failed.
    say "FAILED (status $rc) in: $step"
  fi
  rm -rf "$cp_dir"
  exit "$rc"
}
trap stop EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
CONTROL_PLANE_BIN=$cp_bin scripts/start-control-plane.sh "$cp_dir" >"$cp_dir.env"
mv "$cp_dir.env" "$cp_dir/start.env"
export PODVOLUME_E2E_KUBECONFIG=$cp_dir/admin.kubeconfig
k() { "$cp_bin/kubectl" --kubeconfig "$PODVOLUME_E2E_KUBECONFIG" "$@"; }
echo "== real control plane: kube-apiserver $("$cp_bin/kube-apiserver" --version | cut -d' ' -f2)," \
  "$("$cp_bin/etcd" --version | head -n1), kube-controller-manager $("$cp_bin/kube-controller-manager" --version | cut -d' ' -f2)," \
  "server reports $(k version -o json | sed -n 's/.*"gitVersion": "\([^"]*\)".*/\1/p' | tail -n1) =="

# Velero 1.16.2's CRDs as its installer writes them (what a cluster running Velero <= 1.16 has),
# then Velero 1.18.3's over them, as Velero's upgrade instructions apply them.
"$velero_old_dir/velero" install --crds-only --dry-run -o yaml >"$cp_dir/velero-$velero_old_version-crds.yaml"
"$velero_dir/velero" install --crds-only --dry-run -o yaml >"$cp_dir/velero-$velero_version-crds.yaml"
# The copies the unit tests read (testdata/velero-crds/) are what these binaries print.
section "testdata/velero-crds/ against what Velero $velero_old_version and $velero_version print"
for v in "$velero_old_version" "$velero_version"; do
  python3 tools/velero/crds.py check "$cp_dir/velero-$v-crds.yaml" "testdata/velero-crds/v$v"
done
k apply -f "$cp_dir/velero-$velero_old_version-crds.yaml" >/dev/null
k wait --for condition=established --timeout=60s crd/podvolumebackups.velero.io crd/podvolumerestores.velero.io >/dev/null
phases=$(k get crd podvolumebackups.velero.io -o jsonpath='{.spec.versions[0].schema.openAPIV3Schema.properties.status.properties.phase.enum}')
section "e2e on the real API server with Velero $velero_old_version's CRDs (PodVolumeBackup phases $phases): the velero_116 cases"
timeout --kill-after=30 1200 cargo test --test e2e -- velero_116

k apply -f "$cp_dir/velero-$velero_version-crds.yaml" >/dev/null
k wait --for condition=established --timeout=60s crd/podvolumebackups.velero.io crd/podvolumerestores.velero.io >/dev/null
phases=$(k get crd podvolumebackups.velero.io -o jsonpath='{.spec.versions[0].schema.openAPIV3Schema.properties.status.properties.phase.enum}')
section "e2e on the real API server with Velero $velero_version's CRDs (PodVolumeBackup phases $phases)"
timeout --kill-after=30 2400 cargo test --test e2e
run_e2e_with() { echo "+ $*"; timeout --kill-after=30 1200 "$@"; }
# The same real API server for the e2e cases that depend on the uploader's own behaviour, with
# the other uploader versions scripts/test.sh gives (`<version>=<binary>` for kopia).
for kv in ${PODVOLUME_KOPIA_OTHERS:-}; do
  section "e2e kopia cases on the real API server with kopia $("${kv#*=}" --version)"
  run_e2e_with env PODVOLUME_TEST_KOPIA="${kv#*=}" PODVOLUME_TEST_KOPIA_VERSION="${kv%%=*}" \
    cargo test --test e2e -- kopia::
done
if [ -n "${PODVOLUME_RESTIC_NEW:-}" ]; then
  section "e2e restic cases on the real API server with $("$PODVOLUME_RESTIC_NEW" version)"
  run_e2e_with env PODVOLUME_TEST_RESTIC="$PODVOLUME_RESTIC_NEW" PODVOLUME_TEST_RESTIC_VERSION=0.18.0 \
    cargo test --test e2e -- backup_with_progress cancel_mid_backup deleting_a_running exit_3 \
    empty_volume restore_ incremental_backup_uses restic_under_test two_locations \
    missing_repository_is_created
fi
# The suites that need an API server but are not end to end. Velero 1.18.3's CRDs are installed
# again after the e2e cases: every test but the plugin's that need the project's CRDs.
section "operations API, kubectl-podvolume and volume paths on the real API server with Velero $velero_version's CRDs"
timeout --kill-after=30 1200 cargo test --test opsapi --test plugin --test volume_path -- --skip _our_crds
k apply -f "$root/daemonset/crds.yaml" >/dev/null
k wait --for condition=established --timeout=60s crd/podvolumebackups.velero.io crd/podvolumerestores.velero.io >/dev/null
# The CRDs were Established before this update too, so the wait above returns at once; the API
# server serves the new subresource once its CRD handler has caught up: polled, not read once.
status_served() { k get --raw /apis/velero.io/v1 | grep -c '"podvolumebackups/status"' >/dev/null; }
for ((i = 0; i < 60; i++)); do status_served && break; sleep 0.5; done
status_served || { say "daemonset/crds.yaml applied, but podvolumebackups/status is not served after 30 s"; exit 1; }
subresources=$(k get crd podvolumebackups.velero.io -o jsonpath='{.spec.versions[0].subresources}')
section "the agent (e2e) and kubectl-podvolume on the real API server with the project's CRDs (daemonset/crds.yaml, subresources $subresources)"
timeout --kill-after=30 1200 cargo test --test plugin --test e2e -- _our_crds status_subresource
CONTROL_PLANE_BIN=$cp_bin scripts/start-control-plane.sh --stop "$cp_dir" >&2
cp_stopped=1 # the smokes start control planes of their own

# The smokes run the agent's image on a real node: the image scripts/test.sh built
# (PODVOLUME_IMAGE), or one built here from the debug agent.
if [ -z "${PODVOLUME_IMAGE:-}" ]; then
  section "the agent's image for the smokes (scripts/build-image.sh --oci)"
  cargo build --quiet --bin podvolume-agent
  base=()
  [ -f target/test-tools/image-base.tar ] && base=(--base target/test-tools/image-base.tar)
  scripts/build-image.sh --oci target/test-tools/image --agent target/debug/podvolume-agent "${base[@]}"
  PODVOLUME_IMAGE=$root/target/test-tools/image
fi
export PODVOLUME_IMAGE
section "the real Velero $velero_version server as the agent's client, on a real node (scripts/velero-smoke.sh)"
scripts/velero-smoke.sh "$velero_version"
section "the real Velero $velero_old_version server (restic) as the agent's client, on a real node (scripts/velero-smoke.sh $velero_old_version)"
scripts/velero-smoke.sh "$velero_old_version"
# Velero with its own Azure and GCP plugins, against Azurite and fake-gcs-server (Azure with
# restic cannot run on Azurite: scripts/velero-cloud-smoke.sh says why).
for run in "azure $velero_version" "gcp $velero_version" "gcp $velero_old_version"; do
  section "Velero ${run#* } with its ${run%% *} plugin drives the agent against the emulator (scripts/velero-cloud-smoke.sh $run)"
  scripts/velero-cloud-smoke.sh $run
done
# CSI snapshot data movement: Velero's --snapshot-move-data with CSI claims on the real node,
# the DataUploads claimed, exposed and moved by the agent.
section "Velero $velero_version --snapshot-move-data: DataUploads moved by the agent (scripts/velero-datamover-smoke.sh)"
scripts/velero-datamover-smoke.sh "$velero_version"

echo "== real-cluster tests passed in $(($(date +%s) - started)) s =="
}
