//! The engine driving kopia, end to end: connect/create, snapshot, restore, failures, cancel.
//!
//! kopia cannot be installed where this project is built, so `testdata/kopia/fake-kopia` (a bash
//! test double, see `testdata/kopia/README.md`) stands in for it. What passes here proves the
//! engine agrees with *our model* of kopia (its messages, its cancel behaviour), not with kopia.
//! The double is paced by `FAKE_KOPIA_STEP_SECONDS` and reports its own and its grandchild's pid
//! through `FAKE_KOPIA_PIDS_FILE`, which is how these tests check that nothing outlives a run.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use podvolume_agent::engine::{BackupRequest, Engine, EngineConfig, RestoreRequest};
use podvolume_agent::operation::Operation;
use podvolume_agent::progress::OperationProgress;
use podvolume_agent::uploader::restic::BackupOptions;
use podvolume_agent::uploader::{OutcomeKind, RepositoryAccess, UploaderKind};

const TIMEOUT: Duration = Duration::from_secs(60);

fn fake_kopia() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata/kopia/fake-kopia")
}

fn kopia_engine(update_interval: Duration, cancel_grace: Duration, init: bool) -> Arc<Engine> {
    Engine::new(EngineConfig {
        kopia_binary: fake_kopia(),
        // Never run restic by accident.
        restic_binary: "/nonexistent/restic".into(),
        update_interval,
        cancel_grace,
        init_missing_repository: init,
        lock_wait: Duration::ZERO,
        ..EngineConfig::default()
    })
}

/// The bed's access with knobs for the double; every run appends its pids to `pids.txt`.
fn access(bed: &Bed, knobs: &[(&str, &str)]) -> RepositoryAccess {
    let mut a = bed.access();
    a.extra_env = knobs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    a.extra_env.push((
        "FAKE_KOPIA_PIDS_FILE".into(),
        pids_file(bed).display().to_string(),
    ));
    // A leaked grandchild must not outlive the test run by much.
    a.extra_env
        .push(("FAKE_KOPIA_GRANDCHILD_SECONDS".into(), "120".into()));
    a
}

fn pids_file(bed: &Bed) -> PathBuf {
    bed.path().join("pids.txt")
}

/// (kopia pid, grandchild pid) of every `snapshot create|restore` run so far, in order.
fn runs(bed: &Bed) -> Vec<(u32, u32)> {
    let text = std::fs::read_to_string(pids_file(bed)).unwrap_or_default();
    let mut kopia = None;
    let mut out = Vec::new();
    for line in text.lines() {
        match line.split_once(' ') {
            Some(("kopia", p)) => kopia = Some(p.parse().unwrap()),
            Some(("grandchild", p)) => out.push((kopia.take().unwrap(), p.parse().unwrap())),
            _ => panic!("unexpected line in the pids file: {line:?}"),
        }
    }
    out
}

/// `/proc/<pid>/stat` fields after the command name: state, ppid, pgrp, ...
fn stat_fields(pid: u32) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    Some(rest.split_whitespace().map(String::from).collect())
}

/// Running (not gone, not a zombie).
fn alive(pid: u32) -> bool {
    stat_fields(pid).is_some_and(|f| f[0] != "Z" && f[0] != "X")
}

/// Live members of process group `pgid` (the double runs as the leader of its own group, so this
/// is the double, its grandchild and its step sleeps).
fn live_group(pgid: u32) -> Vec<u32> {
    let mut live = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        if let Some(f) = stat_fields(pid)
            && f[0] != "Z"
            && f[0] != "X"
            && f[2] == pgid.to_string()
        {
            live.push(pid);
        }
    }
    live
}

/// Nothing the double started is running: no process mentions the bed in its argv, and neither
/// the double, its grandchild nor any member of its group of any run is alive.
fn assert_nothing_left(bed: &Bed) {
    assert!(
        bed.own_processes().is_empty(),
        "left behind: {:?}",
        bed.own_processes()
    );
    for (kopia, grandchild) in runs(bed) {
        assert!(!alive(kopia), "fake-kopia {kopia} is still running");
        assert!(
            !alive(grandchild),
            "grandchild {grandchild} is still running"
        );
        assert!(
            live_group(kopia).is_empty(),
            "group {kopia} still has {:?}",
            live_group(kopia)
        );
    }
}

fn backup_req(bed: &Bed, access: RepositoryAccess) -> BackupRequest {
    BackupRequest {
        uploader: UploaderKind::Kopia,
        access,
        source: bed.source.clone(),
        options: BackupOptions::default(),
    }
}

fn restore_req(access: RepositoryAccess, id: &str, target: &Path) -> RestoreRequest {
    RestoreRequest {
        uploader: UploaderKind::Kopia,
        access,
        snapshot_id: id.to_string(),
        target: target.to_path_buf(),
        limit_download_kib: None,
        kopia: Default::default(),
    }
}

/// A small tree; returns the real byte size of its files.
fn fill_source(bed: &Bed) -> u64 {
    let files: &[(&str, usize)] = &[
        ("top.bin", 700_000),
        ("dir1/a.dat", 123_457),
        ("dir1/b.dat", 4_321),
        ("dir1/deeper/c.dat", 77_777),
        ("dir2/d.dat", 31_337),
        ("dir2/empty", 0),
    ];
    for (i, (name, n)) in files.iter().enumerate() {
        write_random(&bed.source.join(name), *n, i as u64 + 1);
    }
    files.iter().map(|(_, n)| *n as u64).sum()
}

/// Every distinct progress value the operation published, up to its end.
async fn watch_to_end(op: &Operation) -> Vec<OperationProgress> {
    let mut rx = op.subscribe();
    let mut seen = vec![rx.borrow_and_update().clone()];
    tokio::time::timeout(TIMEOUT, async {
        loop {
            if seen.last().is_some_and(|p| p.completed) {
                break;
            }
            if rx.changed().await.is_err() {
                break;
            }
            seen.push(rx.borrow_and_update().clone());
        }
    })
    .await
    .expect("operation ends in time");
    seen
}

fn assert_progress_invariants(seen: &[OperationProgress]) {
    let mut last = 0;
    for p in seen {
        assert!(
            p.n_completed >= last,
            "nCompleted went down from {last} to {}: {seen:#?}",
            p.n_completed
        );
        assert!(p.n_completed <= p.n_total, "nCompleted > nTotal: {p:?}");
        assert_eq!(p.operation_units, "bytes");
        last = p.n_completed;
    }
}

/// Waits until the snapshot is really under way: the double is running and progress has moved.
async fn wait_for_snapshot_progress(op: &Operation, bed: &Bed) -> (u32, u32) {
    let mut rx = op.subscribe();
    tokio::time::timeout(TIMEOUT, async {
        while rx.borrow_and_update().n_completed == 0 {
            rx.changed().await.expect("progress before the end");
        }
    })
    .await
    .expect("snapshot progress in time");
    assert!(
        !op.is_finished(),
        "ended before the cancel: {:?}",
        op.progress()
    );
    let runs = runs(bed);
    assert_eq!(runs.len(), 1, "one snapshot run: {runs:?}");
    let (kopia, grandchild) = runs[0];
    assert!(alive(kopia) && alive(grandchild), "the double is running");
    // The double leads its own group, with its grandchild in it (what the cancel must kill).
    let group = live_group(kopia);
    assert!(
        group.contains(&kopia) && group.contains(&grandchild),
        "{group:?}"
    );
    (kopia, grandchild)
}

fn snapshots_in_repo(bed: &Bed) -> Vec<String> {
    let mut ids: Vec<String> = std::fs::read_dir(bed.repo.join("snapshots"))
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    ids.sort();
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backup_creates_the_repository_and_reports_exact_monotonic_progress() {
    let bed = Bed::new();
    let total = fill_source(&bed);
    assert!(!bed.repo.exists());
    let engine = kopia_engine(Duration::from_millis(100), Duration::from_secs(10), true);
    let op = engine.backup(backup_req(
        &bed,
        access(&bed, &[("FAKE_KOPIA_STEP_SECONDS", "0.1")]),
    ));
    let seen = watch_to_end(&op).await;
    let outcome = op.wait().await;
    assert_eq!(outcome.kind, OutcomeKind::Success, "{outcome:?}");
    assert_eq!(outcome.exit_code, Some(0));

    // The repository was created on first use, with this password, and holds the snapshot whose
    // id the manifest carried.
    assert!(bed.repo.join(".fake-kopia-repository").is_file());
    assert_eq!(
        std::fs::read_to_string(bed.repo.join(".fake-password")).unwrap(),
        "correct horse battery staple",
        "the password file's trailing newline is not part of the password"
    );
    let id = outcome.snapshot_id.clone().expect("snapshot id");
    assert!(
        id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit()),
        "{id}"
    );
    assert_eq!(snapshots_in_repo(&bed), vec![id.clone()]);
    assert_eq!(
        std::fs::read_to_string(bed.repo.join("snapshots").join(&id)).unwrap(),
        bed.source.canonicalize().unwrap().display().to_string()
    );
    // kopia's config went to the private cache, not to $HOME.
    assert!(bed.cache.join("kopia/repository.config").is_file());

    let summary = outcome.summary.clone().expect("summary");
    assert_eq!(summary.total_bytes, total);
    assert_eq!(summary.total_files, 6);
    assert!(outcome.message.contains(&id), "{}", outcome.message);

    assert_progress_invariants(&seen);
    let last = seen.last().unwrap();
    assert!(last.completed && last.err.is_empty(), "{last:?}");
    assert_eq!((last.n_completed, last.n_total), (total, total));
    let intermediate = seen
        .iter()
        .filter(|p| !p.completed && p.n_completed > 0 && p.n_completed < total)
        .count();
    assert!(intermediate >= 1, "no intermediate progress: {seen:#?}");
    assert_nothing_left(&bed);
}

/// kopia prints sizes as SI strings with one decimal, which may round *up*: 1_260_000 bytes is
/// "1.3 MB", so the last progress frames say "1.3 MB" done of "1.3 MB" and the manifest then says
/// 1_260_000. Were the rounded figure taken as bytes done, nCompleted would go down at the end
/// (1_300_000 -> 1_260_000), against Velero's contract; the parser reads it as its lower bound
/// (1_250_000) instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn progress_never_goes_down_when_kopias_rounded_sizes_overshoot() {
    let bed = Bed::new();
    write_random(&bed.source.join("a.bin"), 1_000_000, 1);
    write_random(&bed.source.join("b.bin"), 260_000, 2);
    let total = 1_260_000;
    let engine = kopia_engine(Duration::from_millis(100), Duration::from_secs(10), true);
    let op = engine.backup(backup_req(
        &bed,
        access(&bed, &[("FAKE_KOPIA_STEP_SECONDS", "0.1")]),
    ));
    let seen = watch_to_end(&op).await;
    let outcome = op.wait().await;
    assert_eq!(outcome.kind, OutcomeKind::Success, "{outcome:?}");
    let last = seen.last().unwrap();
    assert_eq!((last.n_completed, last.n_total), (total, total));
    assert_progress_invariants(&seen);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_repository_is_reported_when_creation_is_off() {
    let bed = Bed::new();
    fill_source(&bed);
    let engine = kopia_engine(Duration::from_millis(100), Duration::from_secs(10), false);
    let op = engine.backup(backup_req(&bed, access(&bed, &[])));
    let outcome = op.wait().await;
    assert_eq!(outcome.kind, OutcomeKind::RepositoryMissing, "{outcome:?}");
    assert!(
        outcome.message.contains("cannot access storage path"),
        "kopia's words: {}",
        outcome.message
    );
    assert!(!bed.repo.exists(), "the repository must not be created");
    assert!(runs(&bed).is_empty(), "no snapshot was attempted");
    let p = op.progress();
    assert!(p.completed && !p.err.is_empty(), "{p:?}");

    // An existing directory that is not a repository: not initialised, still not created.
    std::fs::create_dir(&bed.repo).unwrap();
    let outcome = engine
        .backup(backup_req(&bed, access(&bed, &[])))
        .wait()
        .await;
    assert_eq!(outcome.kind, OutcomeKind::RepositoryMissing, "{outcome:?}");
    assert!(
        outcome.message.contains("repository not initialized"),
        "{}",
        outcome.message
    );
    assert!(!bed.repo.join(".fake-kopia-repository").exists());
    assert_nothing_left(&bed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_password_is_recognised_with_kopias_words() {
    let bed = Bed::new();
    fill_source(&bed);
    let engine = kopia_engine(Duration::from_millis(100), Duration::from_secs(10), true);
    let fast = [("FAKE_KOPIA_STEP_SECONDS", "0.01")];
    let first = engine
        .backup(backup_req(&bed, access(&bed, &fast)))
        .wait()
        .await;
    assert_eq!(first.kind, OutcomeKind::Success, "{first:?}");
    let before = snapshots_in_repo(&bed);

    let mut wrong = access(&bed, &fast);
    wrong.password_file = bed.access_with_password("not the password").password_file;
    let op = engine.backup(backup_req(&bed, wrong));
    let outcome = op.wait().await;
    assert_eq!(outcome.kind, OutcomeKind::WrongPassword, "{outcome:?}");
    assert!(
        outcome.message.contains("invalid repository password"),
        "{}",
        outcome.message
    );
    assert_eq!(outcome.snapshot_id, None);
    // Neither re-created nor written to.
    assert_eq!(
        std::fs::read_to_string(bed.repo.join(".fake-password")).unwrap(),
        "correct horse battery staple"
    );
    assert_eq!(snapshots_in_repo(&bed), before);
    let p = op.progress();
    assert!(
        p.completed && p.err.contains("invalid repository password"),
        "{p:?}"
    );
    assert_nothing_left(&bed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_mid_snapshot_saves_kopias_partial_snapshot_and_stops_everything() {
    let bed = Bed::new();
    let total = fill_source(&bed);
    let engine = kopia_engine(Duration::from_millis(100), Duration::from_secs(10), true);
    // 20 steps of 0.5 s: ~10 s of snapshot unless canceled.
    let op = engine.backup(backup_req(
        &bed,
        access(
            &bed,
            &[
                ("FAKE_KOPIA_STEP_SECONDS", "0.5"),
                ("FAKE_KOPIA_STEPS", "20"),
            ],
        ),
    ));
    let (kopia, _grandchild) = wait_for_snapshot_progress(&op, &bed).await;
    let outcome = tokio::time::timeout(TIMEOUT, op.cancel()).await.unwrap();
    assert_eq!(outcome.kind, OutcomeKind::Canceled, "{outcome:?}");
    // kopia handled the SIGINT itself (no SIGKILL was needed): exit 0 and an incomplete manifest,
    // which is named but not returned as the result.
    assert_eq!(outcome.exit_code, Some(0), "{outcome:?}");
    assert_eq!(
        outcome.snapshot_id, None,
        "an incomplete snapshot is no result"
    );
    let saved = snapshots_in_repo(&bed);
    assert_eq!(saved.len(), 1, "the double saved its partial snapshot");
    assert!(
        outcome.message.contains(&saved[0]) && outcome.message.contains("incomplete: canceled"),
        "{}",
        outcome.message
    );
    assert!(
        outcome.summary.as_ref().unwrap().total_bytes < total,
        "{outcome:?}"
    );

    assert_nothing_left(&bed);
    assert!(!alive(kopia));
    let p = op.progress();
    assert!(p.completed && !p.err.is_empty(), "{p:?}");
    assert!(p.n_completed < total, "{p:?}");
    // Idempotent, and a no-op after the end.
    let again = op.cancel().await;
    assert_eq!(again.kind, OutcomeKind::Canceled);
    assert_eq!(snapshots_in_repo(&bed).len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_escalates_to_sigkill_when_kopia_ignores_signals() {
    let bed = Bed::new();
    fill_source(&bed);
    let grace = Duration::from_secs(1);
    let engine = kopia_engine(Duration::from_millis(100), grace, true);
    let op = engine.backup(backup_req(
        &bed,
        access(
            &bed,
            &[
                ("FAKE_KOPIA_STEP_SECONDS", "0.5"),
                ("FAKE_KOPIA_STEPS", "60"),
                ("FAKE_KOPIA_IGNORE_SIGNALS", "1"),
            ],
        ),
    ));
    let (kopia, grandchild) = wait_for_snapshot_progress(&op, &bed).await;
    let started = Instant::now();
    let outcome = tokio::time::timeout(TIMEOUT, op.cancel()).await.unwrap();
    let took = started.elapsed();
    assert_eq!(outcome.kind, OutcomeKind::Canceled, "{outcome:?}");
    // Killed, not exited: it ignored SIGINT for the whole grace period.
    assert_eq!(outcome.exit_code, None, "{outcome:?}");
    assert!(
        took >= grace - Duration::from_millis(100),
        "SIGKILL came before the grace period ended: {took:?}"
    );
    assert!(snapshots_in_repo(&bed).is_empty(), "no snapshot was saved");
    assert!(!alive(kopia), "fake-kopia {kopia} survived");
    assert!(!alive(grandchild), "grandchild {grandchild} survived");
    assert_nothing_left(&bed);
    let p = op.progress();
    assert!(p.completed && !p.err.is_empty(), "{p:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreadable_entries_give_a_partial_outcome_with_the_snapshot_and_the_items() {
    let bed = Bed::new();
    let total = fill_source(&bed);
    let engine = kopia_engine(Duration::from_millis(100), Duration::from_secs(10), true);
    let op = engine.backup(backup_req(
        &bed,
        access(
            &bed,
            &[
                ("FAKE_KOPIA_STEP_SECONDS", "0.05"),
                ("FAKE_KOPIA_UNREADABLE", "dir1/b.dat:dir2/d.dat"),
            ],
        ),
    ));
    let outcome = op.wait().await;
    assert_eq!(outcome.kind, OutcomeKind::Partial, "{outcome:?}");
    assert_eq!(outcome.exit_code, Some(1));
    let id = outcome.snapshot_id.clone().expect("the snapshot is kept");
    assert_eq!(snapshots_in_repo(&bed), vec![id.clone()]);
    assert_eq!(outcome.failed_items, 2, "{outcome:?}");
    let names: Vec<&str> = outcome
        .first_failed_items
        .iter()
        .map(|i| i.item.as_str())
        .collect();
    assert_eq!(names, ["dir1/b.dat", "dir2/d.dat"]);
    assert!(
        outcome.first_failed_items[0]
            .message
            .contains("permission denied"),
        "{outcome:?}"
    );
    assert!(
        outcome.message.contains(&id) && outcome.message.contains("dir1/b.dat"),
        "{}",
        outcome.message
    );
    let p = op.progress();
    assert!(p.completed && !p.err.is_empty(), "{p:?}");
    assert_eq!((p.n_completed, p.n_total), (total, total));
    assert_nothing_left(&bed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restore_into_another_directory_is_identical_with_progress() {
    let bed = Bed::new();
    let total = fill_source(&bed);
    assert_eq!(total, 936_892);
    let engine = kopia_engine(Duration::from_millis(100), Duration::from_secs(10), true);
    let knobs = [("FAKE_KOPIA_STEP_SECONDS", "0.1")];
    let backup = engine
        .backup(backup_req(&bed, access(&bed, &knobs)))
        .wait()
        .await;
    assert_eq!(backup.kind, OutcomeKind::Success, "{backup:?}");
    let id = backup.snapshot_id.clone().unwrap();

    let target = bed.path().join("restored");
    std::fs::create_dir(&target).unwrap();
    let op = engine.restore(restore_req(access(&bed, &knobs), &id, &target));
    let seen = watch_to_end(&op).await;
    let outcome = op.wait().await;
    assert_eq!(outcome.kind, OutcomeKind::Success, "{outcome:?}");
    assert_eq!(outcome.exit_code, Some(0));
    assert_same_tree(&bed.source, &target);
    assert!(target.join("dir2/empty").is_file());

    assert_progress_invariants(&seen);
    let last = seen.last().unwrap();
    assert!(last.completed && last.err.is_empty(), "{last:?}");
    // kopia prints sizes only rounded; the final figure is measured on the target instead: exact.
    assert_eq!((last.n_completed, last.n_total), (total, total), "{last:?}");
    let summary = outcome.summary.clone().expect("summary");
    assert_eq!(summary.total_bytes, total);
    assert_eq!(
        summary.total_files, 6,
        "from kopia's `Restored 6 files` line"
    );
    assert_eq!(outcome.message, "restore completed: 914.9 KiB in 6 files");
    // In flight, kopia's rounded figures are read as lower bounds: never above the real size, so
    // the exact final value is at least every intermediate one.
    for p in &seen {
        assert!(
            p.n_completed <= last.n_completed && p.n_total <= total,
            "{p:?} overshoots the {total}-byte snapshot"
        );
    }
    let intermediate = seen
        .iter()
        .filter(|p| !p.completed && p.n_completed > 0 && p.n_completed < total)
        .count();
    assert!(
        intermediate >= 1,
        "no intermediate restore progress: {seen:#?}"
    );
    assert_eq!(runs(&bed).len(), 2, "one snapshot and one restore run");
    assert_nothing_left(&bed);

    // An unknown snapshot fails with kopia's words.
    let other = bed.path().join("other");
    std::fs::create_dir(&other).unwrap();
    let outcome = engine
        .restore(restore_req(
            access(&bed, &knobs),
            "0123456789abcdef",
            &other,
        ))
        .wait()
        .await;
    assert_eq!(outcome.kind, OutcomeKind::Failed, "{outcome:?}");
    assert!(
        outcome.message.contains("manifest not found"),
        "{}",
        outcome.message
    );
    assert_nothing_left(&bed);
}

/// The restored size is what the restore added under the target: files already there and files
/// reached through symlinks are not counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restored_size_excludes_what_the_target_already_held() {
    let bed = Bed::new();
    let total = fill_source(&bed);
    let engine = kopia_engine(Duration::from_millis(100), Duration::from_secs(10), true);
    let knobs = [("FAKE_KOPIA_STEP_SECONDS", "0.05")];
    let backup = engine
        .backup(backup_req(&bed, access(&bed, &knobs)))
        .wait()
        .await;
    assert_eq!(backup.kind, OutcomeKind::Success, "{backup:?}");
    let id = backup.snapshot_id.clone().unwrap();

    let target = bed.path().join("restored");
    write_random(&target.join("already/here.bin"), 250_000, 99);
    let elsewhere = bed.path().join("elsewhere");
    write_random(&elsewhere.join("big.bin"), 400_000, 98);
    std::os::unix::fs::symlink(&elsewhere, target.join("link-to-dir")).unwrap();
    std::os::unix::fs::symlink(elsewhere.join("big.bin"), target.join("link-to-file")).unwrap();

    let op = engine.restore(restore_req(access(&bed, &knobs), &id, &target));
    let seen = watch_to_end(&op).await;
    let outcome = op.wait().await;
    assert_eq!(outcome.kind, OutcomeKind::Success, "{outcome:?}");
    assert_same_tree(&bed.source, &target);
    assert_eq!(outcome.summary.as_ref().unwrap().total_bytes, total);
    assert_progress_invariants(&seen);
    let last = seen.last().unwrap();
    assert_eq!((last.n_completed, last.n_total), (total, total), "{last:?}");
    assert_nothing_left(&bed);
}

/// A one-off stand-in for kopia (not the shared double): `repository connect` succeeds, every
/// other command runs `body` (sh code; `$MARK` is a path the test can wait for). Each call is
/// appended to `calls.log` in the bed.
fn scripted_kopia(bed: &Bed, body: &str) -> PathBuf {
    scripted_kopia_connecting(bed, "exit 0", body)
}

/// [`scripted_kopia`] with `connect` (sh code) run for `repository connect`.
fn scripted_kopia_connecting(bed: &Bed, connect: &str, body: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = bed.path().join("scripted-kopia");
    std::fs::write(
        &path,
        format!(
            "#!/bin/sh\nMARK='{}'\necho \"$*\" >> '{}'\nif [ \"$1 $2\" = 'repository connect' ]; then\n{connect}\nfi\n{body}\n",
            bed.path().join("uploader-exited").display(),
            bed.path().join("calls.log").display(),
        ),
    )
    .unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

fn scripted_engine(kopia: PathBuf) -> Arc<Engine> {
    Engine::new(EngineConfig {
        kopia_binary: kopia,
        restic_binary: "/nonexistent/restic".into(),
        update_interval: Duration::from_millis(100),
        cancel_grace: Duration::from_secs(5),
        lock_wait: Duration::ZERO,
        ..EngineConfig::default()
    })
}

/// A cancel that arrives after kopia ended on its own (snapshot saved with unreadable entries,
/// exit 1) stops nothing: the outcome is kopia's, partial with the snapshot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_after_kopia_ended_on_its_own_keeps_its_outcome() {
    let bed = Bed::new();
    fill_source(&bed);
    let kopia = scripted_kopia(
        &bed,
        r#"if [ "$1 $2" = 'snapshot create' ]; then
echo 'Error when processing "dir1/b.dat": open dir1/b.dat: permission denied' >&2
echo '{"id":"0123456789abcdef0123456789abcdef","rootEntry":{"summ":{"size":100,"files":2,"numFailed":1,"errors":[{"path":"dir1/b.dat","error":"permission denied"}]}}}'
echo 'Found 1 fatal error(s) while snapshotting source.' >&2
(while kill -0 $$ 2>/dev/null; do sleep 0.01; done; touch "$MARK"; sleep 1) &
exit 1
fi
exit 1"#,
    );
    let op = scripted_engine(kopia).backup(backup_req(&bed, bed.access()));
    tokio::time::timeout(TIMEOUT, async {
        while !bed.path().join("uploader-exited").exists() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the scripted kopia exits");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!op.is_finished(), "ended before its pipes closed");
    let outcome = op.cancel().await;
    assert_eq!(outcome.kind, OutcomeKind::Partial, "{outcome:?}");
    assert_eq!(
        outcome.snapshot_id.as_deref(),
        Some("0123456789abcdef0123456789abcdef")
    );
    assert_ne!(op.progress().err, "canceled");
}

/// A snapshot ID from an API object goes to kopia as a positional argument: one that is not a
/// kopia ID (a flag above all) is refused before kopia sees it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_of_a_snapshot_id_that_is_not_one_is_refused() {
    let bed = Bed::new();
    let target = bed.path().join("restored");
    std::fs::create_dir(&target).unwrap();
    let kopia = scripted_kopia(&bed, "exit 0");
    for id in ["--overwrite-files", "-h", "", "k1/../../etc"] {
        let outcome = scripted_engine(kopia.clone())
            .restore(restore_req(bed.access(), id, &target))
            .wait()
            .await;
        assert_eq!(outcome.kind, OutcomeKind::Failed, "{id:?}: {outcome:?}");
        assert!(
            outcome.message.contains("invalid kopia snapshot ID")
                && outcome.message.contains(&format!("{id:?}")),
            "{id:?}: {}",
            outcome.message
        );
    }
    let calls = std::fs::read_to_string(bed.path().join("calls.log")).unwrap();
    assert!(
        calls.lines().all(|l| l.starts_with("repository connect")),
        "kopia ran with a bad ID: {calls}"
    );
}

/// A cancel that arrives after `repository connect` found no repository creates none and
/// reports what kopia said.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_after_kopia_found_no_repository_creates_none() {
    let bed = Bed::new();
    fill_source(&bed);
    let kopia = scripted_kopia_connecting(
        &bed,
        r#"echo 'error connecting to repository: repository not initialized in the provided storage' >&2
(while kill -0 $$ 2>/dev/null; do sleep 0.01; done; touch "$MARK"; sleep 1) &
exit 1"#,
        "exit 0",
    );
    let op = scripted_engine(kopia).backup(backup_req(&bed, bed.access()));
    tokio::time::timeout(TIMEOUT, async {
        while !bed.path().join("uploader-exited").exists() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the scripted kopia exits");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!op.is_finished(), "ended before its pipes closed");
    let outcome = op.cancel().await;
    assert_eq!(outcome.kind, OutcomeKind::RepositoryMissing, "{outcome:?}");
    let calls = std::fs::read_to_string(bed.path().join("calls.log")).unwrap();
    assert!(
        calls.lines().all(|l| !l.starts_with("repository create")),
        "the repository was created after the cancel: {calls}"
    );
}
