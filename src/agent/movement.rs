//! The part of CSI snapshot data movement that DataUploads and DataDownloads share: the claim by
//! any node, the exposure (made in the background by the node that claimed it), the hand-over to
//! the node where the exposed volume is mounted, and the ends of a movement that moved nothing.
//!
//! ```text
//! New --(any node: the claim, conflict-safe)--> Accepted, acceptedByNode = A
//!   A: the volume exposed (DataUpload: the snapshot; DataDownload: a new volume for the target
//!      claim), a hold pod scheduled and Running on node B
//!   A: Prepared, node = B
//!   B: the kind's own transfer, as a pod volume's (Velero's phases, progress, cancel)
//! ```
//!
//! Only objects of Velero's built-in mover (`spec.datamover` "" or "velero") are touched: this
//! agent replaces it; another mover's objects are that mover's.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kube::ResourceExt;
use kube::runtime::controller::Action;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use super::expose::{self, ExposeSettings};
use super::reconcile::{self, Reconciled, writer};
use super::status::{Finalizer, VolumeObject, WriteError, now_rfc3339};
use super::transfer::{self, end, event};
use super::{Context, Error};
use crate::crd::Phase;

/// Velero's finalizer on DataUploads and DataDownloads it is moving.
pub const FINALIZER: &str = "velero.io/data-upload-download-finalizer";

/// What a DataUpload and a DataDownload do differently.
pub trait Movement: Reconciled {
    /// What is exposed, for messages ("the snapshot", "the restore volume").
    const EXPOSED: &'static str;
    fn data_mover(&self) -> &str;
    fn accepted_by_node(&self) -> Option<&String>;
    /// The node whose kubelet mounts the exposed volume (set with Prepared).
    fn node(&self) -> Option<&String>;
    /// Makes the exposure (idempotent: an earlier attempt's objects are taken over). Errors are
    /// messages for the object.
    fn expose(
        ctx: &Context,
        obj: &Self,
        settings: &ExposeSettings,
        within: Duration,
    ) -> impl Future<Output = Result<(), String>> + Send;
    /// Removes everything the exposure made, best effort.
    fn clean_up(ctx: &Context, obj: &Self) -> impl Future<Output = ()> + Send;
    /// The transfer on the node of the hold pod, from its slot to its terminal write.
    fn run(
        ctx: Arc<Context>,
        obj: Self,
        token: CancellationToken,
    ) -> impl Future<Output = ()> + Send + 'static;
}

fn is_us(ctx: &Context, node: Option<&String>) -> bool {
    node.is_some_and(|n| *n == ctx.args.node_name)
}

pub async fn reconcile<K: Movement>(obj: Arc<K>, ctx: Arc<Context>) -> Result<Action, Error> {
    if !crate::datamover::is_built_in(obj.data_mover()) || ctx.shutdown.is_cancelled() {
        return Ok(Action::await_change());
    }
    let phase = obj.phase();
    let uid = obj.uid().unwrap_or_default();
    if phase.is_terminal() {
        // Our finalizer is removed by whoever wrote the result; one left by a crash goes here,
        // by the node that had it last.
        let ours = is_us(&ctx, obj.node().or(obj.accepted_by_node()));
        if ours
            && obj.finalizers().iter().any(|f| f == FINALIZER)
            && !transfer::remove_finalizer(&mut writer(&ctx, &*obj)).await
        {
            return Ok(Action::requeue(Duration::from_secs(10)));
        }
        return Ok(Action::await_change());
    }
    match phase {
        Phase::New => {
            if obj.cancel_requested() {
                // Nobody has exposed anything: any node may write it (the write is conflict-safe).
                cancel_unstarted(&ctx, &*obj, "canceled before it was accepted").await;
                return Ok(Action::await_change());
            }
            let limit = ctx.node_agent_config.prepare_queue_length();
            if limit > 0 && exposures_in_flight(&ctx) >= limit {
                // The ConfigMap's prepareQueueLength: no more exposures at once, cluster-wide.
                tracing::debug!(limit, "prepare queue full; claimed later");
                return Ok(Action::requeue(Duration::from_secs(5)));
            }
            if let Some(o) = claim(&ctx, &*obj).await? {
                start_expose(&ctx, o);
            }
            Ok(Action::await_change())
        }
        Phase::Accepted => {
            if is_us(&ctx, obj.accepted_by_node()) {
                if ctx.exposing.cancel_if_running(&uid, obj.cancel_requested()) {
                    return Ok(Action::await_change());
                }
                if obj.cancel_requested() {
                    cancel_unstarted(&ctx, &*obj, "canceled while it was being prepared").await;
                    return Ok(Action::await_change());
                }
                // Accepted here before a restart: the exposure is picked up where it stopped.
                start_expose(&ctx, (*obj).clone());
                return Ok(Action::await_change());
            }
            // Another node's. If that node's agent is gone, its prepare timeout is enforced
            // here, a minute later than there.
            let limit = ctx.args.data_mover_prepare_timeout + Duration::from_secs(60);
            match prepare_age(&*obj) {
                Some(age) if age >= limit => {
                    let message = format!(
                        "not prepared within {} by the node agent on {} (which accepted it)",
                        humantime::format_duration(ctx.args.data_mover_prepare_timeout),
                        obj.accepted_by_node().map_or("?", |s| s.as_str())
                    );
                    fail_unstarted(&ctx, &*obj, message).await;
                    Ok(Action::await_change())
                }
                Some(age) => Ok(Action::requeue(limit - age + Duration::from_secs(1))),
                None => Ok(Action::requeue(limit)),
            }
        }
        // Prepared, InProgress, Canceling: the node whose kubelet mounts the volume runs it.
        _ => {
            if !is_us(&ctx, obj.node()) {
                // Another node's. If that node is lost, nobody would ever end it (its hold pod
                // and claim would stay too): any agent ends it, with the cause.
                let Some(node) = obj.node() else {
                    return Ok(Action::await_change());
                };
                let lost = match ctx.nodes.lost(&ctx.client, node).await {
                    Some(why) => why,
                    None => return Ok(Action::requeue(super::node_health::CHECK_EVERY)),
                };
                if obj.cancel_requested() {
                    let message = format!("canceled; {lost}, which was moving the data");
                    cancel_unstarted(&ctx, &*obj, &message).await;
                } else {
                    let message =
                        format!("{lost}, which was moving the data: it cannot be finished there");
                    fail_unstarted(&ctx, &*obj, message).await;
                }
                return Ok(Action::await_change());
            }
            reconcile::saved_cancel_claim_submit(obj, ctx, K::run).await
        }
    }
}

/// DataUploads and DataDownloads of the built-in mover being exposed (Accepted or Prepared),
/// cluster-wide, as the watches' caches see them.
fn exposures_in_flight(ctx: &Context) -> usize {
    let Some((dus, dds)) = &ctx.data_movements else {
        return 0;
    };
    let exposing = |p: Phase| matches!(p, Phase::Accepted | Phase::Prepared);
    dus.state()
        .iter()
        .filter(|o| crate::datamover::is_built_in(o.data_mover()) && exposing(o.phase()))
        .count()
        + dds
            .state()
            .iter()
            .filter(|o| crate::datamover::is_built_in(o.data_mover()) && exposing(o.phase()))
            .count()
}

fn prepare_age<K: Movement>(obj: &K) -> Option<Duration> {
    let at = obj.accepted_timestamp()?;
    std::time::SystemTime::now()
        .duration_since(std::time::SystemTime::from(at.0))
        .ok()
}

/// New -> Accepted by this node, only if nobody changed the object since it was seen.
async fn claim<K: Movement>(ctx: &Context, obj: &K) -> Result<Option<K>, Error> {
    let mut w = writer(ctx, obj);
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
        "message": format!("accepted: exposing {}", K::EXPOSED),
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

/// Exposes in the background (the reconcile returns at once), then waits for the hold pod to
/// run and hands the object to its node. One task per object.
fn start_expose<K: Movement>(ctx: &Arc<Context>, obj: K) {
    let uid = obj.uid().unwrap_or_default();
    let Some(token) = ctx.exposing.start(&uid) else {
        return;
    };
    let ctx = Arc::clone(ctx);
    tokio::spawn(async move {
        use tracing::Instrument;
        let span = tracing::info_span!("expose", kind = K::KIND, namespace = %obj.namespace().unwrap_or_default(), name = %obj.name_any(), uid = %uid);
        prepare(&ctx, &obj, &token).instrument(span).await;
        ctx.exposing.finish(&uid);
    });
}

async fn prepare<K: Movement>(ctx: &Context, obj: &K, token: &CancellationToken) {
    let timeout = ctx.args.data_mover_prepare_timeout;
    let deadline = tokio::time::Instant::now()
        + prepare_age(obj)
            .map(|age| timeout.saturating_sub(age))
            .unwrap_or(timeout);
    let settings = match super::datamover_config::expose_settings(ctx).await {
        Ok(s) => s,
        Err(message) => return fail_unstarted(ctx, obj, message).await,
    };
    let exposed = tokio::select! {
        r = K::expose(ctx, obj, &settings, timeout) => r,
        _ = token.cancelled() => Err(String::new()),
        _ = ctx.shutdown.cancelled() => return,
    };
    if let Err(message) = exposed {
        if token.is_cancelled() {
            return cancel_unstarted(ctx, obj, "canceled while it was being prepared").await;
        }
        return fail_unstarted(ctx, obj, format!("cannot expose {}: {message}", K::EXPOSED)).await;
    }
    tracing::info!("{} exposed; waiting for the hold pod to run", K::EXPOSED);
    loop {
        match expose::hold_pod(&ctx.client, obj).await {
            Ok(Some(pod)) => {
                if let Some(why) = expose::unrecoverable(&pod) {
                    return fail_unstarted(ctx, obj, why).await;
                }
                let node = pod.spec.as_ref().and_then(|s| s.node_name.clone());
                let running =
                    pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
                if let (true, Some(node)) = (running, node) {
                    let mut w = writer(ctx, obj);
                    let status = json!({
                        "phase": Phase::Prepared.as_str(),
                        "node": node,
                        "message": format!("prepared: the volume is mounted on {node}"),
                    });
                    match w.write(Some(status), None).await {
                        Ok(_) | Err(WriteError::Gone | WriteError::Terminal(_)) => {}
                        Err(e) => {
                            tracing::warn!(error = %e, "cannot mark it Prepared; retrying");
                            tokio::time::sleep(Duration::from_secs(2)).await;
                            continue;
                        }
                    }
                    return;
                }
            }
            Ok(None) => {
                return fail_unstarted(ctx, obj, "the hold pod was deleted".into()).await;
            }
            Err(e) => tracing::warn!(error = %e, "cannot read the hold pod; retrying"),
        }
        if tokio::time::Instant::now() >= deadline {
            let message = format!(
                "{} was not mounted by any node within {} (--data-mover-prepare-timeout); {}",
                K::EXPOSED,
                humantime::format_duration(timeout),
                super::datamover_config::why_not_running(ctx, obj).await
            );
            return fail_unstarted(ctx, obj, message).await;
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            _ = token.cancelled() => {
                return cancel_unstarted(ctx, obj, "canceled while it was being prepared").await;
            }
            _ = ctx.shutdown.cancelled() => return,
        }
    }
}

/// Ends an object that moved nothing: what was exposed removed, then the result.
async fn end_unstarted<K: Movement>(ctx: &Context, obj: &K, status: Value) {
    K::clean_up(ctx, obj).await;
    let mut w = writer(ctx, obj);
    end(ctx, obj, &mut w, status, Instant::now(), 0).await;
}

pub async fn cancel_unstarted<K: Movement>(ctx: &Context, obj: &K, message: &str) {
    let status = json!({"phase": Phase::Canceled.as_str(), "message": message});
    end_unstarted(ctx, obj, status).await;
}

pub async fn fail_unstarted<K: Movement>(ctx: &Context, obj: &K, message: String) {
    tracing::warn!("{message}");
    end_unstarted(ctx, obj, failed(message)).await;
}

pub fn failed(message: String) -> Value {
    json!({ "phase": Phase::Failed.as_str(), "message": message })
}

/// The exposures running on this node (one task per object it accepted), with a token each so
/// a cancel reaches them.
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_exposure_task_per_object_and_a_cancel_reaches_it() {
        let e = Exposing::default();
        let t = e.start("u1").expect("first");
        assert!(e.start("u1").is_none(), "a second task for the same object");
        assert!(e.start("u2").is_some());
        assert!(e.cancel_if_running("u1", false));
        assert!(!t.is_cancelled());
        assert!(e.cancel_if_running("u1", true));
        assert!(t.is_cancelled());
        e.finish("u1");
        assert!(!e.cancel_if_running("u1", true));
        assert!(e.start("u1").is_some(), "a new task once the first ended");
    }
}
