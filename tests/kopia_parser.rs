//! kopia parser and classification against the synthesised fixtures in `testdata/kopia/` (built
//! from kopia's documented formats, not captured: see that directory's README), and the kopia test
//! double `testdata/kopia/fake-kopia` run for real.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use podvolume_agent::facts::RunFacts;
use podvolume_agent::framing::{DEFAULT_MAX_FRAME, Framer, OwnedFrame, Separators, frame_all};
use podvolume_agent::uploader::kopia::{self, KopiaParser};
use podvolume_agent::uploader::{
    Direction, ExitInfo, OutcomeKind, ProgressSample, RepositoryAccess, RunSummary, Stream,
    UploaderEvent,
};

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata/kopia")
}

/// Everything a fixture run said, in order per stream.
struct Run {
    events: Vec<(Stream, UploaderEvent)>,
    facts: RunFacts,
    exit: ExitInfo,
}

impl Run {
    fn progress(&self) -> Vec<&ProgressSample> {
        self.events
            .iter()
            .filter_map(|(_, e)| match e {
                UploaderEvent::Progress(p) => Some(p),
                _ => None,
            })
            .collect()
    }

    fn items(&self) -> Vec<(&str, &str)> {
        self.events
            .iter()
            .filter_map(|(_, e)| match e {
                UploaderEvent::ItemError { item, message } => {
                    Some((item.as_str(), message.as_str()))
                }
                _ => None,
            })
            .collect()
    }

    fn summary(&self) -> &RunSummary {
        self.facts.summary.as_ref().expect("a summary")
    }

    fn classify(
        &self,
        cancel_requested: bool,
        direction: Direction,
    ) -> podvolume_agent::uploader::Outcome {
        kopia::classify(self.exit, &self.facts, cancel_requested, direction)
    }
}

fn events_of(data: &[u8], parser: &KopiaParser) -> Vec<UploaderEvent> {
    frame_all(
        data,
        Separators::NewlineAndCarriageReturn,
        DEFAULT_MAX_FRAME,
    )
    .into_iter()
    .map(|f| match f {
        OwnedFrame::Line(l) => parser.parse(&l),
        OwnedFrame::Truncated { len } => UploaderEvent::Truncated { len },
    })
    .collect()
}

fn parse_output(stdout: &[u8], stderr: &[u8], exit: ExitInfo, direction: Direction) -> Run {
    let parser = KopiaParser::new(direction);
    let mut events = Vec::new();
    for (stream, data) in [(Stream::Stderr, stderr), (Stream::Stdout, stdout)] {
        for e in events_of(data, &parser) {
            events.push((stream, e));
        }
    }
    let mut facts = RunFacts::default();
    for (s, e) in &events {
        facts.observe(*s, e);
        assert!(
            !matches!(
                e,
                UploaderEvent::Malformed(_) | UploaderEvent::Truncated { .. }
            ),
            "unexpected {e:?}"
        );
    }
    Run {
        events,
        facts,
        exit,
    }
}

fn load(name: &str, direction: Direction) -> Run {
    let dir = fixture_dir();
    let read = |ext: &str| std::fs::read(dir.join(format!("{name}.{ext}"))).unwrap();
    let code: i32 = String::from_utf8(read("exit"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let stderr = read("stderr");
    let run = parse_output(&read("stdout"), &stderr, ExitInfo::code(code), direction);
    // Framing in arbitrary read sizes gives the same events as framing the whole capture.
    let parser = KopiaParser::new(direction);
    for chunk in [1, 7, 64] {
        let mut framer = Framer::new(Separators::NewlineAndCarriageReturn, DEFAULT_MAX_FRAME);
        let mut chunked = Vec::new();
        let mut emit = |f: podvolume_agent::framing::Frame<'_>| {
            if let podvolume_agent::framing::Frame::Line(l) = f {
                chunked.push(parser.parse(l));
            }
        };
        for c in stderr.chunks(chunk) {
            framer.push(c, &mut emit);
        }
        framer.finish(&mut emit);
        assert_eq!(
            chunked,
            events_of(&stderr, &parser),
            "{name}, chunks of {chunk}"
        );
    }
    run
}

fn assert_monotonic(samples: &[&ProgressSample]) {
    for w in samples.windows(2) {
        assert!(w[1].bytes_done >= w[0].bytes_done, "{w:?}");
        assert!(w[1].files_done >= w[0].files_done, "{w:?}");
        if let (Some(a), Some(b)) = (w[0].total_bytes, w[1].total_bytes) {
            assert!(b >= a, "{w:?}");
        }
    }
}

#[test]
fn snapshot_complete() {
    let run = load("snapshot-complete", Direction::Backup);
    let p = run.progress();
    assert_eq!(p.len(), 7);
    assert_monotonic(&p);
    assert_eq!(p[0].total_bytes, None);
    assert!(!p[1].scan_finished);
    assert!(p[2].scan_finished);
    let last = p.last().unwrap();
    // "52.4 MB" is read as the smallest count it could stand for, 52.35 MB: never above the
    // manifest's exact 52_428_800 below, which "52.4 MB" itself would be.
    assert_eq!(last.bytes_done, 52_350_000);
    assert_eq!(last.total_bytes, Some(52_350_000));
    assert_eq!(last.files_done, 24);
    let s = run.summary();
    assert_eq!(
        s.snapshot_id.as_deref(),
        Some("2f6e1c0d9b8a7f6e5d4c3b2a19081726")
    );
    assert_eq!(
        (s.total_bytes, s.total_files, s.failed_items),
        (52_428_800, 24, 0)
    );
    assert!(p.iter().all(|p| p.bytes_done <= s.total_bytes));
    assert_eq!(s.incomplete, None);
    assert!(run.items().is_empty());
    let o = run.classify(false, Direction::Backup);
    assert_eq!(o.kind, OutcomeKind::Success);
    assert_eq!(
        o.snapshot_id.as_deref(),
        Some("2f6e1c0d9b8a7f6e5d4c3b2a19081726")
    );
    assert_eq!(o.summary.unwrap().total_bytes, 52_428_800);
    // The same output without the manifest (stdout lost) cannot be called a success.
    let mut facts = run.facts.clone();
    facts.summary = None;
    let o = kopia::classify(run.exit, &facts, false, Direction::Backup);
    assert_eq!(o.kind, OutcomeKind::Failed);
}

#[test]
fn snapshot_incremental_base2_over_100_percent() {
    let run = load("snapshot-incremental-base2", Direction::Backup);
    let p = run.progress();
    assert_eq!(p.len(), 4);
    assert_monotonic(&p);
    let last = p.last().unwrap();
    // 1.1 MiB hashed + 9.2 MiB cached, estimate 9.5 MiB, each read as its lower bound (0.05 MiB
    // less, rounded up to a whole byte): done passes the estimate (108.4%).
    assert_eq!(last.bytes_done, 1_101_005 + 9_594_471);
    assert_eq!(last.total_bytes, Some(9_909_044));
    assert!(last.bytes_done > last.total_bytes.unwrap());
    assert_eq!(last.files_done, 14);
    assert_eq!(run.summary().total_bytes, 10_800_000);
    // The rounded figures (1.1 + 9.2 MiB = 10_800_333) overshoot the manifest; their lower bounds
    // do not.
    assert!(last.bytes_done <= run.summary().total_bytes);
    assert_eq!(
        run.classify(false, Direction::Backup).kind,
        OutcomeKind::Success
    );
}

#[test]
fn snapshot_partial() {
    let run = load("snapshot-partial", Direction::Backup);
    assert_monotonic(&run.progress());
    assert_eq!(
        run.items(),
        [
            (
                "secrets/key.pem",
                "unable to open file: open /vol/secrets/key.pem: permission denied"
            ),
            (
                "db/locked.db",
                "unable to open file: open /vol/db/locked.db: permission denied"
            ),
        ]
    );
    assert!(
        run.facts
            .stderr_tail
            .iter()
            .any(|l| l == "Found 2 fatal error(s) while snapshotting root@node-1:/vol.")
    );
    assert!(run.facts.fatal.is_empty());
    assert_eq!(run.summary().failed_items, 2);
    let o = run.classify(false, Direction::Backup);
    assert_eq!(o.kind, OutcomeKind::Partial);
    assert_eq!(o.exit_code, Some(1));
    assert_eq!(o.snapshot_id.as_deref(), Some("5e5e5e5e"));
    assert_eq!(o.failed_items, 2);
    assert_eq!(o.first_failed_items.len(), 2);
    assert!(
        o.message
            .starts_with("snapshot 5e5e5e5e saved, but 2 items could not be read: secrets/key.pem"),
        "{}",
        o.message
    );
}

#[test]
fn snapshot_canceled_exits_zero_but_is_not_complete() {
    let run = load("snapshot-canceled", Direction::Backup);
    assert_monotonic(&run.progress());
    assert_eq!(run.exit, ExitInfo::code(0));
    assert_eq!(run.summary().incomplete.as_deref(), Some("canceled"));
    let o = run.classify(true, Direction::Backup);
    assert_eq!(o.kind, OutcomeKind::Canceled);
    assert_eq!(o.snapshot_id, None);
    let o = run.classify(false, Direction::Backup);
    assert_eq!(o.kind, OutcomeKind::Interrupted);
    assert!(o.message.contains("cc00cc00"), "{}", o.message);
}

#[test]
fn restore() {
    let run = load("restore", Direction::Restore);
    let p = run.progress();
    assert_eq!(p.len(), 4);
    assert_monotonic(&p);
    // "20 MB": at least 19.5 MB.
    assert_eq!(p[0].total_bytes, Some(19_500_000));
    assert!(!p[0].scan_finished && p[1].scan_finished);
    let last = p.last().unwrap();
    assert_eq!(
        (last.bytes_done, last.total_bytes),
        (52_350_000, Some(52_350_000))
    );
    assert_eq!((last.files_done, last.total_files), (29, Some(29)));
    let s = run.summary();
    // "52.4 MB" again; the engine replaces it with the size measured on the target.
    assert_eq!(
        (s.total_bytes, s.total_files, s.snapshot_id.as_deref()),
        (52_350_000, 25, None)
    );
    let o = run.classify(false, Direction::Restore);
    assert_eq!(o.kind, OutcomeKind::Success);
    assert_eq!(o.message, "restore completed: 49.9 MiB in 25 files");
}

#[test]
fn failures() {
    let cases = [
        ("connect-wrong-password", OutcomeKind::WrongPassword),
        ("snapshot-wrong-password-legacy", OutcomeKind::WrongPassword),
        ("connect-not-initialized", OutcomeKind::RepositoryMissing),
        ("snapshot-not-connected", OutcomeKind::RepositoryMissing),
    ];
    for (name, want) in cases {
        let run = load(name, Direction::Backup);
        assert!(!run.facts.fatal.is_empty(), "{name}: no fatal line");
        let o = run.classify(false, Direction::Backup);
        assert_eq!(o.kind, want, "{name}");
        assert!(!o.message.contains('\u{1b}'), "{name}: {}", o.message);
        assert!(
            o.message.contains("kopia.io") || o.message.contains("repository"),
            "{}",
            o.message
        );
    }
}

// --- the test double ------------------------------------------------------------------------------

struct Bed {
    dir: tempfile::TempDir,
    access: RepositoryAccess,
}

impl Bed {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let password_file = dir.path().join("password");
        std::fs::write(&password_file, "correct horse\n").unwrap();
        std::fs::create_dir_all(dir.path().join("src/sub")).unwrap();
        std::fs::write(dir.path().join("src/a"), vec![1u8; 123_456]).unwrap();
        std::fs::write(dir.path().join("src/sub/b"), vec![2u8; 2_000_000]).unwrap();
        let access = RepositoryAccess {
            repository: dir.path().join("repo").display().to_string(),
            password_file,
            cache_dir: dir.path().join("cache"),
            extra_env: Vec::new(),
            ..Default::default()
        };
        Self { dir, access }
    }

    fn path(&self, p: &str) -> PathBuf {
        self.dir.path().join(p)
    }

    fn command(&self, inv: &kopia::KopiaInvocation) -> Command {
        let mut cmd = Command::new(fixture_dir().join("fake-kopia"));
        for k in kopia::SCRUBBED_ENV {
            cmd.env_remove(k);
        }
        cmd.args(&inv.args)
            .envs(inv.env.iter().map(|(k, v)| (k, v)))
            .env("FAKE_KOPIA_STEP_SECONDS", "0.01")
            .stdin(Stdio::null());
        cmd
    }

    fn run(&self, inv: &kopia::KopiaInvocation, direction: Direction) -> Run {
        let out = self.command(inv).output().unwrap();
        parse_output(
            &out.stdout,
            &out.stderr,
            ExitInfo::from_status(out.status),
            direction,
        )
    }
}

#[test]
fn double_repository_lifecycle() {
    let bed = Bed::new();
    std::fs::create_dir_all(&bed.access.repository).unwrap();
    let run = bed.run(&kopia::connect(&bed.access).unwrap(), Direction::Backup);
    assert_eq!(run.exit, ExitInfo::code(1));
    assert_eq!(
        run.classify(false, Direction::Backup).kind,
        OutcomeKind::RepositoryMissing
    );

    let run = bed.run(
        &kopia::snapshot_create(&bed.access, &bed.path("src"), &[], &Default::default()).unwrap(),
        Direction::Backup,
    );
    assert_eq!(
        run.classify(false, Direction::Backup).kind,
        OutcomeKind::RepositoryMissing
    );

    let run = bed.run(&kopia::create(&bed.access).unwrap(), Direction::Backup);
    assert_eq!(run.exit, ExitInfo::code(0));
    let run = bed.run(&kopia::connect(&bed.access).unwrap(), Direction::Backup);
    assert_eq!(run.exit, ExitInfo::code(0));

    let mut wrong = bed.access.clone();
    wrong.password_file = bed.path("wrong");
    std::fs::write(&wrong.password_file, "battery staple").unwrap();
    let run = bed.run(&kopia::connect(&wrong).unwrap(), Direction::Backup);
    assert_eq!(
        run.classify(false, Direction::Backup).kind,
        OutcomeKind::WrongPassword
    );

    // Backup: progress on stderr, manifest with the real size on stdout.
    let run = bed.run(
        &kopia::snapshot_create(&bed.access, &bed.path("src"), &[], &Default::default()).unwrap(),
        Direction::Backup,
    );
    let p = run.progress();
    assert!(p.len() >= 5, "{p:?}");
    assert_monotonic(&p);
    assert!(p.last().unwrap().scan_finished);
    assert_eq!(run.summary().total_bytes, 2_123_456);
    assert_eq!(run.summary().total_files, 2);
    let o = run.classify(false, Direction::Backup);
    assert_eq!(o.kind, OutcomeKind::Success, "{}", o.message);
    let id = o.snapshot_id.unwrap();

    // Restore into a new directory.
    let run = bed.run(
        &kopia::snapshot_restore(&bed.access, &id, &bed.path("target"), &Default::default())
            .unwrap(),
        Direction::Restore,
    );
    assert_monotonic(&run.progress());
    // The parser's restore total is kopia's rounded text, "2.1 MB", read as its lower bound (the
    // engine measures the exact size on the target): not above the real 2_123_456 bytes.
    assert_eq!(run.summary().total_bytes, 2_050_000);
    assert_eq!(
        run.classify(false, Direction::Restore).kind,
        OutcomeKind::Success
    );
    assert_eq!(
        std::fs::read(bed.path("target/sub/b")).unwrap(),
        vec![2u8; 2_000_000]
    );
    assert_eq!(std::fs::read(bed.path("target/a")).unwrap().len(), 123_456);
}

#[test]
fn double_partial_snapshot() {
    let bed = Bed::new();
    assert!(
        bed.command(&kopia::create(&bed.access).unwrap())
            .output()
            .unwrap()
            .status
            .success()
    );
    let out = bed
        .command(
            &kopia::snapshot_create(&bed.access, &bed.path("src"), &[], &Default::default())
                .unwrap(),
        )
        .env("FAKE_KOPIA_UNREADABLE", "sub/b")
        .output()
        .unwrap();
    let run = parse_output(
        &out.stdout,
        &out.stderr,
        ExitInfo::from_status(out.status),
        Direction::Backup,
    );
    assert_eq!(run.exit, ExitInfo::code(1));
    assert_eq!(run.items().len(), 1);
    assert_eq!(run.items()[0].0, "sub/b");
    let o = run.classify(false, Direction::Backup);
    assert_eq!(o.kind, OutcomeKind::Partial, "{}", o.message);
    assert!(o.snapshot_id.is_some());
}

fn pids_in(file: &Path) -> Vec<i32> {
    std::fs::read_to_string(file)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_whitespace().nth(1)?.parse().ok())
        .collect()
}

fn alive(pid: i32) -> bool {
    // A zombie is not alive: it holds nothing open.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !stat
            .rsplit(')')
            .next()
            .unwrap_or("")
            .trim_start()
            .starts_with('Z'),
        Err(_) => false,
    }
}

fn wait_for(pids_file: &Path, n: usize) -> Vec<i32> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let pids = pids_in(pids_file);
        if pids.len() >= n {
            return pids;
        }
        assert!(Instant::now() < deadline, "the double did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn double_first_sigint_saves_a_canceled_snapshot_and_exits_zero() {
    use nix::sys::signal::{Signal, kill};
    use nix::unistd::Pid;
    let bed = Bed::new();
    assert!(
        bed.command(&kopia::create(&bed.access).unwrap())
            .output()
            .unwrap()
            .status
            .success()
    );
    let pids_file = bed.path("pids");
    let child = bed
        .command(
            &kopia::snapshot_create(&bed.access, &bed.path("src"), &[], &Default::default())
                .unwrap(),
        )
        .env("FAKE_KOPIA_STEP_SECONDS", "0.5")
        .env("FAKE_KOPIA_PIDS_FILE", &pids_file)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pids = wait_for(&pids_file, 2);
    std::thread::sleep(Duration::from_millis(700));
    kill(Pid::from_raw(child.id() as i32), Signal::SIGINT).unwrap();
    // A second signal is ignored.
    kill(Pid::from_raw(child.id() as i32), Signal::SIGTERM).unwrap();
    let out = child.wait_with_output().unwrap();
    let run = parse_output(
        &out.stdout,
        &out.stderr,
        ExitInfo::from_status(out.status),
        Direction::Backup,
    );
    assert_eq!(run.exit, ExitInfo::code(0));
    assert_eq!(run.summary().incomplete.as_deref(), Some("canceled"));
    assert!(run.summary().total_bytes < 2_123_456);
    assert_eq!(
        run.classify(true, Direction::Backup).kind,
        OutcomeKind::Canceled
    );
    assert_eq!(
        run.classify(false, Direction::Backup).kind,
        OutcomeKind::Interrupted
    );
    // Nothing left behind.
    for pid in pids {
        assert!(!alive(pid), "pid {pid} left behind");
    }
}

#[test]
fn double_ignoring_signals_needs_sigkill_to_the_group() {
    use nix::sys::signal::{Signal, kill, killpg};
    use nix::unistd::Pid;
    use std::os::unix::process::CommandExt;
    let bed = Bed::new();
    assert!(
        bed.command(&kopia::create(&bed.access).unwrap())
            .output()
            .unwrap()
            .status
            .success()
    );
    let pids_file = bed.path("pids");
    let mut child = bed
        .command(
            &kopia::snapshot_create(&bed.access, &bed.path("src"), &[], &Default::default())
                .unwrap(),
        )
        .env("FAKE_KOPIA_STEP_SECONDS", "0.5")
        .env("FAKE_KOPIA_IGNORE_SIGNALS", "1")
        .env("FAKE_KOPIA_PIDS_FILE", &pids_file)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
        .unwrap();
    let pids = wait_for(&pids_file, 2);
    let pgid = Pid::from_raw(child.id() as i32);
    killpg(pgid, Signal::SIGINT).unwrap();
    killpg(pgid, Signal::SIGTERM).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        child.try_wait().unwrap().is_none(),
        "SIGINT/SIGTERM must be ignored"
    );
    assert!(pids.iter().all(|&p| alive(p)));
    killpg(pgid, Signal::SIGKILL).unwrap();
    let status = child.wait().unwrap();
    assert_eq!(ExitInfo::from_status(status).signal, Some(9));
    let deadline = Instant::now() + Duration::from_secs(5);
    while pids.iter().any(|&p| alive(p)) {
        assert!(
            Instant::now() < deadline,
            "the grandchild survived SIGKILL to the group"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = kill(pgid, None);
}
