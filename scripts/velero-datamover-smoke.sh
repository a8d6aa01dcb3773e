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
# the faults: spec.cancel on an InProgress DataUpload
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

# --- tools -----------------------------------------------------------------------------------------
step_begin "tools (install scripts, cached)"
[ "$(id -u)" -eq 0 ] || die "needs root: it runs a real node"
cp_bin=$("$root/scripts/install-control-plane.sh") || die "scripts/install-control-plane.sh failed"
node_bin=$("$root/scripts/install-node.sh") || die "scripts/install-node.sh failed"
read -r v vdir < <("$root/scripts/install-velero.sh" "$VELERO_VERSION") || die "scripts/install-velero.sh failed"
velero=$vdir/velero
csi_bin=$("$root/scripts/install-csi.sh") || die "scripts/install-csi.sh failed"
plugin=$("$root/scripts/install-velero-cloud-plugins.sh" | grep "velero-plugin-for-gcp\$") \
  || die "scripts/install-velero-cloud-plugins.sh failed"
read -r azurite fake_gcs < <("$root/scripts/install-cloud-emulators.sh") || die "scripts/install-cloud-emulators.sh failed"
read -r v kopia < <("$root/scripts/install-kopia.sh" "$KOPIA_VERSION") || die "scripts/install-kopia.sh failed"
plugin_version=$(go version -m "$plugin" | awk '$1 == "mod" && $2 ~ /velero-plugin-for/ { print $3 }')
if [ -n "${PODVOLUME_IMAGE:-}" ]; then
  agent_image=$PODVOLUME_IMAGE
else
  (cd "$root" && cargo build --quiet --bin podvolume-agent --bin kubectl-podvolume) || die "cargo build failed"
  agent_image=$W/image
  base=()
  [ -f "$root/target/test-tools/image-base.tar" ] && base=(--base "$root/target/test-tools/image-base.tar")
  "$root/scripts/build-image.sh" --oci "$agent_image" --agent "$root/target/debug/podvolume-agent" "${base[@]}" \
    >"$W/build-image.log" 2>&1 || die "scripts/build-image.sh --oci failed: $(tail -n 20 "$W/build-image.log")"
fi
kubectl=$cp_bin/kubectl
emulator="fake-gcs-server $(cat "$(dirname "$fake_gcs")/version")"
uploader_version=$("$kopia" --version | head -n1 | cut -d' ' -f1)
csi_versions="external-snapshotter $("$csi_bin/csi-snapshotter" --version 2>&1 | awk '{print $NF}'), external-provisioner $("$csi_bin/csi-provisioner" --version 2>&1 | awk '{print $NF}'), the tests' hostpath CSI driver"
echo "  velero $VELERO_VERSION + $(basename "$plugin") $plugin_version, $emulator, kopia $uploader_version; $csi_versions"
step_end

# --- control plane + node --------------------------------------------------------------------------
step_begin "control plane + the real node $NODE"
cp_started=1
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
agent_ref=$(sed -n 's/^ *image: *//p' "$root/daemonset/daemonset.yaml")
"$root/scripts/start-node.sh" --import "$W/node" "$agent_ref" "$agent_image:latest" 2>>"$W/node.log" \
  || die "importing the agent's image failed: $(tail -n 5 "$W/node.log")"
"$root/scripts/start-node.sh" --make-image "$W/node" "docker.io/velero/velero:v$VELERO_VERSION" /velero \
  "/velero=$velero" "/velero-restore-helper=$vdir/velero-restore-helper" 2>>"$W/node.log" \
  || die "making Velero's image failed: $(tail -n 5 "$W/node.log")"
WORKLOAD_IMAGE=podvolume.test/busybox:1
csi_dir=$W/csi
CSI_BIN=$csi_bin CONTROL_PLANE_BIN=$cp_bin "$root/scripts/start-csi.sh" "$W/cp" "$W/node" "$csi_dir" >"$W/csi.env" 2>"$W/csi.log" \
  || die "scripts/start-csi.sh failed: $(tail -n 30 "$W/csi.log")"
echo "  $apiserver; Node $NODE Ready at $node_ip; CSI storage class podvolume-csi with snapshots"
step_end

# --- the object store ----------------------------------------------------------------------------
step_begin "$emulator on $node_ip, TLS with a private CA"
mkdir -p "$W/store"
(
  cd "$W/store"
  openssl req -x509 -newkey rsa:2048 -nodes -days 2 -keyout ca.key -out ca.pem -subj "/CN=velero-cloud-smoke CA" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
  openssl req -newkey rsa:2048 -nodes -keyout server.key -out server.csr -subj "/CN=$node_ip" 2>/dev/null
  printf 'subjectAltName=IP:%s,DNS:localhost\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n' "$node_ip" >server.ext
  openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 -out server.pem \
    -extfile server.ext 2>/dev/null
  # Go's roots plus ours, for the processes that take no CA setting (SSL_CERT_FILE).
  cat /etc/ssl/certs/ca-certificates.crt ca.pem >bundle.pem
) || die "openssl could not make the certificates"
store_port=$(free_port)
listening() { (exec 3<>"/dev/tcp/$node_ip/$store_port") 2>/dev/null; }
start_group fake-gcs-server 5 "$W/store/fake-gcs.log" "$fake_gcs" -scheme https -host "$node_ip" -port "$store_port" \
  -backend filesystem -filesystem-root "$W/store/data" -public-host "$node_ip:$store_port" \
  -external-url "https://$node_ip:$store_port" -cert-location "$W/store/server.pem" \
  -private-key-location "$W/store/server.key" -log-level warn
wait_until 60 "fake-gcs-server listening" listening
curl -fsS --cacert "$W/store/ca.pem" -X POST -d "{\"name\":\"$BUCKET\"}" "https://$node_ip:$store_port/storage/v1/b?project=podvolume" >/dev/null \
  || die "creating bucket $BUCKET failed"
pk=$(openssl genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:2048 2>/dev/null)
(umask 077; python3 -c 'import json,sys; print(json.dumps({"type": "service_account", "project_id": "podvolume",
  "private_key_id": "0123456789abcdef", "private_key": sys.argv[1], "client_email": "velero@podvolume.iam.gserviceaccount.com",
  "client_id": "1", "token_uri": "https://oauth2.googleapis.com/token"}))' "$pk" >"$W/cloud")
emulator_host=https://$node_ip:$store_port
bsl_config="storeEndpoint=$emulator_host/storage/v1/"
echo "  $emulator_host, bucket $BUCKET, a service-account key file as the credentials"
step_end

# --- Velero and the agent ----------------------------------------------------------------------------
step_begin "velero install --provider $PROVIDER + kubectl apply -k daemonset/"
mkdir -p "$W/home"
vel_cmd=(env HOME="$W/home" "$velero" --kubeconfig "$admin_kc" --namespace "$VNS")
vel() { "${vel_cmd[@]}" "$@"; }
vel install --provider "$PROVIDER" --plugins "velero/$(basename "$plugin"):$plugin_version" --bucket "$BUCKET" --prefix "$PREFIX" \
  --secret-file "$W/cloud" --cacert "$W/store/ca.pem" --backup-location-config "$bsl_config" \
  --use-volume-snapshots=false --uploader-type "$UPLOADER" --features=EnableCSI >"$W/velero-install.log" 2>&1 \
  || die "velero install failed: $(tail -n 20 "$W/velero-install.log")"
# Velero's node-agent ConfigMap, as a user of Velero's node agent has one: a per-node
# loadConcurrency rule, the data-movement pods' labels, annotations, resources and affinity.
k -n "$VNS" create configmap node-agent-config --from-literal=node-agent-config.json='{
  "loadConcurrency": {"globalConfig": 1, "perNodeConfig": [{"nodeSelector": {"matchLabels": {"kubernetes.io/hostname": "'"$NODE"'"}}, "number": 2}]},
  "loadAffinity": [{"nodeSelector": {"matchLabels": {"kubernetes.io/os": "linux"}}}],
  "podLabels": {"team": "storage"}, "podAnnotations": {"podvolume-test/by": "configmap"},
  "podResources": {"cpuRequest": "10m", "memoryLimit": "256Mi"}}' >/dev/null
# Our agent as the DaemonSet node-agent, with what its pod needs for this store and nothing else:
# the emulator's address (no such variable in production).
start_our_agent() {
  k apply -k "$root/daemonset/" -l app.kubernetes.io/name=podvolume-agent >"$W/daemonset-apply.log" 2>&1 \
    || die "kubectl apply -k daemonset/ failed: $(cat "$W/daemonset-apply.log")"
  k -n "$VNS" set env daemonset/node-agent STORAGE_EMULATOR_HOST="$emulator_host" GOOGLE_ACCESS_TOKEN=emulator-needs-none \
    NODE_AGENT_CONFIGMAP=node-agent-config >/dev/null
  wait_until 180 "the Ready pod of DaemonSet node-agent on $NODE" ds_pod_ready
  ds_pod=$(k -n "$VNS" get pods -l name=node-agent --field-selector "spec.nodeName=$NODE" -o jsonpath='{.items[0].metadata.name}')
  ds_uid=$(k -n "$VNS" get pod "$ds_pod" -o jsonpath='{.metadata.uid}')
}
# Every agent pod's log, in agent.log (one file per pod beside it).
save_agent_log() {
  [ -n "${ds_pod:-}" ] || return 0
  cat /var/log/pods/"${VNS}_${ds_pod}_${ds_uid}"/node-agent/*.log >"$W/agent-$ds_pod.log" 2>/dev/null || true
  cat "$W"/agent-*.log >"$W/agent.log" 2>/dev/null || true
}
# Removes whichever node-agent DaemonSet runs (ours or Velero's: the same name), and its pod.
no_agent_pod() { [ -z "$(k -n "$VNS" get pods -l name=node-agent -o name 2>/dev/null)" ]; }
stop_node_agent() {
  save_agent_log
  k -n "$VNS" delete daemonset node-agent --wait=true >/dev/null 2>&1 || true
  wait_until 120 "the node-agent pod gone" no_agent_pod
}
start_our_agent
agent_log_saver=save_agent_log
k -n "$VNS" scale deployment velero --replicas=0 >/dev/null
token_kubeconfig velero "$W/velero-sa.kubeconfig"
echo "  agent pod $ds_pod Ready on $NODE (STORAGE_EMULATOR_HOST=$emulator_host)"
step_end

step_begin "velero server (host process) with $(basename "$plugin")"
port_free 8080 || die "port 8080 is taken (velero server's metrics server binds :8080)"
mkdir -p "$W/velero/tmp" "$W/velero/home" "$W/velero/scratch" "$W/velero/credentials" "$W/velero/plugins" "$W/velero/bin"
ln -s "$plugin" "$W/velero/plugins/"
(umask 077; k -n "$VNS" get secret cloud-credentials -o jsonpath='{.data.cloud}' | base64 -d >"$W/velero/credentials/cloud")
server_env=(TMPDIR="$W/velero/tmp" HOME="$W/velero/home" VELERO_SCRATCH_DIR="$W/velero/scratch" VELERO_NAMESPACE="$VNS"
  PATH="$W/velero/bin:$PATH")
server_env+=(GOOGLE_APPLICATION_CREDENTIALS="$W/velero/credentials/cloud" STORAGE_EMULATOR_HOST="$emulator_host"
  SSL_CERT_FILE="$W/store/bundle.pem" GOOGLE_ACCESS_TOKEN=emulator-needs-none)
start_group velero-server 5 "$W/velero-server.log" env "${server_env[@]}" \
  "$velero" server --features=EnableCSI --uploader-type="$UPLOADER" --kubeconfig "$W/velero-sa.kubeconfig" --namespace "$VNS" \
  --plugin-dir "$W/velero/plugins" --metrics-address "127.0.0.1:$(free_port)" --profiler-address= --log-level info
velero_pg=${groups[-1]#*:}; velero_pg=${velero_pg%%:*}
bsl_available() {
  group_alive "$velero_pg" || die "velero server exited: $(tail -n 20 "$W/velero-server.log")"
  [ "$(k -n "$VNS" get bsl default -o jsonpath='{.status.phase}' 2>/dev/null)" = Available ]
}
wait_until "$TIMEOUT" "BackupStorageLocation default Available" bsl_available
echo "  BackupStorageLocation default ($PROVIDER) Available: $(k -n "$VNS" get bsl default -o jsonpath='{.spec.config}')"
step_end

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
plugin=$root/target/debug/kubectl-podvolume
[ -x "$plugin" ] || (cd "$root" && cargo build --quiet --bin kubectl-podvolume) || die "cargo build kubectl-podvolume failed"
"$plugin" --kubeconfig "$admin_kc" -n "$VNS" backup b1 --once -o json >"$W/podvolume-b1.json" 2>"$W/podvolume-b1.err" || true
"$plugin" --kubeconfig "$admin_kc" -n "$VNS" backup b1 --once >"$W/podvolume-b1.txt" 2>&1 || true
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
"$plugin" --kubeconfig "$admin_kc" -n "$VNS" restore r1 --once -o json >"$W/podvolume-r1.json" 2>"$W/podvolume-r1.err" || true
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
du_in_progress() { [ "$(du_of "$1" status.phase)" = InProgress ] && [ -n "$(pgrep -x kopia)" ]; }
du_ended() { case "$(du_of "$1" status.phase)" in Completed | Failed | Canceled) return 0 ;; *) return 1 ;; esac; }
backup_ended() { case "$(k -n "$VNS" get backup "$1" -o jsonpath='{.status.phase}' 2>/dev/null)" in Completed | PartiallyFailed | Failed) return 0 ;; *) return 1 ;; esac; }
no_kopia() { [ -z "$(pgrep -x kopia)" ]; }

# Cancel: what Velero's server does on an item-operation timeout or its own restart.
"${vel_cmd[@]}" backup create b-cancel --include-namespaces "$BIG" --snapshot-move-data >/dev/null 2>&1 || die "velero backup create b-cancel failed"
wait_until 180 "the DataUpload of b-cancel InProgress with kopia running" du_in_progress b-cancel
kopia_pids=$(pgrep -x kopia | tr '\n' ' ')
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
kopia_pids=$(pgrep -x kopia | tr '\n' ' ')
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
