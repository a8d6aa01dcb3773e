# Shared by scripts/velero-smoke.sh, scripts/velero-cloud-smoke.sh and the case files beside this
# one (sourced, never run): the report (PASS/FAIL, timed steps), the process groups every
# long-running process gets and the cleanup that stops them, the polling helpers, and two
# cluster helpers. Uses the caller's globals W (work directory), root, tools and TIMEOUT.
t_start=$(date +%s.%N)
elapsed() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }
say() { printf '[%6ss] %s\n' "$(elapsed "$t_start")" "$*"; }

# Every FAIL line, repeated in the summary: a CI log that keeps only its head and tail still
# shows what failed. Its length is the count of failed checks.
failed=()
pass() { echo "  PASS $*"; }
fail() { echo "  FAIL $*"; failed+=("${step_name:-}: $*"); }
# check <what> <command...>: PASS/FAIL by the command's status.
check() { local what=$1; shift; if "$@"; then pass "$what"; else fail "$what"; fi; }
# Runs tools/velero-smoke/checks.py and records its FAIL lines (a crash counts as one).
pycheck() {
  local out rc=0 line fails
  out=$(python3 "$tools/checks.py" "$@" 2>&1) || rc=$?
  echo "$out"
  mapfile -t fails < <(grep '^  FAIL' <<<"$out" || true)
  for line in "${fails[@]}"; do failed+=("${step_name:-}: ${line#  FAIL }"); done
  if [ "$rc" -ne 0 ] && [ ${#fails[@]} -eq 0 ]; then fail "checks.py $1 exited $rc"; fi
}

steps=()
step_begin() { step_name=$1; step_t0=$(date +%s.%N); say "== $1"; }
step_end() {
  local d; d=$(elapsed "$step_t0")
  steps+=("$(printf '%7s s  %s' "$d" "$step_name")")
  say "   $step_name: $d s"
}


# --- processes and cleanup -----------------------------------------------------------------------
# Each long-running process is started with setsid (its own process group, PGID = its PID: a
# background child of a script is no group leader, so setsid execs in place) and recorded as
# name:pgid:grace. Cleanup stops the groups newest first: SIGTERM, SIGKILL after grace seconds.
groups=()
cp_started=0
node_started=0
start_group() {
  local name=$1 grace=$2 log=$3; shift 3
  setsid "$@" </dev/null >"$log" 2>&1 &
  local pid=$! i
  groups+=("$name:$pid:$grace")
  # Until the child has called setsid() its group is still the script's: group_alive would call
  # it exited and stop_group could not signal it. Returns once the group exists (or the child
  # is gone).
  for ((i = 0; i < 500; i++)); do
    [ "$(ps -o pgid= -p "$pid" 2>/dev/null | tr -d ' ')" = "$pid" ] && break
    [ -e "/proc/$pid" ] || break
    sleep 0.01
  done
}
group_alive() { # any non-zombie process in group $1
  ps -e -o pgid=,stat= | awk -v g="$1" '$1 == g && $2 !~ /^Z/ { found = 1 } END { exit !found }'
}
stopped=()
stop_group() {
  local name=$1 pg=$2 grace=$3 i t0
  group_alive "$pg" || { wait "$pg" 2>/dev/null || true; return 0; }
  t0=$(date +%s.%N)
  kill -TERM -- "-$pg" 2>/dev/null || true
  for ((i = 0; i < grace * 5; i++)); do group_alive "$pg" || break; sleep 0.2; done
  if group_alive "$pg"; then
    echo "cleanup: $name (process group $pg) still running ${grace} s after SIGTERM: SIGKILL" >&2
    kill -KILL -- "-$pg" 2>/dev/null || true
  fi
  wait "$pg" 2>/dev/null || true
  stopped+=("$name $(elapsed "$t0") s")
}
cleanup() {
  local rc=$? i name pg grace
  set +e
  trap - EXIT INT TERM
  # Process groups the caller paused (SIGSTOP): resumed first, or a stopped process would
  # outlive its parent's SIGTERM.
  for i in ${paused_groups:-}; do kill -CONT -- "-$i" 2>/dev/null; done
  for ((i = ${#groups[@]} - 1; i >= 0; i--)); do
    IFS=: read -r name pg grace <<<"${groups[i]}"
    stop_group "$name" "$pg" "$grace"
  done
  # The node before the control plane: its pods (the agent, the workloads) are killed with it, and
  # nothing of it (mounts, cgroups, the bridge) outlives the run.
  if [ "$node_started" = 1 ]; then
    [ -n "${agent_log_saver:-}" ] && $agent_log_saver
    "$root/scripts/start-node.sh" --stop "$W/node" >>"$W/node.log" 2>&1
  fi
  # CSI storage (the data mover smoke): after the node, which unmounts its volumes.
  if [ -n "${csi_dir:-}" ]; then "$root/scripts/start-csi.sh" --stop "$csi_dir" >>"$W/csi.log" 2>&1; fi
  if [ "$cp_started" = 1 ]; then "$root/scripts/start-control-plane.sh" --stop "$W/cp" >>"$W/control-plane.log" 2>&1; fi
  [ ${#stopped[@]} -eq 0 ] || echo "cleanup: stopped (SIGTERM to exit) $(IFS=,; echo "${stopped[*]}" | sed 's/,/, /g'); control plane"
  if [ "$rc" -eq 0 ] && [ ${#failed[@]} -eq 0 ] && [ "${VELERO_SMOKE_KEEP:-0}" != 1 ]; then
    rm -rf "$W"
  else
    echo "work directory kept: $W (velero-server.log, agent.log, node/{kubelet,containerd}.log, s3/moto.log, cp/*.log)"
  fi
  if [ ${#failed[@]} -gt 0 ]; then
    echo "velero-smoke${VELERO_VERSION:+ $VELERO_VERSION}: what failed (step: check):"
    printf '  %s\n' "${failed[@]}"
  elif [ "$rc" -ne 0 ]; then
    echo "velero-smoke${VELERO_VERSION:+ $VELERO_VERSION}: stopped with status $rc in step '${step_name:-set-up}'"
  fi
  exit "$rc"
}

die() {
  echo "FATAL: $*"
  failed+=("${step_name:-}: FATAL $*")
  [ -n "${agent_log_saver:-}" ] && $agent_log_saver
  for f in agent.log velero-server.log node/kubelet.log; do
    [ -f "$W/$f" ] && { echo "--- last lines of $W/$f"; tail -n 25 "$W/$f"; }
  done
  exit 1
}
# wait_until <seconds> <what> <command...>: polls every 0.5 s.
wait_until() {
  local secs=$1 what=$2; shift 2
  local deadline=$((SECONDS + secs))
  until "$@"; do
    [ $SECONDS -lt $deadline ] || die "$what: not reached within $secs s"
    sleep 0.5
  done
}
# settle <seconds> <command...>: polls every 0.5 s; returns 1 (no exit) if not reached in time.
settle() {
  local deadline=$((SECONDS + $1)); shift
  until "$@"; do [ $SECONDS -lt $deadline ] || return 1; sleep 0.5; done
}
# bounded <log> <command...>: runs a command in a process group of its own (stopped by the
# cleanup if the script ends first), at most VELERO_SMOKE_TIMEOUT seconds; returns its status
# (124: timed out).
bounded() {
  local log=$1 pid rc=0; shift
  setsid timeout -k 10 "$TIMEOUT" "$@" </dev/null >"$log" 2>&1 &
  pid=$!
  groups+=("command:$pid:5")
  wait "$pid" || rc=$?
  return "$rc"
}
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
port_free() { python3 -c 'import socket,sys; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("", int(sys.argv[1])))' "$1" 2>/dev/null; }
# --- the cluster -----------------------------------------------------------------------------------
# Uses the caller's k (kubectl as admin), VNS, NODE, apiserver.
# The DaemonSet's pod on $NODE is Ready (its own readiness probe).
ds_pod_ready() {
  [ "$(k -n "$VNS" get pods -l name=node-agent --field-selector "spec.nodeName=$NODE" \
    -o jsonpath='{range .items[*]}{.status.conditions[?(@.type=="Ready")].status}{"\n"}{end}' 2>/dev/null)" = True ]
}
# token_kubeconfig <ServiceAccount> <file>: a kubeconfig with a TokenRequest token of that account.
token_kubeconfig() {
  local sa=$1 out=$2 token
  token=$(k -n "$VNS" create token "$sa" --duration=6h) || die "TokenRequest for ServiceAccount $VNS/$sa failed"
  (umask 077; cat >"$out" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: smoke
  cluster: {server: "$apiserver", certificate-authority: "$W/cp/pki/ca.crt"}
users:
- name: $sa
  user: {token: "$token"}
contexts:
- name: $sa
  context: {cluster: smoke, user: $sa, namespace: $VNS}
current-context: $sa
EOF
  )
}
