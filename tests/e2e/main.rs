//! End-to-end: the agent binary against an API server (the stand-in by default; a real cluster
//! with `PODVOLUME_E2E_KUBECONFIG=<file>`), real restic, real files.
//!
//! Tests that need fault injection (API outage, 409 storm, counting requests) run only against
//! the stand-in and say so when skipped.

mod harness;

use std::time::Duration;

use harness::*;
use nix::sys::signal::Signal;
use podvolume_agent::crd::{Phase, PodVolumeBackup};
use podvolume_testbed::RequestMatch;

const LONG: Duration = Duration::from_secs(120);

fn status(p: &PodVolumeBackup) -> &podvolume_agent::crd::PodVolumeBackupStatus {
    p.status.as_ref().expect("status")
}

fn progress_of(p: &PodVolumeBackup) -> (i64, i64) {
    let pr = status(p).progress.clone().unwrap_or_default();
    (pr.bytes_done, pr.total_bytes)
}

/// Both CRD flavours: a backup shows monotonic intermediate progress and completes with the
/// snapshot restic reports; a PVB of another node costs zero writes.
async fn backup_with_progress(flavour: Flavour) {
    let env = Env::new(flavour).await;
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
    assert!(
        st.completion_timestamp.is_some()
            && st.start_timestamp.is_some()
            && st.accepted_timestamp.is_some()
    );
    assert!(
        st.path.as_deref().is_some_and(|p| p.ends_with("/data")),
        "{:?}",
        st.path
    );
    assert!(
        !done
            .finalizers()
            .iter()
            .any(|f| f == podvolume_agent::crd::FINALIZER),
        "finalizer left on a finished object"
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
    // Another node's object: untouched.
    let other_now = env.pvbs().get("pvb-other").await.unwrap();
    assert_eq!(
        other_now.metadata.resource_version,
        other.metadata.resource_version
    );
    if let Some(s) = env.standin() {
        let writes = s
            .write_log()
            .into_iter()
            .filter(|w| w.info.name.as_deref() == Some("pvb-other"))
            .count();
        assert_eq!(
            writes, 0,
            "the agent wrote to another node's PodVolumeBackup"
        );
    }
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backup_with_progress_velero_crds() {
    backup_with_progress(Flavour::Velero).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backup_with_progress_status_subresource() {
    backup_with_progress(Flavour::Ours).await;
}

use kube::ResourceExt;
