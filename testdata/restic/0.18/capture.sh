#!/usr/bin/env bash
# Captures the 0.18 fixtures of this directory from a real restic binary (see README.md).
#
#   testdata/restic/0.18/capture.sh "$(scripts/fetch-restic-trixie.sh)"
#
# Must run as root (the exit-3 case runs restic as uid 65534 through setpriv). Writes
# <case>.stdout, <case>.stderr (raw bytes, paths normalised) and <case>.exit next to itself.
set -euo pipefail
restic=${1:?usage: capture.sh PATH-TO-RESTIC}
out=$(cd "$(dirname "$0")" && pwd)
T=$(mktemp -d -t restic-fixtures-XXXXXX)
trap 'chmod -R u+rwx "$T" 2>/dev/null; rm -rf "$T"' EXIT
chmod 755 "$T"

echo "correct horse battery staple" >"$T/pw"
echo "not the password" >"$T/wrong-pw"
chmod 644 "$T/pw" "$T/wrong-pw"
mkdir -p "$T/data/small" "$T/empty" "$T/target"
head -c 20000000 /dev/urandom >"$T/data/big1.bin"
head -c 10000000 /dev/urandom >"$T/data/big2.bin"
for i in $(seq 1 10); do head -c $((i * 1000)) /dev/urandom >"$T/data/small/f$i.txt"; done

# restic with the fixture environment; the repository and password come from the caller's env.
r() { "$restic" --cache-dir "$T/cache" "$@"; }

# capture CASE DIR CMD...: runs CMD in DIR, stdin /dev/null, stdout/stderr apart.
capture() {
  local case=$1 dir=$2
  shift 2
  local rc=0
  (cd "$dir" && "$@" </dev/null >"$out/$case.stdout" 2>"$out/$case.stderr") || rc=$?
  echo "$rc" >"$out/$case.exit"
  normalise "$case"
}

# Paths of this run become stable names; nothing else is changed.
normalise() {
  local f
  for f in "$out/$1.stdout" "$out/$1.stderr"; do
    sed -i -e "s#$T/repo#/repo#g" -e "s#$T/data#/data#g" -e "s#$T/empty#/data#g" \
      -e "s#$T/cache#/cache#g" -e "s#$T#/data#g" -e "s# on $host by # on node-1 by #g" "$f"
  done
}

wait_for_lock() {
  for _ in $(seq 1 100); do
    [ -n "$(RESTIC_REPOSITORY=$T/repo RESTIC_PASSWORD_FILE=$T/pw r list locks --no-lock 2>/dev/null)" ] && return 0
    sleep 0.1
  done
  echo "no lock appeared" >&2
  exit 1
}

host=$(hostname)
export RESTIC_REPOSITORY=$T/repo RESTIC_PASSWORD_FILE=$T/pw
unset RESTIC_PROGRESS_FPS
r init >/dev/null

capture version "$T" r version
capture version-json "$T" r version --json
RESTIC_PROGRESS_FPS=2 capture backup-full "$T/data" r --json --limit-upload 8000 backup --host=velero --tag backup=b1 .
first=$(r snapshots --json --no-lock | python3 -c 'import json,sys; print(json.load(sys.stdin)[0]["id"])')
capture backup-incremental "$T/data" r --json backup --host=velero --tag backup=b2 --parent "$first" .
echo changed >>"$T/data/small/f1.txt"
echo new >"$T/data/small/new.txt"
capture backup-verbose "$T/data" r --json -v backup --host=velero .
capture snapshots "$T" r snapshots --json --no-lock
capture stats-restore-size "$T" r stats "$first" --json
capture restore-json "$T/target" r --json --limit-download 8000 restore "$first" --target=.
capture restore-missing-snapshot "$T/target" r --json restore deadbeef --target=.
capture empty-dir "$T/empty" r --json backup --host=velero .

# Exit 3: two entries unreadable for uid 65534.
echo "top secret" >"$T/data/secret.txt"
chmod 000 "$T/data/secret.txt"
mkdir "$T/data/secretdir" && echo x >"$T/data/secretdir/inside" && chmod 000 "$T/data/secretdir"
chmod -R a+rwX "$T/repo"
mkdir -m 777 "$T/cache-nobody"
capture backup-partial "$T/data" setpriv --reuid=65534 --regid=65534 --clear-groups \
  "$restic" --cache-dir "$T/cache-nobody" --json backup --host=velero .
chmod 644 "$T/data/secret.txt" && chmod 755 "$T/data/secretdir"
rm -rf "$T/data/secret.txt" "$T/data/secretdir"

RESTIC_PASSWORD_FILE=$T/wrong-pw capture wrong-password "$T/data" r --json backup --host=velero .
RESTIC_REPOSITORY=$T/repo-missing capture repo-missing "$T/data" r --json backup --host=velero .

# A lock held by a live process: `check --read-data`, slowed, holds an exclusive lock.
"$restic" --cache-dir "$T/cache" check --read-data --limit-download 64 </dev/null >/dev/null 2>&1 &
holder=$!
wait_for_lock
capture locked "$T/data" r --json backup --host=velero .
capture locked-retry-lock "$T/data" r --json --retry-lock 2s backup --host=velero .
kill -0 "$holder" || { echo "the lock holder ended before the lock cases were captured" >&2; exit 1; }
kill -INT "$holder"
wait "$holder" || true
r unlock >/dev/null 2>&1
[ -z "$(r list locks --no-lock)" ] || { echo "a lock is left" >&2; exit 1; }

# SIGINT mid-backup: the signal to restic 2 s after start.
head -c 60000000 /dev/urandom >"$T/data/big3.bin"
(cd "$T/data" && exec "$restic" --cache-dir "$T/cache" --json --limit-upload 500 backup --host=velero . \
  </dev/null >"$out/sigint.stdout" 2>"$out/sigint.stderr") &
pid=$!
sleep 2
kill -INT "$pid"
rc=0
wait "$pid" || rc=$?
echo "$rc" >"$out/sigint.exit"
normalise sigint
capture sigint-list-locks "$T" r list locks --no-lock

echo "captured with $("$restic" version)" >&2
