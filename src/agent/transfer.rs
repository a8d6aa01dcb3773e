//! What backups and restores share once they run: the monitor loop that publishes progress at
//! `--update-interval`, handles cancel, timeout and stalls; and the terminal write.

use std::time::{Duration, Instant};

use kube::ResourceExt;
use kube::runtime::events::{Event, EventType};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use super::Context;
use super::owner::Owner;
use super::registry::CancelReason;
use super::state::StoredResult;
use super::status::{Finalizer, ObjectWriter, VolumeObject, WriteError, now_rfc3339};
use crate::crd::Phase;
use crate::operation::Operation;
use crate::progress::{OperationProgress, WriteSchedule};
use crate::telemetry::{FailureLog, FailureStreak};

/// Publishes an Event on the object; failures are logged, never fatal.
pub async fn event<K: VolumeObject>(
    ctx: &Context,
    obj: &K,
    warning: bool,
    reason: &str,
    note: String,
) {
    let ev = Event {
        type_: if warning {
            EventType::Warning
        } else {
            EventType::Normal
        },
        reason: reason.to_string(),
        note: Some(crate::text::truncate(&note, 1000)),
        action: reason.to_string(),
        secondary: None,
    };
    if let Err(e) = ctx.recorder.publish(&ev, &obj.object_ref(&())).await {
        tracing::debug!(error = %e, reason, "could not publish an event");
    }
}

/// The progress part of a status patch.
pub fn progress_status(p: &OperationProgress) -> Value {
    json!({
        "progress": {
            "totalBytes": i64::try_from(p.n_total).unwrap_or(i64::MAX),
            "bytesDone": i64::try_from(p.n_completed).unwrap_or(i64::MAX),
        },
    })
}

/// What the published progress must differ in to be worth a write: bytes, total, or stage. A
/// rate or ETA that drifts while bytes stand still is not news, so a stalled transfer costs no
/// writes.
fn write_key(p: &OperationProgress) -> (u64, u64, String) {
    let stage = p
        .description
        .split(':')
        .next()
        .unwrap_or_default()
        .to_string();
    (p.n_completed, p.n_total, stage)
}

/// How often a progress write that keeps failing is logged again (once when it starts, once
/// when it ends, and this in between).
const FAILURE_REMINDER: Duration = Duration::from_secs(60);

fn round_to_ms(d: Duration) -> Duration {
    Duration::from_millis(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Runs until the operation ends. Returns why it was stopped, if it was.
pub async fn monitor<K: VolumeObject>(
    ctx: &Context,
    obj: &K,
    writer: &mut ObjectWriter<K>,
    uid: &str,
    op: &Operation,
    token: &CancellationToken,
) -> Option<CancelReason> {
    let args = &ctx.args;
    let mut tick = tokio::time::interval(args.update_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let timeout_at = args
        .operation_timeout
        .0
        .map(|d| tokio::time::Instant::now() + d);
    let far = tokio::time::Instant::now() + Duration::from_secs(100 * 365 * 86_400);
    let mut last_written: Option<(u64, u64, String)> = None;
    // A newer value is written at the first moment the schedule allows (see WriteSchedule):
    // never older than one interval, never two writes within one, nothing while nothing changes.
    let mut schedule = WriteSchedule::new(args.update_interval);
    let mut updates = op.subscribe();
    let mut updates_open = true;
    let mut write_failures = FailureStreak::new(FAILURE_REMINDER);
    let mut pending = false;
    let mut last_bytes = 0u64;
    let mut last_change = Instant::now();
    let mut stall_reported = false;
    let mut canceling = false;
    let direction = if matches!(K::KIND, "PodVolumeRestore" | "DataDownload") {
        "download"
    } else {
        "upload"
    };
    loop {
        tokio::select! {
            _ = op.wait() => break,
            _ = token.cancelled(), if !canceling => {
                canceling = true;
                let reason = ctx.registry.cancel_reason(uid).unwrap_or(CancelReason::Requested);
                tracing::info!(?reason, "stopping the transfer");
                op.request_cancel();
                if reason != CancelReason::Shutdown {
                    let message = format!("canceling: {}", reason_text(ctx, uid, reason));
                    let patch = json!({ "phase": Phase::Canceling.as_str(), "message": message });
                    match writer.write(Some(patch), None).await {
                        Ok(_) => ctx.registry.set_phase(uid, Phase::Canceling.as_str()),
                        // Someone else's result stands (the cancel may be ours because of it).
                        Err(WriteError::Terminal(_) | WriteError::Gone) => {}
                        Err(e) => tracing::warn!(error = %e, "could not write Canceling"),
                    }
                }
            }
            _ = tokio::time::sleep_until(timeout_at.unwrap_or(far)), if timeout_at.is_some() && !canceling => {
                ctx.registry.cancel(uid, CancelReason::Timeout);
            }
            changed = updates.changed(), if updates_open => {
                if changed.is_err() {
                    updates_open = false;
                    continue;
                }
                let key = write_key(&updates.borrow_and_update());
                pending = last_written.as_ref() != Some(&key);
            }
            _ = tokio::time::sleep_until(tokio::time::Instant::from_std(schedule.due(Instant::now()))), if pending && !canceling => {
                let p = op.progress();
                let key = write_key(&p);
                pending = false;
                if last_written.as_ref() == Some(&key) {
                    continue;
                }
                schedule.wrote(Instant::now());
                let mut patch = progress_status(&p);
                patch["message"] = Value::String(p.description.clone());
                match writer.write(Some(patch), None).await {
                    Ok(_) => {
                        last_written = Some(key);
                        if let Some((failures, lasting)) = write_failures.succeeded(Instant::now()) {
                            tracing::info!(failures, lasted = %humantime::format_duration(round_to_ms(lasting)), "progress writes work again");
                        }
                    }
                    Err(WriteError::Terminal(phase)) => {
                        tracing::warn!(?phase, "someone else finished the object; stopping the transfer");
                        ctx.registry.cancel(uid, CancelReason::Requested);
                    }
                    Err(WriteError::Gone) => {
                        tracing::warn!("the object was deleted; stopping the transfer");
                        ctx.registry.cancel(uid, CancelReason::Deleted);
                    }
                    // Tried again at the next due moment with the newest value.
                    Err(e) => {
                        match write_failures.failed(Instant::now()) {
                            FailureLog::First => tracing::warn!(error = %e, "progress write failed; trying again at each interval with the newest value"),
                            FailureLog::StillFailing { failures, lasting } => tracing::warn!(error = %e, failures, lasting = %humantime::format_duration(round_to_ms(lasting)), "progress writes still failing"),
                            FailureLog::Quiet => tracing::debug!(error = %e, "progress write failed"),
                        }
                        pending = true;
                    }
                }
            }
            _ = tick.tick() => {
                // Whether the owner still waits for this transfer (a cached read, see owner).
                if !canceling
                    && let Some(owner) = Owner::of_transfer(obj)
                    && let Some(why) = ctx.owners.state(&owner).await.stop_reason(&owner)
                {
                    tracing::info!(owner = %owner.describe(), "{why}; stopping the transfer");
                    ctx.registry.cancel_because(uid, CancelReason::OwnerDone, why);
                }
                // Stall detection and the throughput metric; status writes are above.
                let p = op.progress();
                if p.n_completed != last_bytes {
                    last_bytes = p.n_completed;
                    last_change = Instant::now();
                    stall_reported = false;
                } else if let Some(limit) = args.stall_timeout.0
                    && !stall_reported && !canceling && last_change.elapsed() >= limit
                {
                    {
                        stall_reported = true;
                        ctx.metrics.stalled();
                        let note = format!("no byte progress for {} (at {} of {} bytes)", humantime::format_duration(limit), p.n_completed, p.n_total);
                        tracing::warn!("{note}");
                        event(ctx, obj, true, "Stalled", note).await;
                        if args.fail_on_stall {
                            ctx.registry.cancel(uid, CancelReason::Stalled);
                        }
                    }
                }
                ctx.metrics.set_throughput(direction, rate_of(&p, op));
            }
        }
    }
    ctx.metrics.set_throughput(direction, 0.0);
    ctx.registry.cancel_reason(uid)
}

fn rate_of(p: &OperationProgress, _op: &Operation) -> f64 {
    // The description carries the rate for people; the metric uses bytes/elapsed since start as
    // a stable figure while the operation runs.
    let secs = p
        .updated
        .duration_since(p.started)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0);
    if secs > 0.0 {
        p.n_completed as f64 / secs
    } else {
        0.0
    }
}

pub fn reason_text(ctx: &Context, uid: &str, reason: CancelReason) -> String {
    match reason {
        CancelReason::OwnerDone => ctx
            .registry
            .cancel_detail(uid)
            .unwrap_or_else(|| "its owner no longer waits for it".to_string()),
        CancelReason::Requested => "canceled on request".to_string(),
        CancelReason::Deleted => "the object is being deleted".to_string(),
        CancelReason::Timeout => format!(
            "operation timed out after {}",
            ctx.args
                .operation_timeout
                .0
                .map(|d| humantime::format_duration(d).to_string())
                .unwrap_or_default()
        ),
        CancelReason::Stalled => format!(
            "no byte progress for {}",
            ctx.args
                .stall_timeout
                .0
                .map(|d| humantime::format_duration(d).to_string())
                .unwrap_or_default()
        ),
        CancelReason::Shutdown => "the agent is shutting down".to_string(),
    }
}

/// Writes the terminal status (one write with every result, our finalizer removed with it),
/// durably: it is saved in the state dir first and retried with backoff while the API server is
/// unreachable. Returns whether the result reached the server.
pub async fn finish<K: VolumeObject>(
    ctx: &Context,
    obj: &K,
    writer: &mut ObjectWriter<K>,
    mut status: Value,
    shutdown: &CancellationToken,
) -> bool {
    let uid = obj.uid().unwrap_or_default();
    if status.get("completionTimestamp").is_none() {
        status["completionTimestamp"] = Value::String(now_rfc3339());
    }
    let stored = StoredResult {
        kind: K::KIND.to_string(),
        namespace: obj.namespace().unwrap_or_default(),
        name: obj.name_any(),
        uid: uid.clone(),
        status: status.clone(),
    };
    if let Err(e) = ctx.state.save(&stored) {
        tracing::warn!(error = %e, "could not save the result in the state dir");
    }
    let mut backoff = Backoff::new();
    loop {
        match writer.write_result(status.clone()).await {
            Ok(_) | Err(WriteError::Gone) => break,
            Err(WriteError::Terminal(phase)) => {
                tracing::warn!(
                    ?phase,
                    "the object already has a result; ours is not written over it"
                );
                // If this fails, the reconcile of the terminal object removes it later.
                remove_finalizer(writer).await;
                break;
            }
            Err(e) if !e.is_transient() => {
                // Refused for good (a 422 the phase adaptation cannot mend, 403, 400): the
                // same write would be refused for ever and keep our finalizer on, so a deletion
                // could never complete. Nothing of ours may keep an object from being deleted.
                tracing::error!(error = %e, "the terminal status write is refused by the API server; the result is not written and our finalizer is removed");
                remove_finalizer(writer).await;
                break;
            }
            Err(e) => {
                tracing::warn!(error = %e, retry_in = ?backoff.next, "terminal status write failed; retrying");
                if !backoff.wait(shutdown).await {
                    return false;
                }
            }
        }
    }
    ctx.state.remove(&uid);
    true
}

/// A result saved in the state dir that no operation here is writing: one the API server never
/// received (it was down, then the agent restarted). A saved result of an operation still
/// running here is the one it is writing now (saved before its terminal write, removed after
/// it), which a reconcile of an older version of the object must not write and count again.
pub fn unwritten_result(ctx: &Context, uid: &str) -> Option<super::state::StoredResult> {
    if ctx.registry.is_active(uid) {
        return None;
    }
    ctx.state.load(uid)
}

/// Removes our finalizer; the writer's conflict handling keeps other finalizers. Returns whether
/// it is gone (a few quick tries; the caller requeues otherwise).
pub async fn remove_finalizer<K: VolumeObject>(writer: &mut ObjectWriter<K>) -> bool {
    for attempt in 0..3 {
        match writer.set_finalizer(Finalizer::Remove).await {
            Ok(_) | Err(WriteError::Gone) => return true,
            Err(e) => {
                tracing::warn!(error = %e, attempt, "could not remove the finalizer");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
    false
}

/// kopia saves a snapshot marked incomplete when it is stopped: not a result, yet pinned in
/// Velero's repository for ever if left. Made by this operation, so removed; what happened, for
/// the object's message.
pub async fn forget_incomplete(
    ctx: &Context,
    outcome: &crate::uploader::Outcome,
    uploader: crate::uploader::UploaderKind,
    access: &crate::uploader::RepositoryAccess,
    location: &super::storage::LocationAccess,
) -> Option<String> {
    let id = outcome.incomplete_snapshot_id.as_ref()?;
    Some(
        match ctx.engine.forget_snapshot(uploader, access, id).await {
            Ok(()) => format!("the incomplete snapshot {id} kopia saved was deleted"),
            Err(e) => format!(
                "deleting the incomplete snapshot {id} kopia saved failed ({})",
                location.redact(&e)
            ),
        },
    )
}

/// Waits for a started operation to end: its outcome and final progress (the location's
/// secrets redacted from the error), recorded in the registry and the metrics.
pub async fn wait_ended(
    ctx: &Context,
    uid: &str,
    op: &Operation,
    location: &super::storage::LocationAccess,
) -> (std::sync::Arc<crate::uploader::Outcome>, OperationProgress) {
    let outcome = op.wait().await;
    let mut progress = op.progress();
    progress.err = location.redact(&progress.err);
    ctx.registry.set_final(uid, progress.clone());
    ctx.metrics.uploader_exit(outcome.kind.class());
    ctx.metrics.truncated(outcome.truncated_frames);
    (outcome, progress)
}

/// The terminal message: why the uploader was stopped when it was stopped for a reason of ours,
/// else what its outcome says.
pub fn terminal_message(
    ctx: &Context,
    uid: &str,
    phase: Phase,
    reason: Option<CancelReason>,
    outcome: &crate::uploader::Outcome,
    location: &super::storage::LocationAccess,
) -> String {
    match (phase, reason) {
        (Phase::Canceled | Phase::Failed, Some(r))
            if outcome.kind == crate::uploader::OutcomeKind::Canceled =>
        {
            format!("{}; the uploader was stopped", reason_text(ctx, uid, r))
        }
        _ => super::outcome_message(ctx, outcome, location),
    }
}

/// The phase an outcome gives the object.
pub fn terminal_phase(
    kind: &crate::uploader::OutcomeKind,
    reason: Option<CancelReason>,
    partial_as_completed: bool,
) -> Phase {
    use crate::uploader::OutcomeKind as O;
    match (kind, reason) {
        (O::Success, _) => Phase::Completed,
        (O::Partial, _) if partial_as_completed => Phase::Completed,
        (_, Some(CancelReason::Timeout | CancelReason::Stalled)) => Phase::Failed,
        (O::Canceled, _) => Phase::Canceled,
        (_, Some(CancelReason::Requested | CancelReason::Deleted | CancelReason::OwnerDone)) => {
            Phase::Canceled
        }
        _ => Phase::Failed,
    }
}

/// The terminal write of a transfer, with its metrics and event.
pub async fn end<K: VolumeObject>(
    ctx: &Context,
    obj: &K,
    w: &mut ObjectWriter<K>,
    status: Value,
    started: Instant,
    bytes: u64,
) {
    let phase = status["phase"].as_str().unwrap_or("").to_string();
    // The metric's result follows from the phase written, so the two cannot disagree.
    let result = metric_result(&status);
    let message = status["message"].as_str().unwrap_or("").to_string();
    ctx.registry
        .set_phase(&obj.uid().unwrap_or_default(), &phase);
    if finish(ctx, obj, w, status, &ctx.shutdown).await {
        ctx.metrics
            .finished(K::OPERATION, result, started.elapsed(), bytes);
        event(ctx, obj, result == "failure", &phase, message).await;
    }
    // This operation's slot is released right after; count it out already.
    ctx.metrics.set_operations(
        ctx.registry.running().saturating_sub(1),
        ctx.registry.queued(),
    );
}

/// What a transfer that got its slot does first (see [`gate`]).
pub enum Gate<K> {
    /// Start it: the object as the API server has it now.
    Start(K),
    /// Write "canceled before it started" for this reason, and stop.
    CancelBeforeStart(K, CancelReason),
    /// Nothing to do: it is already finished, cannot be read, is stopped by the agent's
    /// shutdown (picked up again after the restart), or has just been failed for too many
    /// interrupted starts.
    Stop,
}

/// The checks between getting a slot and starting the uploader, the same for both kinds: the
/// object may have changed while it waited (finished elsewhere, canceled), and an object whose
/// every run was interrupted by an agent restart is failed here instead of started again.
pub async fn gate<K: VolumeObject>(
    ctx: &Context,
    w: &mut ObjectWriter<K>,
    queued: &K,
    token: &CancellationToken,
    started: Instant,
    failed: impl FnOnce(String) -> Value,
) -> Gate<K> {
    let mut backoff = Backoff::new();
    let obj = loop {
        match w.refresh().await {
            Ok(o) if o.phase().is_terminal() => return Gate::Stop,
            Ok(o) => break o,
            Err(e) if e.is_transient() => {
                tracing::warn!(error = %e, retry_in = ?backoff.next, "cannot read the object before starting; retrying");
                if !backoff.wait(token).await {
                    return stopped_while_waiting(ctx, queued);
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the object before starting");
                return Gate::Stop;
            }
        }
    };
    if token.is_cancelled() || obj.cancel_requested() {
        let uid = obj.uid().unwrap_or_default();
        return match ctx
            .registry
            .cancel_reason(&uid)
            .unwrap_or(CancelReason::Requested)
        {
            CancelReason::Shutdown => Gate::Stop,
            reason => Gate::CancelBeforeStart(obj, reason),
        };
    }
    // Never started for an owner that no longer waits (read now, not from the cache).
    if let Some(owner) = Owner::of_transfer(&obj)
        && let Some(why) = ctx.owners.state_now(&owner).await.stop_reason(&owner)
    {
        let uid = obj.uid().unwrap_or_default();
        ctx.registry
            .cancel_because(&uid, CancelReason::OwnerDone, why);
        return Gate::CancelBeforeStart(obj, CancelReason::OwnerDone);
    }
    let starts = obj.attempts();
    if starts >= ctx.args.max_attempts.max(1) {
        let message = format!(
            "the {} was started {starts} times and each run was interrupted by a node agent restart; giving up",
            K::OPERATION
        );
        end(ctx, &obj, w, failed(message), started, 0).await;
        return Gate::Stop;
    }
    Gate::Start(obj)
}

/// Backoff for API requests that must get through (the terminal write, those between a slot
/// and the uploader's start): 0.5 s doubling to 30 s, cut short by a token.
struct Backoff {
    next: Duration,
}

impl Backoff {
    fn new() -> Self {
        Backoff {
            next: Duration::from_millis(500),
        }
    }

    /// Waits the next delay; false when `token` was cancelled meanwhile.
    async fn wait(&mut self, token: &CancellationToken) -> bool {
        let delay = self.next;
        self.next = (self.next * 2).min(Duration::from_secs(30));
        tokio::select! {
            _ = tokio::time::sleep(delay) => true,
            _ = token.cancelled() => false,
        }
    }
}

/// The operation was stopped while an API request waited for its retry: canceled (written as
/// canceled before it started, from the object as it was queued) or the agent stops (left as
/// it is; the next start picks it up).
fn stopped_while_waiting<K: VolumeObject>(ctx: &Context, queued: &K) -> Gate<K> {
    let uid = queued.uid().unwrap_or_default();
    match ctx
        .registry
        .cancel_reason(&uid)
        .unwrap_or(CancelReason::Requested)
    {
        CancelReason::Shutdown => Gate::Stop,
        reason => Gate::CancelBeforeStart(queued.clone(), reason),
    }
}

/// Counts the start (the attempts annotation) and writes InProgress. Both are retried while the
/// API server fails them for a passing reason: given up, the object would stay Accepted with
/// nothing to start it again (the watch has no change to report). `Start(())`: written, run the
/// uploader.
pub async fn mark_in_progress<K: VolumeObject>(
    ctx: &Context,
    w: &mut ObjectWriter<K>,
    obj: &K,
    token: &CancellationToken,
    status: Value,
) -> Gate<()> {
    let meta = json!({ "annotations": { crate::crd::ATTEMPTS_ANNOTATION: (obj.attempts() + 1).to_string() } });
    let mut backoff = Backoff::new();
    // The count first: a start it does not record could be repeated past --max-attempts.
    for (status, meta) in [(None, Some(meta)), (Some(status), None)] {
        loop {
            match w.write(status.clone(), meta.clone()).await {
                Ok(_) => break,
                Err(WriteError::Terminal(_) | WriteError::Gone) => return Gate::Stop,
                Err(e) if e.is_transient() => {
                    tracing::warn!(error = %e, retry_in = ?backoff.next, "cannot mark the {} InProgress; retrying", K::OPERATION);
                }
                Err(e) => {
                    // Refused for good (RBAC, validation): the result cannot be written either.
                    tracing::error!(error = %e, "cannot mark the {} InProgress", K::OPERATION);
                    return Gate::Stop;
                }
            }
            if !backoff.wait(token).await {
                return match stopped_while_waiting(ctx, obj) {
                    Gate::CancelBeforeStart(_, reason) => Gate::CancelBeforeStart((), reason),
                    _ => Gate::Stop,
                };
            }
        }
    }
    Gate::Start(())
}

/// Queues a transfer in the registry; it runs when a slot is free, the object accepted (else
/// created) first.
pub fn submit<K, F, Fut>(
    ctx: &std::sync::Arc<Context>,
    obj: K,
    kind: super::registry::OperationKind,
    run: F,
) where
    K: VolumeObject,
    F: FnOnce(std::sync::Arc<Context>, K, CancellationToken) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let order = obj
        .accepted_timestamp()
        .or(obj.meta().creation_timestamp.as_ref())
        .map(|t| std::time::SystemTime::from(t.0))
        .unwrap_or_else(std::time::SystemTime::now);
    let uid = obj.uid().unwrap_or_default();
    let (ns, name) = (obj.namespace().unwrap_or_default(), obj.name_any());
    let ctx2 = std::sync::Arc::clone(ctx);
    ctx.registry.submit(
        &uid,
        kind,
        &ns,
        &name,
        order,
        Box::new(move |token| Box::pin(run(ctx2, obj, token))),
    );
    ctx.metrics
        .set_operations(ctx.registry.running(), ctx.registry.queued());
}

/// The metric result and bytes of a saved terminal status (reported after a restart).
pub fn saved_outcome(status: &Value) -> (&'static str, u64) {
    (
        metric_result(status),
        status["progress"]["bytesDone"].as_u64().unwrap_or(0),
    )
}

/// The `result` label of the finished-operations metrics for a terminal status.
fn metric_result(status: &Value) -> &'static str {
    match status["phase"].as_str() {
        Some("Completed") => "success",
        Some("Canceled") => "cancel",
        _ => "failure",
    }
}

/// `started` for the latency metric.
pub fn since(start: Instant) -> Duration {
    start.elapsed()
}
