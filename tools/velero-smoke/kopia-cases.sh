# Velero 1.18's kopia-only cases of scripts/velero-smoke.sh (sourced by it, never run alone):
# case 6, snapshots interchangeable with Velero's own kopia data path, and case 7, Velero's own
# node agent started beside ours. Each is a function run in the main script's context (its
# globals: k, vel_cmd, W, APP, VNS, NODE, kopia, the agent's process group...).

# --- case 6: the snapshots are interchangeable with Velero's own kopia data path ---------------------
case6_interchangeable_with_velero_data_path() {
# Velero 1.17+'s node agent moves file-system data in a pod it creates per PodVolumeBackup/Restore
# running `velero pod-volume backup|restore`. There is no kubelet here to run that pod, so the
# same command runs as a host process (tools/velero-smoke/velero-data-path.sh) on objects made as
# the node agent makes them, for a node with no agent of ours (Node $OTHER: our agent leaves its
# objects alone). 6a: Velero's data path restores a snapshot our agent made in case 1.
# 6b: Velero's data path backs up the same volume; our agent restores that snapshot.
OTHER=smoke-other
CROSS=smoke-cross
step_begin "case 6a: Velero's own kopia data path restores the snapshot our agent made of $APP/writer/data"
k apply -f - >/dev/null <<YAML
apiVersion: v1
kind: Node
metadata: {name: $OTHER, labels: {kubernetes.io/hostname: $OTHER, kubernetes.io/os: linux}}
YAML
k create namespace "$CROSS" >/dev/null
k -n "$CROSS" apply -f - >/dev/null <<YAML
apiVersion: v1
kind: Pod
metadata: {name: elsewhere}
spec:
  nodeName: $OTHER
  containers: [{name: app, image: $WORKLOAD_IMAGE, command: [sleep, infinity], volumeMounts: [{name: data, mountPath: /data}]}]
  volumes: [{name: data, emptyDir: {}}]
YAML
# in_progress_owner <Backup|Restore> <name>: an owner for the hand-made objects below, as Velero's
# server leaves a Backup/Restore while its transfers run (phase InProgress; the CRDs have no
# status subresource, so it is created so; Velero's controllers take up only New ones). The
# agent stops a transfer whose owner has ended, so r1 (Completed) cannot be theirs.
in_progress_owner() {
  local spec='{}'
  [ "$1" = Restore ] && spec='{backupName: b1}'
  k apply -f - >/dev/null <<YAML
apiVersion: velero.io/v1
kind: $1
metadata: {name: $2, namespace: $VNS}
spec: $spec
status: {phase: InProgress}
YAML
  k -n "$VNS" get "$(tr '[:upper:]' '[:lower:]' <<<"$1")" "$2" -o jsonpath='{.metadata.uid}'
}
r1_uid=$(in_progress_owner Restore cross)
ours_sid=$(k -n "$VNS" get podvolumebackups -l velero.io/backup-name=b1 -o jsonpath='{range .items[?(@.spec.volume=="data")]}{.status.snapshotID}{end}')
elsewhere_uid=$(k -n "$CROSS" get pod elsewhere -o jsonpath='{.metadata.uid}')
echo "  our snapshot of $APP/writer/data: $ours_sid"
# $1 name, $2 pod namespace, $3 pod name, $4 pod uid, $5 snapshot ID
pvr_yaml() {
  echo "apiVersion: velero.io/v1
kind: PodVolumeRestore
metadata:
  name: $1
  namespace: $VNS
  ownerReferences: [{apiVersion: velero.io/v1, kind: Restore, name: cross, uid: $r1_uid, controller: true}]
spec:
  pod: {kind: Pod, namespace: $2, name: $3, uid: $4}
  volume: data
  backupStorageLocation: default
  repoIdentifier: \"\"
  uploaderType: kopia
  snapshotID: $5
  sourceNamespace: $APP"
}
pvr_yaml velero-restores-ours "$CROSS" elsewhere "$elsewhere_uid" "$ours_sid" | k apply -f - | sed "s/^/  /"
# What Velero's node agent does before it starts the data-mover pod: the object InProgress (the
# CRDs have no status subresource).
k -n "$VNS" patch podvolumerestore velero-restores-ours --type=merge \
  -p '{"status":{"phase":"InProgress"}}' >/dev/null
mkdir -p "$W/cross/velero-restored"
# As the data-mover pod: the node's name, the cloud-credentials Secret (as the node agent's).
vdp_env() { # <work dir>
  mkdir -p "$1/tmp" "$1/home"
  echo env NODE_NAME="$OTHER" VELERO_NAMESPACE="$VNS" TMPDIR="$1/tmp" HOME="$1/home" \
    AWS_SHARED_CREDENTIALS_FILE="$W/velero/credentials/cloud"
}
vrc=0
bounded "$W/cross/vdp-restore.log" $(vdp_env "$W/cross/vdp-restore") "$tools/velero-data-path.sh" "$W/cross/vdp-restore" "$velero" restore \
  velero-restores-ours "$W/cross/velero-restored" -- --kubeconfig "$W/velero-sa.kubeconfig" --namespace "$VNS" \
  || vrc=$?
step_end
echo "  velero pod-volume restore exited $vrc; its termination message: $(head -c 400 "$W/cross/vdp-restore/termination-log" 2>/dev/null)"
check "Velero's data path restored our snapshot (exit 0)" [ "$vrc" -eq 0 ]
[ "$vrc" -eq 0 ] || { echo "  --- last lines of $W/cross/vdp-restore.log"; tail -n 15 "$W/cross/vdp-restore.log" | cut -c1-300; }
check "Velero's data path wrote the done file .velero/$r1_uid" [ -f "$W/cross/velero-restored/.velero/$r1_uid" ]
rm -rf "$W/cross/velero-restored/.velero"
pycheck same-tree "$(voldir "$APP" writer data)" "$W/cross/velero-restored" "Velero's restore of our snapshot"

step_begin "case 6b: Velero's own kopia data path backs up $APP/writer/data; our agent restores that snapshot"
writer_uid=$(k -n "$APP" get pod writer -o jsonpath='{.metadata.uid}')
b1_uid=$(k -n "$VNS" get backup b1 -o jsonpath='{.metadata.uid}')
k apply -f - >/dev/null <<YAML
apiVersion: velero.io/v1
kind: PodVolumeBackup
metadata:
  name: velero-backs-up
  namespace: $VNS
  ownerReferences: [{apiVersion: velero.io/v1, kind: Backup, name: b1, uid: $b1_uid, controller: true}]
spec:
  node: $OTHER
  pod: {kind: Pod, namespace: $APP, name: writer, uid: $writer_uid}
  volume: data
  backupStorageLocation: default
  repoIdentifier: ""
  uploaderType: kopia
  tags: {backup: b1, backup-uid: $b1_uid, ns: $APP, pod: writer, pod-uid: $writer_uid, volume: data}
YAML
k -n "$VNS" patch podvolumebackup velero-backs-up --type=merge \
  -p '{"status":{"phase":"InProgress"}}' >/dev/null
vrc=0
bounded "$W/cross/vdp-backup.log" $(vdp_env "$W/cross/vdp-backup") "$tools/velero-data-path.sh" "$W/cross/vdp-backup" "$velero" backup \
  velero-backs-up "$(voldir "$APP" writer data)" -- --kubeconfig "$W/velero-sa.kubeconfig" --namespace "$VNS" \
  || vrc=$?
vresult=$(cat "$W/cross/vdp-backup/termination-log" 2>/dev/null || true)
echo "  velero pod-volume backup exited $vrc; its termination message: $(head -c 400 <<<"$vresult")"
check "Velero's data path backed up the volume (exit 0)" [ "$vrc" -eq 0 ]
[ "$vrc" -eq 0 ] || { echo "  --- last lines of $W/cross/vdp-backup.log"; tail -n 15 "$W/cross/vdp-backup.log" | cut -c1-300; }
velero_sid=$(python3 -c 'import json,sys
try: print(json.loads(sys.argv[1]).get("snapshotID", ""))
except ValueError: print("")' "$vresult")
check "Velero's data path names its snapshot ($velero_sid)" [ -n "$velero_sid" ]
# Our agent restores it, into a pod of its node that Velero's restore helper waits in.
k -n "$CROSS" apply -f - >/dev/null <<YAML
apiVersion: v1
kind: Pod
metadata: {name: here}
spec:
  nodeName: $NODE
  initContainers: [{name: restore-wait, image: $velero_image, command: [/velero-restore-helper], args: ["$r1_uid"], volumeMounts: [{name: data, mountPath: /restores/data}]}]
  containers: [{name: app, image: $WORKLOAD_IMAGE, command: [sleep, infinity], volumeMounts: [{name: data, mountPath: /data}]}]
  volumes: [{name: data, emptyDir: {}}]
YAML
here_uid=$(k -n "$CROSS" get pod here -o jsonpath='{.metadata.uid}')
pvr_yaml ours-restores-velero "$CROSS" here "$here_uid" "$velero_sid" | k apply -f - >/dev/null
pvr_done() { case $(k -n "$VNS" get podvolumerestore ours-restores-velero -o jsonpath='{.status.phase}') in Completed|Failed|Canceled) return 0;; *) return 1;; esac; }
settle "$TIMEOUT" pvr_done || true
here_running() { [ "$(k -n "$CROSS" get pod here -o jsonpath='{.status.phase}')" = Running ]; }
settle 30 here_running || true
step_end
echo "  PodVolumeRestore ours-restores-velero: $(k -n "$VNS" get podvolumerestore ours-restores-velero -o jsonpath='{.status.phase} {.status.message} {.status.progress}')"
check "our agent restored Velero's snapshot: PodVolumeRestore Completed" \
  [ "$(k -n "$VNS" get podvolumerestore ours-restores-velero -o jsonpath='{.status.phase}')" = Completed ]
check "the restore helper saw our done file (pod $CROSS/here Running)" here_running
pycheck same-tree "$(voldir "$APP" writer data)" "/var/lib/kubelet/pods/$here_uid/volumes/kubernetes.io~empty-dir/data" "our restore of Velero's snapshot"
if kopia_list cross; then pycheck cross "$W/kopia-cross.json" "$ours_sid" "$velero_sid"; fi
# The Node with no kubelet goes: the DaemonSet made a pod for it that can never be available,
# and with maxUnavailable 1 that pod alone would hold up every later rollout (case 9).
k -n "$CROSS" delete pod elsewhere --grace-period=0 --force >/dev/null 2>&1 || true
k delete node "$OTHER" >/dev/null

}

# --- case 7: Velero's own node agent started beside ours on the same node ---------------------------
case7_velero_node_agent_beside_ours() {
# Why the README says never to run the two on one node, shown rather than read from Velero's
# source: (a) at its start, Velero's node agent takes an InProgress PodVolumeBackup of its node
# that it cannot resume (ours: there is no data-mover pod of its own) and sets spec.cancel on it;
# (b) a new PodVolumeBackup is then claimed by both (reported, not asserted: who wins is a race).
# velero server and Velero's node agent both bind controller-runtime's metrics port :8080 (no
# flag moves it): the server, not needed any more, is stopped first.
step_begin "case 7: Velero's own node agent (velero node-agent server) started on $NODE while our agent backs up"
stop_group velero-server "$velero_pg" 5
port_free 8080 || die "port 8080 still taken after stopping velero server"
slow_uid=$(k -n "$SLOW" get pod slow -o jsonpath='{.metadata.uid}')
bt_uid=$(in_progress_owner Backup beside)
# $1 name, $2 backup label, $3 pod namespace, $4 pod, $5 pod uid: a PodVolumeBackup as Velero
# 1.18's server makes it, owned by the Backup beside (InProgress) so the collector keeps it.
pvb_yaml() {
  echo "apiVersion: velero.io/v1
kind: PodVolumeBackup
metadata:
  name: $1
  namespace: $VNS
  labels: {velero.io/backup-name: $2, velero.io/backup-uid: $bt_uid}
  ownerReferences: [{apiVersion: velero.io/v1, kind: Backup, name: beside, uid: $bt_uid, controller: true}]
spec:
  node: $NODE
  pod: {kind: Pod, namespace: $3, name: $4, uid: $5}
  volume: data
  backupStorageLocation: default
  repoIdentifier: \"\"
  uploaderType: kopia
  tags: {backup: $2, backup-uid: $bt_uid, ns: $3, pod: $4, pod-uid: $5, volume: data}"
}
pvb_yaml beside-1 b-beside "$SLOW" slow "$slow_uid" | k apply -f - >/dev/null
wait_until "$TIMEOUT" "PodVolumeBackup beside-1 InProgress with kopia running" pvb_moving b-beside
mkdir -p "$W/velero-node-agent/tmp" "$W/velero-node-agent/home"
start_group velero-node-agent 5 "$W/velero-node-agent.log" env NODE_NAME="$NODE" VELERO_NAMESPACE="$VNS" \
  TMPDIR="$W/velero-node-agent/tmp" HOME="$W/velero-node-agent/home" \
  AWS_SHARED_CREDENTIALS_FILE="$W/velero/credentials/cloud" \
  "$velero" node-agent server --kubeconfig "$W/velero-sa.kubeconfig" --namespace "$VNS" \
  --metrics-address "127.0.0.1:$(free_port)" --log-level info
vna_pg=${groups[-1]#*:}; vna_pg=${vna_pg%%:*}
ended_by_velero b-beside "Velero's node agent started"
vna_said=$(grep -F 'beside-1' "$W/velero-node-agent.log" | grep -F 'have to cancel it' | sed -E 's/^time="[^"]*" //' | head -n 1 | cut -c1-250 || true)
echo "  Velero's node agent: ${vna_said:-(nothing about beside-1)}"
check "Velero's node agent canceled our running backup at its start (\"Failed to resume data path for PVB, have to cancel it\")" [ -n "$vna_said" ]

# (b) both running: a new PodVolumeBackup of a small volume.
writer_uid=$(k -n "$APP" get pod writer -o jsonpath='{.metadata.uid}')
pvb_yaml beside-2 b-beside-2 "$APP" writer "$writer_uid" | k apply -f - >/dev/null
pvb2_terminal() { case "$(pvb_of b-beside-2 status.phase)" in Completed | Failed | Canceled) return 0 ;; *) return 1 ;; esac; }
settle 30 pvb2_terminal || true
k -n "$VNS" get podvolumebackup beside-2 -o json --show-managed-fields >"$W/beside-2.json"
python3 - "$W/beside-2.json" <<'PY' | sed 's/^/  observed: /'
import json, sys
o = json.load(open(sys.argv[1]))
st = o.get("status") or {}
print(f"PodVolumeBackup beside-2 after 30 s with both agents: phase {st.get('phase')!r}, "
      f"message {(st.get('message') or '')[:160]!r}, snapshotID {st.get('snapshotID')!r}")
writers = sorted({m.get("manager") for m in o["metadata"].get("managedFields", [])
                  if "f:status" in json.dumps(m.get("fieldsV1", {}))})
print(f"status written by: {', '.join(w for w in writers if w)}")
PY
movers=$(k -n "$VNS" get pods -o name 2>/dev/null | grep -c beside-2 || true)
echo "  observed: data-mover pods Velero's node agent created for beside-2: $movers"
check "Velero's node agent is still running (it ran beside ours for the whole case)" group_alive "$vna_pg"
stop_group velero-node-agent "$vna_pg" 5
step_end

}
