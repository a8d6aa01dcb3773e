//! For the test targets that run only against a real kube-apiserver (`tests/opsapi.rs`,
//! `tests/plugin.rs`, `tests/volume_path.rs`): the check that one is configured, and callers of
//! it with identities of their own: ServiceAccounts with a bearer token from the TokenRequest API
//! and exactly the RBAC the test grants them.
//!
//! `scripts/test-real-cluster.sh` starts the server and names its admin kubeconfig in
//! `PODVOLUME_E2E_KUBECONFIG`. Included by path next to `tests/e2e/harness.rs` (as `harness`).
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::api::PostParams;
use kube::{Api, Client};
use serde_json::{Value, json};

use crate::harness::{Env, Flavour};

/// Panics, saying how to get one, unless a real API server is configured: these tests have no
/// double to fall back on, and a test that skips itself would pass having checked nothing.
pub fn require_real_api_server() {
    if std::env::var_os("PODVOLUME_E2E_KUBECONFIG").is_none() {
        panic!(
            "this test runs against a real kube-apiserver: set PODVOLUME_E2E_KUBECONFIG to the admin \
             kubeconfig of one with Velero's CRDs installed (scripts/test-real-cluster.sh starts \
             one and runs this test there)"
        );
    }
}

/// A test environment on the real API server (namespaces of its own, the agent's identity from
/// `daemonset/`), which must serve the CRDs of `flavour`: a real server has one set installed
/// at a time, and `scripts/test-real-cluster.sh` runs each test while its set is.
pub async fn real_env(flavour: Flavour) -> Env {
    require_real_api_server();
    let env = Env::new(flavour).await;
    assert_eq!(
        env.flavour, flavour,
        "this test needs the API server to serve {flavour:?} CRDs (Velero: Velero 1.17+'s \
         PodVolumeBackup/Restore CRDs; Ours: daemonset/crds.yaml); scripts/test-real-cluster.sh \
         runs it while they are installed"
    );
    env
}

/// A kube client with the credentials and server of `kubeconfig` (its current context).
pub async fn client_of(kubeconfig: &Path) -> Client {
    let kc = kube::config::Kubeconfig::read_from(kubeconfig)
        .unwrap_or_else(|e| panic!("reading {}: {e}", kubeconfig.display()));
    let cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default())
        .await
        .unwrap_or_else(|e| panic!("{}: {e}", kubeconfig.display()));
    Client::try_from(cfg).unwrap()
}

/// Who a [`Caller`]'s Role is bound to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BoundAs {
    /// The ServiceAccount itself (its user name).
    User,
    /// The group of every ServiceAccount of its namespace (`system:serviceaccounts:<ns>`), so
    /// that only a check that passes the caller's groups on finds the grant.
    NamespaceGroup,
    /// No Role at all: authenticated, allowed nothing.
    Nothing,
}

/// A ServiceAccount of the test with a token and a kubeconfig that uses it.
pub struct Caller {
    pub namespace: String,
    pub name: String,
    pub token: String,
    pub kubeconfig: PathBuf,
}

impl Caller {
    /// The user name the API server authenticates the token as.
    pub fn username(&self) -> String {
        format!("system:serviceaccount:{}:{}", self.namespace, self.name)
    }

    /// The groups the API server gives the token.
    pub fn groups(&self) -> Vec<String> {
        vec![
            "system:serviceaccounts".to_string(),
            format!("system:serviceaccounts:{}", self.namespace),
            "system:authenticated".to_string(),
        ]
    }
}

/// Makes ServiceAccount `name` in `sa_ns`, binds it (as `bound`) to a Role `name` in `env.ns`
/// with `rules` (RBAC PolicyRules as JSON), and returns it with a TokenRequest token and a
/// kubeconfig in the test's directory (the admin kubeconfig's cluster, the token as the user).
/// Returns once the server's authorizer allows the first rule's first verb (RBAC follows new
/// bindings through an informer, a moment later).
pub async fn caller(env: &Env, sa_ns: &str, name: &str, rules: Value, bound: BoundAs) -> Caller {
    let admin = &env.client;
    let pp = PostParams::default();
    let sa: ServiceAccount =
        serde_json::from_value(json!({"metadata": {"name": name, "namespace": sa_ns}})).unwrap();
    let sas: Api<ServiceAccount> = Api::namespaced(admin.clone(), sa_ns);
    sas.create(&pp, &sa)
        .await
        .unwrap_or_else(|e| panic!("creating ServiceAccount {sa_ns}/{name}: {e}"));
    let token = sas
        .create_token_request(
            name,
            &pp,
            &TokenRequest {
                spec: Some(TokenRequestSpec {
                    expiration_seconds: Some(3600),
                    ..Default::default()
                }),
                ..Default::default()
            },
        )
        .await
        .unwrap_or_else(|e| panic!("TokenRequest for {sa_ns}/{name}: {e}"))
        .status
        .and_then(|s| s.token)
        .expect("TokenRequest answered without a token");
    let caller = Caller {
        namespace: sa_ns.to_string(),
        name: name.to_string(),
        token,
        kubeconfig: env.tmp.path().join(format!("{sa_ns}-{name}.kubeconfig")),
    };
    write_kubeconfig(&env.kubeconfig, &caller);
    if bound == BoundAs::Nothing {
        return caller;
    }

    let role: Role = serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": env.ns}, "rules": rules,
    }))
    .unwrap();
    Api::<Role>::namespaced(admin.clone(), &env.ns)
        .create(&pp, &role)
        .await
        .unwrap_or_else(|e| panic!("creating Role {name}: {e}"));
    let subject = match bound {
        BoundAs::User => json!({"kind": "ServiceAccount", "name": name, "namespace": sa_ns}),
        _ => json!({"kind": "Group", "apiGroup": "rbac.authorization.k8s.io",
                    "name": format!("system:serviceaccounts:{sa_ns}")}),
    };
    let binding: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": env.ns},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [subject],
    }))
    .unwrap();
    Api::<RoleBinding>::namespaced(admin.clone(), &env.ns)
        .create(&pp, &binding)
        .await
        .unwrap_or_else(|e| panic!("creating RoleBinding {name}: {e}"));

    let rule = &rules[0];
    let attributes = ResourceAttributes {
        group: rule["apiGroups"][0].as_str().map(String::from),
        resource: rule["resources"][0].as_str().map(String::from),
        verb: rule["verbs"][0].as_str().map(String::from),
        name: rule["resourceNames"][0].as_str().map(String::from),
        namespace: Some(env.ns.clone()),
        ..Default::default()
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while !allowed(admin, &caller, &attributes).await {
        assert!(
            Instant::now() < deadline,
            "RBAC still does not allow {} {attributes:?}",
            caller.username()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    caller
}

/// What the server's authorizer answers for `caller` (a SubjectAccessReview as the admin).
async fn allowed(admin: &Client, caller: &Caller, attributes: &ResourceAttributes) -> bool {
    let review = SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: Some(caller.username()),
            groups: Some(caller.groups()),
            resource_attributes: Some(attributes.clone()),
            ..Default::default()
        },
        ..Default::default()
    };
    Api::<SubjectAccessReview>::all(admin.clone())
        .create(&PostParams::default(), &review)
        .await
        .unwrap_or_else(|e| panic!("SubjectAccessReview: {e}"))
        .status
        .is_some_and(|s| s.allowed)
}

/// A kubeconfig for `caller`: the cluster (server and CA) of the admin kubeconfig's current
/// context, the caller's token as the user.
fn write_kubeconfig(admin_kubeconfig: &Path, caller: &Caller) {
    let cluster = crate::harness::identity::current_cluster(admin_kubeconfig);
    let user = caller.username();
    let kubeconfig = json!({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "test", "cluster": cluster}],
        "users": [{"name": user, "user": {"token": caller.token}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": user}}],
        "current-context": "test",
    });
    std::fs::write(
        &caller.kubeconfig,
        serde_norway::to_string(&kubeconfig).unwrap(),
    )
    .unwrap();
    // It carries a bearer token: readable by its owner only.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&caller.kubeconfig, std::fs::Permissions::from_mode(0o600)).unwrap();
}
