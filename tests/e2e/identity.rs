//! On a real API server the agent runs as the node agent's own ServiceAccount, with exactly the
//! RBAC `daemonset/` grants it, never as the tests' admin: a rule missing from `daemonset/` must
//! fail a test here before it fails a user's backup with a 403.
//!
//! Each test gets its own copy of `daemonset/serviceaccount.yaml` and `daemonset/rbac.yaml`, as
//! `kubectl apply -k daemonset/` would make them with the test's namespace playing Velero's:
//! namespaced objects (ServiceAccount, Role, RoleBinding) go into that namespace, subjects name
//! its ServiceAccount, and the cluster-scoped ClusterRole/ClusterRoleBinding get the namespace as
//! a suffix so that tests running at once do not share (or delete) each other's. The token comes
//! from the TokenRequest API, as a projected ServiceAccount token does in a pod.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::ServiceAccount;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::{Value, json};

/// The ServiceAccount `daemonset/` runs the agent as.
pub const SERVICE_ACCOUNT: &str = "node-agent";

/// The objects of `daemonset/` that make the agent's identity, adapted to `ns`.
pub fn identity_objects(ns: &str) -> Vec<Value> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("daemonset");
    let mut objects = Vec::new();
    for file in ["serviceaccount.yaml", "rbac.yaml"] {
        let text = std::fs::read_to_string(dir.join(file)).unwrap();
        for doc in text.split("\n---") {
            let v: Value = serde_norway::from_str(doc).unwrap();
            if v.is_null() {
                continue;
            }
            objects.push(into_namespace(v, ns));
        }
    }
    objects
}

/// What `kustomize` does with `namespace:` for these kinds, plus a per-namespace name for the
/// cluster-scoped ones.
fn into_namespace(mut v: Value, ns: &str) -> Value {
    let kind = v["kind"].as_str().unwrap().to_string();
    match kind.as_str() {
        "ClusterRole" | "ClusterRoleBinding" => {
            let name = format!("{}-{ns}", v["metadata"]["name"].as_str().unwrap());
            v["metadata"]["name"] = json!(name);
        }
        _ => v["metadata"]["namespace"] = json!(ns),
    }
    if kind == "ClusterRoleBinding" {
        let role = format!("{}-{ns}", v["roleRef"]["name"].as_str().unwrap());
        v["roleRef"]["name"] = json!(role);
    }
    if let Some(subjects) = v.get_mut("subjects").and_then(Value::as_array_mut) {
        for s in subjects {
            if s["kind"] == "ServiceAccount" {
                s["namespace"] = json!(ns);
            }
        }
    }
    v
}

/// Applies the identity objects for `ns` (server-side apply, as `kubectl apply --server-side`),
/// asks for a token of the ServiceAccount and writes a kubeconfig that uses it, with the admin
/// kubeconfig's cluster (server and CA). Returns the kubeconfig's path once the ServiceAccount
/// can list PodVolumeBackups in `ns` (RBAC takes a moment to see new bindings).
pub async fn node_agent_kubeconfig(
    admin: &Client,
    admin_kubeconfig: &Path,
    ns: &str,
    dir: &Path,
) -> PathBuf {
    for obj in identity_objects(ns) {
        apply(admin, obj).await;
    }
    let sas: Api<ServiceAccount> = Api::namespaced(admin.clone(), ns);
    let request = TokenRequest {
        spec: Some(TokenRequestSpec {
            // Longer than the slowest test; a pod's token is refreshed by the kubelet, which
            // these tests do not have.
            expiration_seconds: Some(3 * 3600),
            ..Default::default()
        }),
        ..Default::default()
    };
    let token = sas
        .create_token_request(SERVICE_ACCOUNT, &PostParams::default(), &request)
        .await
        .unwrap()
        .status
        .expect("TokenRequest answered without a status")
        .token;

    let cluster = current_cluster(admin_kubeconfig);
    let kubeconfig = json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "e2e", "cluster": cluster}],
        "users": [{"name": format!("system:serviceaccount:{ns}:{SERVICE_ACCOUNT}"), "user": {"token": token}}],
        "contexts": [{"name": "node-agent", "context": {
            "cluster": "e2e",
            "user": format!("system:serviceaccount:{ns}:{SERVICE_ACCOUNT}"),
            "namespace": ns,
        }}],
        "current-context": "node-agent",
    });
    let path = dir.join("node-agent.kubeconfig");
    std::fs::write(&path, serde_norway::to_string(&kubeconfig).unwrap()).unwrap();
    set_private(&path);

    // RBAC's authorizer follows bindings through an informer: wait until it sees this one.
    let client = {
        let kc = kube::config::Kubeconfig::read_from(&path).unwrap();
        let cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default())
            .await
            .unwrap();
        Client::try_from(cfg).unwrap()
    };
    let pvbs: Api<podvolume_agent::crd::PodVolumeBackup> = Api::namespaced(client, ns);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match pvbs.list(&Default::default()).await {
            Ok(_) => break,
            Err(e) => assert!(
                Instant::now() < deadline,
                "the node-agent ServiceAccount of {ns} still cannot list PodVolumeBackups: {e}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    path
}

/// The kubeconfig carries a bearer token: readable by its owner only, as a Secret is.
fn set_private(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
}

async fn apply(client: &Client, obj: Value) {
    let (group, version) = match obj["apiVersion"].as_str().unwrap().split_once('/') {
        Some((g, v)) => (g.to_string(), v.to_string()),
        None => (
            String::new(),
            obj["apiVersion"].as_str().unwrap().to_string(),
        ),
    };
    let kind = obj["kind"].as_str().unwrap();
    let gvk = GroupVersionKind::gvk(&group, &version, kind);
    let plural = format!("{}s", kind.to_lowercase());
    let ar = ApiResource::from_gvk_with_plural(&gvk, &plural);
    let name = obj["metadata"]["name"].as_str().unwrap().to_string();
    let api: Api<DynamicObject> = match obj["metadata"]["namespace"].as_str() {
        Some(ns) => Api::namespaced_with(client.clone(), ns, &ar),
        None => Api::all_with(client.clone(), &ar),
    };
    api.patch(
        &name,
        &PatchParams::apply("podvolume-agent-e2e").force(),
        &Patch::Apply(&obj),
    )
    .await
    .unwrap_or_else(|e| panic!("applying {kind} {name}: {e}"));
}

#[test]
fn the_identity_is_daemonsets_own_moved_into_the_test_namespace() {
    let objs = identity_objects("t1");
    let kinds: Vec<&str> = objs.iter().map(|o| o["kind"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        [
            "ServiceAccount",
            "ClusterRole",
            "ClusterRoleBinding",
            "Role",
            "RoleBinding"
        ]
    );
    for o in &objs {
        if let Some(subjects) = o["subjects"].as_array() {
            assert!(subjects.iter().all(|s| s["namespace"] == "t1"), "{o}");
        }
    }
    let crb = &objs[2];
    assert_eq!(crb["metadata"]["name"], "podvolume-agent-t1");
    assert_eq!(crb["roleRef"]["name"], "podvolume-agent-t1");
    assert_eq!(objs[0]["metadata"]["name"], SERVICE_ACCOUNT);
    assert_eq!(objs[3]["metadata"]["namespace"], "t1");
}

/// The cluster entry (server, CA) of a kubeconfig's current context: what a kubeconfig made for
/// another identity on the same server reuses.
pub fn current_cluster(kubeconfig: &Path) -> Value {
    let kc: Value = serde_norway::from_str(&std::fs::read_to_string(kubeconfig).unwrap()).unwrap();
    let current = kc["current-context"].as_str().unwrap_or_default();
    let cluster_name = kc["contexts"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["name"] == current))
        .map(|c| c["context"]["cluster"].clone())
        .unwrap_or(Value::Null);
    kc["clusters"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["name"] == cluster_name))
        .map(|c| c["cluster"].clone())
        .expect("the kubeconfig's current context names no cluster")
}
