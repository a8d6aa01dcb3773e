//! Exposing a CSI snapshot for a DataUpload, as Velero's exposer (`pkg/exposer/csi_snapshot.go`)
//! does: the snapshot moved into the Velero namespace, a claim made from it there, and a pod that
//! mounts that claim, so that the kubelet of whatever node the scheduler picks mounts the
//! snapshot's data and the agent of that node reads it from the kubelet's pods directory.
//!
//! Every object takes the DataUpload's name (Velero's convention, which makes each step
//! idempotent: a second expose after a restart finds what the first one made):
//!
//! ```text
//! source VolumeSnapshot (source namespace) -- ready --> its VolumeSnapshotContent
//!   => VolumeSnapshotContent <du> (same snapshot handle, deletionPolicy Delete)
//!      + VolumeSnapshot <du> (Velero namespace) bound to it
//!   => the source content retained, then the source snapshot and content deleted
//!   => PersistentVolumeClaim <du> from VolumeSnapshot <du>
//!   => Pod <du> mounting it, holding it until the agent is done
//! ```
//!
//! [`clean_up`] removes all of it; deleting VolumeSnapshot `<du>` deletes the storage
//! snapshot itself (its content's policy is Delete), which is what Velero does once the data is
//! moved: the snapshot's data lives on in the repository.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Pod};
use kube::api::{
    ApiResource, DeleteParams, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams,
};
use kube::{Api, Client, ResourceExt};
use serde_json::{Value, json};

use crate::datamover::DataUpload;

/// The label on the pod that holds an exposed snapshot (its value: the DataUpload's name). Not
/// Velero's `velero.io/data-upload`, which Velero's node agent would take for one of its own.
pub const HOLD_LABEL: &str = "podvolume-agent.io/data-upload";
/// The container and volume name in the hold pod.
pub const HOLD_VOLUME: &str = "snapshot";

/// How a DataUpload's exposure is made; from the DataUpload, the node-agent ConfigMap and the
/// agent's own DaemonSet.
#[derive(Debug, Clone, Default)]
pub struct ExposeSettings {
    /// The image of the hold pod (the agent's own).
    pub image: String,
    pub pod_labels: BTreeMap<String, String>,
    pub pod_annotations: BTreeMap<String, String>,
    pub priority_class_name: Option<String>,
    /// `resources` of the hold pod's container (ConfigMap `podResources`), as JSON.
    pub resources: Option<Value>,
    /// Copied from the agent's DaemonSet, as Velero's exposer copies the node agent's.
    pub tolerations: Option<Value>,
    /// Velero's node-agent ConfigMap: the rules that depend on the claim's storage class
    /// (`loadAffinity`, `backupPVC`) and `restorePVC`.
    pub config: std::sync::Arc<super::node_agent_config::NodeAgentConfigs>,
}

fn ar(kind: &str, plural: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("snapshot.storage.k8s.io", "v1", kind),
        plural,
    )
}

fn snapshots(client: &Client, ns: &str) -> Api<DynamicObject> {
    Api::namespaced_with(client.clone(), ns, &ar("VolumeSnapshot", "volumesnapshots"))
}

fn contents(client: &Client) -> Api<DynamicObject> {
    Api::all_with(
        client.clone(),
        &ar("VolumeSnapshotContent", "volumesnapshotcontents"),
    )
}

pub(super) fn is_code(e: &kube::Error, code: u16) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == code)
}

fn str_at<'a>(v: &'a Value, path: &[&str]) -> Option<&'a str> {
    path.iter()
        .try_fold(v, |v, k| v.get(k))
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
}

/// What the source claim says about the exposure.
#[derive(Debug, Clone)]
pub struct SourceClaim {
    pub storage_class: String,
    pub size: Option<String>,
}

/// The DataUpload's source claim; a Block volume is refused (the agent moves file systems).
pub async fn source_claim(client: &Client, du: &DataUpload) -> Result<SourceClaim, String> {
    let ns = &du.spec.source_namespace;
    let name = &du.spec.source_pvc;
    let api: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), ns);
    let pvc = api
        .get_opt(name)
        .await
        .map_err(|e| format!("cannot read the source claim {ns}/{name}: {e}"))?
        .ok_or_else(|| format!("the source claim {ns}/{name} does not exist"))?;
    let spec = pvc.spec.unwrap_or_default();
    if spec.volume_mode.as_deref() == Some("Block") {
        return Err(format!(
            "the source claim {ns}/{name} is a Block volume (volumeMode: Block): this node agent moves file-system volumes only"
        ));
    }
    let storage_class = du
        .spec
        .csi_snapshot
        .as_ref()
        .map(|c| c.storage_class.clone())
        .filter(|s| !s.is_empty())
        .or(spec.storage_class_name)
        .unwrap_or_default();
    let size = spec
        .resources
        .and_then(|r| r.requests)
        .and_then(|r| r.get("storage").map(|q| q.0.clone()));
    Ok(SourceClaim {
        storage_class,
        size,
    })
}

/// Waits until the source VolumeSnapshot is ready to use, then moves it into the Velero
/// namespace and makes the claim and the hold pod. Errors are messages for the DataUpload.
pub async fn expose(
    client: &Client,
    du: &DataUpload,
    settings: &ExposeSettings,
    ready_within: Duration,
) -> Result<(), String> {
    let velero_ns = du.namespace().unwrap_or_default();
    let name = du.name_any();
    let source = source_claim(client, du).await?;
    let vs_name = du
        .spec
        .csi_snapshot
        .as_ref()
        .map(|c| c.volume_snapshot.clone())
        .filter(|s| !s.is_empty())
        .ok_or("spec.csiSnapshot.volumeSnapshot is empty: no snapshot to move")?;
    let src_ns = &du.spec.source_namespace;
    let vs_api = snapshots(client, src_ns);
    let backup_vs_api = snapshots(client, &velero_ns);
    let vsc_api = contents(client);

    // Already moved (an expose interrupted by a restart): the source snapshot is gone, ours is
    // there. Otherwise the source must become ready.
    let moved = backup_vs_api
        .get_opt(&name)
        .await
        .map_err(|e| format!("cannot read VolumeSnapshot {velero_ns}/{name}: {e}"))?;
    let restore_size = match moved {
        Some(vs) => str_at(&vs.data, &["status", "restoreSize"]).map(str::to_string),
        None => {
            let vs = wait_ready(&vs_api, src_ns, &vs_name, ready_within).await?;
            let vsc_name = str_at(&vs.data, &["status", "boundVolumeSnapshotContentName"])
                .ok_or_else(|| format!("VolumeSnapshot {src_ns}/{vs_name} is bound to no content"))?
                .to_string();
            let vsc = vsc_api
                .get(&vsc_name)
                .await
                .map_err(|e| format!("cannot read VolumeSnapshotContent {vsc_name}: {e}"))?;
            let handle = str_at(&vsc.data, &["status", "snapshotHandle"])
                .ok_or_else(|| format!("VolumeSnapshotContent {vsc_name} has no snapshot handle"))?
                .to_string();
            let driver = str_at(&vsc.data, &["spec", "driver"]).unwrap_or_default();
            let class = str_at(&vs.data, &["spec", "volumeSnapshotClassName"]);
            let backup_vs = create_or_get(
                &backup_vs_api,
                serde_json::from_value(json!({
                    "apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshot",
                    "metadata": {"name": name, "namespace": velero_ns,
                        "annotations": vs.metadata.annotations.clone().unwrap_or_default()},
                    "spec": {"source": {"volumeSnapshotContentName": name},
                        "volumeSnapshotClassName": class},
                }))
                .expect("a VolumeSnapshot"),
            )
            .await?;
            let mut labels = BTreeMap::new();
            // Distributed snapshotting: the managing node's label keeps its sidecar in charge.
            const MANAGED_BY: &str = "snapshot.storage.kubernetes.io/managed-by";
            if let Some(m) = vsc.labels().get(MANAGED_BY) {
                labels.insert(MANAGED_BY.to_string(), m.clone());
            }
            create_or_get(
                &vsc_api,
                serde_json::from_value(json!({
                    "apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshotContent",
                    "metadata": {"name": name, "labels": labels,
                        "annotations": vsc.metadata.annotations.clone().unwrap_or_default()},
                    "spec": {
                        "volumeSnapshotRef": {"name": name, "namespace": velero_ns,
                            "uid": backup_vs.metadata.uid, "apiVersion": "snapshot.storage.k8s.io/v1",
                            "kind": "VolumeSnapshot"},
                        "source": {"snapshotHandle": handle},
                        "deletionPolicy": "Delete",
                        "driver": driver,
                        "volumeSnapshotClassName": str_at(&vsc.data, &["spec", "volumeSnapshotClassName"]),
                    },
                }))
                .expect("a VolumeSnapshotContent"),
            )
            .await?;
            // The storage snapshot now belongs to our content: the source content must let go
            // of it before the source objects are deleted.
            if str_at(&vsc.data, &["spec", "deletionPolicy"]) != Some("Retain") {
                vsc_api
                    .patch(
                        &vsc_name,
                        &PatchParams::default(),
                        &Patch::Merge(json!({"spec": {"deletionPolicy": "Retain"}})),
                    )
                    .await
                    .map_err(|e| format!("cannot retain VolumeSnapshotContent {vsc_name}: {e}"))?;
            }
            delete_and_wait(&vs_api, &vs_name, ready_within)
                .await
                .map_err(|e| format!("VolumeSnapshot {src_ns}/{vs_name}: {e}"))?;
            delete_and_wait(&vsc_api, &vsc_name, ready_within)
                .await
                .map_err(|e| format!("VolumeSnapshotContent {vsc_name}: {e}"))?;
            str_at(&vs.data, &["status", "restoreSize"]).map(str::to_string)
        }
    };
    let size = restore_size
        .filter(|s| s != "0")
        .or(source.size)
        .ok_or("neither the snapshot nor the source claim says the volume's size")?;
    let owner = json!([{
        "apiVersion": "velero.io/v2alpha1", "kind": "DataUpload", "name": name,
        "uid": du.metadata.uid, "controller": true,
    }]);
    // ConfigMap backupPVC, keyed by the source claim's class: another class for the claim made
    // from the snapshot (one that clones fast, say), a read-only mount, annotations.
    let rule = settings
        .config
        .backup_pvc(&source.storage_class)
        .cloned()
        .unwrap_or_default();
    let read_only = rule.read_only;
    let storage_class = Some(rule.storage_class)
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| source.storage_class.clone());
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), &velero_ns);
    create_or_get(
        &pvcs,
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": velero_ns, "ownerReferences": owner,
                "annotations": rule.annotations},
            "spec": {
                "accessModes": [if read_only { "ReadOnlyMany" } else { "ReadWriteOnce" }],
                "storageClassName": storage_class,
                "volumeMode": "Filesystem",
                "dataSource": {"apiGroup": "snapshot.storage.k8s.io", "kind": "VolumeSnapshot", "name": name},
                "resources": {"requests": {"storage": size}},
            },
        }))
        .map_err(|e| format!("the backup claim: {e}"))?,
    )
    .await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &velero_ns);
    create_or_get(
        &pods,
        hold_pod_object(
            &name,
            &velero_ns,
            owner,
            settings,
            read_only,
            settings.config.affinity(&source.storage_class),
            None,
        )?,
    )
    .await?;
    Ok(())
}

/// The pod that keeps an exposed claim (named `name` too) mounted on whatever node runs it: its
/// container only sleeps (`podvolume-agent hold`), the agent of that node does the work. No
/// service account token, no capabilities, no writable root. `affinity` is the ConfigMap's
/// `loadAffinity` for the claim's class; `node` pins it to a node instead (a restore into a
/// claim whose volume must be made where its consumer runs).
pub fn hold_pod_object(
    name: &str,
    ns: &str,
    owner: Value,
    settings: &ExposeSettings,
    read_only: bool,
    mut affinity: Option<Value>,
    node: Option<&str>,
) -> Result<Pod, String> {
    let mut labels = settings.pod_labels.clone();
    labels.insert(HOLD_LABEL.to_string(), name.to_string());
    let mut node_selector = json!({"kubernetes.io/os": "linux"});
    if let Some(n) = node {
        node_selector["kubernetes.io/hostname"] = json!(n);
        // The node is chosen already; the ConfigMap's loadAffinity would only contradict it
        // (Velero's restore exposer drops it too).
        affinity = None;
    }
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": ns, "ownerReferences": owner,
            "labels": labels, "annotations": settings.pod_annotations},
        "spec": {
            "containers": [{
                "name": HOLD_VOLUME,
                "image": settings.image,
                "imagePullPolicy": "IfNotPresent",
                "args": ["hold"],
                "volumeMounts": [{"name": HOLD_VOLUME, "mountPath": "/snapshot", "readOnly": read_only}],
                "resources": settings.resources.clone().unwrap_or(json!({})),
                "securityContext": {"allowPrivilegeEscalation": false, "readOnlyRootFilesystem": true,
                    "capabilities": {"drop": ["ALL"]}},
            }],
            "volumes": [{"name": HOLD_VOLUME, "persistentVolumeClaim": {"claimName": name, "readOnly": read_only}}],
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 0,
            "automountServiceAccountToken": false,
            "enableServiceLinks": false,
            "priorityClassName": settings.priority_class_name,
            "affinity": affinity,
            "tolerations": settings.tolerations,
            "os": {"name": "linux"},
            "nodeSelector": node_selector,
        },
    }))
    .map_err(|e| format!("the hold pod: {e}"))
}

/// Deletes a hold pod and the claim it holds (both named `name`), and the claim's volume with it
/// whatever its class's reclaim policy says. Best effort, each step logged.
pub async fn delete_hold(client: &Client, ns: &str, name: &str) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let dp = DeleteParams {
        grace_period_seconds: Some(0),
        ..DeleteParams::background()
    };
    if let Err(e) = pods.delete(name, &dp).await
        && !is_code(&e, 404)
    {
        tracing::warn!(error = %e, "cannot delete the hold pod {ns}/{name}");
    }
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), ns);
    match pvcs.get_opt(name).await {
        Ok(Some(pvc)) => {
            if let Some(pv) = pvc
                .spec
                .and_then(|s| s.volume_name)
                .filter(|v| !v.is_empty())
            {
                let pvs: Api<PersistentVolume> = Api::all(client.clone());
                if let Err(e) = pvs
                    .patch(
                        &pv,
                        &PatchParams::default(),
                        &Patch::Merge(json!({"spec": {"persistentVolumeReclaimPolicy": "Delete"}})),
                    )
                    .await
                    && !is_code(&e, 404)
                {
                    tracing::warn!(error = %e, "cannot set the reclaim policy of volume {pv}");
                }
            }
            // The claim goes once the pod is gone; a snapshot it was made from must outlive it
            // (Velero's order), so wait for it a little.
            if let Err(e) = delete_and_wait(&pvcs, name, Duration::from_secs(60)).await {
                tracing::warn!("claim {ns}/{name}: {e}");
            }
        }
        Ok(None) => {}
        Err(e) => tracing::warn!(error = %e, "cannot read the claim {ns}/{name}"),
    }
}

async fn wait_ready(
    api: &Api<DynamicObject>,
    ns: &str,
    name: &str,
    within: Duration,
) -> Result<DynamicObject, String> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match api.get_opt(name).await {
            Ok(Some(vs)) => {
                if vs.data["status"]["readyToUse"].as_bool() == Some(true) {
                    return Ok(vs);
                }
                if let Some(m) = str_at(&vs.data, &["status", "error", "message"]) {
                    return Err(format!("VolumeSnapshot {ns}/{name} failed: {m}"));
                }
            }
            Ok(None) => return Err(format!("VolumeSnapshot {ns}/{name} does not exist")),
            Err(e) => {
                tracing::warn!(error = %e, "cannot read VolumeSnapshot {ns}/{name}; retrying")
            }
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(format!(
                "VolumeSnapshot {ns}/{name} was not ready to use within {}",
                humantime::format_duration(within)
            ));
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Creates `obj`, or takes the one of that name made by an earlier attempt.
pub(super) async fn create_or_get<K>(api: &Api<K>, obj: K) -> Result<K, String>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + serde::Serialize + std::fmt::Debug,
{
    let name = obj.meta().name.clone().unwrap_or_default();
    match api.create(&PostParams::default(), &obj).await {
        Ok(o) => Ok(o),
        Err(e) if is_code(&e, 409) => api
            .get(&name)
            .await
            .map_err(|e| format!("cannot read {name}: {e}")),
        Err(e) => Err(format!("cannot create {name}: {e}")),
    }
}

pub(super) async fn delete_and_wait<K>(
    api: &Api<K>,
    name: &str,
    within: Duration,
) -> Result<(), String>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match api.delete(name, &DeleteParams::background()).await {
        Ok(_) => {}
        Err(e) if is_code(&e, 404) => return Ok(()),
        Err(e) => return Err(format!("cannot delete: {e}")),
    }
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match api.get_opt(name).await {
            Ok(None) => return Ok(()),
            Ok(Some(_)) | Err(_) if tokio::time::Instant::now() >= deadline => {
                return Err(format!(
                    "still there {} after its deletion",
                    humantime::format_duration(within)
                ));
            }
            _ => tokio::time::sleep(Duration::from_millis(500)).await,
        }
    }
}

/// The hold pod of a DataUpload or DataDownload (named after it), if it exists.
pub async fn hold_pod<K: ResourceExt>(
    client: &Client,
    obj: &K,
) -> Result<Option<Pod>, kube::Error> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), &obj.namespace().unwrap_or_default());
    pods.get_opt(&obj.name_any()).await
}

/// Why a hold pod will never run, when it will not (failed, evicted, its image not pullable,
/// unschedulable for good is left to the prepare timeout).
pub fn unrecoverable(pod: &Pod) -> Option<String> {
    let status = pod.status.as_ref()?;
    if status.phase.as_deref() == Some("Failed") || status.phase.as_deref() == Some("Succeeded") {
        return Some(format!(
            "the pod holding the snapshot ended ({}{})",
            status.phase.as_deref().unwrap_or_default(),
            status
                .message
                .as_deref()
                .map(|m| format!(": {m}"))
                .unwrap_or_default()
        ));
    }
    for c in status.container_statuses.iter().flatten() {
        if let Some(w) = c.state.as_ref().and_then(|s| s.waiting.as_ref())
            && matches!(
                w.reason.as_deref(),
                Some(
                    "ImagePullBackOff"
                        | "ErrImagePull"
                        | "InvalidImageName"
                        | "ErrImageNeverPull"
                        | "CreateContainerConfigError"
                )
            )
        {
            return Some(format!(
                "the pod holding the snapshot cannot start: {}{}",
                w.reason.as_deref().unwrap_or_default(),
                w.message
                    .as_deref()
                    .map(|m| format!(": {m}"))
                    .unwrap_or_default()
            ));
        }
    }
    None
}

/// Removes everything [`expose`] made (best effort, each step logged): the hold pod, the claim
/// and its volume, our VolumeSnapshot (and with it the storage snapshot), and the source
/// VolumeSnapshot if it is still there.
pub async fn clean_up(client: &Client, du: &DataUpload) {
    let ns = du.namespace().unwrap_or_default();
    let name = du.name_any();
    delete_hold(client, &ns, &name).await;
    if let Err(e) = snapshots(client, &ns)
        .delete(&name, &DeleteParams::background())
        .await
        && !is_code(&e, 404)
    {
        tracing::warn!(error = %e, "cannot delete VolumeSnapshot {ns}/{name}");
    }
    if let Some(vs) = du.spec.csi_snapshot.as_ref().map(|c| &c.volume_snapshot)
        && !vs.is_empty()
        && let Err(e) = snapshots(client, &du.spec.source_namespace)
            .delete(vs, &DeleteParams::background())
            .await
        && !is_code(&e, 404)
    {
        tracing::warn!(error = %e, "cannot delete VolumeSnapshot {}/{vs}", du.spec.source_namespace);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> ExposeSettings {
        let config: super::super::node_agent_config::NodeAgentConfigs = serde_json::from_str(
            r#"{"loadAffinity": [{"nodeSelector": {"matchLabels": {"disk": "ssd"}}}],
                "podLabels": {"team": "storage"}}"#,
        )
        .unwrap();
        ExposeSettings {
            image: "registry.example/podvolume-agent:1".into(),
            pod_labels: config.pod_labels.clone(),
            tolerations: Some(json!([{"operator": "Exists"}])),
            config: std::sync::Arc::new(config),
            ..ExposeSettings::default()
        }
    }

    #[test]
    fn the_hold_pod_is_locked_down_and_labelled_ours() {
        let s = settings();
        let pod = hold_pod_object(
            "b1-abc",
            "velero",
            json!([]),
            &s,
            true,
            s.config.affinity("any"),
            None,
        )
        .unwrap();
        let v = serde_json::to_value(&pod).unwrap();
        assert_eq!(v["metadata"]["labels"][HOLD_LABEL], "b1-abc");
        assert_eq!(v["metadata"]["labels"]["team"], "storage");
        // Not Velero's label: its node agent would take the pod for one of its own.
        assert!(
            v["metadata"]["labels"]
                .get("velero.io/data-upload")
                .is_none()
        );
        let spec = &v["spec"];
        assert_eq!(spec["automountServiceAccountToken"], false);
        assert_eq!(spec["containers"][0]["args"], json!(["hold"]));
        assert_eq!(
            spec["containers"][0]["securityContext"]["capabilities"]["drop"],
            json!(["ALL"])
        );
        assert_eq!(
            spec["volumes"][0]["persistentVolumeClaim"]["readOnly"],
            true
        );
        assert_eq!(spec["containers"][0]["volumeMounts"][0]["readOnly"], true);
        assert_eq!(spec["tolerations"], json!([{"operator": "Exists"}]));
        assert_eq!(
            spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
                [0]["matchExpressions"][0]["key"],
            "disk"
        );
        assert!(spec["nodeSelector"].get("kubernetes.io/hostname").is_none());
    }

    #[test]
    fn a_restore_hold_pod_is_pinned_to_the_consumer_s_node_without_the_affinity() {
        let s = settings();
        let pod = hold_pod_object(
            "r1-abc",
            "velero",
            json!([]),
            &s,
            false,
            s.config.affinity("any"),
            Some("node-7"),
        )
        .unwrap();
        let v = serde_json::to_value(&pod).unwrap();
        assert_eq!(
            v["spec"]["nodeSelector"]["kubernetes.io/hostname"],
            "node-7"
        );
        assert!(v["spec"].get("affinity").is_none() || v["spec"]["affinity"].is_null());
        assert_eq!(
            v["spec"]["volumes"][0]["persistentVolumeClaim"]["readOnly"],
            false
        );
    }
}
