#!/usr/bin/env bash
# Starts a real, single-node Kubernetes control plane on loopback -- etcd, kube-apiserver and
# kube-controller-manager, as built by scripts/install-control-plane.sh -- with its state under
# <dir>, waits until it serves, and prints how to reach it. No kubelet: pods are stored and
# validated but never run. For tests and for people trying the agent against a real API server.
#
#   scripts/start-control-plane.sh /tmp/cp          # start (or restart on the same etcd data)
#   scripts/start-control-plane.sh --stop /tmp/cp   # stop what a start left running, in order
#   kill -9 $(cat /tmp/cp/pids)                     # the same, by hand (not plain kill: see stop())
#
# On success stdout is shell assignments (`eval "$(scripts/start-control-plane.sh DIR)"` sets them):
#   KUBECONFIG=DIR/admin.kubeconfig  APISERVER_URL=https://127.0.0.1:PORT  ETCD_URL=http://127.0.0.1:PORT
#   KUBE_CONTROLLER_MANAGER_URL=https://127.0.0.1:PORT  ETCD_PID=  KUBE_APISERVER_PID=  KUBE_CONTROLLER_MANAGER_PID=
# and DIR/env holds the same lines. Progress and errors go to stderr.
#
# Environment:
#   CONTROL_PLANE_BIN   directory with the binaries (default: what install-control-plane.sh prints,
#                       building them first if needed)
#   ETCD_PORT, APISERVER_PORT, CONTROLLER_MANAGER_PORT   fixed ports instead of free ones
#   START_TIMEOUT       seconds to wait for each component (default 120)
#   KUBE_APISERVER_EXTRA_ARGS   more kube-apiserver flags, split at spaces (e.g. the benchmark's
#                       --audit-policy-file=... --audit-log-path=...: which requests the agent made)
#   APISERVER_BIND_ADDRESS  the address kube-apiserver listens on (default 127.0.0.1); the real
#                       node (scripts/start-node.sh) needs 0.0.0.0 with APISERVER_PORT=443, so that
#                       its pods reach it at the `kubernetes` Service address 10.96.0.1:443
#   KUBE_SCHEDULER=1    also run kube-scheduler (pods without spec.nodeName, DaemonSet pods, are
#                       bound to a node by it; without a node nothing changes)
#
# <dir> after a start:
#   pki/ca.{crt,key}                 the CA: signs every certificate below (and CSRs, through the
#                                    controller manager's csrsigning controller)
#   pki/apiserver.{crt,key}          serving cert: 127.0.0.1, ::1, localhost, kubernetes.default.svc...
#   pki/admin.{crt,key}              client cert CN=admin O=system:masters (cluster-admin through RBAC)
#   pki/controller-manager.{crt,key} client cert CN=system:kube-controller-manager (its bootstrap RBAC)
#   pki/scheduler.{crt,key}          client cert CN=system:kube-scheduler (its bootstrap RBAC)
#   pki/apiserver-kubelet-client.{crt,key}   the apiserver's client cert to kubelets (logs, exec,
#                                    port-forward): O=system:masters, as kubeadm made it
#   pki/front-proxy-ca.{crt,key}, pki/front-proxy-client.{crt,key}   the aggregation layer's
#                                    request-header CA and the client the apiserver proxies with
#   pki/sa.{key,pub}                 RSA key pair: the apiserver signs ServiceAccount tokens with sa.key
#                                    (TokenRequest) and verifies them with sa.pub (authn, TokenReview)
#   admin.kubeconfig, controller-manager.kubeconfig, scheduler.kubeconfig   certificates embedded,
#                                    server = APISERVER_URL
#   etcd-data/   etcd's data; kept across stop/start, delete <dir> for a fresh cluster
#   etcd.log kube-apiserver.log kube-controller-manager.log kube-scheduler.log   each process's output
#   pids         one PID per line (etcd, kube-apiserver, kube-controller-manager[, kube-scheduler]); stop them in the
#                reverse order, waiting for each, or all at once with SIGKILL (see stop() below)
#   env          the stdout above
#   The pki/ files are made once and reused on a restart, so tokens and kubeconfigs stay valid.
#
# The exact command lines (a test harness that starts the binaries itself uses the same ones):
#
#   etcd --name=default --data-dir=DIR/etcd-data
#     --listen-client-urls=http://127.0.0.1:ETCD_PORT --advertise-client-urls=http://127.0.0.1:ETCD_PORT
#     --listen-peer-urls=http://127.0.0.1:0      # one member never dials peers: port 0, as
#                                                # kubernetes' integration tests run it
#     --unsafe-no-fsync  --log-level=warn
#
#   kube-apiserver --etcd-servers=http://127.0.0.1:ETCD_PORT
#     --bind-address=127.0.0.1 --advertise-address=127.0.0.1 --secure-port=APISERVER_PORT
#     --enable-admission-plugins=NodeRestriction
#     --kubelet-client-certificate=DIR/pki/apiserver-kubelet-client.crt --kubelet-client-key=DIR/pki/apiserver-kubelet-client.key
#     --kubelet-certificate-authority=DIR/pki/ca.crt --kubelet-preferred-address-types=InternalIP
#     --tls-cert-file=DIR/pki/apiserver.crt --tls-private-key-file=DIR/pki/apiserver.key
#     --client-ca-file=DIR/pki/ca.crt
#     --authorization-mode=Node,RBAC
#     --service-account-issuer=https://kubernetes.default.svc.cluster.local
#     --service-account-key-file=DIR/pki/sa.pub --service-account-signing-key-file=DIR/pki/sa.key
#     --service-cluster-ip-range=10.96.0.0/16 --endpoint-reconciler-type=none
#     --requestheader-client-ca-file=DIR/pki/front-proxy-ca.crt --requestheader-allowed-names=front-proxy-client
#     --requestheader-username-headers=X-Remote-User --requestheader-group-headers=X-Remote-Group
#     --requestheader-extra-headers-prefix=X-Remote-Extra-
#     --proxy-client-cert-file=DIR/pki/front-proxy-client.crt --proxy-client-key-file=DIR/pki/front-proxy-client.key
#     --allow-privileged=true --profiling=false
#     --cert-dir=DIR/pki/apiserver-generated
#
#   kube-controller-manager --kubeconfig=DIR/controller-manager.kubeconfig
#     --authentication-kubeconfig=DIR/controller-manager.kubeconfig
#     --authorization-kubeconfig=DIR/controller-manager.kubeconfig
#     --bind-address=127.0.0.1 --secure-port=CONTROLLER_MANAGER_PORT --cert-dir=DIR/pki/controller-manager-generated
#     --controllers=*  --use-service-account-credentials=true  --leader-elect=false
#     --service-account-private-key-file=DIR/pki/sa.key --root-ca-file=DIR/pki/ca.crt
#     --cluster-signing-cert-file=DIR/pki/ca.crt --cluster-signing-key-file=DIR/pki/ca.key
#     --service-cluster-ip-range=10.96.0.0/16
#
#   kube-scheduler --kubeconfig=DIR/scheduler.kubeconfig --authentication-kubeconfig=DIR/scheduler.kubeconfig
#     --authorization-kubeconfig=DIR/scheduler.kubeconfig --bind-address=127.0.0.1
#     --secure-port=SCHEDULER_PORT --leader-elect=false     (only with KUBE_SCHEDULER=1)
#
# Readiness: etcd GET /health -> {"health":"true"}; apiserver GET /readyz -> ok (after its
# post-start hooks: RBAC bootstrap roles, priority-and-fairness, system namespaces); controller
# manager GET /healthz -> ok, and then the ServiceAccount default/default exists (made by its
# serviceaccount controller, and needed before any pod can be created). Measured on 2 cores: etcd
# ready at once, the apiserver after about 4 s, the controller manager (and default SA) after about
# 10 s; the first start of a <dir> adds about 1 s for the keys.
#
# The logs' `E... options.go:205] The manifest file is empty, ignoring.` is upstream noise (the
# metrics allow-list flag left unset), not a fault.
set -euo pipefail

say() { echo "start-control-plane.sh: $*" >&2; }
usage() { say "usage: $0 <dir> | $0 --stop <dir>"; exit 2; }

# Stops the processes listed in <dir>/pids one at a time, newest first (controller manager,
# apiserver, etcd), each given up to 20 s after SIGTERM before SIGKILL. The order matters: an
# apiserver whose etcd is already gone does not finish its graceful shutdown (measured: still
# running 2 minutes later, retrying its leases), so `kill $(cat <dir>/pids)`, which signals all
# three at once, can leave it hanging. By hand: `kill -9 $(cat <dir>/pids)` is the safe one-liner
# (nothing here needs a graceful stop; --unsafe-no-fsync only risks data on a machine crash).
# A PID is signalled only while its command line still names <dir>, so a PID reused by an
# unrelated process since is left alone.
stop() {
  local dir=$1 pid
  [ -f "$dir/pids" ] || { say "nothing to stop: no $dir/pids"; return 0; }
  local pids=()
  mapfile -t pids < <(tac "$dir/pids")
  # A zombie (exited, not yet reaped) has an empty cmdline, so it counts as stopped.
  # (Matched in bash, not piped into `grep -q`, whose early exit can SIGPIPE the writer.)
  ours() { local c; c=$( { tr '\0' ' ' <"/proc/$1/cmdline"; } 2>/dev/null) && [[ $c == *"$dir/"* ]]; }
  for pid in "${pids[@]}"; do
    ours "$pid" || continue
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 100); do
      ours "$pid" || break
      sleep 0.2
    done
    if ours "$pid"; then
      say "PID $pid did not stop within 20 s of SIGTERM: SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
    fi
  done
  rm -f "$dir/pids"
  say "stopped ${pids[*]}"
}

[ $# -ge 1 ] || usage
if [ "$1" = "--stop" ]; then
  [ $# -eq 2 ] || usage
  stop "$(cd "$2" && pwd)"
  exit 0
fi
[ $# -eq 1 ] || usage
mkdir -p "$1"
dir=$(cd "$1" && pwd)
timeout=${START_TIMEOUT:-120}

for tool in openssl curl python3 base64; do
  command -v "$tool" >/dev/null || { say "$tool is missing"; exit 1; }
done
if [ -f "$dir/pids" ]; then
  while read -r pid; do
    if cmd=$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null) && [[ $cmd == *"$dir/"* ]]; then
      say "a control plane from $dir is still running (PID $pid): $0 --stop $dir first"
      exit 1
    fi
  done <"$dir/pids"
  rm -f "$dir/pids"
fi

bin=${CONTROL_PLANE_BIN:-$("$(dirname "${BASH_SOURCE[0]}")/install-control-plane.sh")}
for b in etcd kube-apiserver kube-controller-manager; do
  [ -x "$bin/$b" ] || { say "$bin/$b is missing (scripts/install-control-plane.sh builds it)"; exit 1; }
done

# Free loopback ports, asked of the kernel all at once (each socket held until the last is bound,
# so the three differ). A port can in principle be taken between here and the server's bind; the
# server then fails to start and the error says so.
read -r p1 p2 p3 p4 < <(python3 -c '
import socket
s = [socket.socket() for _ in range(4)]
for x in s: x.bind(("127.0.0.1", 0))
print(*(x.getsockname()[1] for x in s))')
etcd_port=${ETCD_PORT:-$p1}
api_port=${APISERVER_PORT:-$p2}
kcm_port=${CONTROLLER_MANAGER_PORT:-$p3}
scheduler_port=$p4
bind_address=${APISERVER_BIND_ADDRESS:-127.0.0.1}

# --- certificates (openssl CLI), made once per <dir> ---------------------------------------
pki=$dir/pki
mkdir -p "$pki"
# RSA 2048 everywhere, as kubeadm makes them: every TLS stack (rustls included) takes it.
newkey() { openssl genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:2048 -out "$1" 2>/dev/null; chmod 600 "$1"; }
# sign <name> <subject> <extensions>: a leaf certificate for pki/<name>.key, signed by the CA.
sign() {
  local name=$1 subj=$2 ext=$3
  newkey "$pki/$name.key"
  openssl req -new -key "$pki/$name.key" -subj "$subj" -out "$pki/$name.csr"
  openssl x509 -req -in "$pki/$name.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" -CAcreateserial \
    -days 3650 -sha256 -out "$pki/$name.crt" \
    -extfile <(printf '%s\n' "basicConstraints=critical,CA:FALSE" "authorityKeyIdentifier=keyid" "$ext") 2>/dev/null
  rm -f "$pki/$name.csr"
}
if [ ! -f "$pki/ca.crt" ]; then
  say "making the CA, serving and client certificates and the ServiceAccount key in $pki"
  rm -f "$pki"/*.crt "$pki"/*.key "$pki"/sa.pub
  newkey "$pki/ca.key"
  openssl req -x509 -new -key "$pki/ca.key" -subj "/CN=podvolume-test-ca" -days 3650 -sha256 -out "$pki/ca.crt" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign,digitalSignature"
  # Every name a client may use for the apiserver: loopback, and the in-cluster names and the
  # first service IP (10.96.0.1, the `kubernetes` Service) as a real cluster's cert carries them.
  sign apiserver "/CN=kube-apiserver" "keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=IP:127.0.0.1,IP:::1,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
  # O=system:masters: the group RBAC's bootstrap binds to cluster-admin (and that bypasses
  # authorization altogether), as kubeadm's admin.conf.
  sign admin "/O=system:masters/CN=admin" "keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth"
  # The user the bootstrap ClusterRoleBinding system:kube-controller-manager names.
  sign controller-manager "/CN=system:kube-controller-manager" "keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth"
  newkey "$pki/sa.key"
  openssl pkey -in "$pki/sa.key" -pubout -out "$pki/sa.pub"
fi
if [ ! -f "$pki/scheduler.crt" ]; then
  # The user the bootstrap ClusterRoleBinding system:kube-scheduler names.
  sign scheduler "/CN=system:kube-scheduler" "keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth"
  # The apiserver's identity towards kubelets (logs, exec): the kubelet asks the apiserver whether
  # it may (webhook authorization); system:masters may, as kubeadm's apiserver-kubelet-client did.
  sign apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client" "keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth"
fi
# The aggregation layer's own CA, apart from the cluster CA as kubeadm keeps it: a certificate it
# signs lets its holder assert any user in X-Remote-User headers, so no ordinary client cert may.
if [ ! -f "$pki/front-proxy-client.crt" ]; then
  newkey "$pki/front-proxy-ca.key"
  openssl req -x509 -new -key "$pki/front-proxy-ca.key" -subj "/CN=podvolume-test-front-proxy-ca" -days 3650 -sha256 \
    -out "$pki/front-proxy-ca.crt" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign,digitalSignature"
  newkey "$pki/front-proxy-client.key"
  openssl req -new -key "$pki/front-proxy-client.key" -subj "/CN=front-proxy-client" -out "$pki/front-proxy-client.csr"
  openssl x509 -req -in "$pki/front-proxy-client.csr" -CA "$pki/front-proxy-ca.crt" -CAkey "$pki/front-proxy-ca.key" \
    -CAcreateserial -days 3650 -sha256 -out "$pki/front-proxy-client.crt" \
    -extfile <(printf '%s\n' "basicConstraints=critical,CA:FALSE" "keyUsage=critical,digitalSignature,keyEncipherment" \
      "extendedKeyUsage=clientAuth") 2>/dev/null
  rm -f "$pki/front-proxy-client.csr"
fi

# kubeconfig <file> <user>: certificates embedded, so the file can be copied anywhere.
kubeconfig() {
  local ca crt key
  ca=$(base64 -w0 <"$pki/ca.crt")
  crt=$(base64 -w0 <"$pki/$2.crt")
  key=$(base64 -w0 <"$pki/$2.key")
  # 0600: it holds a private key.
  (umask 077; cat >"$1") <<EOF
apiVersion: v1
kind: Config
clusters:
- name: podvolume-test
  cluster:
    server: https://127.0.0.1:$api_port
    certificate-authority-data: $ca
users:
- name: $2
  user:
    client-certificate-data: $crt
    client-key-data: $key
contexts:
- name: $2@podvolume-test
  context:
    cluster: podvolume-test
    user: $2
current-context: $2@podvolume-test
EOF
}
kubeconfig "$dir/admin.kubeconfig" admin
kubeconfig "$dir/controller-manager.kubeconfig" controller-manager
kubeconfig "$dir/scheduler.kubeconfig" scheduler

# --- processes -------------------------------------------------------------------------------
# Each runs detached from the terminal (setsid: its own process group), so a Ctrl-C at the
# terminal that started this script does not reach it; it is stopped through <dir>/pids. In a non-interactive script the child is no
# process-group leader, so setsid execs in place and $! is the server's own PID.
pids=()
started_ok=0
cleanup() {
  if [ $started_ok -eq 0 ] && [ ${#pids[@]} -gt 0 ]; then
    say "start failed: stopping ${pids[*]}"
    stop "$dir" || true
  fi
}
trap cleanup EXIT
launch() {
  local name=$1; shift
  setsid "$@" </dev/null >"$dir/$name.log" 2>&1 &
  pids+=($!)
  printf '%s\n' "${pids[@]}" >"$dir/pids"
}
# wait_for <what> <log> <pid> <curl args...>: until the URL answers with a 2xx, or the process
# dies, or START_TIMEOUT passes.
wait_for() {
  local what=$1 log=$2 pid=$3; shift 3
  local deadline=$((SECONDS + timeout))
  until curl -fsS --max-time 5 -o /dev/null "$@" 2>/dev/null; do
    if ! kill -0 "$pid" 2>/dev/null; then
      say "$what exited; the end of $log:"; tail -n 30 "$log" >&2; exit 1
    fi
    if [ $SECONDS -ge $deadline ]; then
      say "$what not ready after ${timeout} s; the end of $log:"; tail -n 30 "$log" >&2; exit 1
    fi
    sleep 0.2
  done
}
t0=$SECONDS

# etcd over plain HTTP: it listens on loopback only and only the apiserver talks to it.
# --unsafe-no-fsync: a throw-away test store need not survive a power cut, and fsync dominates
# request latency on slow disks. Peers on port 0: a single member never dials one.
mkdir -p "$dir/etcd-data"
chmod 700 "$dir/etcd-data"
launch etcd "$bin/etcd" --name=default --data-dir="$dir/etcd-data" \
  --listen-client-urls="http://127.0.0.1:$etcd_port" --advertise-client-urls="http://127.0.0.1:$etcd_port" \
  --listen-peer-urls="http://127.0.0.1:0" \
  --unsafe-no-fsync --log-level=warn
etcd_pid=${pids[-1]}
wait_for etcd "$dir/etcd.log" "$etcd_pid" "http://127.0.0.1:$etcd_port/health"
say "etcd ready on 127.0.0.1:$etcd_port (PID $etcd_pid) after $((SECONDS - t0)) s"

read -r -a apiserver_extra <<<"${KUBE_APISERVER_EXTRA_ARGS:-}"
# kube-apiserver. --client-ca-file: x509 client certs (admin, controller manager) authenticate.
# Node,RBAC: authorization as a real cluster has it, so RBAC refusals (403) are real.
# ServiceAccount tokens: signed with sa.key (TokenRequest, the serviceaccounts/<sa>/token
# subresource), verified with sa.pub (bearer-token authentication and TokenReview); the issuer is
# also the default audience. --cert-dir: where it would write self-signed certs (unused: we give
# ours) so nothing lands in the working directory. --allow-privileged: the agent's DaemonSet is
# privileged, and tests create it. --endpoint-reconciler-type=none: the reconciler that publishes
# the apiserver's address as the endpoints of the `kubernetes` Service refuses a loopback address
# ("may not be in the loopback range") and the apiserver then exits; nothing here runs in-cluster
# clients that would dial that Service, so it stays without endpoints. --requestheader-* and
# --proxy-client-*: the aggregation layer (APIService objects served by another server), and the
# request-header CA that the controller manager's delegated authentication reads from the
# kube-system/extension-apiserver-authentication ConfigMap; without it that ConfigMap lacks the
# bundle and the controller manager logs an error for it every few seconds.
launch kube-apiserver "$bin/kube-apiserver" \
  --etcd-servers="http://127.0.0.1:$etcd_port" \
  --bind-address="$bind_address" --advertise-address=127.0.0.1 --secure-port="$api_port" \
  --enable-admission-plugins=NodeRestriction \
  --kubelet-client-certificate="$pki/apiserver-kubelet-client.crt" --kubelet-client-key="$pki/apiserver-kubelet-client.key" \
  --kubelet-certificate-authority="$pki/ca.crt" --kubelet-preferred-address-types=InternalIP \
  --tls-cert-file="$pki/apiserver.crt" --tls-private-key-file="$pki/apiserver.key" \
  --client-ca-file="$pki/ca.crt" \
  --authorization-mode=Node,RBAC \
  --service-account-issuer=https://kubernetes.default.svc.cluster.local \
  --service-account-key-file="$pki/sa.pub" --service-account-signing-key-file="$pki/sa.key" \
  --service-cluster-ip-range=10.96.0.0/16 \
  --endpoint-reconciler-type=none \
  --requestheader-client-ca-file="$pki/front-proxy-ca.crt" --requestheader-allowed-names=front-proxy-client \
  --requestheader-username-headers=X-Remote-User --requestheader-group-headers=X-Remote-Group \
  --requestheader-extra-headers-prefix=X-Remote-Extra- \
  --proxy-client-cert-file="$pki/front-proxy-client.crt" --proxy-client-key-file="$pki/front-proxy-client.key" \
  --allow-privileged=true --profiling=false \
  --cert-dir="$pki/apiserver-generated" \
  "${apiserver_extra[@]}"
api_pid=${pids[-1]}
admin=(--cacert "$pki/ca.crt" --cert "$pki/admin.crt" --key "$pki/admin.key")
wait_for kube-apiserver "$dir/kube-apiserver.log" "$api_pid" "${admin[@]}" "https://127.0.0.1:$api_port/readyz"
say "kube-apiserver ready on https://127.0.0.1:$api_port (PID $api_pid) after $((SECONDS - t0)) s"

# kube-controller-manager: namespace deletion (namespace controller), garbage collection of
# dependents (garbagecollector), the `default` ServiceAccount and kube-root-ca.crt ConfigMap in each
# namespace, CSR signing with the CA. --controllers=*: every default controller; those needing a
# cloud or node CIDRs stay idle. --use-service-account-credentials: each controller acts as its
# own ServiceAccount in kube-system, with the RBAC roles a real cluster gives it.
# --leader-elect=false: one instance, so no lease wait on a restart.
launch kube-controller-manager "$bin/kube-controller-manager" \
  --kubeconfig="$dir/controller-manager.kubeconfig" \
  --authentication-kubeconfig="$dir/controller-manager.kubeconfig" \
  --authorization-kubeconfig="$dir/controller-manager.kubeconfig" \
  --bind-address=127.0.0.1 --secure-port="$kcm_port" --cert-dir="$pki/controller-manager-generated" \
  --controllers='*' --use-service-account-credentials=true --leader-elect=false \
  --service-account-private-key-file="$pki/sa.key" --root-ca-file="$pki/ca.crt" \
  --cluster-signing-cert-file="$pki/ca.crt" --cluster-signing-key-file="$pki/ca.key" \
  --service-cluster-ip-range=10.96.0.0/16
kcm_pid=${pids[-1]}
# Its serving certificate is self-signed (in --cert-dir), hence -k; /healthz needs no credentials.
wait_for kube-controller-manager "$dir/kube-controller-manager.log" "$kcm_pid" -k "https://127.0.0.1:$kcm_port/healthz"
wait_for "the default ServiceAccount (kube-controller-manager's serviceaccount controller)" \
  "$dir/kube-controller-manager.log" "$kcm_pid" "${admin[@]}" "https://127.0.0.1:$api_port/api/v1/namespaces/default/serviceaccounts/default"
say "kube-controller-manager ready on https://127.0.0.1:$kcm_port (PID $kcm_pid) after $((SECONDS - t0)) s"

# kube-scheduler, for a control plane with a real node: binds pods to nodes as in any cluster.
scheduler_env=
if [ "${KUBE_SCHEDULER:-0}" = 1 ]; then
  [ -x "$bin/kube-scheduler" ] || { say "$bin/kube-scheduler is missing (scripts/install-control-plane.sh builds it)"; exit 1; }
  launch kube-scheduler "$bin/kube-scheduler" \
    --kubeconfig="$dir/scheduler.kubeconfig" \
    --authentication-kubeconfig="$dir/scheduler.kubeconfig" --authorization-kubeconfig="$dir/scheduler.kubeconfig" \
    --bind-address=127.0.0.1 --secure-port="$scheduler_port" --leader-elect=false
  scheduler_pid=${pids[-1]}
  wait_for kube-scheduler "$dir/kube-scheduler.log" "$scheduler_pid" -k "https://127.0.0.1:$scheduler_port/healthz"
  say "kube-scheduler ready on https://127.0.0.1:$scheduler_port (PID $scheduler_pid) after $((SECONDS - t0)) s"
  scheduler_env="KUBE_SCHEDULER_PID=$scheduler_pid"
fi

started_ok=1
cat <<EOF | tee "$dir/env"
KUBECONFIG=$dir/admin.kubeconfig
APISERVER_URL=https://127.0.0.1:$api_port
ETCD_URL=http://127.0.0.1:$etcd_port
KUBE_CONTROLLER_MANAGER_URL=https://127.0.0.1:$kcm_port
ETCD_PID=$etcd_pid
KUBE_APISERVER_PID=$api_pid
KUBE_CONTROLLER_MANAGER_PID=$kcm_pid
$scheduler_env
EOF
say "stop with: $0 --stop $dir   (or: kill -9 \$(cat $dir/pids))"
