//! What the agent's watches decode: this node's objects whole, of every other object only its name.
//!
//! The Velero namespace may hold 100,000 finished PodVolumeBackups of other nodes, and a list
//! page holds 500 of them. Decoded whole, with the `managedFields` the API server adds to each,
//! a page held about 11 KB per object (5.6 MB a page, measured once with a counting allocator;
//! BENCHMARKS.md case 5 measures the agent's resident size), and the allocator keeps that
//! high-water mark as the agent's resident size. So a watched object is decoded in two steps: its
//! metadata without `managedFields` (which nothing here reads), its spec and status kept as raw
//! JSON text until one look at the spec says whether the object can be this node's; only then is
//! it decoded into its type. An object of another node costs its name until the page is dropped.
//!
//! An object whose spec or status does not decode is not this agent's to guess at: it becomes
//! [`Watched::Undecodable`] (logged by the watch, never reconciled) instead of failing the whole
//! list page, which would stop the watch of every other object too.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::OnceLock;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference, Time};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer};
use serde_json::value::RawValue;

use crate::crd::{PodVolumeBackup, PodVolumeRestore};

/// The node whose PodVolumeBackups this process decodes whole. Decoding has no other way to
/// learn it (the client decodes list pages with `Deserialize`, which takes no context); one agent
/// runs per process. Unset, every object is decoded whole.
static NODE: OnceLock<String> = OnceLock::new();

/// Sets the node for this process's watches; fails if it was set to another node before.
pub fn set_node(node: &str) -> Result<(), String> {
    let set = NODE.get_or_init(|| node.to_string());
    if set == node {
        Ok(())
    } else {
        Err(format!(
            "this process already watches for node {set:?}, not {node:?}"
        ))
    }
}

/// A kind the agent watches, decodable in two steps.
pub trait WatchedKind: kube::Resource<DynamicType = ()> + Sized {
    type Spec: DeserializeOwned;
    type Status: DeserializeOwned;
    /// Whether an object with this raw spec may be this agent's (a cheap look, no full decode).
    fn may_be_ours(spec: &str) -> bool;
    fn assemble(metadata: ObjectMeta, spec: Self::Spec, status: Option<Self::Status>) -> Self;
}

impl WatchedKind for PodVolumeBackup {
    type Spec = crate::crd::PodVolumeBackupSpec;
    type Status = crate::crd::PodVolumeBackupStatus;
    fn may_be_ours(spec: &str) -> bool {
        #[derive(Deserialize)]
        struct Node<'a> {
            #[serde(borrow, default)]
            node: Option<Cow<'a, str>>,
        }
        match (NODE.get(), serde_json::from_str::<Node>(spec)) {
            (Some(ours), Ok(Node { node: Some(n) })) => n == ours.as_str(),
            // Unset, or a spec that does not say: decode it whole (and let the full decode or
            // the watch's own filter decide).
            _ => true,
        }
    }
    fn assemble(metadata: ObjectMeta, spec: Self::Spec, status: Option<Self::Status>) -> Self {
        PodVolumeBackup {
            metadata,
            spec,
            status,
        }
    }
}

impl WatchedKind for PodVolumeRestore {
    type Spec = crate::crd::PodVolumeRestoreSpec;
    type Status = crate::crd::PodVolumeRestoreStatus;
    /// A PodVolumeRestore names no node; whose it is is found from its pod.
    fn may_be_ours(_spec: &str) -> bool {
        true
    }
    fn assemble(metadata: ObjectMeta, spec: Self::Spec, status: Option<Self::Status>) -> Self {
        PodVolumeRestore {
            metadata,
            spec,
            status,
        }
    }
}

impl WatchedKind for crate::datamover::DataUpload {
    type Spec = crate::datamover::DataUploadSpec;
    type Status = crate::datamover::DataUploadStatus;
    /// Any node may claim a DataUpload of Velero's built-in mover; another mover's are not ours.
    fn may_be_ours(spec: &str) -> bool {
        #[derive(Deserialize)]
        struct Mover<'a> {
            #[serde(borrow, default)]
            datamover: Option<Cow<'a, str>>,
        }
        match serde_json::from_str::<Mover>(spec) {
            Ok(Mover { datamover: Some(m) }) => crate::datamover::is_built_in(&m),
            _ => true,
        }
    }
    fn assemble(metadata: ObjectMeta, spec: Self::Spec, status: Option<Self::Status>) -> Self {
        crate::datamover::DataUpload {
            metadata,
            spec,
            status,
        }
    }
}

impl WatchedKind for crate::datamover::DataDownload {
    type Spec = crate::datamover::DataDownloadSpec;
    type Status = crate::datamover::DataDownloadStatus;
    /// As a DataUpload: any node may claim one of Velero's built-in mover.
    fn may_be_ours(spec: &str) -> bool {
        <crate::datamover::DataUpload as WatchedKind>::may_be_ours(spec)
    }
    fn assemble(metadata: ObjectMeta, spec: Self::Spec, status: Option<Self::Status>) -> Self {
        crate::datamover::DataDownload {
            metadata,
            spec,
            status,
        }
    }
}

/// One decoded object of a watch.
#[derive(Clone, Debug)]
pub enum Watched<K> {
    /// Possibly this agent's: the whole object, without `managedFields`.
    Whole(K),
    /// Another node's: its name and namespace only.
    Other(ObjectMeta),
    /// Its spec or status does not decode as the agent's type; the reason.
    Undecodable(ObjectMeta, String),
}

impl<K> Watched<K> {
    pub fn into_whole(self) -> Option<K> {
        match self {
            Watched::Whole(k) => Some(k),
            _ => None,
        }
    }
}

impl<K: kube::Resource<DynamicType = ()>> kube::Resource for Watched<K> {
    type DynamicType = ();
    type Scope = K::Scope;
    fn kind(dt: &()) -> Cow<'_, str> {
        K::kind(dt)
    }
    fn group(dt: &()) -> Cow<'_, str> {
        K::group(dt)
    }
    fn version(dt: &()) -> Cow<'_, str> {
        K::version(dt)
    }
    fn plural(dt: &()) -> Cow<'_, str> {
        K::plural(dt)
    }
    fn meta(&self) -> &ObjectMeta {
        match self {
            Watched::Whole(k) => k.meta(),
            Watched::Other(m) | Watched::Undecodable(m, _) => m,
        }
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        match self {
            Watched::Whole(k) => k.meta_mut(),
            Watched::Other(m) | Watched::Undecodable(m, _) => m,
        }
    }
}

impl<'de, K: WatchedKind> Deserialize<'de> for Watched<K> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        struct Wire {
            #[serde(default)]
            metadata: Meta,
            spec: Option<Box<RawValue>>,
            status: Option<Box<RawValue>>,
        }
        let wire = Wire::deserialize(d)?;
        let spec = wire.spec.as_deref().map_or("null", RawValue::get);
        if !K::may_be_ours(spec) {
            return Ok(Watched::Other(wire.metadata.identity()));
        }
        let spec = match serde_json::from_str::<K::Spec>(spec) {
            Ok(s) => s,
            Err(e) => {
                return Ok(Watched::Undecodable(
                    wire.metadata.identity(),
                    format!("spec: {e}"),
                ));
            }
        };
        let status = match wire.status.as_deref().map(RawValue::get) {
            None | Some("null") => None,
            Some(s) => match serde_json::from_str::<K::Status>(s) {
                Ok(s) => Some(s),
                Err(e) => {
                    return Ok(Watched::Undecodable(
                        wire.metadata.identity(),
                        format!("status: {e}"),
                    ));
                }
            },
        };
        Ok(Watched::Whole(K::assemble(
            wire.metadata.into_object_meta(),
            spec,
            status,
        )))
    }
}

/// `ObjectMeta` as served, less `managedFields` (skipped while decoding, never allocated).
#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase", default)]
struct Meta {
    annotations: Option<BTreeMap<String, String>>,
    creation_timestamp: Option<Time>,
    deletion_grace_period_seconds: Option<i64>,
    deletion_timestamp: Option<Time>,
    finalizers: Option<Vec<String>>,
    generate_name: Option<String>,
    generation: Option<i64>,
    labels: Option<BTreeMap<String, String>>,
    name: Option<String>,
    namespace: Option<String>,
    owner_references: Option<Vec<OwnerReference>>,
    resource_version: Option<String>,
    self_link: Option<String>,
    uid: Option<String>,
}

impl Meta {
    /// What is kept of an object that is not decoded: enough to name it in a log line.
    fn identity(self) -> ObjectMeta {
        ObjectMeta {
            name: self.name,
            namespace: self.namespace,
            resource_version: self.resource_version,
            ..ObjectMeta::default()
        }
    }

    fn into_object_meta(self) -> ObjectMeta {
        ObjectMeta {
            annotations: self.annotations,
            creation_timestamp: self.creation_timestamp,
            deletion_grace_period_seconds: self.deletion_grace_period_seconds,
            deletion_timestamp: self.deletion_timestamp,
            finalizers: self.finalizers,
            generate_name: self.generate_name,
            generation: self.generation,
            labels: self.labels,
            managed_fields: None,
            name: self.name,
            namespace: self.namespace,
            owner_references: self.owner_references,
            resource_version: self.resource_version,
            self_link: self.self_link,
            uid: self.uid,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Decoded from text, as the client decodes what the server sends.
    fn decode<T: DeserializeOwned>(v: &serde_json::Value) -> T {
        serde_json::from_str(&v.to_string()).unwrap()
    }

    fn pvb(node: &str) -> serde_json::Value {
        json!({
            "apiVersion": "velero.io/v1", "kind": "PodVolumeBackup",
            "metadata": {
                "name": format!("b-{node}"), "namespace": "velero", "uid": "u1",
                "resourceVersion": "7", "labels": {"velero.io/pvc-uid": "p1"},
                "ownerReferences": [{"apiVersion": "velero.io/v1", "kind": "Backup", "name": "b", "uid": "u0", "controller": true}],
                "managedFields": [{"manager": "velero-server", "operation": "Update", "fieldsType": "FieldsV1", "fieldsV1": {"f:spec": {"f:node": {}}}}],
            },
            "spec": {
                "node": node, "pod": {"kind": "Pod", "namespace": "app", "name": "p", "uid": "pu"},
                "volume": "data", "backupStorageLocation": "default", "repoIdentifier": "/repo",
            },
            "status": {"phase": "Completed", "snapshotID": "abc"},
        })
    }

    // One test sets the process-wide node; the others in this module must not depend on it
    // being unset, so everything that needs a node runs here.
    #[test]
    fn this_nodes_objects_whole_others_by_name_bad_ones_named() {
        set_node("n1").unwrap();
        assert!(set_node("n1").is_ok());
        assert!(set_node("n2").is_err(), "a second node in one process");

        let mine: Watched<PodVolumeBackup> = decode(&pvb("n1"));
        let plain: PodVolumeBackup = decode(&pvb("n1"));
        let Watched::Whole(mine) = mine else {
            panic!("this node's object not decoded whole: {mine:?}")
        };
        assert_eq!(mine.spec, plain.spec);
        assert_eq!(mine.status, plain.status);
        assert_eq!(mine.metadata.managed_fields, None);
        assert!(plain.metadata.managed_fields.is_some());
        let mut plain_meta = plain.metadata.clone();
        plain_meta.managed_fields = None;
        assert_eq!(mine.metadata, plain_meta, "every other metadata field kept");

        let other: Watched<PodVolumeBackup> = decode(&pvb("n2"));
        match other {
            Watched::Other(m) => {
                assert_eq!(m.name.as_deref(), Some("b-n2"));
                assert_eq!(m.labels, None, "nothing but the identity kept");
            }
            w => panic!("another node's object decoded: {w:?}"),
        }

        // This node's object whose spec is not what the agent expects: named, not fatal.
        let mut bad = pvb("n1");
        bad["spec"]["volume"] = json!(7);
        match decode::<Watched<PodVolumeBackup>>(&bad) {
            Watched::Undecodable(m, why) => {
                assert_eq!(m.name.as_deref(), Some("b-n1"));
                assert!(why.starts_with("spec: "), "{why}");
            }
            w => panic!("{w:?}"),
        }
        let mut bad = pvb("n1");
        bad["status"]["phase"] = json!("Sideways");
        assert!(matches!(
            decode::<Watched<PodVolumeBackup>>(&bad),
            Watched::Undecodable(_, why) if why.starts_with("status: ")
        ));

        // A list page with one bad object still decodes, every item in its place.
        let mut bad = pvb("n1");
        bad["spec"]["pod"] = json!("p");
        let page = json!({"apiVersion": "velero.io/v1", "kind": "PodVolumeBackupList",
            "metadata": {"resourceVersion": "9"}, "items": [pvb("n1"), bad, pvb("n2")]});
        let list: kube::core::ObjectList<Watched<PodVolumeBackup>> = decode(&page);
        let kinds: Vec<&str> = list
            .items
            .iter()
            .map(|w| match w {
                Watched::Whole(_) => "whole",
                Watched::Other(_) => "other",
                Watched::Undecodable(..) => "undecodable",
            })
            .collect();
        assert_eq!(kinds, ["whole", "undecodable", "other"]);
    }

    #[test]
    fn restores_are_decoded_whole_without_managed_fields() {
        let v = json!({
            "apiVersion": "velero.io/v1", "kind": "PodVolumeRestore",
            "metadata": {"name": "r", "namespace": "velero", "managedFields": [{"manager": "m"}]},
            "spec": {"pod": {"kind": "Pod", "namespace": "app", "name": "p", "uid": "pu"},
                "volume": "data", "backupStorageLocation": "default", "repoIdentifier": "/repo",
                "snapshotID": "abc", "sourceNamespace": "app"},
        });
        let w: Watched<PodVolumeRestore> = decode(&v);
        let plain: PodVolumeRestore = decode(&v);
        let w = w.into_whole().expect("whole");
        assert_eq!(w.spec, plain.spec);
        assert_eq!(w.status, None);
        assert_eq!(w.metadata.managed_fields, None);
    }
}
