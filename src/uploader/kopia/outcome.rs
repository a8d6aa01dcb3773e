//! What a finished kopia run means: its outcome from the exit and the text it printed, and the
//! messages the agent reports.

use super::*;

/// Text kopia prints on failures, per kind (its exit code is just 1).
const WRONG_PASSWORD: &[&str] = &["invalid repository password"];
const REPOSITORY_MISSING: &[&str] = &[
    "repository is not connected",
    "not connected to a repository",
    "unable to find repository",
    "repository not initialized",
    "cannot access storage path",
];
const SOURCE_MISSING: &[&str] = &["unable to get local filesystem entry"];

/// Classifies how a kopia run ended. `stopped`: we sent the stop signal to the running child
/// (the runner's `stop`), not merely that a cancel was requested: a run that ended on its own
/// before our stop reached it keeps its own outcome.
pub fn classify(exit: ExitInfo, facts: &RunFacts, stopped: bool, direction: Direction) -> Outcome {
    let text = facts.error_text();
    let has = |needles: &[&str]| needles.iter().any(|n| text.contains(n));
    let summary = facts.summary.as_ref();
    let incomplete = summary.and_then(|s| s.incomplete.as_deref());
    let failed_items = facts
        .failed_items
        .max(summary.map_or(0, |s| s.failed_items));
    let manifest_failed = summary.is_some_and(|s| s.failed_items > 0);
    let backup = direction == Direction::Backup;
    // `--fail-fast`: kopia stops itself at the first unreadable entry, saves what it has as
    // `incomplete: canceled` and exits 1; a signal's stop exits 0.
    let fail_fast_stop = exit.code == Some(1) && failed_items > 0;

    let kind = match (exit.code, exit.signal) {
        // A manifest marked incomplete is never a complete backup, whatever the exit code.
        _ if backup && incomplete.is_some() => {
            if stopped {
                OutcomeKind::Canceled
            } else if incomplete == Some("canceled") && !fail_fast_stop {
                OutcomeKind::Interrupted
            } else {
                OutcomeKind::Failed
            }
        }
        (Some(0), _) if backup && summary.is_none() => OutcomeKind::Failed,
        (Some(0), _) if backup && manifest_failed => OutcomeKind::Partial,
        (Some(0), _) => OutcomeKind::Success,
        // The whole snapshot was saved (a complete manifest, nothing failed) before our stop
        // reached kopia, which was finishing after it: the backup is done, and its snapshot is
        // the result. kopia's progress counts bytes hashed, which run ahead of the upload, so a
        // cancel near the end can come after the save.
        _ if backup
            && stopped
            && !manifest_failed
            && summary.is_some_and(|s| s.snapshot_id.is_some()) =>
        {
            OutcomeKind::Success
        }
        _ if stopped => OutcomeKind::Canceled,
        (None, Some(sig)) => OutcomeKind::KilledBySignal { signal: sig },
        // Saved, but some entries could not be read (`Found N fatal error(s)`, exit 1).
        _ if backup && manifest_failed => OutcomeKind::Partial,
        _ if has(WRONG_PASSWORD) => OutcomeKind::WrongPassword,
        _ if has(REPOSITORY_MISSING) => OutcomeKind::RepositoryMissing,
        _ if text.contains("repository.config") && text.contains("no such file or directory") => {
            OutcomeKind::RepositoryMissing
        }
        _ if backup && has(SOURCE_MISSING) && text.contains("no such file or directory") => {
            OutcomeKind::SourceMissing
        }
        _ => OutcomeKind::Failed,
    };

    let manifest_id = summary.and_then(|s| s.snapshot_id.clone());
    // An incomplete snapshot is not a result anyone should restore from: name it, don't return it.
    let snapshot_id = if incomplete.is_some() {
        None
    } else {
        manifest_id.clone()
    };
    let message = match &kind {
        _ if backup && incomplete.is_some() => {
            let reason = incomplete.unwrap_or_default();
            let saved = match &manifest_id {
                Some(id) => format!("kopia saved an incomplete snapshot {id}"),
                None => "kopia saved an incomplete snapshot".to_string(),
            };
            match kind {
                OutcomeKind::Canceled => format!("canceled; {saved} (incomplete: {reason})"),
                OutcomeKind::Failed if fail_fast_stop => format!(
                    "kopia stopped at the first unreadable item (fail-fast): {}; {saved} (incomplete: {reason}), which is not a result",
                    unreadable_items(failed_items, facts)
                ),
                OutcomeKind::Interrupted => format!(
                    "{saved} (incomplete: {reason}): kopia was interrupted by a signal we did not send"
                ),
                _ => format!("{saved} (incomplete: {reason})"),
            }
        }
        OutcomeKind::Success => match summary {
            Some(s) if backup => format!(
                "snapshot {} saved: {} in {} files",
                manifest_id.as_deref().unwrap_or("(no id)"),
                format_bytes(s.total_bytes),
                s.total_files
            ),
            Some(s) => restore_message(s.total_bytes, s.total_files),
            None if backup => "completed".to_string(),
            None => "restore completed".to_string(),
        },
        OutcomeKind::Partial => partial_message(snapshot_id.as_deref(), failed_items, facts),
        OutcomeKind::Canceled => "canceled".to_string(),
        OutcomeKind::Failed if exit.code == Some(0) => {
            "kopia exited 0 but printed no snapshot manifest; the snapshot cannot be confirmed"
                .to_string()
        }
        OutcomeKind::Failed if exit.code == Some(2) => facts.cause("kopia crashed (exit code 2)"),
        _ => facts.cause(&format!("kopia failed with {exit}")),
    };
    Outcome {
        kind,
        message,
        exit_code: exit.code,
        snapshot_id,
        summary: summary.map(|s| RunSummaryView {
            incremental_bytes: incremental_bytes(s, facts.last_bytes_read),
            ..RunSummaryView::from(s)
        }),
        failed_items,
        first_failed_items: facts.first_failed_items.clone(),
        truncated_frames: facts.truncated_frames,
        repository_created: false,
        incomplete_snapshot_id: if backup && incomplete.is_some() {
            manifest_id.clone()
        } else {
            None
        },
    }
}

/// The message of a successful restore of `total_bytes` in `files` files (the engine writes it
/// again once it has measured the exact size).
pub fn restore_message(total_bytes: u64, files: u64) -> String {
    format!(
        "restore completed: {} in {files} files",
        format_bytes(total_bytes)
    )
}

/// Bytes of the regular files under `root`, which is not itself followed if it is a symlink;
/// symlinks inside are neither followed nor counted. Entries that vanish during the walk are
/// skipped; any other error ends it. Blocking: run it off the async runtime.
pub fn regular_file_bytes(root: &Path) -> std::io::Result<u64> {
    use std::io::ErrorKind::NotFound;
    let mut total: u64 = 0;
    let meta = std::fs::symlink_metadata(root)?;
    if meta.is_file() {
        return Ok(meta.len());
    }
    if !meta.is_dir() {
        return Ok(0);
    }
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let entries = match std::fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == NotFound && dir != root => continue,
            Err(e) => return Err(e),
        };
        for entry in entries {
            let entry = entry?;
            // The entry's own type: a symlink is a symlink, whatever it points to.
            let file_type = match entry.file_type() {
                Ok(t) => t,
                Err(e) if e.kind() == NotFound => continue,
                Err(e) => return Err(e),
            };
            if file_type.is_dir() {
                stack.push(entry.path());
            } else if file_type.is_file() {
                match entry.metadata() {
                    Ok(m) => total = total.saturating_add(m.len()),
                    Err(e) if e.kind() == NotFound => {}
                    Err(e) => return Err(e),
                }
            }
        }
    }
    Ok(total)
}

/// "snapshot X saved, but 2 items could not be read: a (permission denied), b (...)". `failed` is
/// the larger of the manifest's `numFailed` and the errors seen on stderr.
pub fn partial_message(snapshot_id: Option<&str>, failed: u64, facts: &RunFacts) -> String {
    let saved = match snapshot_id {
        Some(id) => format!("snapshot {id} saved"),
        None => "snapshot saved".to_string(),
    };
    if failed == 0 {
        return format!("{saved}, but some source data could not be read");
    }
    format!("{saved}, but {}", unreadable_items(failed, facts))
}

/// `<N> item(s) could not be read: <cause> (first: a, b and M more)`.
fn unreadable_items(failed: u64, facts: &RunFacts) -> String {
    facts.items_summary(failed, "could not be read")
}
