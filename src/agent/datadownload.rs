//! DataDownloads (CSI snapshot data movement, restore side): a new volume exposed for the target
//! claim (see [`super::restore_expose`]), the snapshot restored into it from Velero's kopia
//! repository of the source namespace on the node where its hold pod runs, the volume handed to
//! the target claim, everything exposed removed, then the result. The claim and the hand-over to
//! the node are [`super::movement`]'s.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kube::ResourceExt;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use super::Context;
use super::expose::{self, ExposeSettings};
use super::movement::{Movement, cancel_unstarted, fail_unstarted};
use super::reconcile::writer;
use super::registry::CancelReason;
use super::restore_expose;
use super::status::now_rfc3339;
use super::transfer::{self, Gate, end, event, monitor, terminal_phase};
use super::volume;
use crate::crd::Phase;
use crate::datamover::DataDownload;
use crate::engine::RestoreRequest;
use crate::uploader::UploaderKind;

impl Movement for DataDownload {
    const EXPOSED: &'static str = "the restore volume";
    fn data_mover(&self) -> &str {
        &self.spec.data_mover
    }
    fn accepted_by_node(&self) -> Option<&String> {
        self.status.as_ref()?.accepted_by_node.as_ref()
    }
    fn node(&self) -> Option<&String> {
        self.status.as_ref()?.node.as_ref()
    }
    async fn expose(
        ctx: &Context,
        dd: &Self,
        settings: &ExposeSettings,
        within: Duration,
    ) -> Result<(), String> {
        restore_expose::expose(
            &ctx.client,
            dd,
            settings,
            within,
            settings.config.ignore_delay_binding(),
        )
        .await
    }
    async fn clean_up(ctx: &Context, dd: &Self) {
        restore_expose::clean_up(&ctx.client, dd).await
    }
    fn run(
        ctx: Arc<Context>,
        dd: Self,
        token: CancellationToken,
    ) -> impl std::future::Future<Output = ()> + Send + 'static {
        run(ctx, dd, token)
    }
}

/// `spec.operationTimeout` (a Go duration such as `10m0s`): how long each step of the hand-over
/// may wait, as Velero's exposer uses it. Ten minutes when absent or unreadable.
fn operation_timeout(dd: &DataDownload) -> Duration {
    humantime::parse_duration(&dd.spec.operation_timeout)
        .ok()
        .filter(|d| !d.is_zero())
        .unwrap_or(Duration::from_secs(600))
}

async fn run(ctx: Arc<Context>, dd: DataDownload, token: CancellationToken) {
    let uid = dd.uid().unwrap_or_default();
    use tracing::Instrument;
    let span = tracing::info_span!("data_download", namespace = %dd.namespace().unwrap_or_default(), name = %dd.name_any(), uid = %uid, node = %ctx.args.node_name);
    async {
        let started = Instant::now();
        let not_started = |reason| {
            format!(
                "{} before the data movement started",
                transfer::reason_text(&ctx, &uid, reason)
            )
        };
        let mut w = writer(&ctx, &dd);
        let dd =
            match transfer::gate(&ctx, &mut w, &dd, &token, started, super::movement::failed).await
            {
                Gate::Start(d) => d,
                Gate::CancelBeforeStart(d, reason) => {
                    return cancel_unstarted(&ctx, &d, &not_started(reason)).await;
                }
                Gate::Stop => return,
            };
        let (request, location) = match prepare(&ctx, &dd).await {
            Ok(p) => p,
            Err(message) => return fail_unstarted(&ctx, &dd, message).await,
        };
        let target = request.target.clone();
        let mut status = json!({
            "phase": Phase::InProgress.as_str(),
            "startTimestamp": now_rfc3339(),
            "message": "starting",
        });
        if let Some(size) = dd.spec.snapshot_size.filter(|s| *s > 0) {
            status["progress"] = json!({ "totalBytes": size });
        }
        match transfer::mark_in_progress(&ctx, &mut w, &dd, &token, status).await {
            Gate::Start(()) => {}
            Gate::CancelBeforeStart((), reason) => {
                return cancel_unstarted(&ctx, &dd, &not_started(reason)).await;
            }
            Gate::Stop => return,
        }
        ctx.registry.set_phase(&uid, Phase::InProgress.as_str());
        let (ns, pvc) = (
            &dd.spec.target_volume.namespace,
            &dd.spec.target_volume.pvc,
        );
        event(
            &ctx,
            &dd,
            false,
            "Started",
            format!(
                "restoring snapshot {} for claim {ns}/{pvc}",
                dd.spec.snapshot_id
            ),
        )
        .await;
        let op = ctx.engine.restore(request);
        ctx.registry.attach(&uid, op.clone());
        let reason = monitor(&ctx, &dd, &mut w, &uid, &op, &token).await;
        let (outcome, progress) = transfer::wait_ended(&ctx, &uid, &op, &location).await;
        if reason == Some(CancelReason::Shutdown) {
            // The next start restores it again into the same exposed volume.
            tracing::info!("left for the next agent start to run again");
            return;
        }
        // A restore with unreadable entries is not the volume the backup had: Failed.
        let mut phase = terminal_phase(&outcome.kind, reason, false);
        let mut message = transfer::terminal_message(&ctx, &uid, phase, reason, &outcome, &location);
        drop(location);
        if phase == Phase::Completed {
            // On disk before the volume changes hands (Velero's restore syncs too).
            if let Err(e) = volume::flush(&target) {
                tracing::warn!(target = %target.display(), error = %e, "could not flush the restored volume");
            }
            match restore_expose::hand_over(&ctx.client, &dd, operation_timeout(&dd)).await {
                Ok(pv) => {
                    message = format!("{message}; volume {pv} bound to claim {ns}/{pvc}");
                }
                Err(e) => {
                    phase = Phase::Failed;
                    message = format!(
                        "data restored, but the volume could not be handed to claim {ns}/{pvc}: {e}"
                    );
                }
            }
        }
        restore_expose::clean_up(&ctx.client, &dd).await;
        let mut status = transfer::progress_status(&progress);
        status["phase"] = Value::String(phase.as_str().to_string());
        status["message"] = Value::String(message);
        end(&ctx, &dd, &mut w, status, started, progress.n_completed).await;
    }
    .instrument(span)
    .await
}

/// The request (into the hold pod's volume as this node's kubelet mounts it) and the location's
/// access (held until the restore ends: its drop removes the operation's credentials files).
async fn prepare(
    ctx: &Context,
    dd: &DataDownload,
) -> Result<(RestoreRequest, super::storage::LocationAccess), String> {
    let pod = crate::crd::PodReference {
        namespace: dd.namespace(),
        name: Some(dd.name_any()),
        ..Default::default()
    };
    let target = super::pod_volume_path(ctx, &pod, expose::HOLD_VOLUME, "hold pod").await?;
    let (access, location) = super::repository_access(
        ctx,
        "",
        UploaderKind::Kopia,
        &dd.spec.backup_storage_location,
        &dd.uid().unwrap_or_default(),
        &dd.spec.source_namespace,
        // Velero's data mover waits for it as long as its --resource-timeout (10 minutes).
        Some(Duration::from_secs(600)),
    )
    .await?;
    let setting = |k: &str| {
        dd.spec
            .data_mover_config
            .as_ref()
            .and_then(|c| c.get(k))
            .cloned()
    };
    Ok((
        RestoreRequest {
            uploader: UploaderKind::Kopia,
            access,
            snapshot_id: dd.spec.snapshot_id.clone(),
            target,
            limit_download_kib: None,
            // The restore's uploaderConfig, as Velero's data mover reads it.
            kopia: super::restore::kopia_restore_options(setting),
        },
        location,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_operation_timeout_is_velero_s_go_duration() {
        let mut dd: DataDownload = serde_json::from_value(json!({
            "apiVersion": "velero.io/v2alpha1", "kind": "DataDownload",
            "metadata": {"name": "r", "namespace": "velero"},
            "spec": {"targetVolume": {"pvc": "p", "pv": "", "namespace": "a"},
                "backupStorageLocation": "default", "snapshotID": "k1", "sourceNamespace": "a",
                "operationTimeout": "10m0s"}
        }))
        .unwrap();
        assert_eq!(operation_timeout(&dd), Duration::from_secs(600));
        dd.spec.operation_timeout = "1h30m0s".into();
        assert_eq!(operation_timeout(&dd), Duration::from_secs(5400));
        dd.spec.operation_timeout = "".into();
        assert_eq!(operation_timeout(&dd), Duration::from_secs(600));
        dd.spec.operation_timeout = "0s".into();
        assert_eq!(operation_timeout(&dd), Duration::from_secs(600));
    }
}
