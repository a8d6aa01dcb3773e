//! The part of a reconcile that backups and restores share once the object is known to be this
//! node's and not finished: a result saved during an outage, cancel before or while it runs, the
//! claim (New -> Accepted) and the queueing. Each kind's module decides before that whether the
//! object is its own (a PVB by `spec.node`, a PVR by where its pod runs) and runs the transfer.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::NamespaceResourceScope;
use kube::runtime::controller::Action;
use kube::{Api, Resource, ResourceExt};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use super::phases::KindPhases;
use super::registry::{CancelReason, CancelResult, OperationKind};
use super::status::{Finalizer, ObjectWriter, VolumeObject, WriteError, now_rfc3339};
use super::transfer::{self, event, finish, saved_outcome};
use super::{Context, Error};
use crate::crd::{Phase, PodVolumeBackup, PodVolumeRestore};

/// What a backup and a restore do differently in the shared part.
pub trait Reconciled: VolumeObject + Resource<Scope = NamespaceResourceScope> {
    const OPERATION_KIND: OperationKind;
    /// Whether the API server serves this kind's status subresource (found at start).
    fn status_subresource(ctx: &Context) -> bool;
    /// The phases this kind's CRD allows (see [`super::phases`]).
    fn phases(ctx: &Context) -> &Arc<KindPhases>;
    /// A PVR names the node that took it in its status (Velero's agent does; its spec has no
    /// node), a PVB has it in its spec already.
    const NODE_IN_STATUS: bool;
    /// Counted when the object is claimed (Velero counts backups enqueued, not restores).
    fn claimed(_ctx: &Context) {}
}

impl Reconciled for PodVolumeBackup {
    const OPERATION_KIND: OperationKind = OperationKind::Backup;
    const NODE_IN_STATUS: bool = false;
    fn status_subresource(ctx: &Context) -> bool {
        ctx.pvb_status_subresource
    }
    fn phases(ctx: &Context) -> &Arc<KindPhases> {
        &ctx.pvb_phases
    }
    fn claimed(ctx: &Context) {
        ctx.metrics.backup_enqueued();
    }
}

impl Reconciled for PodVolumeRestore {
    const OPERATION_KIND: OperationKind = OperationKind::Restore;
    const NODE_IN_STATUS: bool = true;
    fn status_subresource(ctx: &Context) -> bool {
        ctx.pvr_status_subresource
    }
    fn phases(ctx: &Context) -> &Arc<KindPhases> {
        &ctx.pvr_phases
    }
}

impl Reconciled for crate::datamover::DataUpload {
    const OPERATION_KIND: OperationKind = OperationKind::DataUpload;
    /// Its node (`status.node`) is written when it is Prepared, before it is queued.
    const NODE_IN_STATUS: bool = false;
    fn status_subresource(_ctx: &Context) -> bool {
        // Velero's CRD has none (`subresources: {}`).
        false
    }
    fn phases(ctx: &Context) -> &Arc<KindPhases> {
        &ctx.du_phases
    }
}

impl Reconciled for crate::datamover::DataDownload {
    const OPERATION_KIND: OperationKind = OperationKind::DataDownload;
    /// Its node (`status.node`) is written when it is Prepared, before it is queued.
    const NODE_IN_STATUS: bool = false;
    fn status_subresource(_ctx: &Context) -> bool {
        false
    }
    fn phases(ctx: &Context) -> &Arc<KindPhases> {
        &ctx.dd_phases
    }
}

/// The writer of one object's status and finalizer.
pub fn writer<K: Reconciled>(ctx: &Context, obj: &K) -> ObjectWriter<K> {
    let api: Api<K> = Api::namespaced(ctx.client.clone(), &obj.namespace().unwrap_or_default());
    ObjectWriter::new(
        api,
        obj,
        K::status_subresource(ctx),
        K::phases(ctx).clone(),
        ctx.metrics.clone(),
        ctx.recorder.clone(),
    )
}

/// A status patch before the transfer: the phase and message, and the node where the kind
/// carries it in its status.
fn status_with_node<K: Reconciled>(ctx: &Context, mut status: Value) -> Value {
    if K::NODE_IN_STATUS {
        status["node"] = Value::String(ctx.args.node_name.clone());
    }
    status
}

/// From a saved result to the queue; see the module comment. `run` is the transfer, started
/// when the registry gives it a slot.
pub async fn saved_cancel_claim_submit<K, F, Fut>(
    obj: Arc<K>,
    ctx: Arc<Context>,
    run: F,
) -> Result<Action, Error>
where
    K: Reconciled,
    F: FnOnce(Arc<Context>, K, CancellationToken) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let uid = obj.uid().unwrap_or_default();
    if let Some(saved) = transfer::unwritten_result(&ctx, &uid) {
        // A result the API server never received (it was down, then we restarted).
        tracing::info!("writing a saved result");
        let mut w = writer(&ctx, &*obj);
        let (phase, bytes) = saved_outcome(&saved.status);
        return if finish(&ctx, &*obj, &mut w, saved.status, &ctx.shutdown).await {
            ctx.metrics
                .finished(K::OPERATION, phase, Duration::ZERO, bytes);
            Ok(Action::await_change())
        } else {
            Ok(Action::requeue(Duration::from_secs(5)))
        };
    }
    let cancel = obj.cancel_requested();
    let reason = if obj.meta().deletion_timestamp.is_some() {
        CancelReason::Deleted
    } else {
        CancelReason::Requested
    };
    if ctx.registry.is_active(&uid) {
        if cancel && ctx.registry.cancel(&uid, reason) == CancelResult::WasQueued {
            cancel_before_start(&ctx, &*obj, reason).await;
        }
        return Ok(Action::await_change());
    }
    if cancel {
        cancel_before_start(&ctx, &*obj, reason).await;
        return Ok(Action::await_change());
    }
    let obj = match obj.phase() {
        Phase::New => match claim(&ctx, &*obj).await? {
            Some(o) => o,
            None => return Ok(Action::await_change()),
        },
        _ => (*obj).clone(),
    };
    transfer::submit(&ctx, obj, K::OPERATION_KIND, run);
    Ok(Action::await_change())
}

/// New -> Accepted, only if nobody changed the object since we saw it. `None`: it is gone or
/// someone else finished it.
async fn claim<K: Reconciled>(ctx: &Context, obj: &K) -> Result<Option<K>, Error> {
    let mut w = writer(ctx, obj);
    // Finalizer first (main object), then status: a crash in between leaves an object we still
    // pick up (New with our finalizer), never an Accepted one a deletion would not cancel.
    match w.set_finalizer(Finalizer::Add).await {
        Ok(_) => {}
        Err(WriteError::Gone) => return Ok(None),
        Err(e) => return Err(Error::Write(e)),
    }
    let status = status_with_node::<K>(
        ctx,
        json!({
            "phase": Phase::Accepted.as_str(),
            "acceptedTimestamp": now_rfc3339(),
            "message": "accepted by node agent, waiting for a slot",
        }),
    );
    match w.write(Some(status), None).await {
        Ok(o) => {
            K::claimed(ctx);
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
        Err(e) => Err(Error::Write(e)),
    }
}

/// Cancel before the transfer started: straight to Canceled.
pub async fn cancel_before_start<K: Reconciled>(ctx: &Context, obj: &K, reason: CancelReason) {
    let mut w = writer(ctx, obj);
    let status = status_with_node::<K>(
        ctx,
        json!({
            "phase": Phase::Canceled.as_str(),
            "message": format!("{} before the {} started", transfer::reason_text(ctx, &obj.uid().unwrap_or_default(), reason), K::OPERATION),
        }),
    );
    if finish(ctx, obj, &mut w, status, &ctx.shutdown).await {
        ctx.metrics
            .finished(K::OPERATION, "cancel", Duration::ZERO, 0);
        event(
            ctx,
            obj,
            false,
            "Canceled",
            format!("canceled before the {} started", K::OPERATION),
        )
        .await;
    }
}
