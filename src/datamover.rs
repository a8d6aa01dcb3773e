//! Velero's CSI snapshot data movement objects, `DataUpload` and `DataDownload`
//! (`velero.io/v2alpha1`), as Rust types.
//!
//! Velero's server creates them when a backup runs with `--snapshot-move-data` (one DataUpload per
//! CSI claim, after its VolumeSnapshot is taken) and when such a backup is restored (one
//! DataDownload per claim). Field names follow Velero 1.18.3's Go types
//! (`pkg/apis/velero/v2alpha1`); the CRDs are Velero's own (no status subresource: status is
//! written with the object). The phases are the pod-volume ones ([`Phase`]).

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::crd::{DataProgress, Phase};

/// The name Velero's built-in data mover answers to; an empty `spec.datamover` means it too.
/// This agent replaces the built-in mover, so it serves exactly these; a DataUpload for another
/// mover (`kubevirt`, a vendor's) belongs to that mover and is never touched.
pub const BUILT_IN_MOVER: &str = "velero";

/// Is `datamover` (a DataUpload's or DataDownload's `spec.datamover`) Velero's built-in mover?
/// Velero's `datamover.IsBuiltInUploader`: "" or "velero", nothing else (case matters).
pub fn is_built_in(datamover: &str) -> bool {
    datamover.is_empty() || datamover == BUILT_IN_MOVER
}

/// `spec.csiSnapshot` of a DataUpload.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CsiSnapshotSpec {
    /// The VolumeSnapshot Velero took, in the source namespace.
    pub volume_snapshot: String,
    /// The source claim's storage class.
    #[serde(default)]
    pub storage_class: String,
    /// The VolumeSnapshotClass of the snapshot.
    #[serde(default)]
    pub snapshot_class: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub driver: String,
}

#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "velero.io",
    version = "v2alpha1",
    kind = "DataUpload",
    plural = "datauploads",
    namespaced,
    status = "DataUploadStatus"
)]
#[serde(rename_all = "camelCase")]
pub struct DataUploadSpec {
    /// Only `CSI` exists.
    pub snapshot_type: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub csi_snapshot: Option<CsiSnapshotSpec>,
    #[serde(rename = "sourcePVC")]
    pub source_pvc: String,
    /// The mover that serves this object; see [`is_built_in`].
    #[serde(
        default,
        rename = "datamover",
        skip_serializing_if = "String::is_empty"
    )]
    pub data_mover: String,
    pub backup_storage_location: String,
    pub source_namespace: String,
    /// Velero's CSI plugin puts only `ParallelFilesUpload` here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_mover_config: Option<BTreeMap<String, String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cancel: Option<bool>,
    /// The backup's `csiSnapshotTimeout`, a Go duration (`10m0s`).
    #[serde(default)]
    pub operation_timeout: String,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DataUploadStatus {
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
    /// Kept in the backup and handed back at restore (Velero's `DataUploadResult`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_mover_result: Option<BTreeMap<String, String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_timestamp: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_timestamp: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<DataProgress>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub incremental_bytes: Option<i64>,
    /// The node whose agent moved the data.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    #[serde(default, rename = "nodeOS", skip_serializing_if = "Option::is_none")]
    pub node_os: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accepted_by_node: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accepted_timestamp: Option<Time>,
}

/// `spec.targetVolume` of a DataDownload: the claim (and, when known, volume) to fill.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TargetVolumeSpec {
    #[serde(default)]
    pub pvc: String,
    #[serde(default)]
    pub pv: String,
    #[serde(default)]
    pub namespace: String,
}

#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "velero.io",
    version = "v2alpha1",
    kind = "DataDownload",
    plural = "datadownloads",
    namespaced,
    status = "DataDownloadStatus"
)]
#[serde(rename_all = "camelCase")]
pub struct DataDownloadSpec {
    pub target_volume: TargetVolumeSpec,
    pub backup_storage_location: String,
    #[serde(
        default,
        rename = "datamover",
        skip_serializing_if = "String::is_empty"
    )]
    pub data_mover: String,
    #[serde(rename = "snapshotID")]
    pub snapshot_id: String,
    pub source_namespace: String,
    /// From the restore's uploaderConfig: `WriteSparseFiles`, `ParallelFilesDownload`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_mover_config: Option<BTreeMap<String, String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cancel: Option<bool>,
    #[serde(default)]
    pub operation_timeout: String,
    #[serde(default, rename = "nodeOS", skip_serializing_if = "Option::is_none")]
    pub node_os: Option<String>,
    /// The upload's total bytes (Velero 1.18+).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_size: Option<i64>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DataDownloadStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<Phase>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_timestamp: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_timestamp: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<DataProgress>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accepted_by_node: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accepted_timestamp: Option<Time>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A DataUpload as Velero 1.18's CSI plugin creates it and its node agent completes it.
    const VELERO_DATA_UPLOAD: &str = r#"{
      "apiVersion": "velero.io/v2alpha1", "kind": "DataUpload",
      "metadata": {"generateName": "b1-", "name": "b1-x7k2p", "namespace": "velero",
        "labels": {"velero.io/async-operation-id": "du-1.2", "velero.io/backup-name": "b1",
                   "velero.io/backup-uid": "1", "velero.io/pvc-uid": "2"}},
      "spec": {"snapshotType": "CSI",
        "csiSnapshot": {"volumeSnapshot": "velero-data-abcde", "storageClass": "csi-sc",
                        "snapshotClass": "csi-vsc", "driver": "hostpath.csi.k8s.io"},
        "sourcePVC": "data", "backupStorageLocation": "default", "sourceNamespace": "app",
        "dataMoverConfig": {"ParallelFilesUpload": "4"}, "operationTimeout": "10m0s"},
      "status": {"phase": "Completed", "path": "/host_pods/u/volumes/kubernetes.io~csi/pvc-1/mount",
        "snapshotID": "k0123", "dataMoverResult": {}, "message": "", "progress": {"totalBytes": 10, "bytesDone": 10},
        "incrementalBytes": 10, "node": "n1", "nodeOS": "linux", "acceptedByNode": "n1"}
    }"#;

    #[test]
    fn a_velero_data_upload_round_trips() {
        let du: DataUpload = serde_json::from_str(VELERO_DATA_UPLOAD).unwrap();
        assert!(is_built_in(&du.spec.data_mover));
        assert_eq!(du.spec.source_pvc, "data");
        assert_eq!(
            du.spec.csi_snapshot.as_ref().unwrap().volume_snapshot,
            "velero-data-abcde"
        );
        let st = du.status.as_ref().unwrap();
        assert_eq!(st.phase, Some(Phase::Completed));
        assert_eq!(st.snapshot_id.as_deref(), Some("k0123"));
        assert_eq!(st.node_os.as_deref(), Some("linux"));
        // Written back, the wire names are Velero's (sourcePVC, datamover, snapshotID, nodeOS).
        let back = serde_json::to_value(&du).unwrap();
        assert_eq!(back["spec"]["sourcePVC"], "data");
        assert!(back["spec"].get("datamover").is_none());
        assert_eq!(back["status"]["snapshotID"], "k0123");
        assert_eq!(back["status"]["nodeOS"], "linux");
    }

    #[test]
    fn only_the_built_in_mover_is_ours() {
        assert!(is_built_in(""));
        assert!(is_built_in("velero"));
        assert!(!is_built_in("Velero"));
        assert!(!is_built_in("kubevirt"));
    }

    #[test]
    fn a_data_download_reads_its_target_and_config() {
        let dd: DataDownload = serde_json::from_str(
            r#"{"apiVersion": "velero.io/v2alpha1", "kind": "DataDownload",
                "metadata": {"name": "r1-abc", "namespace": "velero"},
                "spec": {"targetVolume": {"pvc": "data", "pv": "", "namespace": "app"},
                  "backupStorageLocation": "default", "datamover": "velero", "snapshotID": "k0123",
                  "sourceNamespace": "app", "dataMoverConfig": {"WriteSparseFiles": "true"},
                  "operationTimeout": "10m0s", "nodeOS": "linux", "snapshotSize": 10}}"#,
        )
        .unwrap();
        assert!(is_built_in(&dd.spec.data_mover));
        assert_eq!(dd.spec.target_volume.pvc, "data");
        assert_eq!(dd.spec.snapshot_size, Some(10));
        assert_eq!(dd.spec.source_namespace, "app");
    }
}
