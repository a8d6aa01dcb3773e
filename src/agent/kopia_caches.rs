//! The node's bound on kopia's caches across repositories (`--kopia-cache-total-mb`).
//!
//! Each repository the agent uses gets a directory of its own under `<scratch>/.cache/kopia/`
//! (kopia's config, connection and cache), kept between transfers so the next transfer of that
//! namespace starts warm; kopia bounds each cache by the repository's limit
//! (`--kopia-cache-limit-mb` or `cacheLimitMB`). A node that serves many namespaces would keep one
//! such directory per namespace for ever: this module bounds their sum. Before a transfer uses a
//! repository, the directories of other repositories no transfer is using are removed, least
//! recently used first, until what they hold plus this repository's own limit fits in the total.
//! A removed repository is connected again on its next use, with a cold cache: what Velero's
//! data-path pods do on every transfer.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::SystemTime;

/// Repository directories in use, with how many transfers use each. The one lock also makes the
/// choice of what to remove and the removal one step, so two transfers never remove each other's
/// directory.
static IN_USE: Mutex<BTreeMap<PathBuf, usize>> = Mutex::new(BTreeMap::new());

/// A file touched when a transfer starts on a repository: its modification time is the
/// directory's last use (kopia writes in the cache at other times too).
const LAST_USE: &str = ".last-use";

/// A transfer's hold on its repository's directory: not removed while held.
#[derive(Debug)]
pub struct CacheClaim {
    dir: PathBuf,
}

impl Drop for CacheClaim {
    fn drop(&mut self) {
        let mut in_use = IN_USE.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = in_use.get_mut(&self.dir) {
            *n -= 1;
            if *n == 0 {
                in_use.remove(&self.dir);
            }
        }
        // Its last use is its end too: a long transfer is not the first to go afterwards.
        touch(&self.dir);
    }
}

/// What [`claim`] removed, for the log.
#[derive(Debug, Default, PartialEq)]
pub struct Removed {
    pub dirs: Vec<PathBuf>,
    pub bytes: u64,
}

/// Claims `dir` (a directory directly under `root`) for a transfer whose cache may grow to
/// `own_limit_mb`, after removing the least recently used idle directories of other repositories
/// under `root` while they hold more than `total_mb - own_limit_mb`. `total_mb == 0`: no bound.
/// Blocking (walks the directories): call it off the async threads.
pub fn claim(root: &Path, dir: &Path, own_limit_mb: u64, total_mb: u64) -> (CacheClaim, Removed) {
    let mut in_use = IN_USE.lock().unwrap_or_else(|e| e.into_inner());
    *in_use.entry(dir.to_path_buf()).or_insert(0) += 1;
    let _ = std::fs::create_dir_all(dir);
    touch(dir);
    let mut removed = Removed::default();
    if total_mb > 0 {
        let budget = total_mb
            .saturating_sub(own_limit_mb)
            .saturating_mul(1 << 20);
        let mut others: Vec<(SystemTime, u64, PathBuf)> = std::fs::read_dir(root)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .filter(|p| p != dir && p.is_dir())
            .map(|p| (last_use(&p), disk_usage(&p), p))
            .collect();
        let mut held: u64 = others.iter().map(|o| o.1).sum();
        // Oldest first.
        others.sort();
        for (_, bytes, path) in others {
            if held <= budget {
                break;
            }
            if in_use.contains_key(&path) {
                continue;
            }
            match std::fs::remove_dir_all(&path) {
                Ok(()) => {
                    held -= bytes;
                    removed.bytes += bytes;
                    removed.dirs.push(path);
                }
                Err(e) => tracing::warn!(dir = %path.display(), error = %e,
                    "could not remove an idle repository's kopia cache"),
            }
        }
    }
    (
        CacheClaim {
            dir: dir.to_path_buf(),
        },
        removed,
    )
}

fn touch(dir: &Path) {
    // Rewriting the file sets its modification time; no clock is read here.
    let _ = std::fs::write(dir.join(LAST_USE), b"");
}

fn last_use(dir: &Path) -> SystemTime {
    std::fs::metadata(dir.join(LAST_USE))
        .or_else(|_| std::fs::metadata(dir))
        .and_then(|m| m.modified())
        .unwrap_or(SystemTime::UNIX_EPOCH)
}

/// Bytes `dir` takes on disk (allocated blocks; symlinks not followed).
fn disk_usage(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let mut total = 0;
    let mut pending = vec![dir.to_path_buf()];
    while let Some(d) = pending.pop() {
        for entry in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let Ok(m) = entry.metadata() else { continue };
            if m.is_dir() {
                pending.push(entry.path());
            } else {
                total += m.blocks() * 512;
            }
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    fn repo(root: &Path, name: &str, bytes: usize) -> PathBuf {
        let d = root.join(name);
        std::fs::create_dir_all(d.join("kopia/cache")).unwrap();
        std::fs::write(d.join("kopia/cache/blob"), vec![7u8; bytes]).unwrap();
        touch(&d);
        // Distinct modification times in the order made.
        std::thread::sleep(std::time::Duration::from_millis(20));
        d
    }

    #[test]
    fn idle_caches_go_least_recently_used_first_until_the_total_fits() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        let a = repo(r, "a", 3 << 20);
        let b = repo(r, "b", 3 << 20);
        let c = repo(r, "c", 3 << 20);
        // b used again after c: a is the least recently used, then c.
        drop(claim(r, &b, 1, 0));
        let new = r.join("new");
        // Others hold 9 MiB; total 7 with this one's 2: 5 may stay, so a and c go, b stays.
        let (held, removed) = claim(r, &new, 2, 7);
        assert_eq!(removed.dirs, vec![a.clone(), c.clone()]);
        assert!(removed.bytes >= 6 << 20, "{removed:?}");
        assert!(b.exists() && new.exists() && !a.exists() && !c.exists());
        drop(held);
        // Within the bound: nothing goes.
        let (_held, removed) = claim(r, &b, 2, 7);
        assert_eq!(removed, Removed::default());
        assert!(new.exists());
    }

    #[test]
    fn a_cache_in_use_is_never_removed_and_no_bound_removes_nothing() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        let busy = repo(r, "busy", 4 << 20);
        let idle = repo(r, "idle", 4 << 20);
        let (busy_claim, _) = claim(r, &busy, 1, 0);
        let (_, removed) = claim(r, &r.join("other"), 1, 0);
        assert_eq!(removed, Removed::default());
        // Even far over the bound, the busy one stays while held; the idle one goes.
        let (other, removed) = claim(r, &r.join("other"), 1, 2);
        assert_eq!(removed.dirs, vec![idle.clone()]);
        assert!(busy.exists());
        drop(other);
        drop(busy_claim);
        let (_, removed) = claim(r, &r.join("other"), 1, 2);
        assert_eq!(removed.dirs, vec![busy]);
    }
}
