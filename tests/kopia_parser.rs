//! kopia's output parser and outcome classification against what real kopia prints.
//!
//! - Captures: `testdata/kopia/<version>/` holds, for each pinned version, the stdout, stderr
//!   (raw, with the `\r` redraws) and exit code of real kopia runs, written by
//!   `testdata/kopia/capture.sh`; its `notes.txt` gives each run's argv and, for the signal cases,
//!   how kopia ended. Every test below reads every version present. What a test expects comes
//!   from the capture itself where it can (the manifest read with serde_json, the raw frames
//!   counted), not from the parser.
//! - The kopia under test (`PODVOLUME_TEST_KOPIA`) run directly on real files with the
//!   invocations the agent builds: the repository lifecycle, a snapshot and its restore, the
//!   first SIGINT, base-2 sizes.
//! - One synthesised fixture, for what no capture holds: `testdata/kopia/snapshot-incremental-base2`
//!   (written by hand, see `testdata/kopia/README.md`).

mod common;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use podvolume_agent::facts::RunFacts;
use podvolume_agent::framing::{DEFAULT_MAX_FRAME, Framer, OwnedFrame, Separators, frame_all};
use podvolume_agent::progress::ProgressTracker;
use podvolume_agent::text::format_bytes;
use podvolume_agent::uploader::kopia::{self, KopiaParser, parse_si_bytes};
use podvolume_agent::uploader::{
    Direction, ExitInfo, Outcome, OutcomeKind, ProgressSample, RepositoryAccess, RunSummary,
    Stream, UploaderEvent,
};
use serde_json::Value;

#[test]
fn kopia_under_test() {
    assert_requested_kopia_version();
    // A version is tested against its own captures: they must be there.
    let k = kopia();
    let version = format!("{}.{}.{}", k.version.0, k.version.1, k.version.2);
    assert!(
        captures().iter().any(|c| c.version == version),
        "no captures of kopia {version} in testdata/kopia/{version}/ (testdata/kopia/capture.sh writes them)"
    );
}

fn kopia_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata/kopia")
}

// --- runs and their events ----------------------------------------------------------------------

/// Everything a run said, in order per stream.
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

    fn fatal_events(&self) -> Vec<&str> {
        self.events
            .iter()
            .filter_map(|(_, e)| match e {
                UploaderEvent::Fatal(m) => Some(m.as_str()),
                _ => None,
            })
            .collect()
    }

    fn malformed(&self) -> Vec<&str> {
        self.events
            .iter()
            .filter_map(|(_, e)| match e {
                UploaderEvent::Malformed(m) => Some(m.as_str()),
                _ => None,
            })
            .collect()
    }

    fn summary(&self) -> &RunSummary {
        self.facts.summary.as_ref().expect("a summary")
    }

    fn classify(&self, stopped: bool, direction: Direction) -> Outcome {
        kopia::classify(self.exit, &self.facts, stopped, direction)
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

/// Parses a run's output as the engine does (stderr framed on `\n` and `\r`, stdout too), and
/// checks that nothing was malformed or cut.
fn parse_output(
    what: &str,
    stdout: &[u8],
    stderr: &[u8],
    exit: ExitInfo,
    direction: Direction,
) -> Run {
    let run = parse_output_leniently(stdout, stderr, exit, direction);
    for (_, e) in &run.events {
        assert!(
            !matches!(
                e,
                UploaderEvent::Malformed(_) | UploaderEvent::Truncated { .. }
            ),
            "{what}: unexpected {e:?}"
        );
    }
    run
}

/// [`parse_output`] that lets malformed records through (see [`Run::malformed`]).
fn parse_output_leniently(
    stdout: &[u8],
    stderr: &[u8],
    exit: ExitInfo,
    direction: Direction,
) -> Run {
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
    }
    Run {
        events,
        facts,
        exit,
    }
}

/// The records of a raw stream, as the framer cuts them, trimmed.
fn records(data: &[u8]) -> Vec<String> {
    data.split(|b| *b == b'\n' || *b == b'\r')
        .map(|r| String::from_utf8_lossy(r.trim_ascii()).into_owned())
        .filter(|r| !r.is_empty())
        .collect()
}

/// kopia's snapshot progress lines in a raw stderr (` <spinner> N hashing, N hashed (...), ...`).
fn snapshot_frames(stderr: &[u8]) -> Vec<String> {
    records(stderr)
        .into_iter()
        .filter(|r| r.contains(" hashing, ") && r.contains(" hashed ("))
        .collect()
}

/// kopia's restore progress lines (`Processed N (...) of M (...)...`).
fn restore_frames(stderr: &[u8]) -> Vec<String> {
    records(stderr)
        .into_iter()
        .filter(|r| r.starts_with("Processed "))
        .collect()
}

/// Counters that only grow in kopia grow in what the parser makes of them: file counts as they
/// are, byte figures once through the tracker the engine publishes from (each figure is a lower
/// bound, and `byte_figures_are_read_as_the_smallest_count_kopia_prints_so` checks the bounds
/// themselves).
fn assert_monotonic(what: &str, samples: &[&ProgressSample]) {
    for w in samples.windows(2) {
        assert!(w[1].files_done >= w[0].files_done, "{what}: {w:?}");
    }
    let now = std::time::SystemTime::now();
    let mut tracker = ProgressTracker::new(Direction::Backup, now);
    let mut last = 0;
    for s in samples {
        tracker.observe(s, Instant::now(), now);
        let p = tracker.progress();
        assert!(p.n_completed >= last, "{what}: went down at {s:?}");
        assert!(p.n_completed <= p.n_total, "{what}: {p:?}");
        last = p.n_completed;
    }
}

// --- the captures -------------------------------------------------------------------------------

/// The captures of one kopia version.
struct Capture {
    version: String,
    dir: PathBuf,
    notes: String,
}

/// Every `testdata/kopia/<version>/` there is, oldest version first.
fn captures() -> Vec<Capture> {
    let mut found: Vec<(Vec<u32>, Capture)> = std::fs::read_dir(kopia_dir())
        .unwrap()
        .flatten()
        .filter(|e| e.file_type().unwrap().is_dir())
        .filter_map(|e| {
            let version = e.file_name().to_string_lossy().into_owned();
            let parts: Vec<u32> = version
                .split('.')
                .map(|p| p.parse().ok())
                .collect::<Option<_>>()?;
            let notes = std::fs::read_to_string(e.path().join("notes.txt"))
                .unwrap_or_else(|err| panic!("{}/notes.txt: {err}", e.path().display()));
            Some((
                parts,
                Capture {
                    version,
                    dir: e.path(),
                    notes,
                },
            ))
        })
        .collect();
    found.sort_by(|a, b| a.0.cmp(&b.0));
    let found: Vec<Capture> = found.into_iter().map(|(_, c)| c).collect();
    assert!(
        !found.is_empty(),
        "no kopia captures in {}",
        kopia_dir().display()
    );
    found
}

impl Capture {
    fn what(&self, name: &str) -> String {
        format!("kopia {} {name}", self.version)
    }

    fn raw(&self, name: &str, ext: &str) -> Vec<u8> {
        let path = self.dir.join(format!("{name}.{ext}"));
        std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    /// The line `notes.txt` has about this case.
    fn note(&self, name: &str) -> &str {
        let prefix = format!("{name}: ");
        self.notes
            .lines()
            .find(|l| l.starts_with(&prefix))
            .unwrap_or_else(|| panic!("{}: not in notes.txt", self.what(name)))
    }

    /// The argv of the case, as the notes show it (`$T` for the capture's temporary directory).
    fn argv(&self, name: &str) -> &str {
        let note = self.note(name);
        &note[note.rfind("; ").unwrap() + 2..]
    }

    /// How kopia ended: the `.exit` file holds 128+N for a death by signal N, which the notes
    /// tell apart (`kopia: signal 2`) from a real exit code.
    fn exit(&self, name: &str) -> ExitInfo {
        let note = self.note(name);
        if let Some(rest) = note.split("kopia: ").nth(1) {
            let mut words = rest.split_whitespace();
            let kind = words.next().unwrap();
            let n: i32 = words.next().unwrap().parse().unwrap();
            return match kind {
                "signal" => ExitInfo {
                    code: None,
                    signal: Some(n),
                },
                "exit" => ExitInfo::code(n),
                other => panic!("{}: {other:?} in the notes", self.what(name)),
            };
        }
        let text = String::from_utf8(self.raw(name, "exit")).unwrap();
        ExitInfo::code(text.trim().parse().unwrap())
    }

    /// Parses the case's output; also checks that framing it in arbitrary read sizes gives the
    /// same events as framing it whole.
    fn run(&self, name: &str, direction: Direction) -> Run {
        let stderr = self.raw(name, "stderr");
        let run = parse_output(
            &self.what(name),
            &self.raw(name, "stdout"),
            &stderr,
            self.exit(name),
            direction,
        );
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
                "{}, chunks of {chunk}",
                self.what(name)
            );
        }
        run
    }

    /// The manifest kopia printed on stdout, read with serde_json.
    fn manifest(&self, name: &str) -> Value {
        let stdout = self.raw(name, "stdout");
        let line = records(&stdout)
            .into_iter()
            .find(|l| l.starts_with('{'))
            .unwrap_or_else(|| panic!("{}: no manifest on stdout", self.what(name)));
        serde_json::from_str(&line).unwrap()
    }
}

fn as_u64(v: &Value) -> u64 {
    v.as_u64().unwrap_or(0)
}

/// The snapshot cases that end with a complete manifest.
const COMPLETE_SNAPSHOTS: &[&str] = &[
    "snapshot-full",
    "snapshot-incremental",
    "snapshot-incremental-json-verbose",
    "snapshot-progress-interval-100ms",
    "snapshot-progress-interval-2s",
    "snapshot-no-progress-flag",
    "snapshot-stdout-tty",
    "snapshot-velero",
    "snapshot-velero-2-json-verbose",
    "snapshot-explicit-no-progress",
];

#[test]
fn complete_snapshots_progress_and_manifests() {
    for cap in captures() {
        for &name in COMPLETE_SNAPSHOTS {
            let what = cap.what(name);
            let run = cap.run(name, Direction::Backup);
            assert_eq!(run.exit, ExitInfo::code(0), "{what}");
            let m = cap.manifest(name);
            let id = m["id"].as_str().unwrap();
            let size = as_u64(&m["rootEntry"]["summ"]["size"]);
            let files = as_u64(&m["rootEntry"]["summ"]["files"]);
            assert!(size > 100_000_000, "{what}: {m}");

            // Every progress line kopia drew is one progress event, in order.
            let frames = snapshot_frames(&cap.raw(name, "stderr"));
            let p = run.progress();
            assert_eq!(p.len(), frames.len(), "{what}: {frames:#?}");
            assert_monotonic(&what, &p);
            for (s, f) in p.iter().zip(&frames) {
                // Lower bounds: never above the exact size the manifest gives.
                assert!(s.bytes_done <= size, "{what}: {f:?} read as {s:?} > {size}");
                if f.contains(", estimating...") {
                    assert_eq!(
                        (s.total_bytes, s.scan_finished),
                        (None, false),
                        "{what}: {f}"
                    );
                } else {
                    assert!(f.contains(", estimated "), "{what}: {f}");
                    let t = s.total_bytes.unwrap_or_else(|| panic!("{what}: {f}"));
                    assert!(t <= size && s.scan_finished, "{what}: {f:?} read as {s:?}");
                }
            }
            // The final frame (`*`) comes last, and its figures are within 1% of the manifest.
            if let Some(last) = frames.last() {
                assert!(last.starts_with("* "), "{what}: {last}");
                let done = p.last().unwrap().bytes_done;
                assert!(
                    done >= size - size / 100,
                    "{what}: {last} read as {done} of {size}"
                );
            }

            let s = run.summary();
            assert_eq!(s.snapshot_id.as_deref(), Some(id), "{what}");
            assert_eq!((s.total_bytes, s.total_files), (size, files), "{what}");
            assert_eq!(
                (s.failed_items, s.incomplete.as_deref()),
                (0, None),
                "{what}"
            );
            assert!(run.items().is_empty(), "{what}");
            assert!(run.fatal_events().is_empty(), "{what}");
            let o = run.classify(false, Direction::Backup);
            assert_eq!(o.kind, OutcomeKind::Success, "{what}: {o:?}");
            assert_eq!(o.snapshot_id.as_deref(), Some(id), "{what}");
            assert_eq!(
                o.message,
                format!(
                    "snapshot {id} saved: {} in {files} files",
                    format_bytes(size)
                ),
                "{what}"
            );
            // The same output without its manifest (stdout lost) is no success.
            let mut facts = run.facts.clone();
            facts.summary = None;
            let o = kopia::classify(run.exit, &facts, false, Direction::Backup);
            assert_eq!(o.kind, OutcomeKind::Failed, "{what}");
        }
    }
}

/// Which versions draw progress without `--progress` when stdout is not a terminal: 0.21 and
/// 0.22 do, 0.23 does not (the agent always passes `--progress`).
#[test]
fn progress_needs_the_progress_flag_from_0_23_on() {
    for cap in captures() {
        let drawn = snapshot_frames(&cap.raw("snapshot-no-progress-flag", "stderr")).len();
        let v: Vec<u32> = cap.version.split('.').map(|p| p.parse().unwrap()).collect();
        if v[..] >= [0, 23][..] {
            assert_eq!(drawn, 0, "{}", cap.version);
        } else {
            assert!(drawn > 0, "{}", cap.version);
        }
        // With --progress every version draws, and --no-progress silences every version.
        assert!(!snapshot_frames(&cap.raw("snapshot-full", "stderr")).is_empty());
        assert!(snapshot_frames(&cap.raw("snapshot-explicit-no-progress", "stderr")).is_empty());
    }
}

/// A second snapshot of the same source: kopia takes the first as its parent, so the files come
/// out "cached", and the manifest with `--json-verbose` says so in its `stats`.
#[test]
fn incremental_snapshots_read_cached_files() {
    for cap in captures() {
        let what = cap.what("snapshot-incremental");
        let run = cap.run("snapshot-incremental", Direction::Backup);
        let last = *run.progress().last().unwrap();
        let frames = snapshot_frames(&cap.raw("snapshot-incremental", "stderr"));
        assert!(
            frames.last().unwrap().contains(" cached (201 MB)"),
            "{what}: {frames:?}"
        );
        assert!(last.bytes_done >= 200_000_000, "{what}: {last:?}");
        let m = cap.manifest("snapshot-incremental-json-verbose");
        assert!(as_u64(&m["stats"]["cachedFiles"]) >= 9, "{what}: {m}");
        assert!(as_u64(&m["stats"]["nonCachedFiles"]) <= 1, "{what}: {m}");
        // Velero's incrementalBytes from the same run: nothing read when every file was cached,
        // else the last progress line's "hashed" figure (a file of a few bytes here).
        let name = "snapshot-incremental-json-verbose";
        let o = cap
            .run(name, Direction::Backup)
            .classify(false, Direction::Backup);
        let incremental = o.summary.as_ref().and_then(|s| s.incremental_bytes);
        if as_u64(&m["stats"]["nonCachedFiles"]) == 0 {
            assert_eq!(incremental, Some(0), "{}: {o:?}", cap.what(name));
        } else {
            assert!(
                incremental.is_some_and(|b| b < 1_000_000),
                "{}: {o:?}",
                cap.what(name)
            );
        }
    }
}

/// kopia says nothing of the total for its first second (`estimating...`): a short incremental
/// snapshot is estimating from its first line to its last. The progress published meanwhile keeps
/// nCompleted <= nTotal ("at least this much of at least that much"); when nTotal equals a
/// non-zero nCompleted it must not read as 100% done: its stage says the total is not known yet
/// (`scanning`), which is what a progress bar goes by. The real frames are fed to the tracker the
/// engine uses.
#[test]
fn progress_is_never_a_full_bar_while_kopia_is_estimating() {
    let started = std::time::SystemTime::now();
    let mut full_bars = Vec::new();
    for cap in captures() {
        for name in ["snapshot-full", "snapshot-incremental", "snapshot-sigint"] {
            let stderr = cap.raw(name, "stderr");
            let frames = snapshot_frames(&stderr);
            let run = cap.run(name, Direction::Backup);
            let mut tracker = ProgressTracker::new(Direction::Backup, started);
            for (sample, frame) in run.progress().into_iter().zip(&frames) {
                tracker.observe(sample, Instant::now(), std::time::SystemTime::now());
                let p = tracker.progress();
                if sample.total_bytes.is_none()
                    && p.n_completed > 0
                    && p.n_total == p.n_completed
                    && !p.description.starts_with("scanning")
                {
                    full_bars.push(format!(
                        "{}: {frame:?} published as {} of {} ({:?})",
                        cap.what(name),
                        p.n_completed,
                        p.n_total,
                        p.description
                    ));
                }
            }
        }
    }
    assert!(
        full_bars.is_empty(),
        "{} full bars before kopia gave a total:\n{}",
        full_bars.len(),
        full_bars.join("\n")
    );
}

/// The smallest byte count kopia prints as `figure`: kopia formats `%.1f` of the value in its
/// unit and trims a trailing `.0` (`internal/units`), so `201 MB` stands for
/// [200.95 MB, 201.05 MB) and `1.3 MB` for [1.25 MB, 1.35 MB). Plain bytes are exact.
fn smallest_printed_as(figure: &str) -> u64 {
    let (num, unit) = figure.split_once(' ').unwrap();
    let multiplier: u128 = match unit {
        "B" => 1,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "TB" => 1_000_000_000_000,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        other => panic!("unit {other:?}"),
    };
    let (int, frac) = num.split_once('.').unwrap_or((num, "0"));
    assert_eq!(frac.len(), 1, "{figure}");
    let tenths: u128 = int.parse::<u128>().unwrap() * 10 + frac.parse::<u128>().unwrap();
    if multiplier == 1 || tenths == 0 {
        return (tenths * multiplier / 10) as u64;
    }
    // (tenths - 1/2) / 10 * multiplier, rounded up to a whole byte.
    ((2 * tenths - 1) * multiplier).div_ceil(20) as u64
}

/// The byte figures of a progress line: those in parentheses and the estimate.
fn byte_figures(line: &str) -> Vec<&str> {
    let mut figures = Vec::new();
    for (i, _) in line.match_indices('(') {
        if let Some(end) = line[i..].find(')') {
            let figure = &line[i + 1..i + end];
            if figure.ends_with('B') && figure.contains(' ') {
                figures.push(figure);
            }
        }
    }
    if let Some((_, rest)) = line.split_once(", estimated ") {
        let end = rest
            .match_indices(' ')
            .nth(1)
            .map_or(rest.len(), |(i, _)| i);
        figures.push(&rest[..end]);
    }
    figures
}

/// Every byte figure of the captured progress and restore lines, read by the parser, is the
/// smallest count kopia prints that way: nothing above (progress would overshoot the manifest)
/// and nothing needlessly below (a whole figure like `201 MB` has a precision of 0.1 MB, not
/// 1 MB). Read a whole unit too low, consecutive lines go backwards (`99.6 MB` then `100 MB`).
#[test]
fn byte_figures_are_read_as_the_smallest_count_kopia_prints_so() {
    let mut wrong = Vec::new();
    for cap in captures() {
        let names = COMPLETE_SNAPSHOTS.iter().chain(&[
            "restore",
            "restore-parallel-sparse",
            "restore-no-progress-flag",
        ]);
        for &name in names {
            let stderr = cap.raw(name, "stderr");
            let mut lines = snapshot_frames(&stderr);
            lines.extend(restore_frames(&stderr));
            for line in &lines {
                for figure in byte_figures(line) {
                    let got = parse_si_bytes(figure).unwrap();
                    let want = smallest_printed_as(figure);
                    if got != want {
                        wrong.push(format!(
                            "{}: {figure:?} read as {got}, but kopia prints it for no count below {want}",
                            cap.what(name)
                        ));
                    }
                }
            }
            let direction = if name.starts_with("restore") {
                Direction::Restore
            } else {
                Direction::Backup
            };
            let run = cap.run(name, direction);
            let p = run.progress();
            for (i, w) in p.windows(2).enumerate() {
                if w[1].bytes_done < w[0].bytes_done {
                    wrong.push(format!(
                        "{}: {:?} then {:?}: bytes done read as {} then {}",
                        cap.what(name),
                        lines.get(i),
                        lines.get(i + 1),
                        w[0].bytes_done,
                        w[1].bytes_done
                    ));
                }
            }
        }
    }
    wrong.sort();
    wrong.dedup();
    assert!(
        wrong.is_empty(),
        "{} figures read below kopia's precision:\n{}",
        wrong.len(),
        wrong.join("\n")
    );
}

/// The first SIGINT or SIGTERM (and a second one 0.5 s later): kopia stops reading, saves a
/// partial snapshot marked `"incomplete":"canceled"` and exits 0.
#[test]
fn signals_during_a_snapshot_save_a_canceled_snapshot() {
    for cap in captures() {
        for name in [
            "snapshot-sigint",
            "snapshot-sigint-twice",
            "snapshot-sigterm",
            "snapshot-sigterm-twice",
        ] {
            let what = cap.what(name);
            let run = cap.run(name, Direction::Backup);
            assert_eq!(run.exit, ExitInfo::code(0), "{what}");
            assert_monotonic(&what, &run.progress());
            let m = cap.manifest(name);
            assert_eq!(m["incomplete"], "canceled", "{what}");
            let id = m["id"].as_str().unwrap();
            let s = run.summary();
            assert_eq!(s.incomplete.as_deref(), Some("canceled"), "{what}");
            assert_eq!(
                s.total_bytes,
                as_u64(&m["rootEntry"]["summ"]["size"]),
                "{what}"
            );
            assert!(s.total_bytes < 200_000_000, "{what}: {s:?}");

            // Our stop: canceled, and the partial snapshot is named, not returned.
            let o = run.classify(true, Direction::Backup);
            assert_eq!(o.kind, OutcomeKind::Canceled, "{what}");
            assert_eq!(o.snapshot_id, None, "{what}");
            assert!(
                o.message.contains(id) && o.message.contains("incomplete: canceled"),
                "{what}: {}",
                o.message
            );
            // Without our stop: someone else's signal.
            let o = run.classify(false, Direction::Backup);
            assert_eq!(o.kind, OutcomeKind::Interrupted, "{what}");
            assert_eq!(o.snapshot_id, None, "{what}");
        }
    }
}

/// kopia run as `nobody` over a file and a directory it may not read: both are reported (` ! Error
/// when processing "<path>": <error>`, or without the ` ! ` when progress is off), the snapshot
/// is saved with `numFailed`, and kopia exits 1.
#[test]
fn unreadable_entries_are_named_and_the_snapshot_kept() {
    for cap in captures() {
        for name in [
            "snapshot-unreadable",
            "snapshot-unreadable-json-verbose",
            "snapshot-unreadable-no-progress",
        ] {
            let what = cap.what(name);
            let run = cap.run(name, Direction::Backup);
            assert_eq!(run.exit, ExitInfo::code(1), "{what}");
            assert_monotonic(&what, &run.progress());
            let m = cap.manifest(name);
            let id = m["id"].as_str().unwrap();
            let summ = &m["rootEntry"]["summ"];
            let mut want: Vec<(String, String)> = summ["errors"]
                .as_array()
                .unwrap()
                .iter()
                .map(|e| {
                    (
                        e["path"].as_str().unwrap().to_string(),
                        e["error"].as_str().unwrap().to_string(),
                    )
                })
                .collect();
            want.sort();
            let mut got: Vec<(String, String)> = run
                .items()
                .iter()
                .map(|(i, m)| (i.to_string(), m.to_string()))
                .collect();
            got.sort();
            assert_eq!(got, want, "{what}");
            assert_eq!(want.len(), 2, "{what}");
            assert!(run.fatal_events().is_empty(), "{what}");
            assert!(
                run.facts
                    .stderr_tail
                    .iter()
                    .any(|l| l.starts_with("Found 2 fatal error(s) while snapshotting ")),
                "{what}: {:?}",
                run.facts.stderr_tail
            );
            assert_eq!(
                run.summary().failed_items,
                as_u64(&summ["numFailed"]),
                "{what}"
            );

            let o = run.classify(false, Direction::Backup);
            assert_eq!(o.kind, OutcomeKind::Partial, "{what}");
            assert_eq!(o.exit_code, Some(1), "{what}");
            assert_eq!(o.snapshot_id.as_deref(), Some(id), "{what}");
            assert_eq!(o.failed_items, 2, "{what}");
            let prefix = format!("snapshot {id} saved, but 2 items could not be read: ");
            assert!(o.message.starts_with(&prefix), "{what}: {}", o.message);
            for (item, _) in &want {
                assert!(o.message.contains(item.as_str()), "{what}: {}", o.message);
            }
        }
    }
}

/// With `--fail-fast` kopia stops at the first unreadable entry by itself: it saves the partial
/// snapshot marked `"incomplete":"canceled"` (the same mark a signal leaves) and exits 1. No
/// signal was sent: the outcome is a failure naming what could not be read, not an interruption.
#[test]
fn a_fail_fast_stop_is_a_failure_naming_the_item_not_an_interruption() {
    let mut wrong = Vec::new();
    for cap in captures() {
        let name = "snapshot-unreadable-fail-fast";
        let what = cap.what(name);
        let run = cap.run(name, Direction::Backup);
        assert_eq!(run.exit, ExitInfo::code(1), "{what}");
        let m = cap.manifest(name);
        assert_eq!(m["incomplete"], "canceled", "{what}");
        assert!(as_u64(&m["rootEntry"]["summ"]["numFailed"]) >= 1, "{what}");
        let first = run.items()[0].0.to_string();
        let o = run.classify(false, Direction::Backup);
        assert_eq!(o.snapshot_id, None, "{what}");
        if o.kind != OutcomeKind::Failed
            || !o.message.contains(&first)
            || o.message.contains("signal")
        {
            wrong.push(format!(
                "{what} (exit 1, {first:?} unreadable): {:?}: {}",
                o.kind, o.message
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "a --fail-fast stop is not a failure naming the unreadable item:\n{}",
        wrong.join("\n")
    );
}

/// Errors a policy says to ignore are printed (` ! Ignored error when processing ...`) but are
/// not failures: exit 0, a complete snapshot.
#[test]
fn ignored_errors_are_no_failure() {
    for cap in captures() {
        let name = "snapshot-unreadable-ignored";
        let what = cap.what(name);
        let run = parse_output_leniently(
            &cap.raw(name, "stdout"),
            &cap.raw(name, "stderr"),
            cap.exit(name),
            Direction::Backup,
        );
        let m = cap.manifest(name);
        assert_eq!(
            as_u64(&m["rootEntry"]["summ"]["numIgnoredErrors"]),
            2,
            "{what}"
        );
        assert!(run.items().is_empty(), "{what}");
        let o = run.classify(false, Direction::Backup);
        assert_eq!(o.kind, OutcomeKind::Success, "{what}: {}", o.message);
        assert_eq!(o.snapshot_id.as_deref(), m["id"].as_str(), "{what}");
    }
}

/// While errors are ignored the progress lines carry `(N errors ignored)`, with no
/// `(N fatal errors)` before it: they are progress like any other, not malformed records.
#[test]
fn progress_lines_with_ignored_errors_are_progress() {
    let mut malformed = Vec::new();
    for cap in captures() {
        let name = "snapshot-unreadable-ignored";
        let frames = snapshot_frames(&cap.raw(name, "stderr"));
        assert!(
            frames.iter().any(|f| f.contains(" errors ignored)")),
            "{}: {frames:?}",
            cap.what(name)
        );
        let run = parse_output_leniently(
            &cap.raw(name, "stdout"),
            &cap.raw(name, "stderr"),
            cap.exit(name),
            Direction::Backup,
        );
        for m in run.malformed() {
            malformed.push(format!("{}: {m}", cap.what(name)));
        }
        assert_eq!(run.progress().len() + run.malformed().len(), frames.len());
    }
    assert!(
        malformed.is_empty(),
        "{} progress lines not understood:\n{}",
        malformed.len(),
        malformed.join("\n")
    );
}

/// `--upload-limit-mb` stops the snapshot after that much data: an incomplete manifest
/// (`"incomplete":"limit reached"`) and exit 0, which is no success.
#[test]
fn an_upload_limit_stop_is_a_failure() {
    for cap in captures() {
        let name = "snapshot-upload-limit";
        let what = cap.what(name);
        let run = cap.run(name, Direction::Backup);
        assert_eq!(run.exit, ExitInfo::code(0), "{what}");
        let o = run.classify(false, Direction::Backup);
        assert_eq!(o.kind, OutcomeKind::Failed, "{what}");
        assert_eq!(o.snapshot_id, None, "{what}");
        assert!(o.message.contains("limit reached"), "{what}: {}", o.message);
    }
}

/// `--json-verbose` without `--json` prints no manifest: a run that cannot be confirmed.
#[test]
fn a_snapshot_without_its_manifest_is_not_confirmed() {
    for cap in captures() {
        let name = "snapshot-json-verbose-without-json";
        let run = cap.run(name, Direction::Backup);
        assert!(run.facts.summary.is_none(), "{}", cap.what(name));
        let o = run.classify(false, Direction::Backup);
        assert_eq!(o.kind, OutcomeKind::Failed, "{}", cap.what(name));
        assert!(o.message.contains("no snapshot manifest"), "{}", o.message);
    }
}

#[test]
fn restores_progress_and_final_line() {
    for cap in captures() {
        let full = cap.manifest("snapshot-full");
        let full_id = full["id"].as_str().unwrap();
        let size = as_u64(&full["rootEntry"]["summ"]["size"]);
        let entries = as_u64(&full["rootEntry"]["summ"]["files"])
            + as_u64(&full["rootEntry"]["summ"]["symlinks"]);
        for name in [
            "restore",
            "restore-parallel-sparse",
            "restore-no-progress-flag",
        ] {
            let what = cap.what(name);
            // The snapshot restored is snapshot-full's.
            assert!(
                cap.argv(name).contains(full_id),
                "{what}: {}",
                cap.argv(name)
            );
            let run = cap.run(name, Direction::Restore);
            assert_eq!(run.exit, ExitInfo::code(0), "{what}");
            let frames = restore_frames(&cap.raw(name, "stderr"));
            let p = run.progress();
            assert_eq!(p.len(), frames.len(), "{what}");
            assert_monotonic(&what, &p);
            for (s, f) in p.iter().zip(&frames) {
                let total = s.total_bytes.unwrap();
                assert!(
                    s.bytes_done <= size && total <= size,
                    "{what}: {f:?} read as {s:?}"
                );
                // The time left appears once kopia has a rate.
                assert_eq!(s.scan_finished, f.contains(" remaining "), "{what}: {f}");
            }
            let s = run.summary();
            assert_eq!(s.snapshot_id, None, "{what}");
            assert_eq!(s.total_files, entries, "{what}: {s:?}");
            assert!(s.total_bytes <= size, "{what}: {s:?}");
            assert!(s.total_bytes >= size - size / 100, "{what}: {s:?}");
            let o = run.classify(false, Direction::Restore);
            assert_eq!(o.kind, OutcomeKind::Success, "{what}");
            assert_eq!(
                o.message,
                kopia::restore_message(s.total_bytes, entries),
                "{what}"
            );
        }
    }
}

/// kopia installs no signal handler for a restore: SIGINT and SIGTERM kill it.
#[test]
fn signals_kill_a_restore() {
    for cap in captures() {
        for (name, signal) in [("restore-sigint", 2), ("restore-sigterm", 15)] {
            let what = cap.what(name);
            let run = cap.run(name, Direction::Restore);
            assert_eq!(
                run.exit,
                ExitInfo {
                    code: None,
                    signal: Some(signal)
                },
                "{what}"
            );
            assert!(!run.progress().is_empty(), "{what}");
            assert_monotonic(&what, &run.progress());
            assert!(run.facts.summary.is_none(), "{what}");
            assert_eq!(
                run.classify(true, Direction::Restore).kind,
                OutcomeKind::Canceled,
                "{what}"
            );
            assert_eq!(
                run.classify(false, Direction::Restore).kind,
                OutcomeKind::KilledBySignal { signal },
                "{what}"
            );
        }
    }
}

/// What kopia prints when the repository, the password or the source is not what it should be,
/// classified by its words (kopia exits 1 for all of them). 0.21 prefixes each error line with
/// `ERROR` (in red unless colours are off), later versions print the bare message.
#[test]
fn failures_are_classified_by_kopias_words() {
    let cases: &[(&str, OutcomeKind, &str)] = &[
        (
            "connect-wrong-password",
            OutcomeKind::WrongPassword,
            "invalid repository password",
        ),
        (
            "connect-wrong-password-color",
            OutcomeKind::WrongPassword,
            "invalid repository password",
        ),
        (
            "snapshot-wrong-password",
            OutcomeKind::WrongPassword,
            "invalid repository password",
        ),
        (
            "connect-empty-dir",
            OutcomeKind::RepositoryMissing,
            "repository not initialized in the provided storage",
        ),
        (
            "connect-missing-dir",
            OutcomeKind::RepositoryMissing,
            "cannot access storage path",
        ),
        (
            "snapshot-not-connected",
            OutcomeKind::RepositoryMissing,
            "repository is not connected",
        ),
        (
            "snapshot-repository-gone",
            OutcomeKind::RepositoryMissing,
            "cannot access storage path",
        ),
        (
            "snapshot-missing-source",
            OutcomeKind::SourceMissing,
            "no such file or directory",
        ),
        ("snapshot-no-password", OutcomeKind::Failed, "get password"),
    ];
    for cap in captures() {
        for (name, want, words) in cases {
            let what = cap.what(name);
            let run = cap.run(name, Direction::Backup);
            assert_eq!(run.exit, ExitInfo::code(1), "{what}");
            let o = run.classify(false, Direction::Backup);
            assert_eq!(&o.kind, want, "{what}: {}", o.message);
            assert!(o.message.contains(words), "{what}: {}", o.message);
            assert!(
                !o.message.contains('\u{1b}') && !o.message.starts_with("ERROR"),
                "{what}: {:?}",
                o.message
            );
            assert_eq!(o.snapshot_id, None, "{what}");
        }
        // A restore that meets the wrong password says the same.
        let run = cap.run("snapshot-wrong-password", Direction::Restore);
        assert_eq!(
            run.classify(false, Direction::Restore).kind,
            OutcomeKind::WrongPassword
        );
    }
}

/// `KOPIA_DISABLE_COLOR=true` (which the agent sets) is honoured: 0.21 colours its `ERROR` prefix
/// without it, and never with it.
#[test]
fn colours_are_off_with_the_agents_environment() {
    for cap in captures() {
        for name in ["connect-wrong-password", "snapshot-wrong-password"] {
            assert!(
                !cap.raw(name, "stderr").contains(&0x1b),
                "{}",
                cap.what(name)
            );
        }
        let coloured = cap
            .raw("connect-wrong-password-color", "stderr")
            .contains(&0x1b);
        assert_eq!(coloured, cap.version == "0.21.1", "{}", cap.version);
    }
}

/// Commands that succeed say nothing the parser would take for a failure.
#[test]
fn successful_commands_print_nothing_fatal() {
    for cap in captures() {
        for name in [
            "repository-create",
            "nobody-repository-create",
            "throttle-set",
            "policy-set-velero",
            "policy-set-ignore-errors",
            "connect-persist-default",
            "connect-no-persist-credentials",
            "connect-no-check-for-updates",
        ] {
            let what = cap.what(name);
            let run = cap.run(name, Direction::Restore);
            assert_eq!(run.exit, ExitInfo::code(0), "{what}");
            assert!(
                run.fatal_events().is_empty(),
                "{what}: {:?}",
                run.fatal_events()
            );
            assert!(
                run.items().is_empty() && run.progress().is_empty(),
                "{what}"
            );
        }
    }
}

/// Every flag the agent puts in a `snapshot create`, `policy set` or `snapshot restore` argv was
/// accepted by each captured version (it appears in a run that exited 0).
#[test]
fn every_flag_the_agent_passes_is_accepted_by_each_version() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("pw"), "pw").unwrap();
    let access = RepositoryAccess {
        repository: "/repo".into(),
        password_file: dir.path().join("pw"),
        cache_dir: dir.path().join("cache"),
        ..Default::default()
    };
    let velero = kopia::SnapshotOptions {
        source: Some("default@default:snapshot-pod-volume/kopia/ns/pod/vol".into()),
        description: Some("Kopia Uploader".into()),
        pins: vec!["velero-pin".into()],
        parallel: Some(2),
        fail_fast: true,
        keep_all_policy: true,
    };
    let invocations = [
        kopia::snapshot_create(
            &access,
            Path::new("/v"),
            &[("k".into(), "v".into())],
            &velero,
        )
        .unwrap(),
        kopia::policy_keep_all(&access, "default@default:x").unwrap(),
        kopia::snapshot_restore(
            &access,
            "k1",
            Path::new("/t"),
            &kopia::RestoreOptions {
                write_sparse_files: true,
                parallel: Some(4),
            },
        )
        .unwrap(),
    ];
    let flags: Vec<String> = invocations
        .iter()
        .flat_map(|i| i.args.iter())
        .map(|a| a.to_string_lossy().into_owned())
        .filter(|a| a.starts_with("--"))
        .map(|a| a.split('=').next().unwrap().to_string())
        .collect();
    assert!(flags.len() >= 10, "{flags:?}");
    for cap in captures() {
        let accepted: Vec<&str> = cap
            .notes
            .lines()
            .filter(|l| l.contains(": exit 0,"))
            .collect();
        for flag in &flags {
            let spaced = format!(" {flag} ");
            let assigned = format!(" {flag}=");
            assert!(
                accepted
                    .iter()
                    .any(|l| l.contains(&spaced) || l.contains(&assigned)),
                "kopia {} ran no successful command with {flag}",
                cap.version
            );
        }
        // --no-check-for-updates is no flag of these commands: the agent uses the variable.
        assert_eq!(
            cap.exit("flag-no-check-for-updates"),
            ExitInfo::code(1),
            "{}",
            cap.version
        );
    }
}

// --- synthesised: what no capture holds ---------------------------------------------------------

/// SYNTHESISED fixture (written by hand, not captured): base-2 units
/// (`KOPIA_BYTES_STRING_BASE_2`, which the agent scrubs from kopia's environment) and a
/// percentage above 100. The real binary's base-2 output is checked in
/// `base2_sizes_from_the_real_binary` below.
#[test]
fn synthesised_incremental_base2_over_100_percent() {
    let dir = kopia_dir();
    let read = |ext: &str| std::fs::read(dir.join(format!("snapshot-incremental-base2.{ext}")));
    let code: i32 = String::from_utf8(read("exit").unwrap())
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let run = parse_output(
        "synthesised snapshot-incremental-base2",
        &read("stdout").unwrap(),
        &read("stderr").unwrap(),
        ExitInfo::code(code),
        Direction::Backup,
    );
    let p = run.progress();
    assert_eq!(p.len(), 4);
    assert_monotonic("base2", &p);
    let last = p.last().unwrap();
    // 1.1 MiB hashed + 9.2 MiB cached, estimate 9.5 MiB, each read as its lower bound (0.05 MiB
    // less, rounded up to a whole byte): done passes the estimate (108.4%).
    assert_eq!(last.bytes_done, 1_101_005 + 9_594_471);
    assert_eq!(last.total_bytes, Some(9_909_044));
    assert!(last.bytes_done > last.total_bytes.unwrap());
    assert_eq!(last.files_done, 14);
    assert_eq!(run.summary().total_bytes, 10_800_000);
    assert!(last.bytes_done <= run.summary().total_bytes);
    assert_eq!(
        run.classify(false, Direction::Backup).kind,
        OutcomeKind::Success
    );
}

// --- the kopia under test, run directly ---------------------------------------------------------

/// Runs an invocation the agent built with the kopia under test, environment and all (the
/// variables the agent scrubs are scrubbed), and parses what it printed.
fn run_kopia(inv: &kopia::KopiaInvocation, direction: Direction, extra: &[(&str, &str)]) -> Run {
    let out = command(inv, extra).output().unwrap();
    parse_output(
        &format!("{:?}", inv.args),
        &out.stdout,
        &out.stderr,
        ExitInfo::from_status(out.status),
        direction,
    )
}

fn command(inv: &kopia::KopiaInvocation, extra: &[(&str, &str)]) -> Command {
    let mut cmd = Command::new(kopia_bin());
    for k in kopia::SCRUBBED_ENV {
        cmd.env_remove(k);
    }
    cmd.args(&inv.args)
        .envs(inv.env.iter().map(|(k, v)| (k, v)))
        .envs(extra.iter().copied())
        .stdin(Stdio::null());
    cmd
}

/// A bed with two files (2,123,456 bytes) and a symlink.
fn lifecycle_bed() -> Bed {
    let bed = Bed::new();
    write_random(&bed.source.join("a"), 123_456, 1);
    write_random(&bed.source.join("sub/b"), 2_000_000, 2);
    std::os::unix::fs::symlink("sub/b", bed.source.join("link")).unwrap();
    bed
}

#[test]
fn real_repository_lifecycle_snapshot_and_restore() {
    let bed = lifecycle_bed();
    let access = bed.access();
    let kind = |run: &Run| run.classify(false, Direction::Backup);

    // No repository: the path is missing, then empty.
    let run = run_kopia(&kopia::connect(&access).unwrap(), Direction::Backup, &[]);
    assert_eq!(run.exit, ExitInfo::code(1));
    let o = kind(&run);
    assert_eq!(o.kind, OutcomeKind::RepositoryMissing, "{}", o.message);
    assert!(
        o.message.contains("cannot access storage path"),
        "{}",
        o.message
    );
    std::fs::create_dir(&bed.repo).unwrap();
    let run = run_kopia(&kopia::connect(&access).unwrap(), Direction::Backup, &[]);
    let o = kind(&run);
    assert_eq!(o.kind, OutcomeKind::RepositoryMissing, "{}", o.message);
    assert!(
        o.message.contains("repository not initialized"),
        "{}",
        o.message
    );
    // Not connected.
    let snapshot = kopia::snapshot_create(&access, &bed.source, &[], &Default::default()).unwrap();
    let o = kind(&run_kopia(&snapshot, Direction::Backup, &[]));
    assert_eq!(o.kind, OutcomeKind::RepositoryMissing, "{}", o.message);
    assert!(
        o.message.contains("repository is not connected"),
        "{}",
        o.message
    );

    // Created (and connected); connecting again works; a wrong password does not.
    let run = run_kopia(&kopia::create(&access).unwrap(), Direction::Backup, &[]);
    assert_eq!(run.exit, ExitInfo::code(0), "{:?}", run.facts.stderr_tail);
    assert!(run.fatal_events().is_empty());
    assert!(bed.repo.join("kopia.repository.f").is_file());
    let run = run_kopia(&kopia::connect(&access).unwrap(), Direction::Backup, &[]);
    assert_eq!(run.exit, ExitInfo::code(0), "{:?}", run.facts.stderr_tail);
    let wrong = bed.access_with_password("battery staple");
    // A failed connect drops the connection there was: kopia writes the new config, fails to
    // open the repository with it, and removes the config file and the cache directory.
    assert!(bed.cache.join("kopia/cache").is_dir());
    let o = kind(&run_kopia(
        &kopia::connect(&wrong).unwrap(),
        Direction::Backup,
        &[],
    ));
    assert_eq!(o.kind, OutcomeKind::WrongPassword, "{}", o.message);
    assert!(!bed.cache.join("kopia/repository.config").exists());
    assert!(!bed.cache.join("kopia/cache").exists());
    let o = kind(&run_kopia(&snapshot, Direction::Backup, &[]));
    assert_eq!(o.kind, OutcomeKind::RepositoryMissing, "{}", o.message);
    let run = run_kopia(&kopia::connect(&access).unwrap(), Direction::Backup, &[]);
    assert_eq!(run.exit, ExitInfo::code(0), "{:?}", run.facts.stderr_tail);

    // Backup: progress on stderr (at least the final frame), the manifest on stdout.
    let run = run_kopia(&snapshot, Direction::Backup, &[]);
    let p = run.progress();
    assert!(!p.is_empty(), "{:?}: {:?}", run.exit, run.facts.stderr_tail);
    assert_monotonic("snapshot", &p);
    assert!(p.iter().all(|s| s.bytes_done <= 2_123_456), "{p:?}");
    assert_eq!(run.summary().total_bytes, 2_123_456);
    assert_eq!(run.summary().total_files, 2);
    let o = kind(&run);
    assert_eq!(o.kind, OutcomeKind::Success, "{}", o.message);
    let id = o.snapshot_id.unwrap();
    assert_eq!(bed.kopia_inspector().snapshot(&id)["id"], id.as_str());

    // Restore into a new directory: the final line counts files and symlinks.
    let target = bed.path().join("target");
    let run = run_kopia(
        &kopia::snapshot_restore(&access, &id, &target, &Default::default()).unwrap(),
        Direction::Restore,
        &[],
    );
    assert_monotonic("restore", &run.progress());
    let s = run.summary();
    // "2.1 MB", read as a lower bound (the engine measures the exact size on the target).
    assert!(
        s.total_bytes <= 2_123_456 && s.total_bytes >= 2_000_000,
        "{s:?}"
    );
    assert_eq!(s.total_files, 3);
    assert_eq!(
        run.classify(false, Direction::Restore).kind,
        OutcomeKind::Success
    );
    assert_same_tree(&bed.source, &target);
    assert_eq!(
        std::fs::read_link(target.join("link")).unwrap(),
        Path::new("sub/b")
    );

    // A source that is not there.
    let gone = kopia::snapshot_create(
        &access,
        &bed.path().join("no-such-dir"),
        &[],
        &Default::default(),
    )
    .unwrap();
    let o = kind(&run_kopia(&gone, Direction::Backup, &[]));
    assert_eq!(o.kind, OutcomeKind::SourceMissing, "{}", o.message);
}

/// With `KOPIA_BYTES_STRING_BASE_2` (which the agent scrubs) kopia prints base-2 units; they are
/// read as lower bounds too.
#[test]
fn base2_sizes_from_the_real_binary() {
    let bed = Bed::new();
    write_random(&bed.source.join("a"), 3_000_000, 3);
    write_random(&bed.source.join("b"), 1_234_567, 4);
    let access = bed.access();
    let run = run_kopia(&kopia::create(&access).unwrap(), Direction::Backup, &[]);
    assert_eq!(run.exit, ExitInfo::code(0), "{:?}", run.facts.stderr_tail);
    let out = command(
        &kopia::snapshot_create(&access, &bed.source, &[], &Default::default()).unwrap(),
        &[("KOPIA_BYTES_STRING_BASE_2", "true")],
    )
    .output()
    .unwrap();
    let frames = snapshot_frames(&out.stderr);
    assert!(
        frames.last().is_some_and(|f| f.contains("MiB")),
        "{frames:?}"
    );
    let run = parse_output(
        "base 2",
        &out.stdout,
        &out.stderr,
        ExitInfo::from_status(out.status),
        Direction::Backup,
    );
    let size = 4_234_567;
    assert_eq!(run.summary().total_bytes, size);
    let p = run.progress();
    assert_eq!(p.len(), frames.len());
    assert_monotonic("base 2", &p);
    let last = p.last().unwrap();
    // "4 MiB" (4.04 MiB): at least 3.5 MiB, never above.
    assert!(
        last.bytes_done <= size && last.bytes_done >= 3 << 20,
        "{last:?}"
    );
}

/// The first SIGINT to a running `snapshot create` (the agent's argv and environment): a partial
/// snapshot marked canceled, exit 0, nothing left of kopia's process group. The source is a
/// 64 GiB sparse file, slow to read without costing disk.
#[test]
fn first_sigint_saves_a_canceled_snapshot_and_exits_zero() {
    use nix::sys::signal::{Signal, killpg};
    use nix::unistd::Pid;
    use std::os::unix::process::CommandExt;
    let bed = Bed::new();
    write_random(&bed.source.join("small"), 100_000, 5);
    write_sparse(&bed.source.join("huge.img"), 64 << 30);
    let access = bed.access();
    let run = run_kopia(&kopia::create(&access).unwrap(), Direction::Backup, &[]);
    assert_eq!(run.exit, ExitInfo::code(0), "{:?}", run.facts.stderr_tail);
    let mut child = command(
        &kopia::snapshot_create(&access, &bed.source, &[], &Default::default()).unwrap(),
        &[],
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .process_group(0)
    .spawn()
    .unwrap();
    let pgid = Pid::from_raw(child.id() as i32);
    // stderr and stdout are read on threads; stderr's bytes are also sent as they come.
    let (tx, rx) = std::sync::mpsc::channel::<Vec<u8>>();
    let mut err_pipe = child.stderr.take().unwrap();
    let err_reader = std::thread::spawn(move || {
        let mut all = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            match err_pipe.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    all.extend_from_slice(&buf[..n]);
                    let _ = tx.send(buf[..n].to_vec());
                }
            }
        }
        all
    });
    let mut out_pipe = child.stdout.take().unwrap();
    let out_reader = std::thread::spawn(move || {
        let mut all = Vec::new();
        out_pipe.read_to_end(&mut all).unwrap();
        all
    });
    // Wait for a progress line with data.
    let parser = KopiaParser::new(Direction::Backup);
    let mut framer = Framer::new(Separators::NewlineAndCarriageReturn, DEFAULT_MAX_FRAME);
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut moving = false;
    while !moving {
        let left = deadline.saturating_duration_since(Instant::now());
        let chunk = rx.recv_timeout(left).unwrap_or_else(|e| {
            let _ = killpg(pgid, Signal::SIGKILL);
            panic!("no progress from kopia within 120 s ({e})")
        });
        framer.push(&chunk, &mut |f| {
            if let podvolume_agent::framing::Frame::Line(l) = f
                && let UploaderEvent::Progress(p) = parser.parse(l)
            {
                moving |= p.bytes_done > 0;
            }
        });
    }
    assert!(
        child.try_wait().unwrap().is_none(),
        "kopia ended on its own"
    );
    killpg(pgid, Signal::SIGINT).unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = killpg(pgid, Signal::SIGKILL);
            panic!("kopia did not exit within 120 s of SIGINT");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stderr = err_reader.join().unwrap();
    let stdout = out_reader.join().unwrap();
    let run = parse_output(
        "SIGINT",
        &stdout,
        &stderr,
        ExitInfo::from_status(status),
        Direction::Backup,
    );
    assert_eq!(
        run.exit,
        ExitInfo::code(0),
        "{}",
        String::from_utf8_lossy(&stderr)
    );
    assert_monotonic("SIGINT", &run.progress());
    let s = run.summary();
    assert_eq!(s.incomplete.as_deref(), Some("canceled"), "{s:?}");
    assert!(s.total_bytes < 64 << 30, "{s:?}");
    let id = s.snapshot_id.clone().unwrap();
    assert_eq!(
        bed.kopia_inspector().snapshot(&id)["incomplete"],
        "canceled"
    );
    assert_eq!(
        run.classify(true, Direction::Backup).kind,
        OutcomeKind::Canceled
    );
    assert_eq!(
        run.classify(false, Direction::Backup).kind,
        OutcomeKind::Interrupted
    );
    // Nothing of kopia's process group is left.
    assert!(
        nix::sys::signal::killpg(pgid, None).is_err(),
        "kopia's process group {pgid} still has members"
    );
}
