//! How a DataUpload's snapshot is exposed on this cluster: the hold pod's image and tolerations
//! (the agent's own DaemonSet's, as Velero's exposer takes its node agent's), and why an exposure
//! did not become ready, for the DataUpload's message.

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod};
use kube::{Api, ResourceExt};

use super::Context;
use super::expose::ExposeSettings;

/// The agent's DaemonSet, whose pod template the hold pod takes its image and tolerations from.
pub const DAEMONSET: &str = "node-agent";

pub async fn expose_settings(ctx: &Context) -> Result<ExposeSettings, String> {
    let config = ctx.node_agent_config.clone();
    let resources = config.resources().unwrap_or_else(|e| {
        // Velero ignores the whole section then; so does the agent, saying why.
        tracing::warn!("node-agent ConfigMap: {e}; podResources ignored");
        None
    });
    let mut settings = ExposeSettings {
        pod_labels: config.pod_labels.clone(),
        pod_annotations: config.pod_annotations.clone(),
        priority_class_name: Some(config.priority_class_name.clone()).filter(|p| !p.is_empty()),
        resources,
        config,
        ..ExposeSettings::default()
    };
    let ns = &ctx.args.namespace;
    let api: Api<DaemonSet> = Api::namespaced(ctx.client.clone(), ns);
    let ds = match api.get_opt(DAEMONSET).await {
        Ok(ds) => ds,
        Err(e) if ctx.args.data_mover_image.is_some() => {
            tracing::debug!(error = %e, "cannot read the agent's DaemonSet; using --data-mover-image");
            None
        }
        Err(e) => {
            return Err(format!(
                "cannot read DaemonSet {ns}/{DAEMONSET} (the hold pod's image): {e}"
            ));
        }
    };
    let template = ds.and_then(|d| d.spec.template.spec);
    settings.tolerations = template
        .as_ref()
        .and_then(|t| t.tolerations.as_ref())
        .map(|t| serde_json::to_value(t).unwrap_or_default());
    settings.image = match (&ctx.args.data_mover_image, template) {
        (Some(image), _) => image.clone(),
        (None, Some(t)) => t
            .containers
            .first()
            .and_then(|c| c.image.clone())
            .ok_or_else(|| format!("DaemonSet {ns}/{DAEMONSET} names no image"))?,
        (None, None) => {
            return Err(format!(
                "DaemonSet {ns}/{DAEMONSET} not found: the hold pod takes the agent's image from it (or give --data-mover-image)"
            ));
        }
    };
    Ok(settings)
}

/// What the hold pod and its claim say, for a prepare that timed out.
pub async fn why_not_running<K: ResourceExt>(ctx: &Context, du: &K) -> String {
    let ns = du.namespace().unwrap_or_default();
    let name = du.name_any();
    let mut parts = Vec::new();
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(ctx.client.clone(), &ns);
    match pvcs.get_opt(&name).await {
        Ok(Some(pvc)) => {
            let phase = pvc
                .status
                .and_then(|s| s.phase)
                .unwrap_or_else(|| "(no phase)".into());
            let mut s = format!("claim {ns}/{name} {phase}");
            // The commonest cause of a claim that never binds: a class that is not there (a
            // ConfigMap backupPVC naming one, say).
            if let Some(class) = pvc
                .spec
                .and_then(|s| s.storage_class_name)
                .filter(|c| !c.is_empty())
            {
                let classes: Api<k8s_openapi::api::storage::v1::StorageClass> =
                    Api::all(ctx.client.clone());
                if let Ok(None) = classes.get_opt(&class).await {
                    s.push_str(&format!(" (its StorageClass {class} does not exist)"));
                }
            }
            parts.push(s);
        }
        Ok(None) => parts.push(format!("claim {ns}/{name} missing")),
        Err(e) => parts.push(format!("claim {ns}/{name} unreadable ({e})")),
    }
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    match pods.get_opt(&name).await {
        Ok(Some(pod)) => {
            let status = pod.status.unwrap_or_default();
            let mut s = format!(
                "hold pod {ns}/{name} {}",
                status.phase.unwrap_or_else(|| "(no phase)".into())
            );
            for c in status
                .conditions
                .iter()
                .flatten()
                .filter(|c| c.status == "False")
            {
                s.push_str(&format!(
                    ", {} False{}",
                    c.type_,
                    c.message
                        .as_deref()
                        .map(|m| format!(": {m}"))
                        .unwrap_or_default()
                ));
            }
            parts.push(s);
        }
        Ok(None) => parts.push(format!("hold pod {ns}/{name} missing")),
        Err(e) => parts.push(format!("hold pod {ns}/{name} unreadable ({e})")),
    }
    crate::text::truncate(&parts.join("; "), 600)
}
