//! Text of `kubectl podvolume`: tables, the lines of `--watch`, the frame of the live view.
//! Pure functions of the figures and `now`.

use std::time::{Duration, SystemTime};

use super::summary::{Item, RateBasis, Settings, State, Summary};
use crate::text::{format_bytes, format_eta};

/// `1.2 GiB of 3.4 GiB`, `1.2 GiB of at least 3.4 GiB`, `1.2 GiB of ?`.
pub fn bytes_of(done: u64, total: Option<u64>, at_least: bool) -> String {
    match total {
        Some(t) if at_least => format!("{} of at least {}", format_bytes(done), format_bytes(t)),
        Some(t) => format!("{} of {}", format_bytes(done), format_bytes(t)),
        None => format!("{} of ?", format_bytes(done)),
    }
}

pub fn rate(r: f64) -> String {
    format!("{}/s", format_bytes(r.round() as u64))
}

/// The rate with how it was measured, or why there is none.
pub fn rate_of(s: &Summary, window: Duration) -> String {
    if let Some(stalled) = s.stalled_seconds {
        return format!("stalled: no progress for {}", format_eta(stalled));
    }
    match (s.rate_bytes_per_second, s.rate_basis) {
        (Some(r), Some(RateBasis::Window)) => {
            format!("{} (last {})", rate(r), humantime::format_duration(window))
        }
        (Some(r), _) if s.finished => format!("{} (average)", rate(r)),
        (Some(r), _) => format!("{} (average since start)", rate(r)),
        (None, _) if s.finished => "-".to_string(),
        (None, _) if s.volumes.running == 0 => "- (waiting for an agent to start)".to_string(),
        (None, _) => "- (measuring)".to_string(),
    }
}

pub fn eta_of(s: &Summary) -> String {
    match s.eta {
        Some(e) if e.at_least => format!("at least {}", format_eta(e.seconds)),
        Some(e) => format_eta(e.seconds),
        None if s.finished => "finished".to_string(),
        None => "-".to_string(),
    }
}

/// `3 queued, 1 running, 2 completed, 1 failed, 0 canceled`.
pub fn phases_of(s: &Summary) -> String {
    let c = &s.volumes;
    format!(
        "{} queued, {} running, {} completed, {} failed, {} canceled",
        c.queued, c.running, c.completed, c.failed, c.canceled
    )
}

fn ago(t: SystemTime, now: SystemTime) -> String {
    format_eta(now.duration_since(t).unwrap_or_default().as_secs())
}

fn when(t: Option<SystemTime>, now: SystemTime) -> String {
    match t {
        Some(t) => format!(
            "{} ({} ago)",
            humantime::format_rfc3339_seconds(t),
            ago(t, now)
        ),
        None => "-".to_string(),
    }
}

/// The block describing the whole.
pub fn summary_block(
    s: &Summary,
    namespace: &str,
    window: Duration,
    now: SystemTime,
) -> Vec<String> {
    let mut out = vec![
        format!("{} {} (namespace {namespace})", s.kind.as_str(), s.name),
        format!(
            "Volumes:  {} of {} done ({})",
            s.volumes.done,
            s.volumes.total,
            phases_of(s)
        ),
        format!(
            "Bytes:    {}",
            bytes_of(s.bytes_done, Some(s.total_bytes), s.total_at_least)
        ),
        format!("Rate:     {}", rate_of(s, window)),
        format!("ETA:      {}", eta_of(s)),
        format!("Started:  {}", when(s.started, now)),
    ];
    if s.finished {
        out.push(format!("Finished: {}", when(s.completed, now)));
    }
    out
}

/// One row per volume; the last column (the agent's message) is cut to fit `width`.
pub fn volume_rows(items: &[Item], width: Option<usize>, bars: bool) -> Vec<String> {
    let mut rows = vec![vec![
        "POD".to_string(),
        "VOLUME".to_string(),
        "NODE".to_string(),
        "PHASE".to_string(),
        "BYTES".to_string(),
        "RATE".to_string(),
        "MESSAGE".to_string(),
    ]];
    for i in items {
        let mut bytes = bytes_of(i.bytes_done, i.total_bytes, false);
        if bars {
            let fraction = match i.total_bytes {
                Some(0) if i.state == State::Completed => Some(1.0),
                Some(t) if t > 0 => Some(i.bytes_done as f64 / t as f64),
                _ => None,
            };
            bytes = format!("{} {bytes}", bar(fraction, 12));
        }
        let phase = if i.cancel_requested && !i.state.is_terminal() && i.phase != "Canceling" {
            format!("{} (cancel asked)", i.phase)
        } else {
            i.phase.clone()
        };
        rows.push(vec![
            i.pod.clone(),
            i.volume.clone(),
            if i.node.is_empty() {
                "-".to_string()
            } else {
                i.node.clone()
            },
            phase,
            bytes,
            i.rate_bytes_per_second
                .map(rate)
                .unwrap_or_else(|| "-".into()),
            // Messages are one line; an agent's multi-line failure shows its first line.
            i.message.lines().next().unwrap_or("").to_string(),
        ]);
    }
    columns(&rows, width)
}

/// Left-aligned columns, three spaces apart; the last column cut at `width` characters.
fn columns(rows: &[Vec<String>], width: Option<usize>) -> Vec<String> {
    let n = rows.first().map(Vec::len).unwrap_or(0);
    let mut widths = vec![0usize; n];
    for r in rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    rows.iter()
        .map(|r| {
            let mut line = String::new();
            for (i, (c, w)) in r.iter().zip(&widths).enumerate() {
                if i + 1 == r.len() {
                    line.push_str(c);
                } else {
                    line.push_str(c);
                    line.push_str(&" ".repeat(w - c.chars().count() + 3));
                }
            }
            let line = line.trim_end().to_string();
            match width {
                Some(w) => cut(&line, w),
                None => line,
            }
        })
        .collect()
}

/// At most `w` characters, the cut marked with `…`.
pub fn cut(s: &str, w: usize) -> String {
    if s.chars().count() <= w {
        return s.to_string();
    }
    let mut out: String = s.chars().take(w.saturating_sub(1)).collect();
    out.push('…');
    out
}

/// `[█████░░░░░]`; `[??????????]` when the total is unknown.
pub fn bar(fraction: Option<f64>, width: usize) -> String {
    match fraction {
        Some(f) => {
            let full = ((f.clamp(0.0, 1.0) * width as f64).floor() as usize).min(width);
            format!("[{}{}]", "█".repeat(full), "░".repeat(width - full))
        }
        None => format!("[{}]", "·".repeat(width)),
    }
}

/// `--once` / non-terminal output for one backup.
pub fn table(
    s: &Summary,
    items: &[Item],
    namespace: &str,
    window: Duration,
    now: SystemTime,
) -> String {
    let mut out = summary_block(s, namespace, window, now).join("\n");
    out.push_str("\n\n");
    out.push_str(&volume_rows(items, None, false).join("\n"));
    out.push('\n');
    out
}

/// One line for `--watch`: the whole in one line. A stall is told by its threshold, not its
/// length, so the line changes when the figures do, not every second.
pub fn watch_line(s: &Summary, settings: &Settings) -> String {
    let rate = if s.stalled_seconds.is_some() {
        format!(
            "stalled (no progress for {} or more)",
            humantime::format_duration(settings.stall_after)
        )
    } else {
        rate_of(s, settings.window)
    };
    let mut line = format!(
        "{} {}: {}/{} volumes done ({}), {}, rate {rate}",
        s.kind.as_str(),
        s.name,
        s.volumes.done,
        s.volumes.total,
        phases_of(s),
        bytes_of(s.bytes_done, Some(s.total_bytes), s.total_at_least),
    );
    if s.eta.is_some() || s.finished {
        line.push_str(&format!(", ETA {}", eta_of(s)));
    }
    line
}

/// `backups` / `restores`: one row per Velero backup/restore.
pub fn list_table(summaries: &[Summary], now: SystemTime) -> String {
    let Some(first) = summaries.first() else {
        return String::new();
    };
    let mut rows = vec![vec![
        first.kind.as_str().to_uppercase(),
        "VOLUMES".to_string(),
        "QUEUED".to_string(),
        "RUNNING".to_string(),
        "COMPLETED".to_string(),
        "FAILED".to_string(),
        "CANCELED".to_string(),
        "BYTES".to_string(),
        "RATE".to_string(),
        "ETA".to_string(),
        "STARTED".to_string(),
        "AGE".to_string(),
    ]];
    for s in summaries {
        let c = &s.volumes;
        let rate = match (s.stalled_seconds, s.rate_bytes_per_second) {
            (Some(_), _) => "stalled".to_string(),
            (None, Some(r)) => rate(r),
            (None, None) => "-".to_string(),
        };
        rows.push(vec![
            s.name.clone(),
            format!("{}/{}", c.done, c.total),
            c.queued.to_string(),
            c.running.to_string(),
            c.completed.to_string(),
            c.failed.to_string(),
            c.canceled.to_string(),
            bytes_of(s.bytes_done, Some(s.total_bytes), s.total_at_least),
            rate,
            eta_of(s),
            s.started
                .map(|t| humantime::format_rfc3339_seconds(t).to_string())
                .unwrap_or_else(|| "-".into()),
            s.created.map(|t| ago(t, now)).unwrap_or_else(|| "-".into()),
        ]);
    }
    let mut out = columns(&rows, None).join("\n");
    out.push('\n');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_rates_bars_and_cuts() {
        assert_eq!(bytes_of(1536, Some(3072), false), "1.5 KiB of 3.0 KiB");
        assert_eq!(
            bytes_of(1536, Some(3072), true),
            "1.5 KiB of at least 3.0 KiB"
        );
        assert_eq!(bytes_of(10, None, false), "10 B of ?");
        assert_eq!(rate(1_048_576.4), "1.0 MiB/s");
        assert_eq!(bar(Some(0.5), 4), "[██░░]");
        assert_eq!(bar(Some(1.7), 2), "[██]");
        assert_eq!(bar(None, 3), "[···]");
        assert_eq!(cut("héllo", 3), "hé…");
        assert_eq!(cut("ok", 3), "ok");
    }

    #[test]
    fn columns_align_and_cut_the_last() {
        let rows = vec![
            vec!["A".to_string(), "BB".to_string()],
            vec!["long".to_string(), "message here".to_string()],
        ];
        assert_eq!(
            columns(&rows, None),
            vec!["A      BB", "long   message here"]
        );
        assert_eq!(columns(&rows, Some(12)), vec!["A      BB", "long   mess…"]);
    }
}
