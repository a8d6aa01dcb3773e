//! Transfers whose Backup has ended: stopped, never started, and a snapshot made after the end
//! removed (agent::owner). The tests' PodVolumeBackups belong to the Backup `b1` the harness
//! creates (phase New: Velero's server is not running here); each test moves it on as Velero's
//! server would, by writing its phase (Velero's CRDs have no status subresource).

use std::time::Duration;

use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams};
use podvolume_agent::crd::Phase;
use serde_json::json;

use super::harness::*;
use super::{LONG, NODE, backed_up, running_backup_at, status};

async fn set_backup_phase(env: &Env, name: &str, phase: &str) {
    set_phase(env, "Backup", name, phase).await;
}

async fn set_phase(env: &Env, kind: &str, name: &str, phase: &str) {
    let gvk = GroupVersionKind::gvk("velero.io", "v1", kind);
    let api: Api<DynamicObject> =
        Api::namespaced_with(env.client.clone(), &env.ns, &ApiResource::from_gvk(&gvk));
    api.patch(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"phase": phase}})),
    )
    .await
    .unwrap();
}

/// Velero <= 1.17 sets no spec.cancel when a pod-volume timeout ends the Backup: the agent sees
/// the Backup PartiallyFailed at its next interval and stops restic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_backup_whose_backup_ended_is_stopped_and_says_why() {
    let env = Env::new(Flavour::Velero).await;
    let (agent, _) = running_backup_at(&env, "pvb-owner-ended", &[], 300).await;
    set_backup_phase(&env, "b1", "PartiallyFailed").await;
    let done = env
        .wait_pvb(
            "pvb-owner-ended",
            &[Phase::Canceled, Phase::Failed, Phase::Completed],
            LONG,
        )
        .await;
    let st = status(&done);
    assert_eq!(st.phase, Some(Phase::Canceled), "{st:?}\n{}", agent.logs());
    assert!(
        st.message
            .as_deref()
            .unwrap_or("")
            .starts_with("backup b1 ended (PartiallyFailed)"),
        "{:?}",
        st.message
    );
    assert_eq!(
        done.spec.cancel, None,
        "the agent stops it without a cancel request"
    );
    assert!(st.snapshot_id.as_deref().unwrap_or("").is_empty(), "{st:?}");
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
    env.cleanup().await;
}

/// A PodVolumeBackup whose Backup has already failed is not started: no uploader runs, no
/// snapshot is made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_backup_whose_backup_already_failed_is_never_started() {
    let env = Env::new(Flavour::Velero).await;
    set_backup_phase(&env, "b1", "Failed").await;
    let (pod, dirs) = env.create_pod("owner-failed-pod", NODE, &["data"]).await;
    Env::fill(&dirs["data"], &[("a.bin", 1 << 20)]);
    let mut agent = env.start_agent(NODE, &[]);
    agent.wait_ready(LONG).await;
    env.create_pvb("pvb-owner-failed", &pod, "data", NODE).await;
    let done = env
        .wait_pvb(
            "pvb-owner-failed",
            &[Phase::Canceled, Phase::Failed, Phase::Completed],
            LONG,
        )
        .await;
    let st = status(&done);
    assert_eq!(st.phase, Some(Phase::Canceled), "{st:?}\n{}", agent.logs());
    assert_eq!(
        st.message.as_deref(),
        Some("backup b1 ended (Failed) before the backup started")
    );
    assert!(
        env.restic_snapshots().is_empty(),
        "{:?}",
        env.restic_snapshots()
    );
    assert!(
        !agent.logs().contains("starting uploader"),
        "restic was started:\n{}",
        agent.logs()
    );
    env.cleanup().await;
}

/// The race the stop cannot always win: the Backup ends after the agent's last look and the
/// upload then completes. Velero has recorded the volume without this snapshot, so nothing would
/// ever reference or forget it: the agent forgets the snapshot it just made and says so. (An
/// interval of an hour leaves the look at the start as the only one while restic runs.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_completed_after_its_backup_ended_is_removed_from_the_repository() {
    let env = Env::new(Flavour::Velero).await;
    let (pod, dirs) = env.create_pod("owner-race-pod", NODE, &["data"]).await;
    Env::fill(&dirs["data"], &[("a.bin", 30 << 20), ("b.bin", 10 << 20)]);
    // 40 MiB at 4 MiB/s: about 10 s of upload.
    let slow = env.slow_restic(4096);
    let restic = format!("--restic-binary={}", slow.display());
    let mut agent = env.start_agent(NODE, &[&restic, "--update-interval=1h"]);
    agent.wait_ready(LONG).await;
    env.create_pvb("pvb-owner-race", &pod, "data", NODE).await;
    let deadline = std::time::Instant::now() + LONG;
    loop {
        let p = env.pvbs().get("pvb-owner-race").await.unwrap();
        let in_progress = p.status.as_ref().and_then(|s| s.phase) == Some(Phase::InProgress);
        let backing_up = agent
            .logs()
            .lines()
            .any(|l| l.contains("starting uploader") && l.contains(" backup "));
        if in_progress && backing_up {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "never InProgress\n{}",
            agent.logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Past the look the transfer takes as it starts (its interval's first tick).
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        !env.uploader_processes().is_empty(),
        "restic should still be running"
    );
    set_backup_phase(&env, "b1", "PartiallyFailed").await;
    let done = env
        .wait_pvb(
            "pvb-owner-race",
            &[Phase::Canceled, Phase::Failed, Phase::Completed],
            LONG,
        )
        .await;
    let st = status(&done);
    let message = st.message.as_deref().unwrap_or("");
    assert_eq!(st.phase, Some(Phase::Canceled), "{st:?}\n{}", agent.logs());
    assert!(
        message
            .starts_with("backup b1 ended (PartiallyFailed) while the backup ran; the snapshot ")
            && message
                .ends_with(" it made was deleted from the repository (no backup references it)"),
        "{message}\n{}",
        agent.logs()
    );
    assert!(st.snapshot_id.as_deref().unwrap_or("").is_empty(), "{st:?}");
    assert!(
        env.restic_snapshots().is_empty(),
        "the snapshot is still in the repository: {:?}",
        env.restic_snapshots()
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
    tokio::time::sleep(Duration::from_millis(100)).await;
    env.cleanup().await;
}

/// The same for a restore: a PodVolumeRestore whose Restore has already failed writes nothing
/// into the volume.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_whose_restore_already_failed_is_never_started() {
    let env = Env::new(Flavour::Velero).await;
    let (agent, _src, id, _total) = backed_up(&env, &[("a.bin", 1 << 20)]).await;
    let (dst_pod, dst) = env.create_pod("owner-dst-pod", NODE, &["data"]).await;
    let restore = env.create_restore("r-failed").await;
    set_phase(&env, "Restore", "r-failed", "Failed").await;
    env.create_pvr("pvr-owner-failed", &dst_pod, "data", &id, &restore)
        .await;
    let r = env
        .wait_pvr(
            "pvr-owner-failed",
            &[Phase::Completed, Phase::Failed, Phase::Canceled],
            LONG,
        )
        .await;
    let st = r.status.clone().unwrap();
    assert_eq!(st.phase, Some(Phase::Canceled), "{st:?}\n{}", agent.logs());
    assert_eq!(
        st.message.as_deref(),
        Some("restore r-failed ended (Failed) before the restore started")
    );
    assert!(
        !dst["data"].join("a.bin").exists(),
        "the volume was written"
    );
    env.cleanup().await;
}
