//! Byte-level framing of an uploader's output stream into records.
//!
//! Uploaders write records separated by `\n` (restic's JSON lines) or redraw a status line with `\r`
//! (kopia). Reads from a pipe cut records at arbitrary places and may carry many records at once, so
//! framing works on bytes and keeps only the unfinished tail of the current record. A record longer
//! than the cap is not buffered: it is counted and reported as one [`Frame::Truncated`] when its end
//! arrives, and framing resumes at the next separator. Memory is therefore bounded by the cap
//! whatever the child prints, and the caller can keep draining the pipe at full speed.

/// Default longest record kept whole (1 MiB). restic's `current_files` makes status lines long
/// (hundreds of KiB with long paths) but never this long.
pub const DEFAULT_MAX_FRAME: usize = 1 << 20;

/// One record cut from the stream. Empty records (blank lines, `\r\n`) are not reported.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame<'a> {
    /// A whole record without its separator.
    Line(&'a [u8]),
    /// A record longer than the cap; only its length is known.
    Truncated { len: u64 },
}

/// Which bytes end a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Separators {
    /// `\n` only (restic).
    Newline,
    /// `\n` and `\r` (kopia's redrawn progress line).
    NewlineAndCarriageReturn,
}

/// Incremental framer. Feed it reads with [`Framer::push`]; call [`Framer::finish`] at EOF so a
/// last record without a separator is not lost.
#[derive(Debug)]
pub struct Framer {
    separators: Separators,
    max_frame: usize,
    /// Bytes of the current, unfinished record (never more than `max_frame`).
    pending: Vec<u8>,
    /// Set while skipping an over-long record: its length so far.
    overflow: Option<u64>,
    truncated_total: u64,
}

impl Framer {
    pub fn new(separators: Separators, max_frame: usize) -> Self {
        Self {
            separators,
            max_frame: max_frame.max(1),
            pending: Vec::new(),
            overflow: None,
            truncated_total: 0,
        }
    }

    /// Number of records reported as truncated so far.
    pub fn truncated_frames(&self) -> u64 {
        self.truncated_total
    }

    /// Frames `data`, calling `emit` for every record it completes.
    pub fn push(&mut self, mut data: &[u8], emit: &mut dyn FnMut(Frame<'_>)) {
        while !data.is_empty() {
            let cut = match self.separators {
                Separators::Newline => data.iter().position(|&b| b == b'\n'),
                Separators::NewlineAndCarriageReturn => {
                    data.iter().position(|&b| b == b'\n' || b == b'\r')
                }
            };
            match cut {
                Some(i) => {
                    self.append(&data[..i]);
                    self.end_record(emit);
                    data = &data[i + 1..];
                }
                None => {
                    self.append(data);
                    data = &[];
                }
            }
        }
    }

    /// Reports the last record if the stream ended without a separator.
    pub fn finish(&mut self, emit: &mut dyn FnMut(Frame<'_>)) {
        self.end_record(emit);
    }

    fn append(&mut self, bytes: &[u8]) {
        if let Some(len) = self.overflow.as_mut() {
            *len += bytes.len() as u64;
            return;
        }
        if self.pending.len() + bytes.len() > self.max_frame {
            // Give the buffer back: an over-long record must not pin a large allocation.
            let len = (self.pending.len() + bytes.len()) as u64;
            self.pending = Vec::new();
            self.overflow = Some(len);
        } else {
            self.pending.extend_from_slice(bytes);
        }
    }

    fn end_record(&mut self, emit: &mut dyn FnMut(Frame<'_>)) {
        if let Some(len) = self.overflow.take() {
            self.truncated_total += 1;
            emit(Frame::Truncated { len });
        } else if !self.pending.is_empty() {
            emit(Frame::Line(&self.pending));
            self.pending.clear();
        }
        // Keep a modest buffer for the next record, release a large one.
        if self.pending.capacity() > 64 * 1024 {
            self.pending = Vec::new();
        }
    }

    #[cfg(test)]
    fn buffered_capacity(&self) -> usize {
        self.pending.capacity()
    }
}

/// Owned form of a frame, for tests and for collecting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OwnedFrame {
    Line(Vec<u8>),
    Truncated { len: u64 },
}

impl From<Frame<'_>> for OwnedFrame {
    fn from(f: Frame<'_>) -> Self {
        match f {
            Frame::Line(l) => OwnedFrame::Line(l.to_vec()),
            Frame::Truncated { len } => OwnedFrame::Truncated { len },
        }
    }
}

/// Frames a whole buffer at once (fixtures, whole-document outputs).
pub fn frame_all(data: &[u8], separators: Separators, max_frame: usize) -> Vec<OwnedFrame> {
    let mut out = Vec::new();
    let mut framer = Framer::new(separators, max_frame);
    framer.push(data, &mut |f| out.push(f.into()));
    framer.finish(&mut |f| out.push(f.into()));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn split_frames(chunks: &[&[u8]], sep: Separators, cap: usize) -> Vec<OwnedFrame> {
        let mut out = Vec::new();
        let mut framer = Framer::new(sep, cap);
        for c in chunks {
            framer.push(c, &mut |f| out.push(f.into()));
        }
        framer.finish(&mut |f| out.push(f.into()));
        out
    }

    fn line(s: &str) -> OwnedFrame {
        OwnedFrame::Line(s.as_bytes().to_vec())
    }

    #[test]
    fn splits_many_records_per_read_and_records_across_reads() {
        let frames = split_frames(
            &[b"{\"a\":1}\n{\"b\"", b":2}\n\n{\"c\":3}"],
            Separators::Newline,
            1024,
        );
        assert_eq!(
            frames,
            vec![line("{\"a\":1}"), line("{\"b\":2}"), line("{\"c\":3}")]
        );
    }

    #[test]
    fn carriage_return_splits_only_when_asked() {
        let input: &[u8] = b" | 1 hashing\r / 2 hashing\r\n * done\n";
        let cr = split_frames(&[input], Separators::NewlineAndCarriageReturn, 1024);
        assert_eq!(
            cr,
            vec![line(" | 1 hashing"), line(" / 2 hashing"), line(" * done")]
        );
        let nl = split_frames(&[input], Separators::Newline, 1024);
        assert_eq!(nl.len(), 2);
        assert_eq!(nl[0], line(" | 1 hashing\r / 2 hashing\r"));
    }

    #[test]
    fn over_long_record_is_truncated_and_framing_resumes() {
        let mut input = vec![b'x'; 100];
        input.extend_from_slice(b"\nok\n");
        let frames = split_frames(&[&input[..30], &input[30..]], Separators::Newline, 10);
        assert_eq!(frames, vec![OwnedFrame::Truncated { len: 100 }, line("ok")]);
    }

    #[test]
    fn a_100_mb_line_stays_within_the_cap() {
        let cap = DEFAULT_MAX_FRAME;
        let mut framer = Framer::new(Separators::Newline, cap);
        let chunk = vec![b'y'; 64 * 1024];
        let mut frames = Vec::new();
        let mut peak = 0;
        for _ in 0..(100 * 1024 * 1024 / chunk.len()) {
            framer.push(&chunk, &mut |f| frames.push(OwnedFrame::from(f)));
            peak = peak.max(framer.buffered_capacity());
        }
        framer.push(b"\n{\"after\":1}\n", &mut |f| {
            frames.push(OwnedFrame::from(f))
        });
        assert!(peak <= cap, "buffer grew to {peak} bytes, cap {cap}");
        assert_eq!(
            frames,
            vec![
                OwnedFrame::Truncated {
                    len: 100 * 1024 * 1024
                },
                line("{\"after\":1}")
            ]
        );
        assert_eq!(framer.truncated_frames(), 1);
    }

    proptest! {
        #[test]
        fn frames_do_not_depend_on_how_input_is_split(
            data in proptest::collection::vec(prop_oneof![
                Just(b'\n'), Just(b'\r'), Just(b'a'), Just(b'{'), any::<u8>()
            ], 0..600),
            cuts in proptest::collection::vec(0usize..600, 0..12),
            cap in 1usize..64,
            cr in any::<bool>(),
        ) {
            let sep = if cr { Separators::NewlineAndCarriageReturn } else { Separators::Newline };
            let whole = split_frames(&[&data], sep, cap);
            let mut points: Vec<usize> = cuts.into_iter().map(|c| c.min(data.len())).collect();
            points.sort_unstable();
            let mut chunks: Vec<&[u8]> = Vec::new();
            let mut start = 0;
            for p in points {
                chunks.push(&data[start..p]);
                start = p;
            }
            chunks.push(&data[start..]);
            let pieces = split_frames(&chunks, sep, cap);
            prop_assert_eq!(&whole, &pieces);
            // Every frame respects the cap, and no separator survives inside a frame.
            for f in &whole {
                if let OwnedFrame::Line(l) = f {
                    prop_assert!(l.len() <= cap);
                    prop_assert!(!l.contains(&b'\n'));
                    if cr { prop_assert!(!l.contains(&b'\r')); }
                }
            }
        }

        #[test]
        fn arbitrary_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..4096)) {
            let frames = split_frames(&[&data], Separators::Newline, 128);
            // Reconstruct the byte count: lines plus truncated lengths never exceed the input.
            let total: u64 = frames.iter().map(|f| match f {
                OwnedFrame::Line(l) => l.len() as u64,
                OwnedFrame::Truncated { len } => *len,
            }).sum();
            prop_assert!(total <= data.len() as u64);
        }
    }
}
