//! PodVolumeBackups: reconcile (claim, queue, cancel — returns at once) and the backup itself.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kube::api::ListParams;
use kube::runtime::controller::Action;
use kube::{Api, ResourceExt};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use super::owner::{Owner, OwnerKind};
use super::reconcile::{self, writer};
use super::registry::CancelReason;
use super::status::{VolumeObject, now_rfc3339};
use super::transfer::{self, Gate, end, event, monitor, terminal_phase};
use super::{Context, Error};
use crate::crd::{Phase, PodVolumeBackup};
use crate::engine::BackupRequest;
use crate::uploader::UploaderKind;
use crate::uploader::restic::BackupOptions;

pub const PVC_UID_LABEL: &str = "velero.io/pvc-uid";

pub async fn reconcile(pvb: Arc<PodVolumeBackup>, ctx: Arc<Context>) -> Result<Action, Error> {
    use tracing::Instrument;
    let span = tracing::debug_span!("pvb", namespace = %pvb.namespace().unwrap_or_default(), name = %pvb.name_any());
    reconcile_inner(pvb, ctx).instrument(span).await
}

async fn reconcile_inner(pvb: Arc<PodVolumeBackup>, ctx: Arc<Context>) -> Result<Action, Error> {
    // Objects of other nodes cost nothing: no reads, no writes.
    if pvb.spec.node != ctx.args.node_name || ctx.shutdown.is_cancelled() {
        return Ok(Action::await_change());
    }
    if pvb.phase().is_terminal() {
        if pvb.finalizers().iter().any(|f| f == crate::crd::FINALIZER)
            && !transfer::remove_finalizer(&mut writer(&ctx, &*pvb)).await
        {
            return Ok(Action::requeue(Duration::from_secs(10)));
        }
        return Ok(Action::await_change());
    }
    reconcile::saved_cancel_claim_submit(pvb, ctx, run).await
}

/// The backup, from its slot to its terminal write.
async fn run(ctx: Arc<Context>, pvb: PodVolumeBackup, token: CancellationToken) {
    let uid = pvb.uid().unwrap_or_default();
    use tracing::Instrument;
    let span = tracing::info_span!("backup", namespace = %pvb.namespace().unwrap_or_default(), name = %pvb.name_any(), uid = %uid, node = %ctx.args.node_name, uploader = %super::uploader_of(&ctx, pvb.spec.uploader_type));
    async {
        let started = Instant::now();
        let mut w = writer(&ctx, &pvb);
        let pvb = match transfer::gate(&ctx, &mut w, &pvb, &token, started, failed).await {
            Gate::Start(p) => p,
            Gate::CancelBeforeStart(p, reason) => {
                reconcile::cancel_before_start(&ctx, &p, reason).await;
                return;
            }
            Gate::Stop => return,
        };
        let prepared = match prepare(&ctx, &pvb).await {
            Ok(p) => p,
            Err(message) => {
                end(&ctx, &pvb, &mut w, failed(message), started, 0).await;
                return;
            }
        };
        let status = json!({
            "phase": Phase::InProgress.as_str(),
            "startTimestamp": now_rfc3339(),
            "path": prepared.request.source.display().to_string(),
            "message": "starting",
        });
        match transfer::mark_in_progress(&ctx, &mut w, &pvb, &token, status).await {
            Gate::Start(()) => {}
            Gate::CancelBeforeStart((), reason) => {
                reconcile::cancel_before_start(&ctx, &pvb, reason).await;
                return;
            }
            Gate::Stop => return,
        }
        ctx.registry.set_phase(&uid, Phase::InProgress.as_str());
        event(
            &ctx,
            &pvb,
            false,
            "Started",
            format!(
                "backing up {} with {}",
                prepared.request.source.display(),
                prepared.request.uploader
            ),
        )
        .await;

        // Kept for removing a snapshot no Backup will reference (below).
        let (uploader, access) = (
            prepared.request.uploader,
            prepared.request.access.clone(),
        );
        let op = ctx.engine.backup(prepared.request);
        ctx.registry.attach(&uid, op.clone());
        let reason = monitor(&ctx, &pvb, &mut w, &uid, &op, &token).await;
        let (outcome, progress) = transfer::wait_ended(&ctx, &uid, &op, &prepared.location).await;
        if reason == Some(CancelReason::Shutdown) {
            // The next start runs it again; kopia's incomplete snapshot of this run goes first.
            if let Some(id) = &outcome.incomplete_snapshot_id
                && let Err(e) = ctx.engine.forget_snapshot(uploader, &access, id).await
            {
                tracing::warn!(snapshot = %id, error = %prepared.location.redact(&e), "could not delete kopia's incomplete snapshot");
            }
            tracing::info!("left for the next agent start to run again");
            return;
        }
        let mut phase = terminal_phase(&outcome.kind, reason, ctx.args.partial_as_completed);
        // A snapshot made although the Backup ended meanwhile (the stop lost the race, or the
        // end came after the last check): Velero has recorded this volume without it, so
        // nothing will ever reference or delete it. It is removed, and the result says so.
        let orphan = match (&outcome.snapshot_id, Owner::of(&pvb, OwnerKind::Backup)) {
            (Some(id), Some(owner)) if !id.is_empty() => ctx
                .owners
                .state_now(&owner)
                .await
                .stop_reason(&owner)
                .map(|why| (id.clone(), why)),
            _ => None,
        };
        if let Some((id, why)) = &orphan {
            phase = Phase::Canceled;
            let removed = ctx.engine.forget_snapshot(uploader, &access, id).await;
            let what = match &removed {
                Ok(()) => format!("the snapshot {id} it made was deleted from the repository (no backup references it)"),
                Err(e) => format!("deleting the snapshot {id} it made failed ({e}): it stays in the repository with no backup referencing it"),
            };
            let message = prepared.location.redact(&format!("{why} while the backup ran; {what}"));
            tracing::warn!(snapshot = %id, "{message}");
            drop(prepared.location);
            let mut status = transfer::progress_status(&progress);
            status["phase"] = Value::String(phase.as_str().to_string());
            status["message"] = Value::String(message);
            status["snapshotID"] = Value::String(String::new());
            end(&ctx, &pvb, &mut w, status, started, progress.n_completed).await;
            return;
        }
        let message = transfer::terminal_message(&ctx, &uid, phase, reason, &outcome, &prepared.location);
        let message = match transfer::forget_incomplete(
            &ctx,
            &outcome,
            uploader,
            &access,
            &prepared.location,
        )
        .await
        {
            Some(what) => format!("{message}; {what}"),
            None => message,
        };
        drop(prepared.location);
        let mut status = transfer::progress_status(&progress);
        status["phase"] = Value::String(phase.as_str().to_string());
        status["message"] = Value::String(message.clone());
        status["snapshotID"] = Value::String(outcome.snapshot_id.clone().unwrap_or_default());
        // How each uploader's figure is derived: restic::classify and kopia::incremental_bytes.
        if let Some(n) = outcome.summary.as_ref().and_then(|s| s.incremental_bytes) {
            status["incrementalBytes"] = json!(i64::try_from(n).unwrap_or(i64::MAX));
        }
        end(&ctx, &pvb, &mut w, status, started, progress.n_completed).await;
    }
    .instrument(span)
    .await
}

fn failed(message: String) -> Value {
    json!({ "phase": Phase::Failed.as_str(), "message": message })
}

struct Prepared {
    request: BackupRequest,
    /// Held until the backup ends: its drop removes the operation's credentials files.
    location: super::storage::LocationAccess,
}

/// Finds the volume, the credentials and the parent snapshot. Errors are messages for the
/// object's status.
async fn prepare(ctx: &Context, pvb: &PodVolumeBackup) -> Result<Prepared, String> {
    let source = super::pod_volume_path(ctx, &pvb.spec.pod, &pvb.spec.volume, "pod").await?;
    let uploader = super::uploader_of(ctx, pvb.spec.uploader_type);
    let (access, location) = super::repository_access(
        ctx,
        &pvb.spec.repo_identifier,
        uploader,
        &pvb.spec.backup_storage_location,
        &pvb.uid().unwrap_or_default(),
        pvb.spec.pod.namespace.as_deref().unwrap_or_default(),
        None,
    )
    .await?;
    let tags: Vec<(String, String)> = pvb
        .spec
        .tags
        .clone()
        .unwrap_or_default()
        .into_iter()
        .collect();
    let parent = if uploader == UploaderKind::Restic {
        parent_snapshot(ctx, pvb).await
    } else {
        None
    };
    if let Some(p) = &parent {
        tracing::info!(parent = %p, "incremental backup from the previous snapshot of this claim");
    }
    Ok(Prepared {
        request: BackupRequest {
            uploader,
            access,
            source,
            options: BackupOptions {
                host: "velero".to_string(),
                tags,
                parent,
                limit_upload_kib: pvb
                    .spec
                    .uploader_settings
                    .as_ref()
                    .and_then(|s| s.get("LimitUploadKiB"))
                    .and_then(|v| v.parse().ok()),
                retry_lock: None,
                verbose: false,
                kopia: kopia_options(pvb, uploader),
            },
        },
        location,
    })
}

/// How a kopia snapshot of a Velero 1.17+ PodVolumeBackup (empty `repoIdentifier`) is filed as
/// Velero files its own: its source identity, description and pin, and Velero's keep-everything
/// policy on that source. Unlike Velero (`FailFast`), an unreadable entry does not stop the
/// snapshot: it is saved with everything readable and the backup reported Failed with the
/// snapshot ID kept and the entries named (Velero's server restores a PodVolumeBackup that has a
/// snapshot ID, whatever its phase).
fn kopia_options(
    pvb: &PodVolumeBackup,
    uploader: UploaderKind,
) -> crate::uploader::kopia::SnapshotOptions {
    use super::kopia_repository as velero;
    if uploader != UploaderKind::Kopia || !pvb.spec.repo_identifier.is_empty() {
        return Default::default();
    }
    let claim_or_volume = pvb
        .annotations()
        .get(velero::PVC_NAME_ANNOTATION)
        .filter(|c| !c.is_empty())
        .cloned()
        .unwrap_or_else(|| pvb.spec.volume.clone());
    let setting = |k: &str| {
        pvb.spec
            .uploader_settings
            .as_ref()
            .and_then(|s| s.get(k))
            .and_then(|v| v.parse().ok())
            .filter(|n| *n > 0)
    };
    crate::uploader::kopia::SnapshotOptions {
        source: Some(velero::velero_source(
            pvb.spec.pod.namespace.as_deref().unwrap_or_default(),
            pvb.spec.pod.name.as_deref().unwrap_or_default(),
            &claim_or_volume,
        )),
        description: Some(velero::DESCRIPTION.to_string()),
        pins: vec![velero::PIN.to_string()],
        parallel: setting("ParallelFilesUpload"),
        fail_fast: false,
        keep_all_policy: true,
    }
}

/// The snapshot of the most recent Completed backup of the same claim, storage location and
/// uploader, as Velero chose the parent. One label-selected list (`velero.io/pvc-uid`, which Velero
/// sets on every claim's PodVolumeBackup) when the backup starts: the watch cache holds only this
/// node's objects, and the previous backup of a claim may have run on any node. If the list
/// fails the backup runs without a parent: every file is read again, nothing is lost.
pub async fn parent_snapshot(ctx: &Context, pvb: &PodVolumeBackup) -> Option<String> {
    let pvc_uid = pvb.labels().get(PVC_UID_LABEL)?;
    let api: Api<PodVolumeBackup> = Api::namespaced(ctx.client.clone(), &ctx.args.namespace);
    let selector = format!("{PVC_UID_LABEL}={pvc_uid}");
    match api.list(&ListParams::default().labels(&selector)).await {
        Ok(list) => parent_among(list.items, pvb),
        Err(e) => {
            tracing::warn!(error = %e, %selector, "cannot list the previous backups of this claim; backing up without a parent (every file is read)");
            None
        }
    }
}

fn parent_among(
    known: impl IntoIterator<Item = PodVolumeBackup>,
    pvb: &PodVolumeBackup,
) -> Option<String> {
    let pvc_uid = pvb.labels().get(PVC_UID_LABEL)?.clone();
    known
        .into_iter()
        .filter(|o| {
            o.labels().get(PVC_UID_LABEL) == Some(&pvc_uid)
                && o.spec.backup_storage_location == pvb.spec.backup_storage_location
                && o.spec.uploader_type == pvb.spec.uploader_type
                && o.phase() == Phase::Completed
                && o.uid() != pvb.uid()
        })
        .filter_map(|o| {
            let s = o.status.as_ref()?;
            let id = s.snapshot_id.clone().filter(|id| !id.is_empty())?;
            Some((s.completion_timestamp.as_ref().map(|t| t.0), id))
        })
        .max_by_key(|(t, _)| *t)
        .map(|(_, id)| id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pvb(name: &str, node: &str, pvc: &str, done: &str, snapshot: &str) -> PodVolumeBackup {
        serde_json::from_value(json!({
            "apiVersion": "velero.io/v1", "kind": "PodVolumeBackup",
            "metadata": {
                "name": name, "namespace": "velero", "uid": format!("uid-{name}"),
                "labels": {PVC_UID_LABEL: pvc, "velero.io/backup-name": "b"},
                "annotations": {"a": "b"},
                "managedFields": [{"manager": "velero-server", "operation": "Update"}],
            },
            "spec": {
                "node": node, "volume": "data", "backupStorageLocation": "default",
                "repoIdentifier": "s3:s3.example/bucket/ns", "tags": {"pod": "app"},
                "pod": {"kind": "Pod", "namespace": "app", "name": "app-0", "uid": "p"},
            },
            "status": {
                "phase": "Completed", "snapshotID": snapshot, "completionTimestamp": done,
                "message": "", "path": "/host_pods/p/volumes/x/data",
                "progress": {"totalBytes": 10, "bytesDone": 10},
            },
        }))
        .unwrap()
    }

    /// The objects a `velero.io/pvc-uid` list returns (plus one of another claim, which a list
    /// never returns but the choice must still ignore): the parent is the latest Completed one of
    /// the same claim, storage location and uploader, whichever node ran it, never the backup
    /// itself.
    #[test]
    fn parent_is_the_latest_completed_backup_of_the_same_claim_location_and_uploader() {
        let mut other_location = pvb("loc", "node-b", "pvc-1", "2026-12-01T05:00:00Z", "10c00000");
        other_location.spec.backup_storage_location = "secondary".into();
        let mut other_uploader = pvb("kop", "node-b", "pvc-1", "2026-12-01T05:00:00Z", "k0p00000");
        other_uploader.spec.uploader_type = Some(crate::crd::UploaderType::Kopia);
        let mut failed = pvb(
            "fail",
            "node-b",
            "pvc-1",
            "2026-12-01T06:00:00Z",
            "fa110000",
        );
        failed.status.as_mut().unwrap().phase = Some(Phase::Failed);
        let no_snapshot = pvb("empty", "node-b", "pvc-1", "2026-12-01T06:00:00Z", "");
        let listed = vec![
            pvb("old", "node-b", "pvc-1", "2026-12-01T01:00:00Z", "0ld00000"),
            pvb("new", "node-c", "pvc-1", "2026-12-01T02:00:00Z", "4e300000"),
            pvb(
                "other-claim",
                "node-b",
                "pvc-2",
                "2026-12-01T03:00:00Z",
                "0th00000",
            ),
            other_location,
            other_uploader,
            failed,
            no_snapshot,
        ];
        let next = pvb("next", "node-a", "pvc-1", "2026-12-02T01:00:00Z", "");
        assert_eq!(
            parent_among(listed.clone(), &next).as_deref(),
            Some("4e300000")
        );
        // The backup itself is in the list once it exists; a finished retry must not be its own parent.
        let mut itself = pvb(
            "next",
            "node-a",
            "pvc-1",
            "2026-12-03T01:00:00Z",
            "5e1f0000",
        );
        itself.metadata.uid = next.metadata.uid.clone();
        let with_itself: Vec<_> = listed.into_iter().chain([itself]).collect();
        assert_eq!(
            parent_among(with_itself, &next).as_deref(),
            Some("4e300000")
        );
        let unlabelled = {
            let mut n = next.clone();
            n.metadata.labels = None;
            n
        };
        assert_eq!(parent_among(Vec::new(), &unlabelled), None);
    }
}
