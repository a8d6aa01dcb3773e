//! `capture`: makes the backups of `testdata/restic-streams/` with the real restic and records
//! their output with timing. Each shape has its own data and a fresh repository.

use std::path::{Path, PathBuf};

use crate::stream;
use crate::util::{Work, gen_large, gen_small, restic_cmd};

struct Shape {
    name: &'static str,
    what: &'static str,
    /// Extra restic arguments before `backup`'s own.
    args: &'static [&'static str],
    make: fn(&Path),
    /// Run one backup first (not captured), then `change` the data, then the captured backup.
    change: Option<fn(&Path)>,
}

fn large(d: &Path) {
    gen_large(d, 4, 512 << 20, 11);
}
fn two_large(d: &Path) {
    gen_large(d, 2, 512 << 20, 16);
}
fn small(d: &Path) {
    gen_small(d, 40_000, 4096, 12);
}
fn mixed(d: &Path) {
    gen_large(&d.join("large"), 3, 200 << 20, 13);
    gen_small(&d.join("small"), 5_000, 4096, 14);
}
fn verbose_data(d: &Path) {
    gen_small(d, 3_000, 2048, 15);
}
fn change_some(d: &Path) {
    // Rewrite one large file and every tenth small file.
    gen_large(&d.join("large"), 1, 200 << 20, 99);
    let mut n = 0;
    for e in walk(&d.join("small")) {
        n += 1;
        if n % 10 == 0 {
            std::fs::write(&e, format!("changed {n}\n")).unwrap();
        }
    }
}

fn walk(d: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![d.to_path_buf()];
    while let Some(p) = stack.pop() {
        for e in std::fs::read_dir(&p).unwrap().flatten() {
            if e.file_type().unwrap().is_dir() {
                stack.push(e.path());
            } else {
                out.push(e.path());
            }
        }
    }
    out.sort();
    out
}

const SHAPES: &[Shape] = &[
    Shape {
        name: "large-files",
        what: "4 files x 512 MiB of random data, fresh local repository, no limit",
        args: &[],
        make: large,
        change: None,
    },
    Shape {
        name: "small-files",
        what: "40,000 files of 1 B..8 KiB (mean 4 KiB) in 400 directories, fresh local repository",
        args: &[],
        make: small,
        change: None,
    },
    Shape {
        name: "throttled-mixed",
        what: "3 x 200 MiB + 5,000 small files, fresh local repository, --limit-upload 12288 (12 MiB/s, a slow link)",
        args: &["--limit-upload", "12288"],
        make: mixed,
        change: None,
    },
    Shape {
        name: "slow-link-large",
        what: "2 files x 512 MiB of random data, fresh local repository, --limit-upload 6144 (6 MiB/s, a slow link: a three-minute backup)",
        args: &["--limit-upload", "6144"],
        make: two_large,
        change: None,
    },
    Shape {
        name: "incremental-changed",
        what: "the throttled-mixed data backed up once (not captured), then one 200 MiB file rewritten and every 10th small file changed; captured backup finds the first as parent; no limit",
        args: &[],
        make: mixed,
        change: Some(change_some),
    },
    Shape {
        name: "verbose-small",
        what: "3,000 files of 1 B..4 KiB with -v (one verbose_status line per file), fresh local repository",
        args: &["-v"],
        make: verbose_data,
        change: None,
    },
];

pub fn capture_all(restic: &Path, work_dir: &Path, out_dir: &Path, only: Option<&str>) {
    std::fs::create_dir_all(out_dir).unwrap();
    let version = std::process::Command::new(restic)
        .arg("version")
        .output()
        .unwrap();
    let version = String::from_utf8_lossy(&version.stdout).trim().to_string();
    let mut work = Work::new(work_dir, restic);
    for s in SHAPES.iter().filter(|s| only.is_none_or(|o| o == s.name)) {
        let data = work_dir.join(format!("data-{}", s.name));
        let _ = std::fs::remove_dir_all(&data);
        std::fs::create_dir_all(&data).unwrap();
        eprintln!("capture {}: generating data", s.name);
        (s.make)(&data);
        let (repo, cache) = work.fresh_repo();
        let base = |extra: &[&str]| {
            let mut argv: Vec<String> = vec![
                restic.display().to_string(),
                "--cache-dir".into(),
                cache.display().to_string(),
            ];
            argv.extend(extra.iter().map(|a| a.to_string()));
            argv.extend(
                ["backup", "--json", "--host=velero", "."]
                    .iter()
                    .map(|a| a.to_string()),
            );
            argv
        };
        if let Some(change) = s.change {
            let st = restic_cmd(restic, &repo, &work.password_file)
                .current_dir(&data)
                .args(["--cache-dir"])
                .arg(&cache)
                .args(["backup", "-q", "--host=velero", "."])
                .status()
                .unwrap();
            assert!(st.success());
            change(&data);
        }
        let argv = base(s.args);
        let env = vec![
            ("RESTIC_REPOSITORY".to_string(), repo.display().to_string()),
            (
                "RESTIC_PASSWORD_FILE".to_string(),
                work.password_file.display().to_string(),
            ),
        ];
        let comment = format!(
            "shape: {}\n{}\n{version}; RESTIC_PROGRESS_FPS unset (restic's default: 60/s asked, fewer when the CPU is busy)\n\
             argv: restic --cache-dir <cache> {}backup --json --host=velero . (cwd = the data dir)\n\
             paths: the data dir is replaced by /data in the output",
            s.name,
            s.what,
            s.args.iter().map(|a| format!("{a} ")).collect::<String>()
        );
        eprintln!("capture {}: backing up", s.name);
        let out = out_dir.join(format!("{}.stream", s.name));
        let code = stream::capture(
            &argv,
            &data,
            &env,
            &out,
            &comment,
            &[(data.display().to_string(), "/data".to_string())],
        );
        assert_eq!(code, 0, "restic backup of {} failed", s.name);
        work.drop_repo(&repo, &cache);
        let _ = std::fs::remove_dir_all(&data);
        eprintln!(
            "capture {}: {} bytes written to {}",
            s.name,
            std::fs::metadata(&out).unwrap().len(),
            out.display()
        );
    }
}
