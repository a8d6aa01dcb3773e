//! The deployment packaging in `daemonset/`: every manifest is a valid Kubernetes object of a known
//! kind, the Kustomize base lists exactly the manifests there are, the DaemonSet agrees with the
//! agent's own flags, the CRDs are what the binary generates and hold every field of Velero's, and
//! the RBAC grants what the agent uses and nothing more.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{CommandFactory, Parser};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Container, PodSpec, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    CustomResourceDefinition, JSONSchemaProps, JSONSchemaPropsOrArray, JSONSchemaPropsOrBool,
};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use podvolume_agent::cli::{Cli, Command, RunArgs};
use serde::Deserialize;
use serde_json::Value;

// ---------------------------------------------------------------------------------------------
// Loading
// ---------------------------------------------------------------------------------------------

fn daemonset_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("daemonset")
}

/// Velero's own CRDs of the newest Velero the tests run, as its installer prints them
/// (testdata/velero-crds/README.md).
fn velero_crd_path(file: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("testdata/velero-crds/v1.18.3")
        .join(file)
}

fn is_yaml(p: &Path) -> bool {
    matches!(p.extension().and_then(|e| e.to_str()), Some("yaml" | "yml"))
}

fn is_kustomization(p: &Path) -> bool {
    matches!(
        p.file_name().and_then(|n| n.to_str()),
        Some("kustomization.yaml" | "kustomization.yml" | "Kustomization")
    )
}

/// Every YAML file under `dir`, recursively, sorted.
fn yaml_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap_or_else(|e| panic!("{}: {e}", d.display())) {
            let p = entry.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if is_yaml(&p) {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// Every non-empty YAML document of a file, as JSON values.
fn documents(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    documents_of(&text, &path.display().to_string())
}

fn documents_of(text: &str, what: &str) -> Vec<Value> {
    serde_norway::Deserializer::from_str(text)
        .enumerate()
        .map(|(i, doc)| {
            Value::deserialize(doc).unwrap_or_else(|e| panic!("{what}: document {i}: {e}"))
        })
        .filter(|v| !v.is_null())
        .collect()
}

/// A manifest of one of the kinds `daemonset/` may contain.
#[derive(Debug, Clone)]
enum Object {
    ServiceAccount(Box<ServiceAccount>),
    ClusterRole(Box<ClusterRole>),
    ClusterRoleBinding(Box<ClusterRoleBinding>),
    Role(Box<Role>),
    RoleBinding(Box<RoleBinding>),
    DaemonSet(Box<DaemonSet>),
    CustomResourceDefinition(Box<CustomResourceDefinition>),
}

/// Parses `doc` into its typed object; `Err` names an unknown kind, a failed parse, or fields the
/// typed object does not know (a typo such as `mountPropogation` would otherwise be dropped
/// silently, here and by the API server).
fn parse_object(doc: &Value) -> Result<Object, String> {
    fn typed<T>(doc: &Value) -> Result<(Box<T>, Value), String>
    where
        T: serde::de::DeserializeOwned + serde::Serialize,
    {
        let t: T = serde_json::from_value(doc.clone()).map_err(|e| e.to_string())?;
        let back = serde_json::to_value(&t).map_err(|e| e.to_string())?;
        Ok((Box::new(t), back))
    }
    let api_version = doc["apiVersion"].as_str().unwrap_or_default();
    let kind = doc["kind"].as_str().unwrap_or_default();
    let (object, back) = match (api_version, kind) {
        ("v1", "ServiceAccount") => typed(doc).map(|(t, b)| (Object::ServiceAccount(t), b))?,
        ("rbac.authorization.k8s.io/v1", "ClusterRole") => {
            typed(doc).map(|(t, b)| (Object::ClusterRole(t), b))?
        }
        ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding") => {
            typed(doc).map(|(t, b)| (Object::ClusterRoleBinding(t), b))?
        }
        ("rbac.authorization.k8s.io/v1", "Role") => {
            typed(doc).map(|(t, b)| (Object::Role(t), b))?
        }
        ("rbac.authorization.k8s.io/v1", "RoleBinding") => {
            typed(doc).map(|(t, b)| (Object::RoleBinding(t), b))?
        }
        ("apps/v1", "DaemonSet") => typed(doc).map(|(t, b)| (Object::DaemonSet(t), b))?,
        ("apiextensions.k8s.io/v1", "CustomResourceDefinition") => {
            typed(doc).map(|(t, b)| (Object::CustomResourceDefinition(t), b))?
        }
        _ => return Err(format!("unknown kind {api_version}/{kind}")),
    };
    let mut dropped = Vec::new();
    dropped_fields(doc, &back, "", &mut dropped);
    if dropped.is_empty() {
        Ok(object)
    } else {
        Err(format!("fields unknown to {kind}: {}", dropped.join(", ")))
    }
}

/// Paths present in `original` but absent from `round_trip` (fields the type does not have).
fn dropped_fields(original: &Value, round_trip: &Value, path: &str, out: &mut Vec<String>) {
    match (original, round_trip) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, v) in a {
                let p = format!("{path}.{k}");
                match b.get(k) {
                    Some(w) => dropped_fields(v, w, &p, out),
                    // An explicit empty value may legitimately be omitted on the way back.
                    None if is_empty(v) => {}
                    None => out.push(p),
                }
            }
        }
        (Value::Array(a), Value::Array(b)) => {
            for (i, (v, w)) in a.iter().zip(b).enumerate() {
                dropped_fields(v, w, &format!("{path}[{i}]"), out);
            }
        }
        _ => {}
    }
}

fn is_empty(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Object(m) => m.is_empty(),
        Value::Array(a) => a.is_empty(),
        _ => false,
    }
}

/// Every object of every manifest (kustomization files excluded), with the file it came from.
fn manifests() -> Vec<(String, Object)> {
    let dir = daemonset_dir();
    let mut out = Vec::new();
    let mut errors = Vec::new();
    for file in yaml_files(&dir)
        .into_iter()
        .filter(|p| !is_kustomization(p))
    {
        let name = file.strip_prefix(&dir).unwrap().display().to_string();
        for (i, doc) in documents(&file).iter().enumerate() {
            match parse_object(doc) {
                Ok(o) => out.push((name.clone(), o)),
                Err(e) => errors.push(format!("{name} document {i}: {e}")),
            }
        }
    }
    assert!(
        errors.is_empty(),
        "invalid manifests:\n{}",
        errors.join("\n")
    );
    out
}

fn the_daemonset() -> DaemonSet {
    let all: Vec<DaemonSet> = manifests()
        .into_iter()
        .filter_map(|(_, o)| match o {
            Object::DaemonSet(d) => Some(*d),
            _ => None,
        })
        .collect();
    assert_eq!(all.len(), 1, "expected exactly one DaemonSet");
    all.into_iter().next().unwrap()
}

fn pod_spec(ds: &DaemonSet) -> PodSpec {
    ds.spec
        .template
        .spec
        .clone()
        .expect("pod template has a spec")
}

fn agent_container(pod: &PodSpec) -> Container {
    pod.containers
        .iter()
        .find(|c| c.name == "node-agent")
        .cloned()
        .expect("container node-agent")
}

/// The container's args parsed by the agent's own CLI definition.
fn run_args(c: &Container) -> RunArgs {
    let args = c.args.clone().expect("the container has args");
    assert!(
        !args.iter().any(|a| a.starts_with("--node-name")),
        "the node name comes from the downward API (NODE_NAME), not from args"
    );
    // NODE_NAME is required and comes from the downward API in the cluster.
    let argv = std::iter::once("podvolume-agent".to_string())
        .chain(args.iter().cloned())
        .chain(std::iter::once("--node-name=test".to_string()));
    match Cli::try_parse_from(argv) {
        Ok(Cli {
            command: Command::Run(run),
        }) => *run,
        Ok(other) => panic!("args {args:?} are not `run`: {other:?}"),
        Err(e) => panic!("args {args:?} do not parse: {e}"),
    }
}

/// The environment variable names of `podvolume-agent run`'s flags.
fn run_flag_envs() -> BTreeSet<String> {
    let cmd = Cli::command();
    let run = cmd.find_subcommand("run").expect("a run subcommand");
    run.get_arguments()
        .filter_map(|a| a.get_env())
        .map(|e| e.to_string_lossy().into_owned())
        .collect()
}

fn mount_path(c: &Container, volume: &str) -> String {
    c.volume_mounts
        .iter()
        .flatten()
        .find(|m| m.name == volume)
        .unwrap_or_else(|| panic!("no mount of volume {volume}"))
        .mount_path
        .clone()
}

// ---------------------------------------------------------------------------------------------
// Manifests and kustomization
// ---------------------------------------------------------------------------------------------

#[test]
fn every_manifest_parses_into_its_kubernetes_type() {
    let all = manifests();
    let kinds: BTreeMap<&str, usize> = all.iter().fold(BTreeMap::new(), |mut m, (_, o)| {
        let k = match o {
            Object::ServiceAccount(_) => "ServiceAccount",
            Object::ClusterRole(_) => "ClusterRole",
            Object::ClusterRoleBinding(_) => "ClusterRoleBinding",
            Object::Role(_) => "Role",
            Object::RoleBinding(_) => "RoleBinding",
            Object::DaemonSet(_) => "DaemonSet",
            Object::CustomResourceDefinition(_) => "CustomResourceDefinition",
        };
        *m.entry(k).or_default() += 1;
        m
    });
    let expected: BTreeMap<&str, usize> = [
        ("ServiceAccount", 1),
        ("ClusterRole", 1),
        ("ClusterRoleBinding", 1),
        ("Role", 1),
        ("RoleBinding", 1),
        ("DaemonSet", 1),
        ("CustomResourceDefinition", 2),
    ]
    .into();
    assert_eq!(kinds, expected);
    // No manifest sets a namespace: the kustomization's `namespace:` does, so an overlay can move
    // everything at once.
    for (file, o) in &all {
        let ns = match o {
            Object::ServiceAccount(x) => x.metadata.namespace.clone(),
            Object::Role(x) => x.metadata.namespace.clone(),
            Object::RoleBinding(x) => x.metadata.namespace.clone(),
            Object::DaemonSet(x) => x.metadata.namespace.clone(),
            _ => None,
        };
        assert_eq!(ns, None, "{file}: namespace belongs in kustomization.yaml");
    }
}

#[test]
fn unknown_kinds_and_misspelt_fields_are_rejected() {
    // The checks above must be able to fail.
    let unknown = documents_of(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n",
        "t",
    );
    assert!(
        parse_object(&unknown[0])
            .unwrap_err()
            .contains("unknown kind")
    );
    let typo = documents_of(
        "apiVersion: v1\nkind: ServiceAccount\nmetadata: {name: x, lables: {a: b}}\n",
        "t",
    );
    assert!(
        parse_object(&typo[0])
            .unwrap_err()
            .contains(".metadata.lables")
    );
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Kustomization {
    api_version: String,
    kind: String,
    namespace: Option<String>,
    #[serde(default)]
    resources: Vec<String>,
}

fn kustomization(dir: &Path) -> Kustomization {
    let docs = documents(&dir.join("kustomization.yaml"));
    assert_eq!(docs.len(), 1);
    let k: Kustomization = serde_json::from_value(docs[0].clone()).unwrap();
    assert_eq!(k.api_version, "kustomize.config.k8s.io/v1beta1");
    assert_eq!(k.kind, "Kustomization");
    k
}

#[test]
fn kustomization_lists_every_manifest_and_sets_the_velero_namespace() {
    let dir = daemonset_dir();
    let k = kustomization(&dir);
    assert_eq!(k.namespace.as_deref(), Some("velero"));
    let listed: BTreeSet<String> = k.resources.iter().cloned().collect();
    assert_eq!(
        listed.len(),
        k.resources.len(),
        "a resource is listed twice"
    );
    let present: BTreeSet<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file() && is_yaml(p) && !is_kustomization(p))
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    let missing: Vec<_> = present.difference(&listed).collect();
    let dangling: Vec<_> = listed.difference(&present).collect();
    assert!(
        missing.is_empty() && dangling.is_empty(),
        "not listed in kustomization.yaml: {missing:?}; listed but absent: {dangling:?}"
    );
}

/// The label that selects every object but the CRDs, for clusters where Velero's CRDs exist:
/// `kubectl apply -k daemonset/ -l app.kubernetes.io/name=podvolume-agent`.
const APP_LABEL: (&str, &str) = ("app.kubernetes.io/name", "podvolume-agent");

fn has_app_label(labels: &Option<BTreeMap<String, String>>) -> bool {
    labels
        .as_ref()
        .and_then(|l| l.get(APP_LABEL.0))
        .is_some_and(|v| v == APP_LABEL.1)
}

#[test]
fn the_app_label_selects_everything_but_the_crds() {
    for (file, o) in manifests() {
        let (what, labelled, is_crd) = match &o {
            Object::ServiceAccount(x) => (&x.metadata, has_app_label(&x.metadata.labels), false),
            Object::ClusterRole(x) => (&x.metadata, has_app_label(&x.metadata.labels), false),
            Object::ClusterRoleBinding(x) => {
                (&x.metadata, has_app_label(&x.metadata.labels), false)
            }
            Object::Role(x) => (&x.metadata, has_app_label(&x.metadata.labels), false),
            Object::RoleBinding(x) => (&x.metadata, has_app_label(&x.metadata.labels), false),
            Object::DaemonSet(x) => (&x.metadata, has_app_label(&x.metadata.labels), false),
            Object::CustomResourceDefinition(x) => {
                (&x.metadata, has_app_label(&x.metadata.labels), true)
            }
        };
        assert_eq!(
            labelled, !is_crd,
            "{file} {:?}: the label {}={} must be on every object but the CRDs",
            what.name, APP_LABEL.0, APP_LABEL.1
        );
    }
}

/// `kubectl kustomize` (kustomize built into kubectl) renders the base, every namespaced object
/// in `velero`, and the label selects all but the CRDs. Skipped where kubectl is not installed; the
/// structural tests above do not need it.
#[test]
fn kubectl_kustomize_renders_the_base() {
    let render = |dir: PathBuf| -> Option<Vec<Value>> {
        let out = std::process::Command::new("kubectl")
            .arg("kustomize")
            .arg(&dir)
            .output()
            .ok()?;
        assert!(
            out.status.success(),
            "kubectl kustomize {}: {}",
            dir.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        Some(documents_of(
            &String::from_utf8(out.stdout).unwrap(),
            "kubectl kustomize",
        ))
    };
    let Some(base) = render(daemonset_dir()) else {
        eprintln!("kubectl not found: skipping the kustomize rendering check");
        return;
    };
    let kinds: Vec<&str> = base.iter().map(|d| d["kind"].as_str().unwrap()).collect();
    assert_eq!(
        kinds
            .iter()
            .filter(|k| **k == "CustomResourceDefinition")
            .count(),
        2
    );
    let selected: Vec<&str> = base
        .iter()
        .filter(|d| d["metadata"]["labels"][APP_LABEL.0] == APP_LABEL.1)
        .map(|d| d["kind"].as_str().unwrap())
        .collect();
    assert_eq!(selected.len(), base.len() - 2);
    assert!(!selected.contains(&"CustomResourceDefinition"));
    for d in &base {
        let kind = d["kind"].as_str().unwrap();
        if matches!(
            kind,
            "ClusterRole" | "ClusterRoleBinding" | "CustomResourceDefinition"
        ) {
            assert!(
                d["metadata"]["namespace"].is_null(),
                "{kind} is cluster-scoped"
            );
        } else {
            assert_eq!(d["metadata"]["namespace"], "velero", "{kind}");
        }
        parse_object(d).unwrap_or_else(|e| panic!("rendered {kind}: {e}"));
    }
}

// ---------------------------------------------------------------------------------------------
// DaemonSet
// ---------------------------------------------------------------------------------------------

#[test]
fn daemonset_is_named_and_labelled_like_veleros_node_agent() {
    let ds = the_daemonset();
    assert_eq!(ds.metadata.name.as_deref(), Some("node-agent"));
    let spec = &ds.spec;
    let template_labels = spec
        .template
        .metadata
        .as_ref()
        .unwrap()
        .labels
        .clone()
        .unwrap();
    for labels in [ds.metadata.labels.clone().unwrap(), template_labels.clone()] {
        assert_eq!(labels.get("name").map(String::as_str), Some("node-agent"));
        assert_eq!(labels.get("component").map(String::as_str), Some("velero"));
    }
    // Velero 1.16+ looks for a Running pod labelled role=node-agent on the node before it
    // creates a PodVolumeBackup/Restore (pkg/nodeagent); without it no pod volume is backed up.
    assert_eq!(
        template_labels.get("role").map(String::as_str),
        Some("node-agent")
    );
    let selector = spec.selector.match_labels.clone().expect("matchLabels");
    for (k, v) in &selector {
        assert_eq!(
            template_labels.get(k),
            Some(v),
            "the selector selects the pods"
        );
    }
    let pod = pod_spec(&ds);
    let sa_names: Vec<String> = manifests()
        .into_iter()
        .filter_map(|(_, o)| match o {
            Object::ServiceAccount(s) => s.metadata.name,
            _ => None,
        })
        .collect();
    assert_eq!(sa_names, ["node-agent"]);
    assert_eq!(pod.service_account_name.as_deref(), Some("node-agent"));
    let c = agent_container(&pod);
    assert!(
        c.image
            .as_deref()
            .is_some_and(|i| i.starts_with("ghcr.io/podvolume-agent/podvolume-agent:")),
        "image {:?}",
        c.image
    );
}

#[test]
fn daemonset_args_parse_with_the_agents_own_cli_and_mounts_match_the_flags() {
    let ds = the_daemonset();
    let pod = pod_spec(&ds);
    let c = agent_container(&pod);
    let run = run_args(&c);
    assert_eq!(run.update_interval, Duration::from_secs(10));
    assert_eq!(run.log_format, podvolume_agent::cli::LogFormat::Json);

    let volume = |name: &str| {
        pod.volumes
            .iter()
            .flatten()
            .find(|v| v.name == name)
            .unwrap_or_else(|| panic!("no volume {name}"))
            .clone()
    };

    // The kubelet's pods directory, with mounts made after the agent started visible inside it.
    assert_eq!(Path::new(&mount_path(&c, "host-pods")), run.host_pods_dir);
    let host_pods = volume("host-pods")
        .host_path
        .expect("host-pods is a hostPath");
    assert_eq!(host_pods.path, "/var/lib/kubelet/pods");
    let hp_mount = c
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.name == "host-pods")
        .unwrap();
    assert_eq!(
        hp_mount.mount_propagation.as_deref(),
        Some("HostToContainer")
    );

    assert_eq!(Path::new(&mount_path(&c, "scratch")), run.scratch_dir);
    assert!(
        volume("scratch").empty_dir.is_some(),
        "scratch is an emptyDir"
    );

    // Velero's cloud-credentials Secret where --default-credentials-file looks, optional.
    assert_eq!(
        Path::new(&mount_path(&c, "cloud-credentials")).join("cloud"),
        run.default_credentials_file
    );
    let creds = volume("cloud-credentials")
        .secret
        .expect("cloud-credentials is a Secret volume");
    assert_eq!(creds.secret_name.as_deref(), Some("cloud-credentials"));
    assert_eq!(creds.optional, Some(true), "not every installation has it");

    assert_eq!(Path::new(&mount_path(&c, "state")), run.state_dir);
    let state = volume("state")
        .host_path
        .expect("state is a hostPath (survives restarts)");
    assert_eq!(state.type_.as_deref(), Some("DirectoryOrCreate"));
    assert_eq!(Path::new(&state.path), run.state_dir);

    // The root filesystem is read-only: every place something writes is a volume.
    assert!(
        c.security_context
            .as_ref()
            .unwrap()
            .read_only_root_filesystem
            == Some(true),
        "read-only root filesystem"
    );
    let mounts: BTreeSet<String> = c
        .volume_mounts
        .iter()
        .flatten()
        .map(|m| m.mount_path.clone())
        .collect();
    for writable in [&run.scratch_dir, &run.state_dir, Path::new("/tmp")] {
        assert!(
            mounts.contains(&writable.display().to_string()),
            "{} must be a mounted volume",
            writable.display()
        );
    }
    for m in c.volume_mounts.iter().flatten() {
        assert!(
            pod.volumes.iter().flatten().any(|v| v.name == m.name),
            "mount of undeclared volume {}",
            m.name
        );
    }
}

#[test]
fn daemonset_env_comes_from_the_downward_api_and_names_real_flags() {
    let ds = the_daemonset();
    let c = agent_container(&pod_spec(&ds));
    let run = run_args(&c);
    let env = c.env.clone().unwrap_or_default();
    let field_ref = |name: &str| -> String {
        env.iter()
            .find(|e| e.name == name)
            .and_then(|e| e.value_from.as_ref())
            .and_then(|v| v.field_ref.as_ref())
            .unwrap_or_else(|| panic!("{name} from a fieldRef"))
            .field_path
            .clone()
    };
    assert_eq!(field_ref("NODE_NAME"), "spec.nodeName");
    assert_eq!(field_ref("VELERO_NAMESPACE"), "metadata.namespace");
    let scratch = env
        .iter()
        .find(|e| e.name == "VELERO_SCRATCH_DIR")
        .expect("VELERO_SCRATCH_DIR");
    assert_eq!(
        scratch.value.as_deref().map(Path::new),
        Some(run.scratch_dir.as_path())
    );

    let known = run_flag_envs();
    assert!(known.contains("NODE_NAME") && known.contains("VELERO_NAMESPACE"));
    let unknown: Vec<&str> = env
        .iter()
        .map(|e| e.name.as_str())
        .filter(|n| !known.contains(*n))
        .collect();
    assert!(
        unknown.is_empty(),
        "env vars that no `run` flag reads: {unknown:?}"
    );
}

#[test]
fn probes_and_metrics_point_at_the_listen_port() {
    let ds = the_daemonset();
    let pod = pod_spec(&ds);
    let c = agent_container(&pod);
    let run = run_args(&c);
    let port = run.listen_address.port();
    let ports = c.ports.clone().expect("container ports");
    let metrics = ports
        .iter()
        .find(|p| p.name.as_deref() == Some("metrics"))
        .expect("port metrics");
    assert_eq!(metrics.container_port, i32::from(port));

    let resolve = |p: &IntOrString| -> i32 {
        match p {
            IntOrString::Int(n) => *n,
            IntOrString::String(name) => {
                ports
                    .iter()
                    .find(|cp| cp.name.as_deref() == Some(name.as_str()))
                    .unwrap_or_else(|| panic!("probe names unknown port {name}"))
                    .container_port
            }
        }
    };
    for (probe, path) in [
        (&c.liveness_probe, "/livez"),
        (&c.readiness_probe, "/readyz"),
    ] {
        let get = probe
            .as_ref()
            .and_then(|p| p.http_get.as_ref())
            .expect("HTTP probe");
        assert_eq!(get.path.as_deref(), Some(path));
        assert_eq!(resolve(&get.port), i32::from(port), "{path}");
    }

    let annotations = ds
        .spec
        .template
        .metadata
        .as_ref()
        .unwrap()
        .annotations
        .clone()
        .expect("scrape annotations");
    assert_eq!(
        annotations.get("prometheus.io/scrape").map(String::as_str),
        Some("true")
    );
    assert_eq!(
        annotations.get("prometheus.io/port"),
        Some(&port.to_string())
    );
    assert_eq!(
        annotations.get("prometheus.io/path").map(String::as_str),
        Some("/metrics")
    );
}

#[test]
fn daemonset_runs_everywhere_with_least_privilege_and_stops_cleanly() {
    let ds = the_daemonset();
    let pod = pod_spec(&ds);
    let c = agent_container(&pod);
    let run = run_args(&c);

    // Every node, tainted ones included.
    assert!(
        pod.tolerations
            .iter()
            .flatten()
            .any(|t| t.operator.as_deref() == Some("Exists")
                && t.key.is_none()
                && t.effect.is_none()),
        "a toleration for every taint"
    );

    // Long enough to stop the uploader (SIGINT, SIGKILL after --cancel-grace), unlock the
    // repository and write the outcome.
    let grace = pod
        .termination_grace_period_seconds
        .expect("terminationGracePeriodSeconds");
    assert!(
        u64::try_from(grace).unwrap() >= run.cancel_grace.as_secs() + 30,
        "terminationGracePeriodSeconds {grace} leaves too little after --cancel-grace {:?}",
        run.cancel_grace
    );

    let sc = c
        .security_context
        .clone()
        .expect("container securityContext");
    assert_eq!(
        sc.run_as_user,
        Some(0),
        "root: reads volume data of any owner"
    );
    assert_ne!(sc.privileged, Some(true));
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    let caps = sc.capabilities.clone().expect("capabilities");
    assert_eq!(caps.drop, Some(vec!["ALL".to_string()]));
    let added: BTreeSet<String> = caps.add.unwrap_or_default().into_iter().collect();
    let expected: BTreeSet<String> = [
        "DAC_READ_SEARCH",
        "DAC_OVERRIDE",
        "CHOWN",
        "FOWNER",
        "FSETID",
    ]
    .map(String::from)
    .into();
    assert_eq!(added, expected);
    let seccomp = sc
        .seccomp_profile
        .or_else(|| pod.security_context.clone().and_then(|p| p.seccomp_profile))
        .expect("a seccomp profile");
    assert_eq!(seccomp.type_, "RuntimeDefault");
    assert_ne!(pod.host_network, Some(true));
    assert_ne!(pod.host_pid, Some(true));

    let res = c.resources.clone().expect("resources");
    let requests = res.requests.expect("requests");
    assert!(requests.contains_key("cpu") && requests.contains_key("memory"));
    assert!(
        res.limits.expect("limits").contains_key("memory"),
        "a memory limit"
    );
}

// ---------------------------------------------------------------------------------------------
// CRDs
// ---------------------------------------------------------------------------------------------

#[test]
fn crds_yaml_is_what_the_binary_generates() {
    let on_disk = std::fs::read_to_string(daemonset_dir().join("crds.yaml")).unwrap();
    assert!(
        on_disk == podvolume_agent::crd::crds_yaml(),
        "daemonset/crds.yaml is stale: regenerate it with `podvolume-agent crds > daemonset/crds.yaml`"
    );
}

fn v1_schema(crd: &CustomResourceDefinition) -> JSONSchemaProps {
    crd.spec
        .versions
        .iter()
        .find(|v| v.name == "v1")
        .and_then(|v| v.schema.as_ref())
        .and_then(|s| s.open_api_v3_schema.clone())
        .expect("a v1 openAPIV3Schema")
}

/// Walks Velero's schema and reports every path that ours lacks, or where the `type` or `format`
/// differ, where ours refuses an enum value Velero's accepts, or is not nullable where Velero's is.
fn compare_schema(
    velero: &JSONSchemaProps,
    ours: &JSONSchemaProps,
    path: &str,
    out: &mut Vec<String>,
) {
    let shown = if path.is_empty() { "<root>" } else { path };
    if velero.type_ != ours.type_ {
        out.push(format!(
            "{shown}: type {:?} in Velero's, {:?} in ours",
            velero.type_, ours.type_
        ));
    }
    if velero.format != ours.format {
        out.push(format!(
            "{shown}: format {:?} in Velero's, {:?} in ours",
            velero.format, ours.format
        ));
    }
    if let (Some(theirs), Some(mine)) = (&velero.enum_, &ours.enum_) {
        for v in theirs {
            if !mine.contains(v) {
                out.push(format!(
                    "{shown}: enum value {} accepted by Velero's, not by ours",
                    v.0
                ));
            }
        }
    }
    if velero.nullable == Some(true) && ours.nullable != Some(true) {
        out.push(format!("{shown}: nullable in Velero's, not in ours"));
    }

    for (name, theirs) in velero.properties.iter().flatten() {
        let p = format!("{path}.{name}");
        match ours.properties.as_ref().and_then(|m| m.get(name)) {
            Some(mine) => compare_schema(theirs, mine, &p, out),
            None => out.push(format!("{p}: missing from ours")),
        }
    }

    match (&velero.items, &ours.items) {
        (None, _) => {}
        (
            Some(JSONSchemaPropsOrArray::Schema(theirs)),
            Some(JSONSchemaPropsOrArray::Schema(mine)),
        ) => compare_schema(theirs, mine, &format!("{path}[]"), out),
        (
            Some(JSONSchemaPropsOrArray::Schemas(theirs)),
            Some(JSONSchemaPropsOrArray::Schemas(mine)),
        ) if theirs.len() == mine.len() => {
            for (i, (t, m)) in theirs.iter().zip(mine).enumerate() {
                compare_schema(t, m, &format!("{path}[{i}]"), out);
            }
        }
        (Some(_), _) => out.push(format!("{path}[]: items differ from Velero's")),
    }

    match (&velero.additional_properties, &ours.additional_properties) {
        (None, _) => {}
        (
            Some(JSONSchemaPropsOrBool::Schema(theirs)),
            Some(JSONSchemaPropsOrBool::Schema(mine)),
        ) => compare_schema(theirs, mine, &format!("{path}{{*}}"), out),
        (Some(JSONSchemaPropsOrBool::Bool(a)), Some(JSONSchemaPropsOrBool::Bool(b))) if a == b => {}
        (Some(_), _) => out.push(format!(
            "{path}{{*}}: additionalProperties differ from Velero's"
        )),
    }
}

#[test]
fn schema_comparison_reports_missing_and_mismatched_paths() {
    let velero: JSONSchemaProps = serde_json::from_value(serde_json::json!({
        "type": "object",
        "properties": {
            "a": {"type": "string", "format": "date-time"},
            "b": {"type": "object", "additionalProperties": {"type": "string"}},
            "c": {"type": "array", "items": {"type": "integer", "format": "int64"}},
            "d": {"type": "string", "enum": ["x", ""]}
        }
    }))
    .unwrap();
    let ours: JSONSchemaProps = serde_json::from_value(serde_json::json!({
        "type": "object",
        "properties": {
            "a": {"type": "string"},
            "b": {"type": "object", "additionalProperties": {"type": "integer"}},
            "c": {"type": "array", "items": {"type": "integer", "format": "int32"}},
            "d": {"type": "string", "enum": ["x"]}
        }
    }))
    .unwrap();
    let mut out = Vec::new();
    compare_schema(&velero, &ours, "", &mut out);
    let joined = out.join("\n");
    for expected in [
        ".a: format",
        ".b{*}: type",
        ".c[]: format",
        ".d: enum value \"\"",
    ] {
        assert!(joined.contains(expected), "{expected} not in:\n{joined}");
    }
    let mut none = Vec::new();
    compare_schema(&velero, &velero, "", &mut none);
    assert!(none.is_empty(), "{none:?}");
}

#[test]
fn generated_crds_hold_every_field_of_veleros_crds() {
    let ours: BTreeMap<String, CustomResourceDefinition> =
        documents_of(&podvolume_agent::crd::crds_yaml(), "crds_yaml()")
            .into_iter()
            .map(|d| {
                let crd: CustomResourceDefinition = serde_json::from_value(d).unwrap();
                (crd.metadata.name.clone().unwrap(), crd)
            })
            .collect();
    let mut problems = Vec::new();
    for file in [
        "velero.io_podvolumebackups.yaml",
        "velero.io_podvolumerestores.yaml",
    ] {
        let docs = documents(&velero_crd_path(file));
        assert_eq!(docs.len(), 1, "{file}");
        let velero: CustomResourceDefinition = serde_json::from_value(docs[0].clone()).unwrap();
        let name = velero.metadata.name.clone().unwrap();
        let Some(mine) = ours.get(&name) else {
            problems.push(format!("{name}: not generated"));
            continue;
        };
        assert_eq!(mine.spec.group, velero.spec.group);
        assert_eq!(mine.spec.scope, velero.spec.scope);
        assert_eq!(mine.spec.names.kind, velero.spec.names.kind);
        assert_eq!(mine.spec.names.plural, velero.spec.names.plural);
        let mut theirs = v1_schema(&velero);
        let ours_schema = v1_schema(mine);
        // The object envelope (apiVersion, kind, metadata) is implicitly part of every CRD's
        // schema and validated by the API server itself; a generated schema may leave it out.
        // Where ours does spell a field out, it is compared like any other.
        if let Some(props) = theirs.properties.as_mut() {
            for envelope in ["apiVersion", "kind", "metadata"] {
                let ours_has = ours_schema
                    .properties
                    .as_ref()
                    .is_some_and(|p| p.contains_key(envelope));
                if !ours_has {
                    props.remove(envelope);
                }
            }
        }
        // Both kinds carry a spec and a status; nothing else is left to compare if these go.
        for part in ["spec", "status"] {
            assert!(
                theirs
                    .properties
                    .as_ref()
                    .is_some_and(|p| p.contains_key(part)),
                "{file}: no {part} in Velero's schema"
            );
        }
        let mut out = Vec::new();
        compare_schema(&theirs, &ours_schema, "", &mut out);
        problems.extend(out.into_iter().map(|p| format!("{name} {p}")));
    }
    assert!(
        problems.is_empty(),
        "generated CRDs differ from Velero's:\n{}",
        problems.join("\n")
    );
}

// ---------------------------------------------------------------------------------------------
// RBAC
// ---------------------------------------------------------------------------------------------

/// Where a permission is needed: everywhere (cluster-scoped objects or objects in application
/// namespaces) or only in the agent's own (Velero's) namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scope {
    Cluster,
    Namespace,
}

/// What the agent does with the API: (scope, apiGroup, resource, verb, resourceName). The
/// CRDs are read and watched by name for the phases they allow (`agent::phases`).
const NEEDS: &[(Scope, &str, &str, &str, Option<&str>)] = &[
    (Scope::Cluster, "", "pods", "get", None),
    (Scope::Cluster, "", "persistentvolumeclaims", "get", None),
    (Scope::Cluster, "", "persistentvolumes", "get", None),
    (Scope::Cluster, "", "persistentvolumes", "patch", None),
    (Scope::Cluster, "", "persistentvolumes", "delete", None),
    (Scope::Cluster, "", "persistentvolumeclaims", "patch", None),
    (Scope::Cluster, "", "nodes", "get", None),
    (Scope::Namespace, "", "configmaps", "get", None),
    (
        Scope::Cluster,
        "storage.k8s.io",
        "storageclasses",
        "get",
        None,
    ),
    (
        Scope::Cluster,
        "snapshot.storage.k8s.io",
        "volumesnapshots",
        "get",
        None,
    ),
    (
        Scope::Cluster,
        "snapshot.storage.k8s.io",
        "volumesnapshots",
        "create",
        None,
    ),
    (
        Scope::Cluster,
        "snapshot.storage.k8s.io",
        "volumesnapshots",
        "delete",
        None,
    ),
    (
        Scope::Cluster,
        "snapshot.storage.k8s.io",
        "volumesnapshotcontents",
        "get",
        None,
    ),
    (
        Scope::Cluster,
        "snapshot.storage.k8s.io",
        "volumesnapshotcontents",
        "create",
        None,
    ),
    (
        Scope::Cluster,
        "snapshot.storage.k8s.io",
        "volumesnapshotcontents",
        "patch",
        None,
    ),
    (
        Scope::Cluster,
        "snapshot.storage.k8s.io",
        "volumesnapshotcontents",
        "delete",
        None,
    ),
    (
        Scope::Namespace,
        "velero.io",
        "backuprepositories",
        "create",
        None,
    ),
    (Scope::Namespace, "velero.io", "datauploads", "get", None),
    (Scope::Namespace, "velero.io", "datauploads", "list", None),
    (Scope::Namespace, "velero.io", "datauploads", "watch", None),
    (Scope::Namespace, "velero.io", "datauploads", "patch", None),
    (Scope::Namespace, "velero.io", "datadownloads", "get", None),
    (Scope::Namespace, "velero.io", "datadownloads", "list", None),
    (
        Scope::Namespace,
        "velero.io",
        "datadownloads",
        "watch",
        None,
    ),
    (
        Scope::Namespace,
        "velero.io",
        "datadownloads",
        "patch",
        None,
    ),
    (
        Scope::Namespace,
        "",
        "persistentvolumeclaims",
        "create",
        None,
    ),
    (
        Scope::Namespace,
        "",
        "persistentvolumeclaims",
        "delete",
        None,
    ),
    (Scope::Namespace, "", "pods", "create", None),
    (Scope::Namespace, "", "pods", "delete", None),
    (
        Scope::Namespace,
        "apps",
        "daemonsets",
        "get",
        Some("node-agent"),
    ),
    (Scope::Cluster, "storage.k8s.io", "csidrivers", "list", None),
    (
        Scope::Cluster,
        "apiextensions.k8s.io",
        "customresourcedefinitions",
        "get",
        Some("podvolumebackups.velero.io"),
    ),
    (
        Scope::Cluster,
        "apiextensions.k8s.io",
        "customresourcedefinitions",
        "list",
        Some("podvolumebackups.velero.io"),
    ),
    (
        Scope::Cluster,
        "apiextensions.k8s.io",
        "customresourcedefinitions",
        "watch",
        Some("podvolumebackups.velero.io"),
    ),
    (
        Scope::Cluster,
        "apiextensions.k8s.io",
        "customresourcedefinitions",
        "get",
        Some("podvolumerestores.velero.io"),
    ),
    (
        Scope::Cluster,
        "apiextensions.k8s.io",
        "customresourcedefinitions",
        "list",
        Some("podvolumerestores.velero.io"),
    ),
    (
        Scope::Cluster,
        "apiextensions.k8s.io",
        "customresourcedefinitions",
        "watch",
        Some("podvolumerestores.velero.io"),
    ),
    (
        Scope::Cluster,
        "authentication.k8s.io",
        "tokenreviews",
        "create",
        None,
    ),
    (
        Scope::Cluster,
        "authorization.k8s.io",
        "subjectaccessreviews",
        "create",
        None,
    ),
    (
        Scope::Namespace,
        "velero.io",
        "podvolumebackups",
        "get",
        None,
    ),
    (
        Scope::Namespace,
        "velero.io",
        "podvolumebackups",
        "list",
        None,
    ),
    (
        Scope::Namespace,
        "velero.io",
        "podvolumebackups",
        "watch",
        None,
    ),
    (
        Scope::Namespace,
        "velero.io",
        "podvolumebackups",
        "patch",
        None,
    ),
    (
        Scope::Namespace,
        "velero.io",
        "podvolumebackups/status",
        "patch",
        None,
    ),
    (
        Scope::Namespace,
        "velero.io",
        "podvolumerestores",
        "get",
        None,
    ),
    (
        Scope::Namespace,
        "velero.io",
        "podvolumerestores",
        "list",
        None,
    ),
    (
        Scope::Namespace,
        "velero.io",
        "podvolumerestores",
        "watch",
        None,
    ),
    (
        Scope::Namespace,
        "velero.io",
        "podvolumerestores",
        "patch",
        None,
    ),
    (
        Scope::Namespace,
        "velero.io",
        "podvolumerestores/status",
        "patch",
        None,
    ),
    // The repository password and the Secrets BackupStorageLocations name (any name).
    (Scope::Namespace, "", "secrets", "get", None),
    (
        Scope::Namespace,
        "velero.io",
        "backuprepositories",
        "list",
        None,
    ),
    (
        Scope::Namespace,
        "velero.io",
        "backupstoragelocations",
        "get",
        None,
    ),
    // The Backup/Restore a transfer belongs to (agent::owner).
    (Scope::Namespace, "velero.io", "backups", "get", None),
    (Scope::Namespace, "velero.io", "restores", "get", None),
    (Scope::Namespace, "events.k8s.io", "events", "create", None),
    (Scope::Namespace, "events.k8s.io", "events", "patch", None),
    (Scope::Namespace, "", "events", "create", None),
    (Scope::Namespace, "", "events", "patch", None),
];

/// Discovery URLs the agent may read (already open to every authenticated client by default).
const DISCOVERY_URLS: &[&str] = &[
    "/api",
    "/api/v1",
    "/apis",
    "/apis/velero.io",
    "/apis/velero.io/v1",
    "/apis/velero.io/v2alpha1",
    "/version",
];

fn grants(rule: &PolicyRule, group: &str, resource: &str, verb: &str, name: Option<&str>) -> bool {
    let has =
        |list: &Option<Vec<String>>, x: &str| list.iter().flatten().any(|s| s == x || s == "*");
    has(&rule.api_groups, group)
        && has(&rule.resources, resource)
        && rule.verbs.iter().any(|v| v == verb || v == "*")
        && match &rule.resource_names {
            None => true,
            Some(names) if names.is_empty() => true,
            Some(names) => name.is_some_and(|n| names.iter().any(|x| x == n)),
        }
}

struct Rbac {
    cluster_rules: Vec<PolicyRule>,
    namespace_rules: Vec<PolicyRule>,
}

/// The rules bound to the ServiceAccount `node-agent` of the kustomization's namespace.
fn rbac() -> Rbac {
    let namespace = kustomization(&daemonset_dir()).namespace.unwrap();
    let all = manifests();
    let bound_to_agent = |subjects: &Option<Vec<k8s_openapi::api::rbac::v1::Subject>>| {
        subjects.iter().flatten().any(|s| {
            s.kind == "ServiceAccount"
                && s.name == "node-agent"
                && s.namespace.as_deref() == Some(namespace.as_str())
        })
    };
    let mut cluster_roles = BTreeMap::new();
    let mut roles = BTreeMap::new();
    let mut crb = Vec::new();
    let mut rb = Vec::new();
    for (_, o) in all {
        match o {
            Object::ClusterRole(r) => {
                cluster_roles.insert(
                    r.metadata.name.clone().unwrap(),
                    r.rules.clone().unwrap_or_default(),
                );
            }
            Object::Role(r) => {
                roles.insert(
                    r.metadata.name.clone().unwrap(),
                    r.rules.clone().unwrap_or_default(),
                );
            }
            Object::ClusterRoleBinding(b) => crb.push(*b),
            Object::RoleBinding(b) => rb.push(*b),
            _ => {}
        }
    }
    let mut cluster_rules = Vec::new();
    let mut namespace_rules = Vec::new();
    for b in crb.iter().filter(|b| bound_to_agent(&b.subjects)) {
        assert_eq!(b.role_ref.kind, "ClusterRole");
        assert_eq!(
            b.role_ref.api_group.as_deref(),
            Some("rbac.authorization.k8s.io")
        );
        let rules = cluster_roles
            .get(&b.role_ref.name)
            .unwrap_or_else(|| panic!("ClusterRole {} is not shipped", b.role_ref.name));
        cluster_rules.extend(rules.iter().cloned());
    }
    for b in rb.iter().filter(|b| bound_to_agent(&b.subjects)) {
        assert_eq!(
            b.role_ref.api_group.as_deref(),
            Some("rbac.authorization.k8s.io")
        );
        let rules = match b.role_ref.kind.as_str() {
            "Role" => roles.get(&b.role_ref.name),
            "ClusterRole" => cluster_roles.get(&b.role_ref.name),
            other => panic!("roleRef kind {other}"),
        };
        namespace_rules.extend(
            rules
                .unwrap_or_else(|| panic!("role {} is not shipped", b.role_ref.name))
                .iter()
                .cloned(),
        );
    }
    assert!(
        !cluster_rules.is_empty(),
        "no ClusterRoleBinding binds node-agent in {namespace}"
    );
    assert!(
        !namespace_rules.is_empty(),
        "no RoleBinding binds node-agent in {namespace}"
    );
    Rbac {
        cluster_rules,
        namespace_rules,
    }
}

#[test]
fn rbac_grants_everything_the_agent_uses() {
    let rbac = rbac();
    let mut missing = Vec::new();
    for &(scope, group, resource, verb, name) in NEEDS {
        let in_cluster = rbac
            .cluster_rules
            .iter()
            .any(|r| grants(r, group, resource, verb, name));
        let in_namespace = rbac
            .namespace_rules
            .iter()
            .any(|r| grants(r, group, resource, verb, name));
        let ok = match scope {
            Scope::Cluster => in_cluster,
            Scope::Namespace => in_namespace || in_cluster,
        };
        if !ok {
            missing.push(format!("{scope:?} {verb} {group}/{resource} {name:?}"));
        }
    }
    assert!(missing.is_empty(), "not granted:\n{}", missing.join("\n"));
}

#[test]
fn rbac_grants_nothing_else_and_no_wildcards() {
    let rbac = rbac();
    let mut problems = Vec::new();
    let all = rbac
        .cluster_rules
        .iter()
        .map(|r| (Scope::Cluster, r))
        .chain(rbac.namespace_rules.iter().map(|r| (Scope::Namespace, r)));
    for (scope, rule) in all {
        let lists = [
            &rule.api_groups,
            &rule.resources,
            &Some(rule.verbs.clone()),
            &rule.resource_names,
            &rule.non_resource_urls,
        ];
        if lists
            .iter()
            .any(|l| l.iter().flatten().any(|s| s.contains('*')))
        {
            problems.push(format!("wildcard in {rule:?}"));
        }
        if let Some(urls) = &rule.non_resource_urls {
            assert_eq!(
                scope,
                Scope::Cluster,
                "nonResourceURLs only work in a ClusterRole"
            );
            if rule.verbs != ["get"] || urls.iter().any(|u| !DISCOVERY_URLS.contains(&u.as_str())) {
                problems.push(format!("non-resource rule beyond discovery: {rule:?}"));
            }
            continue;
        }
        // Every (group, resource, verb, name) the rule grants must be one the agent needs, at
        // this scope.
        let names: Vec<Option<&str>> = match &rule.resource_names {
            Some(n) if !n.is_empty() => n.iter().map(|s| Some(s.as_str())).collect(),
            _ => vec![None],
        };
        for group in rule.api_groups.iter().flatten() {
            for resource in rule.resources.iter().flatten() {
                for verb in &rule.verbs {
                    for name in &names {
                        let needed = NEEDS.iter().any(|&(s, g, r, v, n)| {
                            s == scope
                                && g == group
                                && r == resource
                                && v == verb
                                && (n.is_none() || n == *name)
                        });
                        if !needed {
                            problems.push(format!(
                                "{scope:?} {verb} {group}/{resource} {name:?} is not needed"
                            ));
                        }
                    }
                }
            }
        }
    }
    // Secrets: read by name in the Velero namespace only; never listed or watched, never
    // cluster-wide.
    for r in &rbac.cluster_rules {
        if grants(r, "", "secrets", "get", Some("some-other-secret")) {
            problems.push(format!("reads Secrets of every namespace: {r:?}"));
        }
    }
    for r in rbac.cluster_rules.iter().chain(&rbac.namespace_rules) {
        if grants(r, "", "secrets", "list", None) || grants(r, "", "secrets", "watch", None) {
            problems.push(format!("lists or watches Secrets: {r:?}"));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn every_rbac_rule_has_a_comment_saying_why() {
    let text = std::fs::read_to_string(daemonset_dir().join("rbac.yaml")).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let mut rules = 0;
    for (i, line) in lines.iter().enumerate() {
        let t = line.trim_start();
        if t.starts_with("- apiGroups:") || t.starts_with("- nonResourceURLs:") {
            rules += 1;
            let above = lines[..i]
                .iter()
                .rev()
                .find(|l| !l.trim().is_empty())
                .map(|l| l.trim_start());
            assert!(
                above.is_some_and(|l| l.starts_with('#')),
                "rbac.yaml line {}: rule without a comment above it",
                i + 1
            );
        }
    }
    let parsed: usize = rbac().cluster_rules.len() + rbac().namespace_rules.len();
    assert_eq!(
        rules, parsed,
        "every rule is written as `- apiGroups:` or `- nonResourceURLs:`"
    );
}
