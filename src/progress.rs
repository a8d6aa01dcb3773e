//! The operation progress model (Velero's `OperationProgress`) and the tracker that derives it
//! from uploader samples while keeping its invariants.
//!
//! Invariants kept here, whatever the uploader prints: `n_completed` never decreases and never
//! exceeds `n_total`; on success both equal the final size the uploader reported, or what was
//! already reached when that is more (a restore summary may carry no counters at all).

use std::collections::VecDeque;
use std::time::{Duration, Instant, SystemTime};

use serde::{Deserialize, Serialize};

use crate::text::{format_bytes, format_eta};
pub use crate::uploader::Direction;
use crate::uploader::ProgressSample;

/// Progress of one operation, serialised with Velero's field names.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct OperationProgress {
    pub completed: bool,
    /// The operation's error, empty when none.
    #[serde(default)]
    pub err: String,
    pub n_completed: u64,
    pub n_total: u64,
    pub operation_units: String,
    pub description: String,
    #[serde(with = "rfc3339")]
    pub started: SystemTime,
    #[serde(with = "rfc3339")]
    pub updated: SystemTime,
}

impl OperationProgress {
    pub fn new(started: SystemTime) -> Self {
        Self {
            completed: false,
            err: String::new(),
            n_completed: 0,
            n_total: 0,
            operation_units: "bytes".to_string(),
            description: Stage::Connecting.label().to_string(),
            started,
            updated: started,
        }
    }

    /// Marks the end. On success both counters become the final size, or what was already
    /// reached if that is more (`n_completed` never goes down); otherwise they keep what was
    /// reached and `err` carries the cause.
    pub fn complete(
        &mut self,
        success_size: Option<u64>,
        err: Option<String>,
        description: String,
        wall: SystemTime,
    ) {
        if let Some(size) = success_size {
            let size = size.max(self.n_completed);
            self.n_total = size;
            self.n_completed = size;
        }
        self.completed = true;
        self.err = err.unwrap_or_default();
        self.description = description;
        self.updated = wall;
    }

    /// Percentage done, when a total is known.
    pub fn percent(&self) -> Option<f64> {
        (self.n_total > 0).then(|| self.n_completed as f64 * 100.0 / self.n_total as f64)
    }
}

/// RFC 3339 timestamps as Go's `time.Time` marshals them (UTC, `Z`).
mod rfc3339 {
    use std::time::SystemTime;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(t: &SystemTime, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&humantime::format_rfc3339_millis(*t))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<SystemTime, D::Error> {
        let s = String::deserialize(d)?;
        humantime::parse_rfc3339_weak(&s).map_err(serde::de::Error::custom)
    }
}

/// What the operation is doing now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// Started, nothing heard from the uploader yet (opening the repository, loading the index).
    Connecting,
    /// Walking the source; the total is still growing.
    Scanning,
    Uploading,
    Restoring,
    /// All bytes processed, the uploader is writing its index and snapshot (or flushing a restore).
    Finalizing,
    Done,
}

impl Stage {
    pub fn label(self) -> &'static str {
        match self {
            Stage::Connecting => "connecting",
            Stage::Scanning => "scanning",
            Stage::Uploading => "uploading",
            Stage::Restoring => "restoring",
            Stage::Finalizing => "finalizing",
            Stage::Done => "done",
        }
    }
}

/// How far back the transfer rate looks: long enough to smooth bursts, short enough to follow a
/// changing link.
pub const RATE_WINDOW: Duration = Duration::from_secs(30);
/// An ETA is shown only after this much history, so that it is not a wild first guess.
const MIN_ETA_SPAN: Duration = Duration::from_secs(2);
/// Samples kept for the rate. They are thinned to one per [`RATE_SAMPLE_SPACING`] so that the
/// bounded buffer spans the whole [`RATE_WINDOW`] whatever the uploader's print rate (restic
/// prints 60 lines a second: 256 raw samples would cover 4 s).
const MAX_RATE_SAMPLES: usize = 256;
const RATE_SAMPLE_SPACING: Duration =
    Duration::from_nanos(RATE_WINDOW.as_nanos() as u64 / MAX_RATE_SAMPLES as u64);

/// Folds uploader samples into an [`OperationProgress`].
#[derive(Debug, Clone)]
pub struct ProgressTracker {
    direction: Direction,
    progress: OperationProgress,
    stage: Stage,
    scan_finished: bool,
    /// (when, n_completed) over the last [`RATE_WINDOW`], at least [`RATE_SAMPLE_SPACING`] apart
    /// except the newest, which is always the latest observation.
    samples: VecDeque<(Instant, u64)>,
    rate: Option<f64>,
    /// Since when the reported total has not changed (see [`SCAN_SETTLED`]).
    total_stable_since: Option<Instant>,
}

/// restic 0.14 says nothing when its scan ends (`seconds_remaining` appears only while the ETA is
/// non-zero), so a total that has not moved for this long while bytes flow is taken as final.
/// Getting it wrong early costs only an optimistic ETA; the total keeps growing if it must.
pub const SCAN_SETTLED: Duration = Duration::from_secs(2);

impl ProgressTracker {
    pub fn new(direction: Direction, started: SystemTime) -> Self {
        Self {
            direction,
            progress: OperationProgress::new(started),
            stage: Stage::Connecting,
            scan_finished: false,
            samples: VecDeque::new(),
            rate: None,
            total_stable_since: None,
        }
    }

    pub fn progress(&self) -> &OperationProgress {
        &self.progress
    }

    pub fn stage(&self) -> Stage {
        self.stage
    }

    /// Bytes per second over the recent window.
    pub fn rate(&self) -> Option<f64> {
        self.rate
    }

    /// A total known in advance (restore: the snapshot size from `restic stats`).
    pub fn set_total(&mut self, total: u64, now: Instant, wall: SystemTime) {
        self.progress.n_total = self.progress.n_total.max(total);
        self.scan_finished = true;
        self.refresh(now, wall);
    }

    /// The uploader finished its scan: the total is final from now on.
    pub fn scan_finished(&mut self, total_bytes: Option<u64>, now: Instant, wall: SystemTime) {
        self.scan_finished = true;
        if let Some(t) = total_bytes {
            self.progress.n_total = self.progress.n_total.max(t);
        }
        self.refresh(now, wall);
    }

    /// Applies one sample. Returns whether the published value changed.
    pub fn observe(&mut self, sample: &ProgressSample, now: Instant, wall: SystemTime) -> bool {
        let before = (self.progress.n_completed, self.progress.n_total, self.stage);
        match sample.total_bytes {
            Some(t) if t == self.progress.n_total && t > 0 => {
                let since = *self.total_stable_since.get_or_insert(now);
                if sample.bytes_done > 0 && now.duration_since(since) >= SCAN_SETTLED {
                    self.scan_finished = true;
                }
            }
            _ => self.total_stable_since = None,
        }
        if sample.scan_finished {
            self.scan_finished = true;
        }
        // Totals only grow: the scan discovers more, it never un-discovers.
        let total = sample.total_bytes.unwrap_or(0).max(self.progress.n_total);
        let done = sample.bytes_done.max(self.progress.n_completed);
        // The archiver may run ahead of the scanner; until the scan catches up, the honest
        // statement is "at least this much of at least that much", so done is clamped to total
        // and the total grows with it.
        let total = if sample.total_bytes.is_none() || !self.scan_finished {
            total.max(done)
        } else {
            total
        };
        self.progress.n_total = total;
        self.progress.n_completed = done.min(total);
        self.push_rate_sample(now);
        self.refresh(now, wall);
        before != (self.progress.n_completed, self.progress.n_total, self.stage)
    }

    fn push_rate_sample(&mut self, now: Instant) {
        let point = (now, self.progress.n_completed);
        let n = self.samples.len();
        // The newest sample is the current point: it moves forward until it is a spacing past
        // the one before it, and then stays as history while a new current point starts.
        if n >= 2 && now.duration_since(self.samples[n - 2].0) < RATE_SAMPLE_SPACING {
            self.samples[n - 1] = point;
        } else {
            self.samples.push_back(point);
        }
        while let Some(&(t, _)) = self.samples.front() {
            // Two more than the cap: the history spans the window, plus the current point.
            if now.duration_since(t) > RATE_WINDOW || self.samples.len() > MAX_RATE_SAMPLES + 2 {
                self.samples.pop_front();
            } else {
                break;
            }
        }
        self.rate = match (self.samples.front(), self.samples.back()) {
            (Some(&(t0, b0)), Some(&(t1, b1)))
                if t1.duration_since(t0) >= Duration::from_millis(500) =>
            {
                Some((b1 - b0) as f64 / t1.duration_since(t0).as_secs_f64())
            }
            _ => None,
        };
    }

    fn window_span(&self) -> Duration {
        match (self.samples.front(), self.samples.back()) {
            (Some(&(t0, _)), Some(&(t1, _))) => t1.duration_since(t0),
            _ => Duration::ZERO,
        }
    }

    /// Seconds left, once the total is final and the rate has some history.
    pub fn eta(&self) -> Option<u64> {
        let rate = self.rate?;
        if !self.scan_finished || rate < 1.0 || self.window_span() < MIN_ETA_SPAN {
            return None;
        }
        let left = self
            .progress
            .n_total
            .saturating_sub(self.progress.n_completed);
        (left > 0).then(|| (left as f64 / rate).ceil() as u64)
    }

    fn refresh(&mut self, _now: Instant, wall: SystemTime) {
        let p = &self.progress;
        self.stage = if self.scan_finished && p.n_total > 0 && p.n_completed >= p.n_total {
            Stage::Finalizing
        } else if !self.scan_finished {
            Stage::Scanning
        } else {
            match self.direction {
                Direction::Backup => Stage::Uploading,
                Direction::Restore => Stage::Restoring,
            }
        };
        self.progress.updated = wall;
        self.progress.description = self.describe();
    }

    fn describe(&self) -> String {
        let p = &self.progress;
        let rate = self
            .rate
            .map(|r| format!(", {}/s", format_bytes(r as u64)))
            .unwrap_or_default();
        match self.stage {
            Stage::Connecting => "connecting".to_string(),
            Stage::Scanning => format!(
                "scanning: {} processed of at least {} found so far{rate}",
                format_bytes(p.n_completed),
                format_bytes(p.n_total)
            ),
            Stage::Uploading | Stage::Restoring => {
                let pct = p
                    .percent()
                    .map(|x| format!(" ({x:.1}%)"))
                    .unwrap_or_default();
                let eta = self
                    .eta()
                    .map(|s| format!(", ETA {}", format_eta(s)))
                    .unwrap_or_default();
                format!(
                    "{}: {} of {}{pct}{rate}{eta}",
                    self.stage.label(),
                    format_bytes(p.n_completed),
                    format_bytes(p.n_total)
                )
            }
            Stage::Finalizing => format!(
                "finalizing: {} processed, {}",
                format_bytes(p.n_completed),
                match self.direction {
                    Direction::Backup => "uploading the remaining data and saving the snapshot",
                    Direction::Restore => "writing the last files",
                }
            ),
            Stage::Done => p.description.clone(),
        }
    }

    /// Ends the operation, as [`OperationProgress::complete`] does.
    pub fn finish(
        &mut self,
        success_size: Option<u64>,
        err: Option<String>,
        description: String,
        wall: SystemTime,
    ) {
        self.stage = Stage::Done;
        self.progress.complete(success_size, err, description, wall);
    }
}

/// When a newer progress value may be written: at once when the last write is at least one
/// interval old (or there was none), otherwise one interval after the last write. Operators set
/// `--update-interval` to bound the writes to each object, so two progress writes of one object
/// are never less than an interval apart; a value that changes just after a write waits at most
/// one interval, so what is published is never more than one interval (plus the uploader's own
/// print period) behind what the uploader printed; nothing is written while nothing changes, and
/// a value arriving after a quiet spell is written at once (BENCHMARKS.md case 3 measures both
/// the worst age and the smallest spacing).
#[derive(Debug, Clone)]
pub struct WriteSchedule {
    interval: Duration,
    last_write: Option<Instant>,
}

impl WriteSchedule {
    pub fn new(interval: Duration) -> Self {
        Self {
            // A zero interval would make every write due at once.
            interval: interval.max(Duration::from_millis(1)),
            last_write: None,
        }
    }

    /// The earliest moment a newer value may be written (`now` when it may be written now).
    pub fn due(&self, now: Instant) -> Instant {
        match self.last_write {
            None => now,
            Some(last) => (last + self.interval).max(now),
        }
    }

    /// Records a write (or an attempt: a failed write is tried again at the next due moment).
    pub fn wrote(&mut self, at: Instant) {
        self.last_write = Some(at);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(done: u64, total: Option<u64>, scanned: bool) -> ProgressSample {
        ProgressSample {
            bytes_done: done,
            total_bytes: total,
            scan_finished: scanned,
            ..Default::default()
        }
    }

    #[test]
    fn completed_never_decreases_nor_exceeds_total() {
        let t0 = Instant::now();
        let w = SystemTime::now();
        let mut tr = ProgressTracker::new(Direction::Backup, w);
        let seq = [
            sample(10, Some(100), false),
            sample(5, Some(90), false), // restic went backwards: ignored
            sample(150, Some(120), false), // archiver ahead of scanner
            sample(160, Some(500), true),
            sample(100, Some(500), true),
            sample(900, Some(500), true), // over the final total: clamped
        ];
        let mut last = (0, 0);
        for (i, s) in seq.iter().enumerate() {
            tr.observe(s, t0 + Duration::from_secs(i as u64), w);
            let p = tr.progress();
            assert!(p.n_completed >= last.0, "decreased at {i}");
            assert!(p.n_completed <= p.n_total, "exceeds total at {i}");
            last = (p.n_completed, p.n_total);
        }
        assert_eq!(last, (500, 500));
        assert_eq!(tr.stage(), Stage::Finalizing);
        // A final size below what was already published does not take it back.
        tr.finish(Some(480), None, "done".into(), w);
        assert_eq!(
            (tr.progress().n_completed, tr.progress().n_total),
            (500, 500)
        );
        assert!(tr.progress().completed);
    }

    #[test]
    fn stages_and_eta_appear_when_meaningful() {
        let t0 = Instant::now();
        let w = SystemTime::now();
        let mut tr = ProgressTracker::new(Direction::Backup, w);
        assert_eq!(tr.progress().description, "connecting");
        tr.observe(&sample(0, Some(1 << 20), false), t0, w);
        assert_eq!(tr.stage(), Stage::Scanning);
        assert!(tr.progress().description.starts_with("scanning"));
        assert_eq!(tr.eta(), None);
        tr.observe(
            &sample(1 << 20, Some(10 << 20), true),
            t0 + Duration::from_secs(1),
            w,
        );
        tr.observe(
            &sample(2 << 20, Some(10 << 20), true),
            t0 + Duration::from_secs(2),
            w,
        );
        tr.observe(
            &sample(3 << 20, Some(10 << 20), true),
            t0 + Duration::from_secs(3),
            w,
        );
        assert_eq!(tr.stage(), Stage::Uploading);
        // 3 MiB over 3 s = 1 MiB/s; 7 MiB left -> 7 s.
        assert_eq!(tr.eta(), Some(7));
        let d = &tr.progress().description;
        assert!(d.contains("uploading: 3.0 MiB of 10.0 MiB (30.0%)"), "{d}");
        assert!(d.contains("1.0 MiB/s") && d.contains("ETA 7s"), "{d}");
    }

    #[test]
    fn success_never_lowers_what_was_reached() {
        let t0 = Instant::now();
        let w = SystemTime::now();
        let mut tr = ProgressTracker::new(Direction::Restore, w);
        tr.observe(&sample(1000, Some(1000), true), t0, w);
        // A bare restore summary: every counter omitted, so the final size reads 0.
        let mut p = tr.progress().clone();
        p.complete(Some(0), None, "restore completed".into(), w);
        assert_eq!((p.n_completed, p.n_total), (1000, 1000));
        // A final size below what was published: still no step down, and done == total.
        let mut p = tr.progress().clone();
        p.complete(Some(900), None, "done".into(), w);
        assert_eq!((p.n_completed, p.n_total), (1000, 1000));
        // A larger final size is taken as it is.
        let mut p = tr.progress().clone();
        p.complete(Some(1200), None, "done".into(), w);
        assert_eq!((p.n_completed, p.n_total), (1200, 1200));
        tr.finish(Some(0), None, "restore completed".into(), w);
        assert_eq!(
            (tr.progress().n_completed, tr.progress().n_total),
            (1000, 1000)
        );
        assert_eq!(tr.stage(), Stage::Done);
        // A failure keeps what was reached too.
        let mut p = OperationProgress::new(w);
        p.n_completed = 10;
        p.n_total = 50;
        p.complete(None, Some("boom".into()), "boom".into(), w);
        assert_eq!((p.n_completed, p.n_total, p.err.as_str()), (10, 50, "boom"));
    }

    #[test]
    fn the_rate_covers_the_whole_window_at_restics_print_rate() {
        // restic prints 60 status lines a second. 1 MiB/s for 10 s, then a stall: 20 s in,
        // the rate over the last 30 s is 10 MiB / 20 s, not the 0 of the last few seconds.
        let t0 = Instant::now();
        let w = SystemTime::now();
        let mut tr = ProgressTracker::new(Direction::Backup, w);
        let tick = Duration::from_secs(1) / 60;
        let mut max_len = 0;
        for i in 0..=(20 * 60) {
            let at = tick * i;
            let done = (at.min(Duration::from_secs(10)).as_secs_f64() * (1 << 20) as f64) as u64;
            tr.observe(&sample(done, Some(100 << 20), true), t0 + at, w);
            max_len = max_len.max(tr.samples.len());
        }
        let rate = tr.rate().unwrap();
        assert!(
            (rate - (10 << 20) as f64 / 20.0).abs() < 1000.0,
            "rate {rate} over a {:?} window",
            tr.window_span()
        );
        // 40 s in, the window is the last 30 s (10 s to 40 s, all stalled).
        for i in (20 * 60 + 1)..=(40 * 60) {
            tr.observe(&sample(10 << 20, Some(100 << 20), true), t0 + tick * i, w);
            max_len = max_len.max(tr.samples.len());
        }
        let span = tr.window_span();
        assert!(
            span > RATE_WINDOW - Duration::from_millis(500) && span <= RATE_WINDOW,
            "{span:?}"
        );
        assert_eq!(tr.rate(), Some(0.0));
        // The newest sample is always the latest observation.
        assert_eq!(tr.samples.back().unwrap().0, t0 + tick * (40 * 60));
        assert!(max_len <= MAX_RATE_SAMPLES + 2, "{max_len} samples kept");
    }

    #[test]
    fn the_rate_follows_a_change_within_the_window() {
        // 2 MiB/s for 60 s, then 1 MiB/s: 30 s after the change the window holds only the new rate.
        let t0 = Instant::now();
        let w = SystemTime::now();
        let mut tr = ProgressTracker::new(Direction::Backup, w);
        let tick = Duration::from_secs(1) / 60;
        let mut done = 0u64;
        for i in 0..=(90 * 60) {
            let at = tick * i;
            if i > 0 {
                let per_tick = if at <= Duration::from_secs(60) {
                    2 << 20
                } else {
                    1 << 20
                } / 60;
                done += per_tick;
            }
            tr.observe(&sample(done, Some(1 << 40), true), t0 + at, w);
        }
        let rate = tr.rate().unwrap();
        let want = ((1u64 << 20) / 60 * 60) as f64;
        assert!((rate - want).abs() / want < 0.01, "{rate} vs {want}");
    }

    #[test]
    fn serialises_with_velero_names() {
        let w = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let p = OperationProgress::new(w);
        let v = serde_json::to_value(&p).unwrap();
        for key in [
            "completed",
            "err",
            "nCompleted",
            "nTotal",
            "operationUnits",
            "description",
            "started",
            "updated",
        ] {
            assert!(v.get(key).is_some(), "missing {key}");
        }
        assert_eq!(v["started"], "2023-11-14T22:13:20.000Z");
        let back: OperationProgress = serde_json::from_value(v).unwrap();
        assert_eq!(back, p);
    }

    #[test]
    fn write_schedule_first_at_once_then_an_interval_after_the_last_write() {
        let t0 = Instant::now();
        let s = |ms: u64| t0 + Duration::from_millis(ms);
        let mut w = WriteSchedule::new(Duration::from_secs(10));
        // The first value: at once, whenever it comes.
        assert_eq!(w.due(s(860)), s(860));
        w.wrote(s(860));
        // Then one interval after that write, not at a tick of another clock (which came
        // 0.19 s after the first write at a 1 s interval on a real API server).
        assert_eq!(w.due(s(900)), s(10_860));
        assert_eq!(w.due(s(10_859)), s(10_860));
        w.wrote(s(10_860));
        assert_eq!(w.due(s(10_861)), s(20_860));
        // Quiet until 27.5 s: a newer value is written at once, the last write being older
        // than an interval...
        assert_eq!(w.due(s(27_500)), s(27_500));
        w.wrote(s(27_500));
        // ...and the next one an interval after it.
        assert_eq!(w.due(s(27_600)), s(37_500));
    }

    #[test]
    fn write_schedule_spaces_writes_by_an_interval_and_keeps_them_fresh() {
        // A value every 70 ms for 95 s at a 1 s interval, with quiet spells.
        let t0 = Instant::now();
        let interval = Duration::from_secs(1);
        let mut w = WriteSchedule::new(interval);
        let mut writes = Vec::new();
        let mut pending = false;
        let quiet = |x: u64| (20_000..27_300).contains(&x) || (50_000..50_900).contains(&x);
        for step in 0..=95_000u64 {
            let now = t0 + Duration::from_millis(step);
            if step % 70 == 0 && !quiet(step) {
                pending = true;
            }
            if pending && w.due(now) <= now {
                w.wrote(now);
                writes.push(step);
                pending = false;
            }
        }
        assert_eq!(writes[0], 0);
        // Never two writes within one interval...
        assert!(
            writes.windows(2).all(|p| p[1] - p[0] >= 1_000),
            "{writes:?}"
        );
        // ...and never a value older than an interval plus the 70 ms between values, but over
        // a quiet spell (nothing newer to write).
        let fresh = writes
            .windows(2)
            .all(|p| p[1] - p[0] <= 1_000 + 70 || (p[0]..p[1]).any(quiet));
        assert!(fresh, "{writes:?}");
    }
}
