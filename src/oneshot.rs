//! The one-shot `backup` and `restore` commands: one operation, live progress on the terminal or
//! JSON lines on stdout, clean stop on SIGINT/SIGTERM.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use tokio::signal::unix::{SignalKind, signal};

use crate::cli::{BackupArgs, CommonArgs, RestoreArgs};
use crate::engine::{BackupRequest, Engine, EngineConfig, RestoreRequest};
use crate::operation::Operation;
use crate::progress::OperationProgress;
use crate::uploader::restic::BackupOptions;
use crate::uploader::{Outcome, OutcomeKind, RepositoryAccess};

/// Exit code after a stop by signal, as shells expect for SIGINT.
pub const EXIT_CANCELED: i32 = 130;
/// Exit code of a partial backup, as restic's.
pub const EXIT_PARTIAL: i32 = 3;

fn engine(common: &CommonArgs, init_missing_repository: bool) -> Arc<Engine> {
    Engine::new(EngineConfig {
        restic_binary: common.restic_binary.clone(),
        kopia_binary: common.kopia_binary.clone(),
        update_interval: common.update_interval,
        cancel_grace: common.cancel_grace,
        init_missing_repository,
        lock_wait: common.lock_wait,
        ..EngineConfig::default()
    })
}

fn access(common: &CommonArgs) -> Result<RepositoryAccess, String> {
    let cache_dir = match &common.cache_dir {
        Some(d) => d.clone(),
        None => default_cache_dir(),
    };
    create_private_dir(&cache_dir)?;
    // restic runs inside the source or target directory: relative paths are made absolute here,
    // or a relative cache would land inside the volume being backed up.
    let cache_dir = std::path::absolute(&cache_dir).unwrap_or(cache_dir);
    if let Err(e) = std::fs::metadata(&common.password_file) {
        return Err(format!(
            "password file {}: {e}",
            common.password_file.display()
        ));
    }
    let ca_cert = match &common.cacert {
        Some(f) => {
            if let Err(e) = std::fs::metadata(f) {
                return Err(format!("CA certificate file {}: {e}", f.display()));
            }
            Some(std::path::absolute(f).unwrap_or(f.clone()))
        }
        None => None,
    };
    Ok(RepositoryAccess {
        repository: absolute_local_repository(&common.repo),
        password_file: std::path::absolute(&common.password_file)
            .unwrap_or(common.password_file.clone()),
        cache_dir,
        extra_env: Vec::new(),
        ca_cert,
        insecure_tls: common.insecure_tls,
        restic_options: common.restic_options.clone(),
        kopia_cache_limit_mb: None,
    })
}

/// A local repository given as a relative path (`./repo`, `local:repo`) made absolute against
/// the CLI's working directory: restic is started in the source or target directory, where the
/// same relative path names another place. Anything with another `<backend>:` prefix (`s3:`,
/// `rest:`, `sftp:`, and backends later restic versions add) is left as given.
fn absolute_local_repository(repo: &str) -> String {
    let (prefix, path) = match repo.strip_prefix("local:") {
        Some(p) => ("local:", p),
        None => ("", repo),
    };
    let has_backend_prefix = path
        .split_once(':')
        .is_some_and(|(b, _)| !b.is_empty() && b.bytes().all(|c| c.is_ascii_alphanumeric()));
    if path.is_empty() || has_backend_prefix || std::path::Path::new(path).is_absolute() {
        return repo.to_string();
    }
    match std::path::absolute(path) {
        Ok(p) => format!("{prefix}{}", p.display()),
        Err(_) => repo.to_string(),
    }
}

fn default_cache_dir() -> PathBuf {
    if let Some(x) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(x).join("podvolume-agent");
    }
    if let Some(h) = std::env::var_os("HOME") {
        return PathBuf::from(h).join(".cache").join("podvolume-agent");
    }
    std::env::temp_dir().join("podvolume-agent-cache")
}

/// Creates a directory only its owner can read: the cache holds repository metadata.
fn create_private_dir(dir: &std::path::Path) -> Result<(), String> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| format!("cache directory {}: {e}", dir.display()))
}

pub async fn backup(args: BackupArgs) -> i32 {
    let access = match access(&args.common) {
        Ok(a) => a,
        Err(e) => return usage_error(&e),
    };
    // A source that is not there is the caller's mistake (exit 2), said before any uploader runs.
    match std::fs::metadata(&args.path) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => {
            return usage_error(&format!(
                "backup source {} is not a directory",
                args.path.display()
            ));
        }
        Err(e) => return usage_error(&format!("backup source {}: {e}", args.path.display())),
    }
    let source = std::path::absolute(&args.path).unwrap_or(args.path.clone());
    let req = BackupRequest {
        uploader: args.common.uploader,
        access,
        source,
        options: BackupOptions {
            host: args.host.clone(),
            tags: args.tags.clone(),
            parent: args.parent.clone(),
            limit_upload_kib: args.limit_upload,
            retry_lock: None,
            verbose: false,
            kopia: Default::default(),
        },
    };
    let op = engine(&args.common, !args.no_init).backup(req);
    drive(op, &args.common).await.0
}

pub async fn restore(args: RestoreArgs) -> i32 {
    let access = match access(&args.common) {
        Ok(a) => a,
        Err(e) => return usage_error(&e),
    };
    // The same rule as for a backup's source: a target that exists must be a directory.
    let created = match std::fs::metadata(&args.target) {
        Ok(m) if m.is_dir() => None,
        Ok(_) => {
            return usage_error(&format!(
                "restore target {} is not a directory",
                args.target.display()
            ));
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if let Err(e) = std::fs::create_dir_all(&args.target) {
                return usage_error(&format!("restore target {}: {e}", args.target.display()));
            }
            Some(args.target.clone())
        }
        Err(e) => return usage_error(&format!("restore target {}: {e}", args.target.display())),
    };
    let target = std::path::absolute(&args.target).unwrap_or(args.target.clone());
    let req = RestoreRequest {
        uploader: args.common.uploader,
        access,
        snapshot_id: args.snapshot.clone(),
        target,
        limit_download_kib: args.limit_download,
        kopia: Default::default(),
    };
    // A restore never creates a repository.
    let op = engine(&args.common, false).restore(req);
    let (code, outcome) = drive(op, &args.common).await;
    // A restore that failed or was stopped leaves no directory it created behind (what it wrote
    // there is no result); a partial one keeps what it restored.
    if let (Some(dir), Some(o)) = (created, outcome)
        && !matches!(o.kind, OutcomeKind::Success | OutcomeKind::Partial)
    {
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => eprintln!(
                "removed the restore target {}, which this restore had created",
                dir.display()
            ),
            Err(e) => eprintln!(
                "warning: could not remove the restore target {} this restore had created: {e}",
                dir.display()
            ),
        }
    }
    code
}

fn usage_error(msg: &str) -> i32 {
    eprintln!("error: {msg}");
    2
}

/// Shows progress until the operation ends; a signal cancels it. Returns the exit code and, once
/// the operation ran, its outcome.
async fn drive(op: Operation, common: &CommonArgs) -> (i32, Option<Arc<Outcome>>) {
    let (mut sigint, mut sigterm) = match (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) {
        (Ok(i), Ok(t)) => (i, t),
        _ => return (usage_error("cannot install signal handlers"), None),
    };
    let mut view = ProgressView::new(common.json);
    let mut tick = tokio::time::interval(common.update_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut signalled = false;
    let outcome: Arc<Outcome> = loop {
        tokio::select! {
            o = op.wait() => break o,
            _ = tick.tick() => view.show(&op.progress()),
            _ = sigint.recv() => { signalled = true; break stop(&op, &mut view).await }
            _ = sigterm.recv() => { signalled = true; break stop(&op, &mut view).await }
        }
    };
    let last = op.progress();
    view.finish(&last, &outcome);
    if !common.json {
        report(&outcome);
    }
    let code = match outcome.kind {
        _ if signalled && outcome.kind == OutcomeKind::Canceled => EXIT_CANCELED,
        OutcomeKind::Success => 0,
        OutcomeKind::Partial => EXIT_PARTIAL,
        OutcomeKind::Canceled | OutcomeKind::Interrupted => EXIT_CANCELED,
        _ => 1,
    };
    (code, Some(outcome))
}

async fn stop(op: &Operation, view: &mut ProgressView) -> Arc<Outcome> {
    view.note("stopping the uploader (waiting for it to remove its lock)...");
    op.cancel().await
}

fn report(outcome: &Outcome) {
    if outcome.repository_created {
        eprintln!("note: the repository did not exist; this backup created a new, empty one");
    }
    match outcome.kind {
        OutcomeKind::Success => {
            eprintln!("{}", outcome.message);
            if let Some(id) = &outcome.snapshot_id {
                println!("{id}");
            }
        }
        OutcomeKind::Partial => {
            eprintln!("warning: {}", outcome.message);
            if let Some(id) = &outcome.snapshot_id {
                println!("{id}");
            }
        }
        _ => eprintln!("error: {}", outcome.message),
    }
}

/// Where progress goes: a bar on a terminal, JSON lines with `--json`, plain lines otherwise.
enum ProgressView {
    Json { last: Option<OperationProgress> },
    Bar(ProgressBar),
    Lines { last: Option<OperationProgress> },
}

impl ProgressView {
    fn new(json: bool) -> Self {
        if json {
            return ProgressView::Json { last: None };
        }
        if !std::io::stderr().is_terminal() {
            return ProgressView::Lines { last: None };
        }
        let bar = ProgressBar::with_draw_target(Some(0), ProgressDrawTarget::stderr());
        bar.set_style(unknown_total_style());
        bar.enable_steady_tick(Duration::from_millis(200));
        ProgressView::Bar(bar)
    }

    fn show(&mut self, p: &OperationProgress) {
        match self {
            ProgressView::Json { last } => {
                if last.as_ref() != Some(p) {
                    print_json(p);
                    *last = Some(p.clone());
                }
            }
            ProgressView::Bar(bar) => {
                // While connecting or scanning the total is only "at least what was found so
                // far": a bar would be drawn full. A spinner with the bytes says what is known.
                bar.set_style(if total_known(p) {
                    known_total_style()
                } else {
                    unknown_total_style()
                });
                bar.set_length(p.n_total);
                bar.set_position(p.n_completed);
                bar.set_message(p.description.clone());
            }
            ProgressView::Lines { last } => {
                if last.as_ref().map(|l| &l.description) != Some(&p.description) {
                    eprintln!("{}", p.description);
                    *last = Some(p.clone());
                }
            }
        }
    }

    fn note(&mut self, msg: &str) {
        match self {
            ProgressView::Bar(bar) => bar.set_message(msg.to_string()),
            _ => eprintln!("{msg}"),
        }
    }

    fn finish(&mut self, p: &OperationProgress, outcome: &Outcome) {
        match self {
            ProgressView::Json { .. } => print_final_json(p, outcome),
            ProgressView::Bar(bar) => {
                bar.set_length(p.n_total);
                bar.set_position(p.n_completed);
                bar.finish_and_clear();
            }
            ProgressView::Lines { .. } => {}
        }
    }
}

/// Whether the operation's total is final: not while it connects or its uploader is still
/// finding what there is (the description's stage says so).
fn total_known(p: &OperationProgress) -> bool {
    p.n_total > 0
        && !(p.description.starts_with("connecting") || p.description.starts_with("scanning"))
}

fn known_total_style() -> ProgressStyle {
    ProgressStyle::with_template(
        "{spinner:.green} [{elapsed_precise}] [{wide_bar:.cyan/blue}] {bytes}/{total_bytes}\n  {msg}",
    )
    .unwrap_or_else(|_| ProgressStyle::default_bar())
    .progress_chars("=> ")
}

fn unknown_total_style() -> ProgressStyle {
    ProgressStyle::with_template("{spinner:.green} [{elapsed_precise}] {bytes} so far\n  {msg}")
        .unwrap_or_else(|_| ProgressStyle::default_spinner())
}

/// The last `--json` line: the final progress with the result in fields of their own.
#[derive(serde::Serialize)]
#[serde(rename_all = "camelCase")]
struct FinalLine<'a> {
    #[serde(flatten)]
    progress: &'a OperationProgress,
    /// success, partial, failed or canceled: what the exit code says (0, 3, 1, 130).
    result: &'static str,
    /// The snapshot written (restic's ID, kopia's manifest ID), also for a partial backup.
    #[serde(rename = "snapshotID", skip_serializing_if = "Option::is_none")]
    snapshot_id: Option<&'a str>,
    message: &'a str,
    /// The repository did not exist and the backup created it.
    repository_created: bool,
}

fn print_final_json(p: &OperationProgress, outcome: &Outcome) {
    let line = FinalLine {
        progress: p,
        result: match outcome.kind {
            OutcomeKind::Success => "success",
            OutcomeKind::Partial => "partial",
            OutcomeKind::Canceled | OutcomeKind::Interrupted => "canceled",
            _ => "failed",
        },
        snapshot_id: outcome.snapshot_id.as_deref(),
        message: &outcome.message,
        repository_created: outcome.repository_created,
    };
    let mut out = std::io::stdout().lock();
    if let Ok(s) = serde_json::to_string(&line) {
        let _ = writeln!(out, "{s}");
        let _ = out.flush();
    }
}

fn print_json(p: &OperationProgress) {
    let mut out = std::io::stdout().lock();
    if let Ok(s) = serde_json::to_string(p) {
        let _ = writeln!(out, "{s}");
        let _ = out.flush();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_bar_until_the_total_is_known() {
        let mut p = OperationProgress::new(std::time::SystemTime::now());
        p.description = "connecting".into();
        assert!(!total_known(&p));
        p.n_total = 100;
        p.n_completed = 100;
        p.description = "scanning: 100 B processed of at least 100 B found so far".into();
        assert!(!total_known(&p), "a full bar before anything is known");
        p.n_total = 1000;
        p.description = "uploading: 100 B of 1000 B (10.0%)".into();
        assert!(total_known(&p));
    }

    #[test]
    fn relative_local_repositories_are_made_absolute_remote_ones_kept() {
        let cwd = std::env::current_dir().unwrap();
        let abs = |p: &str| cwd.join(p).display().to_string();
        assert_eq!(absolute_local_repository("repo"), abs("repo"));
        assert_eq!(absolute_local_repository("./a/b"), abs("a/b"));
        assert_eq!(
            absolute_local_repository("local:repo"),
            format!("local:{}", abs("repo"))
        );
        for kept in [
            "/srv/repo",
            "local:/srv/repo",
            "s3:https://s3.example:9000/bucket/restic/ns",
            "rest:http://host:8000/",
            "sftp:user@host:relative/dir",
            "rclone:remote:path",
            "smb:host/share",
            "",
        ] {
            assert_eq!(absolute_local_repository(kept), kept);
        }
    }
}
