#!/usr/bin/env bash
# Captures what a real kopia prints (stdout, stderr as raw bytes with the `\r` redraws, exit code)
# for the scenarios the agent's kopia parser and engine depend on.
#
#   testdata/kopia/capture.sh <path to kopia> <output dir>
#   e.g. testdata/kopia/capture.sh ~/.cache/podvolume-agent/tools/kopia/0.23.1/kopia testdata/kopia/0.23.1
#
# Needs root (the unreadable-file cases run kopia as `nobody` through setpriv), perl (to tell an
# exit code from death by a signal), setsid, script (util-linux) and about 1 GB of free space in
# $TMPDIR (default /tmp). Takes 3-4 minutes per version.
#
# Each case writes <case>.stdout, <case>.stderr and <case>.exit (the exit code; 128+N when kopia
# was killed by signal N) into the output dir, and one line to notes.txt (argv with the temp dir
# written as $T, wall time, frame counts, signal timings). Outputs contain the temp dir path
# (/tmp/kopia-capture.XXXXXX), the host name and real timestamps/IDs: they are not normalised.
#
# Environment given to every kopia run (the agent's own set): a private KOPIA_CONFIG_PATH,
# KOPIA_CACHE_DIRECTORY and KOPIA_LOG_DIR under the temp dir, KOPIA_PASSWORD (never a password in
# argv), KOPIA_CHECK_FOR_UPDATES=false, KOPIA_PERSIST_CREDENTIALS_ON_CONNECT=false,
# KOPIA_USE_KEYRING=false, KOPIA_DISABLE_COLOR=true (one case runs without it). Every command
# that writes to the repository gets --no-auto-maintenance.
#
# The repository gets an upload and download throttle of 10 MB/s (`repository throttle set`) so
# that a 200 MB snapshot or restore takes ~14 s and draws many progress frames. kopia's token
# bucket starts 10% full over a 60 s window, i.e. the first ~60 MB of each process go unthrottled.
# (`snapshot create --upload-limit-mb` is not a rate limit: it stops the snapshot after that much
# data, see case snapshot-upload-limit.)
set -euo pipefail

if [ $# -ne 2 ]; then
  echo "usage: $0 <path to kopia> <output dir>" >&2
  exit 2
fi
[ "$(id -u)" = 0 ] || { echo "$0: must run as root (cases run kopia as nobody via setpriv)" >&2; exit 2; }
for tool in perl setsid setpriv script; do
  command -v "$tool" >/dev/null || { echo "$0: $tool is missing" >&2; exit 2; }
done

KOPIA_SRC=$(readlink -f "$1")
[ -x "$KOPIA_SRC" ] || { echo "$0: $1 is not executable" >&2; exit 2; }
mkdir -p "$2"
OUT=$(cd "$2" && pwd)

T=$(mktemp -d /tmp/kopia-capture.XXXXXX)
chmod 0711 "$T"
BG_PIDS=()
cleanup() {
  local p
  for p in "${BG_PIDS[@]}"; do kill -KILL -- "-$p" 2>/dev/null || true; done
  rm -rf "$T"
}
trap cleanup EXIT

# A copy of the binary that `nobody` can execute (the install cache lives under /root).
mkdir -p "$T/bin"
cp "$KOPIA_SRC" "$T/bin/kopia"
chmod 0755 "$T/bin/kopia"
KOPIA=$T/bin/kopia

PASSWORD='capture-Passw0rd'
export KOPIA_CONFIG_PATH=$T/config/repository.config
export KOPIA_CACHE_DIRECTORY=$T/cache
export KOPIA_LOG_DIR=$T/logs
export KOPIA_PASSWORD=$PASSWORD
export KOPIA_CHECK_FOR_UPDATES=false
export KOPIA_PERSIST_CREDENTIALS_ON_CONNECT=false
export KOPIA_USE_KEYRING=false
export KOPIA_DISABLE_COLOR=true
unset KOPIA_BYTES_STRING_BASE_2 KOPIA_SNAPSHOT_FAIL_FAST KOPIA_FORCE_COLOR || true

REPO=$T/repo
NOTES=$OUT/notes.txt
VERSION=$("$KOPIA" --version 2>/dev/null | awk '{print $1}')
: >"$NOTES"
# Remove earlier outputs of this script so a re-run leaves no stale cases behind.
rm -f "$OUT"/*.stdout "$OUT"/*.stderr "$OUT"/*.exit

note() { printf '%s\n' "$*" >>"$NOTES"; }
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", b - a }'; }
frames() { tr -cd '\r' <"$1" | wc -c; }
# argv for the notes, with the temp dir written as $T.
show() {
  local s
  s=$(printf '%q ' "$@")
  printf '%s' "${s//$T/\$T}"
}
ver_ge() { [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -1)" = "$2" ]; }

# run_case NAME CMD...: runs CMD (stdin /dev/null), records stdout, stderr and exit code.
run_case() {
  local name=$1 rc=0 t0 t1
  shift
  t0=$(now)
  "$@" </dev/null >"$OUT/$name.stdout" 2>"$OUT/$name.stderr" || rc=$?
  t1=$(now)
  echo "$rc" >"$OUT/$name.exit"
  note "$name: exit $rc, $(elapsed "$t0" "$t1") s, $(frames "$OUT/$name.stderr") \\r; $(show "$@")"
  return 0
}

# Runs kopia (argv after the status file) in a new process group under a small perl parent that
# ignores SIGINT/SIGTERM itself and writes kopia's wait status: "exit N" or "signal N".
PERL_WAIT='
  $SIG{INT} = $SIG{TERM} = "IGNORE";
  my $status_file = shift @ARGV;
  my $pid = fork() // die "fork: $!";
  if ($pid == 0) { $SIG{INT} = $SIG{TERM} = "DEFAULT"; exec { $ARGV[0] } @ARGV or exit 127; }
  waitpid($pid, 0);
  my $s = $?;
  open(my $f, ">", $status_file) or die;
  if ($s & 127) { print $f "signal ", $s & 127, "\n"; exit 128 + ($s & 127); }
  print $f "exit ", $s >> 8, "\n"; exit $s >> 8;
'

# signal_case NAME SIGNAL COUNT CMD...: starts CMD in its own process group, waits until stderr
# holds at least 4 progress frames (\r) and one more second, then sends SIGNAL to the group COUNT
# times (0.5 s apart) and waits for the exit.
signal_case() {
  local name=$1 sig=$2 count=$3 rc=0 pg i t0 t1 t2 status waited=0
  shift 3
  t0=$(now)
  : >"$OUT/$name.stderr"
  setsid perl -e "$PERL_WAIT" "$T/status" "$@" </dev/null >"$OUT/$name.stdout" 2>"$OUT/$name.stderr" &
  pg=$!
  BG_PIDS+=("$pg")
  while [ "$(frames "$OUT/$name.stderr")" -lt 4 ] && kill -0 "$pg" 2>/dev/null && [ $waited -lt 600 ]; do
    sleep 0.1
    waited=$((waited + 1))
  done
  sleep 1
  t1=$(now)
  local before
  before=$(frames "$OUT/$name.stderr")
  for ((i = 0; i < count; i++)); do
    [ "$i" -gt 0 ] && sleep 0.5
    kill -s "$sig" -- "-$pg" 2>/dev/null || true
  done
  wait "$pg" || rc=$?
  t2=$(now)
  BG_PIDS=("${BG_PIDS[@]/$pg/}")
  status=$(cat "$T/status" 2>/dev/null || echo "unknown")
  rm -f "$T/status"
  echo "$rc" >"$OUT/$name.exit"
  note "$name: $count x SIG$sig to the process group $(elapsed "$t0" "$t1") s after start, $before \\r before it; kopia: $status ($(elapsed "$t1" "$t2") s after the first signal), $(frames "$OUT/$name.stderr") \\r in all; $(show "$@")"
}

# stdout_tty_case NAME CMD...: like run_case, but stdout is a pseudo-terminal (script(1)); stderr
# is still a file. The pty turns \n into \r\n on stdout.
stdout_tty_case() {
  local name=$1 rc=0 t0 t1 cmd
  shift
  cmd="$(printf '%q ' "$@") 2>$(printf '%q' "$OUT/$name.stderr")"
  t0=$(now)
  script -qec "$cmd" /dev/null </dev/null >"$OUT/$name.stdout" || rc=$?
  t1=$(now)
  echo "$rc" >"$OUT/$name.exit"
  note "$name: exit $rc, $(elapsed "$t0" "$t1") s, $(frames "$OUT/$name.stderr") \\r on stderr; stdout is a pty; $(show "$@")"
}

k() { "$KOPIA" "$@"; }
# 200 MB-ish source: five random 36 MB files, a 20 MB sparse file, small files, a subdir, a symlink.
make_data() {
  local dir=$1 mb=$2 i
  mkdir -p "$dir/sub"
  for i in 1 2 3 4 5; do head -c $((mb * 1000000 / 5)) /dev/urandom >"$dir/file$i.bin"; done
  printf 'hello %s\n' "$dir" >"$dir/sub/small.txt"
  head -c 5000 /dev/urandom >"$dir/sub/five-k.bin"
  ln -s sub/small.txt "$dir/link-to-small"
}
json_id() { sed -n 's/^{"id":"\([0-9a-f]*\)".*/\1/p' "$1" | head -1; }

note "kopia $VERSION ($KOPIA_SRC), captured $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -sm), host name $(hostname)"

# --- version, repository create, throttle ------------------------------------------------------
run_case version k --version
run_case repository-create k repository create filesystem --path="$REPO" --no-auto-maintenance
run_case throttle-set k repository throttle set --upload-bytes-per-second=10000000 \
  --download-bytes-per-second=10000000 --no-auto-maintenance

# --- full and incremental snapshots ------------------------------------------------------------
DATA=$T/src/data
make_data "$DATA" 180
truncate -s 20M "$DATA/sparse.img"
printf 'not zero' | dd of="$DATA/sparse.img" bs=1 seek=10000000 conv=notrunc status=none
run_case snapshot-full k snapshot create "$DATA" --json --progress --no-auto-maintenance
FULL_ID=$(json_id "$OUT/snapshot-full.stdout")
note "  snapshot-full id: $FULL_ID"

printf 'a little new data\n' >"$DATA/sub/new-1.txt"
run_case snapshot-incremental k snapshot create "$DATA" --json --progress --no-auto-maintenance
printf 'a little more new data\n' >"$DATA/sub/new-2.txt"
# --json-verbose alone does not switch on JSON output; with --json it adds "stats" to the manifest.
run_case snapshot-json-verbose-without-json k snapshot create "$DATA" --json-verbose --progress --no-auto-maintenance
run_case snapshot-incremental-json-verbose k snapshot create "$DATA" --json --json-verbose --progress --no-auto-maintenance

# --- progress switches -------------------------------------------------------------------------
make_data "$T/src/interval-100ms" 150
run_case snapshot-progress-interval-100ms k snapshot create "$T/src/interval-100ms" --json --progress \
  --progress-update-interval=100ms --no-auto-maintenance
make_data "$T/src/interval-2s" 150
run_case snapshot-progress-interval-2s k snapshot create "$T/src/interval-2s" --json --progress \
  --progress-update-interval=2s --no-auto-maintenance
make_data "$T/src/no-progress-flag" 100
run_case snapshot-no-progress-flag k snapshot create "$T/src/no-progress-flag" --json --no-auto-maintenance
make_data "$T/src/explicit-no-progress" 100
run_case snapshot-explicit-no-progress k snapshot create "$T/src/explicit-no-progress" --json --no-progress --no-auto-maintenance
make_data "$T/src/stdout-tty" 100
stdout_tty_case snapshot-stdout-tty "$KOPIA" snapshot create "$T/src/stdout-tty" --json --no-auto-maintenance
rm -rf "$T/src/interval-100ms" "$T/src/interval-2s" "$T/src/no-progress-flag" "$T/src/explicit-no-progress" "$T/src/stdout-tty"

# --upload-limit-mb stops the snapshot after N MB.
make_data "$T/src/upload-limit" 100
run_case snapshot-upload-limit k snapshot create "$T/src/upload-limit" --json --progress --upload-limit-mb=30 --no-auto-maintenance
rm -rf "$T/src/upload-limit"

# --- signals during snapshot create ------------------------------------------------------------
for c in "sigint INT 1" "sigint-twice INT 2" "sigterm TERM 1" "sigterm-twice TERM 2"; do
  set -- $c
  make_data "$T/src/$1" 200
  signal_case "snapshot-$1" "$2" "$3" "$KOPIA" snapshot create "$T/src/$1" --json --progress --no-auto-maintenance
  rm -rf "${T:?}/src/$1"
done

# --- Velero-style source, policy, pins, tags ---------------------------------------------------
VSRC=default@default:snapshot-pod-volume/kopia/ns/pod/vol
run_case policy-set-velero k policy set "$VSRC" --keep-latest=2147483647 --keep-hourly=2147483647 \
  --keep-daily=2147483647 --keep-weekly=2147483647 --keep-monthly=2147483647 --keep-annual=2147483647 \
  --compression=none --manual --ignore-unknown-types=true --no-auto-maintenance
run_case policy-show-velero k policy show "$VSRC"
run_case snapshot-velero k snapshot create "$DATA" --override-source="$VSRC" --description="Kopia Uploader" \
  --pin=velero-pin --tags k:v --json --progress --fail-fast --parallel=2 --no-auto-maintenance
printf 'velero second run\n' >"$DATA/sub/new-3.txt"
run_case snapshot-velero-2-json-verbose k snapshot create "$DATA" --override-source="$VSRC" \
  --description="Kopia Uploader" --pin=velero-pin --tags k:v --json --json-verbose --progress --fail-fast --parallel=2 \
  --no-auto-maintenance
run_case snapshot-list-velero k snapshot list --json "$VSRC"

# --- restore -----------------------------------------------------------------------------------
# A fresh cache directory for each restore so that the data is read (throttled) from the repository.
KOPIA_CACHE_DIRECTORY=$T/cache-r1 run_case restore k snapshot restore "$FULL_ID" "$T/restore-1" --progress
KOPIA_CACHE_DIRECTORY=$T/cache-r2 run_case restore-parallel-sparse k snapshot restore "$FULL_ID" "$T/restore-2" \
  --progress --parallel=4 --write-sparse-files
note "  sparse.img in restore-2: $(du -k --apparent-size "$T/restore-2/sparse.img" | cut -f1) KiB apparent, $(du -k "$T/restore-2/sparse.img" | cut -f1) KiB allocated; in restore-1: $(du -k "$T/restore-1/sparse.img" | cut -f1) KiB allocated"
KOPIA_CACHE_DIRECTORY=$T/cache-r3 run_case restore-no-progress-flag k snapshot restore "$FULL_ID" "$T/restore-3"
rm -rf "$T/restore-1" "$T/restore-2" "$T/restore-3" "$T"/cache-r?
KOPIA_CACHE_DIRECTORY=$T/cache-r4 signal_case restore-sigint INT 1 "$KOPIA" snapshot restore "$FULL_ID" "$T/restore-4" --progress
KOPIA_CACHE_DIRECTORY=$T/cache-r5 signal_case restore-sigterm TERM 1 "$KOPIA" snapshot restore "$FULL_ID" "$T/restore-5" --progress
rm -rf "$T/restore-4" "$T/restore-5" "$T"/cache-r?

run_case snapshot-list k snapshot list --json
run_case snapshot-list-all k snapshot list --json --all

# --- errors: password, repository, connection, source ------------------------------------------
mkdir -p "$T/empty-dir"
KOPIA_CONFIG_PATH=$T/config-x/repository.config KOPIA_PASSWORD=wrong-password \
  run_case connect-wrong-password k repository connect filesystem --path="$REPO"
KOPIA_CONFIG_PATH=$T/config-x/repository.config KOPIA_PASSWORD=wrong-password \
  run_case connect-wrong-password-color env -u KOPIA_DISABLE_COLOR "$KOPIA" repository connect filesystem --path="$REPO"
KOPIA_CONFIG_PATH=$T/config-x/repository.config \
  run_case connect-empty-dir k repository connect filesystem --path="$T/empty-dir"
KOPIA_CONFIG_PATH=$T/config-x/repository.config \
  run_case connect-missing-dir k repository connect filesystem --path="$T/no-such-dir"
KOPIA_PASSWORD=wrong-password run_case snapshot-wrong-password k snapshot create "$DATA" --json --progress --no-auto-maintenance
run_case snapshot-no-password timeout 60 env -u KOPIA_PASSWORD "$KOPIA" snapshot create "$DATA" --json --progress --no-auto-maintenance
KOPIA_CONFIG_PATH=$T/config-none/repository.config \
  run_case snapshot-not-connected k snapshot create "$DATA" --json --progress --no-auto-maintenance
run_case snapshot-missing-source k snapshot create "$T/src/no-such-dir" --json --progress --no-auto-maintenance
mv "$REPO" "$REPO.moved"
run_case snapshot-repository-gone k snapshot create "$DATA" --json --progress --no-auto-maintenance
mv "$REPO.moved" "$REPO"

# --- credentials persistence -------------------------------------------------------------------
KOPIA_CONFIG_PATH=$T/config-p1/repository.config \
  run_case connect-persist-default env -u KOPIA_PERSIST_CREDENTIALS_ON_CONNECT "$KOPIA" repository connect filesystem --path="$REPO"
note "  config-p1: $(cd "$T/config-p1" && ls | tr '\n' ' ')"
KOPIA_CONFIG_PATH=$T/config-p2/repository.config \
  run_case connect-no-persist-credentials env -u KOPIA_PERSIST_CREDENTIALS_ON_CONNECT "$KOPIA" repository connect filesystem \
  --path="$REPO" --no-persist-credentials
note "  config-p2: $(cd "$T/config-p2" && ls | tr '\n' ' ')"

# --- flags that do or do not exist in this version ---------------------------------------------
for f in --no-auto-maintenance --progress --no-progress --progress-update-interval=1s --json-verbose \
  --disable-repository-log --disable-internal-log --disable-content-log --no-persist-credentials \
  --disable-color --no-check-for-updates; do
  n=${f#--}
  n=${n%%=*}
  run_case "flag-$n" k snapshot list --json "$f" default@default:/flag-probe
done
# --no-check-for-updates belongs to repository connect.
KOPIA_CONFIG_PATH=$T/config-p3/repository.config \
  run_case connect-no-check-for-updates k repository connect filesystem --path="$REPO" --no-check-for-updates

# --- unreadable entries, as nobody over a repository of its own --------------------------------
NB=$T/nobody
mkdir -p "$NB/data/locked"
head -c 2000000 /dev/urandom >"$NB/data/a-readable.bin"
printf 'readable\n' >"$NB/data/b-readable.txt"
printf 'secret\n' >"$NB/data/secret.txt"
printf 'inside\n' >"$NB/data/locked/inside.txt"
chown -R nobody:nogroup "$NB"
chmod 0700 "$NB"
chmod 0000 "$NB/data/secret.txt" "$NB/data/locked"
nb() {
  setpriv --reuid=nobody --regid=nogroup --clear-groups env HOME="$NB" \
    KOPIA_CONFIG_PATH="$NB/config/repository.config" KOPIA_CACHE_DIRECTORY="$NB/cache" \
    KOPIA_LOG_DIR="$NB/logs" "$KOPIA" "$@"
}
run_case nobody-repository-create nb repository create filesystem --path="$NB/repo" --no-auto-maintenance
run_case snapshot-unreadable nb snapshot create "$NB/data" --json --progress --no-auto-maintenance
run_case snapshot-unreadable-json-verbose nb snapshot create "$NB/data" --json --json-verbose --progress --no-auto-maintenance
run_case snapshot-unreadable-fail-fast nb snapshot create "$NB/data" --json --progress --fail-fast --no-auto-maintenance
run_case snapshot-unreadable-no-progress nb snapshot create "$NB/data" --json --no-progress --no-auto-maintenance
run_case policy-set-ignore-errors nb policy set "$NB/data" --ignore-file-errors=true --ignore-dir-errors=true --no-auto-maintenance
run_case snapshot-unreadable-ignored nb snapshot create "$NB/data" --json --progress --no-auto-maintenance
run_case snapshot-list-nobody nb snapshot list --json "$NB/data"

note "done"
echo "kopia $VERSION: $(ls "$OUT" | grep -c '\.exit$') cases in $OUT" >&2
