//! Writing status to PodVolumeBackups/PodVolumeRestores.
//!
//! Every write is a JSON merge patch carrying the `metadata.resourceVersion` we last saw, so the API
//! server refuses it (409) when someone changed the object meanwhile. On a conflict the object is
//! read again: if it reached a terminal phase, nothing is written (never overwrite a result); if
//! not, the write is retried on the fresh version. Only `status` and our own metadata (finalizers,
//! annotations) are ever patched, so a concurrent `spec.cancel: true` always survives.
//!
//! Velero's CRDs have no status subresource: status is patched on the main object. Our CRDs have
//! it: status goes to `/status`, metadata to the main object. Which one applies is found by API
//! discovery at start.

use std::fmt::Debug;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Recorder};
use kube::{Api, Resource};
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

use super::metrics::Metrics;
use super::phases::{KindPhases, PhaseSet};
use crate::crd::{FINALIZER, Phase, PodVolumeBackup, PodVolumeRestore};

/// The manager the API server records in `managedFields` for the agent's writes (kube's client
/// sends no User-Agent, so without it they would be `unknown` to `kubectl get -o yaml`).
pub const FIELD_MANAGER: &str = "podvolume-agent";

/// What the agent needs to know of either kind.
pub trait VolumeObject:
    Resource<DynamicType = ()> + Clone + Debug + DeserializeOwned + Send + Sync + 'static
{
    const KIND: &'static str;
    /// The operation name in metrics: `backup` or `restore`.
    const OPERATION: &'static str;
    /// The kind of Velero object a transfer of this kind belongs to.
    const OWNER: super::owner::OwnerKind;
    /// The finalizer the agent keeps on an object it is moving (Velero's, per kind).
    const FINALIZER: &'static str;
    /// A Velero async item operation (DataUpload, DataDownload): its Backup/Restore waits for it
    /// in `WaitingForPluginOperations`, not inside `InProgress`.
    const ASYNC_OPERATION: bool;
    fn phase(&self) -> Phase;
    /// When the object was claimed (orders the queue).
    fn accepted_timestamp(&self) -> Option<&Time>;
    fn cancel_requested(&self) -> bool;
    /// How many times a transfer of this object was started (runs interrupted by restarts).
    fn attempts(&self) -> u32 {
        self.meta()
            .annotations
            .as_ref()
            .and_then(|a| a.get(crate::crd::ATTEMPTS_ANNOTATION))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    }
}

// Both kinds have the same status and spec fields for these; one body serves both.
macro_rules! volume_object {
    ($kind:ty, $name:literal, $operation:literal, $owner:expr, $finalizer:expr, $async_op:literal) => {
        impl VolumeObject for $kind {
            const KIND: &'static str = $name;
            const OPERATION: &'static str = $operation;
            const OWNER: super::owner::OwnerKind = $owner;
            const FINALIZER: &'static str = $finalizer;
            const ASYNC_OPERATION: bool = $async_op;
            fn phase(&self) -> Phase {
                self.status
                    .as_ref()
                    .and_then(|s| s.phase)
                    .unwrap_or(Phase::New)
            }
            fn accepted_timestamp(&self) -> Option<&Time> {
                self.status
                    .as_ref()
                    .and_then(|s| s.accepted_timestamp.as_ref())
            }
            fn cancel_requested(&self) -> bool {
                self.spec.cancel == Some(true)
                    || self.metadata.deletion_timestamp.is_some()
                    || self
                        .metadata
                        .annotations
                        .as_ref()
                        .and_then(|a| a.get(crate::crd::CANCEL_ANNOTATION))
                        .is_some_and(|v| v == "true")
            }
        }
    };
}

volume_object!(
    PodVolumeBackup,
    "PodVolumeBackup",
    "backup",
    super::owner::OwnerKind::Backup,
    FINALIZER,
    false
);
volume_object!(
    PodVolumeRestore,
    "PodVolumeRestore",
    "restore",
    super::owner::OwnerKind::Restore,
    FINALIZER,
    false
);
volume_object!(
    crate::datamover::DataUpload,
    "DataUpload",
    "data_upload",
    super::owner::OwnerKind::Backup,
    super::movement::FINALIZER,
    true
);
volume_object!(
    crate::datamover::DataDownload,
    "DataDownload",
    "data_download",
    super::owner::OwnerKind::Restore,
    super::movement::FINALIZER,
    true
);

#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error("the object no longer exists")]
    Gone,
    #[error("the object is already {0:?}; its result is not overwritten")]
    Terminal(Phase),
    #[error("{0}")]
    Api(#[source] kube::Error),
}

impl WriteError {
    /// Worth retrying later: the API server is down, slow, overloaded or busy with conflicts
    /// (no answer, 5xx, 429, 409 after the writer's own retries), as opposed to refused for good
    /// (403 from RBAC or a webhook, 422, 400) or final (gone, terminal).
    pub fn is_transient(&self) -> bool {
        match self {
            WriteError::Api(kube::Error::Api(s)) => {
                s.code >= 500 || s.code == 429 || s.code == 409 || s.code == 408
            }
            WriteError::Api(_) => true,
            WriteError::Gone | WriteError::Terminal(_) => false,
        }
    }
}

fn is_status(e: &kube::Error, code: u16) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == code)
}

/// Writes one object's status, tracking its resourceVersion across writes.
pub struct ObjectWriter<K: VolumeObject> {
    api: Api<K>,
    name: String,
    subresource: bool,
    resource_version: Option<String>,
    /// The object's finalizers at `resource_version`: a finalizer change is computed from them on
    /// every attempt, so a retry after a conflict never drops a finalizer someone else added.
    finalizers: Vec<String>,
    /// The phase at `resource_version`. Once it is terminal no status write is sent, whoever
    /// wrote it: a result Velero (or anyone) wrote is final, and Velero may already have acted
    /// on it. Checking only after a 409 is not enough: the re-read takes the terminal version,
    /// so the next write would go through without a conflict.
    phase: Phase,
    /// The phases this kind's CRD allows: every status is adapted to them before it is sent.
    phases: Arc<KindPhases>,
    metrics: Arc<Metrics>,
    /// A refused write (422) is told on the object as an Event, for `kubectl describe`.
    recorder: Recorder,
    object_ref: ObjectReference,
}

/// What a write does to our finalizer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finalizer {
    Keep,
    Add,
    Remove,
}

const CONFLICT_RETRIES: u32 = 8;

impl<K: VolumeObject> ObjectWriter<K> {
    pub fn new(
        api: Api<K>,
        obj: &K,
        subresource: bool,
        phases: Arc<KindPhases>,
        metrics: Arc<Metrics>,
        recorder: Recorder,
    ) -> Self {
        Self {
            api,
            name: obj.meta().name.clone().unwrap_or_default(),
            subresource,
            resource_version: obj.meta().resource_version.clone(),
            finalizers: obj.meta().finalizers.clone().unwrap_or_default(),
            phase: obj.phase(),
            phases,
            metrics,
            recorder,
            object_ref: obj.object_ref(&()),
        }
    }

    fn seen(&mut self, o: &K) {
        self.resource_version = o.meta().resource_version.clone();
        self.finalizers = o.meta().finalizers.clone().unwrap_or_default();
        self.phase = o.phase();
    }

    /// `metadata.finalizers` after `change`, or `None` when it changes nothing.
    fn finalizers_after(&self, change: Finalizer) -> Option<Value> {
        let has = self.finalizers.iter().any(|f| f == K::FINALIZER);
        let next: Vec<&String> = match (change, has) {
            (Finalizer::Add, false) => self.finalizers.iter().collect(),
            (Finalizer::Remove, true) => self
                .finalizers
                .iter()
                .filter(|f| *f != K::FINALIZER)
                .collect(),
            _ => return None,
        };
        let mut next: Vec<Value> = next.into_iter().map(|f| Value::String(f.clone())).collect();
        if change == Finalizer::Add {
            next.push(Value::String(K::FINALIZER.to_string()));
        }
        Some(json!({ "finalizers": next }))
    }

    /// The terminal write: the result and the removal of our finalizer. With status on the main
    /// object (Velero's CRDs) this is one patch, so nobody ever sees the result with our finalizer
    /// still on; with a status subresource it takes two requests, the result first, so a deletion
    /// can never remove the object before its result is written.
    pub async fn write_result(&mut self, status: Value) -> Result<K, WriteError> {
        if self.subresource {
            let written = self.write_with(Some(status), None, Finalizer::Keep).await?;
            // The result is in: a finalizer that cannot be removed now is removed by the
            // reconcile of the terminal object (our own write triggers one), not by writing the
            // result again.
            match self.write_with(None, None, Finalizer::Remove).await {
                Ok(o) => Ok(o),
                Err(WriteError::Gone) => Ok(written),
                Err(e) => {
                    tracing::warn!(error = %e, "result written; our finalizer is removed later");
                    Ok(written)
                }
            }
        } else {
            self.write_with(Some(status), None, Finalizer::Remove).await
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Reads the object again (after a conflict, or to check on it).
    pub async fn refresh(&mut self) -> Result<K, WriteError> {
        match self.api.get(&self.name).await {
            Ok(o) => {
                self.seen(&o);
                Ok(o)
            }
            Err(e) if is_status(&e, 404) => Err(WriteError::Gone),
            Err(e) => Err(WriteError::Api(e)),
        }
    }

    /// Patches `status` (merge) and, when given, `metadata` fields. A status write is not retried
    /// over a terminal phase someone else wrote (`WriteError::Terminal`).
    pub async fn write(
        &mut self,
        status: Option<Value>,
        metadata: Option<Value>,
    ) -> Result<K, WriteError> {
        self.write_with(status, metadata, Finalizer::Keep).await
    }

    /// Adds or removes our finalizer (alone, on the main object).
    pub async fn set_finalizer(&mut self, change: Finalizer) -> Result<K, WriteError> {
        self.write_with(None, None, change).await
    }

    async fn write_with(
        &mut self,
        status: Option<Value>,
        metadata: Option<Value>,
        finalizer: Finalizer,
    ) -> Result<K, WriteError> {
        let mut attempt = 0;
        loop {
            if status.is_some() && self.phase.is_terminal() {
                return Err(WriteError::Terminal(self.phase));
            }
            // Adapted on every attempt: a refusal below may have taught a smaller set.
            let status = status.clone().map(|s| self.phases.adapt(s));
            let mut metadata = metadata.clone();
            if let Some(Value::Object(f)) = self.finalizers_after(finalizer) {
                match &mut metadata {
                    Some(Value::Object(m)) => m.extend(f),
                    _ => metadata = Some(Value::Object(f)),
                }
            }
            match self.try_write(status.as_ref(), metadata.as_ref()).await {
                Ok(o) => return Ok(o),
                // A phase the CRD does not have (Velero <= 1.16's four): learn the set from the
                // refusal and send what the server accepts. Only when that changes the set, so a
                // refusal the adaptation cannot mend is returned, not retried for ever.
                Err(kube::Error::Api(s))
                    if s.code == 422
                        && PhaseSet::of_refusal(&s.message).is_some_and(|set| {
                            self.phases.learn(set, "a refused status write")
                        }) =>
                {
                    attempt += 1;
                    tracing::warn!(reason = %s.message, "status write refused (422); writing the phases the CRD allows");
                    self.refused(&s.message, "writing the phases the CRD allows instead")
                        .await;
                }
                Err(e) if is_status(&e, 409) && attempt < CONFLICT_RETRIES => {
                    attempt += 1;
                    // The loop's first check refuses the status write if this made it terminal.
                    self.refresh().await?;
                    tokio::time::sleep(Duration::from_millis(50 * u64::from(attempt))).await;
                }
                Err(e) if is_status(&e, 404) => return Err(WriteError::Gone),
                Err(kube::Error::Api(s)) if s.code == 422 => {
                    self.refused(&s.message, "not retried").await;
                    return Err(WriteError::Api(kube::Error::Api(s)));
                }
                Err(e) => return Err(WriteError::Api(e)),
            }
        }
    }

    /// An Event (Warning, `StatusRefused`) with the API server's reason; failures to publish it
    /// are only logged at debug level.
    async fn refused(&self, reason: &str, then: &str) {
        let ev = Event {
            type_: EventType::Warning,
            reason: "StatusRefused".into(),
            note: Some(crate::text::truncate(
                &format!("status write refused by the API server: {reason}; {then}"),
                1000,
            )),
            action: "StatusWrite".into(),
            secondary: None,
        };
        if let Err(e) = self.recorder.publish(&ev, &self.object_ref).await {
            tracing::debug!(error = %e, "could not publish an event");
        }
    }

    async fn try_write(
        &mut self,
        status: Option<&Value>,
        metadata: Option<&Value>,
    ) -> Result<K, kube::Error> {
        let pp = PatchParams {
            field_manager: Some(FIELD_MANAGER.to_string()),
            ..PatchParams::default()
        };
        let mut last = None;
        let mut meta = json!({ "resourceVersion": self.resource_version });
        if let (Some(Value::Object(extra)), Value::Object(m)) = (metadata, &mut meta) {
            m.extend(extra.clone());
        }
        if self.subresource {
            if metadata.is_some() {
                let o = self
                    .timed(self.api.patch(
                        &self.name,
                        &pp,
                        &Patch::Merge(json!({ "metadata": meta })),
                    ))
                    .await?;
                self.seen(&o);
                last = Some(o);
            }
            if let Some(status) = status {
                let body = json!({ "metadata": { "resourceVersion": self.resource_version }, "status": status });
                let o = self
                    .timed(self.api.patch_status(&self.name, &pp, &Patch::Merge(body)))
                    .await?;
                self.seen(&o);
                last = Some(o);
            }
        } else {
            let mut body = json!({ "metadata": meta });
            if let Some(status) = status {
                body["status"] = status.clone();
            }
            let o = self
                .timed(self.api.patch(&self.name, &pp, &Patch::Merge(body)))
                .await?;
            self.seen(&o);
            last = Some(o);
        }
        match last {
            Some(o) => Ok(o),
            None => {
                let o = self.api.get(&self.name).await?;
                self.seen(&o);
                Ok(o)
            }
        }
    }

    async fn timed(
        &self,
        fut: impl Future<Output = Result<K, kube::Error>>,
    ) -> Result<K, kube::Error> {
        let start = Instant::now();
        let r = fut.await;
        let result = match &r {
            Ok(_) => "ok",
            Err(e) if is_status(e, 409) => "conflict",
            Err(e) if is_status(e, 404) => "not_found",
            Err(e) if is_status(e, 422) => "invalid",
            Err(_) => "error",
        };
        self.metrics.status_write(result, start.elapsed());
        r
    }
}

/// RFC 3339 "now" as Kubernetes writes timestamps (seconds, UTC).
pub fn now_rfc3339() -> String {
    humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string()
}
