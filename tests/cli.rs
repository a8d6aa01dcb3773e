//! The one-shot CLI as a user runs it: the real binary, the real restic, real signals.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use podvolume_agent::progress::OperationProgress;

fn agent(bed: &Bed, args: &[&str]) -> Command {
    let mut c = Command::new(agent_bin());
    c.args(args)
        .arg("--repo")
        .arg(&bed.repo)
        .arg("--password-file")
        .arg(&bed.password_file)
        .arg("--cache-dir")
        .arg(&bed.cache)
        .env("RESTIC_BINARY", restic_bin())
        .stdin(Stdio::null());
    c
}

#[test]
fn restic_under_test_is_the_requested_version() {
    assert_requested_version();
}

fn parse_lines(stdout: &[u8]) -> Vec<OperationProgress> {
    String::from_utf8_lossy(stdout)
        .lines()
        .map(|l| {
            serde_json::from_str(l)
                .unwrap_or_else(|e| panic!("not OperationProgress JSON: {l}: {e}"))
        })
        .collect()
}

/// `--json` lines of a successful backup of `total` bytes: never backwards, never above the
/// total, at least two intermediate lines, the last one complete at the total. Returns it.
fn assert_json_progress(lines: &[OperationProgress], total: u64) -> &OperationProgress {
    let last = lines.last().unwrap();
    assert!(last.completed && last.err.is_empty(), "{last:?}");
    assert_eq!((last.n_completed, last.n_total), (total, total));
    let mut prev = 0;
    for p in lines {
        assert!(
            p.n_completed >= prev && p.n_completed <= p.n_total,
            "{lines:#?}"
        );
        prev = p.n_completed;
    }
    assert!(
        lines.iter().filter(|p| !p.completed).count() >= 2,
        "intermediate lines: {lines:#?}"
    );
    last
}

#[test]
fn json_backup_prints_monotonic_progress_ending_at_the_summary_size() {
    let bed = Bed::new();
    write_random(&bed.source.join("a.bin"), 120 << 20, 1);
    write_random(&bed.source.join("b/c.bin"), 30 << 20, 2);
    let out = agent(&bed, &["backup", "--json", "--update-interval", "200ms"])
        .arg(&bed.source)
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines = parse_lines(&out.stdout);
    let last = assert_json_progress(&lines, 150 << 20);
    // The snapshot the summary reports is in the repository; its size matches.
    let snaps = bed.restic(&["snapshots", "--json"]);
    let snaps: serde_json::Value = serde_json::from_slice(&snaps.stdout).unwrap();
    let id = snaps[0]["short_id"].as_str().unwrap();
    assert!(last.description.contains(id), "{}", last.description);
}

fn wait_for_progress(child: &mut std::process::Child) -> Vec<OperationProgress> {
    let stdout = child.stdout.take().unwrap();
    let mut reader = BufReader::new(stdout);
    let mut seen = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut line = String::new();
    while Instant::now() < deadline {
        line.clear();
        if reader.read_line(&mut line).unwrap() == 0 {
            break;
        }
        let p: OperationProgress = serde_json::from_str(line.trim()).unwrap();
        let moving = p.n_completed > 0;
        seen.push(p);
        if moving {
            break;
        }
    }
    // Keep draining in the background so the agent never blocks on its stdout.
    std::thread::spawn(move || {
        let mut sink = String::new();
        while reader.read_line(&mut sink).map(|n| n > 0).unwrap_or(false) {
            sink.clear();
        }
    });
    seen
}

fn interrupted_backup_stops_cleanly(sig: Signal) {
    let bed = Bed::new();
    write_random(&bed.source.join("a.bin"), 80 << 20, 3);
    bed.init_repo();
    let mut child = agent(
        &bed,
        &[
            "backup",
            "--json",
            "--update-interval",
            "200ms",
            "--cancel-grace",
            "4s",
            "--limit-upload",
            "2048",
        ],
    )
    .arg(&bed.source)
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    let seen = wait_for_progress(&mut child);
    assert!(
        seen.iter().any(|p| p.n_completed > 0),
        "backup never moved: {seen:?}"
    );
    assert!(!bed.own_processes().is_empty());
    kill(Pid::from_raw(child.id() as i32), sig).unwrap();
    let status = child.wait().unwrap();
    // SIGINT to the group, SIGKILL after the grace period, then `restic unlock`; how fast is
    // measured by the benchmark, not asserted here.
    assert_eq!(status.code(), Some(130), "exit code after {sig}");
    assert!(
        bed.own_processes().is_empty(),
        "left behind: {:?}",
        bed.own_processes()
    );
    assert!(bed.locks().is_empty(), "locks left: {:?}", bed.locks());
}

#[test]
fn sigint_mid_backup_exits_130_with_no_process_and_no_lock() {
    interrupted_backup_stops_cleanly(Signal::SIGINT);
}

#[test]
fn sigterm_mid_backup_exits_130_with_no_process_and_no_lock() {
    interrupted_backup_stops_cleanly(Signal::SIGTERM);
}

#[test]
fn backup_then_restore_round_trips_byte_for_byte() {
    let bed = Bed::new();
    write_random(&bed.source.join("data/one.bin"), 3 << 20, 4);
    write_random(&bed.source.join("data/two.bin"), 12345, 5);
    std::fs::write(bed.source.join("hello.txt"), "hello\n").unwrap();
    let out = agent(&bed, &["backup"]).arg(&bed.source).output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Without --json and without a terminal: the snapshot ID on stdout for scripts.
    // The ID restic printed: 8 hex digits on 0.14, 64 from 0.15 (see the README on snapshot IDs).
    let id = String::from_utf8(out.stdout).unwrap().trim().to_string();
    assert_eq!(id.len(), restic().snapshot_id_len(), "{id:?}");
    assert!(id.bytes().all(|b| b.is_ascii_hexdigit()), "{id:?}");
    let target = bed.path().join("restored");
    let target_arg = format!("--target={}", target.display());
    let out = agent(&bed, &["restore", "--json", &target_arg])
        .arg(&id)
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let last = parse_lines(&out.stdout).pop().unwrap();
    assert!(
        last.completed && last.n_completed == last.n_total && last.n_total == (3 << 20) + 12345 + 6
    );
    assert_same_tree(&bed.source, &target);
}

#[test]
fn clear_errors_for_bad_input() {
    let bed = Bed::new();
    // Missing password file: a usage error naming the file, before anything runs.
    let out = Command::new(agent_bin())
        .args(["backup", "--repo"])
        .arg(&bed.repo)
        .args(["--password-file", "/nonexistent/pw"])
        .arg(&bed.source)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/pw"));
    // A source that does not exist: the caller's mistake, said before anything runs.
    let out = agent(&bed, &["backup", "--json"])
        .arg(bed.path().join("nope"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("backup source") && err.contains("nope") && err.contains("No such file"),
        "{err}"
    );
    assert!(out.stdout.is_empty(), "nothing ran, nothing to report");
    // --no-init on a missing repository.
    write_random(&bed.source.join("x"), 10, 1);
    let out = agent(&bed, &["backup", "--no-init"])
        .arg(&bed.source)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    // The cause first, and where restic looked; not restic's bare question.
    assert!(
        err.contains(&format!("no repository at {}", bed.repo.display()))
            && err.contains("no such file or directory")
            && !err.contains("Is there a repository"),
        "{err}"
    );
    // The password never appears in anything the agent prints.
    assert!(!err.contains("correct horse"));
}

/// One rule for exit codes: usage and local input errors 2, failures of the transfer 1, partial 3,
/// stopped 130; the same mistake is said in the same words for backup and restore.
#[test]
fn exit_codes_follow_one_rule() {
    let bed = Bed::new();
    write_random(&bed.source.join("x"), 1000, 1);
    let file = bed.path().join("a-file");
    std::fs::write(&file, "x").unwrap();
    let stderr = |o: &std::process::Output| String::from_utf8_lossy(&o.stderr).to_string();

    let out = agent(&bed, &["backup"]).arg(&file).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("backup source") && stderr(&out).contains("is not a directory"));

    let out = agent(&bed, &["restore"])
        .arg("--target")
        .arg(&file)
        .arg("latest")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("restore target") && stderr(&out).contains("is not a directory"),
        "{}",
        stderr(&out)
    );

    let out = agent(&bed, &["backup", "--update-interval", "abc"])
        .arg(&bed.source)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("a duration is a number with a unit, e.g. 10s"),
        "{}",
        stderr(&out)
    );

    // An option that does nothing for a command is not offered by it.
    let out = agent(&bed, &["restore", "--no-init"])
        .arg("--target")
        .arg(bed.path().join("t"))
        .arg("latest")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("--no-init"), "{}", stderr(&out));

    // A failure of the transfer: 1, and the target directory the restore created is gone.
    let out = agent(&bed, &["backup"]).arg(&bed.source).output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let target = bed.path().join("new-target");
    let out = agent(&bed, &["restore"])
        .arg("--target")
        .arg(&target)
        .arg("deadbeef")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        !target.exists(),
        "a failed restore left {}",
        target.display()
    );
    assert!(
        stderr(&out).contains("removed the restore target"),
        "{}",
        stderr(&out)
    );
    // A target that was there before is left as it was.
    let kept = bed.path().join("kept-target");
    std::fs::create_dir(&kept).unwrap();
    let out = agent(&bed, &["restore"])
        .arg("--target")
        .arg(&kept)
        .arg("deadbeef")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(kept.is_dir());
}

/// A read-only file system under a test's directory, unmounted when dropped.
struct ReadOnlyMount(std::path::PathBuf);

impl ReadOnlyMount {
    fn new(dir: &std::path::Path) -> Self {
        std::fs::create_dir_all(dir).unwrap();
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", "ro,size=1m", "tmpfs"])
            .arg(dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "this test mounts a read-only tmpfs (needs root): {}",
            String::from_utf8_lossy(&out.stderr)
        );
        ReadOnlyMount(dir.to_path_buf())
    }
}

impl Drop for ReadOnlyMount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

/// Item failures are summarised, not flooded: a restore into a read-only file system printed
/// one warning per failed item (44 for 21 files) and then restic's bare `There were 44 errors`.
/// Now: a few warnings, then the count, the cause that dominates and the first items.
#[test]
fn item_failures_are_summarised_not_flooded() {
    let bed = Bed::new();
    for i in 0..21 {
        write_random(&bed.source.join(format!("f{i:02}.bin")), 1000 + i, i as u64);
    }
    let out = agent(&bed, &["backup"]).arg(&bed.source).output().unwrap();
    assert_eq!(out.status.code(), Some(0));
    let id = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let target = bed.path().join("read-only");
    let _mount = ReadOnlyMount::new(&target);
    let out = agent(&bed, &["restore"])
        .arg("--target")
        .arg(&target)
        .arg(&id)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    let warnings = err.matches("could not process an item").count();
    assert!(warnings <= 3, "{warnings} item warnings:\n{err}");
    assert!(
        err.contains("items not written: read-only file system (first: ") && err.contains(" more)"),
        "{err}"
    );
    assert!(!err.contains("There were"), "restic's bare count: {err}");
    assert!(target.is_dir(), "a target that was there is left");
}

/// The last `--json` line carries the result in fields of its own: the snapshot ID (not only
/// inside `description`), the result, and whether the backup created the repository (a mistyped
/// `--repo` silently made a new one).
#[test]
fn json_final_line_names_the_snapshot_and_a_created_repository() {
    let bed = Bed::new();
    write_random(&bed.source.join("a.bin"), 200_000, 3);
    let final_line = |out: &std::process::Output| -> serde_json::Value {
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        serde_json::from_str(text.lines().last().unwrap()).unwrap()
    };
    let out = agent(&bed, &["backup", "--json"])
        .arg(&bed.source)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    let first = final_line(&out);
    assert_eq!(first["result"], "success", "{first}");
    assert_eq!(first["repositoryCreated"], true, "{first}");
    let id = first["snapshotID"].as_str().unwrap().to_string();
    let listed = bed.restic(&["snapshots", "--json"]);
    let listed: serde_json::Value = serde_json::from_slice(&listed.stdout).unwrap();
    // restic 0.14's summary names the snapshot by its short ID, later ones by the full one.
    assert!(
        !id.is_empty() && listed[0]["id"].as_str().unwrap().starts_with(&id),
        "{id} vs {listed}"
    );

    // Without --json the creation is said on stderr; a second backup creates nothing.
    let out = agent(&bed, &["backup"]).arg(&bed.source).output().unwrap();
    assert_eq!(out.status.code(), Some(0));
    assert!(!String::from_utf8_lossy(&out.stderr).contains("created a new"));
    let out = agent(&bed, &["backup", "--json"])
        .arg(&bed.source)
        .output()
        .unwrap();
    let third = final_line(&out);
    assert_eq!(third["repositoryCreated"], false, "{third}");
    assert_ne!(third["snapshotID"], first["snapshotID"]);

    let fresh = bed.path().join("typo-repo");
    let out = Command::new(agent_bin())
        .args(["backup", "--password-file"])
        .arg(&bed.password_file)
        .arg("--cache-dir")
        .arg(&bed.cache)
        .arg("--repo")
        .arg(&fresh)
        .arg(&bed.source)
        .env("RESTIC_BINARY", restic_bin())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("the repository did not exist; this backup created a new, empty one"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A user running the CLI from a work directory with relative paths: restic runs inside the
/// source, so every path must mean what it meant where the user typed it.
#[test]
fn relative_repository_password_and_cache_paths_mean_the_callers_directory() {
    let bed = Bed::new();
    write_random(&bed.source.join("a.bin"), 100_000, 9);
    let out = Command::new(agent_bin())
        .current_dir(bed.path())
        .args([
            "backup",
            "--repo",
            "repo",
            "--password-file",
            "password",
            "--cache-dir",
            "cache",
            "source",
        ])
        .env("RESTIC_BINARY", restic_bin())
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let id = String::from_utf8(out.stdout).unwrap().trim().to_string();
    // The snapshot is in the repository next to the source, where the user pointed, ...
    let snaps = bed.restic(&["snapshots", "--json"]);
    assert!(
        String::from_utf8_lossy(&snaps.stdout).contains(&id),
        "snapshot {id} not in {}: {}",
        bed.repo.display(),
        String::from_utf8_lossy(&snaps.stderr)
    );
    // ... and nothing was created inside the volume that was backed up.
    let inside: Vec<_> = std::fs::read_dir(&bed.source)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(inside, vec![std::ffi::OsString::from("a.bin")]);
    assert!(
        bed.cache.is_dir(),
        "restic's cache is where --cache-dir said"
    );
}

fn kopia_agent(bed: &Bed, args: &[&str]) -> Command {
    let mut c = agent(bed, args);
    c.arg("--uploader=kopia")
        .arg(format!("--kopia-binary={}", kopia_bin().display()));
    c
}

#[test]
fn kopia_under_test_is_the_requested_version() {
    assert_requested_kopia_version();
}

/// `backup --uploader kopia --json` on a real kopia repository: intermediate lines, monotonic,
/// and a final one with the manifest ID and the exact size; the ID is the one kopia lists.
#[test]
fn kopia_json_backup_prints_progress_and_the_manifest_id() {
    let bed = Bed::new();
    write_random(&bed.source.join("a.bin"), 120 << 20, 1);
    write_random(&bed.source.join("b/c.bin"), 30 << 20, 2);
    // kopia can snapshot 150 MiB of random data in half a second, before its first progress
    // frame; reading and hashing 2 GiB of zeros (a sparse file, no disk) takes it seconds.
    let sparse: u64 = 2 << 30;
    write_sparse(&bed.source.join("zeros.img"), sparse);
    let out = kopia_agent(&bed, &["backup", "--json", "--update-interval", "200ms"])
        .arg(&bed.source)
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines = parse_lines(&out.stdout);
    let last = assert_json_progress(&lines, (150 << 20) + sparse);
    let id = last
        .description
        .strip_prefix("snapshot ")
        .and_then(|d| d.split_whitespace().next())
        .unwrap();
    // The final line also carries it in a field of its own.
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let final_line: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    assert_eq!(final_line["snapshotID"].as_str(), Some(id), "{final_line}");
    assert_eq!(final_line["result"], "success", "{final_line}");
    assert!(
        id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit()),
        "{}",
        last.description
    );
    let listed = Command::new(kopia_bin())
        .args(["snapshot", "list", "--json", "--all"])
        .env(
            "KOPIA_CONFIG_PATH",
            bed.cache.join("kopia/repository.config"),
        )
        .env("KOPIA_PASSWORD", "correct horse battery staple")
        .env("KOPIA_CHECK_FOR_UPDATES", "false")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let listed: serde_json::Value = serde_json::from_slice(&listed.stdout).unwrap();
    assert_eq!(listed[0]["id"], id, "{listed}");
}

/// SIGINT mid-backup with kopia: exit 130, the final line reports no completed snapshot (kopia's
/// partial one is not a result), no kopia process left.
#[test]
fn kopia_sigint_mid_backup_exits_130_and_reports_no_completed_snapshot() {
    let bed = Bed::new();
    write_random(&bed.source.join("a.bin"), 1 << 20, 3);
    // Slow to snapshot without costing disk: kopia reads and hashes every zero of it.
    write_sparse(&bed.source.join("huge.img"), 64 << 30);
    let mut child = kopia_agent(
        &bed,
        &[
            "backup",
            "--json",
            "--update-interval",
            "200ms",
            "--cancel-grace",
            "20s",
        ],
    )
    .arg(&bed.source)
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut reader = BufReader::new(stdout);
    let mut lines = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut line = String::new();
    while Instant::now() < deadline {
        line.clear();
        if reader.read_line(&mut line).unwrap() == 0 {
            break;
        }
        let p: OperationProgress = serde_json::from_str(line.trim()).unwrap();
        let moving = p.n_completed > 0;
        lines.push(p);
        if moving {
            break;
        }
    }
    assert!(
        lines.iter().any(|p| p.n_completed > 0),
        "backup never moved: {lines:?}"
    );
    kill(Pid::from_raw(child.id() as i32), Signal::SIGINT).unwrap();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut reader, &mut rest).unwrap();
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(130));
    let last: OperationProgress = serde_json::from_str(rest.lines().last().unwrap()).unwrap();
    assert!(last.completed && !last.err.is_empty(), "{last:?}");
    assert!(
        !last.description.starts_with("snapshot "),
        "reported as a snapshot: {last:?}"
    );
    assert!(last.n_completed < (64u64 << 30), "{last:?}");
    assert!(
        bed.own_processes().is_empty(),
        "left behind: {:?}",
        bed.own_processes()
    );
}
