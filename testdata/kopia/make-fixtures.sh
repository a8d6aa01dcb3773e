#!/usr/bin/env bash
# Writes the one synthesised kopia fixture left in this directory, snapshot-incremental-base2
# (base-2 units and a percentage above 100, which no capture in <version>/ holds). It is
# SYNTHESISED from kopia's output format, not captured. Run from anywhere:
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
