//! The kopia commands the agent runs: create, snapshot, policy, delete, restore.

use super::*;

/// `kopia repository create filesystem --path=<repo>`: initialises the repository and connects.
pub fn create(access: &RepositoryAccess) -> Result<KopiaInvocation, Error> {
    repository_command(access, "create")
}

/// What a snapshot records besides the data: Velero 1.17+ snapshots carry a source identity
/// of their own (`default@default:snapshot-pod-volume/kopia/<ns>/<pod>/<volume>`), the
/// description `Kopia Uploader` and the pin `velero-pin`.
#[derive(Debug, Clone, Default)]
pub struct SnapshotOptions {
    /// `--override-source user@host:path`: the identity the snapshot is filed under (and the
    /// previous snapshots kopia chooses a parent among).
    pub source: Option<String>,
    pub description: Option<String>,
    pub pins: Vec<String>,
    /// Files read at once (`--parallel`).
    pub parallel: Option<u32>,
    /// `--fail-fast`: stop at the first unreadable entry (Velero sets it).
    pub fail_fast: bool,
    /// Set Velero's keep-everything policy on the source before the snapshot: without a policy
    /// of its own the source falls under kopia's default retention (10 latest, 48 hourly, ...),
    /// which `snapshot create` applies at once and would delete snapshots Velero still needs.
    pub keep_all_policy: bool,
}

/// `kopia snapshot create --json --progress <source>`: progress on stderr, manifest on stdout.
pub fn snapshot_create(
    access: &RepositoryAccess,
    source: &Path,
    tags: &[(String, String)],
    options: &SnapshotOptions,
) -> Result<KopiaInvocation, Error> {
    let mut inv = base(access)?
        .arg("snapshot")
        .arg("create")
        .arg("--json")
        // With --json: the manifest with its statistics (files cached / read), which
        // incremental_bytes needs; alone it prints no manifest at all.
        .arg("--json-verbose")
        .arg("--progress")
        .arg("--no-auto-maintenance");
    if let Some(s) = &options.source {
        inv = inv.arg(format!("--override-source={s}"));
    }
    if let Some(d) = &options.description {
        inv = inv.arg(format!("--description={d}"));
    }
    for p in &options.pins {
        inv = inv.arg(format!("--pin={p}"));
    }
    for (k, v) in tags {
        inv = inv.arg(format!("--tags={k}:{v}"));
    }
    if let Some(n) = options.parallel {
        inv = inv.arg(format!("--parallel={n}"));
    }
    if options.fail_fast {
        inv = inv.arg("--fail-fast");
    }
    Ok(inv.arg(source.as_os_str()))
}

/// Velero's per-source policy (keep everything, no compression, manual scheduling, unknown
/// entry types ignored), set on `source` (`user@host:path`) before its snapshots.
pub fn policy_keep_all(access: &RepositoryAccess, source: &str) -> Result<KopiaInvocation, Error> {
    const KEEP: &str = "2147483647";
    let mut inv = base(access)?.arg("policy").arg("set").arg(source);
    for k in ["latest", "hourly", "daily", "weekly", "monthly", "annual"] {
        inv = inv.arg(format!("--keep-{k}={KEEP}"));
    }
    Ok(inv
        .arg("--compression=none")
        .arg("--manual")
        .arg("--ignore-unknown-types=true")
        .arg("--no-auto-maintenance"))
}

/// Deletes one snapshot manifest: only one the agent itself has just made (its Backup ended
/// while it ran, so no Backup references it). Its content goes with Velero's next maintenance.
pub fn snapshot_delete(access: &RepositoryAccess, id: &str) -> Result<KopiaInvocation, Error> {
    check_snapshot_id(id)?;
    Ok(base(access)?
        .arg("snapshot")
        .arg("delete")
        .arg(id)
        .arg("--delete")
        .arg("--no-auto-maintenance"))
}

/// The longest snapshot ID accepted for a restore: kopia's manifest IDs are 32 hex digits and its
/// object IDs (`k<hash>`, `Ix<hash>`) a few characters more than their hash; this leaves room.
pub const MAX_SNAPSHOT_ID_LEN: usize = 128;

/// A snapshot ID for kopia's argv: 1 to 128 ASCII letters and digits (manifest and object IDs
/// are that).
pub fn check_snapshot_id(id: &str) -> Result<(), Error> {
    crate::uploader::check_snapshot_id(
        "kopia",
        id,
        MAX_SNAPSHOT_ID_LEN,
        u8::is_ascii_alphanumeric,
        "letters and digits",
    )
}

/// How a snapshot is written out (Velero's `uploaderSettings`).
#[derive(Debug, Clone, Default)]
pub struct RestoreOptions {
    /// `--write-sparse-files` (`WriteSparseFiles: "true"`).
    pub write_sparse_files: bool,
    /// `--parallel` (`ParallelFilesDownload`).
    pub parallel: Option<u32>,
}

/// `kopia snapshot restore --progress <id> <target>`. restore has no `--json`: progress and the
/// final `Restored ...` line are text on stderr. Fails when `snapshot_id` is not a kopia ID (see
/// [`check_snapshot_id`]).
pub fn snapshot_restore(
    access: &RepositoryAccess,
    snapshot_id: &str,
    target: &Path,
    options: &RestoreOptions,
) -> Result<KopiaInvocation, Error> {
    check_snapshot_id(snapshot_id)?;
    let mut inv = base(access)?
        .arg("snapshot")
        .arg("restore")
        .arg("--progress");
    if options.write_sparse_files {
        inv = inv.arg("--write-sparse-files");
    }
    let parallel = options.parallel.or_else(|| {
        default_restore_parallel(&Storage::parse(&access.repository).ok()?, cpu_count())
    });
    if let Some(n) = parallel {
        inv = inv.arg(format!("--parallel={n}"));
    }
    Ok(inv.arg(snapshot_id).arg(target.as_os_str()))
}

/// Files restored at once when the restore names no `ParallelFilesDownload`; `None` leaves
/// kopia's own default (8).
///
/// From object storage: Velero's data path's default, one file per CPU (`runtime.NumCPU()`).
/// kopia's S3 client keeps at most 2 idle connections to its endpoint (its transport is a clone
/// of Go's default one), so with more files at once than that, most reads end their connection
/// and the next one opens a new one, TLS handshake included: a cold restore of 50,000 small files
/// from S3 over TLS opened 21,630 connections at kopia's 8 and 4 at 2, and took 49-52 s (kopia's
/// user CPU 30-31 s) instead of 28-30 s (17 s) on 2 CPUs (BENCHMARKS.md case 9). Velero's node agent pays the
/// same price above 2 CPUs; matching its default is never worse than what the operator had, and
/// `--parallel-files-download` still chooses per restore.
/// From a filesystem repository: kopia's 8, measured faster than 2 on 200,000 small files.
pub(super) fn default_restore_parallel(storage: &Storage, cpus: u32) -> Option<u32> {
    match storage {
        Storage::Filesystem(_) => None,
        Storage::S3 { .. } | Storage::Azure { .. } | Storage::Gcs { .. } => Some(cpus.max(1)),
    }
}

/// CPUs this process may run on: what Go's `runtime.NumCPU()` counts (the scheduler's affinity
/// mask, not a cgroup quota), so the number matches Velero's on the same node.
pub(super) fn cpu_count() -> u32 {
    use nix::sched::{CpuSet, sched_getaffinity};
    use nix::unistd::Pid;
    match sched_getaffinity(Pid::from_raw(0)) {
        Ok(set) => (0..CpuSet::count())
            .filter(|&i| set.is_set(i).unwrap_or(false))
            .count()
            .max(1) as u32,
        Err(_) => std::thread::available_parallelism().map_or(1, |n| n.get() as u32),
    }
}
