# The set-up that scripts/velero-datamover-smoke.sh and scripts/bench-datamover.sh share
# (sourced after tools/velero-smoke/lib.sh, with root, W, PROVIDER, VELERO_VERSION, UPLOADER,
# KOPIA_VERSION, NODE, VNS, BUCKET, PREFIX and TIMEOUT set): the tools, the control plane and the
# real node with CSI storage and snapshots, fake-gcs-server over TLS, Velero (its server as a
# host process, with --features=EnableCSI) and the agent as the DaemonSet node-agent with a
# node-agent ConfigMap. Defines start_our_agent, stop_node_agent, save_agent_log.
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
  # The benchmark measures the release build (AGENT_PROFILE=release), the smoke the debug one.
  profile=${AGENT_PROFILE:-debug}
  (cd "$root" && cargo build --quiet $([ "$profile" = release ] && echo --release) --bin podvolume-agent --bin kubectl-podvolume) \
    || die "cargo build failed"
  agent_image=$W/image
  base=()
  [ -f "$root/target/test-tools/image-base.tar" ] && base=(--base "$root/target/test-tools/image-base.tar")
  "$root/scripts/build-image.sh" --oci "$agent_image" --agent "${CARGO_TARGET_DIR:-$root/target}/$profile/podvolume-agent" "${base[@]}" \
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
