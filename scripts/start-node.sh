#!/usr/bin/env bash
# Starts a real Kubernetes node on this machine -- containerd, runc and a kubelet registered to a
# control plane made by scripts/start-control-plane.sh -- so that pods really run: the kubelet
# mounts their volumes under /var/lib/kubelet/pods, containerd runs their containers with runc, and
# the CNI bridge plugin gives each pod an address on a bridge of its own. For tests, and for
# people trying the agent's DaemonSet as it runs on a real node.
#
#   scripts/start-node.sh CP_DIR NODE_DIR      start (CP_DIR: the control plane's directory)
#   scripts/start-node.sh --stop NODE_DIR      stop everything a start made, and undo what it touched
#   scripts/start-node.sh --import NODE_DIR REF OCI_DIR[:TAG]
#                                              import an OCI image layout (scripts/build-image.sh
#                                              --oci) into the node's containerd as REF
#   scripts/start-node.sh --tag NODE_DIR REF NEW_REF
#                                              an imported image under one more name (a rollout)
#   scripts/start-node.sh --make-image NODE_DIR REF ENTRYPOINT [PATH=]FILE...
#                                              a one-layer image of host files (static binaries),
#                                              imported as REF
#
# The control plane must have been started with the scheduler and the address pods use for the
# API server (the `kubernetes` Service, 10.96.0.1:443; there is no kube-proxy and no iptables
# here, so the node gives that address to its bridge and the apiserver listens on it):
#   KUBE_SCHEDULER=1 APISERVER_PORT=443 APISERVER_BIND_ADDRESS=0.0.0.0 scripts/start-control-plane.sh CP_DIR
#
# On success stdout is shell assignments (NODE_NAME=, NODE_IP=, CONTAINERD_ADDRESS=, KUBELET_PID=,
# CONTAINERD_PID=), also in NODE_DIR/env. Needs root.
#
# What it sets up:
#   - the node's identity: a client certificate CN=system:node:<name>, O=system:nodes signed by the
#     control plane's CA (the Node authorizer and NodeRestriction admission check it), and a
#     serving certificate for the kubelet's own API (logs, exec) on the node's address;
#   - two images made here and imported (no registry is reachable): the pod sandbox
#     (podvolume.test/pause:1, tools/node/pause) and a small workload image
#     (podvolume.test/busybox:1, Debian's busybox-static);
#   - a bridge pvnode0 at 10.244.0.1/24 (the node's InternalIP) with the pods' range
#     10.244.0.0/24, and 10.96.0.1/32 on it for the API server;
#   - containerd (cgroupfs, overlayfs, restrict_oom_score_adj: this machine's root lacks
#     CAP_SYS_RESOURCE), then the kubelet (root dir /var/lib/kubelet, where the DaemonSet's hostPath
#     expects the pods; failCgroupV1: false on a cgroup v1 host), and waits for the Node Ready.
#
# Environment: NODE_NAME (default podvolume-node), NODE_BIN (install-node.sh's directory),
# CONTROL_PLANE_BIN (install-control-plane.sh's), START_TIMEOUT (default 120 s).
#
# What the kubelet and containerd touch outside NODE_DIR, all undone by --stop (and by a failed
# start): sysctls vm.overcommit_memory, kernel.panic, kernel.panic_on_oops (restored to the values
# found); /var/lib/kubelet, /var/lib/cni, /var/log/pods, /var/log/containers, /run/containerd,
# /var/lib/podvolume-agent (the DaemonSet's state hostPath) when they did not exist before; the
# bridge and the pods' network namespaces; the kubepods cgroups in every hierarchy; every mount
# under those paths. No process of the node's pods survives a stop.
set -euo pipefail
{
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
say() { echo "start-node.sh: $*" >&2; }
die() { say "$*"; exit 1; }
usage() { say "usage: $0 CP_DIR NODE_DIR | $0 --stop NODE_DIR | $0 --import NODE_DIR REF OCI_DIR[:TAG] | $0 --tag NODE_DIR REF NEW_REF | $0 --make-image NODE_DIR REF ENTRYPOINT FILE..."; exit 2; }

BRIDGE=pvnode0
NODE_IP=10.244.0.1
POD_CIDR=10.244.0.0/24
SERVICE_IP=10.96.0.1
KUBELET_ROOT=/var/lib/kubelet
SYSCTLS=(vm.overcommit_memory kernel.panic kernel.panic_on_oops)
# Host paths the node's programs create; removed on stop only when a start found them absent.
HOST_PATHS=("$KUBELET_ROOT" /var/lib/cni /var/log/pods /var/log/containers /run/containerd /var/lib/podvolume-agent)

# --- stop ---------------------------------------------------------------------------------------
# A PID is signalled only while its command line still names NODE_DIR (kubelet, containerd and the
# shims all carry it), so a reused PID is left alone.
ours() { local c; c=$( { tr '\0' ' ' <"/proc/$1/cmdline"; } 2>/dev/null) && [[ $c == *"$2/"* ]]; }
stop_pid() {
  local pid=$1 dir=$2 what=$3
  ours "$pid" "$dir" || return 0
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 1 100); do ours "$pid" "$dir" || return 0; sleep 0.2; done
  say "$what (PID $pid) did not stop within 20 s of SIGTERM: SIGKILL"
  kill -KILL "$pid" 2>/dev/null || true
}
# Every process in a cgroup under kubepods (any hierarchy that has one), i.e. every container of
# every pod of this node.
pod_processes() {
  local h
  for h in /sys/fs/cgroup/*/kubepods /sys/fs/cgroup/kubepods; do
    [ -d "$h" ] && find "$h" -name cgroup.procs -exec cat {} + 2>/dev/null
  done | sort -u
}
unmount_under() {
  local prefix=$1 m
  # Deepest first; lazily, so a mount still busy for a moment does not stop the rest.
  while read -r m; do
    umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || say "could not unmount $m"
  done < <(awk -v p="$prefix" '$2 == p || index($2, p "/") == 1 {print $2}' /proc/self/mounts | sort -r)
}
stop_node() {
  local dir=$1 pid p
  [ -d "$dir" ] || { say "nothing to stop: no $dir"; return 0; }
  [ -f "$dir/kubelet.pid" ] && stop_pid "$(cat "$dir/kubelet.pid")" "$dir" kubelet
  # The pods' containers: killed outright (the kubelet that would stop them gracefully is gone;
  # a test that needs a graceful stop deletes its pods first), then their shims and containerd.
  for _ in 1 2 3; do
    mapfile -t p < <(pod_processes)
    [ ${#p[@]} -eq 0 ] && break
    kill -KILL "${p[@]}" 2>/dev/null || true
    sleep 0.5
  done
  [ -f "$dir/containerd.pid" ] && stop_pid "$(cat "$dir/containerd.pid")" "$dir" containerd
  for pid in $(pgrep -f "containerd-shim-runc-v2 .*$dir/" || true); do
    kill -KILL "$pid" 2>/dev/null || true
  done
  mapfile -t p < <(pod_processes)
  [ ${#p[@]} -eq 0 ] || say "pod processes still running after the stop: ${p[*]}"
  for prefix in "$KUBELET_ROOT" "$dir" /run/containerd /var/run/netns /run/netns; do unmount_under "$prefix"; done
  # cgroups, deepest first (an empty cgroup directory is removed with rmdir).
  local h
  for h in /sys/fs/cgroup/*/kubepods /sys/fs/cgroup/kubepods /sys/fs/cgroup/*/k8s.io /sys/fs/cgroup/*/default; do
    [ -d "$h" ] && find "$h" -depth -type d -exec rmdir {} \; 2>/dev/null
  done
  ip link del "$BRIDGE" 2>/dev/null || true
  if [ -f "$dir/sysctls" ]; then
    local key value
    while read -r key value; do sysctl -qw "$key=$value" || say "could not restore $key=$value"; done <"$dir/sysctls"
    rm -f "$dir/sysctls"
  fi
  if [ -f "$dir/created-paths" ]; then
    while read -r p; do rm -rf --one-file-system "$p" || say "could not remove $p"; done <"$dir/created-paths"
    rm -f "$dir/created-paths"
  fi
  rm -f "$dir/kubelet.pid" "$dir/containerd.pid"
  say "stopped the node in $dir"
}

# ctr in the CRI's namespace; its warning on every call that cgroup v1 is deprecated is left out.
ctr_in() {
  "$NODE_BIN/ctr" --address "$1/containerd/containerd.sock" -n k8s.io "${@:2}" 2> >(grep -v 'DEPRECATION: The support for cgroup v1' >&2)
}
# import_image <node dir> <ref> <oci layout dir> <tag>: the layout as one tar, named REF.
import_image() {
  local dir=$1 ref=$2 oci=$3 tag=$4 t
  t=$(mktemp "${TMPDIR:-/tmp}/image.XXXXXX.tar")
  # ctr names an image from the layout's org.opencontainers.image.ref.name (the tag) under
  # --base-name; REF's own tag must be that tag.
  [ "${ref##*:}" = "$tag" ] || die "--import: $ref must end in :$tag, the layout's tag"
  tar -C "$oci" -cf "$t" .
  ctr_in "$dir" images import --base-name "${ref%:*}" "$t" >/dev/null || { rm -f "$t"; die "ctr images import of $oci:$tag failed"; }
  rm -f "$t"
  # Listed first, then matched: `ctr ... | grep -q` fails under pipefail when grep's early exit
  # SIGPIPEs ctr.
  local names
  names=$(ctr_in "$dir" images ls -q) || die "ctr images ls failed"
  grep -qx "$ref" <<<"$names" || die "$ref is not in containerd after the import of $oci:$tag"
  say "imported $oci:$tag as $ref"
}

# --- images --------------------------------------------------------------------------------------
# make_image <node dir> <ref> <entrypoint> <file>...: a one-layer OCI image holding the given host
# files (each at its own path, or PATH=FILE: FILE at PATH), imported as <ref>. A busybox among them
# gets its applets as links; /etc/passwd, /etc/group and /tmp are added.
make_image() {
  local dir=$1 ref=$2 entry=$3; shift 3
  local w; w=$(mktemp -d "${TMPDIR:-/tmp}/node-image.XXXXXX")
  local tag=${ref##*:}
  umoci init --layout "$w/oci" && umoci new --image "$w/oci:$tag" && umoci unpack --image "$w/oci:$tag" "$w/b" >/dev/null
  local f
  for f in "$@"; do
    case $f in
      *=*) install -D -m 0755 "${f#*=}" "$w/b/rootfs/${f%%=*}" ;;
      *) install -D -m 0755 "$f" "$w/b/rootfs/$f" ;;
    esac
  done
  # The busybox applets as links, and the few files a container expects.
  if [ -x "$w/b/rootfs/bin/busybox" ]; then
    local applet
    for applet in $("$w/b/rootfs/bin/busybox" --list); do
      [ -e "$w/b/rootfs/bin/$applet" ] || ln -s busybox "$w/b/rootfs/bin/$applet"
    done
  fi
  mkdir -p "$w/b/rootfs/etc" "$w/b/rootfs/tmp"
  chmod 1777 "$w/b/rootfs/tmp"
  echo 'root:x:0:0:root:/root:/bin/sh' >"$w/b/rootfs/etc/passwd"
  echo 'root:x:0:' >"$w/b/rootfs/etc/group"
  umoci repack --image "$w/oci:$tag" "$w/b" >/dev/null
  umoci config --image "$w/oci:$tag" --config.entrypoint "$entry" \
    --config.env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin >/dev/null
  umoci gc --layout "$w/oci"
  import_image "$dir" "$ref" "$w/oci" "$tag"
  rm -rf "$w"
}
case "${1:-}" in
  --stop)
    [ $# -eq 2 ] || usage
    stop_node "$(cd "$2" && pwd)"
    exit 0 ;;
  --import)
    [ $# -eq 4 ] || usage
    dir=$(cd "$2" && pwd)
    NODE_BIN=${NODE_BIN:-$("$root/scripts/install-node.sh")}
    oci=${4%:*} tag=latest
    [ "$oci" != "$4" ] && tag=${4##*:}
    import_image "$dir" "$3" "$oci" "$tag"
    exit 0 ;;
  --tag)
    # Another name for an imported image (a new tag for a rollout without a second import).
    [ $# -eq 4 ] || usage
    dir=$(cd "$2" && pwd)
    NODE_BIN=${NODE_BIN:-$("$root/scripts/install-node.sh")}
    ctr_in "$dir" images tag --force "$3" "$4" >/dev/null || die "ctr images tag $3 $4 failed"
    say "tagged $3 as $4"
    exit 0 ;;
  --make-image)
    [ $# -ge 5 ] || usage
    dir=$(cd "$2" && pwd)
    NODE_BIN=${NODE_BIN:-$("$root/scripts/install-node.sh")}
    make_image "$dir" "${@:3}"
    exit 0 ;;
esac
[ $# -eq 2 ] || usage
[ "$(id -u)" -eq 0 ] || die "needs root (containerd, runc, mounts, cgroups)"
cp=$(cd "$1" && pwd)
mkdir -p "$2"
dir=$(cd "$2" && pwd)
name=${NODE_NAME:-podvolume-node}
timeout=${START_TIMEOUT:-120}
[ -f "$cp/pki/ca.key" ] && [ -f "$cp/env" ] || die "$cp is not a running control plane's directory (no pki/ca.key or env)"
# shellcheck disable=SC1091
api_url=$(sed -n 's/^APISERVER_URL=//p' "$cp/env")
[ -f "$dir/kubelet.pid" ] && ours "$(cat "$dir/kubelet.pid")" "$dir" && die "a node from $dir is still running: $0 --stop $dir first"
for tool in openssl curl ip umoci python3 sysctl; do command -v "$tool" >/dev/null || die "$tool is missing"; done
[ -x /bin/busybox ] && [[ $(/bin/busybox --help 2>&1 | head -n1) == BusyBox* ]] || die "/bin/busybox is missing (Debian's busybox-static)"
NODE_BIN=${NODE_BIN:-$("$root/scripts/install-node.sh")}
CONTROL_PLANE_BIN=${CONTROL_PLANE_BIN:-$("$root/scripts/install-control-plane.sh")}
[ -x "$CONTROL_PLANE_BIN/kubelet" ] || die "$CONTROL_PLANE_BIN/kubelet is missing (scripts/install-control-plane.sh builds it)"
kubectl=("$CONTROL_PLANE_BIN/kubectl" --kubeconfig "$cp/admin.kubeconfig")

started_ok=0
on_exit() { [ $started_ok -eq 1 ] || { say "start failed: undoing it"; stop_node "$dir" || true; }; }
trap on_exit EXIT

# What a stop must undo, recorded before anything is touched.
: >"$dir/created-paths"
for p in "${HOST_PATHS[@]}"; do [ -e "$p" ] || echo "$p" >>"$dir/created-paths"; done
for key in "${SYSCTLS[@]}"; do echo "$key $(sysctl -n "$key")"; done >"$dir/sysctls"

# --- identity ------------------------------------------------------------------------------------
pki=$dir/pki
mkdir -p "$pki"
newkey() { openssl genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:2048 -out "$1" 2>/dev/null; chmod 600 "$1"; }
sign() {
  local out=$1 subj=$2 ext=$3
  newkey "$out.key"
  openssl req -new -key "$out.key" -subj "$subj" -out "$out.csr"
  openssl x509 -req -in "$out.csr" -CA "$cp/pki/ca.crt" -CAkey "$cp/pki/ca.key" -CAcreateserial -days 3650 -sha256 \
    -out "$out.crt" -extfile <(printf '%s\n' "basicConstraints=critical,CA:FALSE" "authorityKeyIdentifier=keyid" "$ext") 2>/dev/null
  rm -f "$out.csr"
}
if [ ! -f "$pki/kubelet-client.crt" ]; then
  sign "$pki/kubelet-client" "/O=system:nodes/CN=system:node:$name" "keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth"
  sign "$pki/kubelet-serving" "/O=system:nodes/CN=system:node:$name" "keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=IP:$NODE_IP,DNS:$name"
fi
cp "$cp/pki/ca.crt" "$pki/ca.crt"
(umask 077; cat >"$dir/kubelet.kubeconfig") <<EOF
apiVersion: v1
kind: Config
clusters:
- name: podvolume-test
  cluster: {server: "$api_url", certificate-authority: "$pki/ca.crt"}
users:
- name: system:node:$name
  user: {client-certificate: "$pki/kubelet-client.crt", client-key: "$pki/kubelet-client.key"}
contexts:
- name: node
  context: {cluster: podvolume-test, user: "system:node:$name"}
current-context: node
EOF

# --- network -------------------------------------------------------------------------------------
ip link show "$BRIDGE" >/dev/null 2>&1 || ip link add "$BRIDGE" type bridge
ip addr replace "$NODE_IP/24" dev "$BRIDGE"
ip addr replace "$SERVICE_IP/32" dev "$BRIDGE"
ip link set "$BRIDGE" up
sysctl -qw net.ipv4.ip_forward=1 2>/dev/null || true
mkdir -p "$dir/cni/net.d"
cat >"$dir/cni/net.d/10-podvolume.conflist" <<EOF
{
  "cniVersion": "1.0.0",
  "name": "podvolume-node",
  "plugins": [
    {"type": "bridge", "bridge": "$BRIDGE", "isGateway": true, "ipMasq": false, "hairpinMode": false,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": "$POD_CIDR", "gateway": "$NODE_IP"}]],
              "routes": [{"dst": "0.0.0.0/0"}], "dataDir": "$dir/cni/ipam"}},
    {"type": "loopback"}
  ]
}
EOF
# Pods resolve nothing: the machine's own resolver is not for them (see README, "The real node").
echo "nameserver 127.0.0.1" >"$dir/resolv.conf"

# --- containerd ----------------------------------------------------------------------------------
mkdir -p "$dir/containerd"
# Config version 4 (containerd 2.4's own); imports emptied so nothing under /etc/containerd applies.
cat >"$dir/containerd/config.toml" <<EOF
version = 4
imports = []
root = "$dir/containerd/root"
state = "$dir/containerd/state"
[plugins.'io.containerd.server.v1.grpc']
  address = "$dir/containerd/containerd.sock"
[plugins.'io.containerd.server.v1.ttrpc']
  address = "$dir/containerd/containerd.sock.ttrpc"
[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "podvolume.test/pause:1"
[plugins.'io.containerd.cri.v1.runtime']
  # root here lacks CAP_SYS_RESOURCE: a sandbox's negative oom_score_adj would fail its creation.
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        BinaryName = "$NODE_BIN/runc"
        SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["$NODE_BIN/cni"]
    conf_dir = "$dir/cni/net.d"
EOF
# PATH: containerd finds its shim there.
PATH="$NODE_BIN:$PATH" setsid "$NODE_BIN/containerd" --config "$dir/containerd/config.toml" \
  </dev/null >"$dir/containerd.log" 2>&1 &
echo $! >"$dir/containerd.pid"
deadline=$((SECONDS + timeout))
until "$NODE_BIN/ctr" --address "$dir/containerd/containerd.sock" version >/dev/null 2>&1; do
  kill -0 "$(cat "$dir/containerd.pid")" 2>/dev/null || { tail -n 30 "$dir/containerd.log" >&2; die "containerd exited"; }
  [ $SECONDS -lt $deadline ] || { tail -n 30 "$dir/containerd.log" >&2; die "containerd not serving after $timeout s"; }
  sleep 0.2
done
say "containerd $("$NODE_BIN/containerd" --version | awk '{print $3}') serving on $dir/containerd/containerd.sock"

# --- images: the pod sandbox and a small workload image -------------------------------------------
make_image "$dir" podvolume.test/pause:1 /pause "/pause=$NODE_BIN/pause"
make_image "$dir" podvolume.test/busybox:1 /bin/sh /bin/busybox

# --- kubelet -------------------------------------------------------------------------------------
cat >"$dir/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $NODE_IP
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 0
containerRuntimeEndpoint: unix://$dir/containerd/containerd.sock
cgroupDriver: cgroupfs
# This machine has cgroup v1 (hybrid); the kubelet refuses it unless told.
failCgroupV1: false
failSwapOn: false
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: "$pki/ca.crt"}
authorization: {mode: Webhook}
tlsCertFile: "$pki/kubelet-serving.crt"
tlsPrivateKeyFile: "$pki/kubelet-serving.key"
rotateCertificates: false
serverTLSBootstrap: false
podCIDR: $POD_CIDR
resolvConf: "$dir/resolv.conf"
hairpinMode: none
maxPods: 40
# The images were imported, not pulled: never collect them, whatever the disk holds.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
# A shared test machine's disk may be well used: evict on memory alone.
evictionHard: {memory.available: "100Mi"}
EOF
setsid "$CONTROL_PLANE_BIN/kubelet" --config="$dir/kubelet.yaml" --kubeconfig="$dir/kubelet.kubeconfig" \
  --hostname-override="$name" --node-ip="$NODE_IP" --root-dir="$KUBELET_ROOT" --cert-dir="$pki/kubelet-generated" \
  --v=2 </dev/null >"$dir/kubelet.log" 2>&1 &
echo $! >"$dir/kubelet.pid"
deadline=$((SECONDS + timeout))
until [ "$("${kubectl[@]}" get node "$name" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null)" = True ]; do
  kill -0 "$(cat "$dir/kubelet.pid")" 2>/dev/null || { tail -n 30 "$dir/kubelet.log" >&2; die "the kubelet exited"; }
  [ $SECONDS -lt $deadline ] || { tail -n 30 "$dir/kubelet.log" >&2; die "node $name not Ready after $timeout s"; }
  sleep 1
done
started_ok=1
cat <<EOF | tee "$dir/env"
NODE_NAME=$name
NODE_IP=$NODE_IP
CONTAINERD_ADDRESS=$dir/containerd/containerd.sock
KUBELET_PID=$(cat "$dir/kubelet.pid")
CONTAINERD_PID=$(cat "$dir/containerd.pid")
EOF
say "node $name Ready: kubelet $("$CONTROL_PLANE_BIN/kubelet" --version | awk '{print $2}'), containerd $("$NODE_BIN/containerd" --version | awk '{print $3}'), runc $("$NODE_BIN/runc" --version | sed -n '1s/runc version //p')"
say "stop with: $0 --stop $dir"
exit 0
}
