//! What a run said that matters for its outcome, kept in bounded memory.

use std::collections::VecDeque;

use crate::text::truncate;
use crate::uploader::{FailedItem, RunSummary, Stream, UploaderEvent};

/// How many unreadable items are kept (with their errors); the rest are counted.
pub const FIRST_FAILED_ITEMS: usize = 10;
/// How many of them a message names: enough to recognise the problem, short enough to read.
pub const NAMED_FAILED_ITEMS: usize = 3;
/// How many distinct causes of item errors are counted; later new causes count as "other".
const ITEM_CAUSES: usize = 16;
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
    /// The uploader's latest figure of bytes read (kopia's "hashed"): its last progress line.
    pub last_bytes_read: Option<u64>,
    /// Item errors by cause (the last `: `-separated part of the uploader's message, e.g.
    /// `permission denied`), at most [`ITEM_CAUSES`] causes: a flood of errors is summarised by
    /// what dominates it.
    pub item_causes: Vec<(String, u64)>,
    /// Hashes of the distinct items that had errors (restic reports one file several times:
    /// its creation, then its metadata), up to [`DISTINCT_ITEMS`]; `None` past that.
    distinct_items: Option<std::collections::HashSet<u64>>,
    distinct_items_overflowed: bool,
    in_fatal_block: bool,
}

/// How many distinct failed items are told apart (8 bytes each); past it, errors are counted.
const DISTINCT_ITEMS: usize = 100_000;

/// What an item error says when the uploader gave no reason (restic 0.14's `"error":{}`).
pub const UNKNOWN_ITEM_ERROR: &str = "could not be read";

/// The cause in an item error: `open /v/a: permission denied` -> `permission denied`; empty when
/// the uploader gave none.
pub fn item_cause(message: &str) -> &str {
    if message == UNKNOWN_ITEM_ERROR {
        return "";
    }
    message.rsplit(": ").next().unwrap_or(message).trim()
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
                self.note_distinct_item(item);
                let cause = truncate(item_cause(message), 128);
                if cause.is_empty() {
                    // No reason given: counted in failed_items only.
                } else if let Some((_, n)) = self.item_causes.iter_mut().find(|(c, _)| *c == cause)
                {
                    *n += 1;
                } else if self.item_causes.len() < ITEM_CAUSES {
                    self.item_causes.push((cause, 1));
                }
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
            UploaderEvent::Progress(p) => {
                if p.bytes_read.is_some() {
                    self.last_bytes_read = p.bytes_read;
                }
            }
            UploaderEvent::ScanFinished { .. } | UploaderEvent::Ignored => {}
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

    fn note_distinct_item(&mut self, item: &str) {
        use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
        if self.distinct_items_overflowed {
            return;
        }
        let set = self
            .distinct_items
            .get_or_insert_with(std::collections::HashSet::new);
        if set.len() >= DISTINCT_ITEMS {
            // Told apart no longer: the count of errors stands for the count of items.
            self.distinct_items = None;
            self.distinct_items_overflowed = true;
            return;
        }
        set.insert(BuildHasherDefault::<DefaultHasher>::default().hash_one(item));
    }

    /// How many items had errors: distinct items while they can be told apart, else errors.
    pub fn failed_item_count(&self) -> u64 {
        match &self.distinct_items {
            Some(set) => set.len() as u64,
            None => self.failed_items,
        }
    }

    /// `<N> item(s) <verb>: <cause> (first: a, b, c and K more)`: the count, the cause that
    /// dominates (with how many it covers when not all), and the first items, each with its own
    /// cause where that differs. `failed` may exceed the items seen (kopia counts some it does
    /// not name).
    pub fn items_summary(&self, failed: u64, verb: &str) -> String {
        let mut msg = format!("{failed} item{} {verb}", if failed == 1 { "" } else { "s" });
        // The most frequent cause; on a tie the first seen (the first failure of an item, not
        // what followed from it).
        let dominant = self.item_causes.iter().rev().max_by_key(|(_, n)| *n);
        if let Some((cause, n)) = dominant
            && !cause.is_empty()
        {
            msg.push_str(": ");
            msg.push_str(cause);
            if *n < failed {
                msg.push_str(&format!(" ({n} of them)"));
            }
        }
        let named: Vec<String> = self
            .first_failed_items
            .iter()
            .take(NAMED_FAILED_ITEMS)
            .map(|i| {
                let cause = item_cause(&i.message);
                if cause.is_empty() || dominant.is_some_and(|(d, _)| d == cause) {
                    i.item.clone()
                } else {
                    format!("{} ({cause})", i.item)
                }
            })
            .collect();
        if !named.is_empty() {
            msg.push_str(" (first: ");
            msg.push_str(&named.join(", "));
            let more = failed.saturating_sub(named.len() as u64);
            if more > 0 {
                msg.push_str(&format!(" and {more} more"));
            }
            msg.push(')');
        }
        msg
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

    fn item(f: &mut RunFacts, path: &str, message: &str) {
        f.observe(
            Stream::Stdout,
            &UploaderEvent::ItemError {
                item: path.into(),
                message: message.into(),
            },
        );
    }

    #[test]
    fn a_flood_of_item_errors_is_summarised_by_its_dominant_cause() {
        let mut f = RunFacts::default();
        for i in 0..44 {
            item(
                &mut f,
                &format!("/t/f{i}"),
                &format!("open /t/f{i}: read-only file system"),
            );
        }
        assert_eq!(
            f.items_summary(44, "not written"),
            "44 items not written: read-only file system (first: /t/f0, /t/f1, /t/f2 and 41 more)"
        );
        // Another cause among them: named with its item, and the dominant one's share given.
        item(&mut f, "/t/odd", "lstat /t/odd: permission denied");
        let mut g = RunFacts::default();
        item(&mut g, "/a", "open /a: permission denied");
        item(&mut g, "/b", "open /b: input/output error");
        item(&mut g, "/c", "open /c: permission denied");
        assert_eq!(
            g.items_summary(3, "could not be read"),
            "3 items could not be read: permission denied (2 of them) (first: /a, /b (input/output error), /c)"
        );
        assert_eq!(f.item_causes.len(), 2);
    }

    #[test]
    fn item_causes_are_bounded() {
        let mut f = RunFacts::default();
        for i in 0..1000 {
            item(&mut f, "/x", &format!("open /x: cause {i}"));
        }
        assert_eq!(f.item_causes.len(), ITEM_CAUSES);
        assert_eq!(f.failed_items, 1000);
    }

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
