//! Runs an uploader as a child process in its own process group and drains both of its pipes.
//!
//! Why a process group: restic may start helpers (an rclone or ssh backend) and a shell wrapper may
//! stand between us and the uploader. Signals go to the whole group so nothing outlives a stop, and
//! terminal signals (Ctrl-C) reach us, not the uploader, so we decide how it is stopped.
//!
//! Both pipes are read in one loop for the whole run. A child blocked on a full stderr pipe while
//! we wait on stdout would hang forever; reading both, always, makes that impossible.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::io::AsyncReadExt;
use tokio::process::Command;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::error::{Error, Result};
use crate::framing::{Frame, Framer, Separators};
use crate::uploader::{ExitInfo, Stream};

/// A fully specified child process. Built as argv, never through a shell.
#[derive(Debug, Clone)]
pub struct ChildSpec {
    pub program: PathBuf,
    pub args: Vec<OsString>,
    /// Added to (or replacing) the inherited environment.
    pub env: Vec<(OsString, OsString)>,
    /// Removed from the inherited environment (variables that would override ours).
    pub env_remove: Vec<&'static str>,
    pub cwd: Option<PathBuf>,
    pub stdout_separators: Separators,
    pub stderr_separators: Separators,
    pub max_frame: usize,
    /// Receives the child's pid once it runs (for measurements from `/proc`).
    pub pid_cell: Option<Arc<AtomicU32>>,
    /// Where running children are recorded (one file per process group), so that a restarted
    /// agent can stop uploaders a killed predecessor left behind.
    pub record_dir: Option<PathBuf>,
}

impl ChildSpec {
    pub fn new(program: impl Into<PathBuf>, args: Vec<OsString>) -> Self {
        Self {
            program: program.into(),
            args,
            env: Vec::new(),
            env_remove: Vec::new(),
            cwd: None,
            stdout_separators: Separators::Newline,
            stderr_separators: Separators::Newline,
            max_frame: crate::framing::DEFAULT_MAX_FRAME,
            pid_cell: None,
            record_dir: None,
        }
    }

    /// argv for logs: the program and its arguments. Secrets never travel in argv, so this is
    /// safe to log; the environment is not logged.
    pub fn display_argv(&self) -> String {
        let mut s = self.program.display().to_string();
        for a in &self.args {
            s.push(' ');
            s.push_str(&a.to_string_lossy());
        }
        s
    }
}

/// How the stop went, when one was requested.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopKind {
    /// The uploader exited within the grace period after SIGINT.
    Graceful,
    /// SIGKILL was needed.
    Killed,
}

#[derive(Debug, Clone)]
pub struct ChildExit {
    pub exit: ExitInfo,
    /// Set when the cancel token fired while the child was running.
    pub stop: Option<StopKind>,
    pub truncated_frames: u64,
    pub pid: u32,
}

/// Signals a whole process group, ignoring "no such process".
fn signal_group(pgid: Pid, sig: Signal) {
    let _ = killpg(pgid, sig);
}

/// Members of a process group that are still running. A zombie is dead for our purpose: it holds
/// no resources but a table slot, and its parent (us, or init for orphans) reaps it.
pub fn live_group_members(pgid: u32) -> Vec<u32> {
    // Fast path: no member at all, zombie or not.
    if killpg(Pid::from_raw(pgid as i32), None).is_err() {
        return Vec::new();
    }
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut live = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // Fields after the command name (which may contain spaces and parentheses).
        let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
            continue;
        };
        let mut fields = rest.split_whitespace();
        let state = fields.next();
        let _ppid = fields.next();
        let pgrp = fields.next().and_then(|p| p.parse::<u32>().ok());
        if pgrp == Some(pgid) && state != Some("Z") && state != Some("X") {
            live.push(pid);
        }
    }
    live
}

/// Kills what is left of a group and waits (bounded) until no member runs.
async fn reap_group(pgid: u32) {
    let pg = Pid::from_raw(pgid as i32);
    if live_group_members(pgid).is_empty() {
        return;
    }
    signal_group(pg, Signal::SIGKILL);
    let deadline = Instant::now() + Duration::from_secs(5);
    while !live_group_members(pgid).is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let left = live_group_members(pgid);
    if !left.is_empty() {
        tracing::error!(
            pgid,
            ?left,
            "processes of the uploader's group survived SIGKILL"
        );
    }
}

/// Kills the group if the run is abandoned (its future dropped, a panic), so no uploader outlives
/// the operation that started it.
struct GroupGuard {
    pgid: Option<u32>,
}

impl Drop for GroupGuard {
    fn drop(&mut self) {
        if let Some(pgid) = self.pgid {
            signal_group(Pid::from_raw(pgid as i32), Signal::SIGKILL);
        }
    }
}

/// After the uploader itself exits, how long its pipes may stay open (held by a straggling
/// grandchild) before the group is killed.
const PIPE_LINGER: Duration = Duration::from_secs(2);

/// Runs `spec` to its end. Every frame of both pipes goes to `on_frame`, in arrival order per
/// stream. When `cancel` fires, the group gets SIGINT, then SIGKILL after `grace`. When this
/// returns, no process of the group is running.
pub async fn run(
    spec: &ChildSpec,
    cancel: &CancellationToken,
    grace: Duration,
    on_frame: &mut (dyn FnMut(Stream, Frame<'_>) + Send),
) -> Result<ChildExit> {
    let mut cmd = Command::new(&spec.program);
    cmd.args(&spec.args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    for k in &spec.env_remove {
        cmd.env_remove(k);
    }
    for (k, v) in &spec.env {
        cmd.env(k, v);
    }
    if let Some(dir) = &spec.cwd {
        cmd.current_dir(dir);
    }
    let mut child = cmd.spawn().map_err(|source| Error::Spawn {
        program: spec.program.display().to_string(),
        source,
    })?;
    let pid = child.id().expect("a just-spawned child has a pid");
    let pgid = Pid::from_raw(pid as i32);
    let mut guard = GroupGuard { pgid: Some(pid) };
    if let Some(cell) = &spec.pid_cell {
        cell.store(pid, Ordering::Relaxed);
    }
    let record = spec.record_dir.as_ref().map(|d| d.join(pid.to_string()));
    if let Some(r) = &record {
        // The leader's start time identifies it: a later process reusing the pid has another.
        let started = process_start_time(pid).unwrap_or_default();
        if let Err(e) = std::fs::create_dir_all(r.parent().unwrap_or(r))
            .and_then(|_| std::fs::write(r, started))
        {
            tracing::warn!(error = %e, "cannot record the uploader's process group");
        }
    }
    tracing::debug!(pid, argv = %spec.display_argv(), "uploader started");

    let mut stdout = child.stdout.take().expect("stdout is piped");
    let mut stderr = child.stderr.take().expect("stderr is piped");
    let mut out_framer = Framer::new(spec.stdout_separators, spec.max_frame);
    let mut err_framer = Framer::new(spec.stderr_separators, spec.max_frame);
    let mut out_buf = vec![0u8; 64 * 1024];
    let mut err_buf = vec![0u8; 16 * 1024];
    let (mut out_open, mut err_open) = (true, true);
    let mut status: Option<std::process::ExitStatus> = None;
    let mut stop: Option<StopKind> = None;
    let mut kill_at: Option<Instant> = None;
    let mut linger_until: Option<Instant> = None;

    loop {
        if status.is_some() && !out_open && !err_open {
            break;
        }
        let kill_deadline = kill_at.unwrap_or_else(|| Instant::now() + Duration::from_secs(86_400));
        let linger_deadline =
            linger_until.unwrap_or_else(|| Instant::now() + Duration::from_secs(86_400));
        tokio::select! {
            r = stdout.read(&mut out_buf), if out_open => match r {
                Ok(0) | Err(_) => {
                    out_framer.finish(&mut |f| on_frame(Stream::Stdout, f));
                    out_open = false;
                }
                Ok(n) => out_framer.push(&out_buf[..n], &mut |f| on_frame(Stream::Stdout, f)),
            },
            r = stderr.read(&mut err_buf), if err_open => match r {
                Ok(0) | Err(_) => {
                    err_framer.finish(&mut |f| on_frame(Stream::Stderr, f));
                    err_open = false;
                }
                Ok(n) => err_framer.push(&err_buf[..n], &mut |f| on_frame(Stream::Stderr, f)),
            },
            s = child.wait(), if status.is_none() => {
                let s = s.map_err(|source| Error::Io { what: "waiting for", path: spec.program.clone(), source })?;
                status = Some(s);
                linger_until = Some(Instant::now() + PIPE_LINGER);
            }
            _ = cancel.cancelled(), if stop.is_none() && status.is_none() => {
                tracing::info!(pid, "stopping uploader: SIGINT to its process group");
                signal_group(pgid, Signal::SIGINT);
                stop = Some(StopKind::Graceful);
                kill_at = Some(Instant::now() + grace);
            }
            _ = tokio::time::sleep_until(kill_deadline), if kill_at.is_some() && status.is_none() => {
                tracing::warn!(pid, grace = ?grace, "uploader still running after the grace period: SIGKILL");
                signal_group(pgid, Signal::SIGKILL);
                stop = Some(StopKind::Killed);
                kill_at = None;
            }
            _ = tokio::time::sleep_until(linger_deadline), if linger_until.is_some() => {
                // The uploader is gone but something of its group still holds the pipes.
                tracing::warn!(pid, "uploader exited but its process group kept the pipes open: killing the group");
                signal_group(pgid, Signal::SIGKILL);
                linger_until = None;
                out_framer.finish(&mut |f| on_frame(Stream::Stdout, f));
                err_framer.finish(&mut |f| on_frame(Stream::Stderr, f));
                out_open = false;
                err_open = false;
            }
        }
    }

    reap_group(pid).await;
    guard.pgid = None;
    if let Some(r) = &record {
        let _ = std::fs::remove_file(r);
    }
    let status = status.expect("loop ends only after the child exited");
    Ok(ChildExit {
        exit: ExitInfo::from_status(status),
        stop,
        truncated_frames: out_framer.truncated_frames() + err_framer.truncated_frames(),
        pid,
    })
}

/// Start time of a process (field 22 of `/proc/<pid>/stat`, clock ticks since boot).
fn process_start_time(pid: u32) -> Option<String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    // After the command: state is field 3, so start time (field 22) is the 20th here.
    rest.split_whitespace().nth(19).map(str::to_string)
}

/// Stops process groups recorded in `dir` by a previous agent that died without stopping them
/// (SIGKILL, OOM). A recorded group is killed only if its leader is the very process recorded
/// (same start time), so a reused pid is never hit.
pub async fn kill_recorded(dir: &std::path::Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let path = e.path();
        let Some(pgid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let recorded = std::fs::read_to_string(&path).unwrap_or_default();
        let leader_matches =
            !recorded.is_empty() && process_start_time(pgid).as_deref() == Some(recorded.trim());
        if leader_matches && !live_group_members(pgid).is_empty() {
            tracing::warn!(
                pgid,
                "stopping an uploader left running by a previous agent"
            );
            reap_group(pgid).await;
        }
        let _ = std::fs::remove_file(&path);
    }
}

/// Output of a short command whose stdout is one document (`version`, `stats --json`).
#[derive(Debug, Clone)]
pub struct Captured {
    pub exit: ExitInfo,
    /// stdout records joined with `\n`, up to a cap.
    pub stdout: Vec<u8>,
    /// stderr lines (ANSI stripped), up to a cap.
    pub stderr: Vec<String>,
}

/// Runs a short command and keeps (bounded) output. Cancelable like [`run`].
pub async fn capture(
    spec: &ChildSpec,
    cancel: &CancellationToken,
    grace: Duration,
) -> Result<Captured> {
    const CAP: usize = 4 << 20;
    let mut stdout = Vec::new();
    let mut stderr = Vec::new();
    let mut stderr_bytes = 0usize;
    let exit = run(spec, cancel, grace, &mut |stream, frame| {
        if let Frame::Line(l) = frame {
            match stream {
                Stream::Stdout if stdout.len() + l.len() < CAP => {
                    if !stdout.is_empty() {
                        stdout.push(b'\n');
                    }
                    stdout.extend_from_slice(l);
                }
                Stream::Stderr if stderr_bytes + l.len() < 64 * 1024 => {
                    stderr_bytes += l.len();
                    stderr.push(crate::text::clean_line(l));
                }
                _ => {}
            }
        }
    })
    .await?;
    Ok(Captured {
        exit: exit.exit,
        stdout,
        stderr,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::CommandExt;

    fn spawn_group_leader() -> std::process::Child {
        std::process::Command::new("sleep")
            .arg("300")
            .process_group(0)
            .spawn()
            .unwrap()
    }

    fn running(child: &mut std::process::Child) -> bool {
        // Reaping is our job here (we are the parent): a zombie counts as gone.
        child.try_wait().unwrap().is_none()
    }

    #[tokio::test]
    async fn kill_recorded_stops_the_recorded_process_and_spares_a_reused_pid() {
        let dir = tempfile::tempdir().unwrap();
        // A group recorded with its leader's real start time: stopped.
        let mut orphan = spawn_group_leader();
        let pid = orphan.id();
        std::fs::write(
            dir.path().join(pid.to_string()),
            process_start_time(pid).unwrap(),
        )
        .unwrap();
        // A group whose record carries another start time (the pid was reused): untouched.
        let mut other = spawn_group_leader();
        std::fs::write(dir.path().join(other.id().to_string()), "1").unwrap();
        kill_recorded(dir.path()).await;
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while running(&mut orphan) && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(!running(&mut orphan), "the recorded uploader survived");
        assert!(
            running(&mut other),
            "a process with a reused pid was killed"
        );
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            0,
            "records are consumed"
        );
        other.kill().unwrap();
        other.wait().unwrap();
    }
}
