//! Exposing a volume for a DataDownload, and handing it to the restored claim, as Velero's
//! generic restore exposer (`pkg/exposer/generic_restore.go`) does:
//!
//! ```text
//! target claim (restored by Velero, unbound, a selector velero.io/dynamic-pv-restore=...)
//!   -- its consumer scheduled (WaitForFirstConsumer: the scheduler's selected-node) -->
//!   => PersistentVolumeClaim <dd> (Velero namespace) of the target's class, size and modes,
//!      provisioned on that node
//!   => Pod <dd> mounting it, on that node
//!   ... the agent of that node restores the snapshot into it ...
//!   => the new volume retained, pod and claim <dd> deleted, the target claim bound to the volume
//!      (spec.volumeName; the volume's claimRef and the selector's label), the reclaim policy
//!      given back
//! ```
//!
//! Everything takes the DataDownload's name, so an expose after a restart takes over what an
//! earlier one made.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client, ResourceExt};
use serde_json::{Value, json};

use super::expose::{ExposeSettings, create_or_get, delete_and_wait, hold_pod_object};
use crate::datamover::DataDownload;

/// The scheduler's annotation on a WaitForFirstConsumer claim: the node its consumer runs on.
pub const SELECTED_NODE: &str = "volume.kubernetes.io/selected-node";
const BIND_COMPLETED: &str = "pv.kubernetes.io/bind-completed";
const BOUND_BY_CONTROLLER: &str = "pv.kubernetes.io/bound-by-controller";

fn target(dd: &DataDownload) -> (String, String) {
    let t = &dd.spec.target_volume;
    (t.namespace.clone(), t.pvc.clone())
}

/// Waits until the target claim may be provisioned: at once for an immediate class (or with
/// `ignore_delay_binding`), else once the scheduler has chosen a node for its consumer. Returns
/// that node and the claim.
async fn wait_consumed(
    client: &Client,
    dd: &DataDownload,
    within: Duration,
    ignore_delay_binding: bool,
) -> Result<(Option<String>, PersistentVolumeClaim), String> {
    let (ns, name) = target(dd);
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), &ns);
    let classes: Api<StorageClass> = Api::all(client.clone());
    let deadline = tokio::time::Instant::now() + within;
    let mut delayed: Option<bool> = None;
    loop {
        let pvc = pvcs
            .get_opt(&name)
            .await
            .map_err(|e| format!("cannot read the target claim {ns}/{name}: {e}"))?
            .ok_or_else(|| format!("the target claim {ns}/{name} does not exist"))?;
        if ignore_delay_binding {
            return Ok((None, pvc));
        }
        let class = pvc.spec.as_ref().and_then(|s| s.storage_class_name.clone());
        if delayed.is_none() {
            delayed = Some(match &class {
                Some(c) if !c.is_empty() => {
                    let sc = classes
                        .get_opt(c)
                        .await
                        .map_err(|e| format!("cannot read StorageClass {c}: {e}"))?
                        .ok_or_else(|| {
                            format!(
                                "StorageClass {c} of the target claim {ns}/{name} does not exist"
                            )
                        })?;
                    sc.volume_binding_mode.as_deref() == Some("WaitForFirstConsumer")
                }
                _ => false,
            });
        }
        if delayed != Some(true) {
            return Ok((None, pvc));
        }
        if let Some(node) = pvc
            .annotations()
            .get(SELECTED_NODE)
            .filter(|n| !n.is_empty())
        {
            return Ok((Some(node.clone()), pvc));
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(format!(
                "no pod using the target claim {ns}/{name} was scheduled within {} (its class binds on first consumer)",
                humantime::format_duration(within)
            ));
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Makes the restore claim and the pod holding it, on the node of the target claim's consumer
/// when its class waits for one. Errors are messages for the DataDownload.
pub async fn expose(
    client: &Client,
    dd: &DataDownload,
    settings: &ExposeSettings,
    within: Duration,
    ignore_delay_binding: bool,
) -> Result<(), String> {
    let velero_ns = dd.namespace().unwrap_or_default();
    let name = dd.name_any();
    let (ns, pvc_name) = target(dd);
    let (node, target) = wait_consumed(client, dd, within, ignore_delay_binding).await?;
    let spec = target.spec.clone().unwrap_or_default();
    if spec.volume_name.as_deref().is_some_and(|v| !v.is_empty()) {
        // Ours from an earlier attempt is bound already only after the hand-over.
        return Err(format!(
            "the target claim {ns}/{pvc_name} is already bound to volume {}: nothing to restore into",
            spec.volume_name.unwrap_or_default()
        ));
    }
    if spec.volume_mode.as_deref() == Some("Block") {
        return Err(format!(
            "the target claim {ns}/{pvc_name} is a Block volume (volumeMode: Block): this node agent restores file-system volumes only"
        ));
    }
    let owner = json!([{
        "apiVersion": "velero.io/v2alpha1", "kind": "DataDownload", "name": name,
        "uid": dd.metadata.uid, "controller": true,
    }]);
    let mut annotations: BTreeMap<String, String> = target
        .annotations()
        .iter()
        .filter(|(k, _)| {
            ![SELECTED_NODE, BIND_COMPLETED, BOUND_BY_CONTROLLER].contains(&k.as_str())
                && !k.starts_with("volume.beta.kubernetes.io/")
                && !k.starts_with("volume.kubernetes.io/")
        })
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    if let Some(n) = &node {
        annotations.insert(SELECTED_NODE.to_string(), n.clone());
    }
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), &velero_ns);
    create_or_get(
        &pvcs,
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": velero_ns, "ownerReferences": owner,
                "labels": target.labels(), "annotations": annotations},
            "spec": {
                "accessModes": spec.access_modes,
                "storageClassName": spec.storage_class_name,
                "volumeMode": "Filesystem",
                "resources": spec.resources,
            },
        }))
        .map_err(|e| format!("the restore claim: {e}"))?,
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
            false,
            settings
                .config
                .affinity(spec.storage_class_name.as_deref().unwrap_or_default()),
            node.as_deref(),
        )?,
    )
    .await?;
    Ok(())
}

/// Hands the restored volume to the target claim: the volume retained (so that deleting the
/// restore claim keeps it), the hold pod and the restore claim deleted, the target claim bound
/// to it, the reclaim policy given back. On an error after the volume was retained, the volume
/// is deleted (Velero's exposer does the same): the DataDownload fails and nothing is left.
pub async fn hand_over(
    client: &Client,
    dd: &DataDownload,
    within: Duration,
) -> Result<String, String> {
    let velero_ns = dd.namespace().unwrap_or_default();
    let name = dd.name_any();
    let (ns, pvc_name) = target(dd);
    let targets: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), &ns);
    let target = targets
        .get_opt(&pvc_name)
        .await
        .map_err(|e| format!("cannot read the target claim {ns}/{pvc_name}: {e}"))?
        .ok_or_else(|| format!("the target claim {ns}/{pvc_name} no longer exists"))?;
    let restore_claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), &velero_ns);
    let pv_name = restore_claims
        .get_opt(&name)
        .await
        .map_err(|e| format!("cannot read the restore claim {velero_ns}/{name}: {e}"))?
        .and_then(|c| c.spec.and_then(|s| s.volume_name))
        .filter(|v| !v.is_empty())
        .ok_or_else(|| format!("the restore claim {velero_ns}/{name} is bound to no volume"))?;
    let pvs: Api<PersistentVolume> = Api::all(client.clone());
    let pv = pvs
        .get(&pv_name)
        .await
        .map_err(|e| format!("cannot read volume {pv_name}: {e}"))?;
    let policy = pv
        .spec
        .as_ref()
        .and_then(|s| s.persistent_volume_reclaim_policy.clone())
        .unwrap_or_else(|| "Delete".into());
    let patch = |v: Value| Patch::Merge(v);
    let pp = PatchParams::default();
    if policy != "Retain" {
        pvs.patch(
            &pv_name,
            &pp,
            &patch(json!({"spec": {"persistentVolumeReclaimPolicy": "Retain"}})),
        )
        .await
        .map_err(|e| format!("cannot retain volume {pv_name}: {e}"))?;
    }
    let result = async {
        let pods: Api<Pod> = Api::namespaced(client.clone(), &velero_ns);
        delete_and_wait(&pods, &name, within)
            .await
            .map_err(|e| format!("hold pod {velero_ns}/{name}: {e}"))?;
        delete_and_wait(&restore_claims, &name, within)
            .await
            .map_err(|e| format!("restore claim {velero_ns}/{name}: {e}"))?;
        targets
            .patch(
                &pvc_name,
                &pp,
                &patch(json!({
                    "metadata": {"annotations": {BIND_COMPLETED: null, BOUND_BY_CONTROLLER: null}},
                    "spec": {"volumeName": pv_name},
                })),
            )
            .await
            .map_err(|e| format!("cannot bind the target claim {ns}/{pvc_name}: {e}"))?;
        // The selector Velero put on the target claim (velero.io/dynamic-pv-restore) must match
        // the volume; labels the volume has already are kept.
        let mut labels = serde_json::Map::new();
        let have = pv.labels();
        for (k, v) in target
            .spec
            .as_ref()
            .and_then(|s| s.selector.as_ref())
            .and_then(|s| s.match_labels.as_ref())
            .into_iter()
            .flatten()
        {
            if !have.contains_key(k) {
                labels.insert(k.clone(), json!(v));
            }
        }
        pvs.patch(
            &pv_name,
            &pp,
            &patch(json!({
                "metadata": {"labels": labels, "annotations": {BOUND_BY_CONTROLLER: null}},
                "spec": {"claimRef": {"kind": "PersistentVolumeClaim", "apiVersion": "v1",
                    "namespace": ns, "name": pvc_name, "uid": null, "resourceVersion": null}},
            })),
        )
        .await
        .map_err(|e| format!("cannot point volume {pv_name} at {ns}/{pvc_name}: {e}"))?;
        wait_bound(&pvs, &pv_name, &ns, &pvc_name, within).await
    }
    .await;
    match result {
        Ok(()) => {
            if policy != "Retain"
                && let Err(e) = pvs
                    .patch(
                        &pv_name,
                        &pp,
                        &patch(json!({"spec": {"persistentVolumeReclaimPolicy": policy}})),
                    )
                    .await
            {
                tracing::warn!(error = %e, "volume {pv_name} keeps reclaim policy Retain (was {policy})");
            }
            Ok(pv_name)
        }
        Err(e) => {
            if let Err(d) = pvs.delete(&pv_name, &Default::default()).await {
                tracing::warn!(error = %d, "cannot delete the retained volume {pv_name}");
            }
            Err(e)
        }
    }
}

async fn wait_bound(
    pvs: &Api<PersistentVolume>,
    pv: &str,
    ns: &str,
    pvc: &str,
    within: Duration,
) -> Result<(), String> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match pvs.get_opt(pv).await {
            Ok(Some(v)) => {
                let claim = v.spec.as_ref().and_then(|s| s.claim_ref.as_ref());
                if let Some(c) = claim
                    && (c.name.as_deref() != Some(pvc) || c.namespace.as_deref() != Some(ns))
                {
                    return Err(format!(
                        "volume {pv} was taken by claim {}/{}",
                        c.namespace.as_deref().unwrap_or_default(),
                        c.name.as_deref().unwrap_or_default()
                    ));
                }
                if claim.is_some()
                    && v.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound")
                {
                    return Ok(());
                }
            }
            Ok(None) => return Err(format!("volume {pv} disappeared")),
            Err(e) => tracing::warn!(error = %e, "cannot read volume {pv}; retrying"),
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(format!(
                "volume {pv} was not bound to {ns}/{pvc} within {}",
                humantime::format_duration(within)
            ));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Removes what [`expose`] made (best effort): the hold pod, the restore claim and its volume.
/// After a hand-over there is nothing left: the volume is the target claim's.
pub async fn clean_up(client: &Client, dd: &DataDownload) {
    super::expose::delete_hold(client, &dd.namespace().unwrap_or_default(), &dd.name_any()).await;
}
