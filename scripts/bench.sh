#!/usr/bin/env bash
# Runs the benchmarks and writes BENCHMARKS.md (the figures the README quotes).
#
#   scripts/bench.sh            full run (the documented numbers; about 4 hours on 2 CPUs, 3 of them
#                               case 9's 4 GiB and 200,000-file volumes against Velero's data path)
#   scripts/bench.sh --quick    small sizes and few runs, a fast check that everything works
#   scripts/bench.sh --capture  also re-capture testdata/restic-streams/ with the installed restic
#   scripts/bench.sh --case 9 [--runs N] [--quick]
#                               case 9 alone (every shape, both stores; N runs a row, default 3,
#                               57-63 minutes a run at full size), its section of BENCHMARKS.md
#                               replaced in place, the other cases kept
#
# Needs restic on PATH (or RESTIC=/path/to/restic), kopia (KOPIA=..., else scripts/install-kopia.sh
# builds the pinned one), the control plane of cases 4b and 5 (scripts/install-control-plane.sh)
# and Velero 1.18.3 for its CRDs (scripts/install-velero.sh; both build once, cached) and /proc;
# case 8 (scripts/bench-datamover.sh: CSI data movement on a real node, about 10 minutes) and
# case 9 (scripts/bench-velero-path.sh: against Velero 1.18's own data path) need root.
# Work files go to a temporary
# directory under BENCH_WORK_PARENT (default /var/tmp: a real disk, not tmpfs), removed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."

quick=0
capture=0
only_case=
case9_runs=()
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) quick=1 ;;
    --capture) capture=1 ;;
    --case) only_case=$2; shift ;;
    --runs) case9_runs=(--runs "$2"); shift ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done
case "$only_case" in
  ''|9) ;;
  *) echo "--case: only case 9 runs alone (the others take minutes together)" >&2; exit 2 ;;
esac
[ ${#case9_runs[@]} -eq 0 ] || [ "$only_case" = 9 ] || { echo "--runs goes with --case 9" >&2; exit 2; }

export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target-bench}"
RESTIC="${RESTIC:-$(command -v restic)}"
# The kopia of case 7: KOPIA=/path/to/kopia, else the pinned one (built once, cached).
if [ -z "${KOPIA:-}" ]; then read -r _ KOPIA < <(scripts/install-kopia.sh 0.22.3); fi
# Cases 4b and 5: a real kube-apiserver (etcd, kube-controller-manager, kubectl) and Velero's CRDs.
cp_bin=$(scripts/install-control-plane.sh)
read -r velero_version velero_dir < <(scripts/install-velero.sh 1.18.3)
OUT="${BENCH_OUT:-BENCHMARKS.md}"
if [ "$quick" = 1 ]; then runs=3; cpu_runs=3; cancel_runs=3; agent_cancel_runs=3; objects=2000; big_objects=20000; secs=0.1; quick_flag=--quick
else runs=5; cpu_runs=15; cancel_runs=20; agent_cancel_runs=10; objects=10000; big_objects=100000; secs=0.5; quick_flag=; fi

work="$(mktemp -d "${BENCH_WORK_PARENT:-/var/tmp}/pva-bench.XXXXXX")"
trap 'rm -rf "$work"' EXIT
parts="$work/parts"; mkdir -p "$parts"
"$velero_dir/velero" install --crds-only --dry-run -o yaml >"$work/velero-$velero_version-crds.yaml"

if [ "$only_case" = 9 ]; then
  [ "$(id -u)" -eq 0 ] || { echo "case 9 needs root (see scripts/bench-velero-path.sh)" >&2; exit 1; }
  [ -f "$OUT" ] || { echo "$OUT is missing: a whole run writes it first" >&2; exit 1; }
  if ! KOPIA="$KOPIA" scripts/bench-velero-path.sh $quick_flag "${case9_runs[@]}" --out "$parts/9.md" >&2; then
    # The report is rewritten after every store and shape: what was measured before the failure
    # is kept beside $OUT (marked partial), not spliced in.
    if [ -s "$parts/9.md" ]; then cp "$parts/9.md" "${OUT%.md}.case9-partial.md"
      echo "case 9 failed; what it measured before: ${OUT%.md}.case9-partial.md" >&2; fi
    exit 1
  fi
  # The generated part of the section ("## 9." to its "Largest wall ratio" line, else to the
  # next case or the end) replaced; the rest of the file, notes written below it included, kept.
  python3 - "$OUT" "$parts/9.md" <<'PY'
import sys
out, part = sys.argv[1], sys.argv[2]
lines = open(out).read().split("\n")
start = next((i for i, l in enumerate(lines) if l.startswith("## 9.")), None)
if start is None:
    sys.exit(f"{out} has no case 9 section to replace")
end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
last = next((i for i in range(start + 1, end) if lines[i].startswith("Largest wall ratio")), None)
end = end if last is None else last + 1
new = open(part).read().rstrip("\n").split("\n")
tail = lines[end:] if end < len(lines) else [""]
open(out, "w").write("\n".join(lines[:start] + new + [""] + tail))
PY
  echo "case 9 replaced in $OUT" >&2
  exit 0
fi

echo "building (release)..." >&2
cargo build --release --bin podvolume-agent >&2
cargo bench --bench podvolume --no-run >&2
bench() { cargo bench --quiet --bench podvolume -- "$@"; }

if [ "$capture" = 1 ]; then
  bench capture --restic "$RESTIC" --work "$work/capture" --out testdata/restic-streams >&2
fi

echo "case 6: parser throughput" >&2
bench parser --streams testdata/restic-streams --secs "$secs" --out "$parts/6.md" >/dev/null
echo "case 3: progress replay" >&2
bench replay --streams testdata/restic-streams --out "$parts/3.md" >/dev/null
echo "cases 1 and 2: overhead and incremental" >&2
bench overhead --restic "$RESTIC" --agent "$CARGO_TARGET_DIR/release/podvolume-agent" \
  --work "$work/overhead" --runs "$runs" --cpu-runs "$cpu_runs" $quick_flag --out "$parts/1-2.md" >/dev/null
rm -rf "$work/overhead"
echo "case 4: cancel latency" >&2
bench cancel --restic "$RESTIC" --work "$work/cancel" --runs "$cancel_runs" --out "$parts/4.md" >/dev/null
rm -rf "$work/cancel"
echo "case 7: kopia (overhead over bare kopia, progress age, cancel latency)" >&2
bench kopia --kopia "$KOPIA" --agent "$CARGO_TARGET_DIR/release/podvolume-agent" --work "$work/kopia" \
  --runs "$runs" --cancel-runs "$cancel_runs" $quick_flag --out "$parts/7.md" >/dev/null
rm -rf "$work/kopia"
echo "case 8: CSI snapshot data movement on the real node (scripts/bench-datamover.sh)" >&2
if [ "$(id -u)" -eq 0 ]; then
  scripts/bench-datamover.sh $quick_flag --out "$parts/8.md" >&2
else
  printf '## 8. CSI snapshot data movement (DataUploads) on the real node\n\nNot run: it runs a real node, which needs root.\n' >"$parts/8.md"
fi
echo "case 9: the agent against Velero 1.18's own data path (scripts/bench-velero-path.sh)" >&2
if [ "$(id -u)" -eq 0 ]; then
  KOPIA="$KOPIA" scripts/bench-velero-path.sh $quick_flag --out "$parts/9.md" >&2
else
  printf '## 9. agent vs Velero 1.18 data path\n\nNot run: Velero'"'"'s data path runs in a mount namespace of its own, which needs root.\n' >"$parts/9.md"
fi
echo "cases 4b and 5: the agent against a real kube-apiserver" >&2
agent_bench() {
  bench agent --restic "$RESTIC" --agent "$CARGO_TARGET_DIR/release/podvolume-agent" \
    --control-plane-bin "$cp_bin" --velero-crds "$work/velero-$velero_version-crds.yaml" \
    --work "$work/agent" --running 4 $quick_flag "$@"
}
agent_bench --cancel-runs "$agent_cancel_runs" --objects "$objects" --out "$parts/4b-5.md" >/dev/null
rm -rf "$work/agent"
echo "case 5 with $big_objects objects (real kube-apiserver)" >&2
agent_bench --cancel-runs 1 --objects "$big_objects" --out "$parts/5-big.md" >/dev/null
rm -rf "$work/agent"
# Only its case 5 (its one cancel run is not a measurement).
sed -n '/^## 5\. /,$p' "$parts/5-big.md" > "$parts/5b.md"

cpu="$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)"
mem_kib="$(sed -n 's/^MemTotal:[[:space:]]*\([0-9]*\) kB/\1/p' /proc/meminfo)"
{
  echo "# Benchmarks"
  echo
  echo "Generated by \`scripts/bench.sh$([ "$quick" = 1 ] && echo ' --quick')\` — do not edit by hand."
  [ "$quick" = 1 ] && echo && echo "**Quick mode: small sizes and few runs; not the documented figures.**"
  echo
  echo "| machine | |"
  echo "|---|---|"
  echo "| date (UTC) | $(date -u +%Y-%m-%dT%H:%M:%SZ) |"
  echo "| CPU | ${cpu:-unknown} |"
  echo "| cores (online) | $(nproc) |"
  echo "| memory | $((mem_kib / 1024)) MiB |"
  echo "| kernel | $(uname -sr) |"
  echo "| restic | $("$RESTIC" version | head -1) |"
  echo "| kopia | $("$KOPIA" --version | head -1) |"
  echo "| rustc | $(rustc --version) |"
  echo "| commit | $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- src Cargo.toml benches || echo ' (with local changes)') |"
  echo "| work dir filesystem | $(df -T "$work" | awk 'NR==2 {print $2}') on $(df "$work" | awk 'NR==2 {print $1}') |"
  echo
  echo "The machine is shared and noisy: read the medians and the ratios (measured in the same"
  echo "run, alternating), not single absolute times."
  echo
  cat "$parts/1-2.md" "$parts/3.md" "$parts/4.md" "$parts/4b-5.md" "$parts/5b.md" "$parts/6.md" "$parts/7.md" "$parts/8.md" "$parts/9.md"
} > "$OUT"
echo "wrote $OUT" >&2
