#!/usr/bin/env bash
# The real Velero server with its own Azure or Google Cloud plugin drives the agent against a
# real Blob Storage / GCS server: a backup, a restore byte for byte, a deletion.
#
#   scripts/velero-cloud-smoke.sh azure            # Velero 1.18.3, kopia, Azurite
#   scripts/velero-cloud-smoke.sh gcp              # Velero 1.18.3, kopia, fake-gcs-server
#   scripts/velero-cloud-smoke.sh gcp 1.16.2       # Velero 1.16.2 with --uploader-type=restic
#
# (Azure with restic cannot run against Azurite: restic 0.18 sends an empty x-ms-access-tier
# header unless told a tier, which Azurite rejects, and Velero's server runs `restic init` and
# `restic forget` with no option of ours. tests/cloud_cli.rs covers restic on Azurite with
# --restic-option azure.access-tier=Hot.)
#
# What it starts (all stopped on exit; needs root): the control plane and a real node, as
# scripts/velero-smoke.sh (tools/velero-smoke/lib.sh); the emulator on the node's address behind
# TLS with a CA made here; `velero install --provider azure|gcp` with Velero's plugin (built by
# scripts/install-velero-cloud-plugins.sh), the agent's manifests (`kubectl apply -k daemonset/`),
# and `velero server` as a host process with the provider's plugin.
#   - Azure: Azurite with an account of its own (random key), reached as in production at
#     https://<account>.blob.podvolume.test:<port> (config.storageAccountURI); the name resolves to
#     the node's address through the agent pod's hostAliases and, for the server, an /etc/hosts
#     of its own mount namespace. The key is the credentials file's entry that
#     config.storageAccountKeyEnvVar names, as Velero needs for access-key authentication.
#   - GCP: fake-gcs-server; a service-account key file (an RSA key of its own) as the credentials.
#     Velero's kopia path has no endpoint setting for GCS, so STORAGE_EMULATOR_HOST (honoured by
#     Google's Go client, in Velero's server, its plugin, kopia and restic) points the server and
#     the agent's pod at the emulator; the server trusts the CA through SSL_CERT_FILE (its GCS
#     code ignores caCert), the agent through the location's caCert as with any provider.
#
# Checks: the BackupRepository Ready (Velero created the repository); every PodVolumeBackup
# Completed by the agent with exact bytes; the snapshots in the repository where Velero put it
# (<prefix>/kopia/<ns>/ as default@default, or the PVBs' repoIdentifier gs:<bucket>:/<prefix>/restic/<ns>);
# the restore Completed and the trees identical; `velero backup delete` -> the snapshots gone.
#
# Environment: VELERO_SMOKE_DIR, VELERO_SMOKE_KEEP, VELERO_SMOKE_TIMEOUT, PODVOLUME_IMAGE as
# scripts/velero-smoke.sh.
set -euo pipefail
{
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
tools=$root/tools/velero-smoke
PROVIDER=${1:-}
VELERO_VERSION=${2:-1.18.3}
VELERO_VERSION=${VELERO_VERSION#v}
case $VELERO_VERSION in
  1.18.*) UPLOADER=kopia ;;
  1.16.*) UPLOADER=restic ;;
  *) echo "velero-cloud-smoke.sh: Velero $VELERO_VERSION is not one this script knows (1.18.3, 1.16.2)" >&2; exit 2 ;;
esac
case $PROVIDER in
  azure | gcp) ;;
  *) echo "usage: velero-cloud-smoke.sh azure|gcp [1.18.3|1.16.2]" >&2; exit 2 ;;
esac
if [ "$PROVIDER/$UPLOADER" = azure/restic ]; then
  echo "velero-cloud-smoke.sh: Azure with restic cannot run against Azurite (see this script's header)" >&2
  exit 2
fi
KOPIA_VERSION=0.22.3
NODE=cloud-node
VNS=velero
APP=cloud-app
APP2=cloud-app-restored
BUCKET=velero-$PROVIDER
PREFIX=backups
ACCOUNT=pvsmoke
DOMAIN=blob.podvolume.test
TIMEOUT=${VELERO_SMOKE_TIMEOUT:-300}
unset AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY AWS_SHARED_CREDENTIALS_FILE KUBECONFIG VELERO_NAMESPACE NODE_NAME \
  KOPIA_PASSWORD KOPIA_CONFIG_PATH RESTIC_REPOSITORY RESTIC_PASSWORD_FILE GOOGLE_APPLICATION_CREDENTIALS \
  STORAGE_EMULATOR_HOST SSL_CERT_FILE AZURE_CREDENTIALS_FILE AZURE_STORAGE_KEY AZURE_ACCOUNT_KEY

source "$tools/lib.sh"
W=${VELERO_SMOKE_DIR:-}
if [ -z "$W" ]; then W=$(mktemp -d /tmp/velero-cloud-smoke.XXXXXX); else mkdir -p "$W"; W=$(cd "$W" && pwd); fi
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
say "work directory: $W ($PROVIDER, Velero $VELERO_VERSION, $UPLOADER)"

# --- tools -----------------------------------------------------------------------------------------
step_begin "tools (install scripts, cached)"
[ "$(id -u)" -eq 0 ] || die "needs root: it runs a real node"
cp_bin=$("$root/scripts/install-control-plane.sh") || die "scripts/install-control-plane.sh failed"
node_bin=$("$root/scripts/install-node.sh") || die "scripts/install-node.sh failed"
read -r v vdir < <("$root/scripts/install-velero.sh" "$VELERO_VERSION") || die "scripts/install-velero.sh failed"
velero=$vdir/velero
plugin=$("$root/scripts/install-velero-cloud-plugins.sh" | grep "velero-plugin-for-$([ "$PROVIDER" = azure ] && echo microsoft-azure || echo gcp)\$") \
  || die "scripts/install-velero-cloud-plugins.sh failed"
read -r azurite fake_gcs < <("$root/scripts/install-cloud-emulators.sh") || die "scripts/install-cloud-emulators.sh failed"
read -r restic_version restic < <("$root/scripts/install-restic.sh") || die "scripts/install-restic.sh failed"
read -r v kopia < <("$root/scripts/install-kopia.sh" "$KOPIA_VERSION") || die "scripts/install-kopia.sh failed"
plugin_version=$(go version -m "$plugin" | awk '$1 == "mod" && $2 ~ /velero-plugin-for/ { print $3 }')
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
kubectl=$cp_bin/kubectl
if [ "$PROVIDER" = azure ]; then emulator="azurite $("$azurite" --version)"; else emulator="fake-gcs-server $(cat "$(dirname "$fake_gcs")/version")"; fi
if [ "$UPLOADER" = kopia ]; then uploader_version=$("$kopia" --version | head -n1 | cut -d' ' -f1); else uploader_version=$restic_version; fi
echo "  velero $VELERO_VERSION + $(basename "$plugin") $plugin_version, $emulator, $UPLOADER $uploader_version"
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
echo "  $apiserver; Node $NODE Ready at $node_ip"
step_end

# --- the object store ----------------------------------------------------------------------------
step_begin "$emulator on $node_ip, TLS with a private CA"
mkdir -p "$W/store"
(
  cd "$W/store"
  openssl req -x509 -newkey rsa:2048 -nodes -days 2 -keyout ca.key -out ca.pem -subj "/CN=velero-cloud-smoke CA" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
  openssl req -newkey rsa:2048 -nodes -keyout server.key -out server.csr -subj "/CN=$node_ip" 2>/dev/null
  printf 'subjectAltName=IP:%s,DNS:localhost,DNS:*.%s\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n' "$node_ip" "$DOMAIN" >server.ext
  openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 -out server.pem \
    -extfile server.ext 2>/dev/null
  # Go's roots plus ours, for the processes that take no CA setting (SSL_CERT_FILE).
  cat /etc/ssl/certs/ca-certificates.crt ca.pem >bundle.pem
) || die "openssl could not make the certificates"
store_port=$(free_port)
listening() { (exec 3<>"/dev/tcp/$node_ip/$store_port") 2>/dev/null; }
# A mount namespace whose /etc/hosts resolves the account's name to the node (the server's).
printf '127.0.0.1 localhost\n%s %s.%s\n' "$node_ip" "$ACCOUNT" "$DOMAIN" >"$W/hosts"
ns_cmd=(unshare --mount --propagation private sh -c 'mount --bind "$0" /etc/hosts && exec "$@"' "$W/hosts")
in_ns() { "${ns_cmd[@]}" "$@"; }
if [ "$PROVIDER" = azure ]; then
  key=$(head -c 64 /dev/urandom | base64 -w0)
  start_group azurite 5 "$W/store/azurite.log" env AZURITE_ACCOUNTS="$ACCOUNT:$key" "$azurite" \
    --blobHost "$node_ip" --blobPort "$store_port" --location "$W/store/data" --skipApiVersionCheck --loose \
    --cert "$W/store/server.pem" --key "$W/store/server.key"
  wait_until 60 "Azurite listening" listening
  python3 "$root/tests/cloud/azure_container.py" create "https://$node_ip:$store_port/$ACCOUNT" "$ACCOUNT" "$key" "$BUCKET" "$W/store/ca.pem" \
    || die "creating container $BUCKET failed"
  (umask 077; printf 'AZURE_STORAGE_ACCOUNT_ACCESS_KEY=%s\nAZURE_CLOUD_NAME=AzurePublicCloud\n' "$key" >"$W/cloud")
  account_uri=https://$ACCOUNT.$DOMAIN:$store_port
  bsl_config="storageAccount=$ACCOUNT,storageAccountKeyEnvVar=AZURE_STORAGE_ACCOUNT_ACCESS_KEY,storageAccountURI=$account_uri,resourceGroup=podvolume,subscriptionId=00000000-0000-0000-0000-000000000000"
  echo "  $account_uri, container $BUCKET, account key in the credentials file's AZURE_STORAGE_ACCOUNT_ACCESS_KEY"
else
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
fi
step_end

# --- Velero and the agent ----------------------------------------------------------------------------
step_begin "velero install --provider $PROVIDER + kubectl apply -k daemonset/"
mkdir -p "$W/home"
vel_cmd=(env HOME="$W/home" "$velero" --kubeconfig "$admin_kc" --namespace "$VNS")
vel() { "${vel_cmd[@]}" "$@"; }
vel install --provider "$PROVIDER" --plugins "velero/$(basename "$plugin"):$plugin_version" --bucket "$BUCKET" --prefix "$PREFIX" \
  --secret-file "$W/cloud" --cacert "$W/store/ca.pem" --backup-location-config "$bsl_config" \
  --use-volume-snapshots=false --uploader-type "$UPLOADER" >"$W/velero-install.log" 2>&1 \
  || die "velero install failed: $(tail -n 20 "$W/velero-install.log")"
k apply -k "$root/daemonset/" -l app.kubernetes.io/name=podvolume-agent >"$W/daemonset-apply.log" 2>&1 \
  || die "kubectl apply -k daemonset/ failed: $(cat "$W/daemonset-apply.log")"
# What a cluster with this store needs of the agent's pod, and nothing else: the account's name
# resolved (Azure; DNS in production), or the emulator's address (GCS; no such variable in
# production).
if [ "$PROVIDER" = azure ]; then
  k -n "$VNS" patch daemonset node-agent --type merge \
    -p "{\"spec\":{\"template\":{\"spec\":{\"hostAliases\":[{\"ip\":\"$node_ip\",\"hostnames\":[\"$ACCOUNT.$DOMAIN\"]}]}}}}" >/dev/null
else
  k -n "$VNS" set env daemonset/node-agent STORAGE_EMULATOR_HOST="$emulator_host" GOOGLE_ACCESS_TOKEN=emulator-needs-none >/dev/null
fi
wait_until 180 "the Ready pod of DaemonSet node-agent on $NODE" ds_pod_ready
ds_pod=$(k -n "$VNS" get pods -l name=node-agent --field-selector "spec.nodeName=$NODE" -o jsonpath='{.items[0].metadata.name}')
ds_uid=$(k -n "$VNS" get pod "$ds_pod" -o jsonpath='{.metadata.uid}')
save_agent_log() { cat /var/log/pods/"${VNS}_${ds_pod}_${ds_uid}"/node-agent/*.log >"$W/agent.log" 2>/dev/null || true; }
agent_log_saver=save_agent_log
k -n "$VNS" scale deployment velero --replicas=0 >/dev/null
token_kubeconfig velero "$W/velero-sa.kubeconfig"
echo "  agent pod $ds_pod Ready on $NODE ($([ "$PROVIDER" = azure ] && echo "hostAliases $ACCOUNT.$DOMAIN -> $node_ip" || echo "STORAGE_EMULATOR_HOST=$emulator_host"))"
step_end

step_begin "velero server (host process) with $(basename "$plugin")"
port_free 8080 || die "port 8080 is taken (velero server's metrics server binds :8080)"
mkdir -p "$W/velero/tmp" "$W/velero/home" "$W/velero/scratch" "$W/velero/credentials" "$W/velero/plugins" "$W/velero/bin"
ln -s "$plugin" "$W/velero/plugins/"
(umask 077; k -n "$VNS" get secret cloud-credentials -o jsonpath='{.data.cloud}' | base64 -d >"$W/velero/credentials/cloud")
# Velero 1.16 runs restic itself (init, forget): restic with every backend first on its PATH.
ln -s "$restic" "$W/velero/bin/restic"
server_env=(TMPDIR="$W/velero/tmp" HOME="$W/velero/home" VELERO_SCRATCH_DIR="$W/velero/scratch" VELERO_NAMESPACE="$VNS"
  PATH="$W/velero/bin:$PATH")
if [ "$PROVIDER" = azure ]; then
  server_env+=(AZURE_CREDENTIALS_FILE="$W/velero/credentials/cloud")
  wrap=("${ns_cmd[@]}")
else
  server_env+=(GOOGLE_APPLICATION_CREDENTIALS="$W/velero/credentials/cloud" STORAGE_EMULATOR_HOST="$emulator_host"
    SSL_CERT_FILE="$W/store/bundle.pem" GOOGLE_ACCESS_TOKEN=emulator-needs-none)
  wrap=()
fi
start_group velero-server 5 "$W/velero-server.log" "${wrap[@]}" env "${server_env[@]}" \
  "$velero" server --features= --uploader-type="$UPLOADER" --kubeconfig "$W/velero-sa.kubeconfig" --namespace "$VNS" \
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
step_begin "workload: a pod with two emptyDir volumes of random data"
k create namespace "$APP" >/dev/null
k apply -f - >/dev/null <<YAML
apiVersion: v1
kind: Pod
metadata:
  name: writer
  namespace: $APP
  annotations: {backup.velero.io/backup-volumes: "data,logs"}
spec:
  containers:
  - {name: app, image: $WORKLOAD_IMAGE, command: [sleep, infinity], volumeMounts: [{name: data, mountPath: /data}, {name: logs, mountPath: /logs}]}
  volumes: [{name: data, emptyDir: {}}, {name: logs, emptyDir: {}}]
YAML
running() { [ "$(k -n "$APP" get pod writer -o jsonpath='{.status.phase}' 2>/dev/null)" = Running ]; }
wait_until 60 "pod writer Running" running
voldir() { echo "/var/lib/kubelet/pods/$(k -n "$1" get pod "$2" -o jsonpath='{.metadata.uid}')/volumes/kubernetes.io~empty-dir/$3"; }
rnd() { mkdir -p "$(dirname "$1")"; head -c "$2" /dev/urandom >"$1"; }
d=$(voldir "$APP" writer data); rnd "$d/db/table.bin" $((3 * 1024 * 1024 + 5)); rnd "$d/conf/app.conf" 4099; chmod 0640 "$d/conf/app.conf"
d=$(voldir "$APP" writer logs); rnd "$d/app.log" $((1024 * 1024 + 77)); rnd "$d/old/app.log.1" 77777
python3 - "$W/expected.json" "$(voldir "$APP" writer data)" "$(voldir "$APP" writer logs)" <<'EOF'
import json, os, sys
out, dirs = sys.argv[1], dict(zip(["writer/data", "writer/logs"], sys.argv[2:]))
json.dump({k: sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs) for k, d in dirs.items()}, open(out, "w"))
EOF
echo "  bytes per volume: $(cat "$W/expected.json")"
step_end

# --- backup ---------------------------------------------------------------------------------------
step_begin "velero backup create b1 --include-namespaces $APP --wait"
brc=0; bounded "$W/backup-create.out" "${vel_cmd[@]}" backup create b1 --include-namespaces "$APP" --wait || brc=$?
step_end
k -n "$VNS" get podvolumebackups -l velero.io/backup-name=b1 -o json --show-managed-fields >"$W/pvbs.json"
k get crd podvolumebackups.velero.io -o json >"$W/crd-pvb.json"
bphase=$(k -n "$VNS" get backup b1 -o jsonpath='{.status.phase}')
echo "  Backup b1: $bphase; PodVolumeBackups: $(k -n "$VNS" get podvolumebackups -l velero.io/backup-name=b1 -o jsonpath='{range .items[*]}{.spec.volume}={.status.phase} {.status.message} {end}')"
check "velero backup create --wait returned 0" [ "$brc" -eq 0 ]
check "Backup b1 phase Completed" [ "$bphase" = Completed ]
repo_identifier=
[ "$UPLOADER" = restic ] && repo_identifier="gs:$BUCKET:/$PREFIX/restic/$APP"
pycheck pvbs "$W/pvbs.json" "$W/expected.json" "$NODE" "$UPLOADER" "$repo_identifier" "$W/crd-pvb.json"
brepo=$(k -n "$VNS" get backuprepositories -l "velero.io/volume-namespace=$APP" -o jsonpath='{range .items[*]}{.metadata.name} {.status.phase}{"\n"}{end}')
check "BackupRepository of $APP Ready (Velero created the repository): $brepo" grep -q " Ready$" <<<"$brepo"

# The repository where Velero looks, read with the uploader's own CLI (a connection of our own).
repo_password=$(k -n "$VNS" get secret velero-repo-credentials -o jsonpath='{.data.repository-password}' | base64 -d)
list_snapshots() { # <label>: the repository's snapshots as JSON into $W/<uploader>-<label>.json
  local d=$W/check/$1
  mkdir -p "$d"
  if [ "$UPLOADER" = kopia ]; then
    local kenv=(env -i PATH="$PATH" HOME="$d" KOPIA_PASSWORD="$repo_password" KOPIA_CHECK_FOR_UPDATES=false
      KOPIA_LOG_DIR="$d/logs" SSL_CERT_FILE="$W/store/bundle.pem")
    local connect
    if [ "$PROVIDER" = azure ]; then
      kenv+=(AZURE_STORAGE_KEY="$key")
      connect=(in_ns "${kenv[@]}" "$kopia" repository connect azure --container "$BUCKET" --storage-account "$ACCOUNT"
        --storage-domain "$DOMAIN:$store_port")
    else
      kenv+=(STORAGE_EMULATOR_HOST="$emulator_host")
      connect=("${kenv[@]}" "$kopia" repository connect gcs --bucket "$BUCKET" --credentials-file "$W/cloud")
    fi
    "${connect[@]}" --prefix "$PREFIX/kopia/$APP/" --config-file "$d/repository.config" --cache-directory "$d/cache" \
      --override-username=default --override-hostname=default --readonly >"$d/connect.log" 2>&1 \
      || { fail "kopia repository connect ($PROVIDER, prefix $PREFIX/kopia/$APP/): $(tail -n 3 "$d/connect.log")"; return 1; }
    local run=("${kenv[@]}")
    [ "$PROVIDER" = azure ] && run=(in_ns "${kenv[@]}")
    "${run[@]}" "$kopia" snapshot list --all --incomplete --json --config-file "$d/repository.config" >"$W/kopia-$1.json" 2>"$d/list.log" \
      || { fail "kopia snapshot list: $(tail -n 3 "$d/list.log")"; return 1; }
  else
    env -i PATH="$PATH" HOME="$d" RESTIC_PASSWORD="$repo_password" STORAGE_EMULATOR_HOST="$emulator_host" \
      GOOGLE_ACCESS_TOKEN=emulator-needs-none GOOGLE_APPLICATION_CREDENTIALS="$W/cloud" \
      "$restic" --repo "$repo_identifier" --cacert "$W/store/ca.pem" --cache-dir "$d/cache" --no-lock snapshots --json \
      >"$W/restic-$1.json" 2>"$d/snapshots.log" || { fail "restic snapshots ($repo_identifier): $(tail -n 3 "$d/snapshots.log")"; return 1; }
  fi
}
if list_snapshots after-backup; then pycheck "$UPLOADER" "$W/$UPLOADER-after-backup.json" "$W/pvbs.json" "$APP"; fi

# --- restore --------------------------------------------------------------------------------------
step_begin "velero restore create r1 --from-backup b1 --namespace-mappings $APP:$APP2 --wait"
rrc=0; bounded "$W/restore-create.out" "${vel_cmd[@]}" restore create r1 --from-backup b1 --namespace-mappings "$APP:$APP2" --wait || rrc=$?
step_end
restored_running() { [ "$(k -n "$APP2" get pod writer -o jsonpath='{.status.phase}' 2>/dev/null)" = Running ]; }
settle 30 restored_running || echo "  (the restored pod is not Running 30 s after the restore)"
k -n "$VNS" get restore r1 -o json >"$W/restore-r1.json"
k -n "$VNS" get podvolumerestores -l velero.io/restore-name=r1 -o json --show-managed-fields >"$W/pvrs.json"
k get crd podvolumerestores.velero.io -o json >"$W/crd-pvr.json"
rphase=$(k -n "$VNS" get restore r1 -o jsonpath='{.status.phase}')
echo "  Restore r1: $rphase; PodVolumeRestores: $(k -n "$VNS" get podvolumerestores -l velero.io/restore-name=r1 -o jsonpath='{range .items[*]}{.spec.volume}={.status.phase} {.status.message} {end}')"
check "velero restore create --wait returned 0" [ "$rrc" -eq 0 ]
check "Restore r1 phase Completed" [ "$rphase" = Completed ]
pycheck pvrs "$W/pvrs.json" "$W/pvbs.json" "$W/expected.json" "$NODE" "$W/restore-r1.json" "$W/crd-pvr.json"
for vol in data logs; do
  pycheck same-tree "$(voldir "$APP" writer "$vol")" "$(voldir "$APP2" writer "$vol")" "$APP2/writer/$vol" "$(k -n "$VNS" get restore r1 -o jsonpath='{.metadata.uid}')"
done

# --- delete ---------------------------------------------------------------------------------------
step_begin "velero backup delete b1 --confirm (until the Backup is gone)"
bounded "$W/backup-delete.out" "${vel_cmd[@]}" backup delete b1 --confirm || fail "velero backup delete b1: $(cat "$W/backup-delete.out")"
backup_gone() { ! k -n "$VNS" get backup b1 >/dev/null 2>&1; }
gone=0; settle "$TIMEOUT" backup_gone && gone=1
step_end
check "Backup b1 deleted" [ "$gone" = 1 ]
if list_snapshots after-delete; then pycheck gone "$W/$UPLOADER-after-delete.json" "$W/pvbs.json"; fi

save_agent_log
verr=$(grep -c 'level=error' "$W/velero-server.log" || true)
echo "  velero server log: $(wc -l <"$W/velero-server.log") lines, $verr level=error"
echo "== velero-cloud-smoke $PROVIDER: Velero $VELERO_VERSION + $(basename "$plugin") $plugin_version, $emulator, $UPLOADER $uploader_version =="
printf '%s\n' "${steps[@]}"
if [ ${#failed[@]} -eq 0 ]; then
  say "velero-cloud-smoke $PROVIDER: every check passed"
else
  exit 1
fi
}
