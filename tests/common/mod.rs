//! Shared helpers for tests that run the real restic on real files.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use podvolume_agent::engine::{BackupRequest, Engine, EngineConfig, RestoreRequest};
use podvolume_agent::uploader::restic::BackupOptions;
use podvolume_agent::uploader::{RepositoryAccess, UploaderKind};

mod restic_under_test;
pub use restic_under_test::*;
mod kopia_under_test;
#[allow(unused_imports)]
pub use kopia_under_test::*;
mod kopia_direct;
#[allow(unused_imports)]
pub use kopia_direct::*;

/// A scratch area with a source directory, a password file and a repository path.
pub struct Bed {
    pub dir: tempfile::TempDir,
    pub source: PathBuf,
    pub repo: PathBuf,
    pub password_file: PathBuf,
    pub cache: PathBuf,
}

impl Bed {
    pub fn new() -> Self {
        let dir = tempfile::Builder::new()
            .prefix("pva-test-")
            .tempdir()
            .unwrap();
        let source = dir.path().join("source");
        std::fs::create_dir_all(&source).unwrap();
        let password_file = dir.path().join("password");
        std::fs::write(&password_file, "correct horse battery staple\n").unwrap();
        let cache = dir.path().join("cache");
        Self {
            repo: dir.path().join("repo"),
            source,
            password_file,
            cache,
            dir,
        }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    pub fn access(&self) -> RepositoryAccess {
        RepositoryAccess {
            repository: self.repo.display().to_string(),
            password_file: self.password_file.clone(),
            cache_dir: self.cache.clone(),
            extra_env: Vec::new(),
            // As the node agent connects (its default, Velero's): every kopia version under
            // test must accept the cache-limit flags on `repository connect|create`.
            kopia_cache_limit_mb: Some(5000),
            ..Default::default()
        }
    }

    pub fn access_with_password(&self, password: &str) -> RepositoryAccess {
        let f = self.path().join(format!("password-{}", password.len()));
        std::fs::write(&f, password).unwrap();
        RepositoryAccess {
            password_file: f,
            ..self.access()
        }
    }

    /// `restic init` on the repository, directly.
    pub fn init_repo(&self) {
        let out = self.restic(&["init"]);
        assert!(
            out.status.success(),
            "restic init: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Runs restic directly (not through the agent) against this bed's repository.
    pub fn restic(&self, args: &[&str]) -> std::process::Output {
        Command::new(restic_bin())
            .args(args)
            .env("RESTIC_REPOSITORY", &self.repo)
            .env("RESTIC_PASSWORD_FILE", &self.password_file)
            .env("RESTIC_CACHE_DIR", &self.cache)
            .stdin(std::process::Stdio::null())
            .output()
            .expect("restic runs")
    }

    pub fn locks(&self) -> Vec<String> {
        let out = self.restic(&["list", "locks", "--no-lock"]);
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(String::from)
            .collect()
    }

    /// Processes whose command line mentions this bed's directory (restic gets `--cache-dir`
    /// inside it), i.e. uploaders this test started.
    pub fn own_processes(&self) -> Vec<String> {
        let needle = self.path().display().to_string();
        let mut found = Vec::new();
        for e in std::fs::read_dir("/proc").unwrap().flatten() {
            let name = e.file_name();
            let Some(pid) = name.to_str().and_then(|s| s.parse::<u32>().ok()) else {
                continue;
            };
            if pid == std::process::id() {
                continue;
            }
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                continue;
            };
            let state = stat
                .rfind(')')
                .and_then(|i| stat[i + 1..].split_whitespace().next().map(String::from));
            if state.as_deref() == Some("Z") {
                continue;
            }
            let Ok(cmd) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
                continue;
            };
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            if cmd.contains(&needle) {
                found.push(format!("{pid}: {cmd}"));
            }
        }
        found
    }
}

/// Writes `n` bytes of incompressible, deterministic data (restic compresses nothing on 0.14, but
/// later versions would squeeze zeros).
pub fn write_random(path: &Path, n: usize, seed: u64) {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407)
        | 1;
    let mut buf = Vec::with_capacity(n);
    while buf.len() < n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        buf.extend_from_slice(&x.to_le_bytes());
    }
    buf.truncate(n);
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).unwrap();
    }
    std::fs::write(path, buf).unwrap();
}

/// Makes `path` a sparse file of `len` bytes: long for an uploader to read and hash (every zero
/// of it), nothing new to upload, no disk used.
pub fn write_sparse(path: &Path, len: u64) {
    std::fs::File::create(path).unwrap().set_len(len).unwrap();
}

pub fn engine(update_interval: Duration) -> Arc<Engine> {
    Engine::new(EngineConfig {
        update_interval,
        cancel_grace: Duration::from_secs(10),
        lock_wait: Duration::from_secs(0),
        ..engine_config()
    })
}

/// The engine's defaults with the restic under test.
pub fn engine_config() -> EngineConfig {
    EngineConfig {
        restic_binary: restic_bin().to_path_buf(),
        ..EngineConfig::default()
    }
}

/// A shell wrapper around the restic under test: `script` is sh code that ends by running
/// `"$RESTIC" "$@"` (the variable holds the binary's path).
pub fn restic_wrapper(path: &Path, script: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(
        path,
        format!("#!/bin/sh\nRESTIC='{}'\n{script}\n", restic_bin().display()),
    )
    .unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path.to_path_buf()
}

pub fn backup_request(bed: &Bed) -> BackupRequest {
    BackupRequest {
        uploader: UploaderKind::Restic,
        access: bed.access(),
        source: bed.source.clone(),
        options: BackupOptions {
            host: "velero".into(),
            ..BackupOptions::default()
        },
    }
}

pub fn restore_request(bed: &Bed, snapshot: &str, target: &Path) -> RestoreRequest {
    RestoreRequest {
        uploader: UploaderKind::Restic,
        access: bed.access(),
        snapshot_id: snapshot.to_string(),
        target: target.to_path_buf(),
        limit_download_kib: None,
        kopia: Default::default(),
    }
}

/// Compares two trees file by file, byte for byte.
pub fn assert_same_tree(a: &Path, b: &Path) {
    let mut stack = vec![PathBuf::new()];
    let mut files = 0;
    while let Some(rel) = stack.pop() {
        for e in std::fs::read_dir(a.join(&rel)).unwrap().flatten() {
            let r = rel.join(e.file_name());
            let ft = e.file_type().unwrap();
            if ft.is_dir() {
                assert!(b.join(&r).is_dir(), "{} missing in restore", r.display());
                stack.push(r);
            } else if ft.is_file() {
                let x = std::fs::read(a.join(&r)).unwrap();
                let y =
                    std::fs::read(b.join(&r)).unwrap_or_else(|e| panic!("{}: {e}", r.display()));
                assert!(x == y, "{} differs", r.display());
                files += 1;
            }
        }
    }
    assert!(files > 0, "nothing compared");
}

/// Path of the built agent binary.
pub fn agent_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_podvolume-agent"))
}
