//! `kubectl podvolume` (the `kubectl-podvolume` binary) against a real kube-apiserver
//! (`PODVOLUME_E2E_KUBECONFIG`; `scripts/test-real-cluster.sh` runs the `_our_crds` tests while
//! `daemonset/crds.yaml` is installed, the others with Velero's CRDs). The plugin runs as a
//! ServiceAccount of the test with a namespaced Role (PodVolumeBackups/Restores: get, list, watch,
//! patch) and reaches the server through the fault-injecting proxy, whose request log shows what
//! it sent. Objects are written by the test (a backup progressing over time on several nodes, in
//! both CRD flavours), or by the real agent with real restic. The live view runs in a real
//! terminal (tmux). Figures that depend on the clock are checked for consistency (rate > 0, ETA =
//! remaining / rate, rate within what the test's own clock allows), never against wall-clock
//! durations.

// The harness is shared with tests/e2e (owned there); its lints are not this file's.
#[allow(clippy::collapsible_if)]
#[path = "e2e/harness.rs"]
mod harness;
#[path = "common/real_api_server.rs"]
mod real_api_server;

use std::ops::Deref;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant, SystemTime};

use harness::*;
use kube::ResourceExt;
use kube::api::{Patch, PatchParams, PostParams};
use nix::sys::signal::Signal;
use podvolume_agent::crd::{Phase, PodVolumeBackup};
use podvolume_agent::text::format_bytes;
use real_api_server::{BoundAs, caller, real_env};
use serde_json::{Value, json};
use tokio::io::AsyncBufReadExt;

const LONG: Duration = Duration::from_secs(120);
const MB: u64 = 1_000_000;

/// The test's environment on the real API server, with the proxy the plugin's user goes
/// through.
struct PluginEnv {
    env: Env,
    proxy: FaultProxy,
}

impl Deref for PluginEnv {
    type Target = Env;
    fn deref(&self) -> &Env {
        &self.env
    }
}

impl PluginEnv {
    /// What the API server must serve: `flavour`'s CRDs.
    async fn new(flavour: Flavour) -> PluginEnv {
        let env = real_env(flavour).await;
        // What a person watching Velero's namespace needs, and no more: the plugin reads and
        // cancels (patches spec.cancel) PodVolumeBackups and PodVolumeRestores there.
        let rules = json!([{"apiGroups": ["velero.io"],
            "resources": ["podvolumebackups", "podvolumerestores"],
            "verbs": ["get", "list", "watch", "patch"]}]);
        let user = caller(&env, &env.ns, "plugin-user", rules, BoundAs::User).await;
        let dir = env.tmp.path().join("plugin");
        std::fs::create_dir_all(&dir).unwrap();
        let proxy = FaultProxy::start(&user.kubeconfig, &dir)
            .await
            .unwrap_or_else(|e| panic!("starting the fault proxy: {e}"));
        PluginEnv { env, proxy }
    }

    /// The plugin's kubeconfig: its user, through the proxy.
    fn kubeconfig(&self) -> &Path {
        self.proxy.kubeconfig()
    }
}

fn plugin(env: &PluginEnv) -> tokio::process::Command {
    let mut c = tokio::process::Command::new(env!("CARGO_BIN_EXE_kubectl-podvolume"));
    c.arg(format!("--kubeconfig={}", env.kubeconfig().display()))
        .args(["-n", &env.ns])
        .stdin(Stdio::null())
        .kill_on_drop(true);
    c
}

/// Runs the plugin to its end; (exit code, stdout, stderr).
async fn run(env: &PluginEnv, args: &[&str]) -> (i32, String, String) {
    let out = plugin(env).args(args).output().await.unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `backup NAME -o json`, with the test's clock read before and after.
async fn json_of(env: &PluginEnv, backup: &str) -> (Value, SystemTime, SystemTime) {
    let before = SystemTime::now();
    let (code, out, err) = run(env, &["backup", backup, "-o", "json"]).await;
    let after = SystemTime::now();
    assert_eq!(code, 0, "{out}\n{err}");
    let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("not JSON ({e}): {out}"));
    (v, before, after)
}

fn rfc3339(t: SystemTime) -> String {
    humantime::format_rfc3339_seconds(t).to_string()
}

fn parse_time(s: &str) -> SystemTime {
    humantime::parse_rfc3339(s).unwrap()
}

/// A PodVolumeBackup of Velero backup `backup` as Velero's server creates it.
async fn create(env: &Env, name: &str, backup: &str, node: &str, pod: &str) {
    let obj: PodVolumeBackup = serde_json::from_value(json!({
        "apiVersion": "velero.io/v1", "kind": "PodVolumeBackup",
        "metadata": {"name": name, "namespace": env.ns, "labels": {"velero.io/backup-name": backup}},
        "spec": {
            "node": node, "volume": "data", "backupStorageLocation": "default",
            "repoIdentifier": "/unused", "uploaderType": "restic",
            "pod": {"kind": "Pod", "namespace": env.app_ns, "name": pod},
        },
    }))
    .unwrap();
    env.pvbs()
        .create(&PostParams::default(), &obj)
        .await
        .unwrap();
}

/// Writes a status as a node agent would: to `/status` with our CRDs, to the object with
/// Velero's (which have no status subresource).
async fn write_status(env: &Env, flavour: Flavour, name: &str, status: Value) {
    let patch = Patch::Merge(json!({"status": status}));
    let pp = PatchParams::default();
    match flavour {
        Flavour::Ours => env.pvbs().patch_status(name, &pp, &patch).await.unwrap(),
        Flavour::Velero | Flavour::Velero116 => env.pvbs().patch(name, &pp, &patch).await.unwrap(),
    };
}

fn running(done: u64, total: u64, started: &str) -> Value {
    json!({"phase": "InProgress", "startTimestamp": started,
           "progress": {"bytesDone": done, "totalBytes": total},
           "message": format!("uploading: {} of {}", format_bytes(done), format_bytes(total))})
}

/// The summary's rate and ETA agree with each other and with the remaining bytes.
fn assert_eta_consistent(s: &Value) {
    let rate = s["rateBytesPerSecond"].as_f64().expect("a rate");
    assert!(rate > 0.0, "{s}");
    let remaining = s["remainingBytes"].as_u64().unwrap();
    if remaining == 0 {
        // restic may have sent its last bytes before it was paused (it is still finalizing):
        // nothing left to estimate.
        assert!(s["eta"].is_null(), "an ETA with nothing remaining: {s}");
        return;
    }
    let eta = s["eta"]["seconds"]
        .as_u64()
        .unwrap_or_else(|| panic!("no ETA: {s}"));
    assert_eq!(eta, (remaining as f64 / rate).ceil() as u64, "{s}");
}

fn counts(s: &Value) -> [u64; 7] {
    let c = &s["volumes"];
    [
        "total",
        "done",
        "queued",
        "running",
        "completed",
        "failed",
        "canceled",
    ]
    .map(|k| c[k].as_u64().unwrap())
}

/// Four volumes on three nodes (and another backup's, never counted), moved step by step:
/// counts, bytes, "at least", rate and ETA at each step; a failed and a canceled volume counted
/// as such; the `--watch -o json` stream measures a rate from the changes it saw.
async fn backup_progressing_over_time(flavour: Flavour) {
    let env = PluginEnv::new(flavour).await;
    for (name, node) in [
        ("b1-p1", "node-1"),
        ("b1-p2", "node-2"),
        ("b1-p3", "node-3"),
        ("b1-p4", "node-1"),
    ] {
        create(&env, name, "b1", node, &format!("pod-{name}")).await;
    }
    create(&env, "b2-p1", "b2", "node-1", "other").await;
    write_status(
        &env,
        flavour,
        "b2-p1",
        running(7 * MB, 70 * MB, &rfc3339(SystemTime::now())),
    )
    .await;

    // Step 0: nothing started.
    let (v, _, _) = json_of(&env, "b1").await;
    let s = &v["summary"];
    assert_eq!(counts(s), [4, 0, 4, 0, 0, 0, 0], "{s}");
    assert_eq!(
        (s["bytesDone"].as_u64(), s["totalBytes"].as_u64()),
        (Some(0), Some(0))
    );
    assert_eq!(s["totalAtLeast"], true);
    assert!(
        s["rateBytesPerSecond"].is_null() && s["eta"].is_null(),
        "{s}"
    );
    assert_eq!(v["items"].as_array().unwrap().len(), 4);

    let mut watch = plugin(&env)
        .args([
            "backup",
            "b1",
            "--watch",
            "-o",
            "json",
            "--refresh=100ms",
            "--window=5s",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(watch.stdout.take().unwrap()).lines();
    let first = lines.next_line().await.unwrap().expect("a first line");
    let first: Value = serde_json::from_str(&first).unwrap();
    assert_eq!(counts(&first["summary"]), [4, 0, 4, 0, 0, 0, 0]);

    // Step 1: p1 and p2 running (p2 still scanning: no total), p3 taken, p4 new.
    let start1 = rfc3339(SystemTime::now() - Duration::from_secs(100));
    let start2 = rfc3339(SystemTime::now() - Duration::from_secs(50));
    write_status(&env, flavour, "b1-p1", running(100 * MB, 400 * MB, &start1)).await;
    write_status(
        &env,
        flavour,
        "b1-p2",
        json!({"phase": "InProgress", "startTimestamp": start2,
        "progress": {"bytesDone": 50 * MB}}),
    )
    .await;
    write_status(&env, flavour, "b1-p3", json!({"phase": "Accepted"})).await;
    let (v, before, after) = json_of(&env, "b1").await;
    let s = &v["summary"];
    assert_eq!(counts(s), [4, 0, 2, 2, 0, 0, 0], "{s}");
    assert_eq!(s["bytesDone"].as_u64(), Some(150 * MB));
    assert_eq!(s["totalBytes"].as_u64(), Some(400 * MB));
    assert_eq!(s["totalAtLeast"], true, "p2 has no total yet");
    assert_eq!(s["remainingBytes"].as_u64(), Some(300 * MB));
    // One reading: 150 MB over the time since the first start, as the plugin's clock saw it,
    // which lies between the test's clock before and after the run.
    assert_eq!(s["rateBasis"], "sinceStart");
    assert_eq!(s["started"].as_str(), Some(start1.as_str()));
    let t0 = parse_time(&start1);
    let rate = s["rateBytesPerSecond"].as_f64().unwrap();
    let lo = 150e6 / after.duration_since(t0).unwrap().as_secs_f64();
    let hi = 150e6 / before.duration_since(t0).unwrap().as_secs_f64();
    assert!(lo <= rate && rate <= hi, "{lo} <= {rate} <= {hi}");
    assert_eta_consistent(s);
    assert_eq!(s["eta"]["atLeast"], true);
    let items = v["items"].as_array().unwrap();
    let p2 = items.iter().find(|i| i["name"] == "b1-p2").unwrap();
    assert_eq!(
        (p2["node"].as_str(), p2["totalBytes"].is_null()),
        (Some("node-2"), true)
    );
    assert_eq!(
        p2["pod"].as_str().unwrap(),
        format!("{}/pod-b1-p2", env.app_ns)
    );

    // The watch has seen step 1; step 2 comes later than a tenth of its window, so the two
    // make a measurement (a wait to make time pass, not a timing assertion).
    let deadline = Instant::now() + LONG;
    loop {
        let line = tokio::time::timeout_at(deadline.into(), lines.next_line())
            .await
            .expect("a watch line in time")
            .unwrap()
            .expect("the watch goes on");
        let v: Value = serde_json::from_str(&line).unwrap();
        if v["summary"]["bytesDone"].as_u64() == Some(150 * MB) {
            break;
        }
    }
    tokio::time::sleep(Duration::from_millis(600)).await;

    // Step 2: more bytes, p2's total known, p3 failed, p4 canceled.
    write_status(&env, flavour, "b1-p1", running(300 * MB, 400 * MB, &start1)).await;
    write_status(&env, flavour, "b1-p2", running(150 * MB, 200 * MB, &start2)).await;
    write_status(
        &env,
        flavour,
        "b1-p3",
        json!({"phase": "Failed", "message": "restic: repository is locked"}),
    )
    .await;
    write_status(&env, flavour, "b1-p4", json!({"phase": "Canceled"})).await;
    let (v, _, _) = json_of(&env, "b1").await;
    let s = &v["summary"];
    assert_eq!(counts(s), [4, 2, 0, 2, 0, 1, 1], "{s}");
    assert_eq!(
        (s["bytesDone"].as_u64(), s["totalBytes"].as_u64()),
        (Some(450 * MB), Some(600 * MB))
    );
    assert_eq!(s["totalAtLeast"], false);
    assert_eq!(s["remainingBytes"].as_u64(), Some(150 * MB));
    assert_eta_consistent(s);
    assert_eq!(s["eta"]["atLeast"], false);
    let p3 = v["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["name"] == "b1-p3")
        .unwrap();
    assert_eq!(
        (p3["state"].as_str(), p3["message"].as_str()),
        (Some("failed"), Some("restic: repository is locked"))
    );

    // The same moment as a table: the volume count, x of y bytes, a rate and an ETA.
    let (code, text, err) = run(&env, &["backup", "b1", "--once"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(
        text.contains(
            "Volumes:  2 of 4 done (0 queued, 2 running, 0 completed, 1 failed, 1 canceled)"
        ),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "Bytes:    {} of {}",
            format_bytes(450 * MB),
            format_bytes(600 * MB)
        )),
        "{text}"
    );
    assert!(
        text.lines()
            .any(|l| l.starts_with("Rate:") && l.contains("/s (average since start)")),
        "{text}"
    );
    assert!(
        text.lines()
            .any(|l| l.starts_with("ETA:") && l.trim_end().ends_with('s')),
        "{text}"
    );
    assert!(text.contains("restic: repository is locked"), "{text}");

    // The watch saw step 1 and step 2 as changes: its rate is measured between them.
    let deadline = Instant::now() + LONG;
    let measured = loop {
        let line = tokio::time::timeout_at(deadline.into(), lines.next_line())
            .await
            .expect("a watch line in time")
            .unwrap()
            .expect("the watch goes on");
        let v: Value = serde_json::from_str(&line).unwrap();
        if v["summary"]["rateBasis"] == "window" && counts(&v["summary"])[1] == 2 {
            break v;
        }
    };
    let s = &measured["summary"];
    assert_eq!(s["bytesDone"].as_u64(), Some(450 * MB));
    assert_eta_consistent(s);

    // Step 3: the two running ones complete: finished, no ETA, and the watch ends by itself.
    for (name, total, start) in [("b1-p1", 400 * MB, &start1), ("b1-p2", 200 * MB, &start2)] {
        write_status(
            &env,
            flavour,
            name,
            json!({"phase": "Completed", "startTimestamp": start,
            "completionTimestamp": rfc3339(SystemTime::now()),
            "progress": {"bytesDone": total, "totalBytes": total}}),
        )
        .await;
    }
    let (v, _, _) = json_of(&env, "b1").await;
    let s = &v["summary"];
    assert_eq!(counts(s), [4, 4, 0, 0, 2, 1, 1], "{s}");
    assert_eq!(s["finished"], true);
    assert!(s["eta"].is_null());
    assert_eq!(s["remainingBytes"].as_u64(), Some(0));
    let status = tokio::time::timeout(LONG, watch.wait())
        .await
        .expect("--watch ends when finished")
        .unwrap();
    assert!(status.success());

    // `backups`: one line per Velero backup.
    let (code, out, err) = run(&env, &["backups", "-o", "json"]).await;
    assert_eq!(code, 0, "{err}");
    let list: Value = serde_json::from_str(&out).unwrap();
    let names: Vec<&str> = list["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["b1", "b2"]);
    assert_eq!(counts(&list["items"][1]), [1, 0, 0, 1, 0, 0, 0]);
    assert_eq!(list["items"][1]["bytesDone"].as_u64(), Some(7 * MB));
    let (code, table, _) = run(&env, &["backups"]).await;
    assert_eq!(code, 0);
    let b1 = table
        .lines()
        .find(|l| l.starts_with("b1 "))
        .expect("a b1 line");
    assert!(
        b1.contains("4/4")
            && b1.contains(&format!(
                "{} of {}",
                format_bytes(600 * MB),
                format_bytes(600 * MB)
            )),
        "{table}"
    );
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backup_progressing_over_time_velero_crds() {
    backup_progressing_over_time(Flavour::Velero).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backup_progressing_over_time_our_crds() {
    backup_progressing_over_time(Flavour::Ours).await;
}

/// `cancel backup NAME`: only that backup's unfinished objects get `spec.cancel: true`, status
/// untouched; a second call writes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_backup_cancels_only_its_unfinished_volumes() {
    let env = PluginEnv::new(Flavour::Velero).await;
    let now = rfc3339(SystemTime::now());
    for (name, backup) in [
        ("b1-run", "b1"),
        ("b1-new", "b1"),
        ("b1-done", "b1"),
        ("b2-run", "b2"),
    ] {
        create(&env, name, backup, "node-1", name).await;
    }
    write_status(
        &env,
        Flavour::Velero,
        "b1-run",
        running(5 * MB, 50 * MB, &now),
    )
    .await;
    write_status(
        &env,
        Flavour::Velero,
        "b1-done",
        json!({"phase": "Completed", "progress": {"bytesDone": 10, "totalBytes": 10}}),
    )
    .await;
    write_status(
        &env,
        Flavour::Velero,
        "b2-run",
        running(5 * MB, 50 * MB, &now),
    )
    .await;
    let before: Vec<PodVolumeBackup> = env.pvbs().list(&Default::default()).await.unwrap().items;

    let (code, out, err) = run(&env, &["cancel", "backup", "b1"]).await;
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(
        out.contains("podvolumebackup/b1-run: cancel requested (was InProgress)"),
        "{out}"
    );
    assert!(
        out.contains("podvolumebackup/b1-new: cancel requested (was New)"),
        "{out}"
    );
    assert!(
        out.contains("podvolumebackup/b1-done: already Completed, nothing to stop"),
        "{out}"
    );
    assert!(
        out.contains("backup b1: cancel requested on 2, already requested on 0, 1 finished"),
        "{out}"
    );
    for old in &before {
        let new = env.pvbs().get(&old.name_any()).await.unwrap();
        let expect = matches!(old.name_any().as_str(), "b1-run" | "b1-new");
        assert_eq!(new.spec.cancel == Some(true), expect, "{}", old.name_any());
        assert_eq!(
            new.status,
            old.status,
            "status untouched: {}",
            old.name_any()
        );
        if !expect {
            assert_eq!(
                new.resource_version(),
                old.resource_version(),
                "{} not written",
                old.name_any()
            );
        }
    }

    // Again: nothing to do, nothing written.
    let versions: Vec<_> = env
        .pvbs()
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .iter()
        .map(|p| (p.name_any(), p.resource_version()))
        .collect();
    // The first call's patches went through the proxy: the count below can see one.
    let patches = RequestMatch::any()
        .verb("patch")
        .resource("podvolumebackups");
    let patches_before = env.proxy.request_count(&patches);
    assert_eq!(patches_before, 2, "{:?}", env.proxy.request_log());
    let (code, out, _) = run(&env, &["cancel", "backup", "b1"]).await;
    assert_eq!(code, 0);
    assert!(
        out.contains("podvolumebackup/b1-run: cancel already requested (InProgress)"),
        "{out}"
    );
    assert!(
        out.contains("backup b1: cancel requested on 0, already requested on 2, 1 finished"),
        "{out}"
    );
    let after: Vec<_> = env
        .pvbs()
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .iter()
        .map(|p| (p.name_any(), p.resource_version()))
        .collect();
    assert_eq!(after, versions);
    assert_eq!(
        env.proxy.request_count(&patches),
        patches_before,
        "no PATCH sent: {:?}",
        env.proxy.request_log()
    );
    // A backup with no pod volume backups is an error, not silence.
    let (code, _, err) = run(&env, &["cancel", "backup", "nope"]).await;
    assert_eq!(code, 1);
    assert!(
        err.contains("no podvolumebackups or datauploads labelled velero.io/backup-name=nope"),
        "{err}"
    );
    env.cleanup().await;
}

/// Three volumes on two nodes backed up by two real agents with real restic (our CRDs: status
/// through the status subresource): while it runs, `--once` shows the volume count, x of y
/// bytes, a rate and an ETA, the same figures as `-o json` (restic is paused for the two reads
/// so they see the same bytes); at the end the plugin's total is the data written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backup_by_the_real_agent_seen_through_the_plugin_our_crds() {
    let env = PluginEnv::new(Flavour::Ours).await;
    let (pod_a, dirs_a) = env.create_pod("app-a", NODE, &["data", "logs"]).await;
    let (pod_b, dirs_b) = env.create_pod("app-b", OTHER_NODE, &["data"]).await;
    let mut size = Env::fill(&dirs_a["data"], &[("a.bin", 24 << 20), ("b.txt", 1000)]);
    size += Env::fill(&dirs_a["logs"], &[("l.bin", 8 << 20)]);
    size += Env::fill(&dirs_b["data"], &[("c.bin", 24 << 20)]);
    // The repository exists before two agents use it: two first backups at once would both
    // initialise it (restic init is not safe to run twice at the same time).
    let init = std::process::Command::new("restic")
        .arg("init")
        .env("RESTIC_REPOSITORY", &env.repo)
        .env("RESTIC_PASSWORD_FILE", &env.password_file)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(init.status.success(), "{init:?}");
    let slow = env.slow_restic(1500);
    let restic = format!("--restic-binary={}", slow.display());
    // Progress written every second: at the default 10 s the two transfers could both show
    // bytes for well under a second, shorter than one plugin run on a loaded machine.
    let mut agent_a = env.start_agent(NODE, &[&restic, "--update-interval=1s"]);
    let mut agent_b = env.start_agent(OTHER_NODE, &[&restic, "--update-interval=1s"]);
    agent_a.wait_ready(LONG).await;
    agent_b.wait_ready(LONG).await;
    env.create_pvb("pvb-a-data", &pod_a, "data", NODE).await;
    env.create_pvb("pvb-a-logs", &pod_a, "logs", NODE).await;
    env.create_pvb("pvb-b-data", &pod_b, "data", OTHER_NODE)
        .await;

    // Until both nodes move bytes with their totals known.
    let deadline = Instant::now() + LONG;
    loop {
        let (v, _, _) = json_of(&env, "b1").await;
        let items = v["items"].as_array().unwrap();
        let moving = items
            .iter()
            .filter(|i| {
                i["state"] == "running"
                    && i["bytesDone"].as_u64() > Some(0)
                    && i["totalBytes"].as_u64() > Some(0)
            })
            .count();
        // Not also "bytes remaining": restic counts a file's bytes once it has read them, so
        // with uploads throttled it can show all of them read within a second while the upload
        // goes on (seen on the real server); the ETA check below handles both cases.
        if moving == 2 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "never two running: {v}\n{}\n{}",
            agent_a.logs(),
            agent_b.logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Pause restic; wait until the objects stop changing (the agents write only changes).
    let pids: Vec<i32> = env
        .uploader_processes()
        .iter()
        .filter_map(|p| p.split(':').next()?.parse().ok())
        .collect();
    assert!(!pids.is_empty());
    let signal_all = |sig| {
        for p in &pids {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(*p), sig);
        }
    };
    signal_all(Signal::SIGSTOP);
    let mut last = Value::Null;
    let frozen = loop {
        tokio::time::sleep(Duration::from_millis(600)).await;
        let (v, _, _) = json_of(&env, "b1").await;
        let figures = json!([
            v["summary"]["bytesDone"],
            v["summary"]["totalBytes"],
            v["summary"]["volumes"]
        ]);
        if figures == last {
            break v;
        }
        last = figures;
    };
    let (code, text, err) = run(&env, &["backup", "b1", "--once"]).await;
    signal_all(Signal::SIGCONT);
    assert_eq!(code, 0, "{err}");
    let s = &frozen["summary"];
    assert_eq!(s["volumes"]["total"].as_u64(), Some(3));
    assert_eta_consistent(s);
    let c = &s["volumes"];
    assert!(
        text.contains(&format!("Volumes:  {} of 3 done (", c["done"])),
        "{text}\n{s}"
    );
    let bytes = if s["totalAtLeast"] == true {
        "of at least"
    } else {
        "of"
    };
    let line = format!(
        "Bytes:    {} {bytes} {}",
        format_bytes(s["bytesDone"].as_u64().unwrap()),
        format_bytes(s["totalBytes"].as_u64().unwrap())
    );
    assert!(text.contains(&line), "{text}\n{s}");
    assert!(
        text.lines()
            .any(|l| l.starts_with("Rate:") && l.contains("/s")),
        "{text}"
    );
    // The ETA line says what the summary says: seconds, or "-" when restic got through its
    // bytes before it was paused (remaining 0, still finalizing; seen on a loaded machine).
    let eta_shown = |l: &str| {
        if s["eta"].is_null() {
            l.trim_end() == "ETA:      -"
        } else {
            l.trim_end().ends_with('s')
        }
    };
    assert!(
        text.lines().any(|l| l.starts_with("ETA:") && eta_shown(l)),
        "{text}\n{s}"
    );
    for v in ["pvb-a-data", "pvb-a-logs", "pvb-b-data"] {
        let name = env.pvbs().get(v).await.unwrap();
        assert!(text.contains(name.spec.volume.as_str()));
    }

    for name in ["pvb-a-data", "pvb-a-logs", "pvb-b-data"] {
        let done = env
            .wait_pvb(
                name,
                &[Phase::Completed, Phase::Failed, Phase::Canceled],
                LONG,
            )
            .await;
        assert_eq!(
            done.status.unwrap().phase,
            Some(Phase::Completed),
            "{}\n{}",
            agent_a.logs(),
            agent_b.logs()
        );
    }
    let (v, _, _) = json_of(&env, "b1").await;
    let s = &v["summary"];
    assert_eq!(counts(s), [3, 3, 0, 0, 3, 0, 0], "{s}");
    assert_eq!(
        (s["bytesDone"].as_u64(), s["totalBytes"].as_u64()),
        (Some(size), Some(size)),
        "{s}"
    );
    assert_eq!(s["finished"], true);
    let nodes: Vec<&str> = v["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["node"].as_str().unwrap())
        .collect();
    assert_eq!(nodes, [NODE, NODE, OTHER_NODE]);
    assert_eq!(env.restic_snapshots().len(), 3);
    env.cleanup().await;
}

// ----- the live view in a real terminal -----

/// A tmux server of its own (own socket), killed at the end.
struct Tmux {
    socket: String,
}

impl Tmux {
    fn start(dir: &Path) -> Tmux {
        let socket = format!("pvplugin-{}", std::process::id());
        let t = Tmux { socket };
        let shell = format!(
            "env -i PATH={} HOME={} TERM=tmux-256color PS1='$ ' bash --norc --noprofile",
            std::env::var("PATH").unwrap_or_default(),
            dir.display()
        );
        let out = t.cmd(&[
            "new-session",
            "-d",
            "-s",
            "t",
            "-x",
            "160",
            "-y",
            "40",
            &shell,
        ]);
        assert!(
            out.status.success(),
            "tmux (from Debian's tmux package) is needed: {out:?}"
        );
        t
    }

    fn cmd(&self, args: &[&str]) -> std::process::Output {
        std::process::Command::new("tmux")
            .args(["-L", &self.socket])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("tmux (Debian's tmux package) is needed for the live view test")
    }

    fn keys(&self, keys: &[&str]) {
        let mut args = vec!["send-keys", "-t", "t"];
        args.extend(keys);
        assert!(self.cmd(&args).status.success());
    }

    fn screen(&self) -> String {
        String::from_utf8_lossy(&self.cmd(&["capture-pane", "-p", "-t", "t"]).stdout).into_owned()
    }

    fn flag(&self, name: &str) -> String {
        let out = self.cmd(&["display-message", "-p", "-t", "t", &format!("#{{{name}}}")]);
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// Waits until `ok(screen)` holds; the last screen.
    async fn wait_for(&self, what: &str, ok: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + LONG;
        loop {
            let s = self.screen();
            if ok(&s) {
                return s;
            }
            assert!(Instant::now() < deadline, "never saw {what}:\n{s}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.cmd(&["kill-server"]);
    }
}

/// What a person sees: the whole with a bar, a row per volume with its bar, redrawn as bytes
/// move; Ctrl-C gives back the terminal as it was (main screen, cursor shown, same stty modes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_view_in_a_real_terminal() {
    let env = PluginEnv::new(Flavour::Velero).await;
    let started = rfc3339(SystemTime::now() - Duration::from_secs(30));
    create(&env, "b1-web", "b1", "node-1", "web").await;
    create(&env, "b1-db", "b1", "node-2", "db").await;
    write_status(
        &env,
        Flavour::Velero,
        "b1-web",
        running(30 * MB, 120 * MB, &started),
    )
    .await;
    write_status(&env, Flavour::Velero, "b1-db", json!({"phase": "Accepted"})).await;

    let dir = env.tmp.path();
    let tmux = Tmux::start(dir);
    tmux.wait_for("the prompt", |s| s.contains('$')).await;
    tmux.keys(&[
        // The quotes keep the typed command line from showing the marker before it has run.
        &format!("stty -g > {}/before; echo marker-be''fore", dir.display()),
        "Enter",
    ]);
    tmux.wait_for("the marker", |s| s.contains("marker-before"))
        .await;
    let command = format!(
        "{} --kubeconfig={} -n {} backup b1 --refresh=200ms",
        env!("CARGO_BIN_EXE_kubectl-podvolume"),
        env.kubeconfig().display(),
        env.ns
    );
    tmux.keys(&[&command, "Enter"]);
    let screen = tmux
        .wait_for("the live view", |s| {
            s.contains("backup b1 (namespace") && s.contains("q or Ctrl-C: quit")
        })
        .await;
    assert_eq!(tmux.flag("alternate_on"), "1", "on the alternate screen");
    assert_eq!(tmux.flag("cursor_flag"), "0", "cursor hidden");
    assert!(
        !screen.contains("marker-before"),
        "the shell's lines are not under the view:\n{screen}"
    );
    assert!(
        screen.contains(
            "Volumes:  0 of 2 done (1 queued, 1 running, 0 completed, 0 failed, 0 canceled)"
        ),
        "{screen}"
    );
    assert!(
        screen.contains(&format!(
            "Bytes:    {} of at least {}",
            format_bytes(30 * MB),
            format_bytes(120 * MB)
        )),
        "{screen}"
    );
    let web = screen
        .lines()
        .find(|l| l.contains("/web"))
        .expect("a row for web");
    assert!(
        web.contains("node-1") && web.contains("InProgress") && web.contains("[███░░░░░░░░░]"),
        "{screen}"
    );
    assert!(
        web.contains(&format!(
            "{} of {}",
            format_bytes(30 * MB),
            format_bytes(120 * MB)
        )),
        "{screen}"
    );
    let db = screen
        .lines()
        .find(|l| l.contains("/db"))
        .expect("a row for db");
    assert!(db.contains("Accepted") && db.contains("of ?"), "{screen}");

    // Bytes move: the view follows without a key pressed.
    write_status(
        &env,
        Flavour::Velero,
        "b1-web",
        running(90 * MB, 120 * MB, &started),
    )
    .await;
    write_status(
        &env,
        Flavour::Velero,
        "b1-db",
        running(10 * MB, 40 * MB, &started),
    )
    .await;
    let screen = tmux
        .wait_for("the new figures", |s| {
            s.contains(&format!(
                "Bytes:    {} of {}",
                format_bytes(100 * MB),
                format_bytes(160 * MB)
            ))
        })
        .await;
    assert!(
        screen.contains("0 of 2 done (0 queued, 2 running"),
        "{screen}"
    );
    assert!(
        screen
            .lines()
            .any(|l| l.starts_with("ETA:") && l.trim_end().ends_with('s')),
        "{screen}"
    );
    let web = screen.lines().find(|l| l.contains("/web")).unwrap();
    assert!(web.contains("[█████████░░░]"), "{screen}");
    // What it looked like (`cargo test --test plugin live_view -- --nocapture`).
    println!("{screen}");

    tmux.keys(&["C-c"]);
    let screen = tmux
        .wait_for("the shell again", |s| {
            s.contains("marker-before") && s.trim_end().ends_with('$')
        })
        .await;
    assert_eq!(tmux.flag("alternate_on"), "0", "back on the main screen");
    assert_eq!(tmux.flag("cursor_flag"), "1", "cursor shown");
    assert!(
        screen.contains("Volumes:  0 of 2 done"),
        "the last figures stay printed:\n{screen}"
    );
    tmux.keys(&[
        &format!("stty -g > {}/after; echo marker-af''ter", dir.display()),
        "Enter",
    ]);
    tmux.wait_for("the second marker", |s| s.contains("marker-after"))
        .await;
    let before = std::fs::read_to_string(dir.join("before")).unwrap();
    let after = std::fs::read_to_string(dir.join("after")).unwrap();
    assert!(!before.trim().is_empty());
    assert_eq!(before, after, "terminal modes restored (no raw mode left)");
    env.cleanup().await;
}
