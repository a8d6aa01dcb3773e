//! Which restic binary the tests run, chosen explicitly.
//!
//! - `PODVOLUME_TEST_RESTIC`: path of the binary; without it, `restic` on `PATH` (Debian's 0.14 in
//!   CI). `scripts/test.sh` sets it to the unpacked 0.18 for the second pass of the matrix.
//! - `PODVOLUME_TEST_RESTIC_VERSION`: the version that binary must report (`0.18.0`), so a run
//!   labelled with a version cannot quietly test another one.
//!
//! A requested binary that is missing, does not run or reports another version panics with the
//! reason in every test that uses it: nothing falls back to some other restic.
//!
//! Included by path from `tests/common/mod.rs` and `tests/e2e/harness.rs`.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use podvolume_agent::uploader::restic::ResticVersion;

pub struct ResticUnderTest {
    /// Absolute path, for wrapper scripts and `--restic-binary`.
    pub path: PathBuf,
    /// `restic version`'s output line, e.g. `restic 0.18.0 compiled with go1.24.4 on linux/amd64`.
    pub version_line: String,
    pub version: ResticVersion,
}

impl ResticUnderTest {
    /// restic 0.14 prints the 8-hex short ID in its backup summary; 0.15 and later the full 64-hex ID.
    pub fn snapshot_id_len(&self) -> usize {
        if self.version >= ResticVersion::new(0, 15, 0) {
            64
        } else {
            8
        }
    }
}

pub const BINARY_VAR: &str = "PODVOLUME_TEST_RESTIC";
pub const VERSION_VAR: &str = "PODVOLUME_TEST_RESTIC_VERSION";

/// The restic under test, resolved and checked once per test binary.
pub fn restic() -> &'static ResticUnderTest {
    static CHOSEN: OnceLock<ResticUnderTest> = OnceLock::new();
    CHOSEN.get_or_init(choose)
}

/// Absolute path of the restic under test.
pub fn restic_bin() -> &'static Path {
    &restic().path
}

fn choose() -> ResticUnderTest {
    let path = match std::env::var_os(BINARY_VAR) {
        Some(p) => {
            let p = PathBuf::from(p);
            assert!(
                is_executable(&p),
                "{BINARY_VAR}={} is not an executable file (scripts/fetch-restic-trixie.sh unpacks restic 0.18)",
                p.display()
            );
            std::fs::canonicalize(&p).unwrap()
        }
        None => on_path("restic").unwrap_or_else(|| {
            panic!(
                "restic is not on PATH: scripts/test.sh installs it (apt-get install restic), or set {BINARY_VAR}"
            )
        }),
    };
    let out = std::process::Command::new(&path)
        .arg("version")
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("{} version: {e}", path.display()));
    let version_line = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert!(
        out.status.success(),
        "{} version failed: {}",
        path.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let version = ResticVersion::parse(&version_line)
        .unwrap_or_else(|| panic!("{}: unrecognised version {version_line:?}", path.display()));
    if let Some(want) = std::env::var_os(VERSION_VAR) {
        let want = want.to_string_lossy();
        assert_eq!(
            version.to_string(),
            want,
            "{VERSION_VAR}={want} but {} is {version_line:?}",
            path.display()
        );
    }
    eprintln!("restic under test: {version_line} ({})", path.display());
    ResticUnderTest {
        path,
        version_line,
        version,
    }
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

fn on_path(name: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join(name))
        .find(|p| is_executable(p))
}

/// The body of each restic suite's version test: the version this run is labelled with is the
/// one it runs, and the log says which.
pub fn assert_requested_version() {
    let r = restic();
    println!(
        "restic under test: {} ({})",
        r.version_line,
        r.path.display()
    );
    if let Some(want) = std::env::var_os(VERSION_VAR) {
        assert!(
            r.version_line
                .starts_with(&format!("restic {}", want.to_string_lossy())),
            "{}",
            r.version_line
        );
    }
}
