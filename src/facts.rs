//! What a run said that matters for its outcome, kept in bounded memory.

use std::collections::VecDeque;

use crate::text::truncate;
use crate::uploader::{FailedItem, RunSummary, Stream, UploaderEvent};

/// How many unreadable items are named; the rest are counted.
pub const FIRST_FAILED_ITEMS: usize = 10;
/// Lines of stderr kept for diagnostics, and the longest line kept.
pub const STDERR_TAIL_LINES: usize = 40;
pub const STDERR_TAIL_LINE_BYTES: usize = 512;
/// A `Fatal:` line is followed by a few lines of explanation (lock holder, repository location).
const FATAL_BLOCK_LINES: usize = 8;
/// How the Go runtime starts the report of a crash (exit 2), before a goroutine stack of any
/// length: `panic: ...` for a panic, `fatal error: ...` for a runtime failure (out of memory,
/// concurrent map writes).
const GO_CRASH_PREFIXES: &[&str] = &["panic: ", "fatal error: "];

/// Facts gathered from a run's events. Everything is bounded: a run that prints millions of
/// errors costs the same memory as one that prints ten.
#[derive(Debug, Default, Clone)]
pub struct RunFacts {
    pub summary: Option<RunSummary>,
    /// The most recent fatal message, with its continuation lines.
    pub fatal: Vec<String>,
    pub failed_items: u64,
    pub first_failed_items: Vec<FailedItem>,
    pub stderr_tail: VecDeque<String>,
    /// The first line of a Go crash report on stderr (`panic: ...`), kept because the stack
    /// after it pushes it out of the tail.
    pub crash: Option<String>,
    /// restic said "signal interrupt received" (someone sent SIGINT).
    pub interrupt_seen: bool,
    pub truncated_frames: u64,
    pub malformed_records: u64,
    in_fatal_block: bool,
}

impl RunFacts {
    pub fn observe(&mut self, stream: Stream, event: &UploaderEvent) {
        let continues_fatal = matches!(event, UploaderEvent::Text(_)) && stream == Stream::Stderr;
        match event {
            UploaderEvent::Summary(s) => self.summary = Some(s.clone()),
            UploaderEvent::Fatal(m) => {
                self.fatal = vec![truncate(m, 2048)];
                self.in_fatal_block = true;
                self.tail(format!("Fatal: {m}"));
                return;
            }
            UploaderEvent::Text(t) => {
                if self.in_fatal_block && continues_fatal && self.fatal.len() < FATAL_BLOCK_LINES {
                    self.fatal.push(truncate(t, 512));
                }
                if t.contains("signal interrupt received") {
                    self.interrupt_seen = true;
                }
                if stream == Stream::Stderr
                    && self.crash.is_none()
                    && GO_CRASH_PREFIXES.iter().any(|p| t.starts_with(p))
                {
                    self.crash = Some(truncate(t, STDERR_TAIL_LINE_BYTES));
                }
                if stream == Stream::Stderr {
                    self.tail(t.clone());
                }
            }
            UploaderEvent::ItemError { item, message } => {
                self.failed_items += 1;
                if self.first_failed_items.len() < FIRST_FAILED_ITEMS {
                    self.first_failed_items.push(FailedItem {
                        item: truncate(item, 512),
                        message: truncate(message, 256),
                    });
                }
                if stream == Stream::Stderr {
                    self.tail(format!("error: {item}: {message}"));
                }
            }
            UploaderEvent::Truncated { .. } => self.truncated_frames += 1,
            UploaderEvent::Malformed(m) => {
                self.malformed_records += 1;
                self.tail(m.clone());
            }
            UploaderEvent::Progress(_)
            | UploaderEvent::ScanFinished { .. }
            | UploaderEvent::Ignored => {}
        }
        if !continues_fatal {
            self.in_fatal_block = false;
        }
    }

    fn tail(&mut self, line: String) {
        if self.stderr_tail.len() == STDERR_TAIL_LINES {
            self.stderr_tail.pop_front();
        }
        self.stderr_tail
            .push_back(truncate(&line, STDERR_TAIL_LINE_BYTES));
    }

    /// Everything that explains a failure, for matching known causes.
    pub fn error_text(&self) -> String {
        let mut s = self.fatal.join("\n");
        for line in &self.stderr_tail {
            s.push('\n');
            s.push_str(line);
        }
        s
    }

    /// The real cause for people to read: the last fatal message, else the first line of a Go
    /// crash report (`panic: ...`, not the last line of its stack), else the last stderr line,
    /// else `fallback`.
    pub fn cause(&self, fallback: &str) -> String {
        if !self.fatal.is_empty() {
            return self.fatal.join(" ").replace('\n', " ").trim().to_string();
        }
        if let Some(crash) = &self.crash {
            return format!("{fallback}: {crash}");
        }
        match self.stderr_tail.back() {
            Some(last) => format!("{fallback}: {last}"),
            None => format!("{fallback} and printed no error"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fatal_block_keeps_its_continuation_lines_only() {
        let mut f = RunFacts::default();
        f.observe(
            Stream::Stderr,
            &UploaderEvent::Fatal("unable to create lock in backend: locked by PID 7".into()),
        );
        f.observe(
            Stream::Stderr,
            &UploaderEvent::Text("lock was created at 10:00 (5m ago)".into()),
        );
        f.observe(Stream::Stdout, &UploaderEvent::Ignored);
        f.observe(Stream::Stderr, &UploaderEvent::Text("unrelated".into()));
        assert_eq!(
            f.cause("x"),
            "unable to create lock in backend: locked by PID 7 lock was created at 10:00 (5m ago)"
        );
    }

    #[test]
    fn bounded_whatever_the_volume() {
        let mut f = RunFacts::default();
        for i in 0..100_000 {
            f.observe(
                Stream::Stderr,
                &UploaderEvent::ItemError {
                    item: format!("/f{i}"),
                    message: "permission denied".into(),
                },
            );
        }
        assert_eq!(f.failed_items, 100_000);
        assert_eq!(f.first_failed_items.len(), FIRST_FAILED_ITEMS);
        assert_eq!(f.first_failed_items[0].item, "/f0");
        assert_eq!(f.stderr_tail.len(), STDERR_TAIL_LINES);
    }

    #[test]
    fn a_go_crash_is_told_by_its_first_line_not_the_end_of_its_stack() {
        let mut f = RunFacts::default();
        let text = |f: &mut RunFacts, t: &str| {
            f.observe(Stream::Stderr, &UploaderEvent::Text(t.to_string()))
        };
        text(
            &mut f,
            "panic: runtime error: index out of range [3] with length 3",
        );
        text(&mut f, "goroutine 1 [running]:");
        for i in 0..198 {
            text(
                &mut f,
                &format!("main.frame{i}(0x1)\t/src/main.go:{i} +0x2a"),
            );
        }
        // A nested panic further down does not replace the first one.
        text(&mut f, "\tpanic: second");
        assert_eq!(
            f.cause("restic failed with exit code 2"),
            "restic failed with exit code 2: panic: runtime error: index out of range [3] with length 3"
        );
        // The same for the runtime's own failures.
        let mut g = RunFacts::default();
        text(&mut g, "fatal error: concurrent map writes");
        text(&mut g, "goroutine 7 [running]:");
        assert_eq!(g.cause("x"), "x: fatal error: concurrent map writes");
        // On stdout it is no crash report.
        let mut h = RunFacts::default();
        h.observe(
            Stream::Stdout,
            &UploaderEvent::Text("panic: not really".into()),
        );
        assert_eq!(h.crash, None);
        // A Fatal message still comes first.
        f.observe(Stream::Stderr, &UploaderEvent::Fatal("disk full".into()));
        assert_eq!(f.cause("x"), "disk full");
    }

    #[test]
    fn cause_falls_back_to_last_stderr_line() {
        let mut f = RunFacts::default();
        assert_eq!(
            f.cause("restic failed with exit code 1"),
            "restic failed with exit code 1 and printed no error"
        );
        f.observe(
            Stream::Stderr,
            &UploaderEvent::Text("something broke".into()),
        );
        assert_eq!(
            f.cause("restic failed with exit code 1"),
            "restic failed with exit code 1: something broke"
        );
    }
}
