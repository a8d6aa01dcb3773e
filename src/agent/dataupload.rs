//! DataUploads (CSI snapshot data movement, backup side): the snapshot exposed (see
//! [`super::expose`]) and, on the node where its hold pod runs, read from the kubelet's mount
//! into Velero's kopia repository of the source namespace, under the source Velero's own data
//! mover files it under; everything exposed removed before the result. The claim and the
//! hand-over are [`super::movement`]'s.

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
use super::status::now_rfc3339;
use super::transfer::{self, Gate, end, event, monitor, terminal_phase};
use crate::crd::Phase;
use crate::datamover::DataUpload;
use crate::engine::BackupRequest;
use crate::uploader::UploaderKind;
use crate::uploader::restic::BackupOptions;

/// The label Velero's server puts on a DataUpload; Velero's data mover tags the snapshot with it.
pub const ASYNC_OPERATION_ID_LABEL: &str = "velero.io/async-operation-id";

impl Movement for DataUpload {
    const EXPOSED: &'static str = "the snapshot";
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
        du: &Self,
        settings: &ExposeSettings,
        within: Duration,
    ) -> Result<(), String> {
        expose::expose(&ctx.client, du, settings, within).await
    }
    async fn clean_up(ctx: &Context, du: &Self) {
        expose::clean_up(&ctx.client, du).await
    }
    fn run(
        ctx: Arc<Context>,
        du: Self,
        token: CancellationToken,
    ) -> impl std::future::Future<Output = ()> + Send + 'static {
        run(ctx, du, token)
    }
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
        let du = match transfer::gate(&ctx, &mut w, &du, &token, started, super::movement::failed)
            .await
        {
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
        let (outcome, progress) = transfer::wait_ended(&ctx, &uid, &op, &prepared.location).await;
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
        let message =
            transfer::terminal_message(&ctx, &uid, phase, reason, &outcome, &prepared.location);
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
