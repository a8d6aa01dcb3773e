//! Locating a pod volume under the kubelet pods directory, and the restore completion handshake.
//!
//! A pod volume lives at `<host-pods>/<pod-uid>/volumes/<plugin-dir>/<vol-dir>`. `<plugin-dir>` is
//! found the way Velero finds it (exactly one directory of `volumes/` must contain `<vol-dir>`);
//! `<vol-dir>` depends on the volume's source:
//!
//! - not backed by a claim (emptyDir, configMap, inline NFS, ...): the volume name;
//! - an inline CSI ephemeral volume: `<volume-name>/mount`;
//! - a PVC (or a generic ephemeral volume, whose claim is `<pod-name>-<volume-name>`): the bound
//!   PV's name, plus `/mount` when the PV is mounted through CSI.
//!
//! hostPath and block-mode volumes are refused. Every name taken from the API is checked to be a
//! single path component before it goes into a path, and the located directory must be a real
//! directory (no symlinks on the way down from the pods directory) whose canonical path stays
//! inside the canonical pods directory.

use std::ffi::OsString;
use std::fmt;
use std::fs;
use std::io;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::{Container, PersistentVolume, PersistentVolumeClaim, Pod, Volume};
use k8s_openapi::api::storage::v1::CSIDriver;
use kube::Api;
use kube::api::ListParams;
use nix::fcntl::{OFlag, open, openat};
use nix::sys::stat::{Mode, mkdirat};

/// PV annotation naming the provisioner that created the volume.
pub const ANNOTATION_PROVISIONED_BY: &str = "pv.kubernetes.io/provisioned-by";
/// PV annotation set when an in-tree volume is migrated to (mounted through) a CSI driver.
pub const ANNOTATION_MIGRATED_TO: &str = "pv.kubernetes.io/migrated-to";
/// Directory inside a restored volume that carries the restore completion marker.
pub const DONE_DIR: &str = ".velero";

/// Why a volume is not backed up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnsupportedKind {
    /// A `hostPath` volume.
    HostPath,
    /// A block-mode PVC/PV, or a volume used through a container's `volumeDevices`.
    Block,
}

impl fmt::Display for UnsupportedKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            UnsupportedKind::HostPath => "hostPath volumes are not backed up",
            UnsupportedKind::Block => "block-mode volumes are not backed up",
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum VolumeError {
    /// `pod` is `namespace/name`.
    #[error("pod {pod} has no volume named {volume}")]
    NotInPod { pod: String, volume: String },
    #[error("volume {volume}: {kind}")]
    Unsupported {
        volume: String,
        kind: UnsupportedKind,
    },
    #[error("pod {pod} has no metadata.uid")]
    MissingUid { pod: String },
    #[error("persistentvolumeclaim {namespace}/{claim} not found")]
    ClaimNotFound { namespace: String, claim: String },
    #[error("persistentvolumeclaim {namespace}/{claim} is not bound to a persistent volume")]
    ClaimNotBound { namespace: String, claim: String },
    /// A generic ephemeral volume's claim exists but was not created for this pod.
    #[error(
        "persistentvolumeclaim {namespace}/{claim} is not owned by pod {pod}, refusing to use it for its ephemeral volume"
    )]
    ClaimNotOwned {
        namespace: String,
        claim: String,
        pod: String,
    },
    #[error("persistentvolume {name} not found")]
    PersistentVolumeNotFound { name: String },
    /// Velero's wording, kept verbatim.
    #[error("expected one matching path: {glob}, got {count}")]
    Matches { glob: String, count: usize },
    #[error("refusing unsafe volume path {path:?}: {reason}")]
    Unsafe { path: PathBuf, reason: String },
    #[error("Kubernetes API request failed: {0}")]
    Api(#[from] kube::Error),
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: io::Error },
}

fn io_err(path: impl Into<PathBuf>) -> impl FnOnce(io::Error) -> VolumeError {
    let path = path.into();
    move |source| VolumeError::Io { path, source }
}

fn unsafe_path(path: impl Into<PathBuf>, reason: impl Into<String>) -> VolumeError {
    VolumeError::Unsafe {
        path: path.into(),
        reason: reason.into(),
    }
}

fn pod_ref(pod: &Pod) -> String {
    format!(
        "{}/{}",
        pod.metadata.namespace.as_deref().unwrap_or("default"),
        pod.metadata.name.as_deref().unwrap_or("<unnamed>")
    )
}

fn pod_namespace(pod: &Pod) -> &str {
    pod.metadata.namespace.as_deref().unwrap_or("default")
}

/// Checks that `s` is usable as one path component: non-empty, not `.` or `..`, without `/` or NUL.
pub fn validate_component(s: &str) -> Result<(), VolumeError> {
    let reason = if s.is_empty() {
        "empty name"
    } else if s == "." || s == ".." {
        "'.' and '..' are not allowed as names"
    } else if s.contains('/') {
        "names must not contain '/'"
    } else if s.contains('\0') {
        "names must not contain NUL"
    } else {
        return Ok(());
    };
    Err(unsafe_path(s, reason))
}

fn all_containers(pod: &Pod) -> impl Iterator<Item = &Container> {
    let spec = pod.spec.as_ref();
    let containers = spec.map(|s| s.containers.as_slice()).unwrap_or_default();
    let init = spec
        .and_then(|s| s.init_containers.as_deref())
        .unwrap_or_default();
    containers.iter().chain(init)
}

/// Finds `volume` in the pod and refuses the kinds that are never backed up.
fn supported_volume<'a>(pod: &'a Pod, volume: &str) -> Result<&'a Volume, VolumeError> {
    let found = pod
        .spec
        .as_ref()
        .and_then(|s| s.volumes.as_deref())
        .unwrap_or_default()
        .iter()
        .find(|v| v.name == volume)
        .ok_or_else(|| VolumeError::NotInPod {
            pod: pod_ref(pod),
            volume: volume.to_owned(),
        })?;
    let unsupported = |kind| VolumeError::Unsupported {
        volume: volume.to_owned(),
        kind,
    };
    if found.host_path.is_some() {
        return Err(unsupported(UnsupportedKind::HostPath));
    }
    let ephemeral_devices = pod
        .spec
        .as_ref()
        .and_then(|s| s.ephemeral_containers.as_deref())
        .unwrap_or_default()
        .iter()
        .flat_map(|c| c.volume_devices.as_deref().unwrap_or_default());
    let used_as_block = all_containers(pod)
        .flat_map(|c| c.volume_devices.as_deref().unwrap_or_default())
        .chain(ephemeral_devices)
        .any(|d| d.name == volume);
    if used_as_block {
        return Err(unsupported(UnsupportedKind::Block));
    }
    Ok(found)
}

/// The claim backing `volume`: `Some(claimName)` for a PVC volume, `Some(<pod-name>-<volume>)` for
/// a generic ephemeral volume, `None` for everything else. Refuses hostPath volumes and volumes
/// that a container uses through `volumeDevices`.
pub fn claim_name(pod: &Pod, volume: &str) -> Result<Option<String>, VolumeError> {
    let v = supported_volume(pod, volume)?;
    if let Some(pvc) = &v.persistent_volume_claim {
        return Ok(Some(pvc.claim_name.clone()));
    }
    if v.ephemeral.is_some() {
        let pod_name = pod.metadata.name.as_deref().unwrap_or_default();
        return Ok(Some(format!("{pod_name}-{volume}")));
    }
    Ok(None)
}

fn is_block(mode: Option<&String>) -> bool {
    mode.is_some_and(|m| m == "Block")
}

/// The PV's provisioner when it may be a CSI driver that only the cluster's CSIDriver list can
/// confirm (no `spec.csi`, no migration annotation, not an in-tree `kubernetes.io/` provisioner).
fn unconfirmed_provisioner(pv: &PersistentVolume) -> Option<&str> {
    if pv.spec.as_ref().is_some_and(|s| s.csi.is_some()) {
        return None;
    }
    let annotations = pv.metadata.annotations.as_ref()?;
    if annotations.contains_key(ANNOTATION_MIGRATED_TO) {
        return None;
    }
    annotations
        .get(ANNOTATION_PROVISIONED_BY)
        .map(String::as_str)
        .filter(|p| !p.is_empty() && !p.starts_with("kubernetes.io/"))
}

/// Whether the kubelet mounts `pv` through CSI (so its directory has a `mount` subdirectory):
/// `spec.csi` is set, it carries `pv.kubernetes.io/migrated-to`, or its
/// `pv.kubernetes.io/provisioned-by` names one of `csi_drivers`.
pub fn is_csi_pv(pv: &PersistentVolume, csi_drivers: &[String]) -> bool {
    if pv.spec.as_ref().is_some_and(|s| s.csi.is_some()) {
        return true;
    }
    let Some(annotations) = pv.metadata.annotations.as_ref() else {
        return false;
    };
    if annotations.contains_key(ANNOTATION_MIGRATED_TO) {
        return true;
    }
    annotations
        .get(ANNOTATION_PROVISIONED_BY)
        .is_some_and(|p| csi_drivers.iter().any(|d| d == p))
}

/// The `<vol-dir>` part of the volume's path below `volumes/<plugin-dir>/`.
///
/// `pvc` and `pv` are needed only for a claim-backed volume. A PV is treated as CSI when
/// `spec.csi` is set or it has `pv.kubernetes.io/migrated-to`; use [`volume_dir_with_csi_drivers`]
/// to also honour `pv.kubernetes.io/provisioned-by` naming a CSI driver.
pub fn volume_dir(
    pod: &Pod,
    volume: &str,
    pvc: Option<&PersistentVolumeClaim>,
    pv: Option<&PersistentVolume>,
) -> Result<String, VolumeError> {
    volume_dir_with_csi_drivers(pod, volume, pvc, pv, &[])
}

/// [`volume_dir`], with the names of the cluster's CSI drivers (CSIDriver objects) so a PV whose
/// `pv.kubernetes.io/provisioned-by` names one of them counts as CSI.
pub fn volume_dir_with_csi_drivers(
    pod: &Pod,
    volume: &str,
    pvc: Option<&PersistentVolumeClaim>,
    pv: Option<&PersistentVolume>,
    csi_drivers: &[String],
) -> Result<String, VolumeError> {
    validate_component(volume)?;
    let v = supported_volume(pod, volume)?;
    let Some(claim) = claim_name(pod, volume)? else {
        return Ok(if v.csi.is_some() {
            format!("{volume}/mount")
        } else {
            volume.to_owned()
        });
    };
    let namespace = pod_namespace(pod);
    let pvc = pvc
        .filter(|c| c.metadata.name.as_deref() == Some(claim.as_str()))
        .ok_or_else(|| VolumeError::ClaimNotFound {
            namespace: namespace.to_owned(),
            claim: claim.clone(),
        })?;
    if v.ephemeral.is_some() {
        // The kubelet uses an ephemeral volume's claim only if the pod controls it.
        let owned = pod.metadata.uid.as_deref().is_some_and(|uid| {
            pvc.metadata
                .owner_references
                .as_deref()
                .unwrap_or_default()
                .iter()
                .any(|o| o.uid == uid && o.controller == Some(true))
        });
        if !owned {
            return Err(VolumeError::ClaimNotOwned {
                namespace: namespace.to_owned(),
                claim,
                pod: pod_ref(pod),
            });
        }
    }
    let block = || VolumeError::Unsupported {
        volume: volume.to_owned(),
        kind: UnsupportedKind::Block,
    };
    let pvc_spec = pvc.spec.as_ref();
    if is_block(pvc_spec.and_then(|s| s.volume_mode.as_ref())) {
        return Err(block());
    }
    let pv_name = pvc_spec
        .and_then(|s| s.volume_name.as_deref())
        .filter(|n| !n.is_empty())
        .ok_or_else(|| VolumeError::ClaimNotBound {
            namespace: namespace.to_owned(),
            claim: claim.clone(),
        })?;
    let pv = pv
        .filter(|p| p.metadata.name.as_deref() == Some(pv_name))
        .ok_or_else(|| VolumeError::PersistentVolumeNotFound {
            name: pv_name.to_owned(),
        })?;
    if is_block(pv.spec.as_ref().and_then(|s| s.volume_mode.as_ref())) {
        return Err(block());
    }
    validate_component(pv_name)?;
    Ok(if is_csi_pv(pv, csi_drivers) {
        format!("{pv_name}/mount")
    } else {
        pv_name.to_owned()
    })
}

fn is_absent(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::NotFound | io::ErrorKind::NotADirectory
    )
}

/// Finds `<host_pods_dir>/<pod_uid>/volumes/*/<vol_dir>`: exactly one match must exist, be a real
/// directory reached without symlinks below `host_pods_dir`, and canonicalise to a path inside the
/// canonical `host_pods_dir`. Returns that canonical path.
///
/// `host_pods_dir` itself may be (or sit below) a symlink; `vol_dir` is one or more
/// `/`-separated components (as returned by [`volume_dir`]).
pub fn locate(host_pods_dir: &Path, pod_uid: &str, vol_dir: &str) -> Result<PathBuf, VolumeError> {
    validate_component(pod_uid)?;
    let vol_parts: Vec<&str> = vol_dir.split('/').collect();
    for part in &vol_parts {
        validate_component(part).map_err(|_| {
            unsafe_path(
                vol_dir,
                "volume directory must be '/'-separated plain names",
            )
        })?;
    }
    let glob = format!("{}/{pod_uid}/volumes/*/{vol_dir}", host_pods_dir.display());
    let volumes = host_pods_dir.join(pod_uid).join("volumes");
    let mut matches: Vec<(OsString, PathBuf)> = Vec::new();
    match fs::read_dir(&volumes) {
        Err(e) if is_absent(&e) => {}
        Err(e) => return Err(io_err(&volumes)(e)),
        Ok(entries) => {
            for entry in entries {
                let entry = entry.map_err(io_err(&volumes))?;
                let candidate = entry.path().join(vol_dir);
                match fs::symlink_metadata(&candidate) {
                    Ok(_) => matches.push((entry.file_name(), candidate)),
                    Err(e) if is_absent(&e) => {}
                    Err(e) => return Err(io_err(candidate)(e)),
                }
            }
        }
    }
    if matches.len() != 1 {
        return Err(VolumeError::Matches {
            glob,
            count: matches.len(),
        });
    }
    let (plugin, found) = matches.remove(0);

    // Walk down from the pods directory: nothing below it may be a symlink.
    let mut path = host_pods_dir.to_path_buf();
    let components = [pod_uid.into(), "volumes".into(), plugin]
        .into_iter()
        .chain(vol_parts.iter().map(OsString::from));
    let mut last = None;
    for component in components {
        path.push(component);
        let meta = fs::symlink_metadata(&path).map_err(io_err(&path))?;
        if meta.file_type().is_symlink() {
            return Err(unsafe_path(&path, "is a symbolic link"));
        }
        last = Some(meta);
    }
    if !last.is_some_and(|m| m.is_dir()) {
        return Err(unsafe_path(&found, "is not a directory"));
    }

    let root = fs::canonicalize(host_pods_dir).map_err(io_err(host_pods_dir))?;
    let canonical = fs::canonicalize(&found).map_err(io_err(&found))?;
    if !canonical.starts_with(&root) {
        return Err(unsafe_path(
            &found,
            format!(
                "resolves to {}, outside the host pods directory {}",
                canonical.display(),
                root.display()
            ),
        ));
    }
    Ok(canonical)
}

/// Names of the cluster's CSIDriver objects; a failure (e.g. no RBAC permission) is logged and
/// treated as "none", so only `spec.csi` and the migration annotation count.
async fn csi_driver_names(client: &kube::Client) -> Vec<String> {
    match Api::<CSIDriver>::all(client.clone())
        .list(&ListParams::default())
        .await
    {
        Ok(list) => list
            .items
            .into_iter()
            .filter_map(|d| d.metadata.name)
            .collect(),
        Err(error) => {
            tracing::warn!(%error, "cannot list CSIDrivers; PVs are treated as CSI only by spec.csi or pv.kubernetes.io/migrated-to");
            Vec::new()
        }
    }
}

/// Locates `volume` of `pod` below `host_pods_dir`, looking up its PVC and PV through the API.
pub async fn resolve(
    client: &kube::Client,
    host_pods_dir: &Path,
    pod: &Pod,
    volume: &str,
) -> Result<PathBuf, VolumeError> {
    let uid = pod
        .metadata
        .uid
        .as_deref()
        .filter(|u| !u.is_empty())
        .ok_or_else(|| VolumeError::MissingUid { pod: pod_ref(pod) })?;
    validate_component(uid)?;
    let mut pvc = None;
    let mut pv = None;
    let mut csi_drivers = Vec::new();
    if let Some(claim) = claim_name(pod, volume)? {
        let namespace = pod_namespace(pod);
        let found = Api::<PersistentVolumeClaim>::namespaced(client.clone(), namespace)
            .get_opt(&claim)
            .await?
            .ok_or_else(|| VolumeError::ClaimNotFound {
                namespace: namespace.to_owned(),
                claim: claim.clone(),
            })?;
        let pv_name = found
            .spec
            .as_ref()
            .and_then(|s| s.volume_name.clone())
            .filter(|n| !n.is_empty())
            .ok_or_else(|| VolumeError::ClaimNotBound {
                namespace: namespace.to_owned(),
                claim,
            })?;
        let found_pv = Api::<PersistentVolume>::all(client.clone())
            .get_opt(&pv_name)
            .await?
            .ok_or(VolumeError::PersistentVolumeNotFound { name: pv_name })?;
        if unconfirmed_provisioner(&found_pv).is_some() {
            csi_drivers = csi_driver_names(client).await;
        }
        pvc = Some(found);
        pv = Some(found_pv);
    }
    let vol_dir =
        volume_dir_with_csi_drivers(pod, volume, pvc.as_ref(), pv.as_ref(), &csi_drivers)?;
    let root = host_pods_dir.to_path_buf();
    let uid = uid.to_owned();
    match tokio::task::spawn_blocking(move || locate(&root, &uid, &vol_dir)).await {
        Ok(result) => result,
        Err(join) => std::panic::resume_unwind(join.into_panic()),
    }
}

fn open_dir_nofollow(dirfd: Option<&OwnedFd>, path: &Path) -> Result<OwnedFd, VolumeError> {
    let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let fd = match dirfd {
        Some(dirfd) => openat(dirfd, path, flags, Mode::empty()),
        None => open(path, flags, Mode::empty()),
    };
    fd.map_err(|errno| VolumeError::Io {
        path: path.to_path_buf(),
        source: errno.into(),
    })
}

/// Commits the filesystem of `volume_path` to disk (`syncfs`): a restore's data is durable
/// before its done file lets the pod start.
pub fn flush(volume_path: &Path) -> std::io::Result<()> {
    let dir = std::fs::File::open(volume_path)?;
    nix::unistd::syncfs(&dir).map_err(std::io::Error::from)
}

/// Restore completion handshake: replaces `<volume_path>/.velero` with a fresh directory holding
/// the empty file `<restore_uid>`, which Velero's restore-helper init container waits for.
///
/// Whatever the restored data left at `.velero` (file, directory, symlink) is removed without
/// following symlinks, and the new directory and file are created relative to an open handle on
/// `volume_path` with `O_NOFOLLOW`/`O_EXCL`, so nothing is ever written outside the volume.
pub fn write_done_file(volume_path: &Path, restore_uid: &str) -> Result<(), VolumeError> {
    validate_component(restore_uid)?;
    let volume = open_dir_nofollow(None, volume_path)?;
    let done_dir = volume_path.join(DONE_DIR);
    match fs::symlink_metadata(&done_dir) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_err(&done_dir)(e)),
        // remove_dir_all never follows symlinks (neither at the top nor inside).
        Ok(meta) if meta.is_dir() => fs::remove_dir_all(&done_dir).map_err(io_err(&done_dir))?,
        Ok(_) => fs::remove_file(&done_dir).map_err(io_err(&done_dir))?,
    }
    // mkdirat fails with EEXIST rather than following anything that reappeared in between.
    mkdirat(&volume, DONE_DIR, Mode::from_bits_truncate(0o755)).map_err(|errno| {
        VolumeError::Io {
            path: done_dir.clone(),
            source: errno.into(),
        }
    })?;
    let dir = open_dir_nofollow(Some(&volume), Path::new(DONE_DIR))?;
    let marker = done_dir.join(restore_uid);
    openat(
        &dir,
        restore_uid,
        OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::from_bits_truncate(0o644),
    )
    .map_err(|errno| VolumeError::Io {
        path: marker,
        source: errno.into(),
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(spec: serde_json::Value) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "web-0", "namespace": "shop", "uid": "1111-2222"},
            "spec": spec,
        }))
        .unwrap()
    }

    fn pod_with_volumes(volumes: serde_json::Value) -> Pod {
        pod(json!({
            "containers": [{"name": "app", "volumeMounts": [{"name": "data", "mountPath": "/data"}]}],
            "volumes": volumes,
        }))
    }

    fn pvc(name: &str, spec: serde_json::Value) -> PersistentVolumeClaim {
        serde_json::from_value(
            json!({"metadata": {"name": name, "namespace": "shop"}, "spec": spec}),
        )
        .unwrap()
    }

    fn pv(metadata: serde_json::Value, spec: serde_json::Value) -> PersistentVolume {
        serde_json::from_value(json!({"metadata": metadata, "spec": spec})).unwrap()
    }

    fn claim_pod() -> Pod {
        pod_with_volumes(
            json!([{"name": "data", "persistentVolumeClaim": {"claimName": "data-web-0"}}]),
        )
    }

    fn bound_pvc() -> PersistentVolumeClaim {
        pvc("data-web-0", json!({"volumeName": "pvc-123"}))
    }

    #[test]
    fn claim_name_of_pvc_volume() {
        assert_eq!(
            claim_name(&claim_pod(), "data").unwrap().as_deref(),
            Some("data-web-0")
        );
    }

    #[test]
    fn claim_name_of_non_claim_volume_is_none() {
        let p = pod_with_volumes(json!([{"name": "data", "emptyDir": {}}]));
        assert_eq!(claim_name(&p, "data").unwrap(), None);
    }

    #[test]
    fn claim_name_of_generic_ephemeral_volume() {
        let p = pod_with_volumes(
            json!([{"name": "data", "ephemeral": {"volumeClaimTemplate": {"spec": {}}}}]),
        );
        assert_eq!(
            claim_name(&p, "data").unwrap().as_deref(),
            Some("web-0-data")
        );
    }

    #[test]
    fn claim_name_missing_volume() {
        let err = claim_name(&claim_pod(), "logs").unwrap_err();
        assert!(matches!(err, VolumeError::NotInPod { .. }));
        assert_eq!(err.to_string(), "pod shop/web-0 has no volume named logs");
    }

    #[test]
    fn claim_name_refuses_host_path() {
        let p = pod_with_volumes(json!([{"name": "data", "hostPath": {"path": "/var/log"}}]));
        let err = claim_name(&p, "data").unwrap_err();
        assert!(matches!(
            err,
            VolumeError::Unsupported {
                kind: UnsupportedKind::HostPath,
                ..
            }
        ));
        assert_eq!(
            err.to_string(),
            "volume data: hostPath volumes are not backed up"
        );
    }

    #[test]
    fn claim_name_refuses_volume_devices_in_init_container() {
        let p = pod(json!({
            "containers": [{"name": "app"}],
            "initContainers": [{"name": "init", "volumeDevices": [{"name": "data", "devicePath": "/dev/xvda"}]}],
            "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "raw"}}],
        }));
        let err = claim_name(&p, "data").unwrap_err();
        assert_eq!(
            err.to_string(),
            "volume data: block-mode volumes are not backed up"
        );
    }

    #[test]
    fn claim_name_refuses_volume_devices_in_container() {
        let p = pod(json!({
            "containers": [{"name": "app", "volumeDevices": [{"name": "data", "devicePath": "/dev/xvda"}]}],
            "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "raw"}}],
        }));
        assert!(matches!(
            claim_name(&p, "data"),
            Err(VolumeError::Unsupported {
                kind: UnsupportedKind::Block,
                ..
            })
        ));
    }

    #[test]
    fn volume_dir_of_empty_dir_is_its_name() {
        let p = pod_with_volumes(json!([{"name": "data", "emptyDir": {}}]));
        assert_eq!(volume_dir(&p, "data", None, None).unwrap(), "data");
    }

    #[test]
    fn volume_dir_of_inline_csi_has_mount() {
        let p = pod_with_volumes(
            json!([{"name": "data", "csi": {"driver": "secrets-store.csi.k8s.io"}}]),
        );
        assert_eq!(volume_dir(&p, "data", None, None).unwrap(), "data/mount");
    }

    #[test]
    fn volume_dir_of_csi_pv() {
        let v = pv(
            json!({"name": "pvc-123"}),
            json!({"csi": {"driver": "ebs.csi.aws.com", "volumeHandle": "vol-1"}}),
        );
        let dir = volume_dir(&claim_pod(), "data", Some(&bound_pvc()), Some(&v)).unwrap();
        assert_eq!(dir, "pvc-123/mount");
    }

    #[test]
    fn volume_dir_of_in_tree_pv() {
        let v = pv(
            json!({"name": "pvc-123", "annotations": {ANNOTATION_PROVISIONED_BY: "kubernetes.io/aws-ebs"}}),
            json!({"nfs": {"server": "nfs", "path": "/export"}}),
        );
        let dir = volume_dir(&claim_pod(), "data", Some(&bound_pvc()), Some(&v)).unwrap();
        assert_eq!(dir, "pvc-123");
    }

    #[test]
    fn volume_dir_of_migrated_pv_is_csi() {
        let v = pv(
            json!({"name": "pvc-123", "annotations": {ANNOTATION_MIGRATED_TO: "ebs.csi.aws.com"}}),
            json!({"awsElasticBlockStore": {"volumeID": "vol-1"}}),
        );
        let dir = volume_dir(&claim_pod(), "data", Some(&bound_pvc()), Some(&v)).unwrap();
        assert_eq!(dir, "pvc-123/mount");
    }

    #[test]
    fn volume_dir_provisioned_by_csi_driver_needs_driver_list() {
        let v = pv(
            json!({"name": "pvc-123", "annotations": {ANNOTATION_PROVISIONED_BY: "csi.vsphere.vmware.com"}}),
            json!({"vsphereVolume": {"volumePath": "[ds] x.vmdk"}}),
        );
        let (p, c) = (claim_pod(), bound_pvc());
        assert_eq!(unconfirmed_provisioner(&v), Some("csi.vsphere.vmware.com"));
        let drivers = vec!["csi.vsphere.vmware.com".to_owned()];
        let dir = volume_dir_with_csi_drivers(&p, "data", Some(&c), Some(&v), &drivers).unwrap();
        assert_eq!(dir, "pvc-123/mount");
        let other = vec!["ebs.csi.aws.com".to_owned()];
        let dir = volume_dir_with_csi_drivers(&p, "data", Some(&c), Some(&v), &other).unwrap();
        assert_eq!(dir, "pvc-123");
    }

    #[test]
    fn in_tree_provisioner_needs_no_driver_list() {
        let v = pv(
            json!({"name": "pvc-123", "annotations": {ANNOTATION_PROVISIONED_BY: "kubernetes.io/gce-pd"}}),
            json!({}),
        );
        assert_eq!(unconfirmed_provisioner(&v), None);
    }

    #[test]
    fn volume_dir_refuses_block_pvc() {
        let c = pvc(
            "data-web-0",
            json!({"volumeName": "pvc-123", "volumeMode": "Block"}),
        );
        let v = pv(json!({"name": "pvc-123"}), json!({}));
        let err = volume_dir(&claim_pod(), "data", Some(&c), Some(&v)).unwrap_err();
        assert!(matches!(
            err,
            VolumeError::Unsupported {
                kind: UnsupportedKind::Block,
                ..
            }
        ));
    }

    #[test]
    fn volume_dir_refuses_block_pv() {
        let v = pv(json!({"name": "pvc-123"}), json!({"volumeMode": "Block"}));
        let err = volume_dir(&claim_pod(), "data", Some(&bound_pvc()), Some(&v)).unwrap_err();
        assert!(matches!(
            err,
            VolumeError::Unsupported {
                kind: UnsupportedKind::Block,
                ..
            }
        ));
    }

    #[test]
    fn volume_dir_refuses_host_path() {
        let p = pod_with_volumes(json!([{"name": "data", "hostPath": {"path": "/"}}]));
        assert!(matches!(
            volume_dir(&p, "data", None, None),
            Err(VolumeError::Unsupported {
                kind: UnsupportedKind::HostPath,
                ..
            })
        ));
    }

    #[test]
    fn volume_dir_unbound_claim() {
        let c = pvc("data-web-0", json!({}));
        let err = volume_dir(&claim_pod(), "data", Some(&c), None).unwrap_err();
        assert_eq!(
            err.to_string(),
            "persistentvolumeclaim shop/data-web-0 is not bound to a persistent volume"
        );
    }

    #[test]
    fn volume_dir_missing_or_wrong_objects() {
        let p = claim_pod();
        let err = volume_dir(&p, "data", None, None).unwrap_err();
        assert_eq!(
            err.to_string(),
            "persistentvolumeclaim shop/data-web-0 not found"
        );
        let other = pvc("other", json!({"volumeName": "pvc-123"}));
        assert!(matches!(
            volume_dir(&p, "data", Some(&other), None),
            Err(VolumeError::ClaimNotFound { .. })
        ));
        let err = volume_dir(&p, "data", Some(&bound_pvc()), None).unwrap_err();
        assert_eq!(err.to_string(), "persistentvolume pvc-123 not found");
        let wrong_pv = pv(json!({"name": "pvc-999"}), json!({}));
        assert!(matches!(
            volume_dir(&p, "data", Some(&bound_pvc()), Some(&wrong_pv)),
            Err(VolumeError::PersistentVolumeNotFound { .. })
        ));
    }

    #[test]
    fn volume_dir_refuses_hostile_pv_name() {
        let c = pvc("data-web-0", json!({"volumeName": ".."}));
        let v = pv(json!({"name": ".."}), json!({}));
        assert!(matches!(
            volume_dir(&claim_pod(), "data", Some(&c), Some(&v)),
            Err(VolumeError::Unsafe { .. })
        ));
    }

    #[test]
    fn volume_dir_refuses_hostile_volume_name() {
        let p = pod_with_volumes(json!([{"name": "../x", "emptyDir": {}}]));
        assert!(matches!(
            volume_dir(&p, "../x", None, None),
            Err(VolumeError::Unsafe { .. })
        ));
    }

    #[test]
    fn volume_dir_of_generic_ephemeral_requires_ownership() {
        let p = pod_with_volumes(
            json!([{"name": "data", "ephemeral": {"volumeClaimTemplate": {"spec": {}}}}]),
        );
        let v = pv(
            json!({"name": "pvc-9"}),
            json!({"csi": {"driver": "d", "volumeHandle": "h"}}),
        );
        let owned: PersistentVolumeClaim = serde_json::from_value(json!({
            "metadata": {"name": "web-0-data", "namespace": "shop", "ownerReferences": [
                {"apiVersion": "v1", "kind": "Pod", "name": "web-0", "uid": "1111-2222", "controller": true}
            ]},
            "spec": {"volumeName": "pvc-9"},
        }))
        .unwrap();
        assert_eq!(
            volume_dir(&p, "data", Some(&owned), Some(&v)).unwrap(),
            "pvc-9/mount"
        );
        let foreign = pvc("web-0-data", json!({"volumeName": "pvc-9"}));
        assert!(matches!(
            volume_dir(&p, "data", Some(&foreign), Some(&v)),
            Err(VolumeError::ClaimNotOwned { .. })
        ));
    }

    #[test]
    fn validate_component_cases() {
        for ok in ["data", "pvc-123", "1111-2222", ".velero", "a..b"] {
            validate_component(ok).unwrap();
        }
        for bad in ["", ".", "..", "a/b", "/etc", "../../etc", "a\0b"] {
            assert!(
                matches!(validate_component(bad), Err(VolumeError::Unsafe { .. })),
                "{bad:?} accepted"
            );
        }
    }

    #[test]
    fn matches_message_is_veleros() {
        let err = VolumeError::Matches {
            glob: "/host_pods/u/volumes/*/data".into(),
            count: 0,
        };
        assert_eq!(
            err.to_string(),
            "expected one matching path: /host_pods/u/volumes/*/data, got 0"
        );
    }
}
