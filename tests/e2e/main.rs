//! End-to-end: the agent binary against a real Kubernetes API server
//! (`PODVOLUME_E2E_KUBECONFIG=<file>`; scripts/test-real-cluster.sh starts one), real restic and
//! kopia, real files.
//!
//! Faults of the API server (an outage, 409 storms, 500/503 answers) come from a fault-injecting
//! proxy between the agent and the server (`tests/common/fault_proxy.rs`).

#[path = "../cloud/mod.rs"]
mod cloud;
mod cloud_storage;
mod harness;
mod kopia;
mod owner;
#[path = "../s3/mod.rs"]
mod s3;
mod storage;

use std::time::Duration;

use harness::*;
use nix::sys::signal::Signal;
use podvolume_agent::crd::{Phase, PodVolumeBackup};
use serde_json::json;

const LONG: Duration = Duration::from_secs(120);

fn status(p: &PodVolumeBackup) -> &podvolume_agent::crd::PodVolumeBackupStatus {
    p.status.as_ref().expect("status")
}

fn has_our_finalizer(p: &PodVolumeBackup) -> bool {
    p.finalizers()
        .iter()
        .any(|f| f == podvolume_agent::crd::FINALIZER)
}

/// Records `n` interrupted starts on the object, as the agent's attempts annotation does.
async fn set_attempts<K>(api: &kube::Api<K>, name: &str, n: u32)
where
    K: Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    api.patch(
        name,
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(
            json!({"metadata": {"annotations": {podvolume_agent::crd::ATTEMPTS_ANNOTATION: n.to_string()}}}),
        ),
    )
    .await
    .unwrap();
}

fn progress_of(p: &PodVolumeBackup) -> (i64, i64) {
    let pr = status(p).progress.clone().unwrap_or_default();
    (pr.bytes_done, pr.total_bytes)
}

/// Both CRD flavours: a backup shows monotonic intermediate progress and completes with the
/// snapshot restic reports; a PVB of another node costs zero writes.
async fn backup_with_progress(mut env: Env) {
    let flavour = env.flavour;
    // Every request of the agent passes the proxy, which counts them (no fault is set).
    let proxy = env.fault_proxy().await;
    let (pod, dirs) = env.create_pod("app-1", NODE, &["data"]).await;
    let total = Env::fill(
        &dirs["data"],
        &[
            ("big.bin", 160 << 20),
            ("small/a.txt", 1000),
            ("small/b.txt", 2000),
        ],
    );
    let mut agent = env.start_agent(NODE, &["--update-interval=100ms"]);
    agent.wait_ready(LONG).await;
    let (other_pod, _) = env.create_pod("app-2", OTHER_NODE, &["data"]).await;
    let other = env
        .create_pvb("pvb-other", &other_pod, "data", OTHER_NODE)
        .await;
    let rec = env.record(env.pvbs(), "pvb-1");
    env.create_pvb("pvb-1", &pod, "data", NODE).await;
    let done = env
        .wait_pvb("pvb-1", &[Phase::Completed, Phase::Failed], LONG)
        .await;
    let st = status(&done);
    assert_eq!(st.phase, Some(Phase::Completed), "{st:?}\n{}", agent.logs());
    let id = st.snapshot_id.clone().unwrap();
    let snaps = env.restic_snapshots();
    assert!(
        snaps
            .iter()
            .any(|s| s["short_id"] == id.as_str() || s["id"] == id.as_str()),
        "{id} not in {snaps:?}"
    );
    assert_eq!(progress_of(&done), (total as i64, total as i64));
    assert!(st.completion_timestamp.is_some() && st.start_timestamp.is_some());
    // Velero <= 1.16's schema has no acceptedTimestamp (the API server prunes it).
    assert_eq!(st.accepted_timestamp.is_some(), flavour.all_phases());
    assert!(
        st.path.as_deref().is_some_and(|p| p.ends_with("/data")),
        "{:?}",
        st.path
    );
    // Velero's CRDs: one write, no result with our finalizer; ours: the finalizer follows.
    assert_result_released(&env, &done, || agent.logs()).await;
    // The API server records the agent's writes under its own name (kubectl get -o yaml).
    let managers: Vec<String> = done
        .metadata
        .managed_fields
        .iter()
        .flatten()
        .filter_map(|e| e.manager.clone())
        .collect();
    assert!(
        managers.iter().any(|m| m == "podvolume-agent"),
        "managers: {managers:?}"
    );
    // The watch saw the object move: intermediate progress, never backwards, never over total.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let versions = rec.versions();
    let mut last = 0;
    let mut intermediate = 0;
    for v in &versions {
        let (d, t) = v
            .status
            .as_ref()
            .and_then(|s| s.progress.clone())
            .map(|p| (p.bytes_done, p.total_bytes))
            .unwrap_or((0, 0));
        assert!(d >= last, "bytesDone went down: {versions:#?}");
        if flavour.status_on_object()
            && v.status
                .as_ref()
                .and_then(|s| s.phase)
                .is_some_and(|p| p.is_terminal())
        {
            assert!(!has_our_finalizer(v), "a result with our finalizer on");
        }
        assert!(d <= t || t == 0, "bytesDone > totalBytes");
        if d > 0 && d < total as i64 {
            intermediate += 1;
        }
        last = d;
    }
    assert!(
        intermediate >= 2,
        "{intermediate} intermediate progress versions"
    );
    // Only phases the CRD has were written, and none was refused: on Velero <= 1.16's CRDs
    // the object goes New -> InProgress -> Completed.
    let phases: Vec<Phase> = versions
        .iter()
        .filter_map(|v| v.status.as_ref().and_then(|s| s.phase))
        .collect();
    if !flavour.all_phases() {
        assert!(
            phases
                .iter()
                .all(|p| matches!(p, Phase::New | Phase::InProgress | Phase::Completed)),
            "{phases:?}"
        );
    }
    assert_no_refused_writes(&agent).await;
    // Another node's object: untouched.
    let other_now = env.pvbs().get("pvb-other").await.unwrap();
    assert_eq!(
        other_now.metadata.resource_version,
        other.metadata.resource_version
    );
    // Not even a write that changes nothing (which would leave the resourceVersion as it was).
    let writes = proxy.request_count(&RequestMatch::any().writes().name("pvb-other"));
    assert_eq!(
        writes, 0,
        "the agent wrote to another node's PodVolumeBackup"
    );
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backup_with_progress_velero_crds() {
    backup_with_progress(Env::new(Flavour::Velero).await).await;
}

/// Velero 1.16 and older: the CRDs allow only New, InProgress, Completed and Failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backup_with_progress_velero_116_crds() {
    backup_with_progress(Env::new(Flavour::Velero116).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backup_with_progress_status_subresource() {
    backup_with_progress(Env::new(Flavour::Ours).await).await;
}

/// Outside a cluster `run` finds its kubeconfig as kubectl does: the file in `KUBECONFIG`, else
/// `~/.kube/config`, an empty `KUBECONFIG` counting as unset (it used to fail with "a value is
/// required for '--kubeconfig'", and without `KUBECONFIG` it tried only the in-cluster
/// configuration).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_finds_its_kubeconfig_as_kubectl_does() {
    let env = Env::new(Flavour::Velero).await;
    for via in [KubeconfigVia::Env, KubeconfigVia::HomeWithEmptyEnv] {
        let mut agent = env.start_agent_finding_kubeconfig(NODE, &[], via);
        agent.wait_ready(LONG).await;
        agent.signal(Signal::SIGTERM);
        agent.wait(Duration::from_secs(20));
    }
    env.cleanup().await;
}

use kube::ResourceExt;

/// A backup that stays InProgress for a while (uploads slowed to 300 KiB/s: about 2 minutes),
/// with bytes moving.
async fn running_backup(env: &Env, name: &str, extra: &[&str]) -> (Agent, kube::api::ObjectMeta) {
    running_backup_at(env, name, extra, 300).await
}

/// As [`running_backup`], uploading at `kib` KiB/s (40 MiB in all).
async fn running_backup_at(
    env: &Env,
    name: &str,
    extra: &[&str],
    kib: u32,
) -> (Agent, kube::api::ObjectMeta) {
    let (pod, dirs) = env
        .create_pod(&format!("{name}-pod"), NODE, &["data"])
        .await;
    Env::fill(&dirs["data"], &[("a.bin", 30 << 20), ("b.bin", 10 << 20)]);
    let slow = env.slow_restic(kib);
    let mut args = vec![format!("--restic-binary={}", slow.display())];
    args.extend(extra.iter().map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut agent = env.start_agent(NODE, &args);
    agent.wait_ready(LONG).await;
    let pvb = env.create_pvb(name, &pod, "data", NODE).await;
    env.wait_moving(name, &agent, LONG).await;
    assert!(
        !env.uploader_processes().is_empty(),
        "restic should be running"
    );
    (agent, pvb.metadata)
}

/// `--update-interval` bounds the writes to each object: at 1 s, two progress writes of one
/// PodVolumeBackup are never less than an interval apart (on a real API server they came 0.19 s
/// apart: the first value at once, then the first tick of the operation's clock). Measured from
/// the watch's deliveries, so 0.9 s allows for their jitter; how fresh the published value stays
/// is benchmark case 3.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn progress_writes_of_one_object_are_an_interval_apart() {
    let env = Env::new(Flavour::Velero).await;
    let (pod, dirs) = env.create_pod("spacing-pod", NODE, &["data"]).await;
    // Long to read and nothing to upload: restic chunks every zero of a 64 GiB sparse file, so
    // its byte count moves at every status line for as long as the test watches.
    std::fs::File::create(dirs["data"].join("huge.img"))
        .unwrap()
        .set_len(64 << 30)
        .unwrap();
    let mut agent = env.start_agent(NODE, &["--update-interval=1s"]);
    agent.wait_ready(LONG).await;
    let rec = env.record(env.pvbs(), "pvb-spacing");
    env.create_pvb("pvb-spacing", &pod, "data", NODE).await;
    // Progress writes: versions that are InProgress before and after and whose status changed
    // (bytes, total, or the message with its stage, rate and ETA).
    let progress_writes = |rec: &Recorder<PodVolumeBackup>| {
        let in_progress = |p: &PodVolumeBackup| {
            p.status.as_ref().and_then(|s| s.phase) == Some(Phase::InProgress)
        };
        rec.timed_versions()
            .windows(2)
            .filter(|w| {
                in_progress(&w[0].1) && in_progress(&w[1].1) && w[0].1.status != w[1].1.status
            })
            .map(|w| w[1].0)
            .collect::<Vec<_>>()
    };
    let deadline = std::time::Instant::now() + LONG;
    while progress_writes(&rec).len() < 8 {
        assert!(
            std::time::Instant::now() < deadline,
            "{} progress writes in {LONG:?}\n{}",
            progress_writes(&rec).len(),
            agent.logs()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let writes = progress_writes(&rec);
    env.cancel_pvb("pvb-spacing").await;
    env.wait_pvb(
        "pvb-spacing",
        &[Phase::Completed, Phase::Failed, Phase::Canceled],
        LONG,
    )
    .await;
    let spacings: Vec<f64> = writes
        .windows(2)
        .map(|w| (w[1] - w[0]).as_secs_f64())
        .collect();
    let min = spacings.iter().cloned().fold(f64::MAX, f64::min);
    eprintln!(
        "{} progress writes at --update-interval 1s; smallest spacing {min:.3} s: {spacings:.3?}",
        writes.len()
    );
    assert!(
        min >= 0.9,
        "progress writes {min:.3} s apart: {spacings:.3?}"
    );
    env.cleanup().await;
}

/// Velero 1.17+'s CRDs: Canceling shown, then Canceled. Velero <= 1.16's have neither: the
/// backup ends Failed with a message that says it was canceled, as Velero's agent did then.
async fn cancel_mid_backup(flavour: Flavour) {
    let env = Env::new(flavour).await;
    let flavour = env.flavour;
    let (agent, _) = running_backup(&env, "pvb-cancel", &[]).await;
    let rec = env.record(env.pvbs(), "pvb-cancel");
    env.cancel_pvb("pvb-cancel").await;
    let done = env
        .wait_pvb(
            "pvb-cancel",
            &[Phase::Canceled, Phase::Failed, Phase::Completed],
            LONG,
        )
        .await;
    // How fast is measured by the benchmark (case 4b), not asserted here.
    let st = status(&done);
    assert_eq!(
        st.phase,
        Some(flavour.canceled()),
        "{st:?}\n{}",
        agent.logs()
    );
    assert!(
        st.message.as_deref().unwrap_or("").starts_with("cancel"),
        "{:?}",
        st.message
    );
    assert!(
        env.uploader_processes().is_empty(),
        "{:?}",
        env.uploader_processes()
    );
    assert!(
        env.restic_locks().is_empty(),
        "locks left: {:?}",
        env.restic_locks()
    );
    assert_result_released(&env, &done, || agent.logs()).await;
    if flavour.all_phases() {
        assert_eq!(done.spec.cancel, Some(true), "spec.cancel must survive");
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        rec.versions()
            .iter()
            .any(|v| v.status.as_ref().and_then(|s| s.phase) == Some(Phase::Canceling)),
        flavour.all_phases(),
        "Canceling shown if and only if the CRD has it"
    );
    assert_no_refused_writes(&agent).await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_mid_backup_stops_restic_and_ends_canceled() {
    cancel_mid_backup(Flavour::Velero).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_mid_backup_on_velero_116_crds_ends_failed_saying_canceled() {
    cancel_mid_backup(Flavour::Velero116).await;
}

async fn deleting_a_running_backup(flavour: Flavour) {
    let env = Env::new(flavour).await;
    let (agent, _) = running_backup(&env, "pvb-delete", &[]).await;
    env.delete_pvb("pvb-delete").await;
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while env.pvbs().get_opt("pvb-delete").await.unwrap().is_some() {
        assert!(
            std::time::Instant::now() < deadline,
            "object never went away\n{}",
            agent.logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        env.uploader_processes().is_empty(),
        "{:?}",
        env.uploader_processes()
    );
    assert!(env.restic_locks().is_empty());
    assert_no_refused_writes(&agent).await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_running_backup_cancels_it_then_lets_it_go() {
    deleting_a_running_backup(Flavour::Ours).await;
}

/// Velero <= 1.16's CRDs have no Canceled: the deletion still completes (our finalizer goes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_running_backup_on_velero_116_crds_lets_it_go() {
    deleting_a_running_backup(Flavour::Velero116).await;
}

async fn operation_timeout(flavour: Flavour) {
    let env = Env::new(flavour).await;
    let (agent, _) = running_backup(&env, "pvb-timeout", &["--operation-timeout=12s"]).await;
    let done = env
        .wait_pvb(
            "pvb-timeout",
            &[Phase::Canceled, Phase::Failed, Phase::Completed],
            LONG,
        )
        .await;
    let st = status(&done);
    assert_eq!(st.phase, Some(Phase::Failed), "{st:?}\n{}", agent.logs());
    assert!(
        st.message
            .as_deref()
            .unwrap_or("")
            .contains("timed out after 12s"),
        "{:?}",
        st.message
    );
    assert!(env.uploader_processes().is_empty());
    assert!(env.restic_locks().is_empty());
    assert_no_refused_writes(&agent).await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operation_timeout_fails_the_backup_and_says_so() {
    operation_timeout(Flavour::Velero).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operation_timeout_on_velero_116_crds() {
    operation_timeout(Flavour::Velero116).await;
}

/// A backup whose every run was interrupted by an agent restart (the attempts annotation the
/// agent writes at each start) is failed with the cause, not started once more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backup_interrupted_max_attempts_times_is_failed_not_started_again() {
    let env = Env::new(Flavour::Velero).await;
    let (pod, dirs) = env.create_pod("attempts-pod", NODE, &["data"]).await;
    Env::fill(&dirs["data"], &[("a.bin", 1 << 20)]);
    env.create_pvb("pvb-attempts", &pod, "data", NODE).await;
    set_attempts(&env.pvbs(), "pvb-attempts", 2).await;
    let mut agent = env.start_agent(NODE, &["--max-attempts=2"]);
    agent.wait_ready(LONG).await;
    let done = env
        .wait_pvb(
            "pvb-attempts",
            &[Phase::Completed, Phase::Failed, Phase::Canceled],
            LONG,
        )
        .await;
    let st = status(&done);
    assert_eq!(st.phase, Some(Phase::Failed), "{st:?}\n{}", agent.logs());
    let message = st.message.clone().unwrap_or_default();
    assert!(
        message.contains("the backup was started 2 times")
            && message.contains("interrupted by a node agent restart"),
        "{message}"
    );
    // Not started again: the count is unchanged and restic made no snapshot.
    assert_eq!(
        done.annotations()
            .get("podvolume-agent.io/attempts")
            .map(String::as_str),
        Some("2")
    );
    assert!(env.restic_snapshots().is_empty());
    assert!(env.uploader_processes().is_empty());
    env.cleanup().await;
}

async fn agent_killed_mid_backup(flavour: Flavour) {
    let env = Env::new(flavour).await;
    let (mut agent, _) = running_backup(&env, "pvb-restart", &[]).await;
    agent.signal(Signal::SIGKILL);
    agent.wait(Duration::from_secs(5));
    // Its restic is orphaned in its own process group. It dies at its next write to the closed
    // pipe (SIGPIPE), or, if still there when the next agent starts, is stopped by it (that path
    // is tested directly in runner::tests). Either way none may be left at the end.
    let mut agent2 = env.start_agent(NODE, &[]);
    agent2.wait_ready(LONG).await;
    let done = env
        .wait_pvb(
            "pvb-restart",
            &[Phase::Completed, Phase::Failed, Phase::Canceled],
            LONG,
        )
        .await;
    let st = status(&done);
    assert_eq!(
        st.phase,
        Some(Phase::Completed),
        "{st:?}\n{}",
        agent2.logs()
    );
    assert_eq!(
        done.annotations()
            .get("podvolume-agent.io/attempts")
            .map(String::as_str),
        Some("2")
    );
    let id = st.snapshot_id.clone().unwrap();
    assert!(
        env.restic_snapshots()
            .iter()
            .any(|s| s["short_id"] == id.as_str())
    );
    assert!(
        env.uploader_processes().is_empty(),
        "stray: {:?}",
        env.uploader_processes()
    );
    assert_no_refused_writes(&agent2).await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_killed_mid_backup_is_rerun_by_the_next_start() {
    agent_killed_mid_backup(Flavour::Velero).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_killed_mid_backup_on_velero_116_crds_is_rerun() {
    agent_killed_mid_backup(Flavour::Velero116).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_children_and_leaves_the_object_for_the_next_start() {
    let env = Env::new(Flavour::Velero).await;
    let (mut agent, _) = running_backup(&env, "pvb-sigterm", &[]).await;
    agent.signal(Signal::SIGTERM);
    let code = agent.wait(Duration::from_secs(20));
    assert_eq!(code, Some(0), "{}", agent.logs());
    assert!(
        env.uploader_processes().is_empty(),
        "{:?}",
        env.uploader_processes()
    );
    let left = env.pvbs().get("pvb-sigterm").await.unwrap();
    assert_eq!(
        status(&left).phase,
        Some(Phase::InProgress),
        "left for the next start"
    );
    let mut agent2 = env.start_agent(NODE, &[]);
    agent2.wait_ready(LONG).await;
    let done = env
        .wait_pvb(
            "pvb-sigterm",
            &[Phase::Completed, Phase::Failed, Phase::Canceled],
            LONG,
        )
        .await;
    assert_eq!(
        status(&done).phase,
        Some(Phase::Completed),
        "{:?}\n{}",
        done.status,
        agent2.logs()
    );
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_outage_mid_backup_the_result_still_lands() {
    let mut env = Env::new(Flavour::Velero).await;
    let proxy = env.fault_proxy().await;
    // About a minute of upload, so the 30 s outage falls inside it with time to spare on a
    // loaded machine (at running_backup's 2 minutes the wait below was a race with the clock).
    let (agent, _) = running_backup_at(&env, "pvb-outage", &[], 700).await;
    proxy.down_for(Duration::from_secs(30));
    // The agent stays alive and healthy while the API server is gone.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(agent.http_get("/livez").await.map(|r| r.0), Some(200));
    let done = env
        .wait_pvb(
            "pvb-outage",
            &[Phase::Completed, Phase::Failed, Phase::Canceled],
            Duration::from_secs(150),
        )
        .await;
    let st = status(&done);
    assert_eq!(st.phase, Some(Phase::Completed), "{st:?}\n{}", agent.logs());
    let id = st.snapshot_id.clone().unwrap();
    assert!(
        env.restic_snapshots()
            .iter()
            .any(|s| s["short_id"] == id.as_str())
    );
    // 30 s of failed progress writes at a 200 ms interval: said when they begin and when they
    // end (and once a minute in between), not once per interval; and not a second time by
    // kube's own trace layer.
    let logs = agent.logs();
    let count = |needle: &str| logs.lines().filter(|l| l.contains(needle)).count();
    assert_eq!(count("progress write failed"), 1, "{logs}");
    assert!(count("progress writes still failing") <= 1, "{logs}");
    assert_eq!(count("progress writes work again"), 1, "{logs}");
    assert_eq!(count("failed with error"), 0, "{logs}");
    env.cleanup().await;
}

/// Velero's server marks the PVBs it finds InProgress at its own start Failed: that result is
/// final. The agent stops its restic and writes nothing over it (not Canceling, not its own
/// end); it only takes its finalizer off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_someone_else_wrote_mid_backup_is_not_overwritten() {
    let env = Env::new(Flavour::Velero).await;
    let (agent, _) = running_backup(&env, "pvb-theirs", &[]).await;
    let theirs = "found a podvolumebackup with status InProgress during the server starting, mark it as Failed";
    env.pvbs()
        .patch(
            "pvb-theirs",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"status": {"phase": "Failed", "message": theirs}})),
        )
        .await
        .unwrap();
    let deadline = std::time::Instant::now() + LONG;
    let last = loop {
        let p = env.pvbs().get("pvb-theirs").await.unwrap();
        if !has_our_finalizer(&p) && env.uploader_processes().is_empty() {
            break p;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "still running: {:?}\n{}",
            p.status,
            agent.logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    // A few intervals more: nothing the agent still had in flight may land after.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let p = env.pvbs().get("pvb-theirs").await.unwrap();
    assert_eq!(p.metadata.resource_version, last.metadata.resource_version);
    let st = status(&p);
    assert_eq!(st.phase, Some(Phase::Failed), "{st:?}\n{}", agent.logs());
    assert_eq!(st.message.as_deref(), Some(theirs));
    env.cleanup().await;
}

/// A queued backup whose slot comes while the API server fails its requests (the re-read
/// before it starts, the attempts count and InProgress answered 500) is started once they
/// succeed: nothing else would start it again (the watch has no change to report), so giving
/// up there left it Accepted for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_backup_whose_start_meets_api_errors_still_runs() {
    let mut env = Env::new(Flavour::Velero).await;
    let proxy = env.fault_proxy().await;
    let (agent, _) = running_backup_at(&env, "pvb-first", &["--concurrency=1"], 5000).await;
    let (pod, dirs) = env.create_pod("queued-pod", NODE, &["data"]).await;
    Env::fill(&dirs["data"], &[("q.bin", 1 << 20)]);
    env.create_pvb("pvb-queued", &pod, "data", NODE).await;
    // The test's own reads go to the server directly: the faults below meet the agent alone.
    let phase_of = |name: &'static str| {
        let api = env.pvbs();
        async move { api.get(name).await.unwrap().status.and_then(|s| s.phase) }
    };
    let deadline = std::time::Instant::now() + LONG;
    while phase_of("pvb-queued").await != Some(Phase::Accepted) {
        assert!(
            std::time::Instant::now() < deadline,
            "never queued\n{}",
            agent.logs()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(phase_of("pvb-first").await, Some(Phase::InProgress));
    let queued = RequestMatch::any()
        .resource("podvolumebackups")
        .name("pvb-queued");
    proxy.fail_next(queued.clone().verb("get"), 1, 500);
    proxy.fail_next(queued.clone().verb("patch"), 2, 503);
    loop {
        let phase = phase_of("pvb-queued").await;
        if phase.is_some_and(|p| p.is_terminal()) {
            assert_eq!(phase, Some(Phase::Completed), "{}", agent.logs());
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "stranded {phase:?}\n{}",
            agent.logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let failed = proxy
        .request_log()
        .iter()
        .filter(|r| r.path.ends_with("/pvb-queued") && r.status >= 500)
        .count();
    assert_eq!(failed, 3, "the faults were met");
    env.cleanup().await;
}

/// The fault proxy itself, with the agent's identity: what passes through it reaches the server
/// (a watch too, events streaming), and each fault is what a client of the server then meets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fault_proxy_forwards_and_injects_each_fault() {
    use futures::StreamExt;
    use kube::api::{Patch, PatchParams, WatchEvent, WatchParams};
    let mut env = Env::new(Flavour::Velero).await;
    let proxy = env.fault_proxy().await;
    let (pod, _) = env.create_pod("proxied-pod", NODE, &["data"]).await;
    env.create_pvb("pvb-proxied", &pod, "data", NODE).await;
    let client = {
        let kc = kube::config::Kubeconfig::read_from(proxy.kubeconfig()).unwrap();
        let mut cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default())
            .await
            .unwrap();
        // Every answer as the proxy gave it: kube's client would retry a 429 or 503 itself.
        cfg.default_retry = false;
        kube::Client::try_from(cfg).unwrap()
    };
    let pvbs: kube::Api<PodVolumeBackup> = kube::Api::namespaced(client, &env.ns);
    fn answer<T>(r: Result<T, kube::Error>) -> String {
        match r {
            Ok(_) => "ok".to_string(),
            Err(kube::Error::Api(s)) => format!("{} {}", s.code, s.reason),
            Err(e) => format!("no answer: {e}"),
        }
    }
    let get = || pvbs.get("pvb-proxied");
    let label = |v: &str| Patch::Merge(json!({"metadata": {"labels": {"proxied": v}}}));
    let this = RequestMatch::any()
        .resource("podvolumebackups")
        .name("pvb-proxied");

    assert_eq!(answer(get().await), "ok");
    let through = |verb: &str| proxy.request_count(&this.clone().verb(verb));
    assert_eq!(through("get"), 1, "{:?}", proxy.request_log());

    proxy.fail_next(this.clone().verb("get"), 1, 500);
    assert_eq!(answer(get().await), "500 InternalError");
    assert_eq!(answer(get().await), "ok", "one fault asked for, one met");
    proxy.fail_next(this.clone().verb("get"), 1, 429);
    assert_eq!(answer(get().await), "429 TooManyRequests");
    proxy.fail_next(this.clone().verb("get"), 1, 503);
    assert_eq!(answer(get().await), "503 ServiceUnavailable");

    // A conflict is for writes only, and the write it answers is not applied.
    proxy.conflict_next(this.clone(), 1);
    assert_eq!(answer(get().await), "ok");
    let patch = PatchParams::default();
    assert_eq!(
        answer(pvbs.patch("pvb-proxied", &patch, &label("a")).await),
        "409 Conflict"
    );
    let direct = env.pvbs().get("pvb-proxied").await.unwrap();
    assert_eq!(
        direct.labels().get("proxied"),
        None,
        "the refused write landed"
    );
    assert_eq!(
        answer(pvbs.patch("pvb-proxied", &patch, &label("b")).await),
        "ok"
    );
    let direct = env.pvbs().get("pvb-proxied").await.unwrap();
    assert_eq!(
        direct.labels().get("proxied").map(String::as_str),
        Some("b")
    );

    proxy.drop_next(this.clone().verb("get"), 1);
    assert!(answer(get().await).starts_with("no answer"));

    // A held request is answered once released, not before.
    proxy.hold(this.clone().verb("get"));
    let held = tokio::spawn({
        let pvbs = pvbs.clone();
        async move { answer(pvbs.get("pvb-proxied").await) }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!held.is_finished(), "a held request was answered");
    proxy.release_held();
    assert_eq!(
        tokio::time::timeout(Duration::from_secs(10), held)
            .await
            .expect("a released request still unanswered")
            .unwrap(),
        "ok"
    );

    // A watch streams through; an outage cuts it and turns new connections away. Without
    // bookmarks, so that whatever the stream yields after the outage begins is the outage's.
    let rv = direct.resource_version().unwrap();
    let params = WatchParams::default()
        .fields("metadata.name=pvb-proxied")
        .disable_bookmarks();
    let mut watch = pvbs.watch(&params, &rv).await.unwrap().boxed();
    env.pvbs()
        .patch("pvb-proxied", &patch, &label("c"))
        .await
        .unwrap();
    let event = tokio::time::timeout(Duration::from_secs(10), watch.next())
        .await
        .expect("no event through the proxy's watch");
    match event {
        Some(Ok(WatchEvent::Modified(p))) => {
            assert_eq!(p.labels().get("proxied").map(String::as_str), Some("c"))
        }
        other => panic!("the watch delivered {other:?}"),
    }
    proxy.set_down(true);
    let cut = tokio::time::timeout(Duration::from_secs(10), watch.next())
        .await
        .expect("the outage left the watch open");
    assert!(
        !matches!(cut, Some(Ok(_))),
        "an event during the outage: {cut:?}"
    );
    assert!(answer(get().await).starts_with("no answer"));
    proxy.set_down(false);
    assert_eq!(answer(get().await), "ok");
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conflict_storm_on_status_writes() {
    let mut env = Env::new(Flavour::Velero).await;
    let proxy = env.fault_proxy().await;
    let (pod, dirs) = env.create_pod("storm-pod", NODE, &["data"]).await;
    let total = Env::fill(&dirs["data"], &[("a.bin", 20 << 20)]);
    let mut agent = env.start_agent(NODE, &[]);
    agent.wait_ready(LONG).await;
    proxy.conflict_next(
        RequestMatch::any()
            .verb("patch")
            .resource("podvolumebackups"),
        25,
    );
    env.create_pvb("pvb-storm", &pod, "data", NODE).await;
    let done = env
        .wait_pvb(
            "pvb-storm",
            &[Phase::Completed, Phase::Failed, Phase::Canceled],
            LONG,
        )
        .await;
    let st = status(&done);
    assert_eq!(st.phase, Some(Phase::Completed), "{st:?}\n{}", agent.logs());
    assert_eq!(progress_of(&done), (total as i64, total as i64));
    let conflicts = proxy
        .request_log()
        .iter()
        .filter(|r| r.status == 409)
        .count();
    assert!(conflicts >= 20, "the storm happened: {conflicts} conflicts");
    env.cleanup().await;
}

async fn partial_backup(partial_as_completed: bool) {
    use std::os::unix::fs::PermissionsExt;
    let env = Env::new(Flavour::Velero).await;
    let (pod, dirs) = env.create_pod("partial-pod", NODE, &["data"]).await;
    Env::fill(&dirs["data"], &[("ok.bin", 1 << 20), ("secret.txt", 100)]);
    std::fs::set_permissions(
        dirs["data"].join("secret.txt"),
        std::fs::Permissions::from_mode(0o000),
    )
    .unwrap();
    let nobody = env.nobody_restic();
    let mut args = vec![format!("--restic-binary={}", nobody.display())];
    if partial_as_completed {
        args.push("--partial-as-completed".into());
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut agent = env.start_agent(NODE, &args);
    agent.wait_ready(LONG).await;
    env.create_pvb("pvb-partial", &pod, "data", NODE).await;
    let done = env
        .wait_pvb(
            "pvb-partial",
            &[Phase::Completed, Phase::Failed, Phase::Canceled],
            LONG,
        )
        .await;
    let st = status(&done);
    let want = if partial_as_completed {
        Phase::Completed
    } else {
        Phase::Failed
    };
    assert_eq!(st.phase, Some(want), "{st:?}\n{}", agent.logs());
    let id = st.snapshot_id.clone().unwrap_or_default();
    assert!(!id.is_empty(), "the snapshot ID is kept");
    let msg = st.message.clone().unwrap_or_default();
    assert!(
        msg.contains("1 item could not be read") && msg.contains("secret.txt"),
        "{msg}"
    );
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exit_3_keeps_the_snapshot_and_fails_naming_the_items() {
    partial_backup(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exit_3_with_partial_as_completed() {
    partial_backup(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_volume_completes_like_velero() {
    let env = Env::new(Flavour::Velero).await;
    let (pod, _dirs) = env.create_pod("empty-pod", NODE, &["data"]).await;
    let mut agent = env.start_agent(NODE, &[]);
    agent.wait_ready(LONG).await;
    env.create_pvb("pvb-empty", &pod, "data", NODE).await;
    let done = env
        .wait_pvb(
            "pvb-empty",
            &[Phase::Completed, Phase::Failed, Phase::Canceled],
            LONG,
        )
        .await;
    let st = status(&done);
    assert_eq!(st.phase, Some(Phase::Completed), "{st:?}\n{}", agent.logs());
    assert_eq!(st.snapshot_id.as_deref(), Some(""));
    assert_eq!(
        st.message.as_deref(),
        Some("volume was empty so no snapshot was taken")
    );
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_volume_names_and_escaping_symlinks_are_refused() {
    let env = Env::new(Flavour::Velero).await;
    let (pod, dirs) = env.create_pod("hostile-pod", NODE, &["data", "link"]).await;
    Env::fill(&dirs["data"], &[("a", 10)]);
    // The "link" volume's directory is a symlink to a secret place outside the pods dir.
    let outside = env.tmp.path().join("outside-secret");
    std::fs::create_dir_all(&outside).unwrap();
    std::fs::write(outside.join("shadow"), "root:x").unwrap();
    std::fs::remove_dir(&dirs["link"]).unwrap();
    std::os::unix::fs::symlink(&outside, &dirs["link"]).unwrap();
    let mut agent = env.start_agent(NODE, &[]);
    agent.wait_ready(LONG).await;
    env.create_pvb("pvb-dotdot", &pod, "../../../etc", NODE)
        .await;
    env.create_pvb("pvb-link", &pod, "link", NODE).await;
    for name in ["pvb-dotdot", "pvb-link"] {
        let done = env
            .wait_pvb(
                name,
                &[Phase::Completed, Phase::Failed, Phase::Canceled],
                LONG,
            )
            .await;
        let st = status(&done);
        assert_eq!(st.phase, Some(Phase::Failed), "{name}: {st:?}");
        let msg = st.message.clone().unwrap_or_default();
        assert!(msg.contains("cannot locate volume"), "{name}: {msg}");
        assert!(st.snapshot_id.as_deref().unwrap_or("").is_empty());
    }
    assert!(
        env.restic_snapshots().is_empty(),
        "nothing may have been backed up"
    );
    env.cleanup().await;
}

/// An agent on `NODE` and a completed backup of `files` in the volume `data` of a pod there:
/// the agent, the volume's directories, the snapshot ID and the bytes backed up.
async fn backed_up(
    env: &Env,
    files: &[(&str, usize)],
) -> (
    Agent,
    std::collections::BTreeMap<String, std::path::PathBuf>,
    String,
    u64,
) {
    let (src_pod, src) = env.create_pod("src-pod", NODE, &["data"]).await;
    let total = Env::fill(&src["data"], files);
    let mut agent = env.start_agent(NODE, &[]);
    agent.wait_ready(LONG).await;
    env.create_pvb("pvb-src", &src_pod, "data", NODE).await;
    let b = env
        .wait_pvb("pvb-src", &[Phase::Completed, Phase::Failed], LONG)
        .await;
    assert_eq!(
        status(&b).phase,
        Some(Phase::Completed),
        "{:?}\n{}",
        b.status,
        agent.logs()
    );
    let id = status(&b).snapshot_id.clone().unwrap();
    (agent, src, id, total)
}

/// As Velero's agent: a restore starts only once the restore helper init container of the
/// target pod runs (its volumes are mounted then); the agent looks again without a pod watch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restore_waits_for_the_restore_helper_to_run() {
    let env = Env::new(Flavour::Velero).await;
    let (agent, src, id, _) = backed_up(&env, &[("a.bin", 3 << 20), ("d/b.txt", 77)]).await;
    let (dst_pod, dst) = env.create_pod_with("dst-pod", NODE, &["data"], true).await;
    let restore = env.create_restore("r-wait").await;
    env.create_pvr("pvr-wait", &dst_pod, "data", &id, &restore)
        .await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    let waiting = env.pvrs().get("pvr-wait").await.unwrap();
    assert!(
        waiting.status.is_none(),
        "started before the helper ran: {:?}",
        waiting.status
    );
    assert!(!dst["data"].join("a.bin").exists());
    env.restore_helper_running("dst-pod").await;
    let r = env
        .wait_pvr(
            "pvr-wait",
            &[Phase::Completed, Phase::Failed, Phase::Canceled],
            LONG,
        )
        .await;
    let st = r.status.clone().unwrap();
    assert_eq!(st.phase, Some(Phase::Completed), "{st:?}\n{}", agent.logs());
    assert_eq!(
        std::fs::read(src["data"].join("d/b.txt")).unwrap(),
        std::fs::read(dst["data"].join("d/b.txt")).unwrap()
    );
    assert!(dst["data"].join(".velero").join(&restore.uid).exists());
    env.cleanup().await;
}

/// The restore side of the attempts limit: a restore whose every run was interrupted by an
/// agent restart is failed with the cause, and nothing is written into the volume, although
/// its snapshot is there and a run would succeed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_interrupted_max_attempts_times_is_failed_not_started_again() {
    let env = Env::new(Flavour::Velero).await;
    let (mut agent, _, id, _) = backed_up(&env, &[("a.bin", 1 << 20)]).await;
    agent.signal(Signal::SIGTERM);
    agent.wait(Duration::from_secs(10));
    let (dst_pod, dst) = env.create_pod("dst-pod", NODE, &["data"]).await;
    let restore = env.create_restore("r-attempts").await;
    env.create_pvr("pvr-attempts", &dst_pod, "data", &id, &restore)
        .await;
    set_attempts(&env.pvrs(), "pvr-attempts", 2).await;
    let mut agent = env.start_agent(NODE, &["--max-attempts=2"]);
    agent.wait_ready(LONG).await;
    let r = env
        .wait_pvr(
            "pvr-attempts",
            &[Phase::Completed, Phase::Failed, Phase::Canceled],
            LONG,
        )
        .await;
    let st = r.status.clone().unwrap();
    assert_eq!(st.phase, Some(Phase::Failed), "{st:?}\n{}", agent.logs());
    let message = st.message.clone().unwrap_or_default();
    assert!(
        message.contains("the restore was started 2 times")
            && message.contains("interrupted by a node agent restart"),
        "{message}"
    );
    assert_eq!(
        r.annotations()
            .get("podvolume-agent.io/attempts")
            .map(String::as_str),
        Some("2")
    );
    assert!(!dst["data"].join("a.bin").exists());
    assert!(!dst["data"].join(".velero").exists());
    assert!(env.uploader_processes().is_empty());
    env.cleanup().await;
}

async fn restore_into_another_pod(flavour: Flavour) {
    let env = Env::new(flavour).await;
    let (agent, src, id, total) = backed_up(
        &env,
        &[("big.bin", 40 << 20), ("d/x.txt", 123), ("d/e/y.txt", 4567)],
    )
    .await;
    let (dst_pod, dst) = env.create_pod("dst-pod", NODE, &["data"]).await;
    let (far_pod, _) = env.create_pod("far-pod", OTHER_NODE, &["data"]).await;
    let far_restore = env.create_restore("r-far").await;
    env.create_pvr("pvr-far", &far_pod, "data", &id, &far_restore)
        .await;
    let restore = env.create_restore("r1").await;
    env.create_pvr("pvr-1", &dst_pod, "data", &id, &restore)
        .await;
    let r = env
        .wait_pvr(
            "pvr-1",
            &[Phase::Completed, Phase::Failed, Phase::Canceled],
            LONG,
        )
        .await;
    let st = r.status.clone().unwrap();
    assert_eq!(st.phase, Some(Phase::Completed), "{st:?}\n{}", agent.logs());
    // Velero <= 1.16's PodVolumeRestore status has no node (the API server prunes it).
    if env.flavour.all_phases() {
        assert_eq!(st.node.as_deref(), Some(NODE));
    }
    let p = st.progress.unwrap();
    assert_eq!((p.bytes_done, p.total_bytes), (total as i64, total as i64));
    for f in ["big.bin", "d/x.txt", "d/e/y.txt"] {
        assert_eq!(
            std::fs::read(src["data"].join(f)).unwrap(),
            std::fs::read(dst["data"].join(f)).unwrap(),
            "{f}"
        );
    }
    let done_dir = dst["data"].join(".velero");
    let entries: Vec<_> = std::fs::read_dir(&done_dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(entries, vec![std::ffi::OsString::from(&restore.uid)]);
    // The restore for a pod on another node is not touched.
    let far = env.pvrs().get("pvr-far").await.unwrap();
    assert!(far.status.is_none(), "{:?}", far.status);
    assert_no_refused_writes(&agent).await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restore_into_another_pod_with_the_done_file() {
    restore_into_another_pod(Flavour::Velero).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restore_into_another_pod_on_velero_116_crds() {
    restore_into_another_pod(Flavour::Velero116).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrency_one_runs_oldest_first() {
    let env = Env::new(Flavour::Velero).await;
    let (pod, dirs) = env.create_pod("conc-pod", NODE, &["a", "b"]).await;
    Env::fill(&dirs["a"], &[("x.bin", 20 << 20)]);
    Env::fill(&dirs["b"], &[("y.bin", 1 << 20)]);
    let slow = env.slow_restic(2000);
    let mut agent = env.start_agent(
        NODE,
        &[
            &format!("--restic-binary={}", slow.display()),
            "--concurrency=1",
        ],
    );
    agent.wait_ready(LONG).await;
    env.create_pvb("pvb-first", &pod, "a", NODE).await;
    tokio::time::sleep(Duration::from_millis(1100)).await;
    env.create_pvb("pvb-second", &pod, "b", NODE).await;
    let first = env
        .wait_pvb("pvb-first", &[Phase::InProgress, Phase::Completed], LONG)
        .await;
    let second = env
        .wait_pvb(
            "pvb-second",
            &[Phase::Accepted, Phase::InProgress, Phase::Completed],
            LONG,
        )
        .await;
    if status(&first).phase == Some(Phase::InProgress) {
        assert_eq!(
            status(&second).phase,
            Some(Phase::Accepted),
            "second must wait for the slot"
        );
    }
    let first = env.wait_pvb("pvb-first", &[Phase::Completed], LONG).await;
    let second = env.wait_pvb("pvb-second", &[Phase::Completed], LONG).await;
    let t1 = status(&first).completion_timestamp.clone().unwrap().0;
    let t2 = status(&second).start_timestamp.clone().unwrap().0;
    assert!(t2 >= t1, "second started before the first finished");
    env.cleanup().await;
}

/// A free loopback port.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// restic's REST server (`rclone serve restic`) on loopback.
fn rest_server(dir: &std::path::Path, port: u16) -> std::process::Child {
    std::process::Command::new("rclone")
        .args(["serve", "restic", "--addr", &format!("127.0.0.1:{port}")])
        .arg(dir)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("rclone is installed (.ci/run installs it)")
}

async fn wait_port(port: u16) {
    for _ in 0..100 {
        if tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("nothing listens on {port}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_repository_backup_and_server_stopped_mid_backup() {
    let env = Env::new(Flavour::Velero).await;
    let port = free_port();
    let store = env.tmp.path().join("rest-store");
    std::fs::create_dir_all(&store).unwrap();
    let mut server = rest_server(&store, port);
    wait_port(port).await;
    let repo = format!("rest:http://127.0.0.1:{port}/");
    let (pod, dirs) = env.create_pod("remote-pod", NODE, &["data", "big"]).await;
    let total = Env::fill(&dirs["data"], &[("a.bin", 5 << 20), ("b.txt", 777)]);
    Env::fill(&dirs["big"], &[("c.bin", 40 << 20)]);
    let slow = env.slow_restic(500);
    let mut agent = env.start_agent(NODE, &[&format!("--restic-binary={}", slow.display())]);
    agent.wait_ready(LONG).await;
    let spec = serde_json::json!({"repoIdentifier": repo});
    // A backup through the REST server completes (the repository is created on first use).
    env.create_pvb_with(
        "pvb-remote",
        &pod,
        "data",
        NODE,
        serde_json::json!({}),
        spec.clone(),
    )
    .await;
    let done = env
        .wait_pvb("pvb-remote", &[Phase::Completed, Phase::Failed], LONG)
        .await;
    assert_eq!(
        status(&done).phase,
        Some(Phase::Completed),
        "{:?}\n{}",
        done.status,
        agent.logs()
    );
    assert_eq!(progress_of(&done), (total as i64, total as i64));
    // Then the server goes away in the middle of a backup: a clear failure, the agent healthy.
    env.create_pvb_with(
        "pvb-remote-down",
        &pod,
        "big",
        NODE,
        serde_json::json!({}),
        spec,
    )
    .await;
    let deadline = std::time::Instant::now() + LONG;
    loop {
        let p = env.pvbs().get("pvb-remote-down").await.unwrap();
        if p.status.as_ref().and_then(|s| s.phase) == Some(Phase::InProgress) {
            break;
        }
        assert!(std::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    server.kill().unwrap();
    server.wait().unwrap();
    let failed = env
        .wait_pvb(
            "pvb-remote-down",
            &[Phase::Completed, Phase::Failed, Phase::Canceled],
            Duration::from_secs(300),
        )
        .await;
    let st = status(&failed);
    assert_eq!(st.phase, Some(Phase::Failed), "{st:?}");
    let msg = st.message.clone().unwrap_or_default();
    assert!(
        msg.contains("connection refused") || msg.contains("unable to"),
        "not a clear cause: {msg}"
    );
    assert_eq!(agent.http_get("/livez").await.map(|r| r.0), Some(200));
    assert_eq!(agent.http_get("/readyz").await.map(|r| r.0), Some(200));
    // The server comes back: the next backup of the same repository works (the lock the killed
    // run could not remove is not exclusive and does not block it).
    let mut server = rest_server(&store, port);
    wait_port(port).await;
    env.create_pvb_with(
        "pvb-remote-again",
        &pod,
        "data",
        NODE,
        serde_json::json!({}),
        serde_json::json!({"repoIdentifier": repo}),
    )
    .await;
    let again = env
        .wait_pvb("pvb-remote-again", &[Phase::Completed, Phase::Failed], LONG)
        .await;
    assert_eq!(
        status(&again).phase,
        Some(Phase::Completed),
        "{:?}",
        again.status
    );
    server.kill().unwrap();
    server.wait().unwrap();
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_saved_during_an_outage_is_reported_after_a_restart_without_rerunning() {
    let mut env = Env::new(Flavour::Velero).await;
    let proxy = env.fault_proxy().await;
    let (pod, dirs) = env.create_pod("saved-pod", NODE, &["data"]).await;
    Env::fill(&dirs["data"], &[("a.bin", 8 << 20)]);
    let mut agent = env.start_agent(NODE, &[]);
    agent.wait_ready(LONG).await;
    env.create_pvb("pvb-saved", &pod, "data", NODE).await;
    env.wait_pvb("pvb-saved", &[Phase::InProgress, Phase::Completed], LONG)
        .await;
    // The API server goes down before the result can be written; the backup finishes meanwhile.
    proxy.set_down(true);
    let state = env.tmp.path().join(format!("state-{NODE}/results"));
    let deadline = std::time::Instant::now() + LONG;
    while std::fs::read_dir(&state).map(|d| d.count()).unwrap_or(0) == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "no saved result\n{}",
            agent.logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.wait(Duration::from_secs(20)), Some(0));
    let snapshots_before = env.restic_snapshots().len();
    proxy.set_down(false);
    let mut agent2 = env.start_agent(NODE, &[]);
    agent2.wait_ready(LONG).await;
    let done = env
        .wait_pvb("pvb-saved", &[Phase::Completed, Phase::Failed], LONG)
        .await;
    assert_eq!(
        status(&done).phase,
        Some(Phase::Completed),
        "{:?}",
        done.status
    );
    assert_eq!(
        env.restic_snapshots().len(),
        snapshots_before,
        "the backup was run again"
    );
    assert_eq!(snapshots_before, 1);
    env.cleanup().await;
}

#[test]
fn restic_under_test_is_the_requested_version() {
    assert_requested_version();
}

/// The second backup of a claim, from another pod (so another path, where restic would find no
/// parent by itself), uses the first backup's snapshot as its parent: the agent found it with a
/// `velero.io/pvc-uid` list, though its watch cache holds only this node's objects. A backup of
/// another claim finished in between is not chosen. restic records the parent in the snapshot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn incremental_backup_uses_the_previous_backup_of_the_claim_as_parent() {
    let env = Env::new(Flavour::Velero).await;
    let claim = json!({"velero.io/pvc-uid": "6f1d2c3b-claim-data"});
    let other_claim = json!({"velero.io/pvc-uid": "0a0a0a0a-claim-other"});
    let (first_pod, first_dirs) = env.create_pod("db-0", NODE, &["data"]).await;
    Env::fill(
        &first_dirs["data"],
        &[("table.bin", 300_000), ("log.bin", 50_000)],
    );
    let mut agent = env.start_agent(NODE, &[]);
    agent.wait_ready(LONG).await;
    let ended = [Phase::Completed, Phase::Failed, Phase::Canceled];

    env.create_pvb_with(
        "pvb-first",
        &first_pod,
        "data",
        NODE,
        claim.clone(),
        json!({}),
    )
    .await;
    let first = env.wait_pvb("pvb-first", &ended, LONG).await;
    assert_eq!(
        status(&first).phase,
        Some(Phase::Completed),
        "{}",
        agent.logs()
    );
    let first_snapshot = status(&first).snapshot_id.clone().unwrap();

    let (other_pod, other_dirs) = env.create_pod("cache-0", NODE, &["data"]).await;
    Env::fill(&other_dirs["data"], &[("c.bin", 10_000)]);
    env.create_pvb_with(
        "pvb-other",
        &other_pod,
        "data",
        NODE,
        other_claim,
        json!({}),
    )
    .await;
    let other = env.wait_pvb("pvb-other", &ended, LONG).await;
    assert_eq!(
        status(&other).phase,
        Some(Phase::Completed),
        "{}",
        agent.logs()
    );

    // The claim's pod was replaced: the same data under a new pod UID, plus one new file.
    let (second_pod, second_dirs) = env.create_pod("db-0-new", NODE, &["data"]).await;
    Env::fill(
        &second_dirs["data"],
        &[("table.bin", 300_000), ("log.bin", 50_000)],
    );
    std::fs::write(second_dirs["data"].join("new.txt"), b"appended").unwrap();
    env.create_pvb_with("pvb-second", &second_pod, "data", NODE, claim, json!({}))
        .await;
    let second = env.wait_pvb("pvb-second", &ended, LONG).await;
    assert_eq!(
        status(&second).phase,
        Some(Phase::Completed),
        "{}",
        agent.logs()
    );
    let second_snapshot = status(&second).snapshot_id.clone().unwrap();

    let snapshots = env.restic_snapshots();
    let find = |id: &str| {
        snapshots
            .iter()
            .find(|s| s["id"].as_str().is_some_and(|full| full.starts_with(id)))
            .unwrap_or_else(|| panic!("snapshot {id} not in {snapshots:?}"))
            .clone()
    };
    let first_full = find(&first_snapshot)["id"].as_str().unwrap().to_string();
    let second = find(&second_snapshot);
    assert_eq!(
        second["parent"].as_str(),
        Some(first_full.as_str()),
        "the second backup's parent: {second}\n{}",
        agent.logs()
    );
    env.cleanup().await;
}
