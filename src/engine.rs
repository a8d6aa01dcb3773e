//! Runs backups and restores as [`Operation`]s: picks the uploader invocation, wires the child's
//! output through framing and parsing into the progress tracker, stops the child on cancel and
//! turns the end into an [`Outcome`]. Usable with no Kubernetes: the one-shot CLI drives it
//! directly, the node agent through its controllers.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use tokio::sync::OnceCell;
use tokio_util::sync::CancellationToken;

use crate::error::{Error, Result};
use crate::facts::RunFacts;
use crate::framing::{Frame, Separators};
use crate::operation::{Operation, OperationSink};
use crate::progress::{OperationProgress, ProgressTracker};
use crate::runner::{self, ChildSpec, StopKind};
use crate::uploader::kopia;
use crate::uploader::restic::{self, BackupOptions, ResticInvocation, ResticVersion};
use crate::uploader::{
    Direction, ExitInfo, Outcome, OutcomeKind, ProgressSample, RepositoryAccess, Stream,
    UploaderEvent, UploaderKind,
};

/// Settings shared by every operation of an engine.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub restic_binary: PathBuf,
    pub kopia_binary: PathBuf,
    /// How often consumers publish progress; the uploader is asked to report twice as often.
    pub update_interval: Duration,
    /// Time between SIGINT and SIGKILL when stopping an uploader.
    pub cancel_grace: Duration,
    pub max_frame: usize,
    /// Create a missing repository instead of failing.
    pub init_missing_repository: bool,
    /// How long to wait for a repository lock held by someone else before failing.
    pub lock_wait: Duration,
    /// Where running uploaders are recorded (see [`runner::kill_recorded`]).
    pub child_record_dir: Option<PathBuf>,
    /// How long the `restic unlock` after a stop may take before it is stopped too. restic
    /// retries an unreachable backend for minutes, and a cancel must end (a stop is most often
    /// asked for exactly when the backend is the trouble).
    pub unlock_limit: Duration,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            restic_binary: "restic".into(),
            kopia_binary: "kopia".into(),
            update_interval: Duration::from_secs(10),
            cancel_grace: Duration::from_secs(10),
            max_frame: crate::framing::DEFAULT_MAX_FRAME,
            init_missing_repository: true,
            lock_wait: Duration::from_secs(60),
            child_record_dir: None,
            unlock_limit: Duration::from_secs(60),
        }
    }
}

/// A backup of one directory.
#[derive(Debug, Clone)]
pub struct BackupRequest {
    pub uploader: UploaderKind,
    pub access: RepositoryAccess,
    /// The directory to back up; the uploader runs inside it so snapshot paths are relative.
    pub source: PathBuf,
    pub options: BackupOptions,
}

/// A restore of one snapshot into a directory.
#[derive(Debug, Clone)]
pub struct RestoreRequest {
    pub uploader: UploaderKind,
    pub access: RepositoryAccess,
    pub snapshot_id: String,
    pub target: PathBuf,
    /// Download limit in KiB/s (restic `--limit-download`).
    pub limit_download_kib: Option<u64>,
    /// kopia's restore settings (sparse files, parallel downloads).
    pub kopia: kopia::RestoreOptions,
}

/// Starts operations. Detects the uploader version once and reuses it.
#[derive(Debug)]
pub struct Engine {
    cfg: EngineConfig,
    restic_version: OnceCell<ResticVersion>,
}

/// Progress tracker and facts of one child run, shared by the output parser and (for restores
/// that print no progress) the target measurer.
struct Tracking {
    tracker: ProgressTracker,
    facts: RunFacts,
    sink: OperationSink,
}

impl Tracking {
    fn apply(&mut self, stream: Stream, event: UploaderEvent) {
        let now = Instant::now();
        let wall = SystemTime::now();
        let changed = match &event {
            UploaderEvent::Progress(s) => {
                self.tracker.observe(s, now, wall);
                true
            }
            UploaderEvent::ScanFinished { total_bytes, .. } => {
                self.tracker.scan_finished(*total_bytes, now, wall);
                true
            }
            _ => false,
        };
        // The first few item errors are warnings; the rest go to debug (a read-only target made
        // one warning per file): the outcome's message counts them and names the cause.
        if let UploaderEvent::ItemError { item, message } = &event {
            let seen = self.facts.failed_items as usize;
            if seen < crate::facts::NAMED_FAILED_ITEMS {
                tracing::warn!(item = %item, error = %message, "uploader could not process an item");
            } else {
                if seen == crate::facts::NAMED_FAILED_ITEMS {
                    tracing::warn!(
                        "more items could not be processed: counted in the result, each logged at debug level"
                    );
                }
                tracing::debug!(item = %item, error = %message, "uploader could not process an item");
            }
        }
        self.facts.observe(stream, &event);
        if changed {
            self.sink.publish(self.tracker.progress().clone());
        }
    }
}

type Shared = Arc<Mutex<Tracking>>;

fn lock(t: &Shared) -> std::sync::MutexGuard<'_, Tracking> {
    // A panic while holding the lock leaves plain data behind; keep going with it.
    t.lock().unwrap_or_else(|e| e.into_inner())
}

impl Engine {
    pub fn new(cfg: EngineConfig) -> Arc<Self> {
        Arc::new(Self {
            cfg,
            restic_version: OnceCell::new(),
        })
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// The restic version, asked once (`restic version`) and remembered.
    pub async fn restic_version(&self) -> Result<ResticVersion> {
        self.restic_version
            .get_or_try_init(|| async {
                let spec = ChildSpec::new(&self.cfg.restic_binary, vec!["version".into()]);
                let out = runner::capture(&spec, &CancellationToken::new(), self.cfg.cancel_grace)
                    .await?;
                let text = String::from_utf8_lossy(&out.stdout).to_string();
                ResticVersion::parse(&text).ok_or(Error::UnknownVersion {
                    program: self.cfg.restic_binary.display().to_string(),
                    output: crate::text::truncate(&text, 200),
                })
            })
            .await
            .copied()
    }

    /// Starts a backup.
    pub fn backup(self: &Arc<Self>, req: BackupRequest) -> Operation {
        let engine = Arc::clone(self);
        Operation::spawn(
            OperationProgress::new(SystemTime::now()),
            move |sink| async move {
                let outcome = match req.uploader {
                    UploaderKind::Restic => engine.restic_backup(&req, &sink).await,
                    UploaderKind::Kopia => engine.kopia_backup(&req, &sink).await,
                };
                finish(&sink, Direction::Backup, outcome)
            },
        )
    }

    /// Starts a restore.
    pub fn restore(self: &Arc<Self>, req: RestoreRequest) -> Operation {
        let engine = Arc::clone(self);
        Operation::spawn(
            OperationProgress::new(SystemTime::now()),
            move |sink| async move {
                let outcome = match req.uploader {
                    UploaderKind::Restic => engine.restic_restore(&req, &sink).await,
                    UploaderKind::Kopia => engine.kopia_restore(&req, &sink).await,
                };
                finish(&sink, Direction::Restore, outcome)
            },
        )
    }

    /// Removes a snapshot this agent has just made and nothing will reference (its Backup ended
    /// while the upload ran): kopia's manifest deleted, restic's snapshot forgotten; nothing is
    /// pruned. Bounded by the unlock limit; not cancelable (it runs after the transfer's end).
    pub async fn forget_snapshot(
        &self,
        uploader: UploaderKind,
        access: &RepositoryAccess,
        snapshot_id: &str,
    ) -> std::result::Result<(), String> {
        let spec = match uploader {
            UploaderKind::Restic => {
                restic::forget(access, snapshot_id).map(|inv| self.restic_spec(inv, None))
            }
            UploaderKind::Kopia => {
                kopia::snapshot_delete(access, snapshot_id).map(|inv| self.kopia_spec(inv, None))
            }
        }
        .map_err(|e| e.to_string())?;
        tracing::info!(argv = %spec.display_argv(), "removing a snapshot no backup references");
        let stop = CancellationToken::new();
        let timer = {
            let stop = stop.clone();
            let limit = self.cfg.unlock_limit;
            tokio::spawn(async move {
                tokio::time::sleep(limit).await;
                stop.cancel();
            })
        };
        let result = runner::capture(&spec, &stop, self.cfg.cancel_grace).await;
        timer.abort();
        match result {
            _ if stop.is_cancelled() => Err(format!(
                "it did not finish within {}",
                humantime::format_duration(self.cfg.unlock_limit)
            )),
            Ok(c) if c.exit.code == Some(0) => Ok(()),
            Ok(c) => Err(c
                .stderr
                .iter()
                .rev()
                .find(|l| !l.trim().is_empty())
                .map(|l| crate::text::redact_url_credentials(l))
                .unwrap_or_else(|| c.exit.to_string())),
            Err(e) => Err(e.to_string()),
        }
    }

    fn restic_spec(&self, inv: ResticInvocation, cwd: Option<&Path>) -> ChildSpec {
        let mut spec = ChildSpec::new(&self.cfg.restic_binary, inv.args);
        spec.env = inv.env;
        spec.env_remove = restic::SCRUBBED_ENV.to_vec();
        spec.cwd = cwd.map(Path::to_path_buf);
        spec.max_frame = self.cfg.max_frame;
        spec.record_dir = self.cfg.child_record_dir.clone();
        spec
    }

    /// Runs a short restic command to its end (init, unlock, stats).
    async fn restic_capture(
        &self,
        inv: ResticInvocation,
        cancel: &CancellationToken,
    ) -> Result<runner::Captured> {
        runner::capture(&self.restic_spec(inv, None), cancel, self.cfg.cancel_grace).await
    }

    /// Runs one uploader child with its output feeding `tracking`.
    async fn run_tracked(
        &self,
        spec: &ChildSpec,
        parse: &(dyn Fn(Stream, &[u8]) -> UploaderEvent + Sync),
        tracking: &Shared,
        cancel: &CancellationToken,
    ) -> Result<(ExitInfo, Option<StopKind>)> {
        tracing::info!(argv = %spec.display_argv(), cwd = ?spec.cwd, "starting uploader");
        let exit = runner::run(spec, cancel, self.cfg.cancel_grace, &mut |stream, frame| {
            let event = match frame {
                Frame::Line(l) => parse(stream, l),
                Frame::Truncated { len } => UploaderEvent::Truncated { len },
            };
            lock(tracking).apply(stream, event);
        })
        .await?;
        if exit.truncated_frames > 0 {
            tracing::warn!(
                count = exit.truncated_frames,
                "uploader printed records over the frame cap; they were skipped"
            );
        }
        Ok((exit.exit, exit.stop))
    }

    /// Removes the lock a stopped restic may have left. Not cancelable: it must run after a cancel.
    async fn restic_unlock(&self, access: &RepositoryAccess) {
        let stop = CancellationToken::new();
        let limit = self.cfg.unlock_limit;
        let timer = {
            let stop = stop.clone();
            tokio::spawn(async move {
                tokio::time::sleep(limit).await;
                stop.cancel();
            })
        };
        let result = self.restic_capture(restic::unlock(access), &stop).await;
        timer.abort();
        match result {
            _ if stop.is_cancelled() => tracing::warn!(
                limit = %humantime::format_duration(limit),
                "restic unlock did not finish in time and was stopped (backend unreachable?); a stale lock stays until the next unlock"
            ),
            Ok(c) if c.exit.code == Some(0) => tracing::info!("removed stale repository locks"),
            Ok(c) => {
                let last = c
                    .stderr
                    .last()
                    .map(|l| crate::text::redact_url_credentials(l));
                tracing::warn!(exit = %c.exit, stderr = ?last, "restic unlock failed")
            }
            Err(e) => tracing::warn!(error = %e, "restic unlock could not run"),
        }
    }

    async fn restic_init(
        &self,
        access: &RepositoryAccess,
        cancel: &CancellationToken,
    ) -> Result<(), String> {
        tracing::info!("repository does not exist: initialising it");
        match self.restic_capture(restic::init(access), cancel).await {
            Ok(c) if c.exit.code == Some(0) => Ok(()),
            Ok(c) => Err(format!(
                "cannot initialise the repository: {}",
                c.stderr
                    .iter()
                    .rev()
                    .find(|l| !l.is_empty())
                    .map(|l| crate::text::redact_url_credentials(l))
                    .unwrap_or_else(|| c.exit.to_string())
            )),
            Err(e) => Err(format!("cannot initialise the repository: {e}")),
        }
    }

    async fn restic_backup(&self, req: &BackupRequest, sink: &OperationSink) -> Outcome {
        let cancel = sink.cancel_token();
        if let Err(msg) = check_directory(&req.source, "backup source") {
            return Outcome {
                kind: OutcomeKind::SourceMissing,
                ..Outcome::internal(msg)
            };
        }
        let version = match self.restic_version().await {
            Ok(v) => v,
            Err(e) => return Outcome::internal(e.to_string()),
        };
        let tracking = self.tracking(Direction::Backup, sink);
        let parser = restic::ResticParser::new(Direction::Backup);
        let parse = move |_s: Stream, l: &[u8]| parser.parse(l);
        let mut initialised = false;
        let mut unlocked = false;
        let mut parent = req.options.parent.clone();
        let lock_deadline = Instant::now() + self.cfg.lock_wait;
        let mut backoff = Duration::from_secs(2);
        loop {
            if cancel.is_cancelled() {
                return Outcome::canceled("canceled before the uploader started");
            }
            lock(&tracking).facts = RunFacts::default();
            let mut opts = req.options.clone();
            opts.parent = parent.clone();
            if opts.retry_lock.is_none() && version.has_retry_lock() {
                opts.retry_lock = Some(self.cfg.lock_wait);
            }
            let inv = restic::backup(&req.access, version, &opts, self.cfg.update_interval);
            let spec = self.restic_spec(inv, Some(&req.source));
            let (exit, stop) = match self.run_tracked(&spec, &parse, &tracking, cancel).await {
                Ok(r) => r,
                Err(e) => return Outcome::internal(e.to_string()),
            };
            // Canceled only if our stop reached the running restic: one that ended on its own
            // (exit 3 with its snapshot, a failure) before that keeps its own outcome.
            let outcome = {
                let t = lock(&tracking);
                restic::classify(exit, &t.facts, stop.is_some(), Direction::Backup)
            };
            if may_have_left_its_lock(&exit, stop.is_some()) {
                self.restic_unlock(&req.access).await;
            }
            // A cancel requested after restic ended on its own: nothing more is tried (no init,
            // no unlock and retry), and the outcome is restic's own.
            if cancel.is_cancelled() {
                return outcome;
            }
            match outcome.kind {
                OutcomeKind::RepositoryMissing
                    if self.cfg.init_missing_repository && !initialised =>
                {
                    if let Err(msg) = self.restic_init(&req.access, cancel).await {
                        return Outcome {
                            kind: OutcomeKind::RepositoryMissing,
                            ..Outcome::internal(msg)
                        };
                    }
                    initialised = true;
                }
                // A lock left by a dead restic (this host, or older than 30 min) is removed by
                // `restic unlock`, which never touches a live holder's lock: try that once.
                OutcomeKind::Locked if !unlocked => {
                    tracing::info!(cause = %outcome.message, "repository is locked; removing stale locks and retrying");
                    self.restic_unlock(&req.access).await;
                    unlocked = true;
                }
                // The parent only saves reading unchanged files; a parent that is no longer in
                // the repository (pruned by `restic forget`, or a PodVolumeBackup pointing at
                // another repository) must not fail the backup: run again without it.
                OutcomeKind::Failed
                    if parent
                        .as_deref()
                        .is_some_and(|p| restic::is_unknown_snapshot(&outcome.message, p)) =>
                {
                    tracing::warn!(
                        parent = parent.as_deref().unwrap_or_default(),
                        cause = %outcome.message,
                        "the parent snapshot is not in the repository; backing up without a parent (every file is read)"
                    );
                    parent = None;
                }
                // restic >= 0.16 waits itself (--retry-lock); older ones are retried here.
                OutcomeKind::Locked
                    if !version.has_retry_lock() && Instant::now() + backoff < lock_deadline =>
                {
                    tracing::info!(retry_in = ?backoff, cause = %outcome.message, "repository is locked; retrying");
                    tokio::select! {
                        _ = tokio::time::sleep(backoff) => {}
                        _ = cancel.cancelled() => return Outcome::canceled("canceled while waiting for a repository lock"),
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(30));
                }
                _ => {
                    return Outcome {
                        repository_created: initialised,
                        ..outcome
                    };
                }
            }
        }
    }

    async fn restic_restore(&self, req: &RestoreRequest, sink: &OperationSink) -> Outcome {
        let cancel = sink.cancel_token();
        if let Err(msg) = check_directory(&req.target, "restore target") {
            return Outcome {
                kind: OutcomeKind::SourceMissing,
                ..Outcome::internal(msg)
            };
        }
        let version = match self.restic_version().await {
            Ok(v) => v,
            Err(e) => return Outcome::internal(e.to_string()),
        };
        let tracking = self.tracking(Direction::Restore, sink);
        // restic < 0.16 prints nothing while restoring: the total comes from `stats`, the part done
        // from the bytes that appear under the target.
        let mut measurer = None;
        let mut known_total = None;
        let pid_cell = Arc::new(AtomicU32::new(0));
        if !version.has_restore_json() {
            let stats_inv = match restic::stats(&req.access, &req.snapshot_id) {
                Ok(inv) => inv,
                Err(e) => return Outcome::internal(e.to_string()),
            };
            let stats = match self.restic_capture(stats_inv, cancel).await {
                Ok(c) => c,
                Err(e) => return Outcome::internal(e.to_string()),
            };
            if cancel.is_cancelled() {
                return Outcome::canceled("canceled before the uploader started");
            }
            if stats.exit.code != Some(0) {
                let mut facts = RunFacts::default();
                let parser = restic::ResticParser::new(Direction::Restore);
                for line in &stats.stderr {
                    facts.observe(Stream::Stderr, &parser.parse(line.as_bytes()));
                }
                return restic::classify(stats.exit, &facts, false, Direction::Restore);
            }
            match restic::parse_stats(&stats.stdout) {
                Some((total, _files)) => {
                    known_total = Some(total);
                    let mut t = lock(&tracking);
                    t.tracker
                        .set_total(total, Instant::now(), SystemTime::now());
                    t.sink.publish(t.tracker.progress().clone());
                }
                None => tracing::warn!(
                    "restic stats printed no usable total; restore progress will show bytes only"
                ),
            }
            measurer = Some(tokio::spawn(measure_restore(
                Arc::clone(&pid_cell),
                known_total,
                self.cfg.update_interval,
                Arc::clone(&tracking),
            )));
        }
        let parser = restic::ResticParser::new(Direction::Restore);
        let parse = move |_s: Stream, l: &[u8]| parser.parse(l);
        let inv = match restic::restore(
            &req.access,
            version,
            &req.snapshot_id,
            req.limit_download_kib,
            self.cfg.update_interval,
        ) {
            Ok(inv) => inv,
            Err(e) => return Outcome::internal(e.to_string()),
        };
        let mut spec = self.restic_spec(inv, Some(&req.target));
        spec.pid_cell = Some(Arc::clone(&pid_cell));
        let result = self.run_tracked(&spec, &parse, &tracking, cancel).await;
        if let Some(m) = measurer {
            m.abort();
        }
        let (exit, stop) = match result {
            Ok(r) => r,
            Err(e) => return Outcome::internal(e.to_string()),
        };
        if may_have_left_its_lock(&exit, stop.is_some()) {
            self.restic_unlock(&req.access).await;
        }
        let (mut outcome, reached) = {
            let t = lock(&tracking);
            (
                restic::classify(exit, &t.facts, stop.is_some(), Direction::Restore),
                t.tracker.progress().n_completed,
            )
        };
        if let (true, None, Some(total)) =
            (outcome.kind.is_success(), &outcome.summary, known_total)
        {
            outcome.summary = Some(crate::uploader::RunSummaryView {
                total_bytes: total,
                total_files: 0,
                bytes_added: 0,
                files_unmodified: 0,
                incremental_bytes: None,
            });
        }
        // A restore summary may be bare (`{"message_type":"summary"}`, every counter omitted):
        // what was restored is then at least what the progress reached.
        if let (true, Some(s)) = (outcome.kind.is_success(), outcome.summary.as_mut()) {
            s.total_bytes = s.total_bytes.max(reached);
        }
        outcome
    }

    fn kopia_spec(&self, inv: kopia::KopiaInvocation, cwd: Option<&Path>) -> ChildSpec {
        let mut spec = ChildSpec::new(&self.cfg.kopia_binary, inv.args);
        spec.env = inv.env;
        spec.env_remove = kopia::SCRUBBED_ENV.to_vec();
        spec.cwd = cwd.map(Path::to_path_buf);
        spec.max_frame = self.cfg.max_frame;
        spec.record_dir = self.cfg.child_record_dir.clone();
        // kopia redraws its progress line with \r and no newline.
        spec.stderr_separators = Separators::NewlineAndCarriageReturn;
        spec
    }

    /// Runs `repository connect|create`: success is exit 0 (no manifest to check).
    async fn kopia_repository_command(
        &self,
        inv: Result<kopia::KopiaInvocation>,
        tracking: &Shared,
        cancel: &CancellationToken,
    ) -> Outcome {
        let outcome = self
            .kopia_run(inv, None, Direction::Restore, tracking, cancel)
            .await;
        if outcome.exit_code == Some(0) {
            return Outcome {
                kind: OutcomeKind::Success,
                ..Outcome::internal("connected")
            };
        }
        outcome
    }

    /// Runs one kopia command to its end, its output feeding `tracking`.
    async fn kopia_run(
        &self,
        inv: Result<kopia::KopiaInvocation>,
        cwd: Option<&Path>,
        direction: Direction,
        tracking: &Shared,
        cancel: &CancellationToken,
    ) -> Outcome {
        let inv = match inv {
            Ok(i) => i,
            Err(e) => return Outcome::internal(e.to_string()),
        };
        lock(tracking).facts = RunFacts::default();
        let parser = kopia::KopiaParser::new(direction);
        let parse = move |_s: Stream, l: &[u8]| parser.parse(l);
        let spec = self.kopia_spec(inv, cwd);
        match self.run_tracked(&spec, &parse, tracking, cancel).await {
            // Canceled only if our stop reached the running kopia.
            Ok((exit, stop)) => {
                let t = lock(tracking);
                kopia::classify(exit, &t.facts, stop.is_some(), direction)
            }
            Err(e) => Outcome::internal(e.to_string()),
        }
    }

    /// Connects kopia to the repository (its config lives in the private cache), creating the
    /// repository when it is missing and that is allowed; a connection made with the same
    /// settings before is reused (see `kopia::connection_is_current`).
    async fn kopia_connect(
        &self,
        access: &RepositoryAccess,
        may_create: bool,
        tracking: &Shared,
        cancel: &CancellationToken,
    ) -> Result<KopiaConnection, Outcome> {
        if kopia::connection_is_current(access) {
            return Ok(KopiaConnection {
                created: false,
                reused: true,
            });
        }
        kopia::forget_connection(access);
        let connected = self
            .kopia_repository_command(kopia::connect(access), tracking, cancel)
            .await;
        let created = match connected.kind {
            OutcomeKind::Success => false,
            // After a cancel request nothing new is started: the outcome is kopia's own.
            _ if cancel.is_cancelled() => return Err(connected),
            OutcomeKind::RepositoryMissing if may_create && self.cfg.init_missing_repository => {
                tracing::info!("kopia repository does not exist: creating it");
                let created = self
                    .kopia_repository_command(kopia::create(access), tracking, cancel)
                    .await;
                if !created.kind.is_success() {
                    return Err(created);
                }
                true
            }
            _ => return Err(connected),
        };
        kopia::remember_connection(access);
        Ok(KopiaConnection {
            created,
            reused: false,
        })
    }

    /// Runs `attempt` on a connection; when it fails on a reused one (the repository recreated in
    /// place, keys or CA changed under the same settings...), connects afresh and runs it again.
    async fn kopia_connected<F, Fut>(
        &self,
        access: &RepositoryAccess,
        may_create: bool,
        tracking: &Shared,
        cancel: &CancellationToken,
        attempt: F,
    ) -> Outcome
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = Outcome>,
    {
        let conn = match self
            .kopia_connect(access, may_create, tracking, cancel)
            .await
        {
            Ok(c) => c,
            Err(failed) => return failed,
        };
        if cancel.is_cancelled() {
            return Outcome::canceled("canceled before the uploader started");
        }
        let outcome = attempt().await;
        // Only failures to open or reach the repository: an unreadable file (Velero's fail-fast)
        // or a snapshot that does not exist would fail the same way again, after as long.
        let repository_trouble = match outcome.kind {
            OutcomeKind::RepositoryMissing
            | OutcomeKind::RepositoryUnreachable
            | OutcomeKind::WrongPassword => true,
            OutcomeKind::Failed => outcome.message.contains("repository"),
            _ => false,
        };
        let retry = conn.reused
            && repository_trouble
            && !cancel.is_cancelled()
            && outcome.snapshot_id.is_none();
        if !retry {
            return Outcome {
                repository_created: conn.created,
                ..outcome
            };
        }
        tracing::info!(cause = %outcome.message, "kopia failed on a reused connection: connecting again with an empty cache and retrying once");
        kopia::forget_connection_and_cache(access);
        let conn = match self
            .kopia_connect(access, may_create, tracking, cancel)
            .await
        {
            Ok(c) => c,
            Err(failed) => return failed,
        };
        if cancel.is_cancelled() {
            return Outcome::canceled("canceled before the uploader started");
        }
        Outcome {
            repository_created: conn.created,
            ..attempt().await
        }
    }

    async fn kopia_backup(&self, req: &BackupRequest, sink: &OperationSink) -> Outcome {
        let cancel = sink.cancel_token();
        if let Err(msg) = check_directory(&req.source, "backup source") {
            return Outcome {
                kind: OutcomeKind::SourceMissing,
                ..Outcome::internal(msg)
            };
        }
        let tracking = self.tracking(Direction::Backup, sink);
        self.kopia_connected(&req.access, true, &tracking, cancel, || {
            self.kopia_snapshot(req, &tracking, cancel)
        })
        .await
    }

    /// The keep-everything policy (once per source and connection), then `snapshot create`.
    async fn kopia_snapshot(
        &self,
        req: &BackupRequest,
        tracking: &Shared,
        cancel: &CancellationToken,
    ) -> Outcome {
        let options = &req.options.kopia;
        if let (true, Some(source)) = (options.keep_all_policy, &options.source)
            && !kopia::policy_is_set(&req.access, source)
        {
            let set = self
                .kopia_repository_command(
                    kopia::policy_keep_all(&req.access, source),
                    tracking,
                    cancel,
                )
                .await;
            if !set.kind.is_success() {
                let mut failed = set;
                failed.message = format!(
                    "cannot set the keep-everything policy on {source} (without it kopia's default retention could delete snapshots Velero still needs): {}",
                    failed.message
                );
                return failed;
            }
            kopia::remember_policy(&req.access, source);
        }
        self.kopia_run(
            kopia::snapshot_create(&req.access, &req.source, &req.options.tags, options),
            Some(&req.source),
            Direction::Backup,
            tracking,
            cancel,
        )
        .await
    }

    async fn kopia_restore(&self, req: &RestoreRequest, sink: &OperationSink) -> Outcome {
        let cancel = sink.cancel_token();
        if let Err(msg) = check_directory(&req.target, "restore target") {
            return Outcome {
                kind: OutcomeKind::SourceMissing,
                ..Outcome::internal(msg)
            };
        }
        let tracking = self.tracking(Direction::Restore, sink);
        // kopia prints the restored size only rounded, and it is read as the smallest value the
        // figure could stand for (several percent low, up to half a unit for whole figures). The
        // exact size is what appears under the target: the regular files' bytes after the restore
        // less those already there before it.
        let measure = |target: PathBuf| async move {
            tokio::task::spawn_blocking(move || kopia::regular_file_bytes(&target))
                .await
                .map_err(|e| std::io::Error::other(e.to_string()))
                .and_then(|r| r)
        };
        let baseline = tokio::select! {
            b = measure(req.target.clone()) => b,
            _ = cancel.cancelled() => return Outcome::canceled("canceled before the uploader started"),
        };
        if let Err(e) = &baseline {
            tracing::warn!(target = %req.target.display(), error = %e, "cannot measure the restore target; the restored size will be kopia's rounded figure");
        }
        // A restore never creates a repository, whatever the engine allows for backups.
        let access = &req.access;
        let mut outcome = self
            .kopia_connected(access, false, &tracking, cancel, || {
                self.kopia_run(
                    kopia::snapshot_restore(access, &req.snapshot_id, &req.target, &req.kopia),
                    Some(&req.target),
                    Direction::Restore,
                    &tracking,
                    cancel,
                )
            })
            .await;
        let Ok(before) = baseline else {
            return outcome;
        };
        if !outcome.kind.is_success() {
            return outcome;
        }
        let after = match measure(req.target.clone()).await {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(target = %req.target.display(), error = %e, "cannot measure the restored target; the restored size is kopia's rounded figure");
                return outcome;
            }
        };
        // Progress came from lower bounds of partial sizes, so the measured size is at least what
        // was published, unless the restore overwrote files that were there before (then the
        // difference undercounts): never report less than was reached.
        let reached = lock(&tracking).tracker.progress().n_completed;
        let measured = after.saturating_sub(before);
        if measured < reached {
            tracing::warn!(
                measured,
                reached,
                "the target grew by less than kopia reported restoring (files overwritten?)"
            );
        }
        let total_bytes = measured.max(reached);
        let summary = match outcome.summary.take() {
            Some(s) => {
                outcome.message = kopia::restore_message(total_bytes, s.total_files);
                crate::uploader::RunSummaryView { total_bytes, ..s }
            }
            None => crate::uploader::RunSummaryView {
                total_bytes,
                total_files: 0,
                bytes_added: 0,
                files_unmodified: 0,
                incremental_bytes: None,
            },
        };
        outcome.summary = Some(summary);
        outcome
    }

    fn tracking(&self, direction: Direction, sink: &OperationSink) -> Shared {
        Arc::new(Mutex::new(Tracking {
            tracker: ProgressTracker::new(direction, sink.latest().started),
            facts: RunFacts::default(),
            sink: sink.clone(),
        }))
    }
}

/// Whether restic may have ended without removing its lock: we stopped it (restic <= 0.16 leaves
/// it on SIGKILL), something else killed it (the OOM killer, another SIGTERM/SIGKILL), or it
/// crashed (a Go panic exits 2). `restic unlock` removes only stale locks (a dead process on this
/// host), so it is safe to run; a lock left would block the repository's next prune or check.
fn may_have_left_its_lock(exit: &crate::uploader::ExitInfo, stopped: bool) -> bool {
    stopped || exit.signal.is_some() || exit.code == Some(2)
}

/// Publishes the final progress: on success both counters become the final size, never less than
/// what was already published (see [`OperationProgress::complete`]).
fn finish(sink: &OperationSink, direction: Direction, outcome: Outcome) -> Outcome {
    // Start from the last published value so what was reached is kept on failure.
    let mut progress = sink.latest();
    let success_size = match outcome.kind {
        OutcomeKind::Success | OutcomeKind::Partial => {
            outcome.summary.as_ref().map(|s| s.total_bytes)
        }
        _ => None,
    };
    let err = (!outcome.kind.is_success()).then(|| outcome.message.clone());
    progress.complete(
        success_size,
        err,
        outcome.message.clone(),
        SystemTime::now(),
    );
    tracing::info!(direction = ?direction, outcome = ?outcome.kind, message = %outcome.message, "operation finished");
    sink.publish(progress);
    outcome
}

fn check_directory(path: &Path, what: &str) -> Result<(), String> {
    match std::fs::metadata(path) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(format!("{what} {} is not a directory", path.display())),
        Err(e) => Err(format!("{what} {}: {e}", path.display())),
    }
}

/// Bytes a process has written so far (`wchar` of `/proc/<pid>/io`, all its threads).
fn process_bytes_written(pid: u32) -> Option<u64> {
    let io = std::fs::read_to_string(format!("/proc/{pid}/io")).ok()?;
    io.lines()
        .find_map(|l| l.strip_prefix("wchar:"))
        .and_then(|v| v.trim().parse().ok())
}

/// Restore progress for restic versions that print none. The restored files cannot be measured
/// on disk: restic 0.14 creates each file at full size before writing its data. What restic has
/// written is what its process wrote, read once per interval from `/proc`. Writes to its cache
/// are counted too, so the figure is clamped to the snapshot size.
async fn measure_restore(
    pid: Arc<AtomicU32>,
    total: Option<u64>,
    interval: Duration,
    tracking: Shared,
) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let pid = pid.load(Ordering::Relaxed);
        if pid == 0 {
            continue;
        }
        let Some(done) = process_bytes_written(pid) else {
            continue;
        };
        let done = total.map_or(done, |t| done.min(t));
        let sample = ProgressSample {
            bytes_done: done,
            total_bytes: total,
            scan_finished: true,
            ..Default::default()
        };
        lock(&tracking).apply(Stream::Stdout, UploaderEvent::Progress(sample));
    }
}

/// How `kopia_connect` left the repository's connection.
struct KopiaConnection {
    /// The repository did not exist and was created (`--init-missing-repository`).
    created: bool,
    /// The connection made by an earlier operation was reused (no `repository connect` ran).
    reused: bool,
}
