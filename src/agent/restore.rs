//! PodVolumeRestores: selected when the target pod runs on this node; restored into its volume,
//! then the done-file Velero's restore-helper init container waits for.

use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::runtime::controller::Action;
use kube::{Api, ResourceExt};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use super::reconcile::{self, writer};
use super::registry::CancelReason;
use super::status::{VolumeObject, now_rfc3339};
use super::transfer::{self, Gate, end, event, monitor, terminal_phase};
use super::{Context, Error, volume};
use crate::crd::{Phase, PodVolumeRestore};
use crate::engine::RestoreRequest;

pub const RESTORE_UID_LABEL: &str = "velero.io/restore-uid";

/// Names Velero gives the init container it adds (first) to every pod it restores volumes into
/// (`restic-wait` before Velero 1.10). It waits for the done-file; once it runs, the pod's volumes
/// are mounted and the restore can start, as Velero's own agent waits for.
pub const RESTORE_HELPER_NAMES: [&str; 2] = ["restore-wait", "restic-wait"];

/// Where a restore's target pod stands for this node.
#[derive(Debug, PartialEq, Eq)]
pub enum TargetPod {
    /// Scheduled on another node: never ours, and that does not change.
    Elsewhere,
    /// Not ready for a restore yet; the reason is for the log.
    NotYet(&'static str),
    /// No such pod (yet): looked for again, less often.
    Missing,
    /// On this node with its volumes mounted.
    Ready,
}

/// Whether a restore into `pod` can start on `node`. A pod without Velero's restore helper (not
/// restored by Velero) is ready once it is scheduled here.
pub fn readiness(pod: &Pod, node: &str) -> TargetPod {
    let spec = pod.spec.as_ref();
    match spec.and_then(|s| s.node_name.as_deref()) {
        None | Some("") => return TargetPod::NotYet("the pod is not scheduled yet"),
        Some(n) if n != node => return TargetPod::Elsewhere,
        Some(_) => {}
    }
    let Some(helper) = spec.and_then(|s| s.init_containers.as_ref()).and_then(|c| {
        c.iter()
            .find(|c| RESTORE_HELPER_NAMES.contains(&c.name.as_str()))
    }) else {
        return TargetPod::Ready;
    };
    let running = pod
        .status
        .as_ref()
        .and_then(|s| s.init_container_statuses.as_ref())
        .and_then(|st| st.iter().find(|c| c.name == helper.name))
        .and_then(|c| c.state.as_ref())
        .is_some_and(|state| state.running.is_some());
    if running {
        TargetPod::Ready
    } else {
        TargetPod::NotYet("waiting for the restore helper init container to run")
    }
}

/// The target pod's readiness. One read, no writes, for restores of other nodes.
async fn target_pod(ctx: &Context, pvr: &PodVolumeRestore) -> Result<TargetPod, Error> {
    let ns = pvr.spec.pod.namespace.clone().unwrap_or_default();
    let name = pvr.spec.pod.name.clone().unwrap_or_default();
    if ns.is_empty() || name.is_empty() {
        return Ok(TargetPod::Elsewhere);
    }
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    Ok(match pods.get_opt(&name).await.map_err(Error::Kube)? {
        Some(pod) => readiness(&pod, &ctx.args.node_name),
        None => TargetPod::Missing,
    })
}

/// How often a restore waiting for its pod looks again: pods are not watched (one read per wait
/// here costs less than a watch of every pod of the node).
const POD_RECHECK: Duration = Duration::from_secs(5);

pub async fn reconcile(pvr: Arc<PodVolumeRestore>, ctx: Arc<Context>) -> Result<Action, Error> {
    use tracing::Instrument;
    let span = tracing::debug_span!("pvr", namespace = %pvr.namespace().unwrap_or_default(), name = %pvr.name_any());
    reconcile_inner(pvr, ctx).instrument(span).await
}

async fn reconcile_inner(pvr: Arc<PodVolumeRestore>, ctx: Arc<Context>) -> Result<Action, Error> {
    if ctx.shutdown.is_cancelled() {
        return Ok(Action::await_change());
    }
    let uid = pvr.uid().unwrap_or_default();
    let phase = pvr.phase();
    let ours_by_status =
        pvr.status.as_ref().and_then(|s| s.node.as_deref()) == Some(ctx.args.node_name.as_str());
    if phase.is_terminal() {
        if ours_by_status
            && pvr.finalizers().iter().any(|f| f == crate::crd::FINALIZER)
            && !transfer::remove_finalizer(&mut writer(&ctx, &*pvr)).await
        {
            return Ok(Action::requeue(Duration::from_secs(10)));
        }
        return Ok(Action::await_change());
    }
    if !ctx.registry.is_active(&uid) && !ours_by_status {
        match target_pod(&ctx, &pvr).await? {
            TargetPod::Ready => {}
            TargetPod::Elsewhere => return Ok(Action::await_change()),
            TargetPod::NotYet(why) => {
                tracing::debug!(why, "restore not started yet");
                return Ok(Action::requeue(POD_RECHECK));
            }
            TargetPod::Missing => return Ok(Action::requeue(POD_RECHECK * 6)),
        }
    }
    reconcile::saved_cancel_claim_submit(pvr, ctx, run).await
}

/// The owning Restore's UID names the done-file.
fn restore_uid(pvr: &PodVolumeRestore) -> Option<String> {
    pvr.owner_references()
        .iter()
        .find(|o| o.kind == "Restore")
        .map(|o| o.uid.clone())
        .or_else(|| pvr.labels().get(RESTORE_UID_LABEL).cloned())
}

async fn run(ctx: Arc<Context>, pvr: PodVolumeRestore, token: CancellationToken) {
    use tracing::Instrument;
    let uid = pvr.uid().unwrap_or_default();
    let span = tracing::info_span!("restore", namespace = %pvr.namespace().unwrap_or_default(), name = %pvr.name_any(), uid = %uid, node = %ctx.args.node_name, uploader = %super::uploader_of(&ctx, pvr.spec.uploader_type));
    async {
        let started = Instant::now();
        let mut w = writer(&ctx, &pvr);
        let pvr =
            match transfer::gate(&ctx, &mut w, &pvr, &token, started, |m| failed(&ctx, m)).await {
                Gate::Start(p) => p,
                Gate::CancelBeforeStart(p, reason) => {
                    reconcile::cancel_before_start(&ctx, &p, reason).await;
                    return;
                }
                Gate::Stop => return,
            };
        let (request, restore_uid, location) = match prepare(&ctx, &pvr).await {
            Ok(p) => p,
            Err(message) => {
                end(&ctx, &pvr, &mut w, failed(&ctx, message), started, 0).await;
                return;
            }
        };
        let target = request.target.clone();
        let mut status = json!({
            "phase": Phase::InProgress.as_str(),
            "startTimestamp": now_rfc3339(),
            "node": ctx.args.node_name,
            "message": "starting",
        });
        if let Some(size) = pvr.spec.snapshot_size.filter(|s| *s > 0) {
            status["progress"] = json!({ "totalBytes": size });
        }
        match transfer::mark_in_progress(&ctx, &mut w, &pvr, &token, status).await {
            Gate::Start(()) => {}
            Gate::CancelBeforeStart((), reason) => {
                reconcile::cancel_before_start(&ctx, &pvr, reason).await;
                return;
            }
            Gate::Stop => return,
        }
        ctx.registry.set_phase(&uid, Phase::InProgress.as_str());
        event(
            &ctx,
            &pvr,
            false,
            "Started",
            format!(
                "restoring snapshot {} into {}",
                pvr.spec.snapshot_id,
                target.display()
            ),
        )
        .await;

        let op = ctx.engine.restore(request);
        ctx.registry.attach(&uid, op.clone());
        let reason = monitor(&ctx, &pvr, &mut w, &uid, &op, &token).await;
        let (outcome, progress) = transfer::wait_ended(&ctx, &uid, &op, &location).await;
        if reason == Some(CancelReason::Shutdown) {
            return;
        }
        let mut phase = terminal_phase(&outcome.kind, reason, false);
        let mut message = transfer::terminal_message(&ctx, &uid, phase, reason, &outcome, &location);
        drop(location);
        if phase == Phase::Completed {
            // What was restored reaches the disk before the pod is let start (Velero syncs
            // the volume's filesystem too); a failure is logged, the data is there.
            if let Err(e) = volume::flush(&target) {
                tracing::warn!(target = %target.display(), error = %e, "could not flush the restored volume");
            }
            // The handshake: without this file the restored pod's init container never finishes.
            match &restore_uid {
                Some(ruid) => {
                    if let Err(e) = volume::write_done_file(&target, ruid) {
                        phase = Phase::Failed;
                        message = format!(
                            "data restored, but the completion marker could not be written: {e}"
                        );
                    }
                }
                None => tracing::warn!("no owning Restore: no done-file written"),
            }
        }
        let mut status = transfer::progress_status(&progress);
        status["phase"] = Value::String(phase.as_str().to_string());
        status["message"] = Value::String(message);
        status["node"] = Value::String(ctx.args.node_name.clone());
        end(&ctx, &pvr, &mut w, status, started, progress.n_completed).await;
    }
    .instrument(span)
    .await
}

fn failed(ctx: &Context, message: String) -> Value {
    json!({ "phase": Phase::Failed.as_str(), "message": message, "node": ctx.args.node_name })
}

/// The request, the owning Restore's UID, and the location's access (held until the restore
/// ends: its drop removes the operation's credentials files).
async fn prepare(
    ctx: &Context,
    pvr: &PodVolumeRestore,
) -> Result<
    (
        RestoreRequest,
        Option<String>,
        super::storage::LocationAccess,
    ),
    String,
> {
    let target = super::pod_volume_path(ctx, &pvr.spec.pod, &pvr.spec.volume, "target pod").await?;
    let uploader = super::uploader_of(ctx, pvr.spec.uploader_type);
    let (access, location) = super::repository_access(
        ctx,
        &pvr.spec.repo_identifier,
        uploader,
        &pvr.spec.backup_storage_location,
        &pvr.uid().unwrap_or_default(),
        &pvr.spec.source_namespace,
        None,
    )
    .await?;
    let setting = |k: &str| {
        pvr.spec
            .uploader_settings
            .as_ref()
            .and_then(|s| s.get(k))
            .cloned()
    };
    Ok((
        RestoreRequest {
            uploader,
            access,
            snapshot_id: pvr.spec.snapshot_id.clone(),
            target,
            limit_download_kib: None,
            // Velero's uploaderSettings for a restore.
            kopia: kopia_restore_options(setting),
        },
        restore_uid(pvr),
        location,
    ))
}

/// kopia's restore settings from Velero's restore settings (a PodVolumeRestore's
/// `uploaderSettings`, a DataDownload's `dataMoverConfig`: the restore's uploaderConfig).
pub fn kopia_restore_options(
    setting: impl Fn(&str) -> Option<String>,
) -> crate::uploader::kopia::RestoreOptions {
    crate::uploader::kopia::RestoreOptions {
        write_sparse_files: setting("WriteSparseFiles")
            .is_some_and(|v| v.eq_ignore_ascii_case("true")),
        parallel: setting("ParallelFilesDownload")
            .and_then(|v| v.parse().ok())
            .filter(|n| *n > 0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(node: Option<&str>, helper: Option<&str>, state: Option<serde_json::Value>) -> Pod {
        let mut p = json!({
            "metadata": {"name": "app", "namespace": "ns"},
            "spec": {"containers": [{"name": "app", "image": "app"}]},
        });
        if let Some(n) = node {
            p["spec"]["nodeName"] = json!(n);
        }
        if let Some(h) = helper {
            p["spec"]["initContainers"] = json!([{"name": h, "image": "velero/velero"}]);
            if let Some(st) = state {
                p["status"] = json!({"initContainerStatuses": [{
                    "name": h, "image": "velero/velero", "imageID": "", "ready": false,
                    "restartCount": 0, "state": st,
                }]});
            }
        }
        serde_json::from_value(p).unwrap()
    }

    #[test]
    fn a_restore_waits_for_the_pod_to_be_here_with_its_restore_helper_running() {
        let running = Some(json!({"running": {"startedAt": "2026-12-02T10:00:00Z"}}));
        let waiting = Some(json!({"waiting": {"reason": "PodInitializing"}}));
        assert_eq!(
            readiness(&pod(Some("b"), None, None), "a"),
            TargetPod::Elsewhere
        );
        assert!(matches!(
            readiness(&pod(None, Some("restore-wait"), None), "a"),
            TargetPod::NotYet(_)
        ));
        assert!(matches!(
            readiness(&pod(Some("a"), Some("restore-wait"), None), "a"),
            TargetPod::NotYet(_)
        ));
        assert!(matches!(
            readiness(&pod(Some("a"), Some("restore-wait"), waiting), "a"),
            TargetPod::NotYet(_)
        ));
        assert_eq!(
            readiness(&pod(Some("a"), Some("restore-wait"), running.clone()), "a"),
            TargetPod::Ready
        );
        assert_eq!(
            readiness(&pod(Some("a"), Some("restic-wait"), running.clone()), "a"),
            TargetPod::Ready
        );
        // Not restored by Velero: no helper to wait for.
        assert_eq!(
            readiness(&pod(Some("a"), None, None), "a"),
            TargetPod::Ready
        );
        // Another init container's state says nothing.
        assert_eq!(
            readiness(&pod(Some("a"), Some("setup"), None), "a"),
            TargetPod::Ready
        );
    }
}
