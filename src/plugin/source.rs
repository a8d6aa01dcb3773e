//! The thin Kubernetes layer of `kubectl podvolume`: the user's kubeconfig, list and watch of
//! PodVolumeBackups/PodVolumeRestores and DataUploads/DataDownloads by label, and the cancel
//! patch. Objects are read as untyped
//! JSON (`DynamicObject`) so that one odd object (a phase of a later Velero, a mistyped field)
//! costs its own fields, never the whole list.

use std::path::Path;

use futures::{Stream, StreamExt};
use kube::api::{ApiResource, DynamicObject, ListParams, Patch, PatchParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Config};
use serde_json::Value;

use super::summary::{Kind, Volume};
use crate::crd::{PodVolumeBackup, PodVolumeRestore};
use crate::datamover::{DataDownload, DataUpload};

/// The two kinds of objects of one Velero backup/restore: its pod volumes (PodVolumeBackups or
/// PodVolumeRestores) and its CSI snapshot data movement (DataUploads or DataDownloads).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Feed {
    PodVolumes,
    DataMovement,
}

impl Feed {
    pub const ALL: [Feed; 2] = [Feed::PodVolumes, Feed::DataMovement];

    /// The resource, as kubectl names it (singular).
    pub fn resource(self, kind: Kind) -> &'static str {
        match (self, kind) {
            (Feed::PodVolumes, k) => k.resource(),
            (Feed::DataMovement, Kind::Backup) => "dataupload",
            (Feed::DataMovement, Kind::Restore) => "datadownload",
        }
    }
}

/// A client for the current context of the user's kubeconfig (`--kubeconfig`, else `KUBECONFIG`,
/// else `~/.kube/config`, else in-cluster), or of `--context`.
pub async fn client(kubeconfig: Option<&Path>, context: Option<&str>) -> Result<Client, String> {
    let options = KubeConfigOptions {
        context: context.map(str::to_string),
        ..Default::default()
    };
    let config = match kubeconfig {
        Some(path) => {
            let kc = Kubeconfig::read_from(path)
                .map_err(|e| format!("kubeconfig {}: {e}", path.display()))?;
            Config::from_custom_kubeconfig(kc, &options)
                .await
                .map_err(|e| e.to_string())
        }
        None if context.is_some() => Config::from_kubeconfig(&options)
            .await
            .map_err(|e| e.to_string()),
        None => Config::infer().await.map_err(|e| e.to_string()),
    }
    .map_err(|e| format!("no usable kubeconfig: {e}"))?;
    Client::try_from(config).map_err(|e| format!("cannot build a client: {e}"))
}

/// The resource of `kind` and `feed` in `namespace`.
pub fn api(client: &Client, kind: Kind, feed: Feed, namespace: &str) -> Api<DynamicObject> {
    let resource = match (feed, kind) {
        (Feed::PodVolumes, Kind::Backup) => ApiResource::erase::<PodVolumeBackup>(&()),
        (Feed::PodVolumes, Kind::Restore) => ApiResource::erase::<PodVolumeRestore>(&()),
        (Feed::DataMovement, Kind::Backup) => ApiResource::erase::<DataUpload>(&()),
        (Feed::DataMovement, Kind::Restore) => ApiResource::erase::<DataDownload>(&()),
    };
    Api::namespaced_with(client.clone(), namespace, &resource)
}

/// Whether a list error of the data movement kinds means "show pod volumes only": they are not
/// served (Velero < 1.12), or the user may read pod volumes but not them (a Role written before
/// data movement existed). Some(warning) for the second, shown once; None: a real error.
pub fn data_movement_skipped(e: &str) -> Option<Option<String>> {
    if e.starts_with("the API server does not serve") {
        Some(None)
    } else if e.starts_with("forbidden:") {
        Some(Some(format!("warning: moved CSI snapshots not shown: {e}")))
    } else {
        None
    }
}

/// The label selector for one Velero backup/restore, or for all of them.
pub fn selector(kind: Kind, name: Option<&str>) -> String {
    match name {
        Some(n) => format!("{}={n}", kind.group_label()),
        None => kind.group_label().to_string(),
    }
}

/// Every object matching `selector`, page by page.
pub async fn list(
    api: &Api<DynamicObject>,
    kind: Kind,
    feed: Feed,
    selector: &str,
) -> Result<Vec<Value>, String> {
    let mut out = Vec::new();
    let mut params = ListParams::default().labels(selector).limit(500);
    loop {
        let page = api
            .list(&params)
            .await
            .map_err(|e| explain(feed.resource(kind), "list", api, e))?;
        out.extend(
            page.items
                .iter()
                .filter_map(|o| serde_json::to_value(o).ok()),
        );
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(c) => params = params.continue_token(&c),
            None => return Ok(out),
        }
    }
}

/// What a watch tells the tracker.
pub enum Change {
    /// An object as it is now (listed or changed).
    Seen(Value),
    Deleted(Value),
    /// A re-list of one feed starts: what it does not show again is gone.
    RelistStart(Feed),
    RelistDone(Feed),
    /// The watch failed; it is retried with backoff.
    Error(String),
}

/// A watch of the objects matching `selector`, re-listing after errors (kube's watcher).
pub fn watch(
    api: Api<DynamicObject>,
    feed: Feed,
    selector: &str,
) -> impl Stream<Item = Change> + Send + use<> {
    let config = watcher::Config::default().labels(selector);
    watcher::watcher(api, config)
        .default_backoff()
        .map(move |event| match event {
            Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o)) => {
                Change::Seen(serde_json::to_value(o).unwrap_or_default())
            }
            Ok(watcher::Event::Delete(o)) => {
                Change::Deleted(serde_json::to_value(o).unwrap_or_default())
            }
            Ok(watcher::Event::Init) => Change::RelistStart(feed),
            Ok(watcher::Event::InitDone) => Change::RelistDone(feed),
            Err(e) => Change::Error(e.to_string()),
        })
}

/// What `cancel` did to one object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CancelOutcome {
    Requested,
    AlreadyRequested,
    /// Terminal: nothing to stop.
    Finished,
}

/// Sets `spec.cancel: true` on one object unless it is finished or already asked to stop. A
/// merge patch of `spec.cancel` alone: status is never sent, so no agent's write is undone
/// whichever CRD flavour the cluster has.
pub async fn cancel(
    api: &Api<DynamicObject>,
    resource: &str,
    volume: &Volume,
) -> Result<CancelOutcome, String> {
    if volume.state().is_terminal() {
        return Ok(CancelOutcome::Finished);
    }
    if volume.cancel_requested {
        return Ok(CancelOutcome::AlreadyRequested);
    }
    api.patch(
        &volume.name,
        &PatchParams {
            field_manager: Some("kubectl-podvolume".to_string()),
            ..PatchParams::default()
        },
        &Patch::Merge(crate::crd::cancel_patch()),
    )
    .await
    .map_err(|e| explain(resource, "patch", api, e))?;
    Ok(CancelOutcome::Requested)
}

/// An API error in the words a user needs: what was refused and what permission it takes.
fn explain(resource: &str, verb: &str, api: &Api<DynamicObject>, e: kube::Error) -> String {
    let resource = format!("{resource}s.velero.io");
    let ns = api.namespace().unwrap_or("");
    match &e {
        kube::Error::Api(s) if s.code == 403 => format!(
            "forbidden: you may not {verb} {resource} in namespace {ns} ({}); kubectl podvolume needs get, list and watch on podvolumebackups, podvolumerestores, datauploads and datadownloads (and patch to cancel)",
            s.message
        ),
        kube::Error::Api(s) if s.code == 404 => format!(
            "the API server does not serve {resource} in namespace {ns}: is Velero (or podvolume-agent's CRDs) installed? ({})",
            s.message
        ),
        _ => format!("cannot {verb} {resource} in namespace {ns}: {e}"),
    }
}
