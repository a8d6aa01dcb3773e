#!/usr/bin/env bash
# CSI snapshot data movement with the real Velero server: `velero backup create
# --snapshot-move-data` of a namespace with two CSI claims on the real node (the tests' CSI
# driver, the real snapshot-controller and sidecars, see scripts/start-csi.sh); Velero's server
# takes the VolumeSnapshots and creates the DataUploads, the agent (the DaemonSet's pod) claims,
# exposes and moves them into Velero's kopia repository on fake-gcs-server over TLS.
#
#   scripts/velero-datamover-smoke.sh          # Velero 1.18.3
#
# Checks: every DataUpload Completed by the agent with exact bytes, a snapshot ID, its node and
# timestamps; the Backup Completed; the snapshots in the repository of the source namespace under
# Velero's data mover source (default@default:snapshot-data-upload-download/kopia/<ns>/<claim>);
# nothing exposed left in the Velero namespace (pods, claims, VolumeSnapshots, contents). Then the
# namespace deleted and `velero restore create`: every DataDownload Completed by the agent with
# exact bytes, the Restore Completed, both claims bound to the restored volumes (Velero's
# dynamic-pv-restore label) and byte-identical (tree sha256), the pod running again, nothing
# exposed and no unbound volume left. Then Velero's own node agent in place of ours: it restores
# the agent's backup, and moves a backup the agent then restores, byte-identical both ways. Then
# the faults: an exposure that never becomes ready (Failed after --data-mover-prepare-timeout,
# nothing left), a DataUpload left InProgress on a node that is gone (ended Failed by the agent),
# spec.cancel on an InProgress DataUpload
# (Canceled, kopia stopped, nothing left, the Backup PartiallyFailed) and the agent's pod deleted
# mid-transfer (its kopia stopped, the new pod runs the DataUpload again to Completed).
#
# Environment: VELERO_SMOKE_DIR, VELERO_SMOKE_KEEP, VELERO_SMOKE_TIMEOUT, PODVOLUME_IMAGE as
# scripts/velero-smoke.sh.
set -euo pipefail
{
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
tools=$root/tools/velero-smoke
PROVIDER=gcp
VELERO_VERSION=${1:-1.18.3}
VELERO_VERSION=${VELERO_VERSION#v}
UPLOADER=kopia
KOPIA_VERSION=0.22.3
NODE=dm-node
VNS=velero
APP=dm-app
BUCKET=velero-gcp
PREFIX=backups
TIMEOUT=${VELERO_SMOKE_TIMEOUT:-300}
unset AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY AWS_SHARED_CREDENTIALS_FILE KUBECONFIG VELERO_NAMESPACE NODE_NAME \
  KOPIA_PASSWORD KOPIA_CONFIG_PATH RESTIC_REPOSITORY RESTIC_PASSWORD_FILE GOOGLE_APPLICATION_CREDENTIALS \
  STORAGE_EMULATOR_HOST SSL_CERT_FILE

source "$tools/lib.sh"
W=${VELERO_SMOKE_DIR:-}
if [ -z "$W" ]; then W=$(mktemp -d /tmp/velero-datamover-smoke.XXXXXX); else mkdir -p "$W"; W=$(cd "$W" && pwd); fi
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
say "work directory: $W (Velero $VELERO_VERSION, CSI snapshot data movement)"

source "$tools/datamover-setup.sh"

# --- workload -------------------------------------------------------------------------------------
step_begin "workload: a pod with two CSI claims of random data"
k create namespace "$APP" >/dev/null
for c in data logs; do
  k apply -f - >/dev/null <<YAML
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: $c, namespace: $APP}
spec:
  accessModes: [ReadWriteOnce]
  storageClassName: podvolume-csi
  resources: {requests: {storage: 64Mi}}
YAML
done
k apply -f - >/dev/null <<YAML
apiVersion: v1
kind: Pod
metadata: {name: writer, namespace: $APP}
spec:
  terminationGracePeriodSeconds: 1
  containers:
  - {name: app, image: $WORKLOAD_IMAGE, command: [sleep, infinity], volumeMounts: [{name: data, mountPath: /data}, {name: logs, mountPath: /logs}]}
  volumes: [{name: data, persistentVolumeClaim: {claimName: data}}, {name: logs, persistentVolumeClaim: {claimName: logs}}]
YAML
running() { [ "$(k -n "$APP" get pod writer -o jsonpath='{.status.phase}' 2>/dev/null)" = Running ]; }
wait_until 120 "pod writer Running" running
voldir() { echo "/var/lib/kubelet/pods/$(k -n "$APP" get pod writer -o jsonpath='{.metadata.uid}')/volumes/kubernetes.io~csi/$(k -n "$APP" get pvc "$1" -o jsonpath='{.spec.volumeName}')/mount"; }
rnd() { mkdir -p "$(dirname "$1")"; head -c "$2" /dev/urandom >"$1"; }
d=$(voldir data); rnd "$d/db/table.bin" $((5 * 1024 * 1024 + 5)); rnd "$d/conf/app.conf" 4099
d=$(voldir logs); rnd "$d/app.log" $((2 * 1024 * 1024 + 77)); rnd "$d/old/app.log.1" 77777
bytes() { find "$1" -type f -printf '%s\n' | python3 -c 'import sys; print(sum(int(l) for l in sys.stdin))'; }
# Every file's path, mode, size and content, in one sum per claim.
tree_sum() { (cd "$1" && find . -mindepth 1 ! -name lost+found -printf '%p %y %m %s\n' | LC_ALL=C sort && \
  find . -type f -print0 | LC_ALL=C sort -z | xargs -0 -r sha256sum) | sha256sum | cut -d' ' -f1; }
declare -A expected=([data]=$(bytes "$(voldir data)") [logs]=$(bytes "$(voldir logs)"))
declare -A sums=([data]=$(tree_sum "$(voldir data)") [logs]=$(tree_sum "$(voldir logs)"))
echo "  bytes per claim: data=${expected[data]} logs=${expected[logs]}"
step_end

# --- backup with data movement -----------------------------------------------------------------------
step_begin "velero backup create b1 --include-namespaces $APP --snapshot-move-data --wait"
brc=0; bounded "$W/backup-create.out" "${vel_cmd[@]}" backup create b1 --include-namespaces "$APP" --snapshot-move-data --wait || brc=$?
step_end
k -n "$VNS" get datauploads -l velero.io/backup-name=b1 -o json >"$W/datauploads.json"
bphase=$(k -n "$VNS" get backup b1 -o jsonpath='{.status.phase}')
echo "  Backup b1: $bphase; DataUploads: $(k -n "$VNS" get datauploads -l velero.io/backup-name=b1 -o jsonpath='{range .items[*]}{.spec.sourcePVC}={.status.phase} node={.status.node} {.status.progress.bytesDone}/{.status.progress.totalBytes} {.status.message}; {end}')"
check "velero backup create --wait returned 0" [ "$brc" -eq 0 ]
check "Backup b1 phase Completed" [ "$bphase" = Completed ]
du_field() { python3 -c 'import json,sys; d=[i for i in json.load(open(sys.argv[1]))["items"] if i["spec"]["sourcePVC"]==sys.argv[2]]; v=d[0] if d else {}
for k in sys.argv[3].split("."): v=v.get(k, {}) if isinstance(v, dict) else {}
print(v if v != {} else "")' "$W/datauploads.json" "$1" "$2"; }
check "two DataUploads, one per claim" [ "$(python3 -c 'import json,sys; print(len(json.load(open(sys.argv[1]))["items"]))' "$W/datauploads.json")" = 2 ]
for c in data logs; do
  check "DataUpload of $c Completed" [ "$(du_field $c status.phase)" = Completed ]
  check "DataUpload of $c accepted by and moved on $NODE" [ "$(du_field $c status.acceptedByNode)/$(du_field $c status.node)" = "$NODE/$NODE" ]
  check "DataUpload of $c: bytesDone = totalBytes = ${expected[$c]}" [ "$(du_field $c status.progress.bytesDone)/$(du_field $c status.progress.totalBytes)" = "${expected[$c]}/${expected[$c]}" ]
  check "DataUpload of $c has a snapshot ID and both timestamps" [ -n "$(du_field $c status.snapshotID)" ] && [ -n "$(du_field $c status.startTimestamp)" ] && [ -n "$(du_field $c status.completionTimestamp)" ]
done
# kubectl podvolume shows the backup's moved snapshots (its own JSON, parsed by the check).
podvolume_cli=$root/target/debug/kubectl-podvolume
[ -x "$podvolume_cli" ] || (cd "$root" && cargo build --quiet --bin kubectl-podvolume) || die "cargo build kubectl-podvolume failed"
"$podvolume_cli" --kubeconfig "$admin_kc" -n "$VNS" backup b1 --once -o json >"$W/podvolume-b1.json" 2>"$W/podvolume-b1.err" || true
"$podvolume_cli" --kubeconfig "$admin_kc" -n "$VNS" backup b1 --once >"$W/podvolume-b1.txt" 2>&1 || true
sed 's/^/    /' "$W/podvolume-b1.txt"
check "kubectl podvolume backup b1: both claims' DataUploads Completed, the bytes of both" python3 -c 'import json,sys
d=json.load(open(sys.argv[1])); items=sorted((i["volume"], i["phase"]) for i in d["items"])
assert items == [("claim dm-app/data", "Completed"), ("claim dm-app/logs", "Completed")], items
assert d["summary"]["bytesDone"] == int(sys.argv[2]), d["summary"]' "$W/podvolume-b1.json" $((expected[data] + expected[logs]))
left_objects() {
  k -n "$VNS" get pods,pvc,volumesnapshots -o name 2>/dev/null | grep -v '^pod/node-agent-' || true
  k get volumesnapshotcontents -o name 2>/dev/null || true
  k get volumesnapshots -A -o name 2>/dev/null || true
}
nothing_left() { [ -z "$(left_objects)" ]; }
settle 60 nothing_left || true
check "nothing exposed left (pods, claims, VolumeSnapshots, contents): $(left_objects | tr '\n' ' ')" nothing_left

# The repository where Velero's own data mover would look (a read-only connection of our own).
repo_password=$(k -n "$VNS" get secret velero-repo-credentials -o jsonpath='{.data.repository-password}' | base64 -d)
d=$W/check; mkdir -p "$d"
kenv=(env -i PATH="$PATH" HOME="$d" KOPIA_PASSWORD="$repo_password" KOPIA_CHECK_FOR_UPDATES=false
  KOPIA_LOG_DIR="$d/logs" SSL_CERT_FILE="$W/store/bundle.pem" STORAGE_EMULATOR_HOST="$emulator_host")
if "${kenv[@]}" "$kopia" repository connect gcs --bucket "$BUCKET" --credentials-file "$W/cloud" --prefix "$PREFIX/kopia/$APP/" \
  --config-file "$d/repository.config" --cache-directory "$d/cache" --override-username=default --override-hostname=default \
  --readonly >"$d/connect.log" 2>&1 \
  && "${kenv[@]}" "$kopia" snapshot list --all --json --config-file "$d/repository.config" >"$W/kopia-snapshots.json" 2>"$d/list.log"; then
  for c in data logs; do
    id=$(du_field $c status.snapshotID)
    src=$(python3 -c 'import json,sys
for s in json.load(open(sys.argv[1])):
    if s["id"] == sys.argv[2]:
        o = s["source"]; print("%s@%s:%s" % (o["userName"], o["host"], o["path"]))' "$W/kopia-snapshots.json" "$id")
    check "snapshot $id of $c in the repository of $APP under Velero's data mover source ($src)" [ "$src" = "default@default:snapshot-data-upload-download/kopia/$APP/$c" ]
  done
else
  fail "kopia repository connect/list ($PREFIX/kopia/$APP/): $(tail -n 3 "$d/connect.log" "$d/list.log" 2>/dev/null)"
fi

# --- restore with data movement ------------------------------------------------------------------
step_begin "namespace $APP deleted; velero restore create r1 --from-backup b1 --wait"
k delete namespace "$APP" --wait=true --timeout=120s >/dev/null || die "namespace $APP not deleted"
no_app_volumes() { [ -z "$(k get pv -o jsonpath="{range .items[?(@.spec.claimRef.namespace==\"$APP\")]}{.metadata.name} {end}")" ]; }
wait_until 120 "the volumes of $APP deleted" no_app_volumes
rrc=0; bounded "$W/restore-create.out" "${vel_cmd[@]}" restore create r1 --from-backup b1 --wait || rrc=$?
step_end
k -n "$VNS" get datadownloads -l velero.io/restore-name=r1 -o json >"$W/datadownloads.json"
rphase=$(k -n "$VNS" get restore r1 -o jsonpath='{.status.phase}')
echo "  Restore r1: $rphase; DataDownloads: $(k -n "$VNS" get datadownloads -l velero.io/restore-name=r1 -o jsonpath='{range .items[*]}{.spec.targetVolume.pvc}={.status.phase} node={.status.node} {.status.progress.bytesDone}/{.status.progress.totalBytes} {.status.message}; {end}')"
check "velero restore create --wait returned 0" [ "$rrc" -eq 0 ]
check "Restore r1 phase Completed" [ "$rphase" = Completed ]
dd_field() { python3 -c 'import json,sys; d=[i for i in json.load(open(sys.argv[1]))["items"] if i["spec"]["targetVolume"]["pvc"]==sys.argv[2]]; v=d[0] if d else {}
for k in sys.argv[3].split("."): v=v.get(k, {}) if isinstance(v, dict) else {}
print(v if v != {} else "")' "$W/datadownloads.json" "$1" "$2"; }
check "two DataDownloads, one per claim" [ "$(python3 -c 'import json,sys; print(len(json.load(open(sys.argv[1]))["items"]))' "$W/datadownloads.json")" = 2 ]
wait_until 120 "pod writer Running again in $APP" running
for c in data logs; do
  check "DataDownload of $c Completed" [ "$(dd_field $c status.phase)" = Completed ]
  check "DataDownload of $c accepted by and moved on $NODE" [ "$(dd_field $c status.acceptedByNode)/$(dd_field $c status.node)" = "$NODE/$NODE" ]
  check "DataDownload of $c restored snapshot $(du_field $c status.snapshotID)" [ "$(dd_field $c spec.snapshotID)" = "$(du_field $c status.snapshotID)" ]
  check "DataDownload of $c: bytesDone = ${expected[$c]}" [ "$(dd_field $c status.progress.bytesDone)" = "${expected[$c]}" ]
  check "claim $c Bound to the restored volume, labelled for Velero's selector" \
    [ "$(k -n "$APP" get pvc $c -o jsonpath='{.status.phase}')" = Bound ] && \
    [ -n "$(k get pv "$(k -n "$APP" get pvc $c -o jsonpath='{.spec.volumeName}')" -o jsonpath='{.metadata.labels.velero\.io/dynamic-pv-restore}')" ]
  got=$(tree_sum "$(voldir $c)" 2>/dev/null || echo none)
  check "claim $c restored byte-identical (tree sha256 ${sums[$c]:0:16}...)" [ "$got" = "${sums[$c]}" ]
done
"$podvolume_cli" --kubeconfig "$admin_kc" -n "$VNS" restore r1 --once -o json >"$W/podvolume-r1.json" 2>"$W/podvolume-r1.err" || true
check "kubectl podvolume restore r1: both claims' DataDownloads Completed" python3 -c 'import json,sys
d=json.load(open(sys.argv[1])); items=sorted((i["volume"], i["phase"]) for i in d["items"])
assert items == [("claim dm-app/data", "Completed"), ("claim dm-app/logs", "Completed")], items' "$W/podvolume-r1.json"
settle 60 nothing_left || true
check "nothing exposed left after the restore: $(left_objects | tr '\n' ' ')" nothing_left
released() { k get pv -o jsonpath='{range .items[?(@.status.phase!="Bound")]}{.metadata.name}={.status.phase} {end}'; }
check "no volume left unbound: $(released)" [ -z "$(released)" ]

# --- Velero's own data mover, both ways ------------------------------------------------------------
# Snapshots are interchangeable with Velero's node agent: the agent's backup b1 restored by
# Velero's data mover, and a backup moved by Velero's data mover restored by the agent. Velero's
# node agent runs as its own DaemonSet (from `velero install --use-node-agent`, the image made of
# Velero's binary) in place of ours: two node agents cannot share a node.
step_begin "Velero's own data mover: restores the agent's b1; its backup restored by the agent"
stop_node_agent
(umask 077; k -n "$VNS" create secret generic store-ca --from-file=ca-bundle="$W/store/bundle.pem" >/dev/null)
vel install --provider "$PROVIDER" --plugins "velero/$(basename "$plugin"):$plugin_version" --bucket "$BUCKET" --prefix "$PREFIX" \
  --secret-file "$W/cloud" --cacert "$W/store/ca.pem" --backup-location-config "$bsl_config" \
  --use-volume-snapshots=false --uploader-type "$UPLOADER" --use-node-agent --dry-run -o json >"$W/velero-node-agent.json" 2>"$W/velero-dry-run.log" \
  || die "velero install --dry-run failed: $(tail -n 5 "$W/velero-dry-run.log")"
# Velero's kopia reads no CA setting for GCS (see the cloud smoke): the bundle comes through
# SSL_CERT_FILE, from a Secret mounted beside Velero's credentials; its data-path pods inherit both.
python3 - "$W/velero-node-agent.json" "$emulator_host" >"$W/velero-node-agent-ds.json" <<'PY'
import json, sys
items = json.load(open(sys.argv[1]))["items"]
ds = [i for i in items if i["kind"] == "DaemonSet"][0]
spec = ds["spec"]["template"]["spec"]
c = spec["containers"][0]
c.setdefault("env", []).extend([{"name": "STORAGE_EMULATOR_HOST", "value": sys.argv[2]},
    {"name": "GOOGLE_ACCESS_TOKEN", "value": "emulator-needs-none"},
    {"name": "SSL_CERT_FILE", "value": "/store-ca/ca-bundle"}])
c.setdefault("volumeMounts", []).append({"name": "store-ca", "mountPath": "/store-ca", "readOnly": True})
spec.setdefault("volumes", []).append({"name": "store-ca", "secret": {"secretName": "store-ca"}})
print(json.dumps(ds))
PY
k apply -f "$W/velero-node-agent-ds.json" >/dev/null || die "applying Velero's node-agent DaemonSet failed"
wait_until 180 "the Ready pod of Velero's node-agent on $NODE" ds_pod_ready
vpod=$(k -n "$VNS" get pods -l name=node-agent --field-selector "spec.nodeName=$NODE" -o jsonpath='{.items[0].metadata.name}')
echo "  Velero's node agent $vpod Ready ($(k -n "$VNS" get pod "$vpod" -o jsonpath='{.spec.containers[0].image}'))"
save_velero_agent_log() { k -n "$VNS" logs "$vpod" >"$W/velero-node-agent.log" 2>&1 || true; }

# 1. The agent's b1, restored by Velero's data mover.
k delete namespace "$APP" --wait=true --timeout=120s >/dev/null || die "namespace $APP not deleted"
wait_until 120 "the volumes of $APP deleted" no_app_volumes
rrc=0; bounded "$W/restore-vel.out" "${vel_cmd[@]}" restore create r-vel --from-backup b1 --wait || rrc=$?
echo "  Restore r-vel (Velero's data mover): $(k -n "$VNS" get restore r-vel -o jsonpath='{.status.phase}'); DataDownloads: $(k -n "$VNS" get datadownloads -l velero.io/restore-name=r-vel -o jsonpath='{range .items[*]}{.spec.targetVolume.pvc}={.status.phase} node={.status.node} {.status.progress.bytesDone} {.status.message}; {end}')"
check "Velero's data mover restored the agent's b1: Restore r-vel Completed" [ "$(k -n "$VNS" get restore r-vel -o jsonpath='{.status.phase}')" = Completed ]
settle 120 running || true
for c in data logs; do
  got=$(tree_sum "$(voldir $c)" 2>/dev/null || echo none)
  check "Velero's data mover restored claim $c of the agent's snapshot byte-identical" [ "$got" = "${sums[$c]}" ]
done

# 2. A backup moved by Velero's data mover.
VAPP=dm-velero
k create namespace "$VAPP" >/dev/null
k apply -f - >/dev/null <<YAML
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: data, namespace: $VAPP}
spec:
  accessModes: [ReadWriteOnce]
  storageClassName: podvolume-csi
  resources: {requests: {storage: 64Mi}}
---
apiVersion: v1
kind: Pod
metadata: {name: writer, namespace: $VAPP}
spec:
  terminationGracePeriodSeconds: 1
  containers:
  - {name: app, image: $WORKLOAD_IMAGE, command: [sleep, infinity], volumeMounts: [{name: data, mountPath: /data}]}
  volumes: [{name: data, persistentVolumeClaim: {claimName: data}}]
YAML
vrunning() { [ "$(k -n "$VAPP" get pod writer -o jsonpath='{.status.phase}' 2>/dev/null)" = Running ]; }
wait_until 120 "pod $VAPP/writer Running" vrunning
vdir_of() { echo "/var/lib/kubelet/pods/$(k -n "$VAPP" get pod writer -o jsonpath='{.metadata.uid}')/volumes/kubernetes.io~csi/$(k -n "$VAPP" get pvc data -o jsonpath='{.spec.volumeName}')/mount"; }
d=$(vdir_of); rnd "$d/a/b/one.bin" 3333333; rnd "$d/two.bin" 12345; mkdir -p "$d/empty"; ln -s a/b/one.bin "$d/link"
vsum=$(tree_sum "$d"); vbytes=$(bytes "$d")
brc=0; bounded "$W/backup-vel.out" "${vel_cmd[@]}" backup create b-vel --include-namespaces "$VAPP" --snapshot-move-data --wait || brc=$?
echo "  Backup b-vel (Velero's data mover): $(k -n "$VNS" get backup b-vel -o jsonpath='{.status.phase}'); DataUploads: $(k -n "$VNS" get datauploads -l velero.io/backup-name=b-vel -o jsonpath='{range .items[*]}{.spec.sourcePVC}={.status.phase} node={.status.node} {.status.progress.bytesDone}/{.status.progress.totalBytes} {.status.message}; {end}')"
check "Velero's data mover moved b-vel: Backup Completed, DataUpload Completed" \
  [ "$(k -n "$VNS" get backup b-vel -o jsonpath='{.status.phase}')/$(k -n "$VNS" get datauploads -l velero.io/backup-name=b-vel -o jsonpath='{.items[0].status.phase}')" = Completed/Completed ]
save_velero_agent_log

# 3. Back to the agent, which restores b-vel.
stop_node_agent
start_our_agent
echo "  the agent's pod $ds_pod Ready again"
k delete namespace "$VAPP" --wait=true --timeout=120s >/dev/null || die "namespace $VAPP not deleted"
rrc=0; bounded "$W/restore-ours.out" "${vel_cmd[@]}" restore create r-ours --from-backup b-vel --wait || rrc=$?
echo "  Restore r-ours (the agent): $(k -n "$VNS" get restore r-ours -o jsonpath='{.status.phase}'); DataDownloads: $(k -n "$VNS" get datadownloads -l velero.io/restore-name=r-ours -o jsonpath='{range .items[*]}{.spec.targetVolume.pvc}={.status.phase} node={.status.node} {.status.progress.bytesDone} {.status.message}; {end}')"
check "the agent restored Velero's data mover's b-vel: Restore r-ours Completed, DataDownload Completed" \
  [ "$(k -n "$VNS" get restore r-ours -o jsonpath='{.status.phase}')/$(k -n "$VNS" get datadownloads -l velero.io/restore-name=r-ours -o jsonpath='{.items[0].status.phase}')" = Completed/Completed ]
settle 120 vrunning || true
got=$(tree_sum "$(vdir_of)" 2>/dev/null || echo none)
check "the agent restored Velero's snapshot byte-identical ($vbytes bytes, tree sha256 ${vsum:0:16}...)" [ "$got" = "$vsum" ]
settle 60 nothing_left || true
check "nothing exposed left after both directions: $(left_objects | tr '\n' ' ')" nothing_left
step_end

# --- cancel and restart ------------------------------------------------------------------------
# A claim with a 12 GiB sparse file: kopia reads its zeros for several seconds, long enough to be
# seen InProgress and stopped. The cancel case runs first: a completed snapshot would let the
# next backup of the same file finish at once (kopia's parent).
step_begin "data movement stopped: spec.cancel on an InProgress DataUpload, then the agent's pod deleted mid-transfer"
BIG=dm-big
k create namespace "$BIG" >/dev/null
k apply -f - >/dev/null <<YAML
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: big, namespace: $BIG}
spec:
  accessModes: [ReadWriteOnce]
  storageClassName: podvolume-csi
  resources: {requests: {storage: 16Gi}}
---
apiVersion: v1
kind: Pod
metadata: {name: writer, namespace: $BIG}
spec:
  terminationGracePeriodSeconds: 1
  containers:
  - {name: app, image: $WORKLOAD_IMAGE, command: [sleep, infinity], volumeMounts: [{name: big, mountPath: /big}]}
  volumes: [{name: big, persistentVolumeClaim: {claimName: big}}]
YAML
big_running() { [ "$(k -n "$BIG" get pod writer -o jsonpath='{.status.phase}' 2>/dev/null)" = Running ]; }
wait_until 120 "pod $BIG/writer Running" big_running
bigdir="/var/lib/kubelet/pods/$(k -n "$BIG" get pod writer -o jsonpath='{.metadata.uid}')/volumes/kubernetes.io~csi/$(k -n "$BIG" get pvc big -o jsonpath='{.spec.volumeName}')/mount"
truncate -s 12G "$bigdir/zeros.img"
head -c 1000 /dev/urandom >"$bigdir/head.bin"
big_bytes=$(bytes "$bigdir")
du_of() { k -n "$VNS" get datauploads -l "velero.io/backup-name=$1" -o jsonpath="{.items[0].$2}" 2>/dev/null; }
# The snapshot itself, not one of the short kopia commands before it (connect, policy): a pid
# taken while only those ran would be gone a moment later.
kopia_snapshot_pids() { pgrep -f '(^|/)kopia snapshot create' | tr '\n' ' ' || true; }
du_in_progress() { [ "$(du_of "$1" status.phase)" = InProgress ] && [ -n "$(kopia_snapshot_pids)" ]; }
du_ended() { case "$(du_of "$1" status.phase)" in Completed | Failed | Canceled) return 0 ;; *) return 1 ;; esac; }
backup_ended() { case "$(k -n "$VNS" get backup "$1" -o jsonpath='{.status.phase}' 2>/dev/null)" in Completed | PartiallyFailed | Failed) return 0 ;; *) return 1 ;; esac; }
no_kopia() { [ -z "$(pgrep -x kopia)" ]; }

# Cancel: what Velero's server does on an item-operation timeout or its own restart.
"${vel_cmd[@]}" backup create b-cancel --include-namespaces "$BIG" --snapshot-move-data >/dev/null 2>&1 || die "velero backup create b-cancel failed"
wait_until 180 "the DataUpload of b-cancel InProgress with kopia running" du_in_progress b-cancel
kopia_pids=$(kopia_snapshot_pids)
hold=$(k -n "$VNS" get pod "$(du_of b-cancel metadata.name)" -o json 2>/dev/null || echo '{}')
hold_field() { python3 -c 'import json,sys; v=json.loads(sys.argv[1])
for k in sys.argv[2].split("."): v=(v[int(k)] if isinstance(v, list) else v.get(k, {})) if v != {} else {}
print(v if v != {} else "")' "$hold" "$1"; }
check "ConfigMap: the hold pod has podLabels, podAnnotations, podResources and loadAffinity" \
  [ "$(hold_field metadata.labels.team)/$(hold_field metadata.annotations.podvolume-test/by)/$(hold_field spec.containers.0.resources.limits.memory)/$(hold_field spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms.0.matchExpressions.0.key)" \
    = "storage/configmap/256Mi/kubernetes.io/os" ]
t0=$(date +%s.%N)
k -n "$VNS" patch datauploads "$(du_of b-cancel metadata.name)" --type merge -p '{"spec":{"cancel":true}}' >/dev/null
settle 60 du_ended b-cancel || true
t1=$(date +%s.%N)
settle 30 no_kopia || true
cancel_s=$(python3 -c "print('%.1f' % ($t1 - $t0))")
echo "  b-cancel: DataUpload $(du_of b-cancel status.phase) $cancel_s s after spec.cancel: $(du_of b-cancel status.message)"
check "spec.cancel: the DataUpload ends Canceled" [ "$(du_of b-cancel status.phase)" = Canceled ]
check "spec.cancel: kopia ($kopia_pids) stopped, no kopia left on the node" no_kopia
settle 60 nothing_left || true
check "spec.cancel: nothing exposed left: $(left_objects | tr '\n' ' ')" nothing_left
settle 120 backup_ended b-cancel || true
check "spec.cancel: Backup b-cancel ended PartiallyFailed (got $(k -n "$VNS" get backup b-cancel -o jsonpath='{.status.phase}'))" \
  [ "$(k -n "$VNS" get backup b-cancel -o jsonpath='{.status.phase}')" = PartiallyFailed ]

# Restart: the agent's pod deleted (SIGTERM) while it moves the data; the new pod runs it again.
"${vel_cmd[@]}" backup create b-restart --include-namespaces "$BIG" --snapshot-move-data >/dev/null 2>&1 || die "velero backup create b-restart failed"
wait_until 180 "the DataUpload of b-restart InProgress with kopia running" du_in_progress b-restart
kopia_pids=$(kopia_snapshot_pids)
old_pod=$ds_pod
save_agent_log
t0=$SECONDS
k -n "$VNS" delete pod "$old_pod" --wait=false >/dev/null
old_kopia_gone() { local p; for p in $kopia_pids; do [ -e "/proc/$p" ] && return 1; done; return 0; }
settle 90 old_kopia_gone || true
check "restart: the old pod's kopia ($kopia_pids) stopped with it" old_kopia_gone
new_ready() {
  local name
  name=$(k -n "$VNS" get pods -l name=node-agent --field-selector "spec.nodeName=$NODE" \
    -o jsonpath='{range .items[*]}{.metadata.name} {.status.conditions[?(@.type=="Ready")].status} {.metadata.deletionTimestamp}{"\n"}{end}' 2>/dev/null \
    | awk -v old="$old_pod" '$1 != old && $2 == "True" && $3 == "" {print $1}')
  [ -n "$name" ] && ds_pod=$name
}
wait_until 180 "a new Ready agent pod on $NODE" new_ready
ds_uid=$(k -n "$VNS" get pod "$ds_pod" -o jsonpath='{.metadata.uid}')
echo "  new agent pod $ds_pod Ready $((SECONDS - t0)) s after the old one was deleted"
settle "$TIMEOUT" du_ended b-restart || true
settle 120 backup_ended b-restart || true
echo "  b-restart: DataUpload $(du_of b-restart status.phase), attempts $(du_of b-restart 'metadata.annotations.podvolume-agent\.io/attempts'), $(du_of b-restart status.progress.bytesDone)/$(du_of b-restart status.progress.totalBytes): $(du_of b-restart status.message)"
check "restart: the DataUpload ran again (attempts 2) and Completed" \
  [ "$(du_of b-restart status.phase)/$(du_of b-restart 'metadata.annotations.podvolume-agent\.io/attempts')" = Completed/2 ]
check "restart: bytesDone = totalBytes = $big_bytes" \
  [ "$(du_of b-restart status.progress.bytesDone)/$(du_of b-restart status.progress.totalBytes)" = "$big_bytes/$big_bytes" ]
check "restart: Backup b-restart Completed" [ "$(k -n "$VNS" get backup b-restart -o jsonpath='{.status.phase}')" = Completed ]
settle 60 nothing_left || true
check "restart: nothing exposed left: $(left_objects | tr '\n' ' ')" nothing_left
check "restart: no kopia left on the node" no_kopia
step_end

# --- an exposure that never becomes ready ------------------------------------------------------------
# The ConfigMap's backupPVC sends the snapshot's claim to a storage class that does not exist: the
# claim stays Pending, the hold pod unschedulable. With --data-mover-prepare-timeout 20s the
# DataUpload ends Failed saying so, and everything exposed is removed.
step_begin "an exposure that never becomes ready: --data-mover-prepare-timeout 20s, backupPVC to a missing class"
k -n "$VNS" create configmap node-agent-config-2 --from-literal=node-agent-config.json='{
  "backupPVC": {"podvolume-csi": {"storageClass": "no-such-class"}}}' >/dev/null
old_pod=$ds_pod
save_agent_log
k -n "$VNS" set env daemonset/node-agent NODE_AGENT_CONFIGMAP=node-agent-config-2 DATA_MOVER_PREPARE_TIMEOUT=20s >/dev/null
wait_until 180 "the agent's pod replaced with the new settings" new_ready
ds_uid=$(k -n "$VNS" get pod "$ds_pod" -o jsonpath='{.metadata.uid}')
rm -f "$bigdir/zeros.img"
"${vel_cmd[@]}" backup create b-unready --include-namespaces "$BIG" --snapshot-move-data >/dev/null 2>&1 || die "velero backup create b-unready failed"
settle 180 du_ended b-unready || true
msg=$(du_of b-unready status.message)
echo "  b-unready: DataUpload $(du_of b-unready status.phase): $msg"
check "prepare timeout: the DataUpload Failed" [ "$(du_of b-unready status.phase)" = Failed ]
check "prepare timeout: its message says why (not mounted within 20s; the claim Pending, its class missing)" \
  python3 -c 'import sys; m=sys.argv[1]; sys.exit(not ("within 20s" in m and "Pending" in m and "StorageClass no-such-class does not exist" in m))' "$msg"
settle 60 nothing_left || true
check "prepare timeout: nothing exposed left: $(left_objects | tr '\n' ' ')" nothing_left
settle 120 backup_ended b-unready || true
check "prepare timeout: Backup b-unready ended PartiallyFailed" [ "$(k -n "$VNS" get backup b-unready -o jsonpath='{.status.phase}')" = PartiallyFailed ]
step_end

# --- a node lost mid-transfer ------------------------------------------------------------------
# A DataUpload InProgress on a node that no longer exists (as Velero's node agent or ours left it
# when the node went away): nobody would ever end it. The agent of any other node ends it Failed
# with the cause and releases its finalizer, so the object can go with its backup.
step_begin "a node lost mid-transfer: a DataUpload InProgress on a node that no longer exists"
k apply -f - >/dev/null <<YAML
apiVersion: velero.io/v2alpha1
kind: DataUpload
metadata:
  name: du-lost-node
  namespace: $VNS
  finalizers: [velero.io/data-upload-download-finalizer]
  labels: {velero.io/backup-name: b-lost-node}
spec:
  snapshotType: CSI
  csiSnapshot: {volumeSnapshot: velero-gone-abcde, storageClass: podvolume-csi, snapshotClass: podvolume-csi}
  sourcePVC: big
  sourceNamespace: $BIG
  backupStorageLocation: default
  operationTimeout: 10m0s
status:
  phase: InProgress
  node: dm-gone
  acceptedByNode: dm-gone
  startTimestamp: "2026-01-01T00:00:00Z"
  progress: {totalBytes: 1000, bytesDone: 500}
YAML
lost_ended() { [ "$(k -n "$VNS" get datauploads du-lost-node -o jsonpath='{.status.phase}')" = Failed ]; }
settle 60 lost_ended || true
msg=$(k -n "$VNS" get datauploads du-lost-node -o jsonpath='{.status.message}')
echo "  du-lost-node: $(k -n "$VNS" get datauploads du-lost-node -o jsonpath='{.status.phase}'): $msg"
check "node lost: the DataUpload ended Failed, saying node dm-gone no longer exists" \
  python3 -c 'import sys; sys.exit("node dm-gone no longer exists" not in sys.argv[1])' "$msg"
check "node lost: its finalizer released" [ -z "$(k -n "$VNS" get datauploads du-lost-node -o jsonpath='{.metadata.finalizers}')" ]
step_end

save_agent_log
check "ConfigMap: the agent took loadConcurrency's rule for $NODE (2 at once)" grep -q 'concurrency.*2.*loadConcurrency\|loadConcurrency.*concurrency.*2' "$W/agent.log"
verr=$(grep -c 'level=error' "$W/velero-server.log" || true)
echo "  velero server log: $(wc -l <"$W/velero-server.log") lines, $verr level=error"
echo "== velero-datamover-smoke: Velero $VELERO_VERSION, $csi_versions, $emulator, kopia $uploader_version =="
printf '%s\n' "${steps[@]}"
if [ ${#failed[@]} -eq 0 ]; then
  say "velero-datamover-smoke: every check passed"
else
  exit 1
fi
}
