//! Test-only Kubernetes API server stand-in for podvolume-agent's end-to-end tests.
//!
//! [`TestApiServer::start`] serves plain HTTP on `127.0.0.1:<ephemeral port>` and writes a
//! kubeconfig for it. It implements the slice of the Kubernetes API the agent uses (discovery,
//! CRDs with pruning and the status subresource, core/v1 objects, list/watch with selectors,
//! patches, managedFields, finalizers, TokenReview/SubjectAccessReview) with the semantics of a
//! real API server, plus fault injection and a request log driven from the test through this
//! handle.
//! See `testbed/README.md` for the list of behaviours and the limits.

mod auth;
mod discovery;
mod error;
mod faults;
mod managed;
mod patch;
mod resources;
mod schema;
mod selectors;
mod server;
mod store;

pub use auth::{AccessRequest, Authorizer, UserInfo};
pub use error::ApiError;
pub use faults::{RequestInfo, RequestMatch, RequestRecord, WRITE_VERBS};

use faults::{FaultAction, FaultRule, Faults};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use server::{Shared, lock};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use store::{Store, WriteMode};
use tokio::sync::watch;

/// Bearer token written into the generated kubeconfig.
pub const DEFAULT_TOKEN: &str = "podvolume-testbed-token";

/// Directory of Velero's own CRDs (`<workspace>/../shared/reference/velero-crds`).
pub fn velero_crds_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/reference/velero-crds")
}

/// Options for [`TestApiServer`].
#[derive(Debug, Clone)]
pub struct TestApiServerBuilder {
    history_limit: usize,
    bookmark_interval: Duration,
    version: (String, String),
}

impl Default for TestApiServerBuilder {
    fn default() -> Self {
        TestApiServerBuilder {
            history_limit: 10_000,
            bookmark_interval: Duration::from_secs(5),
            version: ("1".into(), "30".into()),
        }
    }
}

impl TestApiServerBuilder {
    /// How many write events the watch history keeps (older resourceVersions get 410 Gone).
    pub fn history_limit(mut self, n: usize) -> Self {
        self.history_limit = n.max(1);
        self
    }

    /// Interval of BOOKMARK events on watches that allow them (default 5 s).
    pub fn bookmark_interval(mut self, d: Duration) -> Self {
        self.bookmark_interval = d;
        self
    }

    /// What `/version` answers (default 1.30).
    pub fn server_version(mut self, major: &str, minor: &str) -> Self {
        self.version = (major.into(), minor.into());
        self
    }

    pub async fn start(self) -> std::io::Result<TestApiServer> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (down, _) = watch::channel(false);
        let (close_watches, _) = watch::channel(0);
        let shared = Arc::new(Shared {
            store: Mutex::new(Store::new(self.history_limit)),
            faults: Mutex::new(Faults::default()),
            log: Mutex::new(Vec::new()),
            auth: Mutex::new(Default::default()),
            down,
            down_epoch: AtomicU64::new(0),
            close_watches,
            bookmark_interval: Mutex::new(self.bookmark_interval),
            version: self.version,
            addr,
        });
        let dir = tempfile::Builder::new()
            .prefix("podvolume-testbed-")
            .tempdir()?;
        let kubeconfig_path = dir.path().join("kubeconfig");
        std::fs::write(&kubeconfig_path, kubeconfig_yaml(addr))?;
        let accept_task = tokio::spawn(server::accept_loop(listener, shared.clone()));
        Ok(TestApiServer {
            shared,
            addr,
            dir: Some(dir),
            kubeconfig_path,
            accept_task,
        })
    }
}

fn kubeconfig_yaml(addr: SocketAddr) -> String {
    format!(
        "apiVersion: v1
kind: Config
clusters:
- name: podvolume-testbed
  cluster:
    server: http://{addr}
contexts:
- name: podvolume-testbed
  context:
    cluster: podvolume-testbed
    user: podvolume-testbed
    namespace: default
current-context: podvolume-testbed
users:
- name: podvolume-testbed
  user:
    token: {DEFAULT_TOKEN}
"
    )
}

fn split_api_version(api_version: &str) -> (&str, &str) {
    match api_version.split_once('/') {
        Some((g, v)) => (g, v),
        None => ("", api_version),
    }
}

/// A running stand-in. Dropping it stops the server and removes the kubeconfig.
pub struct TestApiServer {
    shared: Arc<Shared>,
    addr: SocketAddr,
    dir: Option<tempfile::TempDir>,
    kubeconfig_path: PathBuf,
    accept_task: tokio::task::JoinHandle<()>,
}

impl Drop for TestApiServer {
    fn drop(&mut self) {
        self.accept_task.abort();
        self.shared.down.send_replace(true);
    }
}

impl TestApiServer {
    /// Start with default options.
    pub async fn start() -> std::io::Result<Self> {
        Self::builder().start().await
    }

    pub fn builder() -> TestApiServerBuilder {
        TestApiServerBuilder::default()
    }

    /// `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The generated kubeconfig (token user, namespace `default`).
    pub fn kubeconfig_path(&self) -> &Path {
        &self.kubeconfig_path
    }

    /// Keep the kubeconfig file (and its directory) after the server is dropped.
    pub fn keep_kubeconfig(&mut self) -> PathBuf {
        if let Some(dir) = self.dir.take() {
            let _ = dir.keep();
        }
        self.kubeconfig_path.clone()
    }

    /// The `kube::Config` of the generated kubeconfig (to adjust, e.g. `default_retry`).
    pub async fn config(&self) -> kube::Config {
        let kc = kube::config::Kubeconfig::read_from(&self.kubeconfig_path)
            .expect("read the testbed kubeconfig");
        kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
            .await
            .expect("testbed kubeconfig is valid")
    }

    /// A `kube::Client` built from the generated kubeconfig. Note that kube's default client
    /// retries 429/503/504 answers by itself (`Config::default_retry`).
    pub async fn client(&self) -> kube::Client {
        kube::Client::try_from(self.config().await).expect("build a kube client for the testbed")
    }

    // ----- CRDs -----

    /// Create or update every CustomResourceDefinition in a (multi-document) YAML text.
    pub fn apply_crd_yaml(&self, yaml: &str) -> Result<Vec<Value>, ApiError> {
        let mut out = Vec::new();
        for doc in serde_norway::Deserializer::from_str(yaml) {
            let v: Value = serde::Deserialize::deserialize(doc)
                .map_err(|e| ApiError::bad_request(format!("error decoding YAML: {e}")))?;
            if v.is_null() {
                continue;
            }
            let mut store = lock(&self.shared.store);
            out.push(server::upsert_crd(&mut store, v, WriteMode::Direct, None)?);
        }
        Ok(out)
    }

    /// [`apply_crd_yaml`](Self::apply_crd_yaml) on a file.
    pub fn apply_crd_file(&self, path: impl AsRef<Path>) -> Result<Vec<Value>, ApiError> {
        let text = std::fs::read_to_string(path.as_ref()).map_err(|e| {
            ApiError::bad_request(format!("reading {}: {e}", path.as_ref().display()))
        })?;
        self.apply_crd_yaml(&text)
    }

    /// Install Velero's own PodVolumeBackup/PodVolumeRestore CRDs (no status subresource).
    pub fn install_velero_crds(&self) -> Result<(), ApiError> {
        for f in [
            "velero.io_podvolumebackups.yaml",
            "velero.io_podvolumerestores.yaml",
        ] {
            self.apply_crd_file(velero_crds_dir().join(f))?;
        }
        Ok(())
    }

    /// Install the PodVolumeBackup/PodVolumeRestore CRDs of Velero 1.16 and older
    /// (`velero-crds/v1.15/`): no status subresource, and a `status.phase` enum of only New,
    /// InProgress, Completed and Failed, refused otherwise with 422 as a real API server does.
    pub fn install_velero_116_crds(&self) -> Result<(), ApiError> {
        for f in [
            "v1.15/velero.io_podvolumebackups.yaml",
            "v1.15/velero.io_podvolumerestores.yaml",
        ] {
            self.apply_crd_file(velero_crds_dir().join(f))?;
        }
        Ok(())
    }

    /// Install Velero's BackupStorageLocation CRD (the node agent reads the location of each
    /// PodVolumeBackup/PodVolumeRestore).
    pub fn install_storage_location_crd(&self) -> Result<(), ApiError> {
        self.apply_crd_file(velero_crds_dir().join("velero.io_backupstoragelocations.yaml"))?;
        Ok(())
    }

    // ----- direct store access (no faults, not logged) -----

    fn lookup(
        &self,
        api_version: &str,
        plural: &str,
    ) -> Result<(resources::ResourceInfo, String), ApiError> {
        let (g, v) = split_api_version(api_version);
        let store = lock(&self.shared.store);
        let res = store
            .resource(g, plural)
            .filter(|r| r.version(v).is_some())
            .cloned()
            .ok_or_else(ApiError::no_route)?;
        Ok((res, v.to_string()))
    }

    /// The stored object, with `apiVersion` as asked.
    pub fn get_json(
        &self,
        api_version: &str,
        plural: &str,
        namespace: Option<&str>,
        name: &str,
    ) -> Option<Value> {
        let (res, v) = self.lookup(api_version, plural).ok()?;
        let mut obj = lock(&self.shared.store).get(&res, namespace, name)?;
        obj["apiVersion"] = Value::String(res.api_version(&v));
        Some(obj)
    }

    /// Stored objects of a resource (all namespaces when `namespace` is None).
    pub fn list_json(
        &self,
        api_version: &str,
        plural: &str,
        namespace: Option<&str>,
    ) -> Vec<Value> {
        let Ok((res, v)) = self.lookup(api_version, plural) else {
            return Vec::new();
        };
        let store = lock(&self.shared.store);
        store
            .list(&res, namespace)
            .into_iter()
            .map(|mut o| {
                o["apiVersion"] = Value::String(res.api_version(&v));
                o
            })
            .collect()
    }

    /// Create or replace an object (found by its apiVersion and kind) for test setup: the
    /// whole object including status is written, without preconditions; pruning,
    /// resourceVersion, generation, events and finalizer semantics apply as for API writes.
    /// `metadata.managedFields` are stored as given (none computed): see
    /// [`put_json_as`](Self::put_json_as) for objects as a real API server would store them.
    pub fn put_json(&self, obj: Value) -> Result<Value, ApiError> {
        self.put_direct(obj, None)
    }

    /// [`put_json`](Self::put_json) as written by `manager`: the object is created or replaced
    /// in the same way, and `metadata.managedFields` are recorded as for an API write (operation
    /// `Update`) by that manager: on a create it owns every field; on a replace it takes the
    /// fields whose value it changed or added, and fields no longer there are nobody's. With
    /// `subresource` `Some("status")` it writes as through `/status` (entry with
    /// `subresource: status`, owning only the status fields it changed); that needs a resource
    /// with the status subresource (404 otherwise, as the real server answers). managedFields
    /// in `obj` replace the stored ones first (none given: the stored ones are kept; `[]`: reset;
    /// with `Some("status")` they are ignored).
    ///
    /// E.g. a Velero PodVolumeBackup: created by `velero-server` without status, then written
    /// with its status by `node-agent-server` (Velero's CRD has no status subresource: `None`).
    pub fn put_json_as(
        &self,
        manager: &str,
        subresource: Option<&str>,
        obj: Value,
    ) -> Result<Value, ApiError> {
        if subresource.is_some_and(|s| s != "status") {
            return Err(ApiError::bad_request(format!(
                "unsupported subresource {subresource:?} (only \"status\")"
            )));
        }
        self.put_direct(obj, Some(managed::Writer::update(manager, subresource)))
    }

    fn put_direct(&self, obj: Value, writer: Option<managed::Writer>) -> Result<Value, ApiError> {
        let api_version = obj.get("apiVersion").and_then(Value::as_str).unwrap_or("");
        let kind = obj.get("kind").and_then(Value::as_str).unwrap_or("");
        let (g, v) = split_api_version(api_version);
        let v = v.to_string();
        let mut store = lock(&self.shared.store);
        let res = store
            .resource_by_kind(g, kind)
            .filter(|r| r.version(&v).is_some())
            .cloned()
            .ok_or_else(|| {
                ApiError::bad_request(format!("no resource for {api_version} {kind}"))
            })?;
        if writer.as_ref().is_some_and(|w| w.subresource.is_some())
            && !res.version(&v).is_some_and(|vi| vi.status_subresource)
        {
            return Err(ApiError::no_route());
        }
        let writer = writer.as_ref();
        if res.group == "apiextensions.k8s.io" && res.kind == "CustomResourceDefinition" {
            return server::upsert_crd(&mut store, obj, WriteMode::Direct, writer);
        }
        let ns = obj
            .pointer("/metadata/namespace")
            .and_then(Value::as_str)
            .map(str::to_string)
            .or_else(|| res.namespaced.then(|| "default".to_string()));
        let name = obj
            .pointer("/metadata/name")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        if !name.is_empty() && store.contains(&res, ns.as_deref(), &name) {
            store.update(
                &res,
                &v,
                ns.as_deref(),
                &name,
                obj,
                WriteMode::Direct,
                true,
                writer,
            )
        } else {
            store.create(&res, &v, ns.as_deref(), obj, WriteMode::Direct, writer)
        }
    }

    /// Delete like an API DELETE (finalizers respected), bypassing faults.
    pub fn delete_json(
        &self,
        api_version: &str,
        plural: &str,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Value, ApiError> {
        let (res, _) = self.lookup(api_version, plural)?;
        lock(&self.shared.store).delete(&res, namespace, name, &Value::Null)
    }

    /// Typed [`get_json`](Self::get_json).
    pub fn get<K>(&self, namespace: Option<&str>, name: &str) -> Option<K>
    where
        K: kube::Resource<DynamicType = ()> + DeserializeOwned,
    {
        let v = self.get_json(&K::api_version(&()), &K::plural(&()), namespace, name)?;
        serde_json::from_value(v).ok()
    }

    /// Typed [`list_json`](Self::list_json).
    pub fn list<K>(&self, namespace: Option<&str>) -> Vec<K>
    where
        K: kube::Resource<DynamicType = ()> + DeserializeOwned,
    {
        self.list_json(&K::api_version(&()), &K::plural(&()), namespace)
            .into_iter()
            .filter_map(|v| serde_json::from_value(v).ok())
            .collect()
    }

    /// Typed [`put_json`](Self::put_json).
    pub fn put<K>(&self, obj: &K) -> Result<K, ApiError>
    where
        K: kube::Resource<DynamicType = ()> + Serialize + DeserializeOwned,
    {
        let mut v = serde_json::to_value(obj)
            .map_err(|e| ApiError::bad_request(format!("serializing: {e}")))?;
        v["apiVersion"] = Value::String(K::api_version(&()).into_owned());
        v["kind"] = Value::String(K::kind(&()).into_owned());
        let out = self.put_json(v)?;
        serde_json::from_value(out).map_err(|e| ApiError::bad_request(format!("decoding: {e}")))
    }

    /// The current global resourceVersion.
    pub fn resource_version(&self) -> u64 {
        lock(&self.shared.store).rv
    }

    // ----- watch history -----

    /// Forget the event history (like etcd compaction): a watch from any older
    /// resourceVersion gets an in-stream 410 Gone ERROR event.
    pub fn compact_history(&self) {
        lock(&self.shared.store).compact();
    }

    pub fn set_history_limit(&self, n: usize) {
        lock(&self.shared.store).set_history_limit(n);
    }

    /// End every open watch stream cleanly (as if its timeout expired).
    pub fn close_watches(&self) {
        self.shared.close_watches.send_modify(|n| *n += 1);
    }

    /// Interval of BOOKMARK events for watches opened from now on.
    pub fn set_bookmark_interval(&self, d: Duration) {
        *lock(&self.shared.bookmark_interval) = d;
    }

    // ----- faults -----

    fn add_rule(
        &self,
        matcher: RequestMatch,
        action: FaultAction,
        remaining: Option<u32>,
        window: Option<Duration>,
    ) {
        lock(&self.shared.faults).rules.push(FaultRule {
            matcher,
            action,
            remaining,
            until: window.map(|w| Instant::now() + w),
        });
    }

    /// Answer `code` (e.g. 500, 503) with a Status object to the next `n` matching requests.
    pub fn fail_next(&self, m: RequestMatch, n: u32, code: u16) {
        self.add_rule(m, FaultAction::Error(code), Some(n), None);
    }

    /// Answer `code` to every matching request during `window`.
    pub fn fail_for(&self, m: RequestMatch, window: Duration, code: u16) {
        self.add_rule(m, FaultAction::Error(code), None, Some(window));
    }

    /// Close the connection without answering the next `n` matching requests.
    pub fn drop_next(&self, m: RequestMatch, n: u32) {
        self.add_rule(m, FaultAction::Drop, Some(n), None);
    }

    /// Close the connection without answering every matching request during `window`.
    pub fn drop_for(&self, m: RequestMatch, window: Duration) {
        self.add_rule(m, FaultAction::Drop, None, Some(window));
    }

    /// Answer 409 Conflict (without writing) to the next `n` matching writes.
    pub fn conflict_next(&self, m: RequestMatch, n: u32) {
        let m = if m.has_verbs() { m } else { m.writes() };
        self.add_rule(m, FaultAction::Conflict, Some(n), None);
    }

    /// Delay every matching request by `delay` (until [`clear_faults`](Self::clear_faults),
    /// or during `window` if given).
    pub fn add_latency(&self, m: RequestMatch, delay: Duration, window: Option<Duration>) {
        self.add_rule(m, FaultAction::Latency(delay), None, window);
    }

    /// Remove every fault rule and bring the server back up.
    pub fn clear_faults(&self) {
        lock(&self.shared.faults).rules.clear();
        self.set_server_down(false);
    }

    /// Server down: close every open connection (watches included) and every new one at
    /// once, until set back to false.
    pub fn set_server_down(&self, down: bool) {
        self.shared.down_epoch.fetch_add(1, Ordering::SeqCst);
        self.shared.down.send_replace(down);
    }

    /// Server down during `window` (needs a Tokio runtime).
    pub fn server_down_for(&self, window: Duration) {
        let epoch = self.shared.down_epoch.fetch_add(1, Ordering::SeqCst) + 1;
        self.shared.down.send_replace(true);
        let shared = self.shared.clone();
        tokio::spawn(async move {
            tokio::time::sleep(window).await;
            if shared.down_epoch.load(Ordering::SeqCst) == epoch {
                shared.down.send_replace(false);
            }
        });
    }

    // ----- request log -----

    /// Every request received so far (faulted ones included), oldest first.
    pub fn request_log(&self) -> Vec<RequestRecord> {
        lock(&self.shared.log).clone()
    }

    /// Requests that wrote (create, update, patch, delete, deletecollection).
    pub fn write_log(&self) -> Vec<RequestRecord> {
        lock(&self.shared.log)
            .iter()
            .filter(|r| r.is_write())
            .cloned()
            .collect()
    }

    /// How many requests matched, e.g.
    /// `RequestMatch::any().verb("patch").resource("podvolumebackups").subresource(None)`.
    pub fn request_count(&self, m: &RequestMatch) -> usize {
        lock(&self.shared.log)
            .iter()
            .filter(|r| m.matches(&r.info))
            .count()
    }

    /// Counts per (verb, resource, subresource) ("" for none).
    pub fn request_counts(&self) -> std::collections::BTreeMap<(String, String, String), usize> {
        let mut out = std::collections::BTreeMap::new();
        for r in lock(&self.shared.log).iter() {
            let key = (
                r.info.verb.clone(),
                r.info.resource.clone().unwrap_or_default(),
                r.info.subresource.clone().unwrap_or_default(),
            );
            *out.entry(key).or_insert(0) += 1;
        }
        out
    }

    pub fn clear_request_log(&self) {
        lock(&self.shared.log).clear();
    }

    // ----- authentication / authorization reviews -----

    /// Make `token` valid for TokenReviews, authenticating as `user`.
    pub fn set_token(&self, token: &str, user: UserInfo) {
        lock(&self.shared.auth)
            .tokens
            .insert(token.to_string(), user);
    }

    pub fn remove_token(&self, token: &str) {
        lock(&self.shared.auth).tokens.remove(token);
    }

    /// Decide SubjectAccessReviews (default: allow everything).
    pub fn set_authorizer(&self, f: impl Fn(&AccessRequest) -> bool + Send + Sync + 'static) {
        lock(&self.shared.auth).authorizer = Arc::new(f);
    }
}
