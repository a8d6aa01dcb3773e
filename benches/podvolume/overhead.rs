//! Cases 1 and 2: the agent's cost over bare restic on the same backup, and the second backup of
//! unchanged data with and without a parent.
//!
//! Every run is timed from spawn to exit. CPU is the user+system time of everything the run
//! spawned (the child and what it waited for: restic under the agent), read from this process's
//! `cutime`/`cstime` before and after. The spawned process's own CPU and that of what it waited
//! for are read apart from its `/proc/<pid>/stat` once it has exited and before it is reaped
//! (`waitid` with `WNOWAIT` leaves the zombie's final counters readable): exact to the clock
//! tick, and in the same run, so the agent's own share is free of the run-to-run noise of
//! restic itself. Peak RSS is `VmHWM` from `/proc/<pid>/status`, read every
//! 10 ms while the process lives (the last reading before exit): the agent's own process apart
//! from restic's (restic is a separate process with its own `VmHWM`).
//!
//! restic's own CPU differs by about 10% between two identical runs on a shared 2-core machine,
//! so a CPU ratio across runs cannot resolve a 1% difference in a few runs: case 1 runs the bare
//! restic command twice per round (the second is a control) and reports each ratio with its
//! confidence interval next to the exact same-run figure.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::util::{
    Work, children_cpu, children_of, fmt, gen_large, gen_small, mean_ci95, median, mib, processes,
    restic_cmd, vm_hwm_kib,
};

#[derive(Debug, Clone, Copy)]
pub struct Sample {
    pub wall: f64,
    pub cpu: f64,
    /// CPU seconds of the spawned process itself (the agent's own, for the agent).
    pub own_cpu: f64,
    /// CPU seconds of what the spawned process waited for (restic, under the agent).
    pub waited_cpu: f64,
    /// Peak RSS (KiB) of the spawned process itself.
    pub top_hwm: f64,
    /// Peak RSS (KiB) of the largest uploader process (restic, kopia) under it (same as `top_hwm`
    /// for a bare uploader).
    pub uploader_hwm: f64,
}

pub fn measure(mut cmd: Command, label: &str) -> Sample {
    // The previous run's repository is still being written back: flush it outside the timing,
    // so no run pays for the one before it.
    nix::unistd::sync();
    cmd.stdin(Stdio::null()).stdout(Stdio::null());
    let err_file = std::env::temp_dir().join(format!("pva-bench-{}.err", std::process::id()));
    cmd.stderr(std::fs::File::create(&err_file).unwrap());
    let cpu0 = children_cpu();
    let t0 = Instant::now();
    let mut child = cmd.spawn().expect("spawn");
    let pid = child.id();
    let stop = Arc::new(AtomicBool::new(false));
    let poller = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let (mut top, mut restic) = (0u64, 0u64);
            while !stop.load(Ordering::Relaxed) {
                if let Some(h) = vm_hwm_kib(pid) {
                    top = top.max(h);
                }
                let procs = processes();
                for c in children_of(pid) {
                    if procs
                        .iter()
                        .any(|p| p.0 == c && (p.4 == "restic" || p.4 == "kopia"))
                        && let Some(h) = vm_hwm_kib(c)
                    {
                        restic = restic.max(h);
                    }
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            (top, restic)
        })
    };
    let (own_cpu, waited_cpu) = exited_cpu(pid);
    let status = child.wait().unwrap();
    let wall = t0.elapsed().as_secs_f64();
    let cpu = (children_cpu() - cpu0).as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let (top, restic) = poller.join().unwrap();
    assert!(
        status.success(),
        "{label} failed ({status}): {}",
        std::fs::read_to_string(&err_file).unwrap_or_default()
    );
    let _ = std::fs::remove_file(&err_file);
    Sample {
        wall,
        cpu,
        own_cpu,
        waited_cpu,
        top_hwm: top as f64,
        uploader_hwm: if restic > 0 { restic } else { top } as f64,
    }
}

/// Waits until `pid` (a child of this process) has exited, without reaping it, and returns its
/// own CPU seconds and those of the children it waited for, from its final `/proc/<pid>/stat`.
fn exited_cpu(pid: u32) -> (f64, f64) {
    use nix::sys::wait::{Id, WaitPidFlag, waitid};
    let pid = nix::unistd::Pid::from_raw(pid as i32);
    loop {
        match waitid(Id::Pid(pid), WaitPidFlag::WEXITED | WaitPidFlag::WNOWAIT) {
            Ok(_) => break,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => panic!("waitid: {e}"),
        }
    }
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<u64> = rest
        .split_whitespace()
        .skip(11)
        .take(4)
        .map(|x| x.parse().unwrap())
        .collect();
    // utime, stime, cutime, cstime (fields 14-17) in clock ticks of 10 ms.
    let ticks = |t: u64| t as f64 / 100.0;
    (ticks(f[0] + f[1]), ticks(f[2] + f[3]))
}

struct Ctx<'a> {
    restic: &'a Path,
    agent: &'a Path,
    password_file: PathBuf,
}

impl Ctx<'_> {
    fn restic(&self, repo: &Path, cache: &Path, data: &Path, fps: Option<&str>) -> Command {
        let mut c = restic_cmd(self.restic, repo, &self.password_file);
        if let Some(f) = fps {
            c.env("RESTIC_PROGRESS_FPS", f);
        }
        c.current_dir(data).arg("--cache-dir").arg(cache).args([
            "backup",
            "--json",
            "--host=velero",
            ".",
        ]);
        c
    }

    fn agent(&self, repo: &Path, cache: &Path, data: &Path, extra: &[String]) -> Command {
        let mut c = Command::new(self.agent);
        for (k, _) in std::env::vars_os() {
            let k2 = k.to_string_lossy();
            if k2.starts_with("RESTIC_") || k2.starts_with("PODVOLUME_") || k2 == "RUST_LOG" {
                c.env_remove(&k);
            }
        }
        c.arg("backup")
            .arg("--json")
            .arg("--no-init")
            .arg("--repo")
            .arg(repo)
            .arg("--password-file")
            .arg(&self.password_file)
            .arg("--cache-dir")
            .arg(cache)
            .arg("--restic-binary")
            .arg(self.restic)
            .args(extra)
            .arg(data);
        c
    }
}

struct DataSet {
    name: String,
    dir: PathBuf,
    bytes: u64,
    files: usize,
}

fn data_sets(work: &Path, quick: bool) -> Vec<DataSet> {
    let (lcount, lsize, scount) = if quick {
        (2, 64u64 << 20, 2_000)
    } else {
        (4, 256u64 << 20, 20_000)
    };
    let mut out = Vec::new();
    let large = work.join(format!("data-large-{lcount}x{}", lsize >> 20));
    let small = work.join(format!("data-small-{scount}"));
    let marker = |d: &Path| d.join(".complete");
    if !marker(&large).exists() {
        let _ = std::fs::remove_dir_all(&large);
        gen_large(&large, lcount, lsize, 1);
        std::fs::write(marker(&large), "").unwrap();
    }
    if !marker(&small).exists() {
        let _ = std::fs::remove_dir_all(&small);
        gen_small(&small, scount, 4096, 2);
        std::fs::write(marker(&small), "").unwrap();
    }
    let size_of = |d: &Path| {
        let mut b = 0;
        let mut stack = vec![d.to_path_buf()];
        while let Some(p) = stack.pop() {
            for e in std::fs::read_dir(&p).unwrap().flatten() {
                let m = e.metadata().unwrap();
                if m.is_dir() {
                    stack.push(e.path());
                } else {
                    b += m.len();
                }
            }
        }
        b
    };
    out.push(DataSet {
        name: format!("(a) {lcount} files x {} MiB", lsize >> 20),
        bytes: size_of(&large),
        dir: large,
        files: lcount,
    });
    out.push(DataSet {
        name: format!("(b) {scount} small files"),
        bytes: size_of(&small),
        dir: small,
        files: scount,
    });
    out
}

fn med(samples: &[Sample], f: fn(&Sample) -> f64) -> f64 {
    median(&samples.iter().map(f).collect::<Vec<_>>())
}

pub fn run(
    restic: &Path,
    agent: &Path,
    work_dir: &Path,
    runs: usize,
    cpu_runs: usize,
    quick: bool,
) -> String {
    let mut work = Work::new(work_dir, restic);
    let ctx = Ctx {
        restic,
        agent,
        password_file: work.password_file.clone(),
    };
    let sets = data_sets(work_dir, quick);
    let mut md = String::new();

    // Case 1.
    md.push_str("## 1. Overhead over bare restic\n\n");
    md.push_str(&format!(
        "The same backup into a fresh local repository (an initialised empty one, copied before \
         each run, outside the timing; `sync` before each run, so none pays for the previous \
         one's writeback), {cpu_runs} rounds, each running every variant once in rotating order; \
         medians. Data is read from the page cache (generated once, same for every run). \
         *restic*: `restic backup --json` at restic's default status rate (60/s, the rate the \
         agent asks for); *restic (control)*: the very same bare restic command again, to show \
         how far two identical restic runs differ on this machine; *agent*: `podvolume-agent \
         backup --json --no-init` (release build, which also runs `restic version` once). stdout \
         of all goes to /dev/null. Wall: spawn to exit. CPU: user+system of the process and \
         everything it waited for (agent + restic). *per-round CPU ratio*: the mean over the \
         rounds of the variant's CPU over the restic run of the same round, with its 95% \
         confidence interval (Student's t): restic's own run-to-run noise, which the control \
         measures. *agent's own*: the agent process's CPU, without restic's, read from its final \
         `/proc/<pid>/stat` (exact to the 10 ms clock tick); *1 + own/restic*: the agent's cost \
         over the restic it ran, in the same run, free of that noise. Peak RSS: `VmHWM` of each \
         process, read every 10 ms from /proc while it runs.\n\n"
    ));
    md.push_str(
        "| data | variant | wall s | CPU s | wall ratio vs restic | CPU ratio vs restic (medians) | per-round CPU ratio, mean [95% CI] | agent's own CPU s | restic CPU under the agent s | 1 + own/restic | agent peak RSS MiB | restic peak RSS MiB |\n\
         |---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|\n",
    );
    for set in &sets {
        eprintln!("overhead: {} ({} MiB)", set.name, fmt(mib(set.bytes)));
        let variants = ["restic", "agent", "restic (control)"];
        let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); variants.len()];
        for i in 0..cpu_runs {
            for k in 0..variants.len() {
                let v = (i + k) % variants.len();
                let (repo, cache) = work.fresh_repo();
                let cmd = match v {
                    1 => ctx.agent(&repo, &cache, &set.dir, &[]),
                    _ => ctx.restic(&repo, &cache, &set.dir, None),
                };
                let s = measure(cmd, variants[v]);
                eprintln!(
                    "  run {} {}: wall {:.2} s, cpu {:.2} s (own {:.2}, waited {:.2}), rss {} / {} KiB",
                    i + 1,
                    variants[v],
                    s.wall,
                    s.cpu,
                    s.own_cpu,
                    s.waited_cpu,
                    s.top_hwm,
                    s.uploader_hwm
                );
                samples[v].push(s);
                work.drop_repo(&repo, &cache);
            }
        }
        let w: Vec<f64> = samples.iter().map(|s| med(s, |x| x.wall)).collect();
        let c: Vec<f64> = samples.iter().map(|s| med(s, |x| x.cpu)).collect();
        for (v, name) in variants.iter().enumerate() {
            let per_round = if v == 0 {
                "-".to_string()
            } else {
                let ratios: Vec<f64> = samples[v]
                    .iter()
                    .zip(&samples[0])
                    .map(|(x, r)| x.cpu / r.cpu)
                    .collect();
                let (mean, half) = mean_ci95(&ratios);
                format!("{mean:.3} [{:.3}, {:.3}]", mean - half, mean + half)
            };
            let agent_cols = if v == 1 {
                let a = &samples[v];
                // The median of the per-run ratios: each is one run's agent against its restic.
                let ratio = med(a, |x| 1.0 + x.own_cpu / x.waited_cpu.max(0.01));
                format!(
                    "{} | {} | {ratio:.3} | {}",
                    fmt(med(a, |x| x.own_cpu)),
                    fmt(med(a, |x| x.waited_cpu)),
                    fmt(med(a, |x| x.top_hwm) / 1024.0),
                )
            } else {
                "- | - | - | -".into()
            };
            md.push_str(&format!(
                "| {} ({} MiB, {} files) | {name} | {} | {} | {} | {} | {per_round} | {agent_cols} | {} |\n",
                set.name,
                fmt(mib(set.bytes)),
                set.files,
                fmt(w[v]),
                fmt(c[v]),
                fmt(w[v] / w[0]),
                fmt(c[v] / c[0]),
                fmt(med(&samples[v], |x| x.uploader_hwm) / 1024.0),
            ));
        }
    }

    // Case 2.
    md.push_str("\n## 2. Incremental backup of unchanged data\n\n");
    md.push_str(&format!(
        "One first backup by the agent into a fresh repository, then {runs} runs of each variant \
         of a second backup of the same, unchanged data, alternating, into that repository \
         (`sync` before each run); medians. *parent found automatically*: no `--parent`, \
         restic picks the latest snapshot of the same host and path; *explicit `--parent`*: the first snapshot's ID; *no parent*: \
         `--host` set to a new name for each run, so restic finds no parent — what happens when \
         parent selection fails (every file is read and hashed again; nothing new is stored \
         because the chunks deduplicate).\n\n"
    ));
    md.push_str(
        "| data | variant | wall s | CPU s | wall ratio vs no parent | CPU ratio vs no parent |\n\
         |---|---|---:|---:|---:|---:|\n",
    );
    for set in &sets {
        eprintln!("incremental: {}", set.name);
        let (repo, cache) = work.fresh_repo();
        let first = Command::new(agent)
            .arg("backup")
            .arg("--no-init")
            .arg("--repo")
            .arg(&repo)
            .arg("--password-file")
            .arg(&ctx.password_file)
            .arg("--cache-dir")
            .arg(&cache)
            .arg("--restic-binary")
            .arg(restic)
            .arg(&set.dir)
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .output()
            .unwrap();
        assert!(first.status.success(), "first backup failed");
        let id = String::from_utf8_lossy(&first.stdout).trim().to_string();
        assert!(!id.is_empty(), "no snapshot ID from the first backup");
        let variants = [
            "parent found automatically",
            "explicit --parent",
            "no parent",
        ];
        let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); variants.len()];
        for i in 0..runs {
            for k in 0..variants.len() {
                let v = (i + k) % variants.len();
                let extra: Vec<String> = match v {
                    0 => vec![],
                    1 => vec![format!("--parent={id}")],
                    _ => vec![format!("--host=bench-no-parent-{i}")],
                };
                let s = measure(ctx.agent(&repo, &cache, &set.dir, &extra), variants[v]);
                eprintln!(
                    "  run {} {}: wall {:.2} s, cpu {:.2} s",
                    i + 1,
                    variants[v],
                    s.wall,
                    s.cpu
                );
                samples[v].push(s);
            }
        }
        work.drop_repo(&repo, &cache);
        let w: Vec<f64> = samples.iter().map(|s| med(s, |x| x.wall)).collect();
        let c: Vec<f64> = samples.iter().map(|s| med(s, |x| x.cpu)).collect();
        for (v, name) in variants.iter().enumerate() {
            md.push_str(&format!(
                "| {} | {name} | {} | {} | {} | {} |\n",
                set.name,
                fmt(w[v]),
                fmt(c[v]),
                fmt(w[v] / w[2]),
                fmt(c[v] / c[2]),
            ));
        }
    }
    md.push('\n');
    md
}
