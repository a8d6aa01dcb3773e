//! The node agent: watches this node's PodVolumeBackups and PodVolumeRestores and runs them.
//!
//! ```text
//! watch (objects for this node) -> reconcile (claim / queue / cancel; returns at once)
//!   -> registry (concurrency, cancel tokens) -> engine operation (uploader, progress)
//!   -> monitor (one status write per interval when changed) -> terminal write (one patch, durable)
//! ```

pub mod admin;
pub mod backup;
pub mod datadownload;
pub mod datamover_config;
pub mod dataupload;
pub mod expose;
pub mod kopia_caches;
pub mod kopia_repository;
pub mod metrics;
pub mod movement;
pub mod node_agent_config;
pub mod node_health;
pub mod opsapi;
pub mod owner;
pub mod phases;
pub mod reconcile;
pub mod registry;
pub mod restore;
pub mod restore_expose;
pub mod state;
pub mod status;
pub mod storage;
pub mod transfer;
pub mod volume;
pub mod watched;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Secret;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::Store;
use kube::runtime::watcher;
use kube::{Api, Client};
use tokio_util::sync::CancellationToken;

use crate::cli::RunArgs;
use crate::crd::{PodVolumeBackup, PodVolumeRestore, UploaderType};
use crate::engine::{Engine, EngineConfig};
use crate::uploader::{RepositoryAccess, UploaderKind};
use metrics::Metrics;
use registry::{CancelReason, Registry};
use state::StateDir;

/// Errors of a reconcile; the object is retried after a short wait.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("API request failed: {0}")]
    Kube(#[source] kube::Error),
    #[error("status write failed: {0}")]
    Write(#[source] status::WriteError),
}

/// Everything reconcilers and transfers share.
pub struct Context {
    pub client: Client,
    pub args: RunArgs,
    pub engine: Arc<Engine>,
    pub registry: Registry,
    /// Whether the Backup/Restore of a transfer still waits for it.
    pub owners: owner::OwnerCheck,
    pub metrics: Arc<Metrics>,
    pub recorder: Recorder,
    pub state: StateDir,
    /// Set on SIGTERM/SIGINT: stop claiming, stop children, leave objects for the next start.
    pub shutdown: CancellationToken,
    /// Whether each kind has the status subresource (our CRDs) or not (Velero's).
    pub pvb_status_subresource: bool,
    pub pvr_status_subresource: bool,
    /// The phases each kind's installed CRD allows (Velero <= 1.16: four; 1.17+: eight).
    pub pvb_phases: Arc<phases::KindPhases>,
    pub pvr_phases: Arc<phases::KindPhases>,
    pub du_phases: Arc<phases::KindPhases>,
    pub dd_phases: Arc<phases::KindPhases>,
    /// The DataUpload/DataDownload exposures this node runs.
    pub exposing: movement::Exposing,
    /// What this agent last found about other nodes (data movement on a lost node is ended).
    pub nodes: node_health::NodeHealth,
    /// Velero's node-agent ConfigMap (`--node-agent-configmap`), as read at start.
    pub node_agent_config: Arc<node_agent_config::NodeAgentConfigs>,
    /// Every DataUpload and DataDownload of the namespace (the watches' caches), to count the
    /// exposures in flight against `prepareQueueLength`.
    pub data_movements: Option<(
        Store<crate::datamover::DataUpload>,
        Store<crate::datamover::DataDownload>,
    )>,
}

/// How long finished operations stay visible in the operations API.
pub const RETENTION: Duration = Duration::from_secs(3600);

pub fn uploader_of(ctx: &Context, t: Option<UploaderType>) -> UploaderKind {
    match t {
        Some(UploaderType::Restic) => UploaderKind::Restic,
        Some(UploaderType::Kopia) => UploaderKind::Kopia,
        _ => ctx.args.default_uploader,
    }
}

/// The host path of volume `volume` of the pod `pod` names; `role` names the pod in messages
/// ("pod", "target pod"). Errors are messages for the object's status.
pub async fn pod_volume_path(
    ctx: &Context,
    pod: &crate::crd::PodReference,
    volume: &str,
    role: &str,
) -> Result<PathBuf, String> {
    let ns = pod.namespace.as_deref().unwrap_or_default();
    let name = pod.name.as_deref().unwrap_or_default();
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(ctx.client.clone(), ns);
    let pod = match pods.get_opt(name).await {
        Ok(Some(p)) => p,
        Ok(None) => return Err(format!("{role} {ns}/{name} not found")),
        Err(e) => return Err(format!("cannot read {role} {ns}/{name}: {e}")),
    };
    volume::resolve(&ctx.client, &ctx.args.host_pods_dir, &pod, volume)
        .await
        .map_err(|e| format!("cannot locate volume {volume}: {e}"))
}

/// The repository, its password file and the storage location's access for one operation. The
/// password comes from `--repo-password-file` or from the Secret, written to a private file in
/// the scratch dir (the uploader reads it; it never travels in argv or logs). Object storage
/// access comes from the BackupStorageLocation `location` (see [`storage`]).
///
/// restic: the repository is `repo` (Velero writes its URL into `spec.repoIdentifier`). kopia
/// with an empty `repo` (Velero 1.17+; every kopia PodVolumeBackup Velero creates): the
/// repository Velero's server created for (`volume_namespace`, `location`), which must exist as
/// a Ready BackupRepository, at `<prefix>/kopia/<volume_namespace>/` of the location (see
/// [`kopia_repository`]). kopia with a `repo`: that local repository, no location read.
/// With `ensure_within` (data movement) a missing BackupRepository is asked of Velero's server
/// and waited for, as Velero's data mover does ([`kopia_repository::ensure_repository`]).
/// The returned [`storage::LocationAccess`] must live as long as the operation: dropping it
/// removes the operation's credentials files.
pub async fn repository_access(
    ctx: &Context,
    repo: &str,
    uploader: UploaderKind,
    location: &str,
    uid: &str,
    volume_namespace: &str,
    ensure_within: Option<Duration>,
) -> Result<(RepositoryAccess, storage::LocationAccess), String> {
    let velero_kopia = uploader == UploaderKind::Kopia && repo.is_empty();
    if repo.is_empty() && !velero_kopia {
        return Err("spec.repoIdentifier is empty: no repository to use".to_string());
    }
    let mut location_access = if uploader == UploaderKind::Restic || velero_kopia {
        storage::location_access(
            &ctx.client,
            &ctx.args.namespace,
            location,
            &ctx.args.default_credentials_file,
            &ctx.args.scratch_dir,
            uid,
        )
        .await?
    } else {
        storage::LocationAccess::default()
    };
    let mut cache_limit_mb = ctx.args.kopia_cache_limit_mb;
    let repository = if velero_kopia {
        let name = match ensure_within {
            Some(within) => {
                kopia_repository::ensure_repository(
                    &ctx.client,
                    &ctx.args.namespace,
                    volume_namespace,
                    location,
                    within,
                )
                .await
            }
            None => kopia_repository::ready_repository(
                &ctx.client,
                &ctx.args.namespace,
                volume_namespace,
                location,
            )
            .await
            .map_err(|e| e.message),
        }?;
        let what = format!("BackupStorageLocation {}/{location}", ctx.args.namespace);
        let (url, region) =
            kopia_repository::repository_location(&location_access.spec, &what, volume_namespace)?;
        if let Some(r) = region {
            location_access.extra_env.push(("AWS_REGION".into(), r));
        }
        tracing::info!(backup_repository = %name.name, repository = %url, "Velero's kopia repository");
        cache_limit_mb = name.cache_limit_mb.unwrap_or(ctx.args.kopia_cache_limit_mb);
        url
    } else {
        repo.to_string()
    };
    let password_file = match &ctx.args.repo_password_file {
        Some(f) => f.clone(),
        // Velero's kopia path trims the password (strings.TrimSpace); its restic path gave
        // restic the value as stored.
        None => secret_password_file(ctx, uploader == UploaderKind::Kopia).await?,
    };
    let cache_dir = uploader_cache_dir(&ctx.args.scratch_dir, uploader, &repository);
    if uploader == UploaderKind::Kopia
        && let Some(root) = cache_dir.parent()
    {
        let (root, dir, total) = (
            root.to_path_buf(),
            cache_dir.clone(),
            ctx.args.kopia_cache_total_mb,
        );
        let (claim, removed) = tokio::task::spawn_blocking(move || {
            kopia_caches::claim(&root, &dir, cache_limit_mb, total)
        })
        .await
        .map_err(|e| format!("cannot bound kopia's caches: {e}"))?;
        if !removed.dirs.is_empty() {
            tracing::info!(
                repositories = removed.dirs.len(),
                freed_mb = removed.bytes >> 20,
                total_mb = total,
                "removed the kopia caches of the repositories used least recently (--kopia-cache-total-mb)"
            );
        }
        location_access.cache_claim = Some(claim);
    }
    Ok((
        RepositoryAccess {
            repository,
            password_file,
            cache_dir,
            extra_env: location_access.extra_env.clone(),
            ca_cert: location_access.ca_cert.clone(),
            insecure_tls: location_access.insecure_tls,
            restic_options: ctx.args.restic_options.clone(),
            kopia_cache_limit_mb: Some(cache_limit_mb),
        },
        location_access,
    ))
}

/// The message an outcome gives the object: secrets of the location scrubbed, and for a
/// repository that is not there, what that means in a Velero installation (the agent does not
/// create repositories unless `--init-missing-repository`).
pub fn outcome_message(
    ctx: &Context,
    outcome: &crate::uploader::Outcome,
    location: &storage::LocationAccess,
) -> String {
    let mut message = outcome.message.clone();
    if outcome.kind == crate::uploader::OutcomeKind::RepositoryMissing
        && !ctx.args.init_missing_repository
    {
        let trimmed = message.trim_end().trim_end_matches('.').len();
        message.truncate(trimmed);
        message.push_str(
            ". The node agent does not create repositories (Velero's server creates them before any \
             PodVolumeBackup): likely a wrong repoIdentifier or resticRepoPrefix, a wrong bucket or \
             prefix in the BackupStorageLocation, credentials without permission to list it, or a \
             local path not mounted into the agent (--init-missing-repository creates it instead)",
        );
    }
    location.redact(&crate::text::redact_url_credentials(&message))
}

const SECRET_NAME: &str = "velero-repo-credentials";
const SECRET_KEY: &str = "repository-password";

async fn secret_password_file(ctx: &Context, trim: bool) -> Result<PathBuf, String> {
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &ctx.args.namespace);
    let secret = secrets
        .get_opt(SECRET_NAME)
        .await
        .map_err(|e| {
            format!(
                "cannot read Secret {}/{SECRET_NAME}: {e}",
                ctx.args.namespace
            )
        })?
        .ok_or_else(|| format!("Secret {}/{SECRET_NAME} not found", ctx.args.namespace))?;
    let value = secret
        .data
        .as_ref()
        .and_then(|d| d.get(SECRET_KEY))
        .ok_or_else(|| {
            format!(
                "Secret {}/{SECRET_NAME} has no key {SECRET_KEY}",
                ctx.args.namespace
            )
        })?;
    let dir = ctx.args.scratch_dir.join("credentials");
    let value = if trim {
        value.0.trim_ascii()
    } else {
        &value.0[..]
    };
    // Two names: operations of both uploaders run at once and each reads its own form.
    let name = if trim {
        "repository-password-trimmed"
    } else {
        "repository-password"
    };
    write_private(&dir, name, value).map_err(|e| format!("cannot write the password file: {e}"))
}

/// Where an uploader keeps its cache (and kopia its connection). restic keys its cache by
/// repository itself: one dir for all. kopia keeps which repository it is connected to in a
/// config file there, and `repository connect` and `snapshot create` are separate runs: two
/// operations on two repositories sharing one config would each snapshot into whichever
/// connected last, and report Completed for data in the other repository. One dir per
/// repository keeps them apart and keeps each repository's cache across its operations.
fn uploader_cache_dir(scratch: &std::path::Path, uploader: UploaderKind, repo: &str) -> PathBuf {
    let base = scratch.join(".cache").join(uploader.to_string());
    match uploader {
        UploaderKind::Restic => base,
        UploaderKind::Kopia => {
            // Readable (the repository's last path characters) and unique (a stable hash of
            // all of it); a single path component whatever the identifier holds.
            let tail = repo.chars().count().saturating_sub(40);
            let tail: String = repo.chars().skip(tail).collect();
            base.join(format!(
                "{}-{:016x}",
                storage::safe_name(&tail),
                crate::text::fnv1a64(repo.as_bytes())
            ))
        }
    }
}

/// Writes a file only its owner can read, atomically. Operations that start together (Velero
/// creates all the PVBs of a pod at once) write the same file at the same time: each writes its
/// own temporary file, so none truncates another's or renames it away.
pub(crate) fn write_private(
    dir: &std::path::Path,
    name: &str,
    data: &[u8],
) -> std::io::Result<PathBuf> {
    use std::io::Write;
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let path = dir.join(name);
    let tmp = dir.join(format!(
        ".{name}.{}.{}.tmp",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    let written = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(data)?;
        f.sync_all()?;
        std::fs::rename(&tmp, &path)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written.map(|()| path)
}

async fn client(args: &RunArgs) -> Result<Client, String> {
    let mut config = match &args.kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path)
                .map_err(|e| format!("kubeconfig {}: {e}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(|e| format!("kubeconfig {}: {e}", path.display()))?
        }
        // As kubectl: KUBECONFIG's files, then ~/.kube/config, then the pod's own ServiceAccount.
        None => kube::Config::infer().await.map_err(|e| {
            format!(
                "no Kubernetes configuration: give --kubeconfig, set KUBECONFIG, or run in a pod ({e})"
            )
        })?,
    };
    // kube sets no read timeout: a request whose connection goes silent (a partition that
    // drops packets, an API server that accepts and stalls) would wait forever, and with it the
    // status writer or a reconcile. 295 s is longer than any watch stays silent (the watcher
    // asks for 290 s and then reconnects), so watches are untouched; counted from each write,
    // not from when a pooled connection went idle.
    config.read_timeout = Some(std::time::Duration::from_secs(295));
    config.reset_reader_on_write = true;
    Client::try_from(config).map_err(|e| format!("Kubernetes client: {e}"))
}

/// Which velero.io kinds are served and whether they have the status subresource. Retried until
/// the API server answers: an agent that starts before its API server must not crash.
async fn discover(client: &Client, shutdown: &CancellationToken) -> Option<(bool, bool)> {
    let mut backoff = Duration::from_secs(1);
    loop {
        match client.list_api_group_resources("velero.io/v1").await {
            Ok(list) => {
                let has = |n: &str| list.resources.iter().any(|r| r.name == n);
                if has("podvolumebackups") && has("podvolumerestores") {
                    let flavour = (
                        has("podvolumebackups/status"),
                        has("podvolumerestores/status"),
                    );
                    tracing::info!(
                        pvb_status_subresource = flavour.0,
                        pvr_status_subresource = flavour.1,
                        "velero.io/v1 CRDs found"
                    );
                    return Some(flavour);
                }
                tracing::warn!(
                    "the PodVolumeBackup/PodVolumeRestore CRDs are not installed; waiting"
                );
            }
            Err(e) => {
                tracing::warn!(error = %e, retry_in = ?backoff, "cannot read API discovery for velero.io/v1; retrying")
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = shutdown.cancelled() => return None,
        }
        backoff = (backoff * 2).min(Duration::from_secs(30));
    }
}

/// Velero's node-agent ConfigMap, when `--node-agent-configmap` names one. One that cannot be
/// read or is not valid is logged as an error and the defaults apply (Velero's node agent does
/// the same); the start goes on.
async fn read_node_agent_config(
    client: &Client,
    args: &RunArgs,
) -> node_agent_config::NodeAgentConfigs {
    let Some(name) = &args.node_agent_configmap else {
        return Default::default();
    };
    let api: Api<k8s_openapi::api::core::v1::ConfigMap> =
        Api::namespaced(client.clone(), &args.namespace);
    let result = match api.get_opt(name).await {
        Ok(Some(cm)) => {
            node_agent_config::NodeAgentConfigs::from_data(name, &cm.data.unwrap_or_default())
        }
        Ok(None) => Err(format!(
            "ConfigMap {}/{name} does not exist",
            args.namespace
        )),
        Err(e) => Err(format!(
            "cannot read ConfigMap {}/{name}: {e}",
            args.namespace
        )),
    };
    match result {
        Ok(c) => {
            tracing::info!(configmap = %name, ?c, "node-agent ConfigMap read");
            for what in c.not_applicable() {
                tracing::info!(configmap = %name, "not applicable to this agent: {what}");
            }
            c
        }
        Err(e) => {
            tracing::error!(configmap = %name, "node-agent ConfigMap ignored, defaults apply: {e}");
            Default::default()
        }
    }
}

/// This node's labels (for the ConfigMap's per-node rules); None when they cannot be read.
async fn node_labels(
    client: &Client,
    node: &str,
) -> Option<std::collections::BTreeMap<String, String>> {
    let api: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
    match api.get(node).await {
        Ok(n) => Some(n.metadata.labels.unwrap_or_default()),
        Err(e) => {
            tracing::warn!(error = %e, "cannot read Node {node}: the ConfigMap's per-node rules are not applied");
            None
        }
    }
}

/// Whether Velero's data mover kinds (velero.io/v2alpha1 DataUpload; Velero 1.12+) are served.
/// Asked once at start; a cluster without them gets no DataUpload controller (logged).
async fn data_movement_served(client: &Client) -> bool {
    match client.list_api_group_resources("velero.io/v2alpha1").await {
        Ok(list) if list.resources.iter().any(|r| r.name == "datauploads") => true,
        Ok(_) => {
            tracing::info!(
                "velero.io/v2alpha1 serves no DataUploads: CSI snapshot data movement is off"
            );
            false
        }
        Err(e) => {
            tracing::info!(error = %e, "velero.io/v2alpha1 is not served (Velero < 1.12): CSI snapshot data movement is off");
            false
        }
    }
}

/// Keeps `phases` equal to what the CRD `name` allows: read once before the controllers start
/// (so the first claim is written right), then watched by name, so a CRD upgraded or
/// downgraded under a running agent is followed. A read the API server refuses (an older RBAC
/// without `get` on the CRD) is logged once; the status writer then learns the set from the
/// first refused write instead.
async fn follow_crd_phases(
    client: Client,
    name: &'static str,
    phases: Arc<phases::KindPhases>,
) -> tokio::task::JoinHandle<()> {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    use kube::runtime::WatchStreamExt;
    let api: Api<CustomResourceDefinition> = Api::all(client);
    match tokio::time::timeout(Duration::from_secs(30), api.get(name)).await {
        Ok(Ok(crd)) => {
            if let Some(set) = phases::PhaseSet::of_crd(&crd) {
                phases.learn(set, "the CRD");
            }
        }
        Ok(Err(e)) => {
            tracing::warn!(crd = name, error = %e, "cannot read the CRD; its phases are learned from the first refused write")
        }
        Err(_) => tracing::warn!(
            crd = name,
            "no answer reading the CRD in 30 s; its phases are learned from the first refused write"
        ),
    }
    tokio::spawn(async move {
        let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
        let mut changes = std::pin::pin!(watcher(api, config).default_backoff().applied_objects());
        let mut failing = false;
        while let Some(change) = changes.next().await {
            match change {
                Ok(crd) => {
                    failing = false;
                    if let Some(set) = phases::PhaseSet::of_crd(&crd) {
                        phases.learn(set, "the CRD");
                    }
                }
                Err(e) if !failing => {
                    failing = true;
                    tracing::warn!(crd = name, error = %e, "cannot watch the CRD; retrying with backoff");
                }
                Err(_) => {}
            }
        }
    })
}

fn error_policy<K>(_obj: Arc<K>, error: &Error, _ctx: Arc<Context>) -> Action {
    tracing::warn!(%error, "reconcile failed; retrying in 5s");
    Action::requeue(Duration::from_secs(5))
}

async fn log_controller_result<T, E1, E2>(r: Result<T, kube::runtime::controller::Error<E1, E2>>)
where
    E1: std::error::Error + 'static,
    E2: std::error::Error + 'static,
{
    match r {
        Ok(_) => {}
        // An object deleted between its trigger and its reconcile (every PVB/PVR that Velero
        // deletes with its backup or restore): nothing to do, and nothing an operator should
        // be warned about once per object.
        Err(kube::runtime::controller::Error::ObjectNotFound(obj)) => {
            tracing::debug!(object = %obj, "deleted before its reconcile; nothing to do");
        }
        Err(e) => tracing::warn!(error = %e, "controller"),
    }
}

/// At most this many reconciles run at once per kind (they only claim, queue or cancel).
const RECONCILE_CONCURRENCY: u16 = 16;

/// A controller over a watch whose first complete list sets `synced`.
/// Only objects for which `ours` holds enter the cache and are reconciled; the others are dropped
/// as each list page or watch event is decoded. The namespace may hold 100,000 finished
/// PodVolumeBackups of other nodes (Velero keeps one per volume per backup): caching them, even
/// trimmed, made the agent's memory grow with the cluster (about 3 KB per object), and decoding a
/// list page of them whole set its high-water mark; [`watched::Watched`] decodes of another
/// node's object only its name, and of none the `managedFields`.
fn controller_for<K>(
    api: Api<watched::Watched<K>>,
    synced: Arc<AtomicBool>,
    ours: impl Fn(&K) -> bool + Send + Sync + 'static,
) -> (Controller<K>, Store<K>)
where
    K: watched::WatchedKind
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static,
{
    use kube::runtime::WatchStreamExt;
    use watched::Watched;
    let (reader, writer) = kube::runtime::reflector::store();
    let keep = move |w: Watched<K>| -> Option<K> {
        match w {
            Watched::Whole(k) => ours(&k).then_some(k),
            Watched::Other(_) => None,
            Watched::Undecodable(meta, why) => {
                tracing::warn!(
                    kind = %K::kind(&()),
                    name = meta.name.as_deref().unwrap_or(""),
                    namespace = meta.namespace.as_deref().unwrap_or(""),
                    reason = %why,
                    "object does not decode; not handled"
                );
                None
            }
        }
    };
    let stream = watcher(api, watcher::Config::default())
        .default_backoff()
        .try_filter_map(move |ev| {
            std::future::ready(Ok(match ev {
                watcher::Event::Apply(o) => keep(o).map(watcher::Event::Apply),
                watcher::Event::InitApply(o) => keep(o).map(watcher::Event::InitApply),
                watcher::Event::Delete(o) => keep(o).map(watcher::Event::Delete),
                watcher::Event::Init => Some(watcher::Event::Init),
                watcher::Event::InitDone => Some(watcher::Event::InitDone),
            }))
        })
        .inspect(move |ev| {
            if let Ok(watcher::Event::InitDone) = ev {
                synced.store(true, Ordering::SeqCst);
            }
        })
        .reflect(writer)
        .touched_objects();
    // Reconciles return at once; a bound keeps a burst of triggers from being a burst of memory.
    let config = kube::runtime::controller::Config::default().concurrency(RECONCILE_CONCURRENCY);
    (
        Controller::for_stream(stream, reader.clone()).with_config(config),
        reader,
    )
}

/// Runs the agent until SIGTERM/SIGINT; returns the process exit code.
pub async fn run(args: RunArgs) -> i32 {
    if let Err(e) = opsapi::check_auth_mode(&args) {
        tracing::error!("{e}");
        return 2;
    }
    let shutdown = CancellationToken::new();
    let ready = Arc::new(AtomicBool::new(false));
    let metrics = Arc::new(Metrics::new(&args.node_name));
    let registry = Registry::new(args.concurrency as usize, RETENTION);

    // Signals first, so a SIGTERM during start-up is honoured.
    {
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            use tokio::signal::unix::{SignalKind, signal};
            let (Ok(mut term), Ok(mut int)) = (
                signal(SignalKind::terminate()),
                signal(SignalKind::interrupt()),
            ) else {
                return;
            };
            tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
            tracing::info!("shutting down: no new claims, stopping running transfers");
            shutdown.cancel();
        });
    }
    let admin_state = admin::AdminState {
        ready: ready.clone(),
        shutdown: shutdown.clone(),
        metrics: metrics.clone(),
        registry: registry.clone(),
        ops: Arc::new(tokio::sync::OnceCell::new()),
    };
    let listener = match tokio::net::TcpListener::bind(args.listen_address).await {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(address = %args.listen_address, error = %e, "cannot listen");
            return 1;
        }
    };
    tokio::spawn(admin::serve(listener, admin_state.clone()));

    let client = match client(&args).await {
        Ok(c) => c,
        Err(e) => {
            tracing::error!("{e}");
            return 1;
        }
    };
    let Some((pvb_sub, pvr_sub)) = discover(&client, &shutdown).await else {
        return 0;
    };
    let node_agent_config = Arc::new(read_node_agent_config(&client, &args).await);
    let concurrency = match node_labels(&client, &args.node_name).await {
        Some(labels) => node_agent_config.concurrency(&labels),
        None => None,
    };
    if let Some(n) = concurrency {
        registry.set_concurrency(n);
        tracing::info!(
            concurrency = n,
            "transfers at once on this node: the node-agent ConfigMap's loadConcurrency (not --concurrency)"
        );
    }
    let pvb_phases = Arc::new(phases::KindPhases::new("PodVolumeBackup"));
    let pvr_phases = Arc::new(phases::KindPhases::new("PodVolumeRestore"));
    let crd_watches = [
        follow_crd_phases(
            client.clone(),
            "podvolumebackups.velero.io",
            pvb_phases.clone(),
        )
        .await,
        follow_crd_phases(
            client.clone(),
            "podvolumerestores.velero.io",
            pvr_phases.clone(),
        )
        .await,
    ];
    let state = match StateDir::open(&args.state_dir) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(dir = %args.state_dir.display(), error = %e, "cannot open the state dir");
            return 1;
        }
    };
    let engine = Engine::new(EngineConfig {
        restic_binary: args.restic_binary.clone(),
        kopia_binary: args.kopia_binary.clone(),
        update_interval: args.update_interval,
        cancel_grace: args.cancel_grace,
        // Velero's server creates repositories; one that is missing here is looked for in the
        // wrong place, and creating it would put the data where Velero will not look.
        init_missing_repository: args.init_missing_repository,
        lock_wait: args.lock_wait,
        child_record_dir: Some(args.state_dir.join("children")),
        ..EngineConfig::default()
    });
    storage::remove_leftovers(&args.scratch_dir);
    // Uploaders of a predecessor killed before it could stop them: their objects are run again.
    crate::runner::kill_recorded(&args.state_dir.join("children")).await;
    if let Err(e) = watched::set_node(&args.node_name) {
        tracing::error!("{e}");
        return 1;
    }
    let pvbs = Api::namespaced(client.clone(), &args.namespace);
    let pvrs = Api::namespaced(client.clone(), &args.namespace);
    let pvb_synced = Arc::new(AtomicBool::new(false));
    let pvr_synced = Arc::new(AtomicBool::new(false));
    let node = args.node_name.clone();
    let (pvb_controller, _pvb_store) =
        controller_for(pvbs, pvb_synced.clone(), move |o: &PodVolumeBackup| {
            o.spec.node == node
        });
    // A PodVolumeRestore names no node; which one it is for is found from its pod.
    let (pvr_controller, _pvr_store) =
        controller_for(pvrs, pvr_synced.clone(), |_: &PodVolumeRestore| true);
    let du_synced = Arc::new(AtomicBool::new(false));
    let dd_synced = Arc::new(AtomicBool::new(false));
    let (du_controller, dd_controller, data_movements) = if data_movement_served(&client).await {
        let (du, du_store) = controller_for(
            Api::namespaced(client.clone(), &args.namespace),
            du_synced.clone(),
            |_: &crate::datamover::DataUpload| true,
        );
        let (dd, dd_store) = controller_for(
            Api::namespaced(client.clone(), &args.namespace),
            dd_synced.clone(),
            |_: &crate::datamover::DataDownload| true,
        );
        (Some(du), Some(dd), Some((du_store, dd_store)))
    } else {
        du_synced.store(true, Ordering::SeqCst);
        dd_synced.store(true, Ordering::SeqCst);
        (None, None, None)
    };
    let reporter = Reporter {
        controller: "podvolume-agent".into(),
        instance: Some(args.node_name.clone()),
    };
    let ctx = Arc::new(Context {
        recorder: Recorder::new(client.clone(), reporter),
        owners: owner::OwnerCheck::new(
            client.clone(),
            args.namespace.clone(),
            args.update_interval,
        ),
        client,
        engine,
        registry: registry.clone(),
        metrics,
        state,
        shutdown: shutdown.clone(),
        pvb_status_subresource: pvb_sub,
        pvr_status_subresource: pvr_sub,
        pvb_phases,
        pvr_phases,
        du_phases: Arc::new(phases::KindPhases::new("DataUpload")),
        dd_phases: Arc::new(phases::KindPhases::new("DataDownload")),
        exposing: movement::Exposing::default(),
        node_agent_config: node_agent_config.clone(),
        nodes: node_health::NodeHealth::default(),
        data_movements,
        args: args.clone(),
    });
    let _ = admin_state.ops.set(ctx.clone());
    {
        // Ready once both watches have listed once (and stay ready across re-lists).
        let ready = ready.clone();
        tokio::spawn(async move {
            while !(pvb_synced.load(Ordering::SeqCst)
                && pvr_synced.load(Ordering::SeqCst)
                && du_synced.load(Ordering::SeqCst)
                && dd_synced.load(Ordering::SeqCst))
            {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            tracing::info!("watches synced; ready");
            ready.store(true, Ordering::SeqCst);
        });
    }
    {
        // Shutdown: tell every running transfer to stop (leaving its object for the next start).
        let registry = registry.clone();
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            shutdown.cancelled().await;
            registry.cancel_all(CancelReason::Shutdown);
        });
    }
    let pvb_run = pvb_controller
        .graceful_shutdown_on(shutdown.clone().cancelled_owned())
        .run(backup::reconcile, error_policy, ctx.clone())
        .for_each(log_controller_result);
    let pvr_run = pvr_controller
        .graceful_shutdown_on(shutdown.clone().cancelled_owned())
        .run(restore::reconcile, error_policy, ctx.clone())
        .for_each(log_controller_result);
    // Every node sees every DataUpload and DataDownload of the built-in mover: any may claim a
    // New one.
    let du_run = async {
        if let Some(controller) = du_controller {
            controller
                .graceful_shutdown_on(shutdown.clone().cancelled_owned())
                .run(movement::reconcile, error_policy, ctx.clone())
                .for_each(log_controller_result)
                .await;
        }
    };
    let dd_run = async {
        if let Some(controller) = dd_controller {
            controller
                .graceful_shutdown_on(shutdown.clone().cancelled_owned())
                .run(movement::reconcile, error_policy, ctx.clone())
                .for_each(log_controller_result)
                .await;
        }
    };
    tracing::info!(node = %args.node_name, namespace = %args.namespace, "node agent started");
    futures::join!(pvb_run, pvr_run, du_run, dd_run);
    for w in crd_watches {
        w.abort();
    }
    // Transfers stop with SIGINT, SIGKILL after the grace period, then `restic unlock`.
    let bound = args.cancel_grace + Duration::from_secs(20);
    if tokio::time::timeout(bound, registry.drained())
        .await
        .is_err()
    {
        tracing::warn!("some transfers did not stop in time");
    }
    tracing::info!("stopped");
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kopia_gets_one_cache_dir_per_repository_restic_one_for_all() {
        let scratch = std::path::Path::new("/scratch");
        let a = uploader_cache_dir(scratch, UploaderKind::Kopia, "/repos/ns1");
        let b = uploader_cache_dir(scratch, UploaderKind::Kopia, "/repos/ns2");
        assert_ne!(a, b);
        assert_eq!(
            a,
            uploader_cache_dir(scratch, UploaderKind::Kopia, "/repos/ns1")
        );
        // Stable across builds: a changed hash would orphan every node's kopia cache. FNV-1a's
        // published vector, and this path's value computed apart.
        assert_eq!(crate::text::fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(a, scratch.join(".cache/kopia/_repos_ns1-98c75875e6cf87b2"));
        // Whatever the identifier holds, one component under the uploader's dir.
        let hostile = uploader_cache_dir(scratch, UploaderKind::Kopia, "../../etc/\u{e9}x/..");
        assert_eq!(
            hostile.parent(),
            Some(scratch.join(".cache/kopia").as_path())
        );
        assert!(
            !hostile
                .file_name()
                .unwrap()
                .to_str()
                .unwrap()
                .contains("..")
        );
        assert_eq!(
            uploader_cache_dir(scratch, UploaderKind::Restic, "/repos/ns1"),
            uploader_cache_dir(scratch, UploaderKind::Restic, "s3:https://x/b/ns2")
        );
    }

    #[test]
    fn private_files_written_at_once_by_many_all_land_whole() {
        let dir = tempfile::tempdir().unwrap();
        let threads: Vec<_> = (0..8u8)
            .map(|t| {
                let dir = dir.path().to_path_buf();
                std::thread::spawn(move || {
                    for _ in 0..300 {
                        let data = vec![t; 4096];
                        let path = write_private(&dir, "repository-password", &data)
                            .expect("every write succeeds");
                        let read = std::fs::read(&path).unwrap();
                        // Whole: some thread's 4096 bytes, never a truncated or mixed file.
                        assert_eq!(read.len(), 4096);
                        assert!(read.iter().all(|b| *b == read[0]));
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().flatten().collect();
        assert_eq!(left.len(), 1, "no temporary file left: {left:?}");
    }
}
