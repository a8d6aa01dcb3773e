//! restic: argv/env for each command, the `--json` message parser, and outcome classification.
//!
//! Facts this follows (see the project's reference on uploader output): JSON lines on stdout, JSON
//! `error` objects and plain text on stderr, zero fields omitted, unknown types and fields appear
//! across versions, exit codes that grew over versions (0.14 reports most failures as exit 1 with
//! a `Fatal:` text, which is why classification also reads the text).

use std::ffi::OsString;
use std::fmt;
use std::path::Path;
use std::time::Duration;

use serde::Deserialize;

use super::{
    Direction, ExitInfo, Outcome, OutcomeKind, ProgressSample, RepositoryAccess, RunSummary,
    RunSummaryView, UploaderEvent,
};
use crate::error::Error;
use crate::facts::RunFacts;
use crate::text::clean_line;

/// A restic release, compared to gate version-specific behaviour.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ResticVersion {
    pub major: u32,
    pub minor: u32,
    pub patch: u32,
}

impl ResticVersion {
    pub const fn new(major: u32, minor: u32, patch: u32) -> Self {
        Self {
            major,
            minor,
            patch,
        }
    }

    /// `restore --json` with progress, and `--retry-lock`.
    pub fn has_restore_json(&self) -> bool {
        *self >= Self::new(0, 16, 0)
    }
    pub fn has_retry_lock(&self) -> bool {
        *self >= Self::new(0, 16, 0)
    }
    /// SIGTERM is handled like SIGINT (earlier versions die and leave a lock).
    pub fn handles_sigterm(&self) -> bool {
        *self >= Self::new(0, 17, 0)
    }

    /// Parses `restic version` output: text (`restic 0.14.0 compiled with ...`) or the JSON of
    /// `restic version --json` (>= 0.17).
    pub fn parse(output: &str) -> Option<Self> {
        let trimmed = output.trim();
        let version_str = if trimmed.starts_with('{') {
            #[derive(Deserialize)]
            struct V {
                version: String,
            }
            serde_json::from_str::<V>(trimmed).ok()?.version
        } else {
            trimmed
                .split_whitespace()
                .skip_while(|w| *w != "restic")
                .nth(1)?
                .to_string()
        };
        let core = version_str.trim_start_matches('v');
        let core = core.split(['-', '+', ' ']).next()?;
        let mut parts = core.split('.').map(|p| p.parse::<u32>());
        let major = parts.next()?.ok()?;
        let minor = parts.next()?.ok()?;
        let patch = parts.next().and_then(|p| p.ok()).unwrap_or(0);
        Some(Self::new(major, minor, patch))
    }
}

impl fmt::Display for ResticVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// Variables that would override the password file or point restic elsewhere; removed from the
/// child's environment so the values we pass are the ones restic uses.
pub const SCRUBBED_ENV: &[&str] = &[
    "RESTIC_PASSWORD",
    "RESTIC_PASSWORD_COMMAND",
    "RESTIC_PASSWORD_FILE",
    "RESTIC_REPOSITORY",
    "RESTIC_REPOSITORY_FILE",
    "RESTIC_CACHE_DIR",
    "RESTIC_PROGRESS_FPS",
];

/// A restic invocation: argv (without the program) and environment. The repository goes through
/// `RESTIC_REPOSITORY` rather than argv because URLs may embed credentials, and argv is visible to
/// every user of the node in `ps`.
#[derive(Debug, Clone, Default)]
pub struct ResticInvocation {
    pub args: Vec<OsString>,
    pub env: Vec<(OsString, OsString)>,
}

/// What to pass to `restic backup`.
#[derive(Debug, Clone, Default)]
pub struct BackupOptions {
    pub host: String,
    pub tags: Vec<(String, String)>,
    pub parent: Option<String>,
    /// KiB/s, for tests and throttled environments.
    pub limit_upload_kib: Option<u64>,
    /// How long to wait for a lock held by someone else (restic >= 0.16 only).
    pub retry_lock: Option<Duration>,
    pub verbose: bool,
    /// What only kopia records (its source identity, description, pins, policy).
    pub kopia: crate::uploader::kopia::SnapshotOptions,
}

/// restic's printing rate for status lines: its own default for `--json` (60/s), the rate of
/// the stream Velero's method reads, and set explicitly so a variable in the agent's environment
/// cannot change it. With it, what the agent publishes is at most one interval plus 1/60 s
/// behind what restic knows, and never older than Velero's on the same stream (BENCHMARKS.md
/// case 3). Parsing a line costs about a microsecond (case 6); restic computes the line anyway.
pub const PROGRESS_FPS: &str = "60";

fn base(access: &RepositoryAccess, update_interval: Option<Duration>) -> ResticInvocation {
    let mut env: Vec<(OsString, OsString)> = vec![
        ("RESTIC_REPOSITORY".into(), access.repository.clone().into()),
        (
            "RESTIC_PASSWORD_FILE".into(),
            access.password_file.clone().into_os_string(),
        ),
    ];
    if update_interval.is_some() {
        env.push(("RESTIC_PROGRESS_FPS".into(), PROGRESS_FPS.into()));
    }
    for (k, v) in &access.extra_env {
        env.push((k.into(), v.into()));
    }
    let mut args: Vec<OsString> = vec![
        "--cache-dir".into(),
        access.cache_dir.clone().into_os_string(),
    ];
    // A path, not a secret: the CA is public, only who trusts it is configured here.
    if let Some(ca) = &access.ca_cert {
        let mut a = OsString::from("--cacert=");
        a.push(ca);
        args.push(a);
    }
    if access.insecure_tls {
        args.push("--insecure-tls".into());
    }
    for o in &access.restic_options {
        args.push("-o".into());
        args.push(o.into());
    }
    ResticInvocation { args, env }
}

impl ResticInvocation {
    fn arg(mut self, a: impl Into<OsString>) -> Self {
        self.args.push(a.into());
        self
    }
}

/// `restic backup --json ... .` to run with the volume as working directory, so the snapshot's
/// tree is relative to the volume (as Velero ran it) and restores into another volume land in place.
pub fn backup(
    access: &RepositoryAccess,
    version: ResticVersion,
    opts: &BackupOptions,
    update_interval: Duration,
) -> ResticInvocation {
    let mut inv = base(access, Some(update_interval))
        .arg("backup")
        .arg("--json");
    inv = inv.arg(format!("--host={}", opts.host));
    for (k, v) in &opts.tags {
        inv = inv.arg(format!("--tag={k}={v}"));
    }
    if let Some(parent) = &opts.parent {
        inv = inv.arg(format!("--parent={parent}"));
    }
    if let Some(kib) = opts.limit_upload_kib {
        inv = inv.arg(format!("--limit-upload={kib}"));
    }
    if let (Some(wait), true) = (opts.retry_lock, version.has_retry_lock()) {
        inv = inv.arg(format!("--retry-lock={}s", wait.as_secs().max(1)));
    }
    if opts.verbose {
        inv = inv.arg("-v");
    }
    inv.arg(".")
}

/// The longest snapshot ID restic has (0.15 and later print 64 hex digits; 0.14 prints 8).
pub const MAX_SNAPSHOT_ID_LEN: usize = 64;

/// A snapshot ID for restic's argv: 1 to 64 hexadecimal digits (a full ID or a prefix of one).
pub fn check_snapshot_id(id: &str) -> Result<(), Error> {
    super::check_snapshot_id(
        "restic",
        id,
        MAX_SNAPSHOT_ID_LEN,
        u8::is_ascii_hexdigit,
        "hexadecimal characters",
    )
}

/// `restic restore <id> --target .`, run inside the target directory. `--json` only where restic
/// prints progress for restores (>= 0.16); earlier versions are measured from the target's size.
/// Fails when `snapshot_id` is not a restic snapshot ID (see [`check_snapshot_id`]).
pub fn restore(
    access: &RepositoryAccess,
    version: ResticVersion,
    snapshot_id: &str,
    limit_download_kib: Option<u64>,
    update_interval: Duration,
) -> Result<ResticInvocation, Error> {
    check_snapshot_id(snapshot_id)?;
    let mut inv = base(access, Some(update_interval))
        .arg("restore")
        .arg(snapshot_id)
        .arg("--target=.");
    if let Some(kib) = limit_download_kib {
        inv = inv.arg(format!("--limit-download={kib}"));
    }
    if version.has_restore_json() {
        inv = inv.arg("--json");
    }
    Ok(inv)
}

/// `restic stats <id> --json`: the restore size of a snapshot, for restore totals on 0.14/0.15.
/// Fails when `snapshot_id` is not a restic snapshot ID (see [`check_snapshot_id`]).
pub fn stats(access: &RepositoryAccess, snapshot_id: &str) -> Result<ResticInvocation, Error> {
    check_snapshot_id(snapshot_id)?;
    Ok(base(access, None)
        .arg("stats")
        .arg(snapshot_id)
        .arg("--json"))
}

pub fn init(access: &RepositoryAccess) -> ResticInvocation {
    base(access, None).arg("init")
}

/// Forgets one snapshot: only one the agent itself has just made (its Backup ended while it
/// ran). Never prunes: the data goes with the next prune of whoever maintains the repository.
pub fn forget(access: &RepositoryAccess, id: &str) -> Result<ResticInvocation, Error> {
    check_snapshot_id(id)?;
    Ok(base(access, None).arg("forget").arg(id))
}

/// Removes stale locks: those older than 30 min or left by a dead process of this host.
pub fn unlock(access: &RepositoryAccess) -> ResticInvocation {
    base(access, None).arg("unlock")
}

/// Cheapest probe of whether a repository exists and the password opens it.
pub fn cat_config(access: &RepositoryAccess) -> ResticInvocation {
    base(access, None).arg("cat").arg("config")
}

pub fn list_locks(access: &RepositoryAccess) -> ResticInvocation {
    base(access, None).arg("list").arg("locks").arg("--no-lock")
}

/// Parses the document printed by `restic stats --json`.
pub fn parse_stats(doc: &[u8]) -> Option<(u64, u64)> {
    #[derive(Deserialize)]
    struct Stats {
        #[serde(default)]
        total_size: u64,
        #[serde(default)]
        total_file_count: u64,
    }
    let s: Stats = serde_json::from_slice(trim_ascii(doc)).ok()?;
    Some((s.total_size, s.total_file_count))
}

fn trim_ascii(b: &[u8]) -> &[u8] {
    b.trim_ascii()
}

#[derive(Deserialize)]
#[serde(tag = "message_type", rename_all = "snake_case")]
enum Message {
    Status(Status),
    VerboseStatus(VerboseStatus),
    Summary(Summary),
    Error(ErrorMessage),
    ExitError(ExitError),
    #[serde(other)]
    Unknown,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Status {
    // Backup counters.
    total_files: u64,
    files_done: u64,
    total_bytes: Option<u64>,
    bytes_done: u64,
    seconds_remaining: Option<u64>,
    // Restore counters (>= 0.16).
    files_restored: u64,
    bytes_restored: u64,
    files_skipped: u64,
    bytes_skipped: u64,
    // restic <= 0.15 types `scan_finished` as a status carrying `action`, with the scanned size
    // in `data_size` (captured from 0.14).
    action: Option<String>,
    data_size: Option<u64>,
    // Unknown fields, `current_files` among them (long, useless to us), are skipped by serde
    // without allocating.
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct VerboseStatus {
    action: String,
    total_files: Option<u64>,
    /// `scan_finished` carries the scanned size as `data_size` (captured from 0.18).
    data_size: Option<u64>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Summary {
    // Backup.
    files_new: u64,
    files_changed: u64,
    files_unmodified: u64,
    data_added: u64,
    total_files_processed: u64,
    total_bytes_processed: u64,
    snapshot_id: Option<String>,
    // Restore (>= 0.16).
    total_files: u64,
    files_restored: u64,
    files_skipped: u64,
    total_bytes: u64,
    bytes_restored: u64,
    bytes_skipped: u64,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct ErrorMessage {
    error: serde_json::Value,
    during: String,
    item: String,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct ExitError {
    code: i64,
    message: String,
}

/// Turns restic's error payload into words. It was the Go error marshalled as JSON up to 0.17.0
/// (often `{}` or `{"Op":"open","Path":...,"Err":13}`) and `{"message": ...}` since 0.17.1.
fn describe_error_value(v: &serde_json::Value) -> String {
    use serde_json::Value;
    match v {
        Value::String(s) => s.clone(),
        Value::Object(map) => {
            if let Some(Value::String(m)) = map.get("message") {
                return m.clone();
            }
            let op = map.get("Op").and_then(Value::as_str);
            let path = map.get("Path").and_then(Value::as_str);
            let errno = map.get("Err").and_then(Value::as_i64);
            match (op, path, errno) {
                (Some(op), Some(path), Some(e)) => {
                    let desc = i32::try_from(e)
                        .map(|e| nix::errno::Errno::from_raw(e).desc())
                        .unwrap_or("unknown error");
                    format!("{op} {path}: {}", desc.to_lowercase())
                }
                _ if map.is_empty() => crate::facts::UNKNOWN_ITEM_ERROR.to_string(),
                _ => v.to_string(),
            }
        }
        Value::Null => crate::facts::UNKNOWN_ITEM_ERROR.to_string(),
        other => other.to_string(),
    }
}

fn untyped_json(record: &[u8]) -> bool {
    #[derive(Deserialize)]
    struct Typed {
        message_type: Option<serde::de::IgnoredAny>,
    }
    matches!(
        serde_json::from_slice::<Typed>(record),
        Ok(Typed { message_type: None })
    )
}

/// Stateless-per-record parser for restic's output.
#[derive(Debug, Clone, Copy)]
pub struct ResticParser {
    mode: Direction,
}

impl ResticParser {
    pub fn new(mode: Direction) -> Self {
        Self { mode }
    }

    /// Parses one framed record from either stream.
    pub fn parse(&self, record: &[u8]) -> UploaderEvent {
        let trimmed = record.trim_ascii();
        if trimmed.first() == Some(&b'{') {
            return match serde_json::from_slice::<Message>(trimmed) {
                Ok(msg) => self.event(msg),
                // Valid JSON without a message type (a document such as `stats --json`): not ours.
                Err(_) if untyped_json(trimmed) => UploaderEvent::Ignored,
                Err(e) => UploaderEvent::Malformed(format!(
                    "unparsable JSON record of {} bytes ({e})",
                    trimmed.len()
                )),
            };
        }
        self.text(clean_line(trimmed))
    }

    fn event(&self, msg: Message) -> UploaderEvent {
        match msg {
            Message::Status(s) => {
                if s.action.as_deref() == Some("scan_finished") {
                    return UploaderEvent::ScanFinished {
                        total_bytes: s.data_size.or(s.total_bytes),
                        total_files: Some(s.total_files),
                    };
                }
                match self.mode {
                    Direction::Backup => UploaderEvent::Progress(ProgressSample {
                        bytes_done: s.bytes_done,
                        total_bytes: s.total_bytes,
                        files_done: s.files_done,
                        total_files: Some(s.total_files),
                        // restic estimates the remaining time only once the scan is over.
                        scan_finished: s.seconds_remaining.is_some(),
                        bytes_read: None,
                    }),
                    Direction::Restore => UploaderEvent::Progress(ProgressSample {
                        bytes_done: s.bytes_restored.saturating_add(s.bytes_skipped),
                        total_bytes: s.total_bytes,
                        files_done: s.files_restored.saturating_add(s.files_skipped),
                        total_files: Some(s.total_files),
                        scan_finished: true,
                        bytes_read: None,
                    }),
                }
            }
            Message::VerboseStatus(v) => {
                if v.action == "scan_finished" {
                    UploaderEvent::ScanFinished {
                        total_bytes: v.data_size,
                        total_files: v.total_files,
                    }
                } else {
                    UploaderEvent::Ignored
                }
            }
            Message::Summary(s) => UploaderEvent::Summary(match self.mode {
                Direction::Backup => RunSummary {
                    snapshot_id: s.snapshot_id.filter(|id| !id.is_empty()),
                    total_bytes: s.total_bytes_processed,
                    total_files: s.total_files_processed,
                    bytes_added: s.data_added,
                    files_new: s.files_new,
                    files_changed: s.files_changed,
                    files_unmodified: s.files_unmodified,
                    ..RunSummary::default()
                },
                Direction::Restore => RunSummary {
                    snapshot_id: None,
                    total_bytes: s
                        .total_bytes
                        .max(s.bytes_restored.saturating_add(s.bytes_skipped)),
                    total_files: s
                        .total_files
                        .max(s.files_restored.saturating_add(s.files_skipped)),
                    ..RunSummary::default()
                },
            }),
            // The scanner only sizes the tree; the archiver reports the same item again when it
            // fails to read it. Counting both would double every unreadable directory.
            Message::Error(e) if e.during == "scan" => UploaderEvent::Text(format!(
                "scan: {}: {}",
                e.item,
                describe_error_value(&e.error)
            )),
            Message::Error(e) => {
                let message = describe_error_value(&e.error);
                // 0.18 starts some messages with the item itself ("/v/a: open a: permission
                // denied"); the item is shown beside the message, so once is enough.
                let message = match message.strip_prefix(&format!("{}: ", e.item)) {
                    Some(rest) if !e.item.is_empty() => rest.to_string(),
                    _ => message,
                };
                UploaderEvent::ItemError {
                    item: e.item,
                    message,
                }
            }
            // 0.18 keeps the `Fatal: ` of its text output inside the message.
            Message::ExitError(e) => {
                let message = crate::text::strip_ansi(e.message.trim());
                let message = message.strip_prefix("Fatal: ").unwrap_or(&message);
                UploaderEvent::Fatal(format!("{message} (exit code {})", e.code))
            }
            Message::Unknown => UploaderEvent::Ignored,
        }
    }

    fn text(&self, line: String) -> UploaderEvent {
        if line.is_empty() {
            return UploaderEvent::Ignored;
        }
        // restic may glue "Fatal: ..." to the end of a previous message (no newline between).
        if let Some(at) = line.find("Fatal: ") {
            return UploaderEvent::Fatal(line[at + "Fatal: ".len()..].to_string());
        }
        if FATAL_WITHOUT_PREFIX.iter().any(|p| line.starts_with(p)) {
            return UploaderEvent::Fatal(line);
        }
        // 0.14/0.15 restore reports per-file failures only as text.
        if let Some((item, message)) = line
            .strip_prefix("ignoring error for ")
            .and_then(|rest| rest.split_once(": "))
        {
            return UploaderEvent::ItemError {
                item: item.to_string(),
                message: message.to_string(),
            };
        }
        UploaderEvent::Text(line)
    }
}

/// Messages that end a run but that restic 0.14 prints without `Fatal:`.
const FATAL_WITHOUT_PREFIX: &[&str] = &["unable to create lock in backend", "invalid id "];

/// Text that restic prints on failures, per kind, for versions whose exit code is just 1.
const WRONG_PASSWORD: &[&str] = &["wrong password or no key found", "no key found"];
/// restic could not read the repository's config file. That is all it knows: the cause inside the
/// same message tells a repository that is not there from one it could not look at.
const REPOSITORY_NOT_OPENED: &[&str] = &[
    REPOSITORY_QUESTION,
    "unable to open config file",
    "repository does not exist",
];
/// restic's question after the cause; the next line is the repository's location.
const REPOSITORY_QUESTION: &str = "Is there a repository at the following location?";
/// Causes that say nothing is there (local `stat`, S3 `NoSuchKey`/`NoSuchBucket`, Azure's
/// container, GCS, restic's REST backend), as opposed to TLS, permission, DNS or connection
/// failures. Specific on purpose: S3's unknown access key reads "The AWS Access Key Id you
/// provided does not exist in our records", which says nothing about the repository.
const NOTHING_THERE: &[&str] = &[
    "no such file or directory",
    "The specified key does not exist",
    "The specified bucket does not exist",
    "The specified container does not exist",
    "NoSuchKey",
    "NoSuchBucket",
    "object doesn't exist",
    "bucket doesn't exist",
    "/> does not exist",
    "repository does not exist",
];
const LOCKED: &[&str] = &[
    "unable to create lock in backend",
    "repository is already locked",
];
const SOURCE_MISSING: &[&str] = &["all target directories/files do not exist"];
/// restic 0.14 refuses to save a snapshot of an empty directory (exit 1); later versions save one.
const EMPTY_SOURCE: &[&str] = &["snapshot is empty"];

/// What Velero reports for a volume with nothing in it; kept word for word for compatibility.
pub const EMPTY_VOLUME_MESSAGE: &str = "volume was empty so no snapshot was taken";

/// Classifies how a restic run ended. `stopped`: we sent the stop signal to the running child
/// (the runner's `stop`), not merely that a cancel was requested: a run that ended on its own
/// before our stop reached it keeps its own outcome (exit 3 stays partial with its snapshot).
pub fn classify(exit: ExitInfo, facts: &RunFacts, stopped: bool, mode: Direction) -> Outcome {
    let text = facts.error_text();
    let has = |needles: &[&str]| needles.iter().any(|n| text.contains(n));
    let kind = match (exit.code, exit.signal) {
        (Some(0), _) if mode == Direction::Backup && facts.summary.is_none() => OutcomeKind::Failed,
        (Some(0), _) => OutcomeKind::Success,
        _ if stopped => OutcomeKind::Canceled,
        (Some(3), _) => OutcomeKind::Partial,
        (Some(10), _) => OutcomeKind::RepositoryMissing,
        (Some(11), _) => OutcomeKind::Locked,
        (Some(12), _) => OutcomeKind::WrongPassword,
        (Some(130), _) => OutcomeKind::Interrupted,
        (None, Some(sig)) => OutcomeKind::KilledBySignal { signal: sig },
        _ if has(WRONG_PASSWORD) => OutcomeKind::WrongPassword,
        _ if has(REPOSITORY_NOT_OPENED) && has(NOTHING_THERE) => OutcomeKind::RepositoryMissing,
        _ if has(REPOSITORY_NOT_OPENED) => OutcomeKind::RepositoryUnreachable,
        _ if has(LOCKED) => OutcomeKind::Locked,
        _ if has(SOURCE_MISSING) => OutcomeKind::SourceMissing,
        _ if mode == Direction::Backup && has(EMPTY_SOURCE) => {
            return Outcome {
                kind: OutcomeKind::Success,
                message: EMPTY_VOLUME_MESSAGE.to_string(),
                exit_code: exit.code,
                snapshot_id: None,
                summary: Some(RunSummaryView {
                    total_bytes: 0,
                    total_files: 0,
                    bytes_added: 0,
                    files_unmodified: 0,
                    incremental_bytes: Some(0),
                }),
                failed_items: 0,
                first_failed_items: Vec::new(),
                truncated_frames: facts.truncated_frames,
                repository_created: false,
                incomplete_snapshot_id: None,
            };
        }
        // 0.17/0.18 sometimes end an interrupted run with exit 1 and "context canceled".
        _ if facts.interrupt_seen && text.contains("context canceled") => OutcomeKind::Interrupted,
        _ => OutcomeKind::Failed,
    };
    let snapshot_id = facts.summary.as_ref().and_then(|s| s.snapshot_id.clone());
    let message = match &kind {
        OutcomeKind::Success => match (&snapshot_id, &facts.summary) {
            (Some(id), Some(s)) => format!(
                "snapshot {id} saved: {} in {} files, {} new",
                crate::text::format_bytes(s.total_bytes),
                s.total_files,
                crate::text::format_bytes(s.bytes_added)
            ),
            _ if mode == Direction::Restore => "restore completed".to_string(),
            _ => "completed".to_string(),
        },
        OutcomeKind::Partial => partial_message(snapshot_id.as_deref(), facts),
        OutcomeKind::Canceled => "canceled".to_string(),
        OutcomeKind::Failed if exit.code == Some(0) => {
            "restic exited 0 but printed no summary; the snapshot cannot be confirmed".to_string()
        }
        OutcomeKind::RepositoryMissing | OutcomeKind::RepositoryUnreachable
            if !facts.fatal.is_empty() =>
        {
            repository_message(&kind, &facts.fatal)
        }
        // A restore whose items could not be written ends with restic's bare `There were N
        // errors`: the count, the cause that dominates and the first items say what happened.
        OutcomeKind::Failed if mode == Direction::Restore && facts.failed_items > 0 => {
            facts.items_summary(facts.failed_item_count(), "not written")
        }
        _ => facts.cause(&format!("restic failed with {exit}")),
    };
    Outcome {
        kind,
        message: crate::text::redact_url_credentials(&message),
        exit_code: exit.code,
        snapshot_id,
        // restic's summary counts the new data it stored: what its Velero reported too.
        summary: facts.summary.as_ref().map(|s| RunSummaryView {
            incremental_bytes: (mode == Direction::Backup).then_some(s.bytes_added),
            ..RunSummaryView::from(s)
        }),
        failed_items: facts.failed_items,
        first_failed_items: facts.first_failed_items.clone(),
        truncated_frames: facts.truncated_frames,
        repository_created: false,
        incomplete_snapshot_id: None,
    }
}

/// `no repository at <location>: <cause>` / `cannot open the repository at <location>: <cause>`
/// from restic's `Fatal: unable to open config file: <cause>` + `Is there a repository at the
/// following location?` + `<location>`: the cause (x509, Access Denied, no such host) first,
/// without the question that hides it.
fn repository_message(kind: &OutcomeKind, fatal: &[String]) -> String {
    // restic >= 0.16 puts the whole text into one `exit_error` message, lines and all.
    let fatal: Vec<&str> = fatal.iter().flat_map(|l| l.lines()).collect();
    let question = fatal.iter().position(|l| l.contains(REPOSITORY_QUESTION));
    let (cause, location) = match question {
        Some(i) => (
            fatal[..i].join(" "),
            fatal.get(i + 1).map(|l| l.trim()).filter(|l| !l.is_empty()),
        ),
        None => (fatal.join(" "), None),
    };
    let what = match kind {
        OutcomeKind::RepositoryMissing => "no repository",
        _ => "cannot open the repository",
    };
    let cause = cause.replace('\n', " ");
    // The code of an `exit_error` (appended to its text, see the parser) follows the location
    // line there; it belongs at the end of the message, not in the location.
    let (location, code) = match location {
        Some(l) => match l.rfind(" (exit code ") {
            Some(i) if l.ends_with(')') => (Some(&l[..i]), &l[i..]),
            _ => (Some(l), ""),
        },
        None => (None, ""),
    };
    match location {
        Some(loc) => format!("{what} at {loc}: {}{code}", cause.trim()),
        None => format!("{what}: {}", cause.trim()),
    }
}

/// "snapshot X saved, but 2 items could not be read: permission denied (first: a, b)".
pub fn partial_message(snapshot_id: Option<&str>, facts: &RunFacts) -> String {
    let saved = match snapshot_id {
        Some(id) => format!("snapshot {id} saved"),
        None => "snapshot saved".to_string(),
    };
    let n = facts.failed_items;
    if n == 0 {
        return format!("{saved}, but some source data could not be read");
    }
    format!(
        "{saved}, but {}",
        facts.items_summary(n, "could not be read")
    )
}

/// Paths in restic's messages are absolute inside the volume; shown relative to it they are
/// what the operator recognises.
pub fn relative_item(item: &str, volume: &Path) -> String {
    Path::new(item)
        .strip_prefix(volume)
        .map(|p| p.display().to_string())
        .unwrap_or_else(|_| item.to_string())
}

/// Whether restic's error says snapshot `id` does not exist in the repository
/// (`invalid id "<id>": no matching ID found for prefix "<id>"`, all versions to date).
pub fn is_unknown_snapshot(message: &str, id: &str) -> bool {
    message.contains("no matching ID found") && message.contains(id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::uploader::Stream;

    #[test]
    fn an_unknown_parent_is_recognised_only_for_that_id() {
        let m = r#"Fatal: invalid id "fc540c27": no matching ID found for prefix "fc540c27""#;
        assert!(is_unknown_snapshot(m, "fc540c27"));
        assert!(!is_unknown_snapshot(m, "0badc0de"));
        assert!(!is_unknown_snapshot("Fatal: wrong password", "fc540c27"));
    }

    fn access() -> RepositoryAccess {
        RepositoryAccess {
            repository: "/r".into(),
            password_file: "/p".into(),
            ..Default::default()
        }
    }

    #[test]
    fn operator_options_go_to_every_command_as_dash_o() {
        let mut a = access();
        a.restic_options = vec!["azure.access-tier=Hot".into(), "s3.region=x".into()];
        for inv in [
            init(&a),
            unlock(&a),
            cat_config(&a),
            forget(&a, "fc540c27").unwrap(),
        ] {
            let argv: Vec<&str> = inv.args.iter().map(|x| x.to_str().unwrap()).collect();
            let at = argv.iter().position(|x| *x == "-o").unwrap();
            assert_eq!(
                argv[at..at + 4],
                ["-o", "azure.access-tier=Hot", "-o", "s3.region=x"]
            );
        }
    }

    #[test]
    fn restore_and_stats_refuse_snapshot_ids_that_are_not_restic_ids() {
        let v = ResticVersion::new(0, 18, 0);
        let full = "f".repeat(64);
        for good in ["fc540c27", "ABCDEF01", "0", full.as_str()] {
            let inv = restore(&access(), v, good, None, Duration::from_secs(1)).unwrap();
            assert!(inv.args.iter().any(|a| a == good), "{good}");
            let inv = stats(&access(), good).unwrap();
            assert!(inv.args.iter().any(|a| a == good), "{good}");
        }
        let long = "a".repeat(65);
        for bad in [
            "-h",
            "--target=/etc",
            "",
            "latest",
            "fc540c27:sub",
            "fc54 0c27",
            "fc540c27\nFatal: forged",
            long.as_str(),
        ] {
            for err in [
                restore(&access(), v, bad, None, Duration::from_secs(1))
                    .unwrap_err()
                    .to_string(),
                stats(&access(), bad).unwrap_err().to_string(),
            ] {
                assert!(
                    err.starts_with("invalid restic snapshot ID \""),
                    "{bad:?}: {err}"
                );
                assert!(!err.contains('\n'), "the ID is shown escaped: {err}");
                assert!(err.len() < 200, "the ID is shown cut short: {err}");
            }
        }
        let err = stats(&access(), "--target=/etc").unwrap_err().to_string();
        assert!(err.contains("\"--target=/etc\""), "{err}");
    }

    #[test]
    fn huge_restore_counters_saturate_instead_of_overflowing() {
        let p = ResticParser::new(Direction::Restore);
        let max = u64::MAX;
        let status = format!(
            r#"{{"message_type":"status","percent_done":1,"total_files":{max},"files_restored":{max},"files_skipped":{max},"total_bytes":{max},"bytes_restored":{max},"bytes_skipped":{max}}}"#
        );
        match p.parse(status.as_bytes()) {
            UploaderEvent::Progress(s) => {
                assert_eq!((s.bytes_done, s.files_done), (max, max));
            }
            other => panic!("{other:?}"),
        }
        let summary = format!(
            r#"{{"message_type":"summary","files_restored":{max},"files_skipped":1,"bytes_restored":{max},"bytes_skipped":1}}"#
        );
        match p.parse(summary.as_bytes()) {
            UploaderEvent::Summary(s) => {
                assert_eq!((s.total_bytes, s.total_files), (max, max));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_go_panic_is_reported_by_its_panic_line_not_the_end_of_its_stack() {
        let p = ResticParser::new(Direction::Backup);
        let mut facts = RunFacts::default();
        let mut stderr = vec![
            "panic: runtime error: invalid memory address or nil pointer dereference".to_string(),
            "[signal SIGSEGV: segmentation violation code=0x1 addr=0x0 pc=0x8a1b2c]".to_string(),
            String::new(),
            "goroutine 1 [running]:".to_string(),
        ];
        for i in 0..98 {
            stderr.push(format!(
                "github.com/restic/restic/internal/archiver.(*Archiver).Save{i}(0xc000123456)"
            ));
            stderr.push(format!(
                "\t/build/restic/internal/archiver/archiver.go:{}+0x1a4",
                100 + i
            ));
        }
        assert_eq!(stderr.len(), 200);
        for line in &stderr {
            facts.observe(Stream::Stderr, &p.parse(line.as_bytes()));
        }
        let o = classify(ExitInfo::code(2), &facts, false, Direction::Backup);
        assert_eq!(o.kind, OutcomeKind::Failed);
        assert_eq!(
            o.message,
            "restic failed with exit code 2: panic: runtime error: invalid memory address or nil pointer dereference"
        );
        // A Fatal line still wins.
        facts.observe(
            Stream::Stderr,
            &p.parse(b"Fatal: unable to save snapshot: disk full"),
        );
        let o = classify(ExitInfo::code(1), &facts, false, Direction::Backup);
        assert_eq!(o.message, "unable to save snapshot: disk full");
    }

    #[test]
    fn a_cancel_that_sent_no_stop_keeps_restics_outcome() {
        let p = ResticParser::new(Direction::Backup);
        let mut facts = RunFacts::default();
        for line in [
            r#"{"message_type":"summary","total_bytes_processed":10,"snapshot_id":"0123abcd"}"#,
            "Warning: at least one source file could not be read",
        ] {
            facts.observe(Stream::Stdout, &p.parse(line.as_bytes()));
        }
        let o = classify(ExitInfo::code(3), &facts, false, Direction::Backup);
        assert_eq!(o.kind, OutcomeKind::Partial);
        assert_eq!(o.snapshot_id.as_deref(), Some("0123abcd"));
        // Our SIGINT reached it: canceled.
        let o = classify(ExitInfo::code(130), &facts, true, Direction::Backup);
        assert_eq!(o.kind, OutcomeKind::Canceled);
    }

    #[test]
    fn progress_is_asked_at_restics_default_rate_whatever_the_interval() {
        let access = RepositoryAccess {
            repository: "/r".into(),
            password_file: "/p".into(),
            ..Default::default()
        };
        for interval in [
            Duration::from_millis(100),
            Duration::from_secs(1),
            Duration::from_secs(10),
        ] {
            let inv = base(&access, Some(interval));
            let fps: Vec<_> = inv
                .env
                .iter()
                .filter(|(k, _)| k == "RESTIC_PROGRESS_FPS")
                .collect();
            assert_eq!(fps.len(), 1, "{interval:?}");
            assert_eq!(fps[0].1, "60");
        }
        assert!(
            base(&access, None)
                .env
                .iter()
                .all(|(k, _)| k != "RESTIC_PROGRESS_FPS")
        );
    }
}
