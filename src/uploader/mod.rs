//! Uploaders (restic, kopia): how to run them and what their output means.
//!
//! Each uploader module turns frames of the child's output into [`UploaderEvent`]s, which are the
//! only thing the rest of the engine sees. Nothing here knows about Kubernetes.

pub mod kopia;
pub mod restic;

use std::fmt;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Which uploader program moves the data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum UploaderKind {
    Restic,
    Kopia,
}

impl fmt::Display for UploaderKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            UploaderKind::Restic => "restic",
            UploaderKind::Kopia => "kopia",
        })
    }
}

impl std::str::FromStr for UploaderKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "restic" => Ok(UploaderKind::Restic),
            "kopia" => Ok(UploaderKind::Kopia),
            other => Err(format!(
                "unknown uploader {other:?} (expected restic or kopia)"
            )),
        }
    }
}

/// Which way data moves. The same message types carry different counters in each direction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Direction {
    Backup,
    Restore,
}

/// Which stream a frame came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Stdout,
    Stderr,
}

/// A progress sample as the uploader reported it. Totals may be unknown or still growing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProgressSample {
    pub bytes_done: u64,
    /// `None` when the uploader did not say (restic `--stdin`, kopia before its estimate).
    pub total_bytes: Option<u64>,
    pub files_done: u64,
    pub total_files: Option<u64>,
    /// The uploader has finished walking the source, so `total_bytes` is final.
    pub scan_finished: bool,
    /// Bytes read and hashed so far, as opposed to taken unchanged from the parent snapshot
    /// (kopia's "hashed"; `None` where the uploader does not say).
    pub bytes_read: Option<u64>,
}

/// The uploader's final report of a finished snapshot or restore.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RunSummary {
    /// Absent for restores and for restic's skipped snapshots. kopia's canceled (incomplete)
    /// snapshot has one, but its outcome does not report it as the result.
    pub snapshot_id: Option<String>,
    /// Bytes of the source (backup) or of the snapshot (restore): the final size.
    pub total_bytes: u64,
    pub total_files: u64,
    /// New data the uploader had to store (backup only).
    pub bytes_added: u64,
    /// Files found unchanged against the parent snapshot and therefore not read again.
    pub files_unmodified: u64,
    pub files_new: u64,
    pub files_changed: u64,
    /// Entries that could not be read (kopia's `numFailed`).
    pub failed_items: u64,
    /// kopia's `incomplete` reason (`canceled`, `checkpoint`, `limit reached`).
    pub incomplete: Option<String>,
    /// kopia's manifest statistics: files taken from the parent snapshot unread (`cachedFiles`)
    /// and files read (`nonCachedFiles`). `None` for restic.
    pub files_cached: Option<u64>,
    pub files_read: Option<u64>,
}

/// One thing the uploader said, in the engine's terms.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UploaderEvent {
    Progress(ProgressSample),
    /// The uploader finished the scan and knows the total (restic `scan_finished`).
    ScanFinished {
        total_bytes: Option<u64>,
        total_files: Option<u64>,
    },
    /// An item (file, directory) could not be processed; the run goes on.
    ItemError {
        item: String,
        message: String,
    },
    Summary(RunSummary),
    /// A fatal message: restic's `Fatal:` lines and `exit_error`, kopia's `ERROR` lines.
    Fatal(String),
    /// A human text line worth keeping in the diagnostic tail.
    Text(String),
    /// A record that looked like a message but could not be decoded (kept for diagnostics).
    Malformed(String),
    /// A record over the framing cap was dropped.
    Truncated {
        len: u64,
    },
    /// Nothing of interest (unknown message types, blank status).
    Ignored,
}

/// How a run ended, in the terms an operator acts on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase", tag = "kind")]
pub enum OutcomeKind {
    /// Everything was transferred.
    Success,
    /// restic exit 3 / kopia with failed entries: a snapshot was saved but some items were unreadable.
    Partial,
    RepositoryMissing,
    /// The repository could not be reached or read (TLS, permission, DNS, connection): nothing
    /// says it is missing, so it must never be initialised.
    RepositoryUnreachable,
    WrongPassword,
    Locked,
    /// The uploader stopped because it was interrupted (SIGINT) without us asking.
    Interrupted,
    /// The uploader died from a signal.
    KilledBySignal {
        signal: i32,
    },
    /// Stopped on request.
    Canceled,
    /// The uploader's data source or target does not exist.
    SourceMissing,
    Failed,
}

impl OutcomeKind {
    /// A short fixed name, for metric labels and logs.
    pub fn class(&self) -> &'static str {
        match self {
            OutcomeKind::Success => "success",
            OutcomeKind::Partial => "partial",
            OutcomeKind::RepositoryMissing => "repository_missing",
            OutcomeKind::RepositoryUnreachable => "repository_unreachable",
            OutcomeKind::WrongPassword => "wrong_password",
            OutcomeKind::Locked => "locked",
            OutcomeKind::Interrupted => "interrupted",
            OutcomeKind::KilledBySignal { .. } => "killed_by_signal",
            OutcomeKind::Canceled => "canceled",
            OutcomeKind::SourceMissing => "source_missing",
            OutcomeKind::Failed => "failed",
        }
    }

    pub fn is_success(&self) -> bool {
        matches!(self, OutcomeKind::Success)
    }
}

/// The classified end of a run, with the real cause for people to read.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Outcome {
    pub kind: OutcomeKind,
    /// The uploader's own words (ANSI stripped), or ours where it said nothing.
    pub message: String,
    pub exit_code: Option<i32>,
    pub snapshot_id: Option<String>,
    pub summary: Option<RunSummaryView>,
    /// Number of unreadable items and the first few of them.
    pub failed_items: u64,
    pub first_failed_items: Vec<FailedItem>,
    /// Output records over the framing cap that were skipped.
    #[serde(skip)]
    pub truncated_frames: u64,
    /// The repository did not exist and this operation created it (allowed by
    /// `init_missing_repository`): a mistyped repository becomes a new, empty one, which the
    /// caller must be told.
    pub repository_created: bool,
    /// kopia's manifest of a snapshot it saved incomplete (a cancel, fail-fast): not a result,
    /// but in the repository (with the pin the agent asked for) until someone deletes it.
    #[serde(skip)]
    pub incomplete_snapshot_id: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct FailedItem {
    pub item: String,
    pub message: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RunSummaryView {
    pub total_bytes: u64,
    pub total_files: u64,
    pub bytes_added: u64,
    /// Files found unchanged against the parent and not read again.
    pub files_unmodified: u64,
    /// What Velero's status field `incrementalBytes` holds, when the uploader's output gives it
    /// (see each uploader's classification).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub incremental_bytes: Option<u64>,
}

impl From<&RunSummary> for RunSummaryView {
    fn from(s: &RunSummary) -> Self {
        Self {
            total_bytes: s.total_bytes,
            total_files: s.total_files,
            bytes_added: s.bytes_added,
            files_unmodified: s.files_unmodified,
            incremental_bytes: None,
        }
    }
}

/// How a child process ended, independent of tokio's types so classification is testable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExitInfo {
    pub code: Option<i32>,
    pub signal: Option<i32>,
}

impl ExitInfo {
    pub fn code(code: i32) -> Self {
        Self {
            code: Some(code),
            signal: None,
        }
    }
    pub fn from_status(status: std::process::ExitStatus) -> Self {
        use std::os::unix::process::ExitStatusExt;
        Self {
            code: status.code(),
            signal: status.signal(),
        }
    }
}

impl fmt::Display for ExitInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.code, self.signal) {
            (Some(c), _) => write!(f, "exit code {c}"),
            (None, Some(s)) => write!(f, "signal {s}"),
            (None, None) => f.write_str("unknown exit"),
        }
    }
}

/// What a run needs to know about the repository and its secrets. Secrets are referenced by file,
/// never held in argv.
#[derive(Debug, Clone, Default)]
pub struct RepositoryAccess {
    /// restic: the repository URL or path; kopia: a filesystem path or a kopia config file.
    pub repository: String,
    pub password_file: PathBuf,
    /// Private cache (restic `--cache-dir`, kopia cache/log dirs).
    pub cache_dir: PathBuf,
    /// Extra environment for the backend (cloud credentials files and the like).
    pub extra_env: Vec<(String, String)>,
    /// PEM file of the CA(s) that sign the object store's certificate (restic `--cacert`).
    pub ca_cert: Option<PathBuf>,
    /// Accept any TLS certificate (restic `--insecure-tls`).
    pub insecure_tls: bool,
    /// restic's extended options (`-o KEY=VALUE`), given by the operator.
    pub restic_options: Vec<String>,
    /// kopia's cache of this repository, content and metadata together, in MB (split as Velero
    /// splits its `cacheLimitMB`: 4/5 content, 1/5 metadata); `None`: kopia's own defaults.
    pub kopia_cache_limit_mb: Option<u64>,
}

/// A snapshot ID from outside (an API object) as error messages show it: cut to a few dozen
/// characters and quoted with control characters escaped, so a hostile value cannot forge lines.
pub(crate) fn show_id(id: &str) -> String {
    format!("{:?}", crate::text::truncate(id, 72))
}

/// Checks a snapshot ID that goes to an uploader as a positional argument: 1 to `max` bytes, each
/// one `allowed` says the uploader's IDs are made of. Anything else, a value starting with `-`
/// above all (it would be read as a flag), is refused with the value shown escaped and cut short.
pub(crate) fn check_snapshot_id(
    uploader: &str,
    id: &str,
    max: usize,
    allowed: fn(&u8) -> bool,
    expected: &str,
) -> Result<(), crate::error::Error> {
    if !id.is_empty() && id.len() <= max && id.bytes().all(|b| allowed(&b)) {
        return Ok(());
    }
    Err(crate::error::Error::Invalid(format!(
        "invalid {uploader} snapshot ID {}: expected 1 to {max} {expected}",
        show_id(id)
    )))
}

impl Outcome {
    /// An outcome that did not come from the uploader (the agent itself failed).
    pub fn internal(message: impl Into<String>) -> Self {
        Self {
            kind: OutcomeKind::Failed,
            message: message.into(),
            exit_code: None,
            snapshot_id: None,
            summary: None,
            failed_items: 0,
            first_failed_items: Vec::new(),
            truncated_frames: 0,
            repository_created: false,
            incomplete_snapshot_id: None,
        }
    }

    pub fn canceled(message: impl Into<String>) -> Self {
        Self {
            kind: OutcomeKind::Canceled,
            ..Self::internal(message)
        }
    }
}
