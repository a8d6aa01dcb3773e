#!/usr/bin/env bash
# The agent's image as the DaemonSet's pod on a real node: kubelet and containerd run it, its real
# probes make it Ready. Part of the test command (scripts/test.sh), runnable alone as root:
#
#   scripts/test-node.sh [--image OCI_DIR]     (default: builds the image from the debug agent)
#
# 1. A control plane with kube-scheduler (scripts/start-control-plane.sh) and a real node
#    registered to it as system:node:<name> (scripts/start-node.sh: containerd, runc, kubelet,
#    the CNI bridge); prints the versions and the Node Ready.
# 2. The image (scripts/build-image.sh --oci) imported into the node's containerd under the very
#    reference daemonset/daemonset.yaml names, then `kubectl apply -k daemonset/` unchanged: the
#    DaemonSet controller makes the pod, kube-scheduler binds it, the kubelet runs it; Ready
#    through its real readiness probe. On the node: the agent is PID 2 under tini, as uid 0 with
#    exactly the capabilities the DaemonSet adds, a read-only root filesystem, NODE_NAME from the
#    downward API, /host_pods the kubelet's pods directory with HostToContainer propagation, and
#    `kubectl logs` through the kubelet shows it watching for this node.
# 3. A rollout: the pod deleted -> the kubelet stops it with SIGTERM (the agent exits 0 within its
#    grace period), the DaemonSet makes a new one, Ready again.
# 4. The same image through the Helm chart: `helm install` with only the image reference set
#    (daemonset/'s objects deleted first), the pod Ready; `helm uninstall` removes it.
# Everything is stopped on exit, also on failure (the node first: scripts/start-node.sh --stop
# leaves no mount, cgroup, bridge or process behind).
#
# Environment: PODVOLUME_TOOLS_CACHE (the tools cache, as the install scripts); NODE_TEST_KEEP=1
# keeps the work directory.
set -euo pipefail
{
cd "$(dirname "$0")/.."
root=$(pwd)
started=$(date +%s)
say() { echo "test-node.sh: $*" >&2; }
step="setting up"
section() { step=$1; echo "== $1 =="; }
failures=0
check() { # <what> <command...>
  local what=$1; shift
  if "$@"; then echo "  PASS $what"; else echo "  FAIL $what"; failures=$((failures + 1)); fi
}
[ "$(id -u)" -eq 0 ] || { say "needs root (containerd, runc, mounts)"; exit 1; }

image=
[ "${1:-}" = --image ] && image=$2

cp_bin=$(scripts/install-control-plane.sh)
node_bin=$(scripts/install-node.sh)
helm=$(scripts/install-helm.sh)
work=$(mktemp -d /tmp/podvolume-node.XXXXXX)
k() { "$cp_bin/kubectl" --kubeconfig "$work/cp/admin.kubeconfig" "$@"; }
finish() {
  local rc=$?
  [ "$rc" -eq 0 ] && [ "$failures" -gt 0 ] && rc=1
  if [ "$rc" -ne 0 ] && [ -d "$work/cp" ]; then
    k get nodes,pods -A -o wide >&2 2>/dev/null || true
    k -n velero get events --sort-by=.lastTimestamp 2>/dev/null | tail -n 20 >&2 || true
    for f in node/kubelet.log node/containerd.log cp/kube-scheduler.log; do
      echo "--- last lines of $work/$f" >&2
      tail -n 15 "$work/$f" >&2 || true
    done
  fi
  [ -d "$work/node" ] && NODE_BIN=$node_bin CONTROL_PLANE_BIN=$cp_bin scripts/start-node.sh --stop "$work/node" >&2 || true
  [ -d "$work/cp" ] && CONTROL_PLANE_BIN=$cp_bin scripts/start-control-plane.sh --stop "$work/cp" >&2 || true
  [ "$rc" -eq 0 ] || say "FAILED (status $rc) in: $step"
  if [ "${NODE_TEST_KEEP:-0}" = 1 ] || [ "$rc" -ne 0 ]; then say "work directory kept: $work"; else rm -rf "$work"; fi
  exit "$rc"
}
trap finish EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

section "a control plane with kube-scheduler, and a real node (scripts/start-node.sh)"
KUBE_SCHEDULER=1 APISERVER_PORT=443 APISERVER_BIND_ADDRESS=0.0.0.0 CONTROL_PLANE_BIN=$cp_bin \
  scripts/start-control-plane.sh "$work/cp" >/dev/null
t0=$SECONDS
NODE_BIN=$node_bin CONTROL_PLANE_BIN=$cp_bin scripts/start-node.sh "$work/cp" "$work/node" >"$work/node.env"
node=$(sed -n 's/^NODE_NAME=//p' "$work/node.env")
echo "== real node $node: $(k get node "$node" -o jsonpath='kubelet {.status.nodeInfo.kubeletVersion}, {.status.nodeInfo.containerRuntimeVersion}, kernel {.status.nodeInfo.kernelVersion}'), runc $("$node_bin/runc" --version | sed -n '1s/runc version //p'), Ready after $((SECONDS - t0)) s =="
k get node "$node" -o wide

section "the agent's image (scripts/build-image.sh --oci) imported into the node's containerd"
ref=$(sed -n 's/^ *image: *//p' daemonset/daemonset.yaml)
[[ $ref == *:* ]] || { say "daemonset/daemonset.yaml names no image:tag ($ref)"; exit 1; }
if [ -z "$image" ]; then
  cargo build --quiet --bin podvolume-agent
  image=$work/image
  base=()
  [ -f target/test-tools/image-base.tar ] && base=(--base target/test-tools/image-base.tar)
  scripts/build-image.sh --oci "$image" --tag "${ref##*:}" --agent target/debug/podvolume-agent "${base[@]}"
fi
NODE_BIN=$node_bin scripts/start-node.sh --import "$work/node" "$ref" "$image:${ref##*:}"

# ready_pod <selector>: waits until exactly one pod matches, Ready, and prints its name.
ready_pod() {
  local sel=$1 deadline=$((SECONDS + 180)) name
  while :; do
    name=$(k -n velero get pods -l "$sel" -o jsonpath='{range .items[?(@.metadata.deletionTimestamp)]}{end}{range .items[*]}{.metadata.name} {.status.conditions[?(@.type=="Ready")].status} {.metadata.deletionTimestamp}{"\n"}{end}' 2>/dev/null \
      | awk '$2 == "True" && $3 == "" {print $1}')
    [ "$(wc -w <<<"$name")" -eq 1 ] && { echo "$name"; return 0; }
    [ $SECONDS -lt $deadline ] || { say "no Ready pod for $sel after 180 s"; k -n velero get pods -o wide >&2; k -n velero describe pods -l "$sel" | tail -n 30 >&2; return 1; }
    sleep 1
  done
}
# The agent's host PID (the pod's container process under tini), from the pod's cgroup.
agent_pid() {
  local uid=$1 p
  for p in $(find /sys/fs/cgroup/pids/kubepods -path "*pod$uid*" -name cgroup.procs -exec cat {} + 2>/dev/null); do
    [[ $(tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null) == /usr/local/bin/podvolume-agent* ]] && { echo "$p"; return 0; }
  done
  return 1
}

section "kubectl apply -k daemonset/ (unchanged): the DaemonSet's pod Ready on $node"
k create namespace velero >/dev/null
t0=$SECONDS
k apply -k daemonset/ >/dev/null
pod=$(ready_pod name=node-agent)
echo "  pod $pod Ready after $((SECONDS - t0)) s: $(k -n velero get pod "$pod" -o jsonpath='node {.spec.nodeName}, IP {.status.podIP}, image {.status.containerStatuses[0].image} ({.status.containerStatuses[0].imageID}), restarts {.status.containerStatuses[0].restartCount}')"
check "the pod runs on the real node $node" [ "$(k -n velero get pod "$pod" -o jsonpath='{.spec.nodeName}')" = "$node" ]
check "the pod has an address on the node's pod network (10.244.0.0/24)" \
  grep -q '^10\.244\.0\.' <<<"$(k -n velero get pod "$pod" -o jsonpath='{.status.podIP}')"
uid=$(k -n velero get pod "$pod" -o jsonpath='{.metadata.uid}')
pid=$(agent_pid "$uid") || { say "no podvolume-agent process in pod $pod's cgroups"; exit 1; }
echo "  agent process $pid: $(tr '\0' ' ' <"/proc/$pid/cmdline")"
check "the agent runs under tini (the image's entrypoint) with the DaemonSet's arguments" \
  grep -q "^/usr/bin/tini" <<<"$(tr '\0' ' ' <"/proc/$(awk '/^PPid:/ {print $2}' "/proc/$pid/status")/cmdline")"
check "the agent runs as uid 0" [ "$(awk '/^Uid:/ {print $2}' "/proc/$pid/status")" = 0 ]
# DAC_READ_SEARCH, DAC_OVERRIDE, CHOWN, FOWNER, FSETID: bits 2, 1, 0, 3, 4 -> 0x1f, nothing else.
check "its effective capabilities are exactly the five the DaemonSet adds (CapEff 000000000000001f)" \
  [ "$(awk '/^CapEff:/ {print $2}' "/proc/$pid/status")" = 000000000000001f ]
# mountinfo: field 5 is the mount point, 6 its options, then optional fields (master:N is a
# slave mount: HostToContainer propagation).
check "its root filesystem is read-only" grep -q '^ro' <<<"$(awk '$5 == "/" {print $6; exit}' "/proc/$pid/mountinfo")"
check "NODE_NAME=$node from the downward API" grep -qx "NODE_NAME=$node" <<<"$(tr '\0' '\n' <"/proc/$pid/environ")"
check "/host_pods is the kubelet's pods directory, HostToContainer (a slave mount)" \
  grep -q '^/var/lib/kubelet/pods .*master:' <<<"$(awk '$5 == "/host_pods" {print $4, $0; exit}' "/proc/$pid/mountinfo")"
check "kubectl logs (through the kubelet) shows the agent started for $node" \
  grep -q "$node" <<<"$(k -n velero logs "$pod" --tail=50)"

section "a rollout: the pod deleted (the kubelet sends SIGTERM), the DaemonSet makes a new one"
t0=$SECONDS
k -n velero delete pod "$pod" --wait=true >/dev/null
old_gone=$((SECONDS - t0))
check "the old agent process is gone" [ ! -e "/proc/$pid" ]
new=$(ready_pod name=node-agent)
echo "  old pod gone after ${old_gone} s (grace period 60 s); new pod $new Ready after $((SECONDS - t0)) s"
check "the agent stopped within its grace period on SIGTERM" [ "$old_gone" -lt 60 ]
check "a new pod replaced it" [ "$new" != "$pod" ]
grep -h "podvolume-agent" /var/log/pods/velero_"$pod"_*/node-agent/*.log 2>/dev/null | tail -n 3 | sed 's/^/  old pod log: /' || true

section "helm install of the chart (image reference only) on the node"
k delete -k daemonset/ -l app.kubernetes.io/name=podvolume-agent --wait=true >/dev/null
t0=$SECONDS
"$helm" --kubeconfig "$work/cp/admin.kubeconfig" install podvolume-agent charts/podvolume-agent -n velero \
  --set image.repository="${ref%:*}" --set image.tag="${ref##*:}" >/dev/null
pod=$(ready_pod app.kubernetes.io/instance=podvolume-agent)
echo "  chart's pod $pod Ready after $((SECONDS - t0)) s on $(k -n velero get pod "$pod" -o jsonpath='{.spec.nodeName}')"
check "the chart's pod is Ready on $node" [ "$(k -n velero get pod "$pod" -o jsonpath='{.spec.nodeName}')" = "$node" ]
"$helm" --kubeconfig "$work/cp/admin.kubeconfig" uninstall podvolume-agent -n velero --wait >/dev/null
# helm's --wait covers the chart's objects, not the pods the DaemonSet's deletion garbage-collects.
gone() {
  local deadline=$((SECONDS + 60))
  until [ -z "$(k -n velero get pods -l app.kubernetes.io/instance=podvolume-agent -o name)" ]; do
    [ $SECONDS -lt $deadline ] || return 1
    sleep 1
  done
}
check "helm uninstall removed the DaemonSet and its pod (within 60 s)" gone

step="stopping the node"
NODE_BIN=$node_bin CONTROL_PLANE_BIN=$cp_bin scripts/start-node.sh --stop "$work/node" >&2
left=$(grep -c -e /var/lib/kubelet -e "$work/node" /proc/self/mounts || true)
check "no mount of the node left (/var/lib/kubelet, $work/node)" [ "$left" -eq 0 ]
check "no pod cgroup left" [ ! -d /sys/fs/cgroup/pids/kubepods ]
check "no bridge left" eval '! ip link show pvnode0 >/dev/null 2>&1'
rm -rf "$work/node"
[ "$failures" -eq 0 ] || { say "$failures check(s) failed"; exit 1; }
echo "== real node tests passed in $(($(date +%s) - started)) s =="
}
