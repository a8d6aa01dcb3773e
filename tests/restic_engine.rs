//! The engine against the real restic on real files: backups, restores, failures, cancel.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, Instant};

use common::*;
use podvolume_agent::engine::EngineConfig;
use podvolume_agent::operation::Operation;
use podvolume_agent::progress::OperationProgress;
use podvolume_agent::uploader::OutcomeKind;

const TIMEOUT: Duration = Duration::from_secs(120);

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
        assert!(p.n_completed >= last, "nCompleted went down: {seen:#?}");
        assert!(p.n_completed <= p.n_total, "nCompleted > nTotal: {p:?}");
        assert_eq!(p.operation_units, "bytes");
        last = p.n_completed;
    }
}

fn fill_source(bed: &Bed, big_mib: usize, small: usize) -> u64 {
    let mut total = 0;
    write_random(&bed.source.join("big.bin"), big_mib << 20, 1);
    total += (big_mib << 20) as u64;
    for i in 0..small {
        let n = 1000 + i * 37;
        write_random(
            &bed.source.join(format!("dir{}/small-{i}.dat", i % 5)),
            n,
            i as u64 + 2,
        );
        total += n as u64;
    }
    total
}

#[test]
fn restic_under_test_is_the_requested_version() {
    assert_requested_version();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_backup_reports_exact_monotonic_progress_and_the_snapshot() {
    let bed = Bed::new();
    let total = fill_source(&bed, 40, 30);
    bed.init_repo();
    let engine = engine(Duration::from_millis(200));
    let op = engine.backup(backup_request(&bed));
    let seen = watch_to_end(&op).await;
    let outcome = op.wait().await;
    assert_eq!(outcome.kind, OutcomeKind::Success, "{outcome:?}");
    let id = outcome.snapshot_id.clone().expect("snapshot id");
    assert_eq!(id.len(), restic().snapshot_id_len(), "{id}");
    let summary = outcome.summary.clone().unwrap();
    assert_eq!(summary.total_bytes, total);
    assert_progress_invariants(&seen);
    let last = seen.last().unwrap();
    assert!(last.completed && last.err.is_empty(), "{last:?}");
    assert_eq!((last.n_completed, last.n_total), (total, total));
    assert!(last.description.contains(&id), "{}", last.description);
    // restic itself lists the snapshot the engine reported.
    let snaps = bed.restic(&["snapshots", "--json"]);
    assert!(String::from_utf8_lossy(&snaps.stdout).contains(&id));
    assert!(bed.locks().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn incremental_backup_with_a_parent_does_not_read_unchanged_files() {
    let bed = Bed::new();
    fill_source(&bed, 8, 20);
    bed.init_repo();
    let engine = engine(Duration::from_millis(500));
    let first = engine.backup(backup_request(&bed)).wait().await;
    assert_eq!(first.kind, OutcomeKind::Success, "{first:?}");
    // One new file; everything else untouched.
    write_random(&bed.source.join("new.bin"), 4096, 99);
    let mut req = backup_request(&bed);
    req.options.parent = first.snapshot_id.clone();
    let second = engine.backup(req).wait().await;
    assert_eq!(second.kind, OutcomeKind::Success, "{second:?}");
    let s = second.summary.clone().unwrap();
    let files_before = first.summary.clone().unwrap().total_files;
    assert_eq!(s.files_unmodified, files_before, "{s:?}");
    assert!(
        s.bytes_added < 1 << 20,
        "only the new file and metadata are added: {s:?}"
    );
    assert_ne!(second.snapshot_id, first.snapshot_id);
}

/// A parent that is no longer in the repository (pruned, or another repository's) costs a full
/// read, never the backup.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parent_missing_from_the_repository_falls_back_to_a_full_backup() {
    let bed = Bed::new();
    let total = fill_source(&bed, 2, 10);
    bed.init_repo();
    let engine = engine(Duration::from_millis(500));
    let mut req = backup_request(&bed);
    req.options.parent = Some("fc540c27".to_string());
    let outcome = engine.backup(req).wait().await;
    assert_eq!(outcome.kind, OutcomeKind::Success, "{outcome:?}");
    let s = outcome.summary.clone().unwrap();
    assert_eq!((s.total_bytes, s.files_unmodified), (total, 0), "{s:?}");
    let snaps = bed.restic(&["snapshots", "--json"]);
    assert!(
        String::from_utf8_lossy(&snaps.stdout).contains(outcome.snapshot_id.as_deref().unwrap())
    );
    assert!(bed.locks().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreadable_files_give_a_partial_outcome_with_the_snapshot_and_the_items() {
    let bed = Bed::new();
    fill_source(&bed, 1, 5);
    std::fs::write(bed.source.join("secret.txt"), "top secret").unwrap();
    std::fs::set_permissions(
        bed.source.join("secret.txt"),
        std::fs::Permissions::from_mode(0o000),
    )
    .unwrap();
    std::fs::create_dir(bed.source.join("locked-dir")).unwrap();
    std::fs::write(bed.source.join("locked-dir/inside"), "x").unwrap();
    std::fs::set_permissions(
        bed.source.join("locked-dir"),
        std::fs::Permissions::from_mode(0o000),
    )
    .unwrap();
    // restic runs as "nobody", which may read the tree but not those two entries.
    std::fs::set_permissions(bed.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let wrapper = restic_wrapper(
        &bed.path().join("restic-as-nobody"),
        r#"exec setpriv --reuid=65534 --regid=65534 --clear-groups "$RESTIC" "$@""#,
    );
    std::fs::set_permissions(&bed.password_file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let engine = podvolume_agent::engine::Engine::new(EngineConfig {
        restic_binary: wrapper,
        update_interval: Duration::from_millis(500),
        lock_wait: Duration::ZERO,
        ..engine_config()
    });
    // The repository is created by the engine (as nobody), so nobody can write to it.
    let outcome = engine.backup(backup_request(&bed)).wait().await;
    assert_eq!(outcome.kind, OutcomeKind::Partial, "{outcome:?}");
    assert_eq!(outcome.exit_code, Some(3));
    let id = outcome.snapshot_id.clone().expect("the snapshot is kept");
    assert_eq!(outcome.failed_items, 2, "{outcome:?}");
    let names: Vec<&str> = outcome
        .first_failed_items
        .iter()
        .map(|i| i.item.as_str())
        .collect();
    assert!(names.iter().any(|n| n.ends_with("secret.txt")), "{names:?}");
    assert!(names.iter().any(|n| n.ends_with("locked-dir")), "{names:?}");
    assert!(
        outcome.message.contains(&id) && outcome.message.contains("2 items could not be read"),
        "{}",
        outcome.message
    );
    assert!(
        outcome.message.contains("permission denied"),
        "{}",
        outcome.message
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_password_is_recognised() {
    let bed = Bed::new();
    fill_source(&bed, 1, 1);
    bed.init_repo();
    let mut req = backup_request(&bed);
    req.access = bed.access_with_password("not the password");
    let outcome = engine(Duration::from_secs(1)).backup(req).wait().await;
    assert_eq!(outcome.kind, OutcomeKind::WrongPassword, "{outcome:?}");
    assert!(
        outcome.message.contains("wrong password"),
        "{}",
        outcome.message
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_repository_is_reported_or_initialised() {
    let bed = Bed::new();
    fill_source(&bed, 1, 3);
    let strict = podvolume_agent::engine::Engine::new(EngineConfig {
        init_missing_repository: false,
        lock_wait: Duration::ZERO,
        ..engine_config()
    });
    let outcome = strict.backup(backup_request(&bed)).wait().await;
    assert_eq!(outcome.kind, OutcomeKind::RepositoryMissing, "{outcome:?}");
    assert!(
        outcome.message.contains("Is there a repository") || outcome.message.contains("config"),
        "{}",
        outcome.message
    );
    assert!(!bed.repo.join("config").exists());

    let outcome = engine(Duration::from_secs(1))
        .backup(backup_request(&bed))
        .wait()
        .await;
    assert_eq!(outcome.kind, OutcomeKind::Success, "{outcome:?}");
    assert!(bed.repo.join("config").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_directory_completes_without_a_snapshot() {
    let bed = Bed::new();
    bed.init_repo();
    let op = engine(Duration::from_secs(1)).backup(backup_request(&bed));
    let outcome = op.wait().await;
    assert_eq!(outcome.kind, OutcomeKind::Success, "{outcome:?}");
    assert_eq!(outcome.snapshot_id, None);
    assert_eq!(outcome.message, "volume was empty so no snapshot was taken");
    let p = op.progress();
    assert!(p.completed && p.err.is_empty() && p.n_total == 0, "{p:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_mid_backup_stops_the_group_and_leaves_no_lock() {
    let bed = Bed::new();
    fill_source(&bed, 60, 3);
    bed.init_repo();
    let engine = engine(Duration::from_millis(200));
    let mut req = backup_request(&bed);
    req.options.limit_upload_kib = Some(1024);
    let op = engine.backup(req);
    // Wait until restic is really running (first progress), then cancel.
    let mut rx = op.subscribe();
    tokio::time::timeout(TIMEOUT, async {
        while rx.borrow_and_update().n_total == 0 {
            rx.changed().await.unwrap();
        }
    })
    .await
    .unwrap();
    assert!(!bed.own_processes().is_empty(), "restic should be running");
    let started = Instant::now();
    let outcome = op.cancel().await;
    let took = started.elapsed();
    assert_eq!(outcome.kind, OutcomeKind::Canceled, "{outcome:?}");
    assert!(
        bed.own_processes().is_empty(),
        "left behind: {:?}",
        bed.own_processes()
    );
    assert!(bed.locks().is_empty(), "locks left: {:?}", bed.locks());
    let p = op.progress();
    assert!(p.completed && p.err == "canceled", "{p:?}");
    // Idempotent and a no-op after the end.
    let again = op.cancel().await;
    assert_eq!(again.kind, OutcomeKind::Canceled);
    eprintln!("cancel took {took:?}");
}

/// A restic killed by someone else (the OOM killer, a stray SIGKILL) leaves its lock; the
/// engine removes it as after its own stop, so the repository's next prune or check is not
/// blocked by a dead process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restic_killed_by_someone_else_leaves_no_lock() {
    let bed = Bed::new();
    fill_source(&bed, 60, 3);
    bed.init_repo();
    // The backup is SIGKILLed, then the wrapper, once its lock is in the repository. The
    // wrapper reaps restic first, as the agent does its own child: a dead restic not yet reaped
    // by init still has a PID, and restic's unlock rightly calls its lock live.
    let wrapper = restic_wrapper(
        &bed.path().join("restic-oom-killed"),
        &format!(
            "case \" $* \" in *\" backup \"*)\n\
             \"$RESTIC\" \"$@\" & pid=$!\n\
             while [ -z \"$(ls {locks} 2>/dev/null)\" ]; do sleep 0.05; done\n\
             kill -9 $pid; wait $pid; kill -9 $$;;\n\
             esac\nexec \"$RESTIC\" \"$@\"",
            locks = bed.repo.join("locks").display()
        ),
    );
    let engine = podvolume_agent::engine::Engine::new(EngineConfig {
        restic_binary: wrapper,
        update_interval: Duration::from_millis(200),
        lock_wait: Duration::ZERO,
        ..engine_config()
    });
    let mut req = backup_request(&bed);
    req.options.limit_upload_kib = Some(1024);
    let outcome = tokio::time::timeout(TIMEOUT, engine.backup(req).wait())
        .await
        .unwrap();
    assert!(
        matches!(outcome.kind, OutcomeKind::KilledBySignal { .. }),
        "{outcome:?}"
    );
    assert!(bed.locks().is_empty(), "locks left: {:?}", bed.locks());
}

/// The `restic unlock` after a stop is bounded: restic retries an unreachable backend for
/// minutes, and a cancel must still end (with the unlock's own process group gone).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unlock_that_hangs_does_not_hold_the_cancel() {
    let bed = Bed::new();
    fill_source(&bed, 60, 3);
    bed.init_repo();
    // `unlock` hangs as against a backend that never answers; everything else is restic.
    let wrapper = restic_wrapper(
        &bed.path().join("restic-hanging-unlock"),
        "for a in \"$@\"; do [ \"$a\" = unlock ] && exec sleep 297; done\nexec \"$RESTIC\" \"$@\"",
    );
    let engine = podvolume_agent::engine::Engine::new(EngineConfig {
        restic_binary: wrapper,
        update_interval: Duration::from_millis(200),
        cancel_grace: Duration::from_secs(3),
        lock_wait: Duration::ZERO,
        unlock_limit: Duration::from_secs(2),
        ..engine_config()
    });
    let mut req = backup_request(&bed);
    req.options.limit_upload_kib = Some(1024);
    let op = engine.backup(req);
    let mut rx = op.subscribe();
    tokio::time::timeout(TIMEOUT, async {
        while rx.borrow_and_update().n_total == 0 {
            rx.changed().await.unwrap();
        }
    })
    .await
    .unwrap();
    // Not a timing check: without the limit this waits for the 297 s sleep, far past TIMEOUT.
    let outcome = tokio::time::timeout(TIMEOUT, op.cancel())
        .await
        .expect("the cancel ended although unlock hangs");
    assert_eq!(outcome.kind, OutcomeKind::Canceled, "{outcome:?}");
    let hanging: Vec<String> = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
        .filter(|c| c.starts_with("sleep 297"))
        .collect();
    assert!(
        hanging.is_empty(),
        "the unlock was left running: {hanging:?}"
    );
    assert!(
        bed.own_processes().is_empty(),
        "left behind: {:?}",
        bed.own_processes()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_kills_grandchildren_and_a_straggler_does_not_hold_the_run() {
    let bed = Bed::new();
    fill_source(&bed, 30, 2);
    bed.init_repo();
    // A wrapper that leaves a long-lived grandchild holding the pipes, as a shell or a backend
    // helper might.
    let pidfile = bed.path().join("helper.pid");
    let wrapper = restic_wrapper(
        &bed.path().join("restic-with-helper"),
        &format!(
            "sleep 600 &\necho $! > {}\nexec \"$RESTIC\" \"$@\"",
            pidfile.display()
        ),
    );
    let engine = podvolume_agent::engine::Engine::new(EngineConfig {
        restic_binary: wrapper,
        update_interval: Duration::from_millis(200),
        cancel_grace: Duration::from_secs(3),
        lock_wait: Duration::ZERO,
        ..engine_config()
    });
    let alive = |pid: &str| {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| {
                !s.rsplit(')')
                    .next()
                    .unwrap_or("")
                    .trim_start()
                    .starts_with('Z')
            })
            .unwrap_or(false)
    };

    // A normal run ends although the helper keeps the pipes open, and the helper is gone.
    let outcome = tokio::time::timeout(TIMEOUT, engine.backup(backup_request(&bed)).wait())
        .await
        .unwrap();
    assert_eq!(outcome.kind, OutcomeKind::Success, "{outcome:?}");
    let helper = std::fs::read_to_string(&pidfile)
        .unwrap()
        .trim()
        .to_string();
    assert!(!alive(&helper), "helper {helper} survived a finished run");

    // A canceled run: the whole group is gone when cancel returns.
    let mut req = backup_request(&bed);
    req.options.limit_upload_kib = Some(512);
    write_random(&bed.source.join("more.bin"), 20 << 20, 7);
    let op = engine.backup(req);
    let mut rx = op.subscribe();
    tokio::time::timeout(TIMEOUT, async {
        while rx.borrow_and_update().n_total == 0 {
            rx.changed().await.unwrap();
        }
    })
    .await
    .unwrap();
    let helper = std::fs::read_to_string(&pidfile)
        .unwrap()
        .trim()
        .to_string();
    assert!(alive(&helper));
    let outcome = op.cancel().await;
    assert_eq!(outcome.kind, OutcomeKind::Canceled, "{outcome:?}");
    assert!(!alive(&helper), "grandchild {helper} outlived cancel");
    assert!(bed.own_processes().is_empty(), "{:?}", bed.own_processes());
    assert!(bed.locks().is_empty(), "{:?}", bed.locks());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restore_into_another_directory_is_byte_identical_with_progress() {
    let bed = Bed::new();
    let total = fill_source(&bed, 30, 25);
    bed.init_repo();
    let engine = engine(Duration::from_millis(200));
    let backup = engine.backup(backup_request(&bed)).wait().await;
    let id = backup.snapshot_id.clone().unwrap();
    let target = bed.path().join("restored");
    std::fs::create_dir(&target).unwrap();
    let mut req = restore_request(&bed, &id, &target);
    req.limit_download_kib = Some(15_000);
    let op = engine.restore(req);
    let seen = watch_to_end(&op).await;
    let outcome = op.wait().await;
    assert_eq!(outcome.kind, OutcomeKind::Success, "{outcome:?}");
    assert_same_tree(&bed.source, &target);
    assert_progress_invariants(&seen);
    let last = seen.last().unwrap();
    assert_eq!((last.n_completed, last.n_total), (total, total));
    let intermediate = seen
        .iter()
        .filter(|p| p.n_completed > 0 && p.n_completed < total)
        .count();
    assert!(
        intermediate >= 1,
        "no intermediate restore progress: {seen:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_snapshot_fails_with_restics_words() {
    let bed = Bed::new();
    bed.init_repo();
    let target = bed.path().join("restored");
    std::fs::create_dir(&target).unwrap();
    let outcome = engine(Duration::from_secs(1))
        .restore(restore_request(&bed, "deadbeef", &target))
        .wait()
        .await;
    assert_eq!(outcome.kind, OutcomeKind::Failed, "{outcome:?}");
    assert!(
        outcome.message.contains("no matching ID found"),
        "{}",
        outcome.message
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_lock_is_removed_and_a_live_one_is_reported_with_its_holder() {
    let bed = Bed::new();
    fill_source(&bed, 20, 3);
    bed.init_repo();
    let first = engine(Duration::from_secs(1))
        .backup(backup_request(&bed))
        .wait()
        .await;
    assert_eq!(first.kind, OutcomeKind::Success, "{first:?}");

    // A live exclusive lock: `restic check --read-data`, slowed, holds one while it runs.
    let holder = std::process::Command::new(restic_bin())
        .args(["check", "--read-data", "--limit-download", "64"])
        .env("RESTIC_REPOSITORY", &bed.repo)
        .env("RESTIC_PASSWORD_FILE", &bed.password_file)
        .env("RESTIC_CACHE_DIR", &bed.cache)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while bed.locks().is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(!bed.locks().is_empty(), "check did not take its lock");
    let outcome = engine(Duration::from_secs(1))
        .backup(backup_request(&bed))
        .wait()
        .await;
    assert_eq!(outcome.kind, OutcomeKind::Locked, "{outcome:?}");
    assert!(
        outcome
            .message
            .contains(&format!("locked exclusively by PID {}", holder.id())),
        "the holder is named: {}",
        outcome.message
    );

    // The holder dies without cleaning up: its lock is stale and the next backup removes it.
    let mut holder = holder;
    holder.kill().unwrap();
    holder.wait().unwrap();
    assert!(
        !bed.locks().is_empty(),
        "SIGKILL should leave the lock behind"
    );
    let outcome = engine(Duration::from_secs(1))
        .backup(backup_request(&bed))
        .wait()
        .await;
    assert_eq!(outcome.kind, OutcomeKind::Success, "{outcome:?}");
    assert!(bed.locks().is_empty());
}

/// Snapshot IDs across an upgrade of restic in one repository. The status carries the ID restic
/// printed: 8 hex digits from 0.14 (what Velero's restic path stored too), 64 from 0.15 on. Both
/// are IDs to every restic version (they match by prefix), so after an upgrade the stored short
/// ID still serves as parent and for restores, and after a rollback the full one does.
///
/// Runs two binaries regardless of the pass: Debian's 0.14 (`restic` on PATH) and the 0.18 that
/// `scripts/fetch-restic-trixie.sh` unpacks (or `PODVOLUME_TEST_RESTIC_NEW`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upgrade_014_to_018_in_one_repository_keeps_parents_and_restores() {
    let old = std::env::var_os("PODVOLUME_TEST_RESTIC_OLD")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| "restic".into());
    let new = std::env::var_os("PODVOLUME_TEST_RESTIC_NEW")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("target/test-tools/restic-trixie/root/usr/bin/restic")
        });
    let version_of = |bin: &std::path::Path| {
        let out = std::process::Command::new(bin)
            .arg("version")
            .output()
            .unwrap_or_else(|e| {
                panic!(
                    "{}: {e} (scripts/test.sh installs restic and fetches 0.18)",
                    bin.display()
                )
            });
        let line = String::from_utf8_lossy(&out.stdout).to_string();
        podvolume_agent::uploader::restic::ResticVersion::parse(&line)
            .unwrap_or_else(|| panic!("{}: {line:?}", bin.display()))
    };
    let (v_old, v_new) = (version_of(&old), version_of(&new));
    println!("upgrade from restic {v_old} to restic {v_new}");
    assert!(v_old.minor == 14 && v_new.minor >= 18, "{v_old} -> {v_new}");
    let engine_of = |bin: &std::path::Path| {
        podvolume_agent::engine::Engine::new(EngineConfig {
            restic_binary: bin.to_path_buf(),
            update_interval: Duration::from_millis(500),
            lock_wait: Duration::ZERO,
            ..EngineConfig::default()
        })
    };
    let bed = Bed::new();
    fill_source(&bed, 4, 20);

    // Backup with 0.14: the short ID, as Velero's restic path stored it.
    let first = engine_of(&old).backup(backup_request(&bed)).wait().await;
    assert_eq!(first.kind, OutcomeKind::Success, "{first:?}");
    let short = first.snapshot_id.clone().unwrap();
    assert_eq!(short.len(), 8, "{short}");
    let files_before = first.summary.clone().unwrap().total_files;

    // Incremental backup with 0.18 in the same repository, the short ID as parent.
    write_random(&bed.source.join("after-upgrade.bin"), 100_000, 42);
    let mut req = backup_request(&bed);
    req.options.parent = Some(short.clone());
    let second = engine_of(&new).backup(req).wait().await;
    assert_eq!(second.kind, OutcomeKind::Success, "{second:?}");
    let full = second.snapshot_id.clone().unwrap();
    assert_eq!(full.len(), 64, "{full}");
    let s = second.summary.clone().unwrap();
    assert_eq!(
        s.files_unmodified, files_before,
        "the parent was used: {s:?}"
    );
    // restic records the parent: the full ID of the 0.14 snapshot.
    let out = std::process::Command::new(&new)
        .args(["snapshots", "--json", "--no-lock"])
        .env("RESTIC_REPOSITORY", &bed.repo)
        .env("RESTIC_PASSWORD_FILE", &bed.password_file)
        .env("RESTIC_CACHE_DIR", &bed.cache)
        .output()
        .unwrap();
    let snaps: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    let snap = snaps
        .iter()
        .find(|x| x["id"] == full.as_str())
        .unwrap_or_else(|| panic!("{full} not in {snaps:?}"));
    assert!(
        snap["parent"]
            .as_str()
            .is_some_and(|p| p.starts_with(&short)),
        "{snap}"
    );

    // Restores with 0.18: the new snapshot by its full ID, byte for byte; the old one by its
    // short ID.
    let target = bed.path().join("restored-new");
    std::fs::create_dir(&target).unwrap();
    let r = engine_of(&new)
        .restore(restore_request(&bed, &full, &target))
        .wait()
        .await;
    assert_eq!(r.kind, OutcomeKind::Success, "{r:?}");
    assert_same_tree(&bed.source, &target);
    let target_old = bed.path().join("restored-old");
    std::fs::create_dir(&target_old).unwrap();
    let r = engine_of(&new)
        .restore(restore_request(&bed, &short, &target_old))
        .wait()
        .await;
    assert_eq!(r.kind, OutcomeKind::Success, "{r:?}");
    assert!(target_old.join("big.bin").is_file() && !target_old.join("after-upgrade.bin").exists());

    // A rollback to 0.14 restores the snapshot 0.18 made, by the full ID the status carries.
    let target_back = bed.path().join("restored-rollback");
    std::fs::create_dir(&target_back).unwrap();
    let r = engine_of(&old)
        .restore(restore_request(&bed, &full, &target_back))
        .wait()
        .await;
    assert_eq!(r.kind, OutcomeKind::Success, "{r:?}");
    assert_same_tree(&bed.source, &target_back);
    assert!(bed.locks().is_empty());
}

/// A stand-in for restic: a shell script that answers `version` with `version_line` and runs
/// `body` (sh code; `$cmd` is the subcommand, `$MARK` a path for the fake's pid) for every
/// other command. Every call is appended to `calls.log` in the bed.
fn fake_restic(bed: &Bed, version_line: &str, body: &str) -> std::path::PathBuf {
    let path = bed.path().join("fake-restic");
    std::fs::write(
        &path,
        format!(
            r#"#!/bin/sh
MARK='{mark}'
cmd=
for a in "$@"; do
  case "$a" in version|backup|restore|stats|unlock|init|snapshots) cmd=$a; break;; esac
done
echo "$cmd $*" >> '{log}'
if [ "$cmd" = version ]; then echo '{version_line}'; exit 0; fi
{body}
"#,
            mark = fake_mark(bed).display(),
            log = fake_calls_log(bed).display(),
        ),
    )
    .unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

fn fake_mark(bed: &Bed) -> std::path::PathBuf {
    bed.path().join("uploader-exited")
}

fn fake_calls_log(bed: &Bed) -> std::path::PathBuf {
    bed.path().join("calls.log")
}

/// sh code that writes the fake's pid to `$MARK` and ends its run with `code` while a background
/// `sleep` keeps its pipes open (until the runner's pipe-linger kill ends its group).
fn exit_while_pipes_linger(code: i32) -> String {
    format!("echo $$ > \"$MARK.tmp\" && mv \"$MARK.tmp\" \"$MARK\"\nsleep 3 &\nexit {code}")
}

/// True once process `pid` has exited (a zombie or reaped).
fn has_exited(pid: &str) -> bool {
    match std::fs::read_to_string(format!("/proc/{}/stat", pid.trim())) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit(')')
            .next()
            .unwrap_or("")
            .trim_start()
            .starts_with('Z'),
    }
}

fn fake_engine(binary: std::path::PathBuf) -> std::sync::Arc<podvolume_agent::engine::Engine> {
    podvolume_agent::engine::Engine::new(EngineConfig {
        restic_binary: binary,
        update_interval: Duration::from_millis(100),
        cancel_grace: Duration::from_secs(5),
        lock_wait: Duration::ZERO,
        ..engine_config()
    })
}

/// Requests a cancel once the uploader has exited on its own (and a little later), while its
/// pipes are still open; returns the outcome `cancel` gives.
async fn cancel_after_the_uploader_exited(
    op: &Operation,
    bed: &Bed,
) -> std::sync::Arc<podvolume_agent::uploader::Outcome> {
    // Watched in-process: a helper process of the fake that waited for its parent could be killed
    // by the pipe-linger kill before it noticed, on a loaded machine.
    tokio::time::timeout(TIMEOUT, async {
        loop {
            if let Ok(pid) = std::fs::read_to_string(fake_mark(bed))
                && has_exited(&pid)
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the fake restic exits");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        !op.is_finished(),
        "the run ended before the pipes closed: the cancel would come too late to test anything"
    );
    op.cancel().await
}

/// A cancel that arrives after restic exited 3 on its own (snapshot saved, some files
/// unreadable) stops nothing: the outcome is restic's, partial with the snapshot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_after_restic_exited_3_keeps_the_partial_snapshot() {
    let bed = Bed::new();
    let fake = fake_restic(
        &bed,
        "restic 0.14.0 compiled with go1.19.8 on linux/amd64",
        &format!(
            r#"if [ "$cmd" = backup ]; then
echo '{{"message_type":"status","percent_done":1,"total_files":2,"files_done":2,"total_bytes":100,"bytes_done":100}}'
echo '{{"message_type":"error","error":{{"Op":"open","Path":"/v/secret","Err":13}},"during":"archival","item":"/v/secret"}}' >&2
echo '{{"message_type":"summary","files_new":1,"total_files_processed":1,"total_bytes_processed":100,"data_added":100,"snapshot_id":"0123abcd"}}'
echo 'Warning: at least one source file could not be read' >&2
{}
fi
exit 1"#,
            exit_while_pipes_linger(3)
        ),
    );
    let op = fake_engine(fake).backup(backup_request(&bed));
    let outcome = cancel_after_the_uploader_exited(&op, &bed).await;
    assert_eq!(outcome.kind, OutcomeKind::Partial, "{outcome:?}");
    assert_eq!(outcome.exit_code, Some(3));
    assert_eq!(outcome.snapshot_id.as_deref(), Some("0123abcd"));
    assert_eq!(outcome.failed_items, 1, "{outcome:?}");
    let p = op.progress();
    assert!(p.completed, "{p:?}");
    assert_ne!(p.err, "canceled", "{p:?}");
    assert_eq!((p.n_completed, p.n_total), (100, 100));
    // Nothing was stopped, so there is no stale lock to remove.
    let calls = std::fs::read_to_string(fake_calls_log(&bed)).unwrap();
    assert!(!calls.contains("unlock"), "{calls}");
}

/// A cancel that arrives after a restore failed on its own keeps the real cause.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_after_a_restore_failed_on_its_own_keeps_the_cause() {
    let bed = Bed::new();
    let target = bed.path().join("restored");
    std::fs::create_dir(&target).unwrap();
    let fake = fake_restic(
        &bed,
        "restic 0.16.0 compiled with go1.21.1 on linux/amd64",
        &format!(
            r#"if [ "$cmd" = restore ]; then
echo '{{"message_type":"status","percent_done":0.1,"total_files":3,"total_bytes":1000,"bytes_restored":100}}'
echo 'Fatal: failed to load snapshot 0123abcd: ciphertext verification failed' >&2
{}
fi
exit 1"#,
            exit_while_pipes_linger(1)
        ),
    );
    let op = fake_engine(fake).restore(restore_request(&bed, "0123abcd", &target));
    let outcome = cancel_after_the_uploader_exited(&op, &bed).await;
    assert_eq!(outcome.kind, OutcomeKind::Failed, "{outcome:?}");
    assert!(
        outcome.message.contains("ciphertext verification failed"),
        "{}",
        outcome.message
    );
    let p = op.progress();
    assert!(p.err.contains("ciphertext verification failed"), "{p:?}");
}

/// restic >= 0.16 may end a restore with a bare `{"message_type":"summary"}`: the final progress
/// keeps what was reached instead of falling to the summary's zero.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bare_restore_summary_never_lowers_the_final_progress() {
    let bed = Bed::new();
    let target = bed.path().join("restored");
    std::fs::create_dir(&target).unwrap();
    let fake = fake_restic(
        &bed,
        "restic 0.16.0 compiled with go1.21.1 on linux/amd64",
        r#"if [ "$cmd" = restore ]; then
echo '{"message_type":"status","percent_done":0.5,"total_files":2,"files_restored":1,"total_bytes":1000,"bytes_restored":500}'
echo '{"message_type":"status","percent_done":1,"total_files":2,"files_restored":2,"total_bytes":1000,"bytes_restored":1000}'
echo '{"message_type":"summary"}'
exit 0
fi
exit 1"#,
    );
    let op = fake_engine(fake).restore(restore_request(&bed, "0123abcd", &target));
    let seen = watch_to_end(&op).await;
    let outcome = op.wait().await;
    assert_eq!(outcome.kind, OutcomeKind::Success, "{outcome:?}");
    assert_progress_invariants(&seen);
    let last = seen.last().unwrap();
    assert!(last.completed && last.err.is_empty(), "{last:?}");
    assert_eq!((last.n_completed, last.n_total), (1000, 1000), "{seen:#?}");
    assert_eq!(outcome.summary.as_ref().map(|s| s.total_bytes), Some(1000));
}

/// restic 0.14 restores start with `restic stats`; its `Fatal:` comes after a long run of retry
/// lines and must still decide the outcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fatal_line_after_many_retry_lines_decides_the_outcome() {
    let bed = Bed::new();
    let target = bed.path().join("restored");
    std::fs::create_dir(&target).unwrap();
    let fake = fake_restic(
        &bed,
        "restic 0.14.0 compiled with go1.19.8 on linux/amd64",
        r#"if [ "$cmd" = stats ]; then
line=$(printf 'Load(<key/0123456789>) returned error, retrying after 1s: %0152d' 0)
i=0
while [ $i -lt 1000 ]; do echo "$line" >&2; i=$((i+1)); done
echo 'Fatal: wrong password or no key found' >&2
fi
exit 1"#,
    );
    let outcome = fake_engine(fake)
        .restore(restore_request(&bed, "0123abcd", &target))
        .wait()
        .await;
    assert_eq!(outcome.kind, OutcomeKind::WrongPassword, "{outcome:?}");
    assert!(
        outcome.message.contains("wrong password or no key found"),
        "{}",
        outcome.message
    );
}

/// A snapshot ID from an API object goes to restic as a positional argument: one that is not a
/// restic ID (a flag above all) is refused before restic sees it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_of_a_snapshot_id_that_is_not_one_is_refused() {
    for version in ["0.14.0", "0.16.0"] {
        let bed = Bed::new();
        let target = bed.path().join("restored");
        std::fs::create_dir(&target).unwrap();
        let fake = fake_restic(
            &bed,
            &format!("restic {version} compiled with go1.21.1 on linux/amd64"),
            "exit 0",
        );
        for id in [
            "--target=/etc",
            "-h",
            "",
            "0123abcd\nFatal: forged",
            "latest!",
        ] {
            let outcome = fake_engine(fake.clone())
                .restore(restore_request(&bed, id, &target))
                .wait()
                .await;
            assert_eq!(
                outcome.kind,
                OutcomeKind::Failed,
                "{version} {id:?}: {outcome:?}"
            );
            assert!(
                outcome.message.contains("invalid restic snapshot ID")
                    && outcome.message.contains(&format!("{id:?}")),
                "{version} {id:?}: {}",
                outcome.message
            );
        }
        let calls = std::fs::read_to_string(fake_calls_log(&bed)).unwrap();
        assert!(
            calls.lines().all(|l| l.starts_with("version ")),
            "restic ran with a bad ID ({version}): {calls}"
        );
    }
}

/// A cancel that arrives after restic found no repository stops everything that would follow
/// (no `restic init`, no retry) and reports what restic said.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_after_restic_found_no_repository_initialises_nothing() {
    let bed = Bed::new();
    let fake = fake_restic(
        &bed,
        "restic 0.14.0 compiled with go1.19.8 on linux/amd64",
        &format!(
            r#"if [ "$cmd" = backup ]; then
echo 'Fatal: unable to open config file: Stat: stat /nowhere/config: no such file or directory' >&2
echo 'Is there a repository at the following location?' >&2
echo '/nowhere' >&2
{}
fi
exit 0"#,
            exit_while_pipes_linger(1)
        ),
    );
    let op = fake_engine(fake).backup(backup_request(&bed));
    let outcome = cancel_after_the_uploader_exited(&op, &bed).await;
    assert_eq!(outcome.kind, OutcomeKind::RepositoryMissing, "{outcome:?}");
    assert!(outcome.message.contains("/nowhere"), "{}", outcome.message);
    let calls = std::fs::read_to_string(fake_calls_log(&bed)).unwrap();
    assert!(
        calls.lines().all(|l| !l.starts_with("init ")),
        "init ran after the cancel: {calls}"
    );
}
