//! Cases 4b and 5: the agent binary (release build) against the API server stand-in with the
//! real restic, as in the e2e tests.
//!
//! 4b. From `spec.cancel: true` (a merge patch, as `kubectl patch` or Velero sends it) to phase
//!     Canceled as the API server serves it, and to restic's process group gone.
//! 5.  The agent process's resident memory (`VmRSS`, the agent alone: restic is a separate
//!     process) idle, with 10,000 PodVolumeBackups of other nodes in its namespace (arrived by
//!     watch, and in the first list after a restart), and with running backups.
//!
//! The other nodes' objects carry the `managedFields` the stand-in records as a real API server
//! does (one entry per manager that wrote). Its `fieldsV1` treats lists as atomic, where a real
//! server lists the owner reference's fields under a `k:{"uid":...}` key: 141 bytes more per
//! object there, so the figures with 10,000 objects are still slightly low for a real cluster.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use podvolume_agent::crd::{Phase, PodVolumeBackup};
use podvolume_testbed::TestApiServer;
use serde_json::{Value, json};

use crate::util::{fmt, gen_large, max, median, processes};

const NS: &str = "velero";
const APP_NS: &str = "apps";
const NODE: &str = "bench-node";
const TIMEOUT: Duration = Duration::from_secs(300);

pub struct Options<'a> {
    pub restic: &'a Path,
    pub agent: &'a Path,
    pub work: &'a Path,
    pub cancel_runs: usize,
    pub objects: usize,
    pub running: usize,
    pub quick: bool,
}

pub fn run(o: &Options) -> String {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(run_async(o))
}

/// The stand-in, the kubelet-like pod directories and the agent's flags.
struct Bed {
    server: TestApiServer,
    client: Client,
    dir: PathBuf,
    pods_dir: PathBuf,
    password_file: PathBuf,
    slow_restic: PathBuf,
    pods: u32,
}

impl Bed {
    async fn new(work: &Path, restic: &Path, upload_kib: u32) -> Bed {
        let _ = std::fs::remove_dir_all(work);
        std::fs::create_dir_all(work).unwrap();
        let server = TestApiServer::start().await.unwrap();
        server.install_velero_crds().unwrap();
        server.install_storage_location_crd().unwrap();
        let client = server.client().await;
        for n in [NS, APP_NS] {
            server
                .put_json(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": n}}))
                .unwrap();
        }
        // The location every PVB names: a local repository, so a plugin's provider.
        server
            .put_json(json!({"apiVersion": "velero.io/v1", "kind": "BackupStorageLocation",
                "metadata": {"name": "default", "namespace": NS},
                "spec": {"provider": "podvolume-agent.io/filesystem", "objectStorage": {"bucket": "local"}}}))
            .unwrap();
        let password_file = work.join("password");
        std::fs::write(&password_file, "benchmark password\n").unwrap();
        // restic 0.14 reads at full speed and spends the run uploading: a limit keeps each
        // backup running long enough to measure it and cancel it mid-way.
        let slow_restic = work.join("restic-slow");
        std::fs::write(
            &slow_restic,
            format!(
                "#!/bin/sh\ncase \" $* \" in *\" backup \"*) exec {r} \"$@\" --limit-upload={upload_kib};; esac\nexec {r} \"$@\"\n",
                r = restic.display()
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
            .arg(format!(
                "--kubeconfig={}",
                self.server.kubeconfig_path().display()
            ))
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
    status: Option<Value>,
) -> Value {
    let mut o = json!({
        "apiVersion": "velero.io/v1", "kind": "PodVolumeBackup",
        "metadata": {
            "name": name, "namespace": NS,
            "labels": {"velero.io/backup-name": "nightly-20261201", "velero.io/backup-uid": "6c3e2f0a-9d1b-4c1e-9a57-2b0d6f3e8a11", "velero.io/pvc-uid": format!("pvc-{pod_uid}")},
            "ownerReferences": [{"apiVersion": "velero.io/v1", "kind": "Backup", "name": "nightly-20261201", "uid": "6c3e2f0a-9d1b-4c1e-9a57-2b0d6f3e8a11", "controller": true}],
            "annotations": {"velero.io/pvc-name": format!("{pod}-data")},
        },
        "spec": {
            "node": node,
            "pod": {"kind": "Pod", "namespace": APP_NS, "name": pod, "uid": pod_uid},
            "volume": "data",
            "backupStorageLocation": "default",
            "repoIdentifier": repo,
            "uploaderType": "restic",
            "tags": {"backup": "nightly-20261201", "backup-uid": "6c3e2f0a-9d1b-4c1e-9a57-2b0d6f3e8a11", "ns": APP_NS, "pod": pod, "pod-uid": pod_uid, "pvc-uid": format!("pvc-{pod_uid}"), "volume": "data"},
        },
    });
    if let Some(s) = status {
        o["status"] = s;
    }
    o
}

fn other_nodes_backup_name(i: usize) -> String {
    format!("nightly-20261201-{i:06}")
}

/// The `i`th finished PodVolumeBackup of another node, as Velero leaves them behind.
fn other_nodes_backup(i: usize) -> Value {
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
        Some(status),
    )
}

/// Store the `i`th other-node PodVolumeBackup as its writers would have (in-process, no HTTP),
/// the stand-in recording each in `managedFields`: Velero's server creates it without status,
/// then Velero's node agent writes the status. Velero's CRD has no status subresource, so that
/// is a main-resource write (no `subresource: status` in its entry, as on a real server).
fn seed_other_nodes_backup(server: &TestApiServer, i: usize) {
    let with_status = other_nodes_backup(i);
    let mut created = with_status.clone();
    created.as_object_mut().unwrap().remove("status");
    server.put_json_as("velero-server", None, created).unwrap();
    server
        .put_json_as("node-agent-server", None, with_status)
        .unwrap();
}

async fn run_async(o: &Options<'_>) -> String {
    AGENT.set(o.agent.to_path_buf()).ok();
    let data = o.work.join("data");
    let per_backup: u64 = if o.quick { 96 << 20 } else { 256 << 20 };
    if !data.join("big-0.bin").exists() {
        gen_large(&data, 1, per_backup, 77);
    }
    // 8 MiB/s as in case 4a: a 256 MiB backup runs ~30 s.
    let mut bed = Bed::new(&o.work.join("bed"), o.restic, 8192).await;

    // --- 5: idle, then 10,000 objects of other nodes arriving by watch.
    let concurrency = o.running.to_string();
    let mut agent = bed.start_agent(&[&format!("--concurrency={concurrency}")]);
    agent.wait_ready().await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let idle = rss_mib(agent.pid(), 8).await;
    eprintln!("agent idle: {idle:.1} MiB");

    let t = Instant::now();
    for i in 0..o.objects {
        seed_other_nodes_backup(&bed.server, i);
    }
    eprintln!("{} objects stored in {:?}", o.objects, t.elapsed());
    // The size of one as the stand-in stores (and serves) it, managedFields included.
    let object_bytes = bed
        .server
        .get_json(
            "velero.io/v1",
            "podvolumebackups",
            Some(NS),
            &other_nodes_backup_name(0),
        )
        .map_or(0, |v| v.to_string().len());
    // Watch events arrive in order: once a PVB created after them is handled, the agent has seen
    // (and cached) every one of them.
    let empty_repo = bed.dir.join("repo-marker");
    let marker_pod = bed.pod_with(None).await;
    bed.create_pvb("marker", &marker_pod, &empty_repo).await;
    bed.wait_phase("marker", |p| phase_of(p).is_terminal())
        .await;
    let seen_after = t.elapsed();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let with_objects = rss_mib(agent.pid(), 8).await;
    let hwm_watch = status_kib(agent.pid(), "VmHWM:").unwrap() as f64 / 1024.0;
    eprintln!("with {} objects by watch: {with_objects:.1} MiB", o.objects);
    let writes_to_others = bed
        .server
        .write_log()
        .into_iter()
        .filter(|w| {
            w.info
                .name
                .as_deref()
                .is_some_and(|n| n.starts_with("nightly-"))
        })
        .count();
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
            .request_log()
            .into_iter()
            .filter(|r| r.info.verb == "list" && r.query.contains("labelSelector"))
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

    let mut md = String::from("## 4b. Cancel latency through the agent\n\n");
    md.push_str(&format!(
        "The agent binary (`--update-interval=1s --cancel-grace=10s`, the default) against the API \
         server stand-in, real restic mid-backup ({} MiB source, upload limited to 8 MiB/s as in 4a, fresh \
         repository each run, canceled 0.5 s after the first published progress), {} runs. The \
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
         separate process, its own figure given apart), release build, API server stand-in. The \
         {n} other-node objects are finished PodVolumeBackups as Velero writes them (labels, owner \
         reference, tags, status, and the `managedFields` the stand-in records as a real API \
         server does: one entry per manager that wrote, Velero's server and its node agent; about \
         {size} bytes of JSON each as stored), spread over 50 nodes. The stand-in \
         serves the list in pages of 500 (the agent's page size), each in time proportional to the \
         page. *bare paged list*: the same objects listed in pages of 500 and decoded by a plain \
         client from the same server, just before the restart. *per object*: (restarted - idle) / \
         objects. Status writes the agent made to those objects: {writes_to_others}. Parent lookups \
         (label-selected lists) while {running} backups of labelled claims started: {lookups}.\n\n",
        n = o.objects,
        size = object_bytes,
        running = o.running,
    ));
    md.push_str("| state | agent RSS MiB | note |\n|---|---:|---|\n");
    md.push_str(&format!(
        "| idle, ready, empty namespace | {} | |\n",
        fmt(idle)
    ));
    md.push_str(&format!(
        "| {} other-node objects arrived by watch | {} | peak (VmHWM) {} MiB; all seen {} s after the first was stored |\n",
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
