//! API discovery documents (`/api`, `/apis`, `/apis/<group>[/<version>]`, `/version`).

use crate::resources::ResourceInfo;
use serde_json::{Value, json};
use std::collections::BTreeMap;

type Registry = BTreeMap<(String, String), ResourceInfo>;

pub(crate) fn api_versions(server_address: &str) -> Value {
    json!({
        "kind": "APIVersions",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": server_address}],
    })
}

/// Served versions per non-core group, in first-registered order, preferred first.
fn groups(reg: &Registry) -> BTreeMap<String, Vec<String>> {
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for r in reg.values().filter(|r| !r.group.is_empty()) {
        let entry = out.entry(r.group.clone()).or_default();
        for v in &r.versions {
            if !entry.contains(&v.name) {
                entry.push(v.name.clone());
            }
        }
    }
    out
}

fn group_doc(name: &str, versions: &[String]) -> Value {
    let vs: Vec<Value> = versions
        .iter()
        .map(|v| json!({"groupVersion": format!("{name}/{v}"), "version": v}))
        .collect();
    json!({
        "name": name,
        "versions": vs,
        "preferredVersion": vs.first().cloned().unwrap_or(Value::Null),
    })
}

pub(crate) fn api_group_list(reg: &Registry) -> Value {
    let gs: Vec<Value> = groups(reg).iter().map(|(g, vs)| group_doc(g, vs)).collect();
    json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": gs})
}

pub(crate) fn api_group(reg: &Registry, group: &str) -> Option<Value> {
    let gs = groups(reg);
    let vs = gs.get(group)?;
    let mut doc = group_doc(group, vs);
    doc["kind"] = json!("APIGroup");
    doc["apiVersion"] = json!("v1");
    Some(doc)
}

pub(crate) fn api_resource_list(reg: &Registry, group: &str, version: &str) -> Option<Value> {
    let mut resources = Vec::new();
    for r in reg.values().filter(|r| r.group == group) {
        let Some(v) = r.version(version) else {
            continue;
        };
        let mut doc = json!({
            "name": r.plural,
            "singularName": r.singular,
            "namespaced": r.namespaced,
            "kind": r.kind,
            "verbs": r.verbs(),
        });
        if !r.short_names.is_empty() {
            doc["shortNames"] = json!(r.short_names);
        }
        if !r.categories.is_empty() {
            doc["categories"] = json!(r.categories);
        }
        resources.push(doc);
        if v.status_subresource {
            resources.push(json!({
                "name": format!("{}/status", r.plural),
                "singularName": "",
                "namespaced": r.namespaced,
                "kind": r.kind,
                "verbs": ["get", "patch", "update"],
            }));
        }
    }
    if resources.is_empty() {
        return None;
    }
    let gv = if group.is_empty() {
        version.to_string()
    } else {
        format!("{group}/{version}")
    };
    Some(json!({
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": gv,
        "resources": resources,
    }))
}

pub(crate) fn version_info(major: &str, minor: &str) -> Value {
    json!({
        "major": major,
        "minor": minor,
        "gitVersion": format!("v{major}.{minor}.0-podvolume-testbed"),
        "gitCommit": "0000000000000000000000000000000000000000",
        "gitTreeState": "clean",
        "buildDate": "2024-04-17T00:00:00Z",
        "goVersion": "go1.22.2",
        "compiler": "gc",
        "platform": "linux/amd64",
    })
}
