//! DataUploads (CSI snapshot data movement): claim, expose, hand over to the node where the
//! exposed volume is mounted, move the data, clean up.
//!
//! ```text
//! New --(any node: the claim, conflict-safe)--> Accepted, acceptedByNode = A
//!   A: the snapshot exposed (see expose), the hold pod scheduled and Running on node B
//!   A: Prepared, node = B
//!   B: the volume read from its kubelet's mount, as a pod volume is: InProgress ... Completed
//!      with the snapshot in Velero's kopia repository of the source namespace, under the
//!      source Velero's own data mover files it under; everything exposed removed first
//! ```
//!
//! Only DataUploads of Velero's built-in mover (`spec.datamover` "" or "velero") are touched:
//! this agent replaces it; another mover's objects are that mover's.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kube::ResourceExt;
use kube::runtime::controller::Action;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use super::expose;
use super::reconcile::{self, writer};
use super::registry::CancelReason;
use super::status::{Finalizer, VolumeObject, WriteError, now_rfc3339};
use super::transfer::{self, Gate, end, event, monitor, terminal_phase};
use super::{Context, Error};
use crate::crd::Phase;
use crate::datamover::{DataUpload, is_built_in};
use crate::engine::BackupRequest;
use crate::uploader::UploaderKind;
use crate::uploader::restic::BackupOptions;

/// Velero's finalizer on DataUploads and DataDownloads it is moving.
pub const FINALIZER: &str = "velero.io/data-upload-download-finalizer";
/// The label Velero's server puts on a DataUpload; Velero's data mover tags the snapshot with it.
pub const ASYNC_OPERATION_ID_LABEL: &str = "velero.io/async-operation-id";

pub async fn reconcile(du: Arc<DataUpload>, ctx: Arc<Context>) -> Result<Action, Error> {
    use tracing::Instrument;
    let span = tracing::debug_span!("du", namespace = %du.namespace().unwrap_or_default(), name = %du.name_any());
    reconcile_inner(du, ctx).instrument(span).await
}

fn is_us(ctx: &Context, node: Option<&String>) -> bool {
    node.is_some_and(|n| *n == ctx.args.node_name)
}

async fn reconcile_inner(du: Arc<DataUpload>, ctx: Arc<Context>) -> Result<Action, Error> {
    if !is_built_in(&du.spec.data_mover) || ctx.shutdown.is_cancelled() {
        return Ok(Action::await_change());
    }
    let status = du.status.clone().unwrap_or_default();
    let phase = du.phase();
    let uid = du.uid().unwrap_or_default();
    if phase.is_terminal() {
        // Our finalizer is removed by whoever wrote the result; one left by a crash goes here,
        // by the node that had it last.
        let ours = is_us(
            &ctx,
            status.node.as_ref().or(status.accepted_by_node.as_ref()),
        );
        if ours
            && du.finalizers().iter().any(|f| f == FINALIZER)
            && !transfer::remove_finalizer(&mut writer(&ctx, &*du)).await
        {
            return Ok(Action::requeue(Duration::from_secs(10)));
        }
        return Ok(Action::await_change());
    }
    match phase {
        Phase::New => {
            if du.cancel_requested() {
                // Nobody has exposed anything: any node may write it (the write is conflict-safe).
                cancel_unstarted(&ctx, &du, "canceled before it was accepted").await;
                return Ok(Action::await_change());
            }
            if let Some(o) = claim(&ctx, &du).await? {
                start_expose(&ctx, o);
            }
            Ok(Action::await_change())
        }
        Phase::Accepted => {
            let accepted_here = is_us(&ctx, status.accepted_by_node.as_ref());
            if accepted_here {
                if ctx.exposing.cancel_if_running(&uid, du.cancel_requested()) {
                    return Ok(Action::await_change());
                }
                if du.cancel_requested() {
                    cancel_unstarted(&ctx, &du, "canceled while it was being prepared").await;
                    return Ok(Action::await_change());
                }
                // Accepted here before a restart: the exposure is picked up where it stopped.
                start_expose(&ctx, (*du).clone());
                return Ok(Action::await_change());
            }
            // Another node's. If that node's agent is gone, its prepare timeout is enforced
            // here, a minute later than there.
            let limit = ctx.args.data_mover_prepare_timeout + Duration::from_secs(60);
            match prepare_age(&du) {
                Some(age) if age >= limit => {
                    let message = format!(
                        "not prepared within {} by the node agent on {} (which accepted it)",
                        humantime::format_duration(ctx.args.data_mover_prepare_timeout),
                        status.accepted_by_node.as_deref().unwrap_or("?")
                    );
                    fail_unstarted(&ctx, &du, message).await;
                    Ok(Action::await_change())
                }
                Some(age) => Ok(Action::requeue(limit - age + Duration::from_secs(1))),
                None => Ok(Action::requeue(limit)),
            }
        }
        // Prepared, InProgress, Canceling: the node whose kubelet mounts the volume runs it.
        _ => {
            if !is_us(&ctx, status.node.as_ref()) {
                return Ok(Action::await_change());
            }
            reconcile::saved_cancel_claim_submit(du, ctx, run).await
        }
    }
}

fn prepare_age(du: &DataUpload) -> Option<Duration> {
    let at = du.accepted_timestamp()?;
    std::time::SystemTime::now()
        .duration_since(std::time::SystemTime::from(at.0))
        .ok()
}

/// New -> Accepted by this node, only if nobody changed the object since it was seen.
async fn claim(ctx: &Context, du: &DataUpload) -> Result<Option<DataUpload>, Error> {
    let mut w = writer(ctx, du);
    match w.set_finalizer(Finalizer::Add).await {
        Ok(_) => {}
        Err(WriteError::Gone) => return Ok(None),
        // Another node claimed it first (the conflict re-read shows it is no longer New).
        Err(WriteError::Api(kube::Error::Api(s))) if s.code == 409 => return Ok(None),
        Err(e) => return Err(Error::Write(e)),
    }
    let fresh = match w.refresh().await {
        Ok(o) => o,
        Err(WriteError::Gone) => return Ok(None),
        Err(e) => return Err(Error::Write(e)),
    };
    if fresh.phase() != Phase::New {
        return Ok(None);
    }
    let status = json!({
        "phase": Phase::Accepted.as_str(),
        "acceptedByNode": ctx.args.node_name,
        "acceptedTimestamp": now_rfc3339(),
        "message": "accepted: exposing the snapshot",
    });
    match w.write(Some(status), None).await {
        Ok(o) => {
            event(
                ctx,
                &o,
                false,
                "Accepted",
                format!("accepted by the node agent on {}", ctx.args.node_name),
            )
            .await;
            Ok(Some(o))
        }
        Err(WriteError::Gone | WriteError::Terminal(_)) => Ok(None),
        Err(WriteError::Api(kube::Error::Api(s))) if s.code == 409 => Ok(None),
        Err(e) => Err(Error::Write(e)),
    }
}

/// Exposes the snapshot in the background (the reconcile returns at once), then waits for the
/// hold pod to run and hands the DataUpload to its node. One task per DataUpload.
fn start_expose(ctx: &Arc<Context>, du: DataUpload) {
    let uid = du.uid().unwrap_or_default();
    let Some(token) = ctx.exposing.start(&uid) else {
        return;
    };
    let ctx = Arc::clone(ctx);
    tokio::spawn(async move {
        use tracing::Instrument;
        let span = tracing::info_span!("expose", namespace = %du.namespace().unwrap_or_default(), name = %du.name_any(), uid = %uid);
        prepare(&ctx, &du, &token).instrument(span).await;
        ctx.exposing.finish(&uid);
    });
}

async fn prepare(ctx: &Context, du: &DataUpload, token: &CancellationToken) {
    let timeout = ctx.args.data_mover_prepare_timeout;
    let deadline = tokio::time::Instant::now()
        + prepare_age(du)
            .map(|age| timeout.saturating_sub(age))
            .unwrap_or(timeout);
    let settings = match super::datamover_config::expose_settings(ctx, du).await {
        Ok(s) => s,
        Err(message) => return fail_unstarted(ctx, du, message).await,
    };
    let exposed = tokio::select! {
        r = expose::expose(&ctx.client, du, &settings, timeout) => r,
        _ = token.cancelled() => Err(String::new()),
        _ = ctx.shutdown.cancelled() => return,
    };
    if let Err(message) = exposed {
        if token.is_cancelled() {
            return cancel_unstarted(ctx, du, "canceled while it was being prepared").await;
        }
        return fail_unstarted(ctx, du, format!("cannot expose the snapshot: {message}")).await;
    }
    tracing::info!("snapshot exposed; waiting for the hold pod to run");
    loop {
        match expose::hold_pod(&ctx.client, du).await {
            Ok(Some(pod)) => {
                if let Some(why) = expose::unrecoverable(&pod) {
                    return fail_unstarted(ctx, du, why).await;
                }
                let node = pod.spec.as_ref().and_then(|s| s.node_name.clone());
                let running =
                    pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
                if let (true, Some(node)) = (running, node) {
                    let mut w = writer(ctx, du);
                    let status = json!({
                        "phase": Phase::Prepared.as_str(),
                        "node": node,
                        "message": format!("prepared: the volume is mounted on {node}"),
                    });
                    match w.write(Some(status), None).await {
                        Ok(_) | Err(WriteError::Gone | WriteError::Terminal(_)) => {}
                        Err(e) => {
                            tracing::warn!(error = %e, "cannot mark the DataUpload Prepared; retrying");
                            tokio::time::sleep(Duration::from_secs(2)).await;
                            continue;
                        }
                    }
                    return;
                }
            }
            Ok(None) => {
                return fail_unstarted(ctx, du, "the pod holding the snapshot was deleted".into())
                    .await;
            }
            Err(e) => tracing::warn!(error = %e, "cannot read the hold pod; retrying"),
        }
        if tokio::time::Instant::now() >= deadline {
            let message = format!(
                "the exposed snapshot was not mounted by any node within {} (--data-mover-prepare-timeout); {}",
                humantime::format_duration(timeout),
                super::datamover_config::why_not_running(ctx, du).await
            );
            return fail_unstarted(ctx, du, message).await;
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            _ = token.cancelled() => {
                return cancel_unstarted(ctx, du, "canceled while it was being prepared").await;
            }
            _ = ctx.shutdown.cancelled() => return,
        }
    }
}

/// Ends a DataUpload that moved nothing: what was exposed removed, then the result.
async fn end_unstarted(ctx: &Context, du: &DataUpload, status: Value) {
    expose::clean_up(&ctx.client, du).await;
    let mut w = writer(ctx, du);
    end(ctx, du, &mut w, status, Instant::now(), 0).await;
}

async fn cancel_unstarted(ctx: &Context, du: &DataUpload, message: &str) {
    let status = json!({"phase": Phase::Canceled.as_str(), "message": message});
    end_unstarted(ctx, du, status).await;
}

async fn fail_unstarted(ctx: &Context, du: &DataUpload, message: String) {
    tracing::warn!("{message}");
    end_unstarted(ctx, du, failed(message)).await;
}

fn failed(message: String) -> Value {
    json!({ "phase": Phase::Failed.as_str(), "message": message })
}

/// The data movement, from its slot to its terminal write, on the node of the hold pod.
async fn run(ctx: Arc<Context>, du: DataUpload, token: CancellationToken) {
    let uid = du.uid().unwrap_or_default();
    use tracing::Instrument;
    let span = tracing::info_span!("data_upload", namespace = %du.namespace().unwrap_or_default(), name = %du.name_any(), uid = %uid, node = %ctx.args.node_name);
    async {
        let started = Instant::now();
        let not_started = |reason| {
            format!(
                "{} before the data movement started",
                transfer::reason_text(&ctx, &uid, reason)
            )
        };
        let mut w = writer(&ctx, &du);
        let du = match transfer::gate(&ctx, &mut w, &du, &token, started, failed).await {
            Gate::Start(d) => d,
            Gate::CancelBeforeStart(d, reason) => {
                return cancel_unstarted(&ctx, &d, &not_started(reason)).await;
            }
            Gate::Stop => return,
        };
        let prepared = match prepare_transfer(&ctx, &du).await {
            Ok(p) => p,
            Err(message) => return fail_unstarted(&ctx, &du, message).await,
        };
        let path = prepared.request.source.display().to_string();
        let status = json!({
            "phase": Phase::InProgress.as_str(),
            "startTimestamp": now_rfc3339(),
            "nodeOS": "linux",
            "message": "starting",
        });
        match transfer::mark_in_progress(&ctx, &mut w, &du, &token, status).await {
            Gate::Start(()) => {}
            Gate::CancelBeforeStart((), reason) => {
                return cancel_unstarted(&ctx, &du, &not_started(reason)).await;
            }
            Gate::Stop => return,
        }
        ctx.registry.set_phase(&uid, Phase::InProgress.as_str());
        event(
            &ctx,
            &du,
            false,
            "Started",
            format!("moving the data of {path} with kopia"),
        )
        .await;
        let (uploader, access) = (prepared.request.uploader, prepared.request.access.clone());
        let op = ctx.engine.backup(prepared.request);
        ctx.registry.attach(&uid, op.clone());
        let reason = monitor(&ctx, &du, &mut w, &uid, &op, &token).await;
        let outcome = op.wait().await;
        let mut progress = op.progress();
        progress.err = prepared.location.redact(&progress.err);
        ctx.registry.set_final(&uid, progress.clone());
        ctx.metrics.uploader_exit(outcome.kind.class());
        ctx.metrics.truncated(outcome.truncated_frames);
        let incomplete =
            transfer::forget_incomplete(&ctx, &outcome, uploader, &access, &prepared.location)
                .await;
        if reason == Some(CancelReason::Shutdown) {
            // The next start runs it again on the same exposure.
            tracing::info!("left for the next agent start to run again");
            return;
        }
        // Velero's data mover fails on any unreadable entry (FailFast); a snapshot with holes
        // is not a DataUpload result Velero would restore from.
        let phase = terminal_phase(&outcome.kind, reason, false);
        let message = match (phase, reason) {
            (Phase::Canceled | Phase::Failed, Some(r))
                if outcome.kind == crate::uploader::OutcomeKind::Canceled =>
            {
                format!(
                    "{}; the uploader was stopped",
                    transfer::reason_text(&ctx, &uid, r)
                )
            }
            _ => super::outcome_message(&ctx, &outcome, &prepared.location),
        };
        let message = match incomplete {
            Some(what) => format!("{message}; {what}"),
            None => message,
        };
        drop(prepared.location);
        expose::clean_up(&ctx.client, &du).await;
        let mut status = transfer::progress_status(&progress);
        status["phase"] = Value::String(phase.as_str().to_string());
        status["message"] = Value::String(message);
        status["path"] = Value::String(path);
        if phase == Phase::Completed {
            status["snapshotID"] = Value::String(outcome.snapshot_id.clone().unwrap_or_default());
            if let Some(n) = outcome.summary.as_ref().and_then(|s| s.incremental_bytes) {
                status["incrementalBytes"] = json!(i64::try_from(n).unwrap_or(i64::MAX));
            }
        }
        end(&ctx, &du, &mut w, status, started, progress.n_completed).await;
    }
    .instrument(span)
    .await
}

struct Prepared {
    request: BackupRequest,
    location: super::storage::LocationAccess,
}

async fn prepare_transfer(ctx: &Context, du: &DataUpload) -> Result<Prepared, String> {
    let pod = crate::crd::PodReference {
        namespace: du.namespace(),
        name: Some(du.name_any()),
        ..Default::default()
    };
    let source = super::pod_volume_path(ctx, &pod, expose::HOLD_VOLUME, "hold pod").await?;
    let (access, location) = super::repository_access(
        ctx,
        "",
        UploaderKind::Kopia,
        &du.spec.backup_storage_location,
        &du.uid().unwrap_or_default(),
        &du.spec.source_namespace,
        // Velero's data mover waits for it as long as its --resource-timeout (10 minutes).
        Some(Duration::from_secs(600)),
    )
    .await?;
    use super::kopia_repository as velero;
    let tags = du
        .labels()
        .get(ASYNC_OPERATION_ID_LABEL)
        .map(|id| vec![(ASYNC_OPERATION_ID_LABEL.to_string(), id.clone())])
        .unwrap_or_default();
    let parallel = du
        .spec
        .data_mover_config
        .as_ref()
        .and_then(|c| c.get("ParallelFilesUpload"))
        .and_then(|v| v.parse().ok())
        .filter(|n| *n > 0);
    Ok(Prepared {
        request: BackupRequest {
            uploader: UploaderKind::Kopia,
            access,
            source,
            options: BackupOptions {
                host: "velero".to_string(),
                tags,
                parent: None,
                limit_upload_kib: None,
                retry_lock: None,
                verbose: false,
                kopia: crate::uploader::kopia::SnapshotOptions {
                    source: Some(velero::data_mover_source(
                        &du.spec.source_namespace,
                        &du.spec.source_pvc,
                    )),
                    description: Some(velero::DESCRIPTION.to_string()),
                    pins: vec![velero::PIN.to_string()],
                    parallel,
                    fail_fast: false,
                    keep_all_policy: true,
                },
            },
        },
        location,
    })
}

/// The exposures running on this node (one task per DataUpload it accepted), with a token
/// each so a cancel reaches them.
#[derive(Default)]
pub struct Exposing {
    tasks: std::sync::Mutex<std::collections::HashMap<String, CancellationToken>>,
}

impl Exposing {
    /// A token for a new task, or None when one runs already for `uid`.
    fn start(&self, uid: &str) -> Option<CancellationToken> {
        let mut tasks = self.tasks.lock().expect("exposing");
        if tasks.contains_key(uid) {
            return None;
        }
        let token = CancellationToken::new();
        tasks.insert(uid.to_string(), token.clone());
        Some(token)
    }

    fn finish(&self, uid: &str) {
        self.tasks.lock().expect("exposing").remove(uid);
    }

    /// Whether a task runs for `uid`; when the object asks for a cancel it is told so.
    fn cancel_if_running(&self, uid: &str, cancel: bool) -> bool {
        let tasks = self.tasks.lock().expect("exposing");
        match tasks.get(uid) {
            Some(t) => {
                if cancel {
                    t.cancel();
                }
                true
            }
            None => false,
        }
    }
}
