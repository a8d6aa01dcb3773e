//! The resource registry: built-in resources and resources defined by CRDs.

use serde_json::Value;
use std::sync::Arc;

/// One served version of a resource.
#[derive(Debug, Clone)]
pub(crate) struct VersionInfo {
    pub name: String,
    /// `openAPIV3Schema` (custom resources only): unknown fields are pruned against it. Shared:
    /// every request clones its resource's description.
    pub schema: Option<Arc<Value>>,
    pub status_subresource: bool,
    /// Extra field selectors (`spec.nodeName` for pods, a CRD's `selectableFields`).
    pub selectable_fields: Vec<String>,
}

/// What the server knows about one resource (group + plural).
#[derive(Debug, Clone)]
pub(crate) struct ResourceInfo {
    pub group: String,
    pub plural: String,
    pub singular: String,
    pub kind: String,
    pub list_kind: String,
    pub namespaced: bool,
    pub short_names: Vec<String>,
    pub categories: Vec<String>,
    pub versions: Vec<VersionInfo>,
    /// Defined by a CustomResourceDefinition (pruning, SMP rejected, unconditional update refused).
    pub custom: bool,
    /// Review-style resources: only `create`, nothing stored.
    pub create_only: bool,
}

pub(crate) const ALL_VERBS: &[&str] = &[
    "create",
    "delete",
    "deletecollection",
    "get",
    "list",
    "patch",
    "update",
    "watch",
];

impl ResourceInfo {
    pub fn version(&self, v: &str) -> Option<&VersionInfo> {
        self.versions.iter().find(|x| x.name == v)
    }

    pub fn api_version(&self, v: &str) -> String {
        if self.group.is_empty() {
            v.to_string()
        } else {
            format!("{}/{}", self.group, v)
        }
    }

    pub fn verbs(&self) -> Vec<&'static str> {
        if self.create_only {
            vec!["create"]
        } else {
            ALL_VERBS.to_vec()
        }
    }

    /// Field selectors the server accepts for this resource at version `v`.
    pub fn supported_fields(&self, v: &str) -> Vec<String> {
        let mut f = vec!["metadata.name".to_string()];
        if self.namespaced {
            f.push("metadata.namespace".to_string());
        }
        if let Some(vi) = self.version(v) {
            f.extend(vi.selectable_fields.iter().cloned());
        }
        f
    }

    #[allow(clippy::too_many_arguments)]
    fn builtin(
        group: &str,
        version: &str,
        plural: &str,
        kind: &str,
        namespaced: bool,
        short: &[&str],
        status: bool,
        fields: &[&str],
    ) -> Self {
        ResourceInfo {
            group: group.into(),
            plural: plural.into(),
            singular: kind.to_lowercase(),
            kind: kind.into(),
            list_kind: format!("{kind}List"),
            namespaced,
            short_names: short.iter().map(|s| s.to_string()).collect(),
            categories: Vec::new(),
            versions: vec![VersionInfo {
                name: version.into(),
                schema: None,
                status_subresource: status,
                selectable_fields: fields.iter().map(|s| s.to_string()).collect(),
            }],
            custom: false,
            create_only: false,
        }
    }

    /// Build the resource a CRD object defines.
    pub fn from_crd(crd: &Value) -> Result<Self, String> {
        let spec = crd.get("spec").ok_or("spec: Required value")?;
        let s = |p: &str| spec.pointer(p).and_then(Value::as_str).map(str::to_string);
        let group = s("/group").ok_or("spec.group: Required value")?;
        let plural = s("/names/plural").ok_or("spec.names.plural: Required value")?;
        let kind = s("/names/kind").ok_or("spec.names.kind: Required value")?;
        let expected = format!("{plural}.{group}");
        let name = crd
            .pointer("/metadata/name")
            .and_then(Value::as_str)
            .unwrap_or("");
        if name != expected {
            return Err(format!(
                "metadata.name: Invalid value: {name:?}: must be spec.names.plural+\".\"+spec.group"
            ));
        }
        let strings = |p: &str| -> Vec<String> {
            spec.pointer(p)
                .and_then(Value::as_array)
                .map(|a| {
                    a.iter()
                        .filter_map(|x| x.as_str().map(str::to_string))
                        .collect()
                })
                .unwrap_or_default()
        };
        let mut versions = Vec::new();
        for v in spec
            .get("versions")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            if v.get("served").and_then(Value::as_bool) == Some(false) {
                continue;
            }
            let Some(vname) = v.get("name").and_then(Value::as_str) else {
                return Err("spec.versions[].name: Required value".into());
            };
            versions.push(VersionInfo {
                name: vname.to_string(),
                schema: v.pointer("/schema/openAPIV3Schema").cloned().map(Arc::new),
                status_subresource: v.pointer("/subresources/status").is_some(),
                selectable_fields: v
                    .get("selectableFields")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .filter_map(|f| f.get("jsonPath").and_then(Value::as_str))
                    .map(|p| p.trim_start_matches('.').to_string())
                    .collect(),
            });
        }
        if versions.is_empty() {
            return Err(
                "spec.versions: Invalid value: must have at least one served version".into(),
            );
        }
        Ok(ResourceInfo {
            group,
            singular: s("/names/singular").unwrap_or_else(|| kind.to_lowercase()),
            list_kind: s("/names/listKind").unwrap_or_else(|| format!("{kind}List")),
            namespaced: s("/scope").as_deref() != Some("Cluster"),
            short_names: strings("/names/shortNames"),
            categories: strings("/names/categories"),
            plural,
            kind,
            versions,
            custom: true,
            create_only: false,
        })
    }
}

/// Resources every stand-in serves from the start.
pub(crate) fn builtins() -> Vec<ResourceInfo> {
    let pod_fields = [
        "spec.nodeName",
        "spec.restartPolicy",
        "spec.schedulerName",
        "spec.serviceAccountName",
        "status.phase",
        "status.podIP",
        "status.nominatedNodeName",
    ];
    let event_fields = [
        "involvedObject.kind",
        "involvedObject.namespace",
        "involvedObject.name",
        "involvedObject.uid",
        "involvedObject.apiVersion",
        "involvedObject.resourceVersion",
        "involvedObject.fieldPath",
        "reason",
        "reportingComponent",
        "source",
        "type",
    ];
    let new_event_fields = [
        "regarding.kind",
        "regarding.namespace",
        "regarding.name",
        "regarding.uid",
        "reason",
        "type",
        "reportingController",
    ];
    let b = ResourceInfo::builtin;
    let mut v = vec![
        b("", "v1", "pods", "Pod", true, &["po"], true, &pod_fields),
        b(
            "",
            "v1",
            "persistentvolumeclaims",
            "PersistentVolumeClaim",
            true,
            &["pvc"],
            true,
            &[],
        ),
        b(
            "",
            "v1",
            "persistentvolumes",
            "PersistentVolume",
            false,
            &["pv"],
            true,
            &[],
        ),
        b("", "v1", "secrets", "Secret", true, &[], false, &["type"]),
        b(
            "",
            "v1",
            "configmaps",
            "ConfigMap",
            true,
            &["cm"],
            false,
            &[],
        ),
        b(
            "",
            "v1",
            "namespaces",
            "Namespace",
            false,
            &["ns"],
            true,
            &["status.phase"],
        ),
        b(
            "",
            "v1",
            "nodes",
            "Node",
            false,
            &["no"],
            true,
            &["spec.unschedulable"],
        ),
        b(
            "",
            "v1",
            "events",
            "Event",
            true,
            &["ev"],
            false,
            &event_fields,
        ),
        b(
            "events.k8s.io",
            "v1",
            "events",
            "Event",
            true,
            &["ev"],
            false,
            &new_event_fields,
        ),
        b(
            "apiextensions.k8s.io",
            "v1",
            "customresourcedefinitions",
            "CustomResourceDefinition",
            false,
            &["crd", "crds"],
            true,
            &[],
        ),
    ];
    let mut review = |group: &str, plural: &str, kind: &str| {
        let mut r = b(group, "v1", plural, kind, false, &[], false, &[]);
        r.create_only = true;
        v.push(r);
    };
    review("authentication.k8s.io", "tokenreviews", "TokenReview");
    review(
        "authorization.k8s.io",
        "subjectaccessreviews",
        "SubjectAccessReview",
    );
    v
}
