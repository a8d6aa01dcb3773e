#!/usr/bin/env bash
# The CSI storage the data-mover tests stand on, proven on a real node: a PersistentVolumeClaim
# provisioned by the real csi-provisioner, mounted by the kubelet through the CSI node calls,
# written by a pod; a VolumeSnapshot taken by the real snapshot-controller and csi-snapshotter,
# ready to use; a claim restored from it holding the same bytes; everything deleted through the
# API leaves nothing in the driver's state. Part of the test command, runnable alone as root:
#
#   scripts/test-csi.sh
#
# Environment: PODVOLUME_TOOLS_CACHE (the tools cache, as the install scripts); CSI_TEST_KEEP=1
# keeps the work directory.
set -euo pipefail
{
cd "$(dirname "$0")/.."
say() { echo "test-csi.sh: $*" >&2; }
step="setting up"
section() { step=$1; echo "== $1 =="; }
failures=0
check() { # <what> <command...>
  local what=$1; shift
  if "$@"; then echo "  PASS $what"; else echo "  FAIL $what"; failures=$((failures + 1)); fi
}
[ "$(id -u)" -eq 0 ] || { say "needs root (containerd, runc, mounts)"; exit 1; }

cp_bin=$(scripts/install-control-plane.sh)
node_bin=$(scripts/install-node.sh)
csi_bin=$(scripts/install-csi.sh)
work=$(mktemp -d /tmp/podvolume-csi.XXXXXX)
k() { "$cp_bin/kubectl" --kubeconfig "$work/cp/admin.kubeconfig" "$@"; }
finish() {
  local rc=$?
  [ "$rc" -eq 0 ] && [ "$failures" -gt 0 ] && rc=1
  if [ "$rc" -ne 0 ] && [ -d "$work/cp" ]; then
    k get nodes,pods,pvc,pv,volumesnapshots,volumesnapshotcontents -A -o wide >&2 2>/dev/null || true
    k get events -A --sort-by=.lastTimestamp 2>/dev/null | tail -n 20 >&2 || true
    for f in csi/hostpath.log csi/csi-provisioner.log csi/csi-snapshotter.log csi/snapshot-controller.log node/kubelet.log; do
      echo "--- last lines of $work/$f" >&2
      tail -n 15 "$work/$f" >&2 || true
    done
  fi
  [ -d "$work/node" ] && NODE_BIN=$node_bin CONTROL_PLANE_BIN=$cp_bin scripts/start-node.sh --stop "$work/node" >&2 || true
  [ -d "$work/csi" ] && scripts/start-csi.sh --stop "$work/csi" >&2 || true
  [ -d "$work/cp" ] && CONTROL_PLANE_BIN=$cp_bin scripts/start-control-plane.sh --stop "$work/cp" >&2 || true
  [ "$rc" -eq 0 ] || say "FAILED (status $rc) in: $step"
  if [ "${CSI_TEST_KEEP:-0}" = 1 ] || [ "$rc" -ne 0 ]; then say "work directory kept: $work"; else rm -rf "$work"; fi
  exit "$rc"
}
trap finish EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

section "a control plane with kube-scheduler, a real node, and CSI storage with snapshots (scripts/start-csi.sh)"
KUBE_SCHEDULER=1 APISERVER_PORT=443 APISERVER_BIND_ADDRESS=0.0.0.0 CONTROL_PLANE_BIN=$cp_bin \
  scripts/start-control-plane.sh "$work/cp" >/dev/null
NODE_BIN=$node_bin CONTROL_PLANE_BIN=$cp_bin scripts/start-node.sh "$work/cp" "$work/node" >"$work/node.env"
node=$(sed -n 's/^NODE_NAME=//p' "$work/node.env")
t0=$SECONDS
CSI_BIN=$csi_bin CONTROL_PLANE_BIN=$cp_bin scripts/start-csi.sh "$work/cp" "$work/node" "$work/csi" >/dev/null
echo "== CSI on $node: external-snapshotter $("$csi_bin/csi-snapshotter" --version 2>&1 | awk '{print $NF}'), external-provisioner $("$csi_bin/csi-provisioner" --version 2>&1 | awk '{print $NF}'), the tests' hostpath driver registered with the kubelet after $((SECONDS - t0)) s =="

# wait_for <what> <seconds> <command...>
wait_for() {
  local what=$1 limit=$2; shift 2
  local deadline=$((SECONDS + limit))
  until "$@" >/dev/null 2>&1; do
    [ $SECONDS -lt $deadline ] || { say "no $what after $limit s"; return 1; }
    sleep 0.5
  done
}
jp() { k "$@" 2>/dev/null; }
# The kubelet's mount of a pod's CSI volume, seen from the host.
volume_dir() { # <namespace> <pod> <claim>
  local uid pv
  uid=$(k -n "$1" get pod "$2" -o jsonpath='{.metadata.uid}')
  pv=$(k -n "$1" get pvc "$3" -o jsonpath='{.spec.volumeName}')
  echo "/var/lib/kubelet/pods/$uid/volumes/kubernetes.io~csi/$pv/mount"
}
tree_sum() { (cd "$1" && find . -type f -print0 | sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16); }

section "a claim provisioned, mounted by the kubelet and written by a pod"
k create namespace csi-test >/dev/null
pod() { # <name> <claim>
  cat <<YAML
apiVersion: v1
kind: Pod
metadata: {name: $1, namespace: csi-test}
spec:
  terminationGracePeriodSeconds: 1
  containers:
  - name: c
    image: podvolume.test/busybox:1
    imagePullPolicy: Never
    command: [sh, -c, 'if [ ! -f /data/done ]; then mkdir -p /data/d/e && head -c 3000000 /dev/urandom > /data/a && head -c 12345 /dev/urandom > /data/d/e/b && echo hello > /data/c && touch /data/done; fi; sleep 3600']
    volumeMounts: [{name: data, mountPath: /data}]
  volumes:
  - name: data
    persistentVolumeClaim: {claimName: $2}
YAML
}
k apply -f - >/dev/null <<YAML
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: data, namespace: csi-test}
spec:
  accessModes: [ReadWriteOnce]
  storageClassName: podvolume-csi
  resources: {requests: {storage: 64Mi}}
YAML
pod writer data | k apply -f - >/dev/null
t0=$SECONDS
wait_for "Running writer pod" 120 sh -c "[ \"\$($cp_bin/kubectl --kubeconfig $work/cp/admin.kubeconfig -n csi-test get pod writer -o jsonpath='{.status.phase}')\" = Running ]"
dir=$(volume_dir csi-test writer data)
wait_for "written volume" 60 test -f "$dir/done"
echo "  writer Running after $((SECONDS - t0)) s; claim $(jp -n csi-test get pvc data -o jsonpath='{.status.phase} to {.spec.volumeName}')"
check "the claim is Bound to a volume of the driver" [ "$(jp get pv "$(jp -n csi-test get pvc data -o jsonpath='{.spec.volumeName}')" -o jsonpath='{.spec.csi.driver}')" = hostpath.csi.podvolume.test ]
check "the kubelet mounted it through the CSI node service at $dir" grep -qF " $dir " /proc/self/mountinfo
before=$(tree_sum "$dir")

section "a VolumeSnapshot, then a claim restored from it"
k apply -f - >/dev/null <<YAML
apiVersion: snapshot.storage.k8s.io/v1
kind: VolumeSnapshot
metadata: {name: snap, namespace: csi-test}
spec:
  volumeSnapshotClassName: podvolume-csi
  source: {persistentVolumeClaimName: data}
YAML
t0=$SECONDS
wait_for "ready VolumeSnapshot" 60 sh -c "[ \"\$($cp_bin/kubectl --kubeconfig $work/cp/admin.kubeconfig -n csi-test get volumesnapshot snap -o jsonpath='{.status.readyToUse}')\" = true ]"
vsc=$(jp -n csi-test get volumesnapshot snap -o jsonpath='{.status.boundVolumeSnapshotContentName}')
echo "  ready after $((SECONDS - t0)) s: content $vsc, handle $(jp get volumesnapshotcontent "$vsc" -o jsonpath='{.status.snapshotHandle}'), restoreSize $(jp -n csi-test get volumesnapshot snap -o jsonpath='{.status.restoreSize}')"
check "the snapshot's content has the driver's handle" [ -n "$(jp get volumesnapshotcontent "$vsc" -o jsonpath='{.status.snapshotHandle}')" ]
echo changed-after-snapshot >"$dir/c"
k apply -f - >/dev/null <<YAML
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: restored, namespace: csi-test}
spec:
  accessModes: [ReadWriteOnce]
  storageClassName: podvolume-csi
  resources: {requests: {storage: 64Mi}}
  dataSource: {apiGroup: snapshot.storage.k8s.io, kind: VolumeSnapshot, name: snap}
YAML
pod reader restored | k apply -f - >/dev/null
wait_for "Running reader pod" 120 sh -c "[ \"\$($cp_bin/kubectl --kubeconfig $work/cp/admin.kubeconfig -n csi-test get pod reader -o jsonpath='{.status.phase}')\" = Running ]"
rdir=$(volume_dir csi-test reader restored)
check "the restored claim holds the snapshot's bytes (tree sha256 $before), not the later change" [ "$(tree_sum "$rdir")" = "$before" ]

section "everything deleted through the API: nothing left in the driver"
k delete namespace csi-test --wait=true --timeout=120s >/dev/null
wait_for "PersistentVolumes deleted" 60 sh -c "[ -z \"\$($cp_bin/kubectl --kubeconfig $work/cp/admin.kubeconfig get pv -o name)\" ]"
wait_for "VolumeSnapshotContents deleted" 60 sh -c "[ -z \"\$($cp_bin/kubectl --kubeconfig $work/cp/admin.kubeconfig get volumesnapshotcontents -o name)\" ]"
left() { find "$work/csi/state/volumes" "$work/csi/state/snapshots" -mindepth 1 -maxdepth 1; }
wait_for "empty driver state" 30 sh -c "[ -z \"\$(find $work/csi/state/volumes $work/csi/state/snapshots -mindepth 1 -maxdepth 1)\" ]" || true
check "no volume and no snapshot left in the driver's state" [ -z "$(left)" ]
section "stopped: no CSI process left"
NODE_BIN=$node_bin CONTROL_PLANE_BIN=$cp_bin scripts/start-node.sh --stop "$work/node" >/dev/null 2>&1 || true
scripts/start-csi.sh --stop "$work/csi" >/dev/null 2>&1 || true
csi_left() { pgrep -f "^$csi_bin/" | while read -r p; do [ "$(awk '{print $3}' "/proc/$p/stat" 2>/dev/null)" = Z ] || echo "$p"; done; }
check "no process of the CSI parts left after scripts/start-csi.sh --stop: $(csi_left | tr '\n' ' ')" [ -z "$(csi_left)" ]
echo "== test-csi.sh: $failures failure(s) in $SECONDS s =="
exit 0
}
