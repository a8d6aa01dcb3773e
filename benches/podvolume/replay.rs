//! Case 3: how old is the published `bytesDone`, and how many status writes does it cost?
//!
//! Captured restic streams are replayed in virtual time (no sleeping): the agent's path is the
//! real framer -> restic parser -> progress tracker, and a publisher that, like
//! `agent::transfer::monitor`, reads the latest progress once per update interval and writes it
//! when (bytesDone, totalBytes, stage) changed. Velero's former method is modelled on the same
//! bytes: every 10 s take the last line of everything restic wrote so far; a half-written line or
//! a line without a non-zero `bytes_done` is skipped, anything else is written.
//!
//! Age at a moment t: 0 when the published value is at least the newest `bytes_done` restic had
//! printed by t; otherwise how long ago restic first printed a value above the published one.
//! It is sampled every 10 ms from restic's first status line to its summary line. Publishers tick
//! from the moment restic is started (the monitor's tokio interval, Velero's Go ticker). When
//! restic prints at the agent's lower rate, its own status ticker starts some time after the
//! publisher's, so ten phases of it across its period are simulated; worst and p99 are over all
//! samples of all phases, writes are the median over phases.

use std::path::Path;
use std::time::{Duration, Instant, SystemTime};

use podvolume_agent::framing::{DEFAULT_MAX_FRAME, Frame, Framer, Separators};
use podvolume_agent::progress::{ProgressTracker, WriteSchedule};
use podvolume_agent::uploader::restic::ResticParser;
use podvolume_agent::uploader::{Direction, UploaderEvent};

use crate::stream::{self, Chunk};
use crate::util::{fmt, max, median, percentile};

const GRID: Duration = Duration::from_millis(10);
const PHASES: u32 = 10;
const VELERO_INTERVAL: Duration = Duration::from_secs(10);

/// (time, bytes_done) of every status line restic printed, and the time of the summary line.
struct Reference {
    /// Running maximum of bytes_done, by time.
    status: Vec<(Duration, u64)>,
    end: Duration,
}

fn json_u64(v: &serde_json::Value, k: &str) -> u64 {
    v.get(k).and_then(|x| x.as_u64()).unwrap_or(0)
}

fn reference(chunks: &[Chunk]) -> Reference {
    let mut status = Vec::new();
    let mut best = 0u64;
    let mut end = None;
    for (t, line) in stream::stdout_lines(chunks) {
        let Ok(v) = serde_json::from_slice::<serde_json::Value>(&line) else {
            continue;
        };
        match v.get("message_type").and_then(|m| m.as_str()) {
            Some("status") => {
                best = best.max(json_u64(&v, "bytes_done"));
                status.push((t, best));
            }
            Some("summary") => end = end.or(Some(t)),
            _ => {}
        }
    }
    let end = end.unwrap_or_else(|| chunks.last().map(|c| c.t).unwrap_or_default());
    Reference { status, end }
}

impl Reference {
    fn newest(&self, t: Duration) -> u64 {
        let i = self.status.partition_point(|s| s.0 <= t);
        if i == 0 { 0 } else { self.status[i - 1].1 }
    }
    /// When restic first printed more than `v`.
    fn first_above(&self, v: u64) -> Option<Duration> {
        let i = self.status.partition_point(|s| s.1 <= v);
        self.status.get(i).map(|s| s.0)
    }
    fn start(&self) -> Duration {
        self.status.first().map(|s| s.0).unwrap_or_default()
    }
}

/// The stream restic would have printed at `fps` status lines per second, its ticker started at
/// `phase`: at each of its ticks the newest status line of the captured stream; other stdout
/// lines at their own times.
fn thin(chunks: &[Chunk], fps: f64, phase: Duration) -> Vec<Chunk> {
    let period = Duration::from_secs_f64(1.0 / fps);
    let mut out = Vec::new();
    let mut latest: Option<Vec<u8>> = None;
    let mut next_tick = phase + period;
    for (t, mut line) in stream::stdout_lines(chunks) {
        while next_tick < t {
            if let Some(l) = &latest {
                out.push(Chunk {
                    t: next_tick,
                    fd: 1,
                    data: l.clone(),
                });
            }
            next_tick += period;
        }
        line.push(b'\n');
        if line.starts_with(b"{\"message_type\":\"status\"") {
            latest = Some(line);
        } else {
            out.push(Chunk {
                t,
                fd: 1,
                data: line,
            });
        }
    }
    out
}

/// How the agent's publisher decides when to write.
#[derive(Clone, Copy)]
enum Publisher {
    /// `agent::transfer::monitor` now: a newer value is written when
    /// `progress::WriteSchedule` allows (at once when the last write is an interval old, else an
    /// interval after it).
    OnChange,
    /// The former monitor: a tokio interval ticking at `k * interval` from the start, writing the
    /// latest value at each tick when it changed.
    Tick,
}

/// Publishes (time, bytesDone) writes of the agent's path over `chunks`.
fn agent_writes(
    chunks: &[Chunk],
    interval: Duration,
    end: Duration,
    publisher: Publisher,
) -> Vec<(Duration, u64)> {
    let base = Instant::now();
    let wall0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
    let parser = ResticParser::new(Direction::Backup);
    let mut tracker = ProgressTracker::new(Direction::Backup, wall0);
    let mut framer = Framer::new(Separators::Newline, DEFAULT_MAX_FRAME);
    let mut writes: Vec<(Duration, u64)> = Vec::new();
    let mut last_key = None;
    let mut tick = Duration::ZERO;
    let mut schedule = WriteSchedule::new(interval);
    let mut prev_t = Duration::ZERO;
    let key_of = |tracker: &ProgressTracker| {
        let p = tracker.progress();
        (p.n_completed, p.n_total, tracker.stage())
    };
    for c in chunks.iter().filter(|c| c.fd == 1) {
        match publisher {
            Publisher::Tick => {
                while tick < c.t && tick <= end {
                    let key = key_of(&tracker);
                    if last_key != Some(key) {
                        last_key = Some(key);
                        writes.push((tick, key.0));
                    }
                    tick += interval;
                }
            }
            Publisher::OnChange => {
                // A value that arrived before it was due, written when it is.
                let key = key_of(&tracker);
                let due = schedule.due(base + prev_t) - base;
                if last_key != Some(key) && due <= c.t && due <= end {
                    last_key = Some(key);
                    schedule.wrote(base + due);
                    writes.push((due, key.0));
                }
            }
        }
        let now = base + c.t;
        let wall = wall0 + c.t;
        framer.push(&c.data, &mut |f| {
            if let Frame::Line(l) = f {
                match parser.parse(l) {
                    UploaderEvent::Progress(s) => {
                        tracker.observe(&s, now, wall);
                    }
                    UploaderEvent::ScanFinished { total_bytes, .. } => {
                        tracker.scan_finished(total_bytes, now, wall)
                    }
                    _ => {}
                }
            }
        });
        if let Publisher::OnChange = publisher {
            let key = key_of(&tracker);
            if last_key != Some(key) && schedule.due(now) == now && c.t <= end {
                last_key = Some(key);
                schedule.wrote(now);
                writes.push((c.t, key.0));
            }
        }
        prev_t = c.t;
    }
    match publisher {
        Publisher::Tick => {
            while tick <= end {
                let key = key_of(&tracker);
                if last_key != Some(key) {
                    last_key = Some(key);
                    writes.push((tick, key.0));
                }
                tick += interval;
            }
        }
        Publisher::OnChange => {
            let key = key_of(&tracker);
            let due = schedule.due(base + prev_t) - base;
            if last_key != Some(key) && due <= end {
                writes.push((due, key.0));
            }
        }
    }
    writes
}

/// Velero's former method: every 10 s the last line of the whole stdout so far (Go's
/// `getLastLine`), decoded; written when `bytes_done` is non-zero. Also counts the skipped ticks.
fn velero_writes(chunks: &[Chunk], end: Duration) -> (Vec<(Duration, u64)>, u32) {
    let mut buf: Vec<u8> = Vec::new();
    let mut writes = Vec::new();
    let mut skipped = 0;
    // A Go ticker first fires one period after it starts (when restic was started).
    let mut tick = VELERO_INTERVAL;
    let mut check = |tick: Duration, buf: &[u8]| {
        if buf.is_empty() {
            return;
        }
        let body = &buf[..buf.len() - 1];
        let from = body.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
        let last = &body[from..];
        match serde_json::from_slice::<serde_json::Value>(last) {
            Ok(v) if json_u64(&v, "bytes_done") != 0 => {
                writes.push((tick, json_u64(&v, "bytes_done")))
            }
            _ => skipped += 1,
        }
    };
    for c in chunks.iter().filter(|c| c.fd == 1) {
        while tick < c.t && tick <= end {
            check(tick, &buf);
            tick += VELERO_INTERVAL;
        }
        buf.extend_from_slice(&c.data);
    }
    while tick <= end {
        check(tick, &buf);
        tick += VELERO_INTERVAL;
    }
    (writes, skipped)
}

/// Ages (seconds) on the grid for one series of writes.
fn ages(r: &Reference, writes: &[(Duration, u64)]) -> Vec<f64> {
    let mut out = Vec::new();
    let mut g = r.start();
    let mut wi = 0;
    let mut published = 0u64;
    while g <= r.end {
        while wi < writes.len() && writes[wi].0 <= g {
            published = published.max(writes[wi].1);
            wi += 1;
        }
        let newest = r.newest(g);
        let age = if published >= newest {
            0.0
        } else {
            r.first_above(published)
                .map_or(0.0, |t| g.saturating_sub(t).as_secs_f64())
        };
        out.push(age);
        g += GRID;
    }
    out
}

struct Row {
    method: String,
    /// The smallest time between two consecutive writes (seconds), over every phase.
    min_spacing: f64,
    worst: f64,
    p99: f64,
    p50: f64,
    writes: f64,
    skipped: Option<f64>,
}

/// `sim(phase)` for `phases` phases of restic's status ticker across `period`.
fn method_row(
    r: &Reference,
    method: String,
    period: Duration,
    phases: u32,
    sim: &dyn Fn(Duration) -> (Vec<(Duration, u64)>, u32),
    count_skips: bool,
) -> Row {
    let mut all = Vec::new();
    let mut writes = Vec::new();
    let mut skips = Vec::new();
    let mut min_spacing = f64::INFINITY;
    for j in 0..phases {
        let phase = period * j / phases;
        let (w, s) = sim(phase);
        for pair in w.windows(2) {
            min_spacing = min_spacing.min(pair[1].0.saturating_sub(pair[0].0).as_secs_f64());
        }
        all.extend(ages(r, &w));
        writes.push(w.len() as f64);
        skips.push(s as f64);
    }
    Row {
        method,
        min_spacing,
        worst: max(&all),
        p99: percentile(&all, 99.0),
        p50: percentile(&all, 50.0),
        writes: median(&writes),
        skipped: count_skips.then(|| median(&skips)),
    }
}

pub fn run(dir: &Path) -> String {
    let streams = stream::load_dir(dir);
    let mut md = String::new();
    md.push_str("## 3. Progress timeliness and status writes (replayed restic streams)\n\n");
    md.push_str(
        "Captured restic 0.14 streams (`testdata/restic-streams/`, restic's default status rate) replayed in \
         virtual time. *agent I on change (restic at F/s)*: the agent's path (framer -> parser -> \
         tracker -> publisher) as `agent::transfer::monitor` now does it (`progress::WriteSchedule`): \
         a newer bytesDone/totalBytes/stage at once when the last write is at least I old, else I \
         after the last write (never two writes of one object within I); fed the captured stream as is (the agent asks restic for its default \
         rate, F = 60/s); *former: agent I tick*: the former publisher, ticking every I from restic's \
         start (at once, then every I) and writing when changed, at the former rate (2/I, at least \
         1/s); *Velero 10 s last line*: Velero's method on the captured stream (first tick 10 s \
         after restic's start). Age = how long the published bytesDone has been behind the newest \
         value restic had printed (0 while it is current), sampled every 10 ms from the first status \
         line to the summary (at restic's lower rates: over 10 phases of restic's status ticker \
         against the publisher). Writes exclude the final (terminal) write, which all make once.\n\n",
    );
    md.push_str(
        "| stream | length s | method | worst age s | p99 age s | median age s | writes | writes/min | min spacing s | skipped ticks |\n\
         |---|---:|---|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    let mut summary: Vec<(String, f64, f64)> = Vec::new();
    let mut goals = String::new();
    for (name, chunks) in &streams {
        if name.starts_with("verbose") {
            // Verbose streams are for the parser benchmark (one line per file, same status lines).
            continue;
        }
        let r = reference(chunks);
        let len = r.end.saturating_sub(r.start()).as_secs_f64();
        let mut rows = Vec::new();
        for secs in [1u64, 10] {
            let interval = Duration::from_secs(secs);
            // The agent asks restic for its default rate (RESTIC_PROGRESS_FPS=60): the captured
            // stream as it is.
            let fps: f64 = podvolume_agent::uploader::restic::PROGRESS_FPS
                .parse()
                .expect("PROGRESS_FPS is a number");
            // The former rate: two lines per interval, at least one a second.
            let old_fps = (2.0 / secs as f64).clamp(1.0, 60.0);
            rows.push(method_row(
                &r,
                format!("agent {secs} s on change (restic at {} /s)", fmt(fps)),
                interval,
                1,
                &|_| {
                    (
                        agent_writes(chunks, interval, r.end, Publisher::OnChange),
                        0,
                    )
                },
                false,
            ));
            rows.push(method_row(
                &r,
                format!(
                    "former: agent {secs} s tick (restic at {} /s)",
                    fmt(old_fps)
                ),
                Duration::from_secs_f64(1.0 / old_fps),
                PHASES,
                &|ph| {
                    let w =
                        agent_writes(&thin(chunks, old_fps, ph), interval, r.end, Publisher::Tick);
                    (w, 0)
                },
                false,
            ));
        }
        let ten = Duration::from_secs(10);
        rows.push(method_row(
            &r,
            "Velero 10 s last line".into(),
            ten,
            1,
            &|_| velero_writes(chunks, r.end),
            true,
        ));
        for row in &rows {
            md.push_str(&format!(
                "| {name} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
                fmt(len),
                row.method,
                fmt(row.worst),
                fmt(row.p99),
                fmt(row.p50),
                fmt(row.writes),
                fmt(row.writes / (len / 60.0)),
                if row.min_spacing.is_finite() {
                    fmt(row.min_spacing)
                } else {
                    "-".into()
                },
                row.skipped.map(fmt).unwrap_or_else(|| "-".into()),
            ));
            summary.push((row.method.clone(), row.worst, row.p99));
        }
        // The goals, checked on this stream: rows are [agent 1 s, former 1 s, agent 10 s,
        // former 10 s, Velero].
        let velero_worst = rows[4].worst;
        for (row, secs) in [(&rows[0], 1.0), (&rows[2], 10.0)] {
            // T: restic's start to its summary, the operation's length.
            let bound = (r.end.as_secs_f64() / secs).ceil() + 2.0;
            let age_ok = row.worst <= secs + 0.2;
            let writes_ok = row.writes <= bound;
            let spacing_ok = row.min_spacing >= secs;
            goals.push_str(&format!(
                "| {name} | {} | {} (<= {}: {}) | {} (>= {}: {}) | {} (<= {}: {}) | {} |\n",
                fmt(secs),
                fmt(row.worst),
                fmt(secs + 0.2),
                if age_ok { "yes" } else { "NO" },
                if row.min_spacing.is_finite() {
                    fmt(row.min_spacing)
                } else {
                    "-".into()
                },
                fmt(secs),
                if spacing_ok { "yes" } else { "NO" },
                fmt(row.writes),
                fmt(bound),
                if writes_ok { "yes" } else { "NO" },
                if secs == 10.0 {
                    fmt(velero_worst)
                } else {
                    "-".into()
                },
            ));
        }
    }
    md.push_str(
        "\nThe goals on each stream for the agent's publisher: worst age <= I + 0.2 s, never two \
         writes within I (min spacing >= I), status writes <= ceil(T / I) + 2 (T from restic's start \
         to its summary); Velero's method's worst age on the same stream beside it:\n\n\
         | stream | I s | worst age s | min spacing s | writes | Velero's worst age s |\n|---|---:|---|---|---|---:|\n",
    );
    md.push_str(&goals);
    md.push_str("\nAcross all streams (worst of worst, median of p99):\n\n");
    md.push_str("| method | worst age s | median p99 age s |\n|---|---:|---:|\n");
    let mut methods: Vec<String> = summary.iter().map(|s| s.0.clone()).collect();
    methods.dedup();
    methods.sort();
    methods.dedup();
    for m in methods {
        let worst: Vec<f64> = summary.iter().filter(|s| s.0 == m).map(|s| s.1).collect();
        let p99: Vec<f64> = summary.iter().filter(|s| s.0 == m).map(|s| s.2).collect();
        md.push_str(&format!(
            "| {m} | {} | {} |\n",
            fmt(max(&worst)),
            fmt(median(&p99))
        ));
    }
    md.push('\n');
    md
}
