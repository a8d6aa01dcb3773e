#!/usr/bin/env bash
# Smoke test of the node agent with the real Velero server as its client: Velero asks,
# podvolume-agent does the work, and the results are checked from the API server, the repository
# and the restored files. Two Velero versions, each with the uploader its users run:
#
#   scripts/velero-smoke.sh            # Velero 1.18.3, kopia (1.17+ back up pod volumes with kopia only)
#   scripts/velero-smoke.sh 1.16.2     # Velero 1.16.2 with --uploader-type=restic, its own CRDs
#                                      # (four phases, no spec.cancel, no incrementalBytes)
#
# What it starts (all stopped on exit by a trap, process groups included; needs root):
#   - etcd + kube-apiserver + kube-controller-manager + kube-scheduler
#     (scripts/start-control-plane.sh) and a real node, smoke-node (scripts/start-node.sh:
#     containerd, runc and the kubelet, pods on a bridge of their own, the apiserver at the
#     `kubernetes` Service address 10.96.0.1:443); the images it runs are imported, not pulled:
#     the agent's (scripts/build-image.sh --oci, or PODVOLUME_IMAGE), Velero's own as far as a
#     node needs it (velero and velero-restore-helper of this version, under the name the velero
#     Deployment gives, docker.io/velero/velero:v<version>), and a busybox workload image;
#   - moto's S3 server behind TLS with a CA made here (openssl), on the node's address 10.244.0.1
#     (reachable from the agent's pod and from the host), an IAM user that may use the bucket
#     velero-bsl only (tests/s3/moto_setup.py);
#   - `velero install` (the real CLI, no node agent) against that API server; its Deployment is
#     scaled to 0, the server runs as a host process (its plugin image is not on the node); then
#     the agent's manifests exactly as README says for a cluster with Velero: `kubectl apply -k
#     daemonset/ -l app.kubernetes.io/name=podvolume-agent`. The DaemonSet's pod runs on the node
#     from the image, as ServiceAccount node-agent, Ready through its own probe (Velero creates a
#     PodVolumeBackup only when a Running pod labelled role=node-agent is on the pod's node);
#   - `velero server` as a host process with the Deployment's arguments (server --features=
#     --uploader-type=kopia|restic), as ServiceAccount velero (a TokenRequest token); for 1.16 the
#     server runs restic itself (PATH's) to initialise the repository and to forget snapshots.
#   The workload pods really run: the kubelet makes their emptyDir volumes under
#   /var/lib/kubelet/pods/<uid>/volumes/kubernetes.io~empty-dir/, bind-mounts case 8's local
#   PersistentVolume at kubernetes.io~local-volume/<pv>, and runs the restore-wait init container
#   Velero adds to restored pods (Velero's own velero-restore-helper, waiting for
#   .velero/<restore UID> in each volume).
#
# Cases, each timed:
#   1. backup: namespace smoke-app, two pods, three emptyDir volumes of random data annotated
#      backup.velero.io/backup-volumes; `velero backup create b1 --include-namespaces smoke-app
#      --wait` -> Completed; every PodVolumeBackup Completed by the agent (status written by field
#      manager podvolume-agent, snapshotID, bytesDone == totalBytes == bytes written); the kopia
#      manifests in <bucket>/backups/kopia/smoke-app/ as Velero's identity (default@default), or
#      the restic snapshots in the PVBs' repoIdentifier <s3Url>/<bucket>/backups/restic/smoke-app
#      (host velero, the PVB's tags); a status field the served CRD lacks is absent.
#   2. restore: `velero restore create r1 --from-backup b1 --namespace-mappings
#      smoke-app:smoke-app-restored --wait` -> Completed; restore-wait init container; every
#      PodVolumeRestore Completed by the agent; the done files seen by the helper; the restored
#      trees identical (sha256, modes, mtimes).
#   3. delete: `velero backup delete b1 --confirm` -> the Backup gone, its snapshots gone from
#      the repository (kopia manifests deleted; restic snapshots forgotten by the server).
#   8. (run after 3) incremental: a claim bound to a local PersistentVolume, its volume at
#      kubernetes.io~local-volume/<pv> (a bind mount by the kubelet); two backups with a file added between: both PVBs labelled
#      velero.io/pvc-uid by Velero and Completed with exact bytes; the second incremental from the
#      first (restic: the agent chose the first's snapshot as --parent, as its log says, and
#      restic recorded it; kopia: incrementalBytes is the added file only).
#   4. timeout: a Backup with the annotation velero.io/pod-volume-timeout of a volume the
#      uploader takes long over (a sparse file) -> the Backup ends PartiallyFailed. 1.18 (20 s,
#      64 GiB): Velero sets spec.cancel on the running PodVolumeBackup ("Cancel PVB on pod
#      volume timeout"), the agent stops kopia: the PVB ends Canceled with no snapshot. 1.16
#      (10 s, 12 GiB): Velero has no cancel and leaves the PVB alone; the agent sees the Backup
#      ended and stops restic: Failed, naming the Backup's phase, no snapshot. Either way no
#      uploader is left, our finalizer is gone, and the delay after Velero's decision is shown.
#   5. server restart: the same kind of backup, and `velero server` stopped and started again
#      mid-transfer -> the Backup Failed; 1.18 at its start sets spec.cancel on the PVB ("during
#      the velero server starting, mark it as cancel"), 1.16 does not: the same checks as 4.
#   6. (1.18 only) interchangeable snapshots: Velero 1.18's own kopia data path (`velero pod-volume restore`,
#      the command of its node agent's data-mover pod, run as a host process by
#      tools/velero-smoke/velero-data-path.sh) restores a snapshot our agent made in case 1;
#      `velero pod-volume backup` snapshots the same volume and our agent restores that one:
#      both byte for byte, modes and mtimes, done files; both snapshots under one kopia source.
#   7. (1.18 only) Velero's own node agent (`velero node-agent server`, host process) started on the node
#      while our agent backs up: it sets spec.cancel on our running PodVolumeBackup, ours stops
#      kopia and ends it Canceled; what a PodVolumeBackup created with both running gets is
#      printed (a race: not asserted). velero server is stopped first (both bind :8080).
#   9. the agent's pod replaced mid-backup, by `kubectl delete pod` and by a DaemonSet rollout to
#      a new image tag (tools/velero-smoke/node-faults.sh): the old pod's uploader gone, the new
#      pod starts the PodVolumeBackup again (attempts 2) -> Completed with its snapshot, or Failed
#      with the cause; no uploader, finalizer or restic lock left.
#  10. a Backup deleted mid-transfer with kubectl: the PodVolumeBackup stopped and gone; then
#      every snapshot in the slow volume's repository belongs to a PodVolumeBackup of a Backup
#      that exists (kopia's incomplete ones included): nothing pinned outside a Backup.
#  11. a Restore deleted mid-transfer with kubectl (restoring case 9's backup into a new
#      namespace): the agent stops the uploader; the PodVolumeRestore ends Canceled/Failed saying
#      why, or is collected with its owner; no uploader left.
#   (Velero refuses to delete a backup that is still in progress -- its DeleteBackupRequest ends
#   with "backup is still in progress" -- so a deletion mid-transfer never reaches the agent
#   through Velero; deleting a PodVolumeBackup itself is tests/e2e's deleting_a_running_backup.)
#
# Prints PASS/FAIL per check with the figures, the time per step, and exits 1 if any check failed
# (the work directory, with every log, is then kept and named).
#
# Measured warm (tools built, 2 cores, alone): 1.18.3 199 s, 1.16.2 167 s; each starts the
# control plane and the node in 21-23 s, backs up in 12-15 s (Velero polls each pod's
# PodVolumeBackups every 5 s), restores in 8-12 s, spends about 15 s on case 8, 16-22 s on case
# 4, 17 s (restic) or 32 s (kopia) on each half of case 9 (the backup runs twice).
#
# Environment:
#   VELERO_SMOKE_DIR      work directory (default: a new /tmp/velero-smoke.XXXXXX)
#   VELERO_SMOKE_KEEP=1   keep the work directory after a successful run too
#   VELERO_SMOKE_TIMEOUT  seconds allowed for each wait (default 300)
#   PODVOLUME_IMAGE       the agent's OCI image layout (default: scripts/build-image.sh --oci of
#                         `cargo build`'s target/debug/podvolume-agent)
#
# Needs: Go (first run only, to build the tools), cargo, python3, openssl, curl. Port 8080 must be
# free: velero server's controller-runtime metrics server binds :8080 (no flag to move it).
set -euo pipefail

# Read whole before running (a checkout that changes this file meanwhile cannot derail it).
{
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
tools=$root/tools/velero-smoke
VELERO_VERSION=${1:-1.18.3}
VELERO_VERSION=${VELERO_VERSION#v}
# The uploader each Velero's file-system backups use: 1.17+ kopia only; 1.16 restic when the
# server runs with --uploader-type=restic (what its users of the restic path run).
case $VELERO_VERSION in
  1.18.*) UPLOADER=kopia ;;
  1.16.*) UPLOADER=restic ;;
  *) echo "velero-smoke.sh: Velero $VELERO_VERSION is not one this script knows (1.18.3, 1.16.2)" >&2; exit 2 ;;
esac
# scripts/install-velero.sh builds velero-plugin-for-aws v1.14.3 for both (it says why).
AWS_PLUGIN_IMAGE=velero/velero-plugin-for-aws:v1.14.3
KOPIA_VERSION=0.22.3
NODE=smoke-node
VNS=velero
APP=smoke-app
APP2=smoke-app-restored
BUCKET=velero-bsl
PREFIX=backups
TIMEOUT=${VELERO_SMOKE_TIMEOUT:-300}

# Nothing of the caller's environment may point the tools elsewhere.
unset AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY AWS_SESSION_TOKEN AWS_PROFILE AWS_DEFAULT_PROFILE \
  AWS_SHARED_CREDENTIALS_FILE AWS_CONFIG_FILE AWS_CA_BUNDLE AWS_REGION AWS_DEFAULT_REGION \
  KUBECONFIG VELERO_NAMESPACE NODE_NAME KOPIA_PASSWORD KOPIA_CONFIG_PATH KOPIA_CACHE_DIRECTORY \
  KOPIA_LOG_DIR RESTIC_REPOSITORY RESTIC_PASSWORD_FILE

# The report, process groups and cleanup, polling: tools/velero-smoke/lib.sh.
source "$tools/lib.sh"
# Cases 6 and 7 (Velero 1.18, kopia): functions in tools/velero-smoke/kopia-cases.sh.
source "$tools/kopia-cases.sh"
source "$tools/node-faults.sh"

W=${VELERO_SMOKE_DIR:-}
if [ -z "$W" ]; then W=$(mktemp -d /tmp/velero-smoke.XXXXXX); else mkdir -p "$W"; W=$(cd "$W" && pwd); fi

trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM


say "work directory: $W"

# --- tools -----------------------------------------------------------------------------------------
step_begin "tools (install scripts, cached; cargo build)"
for t in python3 openssl curl base64 setsid ip; do command -v "$t" >/dev/null || die "$t is missing"; done
[ "$(id -u)" -eq 0 ] || die "needs root: it runs a real node (containerd, runc, the kubelet)"
cp_bin=$("$root/scripts/install-control-plane.sh") || die "scripts/install-control-plane.sh failed"
node_bin=$("$root/scripts/install-node.sh") || die "scripts/install-node.sh failed"
read -r v vdir < <("$root/scripts/install-velero.sh" "$VELERO_VERSION") || die "scripts/install-velero.sh failed"
[ "$v" = "$VELERO_VERSION" ] && [ -x "$vdir/velero" ] && [ -x "$vdir/plugins/velero-plugin-for-aws" ] && [ -x "$vdir/velero-restore-helper" ] \
  || die "scripts/install-velero.sh $VELERO_VERSION printed '$v $vdir' without velero, velero-restore-helper and plugins/velero-plugin-for-aws"
velero=$vdir/velero
if [ "$UPLOADER" = kopia ]; then
  read -r v kopia < <("$root/scripts/install-kopia.sh" "$KOPIA_VERSION") || die "scripts/install-kopia.sh failed"
  [ -x "$kopia" ] || die "scripts/install-kopia.sh printed no kopia binary"
  uploader_bin=$kopia uploader_version=$("$kopia" --version | head -n1 | cut -d' ' -f1)
else
  # The restic of PATH (Debian's; scripts/test.sh installs it): the agent runs it for the
  # transfers, and Velero 1.16's server itself for `restic init` and `restic forget`.
  restic=$(command -v restic) || die "restic is missing (Velero $VELERO_VERSION's server and the agent run it)"
  uploader_bin=$restic uploader_version=$("$restic" version | cut -d' ' -f2)
fi
moto=${PODVOLUME_MOTO_SERVER:-$root/target/test-tools/moto/bin/moto_server}
[ -x "$moto" ] || "$root/scripts/install-moto.sh" >&2 || die "scripts/install-moto.sh failed"
moto_py=$(dirname "$moto")/python
# The agent's image (scripts/build-image.sh --oci), as the DaemonSet runs it on the node.
if [ -n "${PODVOLUME_IMAGE:-}" ]; then
  agent_image=$PODVOLUME_IMAGE
else
  (cd "$root" && cargo build --quiet --bin podvolume-agent) || die "cargo build failed"
  agent_image=$W/image
  base=()
  [ -f "$root/target/test-tools/image-base.tar" ] && base=(--base "$root/target/test-tools/image-base.tar")
  "$root/scripts/build-image.sh" --oci "$agent_image" --agent "$root/target/debug/podvolume-agent" "${base[@]}" \
    >"$W/build-image.log" 2>&1 || die "scripts/build-image.sh --oci failed: $(tail -n 20 "$W/build-image.log")"
fi
[ -f "$agent_image/index.json" ] || die "no OCI image layout at $agent_image"
kubectl=$cp_bin/kubectl
echo "  velero $("$velero" version --client-only 2>/dev/null | awk '/Version:/ { print $2; exit }'), $UPLOADER $uploader_version,"\
  "kube-apiserver $("$cp_bin/kube-apiserver" --version | cut -d' ' -f2), agent image $agent_image"
step_end

# --- control plane + node --------------------------------------------------------------------------
step_begin "control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler) + the real node $NODE"
cp_started=1
# The apiserver also at the `kubernetes` Service address the node's pods are given (10.96.0.1:443,
# on the node's bridge: there is no kube-proxy); scripts/start-node.sh says why.
KUBE_SCHEDULER=1 APISERVER_PORT=443 APISERVER_BIND_ADDRESS=0.0.0.0 CONTROL_PLANE_BIN=$cp_bin \
  "$root/scripts/start-control-plane.sh" "$W/cp" >"$W/cp.env" 2>"$W/control-plane.log" \
  || { cp_started=0; die "scripts/start-control-plane.sh failed: $(tail -n 30 "$W/control-plane.log")"; }
apiserver=$(sed -n 's/^APISERVER_URL=//p' "$W/cp.env")
admin_kc=$W/cp/admin.kubeconfig
k() { "$kubectl" --kubeconfig "$admin_kc" "$@"; }
node_started=1
NODE_NAME=$NODE NODE_BIN=$node_bin CONTROL_PLANE_BIN=$cp_bin "$root/scripts/start-node.sh" "$W/cp" "$W/node" \
  >"$W/node.env" 2>"$W/node.log" || { node_started=0; die "scripts/start-node.sh failed: $(tail -n 30 "$W/node.log")"; }
node_ip=$(sed -n 's/^NODE_IP=//p' "$W/node.env")
# Images the node runs: the agent's; Velero's own image as far as a node needs it (the restore
# helper init container Velero adds to restored pods, and the velero binary), under the name
# the velero Deployment gives (Velero 1.18 takes the helper's image from it); a small workload.
agent_ref=$(sed -n 's/^ *image: *//p' "$root/daemonset/daemonset.yaml")
"$root/scripts/start-node.sh" --import "$W/node" "$agent_ref" "$agent_image:latest" 2>>"$W/node.log" \
  || die "importing the agent's image failed: $(tail -n 5 "$W/node.log")"
velero_image=docker.io/velero/velero:v$VELERO_VERSION
"$root/scripts/start-node.sh" --make-image "$W/node" "$velero_image" /velero \
  "/velero=$velero" "/velero-restore-helper=$vdir/velero-restore-helper" 2>>"$W/node.log" \
  || die "making $velero_image failed: $(tail -n 5 "$W/node.log")"
WORKLOAD_IMAGE=podvolume.test/busybox:1
echo "  $apiserver; Node $NODE Ready: $(k get node "$NODE" -o jsonpath='kubelet {.status.nodeInfo.kubeletVersion}, {.status.nodeInfo.containerRuntimeVersion}, InternalIP {.status.addresses[0].address}')"
echo "  images on the node: $agent_ref, $velero_image (velero, velero-restore-helper), $WORKLOAD_IMAGE"
step_end

# --- S3 ------------------------------------------------------------------------------------------
step_begin "S3 server (moto, TLS with a private CA) + IAM user + bucket"
mkdir -p "$W/s3"
(
  cd "$W/s3"
  openssl req -x509 -newkey rsa:2048 -nodes -days 2 -keyout ca.key -out ca.pem -subj "/CN=velero-smoke CA" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
  openssl req -newkey rsa:2048 -nodes -keyout server.key -out server.csr -subj "/CN=$node_ip" 2>/dev/null
  printf 'subjectAltName=IP:%s,DNS:localhost\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n' "$node_ip" >server.ext
  openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 -out server.pem \
    -extfile server.ext 2>/dev/null
) || die "openssl could not make the S3 server's certificates"
s3_port=$(free_port)
# On the node's address: the agent's pod reaches it there, and so do the host's processes.
s3_url=https://$node_ip:$s3_port
# Requests before signatures are enforced: those of moto_setup.py (3 per user + 1 per bucket).
start_group moto 10 "$W/s3/moto.log" env INITIAL_NO_AUTH_ACTION_COUNT=4 \
  "$moto" -H "$node_ip" -p "$s3_port" -c "$W/s3/server.pem" -k "$W/s3/server.key"
s3_listening() { (exec 3<>"/dev/tcp/$node_ip/$s3_port") 2>/dev/null; }
wait_until 60 "moto listening on $s3_port" s3_listening
keys=$("$moto_py" "$root/tests/s3/moto_setup.py" "$s3_url" "$W/s3/ca.pem" "[{\"user\": \"velero\", \"buckets\": [\"$BUCKET\"]}]") \
  || die "moto set-up failed: $(tail -n 20 "$W/s3/moto.log")"
(umask 077; python3 -c 'import json,sys; k = json.loads(sys.argv[1])["velero"]
print("[default]\naws_access_key_id = %s\naws_secret_access_key = %s" % (k["accessKeyId"], k["secretAccessKey"]))' "$keys" >"$W/cloud")
# Where Velero keeps each namespace's repository: kopia under <prefix>/kopia/<ns>/ (no
# repoIdentifier in the PVB), restic under <prefix>/restic/<ns>, named in the PVB's repoIdentifier.
restic_repo_of() { echo "s3:$s3_url/$BUCKET/$PREFIX/restic/$1"; }
repo_identifier=
if [ "$UPLOADER" = restic ]; then repo_identifier=$(restic_repo_of "$APP"); fi
bucket() { "$moto_py" "$tools/bucket.py" "$s3_url" "$W/s3/ca.pem" "$W/cloud" "$BUCKET" "$@"; }
echo "  $s3_url, bucket $BUCKET, IAM user velero (may use that bucket only)"
step_end

# --- Velero and the agent's manifests ------------------------------------------------------------------
step_begin "velero install (no node agent) + kubectl apply -k daemonset/"
mkdir -p "$W/home"
vel_cmd=(env HOME="$W/home" "$velero" --kubeconfig "$admin_kc" --namespace "$VNS")
vel() { "${vel_cmd[@]}" "$@"; }
vel install --provider aws --plugins "$AWS_PLUGIN_IMAGE" --bucket "$BUCKET" --prefix "$PREFIX" \
  --secret-file "$W/cloud" --cacert "$W/s3/ca.pem" \
  --backup-location-config "region=us-east-1,s3Url=$s3_url,s3ForcePathStyle=true" \
  --use-volume-snapshots=false --uploader-type "$UPLOADER" >"$W/velero-install.log" 2>&1 \
  || die "velero install failed: $(tail -n 20 "$W/velero-install.log")"
echo "  $(grep -c 'attempting to create resource' "$W/velero-install.log" || true) resources created by velero install"
k apply -k "$root/daemonset/" -l app.kubernetes.io/name=podvolume-agent >"$W/daemonset-apply.log" 2>&1 \
  || die "kubectl apply -k daemonset/ failed: $(cat "$W/daemonset-apply.log")"
sed 's/^/  /' "$W/daemonset-apply.log"
# The DaemonSet's pod, made by the DaemonSet controller, bound by kube-scheduler, run by the
# kubelet from the agent's image: Ready through its own readiness probe.
wait_until 180 "the Ready pod of DaemonSet node-agent on $NODE" ds_pod_ready
ds_pod=$(k -n "$VNS" get pods -l name=node-agent --field-selector "spec.nodeName=$NODE" -o jsonpath='{.items[0].metadata.name}')
ds_role=$(k -n "$VNS" get pod "$ds_pod" -o jsonpath='{.metadata.labels.role}')
echo "  DaemonSet node-agent made pod $ds_pod on $NODE, labels: $(k -n "$VNS" get pod "$ds_pod" -o jsonpath='{.metadata.labels}')"
check "the DaemonSet's pod carries role=node-agent (what Velero 1.16+ looks for on the node)" [ "$ds_role" = node-agent ]
[ "$ds_role" = node-agent ] || die "daemonset/daemonset.yaml's pod template lacks the label role=node-agent: Velero would never create a PodVolumeBackup"
# velero server runs as a host process below (its plugin image is not on the node): the
# Deployment stays, with no pod (Velero reads its image from it for the restore helper).
k -n "$VNS" scale deployment velero --replicas=0 >/dev/null
# TokenRequest kubeconfigs: the server runs as ServiceAccount velero, the agent as node-agent.
token_kubeconfig velero "$W/velero-sa.kubeconfig"
token_kubeconfig node-agent "$W/node-agent-sa.kubeconfig"
sa_can() { "$kubectl" --kubeconfig "$W/node-agent-sa.kubeconfig" auth can-i "$@" >/dev/null 2>&1; }
check "ServiceAccount node-agent may patch podvolumebackups (daemonset/rbac.yaml)" sa_can patch podvolumebackups.velero.io -n "$VNS"
check "ServiceAccount node-agent may not list secrets (least privilege)" eval '! sa_can list secrets -n "$VNS"'
step_end

step_begin "velero server (host process, ServiceAccount velero)"
port_free 8080 || die "port 8080 is taken: velero server's controller-runtime metrics server binds :8080 (no flag); free it first"
mkdir -p "$W/velero/tmp" "$W/velero/home" "$W/velero/scratch" "$W/velero/credentials"
# As the Deployment: the cloud-credentials Secret mounted at /credentials, AWS_SHARED_CREDENTIALS_FILE.
(umask 077; k -n "$VNS" get secret cloud-credentials -o jsonpath='{.data.cloud}' | base64 -d >"$W/velero/credentials/cloud")
velero_args=$(k -n "$VNS" get deploy velero -o jsonpath='{.spec.template.spec.containers[0].args}')
echo "  the Deployment's arguments: $velero_args"
# Stopped with 5 s of grace: with a backup in progress (an interrupted run) its own graceful stop
# waits 30 s, and nothing of it is needed after the run.
start_velero_server() { # [log file]
  velero_log=${1:-$W/velero-server.log}
  start_group velero-server 5 "$velero_log" env TMPDIR="$W/velero/tmp" HOME="$W/velero/home" \
    VELERO_SCRATCH_DIR="$W/velero/scratch" VELERO_NAMESPACE="$VNS" \
    AWS_SHARED_CREDENTIALS_FILE="$W/velero/credentials/cloud" \
    "$velero" server --features= --uploader-type="$UPLOADER" \
    --kubeconfig "$W/velero-sa.kubeconfig" --namespace "$VNS" --plugin-dir "$vdir/plugins" \
    --metrics-address "127.0.0.1:$(free_port)" --profiler-address= --log-level info
  velero_pg=${groups[-1]#*:}; velero_pg=${velero_pg%%:*}
}
start_velero_server
bsl_available() {
  group_alive "$velero_pg" || die "velero server (process group $velero_pg) exited: $(tail -n 20 "$velero_log"; ps -e -o pid,pgid,stat,args | grep -F velero | cut -c1-160)"
  [ "$(k -n "$VNS" get bsl default -o jsonpath='{.status.phase}' 2>/dev/null)" = Available ]
}
wait_until "$TIMEOUT" "BackupStorageLocation default Available" bsl_available
repo_secret() { k -n "$VNS" get secret velero-repo-credentials >/dev/null 2>&1; }
wait_until 60 "Secret velero-repo-credentials (made by velero server)" repo_secret
echo "  BackupStorageLocation default Available; Secret velero-repo-credentials present"
step_end

step_begin "podvolume-agent: the DaemonSet's pod on $NODE (ServiceAccount node-agent)"
# use_agent_pod <pod>: the agent's pod from now on: its host PID (under tini in the pod's
# cgroup), its address, and its log (the kubelet's file of the container, read again whenever a
# check needs it; a replaced pod's log is kept as agent-<pod>.log).
use_agent_pod() {
  local p
  ds_pod=$1
  ds_uid=$(k -n "$VNS" get pod "$ds_pod" -o jsonpath='{.metadata.uid}')
  agent_pid=
  for p in $(find /sys/fs/cgroup/pids/kubepods -path "*pod$ds_uid*" -name cgroup.procs -exec cat {} + 2>/dev/null); do
    [[ $( { tr '\0' ' ' <"/proc/$p/cmdline"; } 2>/dev/null) == /usr/local/bin/podvolume-agent* ]] && agent_pid=$p
  done
  [ -n "$agent_pid" ] || die "no podvolume-agent process in pod $ds_pod's cgroups"
  agent_ip=$(k -n "$VNS" get pod "$ds_pod" -o jsonpath='{.status.podIP}')
}
use_agent_pod "$ds_pod"
save_agent_log() {
  cat /var/log/pods/"${VNS}_${ds_pod}_${ds_uid}"/node-agent/*.log >"$W/agent.log" 2>/dev/null || true
  cp "$W/agent.log" "$W/agent-$ds_pod.log"
}
agent_log_saver=save_agent_log
agent_alive() {
  [ -e "/proc/$agent_pid" ] && [ "$(k -n "$VNS" get pod "$ds_pod" -o jsonpath='{.status.containerStatuses[0].restartCount}')" = 0 ]
}
echo "  pod $ds_pod, IP $agent_ip, agent PID $agent_pid: $(tr '\0' ' ' <"/proc/$agent_pid/cmdline")"
curl -fsS --max-time 2 -o /dev/null "http://$agent_ip:8085/readyz" || die "the agent's /readyz at $agent_ip:8085 does not answer"
step_end

# --- case 1: backup ------------------------------------------------------------------------------
step_begin "case 1: workload (2 pods, 3 emptyDir volumes of random data)"
k create namespace "$APP" >/dev/null
pod_yaml() { # name volumes...
  local name=$1; shift
  local vols=("$@") v list
  list=$(IFS=,; echo "${vols[*]}")
  echo "apiVersion: v1
kind: Pod
metadata:
  name: $name
  namespace: $APP
  labels: {app: velero-smoke}
  annotations: {backup.velero.io/backup-volumes: \"$list\"}
spec:
  containers:
  - name: app
    image: $WORKLOAD_IMAGE
    command: [sleep, infinity]
    volumeMounts:"
  for v in "${vols[@]}"; do echo "    - {name: $v, mountPath: /$v}"; done
  echo "  volumes:"
  for v in "${vols[@]}"; do echo "  - {name: $v, emptyDir: {}}"; done
}
{ pod_yaml writer data logs; echo ---; pod_yaml cache cache; } | k apply -f - >/dev/null
pods_running() { [ "$(k -n "$APP" get pods --field-selector status.phase=Running -o name | wc -l)" -eq 2 ]; }
wait_until 60 "the two pods Running" pods_running
# Where the kubelet made a pod's emptyDir volume.
voldir() { echo "/var/lib/kubelet/pods/$(k -n "$1" get pod "$2" -o jsonpath='{.metadata.uid}')/volumes/kubernetes.io~empty-dir/$3"; }
rnd() { mkdir -p "$(dirname "$1")"; head -c "$2" /dev/urandom >"$1"; }
d=$(voldir "$APP" writer data)
rnd "$d/db/table-1.bin" $((3 * 1024 * 1024)); rnd "$d/db/table-2.bin" $((1024 * 1024 + 17)); rnd "$d/conf/app.conf" 4099
: >"$d/empty"; chmod 0640 "$d/conf/app.conf"; chmod 0700 "$d/db"; touch -d '2024-02-29 12:34:56.789' "$d/db/table-2.bin"
d=$(voldir "$APP" writer logs)
rnd "$d/app.log" $((2 * 1024 * 1024 + 12345)); rnd "$d/rotated/app.log.1" 777777
d=$(voldir "$APP" cache cache)
rnd "$d/blob" $((4 * 1024 * 1024)); for i in 1 2 3 4 5 6 7 8; do rnd "$d/small/$i" $((i * 1000 + 1)); done
chmod 0755 "$d/blob"
python3 - "$W/expected.json" "$(voldir "$APP" writer data)" "$(voldir "$APP" writer logs)" "$(voldir "$APP" cache cache)" <<'EOF'
import json, os, sys
out, dirs = sys.argv[1], dict(zip(["writer/data", "writer/logs", "cache/cache"], sys.argv[2:]))
exp = {k: sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs) for k, d in dirs.items()}
json.dump(exp, open(out, "w"))
EOF
echo "  bytes written per volume: $(cat "$W/expected.json") (total $(python3 -c 'import json,sys; print(sum(json.load(open(sys.argv[1])).values()))' "$W/expected.json"))"
for pv in writer/data writer/logs cache/cache; do
  python3 "$tools/checks.py" tree "$(voldir "$APP" "${pv%/*}" "${pv#*/}")" >"$W/source-${pv%/*}-${pv#*/}.tree"
done
step_end

step_begin "case 1: velero backup create b1 --include-namespaces $APP --wait"
brc=0; bounded "$W/backup-create.out" "${vel_cmd[@]}" backup create b1 --include-namespaces "$APP" --wait || brc=$?
sed 's/^/  | /' "$W/backup-create.out" | tail -n 5
step_end
k -n "$VNS" get backup b1 -o json >"$W/backup-b1.json"
k -n "$VNS" get podvolumebackups -l velero.io/backup-name=b1 -o json --show-managed-fields >"$W/pvbs.json"
bphase=$(k -n "$VNS" get backup b1 -o jsonpath='{.status.phase}')
echo "  Backup b1: phase $bphase, $(k -n "$VNS" get backup b1 -o jsonpath='{.status.startTimestamp} -> {.status.completionTimestamp}, items {.status.progress.itemsBackedUp}/{.status.progress.totalItems}, errors {.status.errors}, warnings {.status.warnings}')"
check "velero backup create --wait returned 0" [ "$brc" -eq 0 ]
check "Backup b1 phase Completed" [ "$bphase" = Completed ]
k get crd podvolumebackups.velero.io -o json >"$W/crd-pvb.json"
k get crd podvolumerestores.velero.io -o json >"$W/crd-pvr.json"
pycheck pvbs "$W/pvbs.json" "$W/expected.json" "$NODE" "$UPLOADER" "$repo_identifier" "$W/crd-pvb.json"
# What Velero's server recorded in the bucket for each volume (the same file `velero backup
# describe --details` shows; read directly, see tools/velero-smoke/bucket.py).
if bucket json "$PREFIX/backups/b1/b1-volumeinfo.json.gz" >"$W/b1-volumeinfo.json" 2>"$W/bucket.err"; then
  pycheck volumeinfo "$W/b1-volumeinfo.json" "$W/pvbs.json"
else
  fail "reading $PREFIX/backups/b1/b1-volumeinfo.json.gz: $(tail -n 1 "$W/bucket.err")"
fi
brepo=$(k -n "$VNS" get backuprepositories -l "velero.io/volume-namespace=$APP" -o jsonpath='{range .items[*]}{.metadata.name} {.status.phase} {.spec.resticIdentifier}{"\n"}{end}')
echo "  BackupRepository: $brepo"
check "BackupRepository $APP-default-$UPLOADER Ready" grep -q "^$APP-default-$UPLOADER Ready" <<<"$brepo"

repo_password=$(k -n "$VNS" get secret velero-repo-credentials -o jsonpath='{.data.repository-password}' | base64 -d)
ak=$(sed -n 's/^aws_access_key_id = //p' "$W/cloud"); sk=$(sed -n 's/^aws_secret_access_key = //p' "$W/cloud")
# kopia_list <label>: `kopia snapshot list --all --json` of the namespace's repository, through a
# fresh read-only connection as Velero's identity (default@default), into $W/kopia-<label>.json.
kopia_list() { # <label> [namespace of the repository, default $APP]
  local d=$W/kopia-check/$1 ns=${2:-$APP}
  mkdir -p "$d"
  kenv=(env -i PATH="$PATH" HOME="$d" KOPIA_PASSWORD="$repo_password" AWS_ACCESS_KEY_ID="$ak"
    AWS_SECRET_ACCESS_KEY="$sk" KOPIA_CHECK_FOR_UPDATES=false KOPIA_LOG_DIR="$d/logs")
  "${kenv[@]}" "$kopia" repository connect s3 --config-file "$d/repository.config" --cache-directory "$d/cache" \
    --bucket "$BUCKET" --prefix "$PREFIX/kopia/$ns/" --endpoint "$node_ip:$s3_port" --region us-east-1 \
    --root-ca-pem-path "$W/s3/ca.pem" --override-username=default --override-hostname=default --readonly \
    >"$d/connect.log" 2>&1 || { fail "kopia repository connect s3 (bucket $BUCKET, prefix $PREFIX/kopia/$ns/): $(tail -n 3 "$d/connect.log")"; return 1; }
  "${kenv[@]}" "$kopia" snapshot list --all --incomplete --json --config-file "$d/repository.config" >"$W/kopia-$1.json" 2>"$d/list.log" \
    || { fail "kopia snapshot list --all: $(tail -n 3 "$d/list.log")"; return 1; }
}
# restic_list <label> [repository]: `restic snapshots --json` of a namespace's repository (the
# PVBs' repoIdentifier; default $APP's), Velero's CA, without a lock, into $W/restic-<label>.json.
restic_list() {
  local d=$W/restic-check/$1 repo=${2:-$repo_identifier}
  mkdir -p "$d"
  env -i PATH="$PATH" HOME="$d" RESTIC_PASSWORD="$repo_password" AWS_ACCESS_KEY_ID="$ak" AWS_SECRET_ACCESS_KEY="$sk" \
    "$restic" --repo "$repo" --cacert "$W/s3/ca.pem" --cache-dir "$d/cache" --no-lock snapshots --json \
    >"$W/restic-$1.json" 2>"$d/snapshots.log" \
    || { fail "restic snapshots ($repo): $(tail -n 3 "$d/snapshots.log")"; return 1; }
}
if [ "$UPLOADER" = kopia ]; then
  echo "  kopia repository s3://$BUCKET/$PREFIX/kopia/$APP/ as default@default:"
  if kopia_list after-backup; then pycheck kopia "$W/kopia-after-backup.json" "$W/pvbs.json" "$APP"; fi
else
  echo "  restic repository $repo_identifier:"
  if restic_list after-backup; then pycheck restic "$W/restic-after-backup.json" "$W/pvbs.json" "$APP"; fi
fi

# restore_helper_events <namespace>: what Velero's restore helper did in each pod of the
# namespace, from its log (`kubectl logs -c restore-wait`) and its container's exit, as JSON lines
# {"event": "restore-helper-done", "uid", "restoreUID", "doneFiles"} for each helper that exited 0
# after finding every done file (its last "Found the done file" pass before "are done").
restore_helper_events() {
  local pod uid ruid code
  for pod in $(k -n "$1" get pods -o jsonpath='{.items[*].metadata.name}'); do
    uid=$(k -n "$1" get pod "$pod" -o jsonpath='{.metadata.uid}')
    ruid=$(k -n "$1" get pod "$pod" -o jsonpath='{.spec.initContainers[?(@.name=="restore-wait")].args[0]}')
    code=$(k -n "$1" get pod "$pod" -o jsonpath='{.status.initContainerStatuses[?(@.name=="restore-wait")].state.terminated.exitCode}')
    [ "$code" = 0 ] || continue
    k -n "$1" logs "$pod" -c restore-wait 2>/dev/null | python3 -c '
import json, sys
uid, ruid = sys.argv[1], sys.argv[2]
found, done, after = [], None, []
for line in sys.stdin:
    if done is not None:
        after.append(line.strip())
    elif line.startswith("Found the done file "):
        found.append(line[len("Found the done file "):].strip())
    elif line.startswith("The filesystem restore done file "):
        found = []
    elif "restores are done" in line:
        done = found
if done is not None:
    print(json.dumps({"event": "restore-helper-done", "uid": uid, "restoreUID": ruid, "doneFiles": done,
                      "cleanup": " | ".join(after)}))
' "$uid" "$ruid"
  done
}

# --- case 2: restore -----------------------------------------------------------------------------
step_begin "case 2: velero restore create r1 --from-backup b1 --namespace-mappings $APP:$APP2 --wait"
rrc=0; bounded "$W/restore-create.out" "${vel_cmd[@]}" restore create r1 --from-backup b1 --namespace-mappings "$APP:$APP2" --wait || rrc=$?
sed 's/^/  | /' "$W/restore-create.out" | tail -n 5
step_end
# Velero's restore helper (the init container restore-wait, run by the kubelet) exits once it
# has seen every done file, and the pod then runs; give it a moment after the Restore's end.
restored_running() { [ "$(k -n "$APP2" get pods --field-selector status.phase=Running -o name 2>/dev/null | wc -l)" -eq 2 ]; }
settle 30 restored_running || echo "  (the restored pods are not Running 30 s after the restore: see below)"
k -n "$VNS" get restore r1 -o json >"$W/restore-r1.json"
k -n "$VNS" get podvolumerestores -l velero.io/restore-name=r1 -o json --show-managed-fields >"$W/pvrs.json"
k -n "$APP2" get pods -o json >"$W/restored-pods.json"
rphase=$(k -n "$VNS" get restore r1 -o jsonpath='{.status.phase}')
echo "  Restore r1: phase $rphase, $(k -n "$VNS" get restore r1 -o jsonpath='{.status.startTimestamp} -> {.status.completionTimestamp}, items {.status.progress.itemsRestored}/{.status.progress.totalItems}, errors {.status.errors}, warnings {.status.warnings}')"
check "velero restore create --wait returned 0" [ "$rrc" -eq 0 ]
check "Restore r1 phase Completed" [ "$rphase" = Completed ]
echo '{"writer": ["data", "logs"], "cache": ["cache"]}' >"$W/volumes.json"
if bucket json "$PREFIX/restores/r1/restore-r1-results.gz" >"$W/r1-results.json" 2>"$W/bucket.err"; then
  echo "  the restore's results ($PREFIX/restores/r1/restore-r1-results.gz): $(cat "$W/r1-results.json")"
else
  fail "reading $PREFIX/restores/r1/restore-r1-results.gz: $(tail -n 1 "$W/bucket.err")"
fi
restore_helper_events "$APP2" >"$W/restore-helper.events"
pycheck restored-pods "$W/restored-pods.json" "$W/restore-r1.json" "$W/restore-helper.events" "$W/volumes.json"
pycheck pvrs "$W/pvrs.json" "$W/pvbs.json" "$W/expected.json" "$NODE" "$W/restore-r1.json" "$W/crd-pvr.json"
k -n "$VNS" get events -o json >"$W/events.json"
pycheck events "$W/events.json" "$W/pvbs.json" "$W/pvrs.json"
for pv in writer/data writer/logs cache/cache; do
  pod=${pv%/*} vol=${pv#*/}
  src=$(voldir "$APP" "$pod" "$vol") dst=$(voldir "$APP2" "$pod" "$vol")
  pycheck same-tree "$src" "$dst" "$APP2/$pv" "$(k -n "$VNS" get restore r1 -o jsonpath='{.metadata.uid}')"
done

# --- case 6 (kopia): tools/velero-smoke/kopia-cases.sh ---------------------------------------------
if [ "$UPLOADER" = kopia ]; then case6_interchangeable_with_velero_data_path; fi

# --- case 3: delete ------------------------------------------------------------------------------
step_begin "case 3: velero backup delete b1 --confirm (until the Backup is gone)"
bounded "$W/backup-delete.out" "${vel_cmd[@]}" backup delete b1 --confirm || fail "velero backup delete b1 --confirm: $(cat "$W/backup-delete.out")"
sed 's/^/  | /' "$W/backup-delete.out"
backup_gone() { ! k -n "$VNS" get backup b1 >/dev/null 2>&1; }
gone=0; settle "$TIMEOUT" backup_gone && gone=1
step_end
check "Backup b1 deleted" [ "$gone" = 1 ]
k -n "$VNS" get deletebackuprequests -o jsonpath='{range .items[*]}  DeleteBackupRequest {.metadata.name}: {.status.phase} {.status.errors}{"\n"}{end}' 2>/dev/null || true
left=$(k -n "$VNS" get podvolumebackups -l velero.io/backup-name=b1 -o name | wc -l)
echo "  PodVolumeBackups of b1 left: $left; Restores left: $(k -n "$VNS" get restores -o name | wc -l), PodVolumeRestores left: $(k -n "$VNS" get podvolumerestores -o name | wc -l)"
# Velero forgets the backup's snapshots itself (kopia: its repository code; 1.16's restic path:
# `restic forget` run by the server); the agent has no part in it.
if [ "$UPLOADER" = kopia ]; then
  if kopia_list after-delete; then pycheck gone "$W/kopia-after-delete.json" "$W/pvbs.json"; fi
else
  if restic_list after-delete; then pycheck gone "$W/restic-after-delete.json" "$W/pvbs.json"; fi
fi
objs=$(bucket count "$PREFIX/backups/b1/" "$PREFIX/$UPLOADER/") || objs="? ?"
echo "  objects in the bucket: $PREFIX/backups/b1/: ${objs% *}, $PREFIX/$UPLOADER/: ${objs#* }"
check "the backup's objects removed from $PREFIX/backups/b1/" [ "${objs% *}" = 0 ]

# --- case 8: the second backup of a claim is incremental from the first ----------------------------
# Velero labels the PodVolumeBackup of a claim's volume velero.io/pvc-uid. restic: the agent takes
# the latest Completed PVB of the same claim, location and uploader as --parent (Velero's own
# rule); kopia: kopia takes the latest snapshot of the same source itself. A local
# PersistentVolume (a directory of the node) pre-bound to the claim (the controller manager's PV
# controller binds the pair); the kubelet bind-mounts it at kubernetes.io~local-volume/<pv>.
CLAIMNS=smoke-claim
pvb_of() { k -n "$VNS" get podvolumebackups -l "velero.io/backup-name=$1" -o jsonpath="{.items[0].$2}" 2>/dev/null; }
backup_phase() { k -n "$VNS" get backup "$1" -o jsonpath='{.status.phase}' 2>/dev/null; }
step_begin "case 8: two backups of a claim's volume; the second is incremental from the first"
k create namespace "$CLAIMNS" >/dev/null
mkdir -p "$W/local-pv"
k apply -f - >/dev/null <<YAML
apiVersion: v1
kind: PersistentVolume
metadata: {name: smoke-claim-pv}
spec:
  capacity: {storage: 1Gi}
  accessModes: [ReadWriteOnce]
  persistentVolumeReclaimPolicy: Retain
  storageClassName: smoke-manual
  local: {path: "$W/local-pv"}
  nodeAffinity:
    required:
      nodeSelectorTerms: [{matchExpressions: [{key: kubernetes.io/hostname, operator: In, values: [$NODE]}]}]
  claimRef: {namespace: $CLAIMNS, name: data}
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: data, namespace: $CLAIMNS}
spec:
  accessModes: [ReadWriteOnce]
  storageClassName: smoke-manual
  volumeName: smoke-claim-pv
  resources: {requests: {storage: 1Gi}}
---
apiVersion: v1
kind: Pod
metadata: {name: db, namespace: $CLAIMNS, annotations: {backup.velero.io/backup-volumes: data}}
spec:
  containers: [{name: app, image: $WORKLOAD_IMAGE, command: [sleep, infinity], volumeMounts: [{name: data, mountPath: /data}]}]
  volumes: [{name: data, persistentVolumeClaim: {claimName: data}}]
YAML
claim_bound() { [ "$(k -n "$CLAIMNS" get pvc data -o jsonpath='{.status.phase}' 2>/dev/null)" = Bound ]; }
wait_until 60 "claim $CLAIMNS/data Bound to smoke-claim-pv" claim_bound
db_running() { [ "$(k -n "$CLAIMNS" get pod db -o jsonpath='{.status.phase}' 2>/dev/null)" = Running ]; }
wait_until 60 "pod $CLAIMNS/db Running" db_running
d=/var/lib/kubelet/pods/$(k -n "$CLAIMNS" get pod db -o jsonpath='{.metadata.uid}')/volumes/kubernetes.io~local-volume/smoke-claim-pv
grep -q " $d " /proc/self/mounts || die "the kubelet did not mount the claim's local volume at $d"
rnd "$d/base.bin" $((3 * 1024 * 1024))
claim_backup() { # <name>
  local rc=0
  bounded "$W/backup-$1.out" "${vel_cmd[@]}" backup create "$1" --include-namespaces "$CLAIMNS" --wait || rc=$?
  check "velero backup create $1 --wait returned 0" [ "$rc" -eq 0 ]
  check "Backup $1 phase Completed" [ "$(backup_phase "$1")" = Completed ]
}
claim_backup c1
rnd "$d/added.bin" 12345
claim_backup c2
step_end
k -n "$VNS" get podvolumebackups -l 'velero.io/backup-name in (c1,c2)' -o json >"$W/claim-pvbs.json"
pvc_uid=$(k -n "$CLAIMNS" get pvc data -o jsonpath='{.metadata.uid}')
claim_snapshots=-
if [ "$UPLOADER" = restic ] && restic_list claim "$(restic_repo_of "$CLAIMNS")"; then
  claim_snapshots=$W/restic-claim.json
fi
pycheck incremental "$W/claim-pvbs.json" c1 c2 "$pvc_uid" "$UPLOADER" $((3 * 1024 * 1024)) 12345 "$claim_snapshots" "$W/crd-pvb.json"
if [ "$UPLOADER" = restic ]; then
  c1_sid=$(pvb_of c1 status.snapshotID)
  save_agent_log
  check "the agent logged c2's backup as incremental from c1's snapshot $c1_sid" \
    eval 'grep -F "incremental backup from the previous snapshot of this claim" "$W/agent.log" | grep -qF "$c1_sid"'
fi

# --- cases 4 and 5: a running backup timed out, the server restarted ----------------------------------
# Velero 1.17+ cancels the running PodVolumeBackup (spec.cancel); Velero 1.16 has no cancel in
# its API (the field is not in its CRD) and leaves the PodVolumeBackup to run to its end, as its
# own node agent would. A volume the uploader takes long over: a sparse file (read and hashed
# zero by zero; nothing new to upload): 64 GiB for kopia, canceled long before its end. restic
# must finish its 12 GiB (12 to 25 s here), which is not surely longer than Velero takes to act:
# once restic runs, the test pauses its process group (SIGSTOP) until Velero has acted, then
# lets it go on (SIGCONT), so that the backup is mid-transfer when Velero acts whatever the
# machine's speed.
SLOW=smoke-slow
k create namespace "$SLOW" >/dev/null
APP=$SLOW pod_yaml slow data | k apply -f - >/dev/null
slow_running() { [ "$(k -n "$SLOW" get pod slow -o jsonpath='{.status.phase}' 2>/dev/null)" = Running ]; }
wait_until 60 "pod $SLOW/slow Running" slow_running
d=$(voldir "$SLOW" slow data)
if [ "$UPLOADER" = kopia ]; then slow_size=64G; else slow_size=12G; fi
rnd "$d/head.bin" 65536; truncate -s "$slow_size" "$d/huge.img"
# The agent's uploaders are its children (each in a process group of its own), seen from the host.
uploader_pids() { pgrep -P "$agent_pid" -x "$UPLOADER" 2>/dev/null || true; }
uploaders() { uploader_pids | grep -c . || true; }
pvb_moving() { [ "$(pvb_of "$1" status.phase)" = InProgress ] && [ "$(uploaders)" -ge 1 ]; }
# pause_uploaders STOP|CONT: signals every uploader's process group (restic only, see above).
# `pause_uploaders STOP any` pauses kopia too (case 11).
pause_uploaders() {
  [ "$UPLOADER" = restic ] || [ "${2:-}" = any ] || [ -n "${paused_groups:-}" ] || return 0
  local pid
  [ "$1" = STOP ] && paused_groups=$(uploader_pids)
  for pid in $paused_groups; do kill "-$1" -- "-$pid" 2>/dev/null || true; done
  echo "  SIG$1 to $UPLOADER's process group(s): ${paused_groups:-none found}" | tr '\n' ' '
  echo
  [ "$1" = STOP ] || paused_groups=
}
backup_backing_up_slow() { # <name> [annotations as JSON]
  k apply -f - >/dev/null <<EOF
apiVersion: velero.io/v1
kind: Backup
metadata: {name: $1, namespace: $VNS, annotations: ${2:-{\}}}
spec: {includedNamespaces: [$SLOW], storageLocation: default}
EOF
  wait_until "$TIMEOUT" "the PodVolumeBackup of $1 InProgress with $UPLOADER running" pvb_moving "$1"
}
# ended_by_velero <backup> <case>: what the PVB ends as once Velero has acted. Velero 1.17+ sets
# spec.cancel: the PVB ends Canceled with no snapshot. Velero 1.16 has no cancel and asks nothing
# more of a running PVB; the agent sees its Backup has ended and stops it: Failed (four phases)
# saying so, no snapshot. Either way no uploader is left and our finalizer is gone.
ended_by_velero() {
  local b=$1 phase t0=$SECONDS
  pvb_terminal() { case "$(pvb_of "$b" status.phase)" in Completed | Failed | Canceled) return 0 ;; *) return 1 ;; esac; }
  settle "$TIMEOUT" pvb_terminal || true
  phase=$(pvb_of "$b" status.phase)
  echo "  PodVolumeBackup $(pvb_of "$b" metadata.name): phase $phase after $((SECONDS - t0)) s more, spec.cancel=$(pvb_of "$b" spec.cancel),"\
    "snapshotID $(pvb_of "$b" status.snapshotID), progress $(pvb_of "$b" status.progress), message: $(pvb_of "$b" status.message | cut -c1-200)"
  if [ "$UPLOADER" = kopia ]; then
    check "$2: Velero set spec.cancel on the PodVolumeBackup" [ "$(pvb_of "$b" spec.cancel)" = true ]
    check "$2: the PodVolumeBackup ends Canceled" [ "$phase" = Canceled ]
    check "$2: no snapshotID is reported for the canceled transfer" [ -z "$(pvb_of "$b" status.snapshotID)" ]
  else
    # Velero 1.16 asks nothing more of the PodVolumeBackup; the agent sees its Backup ended and
    # stops the transfer nobody will read (agent::owner), Failed on this four-phase CRD.
    check "$2: the PodVolumeBackup has no spec.cancel (not in Velero $VELERO_VERSION's CRD)" [ -z "$(pvb_of "$b" spec.cancel)" ]
    check "$2: the agent stopped it once its Backup ended: Failed, the message names the Backup's phase" \
      eval '[ "$phase" = Failed ] && pvb_of "$b" status.message | grep -q "backup $b ended ($(backup_phase "$b"))"'
    check "$2: no snapshotID is reported for the stopped transfer" [ -z "$(pvb_of "$b" status.snapshotID)" ]
  fi
  # How long after Velero's own decision (the Backup's completionTimestamp) the PVB ended.
  local decided ended
  decided=$(k -n "$VNS" get backup "$b" -o jsonpath='{.status.completionTimestamp}' 2>/dev/null || true)
  ended=$(pvb_of "$b" status.completionTimestamp)
  [ -n "$decided" ] && [ -n "$ended" ] && echo "  the PodVolumeBackup ended $(( $(date -d "$ended" +%s) - $(date -d "$decided" +%s) )) s after the Backup ($decided -> $ended; --update-interval 10s)"
  no_uploader() { [ "$(uploaders)" -eq 0 ]; }
  settle 30 no_uploader || true
  check "$2: no $UPLOADER process left" [ "$(uploaders)" -eq 0 ]
  check "$2: the agent's finalizer is gone" eval '! pvb_of "$b" metadata.finalizers | grep -q pod-volume-finalizer'
}

if [ "$UPLOADER" = kopia ]; then slow_timeout=20s; else slow_timeout=10s; fi
step_begin "case 4: a backup timed out by Velero mid-transfer (annotation velero.io/pod-volume-timeout: $slow_timeout)"
backup_backing_up_slow b-timeout "{velero.io/pod-volume-timeout: $slow_timeout}"
pause_uploaders STOP
backup_ended() { case "$(backup_phase "$1")" in Completed | PartiallyFailed | Failed) return 0 ;; *) return 1 ;; esac; }
settle "$TIMEOUT" backup_ended b-timeout || true
pause_uploaders CONT
echo "  Backup b-timeout: phase $(backup_phase b-timeout), errors $(k -n "$VNS" get backup b-timeout -o jsonpath='{.status.errors}')"
check "Backup b-timeout ends PartiallyFailed (its volume timed out)" [ "$(backup_phase b-timeout)" = PartiallyFailed ]
ended_by_velero b-timeout "timeout"
step_end

step_begin "case 5: the Velero server restarted mid-backup"
# A new file in place of the one case 4 read: with restic, case 4's backup completed, and the
# agent gives its snapshot as parent; restic would skip the unchanged file and end within a
# second, too soon to be seen running.
rm -f "$d/huge.img"
truncate -s "$slow_size" "$d/huge-2.img"
backup_backing_up_slow b-restart
pause_uploaders STOP
stop_group velero-server "$velero_pg" 5
echo "  velero server stopped with backup b-restart $(backup_phase b-restart); starting it again (log: velero-server-2.log)"
start_velero_server "$W/velero-server-2.log"
wait_until "$TIMEOUT" "BackupStorageLocation default Available after the restart" bsl_available
settle "$TIMEOUT" backup_ended b-restart || true
pause_uploaders CONT
echo "  Backup b-restart: phase $(backup_phase b-restart), failureReason: $(k -n "$VNS" get backup b-restart -o jsonpath='{.status.failureReason}')"
check "Backup b-restart ends Failed (a restart of the server fails the backup it was running)" [ "$(backup_phase b-restart)" = Failed ]
ended_by_velero b-restart "server restart"
step_end

# --- the agent itself --------------------------------------------------------------------------------
say "== the agent and the server over the whole run"
check "the agent is still running, never restarted" agent_alive
check "the velero server is still running" group_alive "$velero_pg"
save_agent_log
# The DaemonSet logs JSON (--log-format=json); the kubelet's file prefixes each line.
n_err=$(grep -c '"level":"ERROR"' "$W/agent.log" || true)
n_warn=$(grep -c '"level":"WARN"' "$W/agent.log" || true)
echo "  agent log: $(wc -l <"$W/agent.log") lines, $n_err ERROR, $n_warn WARN"
grep -E '"level":"(ERROR|WARN)"' "$W/agent.log" | cut -c1-300 | head -n 20 | sed 's/^/  | /' || true
check "no ERROR line in the agent's log" [ "$n_err" -eq 0 ]
verr=$(grep -c 'level=error' "$W/velero-server.log" || true)
echo "  velero server log: $(wc -l <"$W/velero-server.log") lines, $verr level=error (the first two, before the first BSL validation, are normal):"
grep 'level=error' "$W/velero-server.log" | sed -E 's/^time="[^"]*" //' | cut -c1-300 | head -n 10 | sed 's/^/  | /' || true
curl -fsS "http://$agent_ip:8085/metrics" 2>/dev/null | grep -E '^podvolume_agent_(operations|status_writes)_total' | sed 's/^/  metric /' || true

# --- case 9: the agent's pod replaced mid-backup: tools/velero-smoke/node-faults.sh ----------------
case9_agent_pod_replaced delete
case9_agent_pod_replaced rollout
case10_backup_deleted_mid_transfer
case11_restore_deleted_mid_transfer

# --- case 7 (kopia): tools/velero-smoke/kopia-cases.sh ---------------------------------------------
if [ "$UPLOADER" = kopia ]; then case7_velero_node_agent_beside_ours; fi

# --- summary -------------------------------------------------------------------------------------
echo
echo "time per step:"
printf '  %s\n' "${steps[@]}"
echo "  total: $(elapsed "$t_start") s"
if [ ${#failed[@]} -gt 0 ]; then
  echo "velero-smoke: ${#failed[@]} check(s) FAILED"
  exit 1
fi
echo "velero-smoke: every check passed"
exit 0
}
