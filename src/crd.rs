//! Velero's `PodVolumeBackup` and `PodVolumeRestore` (`velero.io/v1`) as Rust types.
//!
//! Field names, types and enums follow Velero's published schema so that objects created by a
//! stock Velero server round-trip, and so that the CRDs generated from these types
//! (`podvolume-agent crds`) can replace Velero's on clusters without it. Our CRDs add the status
//! subresource and printer columns; the agent works with either flavour.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The finalizer Velero's node agent keeps on unfinished objects so a deletion becomes a cancel.
pub const FINALIZER: &str = "velero.io/pod-volume-finalizer";
/// A cancel request that survives every CRD version: Velero <= 1.16's CRDs have no
/// `spec.cancel` (the API server prunes it without an error), so a cancel written only there
/// would be lost. Annotations are never pruned.
pub const CANCEL_ANNOTATION: &str = "podvolume-agent.io/cancel";

/// The merge patch that asks for a cancel: `spec.cancel` (Velero 1.17+'s field, which Velero's
/// own agent honours too) and [`CANCEL_ANNOTATION`] (read by this agent whatever the CRDs).
pub fn cancel_patch() -> serde_json::Value {
    serde_json::json!({
        "metadata": { "annotations": { CANCEL_ANNOTATION: "true" } },
        "spec": { "cancel": true },
    })
}

/// How many times an object interrupted by agent restarts is run again before it is failed.
pub const ATTEMPTS_ANNOTATION: &str = "podvolume-agent.io/attempts";

/// A reference to the pod whose volume is moved (Velero's `corev1.ObjectReference`).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PodReference {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_version: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field_path: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource_version: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<String>,
}

/// Bytes moved so far and in total.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DataProgress {
    #[serde(default, skip_serializing_if = "is_zero")]
    pub total_bytes: i64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub bytes_done: i64,
}

fn is_zero(n: &i64) -> bool {
    *n == 0
}

/// The phases of both kinds. "" (absent) means New.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, JsonSchema)]
pub enum Phase {
    New,
    Accepted,
    Prepared,
    InProgress,
    Canceling,
    Canceled,
    Completed,
    Failed,
}

impl Phase {
    pub fn is_terminal(self) -> bool {
        matches!(self, Phase::Completed | Phase::Failed | Phase::Canceled)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Phase::New => "New",
            Phase::Accepted => "Accepted",
            Phase::Prepared => "Prepared",
            Phase::InProgress => "InProgress",
            Phase::Canceling => "Canceling",
            Phase::Canceled => "Canceled",
            Phase::Completed => "Completed",
            Phase::Failed => "Failed",
        }
    }
}

/// Which uploader the object asks for; "" means the agent's default.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema, Default)]
#[serde(rename_all = "lowercase")]
pub enum UploaderType {
    Kopia,
    Restic,
    #[default]
    #[serde(rename = "")]
    Default,
}

#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "velero.io",
    version = "v1",
    kind = "PodVolumeBackup",
    plural = "podvolumebackups",
    namespaced,
    status = "PodVolumeBackupStatus",
    shortname = "pvb",
    printcolumn = r#"{"name":"Status","type":"string","jsonPath":".status.phase","description":"Phase of the backup"}"#,
    printcolumn = r#"{"name":"Started","type":"date","jsonPath":".status.startTimestamp"}"#,
    printcolumn = r#"{"name":"Bytes Done","type":"integer","format":"int64","jsonPath":".status.progress.bytesDone"}"#,
    printcolumn = r#"{"name":"Total Bytes","type":"integer","format":"int64","jsonPath":".status.progress.totalBytes"}"#,
    printcolumn = r#"{"name":"Incremental Bytes","type":"integer","format":"int64","jsonPath":".status.incrementalBytes","priority":10}"#,
    printcolumn = r#"{"name":"Storage Location","type":"string","jsonPath":".spec.backupStorageLocation"}"#,
    printcolumn = r#"{"name":"Node","type":"string","jsonPath":".spec.node"}"#,
    printcolumn = r#"{"name":"Uploader","type":"string","jsonPath":".spec.uploaderType"}"#,
    printcolumn = r#"{"name":"Message","type":"string","jsonPath":".status.message","description":"Stage, rate and ETA while running; the outcome at the end"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct PodVolumeBackupSpec {
    /// Node name of the pod; the agent on that node does the backup.
    pub node: String,
    pub pod: PodReference,
    /// The volume's name in the pod spec.
    pub volume: String,
    pub backup_storage_location: String,
    /// The repository URL for restic; may be empty for kopia.
    pub repo_identifier: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uploader_type: Option<UploaderType>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tags: Option<BTreeMap<String, String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uploader_settings: Option<BTreeMap<String, String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cancel: Option<bool>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PodVolumeBackupStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<Phase>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        rename = "snapshotID"
    )]
    pub snapshot_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_timestamp: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_timestamp: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accepted_timestamp: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<DataProgress>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub incremental_bytes: Option<i64>,
}

#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "velero.io",
    version = "v1",
    kind = "PodVolumeRestore",
    plural = "podvolumerestores",
    namespaced,
    status = "PodVolumeRestoreStatus",
    shortname = "pvr",
    printcolumn = r#"{"name":"Status","type":"string","jsonPath":".status.phase","description":"Phase of the restore"}"#,
    printcolumn = r#"{"name":"Started","type":"date","jsonPath":".status.startTimestamp"}"#,
    printcolumn = r#"{"name":"Bytes Done","type":"integer","format":"int64","jsonPath":".status.progress.bytesDone"}"#,
    printcolumn = r#"{"name":"Total Bytes","type":"integer","format":"int64","jsonPath":".status.progress.totalBytes"}"#,
    printcolumn = r#"{"name":"Storage Location","type":"string","jsonPath":".spec.backupStorageLocation"}"#,
    printcolumn = r#"{"name":"Node","type":"string","jsonPath":".status.node"}"#,
    printcolumn = r#"{"name":"Uploader Type","type":"string","jsonPath":".spec.uploaderType"}"#,
    printcolumn = r#"{"name":"Message","type":"string","jsonPath":".status.message"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct PodVolumeRestoreSpec {
    /// The pod to restore into (the target).
    pub pod: PodReference,
    pub volume: String,
    pub backup_storage_location: String,
    pub repo_identifier: String,
    #[serde(rename = "snapshotID")]
    pub snapshot_id: String,
    pub source_namespace: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uploader_type: Option<UploaderType>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uploader_settings: Option<BTreeMap<String, String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cancel: Option<bool>,
    /// The backup's final size (the PVB's `status.progress.totalBytes`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_size: Option<i64>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PodVolumeRestoreStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<Phase>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_timestamp: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_timestamp: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accepted_timestamp: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<DataProgress>,
    /// The node whose agent handled the restore.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
}

/// The two CRDs as YAML documents, as `podvolume-agent crds` prints them.
pub fn crds_yaml() -> String {
    use kube::CustomResourceExt;
    let mut out = String::new();
    for crd in [PodVolumeBackup::crd(), PodVolumeRestore::crd()] {
        out.push_str("---\n");
        out.push_str(&serde_norway::to_string(&crd).expect("CRDs serialise"));
    }
    out
}
