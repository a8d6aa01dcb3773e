//! Case 7: the kopia rows beside the restic ones, with the real kopia binary.
//!
//! (a) Overhead: the agent's one-shot backup against the very commands it runs, run bare by a
//!     shell (`kopia repository connect filesystem` then `kopia snapshot create --json
//!     --json-verbose --progress --no-auto-maintenance`, with the environment the agent gives
//!     kopia), into a fresh copy of an empty repository each run; rounds alternate the order.
//! (b) Progress age: a live engine backup; every change of the operation's progress (each kopia
//!     progress line, parsed) is recorded with its time, and the agent's status writer
//!     (`progress::WriteSchedule`: a newer value at once when the last write is an interval
//!     old, else an interval after it) is applied to that timeline on a 10 ms grid at 1 s and
//!     10 s. Age = how long the published value has been behind the newest one kopia printed.
//! (c) Cancel latency: `Operation::cancel()` on a running kopia backup until its process group
//!     is gone and until `cancel()` returns (kopia's SIGINT first saves a partial snapshot).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use podvolume_agent::engine::{BackupRequest, Engine, EngineConfig};
use podvolume_agent::progress::WriteSchedule;
use podvolume_agent::uploader::restic::BackupOptions;
use podvolume_agent::uploader::{OutcomeKind, RepositoryAccess, UploaderKind};

use crate::cancel::cancel_timed;
use crate::overhead::{Sample, measure};
use crate::util::{fmt, fresh_copy, gen_large, gen_small, max, median, mib, percentile};

pub struct Options<'a> {
    pub kopia: &'a Path,
    pub agent: &'a Path,
    pub work: &'a Path,
    pub runs: usize,
    pub cancel_runs: usize,
    pub quick: bool,
}

const PASSWORD: &str = "benchmark password";
const GRID: Duration = Duration::from_millis(10);

/// A fresh, empty kopia repository per run: a copy of one made once.
struct Repos {
    dir: PathBuf,
    template: PathBuf,
    password_file: PathBuf,
    n: u32,
}

impl Repos {
    fn new(kopia: &Path, dir: &Path) -> Repos {
        std::fs::create_dir_all(dir).unwrap();
        let password_file = dir.join("password");
        std::fs::write(&password_file, format!("{PASSWORD}\n")).unwrap();
        let template = dir.join("kopia-template");
        let _ = std::fs::remove_dir_all(&template);
        let init = dir.join("kopia-init");
        let out = kopia_env(Command::new(kopia), &init)
            .args(["repository", "create", "filesystem", "--path"])
            .arg(&template)
            .arg(format!(
                "--cache-directory={}",
                init.join("cache").display()
            ))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "kopia repository create: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Repos {
            dir: dir.to_path_buf(),
            template,
            password_file,
            n: 0,
        }
    }

    /// (repository, cache dir) fresh for one run.
    fn fresh(&mut self) -> (PathBuf, PathBuf) {
        self.n += 1;
        fresh_copy(&self.template, &self.dir, &format!("kopia-{}", self.n))
    }

    fn drop(&self, repo: &Path, cache: &Path) {
        let _ = std::fs::remove_dir_all(repo);
        let _ = std::fs::remove_dir_all(cache);
    }
}

/// The environment the agent gives kopia (`uploader::kopia::base`), its config under `dir`.
fn kopia_env(mut c: Command, dir: &Path) -> Command {
    c.env("KOPIA_PASSWORD", PASSWORD)
        .env("KOPIA_CONFIG_PATH", dir.join("repository.config"))
        .env("KOPIA_LOG_DIR", dir.join("logs"))
        .env("KOPIA_PERSIST_CREDENTIALS_ON_CONNECT", "false")
        .env("KOPIA_USE_KEYRING", "false")
        .env("KOPIA_CHECK_FOR_UPDATES", "false")
        .env("KOPIA_DISABLE_COLOR", "true");
    c
}

/// Both kopia commands are children of the shell (no `exec`), as under the agent, so the peak
/// RSS taken is the larger of the two either way.
fn bare(kopia: &Path, repo: &Path, cache: &Path, data: &Path) -> Command {
    let dir = cache.join("kopia");
    let mut c = kopia_env(Command::new("sh"), &dir);
    c.arg("-c")
        .arg(
            r#""$0" repository connect filesystem --path="$1" --cache-directory="$2" >/dev/null &&
               cd "$3" && "$0" snapshot create --json --json-verbose --progress --no-auto-maintenance "$3""#,
        )
        .arg(kopia)
        .arg(repo)
        .arg(dir.join("cache"))
        .arg(data);
    c
}

fn agent(o: &Options, password_file: &Path, repo: &Path, cache: &Path, data: &Path) -> Command {
    let mut c = Command::new(o.agent);
    for (k, _) in std::env::vars_os() {
        let k2 = k.to_string_lossy();
        if k2.starts_with("KOPIA_") || k2.starts_with("PODVOLUME_") || k2 == "RUST_LOG" {
            c.env_remove(&k);
        }
    }
    c.args(["backup", "--json", "--no-init", "--uploader=kopia"])
        .arg(format!("--kopia-binary={}", o.kopia.display()))
        .arg("--repo")
        .arg(repo)
        .arg("--password-file")
        .arg(password_file)
        .arg("--cache-dir")
        .arg(cache)
        .arg(data);
    c
}

struct DataSet {
    name: String,
    dir: PathBuf,
}

fn data_sets(work: &Path, quick: bool) -> Vec<DataSet> {
    let (lcount, lsize, scount) = if quick {
        (2, 16u64 << 20, 500)
    } else {
        (2, 256u64 << 20, 5_000)
    };
    let large = work.join(format!("kopia-data-large-{lcount}x{}", lsize >> 20));
    let bytes = gen_large(&large, lcount, lsize, 71);
    let small = work.join(format!("kopia-data-small-{scount}"));
    let sbytes = gen_small(&small, scount, 4096, 72);
    vec![
        DataSet {
            name: format!(
                "(a) {lcount} files x {} MiB ({} MiB)",
                lsize >> 20,
                fmt(mib(bytes))
            ),
            dir: large,
        },
        DataSet {
            name: format!("(b) {scount} small files ({} MiB)", fmt(mib(sbytes))),
            dir: small,
        },
    ]
}

fn ratio3(x: f64) -> String {
    format!("{x:.3}")
}

fn med(samples: &[Sample], f: fn(&Sample) -> f64) -> f64 {
    median(&samples.iter().map(f).collect::<Vec<_>>())
}

fn overhead(o: &Options, repos: &mut Repos, md: &mut String) {
    md.push_str(&format!(
        "### 7a. Overhead over bare kopia\n\n*kopia*: the two commands the agent runs (`kopia \
         repository connect filesystem`, then `kopia snapshot create --json --json-verbose \
         --progress --no-auto-maintenance`) run bare from `sh`, with the agent's environment for \
         kopia; *agent*: `podvolume-agent backup --uploader=kopia --json --no-init` (release \
         build; it also runs `kopia --version` once). A fresh copy of an empty repository each \
         run, {} rounds alternating the order, medians. CPU: user+system of everything waited \
         for; *agent's own*: the agent process alone (from its final `/proc/<pid>/stat`); *1 + \
         own/kopia*: the agent's cost over the kopia it ran, in the same run. Peak RSS: \
         `VmHWM`.\n\n",
        o.runs
    ));
    md.push_str(
        "| data | variant | wall s | CPU s | wall ratio vs kopia | CPU ratio vs kopia | agent's own CPU s | 1 + own/kopia | agent peak RSS MiB | kopia peak RSS MiB |\n\
         |---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for set in data_sets(o.work, o.quick) {
        let mut kopia_s = Vec::new();
        let mut agent_s = Vec::new();
        for round in 0..o.runs {
            for which in [round % 2, 1 - round % 2] {
                let (repo, cache) = repos.fresh();
                if which == 0 {
                    kopia_s.push(measure(bare(o.kopia, &repo, &cache, &set.dir), "kopia"));
                } else {
                    let c = agent(o, &repos.password_file, &repo, &cache, &set.dir);
                    agent_s.push(measure(c, "agent"));
                }
                repos.drop(&repo, &cache);
            }
        }
        let (kw, kc) = (med(&kopia_s, |s| s.wall), med(&kopia_s, |s| s.cpu));
        let kh = med(&kopia_s, |s| s.uploader_hwm) / 1024.0;
        md.push_str(&format!(
            "| {} | kopia | {} | {} | 1.00 | 1.00 | - | - | - | {} |\n",
            set.name,
            fmt(kw),
            fmt(kc),
            fmt(kh)
        ));
        let (aw, ac) = (med(&agent_s, |s| s.wall), med(&agent_s, |s| s.cpu));
        let own = med(&agent_s, |s| s.own_cpu);
        let waited = med(&agent_s, |s| s.waited_cpu);
        md.push_str(&format!(
            "| {} | agent | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            set.name,
            fmt(aw),
            fmt(ac),
            fmt(aw / kw),
            fmt(ac / kc),
            fmt(own),
            ratio3(1.0 + own / waited.max(0.01)),
            fmt(med(&agent_s, |s| s.top_hwm) / 1024.0),
            fmt(med(&agent_s, |s| s.uploader_hwm) / 1024.0)
        ));
    }
    md.push('\n');
}

fn engine(kopia: &Path, interval: Duration) -> Arc<Engine> {
    Engine::new(EngineConfig {
        kopia_binary: kopia.to_path_buf(),
        restic_binary: "/nonexistent/restic".into(),
        update_interval: interval,
        cancel_grace: Duration::from_secs(60),
        init_missing_repository: false,
        lock_wait: Duration::ZERO,
        ..EngineConfig::default()
    })
}

fn request(repos: &Repos, repo: &Path, cache: &Path, source: &Path) -> BackupRequest {
    BackupRequest {
        uploader: UploaderKind::Kopia,
        access: RepositoryAccess {
            repository: repo.display().to_string(),
            password_file: repos.password_file.clone(),
            cache_dir: cache.to_path_buf(),
            ..Default::default()
        },
        source: source.to_path_buf(),
        options: BackupOptions::default(),
    }
}

/// The writes the status writer makes at `interval` of a timeline of (time, value) changes,
/// on the 10 ms grid.
fn writes(timeline: &[(Duration, u64)], interval: Duration, end: Duration) -> Vec<(Duration, u64)> {
    let base = Instant::now();
    let mut schedule = WriteSchedule::new(interval);
    let mut out = Vec::new();
    let mut published: Option<u64> = None;
    let mut g = timeline.first().map(|t| t.0).unwrap_or_default();
    while g <= end {
        let newest = newest(timeline, g);
        if published != Some(newest) && schedule.due(base + g) <= base + g {
            schedule.wrote(base + g);
            published = Some(newest);
            out.push((g, newest));
        }
        g += GRID;
    }
    out
}

fn newest(timeline: &[(Duration, u64)], t: Duration) -> u64 {
    let i = timeline.partition_point(|s| s.0 <= t);
    if i == 0 { 0 } else { timeline[i - 1].1 }
}

/// Ages (s) on the grid: 0 while the published value is the newest kopia printed, else how long
/// ago kopia first printed more than it.
fn ages(timeline: &[(Duration, u64)], writes: &[(Duration, u64)], end: Duration) -> Vec<f64> {
    let mut out = Vec::new();
    let mut g = timeline.first().map(|t| t.0).unwrap_or_default();
    while g <= end {
        let published = newest(writes, g);
        let age = if published >= newest(timeline, g) {
            0.0
        } else {
            let i = timeline.partition_point(|s| s.1 <= published);
            timeline
                .get(i)
                .map_or(0.0, |s| g.saturating_sub(s.0).as_secs_f64())
        };
        out.push(age);
        g += GRID;
    }
    out
}

fn progress_age(o: &Options, repos: &mut Repos, rt: &tokio::runtime::Runtime, md: &mut String) {
    let data = o.work.join("kopia-data-age");
    let size = if o.quick { 64u64 << 20 } else { 1u64 << 30 };
    if !data.join("big-0.bin").exists() {
        gen_large(&data, 1, size, 73);
    }
    let (repo, cache) = repos.fresh();
    let engine = engine(o.kopia, Duration::from_secs(1));
    let (timeline, end) = rt.block_on(async {
        let op = engine.backup(request(repos, &repo, &cache, &data));
        let mut rx = op.subscribe();
        let t0 = Instant::now();
        let mut timeline: Vec<(Duration, u64)> = Vec::new();
        loop {
            let v = rx.borrow_and_update().n_completed;
            if timeline.last().is_none_or(|l| l.1 != v) && v > 0 {
                timeline.push((t0.elapsed(), v));
            }
            if rx.changed().await.is_err() {
                break;
            }
        }
        let outcome = op.wait().await;
        assert_eq!(outcome.kind, OutcomeKind::Success, "{outcome:?}");
        (timeline, t0.elapsed())
    });
    repos.drop(&repo, &cache);
    let gaps: Vec<f64> = timeline
        .windows(2)
        .map(|w| (w[1].0 - w[0].0).as_secs_f64())
        .collect();
    md.push_str(&format!(
        "### 7b. Progress age (live kopia timeline)\n\nOne engine backup of {} MiB into a fresh \
         repository: kopia printed {} progress values over {} s (its own interval as the agent \
         runs it: median {} s, longest {} s between two values). The status writer applied to \
         that timeline:\n\n",
        size >> 20,
        timeline.len(),
        fmt(end.as_secs_f64()),
        fmt(median(&gaps)),
        fmt(max(&gaps))
    ));
    md.push_str(
        "| interval | worst age s | p99 age s | median age s | writes | min spacing s |\n|---|---:|---:|---:|---:|---:|\n",
    );
    for interval in [Duration::from_secs(1), Duration::from_secs(10)] {
        let w = writes(&timeline, interval, end);
        let a = ages(&timeline, &w, end);
        let spacing: Vec<f64> = w
            .windows(2)
            .map(|x| (x[1].0 - x[0].0).as_secs_f64())
            .collect();
        md.push_str(&format!(
            "| {} s | {} | {} | {} | {} | {} |\n",
            interval.as_secs(),
            fmt(max(&a)),
            fmt(percentile(&a, 99.0)),
            fmt(median(&a)),
            w.len(),
            if spacing.is_empty() {
                "-".to_string()
            } else {
                fmt(spacing.iter().cloned().fold(f64::INFINITY, f64::min))
            }
        ));
    }
    md.push('\n');
}

fn cancel(o: &Options, repos: &mut Repos, rt: &tokio::runtime::Runtime, md: &mut String) {
    // A 64 GiB sparse file: kopia reads and hashes every zero, so it is surely still running.
    let data = o.work.join("kopia-data-cancel");
    std::fs::create_dir_all(&data).unwrap();
    std::fs::File::create(data.join("huge.img"))
        .unwrap()
        .set_len(64 << 30)
        .unwrap();
    let engine = engine(o.kopia, Duration::from_secs(1));
    let (mut gone_ms, mut returned_ms, mut not_canceled) = (Vec::new(), Vec::new(), 0);
    for i in 0..o.cancel_runs {
        let (repo, cache) = repos.fresh();
        let req = request(repos, &repo, &cache, &data);
        let (gone, returned, kind) =
            rt.block_on(async { cancel_timed(engine.backup(req), "kopia").await });
        if kind != OutcomeKind::Canceled {
            not_canceled += 1;
        }
        eprintln!(
            "kopia cancel run {}: group gone after {gone:?}, cancel() returned after {returned:?}",
            i + 1
        );
        gone_ms.push(gone.as_secs_f64() * 1000.0);
        returned_ms.push(returned.as_secs_f64() * 1000.0);
        repos.drop(&repo, &cache);
    }
    let _ = std::fs::remove_dir_all(&data);
    md.push_str(&format!(
        "### 7c. Cancel latency\n\nEngine API, real kopia mid-snapshot (a 64 GiB sparse file, \
         canceled 0.5 s after the first progress), fresh repository each run, {} runs. kopia's \
         first SIGINT makes it save a partial snapshot of what it has hashed and exit 0, which \
         the engine reports as canceled. Outcome other than canceled: {not_canceled}.\n\n\
         | measure | p50 ms | max ms |\n|---|---:|---:|\n\
         | `cancel()` -> process group gone | {} | {} |\n\
         | `cancel()` -> returned | {} | {} |\n\n",
        o.cancel_runs,
        fmt(median(&gone_ms)),
        fmt(max(&gone_ms)),
        fmt(median(&returned_ms)),
        fmt(max(&returned_ms))
    ));
}

pub fn run(o: &Options) -> String {
    let version = Command::new(o.kopia)
        .arg("--version")
        .output()
        .map(|out| {
            String::from_utf8_lossy(&out.stdout)
                .split_whitespace()
                .next()
                .unwrap_or("?")
                .to_string()
        })
        .unwrap_or_else(|e| panic!("{}: {e}", o.kopia.display()));
    let mut repos = Repos::new(o.kopia, o.work);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut md = format!(
        "## 7. kopia: overhead, progress age, cancel latency\n\nThe real kopia {version} on a \
         filesystem repository.\n\n"
    );
    overhead(o, &mut repos, &mut md);
    progress_age(o, &mut repos, &rt, &mut md);
    cancel(o, &mut repos, &rt, &mut md);
    md
}
