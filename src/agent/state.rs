//! Durable results. A finished transfer's terminal status is saved here before it is written to
//! the API server, and removed once the server has it. If the server is down when a backup ends
//! and the agent restarts meanwhile, the next start reports the saved result instead of running
//! the backup again (or losing its snapshot ID).

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct StoredResult {
    pub kind: String,
    pub namespace: String,
    pub name: String,
    pub uid: String,
    /// The terminal `status` patch, as it is to be written.
    pub status: serde_json::Value,
}

#[derive(Debug, Clone)]
pub struct StateDir {
    dir: PathBuf,
}

/// UIDs become file names: accept only what Kubernetes generates.
fn safe_uid(uid: &str) -> bool {
    !uid.is_empty() && uid.len() <= 64 && uid.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
}

impl StateDir {
    pub fn open(dir: &Path) -> std::io::Result<Self> {
        let dir = dir.join("results");
        std::fs::create_dir_all(&dir)?;
        Ok(Self { dir })
    }

    fn path(&self, uid: &str) -> Option<PathBuf> {
        safe_uid(uid).then(|| self.dir.join(format!("{uid}.json")))
    }

    /// Saves atomically (write, fsync, rename) so a crash never leaves half a result.
    pub fn save(&self, r: &StoredResult) -> std::io::Result<()> {
        let Some(path) = self.path(&r.uid) else {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "unexpected uid",
            ));
        };
        let tmp = path.with_extension("json.tmp");
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&serde_json::to_vec(r)?)?;
        f.sync_all()?;
        std::fs::rename(&tmp, &path)
    }

    pub fn load(&self, uid: &str) -> Option<StoredResult> {
        let data = std::fs::read(self.path(uid)?).ok()?;
        match serde_json::from_slice(&data) {
            Ok(r) => Some(r),
            Err(e) => {
                tracing::warn!(uid, error = %e, "ignoring an unreadable saved result");
                None
            }
        }
    }

    pub fn remove(&self, uid: &str) {
        if let Some(p) = self.path(uid) {
            let _ = std::fs::remove_file(p);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_refuses_odd_uids() {
        let tmp = tempfile::tempdir().unwrap();
        let s = StateDir::open(tmp.path()).unwrap();
        let r = StoredResult {
            kind: "PodVolumeBackup".into(),
            namespace: "velero".into(),
            name: "b-1".into(),
            uid: "0b1c-22".into(),
            status: serde_json::json!({"phase": "Completed", "snapshotID": "abc"}),
        };
        s.save(&r).unwrap();
        assert_eq!(s.load("0b1c-22"), Some(r));
        s.remove("0b1c-22");
        assert_eq!(s.load("0b1c-22"), None);
        assert!(
            s.save(&StoredResult {
                uid: "../x".into(),
                ..s_dummy()
            })
            .is_err()
        );
    }

    fn s_dummy() -> StoredResult {
        StoredResult {
            kind: String::new(),
            namespace: String::new(),
            name: String::new(),
            uid: String::new(),
            status: serde_json::Value::Null,
        }
    }
}
