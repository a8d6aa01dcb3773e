//! The engine driving the real kopia (the one `PODVOLUME_TEST_KOPIA` names, see
//! `tests/common/kopia_under_test.rs`) on real files: repository creation, snapshots with
//! progress, restores, failures, cancel. `scripts/install-kopia.sh` builds the pinned versions;
//! the suite runs once per version.
//!
//! Some tests run the real binary through a small sh wrapper that `exec`s it (so kopia keeps the
//! wrapper's pid): to record its pid and arguments, to copy its stderr aside, or to run it as
//! `nobody`. Only what a real kopia cannot be made to do on demand uses a stand-in:
//! - a kopia that ignores SIGINT and SIGTERM, so that the stop must escalate to SIGKILL after the
//!   grace period: the bash double `testdata/kopia/fake-kopia` (`FAKE_KOPIA_IGNORE_SIGNALS=1`,
//!   see `testdata/kopia/README.md`);
//! - the races of a cancel that arrives after kopia ended on its own, and of one that arrives
//!   after `repository connect` found no repository: sh scripts that print kopia's own words (as
//!   captured in `testdata/kopia/<version>/`) and keep the output pipes open a moment, so that the
//!   cancel lands exactly in that window.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use podvolume_agent::engine::{BackupRequest, Engine, EngineConfig, RestoreRequest};
use podvolume_agent::framing::{DEFAULT_MAX_FRAME, OwnedFrame, Separators, frame_all};
use podvolume_agent::operation::Operation;
use podvolume_agent::progress::OperationProgress;
use podvolume_agent::text::format_bytes;
use podvolume_agent::uploader::kopia::KopiaParser;
use podvolume_agent::uploader::restic::BackupOptions;
use podvolume_agent::uploader::{
    Direction, OutcomeKind, ProgressSample, RepositoryAccess, UploaderEvent, UploaderKind,
};

const TIMEOUT: Duration = Duration::from_secs(180);

#[test]
fn kopia_under_test() {
    assert_requested_kopia_version();
}

/// An engine running `kopia` (the binary under test or a wrapper around it). The grace period is
/// long: on SIGINT a real kopia first uploads what it has hashed and saves a partial snapshot.
fn kopia_engine(kopia: PathBuf, init: bool) -> Arc<Engine> {
    Engine::new(EngineConfig {
        kopia_binary: kopia,
        // Never run restic by accident.
        restic_binary: "/nonexistent/restic".into(),
        update_interval: Duration::from_millis(100),
        cancel_grace: Duration::from_secs(60),
        init_missing_repository: init,
        lock_wait: Duration::ZERO,
        ..EngineConfig::default()
    })
}

fn real_engine(init: bool) -> Arc<Engine> {
    kopia_engine(kopia_bin().to_path_buf(), init)
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

/// The small tree: six regular files (one empty) in nested directories. Returns their bytes.
const SMALL_TREE: &[(&str, usize)] = &[
    ("top.bin", 700_000),
    ("dir1/a.dat", 123_457),
    ("dir1/b.dat", 4_321),
    ("dir1/deeper/c.dat", 77_777),
    ("dir2/d.dat", 31_337),
    ("dir2/empty", 0),
];

fn fill_small(bed: &Bed) -> u64 {
    for (i, (name, n)) in SMALL_TREE.iter().enumerate() {
        write_random(&bed.source.join(name), *n, i as u64 + 1);
    }
    SMALL_TREE.iter().map(|(_, n)| *n as u64).sum()
}

/// The small tree plus four big files: 200,000,000 bytes of incompressible data in ten regular
/// files, enough for kopia to draw several progress lines (one every 300 ms) and to spend its
/// first second "estimating...".
fn fill_big(bed: &Bed) -> u64 {
    let small = fill_small(bed);
    let big = 200_000_000 - small;
    for (i, name) in ["big/a.bin", "big/b.bin", "big/c.bin", "big/d.bin"]
        .iter()
        .enumerate()
    {
        let n = if i < 3 { big / 4 } else { big - 3 * (big / 4) };
        write_random(&bed.source.join(name), n as usize, 100 + i as u64);
    }
    200_000_000
}

/// Regular files the trees above hold.
fn regular_files(root: &Path) -> u64 {
    let mut n = 0;
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            let t = e.file_type().unwrap();
            if t.is_dir() {
                stack.push(e.path());
            } else if t.is_file() {
                n += 1;
            }
        }
    }
    n
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
    .unwrap_or_else(|_| panic!("the operation did not end within {TIMEOUT:?}"));
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

fn intermediate(seen: &[OperationProgress], total: u64) -> usize {
    seen.iter()
        .filter(|p| !p.completed && p.n_completed > 0 && p.n_completed < total)
        .count()
}

// --- processes ----------------------------------------------------------------------------------

/// A wrapper that appends `<pid> <args>` to `calls.log` in the bed and `exec`s the real kopia.
fn logging_kopia(bed: &Bed) -> PathBuf {
    kopia_wrapper(
        &bed.path().join("logging-kopia"),
        &format!(
            "echo \"$$ $*\" >> '{}'\nexec \"$KOPIA\" \"$@\"",
            bed.path().join("calls.log").display()
        ),
    )
}

/// (pid, argv) of every kopia run through [`logging_kopia`], in order.
fn calls(bed: &Bed) -> Vec<(u32, String)> {
    std::fs::read_to_string(bed.path().join("calls.log"))
        .unwrap_or_default()
        .lines()
        .map(|l| {
            let (pid, args) = l.split_once(' ').unwrap();
            (pid.parse().unwrap(), args.to_string())
        })
        .collect()
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

/// Live members of process group `pgid`.
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

/// No process mentions the bed in its argv (kopia's argv holds the source or target path).
fn assert_no_uploader_left(bed: &Bed) {
    let left = bed.own_processes();
    assert!(left.is_empty(), "left behind: {left:?}");
}

// --- backups ------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backup_creates_the_repository_and_reports_exact_monotonic_progress() {
    let bed = Bed::new();
    // 200 MB of random data can be snapshotted before kopia's first progress frame; 2 GiB of
    // zeros (a sparse file, no disk) keeps it reading and hashing for seconds.
    let sparse: u64 = 2 << 30;
    write_sparse(&bed.source.join("zeros.img"), sparse);
    let total = fill_big(&bed) + sparse;
    let files = regular_files(&bed.source);
    assert!(!bed.repo.exists());
    let op = real_engine(true).backup(backup_req(&bed, bed.access()));
    let seen = watch_to_end(&op).await;
    let outcome = op.wait().await;
    assert_eq!(outcome.kind, OutcomeKind::Success, "{outcome:?}");
    assert_eq!(outcome.exit_code, Some(0));

    // The repository was created on first use, and opens with the bed's password (the password
    // file's trailing newline is not part of it).
    assert!(bed.repo.join("kopia.repository.f").is_file());
    let id = outcome.snapshot_id.clone().expect("snapshot id");
    assert!(
        id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit()),
        "{id}"
    );
    let manifest = bed.kopia_inspector().snapshot(&id);
    assert_eq!(
        manifest["source"]["path"],
        bed.source.canonicalize().unwrap().display().to_string()
    );
    assert_eq!(manifest["rootEntry"]["summ"]["size"], total);
    assert_eq!(manifest["rootEntry"]["summ"]["files"], files);
    assert!(manifest.get("incomplete").is_none(), "{manifest}");
    // kopia's config, cache and logs went to the private cache, without the password.
    let own = bed.cache.join("kopia");
    assert!(own.join("repository.config").is_file());
    assert!(own.join("cache").is_dir());
    assert!(own.join("logs").is_dir());
    assert!(
        !own.join("repository.config.kopia-password").exists(),
        "kopia saved the password next to its config"
    );

    let summary = outcome.summary.clone().expect("summary");
    assert_eq!(summary.total_bytes, total);
    assert_eq!(summary.total_files, files);
    assert!(outcome.message.contains(&id), "{}", outcome.message);

    assert_progress_invariants(&seen);
    let last = seen.last().unwrap();
    assert!(last.completed && last.err.is_empty(), "{last:?}");
    assert_eq!((last.n_completed, last.n_total), (total, total));
    assert!(
        intermediate(&seen, total) >= 1,
        "no intermediate progress: {seen:#?}"
    );
    assert_no_uploader_left(&bed);
}

/// While kopia prints `estimating...` (its whole first second, kopia's estimator gives nothing
/// sooner) it has said nothing about the total. What the engine publishes then keeps Velero's
/// invariant (nCompleted <= nTotal: "at least this much of at least that much"), so nTotal may
/// equal nCompleted; it must then not claim to be a full bar: its stage says the total is not
/// known yet (`scanning`), which is what a progress bar goes by (the CLI draws a spinner then).
/// A published nTotal equal to a non-zero nCompleted in any other stage must be one of kopia's
/// own estimates. kopia's stderr is copied aside to know what it printed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn progress_is_never_a_full_bar_while_kopia_is_still_estimating() {
    let bed = Bed::new();
    let total = fill_big(&bed);
    let log = bed.path().join("kopia-stderr");
    let wrapper = bed.path().join("kopia-tee");
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/bash\nexec 2> >(exec tee -a '{}' >&2)\nexec '{}' \"$@\"\n",
            log.display(),
            kopia_bin().display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).unwrap();
    let op = kopia_engine(wrapper, true).backup(backup_req(&bed, bed.access()));
    let seen = watch_to_end(&op).await;
    let outcome = op.wait().await;
    assert_eq!(outcome.kind, OutcomeKind::Success, "{outcome:?}");
    assert_progress_invariants(&seen);

    // What kopia printed: its progress lines, read as the engine reads them.
    let printed = std::fs::read(&log).unwrap();
    let parser = KopiaParser::new(Direction::Backup);
    let samples: Vec<ProgressSample> = frame_all(
        &printed,
        Separators::NewlineAndCarriageReturn,
        DEFAULT_MAX_FRAME,
    )
    .into_iter()
    .filter_map(|f| match f {
        OwnedFrame::Line(l) => match parser.parse(&l) {
            UploaderEvent::Progress(p) => Some(p),
            _ => None,
        },
        OwnedFrame::Truncated { .. } => None,
    })
    .collect();
    let estimating: Vec<&ProgressSample> = samples
        .iter()
        .filter(|s| s.total_bytes.is_none() && s.bytes_done > 0)
        .collect();
    assert!(
        !estimating.is_empty(),
        "kopia printed no `estimating...` line with data: {}",
        String::from_utf8_lossy(&printed)
    );
    let mut estimates: Vec<u64> = samples.iter().filter_map(|s| s.total_bytes).collect();
    estimates.dedup();
    let full_bars: Vec<(u64, u64, &str)> = seen
        .iter()
        .filter(|p| {
            !p.completed
                && p.n_completed > 0
                && p.n_total == p.n_completed
                && !p.description.starts_with("scanning")
                && !estimates.contains(&p.n_total)
        })
        .map(|p| (p.n_completed, p.n_total, p.description.as_str()))
        .collect();
    assert!(
        full_bars.is_empty(),
        "published (nCompleted, nTotal) as a full bar of a {total}-byte source while kopia had \
         given no such total (its estimates: {estimates:?}; it printed `estimating...` at {:?} \
         bytes done): {full_bars:#?}",
        estimating.iter().map(|s| s.bytes_done).collect::<Vec<_>>()
    );
}

/// kopia prints sizes with one decimal, rounded: 1,260,000 bytes is "1.3 MB". Read as bytes,
/// the last frames would say more than the manifest's exact size and nCompleted would go down at
/// the end; each figure is read as a lower bound instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn progress_never_goes_down_when_kopias_rounded_sizes_overshoot() {
    let bed = Bed::new();
    write_random(&bed.source.join("a.bin"), 1_000_000, 1);
    write_random(&bed.source.join("b.bin"), 260_000, 2);
    let total = 1_260_000;
    let op = real_engine(true).backup(backup_req(&bed, bed.access()));
    let seen = watch_to_end(&op).await;
    let outcome = op.wait().await;
    assert_eq!(outcome.kind, OutcomeKind::Success, "{outcome:?}");
    assert_progress_invariants(&seen);
    let last = seen.last().unwrap();
    assert_eq!((last.n_completed, last.n_total), (total, total));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_repository_is_reported_when_creation_is_off() {
    let bed = Bed::new();
    fill_small(&bed);
    let engine = kopia_engine(logging_kopia(&bed), false);
    let op = engine.backup(backup_req(&bed, bed.access()));
    let outcome = op.wait().await;
    assert_eq!(outcome.kind, OutcomeKind::RepositoryMissing, "{outcome:?}");
    // kopia's words: "can't connect to storage: cannot access storage path: stat <repo>: no such
    // file or directory".
    assert!(
        outcome.message.contains("cannot access storage path")
            && outcome.message.contains(&bed.repo.display().to_string()),
        "{}",
        outcome.message
    );
    assert!(!bed.repo.exists(), "the repository must not be created");
    let argv: Vec<String> = calls(&bed).into_iter().map(|(_, a)| a).collect();
    assert_eq!(argv.len(), 1, "{argv:?}");
    assert!(
        argv[0].starts_with("repository connect filesystem"),
        "{argv:?}"
    );
    let p = op.progress();
    assert!(p.completed && p.err == outcome.message, "{p:?}");

    // An existing directory that is not a repository: not initialised. (kopia's connect leaves
    // its storage layout file `.shards` there, nothing else.)
    std::fs::create_dir(&bed.repo).unwrap();
    let outcome = engine.backup(backup_req(&bed, bed.access())).wait().await;
    assert_eq!(outcome.kind, OutcomeKind::RepositoryMissing, "{outcome:?}");
    assert!(
        outcome.message.contains("repository not initialized"),
        "{}",
        outcome.message
    );
    let left: Vec<String> = std::fs::read_dir(&bed.repo)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n != ".shards")
        .collect();
    assert!(left.is_empty(), "written to the directory: {left:?}");
    let argv: Vec<String> = calls(&bed).into_iter().map(|(_, a)| a).collect();
    assert_eq!(argv.len(), 2, "{argv:?}");
    assert!(
        argv[1].starts_with("repository connect filesystem"),
        "{argv:?}"
    );
    assert_no_uploader_left(&bed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_password_is_recognised_with_kopias_words_and_the_repository_is_untouched() {
    let bed = Bed::new();
    fill_small(&bed);
    let engine = real_engine(true);
    let first = engine.backup(backup_req(&bed, bed.access())).wait().await;
    assert_eq!(first.kind, OutcomeKind::Success, "{first:?}");
    let ids = |snapshots: Vec<serde_json::Value>| -> Vec<String> {
        let mut ids: Vec<String> = snapshots
            .iter()
            .map(|s| s["id"].as_str().unwrap().to_string())
            .collect();
        ids.sort();
        ids
    };
    let before = ids(bed.kopia_inspector().snapshots());
    assert_eq!(before, vec![first.snapshot_id.clone().unwrap()]);
    let files = bed.repository_files();

    let wrong = bed.access_with_password("not the password");
    let op = engine.backup(backup_req(&bed, wrong));
    let outcome = op.wait().await;
    assert_eq!(outcome.kind, OutcomeKind::WrongPassword, "{outcome:?}");
    assert!(
        outcome.message.contains("invalid repository password"),
        "{}",
        outcome.message
    );
    assert_eq!(outcome.snapshot_id, None);
    let p = op.progress();
    assert!(
        p.completed && p.err.contains("invalid repository password"),
        "{p:?}"
    );
    // Neither re-created nor written to: the same files, sizes and times, the same snapshots.
    assert!(
        bed.repository_files() == files,
        "the repository changed under the wrong password"
    );
    assert_eq!(ids(bed.kopia_inspector().snapshots()), before);
    assert_no_uploader_left(&bed);
}

/// The first SIGINT makes kopia stop reading, upload what it hashed, save a partial snapshot
/// marked `"incomplete":"canceled"` and exit 0. The source is slow to snapshot without costing
/// disk: a 64 GiB sparse file (kopia reads and hashes every zero of it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_mid_snapshot_saves_kopias_partial_snapshot_and_stops_everything() {
    let bed = Bed::new();
    let small = fill_small(&bed);
    let huge = 64u64 << 30;
    write_sparse(&bed.source.join("huge.img"), huge);
    let total = small + huge;
    let op = kopia_engine(logging_kopia(&bed), true).backup(backup_req(&bed, bed.access()));
    let mut rx = op.subscribe();
    tokio::time::timeout(TIMEOUT, async {
        while rx.borrow_and_update().n_completed == 0 {
            rx.changed().await.expect("progress before the end");
        }
    })
    .await
    .unwrap_or_else(|_| panic!("no snapshot progress within {TIMEOUT:?}"));
    assert!(
        !op.is_finished(),
        "ended before the cancel: {:?}",
        op.progress()
    );
    let runs: Vec<(u32, String)> = calls(&bed)
        .into_iter()
        .filter(|(_, a)| a.starts_with("snapshot create"))
        .collect();
    assert_eq!(runs.len(), 1, "one snapshot run: {runs:?}");
    let kopia = runs[0].0;
    assert!(alive(kopia), "kopia {kopia} is not running");
    // kopia leads a process group of its own: what the stop signals.
    assert!(
        live_group(kopia).contains(&kopia),
        "{:?}",
        live_group(kopia)
    );

    let outcome = tokio::time::timeout(TIMEOUT, op.cancel())
        .await
        .unwrap_or_else(|_| panic!("the cancel did not end within {TIMEOUT:?}"));
    assert_eq!(outcome.kind, OutcomeKind::Canceled, "{outcome:?}");
    // kopia handled the SIGINT itself (no SIGKILL was needed): exit 0 and an incomplete
    // manifest, which is named but not returned as the result.
    assert_eq!(outcome.exit_code, Some(0), "{outcome:?}");
    assert_eq!(
        outcome.snapshot_id, None,
        "an incomplete snapshot is no result"
    );
    let snapshots = bed.kopia_inspector().snapshots();
    assert_eq!(snapshots.len(), 1, "{snapshots:#?}");
    let partial = &snapshots[0];
    assert_eq!(partial["incomplete"], "canceled", "{partial}");
    let partial_id = partial["id"].as_str().unwrap();
    assert!(
        outcome.message.contains(partial_id) && outcome.message.contains("incomplete: canceled"),
        "{}",
        outcome.message
    );
    let summary = outcome.summary.clone().unwrap();
    assert_eq!(summary.total_bytes, partial["rootEntry"]["summ"]["size"]);
    assert!(summary.total_bytes < total, "{outcome:?}");

    // Nothing of kopia's is left: not kopia, not a member of its group.
    assert!(!alive(kopia), "kopia {kopia} survived the cancel");
    assert!(
        live_group(kopia).is_empty(),
        "group {kopia} still has {:?}",
        live_group(kopia)
    );
    assert_no_uploader_left(&bed);
    let p = op.progress();
    assert!(p.completed && !p.err.is_empty(), "{p:?}");
    assert!(p.n_completed < total, "{p:?}");
    // Idempotent, and a no-op after the end.
    let again = op.cancel().await;
    assert_eq!(again.kind, OutcomeKind::Canceled);
    assert_eq!(bed.kopia_inspector().snapshots().len(), 1);
}

/// A kopia that ignores SIGINT and SIGTERM is killed (SIGKILL to its group) after the grace
/// period. A real kopia cannot be made to ignore them: this runs the bash double, which leads its
/// group with a grandchild in it and reports both pids.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_escalates_to_sigkill_when_kopia_ignores_signals() {
    let bed = Bed::new();
    fill_small(&bed);
    let grace = Duration::from_secs(1);
    let pids = bed.path().join("pids.txt");
    let engine = Engine::new(EngineConfig {
        cancel_grace: grace,
        ..kopia_engine(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata/kopia/fake-kopia"),
            true,
        )
        .config()
        .clone()
    });
    let mut access = bed.access();
    for (k, v) in [
        ("FAKE_KOPIA_STEP_SECONDS", "0.5".to_string()),
        ("FAKE_KOPIA_STEPS", "60".into()),
        ("FAKE_KOPIA_IGNORE_SIGNALS", "1".into()),
        ("FAKE_KOPIA_PIDS_FILE", pids.display().to_string()),
        // A leaked grandchild must not outlive the test run by much.
        ("FAKE_KOPIA_GRANDCHILD_SECONDS", "120".into()),
    ] {
        access.extra_env.push((k.into(), v));
    }
    let op = engine.backup(backup_req(&bed, access));
    let mut rx = op.subscribe();
    tokio::time::timeout(TIMEOUT, async {
        while rx.borrow_and_update().n_completed == 0 {
            rx.changed().await.expect("progress before the end");
        }
    })
    .await
    .unwrap_or_else(|_| panic!("no snapshot progress within {TIMEOUT:?}"));
    // "kopia <pid>" then "grandchild <pid>".
    let text = std::fs::read_to_string(&pids).unwrap();
    let pid_of = |what: &str| -> u32 {
        text.lines()
            .find_map(|l| l.strip_prefix(what)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {what} pid in {text:?}"))
    };
    let (kopia, grandchild) = (pid_of("kopia "), pid_of("grandchild "));
    let group = live_group(kopia);
    assert!(
        group.contains(&kopia) && group.contains(&grandchild),
        "{group:?}"
    );
    let started = Instant::now();
    let outcome = tokio::time::timeout(TIMEOUT, op.cancel())
        .await
        .unwrap_or_else(|_| panic!("the cancel did not end within {TIMEOUT:?}"));
    let took = started.elapsed();
    assert_eq!(outcome.kind, OutcomeKind::Canceled, "{outcome:?}");
    // Killed, not exited: it ignored SIGINT for the whole grace period (a lower bound only: the
    // kill may not come before the grace period ends).
    assert_eq!(outcome.exit_code, None, "{outcome:?}");
    assert!(
        took >= grace - Duration::from_millis(100),
        "SIGKILL came before the grace period ended: {took:?}"
    );
    // The double records its snapshots as files here: none was saved.
    let saved = std::fs::read_dir(bed.repo.join("snapshots")).map_or(0, |d| d.count());
    assert_eq!(saved, 0, "the double saved a snapshot");
    assert!(!alive(kopia), "fake-kopia {kopia} survived");
    assert!(!alive(grandchild), "grandchild {grandchild} survived");
    assert!(live_group(kopia).is_empty(), "{:?}", live_group(kopia));
    assert_no_uploader_left(&bed);
    let p = op.progress();
    assert!(p.completed && !p.err.is_empty(), "{p:?}");
}

/// kopia runs as `nobody` (root reads everything), over a source with an unreadable file and an
/// unreadable directory: the snapshot is saved without them, kopia exits 1, and the outcome is
/// partial with the snapshot and the items named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreadable_entries_give_a_partial_outcome_with_the_snapshot_and_the_items() {
    use nix::unistd::{Gid, Uid, chown};
    let bed = Bed::new();
    let readable = fill_small(&bed);
    write_random(&bed.source.join("dir1/secret.bin"), 5_000, 50);
    write_random(&bed.source.join("locked/inside.bin"), 7_000, 51);
    // Everything readable by others, but those two.
    let mut stack = vec![bed.source.clone()];
    while let Some(dir) = stack.pop() {
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        for e in std::fs::read_dir(&dir).unwrap().flatten() {
            if e.file_type().unwrap().is_dir() {
                stack.push(e.path());
            } else {
                std::fs::set_permissions(e.path(), std::fs::Permissions::from_mode(0o644)).unwrap();
            }
        }
    }
    std::fs::set_permissions(
        bed.source.join("dir1/secret.bin"),
        std::fs::Permissions::from_mode(0o000),
    )
    .unwrap();
    std::fs::set_permissions(
        bed.source.join("locked"),
        std::fs::Permissions::from_mode(0o000),
    )
    .unwrap();
    // nobody may enter the bed, owns the directory of the repository and of kopia's cache, and
    // runs a copy of the binary (the install cache may be private to root).
    std::fs::set_permissions(bed.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let home = bed.path().join("nobody");
    std::fs::create_dir(&home).unwrap();
    chown(
        &home,
        Some(Uid::from_raw(65534)),
        Some(Gid::from_raw(65534)),
    )
    .unwrap();
    let bin = bed.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    std::fs::copy(kopia_bin(), bin.join("kopia")).unwrap();
    std::fs::set_permissions(bin.join("kopia"), std::fs::Permissions::from_mode(0o755)).unwrap();
    let wrapper = kopia_wrapper_of(
        &bed.path().join("kopia-as-nobody"),
        &bin.join("kopia"),
        &format!(
            "exec setpriv --reuid=nobody --regid=nogroup --clear-groups env HOME='{}' \"$KOPIA\" \"$@\"",
            home.display()
        ),
    );
    let repo = home.join("repo");
    let access = RepositoryAccess {
        repository: repo.display().to_string(),
        cache_dir: home.join("cache"),
        ..bed.access()
    };
    let op = kopia_engine(wrapper, true).backup(backup_req(&bed, access));
    let outcome = op.wait().await;
    assert_eq!(outcome.kind, OutcomeKind::Partial, "{outcome:?}");
    assert_eq!(outcome.exit_code, Some(1));
    let id = outcome.snapshot_id.clone().expect("the snapshot is kept");
    assert_eq!(outcome.failed_items, 2, "{outcome:?}");
    let mut names: Vec<&str> = outcome
        .first_failed_items
        .iter()
        .map(|i| i.item.as_str())
        .collect();
    names.sort();
    assert_eq!(names, ["dir1/secret.bin", "locked"]);
    for item in &outcome.first_failed_items {
        assert!(item.message.contains("permission denied"), "{item:?}");
    }
    assert!(
        outcome.message.contains(&id)
            && outcome.message.contains("2 items could not be read")
            && outcome.message.contains("dir1/secret.bin")
            && outcome.message.contains("locked"),
        "{}",
        outcome.message
    );
    // The snapshot is in the repository, with what could be read.
    let inspector =
        KopiaInspector::connect(&bed.path().join("inspection"), &repo, &bed.kopia_password());
    let manifest = inspector.snapshot(&id);
    assert_eq!(manifest["rootEntry"]["summ"]["numFailed"], 2, "{manifest}");
    assert_eq!(
        manifest["rootEntry"]["summ"]["size"], readable,
        "{manifest}"
    );
    assert!(manifest.get("incomplete").is_none(), "{manifest}");
    let p = op.progress();
    assert!(p.completed && !p.err.is_empty(), "{p:?}");
    assert_eq!((p.n_completed, p.n_total), (readable, readable));
    assert_no_uploader_left(&bed);
}

/// A second backup of the same source: kopia picks the first snapshot as its parent by itself
/// (same user, host and path) and reads only what changed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_backup_of_the_same_source_is_incremental() {
    let bed = Bed::new();
    let first_total = fill_small(&bed);
    write_random(&bed.source.join("big/a.bin"), 20_000_000, 60);
    let first_total = first_total + 20_000_000;
    let engine = real_engine(true);
    let first = engine.backup(backup_req(&bed, bed.access())).wait().await;
    assert_eq!(first.kind, OutcomeKind::Success, "{first:?}");
    write_random(&bed.source.join("dir2/new.dat"), 12_345, 61);
    let op = engine.backup(backup_req(&bed, bed.access()));
    let seen = watch_to_end(&op).await;
    let second = op.wait().await;
    assert_eq!(second.kind, OutcomeKind::Success, "{second:?}");
    let total = first_total + 12_345;
    assert_eq!(second.summary.as_ref().unwrap().total_bytes, total);
    assert_progress_invariants(&seen);
    assert_eq!(
        (
            seen.last().unwrap().n_completed,
            seen.last().unwrap().n_total
        ),
        (total, total)
    );

    let inspector = bed.kopia_inspector();
    let one = inspector.snapshot(first.snapshot_id.as_deref().unwrap());
    let two = inspector.snapshot(second.snapshot_id.as_deref().unwrap());
    let files = regular_files(&bed.source);
    assert_eq!(one["stats"]["cachedFiles"], 0, "{one}");
    assert_eq!(one["stats"]["nonCachedFiles"], files - 1, "{one}");
    // Everything but the new file came from the parent without being read again.
    assert_eq!(two["stats"]["cachedFiles"], files - 1, "{two}");
    assert_eq!(two["stats"]["nonCachedFiles"], 1, "{two}");
    assert_eq!(two["stats"]["totalSize"], total, "{two}");
    assert_eq!(two["rootEntry"]["summ"]["size"], total, "{two}");

    // Velero's incrementalBytes: everything the first time (exact: no file came from a parent),
    // the new file the second time (kopia prints 12,345 bytes as "12.3 KB", read as its lower
    // bound 12,250: at most 0.1 kB below),
    // nothing for a third backup of the unchanged source (exact: no file read).
    let incremental =
        |o: &podvolume_agent::uploader::Outcome| o.summary.as_ref().unwrap().incremental_bytes;
    assert_eq!(incremental(&first), Some(first_total), "{first:?}");
    let second_incremental = incremental(&second).expect("an incremental figure");
    assert!(
        (12_245..=12_345).contains(&second_incremental),
        "incrementalBytes {second_incremental} for a 12,345-byte new file"
    );
    let third = engine.backup(backup_req(&bed, bed.access())).wait().await;
    assert_eq!(third.kind, OutcomeKind::Success, "{third:?}");
    assert_eq!(incremental(&third), Some(0), "{third:?}");

    // Only what a snapshot needs went into the repository: kopia's CLI also writes its
    // diagnostic logs there as `_log_*` blobs, which Velero's data path never does. 0.22 and
    // later can be told not to (the agent does); 0.21 has no such setting.
    if kopia().version >= (0, 22, 0) {
        let ids: Vec<String> = bed
            .repository_files()
            .iter()
            .filter_map(|(path, _, _)| blob_id(&bed.repo, path))
            .collect();
        assert!(!ids.is_empty(), "no blobs under {}", bed.repo.display());
        let logs: Vec<&String> = ids.iter().filter(|id| id.starts_with("_log")).collect();
        assert!(logs.is_empty(), "log blobs in the repository: {logs:?}");
    }
}

/// The blob ID of a file of a kopia filesystem repository: its path below the root with the
/// shard separators and the `.f` suffix removed (`_/log/_2026...f` is `_log_2026...`).
fn blob_id(root: &Path, file: &Path) -> Option<String> {
    let rel = file.strip_prefix(root).ok()?.to_str()?;
    Some(rel.strip_suffix(".f")?.replace('/', ""))
}

// --- restores -----------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restore_into_another_directory_is_identical_with_progress() {
    let bed = Bed::new();
    let total = fill_big(&bed);
    std::os::unix::fs::symlink("top.bin", bed.source.join("link-to-top")).unwrap();
    let files = regular_files(&bed.source);
    let engine = real_engine(true);
    let backup = engine.backup(backup_req(&bed, bed.access())).wait().await;
    assert_eq!(backup.kind, OutcomeKind::Success, "{backup:?}");
    let id = backup.snapshot_id.clone().unwrap();

    let target = bed.path().join("restored");
    std::fs::create_dir(&target).unwrap();
    let op = engine.restore(restore_req(bed.access(), &id, &target));
    let seen = watch_to_end(&op).await;
    let outcome = op.wait().await;
    assert_eq!(outcome.kind, OutcomeKind::Success, "{outcome:?}");
    assert_eq!(outcome.exit_code, Some(0));
    assert_same_tree(&bed.source, &target);
    assert!(target.join("dir2/empty").is_file());
    assert_eq!(
        std::fs::read_link(target.join("link-to-top")).unwrap(),
        Path::new("top.bin")
    );

    assert_progress_invariants(&seen);
    let last = seen.last().unwrap();
    assert!(last.completed && last.err.is_empty(), "{last:?}");
    // kopia prints sizes only rounded; the final figure is measured on the target: exact.
    assert_eq!((last.n_completed, last.n_total), (total, total), "{last:?}");
    let summary = outcome.summary.clone().expect("summary");
    assert_eq!(summary.total_bytes, total);
    // kopia's `Restored N files, M directories and K symbolic links`: files and symlinks.
    assert_eq!(summary.total_files, files + 1);
    assert_eq!(
        outcome.message,
        format!(
            "restore completed: {} in {} files",
            format_bytes(total),
            files + 1
        )
    );
    // In flight, kopia's rounded figures are read as lower bounds: never above the real size.
    for p in &seen {
        assert!(
            p.n_total <= total,
            "{p:?} overshoots the {total}-byte snapshot"
        );
    }
    assert!(
        intermediate(&seen, total) >= 1,
        "no intermediate restore progress: {seen:#?}"
    );
    assert_no_uploader_left(&bed);

    // A snapshot ID that is none: kopia's words, nothing restored.
    let other = bed.path().join("other");
    std::fs::create_dir(&other).unwrap();
    let missing = "0123456789abcdef0123456789abcdef";
    let outcome = engine
        .restore(restore_req(bed.access(), missing, &other))
        .wait()
        .await;
    assert_eq!(outcome.kind, OutcomeKind::Failed, "{outcome:?}");
    assert!(
        outcome.message.contains(missing) && outcome.message.contains("not found"),
        "{}",
        outcome.message
    );
    assert_eq!(std::fs::read_dir(&other).unwrap().count(), 0);
    assert_no_uploader_left(&bed);
}

/// The restored size is what the restore added under the target: files already there and files
/// reached through symlinks are not counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restored_size_excludes_what_the_target_already_held() {
    let bed = Bed::new();
    let total = fill_small(&bed);
    let engine = real_engine(true);
    let backup = engine.backup(backup_req(&bed, bed.access())).wait().await;
    assert_eq!(backup.kind, OutcomeKind::Success, "{backup:?}");
    let id = backup.snapshot_id.clone().unwrap();

    let target = bed.path().join("restored");
    write_random(&target.join("already/here.bin"), 250_000, 99);
    let elsewhere = bed.path().join("elsewhere");
    write_random(&elsewhere.join("big.bin"), 400_000, 98);
    std::os::unix::fs::symlink(&elsewhere, target.join("link-to-dir")).unwrap();
    std::os::unix::fs::symlink(elsewhere.join("big.bin"), target.join("link-to-file")).unwrap();

    let op = engine.restore(restore_req(bed.access(), &id, &target));
    let seen = watch_to_end(&op).await;
    let outcome = op.wait().await;
    assert_eq!(outcome.kind, OutcomeKind::Success, "{outcome:?}");
    assert_same_tree(&bed.source, &target);
    assert_eq!(outcome.summary.as_ref().unwrap().total_bytes, total);
    assert_progress_invariants(&seen);
    let last = seen.last().unwrap();
    assert_eq!((last.n_completed, last.n_total), (total, total), "{last:?}");
    // What was there is untouched.
    assert_eq!(
        std::fs::metadata(target.join("already/here.bin"))
            .unwrap()
            .len(),
        250_000
    );
    assert_no_uploader_left(&bed);
}

/// A snapshot ID from an API object goes to kopia as a positional argument: one that is not a
/// kopia ID (a flag above all) never reaches kopia.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_of_a_snapshot_id_that_is_not_one_is_refused() {
    let bed = Bed::new();
    fill_small(&bed);
    let engine = kopia_engine(logging_kopia(&bed), true);
    let backup = engine.backup(backup_req(&bed, bed.access())).wait().await;
    assert_eq!(backup.kind, OutcomeKind::Success, "{backup:?}");
    let before = calls(&bed).len();
    let target = bed.path().join("restored");
    std::fs::create_dir(&target).unwrap();
    for id in ["--overwrite-files", "-h", "", "k1/../../etc", "a1\nb2"] {
        let outcome = engine
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
    let after = calls(&bed);
    for (_, argv) in &after[before..] {
        assert!(
            argv.starts_with("repository connect"),
            "kopia ran with a bad ID: {argv}"
        );
    }
    assert_eq!(std::fs::read_dir(&target).unwrap().count(), 0);
}

// --- races, with scripted stand-ins -------------------------------------------------------------

/// A one-off stand-in for kopia: `repository connect` runs `connect` (sh code), every other
/// command runs `body`. Each call is appended to `calls.log` in the bed.
fn scripted_kopia(bed: &Bed, connect: &str, body: &str) -> PathBuf {
    let path = bed.path().join("scripted-kopia");
    std::fs::write(
        &path,
        format!(
            "#!/bin/sh\necho \"$$ $*\" >> '{}'\nif [ \"$1 $2\" = 'repository connect' ]; then\n{connect}\nfi\n{body}\n",
            bed.path().join("calls.log").display(),
        ),
    )
    .unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

fn scripted_engine(kopia: PathBuf) -> Arc<Engine> {
    Engine::new(EngineConfig {
        cancel_grace: Duration::from_secs(5),
        ..kopia_engine(kopia, true).config().clone()
    })
}

/// Waits until the scripted kopia call whose arguments start with `command` has exited (a
/// zombie or reaped). The test watches the process itself, in-process: a helper process of the
/// script that waited for its parent could be killed by the runner's pipe-linger kill before it
/// noticed, on a loaded machine.
async fn wait_for_exit_of(bed: &Bed, command: &str) {
    tokio::time::timeout(TIMEOUT, async {
        loop {
            let call = calls(bed).into_iter().find(|(_, a)| a.starts_with(command));
            if let Some((pid, _)) = call {
                match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
                    Err(_) => return,
                    Ok(stat)
                        if stat
                            .rsplit(')')
                            .next()
                            .unwrap_or("")
                            .trim_start()
                            .starts_with('Z') =>
                    {
                        return;
                    }
                    Ok(_) => {}
                }
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("the scripted kopia's {command:?} did not exit within {TIMEOUT:?}"));
}

/// A cancel that arrives after kopia ended on its own (snapshot saved with an unreadable entry,
/// exit 1) stops nothing: the outcome is kopia's, partial with the snapshot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_after_kopia_ended_on_its_own_keeps_its_outcome() {
    let bed = Bed::new();
    fill_small(&bed);
    let kopia = scripted_kopia(
        &bed,
        "exit 0",
        r#"if [ "$1 $2" = 'snapshot create' ]; then
printf '\n ! Error when processing "dir1/b.dat": unable to open file: unable to open local file: open dir1/b.dat: permission denied\n' >&2
echo '{"id":"0123456789abcdef0123456789abcdef","rootEntry":{"summ":{"size":100,"files":2,"numFailed":1,"errors":[{"path":"dir1/b.dat","error":"permission denied"}]}}}'
echo 'Found 1 fatal error(s) while snapshotting root@node:/source.' >&2
sleep 3 &
exit 1
fi
exit 1"#,
    );
    let op = scripted_engine(kopia).backup(backup_req(&bed, bed.access()));
    wait_for_exit_of(&bed, "snapshot create").await;
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

/// A cancel that arrives after `repository connect` found no repository creates none and
/// reports what kopia said.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_after_kopia_found_no_repository_creates_none() {
    let bed = Bed::new();
    fill_small(&bed);
    let kopia = scripted_kopia(
        &bed,
        r#"echo 'error connecting to repository: repository not initialized in the provided storage' >&2
sleep 3 &
exit 1"#,
        "exit 0",
    );
    let op = scripted_engine(kopia).backup(backup_req(&bed, bed.access()));
    wait_for_exit_of(&bed, "repository connect").await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!op.is_finished(), "ended before its pipes closed");
    let outcome = op.cancel().await;
    assert_eq!(outcome.kind, OutcomeKind::RepositoryMissing, "{outcome:?}");
    assert!(
        outcome.message.contains("repository not initialized"),
        "{}",
        outcome.message
    );
    let argv: Vec<String> = calls(&bed).into_iter().map(|(_, a)| a).collect();
    assert!(
        argv.iter().all(|l| !l.starts_with("repository create")),
        "the repository was created after the cancel: {argv:?}"
    );
}

/// A second operation on the same repository reuses the connection and the source's policy
/// (only `snapshot create` runs: one repository open, as Velero's data path makes); a
/// repository recreated in place under the same settings fails the reused connection, which is
/// dropped: a fresh `repository connect`, and the backup lands in the new repository.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_connection_and_policy_are_reused_and_a_stale_one_is_replaced() {
    let bed = Bed::new();
    fill_small(&bed);
    let engine = kopia_engine(logging_kopia(&bed), true);
    let req = || BackupRequest {
        options: BackupOptions {
            kopia: podvolume_agent::uploader::kopia::SnapshotOptions {
                source: Some("default@default:snapshot-pod-volume/kopia/ns/pod/vol".into()),
                keep_all_policy: true,
                ..Default::default()
            },
            ..Default::default()
        },
        ..backup_req(&bed, bed.access())
    };
    let commands = |from: usize| -> Vec<String> {
        calls(&bed)[from..]
            .iter()
            .map(|(_, a)| a.split_whitespace().take(2).collect::<Vec<_>>().join(" "))
            .collect()
    };
    let first = engine.backup(req()).wait().await;
    assert_eq!(first.kind, OutcomeKind::Success, "{first:?}");
    assert_eq!(
        commands(0),
        [
            "repository connect",
            "repository create",
            "policy set",
            "snapshot create"
        ]
    );
    let n = calls(&bed).len();
    let second = engine.backup(req()).wait().await;
    assert_eq!(second.kind, OutcomeKind::Success, "{second:?}");
    assert_eq!(commands(n), ["snapshot create"]);
    let n = calls(&bed).len();
    let target = bed.path().join("restored");
    std::fs::create_dir(&target).unwrap();
    let restored = engine
        .restore(restore_req(
            bed.access(),
            second.snapshot_id.as_deref().unwrap(),
            &target,
        ))
        .wait()
        .await;
    assert_eq!(restored.kind, OutcomeKind::Success, "{restored:?}");
    assert_eq!(commands(n), ["snapshot restore"]);

    // The repository replaced by another one at the same place (deleted and created again).
    std::fs::remove_dir_all(&bed.repo).unwrap();
    let other = bed.path().join("other-config");
    let out = std::process::Command::new(kopia_bin())
        .args(["repository", "create", "filesystem", "--path"])
        .arg(&bed.repo)
        .arg(format!(
            "--config-file={}",
            other.join("repository.config").display()
        ))
        .arg(format!(
            "--cache-directory={}",
            other.join("cache").display()
        ))
        .env("KOPIA_PASSWORD", bed.kopia_password())
        .env("KOPIA_CHECK_FOR_UPDATES", "false")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let n = calls(&bed).len();
    let third = engine.backup(req()).wait().await;
    assert_eq!(third.kind, OutcomeKind::Success, "{third:?}");
    let after = commands(n);
    assert_eq!(
        after[after.len() - 3..],
        ["repository connect", "policy set", "snapshot create"],
        "{after:?}"
    );
    let inspector = bed.kopia_inspector();
    inspector.snapshot(third.snapshot_id.as_deref().unwrap());
}
