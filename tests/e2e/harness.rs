//! End-to-end harness: the real agent binary, talking to a real Kubernetes API server given by
//! `PODVOLUME_E2E_KUBECONFIG` (scripts/test-real-cluster.sh starts one), with real restic and
//! kopia on real files laid out like the kubelet's pods directory.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use kube::{Api, Client, Resource, ResourceExt};
use podvolume_agent::agent::status::VolumeObject;
use podvolume_agent::crd::{Phase, PodVolumeBackup, PodVolumeRestore};
use serde_json::json;

#[allow(unused_imports)]
pub use fault_proxy::{FaultProxy, RequestMatch};

#[path = "../common/fault_proxy.rs"]
pub mod fault_proxy;
#[path = "identity.rs"]
pub mod identity;
#[path = "../common/restic_under_test.rs"]
mod restic_under_test;
pub use restic_under_test::*;
#[path = "../common/kopia_under_test.rs"]
mod kopia_under_test;
#[allow(unused_imports)]
pub use kopia_under_test::*;

pub const NODE: &str = "e2e-node-a";
pub const OTHER_NODE: &str = "e2e-node-b";

/// Which CRDs the API server serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavour {
    /// Velero's own (1.17+): no status subresource, eight phases.
    Velero,
    /// Velero 1.16 and older (1.16.2's `velero install --crds-only`, as 1.15's in
    /// `velero-crds/v1.15/`): no status subresource, and only the
    /// phases New, InProgress, Completed and Failed.
    Velero116,
    /// The project's: status subresource, printer columns.
    Ours,
}

impl Flavour {
    /// Status is written on the object itself, so the result and the removal of our finalizer
    /// are one write.
    pub fn status_on_object(self) -> bool {
        self != Flavour::Ours
    }

    /// The phase a canceled transfer ends in: Velero <= 1.16's CRDs have no Canceled, and a
    /// cancel ends Failed (with a message that says it was canceled), as Velero's agent did.
    pub fn canceled(self) -> Phase {
        if self == Flavour::Velero116 {
            Phase::Failed
        } else {
            Phase::Canceled
        }
    }

    /// Whether the CRDs have every phase (Accepted, Canceling, Canceled among them).
    pub fn all_phases(self) -> bool {
        self != Flavour::Velero116
    }
}

/// How a test tells the agent where its kubeconfig is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KubeconfigVia {
    /// `--kubeconfig <file>`.
    Flag,
    /// `KUBECONFIG=<file>` and no flag.
    Env,
    /// `~/.kube/config`, with `KUBECONFIG` set but empty (which counts as unset).
    HomeWithEmptyEnv,
}

/// A Velero Restore (see [`Env::create_restore`]).
pub struct RestoreRef {
    pub name: String,
    pub uid: String,
}

impl RestoreRef {
    pub fn owner_reference(&self) -> serde_json::Value {
        json!({"apiVersion": "velero.io/v1", "kind": "Restore", "name": self.name, "uid": self.uid})
    }
}

pub struct Env {
    /// The flavour the API server serves, found by discovery (what a test asserts), which on a
    /// real cluster may differ from the one the test asked for.
    pub flavour: Flavour,
    pub client: Client,
    /// The tests' own identity (admin on a real cluster).
    pub kubeconfig: PathBuf,
    /// The agent's: the ServiceAccount and RBAC of `daemonset/` (see `identity.rs`), or a fault
    /// proxy's kubeconfig with those credentials (`fault_proxy`).
    pub agent_kubeconfig: PathBuf,
    /// Velero's namespace: where the PodVolumeBackups/Restores live.
    pub ns: String,
    /// The application pods' namespace.
    pub app_ns: String,
    pub tmp: tempfile::TempDir,
    pub pods_dir: PathBuf,
    pub repo: PathBuf,
    pub password_file: PathBuf,
    /// Every agent this test started (pid, log), for the watchdog.
    agents: Arc<Mutex<Vec<(u32, PathBuf)>>>,
    _watchdog: Watchdog,
}

/// Ends the whole test binary, loudly, when one test runs past its deadline: a test that hangs
/// (a blocked runtime, a peer that accepts and never answers) must fail with what it was doing,
/// not sit until CI's own limit kills everything with nothing said. The deadline is
/// `PODVOLUME_E2E_TEST_TIMEOUT` (humantime, default 10m), far above the slowest test.
struct Watchdog {
    stop: Option<std::sync::mpsc::Sender<()>>,
}

impl Watchdog {
    fn start(agents: Arc<Mutex<Vec<(u32, PathBuf)>>>) -> Watchdog {
        let limit = std::env::var("PODVOLUME_E2E_TEST_TIMEOUT")
            .ok()
            .map(|v| humantime::parse_duration(&v).expect("PODVOLUME_E2E_TEST_TIMEOUT"))
            .unwrap_or(Duration::from_secs(600));
        let test = std::thread::current()
            .name()
            .unwrap_or("an e2e test")
            .to_string();
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        std::thread::spawn(move || {
            if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(limit) {
                let agents = agents.lock().unwrap_or_else(|e| e.into_inner()).clone();
                report_hang(&test, limit, &agents);
                // Exiting runs no Drop: stop the agents and their uploaders here, or they
                // outlive the test binary: every test's, not only this one's (the others
                // running beside it end with the binary too).
                let every = EVERY_AGENT
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .clone();
                for pid in every {
                    stop_agent_and_uploaders(pid);
                }
                std::process::exit(124);
            }
        });
        Watchdog { stop: Some(stop) }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

/// Every agent any test of this binary started: a watchdog that ends the binary stops them all.
static EVERY_AGENT: Mutex<Vec<u32>> = Mutex::new(Vec::new());

/// SIGKILL to an agent and to the process group of each of its children (every uploader runs
/// in its own group).
fn stop_agent_and_uploaders(agent: u32) {
    use nix::sys::signal::{Signal, kill, killpg};
    use nix::unistd::Pid;
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // pid (comm) state ppid pgrp ...: comm may hold spaces, so split after its ')'.
        let Some((_, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        let fields: Vec<&str> = rest.split_whitespace().collect();
        if fields.get(1).and_then(|p| p.parse::<u32>().ok()) == Some(agent)
            && let Some(pgrp) = fields.get(2).and_then(|g| g.parse::<i32>().ok())
        {
            let _ = killpg(Pid::from_raw(pgrp), Signal::SIGKILL);
        }
    }
    let _ = kill(Pid::from_raw(agent as i32), Signal::SIGKILL);
}

/// Written straight to the process's stderr: the test harness captures what the test's
/// threads print, and would drop it when the process exits.
fn report_hang(test: &str, limit: Duration, agents: &[(u32, PathBuf)]) {
    use std::io::Write;
    let mut r = format!(
        "\n==== e2e watchdog: {test} still running after {limit:?}; ending the test binary ====\n"
    );
    let ps = Command::new("ps")
        .args(["-eo", "pid,ppid,pgid,stat,etime,args"])
        .output()
        .map(|o| {
            // Kernel threads ([name]) say nothing about the test.
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .filter(|l| {
                    !l.split_whitespace()
                        .nth(5)
                        .is_some_and(|a| a.starts_with('['))
                })
                .map(|l| format!("{l}\n"))
                .collect::<String>()
        })
        .unwrap_or_default();
    r.push_str("---- processes ----\n");
    r.push_str(&ps);
    r.push_str(&test_threads());
    for (_, log) in agents {
        for path in [log.clone(), log.with_extension("err")] {
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(80).collect();
            r.push_str(&format!("---- last lines of {} ----\n", path.display()));
            for line in tail.into_iter().rev() {
                r.push_str(line);
                r.push('\n');
            }
        }
    }
    let _ = std::io::stderr().write_all(r.as_bytes());
}

/// Where each thread of this test binary waits (name, state, kernel wait channel and the top of
/// its kernel stack, readable as root): a hang in a blocking read, a futex or the network shows
/// there, which the process table cannot tell.
fn test_threads() -> String {
    let mut r = String::from("---- threads of this test binary ----\n");
    for task in std::fs::read_dir("/proc/self/task")
        .into_iter()
        .flatten()
        .flatten()
    {
        let read = |f: &str| std::fs::read_to_string(task.path().join(f)).unwrap_or_default();
        let stat = read("stat");
        let state = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .unwrap_or("?")
            .to_string();
        let stack: Vec<String> = read("stack")
            .lines()
            .take(6)
            .map(|l| l.trim().to_string())
            .collect();
        r.push_str(&format!(
            "{} {} {} wchan={} | {}\n",
            task.file_name().to_string_lossy(),
            read("comm").trim(),
            state,
            read("wchan").trim(),
            stack.join(" < ")
        ));
    }
    r
}

fn unique(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    )
}

impl Env {
    /// A test environment on the cluster of `PODVOLUME_E2E_KUBECONFIG`. The cluster keeps the
    /// CRDs it has (ours installed when it has none) and `Env::flavour` says which it serves:
    /// a test asking for another flavour asserts the served one's behaviour.
    pub async fn new(requested: Flavour) -> Env {
        let tmp = tempfile::Builder::new()
            .prefix("pva-e2e-")
            .tempdir()
            .unwrap();
        let kubeconfig = PathBuf::from(std::env::var_os("PODVOLUME_E2E_KUBECONFIG").expect(
            "the end-to-end suite needs a Kubernetes API server: set PODVOLUME_E2E_KUBECONFIG to \
             an admin kubeconfig, or run scripts/test-real-cluster.sh (it starts one)",
        ));
        let client = {
            let kc = kube::config::Kubeconfig::read_from(&kubeconfig).unwrap();
            let cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default())
                .await
                .unwrap();
            Client::try_from(cfg).unwrap()
        };
        ensure_crds(&client).await;
        let flavour = served_flavour(&client).await;
        if flavour != requested {
            eprintln!(
                "the API server serves {flavour:?} CRDs (asked for {requested:?}): asserting {flavour:?} behaviour"
            );
        }
        let ns = unique("pva-velero");
        let app_ns = unique("pva-app");
        let namespaces: Api<Namespace> = Api::all(client.clone());
        for n in [&ns, &app_ns] {
            let obj: Namespace = serde_json::from_value(json!({"metadata": {"name": n}})).unwrap();
            let _ = namespaces.create(&PostParams::default(), &obj).await;
        }
        ensure_nodes(&client).await;
        let agent_kubeconfig =
            identity::node_agent_kubeconfig(&client, &kubeconfig, &ns, tmp.path()).await;
        let pods_dir = tmp.path().join("pods");
        std::fs::create_dir_all(&pods_dir).unwrap();
        let password_file = tmp.path().join("repo-password");
        std::fs::write(&password_file, "e2e password").unwrap();
        let agents = Arc::new(Mutex::new(Vec::new()));
        // The Backup the tests' PodVolumeBackups name (velero.io/backup-name: b1): the agent
        // stops a transfer whose Backup is gone or has ended, so it must exist (and, with no
        // Velero server here, it stays New). Where Velero's Backup kind is not served the agent
        // cannot tell and runs the transfers.
        create_backup(&client, &ns, "b1").await;
        // The location of the tests' local repositories: a plugin's provider, which gets no
        // cloud credentials or TLS settings.
        create_storage_location(
            &client,
            &ns,
            "default",
            json!({"provider": "podvolume-agent.io/filesystem", "objectStorage": {"bucket": "local"}}),
        )
        .await;
        Env {
            repo: tmp.path().join("repo"),
            flavour,
            client,
            kubeconfig,
            agent_kubeconfig,
            ns,
            app_ns,
            pods_dir,
            password_file,
            tmp,
            _watchdog: Watchdog::start(agents.clone()),
            agents,
        }
    }

    /// Puts a fault-injecting proxy between the agents this test starts from now on and the API
    /// server: the agent's kubeconfig then names the proxy, with the agent's
    /// own credentials. The test's own client keeps going to the server directly.
    pub async fn fault_proxy(&mut self) -> FaultProxy {
        let proxy = FaultProxy::start(&self.agent_kubeconfig, self.tmp.path())
            .await
            .unwrap_or_else(|e| panic!("starting the fault proxy: {e}"));
        self.agent_kubeconfig = proxy.kubeconfig().to_path_buf();
        proxy
    }

    pub fn pvbs(&self) -> Api<PodVolumeBackup> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    pub fn pvrs(&self) -> Api<PodVolumeRestore> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    /// A Pod object scheduled on `node` with emptyDir volumes, and its kubelet-like directories.
    /// Returns the pod and each volume's directory.
    pub async fn create_pod(
        &self,
        name: &str,
        node: &str,
        volumes: &[&str],
    ) -> (Pod, BTreeMap<String, PathBuf>) {
        self.create_pod_with(name, node, volumes, false).await
    }

    /// `restore_helper`: with the init container Velero adds to pods it restores into (first,
    /// named `restore-wait`), not yet running.
    pub async fn create_pod_with(
        &self,
        name: &str,
        node: &str,
        volumes: &[&str],
        restore_helper: bool,
    ) -> (Pod, BTreeMap<String, PathBuf>) {
        let vols: Vec<_> = volumes
            .iter()
            .map(|v| json!({"name": v, "emptyDir": {}}))
            .collect();
        let mut spec = json!({
            "nodeName": node,
            "containers": [{"name": "app", "image": "busybox"}],
            "volumes": vols,
        });
        if restore_helper {
            let mounts: Vec<_> = volumes
                .iter()
                .map(|v| json!({"name": v, "mountPath": format!("/restores/{v}")}))
                .collect();
            spec["initContainers"] = json!([{
                "name": "restore-wait", "image": "velero/velero-restore-helper",
                "volumeMounts": mounts,
            }]);
        }
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": self.app_ns},
            "spec": spec,
        }))
        .unwrap();
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &self.app_ns);
        let pod = pods.create(&PostParams::default(), &pod).await.unwrap();
        let uid = pod.uid().unwrap();
        let mut dirs = BTreeMap::new();
        for v in volumes {
            let d = self
                .pods_dir
                .join(&uid)
                .join("volumes/kubernetes.io~empty-dir")
                .join(v);
            std::fs::create_dir_all(&d).unwrap();
            dirs.insert(v.to_string(), d);
        }
        (pod, dirs)
    }

    pub async fn create_pvb(
        &self,
        name: &str,
        pod: &Pod,
        volume: &str,
        node: &str,
    ) -> PodVolumeBackup {
        self.create_pvb_with(name, pod, volume, node, json!({}), json!({}))
            .await
    }

    /// A PodVolumeBackup as Velero's server creates it; `labels` and `spec_extra` are merged in.
    pub async fn create_pvb_with(
        &self,
        name: &str,
        pod: &Pod,
        volume: &str,
        node: &str,
        labels: serde_json::Value,
        spec_extra: serde_json::Value,
    ) -> PodVolumeBackup {
        let mut spec = json!({
            "node": node,
            "pod": {"kind": "Pod", "namespace": pod.namespace(), "name": pod.name_any(), "uid": pod.uid()},
            "volume": volume,
            "backupStorageLocation": "default",
            "repoIdentifier": self.repo.display().to_string(),
            "uploaderType": "restic",
            "tags": {"backup": "b1", "volume": volume, "pod": pod.name_any()},
        });
        merge(&mut spec, spec_extra);
        let mut meta =
            json!({"name": name, "namespace": self.ns, "labels": {"velero.io/backup-name": "b1"}});
        merge(&mut meta["labels"], labels);
        let obj: PodVolumeBackup = serde_json::from_value(json!({
            "apiVersion": "velero.io/v1", "kind": "PodVolumeBackup", "metadata": meta, "spec": spec,
        }))
        .unwrap();
        self.pvbs()
            .create(&PostParams::default(), &obj)
            .await
            .unwrap()
    }

    /// The Velero Restore a test's PodVolumeRestores belong to, a real Restore object: Velero
    /// sets it as each PVR's owner, and the garbage collector deletes a PVR whose owner does not
    /// exist. The agent names the done file after its UID.
    pub async fn create_restore(&self, name: &str) -> RestoreRef {
        use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
        let gvk = GroupVersionKind::gvk("velero.io", "v1", "Restore");
        let api: Api<DynamicObject> =
            Api::namespaced_with(self.client.clone(), &self.ns, &ApiResource::from_gvk(&gvk));
        let obj: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "velero.io/v1", "kind": "Restore",
            "metadata": {"name": name, "namespace": self.ns},
            "spec": {"backupName": "b1"},
        }))
        .unwrap();
        let created = api.create(&PostParams::default(), &obj).await.unwrap();
        RestoreRef {
            name: name.to_string(),
            uid: created.uid().unwrap(),
        }
    }

    pub async fn create_pvr(
        &self,
        name: &str,
        pod: &Pod,
        volume: &str,
        snapshot: &str,
        restore: &RestoreRef,
    ) -> PodVolumeRestore {
        let obj: PodVolumeRestore = serde_json::from_value(json!({
            "apiVersion": "velero.io/v1", "kind": "PodVolumeRestore",
            "metadata": {
                "name": name, "namespace": self.ns,
                "labels": {"velero.io/restore-name": restore.name, "velero.io/restore-uid": restore.uid, "velero.io/pod-uid": pod.uid()},
                "ownerReferences": [restore.owner_reference()],
            },
            "spec": {
                "pod": {"kind": "Pod", "namespace": pod.namespace(), "name": pod.name_any(), "uid": pod.uid()},
                "volume": volume,
                "backupStorageLocation": "default",
                "repoIdentifier": self.repo.display().to_string(),
                "snapshotID": snapshot,
                "sourceNamespace": self.app_ns,
                "uploaderType": "restic",
            },
        }))
        .unwrap();
        self.pvrs()
            .create(&PostParams::default(), &obj)
            .await
            .unwrap()
    }

    /// Reports the pod's restore helper init container running, as the kubelet would.
    pub async fn restore_helper_running(&self, pod: &str) {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &self.app_ns);
        pods.patch_status(
            pod,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"initContainerStatuses": [{
                "name": "restore-wait", "image": "velero/velero-restore-helper", "imageID": "",
                "ready": false, "restartCount": 0,
                "state": {"running": {"startedAt": "2026-12-02T00:00:00Z"}},
            }]}})),
        )
        .await
        .unwrap();
    }

    /// Waits until the PodVolumeBackup `name` is InProgress with bytes moving.
    pub async fn wait_moving(&self, name: &str, agent: &Agent, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let p = self.pvbs().get(name).await.unwrap();
            let st = p.status.clone().unwrap_or_default();
            if st.phase == Some(Phase::InProgress)
                && st.progress.as_ref().is_some_and(|p| p.bytes_done > 0)
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "never in progress: {st:?}\n{}",
                agent.logs()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Asks for a cancel as a user would: `spec.cancel: true` (Velero 1.17+, or Velero's server
    /// at its start) on CRDs that have it, else what `kubectl podvolume cancel` writes (Velero
    /// <= 1.16's CRDs have no `spec.cancel`; the API server would prune it).
    pub async fn cancel_pvb(&self, name: &str) {
        let patch = if self.flavour.all_phases() {
            json!({"spec": {"cancel": true}})
        } else {
            podvolume_agent::crd::cancel_patch()
        };
        self.pvbs()
            .patch(name, &PatchParams::default(), &Patch::Merge(patch))
            .await
            .unwrap();
    }

    pub async fn delete_pvb(&self, name: &str) {
        self.pvbs()
            .delete(name, &DeleteParams::default())
            .await
            .unwrap();
    }

    /// Starts the agent binary for `node` with the test's directories; `extra` flags override.
    pub fn start_agent(&self, node: &str, extra: &[&str]) -> Agent {
        self.start_agent_finding_kubeconfig(node, extra, KubeconfigVia::Flag)
    }

    /// As [`Env::start_agent`], telling the agent its kubeconfig as `via` says.
    pub fn start_agent_finding_kubeconfig(
        &self,
        node: &str,
        extra: &[&str],
        via: KubeconfigVia,
    ) -> Agent {
        self.start_agent_wrapped(node, extra, via, &[], &[])
    }

    /// As [`Env::start_agent`], the agent started through `wrapper` (a program and its
    /// arguments that end by exec'ing the agent's command line, e.g. a namespace of its own:
    /// the PID stays the agent's) with `envs` added to its environment.
    pub fn start_agent_wrapped(
        &self,
        node: &str,
        extra: &[&str],
        via: KubeconfigVia,
        wrapper: &[std::ffi::OsString],
        envs: &[(&str, String)],
    ) -> Agent {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let log = self.tmp.path().join(format!("agent-{node}-{port}.log"));
        let agent_bin = env!("CARGO_BIN_EXE_podvolume-agent");
        let mut cmd = match wrapper.split_first() {
            Some((program, args)) => {
                let mut c = Command::new(program);
                c.args(args).arg(agent_bin);
                c
            }
            None => Command::new(agent_bin),
        };
        cmd.envs(envs.iter().map(|(k, v)| (*k, v.as_str())));
        cmd.arg("run");
        match via {
            KubeconfigVia::Flag => {
                cmd.arg(format!("--kubeconfig={}", self.agent_kubeconfig.display()))
                    .env_remove("KUBECONFIG");
            }
            KubeconfigVia::Env => {
                cmd.env("KUBECONFIG", &self.agent_kubeconfig);
            }
            KubeconfigVia::HomeWithEmptyEnv => {
                let home = self.tmp.path().join(format!("home-{node}"));
                std::fs::create_dir_all(home.join(".kube")).unwrap();
                std::fs::copy(&self.agent_kubeconfig, home.join(".kube/config")).unwrap();
                cmd.env("HOME", &home).env("KUBECONFIG", "");
            }
        }
        cmd.arg(format!("--node-name={node}"))
            .arg(format!("--namespace={}", self.ns))
            .arg(format!("--host-pods-dir={}", self.pods_dir.display()))
            .arg(format!(
                "--scratch-dir={}",
                self.tmp.path().join(format!("scratch-{node}")).display()
            ))
            .arg(format!(
                "--state-dir={}",
                self.tmp.path().join(format!("state-{node}")).display()
            ))
            .arg(format!(
                "--repo-password-file={}",
                self.password_file.display()
            ))
            .arg(format!("--listen-address=127.0.0.1:{port}"))
            .arg("--update-interval=200ms")
            .arg("--cancel-grace=3s")
            .arg("--log-format=plain")
            .arg(format!("--restic-binary={}", restic_bin().display()))
            // Velero's server creates repositories before any PVB; there is none here, so the
            // agent may create them. Tests of the default pass --init-missing-repository=false.
            .arg("--init-missing-repository")
            .args(extra)
            // The agent's own default filter (what a DaemonSet without RUST_LOG logs).
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&log).unwrap())
            .stderr(std::fs::File::create(log.with_extension("err")).unwrap());
        let child = cmd.spawn().unwrap();
        self.agents.lock().unwrap().push((child.id(), log.clone()));
        EVERY_AGENT
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(child.id());
        Agent {
            child: Some(child),
            port,
            log,
        }
    }

    /// Waits until the object reaches one of `phases`.
    pub async fn wait_pvb(
        &self,
        name: &str,
        phases: &[Phase],
        timeout: Duration,
    ) -> PodVolumeBackup {
        wait_phase(self.pvbs(), name, phases, timeout).await
    }

    pub async fn wait_pvr(
        &self,
        name: &str,
        phases: &[Phase],
        timeout: Duration,
    ) -> PodVolumeRestore {
        wait_phase(self.pvrs(), name, phases, timeout).await
    }

    /// Records every version of one object as the API server serves it (a watch).
    pub fn record<K>(&self, api: Api<K>, name: &str) -> Recorder<K>
    where
        K: Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + Sync + 'static,
    {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let arrived = Arc::new(Mutex::new(Vec::new()));
        let cfg = watcher::Config::default().fields(&format!("metadata.name={name}"));
        let (s, a) = (seen.clone(), arrived.clone());
        let task = tokio::spawn(async move {
            let mut stream = watcher::watcher(api, cfg).boxed();
            while let Some(ev) = stream.next().await {
                if let Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o)) = ev {
                    let mut s = s.lock().unwrap();
                    s.push(o);
                    a.lock().unwrap().push(Instant::now());
                }
            }
        });
        Recorder {
            seen,
            arrived,
            task,
        }
    }

    /// Files under a volume, as a test fixture.
    pub fn fill(dir: &Path, files: &[(&str, usize)]) -> u64 {
        let mut total = 0;
        for (i, (name, size)) in files.iter().enumerate() {
            let p = dir.join(name);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(&p, pseudo_random(*size, i as u64 + 1)).unwrap();
            total += *size as u64;
        }
        total
    }

    /// restic's own view of the repository (snapshot IDs).
    pub fn restic_snapshots(&self) -> Vec<serde_json::Value> {
        let out = Command::new(restic_bin())
            .args(["snapshots", "--json", "--no-lock"])
            .env("RESTIC_REPOSITORY", &self.repo)
            .env("RESTIC_PASSWORD_FILE", &self.password_file)
            .env("RESTIC_CACHE_DIR", self.tmp.path().join("restic-cache"))
            .stdin(Stdio::null())
            .output()
            .unwrap();
        serde_json::from_slice(&out.stdout).unwrap_or_default()
    }

    pub fn restic_locks(&self) -> Vec<String> {
        let out = Command::new(restic_bin())
            .args(["list", "locks", "--no-lock"])
            .env("RESTIC_REPOSITORY", &self.repo)
            .env("RESTIC_PASSWORD_FILE", &self.password_file)
            .env("RESTIC_CACHE_DIR", self.tmp.path().join("restic-cache"))
            .stdin(Stdio::null())
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| !l.is_empty())
            .map(String::from)
            .collect()
    }

    /// Uploader processes still running for this test (their argv names its directory).
    pub fn uploader_processes(&self) -> Vec<String> {
        let needle = self.tmp.path().display().to_string();
        let mut found = Vec::new();
        for e in std::fs::read_dir("/proc").unwrap().flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                continue;
            };
            if stat
                .rsplit(')')
                .next()
                .is_some_and(|r| r.trim_start().starts_with('Z'))
            {
                continue;
            }
            let Ok(cmd) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
                continue;
            };
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            if is_uploader(&cmd) && cmd.contains(&needle) {
                found.push(format!("{pid}: {cmd}"));
            }
        }
        found
    }

    /// A restic wrapper that slows uploads to `kib` KiB/s (restic 0.14 reads at full speed and
    /// then spends the run uploading), so a backup stays in progress long enough to act on.
    pub fn slow_restic(&self, kib: u32) -> PathBuf {
        let p = self.tmp.path().join(format!("restic-slow-{kib}"));
        std::fs::write(
            &p,
            format!(
                "#!/bin/sh\nRESTIC='{}'\ncase \" $* \" in *\" backup \"*) exec \"$RESTIC\" \"$@\" --limit-upload={kib};; esac\nexec \"$RESTIC\" \"$@\"\n",
                restic_bin().display()
            ),
        )
        .unwrap();
        make_executable(&p);
        p
    }

    /// A restic wrapper that runs restic as `nobody`, who cannot read files made unreadable.
    pub fn nobody_restic(&self) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(self.tmp.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        std::fs::set_permissions(&self.password_file, std::fs::Permissions::from_mode(0o644))
            .unwrap();
        let p = self.tmp.path().join("restic-as-nobody");
        std::fs::write(
            &p,
            format!(
                "#!/bin/sh\nexec setpriv --reuid=65534 --regid=65534 --clear-groups '{}' \"$@\"\n",
                restic_bin().display()
            ),
        )
        .unwrap();
        make_executable(&p);
        p
    }

    /// Deletes the test's namespaces (finalizers dropped first, so nothing is left waiting).
    pub async fn cleanup(&self) {
        drop_finalizers(self.pvbs()).await;
        drop_finalizers(self.pvrs()).await;
        let namespaces: Api<Namespace> = Api::all(self.client.clone());
        for n in [&self.ns, &self.app_ns] {
            let _ = namespaces.delete(n, &DeleteParams::default()).await;
        }
    }
}

impl Drop for Env {
    /// An agent killed by the test leaves its uploaders running (they have their own process
    /// group); they must not outlive the test.
    fn drop(&mut self) {
        for p in self.uploader_processes() {
            if let Some(pid) = p.split(':').next().and_then(|p| p.parse::<i32>().ok()) {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
    }
}

/// Whether a command line (argv joined by spaces) runs restic: the program itself, or a test's
/// `sh` wrapper script named `restic-*`. The agent's own argv names restic in `--restic-binary`
/// and is not one.
fn is_uploader(cmd: &str) -> bool {
    let base = |a: &str| a.rsplit('/').next().unwrap_or("").to_string();
    let mut args = cmd.split(' ');
    let program = base(args.next().unwrap_or(""));
    let uploader = |p: &str| p.starts_with("restic") || p.starts_with("kopia");
    if program == "sh" || program == "dash" || program == "bash" {
        return args.next().is_some_and(|a| uploader(&base(a)));
    }
    uploader(&program)
}

/// Which CRD flavour the API server serves, from discovery as the agent reads it: the status
/// subresource on PodVolumeBackups means ours.
pub async fn served_flavour(client: &Client) -> Flavour {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match client.list_api_group_resources("velero.io/v1").await {
            Ok(list) if list.resources.iter().any(|r| r.name == "podvolumebackups") => {
                let status = list
                    .resources
                    .iter()
                    .any(|r| r.name == "podvolumebackups/status");
                return if status {
                    Flavour::Ours
                } else if four_phases(client).await {
                    Flavour::Velero116
                } else {
                    Flavour::Velero
                };
            }
            other => assert!(
                Instant::now() < deadline,
                "velero.io/v1 podvolumebackups not served: {other:?}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// No status write of this agent was refused by the API server (422): its metrics count none
/// and its log tells none.
pub async fn assert_no_refused_writes(agent: &Agent) {
    let (_, metrics) = agent.http_get("/metrics").await.expect("metrics");
    assert!(
        !metrics.contains("result=\"invalid\""),
        "a status write was refused:\n{metrics}\n{}",
        agent.logs()
    );
    assert!(
        !agent.logs().contains("refused"),
        "a refused write in the log:\n{}",
        agent.logs()
    );
}

/// Whether the PodVolumeBackup CRD's `status.phase` enum is Velero <= 1.16's four phases.
async fn four_phases(client: &Client) -> bool {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    use podvolume_agent::agent::phases::PhaseSet;
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let crd = crds.get("podvolumebackups.velero.io").await.unwrap();
    PhaseSet::of_crd(&crd).is_some_and(|set| !set.contains(Phase::Accepted))
}

/// Waits until a finished object is free of our finalizer, as the served flavour promises:
/// with Velero's CRDs the result and the removal are one write, so the result itself must not
/// carry it; with a status subresource the removal is a second request that follows shortly.
pub async fn assert_result_released(env: &Env, done: &PodVolumeBackup, logs: impl Fn() -> String) {
    let ours = |p: &PodVolumeBackup| {
        p.finalizers()
            .iter()
            .any(|f| f == podvolume_agent::crd::FINALIZER)
    };
    match env.flavour {
        Flavour::Velero | Flavour::Velero116 => {
            assert!(!ours(done), "finalizer left on the result\n{}", logs())
        }
        Flavour::Ours => {
            let name = done.name_any();
            let deadline = Instant::now() + Duration::from_secs(10);
            while env
                .pvbs()
                .get_opt(&name)
                .await
                .unwrap()
                .is_some_and(|p| ours(&p))
            {
                assert!(
                    Instant::now() < deadline,
                    "finalizer left on a finished object\n{}",
                    logs()
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// A `velero.io/v1` BackupStorageLocation `name` in `ns` with `spec`.
pub async fn create_storage_location(
    client: &Client,
    ns: &str,
    name: &str,
    spec: serde_json::Value,
) {
    use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
    let gvk = GroupVersionKind::gvk("velero.io", "v1", "BackupStorageLocation");
    let api: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), ns, &ApiResource::from_gvk(&gvk));
    let obj: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "velero.io/v1", "kind": "BackupStorageLocation",
        "metadata": {"name": name, "namespace": ns}, "spec": spec,
    }))
    .unwrap();
    api.create(&PostParams::default(), &obj).await.unwrap();
}

/// The test nodes as Node objects: a real control plane's pod garbage collector force-deletes
/// pods bound to a node that does not exist (about 40 s after they are created).
async fn ensure_nodes(client: &Client) {
    use k8s_openapi::api::core::v1::Node;
    let nodes: Api<Node> = Api::all(client.clone());
    for name in [NODE, OTHER_NODE] {
        if nodes.get_opt(name).await.unwrap().is_none() {
            let node: Node = serde_json::from_value(json!({"metadata": {"name": name}})).unwrap();
            match nodes.create(&PostParams::default(), &node).await {
                Ok(_) => {}
                // Another test made it first.
                Err(kube::Error::Api(s)) if s.code == 409 => {}
                Err(e) => panic!("creating Node {name}: {e}"),
            }
        }
    }
}

async fn ensure_crds(client: &Client) {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    for doc in podvolume_agent::crd::crds_yaml()
        .split("---\n")
        .filter(|d| !d.trim().is_empty())
    {
        let crd: CustomResourceDefinition = serde_norway::from_str(doc).unwrap();
        if crds.get_opt(&crd.name_any()).await.unwrap().is_none() {
            crds.create(&PostParams::default(), &crd).await.unwrap();
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
    }
}

async fn wait_phase<K: VolumeObject>(
    api: Api<K>,
    name: &str,
    phases: &[Phase],
    timeout: Duration,
) -> K {
    let deadline = Instant::now() + timeout;
    loop {
        match api.get(name).await {
            Ok(o) if phases.contains(&o.phase()) => return o,
            Ok(o) => assert!(
                Instant::now() < deadline,
                "{name} stuck in {:?}: {o:?}",
                o.phase()
            ),
            Err(e) => assert!(
                Instant::now() < deadline,
                "{name} not readable in time: {e}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Removes every finalizer from the objects of `api`, so their namespace can go.
async fn drop_finalizers<K>(api: Api<K>)
where
    K: kube::Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let items = api
        .list(&Default::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default();
    for o in items {
        let _ = api
            .patch(
                &o.name_any(),
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"finalizers": null}})),
            )
            .await;
    }
}

fn make_executable(p: &Path) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755)).unwrap();
}

fn merge(a: &mut serde_json::Value, b: serde_json::Value) {
    if let (Some(a), serde_json::Value::Object(b)) = (a.as_object_mut(), b) {
        for (k, v) in b {
            a.insert(k, v);
        }
    }
}

pub fn pseudo_random(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut v = Vec::with_capacity(n + 8);
    while v.len() < n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(n);
    v
}

pub struct Recorder<K> {
    pub seen: Arc<Mutex<Vec<K>>>,
    /// When each version arrived through the watch.
    arrived: Arc<Mutex<Vec<Instant>>>,
    task: tokio::task::JoinHandle<()>,
}

impl<K: Clone> Recorder<K> {
    pub fn versions(&self) -> Vec<K> {
        self.seen.lock().unwrap().clone()
    }

    /// Each version with the moment the watch delivered it.
    pub fn timed_versions(&self) -> Vec<(Instant, K)> {
        let seen = self.seen.lock().unwrap().clone();
        let arrived = self.arrived.lock().unwrap().clone();
        arrived.into_iter().zip(seen).collect()
    }
}

impl<K> Drop for Recorder<K> {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The agent as a child process; killed when dropped.
pub struct Agent {
    pub child: Option<Child>,
    pub port: u16,
    pub log: PathBuf,
}

impl Agent {
    pub fn pid(&self) -> u32 {
        self.child.as_ref().unwrap().id()
    }

    pub fn signal(&self, sig: nix::sys::signal::Signal) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.pid() as i32), sig);
    }

    /// Waits for the process to exit; returns its exit code.
    pub fn wait(&mut self, timeout: Duration) -> Option<i32> {
        let deadline = Instant::now() + timeout;
        let child = self.child.as_mut()?;
        loop {
            if let Some(s) = child.try_wait().unwrap() {
                return s.code();
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn logs(&self) -> String {
        let mut s = std::fs::read_to_string(&self.log).unwrap_or_default();
        s.push_str(&std::fs::read_to_string(self.log.with_extension("err")).unwrap_or_default());
        s
    }

    /// GET on the agent's admin server; (status, body).
    pub async fn http_get(&self, path: &str) -> Option<(u16, String)> {
        // Bounded: an agent that accepts and never answers is a failure to report, not a hang.
        tokio::time::timeout(Duration::from_secs(10), self.http_exchange(path))
            .await
            .ok()
            .flatten()
    }

    async fn http_exchange(&self, path: &str) -> Option<(u16, String)> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", self.port))
            .await
            .ok()?;
        s.write_all(
            format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
                .as_bytes(),
        )
        .await
        .ok()?;
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).await.ok()?;
        let text = String::from_utf8_lossy(&buf).to_string();
        let code = text.split_whitespace().nth(1)?.parse().ok()?;
        let body = text
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_string())
            .unwrap_or_default();
        Some((code, body))
    }

    /// Waits for `/readyz` to answer 200.
    pub async fn wait_ready(&mut self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Some(Ok(Some(status))) = self.child.as_mut().map(|c| c.try_wait()) {
                panic!(
                    "agent exited ({status}) before it was ready:\n{}",
                    self.logs()
                );
            }
            if let Some((200, _)) = self.http_get("/readyz").await {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("agent not ready in {timeout:?}:\n{}", self.logs());
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A Velero Backup with no status (phase New), best effort: nothing when the kind is not served.
pub async fn create_backup(client: &Client, ns: &str, name: &str) {
    use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
    let gvk = GroupVersionKind::gvk("velero.io", "v1", "Backup");
    let api: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), ns, &ApiResource::from_gvk(&gvk));
    let obj: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "velero.io/v1", "kind": "Backup",
        "metadata": {"name": name, "namespace": ns},
        "spec": {},
    }))
    .unwrap();
    if let Err(e) = api.create(&PostParams::default(), &obj).await {
        eprintln!(
            "Backup {ns}/{name} not created ({e}): the agent cannot see the owner of the tests' PodVolumeBackups"
        );
    }
}

/// `data` in the API's base64 (Secret data, `objectStorage.caCert`).
pub fn b64(data: &[u8]) -> String {
    serde_json::to_value(k8s_openapi::ByteString(data.to_vec()))
        .unwrap()
        .as_str()
        .unwrap()
        .to_string()
}
