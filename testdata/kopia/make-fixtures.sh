#!/usr/bin/env bash
# Writes the kopia fixtures in this directory. They are SYNTHESISED from kopia's documented
# output formats (see README.md), not captured from a real kopia. Run from anywhere:
#   testdata/kopia/make-fixtures.sh
set -euo pipefail
cd "$(dirname "$0")"

# A progress frame as kopia draws it: `\r`, the line, and padding spaces when the line is shorter
# than the previous one.
last=0
frame() {
    local line="$1" pad=""
    if (( ${#line} < last )); then
        pad=$(printf '%*s' $((last - ${#line})) '')
    fi
    last=${#line}
    printf '\r%s%s' "$line" "$pad"
}

# --- snapshot create, complete -------------------------------------------------------------
{
    last=0
    printf 'Snapshotting root@node-1:/host_pods/uid/volumes/kubernetes.io~csi/pvc-1/mount ...\n'
    frame ' | 1 hashing, 0 hashed (0 B), 0 cached (0 B), uploaded 0 B, estimating...'
    frame ' / 2 hashing, 3 hashed (4.2 MB), 0 cached (0 B), uploaded 0 B, estimating...'
    frame ' - 2 hashing, 9 hashed (17.8 MB), 0 cached (0 B), uploaded 10.5 MB, estimated 52.4 MB (34.0%) 5s left'
    frame ' \ 1 hashing, 15 hashed (30.1 MB), 0 cached (0 B), uploaded 25 MB, estimated 52.4 MB (57.4%) 3s left'
    frame ' | 1 hashing, 22 hashed (45.9 MB), 0 cached (0 B), uploaded 41.2 MB, estimated 52.4 MB (87.6%) 1s left'
    frame ' / 0 hashing, 24 hashed (52.4 MB), 0 cached (0 B), uploaded 52.4 MB, estimated 52.4 MB (100.0%) 0s left'
    frame ' * 0 hashing, 24 hashed (52.4 MB), 0 cached (0 B), uploaded 52.4 MB, estimated 52.4 MB (100.0%) 0s left'
    printf '\n'
} > snapshot-complete.stderr
printf '%s\n' '{"id":"2f6e1c0d9b8a7f6e5d4c3b2a19081726","source":{"host":"node-1","userName":"root","path":"/host_pods/uid/volumes/kubernetes.io~csi/pvc-1/mount"},"description":"","startTime":"2026-12-02T10:00:00.123456789Z","endTime":"2026-12-02T10:00:06.987654321Z","rootEntry":{"name":"mount","type":"d","mode":"0755","mtime":"2026-12-02T09:59:00Z","uid":0,"gid":0,"obj":"k9f8e7d6c5b4a39281706f5e4d3c2b1a0","summ":{"size":52428800,"files":24,"symlinks":1,"dirs":4,"maxTime":"2026-12-02T09:59:00Z","numFailed":0}}}' > snapshot-complete.stdout
echo 0 > snapshot-complete.exit

# --- snapshot create, incremental: cached files, percentage above 100, base-2 units -----------
# (KOPIA_BYTES_STRING_BASE_2=true; the estimate was smaller than what was finally read)
{
    last=0
    printf 'Snapshotting root@node-1:/data ...\n'
    frame ' | 0 hashing, 0 hashed (0 B), 3 cached (1.5 MiB), uploaded 0 B, estimating...'
    frame ' / 1 hashing, 1 hashed (512 KiB), 10 cached (8 MiB), uploaded 4 KiB, estimated 9.5 MiB (89.5%) 1s left'
    frame ' - 0 hashing, 2 hashed (1.1 MiB), 12 cached (9.2 MiB), uploaded 600 KiB, estimated 9.5 MiB (108.4%) 0s left'
    frame ' * 0 hashing, 2 hashed (1.1 MiB), 12 cached (9.2 MiB), uploaded 600 KiB, estimated 9.5 MiB (108.4%) 0s left'
    printf '\n'
} > snapshot-incremental-base2.stderr
printf '%s\n' '{"id":"77aa","source":{"host":"node-1","userName":"root","path":"/data"},"startTime":"2026-12-02T11:00:00Z","endTime":"2026-12-02T11:00:01Z","rootEntry":{"name":"data","type":"d","obj":"kaa","summ":{"size":10800000,"files":14,"dirs":2,"maxTime":"2026-12-02T10:00:00Z"}},"tags":{"velero.io/backup":"b1"},"pins":["keep"]}' > snapshot-incremental-base2.stdout
echo 0 > snapshot-incremental-base2.exit

# --- snapshot create with unreadable entries: saved, `Found N fatal error(s)`, exit 1 -------------
{
    last=0
    printf 'Snapshotting root@node-1:/vol ...\n'
    frame ' | 1 hashing, 0 hashed (0 B), 0 cached (0 B), uploaded 0 B, estimating...'
    frame ' / 1 hashing, 4 hashed (2.1 MB), 0 cached (0 B), uploaded 0 B, estimated 10 MB (21.0%) 4s left'
    printf '\n ! Error when processing "secrets/key.pem": unable to open file: open /vol/secrets/key.pem: permission denied\n'
    frame ' - 1 hashing, 6 hashed (4.8 MB), 0 cached (0 B), uploaded 4.8 MB (1 fatal errors), estimated 10 MB (48.0%) 2s left'
    printf '\n ! Error when processing "db/locked.db": unable to open file: open /vol/db/locked.db: permission denied\n'
    frame ' \ 0 hashing, 9 hashed (9.9 MB), 0 cached (0 B), uploaded 9.9 MB (2 fatal errors), estimated 10 MB (99.0%) 0s left'
    frame ' * 0 hashing, 9 hashed (9.9 MB), 0 cached (0 B), uploaded 9.9 MB (2 fatal errors), estimated 10 MB (99.0%) 0s left'
    printf '\n'
    printf 'Found 2 fatal error(s) while snapshotting root@node-1:/vol.\n'
} > snapshot-partial.stderr
printf '%s\n' '{"id":"5e5e5e5e","source":{"host":"node-1","userName":"root","path":"/vol"},"description":"","startTime":"2026-12-02T12:00:00Z","endTime":"2026-12-02T12:00:05Z","rootEntry":{"name":"vol","type":"d","obj":"k5e","summ":{"size":9900000,"files":9,"symlinks":0,"dirs":3,"maxTime":"2026-12-02T11:00:00Z","numFailed":2,"errors":[{"path":"secrets/key.pem","error":"unable to open file: open /vol/secrets/key.pem: permission denied"},{"path":"db/locked.db","error":"unable to open file: open /vol/db/locked.db: permission denied"}]}}}' > snapshot-partial.stdout
echo 1 > snapshot-partial.exit

# --- snapshot create stopped by the first SIGINT: partial snapshot saved, exit 0 ---------------
{
    last=0
    printf 'Snapshotting root@node-1:/vol ...\n'
    frame ' | 2 hashing, 0 hashed (0 B), 0 cached (0 B), uploaded 0 B, estimating...'
    frame ' / 2 hashing, 5 hashed (120.5 MB), 0 cached (0 B), uploaded 100 MB, estimated 1.2 GB (10.0%) 1m30s left'
    frame ' - 1 hashing, 11 hashed (310 MB), 0 cached (0 B), uploaded 300.2 MB, estimated 1.2 GB (25.8%) 1m5s left'
    frame ' * 0 hashing, 11 hashed (310 MB), 0 cached (0 B), uploaded 310 MB, estimated 1.2 GB (25.8%) 1m5s left'
    printf '\n'
} > snapshot-canceled.stderr
printf '%s\n' '{"id":"cc00cc00","source":{"host":"node-1","userName":"root","path":"/vol"},"description":"","startTime":"2026-12-02T13:00:00Z","endTime":"2026-12-02T13:00:20Z","incomplete":"canceled","rootEntry":{"name":"vol","type":"d","obj":"kcc","summ":{"size":310000000,"files":11,"dirs":2,"maxTime":"2026-12-02T12:00:00Z"}}}' > snapshot-canceled.stdout
echo 0 > snapshot-canceled.exit

# --- snapshot restore -----------------------------------------------------------------------------
{
    last=0
    printf 'Restoring to local filesystem (/host_pods/uid2/volumes/kubernetes.io~csi/pvc-2/mount) with parallelism=8...\n'
    frame 'Processed 2 (4.2 MB) of 10 (20 MB).'
    frame 'Processed 5 (10.1 MB) of 25 (52.4 MB) 8.4 MB/s (19.3%) remaining 5s.'
    frame 'Processed 14 (30.2 MB) of 29 (52.4 MB) 9.1 MB/s (57.6%) remaining 2s.'
    frame 'Processed 29 (52.4 MB) of 29 (52.4 MB) 9.3 MB/s (100.0%) remaining 0s.'
    printf '\n'
    printf 'Restored 24 files, 4 directories and 1 symbolic links (52.4 MB).\n'
} > restore.stderr
: > restore.stdout
echo 0 > restore.exit

# --- failures -------------------------------------------------------------------------------------
: > connect-wrong-password.stdout
printf 'Connecting to repository at filesystem:/backups/repo ...\nerror connecting to repository: invalid repository password\n' > connect-wrong-password.stderr
echo 1 > connect-wrong-password.exit

: > connect-not-initialized.stdout
printf 'error connecting to repository: repository not initialized in the provided storage\n' > connect-not-initialized.stderr
echo 1 > connect-not-initialized.exit

: > snapshot-not-connected.stdout
printf 'open repository: repository is not connected. See https://kopia.io/docs/repositories/\n' > snapshot-not-connected.stderr
echo 1 > snapshot-not-connected.exit

# Older releases prefixed error log lines with the level (and colour it unless disabled).
: > snapshot-wrong-password-legacy.stdout
printf '\033[31mERROR\033[0m open repository: unable to open repository: invalid repository password\n' > snapshot-wrong-password-legacy.stderr
echo 1 > snapshot-wrong-password-legacy.exit
