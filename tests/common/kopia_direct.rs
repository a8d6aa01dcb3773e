//! The kopia under test run directly (not through the agent): a read-only connection of its own
//! to look into a repository the agent wrote, and shell wrappers around the binary.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use super::{Bed, kopia_bin};

/// What every direct kopia run gets besides its config and password (the agent's own settings):
/// no update check, no password saved next to the config, no keyring, no colours.
pub const KOPIA_QUIET_ENV: &[(&str, &str)] = &[
    ("KOPIA_CHECK_FOR_UPDATES", "false"),
    ("KOPIA_PERSIST_CREDENTIALS_ON_CONNECT", "false"),
    ("KOPIA_USE_KEYRING", "false"),
    ("KOPIA_DISABLE_COLOR", "true"),
];

/// Variables of the caller's environment that would change what a direct run does.
const KOPIA_INHERITED: &[&str] = &[
    "KOPIA_PASSWORD",
    "KOPIA_CONFIG_PATH",
    "KOPIA_CACHE_DIRECTORY",
    "KOPIA_LOG_DIR",
    "KOPIA_BYTES_STRING_BASE_2",
];

/// `kopia <args>` with its config, cache and logs under `dir` and `password` in the environment.
pub fn kopia_command(dir: &Path, password: &str, args: &[&str]) -> Command {
    let mut cmd = Command::new(kopia_bin());
    for k in KOPIA_INHERITED {
        cmd.env_remove(k);
    }
    cmd.args(args)
        .env("KOPIA_CONFIG_PATH", dir.join("repository.config"))
        .env("KOPIA_CACHE_DIRECTORY", dir.join("cache"))
        .env("KOPIA_LOG_DIR", dir.join("logs"))
        .env("KOPIA_PASSWORD", password)
        .envs(KOPIA_QUIET_ENV.iter().copied())
        .stdin(Stdio::null());
    cmd
}

/// A read-only connection to a filesystem repository, apart from the agent's (its own config,
/// cache and logs), to see what the agent left there.
pub struct KopiaInspector {
    dir: PathBuf,
    password: String,
}

impl KopiaInspector {
    /// Connects with `repository connect filesystem --readonly`; panics with kopia's words when
    /// that fails.
    pub fn connect(dir: &Path, repo: &Path, password: &str) -> Self {
        std::fs::create_dir_all(dir).unwrap();
        let inspector = KopiaInspector {
            dir: dir.to_path_buf(),
            password: password.to_string(),
        };
        let path = format!("--path={}", repo.display());
        let out = inspector.run(&["repository", "connect", "filesystem", &path, "--readonly"]);
        assert!(
            out.status.success(),
            "kopia repository connect (inspection) failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        inspector
    }

    pub fn run(&self, args: &[&str]) -> Output {
        kopia_command(&self.dir, &self.password, args)
            .output()
            .unwrap_or_else(|e| panic!("{} does not run: {e}", kopia_bin().display()))
    }

    /// Every snapshot manifest in the repository, incomplete ones too, as
    /// `snapshot list --json --all --incomplete` prints them (with their `stats`).
    pub fn snapshots(&self) -> Vec<serde_json::Value> {
        let out = self.run(&["snapshot", "list", "--json", "--all", "--incomplete"]);
        assert!(
            out.status.success(),
            "kopia snapshot list failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!(
                "kopia snapshot list printed no JSON list ({e}): {}",
                String::from_utf8_lossy(&out.stdout)
            )
        })
    }

    /// The manifest with this ID; panics listing the IDs there are when it is missing.
    pub fn snapshot(&self, id: &str) -> serde_json::Value {
        let all = self.snapshots();
        all.iter()
            .find(|s| s["id"] == id)
            .cloned()
            .unwrap_or_else(|| {
                let ids: Vec<&serde_json::Value> = all.iter().map(|s| &s["id"]).collect();
                panic!("snapshot {id} is not in the repository, which holds {ids:?}")
            })
    }
}

impl Bed {
    /// The bed's password as kopia gets it (the file without its trailing newline).
    pub fn kopia_password(&self) -> String {
        let p = std::fs::read_to_string(&self.password_file).unwrap();
        p.strip_suffix('\n').unwrap_or(&p).to_string()
    }

    /// A fresh read-only connection of its own to the bed's repository.
    pub fn kopia_inspector(&self) -> KopiaInspector {
        let n = std::fs::read_dir(self.path()).unwrap().count();
        let dir = self.path().join(format!("inspection-{n}"));
        KopiaInspector::connect(&dir, &self.repo, &self.kopia_password())
    }

    /// Every file under the repository with its size and modification time, sorted: two equal
    /// listings mean nothing was written, renamed or removed in between.
    pub fn repository_files(&self) -> Vec<(PathBuf, u64, std::time::SystemTime)> {
        let mut out = Vec::new();
        let mut stack = vec![self.repo.clone()];
        while let Some(dir) = stack.pop() {
            for e in std::fs::read_dir(&dir).unwrap().flatten() {
                let meta = e.metadata().unwrap();
                if meta.is_dir() {
                    stack.push(e.path());
                } else {
                    out.push((e.path(), meta.len(), meta.modified().unwrap()));
                }
            }
        }
        out.sort();
        out
    }
}

/// A shell wrapper around the kopia under test: `script` is sh code that ends by running
/// `"$KOPIA" "$@"` (the variable holds the binary's path), usually with `exec` so that kopia
/// keeps the wrapper's pid.
pub fn kopia_wrapper(path: &Path, script: &str) -> PathBuf {
    kopia_wrapper_of(path, kopia_bin(), script)
}

/// [`kopia_wrapper`] around another copy of the binary.
pub fn kopia_wrapper_of(path: &Path, kopia: &Path, script: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(
        path,
        format!("#!/bin/sh\nKOPIA='{}'\n{script}\n", kopia.display()),
    )
    .unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path.to_path_buf()
}
