//! Case 6: restic parser throughput (lines/s and MB/s), on real captured lines.

use std::hint::black_box;
use std::path::Path;
use std::time::{Duration, Instant};

use podvolume_agent::framing::{DEFAULT_MAX_FRAME, Frame, Framer, Separators};
use podvolume_agent::uploader::Direction;
use podvolume_agent::uploader::restic::ResticParser;

use crate::stream;
use crate::util::{fmt, median};

const TRIALS: usize = 7;

/// Runs `f` (which processes `bytes` bytes in `lines` lines per call) repeatedly for at least
/// `secs`, `TRIALS` times; returns the median (MB/s, lines/s).
fn measure(secs: f64, bytes: usize, lines: usize, f: &dyn Fn()) -> (f64, f64) {
    let mut mbs = Vec::new();
    let mut lps = Vec::new();
    f(); // warm-up
    for _ in 0..TRIALS {
        let start = Instant::now();
        let mut calls = 0u64;
        while start.elapsed() < Duration::from_secs_f64(secs) {
            f();
            calls += 1;
        }
        let el = start.elapsed().as_secs_f64();
        mbs.push(calls as f64 * bytes as f64 / el / 1e6);
        lps.push(calls as f64 * lines as f64 / el);
    }
    (median(&mbs), median(&lps))
}

fn kind(line: &[u8]) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(line).ok()?;
    Some(v.get("message_type")?.as_str()?.to_string())
}

pub fn run(dir: &Path, secs: f64) -> String {
    let streams = stream::load_dir(dir);
    let mut status = Vec::new();
    let mut verbose = Vec::new();
    let mut verbose_raw = Vec::new();
    let mut verbose_span = Duration::ZERO;
    for (name, chunks) in &streams {
        for (_, line) in stream::stdout_lines(chunks) {
            match kind(&line).as_deref() {
                Some("status") => status.push(line),
                Some("verbose_status") => verbose.push(line),
                _ => {}
            }
        }
        if name.starts_with("verbose") {
            for c in chunks.iter().filter(|c| c.fd == 1) {
                verbose_raw.extend_from_slice(&c.data);
            }
            verbose_span += chunks.last().map(|c| c.t).unwrap_or_default();
        }
    }
    assert!(!status.is_empty(), "no status lines in {}", dir.display());
    let parser = ResticParser::new(Direction::Backup);
    let mut md = String::from("## 6. Parser throughput\n\n");
    md.push_str(&format!(
        "`ResticParser::parse` on real restic 0.14 lines from `testdata/restic-streams/` (one line \
         per call, bytes counted with their newline), and framer + parser on the whole stdout of \
         the verbose stream in 32 KiB reads. {TRIALS} trials of at least {secs} s, medians; one \
         thread.\n\n"
    ));
    md.push_str(
        "| input | lines | mean line B | MB/s | lines/s | x restic's fastest status rate (60 lines/s) |\n\
         |---|---:|---:|---:|---:|---:|\n",
    );
    let mut row = |name: &str, lines: &[Vec<u8>]| {
        if lines.is_empty() {
            return;
        }
        let bytes: usize = lines.iter().map(|l| l.len() + 1).sum();
        let (mbs, lps) = measure(secs, bytes, lines.len(), &|| {
            for l in lines {
                black_box(parser.parse(black_box(l)));
            }
        });
        md.push_str(&format!(
            "| {name} | {} | {} | {} | {} | {} |\n",
            lines.len(),
            bytes / lines.len(),
            fmt(mbs),
            fmt(lps),
            fmt(lps / 60.0)
        ));
    };
    row("status lines", &status);
    row("verbose_status lines (-v)", &verbose);
    if !verbose_raw.is_empty() {
        let lines = verbose_raw.iter().filter(|&&b| b == b'\n').count();
        let (mbs, lps) = measure(secs, verbose_raw.len(), lines, &|| {
            let mut framer = Framer::new(Separators::Newline, DEFAULT_MAX_FRAME);
            for chunk in verbose_raw.chunks(32 * 1024) {
                framer.push(chunk, &mut |f| {
                    if let Frame::Line(l) = f {
                        black_box(parser.parse(l));
                    }
                });
            }
        });
        let produced = verbose_raw.len() as f64 / verbose_span.as_secs_f64().max(1e-9) / 1e6;
        md.push_str(&format!(
            "| framer + parser, verbose stream stdout | {lines} | {} | {} | {} | {} |\n",
            verbose_raw.len() / lines.max(1),
            fmt(mbs),
            fmt(lps),
            fmt(lps / 60.0)
        ));
        md.push_str(&format!(
            "\nrestic itself produced that verbose stream at {} MB/s while backing up; the parser \
             is {}x faster.\n",
            fmt(produced),
            fmt(mbs / produced)
        ));
    }
    md.push('\n');
    md
}
