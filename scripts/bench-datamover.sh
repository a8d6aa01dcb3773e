#!/usr/bin/env bash
# Benchmark of CSI snapshot data movement (case 8 of BENCHMARKS.md), on the set-up of
# scripts/velero-datamover-smoke.sh: the real Velero 1.18.3 server, the agent as the DaemonSet's
# pod on the real node, the tests' CSI driver, fake-gcs-server over TLS.
#
#   scripts/bench-datamover.sh [--quick] [--out FILE]
#
# Measures, for a volume of random data (incompressible; rewritten before every run so that each
# run moves it all):
#   - the DataUpload's phases as a watcher of the API sees them (polled every 0.2 s): accepted ->
#     Prepared (the exposure), InProgress -> Completed (the transfer), created -> Completed;
#   - the bare kopia CLI snapshotting the same directory on the host into a repository of its own
#     on the same store: the transfer's overhead is InProgress -> Completed over that;
#   - progress age while InProgress: at each poll, how long since `bytesDone` last changed
#     (worst, median), and the progress writes per minute, at the DaemonSet's --update-interval;
#   - an unchanged second backup (kopia's parent: incremental);
#   - cancel: `spec.cancel` on an InProgress DataUpload (a 12 GiB sparse file) -> Canceled, and ->
#     no kopia process left.
# Needs root (it runs a real node). Prints a Markdown section (to --out, else stdout).
set -euo pipefail
{
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
tools=$root/tools/velero-smoke
PROVIDER=gcp
VELERO_VERSION=1.18.3
UPLOADER=kopia
KOPIA_VERSION=0.22.3
NODE=bench-node
VNS=velero
BUCKET=velero-gcp
PREFIX=backups
TIMEOUT=${VELERO_SMOKE_TIMEOUT:-600}
quick=0 out=
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) quick=1 ;;
    --out) out=$2; shift ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done
if [ "$quick" = 1 ]; then runs=1 cancel_runs=2 size_mib=256; else runs=3 cancel_runs=5 size_mib=1024; fi
unset AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY AWS_SHARED_CREDENTIALS_FILE KUBECONFIG VELERO_NAMESPACE NODE_NAME \
  KOPIA_PASSWORD KOPIA_CONFIG_PATH RESTIC_REPOSITORY RESTIC_PASSWORD_FILE GOOGLE_APPLICATION_CREDENTIALS \
  STORAGE_EMULATOR_HOST SSL_CERT_FILE
AGENT_PROFILE=release
source "$tools/lib.sh"
W=$(mktemp -d "${BENCH_WORK_PARENT:-/var/tmp}/bench-datamover.XXXXXX")
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
exec 3>&1 1>&2
say "work directory: $W"
source "$tools/datamover-setup.sh"

step_begin "workload: one CSI claim"
BNS=bench
k create namespace "$BNS" >/dev/null
k apply -f - >/dev/null <<YAML
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: vol, namespace: $BNS}
spec:
  accessModes: [ReadWriteOnce]
  storageClassName: podvolume-csi
  resources: {requests: {storage: 16Gi}}
---
apiVersion: v1
kind: Pod
metadata: {name: app, namespace: $BNS}
spec:
  terminationGracePeriodSeconds: 1
  containers:
  - {name: app, image: $WORKLOAD_IMAGE, command: [sleep, infinity], volumeMounts: [{name: vol, mountPath: /vol}]}
  volumes: [{name: vol, persistentVolumeClaim: {claimName: vol}}]
YAML
app_running() { [ "$(k -n "$BNS" get pod app -o jsonpath='{.status.phase}' 2>/dev/null)" = Running ]; }
wait_until 120 "pod $BNS/app Running" app_running
vol="/var/lib/kubelet/pods/$(k -n "$BNS" get pod app -o jsonpath='{.metadata.uid}')/volumes/kubernetes.io~csi/$(k -n "$BNS" get pvc vol -o jsonpath='{.spec.volumeName}')/mount"
interval=$(k -n "$VNS" get ds node-agent -o jsonpath='{.spec.template.spec.containers[0].args}' | python3 -c 'import json,sys
a=json.load(sys.stdin); v=[x.split("=",1)[1] for x in a if x.startswith("--update-interval=")]; print(v[0] if v else "10s")')
step_end

# The bare kopia: a repository of its own on the same store, the same directory.
repo_password=bench-bare-password
kd=$W/bare; mkdir -p "$kd"
kenv=(env -i PATH="$PATH" HOME="$kd" KOPIA_PASSWORD="$repo_password" KOPIA_CHECK_FOR_UPDATES=false
  KOPIA_LOG_DIR="$kd/logs" SSL_CERT_FILE="$W/store/bundle.pem" STORAGE_EMULATOR_HOST="$emulator_host")
"${kenv[@]}" "$kopia" repository create gcs --bucket "$BUCKET" --credentials-file "$W/cloud" --prefix bench-bare/ \
  --config-file "$kd/repository.config" --cache-directory "$kd/cache" >"$kd/create.log" 2>&1 \
  || die "kopia repository create (bare): $(tail -n 3 "$kd/create.log")"

# poll_du <backup> <samples file>: one line per 0.2 s, "<unix time> <phase> <bytesDone>", until the
# DataUpload of the backup ends.
poll_du() {
  local b=$1 f=$2 line
  : >"$f"
  while :; do
    line=$(k -n "$VNS" get datauploads -l "velero.io/backup-name=$b" -o jsonpath='{.items[0].status.phase} {.items[0].status.progress.bytesDone}' 2>/dev/null || true)
    echo "$(date +%s.%N) $line" >>"$f"
    case "$line" in Completed* | Failed* | Canceled*) return 0 ;; esac
    sleep 0.2
  done
}
# figures <samples>: accepted->prepared, inprogress->end, first->end, worst/median progress age,
# progress changes per minute while InProgress.
figures() {
  python3 - "$1" <<'PY'
import sys, statistics
rows = []
for l in open(sys.argv[1]):
    p = l.split()
    if len(p) >= 2:
        rows.append((float(p[0]), p[1], int(p[2]) if len(p) > 2 and p[2].isdigit() else 0))
def first(ph):
    return next((t for t, p, _ in rows if p == ph), None)
t0 = rows[0][0]
acc, prep, run = first("Accepted") or t0, first("Prepared"), first("InProgress")
end = rows[-1][0]
ages, last_change, last_bytes, changes = [], None, None, 0
for t, p, b in rows:
    if p != "InProgress":
        continue
    if last_bytes is None or b != last_bytes:
        if last_bytes is not None:
            changes += 1
        last_change, last_bytes = t, b
    ages.append(t - last_change)
dur = (end - run) if run else 0
print("%.1f %.1f %.1f %.1f %.1f %.1f %s" % (
    (prep or run or end) - acc, dur, end - t0,
    max(ages) if ages else 0, statistics.median(ages) if ages else 0,
    changes / dur * 60 if dur > 0 else 0, rows[-1][1]))
PY
}

step_begin "data movement: $runs run(s) of $size_mib MiB of random data, the bare kopia beside"
results=$W/results.txt; : >"$results"
for r in $(seq 1 "$runs"); do
  rm -rf "${vol:?}"/*; mkdir -p "$vol/d"
  for i in $(seq 1 $((size_mib / 256))); do head -c $((256 * 1024 * 1024)) /dev/urandom >"$vol/d/part-$i.bin"; done
  [ "$size_mib" -lt 256 ] && head -c $((size_mib * 1024 * 1024)) /dev/urandom >"$vol/d/part.bin"
  sync
  t0=$(date +%s.%N)
  "${kenv[@]}" "$kopia" snapshot create "$vol" --config-file "$kd/repository.config" \
    >"$kd/snap-$r.log" 2>&1 || die "bare kopia snapshot: $(tail -n 3 "$kd/snap-$r.log")"
  bare=$(python3 -c "import time; print('%.1f' % (time.time() - $t0))")
  "${vel_cmd[@]}" backup create "bm-$r" --include-namespaces "$BNS" --snapshot-move-data >/dev/null 2>&1 || die "velero backup create bm-$r"
  poll_du "bm-$r" "$W/du-$r.txt"
  read -r expose transfer whole worst median per_min phase < <(figures "$W/du-$r.txt")
  [ "$phase" = Completed ] || die "DataUpload of bm-$r ended $phase: $(k -n "$VNS" get datauploads -l velero.io/backup-name=bm-$r -o jsonpath='{.items[0].status.message}')"
  echo "full $bare $expose $transfer $whole $worst $median $per_min" >>"$results"
  echo "  run $r: bare kopia $bare s; DataUpload: exposed in $expose s, moved in $transfer s, $whole s in all; progress age worst $worst s, median $median s, $per_min writes/min"
done
# The same data again: kopia's parent snapshot makes it incremental.
"${vel_cmd[@]}" backup create bm-incr --include-namespaces "$BNS" --snapshot-move-data >/dev/null 2>&1 || die "velero backup create bm-incr"
poll_du bm-incr "$W/du-incr.txt"
read -r expose transfer whole worst median per_min phase < <(figures "$W/du-incr.txt")
echo "incr - $expose $transfer $whole $worst $median $per_min" >>"$results"
echo "  unchanged: exposed in $expose s, moved in $transfer s, $whole s in all"
step_end

step_begin "cancel: $cancel_runs run(s), spec.cancel on an InProgress DataUpload of a 12 GiB sparse file"
rm -rf "${vol:?}"/*
truncate -s 12G "$vol/zeros.img"
du_of() { k -n "$VNS" get datauploads -l "velero.io/backup-name=$1" -o jsonpath="{.items[0].$2}" 2>/dev/null; }
moving() { [ "$(du_of "$1" status.phase)" = InProgress ] && [ -n "$(pgrep -x kopia)" ]; }
for r in $(seq 1 "$cancel_runs"); do
  "${vel_cmd[@]}" backup create "bc-$r" --include-namespaces "$BNS" --snapshot-move-data >/dev/null 2>&1 || die "velero backup create bc-$r"
  wait_until 180 "DataUpload of bc-$r InProgress with kopia running" moving "bc-$r"
  t0=$(date +%s.%N)
  k -n "$VNS" patch datauploads "$(du_of "bc-$r" metadata.name)" --type merge -p '{"spec":{"cancel":true}}' >/dev/null
  until [ "$(du_of "bc-$r" status.phase)" = Canceled ]; do
    python3 -c "import time,sys; sys.exit(time.time() - $t0 > 120)" || die "bc-$r not Canceled in 120 s"
    sleep 0.05
  done
  t1=$(date +%s.%N)
  until [ -z "$(pgrep -x kopia)" ]; do sleep 0.05; done
  t2=$(date +%s.%N)
  read -r c1 c2 < <(python3 -c "print('%.2f %.2f' % ($t1 - $t0, $t2 - $t0))")
  echo "cancel $c1 $c2" >>"$results"
  echo "  run $r: Canceled after $c1 s, no kopia after $c2 s"
done
step_end

python3 - "$results" "$size_mib" "$interval" "$VELERO_VERSION" "$(basename "$csi_bin")" "$("$kopia" --version | head -n1 | cut -d' ' -f1)" >"$W/section.md" <<'PY'
import sys, statistics
res, size, interval, velero, _, kopia = sys.argv[1:7]
rows = [l.split() for l in open(res)]
full = [r for r in rows if r[0] == "full"]
incr = [r for r in rows if r[0] == "incr"]
canc = [r for r in rows if r[0] == "cancel"]
def col(rs, i): return [float(r[i]) for r in rs]
def mmm(v): return "%.1f / %.1f / %.1f" % (min(v), statistics.median(v), max(v)) if v else "-"
print("## 8. CSI snapshot data movement (DataUploads) on the real node")
print()
print("The real Velero %s server, `velero backup create --snapshot-move-data` of one CSI claim of %s MiB of random data" % (velero, size))
print("(rewritten before each run), the agent as the DaemonSet's pod on the real node (`--update-interval` %s), the" % interval)
print("tests' CSI driver with the real snapshot controller and sidecars, the repository on fake-gcs-server over TLS on")
print("the same machine; kopia %s. Times as a watcher of the API sees them (polled every 0.2 s): `scripts/bench-datamover.sh`." % kopia)
print()
print("| measure | min / median / max | runs |")
print("|---|---|---:|")
print("| bare kopia CLI, same directory, own repository on the same store (s) | %s | %d |" % (mmm(col(full, 1)), len(full)))
print("| DataUpload exposure: Accepted -> Prepared (snapshot moved, claim, hold pod running) (s) | %s | %d |" % (mmm(col(full, 2)), len(full)))
print("| DataUpload transfer: InProgress -> Completed (s) | %s | %d |" % (mmm(col(full, 3)), len(full)))
ratio = [float(r[3]) / float(r[1]) for r in full if float(r[1]) > 0]
print("| transfer / bare kopia (agent overhead) | %s | %d |" % ("%.2f / %.2f / %.2f" % (min(ratio), statistics.median(ratio), max(ratio)) if ratio else "-", len(ratio)))
print("| DataUpload created -> Completed (s) | %s | %d |" % (mmm(col(full, 4)), len(full)))
print("| progress age while InProgress, worst (s) | %s | %d |" % (mmm(col(full, 5)), len(full)))
print("| progress age while InProgress, median (s) | %s | %d |" % (mmm(col(full, 6)), len(full)))
print("| progress writes per minute while InProgress | %s | %d |" % (mmm(col(full, 7)), len(full)))
print("| unchanged data again (incremental): created -> Completed (s) | %s | %d |" % (mmm(col(incr, 4)), len(incr)))
print("| cancel: `spec.cancel` -> Canceled (s) | %s | %d |" % (mmm(col(canc, 1)), len(canc)))
print("| cancel: `spec.cancel` -> no kopia process (s) | %s | %d |" % (mmm(col(canc, 2)), len(canc)))
print()
print("Progress age is bounded by the update interval (a write at most once per interval, when the bytes changed);")
print("the exposure is CSI work (the driver copies the snapshot twice: a snapshot, then a claim from it) and the")
print("scheduler; the transfer is kopia's plus the agent's start (repository connect) and end (snapshot list, clean-up).")
PY
if [ -n "$out" ]; then cp "$W/section.md" "$out"; else cat "$W/section.md" >&3; fi
save_agent_log
say "bench-datamover: done"
}
