//! Shared helpers: statistics, deterministic test data, /proc readings, repository templates.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// Median of the values (mean of the middle two for an even count). NaN when empty.
pub fn median(v: &[f64]) -> f64 {
    percentile(v, 50.0)
}

/// Linear-interpolated percentile (0..=100). NaN when empty.
pub fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let rank = (p / 100.0) * (s.len() - 1) as f64;
    let lo = rank.floor() as usize;
    let hi = rank.ceil() as usize;
    s[lo] + (s[hi] - s[lo]) * (rank - lo as f64)
}

/// Mean of the values and the half-width of its 95% confidence interval (Student's t, the
/// values taken as independent samples). The half-width is NaN for fewer than two values.
pub fn mean_ci95(v: &[f64]) -> (f64, f64) {
    const T975: [f64; 30] = [
        12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042,
    ];
    let n = v.len();
    let mean = v.iter().sum::<f64>() / n as f64;
    if n < 2 {
        return (mean, f64::NAN);
    }
    let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
    let t = T975.get(n - 2).copied().unwrap_or(1.96);
    (mean, t * (var / n as f64).sqrt())
}

pub fn max(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::NAN, f64::max)
}

/// splitmix64: deterministic, incompressible-looking bytes without a dependency.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
    pub fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let x = self.next_u64().to_le_bytes();
            chunk.copy_from_slice(&x[..chunk.len()]);
        }
    }
}

/// Writes `count` files of `size` random bytes (`big-<i>.bin`). Returns the bytes written.
pub fn gen_large(dir: &Path, count: usize, size: u64, seed: u64) -> u64 {
    fs::create_dir_all(dir).unwrap();
    let mut rng = Rng::new(seed);
    let mut buf = vec![0u8; 1 << 20];
    for i in 0..count {
        let mut f = fs::File::create(dir.join(format!("big-{i}.bin"))).unwrap();
        let mut left = size;
        while left > 0 {
            let n = left.min(buf.len() as u64) as usize;
            rng.fill(&mut buf[..n]);
            f.write_all(&buf[..n]).unwrap();
            left -= n as u64;
        }
    }
    count as u64 * size
}

/// Writes `count` small files (1 B .. 2*`mean` B, uniform) spread over 100 files per directory,
/// two directory levels deep. Returns the bytes written.
pub fn gen_small(dir: &Path, count: usize, mean: u64, seed: u64) -> u64 {
    let mut rng = Rng::new(seed);
    let mut buf = vec![0u8; (2 * mean) as usize + 1];
    let mut total = 0;
    for i in 0..count {
        let sub = dir
            .join(format!("d{:03}", i / 10_000))
            .join(format!("e{:03}", (i / 100) % 100));
        if i % 100 == 0 {
            fs::create_dir_all(&sub).unwrap();
        }
        let n = 1 + rng.below(2 * mean) as usize;
        rng.fill(&mut buf[..n]);
        fs::write(sub.join(format!("f{i:06}.dat")), &buf[..n]).unwrap();
        total += n as u64;
    }
    total
}

/// Sum of utime+stime of this process's waited-for children, from /proc/self/stat (USER_HZ=100
/// on Linux: /proc reports clock ticks of 10 ms).
pub fn children_cpu() -> Duration {
    let stat = fs::read_to_string("/proc/self/stat").unwrap();
    // Fields after the command name, which is in parentheses and may contain spaces.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // rest[0] is field 3 (state); cutime is field 16, cstime field 17.
    let cutime: u64 = f[13].parse().unwrap();
    let cstime: u64 = f[14].parse().unwrap();
    Duration::from_millis((cutime + cstime) * 10)
}

/// `VmHWM` (peak resident set) of a process in KiB, while it exists.
pub fn vm_hwm_kib(pid: u32) -> Option<u64> {
    let s = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}

/// (pid, ppid, pgrp, state, comm) of every process.
pub fn processes() -> Vec<(u32, u32, u32, char, String)> {
    let mut out = Vec::new();
    let Ok(dir) = fs::read_dir("/proc") else {
        return out;
    };
    for e in dir.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let comm = stat[open + 1..close].to_string();
        let f: Vec<&str> = stat[close + 2..].split_whitespace().collect();
        if f.len() < 3 {
            continue;
        }
        let state = f[0].chars().next().unwrap_or('?');
        let ppid = f[1].parse().unwrap_or(0);
        let pgrp = f[2].parse().unwrap_or(0);
        out.push((pid, ppid, pgrp, state, comm));
    }
    out
}

/// Live (non-zombie) processes of a process group.
pub fn group_alive(pgrp: u32) -> bool {
    processes()
        .iter()
        .any(|p| p.2 == pgrp && p.3 != 'Z' && p.3 != 'X')
}

/// Direct children of `pid`.
pub fn children_of(pid: u32) -> Vec<u32> {
    processes()
        .into_iter()
        .filter(|p| p.1 == pid)
        .map(|p| p.0)
        .collect()
}

/// A restic command with only the environment we give it.
pub fn restic_cmd(restic: &Path, repo: &Path, password_file: &Path) -> Command {
    let mut c = Command::new(restic);
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("RESTIC_") {
            c.env_remove(k);
        }
    }
    c.env("RESTIC_REPOSITORY", repo)
        .env("RESTIC_PASSWORD_FILE", password_file);
    c
}

/// Paths of a work area: password file and an initialised empty repository to copy from.
pub struct Work {
    pub dir: PathBuf,
    pub password_file: PathBuf,
    template: PathBuf,
    n: u32,
}

impl Work {
    pub fn new(dir: &Path, restic: &Path) -> Work {
        fs::create_dir_all(dir).unwrap();
        let password_file = dir.join("password");
        fs::write(&password_file, "benchmark password\n").unwrap();
        let template = dir.join("repo-template");
        if !template.join("config").exists() {
            let _ = fs::remove_dir_all(&template);
            let st = restic_cmd(restic, &template, &password_file)
                .args(["--cache-dir"])
                .arg(dir.join("cache-init"))
                .args(["init", "-q"])
                .status()
                .unwrap();
            assert!(st.success(), "restic init failed");
        }
        Work {
            dir: dir.to_path_buf(),
            password_file,
            template,
            n: 0,
        }
    }

    /// A fresh, initialised, empty repository (a copy of the template) and a fresh cache dir.
    pub fn fresh_repo(&mut self) -> (PathBuf, PathBuf) {
        self.n += 1;
        fresh_copy(&self.template, &self.dir, &format!("{}", self.n))
    }

    pub fn drop_repo(&self, repo: &Path, cache: &Path) {
        let _ = fs::remove_dir_all(repo);
        let _ = fs::remove_dir_all(cache);
    }
}

/// A copy of `template` at `<dir>/repo-<n>` and an empty `<dir>/cache-<n>` path, whatever an
/// earlier run left there removed first.
pub fn fresh_copy(template: &Path, dir: &Path, n: &str) -> (PathBuf, PathBuf) {
    let repo = dir.join(format!("repo-{n}"));
    let cache = dir.join(format!("cache-{n}"));
    let _ = fs::remove_dir_all(&repo);
    let _ = fs::remove_dir_all(&cache);
    let st = Command::new("cp")
        .arg("-a")
        .arg(template)
        .arg(&repo)
        .status()
        .unwrap();
    assert!(st.success(), "cp -a {}", template.display());
    (repo, cache)
}

pub fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// Formats a number with a sensible number of digits for a table.
pub fn fmt(x: f64) -> String {
    if !x.is_finite() {
        "n/a".to_string()
    } else if x.abs() >= 100.0 {
        format!("{x:.0}")
    } else if x.abs() >= 10.0 {
        format!("{x:.1}")
    } else {
        format!("{x:.2}")
    }
}
