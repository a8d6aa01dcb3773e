//! Whether the Backup or Restore a transfer belongs to still waits for it.
//!
//! Velero records a PodVolumeBackup in its Backup when the Backup leaves `InProgress`, finished or
//! not; a transfer that goes on after that (a pod-volume timeout on Velero <= 1.17, which sets no
//! `spec.cancel`; a Backup deleted or failed by a server restart) spends the node's I/O on data
//! nobody reads and, for a backup, leaves a snapshot that no Backup references. So a running
//! transfer asks, once per `--update-interval`, whether its owner has moved on; an object whose
//! owner is done is never started.
//!
//! Cost is bounded by what this node runs: one GET per owner per interval, shared by the
//! transfers of one owner (a small cache), never a watch of every Backup in the cluster.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind};
use kube::{Client, Resource};

/// The owner kind of each transfer kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OwnerKind {
    Backup,
    Restore,
}

impl OwnerKind {
    fn as_str(self) -> &'static str {
        match self {
            OwnerKind::Backup => "Backup",
            OwnerKind::Restore => "Restore",
        }
    }
    fn label(self) -> &'static str {
        match self {
            OwnerKind::Backup => "velero.io/backup-name",
            OwnerKind::Restore => "velero.io/restore-name",
        }
    }
}

/// The owner a PodVolumeBackup/Restore names: its owner reference of that kind (with the UID,
/// so a new owner of the same name is not taken for it), else its name label.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    pub kind: OwnerKind,
    pub name: String,
    pub uid: Option<String>,
    /// Whether the transfer is one of the owner's async item operations (a DataUpload or
    /// DataDownload), which Velero waits for in `WaitingForPluginOperations`.
    pub async_operation: bool,
}

impl Owner {
    pub fn of<K: Resource>(obj: &K, kind: OwnerKind) -> Option<Owner> {
        let meta = obj.meta();
        if let Some(r) = meta.owner_references.as_ref().and_then(|refs| {
            refs.iter()
                .find(|r| r.kind == kind.as_str() && r.api_version.starts_with("velero.io/"))
        }) {
            return Some(Owner {
                kind,
                name: r.name.clone(),
                uid: Some(r.uid.clone()),
                async_operation: false,
            });
        }
        let name = meta.labels.as_ref()?.get(kind.label())?;
        (!name.is_empty()).then(|| Owner {
            kind,
            name: name.clone(),
            uid: None,
            async_operation: false,
        })
    }

    /// The owner of a transfer object of kind `K`.
    pub fn of_transfer<K: super::status::VolumeObject>(obj: &K) -> Option<Owner> {
        Owner::of(obj, K::OWNER).map(|o| Owner {
            async_operation: K::ASYNC_OPERATION,
            ..o
        })
    }

    /// "backup b1", "restore r1" (messages).
    pub fn describe(&self) -> String {
        format!("{} {}", self.kind.as_str().to_lowercase(), self.name)
    }
}

/// What the owner's state means for its transfers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OwnerState {
    /// It still waits for its transfers (New, Queued, ReadyToStart, InProgress), or its phase
    /// is one this agent does not know (kept running: stopping a transfer its owner still
    /// waits for would lose the backup).
    Waiting,
    /// It has moved past the point where it reads its transfers' results: the phase.
    Done(String),
    /// It no longer exists (deleted, or replaced by one of the same name).
    Gone,
    /// It is being deleted (a finalizer holds it): it will not read the result either.
    Deleting,
}

impl OwnerState {
    /// Why a transfer of `owner` is stopped, for the object's message; None while it waits.
    pub fn stop_reason(&self, owner: &Owner) -> Option<String> {
        match self {
            OwnerState::Waiting => None,
            OwnerState::Done(phase) => Some(format!("{} ended ({phase})", owner.describe())),
            OwnerState::Gone => Some(format!("{} no longer exists", owner.describe())),
            OwnerState::Deleting => Some(format!("{} is being deleted", owner.describe())),
        }
    }
}

/// Phases past which Velero no longer reads the results of a Backup's or a Restore's pod
/// volume transfers. Velero waits for them inside `InProgress` (the Backup's item backup,
/// the Restore's pod volume wait group); every later phase of 1.10-1.18 is here.
const DONE_PHASES: &[&str] = &[
    "WaitingForPluginOperations",
    "WaitingForPluginOperationsPartiallyFailed",
    "Finalizing",
    "FinalizingPartiallyFailed",
    "Completed",
    "PartiallyFailed",
    "Failed",
    "FailedValidation",
    "Deleting",
];

/// The phases in which Velero still waits for its async item operations (DataUploads,
/// DataDownloads).
const ASYNC_WAITING_PHASES: &[&str] = &[
    "WaitingForPluginOperations",
    "WaitingForPluginOperationsPartiallyFailed",
];

pub fn state_of_phase(phase: &str, async_operation: bool) -> OwnerState {
    if async_operation && ASYNC_WAITING_PHASES.contains(&phase) {
        return OwnerState::Waiting;
    }
    if DONE_PHASES.contains(&phase) {
        OwnerState::Done(phase.to_string())
    } else {
        OwnerState::Waiting
    }
}

/// What a read found: (uid, phase, being deleted), or None when the owner does not exist.
type Found = Option<(String, String, bool)>;

/// Reads owners through a cache of one `--update-interval`.
pub struct OwnerCheck {
    client: Client,
    namespace: String,
    ttl: Duration,
    cache: Mutex<HashMap<(OwnerKind, String), (Instant, Found)>>,
}

impl OwnerCheck {
    pub fn new(client: Client, namespace: String, ttl: Duration) -> Self {
        OwnerCheck {
            client,
            namespace,
            ttl,
            cache: Mutex::new(HashMap::new()),
        }
    }

    /// The owner's state; an error (the API server unreachable, RBAC) is logged and taken as
    /// `Waiting`: a transfer is never stopped for a question that got no answer.
    pub async fn state(&self, owner: &Owner) -> OwnerState {
        let key = (owner.kind, owner.name.clone());
        let cached = self
            .cache
            .lock()
            .expect("owner cache")
            .get(&key)
            .filter(|(at, _)| at.elapsed() < self.ttl)
            .map(|(_, v)| v.clone());
        let found = match cached {
            Some(v) => v,
            None => match self.read(owner).await {
                Ok(v) => {
                    let mut cache = self.cache.lock().expect("owner cache");
                    cache.retain(|_, (at, _)| at.elapsed() < self.ttl);
                    cache.insert(key, (Instant::now(), v.clone()));
                    v
                }
                Err(e) => {
                    tracing::warn!(owner = %owner.describe(), error = %e, "cannot read the transfer's owner; assuming it still waits");
                    return OwnerState::Waiting;
                }
            },
        };
        match found {
            None => OwnerState::Gone,
            Some((uid, _, _)) if owner.uid.as_ref().is_some_and(|u| *u != uid) => OwnerState::Gone,
            Some((_, _, true)) => OwnerState::Deleting,
            Some((_, phase, false)) => state_of_phase(&phase, owner.async_operation),
        }
    }

    /// (uid, phase) of the owner, None when it does not exist.
    async fn read(&self, owner: &Owner) -> Result<Found, kube::Error> {
        let gvk = GroupVersionKind::gvk("velero.io", "v1", owner.kind.as_str());
        let plural = match owner.kind {
            OwnerKind::Backup => "backups",
            OwnerKind::Restore => "restores",
        };
        let ar = ApiResource::from_gvk_with_plural(&gvk, plural);
        let api: Api<DynamicObject> =
            Api::namespaced_with(self.client.clone(), &self.namespace, &ar);
        match api.get(&owner.name).await {
            Ok(o) => {
                let phase = o
                    .data
                    .get("status")
                    .and_then(|s| s.get("phase"))
                    .and_then(|p| p.as_str())
                    .unwrap_or_default()
                    .to_string();
                let deleting = o.metadata.deletion_timestamp.is_some();
                Ok(Some((o.metadata.uid.unwrap_or_default(), phase, deleting)))
            }
            // Only "this object does not exist" means gone: a 404 because the kind is not served
            // (a cluster with the PodVolume CRDs but not Velero's Backup/Restore) says nothing.
            Err(kube::Error::Api(e)) if object_not_found(&e, &owner.name) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The state read now, past the cache: for the decision to delete a snapshot just made.
    pub async fn state_now(&self, owner: &Owner) -> OwnerState {
        self.cache
            .lock()
            .expect("owner cache")
            .remove(&(owner.kind, owner.name.clone()));
        self.state(owner).await
    }
}

/// The API server's 404 for a missing object names it (`backups.velero.io "b1" not found`);
/// its 404 for a kind it does not serve does not ("the server could not find the requested
/// resource").
fn object_not_found(e: &kube::core::Status, name: &str) -> bool {
    e.code == 404 && e.reason == "NotFound" && e.message.contains(&format!("\"{name}\" not found"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::PodVolumeBackup;

    fn pvb(mut json: serde_json::Value) -> PodVolumeBackup {
        json["spec"] = serde_json::json!({"node": "n", "pod": {"name": "p"}, "volume": "v",
            "backupStorageLocation": "default", "repoIdentifier": ""});
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn the_owner_reference_wins_over_the_label_and_carries_the_uid() {
        let o = pvb(serde_json::json!({
            "apiVersion": "velero.io/v1", "kind": "PodVolumeBackup",
            "metadata": {"name": "p", "namespace": "velero",
                "labels": {"velero.io/backup-name": "from-label"},
                "ownerReferences": [
                    {"apiVersion": "v1", "kind": "Pod", "name": "x", "uid": "u0"},
                    {"apiVersion": "velero.io/v1", "kind": "Backup", "name": "b1", "uid": "u1", "controller": true}]},
            "spec": {}
        }));
        let owner = Owner::of(&o, OwnerKind::Backup).unwrap();
        assert_eq!(owner.name, "b1");
        assert_eq!(owner.uid.as_deref(), Some("u1"));
        assert_eq!(owner.describe(), "backup b1");
    }

    #[test]
    fn the_label_names_the_owner_when_there_is_no_reference_and_nothing_names_none() {
        let o = pvb(serde_json::json!({
            "apiVersion": "velero.io/v1", "kind": "PodVolumeBackup",
            "metadata": {"name": "p", "labels": {"velero.io/backup-name": "b2"}}, "spec": {}
        }));
        assert_eq!(
            Owner::of(&o, OwnerKind::Backup),
            Some(Owner {
                kind: OwnerKind::Backup,
                name: "b2".into(),
                uid: None,
                async_operation: false,
            })
        );
        let bare = pvb(serde_json::json!({
            "apiVersion": "velero.io/v1", "kind": "PodVolumeBackup",
            "metadata": {"name": "p"}, "spec": {}
        }));
        assert_eq!(Owner::of(&bare, OwnerKind::Backup), None);
        assert_eq!(Owner::of(&o, OwnerKind::Restore), None);
    }

    #[test]
    fn only_a_404_naming_the_object_means_it_is_gone() {
        let e = |message: &str| kube::core::Status {
            code: 404,
            ..kube::core::Status::failure(message, "NotFound")
        };
        assert!(object_not_found(
            &e(r#"backups.velero.io "b1" not found"#),
            "b1"
        ));
        assert!(!object_not_found(
            &e("the server could not find the requested resource"),
            "b1"
        ));
        assert!(!object_not_found(
            &e(r#"backups.velero.io "b10" not found"#),
            "b1"
        ));
    }

    #[test]
    fn only_phases_past_the_wait_for_transfers_stop_them() {
        for p in [
            "",
            "New",
            "Queued",
            "ReadyToStart",
            "InProgress",
            "SomethingNew",
        ] {
            assert_eq!(state_of_phase(p, false), OwnerState::Waiting, "{p}");
        }
        for p in [
            "WaitingForPluginOperations",
            "Finalizing",
            "Completed",
            "PartiallyFailed",
            "Failed",
            "FailedValidation",
            "Deleting",
        ] {
            assert_eq!(state_of_phase(p, false), OwnerState::Done(p.into()), "{p}");
        }
        // A DataUpload's Backup waits for it in WaitingForPluginOperations.
        for p in [
            "WaitingForPluginOperations",
            "WaitingForPluginOperationsPartiallyFailed",
        ] {
            assert_eq!(state_of_phase(p, true), OwnerState::Waiting, "{p}");
        }
        assert_eq!(
            state_of_phase("Finalizing", true),
            OwnerState::Done("Finalizing".into())
        );
        let owner = Owner {
            kind: OwnerKind::Backup,
            name: "b".into(),
            uid: None,
            async_operation: false,
        };
        assert_eq!(
            state_of_phase("PartiallyFailed", false)
                .stop_reason(&owner)
                .unwrap(),
            "backup b ended (PartiallyFailed)"
        );
        assert_eq!(
            OwnerState::Gone.stop_reason(&owner).unwrap(),
            "backup b no longer exists"
        );
        assert_eq!(
            OwnerState::Deleting.stop_reason(&owner).unwrap(),
            "backup b is being deleted"
        );
    }
}
