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
    /// Set when the cancel token fired while the child was running, i.e. we sent it SIGINT. A
    /// cancel requested after the child had exited on its own leaves this `None`.
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
    // ETXTBSY: the program is open for writing somewhere (being copied into place, or a write
    // handle inherited by another thread's fork for the moment before its exec). It clears by
    // itself; a few short retries turn it from a failed transfer into a delay of milliseconds.
    let mut busy_retries = 0;
    let mut child = loop {
        match cmd.spawn() {
            Err(e) if e.kind() == std::io::ErrorKind::ExecutableFileBusy && busy_retries < 20 => {
                busy_retries += 1;
                tokio::time::sleep(Duration::from_millis(10 * busy_retries)).await;
            }
            r => {
                break r.map_err(|source| Error::Spawn {
                    program: spec.program.display().to_string(),
                    source,
                })?;
            }
        }
    };
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
                // The uploader may have exited on its own a moment ago without `wait` having
                // reported it yet: then there is nothing to stop, and its own outcome stands.
                match child.try_wait() {
                    Ok(Some(s)) => {
                        tracing::info!(pid, "cancel requested after the uploader had already exited");
                        status = Some(s);
                        linger_until = Some(Instant::now() + PIPE_LINGER);
                    }
                    _ => {
                        tracing::info!(pid, "stopping uploader: SIGINT to its process group");
                        signal_group(pgid, Signal::SIGINT);
                        stop = Some(StopKind::Graceful);
                        kill_at = Some(Instant::now() + grace);
                    }
                }
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
    /// The last stderr lines (ANSI stripped), up to [`CAPTURED_STDERR_BYTES`] in all: the end is
    /// kept because that is where restic prints its `Fatal:` line, after any retries.
    pub stderr: Vec<String>,
}

/// How much of a captured command's stderr is kept (its last lines).
pub const CAPTURED_STDERR_BYTES: usize = 64 * 1024;
/// The longest stderr line kept by [`capture`]; longer ones are cut.
const CAPTURED_STDERR_LINE_BYTES: usize = 4 * 1024;

/// The last lines of a stream, at most `cap` bytes in all.
#[derive(Debug)]
struct LineTail {
    lines: std::collections::VecDeque<String>,
    bytes: usize,
    cap: usize,
}

impl LineTail {
    fn new(cap: usize) -> Self {
        Self {
            lines: std::collections::VecDeque::new(),
            bytes: 0,
            cap,
        }
    }

    fn push(&mut self, line: String) {
        let line = crate::text::truncate(&line, CAPTURED_STDERR_LINE_BYTES.min(self.cap));
        self.bytes += line.len();
        self.lines.push_back(line);
        while self.bytes > self.cap {
            match self.lines.pop_front() {
                Some(old) => self.bytes -= old.len(),
                None => break,
            }
        }
    }

    fn into_vec(self) -> Vec<String> {
        self.lines.into()
    }
}

/// Runs a short command and keeps (bounded) output. Cancelable like [`run`].
pub async fn capture(
    spec: &ChildSpec,
    cancel: &CancellationToken,
    grace: Duration,
) -> Result<Captured> {
    const CAP: usize = 4 << 20;
    let mut stdout = Vec::new();
    let mut stderr = LineTail::new(CAPTURED_STDERR_BYTES);
    let exit = run(spec, cancel, grace, &mut |stream, frame| {
        if let Frame::Line(l) = frame {
            match stream {
                Stream::Stdout if stdout.len() + l.len() < CAP => {
                    if !stdout.is_empty() {
                        stdout.push(b'\n');
                    }
                    stdout.extend_from_slice(l);
                }
                Stream::Stdout => {}
                Stream::Stderr => stderr.push(crate::text::clean_line(l)),
            }
        }
    })
    .await?;
    Ok(Captured {
        exit: exit.exit,
        stdout,
        stderr: stderr.into_vec(),
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

    fn script(dir: &std::path::Path, body: &str) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let path = dir.join("fake-uploader");
        std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path
    }

    #[tokio::test]
    async fn capture_keeps_the_fatal_line_printed_after_many_retry_lines() {
        let dir = tempfile::tempdir().unwrap();
        // 1000 numbered lines of 200 bytes (199 + newline): 200 KB of retries, then the cause.
        let prog = script(
            dir.path(),
            r#"i=0
while [ $i -lt 1000 ]; do
  printf 'Save(<data/%04d>) returned error, retrying after 1s: %0146d\n' $i 0 >&2
  i=$((i+1))
done
echo 'Fatal: wrong password or no key found' >&2
exit 1"#,
        );
        let c = capture(
            &ChildSpec::new(&prog, Vec::new()),
            &CancellationToken::new(),
            Duration::from_secs(5),
        )
        .await
        .unwrap();
        assert_eq!(c.exit.code, Some(1));
        assert_eq!(
            c.stderr.last().map(String::as_str),
            Some("Fatal: wrong password or no key found")
        );
        // What is kept is the end: the retry line just before the cause, not the first ones.
        let n = c.stderr.len();
        assert!(n > 100 && n < 1000, "{n} lines kept");
        assert_eq!(c.stderr[n - 2].len(), 199);
        assert!(
            c.stderr[n - 2].starts_with("Save(<data/0999>)"),
            "{:?}",
            c.stderr[n - 2]
        );
        assert!(
            c.stderr[0].starts_with(&format!("Save(<data/{:04}>)", 1001 - n)),
            "{:?}",
            c.stderr[0]
        );
        let kept: usize = c.stderr.iter().map(String::len).sum();
        assert!(kept <= CAPTURED_STDERR_BYTES, "{kept} bytes kept");
    }

    #[tokio::test]
    async fn a_program_briefly_open_for_writing_is_started_once_it_is_closed() {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let dir = tempfile::tempdir().unwrap();
        let prog = dir.path().join("being-written");
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o755)
            .open(&prog)
            .unwrap();
        f.write_all(b"#!/bin/sh\necho started\n").unwrap();
        // Open for writing while the spawn is tried: ETXTBSY until it is closed.
        let writer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            drop(f);
        });
        let c = capture(
            &ChildSpec::new(&prog, Vec::new()),
            &CancellationToken::new(),
            Duration::from_secs(5),
        )
        .await
        .unwrap();
        writer.join().unwrap();
        assert_eq!(c.exit.code, Some(0));
        assert_eq!(c.stdout, b"started");
    }

    #[tokio::test]
    async fn a_cancel_after_the_child_exited_on_its_own_is_no_stop() {
        let dir = tempfile::tempdir().unwrap();
        let marker = dir.path().join("exited");
        // Exits 3 at once; a background subshell notes when the leader is gone (reaped), then
        // keeps the pipes open for a second.
        let prog = script(
            dir.path(),
            &format!(
                "(while kill -0 $$ 2>/dev/null; do sleep 0.01; done; touch '{}'; sleep 1) &\nexit 3",
                marker.display()
            ),
        );
        let cancel = CancellationToken::new();
        let canceller = {
            let cancel = cancel.clone();
            let marker = marker.clone();
            tokio::spawn(async move {
                while !marker.exists() {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                cancel.cancel();
            })
        };
        let exit = run(
            &ChildSpec::new(&prog, Vec::new()),
            &cancel,
            Duration::from_secs(5),
            &mut |_, _| {},
        )
        .await
        .unwrap();
        canceller.await.unwrap();
        assert!(cancel.is_cancelled());
        assert_eq!(exit.exit.code, Some(3));
        assert_eq!(
            exit.stop, None,
            "no stop was sent to a child that had exited"
        );
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
