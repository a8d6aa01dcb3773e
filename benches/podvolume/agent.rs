//! Cases 4b and 5: the agent binary (release build) against a real control plane (etcd,
//! kube-apiserver and kube-controller-manager, started by `scripts/start-control-plane.sh` and
//! stopped when the run ends, also on a panic or an interrupt) with the real restic, as in the
//! e2e tests. The agent runs as `daemonset/`'s ServiceAccount with its RBAC, its token from the
//! TokenRequest API (`tests/e2e/identity.rs`), as in production.
//!
//! 4b. From `spec.cancel: true` (a merge patch, as `kubectl patch` or Velero sends it) to phase
//!     Canceled as the API server serves it, and to restic's process group gone.
//! 5.  The agent process's resident memory (`VmRSS`, the agent alone: restic is a separate
//!     process) idle, with 10,000 PodVolumeBackups of other nodes in its namespace (arrived by
//!     watch, and in the first list after a restart), and with running backups.
//!
//! The other nodes' objects are written as Velero writes them: created by its server (field
//! manager `velero-server`), then their status by its node agent (`node-agent-server`), so the
//! API server records two `managedFields` entries. Their owner, a Backup, exists: the controller
//! manager's garbage collector deletes dependents whose owner does not. Which requests the agent
//! made (status writes to those objects, label-selected lists) comes from the API server's audit
//! log, which records the agent's ServiceAccount only.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Pod, ServiceAccount};
use kube::api::{
    Api, ApiResource, DynamicObject, GroupVersionKind, ListParams, Patch, PatchParams, PostParams,
};
use kube::{Client, ResourceExt};
use podvolume_agent::crd::{Phase, PodVolumeBackup};
use serde_json::{Value, json};

use crate::util::{fmt, gen_large, max, median, processes};

const NS: &str = "velero";
const APP_NS: &str = "apps";
const NODE: &str = "bench-node";
const TIMEOUT: Duration = Duration::from_secs(300);
/// The Backup every PodVolumeBackup here belongs to.
const BACKUP: &str = "nightly-20261201";
/// Requests in flight while the other nodes' objects are stored (kube's client keeps one
/// HTTP/1.1 keep-alive connection per request in flight).
const SEED_CONCURRENCY: usize = 8;

pub struct Options<'a> {
    pub restic: &'a Path,
    pub agent: &'a Path,
    /// etcd, kube-apiserver, kube-controller-manager and kubectl (`install-control-plane.sh`).
    pub control_plane_bin: &'a Path,
    /// Velero's CRDs as `velero install --crds-only --dry-run -o yaml` prints them.
    pub velero_crds: &'a Path,
    pub work: &'a Path,
    pub cancel_runs: usize,
    pub objects: usize,
    pub running: usize,
    pub quick: bool,
}

pub fn run(o: &Options) -> String {
    let rt = tokio::runtime::Runtime::new().unwrap();
    // An interrupt drops the run, and with it the agents and the control plane it started.
    rt.block_on(async {
        tokio::select! {
            md = run_async(o) => md,
            sig = interrupted() => panic!("{sig}: the run stopped"),
        }
    })
}

async fn interrupted() -> &'static str {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).unwrap();
    let mut int = signal(SignalKind::interrupt()).unwrap();
    tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    }
}

/// A control plane started by `scripts/start-control-plane.sh`, stopped (`--stop`) on drop.
struct ControlPlane {
    dir: PathBuf,
    bin: PathBuf,
    admin_kubeconfig: PathBuf,
    audit_log: PathBuf,
    apiserver_pid: u32,
    etcd_pid: u32,
    versions: String,
}

impl ControlPlane {
    /// Starts one under `dir`, the API server auditing the requests of the node agent's
    /// ServiceAccount in `NS` (metadata only) into `dir/audit.log`.
    fn start(dir: &Path, bin: &Path) -> ControlPlane {
        std::fs::create_dir_all(dir).unwrap();
        let policy = dir.join("audit-policy.yaml");
        std::fs::write(
            &policy,
            format!(
                "apiVersion: audit.k8s.io/v1\nkind: Policy\nomitStages: [RequestReceived]\nrules:\n\
                 - level: Metadata\n  users: [\"system:serviceaccount:{NS}:{}\"]\n- level: None\n",
                crate::identity::SERVICE_ACCOUNT
            ),
        )
        .unwrap();
        let audit_log = dir.join("audit.log");
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/start-control-plane.sh");
        let t = Instant::now();
        let out = Command::new(&script)
            .arg(dir)
            .env("CONTROL_PLANE_BIN", bin)
            .env(
                "KUBE_APISERVER_EXTRA_ARGS",
                format!(
                    "--audit-policy-file={} --audit-log-path={}",
                    policy.display(),
                    audit_log.display()
                ),
            )
            .stderr(Stdio::inherit())
            .output()
            .unwrap();
        // On a failed start the script stops what it started.
        assert!(out.status.success(), "the control plane did not start");
        let env = String::from_utf8(out.stdout).unwrap();
        let var = |k: &str| {
            env.lines()
                .find_map(|l| l.strip_prefix(&format!("{k}=")))
                .unwrap_or_else(|| panic!("{k} missing from the control plane's env"))
                .to_string()
        };
        let version = |b: &str| {
            let out = Command::new(bin.join(b)).arg("--version").output().unwrap();
            let first = String::from_utf8_lossy(&out.stdout)
                .lines()
                .next()
                .unwrap_or_default()
                .to_string();
            first
                .split_whitespace()
                .last()
                .unwrap_or_default()
                .to_string()
        };
        let cp = ControlPlane {
            dir: dir.to_path_buf(),
            bin: bin.to_path_buf(),
            admin_kubeconfig: PathBuf::from(var("KUBECONFIG")),
            audit_log,
            apiserver_pid: var("KUBE_APISERVER_PID").parse().unwrap(),
            etcd_pid: var("ETCD_PID").parse().unwrap(),
            versions: format!(
                "kube-apiserver {}, etcd {}",
                version("kube-apiserver"),
                version("etcd")
            ),
        };
        eprintln!("control plane ({}) up in {:?}", cp.versions, t.elapsed());
        cp
    }

    fn kubectl(&self, args: &[&str]) {
        let st = Command::new(self.bin.join("kubectl"))
            .arg(format!("--kubeconfig={}", self.admin_kubeconfig.display()))
            .args(args)
            .stdout(Stdio::null())
            .status()
            .unwrap();
        assert!(st.success(), "kubectl {args:?} failed");
    }

    /// The audit events of completed requests (the agent's, by the policy).
    fn audited(&self) -> Vec<Value> {
        std::fs::read_to_string(&self.audit_log)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|e| e["stage"] == "ResponseComplete")
            .collect()
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/start-control-plane.sh");
        let _ = Command::new(script)
            .arg("--stop")
            .arg(&self.dir)
            .stdout(Stdio::null())
            .status();
    }
}

fn pvb_resource() -> ApiResource {
    ApiResource::from_gvk(&GroupVersionKind::gvk("velero.io", "v1", "PodVolumeBackup"))
}

/// The control plane, the kubelet-like pod directories and the agent's flags.
struct Bed {
    client: Client,
    agent_kubeconfig: PathBuf,
    backup_uid: String,
    dir: PathBuf,
    pods_dir: PathBuf,
    password_file: PathBuf,
    slow_restic: PathBuf,
    pods: u32,
    /// Declared last, so dropped last.
    server: ControlPlane,
}

impl Bed {
    async fn new(work: &Path, o: &Options<'_>, upload_kib: u32) -> Bed {
        let _ = std::fs::remove_dir_all(work);
        std::fs::create_dir_all(work).unwrap();
        let server = ControlPlane::start(&work.join("control-plane"), o.control_plane_bin);
        let crds = o.velero_crds.display().to_string();
        server.kubectl(&["apply", "-f", &crds]);
        server.kubectl(&[
            "wait",
            "--for=condition=established",
            "--timeout=60s",
            "crd/podvolumebackups.velero.io",
            "crd/backups.velero.io",
            "crd/backupstoragelocations.velero.io",
        ]);
        let client = {
            let kc = kube::config::Kubeconfig::read_from(&server.admin_kubeconfig).unwrap();
            let cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default())
                .await
                .unwrap();
            Client::try_from(cfg).unwrap()
        };
        for n in [NS, APP_NS] {
            create(
                &client,
                None,
                json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": n}}),
            )
            .await;
        }
        // Pods are bound to this node: without a Node object the controller manager's pod
        // garbage collector deletes them.
        create(
            &client,
            None,
            json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}}),
        )
        .await;
        // The location every PVB names: a local repository, so a plugin's provider.
        create(&client, Some(NS), json!({"apiVersion": "velero.io/v1", "kind": "BackupStorageLocation",
                "metadata": {"name": "default", "namespace": NS},
                "spec": {"provider": "podvolume-agent.io/filesystem", "objectStorage": {"bucket": "local"}}}))
            .await;
        // The Backup every PVB names as its owner.
        let backup = create(
            &client,
            Some(NS),
            json!({"apiVersion": "velero.io/v1", "kind": "Backup",
                "metadata": {"name": BACKUP, "namespace": NS},
                "spec": {"defaultVolumesToFsBackup": true, "storageLocation": "default"}}),
        )
        .await;
        let backup_uid = backup.uid().unwrap();
        // A pod needs its namespace's default ServiceAccount (made by the controller manager).
        let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), APP_NS);
        let deadline = Instant::now() + Duration::from_secs(60);
        while sas.get_opt("default").await.unwrap().is_none() {
            assert!(
                Instant::now() < deadline,
                "no default ServiceAccount in {APP_NS}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let agent_kubeconfig =
            crate::identity::node_agent_kubeconfig(&client, &server.admin_kubeconfig, NS, work)
                .await;
        let password_file = work.join("password");
        std::fs::write(&password_file, "benchmark password\n").unwrap();
        // restic 0.14 reads at full speed and spends the run uploading: a limit keeps each
        // backup running long enough to measure it and cancel it mid-way.
        let slow_restic = work.join("restic-slow");
        std::fs::write(
            &slow_restic,
            format!(
                "#!/bin/sh\ncase \" $* \" in *\" backup \"*) exec {r} \"$@\" --limit-upload={upload_kib};; esac\nexec {r} \"$@\"\n",
                r = o.restic.display()
            ),
        )
        .unwrap();
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&slow_restic, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        Bed {
            server,
            client,
            agent_kubeconfig,
            backup_uid,
            pods_dir: work.join("pods"),
            dir: work.to_path_buf(),
            password_file,
            slow_restic,
            pods: 0,
        }
    }

    fn pvbs(&self) -> Api<PodVolumeBackup> {
        Api::namespaced(self.client.clone(), NS)
    }

    /// A pod on `NODE` whose volume `data` holds `data` (hard links, so no copy is written).
    async fn pod_with(&mut self, data: Option<&Path>) -> Pod {
        self.pods += 1;
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": format!("app-{}", self.pods), "namespace": APP_NS},
            "spec": {"nodeName": NODE, "containers": [{"name": "app", "image": "busybox"}],
                     "volumes": [{"name": "data", "emptyDir": {}}]},
        }))
        .unwrap();
        let pod = Api::<Pod>::namespaced(self.client.clone(), APP_NS)
            .create(&PostParams::default(), &pod)
            .await
            .unwrap();
        let dir = self
            .pods_dir
            .join(pod.uid().unwrap())
            .join("volumes/kubernetes.io~empty-dir/data");
        std::fs::create_dir_all(&dir).unwrap();
        if let Some(src) = data {
            for e in std::fs::read_dir(src).unwrap().flatten() {
                std::fs::hard_link(e.path(), dir.join(e.file_name())).unwrap();
            }
        }
        pod
    }

    async fn create_pvb(&self, name: &str, pod: &Pod, repo: &Path) {
        let obj: PodVolumeBackup = serde_json::from_value(pvb_json(
            name,
            NODE,
            &pod.name_any(),
            &pod.uid().unwrap(),
            &repo.display().to_string(),
            &self.backup_uid,
            None,
        ))
        .unwrap();
        self.pvbs()
            .create(&PostParams::default(), &obj)
            .await
            .unwrap();
    }

    fn start_agent(&self, extra: &[&str]) -> AgentProcess {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let log = self.dir.join(format!("agent-{port}.log"));
        let child = Command::new(self_agent())
            .arg("run")
            .arg(format!("--kubeconfig={}", self.agent_kubeconfig.display()))
            .arg(format!("--node-name={NODE}"))
            .arg(format!("--namespace={NS}"))
            .arg(format!("--host-pods-dir={}", self.pods_dir.display()))
            .arg(format!(
                "--scratch-dir={}",
                self.dir.join("scratch").display()
            ))
            .arg(format!("--state-dir={}", self.dir.join("state").display()))
            .arg(format!(
                "--repo-password-file={}",
                self.password_file.display()
            ))
            .arg(format!("--restic-binary={}", self.slow_restic.display()))
            .arg(format!("--listen-address=127.0.0.1:{port}"))
            .arg("--update-interval=1s")
            .arg("--log-format=plain")
            // No Velero server creates the repositories here.
            .arg("--init-missing-repository")
            .args(extra)
            .env(
                "RUST_LOG",
                std::env::var("BENCH_AGENT_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&log).unwrap())
            .stderr(std::fs::File::create(log.with_extension("err")).unwrap())
            .spawn()
            .unwrap();
        AgentProcess { child, port }
    }

    async fn wait_phase(
        &self,
        name: &str,
        until: impl Fn(&PodVolumeBackup) -> bool,
    ) -> PodVolumeBackup {
        let deadline = Instant::now() + TIMEOUT;
        loop {
            let o = self.pvbs().get(name).await.unwrap();
            if until(&o) {
                return o;
            }
            assert!(Instant::now() < deadline, "{name} stuck: {:?}", o.status);
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Waits until `name` is InProgress with published progress.
    async fn wait_running(&self, name: &str) {
        self.wait_phase(name, |o| {
            let st = o.status.as_ref();
            assert!(
                !phase_of(o).is_terminal(),
                "{name} ended before it could be measured: {st:?}"
            );
            phase_of(o) == Phase::InProgress
                && st
                    .and_then(|s| s.progress.as_ref())
                    .is_some_and(|p| p.bytes_done > 0)
        })
        .await;
    }
}

fn phase_of(o: &PodVolumeBackup) -> Phase {
    o.status
        .as_ref()
        .and_then(|s| s.phase)
        .unwrap_or(Phase::New)
}

/// The agent binary given on the command line (set once in `run_async`).
static AGENT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
fn self_agent() -> &'static Path {
    AGENT.get().unwrap()
}

struct AgentProcess {
    child: Child,
    port: u16,
}

impl AgentProcess {
    fn pid(&self) -> u32 {
        self.child.id()
    }

    async fn wait_ready(&mut self) -> Duration {
        let t0 = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                panic!("agent exited ({st}) before it was ready");
            }
            if http_status(self.port, "/readyz").await == Some(200) {
                return t0.elapsed();
            }
            assert!(t0.elapsed() < TIMEOUT, "agent not ready");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn stop(mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.child.try_wait().unwrap().is_none() {
            if Instant::now() > deadline {
                let _ = self.child.kill();
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for AgentProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn http_status(port: u16, path: &str) -> Option<u16> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .ok()?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await.ok()?;
    String::from_utf8_lossy(&buf)
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

fn status_kib(pid: u32, field: &str) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}

/// Median `VmRSS` in MiB over `samples` readings 250 ms apart.
async fn rss_mib(pid: u32, samples: usize) -> f64 {
    let mut v = Vec::new();
    for _ in 0..samples {
        v.push(status_kib(pid, "VmRSS:").expect("agent alive") as f64 / 1024.0);
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    median(&v)
}

/// A PodVolumeBackup as Velero's server writes it; `status` for finished ones.
fn pvb_json(
    name: &str,
    node: &str,
    pod: &str,
    pod_uid: &str,
    repo: &str,
    backup_uid: &str,
    status: Option<Value>,
) -> Value {
    let mut o = json!({
        "apiVersion": "velero.io/v1", "kind": "PodVolumeBackup",
        "metadata": {
            "name": name, "namespace": NS,
            "labels": {"velero.io/backup-name": BACKUP, "velero.io/backup-uid": backup_uid, "velero.io/pvc-uid": format!("pvc-{pod_uid}")},
            "ownerReferences": [{"apiVersion": "velero.io/v1", "kind": "Backup", "name": BACKUP, "uid": backup_uid, "controller": true}],
            "annotations": {"velero.io/pvc-name": format!("{pod}-data")},
        },
        "spec": {
            "node": node,
            "pod": {"kind": "Pod", "namespace": APP_NS, "name": pod, "uid": pod_uid},
            "volume": "data",
            "backupStorageLocation": "default",
            "repoIdentifier": repo,
            "uploaderType": "restic",
            "tags": {"backup": BACKUP, "backup-uid": backup_uid, "ns": APP_NS, "pod": pod, "pod-uid": pod_uid, "pvc-uid": format!("pvc-{pod_uid}"), "volume": "data"},
        },
    });
    if let Some(s) = status {
        o["status"] = s;
    }
    o
}

fn other_nodes_backup_name(i: usize) -> String {
    format!("{BACKUP}-{i:06}")
}

/// The `i`th finished PodVolumeBackup of another node, as Velero leaves them behind.
fn other_nodes_backup(i: usize, backup_uid: &str) -> Value {
    let uid = format!("00000000-0000-4000-8000-{i:012}");
    let status = json!({
        "phase": "Completed", "path": format!("/host_pods/{uid}/volumes/kubernetes.io~csi/pvc-{i}/mount"),
        "snapshotID": format!("{:08x}", i * 2_654_435_761usize % (1 << 32)),
        "startTimestamp": "2026-12-01T02:00:00Z", "completionTimestamp": "2026-12-01T02:03:10Z",
        "progress": {"totalBytes": 1_073_741_824i64, "bytesDone": 1_073_741_824i64},
        "message": "",
    });
    pvb_json(
        &other_nodes_backup_name(i),
        &format!("node-{}", i % 50),
        &format!("app-{i}"),
        &uid,
        "/repo",
        backup_uid,
        Some(status),
    )
}

/// Creates `obj` (in `ns`) as the admin, as is; returns it as stored.
async fn create(client: &Client, ns: Option<&str>, obj: Value) -> DynamicObject {
    let (group, version) = match obj["apiVersion"].as_str().unwrap().split_once('/') {
        Some((g, v)) => (g, v),
        None => ("", obj["apiVersion"].as_str().unwrap()),
    };
    let ar = ApiResource::from_gvk(&GroupVersionKind::gvk(
        group,
        version,
        obj["kind"].as_str().unwrap(),
    ));
    let api: Api<DynamicObject> = match ns {
        Some(ns) => Api::namespaced_with(client.clone(), ns, &ar),
        None => Api::all_with(client.clone(), &ar),
    };
    let obj: DynamicObject = serde_json::from_value(obj).unwrap();
    api.create(&PostParams::default(), &obj)
        .await
        .unwrap_or_else(|e| panic!("creating {}: {e}", obj.name_any()))
}

/// Stores the `i`th other-node PodVolumeBackup as its writers do: Velero's server creates it
/// without status (field manager `velero-server`), then Velero's node agent writes the status
/// (`node-agent-server`). Velero's CRD has no status subresource, so that is a main-resource
/// write, as Velero's node agent makes it. A refused or failed request is retried.
async fn seed_other_nodes_backup(api: &Api<DynamicObject>, i: usize, backup_uid: &str) {
    let with_status = other_nodes_backup(i, backup_uid);
    let mut created = with_status.clone();
    created.as_object_mut().unwrap().remove("status");
    let created: DynamicObject = serde_json::from_value(created).unwrap();
    let name = other_nodes_backup_name(i);
    let as_velero = PostParams {
        field_manager: Some("velero-server".into()),
        ..Default::default()
    };
    let as_node_agent = PatchParams {
        field_manager: Some("node-agent-server".into()),
        ..Default::default()
    };
    let status = Patch::Merge(json!({"status": with_status["status"]}));
    for attempt in 1.. {
        match api.create(&as_velero, &created).await {
            Ok(_) => break,
            Err(kube::Error::Api(s)) if s.code == 409 => break,
            Err(e) if attempt < 10 => {
                eprintln!("creating {name}: {e}; again");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("creating {name}: {e}"),
        }
    }
    for attempt in 1.. {
        match api.patch(&name, &as_node_agent, &status).await {
            Ok(_) => break,
            Err(e) if attempt < 10 => {
                eprintln!("writing {name}'s status: {e}; again");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("writing {name}'s status: {e}"),
        }
    }
}

/// Resident set of a process in MiB (0 when it is gone).
fn rss_now_mib(pid: u32) -> f64 {
    status_kib(pid, "VmRSS:").unwrap_or(0) as f64 / 1024.0
}

async fn run_async(o: &Options<'_>) -> String {
    AGENT.set(o.agent.to_path_buf()).ok();
    let data = o.work.join("data");
    let per_backup: u64 = if o.quick { 96 << 20 } else { 256 << 20 };
    if !data.join("big-0.bin").exists() {
        gen_large(&data, 1, per_backup, 77);
    }
    // 8 MiB/s as in case 4a: a 256 MiB backup runs ~30 s.
    let mut bed = Bed::new(&o.work.join("bed"), o, 8192).await;

    // --- 5: idle, then 10,000 objects of other nodes arriving by watch.
    let concurrency = o.running.to_string();
    let mut agent = bed.start_agent(&[&format!("--concurrency={concurrency}")]);
    agent.wait_ready().await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let idle = rss_mib(agent.pid(), 8).await;
    eprintln!("agent idle: {idle:.1} MiB");

    // Stored through the API while the agent watches (two requests each, SEED_CONCURRENCY at
    // once): outside what is measured, but its time says how fast this server takes them.
    let t = Instant::now();
    let seed_api: Api<DynamicObject> =
        Api::namespaced_with(bed.client.clone(), NS, &pvb_resource());
    futures::stream::iter(0..o.objects)
        .map(|i| seed_other_nodes_backup(&seed_api, i, &bed.backup_uid))
        .buffer_unordered(SEED_CONCURRENCY)
        .collect::<()>()
        .await;
    let seeding = t.elapsed();
    eprintln!("{} objects stored in {seeding:?}", o.objects);
    // The size of one as the API server serves it (compact JSON, managedFields included).
    let sample = seed_api.get(&other_nodes_backup_name(0)).await.unwrap();
    let object_bytes = serde_json::to_string(&sample).unwrap().len();
    let managers: Vec<String> = sample
        .managed_fields()
        .iter()
        .map(|m| {
            format!(
                "{} ({})",
                m.manager.as_deref().unwrap_or("?"),
                m.operation.as_deref().unwrap_or("?")
            )
        })
        .collect();
    let t_stored = Instant::now();
    // Watch events arrive in order: once a PVB created after them is handled, the agent has seen
    // (and cached) every one of them.
    let empty_repo = bed.dir.join("repo-marker");
    let marker_pod = bed.pod_with(None).await;
    bed.create_pvb("marker", &marker_pod, &empty_repo).await;
    bed.wait_phase("marker", |p| phase_of(p).is_terminal())
        .await;
    let seen_after = t_stored.elapsed();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let with_objects = rss_mib(agent.pid(), 8).await;
    let hwm_watch = status_kib(agent.pid(), "VmHWM:").unwrap() as f64 / 1024.0;
    eprintln!("with {} objects by watch: {with_objects:.1} MiB", o.objects);
    agent.stop();

    // --- 5: a bare paged list of the same objects from the same server (pages of 500, as the
    // agent's watcher lists), decoded into the same type, the reference for *ready after*.
    let t = Instant::now();
    let mut listed = 0usize;
    let mut lp = ListParams::default().limit(500);
    loop {
        let page = bed.pvbs().list(&lp).await.unwrap();
        listed += page.items.len();
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(c) => lp = lp.continue_token(&c),
            None => break,
        }
    }
    let bare_list = t.elapsed();
    eprintln!("bare paged list of {listed} objects: {bare_list:?}");

    // --- 5: restart with all of them in the first list.
    let mut agent = bed.start_agent(&[&format!("--concurrency={concurrency}")]);
    let ready_after = agent.wait_ready().await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let restarted = rss_mib(agent.pid(), 8).await;
    let hwm_restart = status_kib(agent.pid(), "VmHWM:").unwrap() as f64 / 1024.0;
    eprintln!(
        "restarted with {} objects: {restarted:.1} MiB (ready after {ready_after:?})",
        o.objects
    );

    // --- 5: running backups (the agent alone; restic's memory is its own process).
    let parent_lookups = |bed: &Bed| {
        bed.server
            .audited()
            .into_iter()
            .filter(|e| {
                e["verb"] == "list"
                    && e["objectRef"]["resource"] == "podvolumebackups"
                    && e["requestURI"]
                        .as_str()
                        .is_some_and(|u| u.contains("labelSelector"))
            })
            .count()
    };
    let lookups_before = parent_lookups(&bed);
    let mut restic_rss = Vec::new();
    let mut names = Vec::new();
    for k in 0..o.running {
        let pod = bed.pod_with(Some(&data)).await;
        let name = format!("run-{k}");
        bed.create_pvb(&name, &pod, &bed.dir.join(format!("repo-run-{k}")))
            .await;
        names.push(name);
    }
    for n in &names {
        bed.wait_running(n).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rss_running = rss_mib(agent.pid(), 8).await;
    let uploaders: Vec<u32> = processes()
        .into_iter()
        .filter(|p| p.1 == agent.pid() && p.4 == "restic")
        .map(|p| p.0)
        .collect();
    for p in &uploaders {
        if let Some(k) = status_kib(*p, "VmRSS:") {
            restic_rss.push(k as f64 / 1024.0);
        }
    }
    eprintln!(
        "{} running: agent {rss_running:.1} MiB, restic {:?}",
        o.running, restic_rss
    );
    for n in &names {
        cancel(&bed, n).await;
    }
    for n in &names {
        bed.wait_phase(n, |p| phase_of(p).is_terminal()).await;
    }
    let per_op = (rss_running - restarted) / o.running as f64;
    let lookups = parent_lookups(&bed) - lookups_before;
    // The control plane beside the agent on the same cores, with every object stored.
    let (apiserver_rss, etcd_rss) = (
        rss_now_mib(bed.server.apiserver_pid),
        rss_now_mib(bed.server.etcd_pid),
    );

    // --- 4b: cancel latency through the API.
    let mut to_canceled = Vec::new();
    let mut to_gone = Vec::new();
    let mut anomalies = Vec::new();
    let pod = bed.pod_with(Some(&data)).await;
    for i in 0..o.cancel_runs {
        let name = format!("cancel-{i}");
        let repo = bed.dir.join(format!("repo-cancel-{i}"));
        bed.create_pvb(&name, &pod, &repo).await;
        bed.wait_running(&name).await;
        // Half a second into the upload, as a cancel would arrive at any time.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let group = processes()
            .into_iter()
            .find(|p| p.1 == agent.pid() && p.4 == "restic" && p.0 == p.2)
            .map(|p| p.0)
            .expect("restic running in its own process group");
        let t0 = Instant::now();
        let gone = std::thread::spawn(move || {
            while crate::util::group_alive(group) {
                std::thread::sleep(Duration::from_micros(500));
                if t0.elapsed() > TIMEOUT {
                    break;
                }
            }
            t0.elapsed()
        });
        cancel(&bed, &name).await;
        let done = bed.wait_phase(&name, |p| phase_of(p).is_terminal()).await;
        let took = t0.elapsed();
        let gone = gone.join().unwrap();
        if phase_of(&done) != Phase::Canceled {
            anomalies.push(format!("{name} ended {:?}", phase_of(&done)));
        }
        let locks = std::fs::read_dir(repo.join("locks"))
            .map(|d| d.count())
            .unwrap_or(0);
        if locks > 0 {
            anomalies.push(format!("{name}: {locks} lock(s) left"));
        }
        eprintln!(
            "cancel run {}: group gone {gone:?}, Canceled {took:?}",
            i + 1
        );
        to_canceled.push(took.as_secs_f64() * 1000.0);
        to_gone.push(gone.as_secs_f64() * 1000.0);
        let _ = std::fs::remove_dir_all(&repo);
    }
    let left: Vec<_> = processes()
        .into_iter()
        .filter(|p| p.1 == agent.pid() && p.3 != 'Z')
        .collect();
    if !left.is_empty() {
        anomalies.push(format!("children left: {left:?}"));
    }
    agent.stop();
    // Every write the agent made (both runs of it) to the other nodes' objects.
    let writes_to_others = bed
        .server
        .audited()
        .into_iter()
        .filter(|e| {
            matches!(
                e["verb"].as_str(),
                Some("create" | "update" | "patch" | "delete")
            ) && e["objectRef"]["name"]
                .as_str()
                .is_some_and(|n| n.starts_with(&format!("{BACKUP}-")))
        })
        .count();

    let versions = &bed.server.versions;
    let objects = o.objects;
    let mut md = String::from("## 4b. Cancel latency through the agent\n\n");
    md.push_str(&format!(
        "The agent binary (`--update-interval=1s --cancel-grace=10s`, the default) against a real \
         kube-apiserver ({versions}, with kube-controller-manager; TLS, RBAC), running as \
         `daemonset/`'s ServiceAccount with its RBAC (a TokenRequest token), real restic \
         mid-backup ({} MiB source, upload limited to 8 MiB/s as in 4a, fresh \
         repository each run, canceled 0.5 s after the first published progress), {} runs, with \
         the {objects} other-node objects of case 5 stored. etcd and kube-apiserver run on the \
         same 2 cores as the agent and restic, and the machine is shared with other work: the \
         times are noisy. The \
         cancel is a merge patch `spec.cancel: true`; *Canceled*: until a GET (every 10 ms) \
         returns phase Canceled, the result written (this includes `restic unlock`); *group \
         gone*: until no live process of restic's process group is left (`/proc`, every \
         0.5 ms). Anomalies (other phase, lock left, child left): {}.\n\n",
        per_backup >> 20,
        o.cancel_runs,
        if anomalies.is_empty() {
            "none".to_string()
        } else {
            anomalies.join("; ")
        }
    ));
    md.push_str("| measure | p50 ms | max ms |\n|---|---:|---:|\n");
    md.push_str(&format!(
        "| `spec.cancel: true` -> restic's process group gone | {} | {} |\n",
        fmt(median(&to_gone)),
        fmt(max(&to_gone))
    ));
    md.push_str(&format!(
        "| `spec.cancel: true` -> phase Canceled served by the API server | {} | {} |\n\n",
        fmt(median(&to_canceled)),
        fmt(max(&to_canceled))
    ));

    md.push_str(&format!(
        "## 5. Memory at scale ({} other-node objects)\n\n",
        o.objects
    ));
    md.push_str(&format!(
        "The agent process's resident set (`VmRSS`, median of 8 readings over 2 s; restic is a \
         separate process, its own figure given apart), release build, real kube-apiserver \
         ({versions}; the agent as `daemonset/`'s ServiceAccount). The \
         {n} other-node objects are finished PodVolumeBackups of a Backup that exists, stored \
         through the API as Velero writes them: created by Velero's server, then their status \
         written by its node agent, so the server's `managedFields` has {managers} (labels, owner \
         reference, tags, status; about {size} bytes of JSON each as the server returns it), \
         spread over 50 nodes. Storing them ({reqs} requests, {SEED_CONCURRENCY} at a time, while \
         the agent watches) took {seeding} s; *all seen*: from the last stored until the agent \
         had handled a PodVolumeBackup created after them. etcd and kube-apiserver share the \
         machine's 2 cores with the agent (with the objects stored: kube-apiserver {apiserver_rss} \
         MiB, etcd {etcd_rss} MiB resident), and the machine runs other work too: times are noisy. \
         *bare paged list*: the same objects listed in pages of 500 (the agent's page size) and \
         decoded by a plain client from the same server, just before the restart. *per object*: \
         (restarted - idle) / objects. Writes the agent made to those objects (both of its runs, \
         from the API server's audit log): {writes_to_others}. Parent lookups (label-selected \
         lists, audit log) while {running} backups of labelled claims started: {lookups}.\n\n",
        n = o.objects,
        size = object_bytes,
        running = o.running,
        managers = managers.join(" and "),
        reqs = 2 * o.objects,
        seeding = fmt(seeding.as_secs_f64()),
        apiserver_rss = fmt(apiserver_rss),
        etcd_rss = fmt(etcd_rss),
    ));
    md.push_str("| state | agent RSS MiB | note |\n|---|---:|---|\n");
    md.push_str(&format!(
        "| idle, ready, empty namespace | {} | |\n",
        fmt(idle)
    ));
    md.push_str(&format!(
        "| {} other-node objects arrived by watch | {} | peak (VmHWM) {} MiB; all seen {} s after the last was stored |\n",
        o.objects,
        fmt(with_objects),
        fmt(hwm_watch),
        fmt(seen_after.as_secs_f64())
    ));
    md.push_str(&format!(
        "| restarted with {} objects in the first list | {} | peak (VmHWM) {} MiB; ready after {} s; bare paged list {} s (ratio {}); per object {} bytes |\n",
        o.objects,
        fmt(restarted),
        fmt(hwm_restart),
        fmt(ready_after.as_secs_f64()),
        fmt(bare_list.as_secs_f64()),
        fmt(ready_after.as_secs_f64() / bare_list.as_secs_f64()),
        fmt((restarted - idle) * 1048576.0 / o.objects as f64),
    ));
    md.push_str(&format!(
        "| the same with {} backups running | {} | restic, each: {} MiB |\n\n",
        o.running,
        fmt(rss_running),
        restic_rss
            .iter()
            .map(|r| fmt(*r))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    md.push_str(&format!(
        "Per running operation (agent only): ({} - {}) / {} = **{} MiB**.\n\n",
        fmt(rss_running),
        fmt(restarted),
        o.running,
        fmt(per_op)
    ));
    md
}

async fn cancel(bed: &Bed, name: &str) {
    bed.pvbs()
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"cancel": true}})),
        )
        .await
        .unwrap();
}
