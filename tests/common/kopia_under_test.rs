//! Which kopia binary the tests run, chosen explicitly (as `restic_under_test` for restic).
//!
//! - `PODVOLUME_TEST_KOPIA`: path of the binary; without it, `kopia` on `PATH`.
//!   `scripts/test.sh` builds the pinned versions with `scripts/install-kopia.sh` and runs the
//!   kopia suites once per version with this set.
//! - `PODVOLUME_TEST_KOPIA_VERSION`: the version that binary must report (`0.22.3`), so a run
//!   labelled with a version cannot quietly test another one.
//!
//! A requested binary that is missing, does not run or reports another version panics with the
//! reason in every test that uses it: nothing falls back to another kopia.
//!
//! Included by path from `tests/common/mod.rs` and `tests/e2e/harness.rs`.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

pub struct KopiaUnderTest {
    /// Absolute path, for wrapper scripts and `--kopia-binary`.
    pub path: PathBuf,
    /// `kopia --version`'s output line, e.g. `0.22.3 build: go-module-proxy from: `.
    pub version_line: String,
    /// (major, minor, patch).
    pub version: (u32, u32, u32),
}

pub const KOPIA_BINARY_VAR: &str = "PODVOLUME_TEST_KOPIA";
pub const KOPIA_VERSION_VAR: &str = "PODVOLUME_TEST_KOPIA_VERSION";

/// The kopia under test, resolved and checked once per test binary.
pub fn kopia() -> &'static KopiaUnderTest {
    static CHOSEN: OnceLock<KopiaUnderTest> = OnceLock::new();
    CHOSEN.get_or_init(choose_kopia)
}

/// Absolute path of the kopia under test.
pub fn kopia_bin() -> &'static Path {
    &kopia().path
}

fn choose_kopia() -> KopiaUnderTest {
    let path = match std::env::var_os(KOPIA_BINARY_VAR) {
        Some(p) => {
            let p = PathBuf::from(p);
            assert!(
                kopia_is_executable(&p),
                "{KOPIA_BINARY_VAR}={} is not an executable file (scripts/install-kopia.sh builds the pinned versions)",
                p.display()
            );
            std::fs::canonicalize(&p).unwrap()
        }
        None => std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
            .map(|d| d.join("kopia"))
            .find(|p| kopia_is_executable(p))
            .unwrap_or_else(|| {
                panic!(
                    "kopia is not on PATH: scripts/test.sh builds it (scripts/install-kopia.sh prints the paths), or set {KOPIA_BINARY_VAR}"
                )
            }),
    };
    let out = std::process::Command::new(&path)
        .arg("--version")
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("{} --version: {e}", path.display()));
    let version_line = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert!(
        out.status.success(),
        "{} --version failed: {}",
        path.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let number = version_line
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .trim_start_matches('v');
    let parts: Vec<u32> = number.split('.').filter_map(|p| p.parse().ok()).collect();
    let [major, minor, patch] = parts[..] else {
        panic!("{}: unrecognised version {version_line:?}", path.display());
    };
    if let Some(want) = std::env::var_os(KOPIA_VERSION_VAR) {
        assert_eq!(
            number,
            want.to_string_lossy(),
            "{KOPIA_VERSION_VAR}={} but {} is {version_line:?}",
            want.to_string_lossy(),
            path.display()
        );
    }
    eprintln!("kopia under test: {version_line} ({})", path.display());
    KopiaUnderTest {
        path,
        version_line,
        version: (major, minor, patch),
    }
}

fn kopia_is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// The body of each kopia suite's version test: the version this run is labelled with is the
/// one it runs, and the log says which.
pub fn assert_requested_kopia_version() {
    let k = kopia();
    println!(
        "kopia under test: {} ({})",
        k.version_line,
        k.path.display()
    );
    if let Some(want) = std::env::var_os(KOPIA_VERSION_VAR) {
        assert!(
            k.version_line
                .starts_with(&format!("{} ", want.to_string_lossy())),
            "{}",
            k.version_line
        );
    }
}
