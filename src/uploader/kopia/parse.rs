//! kopia's output: human byte strings, the progress lines it redraws, the snapshot manifest.

use super::*;

/// Parses kopia's human byte strings: `0 B`, `52.4 MB`, `1.2 GB`, `512 KB`/`kB`, and base 2
/// (`KiB`, `MiB`, `GiB`, ...). The space before the unit is optional and a bare number is bytes.
///
/// kopia rounds sizes to the printed precision, so a figure stands for a range of byte counts and
/// this returns the *smallest* of them: half a unit of the last printed digit below the figure
/// (`1.3 MB` -> 1,250,000; `2 MiB`, kopia's 2.0 with `.0` trimmed, -> 1.95 MiB; plain bytes are
/// exact). Progress built from these
/// values never exceeds the exact size the snapshot manifest reports at the end, so it never has to
/// go backwards. Exact integer arithmetic (no floats); `None` for anything else or when that
/// smallest value is above `u64::MAX`.
pub fn parse_si_bytes(s: &str) -> Option<u64> {
    let s = s.trim();
    let num_end = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(num_end);
    let unit = unit.trim_start();
    let (int_part, frac_part) = match num.split_once('.') {
        Some((i, f)) => (i, f),
        None => (num, ""),
    };
    if int_part.is_empty() && frac_part.is_empty() || frac_part.contains('.') {
        return None;
    }
    let multiplier: u128 = unit_multiplier(unit)?;
    let int: u128 = if int_part.is_empty() {
        0
    } else {
        // More than 39 digits cannot fit in u128 and certainly not in the u64 result.
        if int_part.len() > 30 {
            return None;
        }
        int_part.parse().ok()?
    };
    // Digits beyond 18 decimals cannot matter for a byte count.
    let frac_digits = &frac_part[..frac_part.len().min(18)];
    let (frac, scale): (u128, u128) = if frac_digits.is_empty() {
        // kopia prints every size with one decimal and trims a trailing `.0` (`niceNumber`):
        // `201 MB` is 201.0 MB, at least 200.95 MB, not 200.5 MB. Plain bytes are exact.
        if multiplier == 1 { (0, 1) } else { (0, 10) }
    } else {
        (
            frac_digits.parse().ok()?,
            10u128.pow(frac_digits.len() as u32),
        )
    };
    // The figure in units of its last printed digit (`52.4` -> 524 tenths). Every overflow below
    // means a result far above u64::MAX.
    let figure = int.checked_mul(scale)?.checked_add(frac)?;
    let value = if multiplier == 1 || figure == 0 {
        // Plain bytes are printed exactly (a fraction of a byte is dropped).
        figure * multiplier / scale
    } else {
        // ceil((figure - 1/2) * multiplier / scale): the smallest whole byte count that rounds to
        // the figure.
        (figure.checked_mul(2)? - 1)
            .checked_mul(multiplier)?
            .div_ceil(2 * scale)
    };
    u64::try_from(value).ok()
}

pub(super) fn unit_multiplier(unit: &str) -> Option<u128> {
    let u = unit.strip_suffix(['B', 'b']).unwrap_or(unit);
    if u.is_empty() {
        // `B`, or a bare number.
        return Some(1);
    }
    let (prefix, base2) = match u.strip_suffix('i') {
        Some(p) => (p, true),
        None => (u, false),
    };
    let power = match prefix {
        "k" | "K" => 1,
        "M" | "m" => 2,
        "G" | "g" => 3,
        "T" | "t" => 4,
        "P" | "p" => 5,
        "E" | "e" => 6,
        _ => return None,
    };
    let base: u128 = if base2 { 1024 } else { 1000 };
    Some(base.pow(power))
}

/// The snapshot manifest printed by `snapshot create --json`. Unknown fields are ignored.
#[derive(Deserialize)]
struct Manifest {
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    incomplete: Option<String>,
    #[serde(default, rename = "rootEntry")]
    root_entry: Option<RootEntry>,
    #[serde(default)]
    stats: Option<ManifestStats>,
}

#[derive(Deserialize)]
struct ManifestStats {
    #[serde(rename = "cachedFiles")]
    cached_files: Option<u64>,
    #[serde(rename = "nonCachedFiles")]
    non_cached_files: Option<u64>,
}

#[derive(Deserialize)]
struct RootEntry {
    #[serde(default)]
    summ: Option<DirSummary>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct DirSummary {
    size: u64,
    files: u64,
    #[serde(rename = "numFailed")]
    num_failed: u64,
}

/// Phrases that end a kopia run, whatever the line starts with (current kopia prints errors with
/// no level prefix).
const FATAL_PHRASES: &[&str] = &[
    "invalid repository password",
    "repository is not connected",
    "not connected to a repository",
    "repository not initialized",
    "unable to find repository",
    "unable to open repository",
    "error connecting to repository",
    "cannot access storage path",
    "can't connect to storage",
    "unable to get local filesystem entry",
];

/// Stateless-per-record parser for kopia's output (both streams).
#[derive(Debug, Clone, Copy)]
pub struct KopiaParser {
    direction: Direction,
}

impl KopiaParser {
    pub fn new(direction: Direction) -> Self {
        Self { direction }
    }

    /// Parses one framed record from either stream.
    pub fn parse(&self, record: &[u8]) -> UploaderEvent {
        let trimmed = record.trim_ascii();
        if trimmed.first() == Some(&b'{') {
            return parse_manifest(trimmed);
        }
        self.text(clean_line(trimmed))
    }

    fn text(&self, line: String) -> UploaderEvent {
        if line.is_empty() {
            return UploaderEvent::Ignored;
        }
        // Per-entry errors come after `\n ! ` while progress is on.
        let body = match line.strip_prefix('!') {
            Some(rest) => rest.trim_start(),
            None => line.as_str(),
        };
        // Older kopia prefixed error log lines with their level. Azure's SDK errors span lines,
        // one of which is `ERROR CODE: <code>`: part of the error above, not a level.
        let (level_error, body) = match body.strip_prefix("ERROR") {
            Some(rest) if rest.starts_with(" CODE:") => (false, body),
            Some(rest) if rest.is_empty() || rest.starts_with([' ', ':', '\t']) => {
                (true, rest.trim_start_matches(':').trim_start())
            }
            _ => (false, body),
        };
        if let Some(ev) = item_error(body) {
            return ev;
        }
        if body.starts_with("Found ") && body.contains("fatal error(s) while snapshotting") {
            return UploaderEvent::Text(body.to_string());
        }
        if let Some(sample) = backup_progress(body) {
            return UploaderEvent::Progress(sample);
        }
        if self.direction == Direction::Restore {
            if let Some(sample) = restore_progress(body) {
                return UploaderEvent::Progress(sample);
            }
            if let Some(summary) = restore_summary(body) {
                return UploaderEvent::Summary(summary);
            }
        }
        if looks_like_progress(body) {
            return UploaderEvent::Malformed(format!(
                "unparsable kopia progress line: {}",
                truncate(body, 256)
            ));
        }
        if level_error || FATAL_PHRASES.iter().any(|p| body.contains(p)) {
            return UploaderEvent::Fatal(body.to_string());
        }
        UploaderEvent::Text(line)
    }
}

fn parse_manifest(json: &[u8]) -> UploaderEvent {
    match serde_json::from_slice::<Manifest>(json) {
        Ok(m) if m.id.is_some() || m.root_entry.is_some() => {
            let summ = m.root_entry.and_then(|r| r.summ).unwrap_or_default();
            UploaderEvent::Summary(RunSummary {
                snapshot_id: m.id.filter(|id| !id.is_empty()),
                total_bytes: summ.size,
                total_files: summ.files,
                bytes_added: 0,
                failed_items: summ.num_failed,
                incomplete: m.incomplete.filter(|r| !r.is_empty()),
                files_cached: m.stats.as_ref().and_then(|s| s.cached_files),
                files_read: m.stats.as_ref().and_then(|s| s.non_cached_files),
                ..RunSummary::default()
            })
        }
        // Valid JSON, but not a manifest: not ours to judge.
        Ok(_) => UploaderEvent::Ignored,
        Err(e) => UploaderEvent::Malformed(format!(
            "unparsable kopia JSON record of {} bytes ({e})",
            json.len()
        )),
    }
}

/// Velero's `incrementalBytes` for a kopia snapshot: the bytes read again rather than taken
/// unchanged from the parent snapshot (its own uploader reports the estimated total minus the
/// cached bytes). The manifest counts files, not bytes, so the figure is exact when no file or
/// every file came from the parent; in between it is the "hashed" figure of kopia's last
/// progress line (printed when the upload finishes), which kopia rounds to one decimal of its
/// unit and the parser reads as the lower bound: at most 0.1 of that unit (kB, MB, GB, ...)
/// below the truth, never above it, exact below 900 bytes. `None` when kopia said
/// neither (no statistics in the manifest).
pub fn incremental_bytes(s: &RunSummary, last_bytes_read: Option<u64>) -> Option<u64> {
    match (s.files_cached?, s.files_read?) {
        (_, 0) => Some(0),
        (0, _) => Some(s.total_bytes),
        _ => last_bytes_read.map(|b| b.min(s.total_bytes)),
    }
}

/// `Error when processing "<path>": <error>`.
fn item_error(body: &str) -> Option<UploaderEvent> {
    let rest = body.strip_prefix("Error when processing \"")?;
    let (item, message) = rest.split_once("\": ")?;
    Some(UploaderEvent::ItemError {
        item: item.to_string(),
        message: message.trim().to_string(),
    })
}

/// A progress line we should have understood (so a failure to parse it is worth reporting).
fn looks_like_progress(body: &str) -> bool {
    let after_spinner = strip_spinner(body).unwrap_or(body);
    after_spinner.contains(" hashing, ") && after_spinner.contains(" hashed (")
        || body.starts_with("Processed ") && body.contains(") of ")
}

const SPINNER: &[char] = &['|', '/', '-', '\\', '*'];

fn strip_spinner(body: &str) -> Option<&str> {
    let mut chars = body.chars();
    let first = chars.next()?;
    if !SPINNER.contains(&first) {
        return None;
    }
    let rest = chars.as_str();
    rest.starts_with(' ').then(|| rest.trim_start())
}

/// A tiny cursor over a progress line; every step returns `None` when the text does not match.
struct Cursor<'a>(&'a str);

impl<'a> Cursor<'a> {
    fn lit(&mut self, s: &str) -> Option<()> {
        self.0 = self.0.strip_prefix(s)?;
        Some(())
    }

    fn try_lit(&mut self, s: &str) -> bool {
        self.lit(s).is_some()
    }

    fn count(&mut self) -> Option<u64> {
        let end = self
            .0
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(self.0.len());
        let (n, rest) = self.0.split_at(end);
        let n = n.parse().ok()?;
        self.0 = rest;
        Some(n)
    }

    /// `<number> <unit>` as kopia prints it, e.g. `52.4 MB`.
    fn bytes(&mut self) -> Option<u64> {
        let num_end = self
            .0
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(self.0.len());
        let after_num = self.0[num_end..].strip_prefix(' ')?;
        let unit_end = after_num
            .find(|c: char| !c.is_ascii_alphabetic())
            .unwrap_or(after_num.len());
        let len = num_end + 1 + unit_end;
        let v = parse_si_bytes(&self.0[..len])?;
        self.0 = &self.0[len..];
        Some(v)
    }

    /// `(<bytes>)`.
    fn paren_bytes(&mut self) -> Option<u64> {
        self.lit("(")?;
        let v = self.bytes()?;
        self.lit(")")?;
        Some(v)
    }
}

/// ` <spinner> <N> hashing, <N> hashed (<bytes>), <N> cached (<bytes>), uploaded <bytes>
/// [ (<N> fatal errors)][ (<N> errors ignored)], estimated <bytes> (<P>%) <D> left`
/// or `..., estimating...`.
fn backup_progress(body: &str) -> Option<ProgressSample> {
    let mut c = Cursor(strip_spinner(body).unwrap_or(body));
    c.count()?;
    c.lit(" hashing, ")?;
    let hashed_files = c.count()?;
    c.lit(" hashed ")?;
    let hashed_bytes = c.paren_bytes()?;
    c.lit(", ")?;
    let cached_files = c.count()?;
    c.lit(" cached ")?;
    let cached_bytes = c.paren_bytes()?;
    c.lit(", uploaded ")?;
    c.bytes()?;
    // ` (<N> fatal errors)` and ` (<N> errors ignored)`, each optional.
    while c.try_lit(" (") {
        c.count()?;
        if !(c.try_lit(" fatal errors)") || c.try_lit(" errors ignored)")) {
            return None;
        }
    }
    let estimated = if c.try_lit(", estimating...") {
        None
    } else if c.try_lit(", estimated ") {
        // The percentage (may exceed 100) and the time left follow; we compute our own.
        Some(c.bytes()?)
    } else if c.0.is_empty() {
        // Progress printed without the estimate part (not expected with --progress).
        None
    } else {
        return None;
    };
    Some(ProgressSample {
        bytes_done: hashed_bytes.saturating_add(cached_bytes),
        total_bytes: estimated,
        files_done: hashed_files.saturating_add(cached_files),
        total_files: None,
        scan_finished: estimated.is_some(),
        bytes_read: Some(hashed_bytes),
    })
}

/// `Processed <N> (<bytes>) of <M> (<bytes>)[, skipped <N> (<bytes>)][, ignored N errors]
/// [ <rate>/s (<P>%) remaining <D>].`
fn restore_progress(body: &str) -> Option<ProgressSample> {
    let mut c = Cursor(body);
    c.lit("Processed ")?;
    let files_done = c.count()?;
    c.lit(" ")?;
    let restored = c.paren_bytes()?;
    c.lit(" of ")?;
    let total_files = c.count()?;
    c.lit(" ")?;
    let total_bytes = c.paren_bytes()?;
    let mut skipped_bytes = 0;
    if c.try_lit(", skipped ") {
        c.count()?;
        c.lit(" ")?;
        skipped_bytes = c.paren_bytes()?;
    }
    if c.try_lit(", ignored ") {
        c.count()?;
        c.lit(" errors")?;
    }
    // kopia estimates the time left once it has a rate: the closest thing to "the walk is done".
    let has_eta = c.0.starts_with(' ') && c.0.contains(" remaining ");
    if !(has_eta || c.0 == ".") {
        return None;
    }
    Some(ProgressSample {
        bytes_done: restored.saturating_add(skipped_bytes),
        total_bytes: Some(total_bytes),
        files_done,
        total_files: Some(total_files),
        scan_finished: has_eta,
        bytes_read: None,
    })
}

/// `Restored N files, M directories and K symbolic links (<bytes>)[, skipped N (<bytes>)]...`.
fn restore_summary(body: &str) -> Option<RunSummary> {
    let mut c = Cursor(body);
    c.lit("Restored ")?;
    let files = c.count()?;
    c.lit(" files, ")?;
    c.count()?;
    c.lit(" directories and ")?;
    let symlinks = c.count()?;
    c.lit(" symbolic links ")?;
    let bytes = c.paren_bytes()?;
    let (mut skipped_count, mut skipped_bytes) = (0, 0);
    if c.try_lit(", skipped ") {
        skipped_count = c.count()?;
        c.lit(" ")?;
        skipped_bytes = c.paren_bytes()?;
    }
    Some(RunSummary {
        snapshot_id: None,
        total_bytes: bytes.saturating_add(skipped_bytes),
        total_files: files.saturating_add(symlinks).saturating_add(skipped_count),
        ..RunSummary::default()
    })
}
