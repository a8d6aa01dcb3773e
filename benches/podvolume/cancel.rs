//! Case 4 (first half): from `Operation::cancel()` to the uploader's whole process group gone,
//! through the engine with the real restic mid-backup.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use podvolume_agent::engine::{BackupRequest, Engine, EngineConfig};
use podvolume_agent::operation::Operation;
use podvolume_agent::uploader::restic::BackupOptions;
use podvolume_agent::uploader::{OutcomeKind, RepositoryAccess, UploaderKind};

use crate::util::{Work, children_of, fmt, gen_large, group_alive, max, median, processes};

/// Waits for the operation's first progress, then half a second (a cancel arrives at any time),
/// cancels it and returns (until its uploader's process group is gone, until `cancel()`
/// returned, the outcome). `uploader`: the process name leading that group.
pub async fn cancel_timed(op: Operation, uploader: &str) -> (Duration, Duration, OutcomeKind) {
    let me = std::process::id();
    let deadline = Instant::now() + Duration::from_secs(120);
    while op.progress().n_completed == 0 {
        assert!(Instant::now() < deadline, "no progress within 120 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let pgid = children_of(me)
        .into_iter()
        .find(|p| {
            processes()
                .iter()
                .any(|q| q.0 == *p && q.4 == uploader && q.2 == *p)
        })
        .unwrap_or_else(|| panic!("{uploader} running in its own process group"));
    let done = Arc::new(AtomicBool::new(false));
    let t0 = Instant::now();
    let watcher = {
        let done = done.clone();
        std::thread::spawn(move || {
            while group_alive(pgid) && !done.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_micros(500));
            }
            t0.elapsed()
        })
    };
    let outcome = op.cancel().await;
    let returned = t0.elapsed();
    done.store(true, Ordering::Relaxed);
    let gone = watcher.join().unwrap();
    assert!(
        !group_alive(pgid),
        "process group {pgid} alive after cancel()"
    );
    (gone, returned, outcome.kind.clone())
}

pub fn run(restic: &Path, work_dir: &Path, runs: usize) -> String {
    let mut work = Work::new(work_dir, restic);
    let data = work_dir.join("data-cancel");
    if !data.join("big-0.bin").exists() {
        gen_large(&data, 1, 256 << 20, 41);
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    let engine = Engine::new(EngineConfig {
        restic_binary: restic.to_path_buf(),
        update_interval: Duration::from_secs(1),
        init_missing_repository: false,
        ..EngineConfig::default()
    });
    let mut gone_ms = Vec::new();
    let mut returned_ms = Vec::new();
    let mut locks_left = 0;
    let mut not_canceled = 0;
    for i in 0..runs {
        let (repo, cache) = work.fresh_repo();
        let req = BackupRequest {
            uploader: UploaderKind::Restic,
            access: RepositoryAccess {
                repository: repo.display().to_string(),
                password_file: work.password_file.clone(),
                cache_dir: cache.clone(),
                extra_env: Vec::new(),
                ..Default::default()
            },
            source: data.clone(),
            options: BackupOptions {
                host: "velero".into(),
                // Slow enough that the backup is surely running when canceled.
                limit_upload_kib: Some(8192),
                ..BackupOptions::default()
            },
        };
        let (gone, returned, kind) =
            rt.block_on(async { cancel_timed(engine.backup(req), "restic").await });
        if kind != OutcomeKind::Canceled {
            not_canceled += 1;
        }
        let locks = std::fs::read_dir(repo.join("locks"))
            .map(|d| d.count())
            .unwrap_or(0);
        if locks > 0 {
            locks_left += 1;
        }
        eprintln!(
            "cancel run {}: group gone after {:?}, cancel() returned after {:?}",
            i + 1,
            gone,
            returned
        );
        gone_ms.push(gone.as_secs_f64() * 1000.0);
        returned_ms.push(returned.as_secs_f64() * 1000.0);
        work.drop_repo(&repo, &cache);
    }
    let mut md = String::from("## 4. Cancel latency\n\n");
    md.push_str(&format!(
        "Engine API, real restic mid-backup (256 MiB source, `--limit-upload 8192`, canceled 0.5 s \
         after the first progress), fresh repository each run, {runs} runs. *group gone*: from the \
         `cancel()` call until no live (non-zombie) process of restic's process group is left, \
         watched through `/proc` every 0.5 ms; *cancel() returned*: until `cancel().await` \
         returns, which includes the `restic unlock` that follows every stop. Outcome other than \
         canceled: {not_canceled}; runs leaving a lock: {locks_left}.\n\n"
    ));
    md.push_str("| measure | p50 ms | max ms |\n|---|---:|---:|\n");
    md.push_str(&format!(
        "| `cancel()` -> process group gone | {} | {} |\n",
        fmt(median(&gone_ms)),
        fmt(max(&gone_ms))
    ));
    md.push_str(&format!(
        "| `cancel()` -> returned (group gone + unlock) | {} | {} |\n\n",
        fmt(median(&returned_ms)),
        fmt(max(&returned_ms))
    ));
    md
}
