//! Locating pod volumes in a kubelet-like pods directory, and the restore done-file handshake;
//! PVC -> PV lookups against a real kube-apiserver (`PODVOLUME_E2E_KUBECONFIG`, as
//! `scripts/test-real-cluster.sh` runs this file), as the agent's own ServiceAccount, through the
//! fault-injecting proxy that counts the requests and gives the one 500.

// The harness is shared with tests/e2e (owned there); its lints are not this file's.
#[allow(clippy::collapsible_if)]
#[path = "e2e/harness.rs"]
mod harness;
#[path = "common/real_api_server.rs"]
mod real_api_server;

use std::fs;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};

use podvolume_agent::agent::volume::{VolumeError, locate, write_done_file};

const UID: &str = "5b0c7e9a-1111-4c1e-9d1b-000000000001";

/// `<tmp>/pods` as the host pods dir, plus a sibling `<tmp>/outside` that must never be reached.
struct Layout {
    _tmp: tempfile::TempDir,
    pods: PathBuf,
    outside: PathBuf,
}

fn layout() -> Layout {
    let tmp = tempfile::tempdir().unwrap();
    let pods = tmp.path().join("pods");
    let outside = tmp.path().join("outside");
    fs::create_dir_all(pods.join(UID).join("volumes")).unwrap();
    fs::create_dir_all(&outside).unwrap();
    fs::write(outside.join("secret"), "keep me").unwrap();
    Layout {
        _tmp: tmp,
        pods,
        outside,
    }
}

fn plugin_dir(l: &Layout, plugin: &str) -> PathBuf {
    l.pods.join(UID).join("volumes").join(plugin)
}

fn mkdir(p: &Path) -> PathBuf {
    fs::create_dir_all(p).unwrap();
    p.to_path_buf()
}

fn assert_unsafe(result: Result<PathBuf, VolumeError>) -> String {
    match result {
        Err(err @ VolumeError::Unsafe { .. }) => err.to_string(),
        other => panic!("expected Unsafe, got {other:?}"),
    }
}

fn assert_symlink_refused(result: Result<PathBuf, VolumeError>) {
    let msg = assert_unsafe(result);
    assert!(msg.contains("is a symbolic link"), "{msg}");
}

fn assert_count(result: Result<PathBuf, VolumeError>, expected: usize) -> String {
    match result {
        Err(err @ VolumeError::Matches { count, .. }) => {
            assert_eq!(count, expected);
            err.to_string()
        }
        other => panic!("expected Matches, got {other:?}"),
    }
}

#[test]
fn locates_empty_dir_volume() {
    let l = layout();
    let dir = mkdir(&plugin_dir(&l, "kubernetes.io~empty-dir").join("cache"));
    let found = locate(&l.pods, UID, "cache").unwrap();
    assert_eq!(found, fs::canonicalize(dir).unwrap());
}

#[test]
fn locates_csi_volume_mount_dir() {
    let l = layout();
    let dir = mkdir(
        &plugin_dir(&l, "kubernetes.io~csi")
            .join("pvc-123")
            .join("mount"),
    );
    mkdir(&plugin_dir(&l, "kubernetes.io~empty-dir").join("other"));
    let found = locate(&l.pods, UID, "pvc-123/mount").unwrap();
    assert_eq!(found, fs::canonicalize(dir).unwrap());
}

#[test]
fn same_name_in_two_plugin_dirs_counts_two() {
    let l = layout();
    mkdir(&plugin_dir(&l, "kubernetes.io~empty-dir").join("data"));
    mkdir(&plugin_dir(&l, "kubernetes.io~nfs").join("data"));
    let msg = assert_count(locate(&l.pods, UID, "data"), 2);
    assert_eq!(
        msg,
        format!(
            "expected one matching path: {}/{UID}/volumes/*/data, got 2",
            l.pods.display()
        )
    );
}

#[test]
fn missing_volume_counts_zero() {
    let l = layout();
    mkdir(&plugin_dir(&l, "kubernetes.io~empty-dir").join("other"));
    assert_count(locate(&l.pods, UID, "data"), 0);
}

#[test]
fn missing_pod_dir_counts_zero() {
    let l = layout();
    assert_count(locate(&l.pods, "no-such-pod", "data"), 0);
}

#[test]
fn csi_volume_without_mount_subdir_counts_zero() {
    let l = layout();
    mkdir(&plugin_dir(&l, "kubernetes.io~csi").join("pvc-123"));
    assert_count(locate(&l.pods, UID, "pvc-123/mount"), 0);
}

#[test]
fn refuses_hostile_names() {
    let l = layout();
    mkdir(&plugin_dir(&l, "kubernetes.io~empty-dir").join("data"));
    for vol in [
        "../../etc",
        "..",
        ".",
        "",
        "/etc",
        "a\0b",
        "data/../../..",
        "data/",
    ] {
        assert_unsafe(locate(&l.pods, UID, vol));
    }
    for uid in ["../../etc", "a/b", "/abs", "", "..", "u\0id"] {
        assert_unsafe(locate(&l.pods, uid, "data"));
    }
}

#[test]
fn refuses_symlinked_volume_dir_pointing_outside() {
    let l = layout();
    let plugin = mkdir(&plugin_dir(&l, "kubernetes.io~empty-dir"));
    symlink(&l.outside, plugin.join("data")).unwrap();
    assert_symlink_refused(locate(&l.pods, UID, "data"));
}

#[test]
fn refuses_symlinked_volume_dir_even_inside_pods_dir() {
    let l = layout();
    let plugin = mkdir(&plugin_dir(&l, "kubernetes.io~empty-dir"));
    let real = mkdir(&plugin.join("real"));
    symlink(&real, plugin.join("data")).unwrap();
    assert_symlink_refused(locate(&l.pods, UID, "data"));
}

#[test]
fn refuses_symlinked_plugin_dir() {
    let l = layout();
    mkdir(&l.outside.join("data"));
    symlink(&l.outside, plugin_dir(&l, "kubernetes.io~empty-dir")).unwrap();
    assert_symlink_refused(locate(&l.pods, UID, "data"));
}

#[test]
fn refuses_symlinked_mount_dir() {
    let l = layout();
    let pv = mkdir(&plugin_dir(&l, "kubernetes.io~csi").join("pvc-1"));
    symlink(&l.outside, pv.join("mount")).unwrap();
    assert_symlink_refused(locate(&l.pods, UID, "pvc-1/mount"));
}

#[test]
fn refuses_non_directory_match() {
    let l = layout();
    let plugin = mkdir(&plugin_dir(&l, "kubernetes.io~empty-dir"));
    fs::write(plugin.join("data"), "").unwrap();
    assert_unsafe(locate(&l.pods, UID, "data"));
}

#[test]
fn host_pods_dir_may_itself_be_a_symlink() {
    let l = layout();
    let dir = mkdir(&plugin_dir(&l, "kubernetes.io~empty-dir").join("data"));
    let link = l.pods.parent().unwrap().join("pods-link");
    symlink(&l.pods, &link).unwrap();
    let found = locate(&link, UID, "data").unwrap();
    assert_eq!(found, fs::canonicalize(dir).unwrap());
}

fn entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

fn assert_done(volume: &Path, restore_uid: &str) {
    let dir = volume.join(".velero");
    let meta = fs::symlink_metadata(&dir).unwrap();
    assert!(meta.is_dir() && !meta.file_type().is_symlink());
    assert_eq!(entries(&dir), vec![restore_uid.to_owned()]);
    let marker = fs::symlink_metadata(dir.join(restore_uid)).unwrap();
    assert!(marker.is_file());
    assert_eq!(marker.len(), 0);
}

fn assert_outside_untouched(l: &Layout) {
    assert_eq!(entries(&l.outside), vec!["secret".to_owned()]);
    assert_eq!(
        fs::read_to_string(l.outside.join("secret")).unwrap(),
        "keep me"
    );
}

#[test]
fn done_file_in_fresh_volume() {
    let l = layout();
    let vol = mkdir(&plugin_dir(&l, "kubernetes.io~empty-dir").join("data"));
    fs::write(vol.join("app.db"), "data").unwrap();
    write_done_file(&vol, "restore-uid-1").unwrap();
    assert_done(&vol, "restore-uid-1");
    assert_eq!(fs::read_to_string(vol.join("app.db")).unwrap(), "data");
}

#[test]
fn done_file_replaces_existing_velero_dir() {
    let l = layout();
    let vol = mkdir(&plugin_dir(&l, "kubernetes.io~empty-dir").join("data"));
    let old = mkdir(&vol.join(".velero").join("nested"));
    fs::write(vol.join(".velero").join("old-restore-uid"), "").unwrap();
    fs::write(old.join("file"), "x").unwrap();
    write_done_file(&vol, "restore-uid-2").unwrap();
    assert_done(&vol, "restore-uid-2");
}

#[test]
fn done_file_replaces_velero_file() {
    let l = layout();
    let vol = mkdir(&plugin_dir(&l, "kubernetes.io~empty-dir").join("data"));
    fs::write(vol.join(".velero"), "not a dir").unwrap();
    write_done_file(&vol, "restore-uid-3").unwrap();
    assert_done(&vol, "restore-uid-3");
}

#[test]
fn done_file_never_follows_velero_symlink() {
    let l = layout();
    let vol = mkdir(&plugin_dir(&l, "kubernetes.io~empty-dir").join("data"));
    symlink(&l.outside, vol.join(".velero")).unwrap();
    write_done_file(&vol, "restore-uid-4").unwrap();
    assert_done(&vol, "restore-uid-4");
    assert_outside_untouched(&l);
}

#[test]
fn done_file_never_follows_symlinks_inside_velero_dir() {
    let l = layout();
    let vol = mkdir(&plugin_dir(&l, "kubernetes.io~empty-dir").join("data"));
    let dot = mkdir(&vol.join(".velero"));
    symlink(&l.outside, dot.join("escape")).unwrap();
    symlink(l.outside.join("secret"), dot.join("secret-link")).unwrap();
    write_done_file(&vol, "restore-uid-5").unwrap();
    assert_done(&vol, "restore-uid-5");
    assert_outside_untouched(&l);
}

#[test]
fn done_file_replaces_dangling_velero_symlink() {
    let l = layout();
    let vol = mkdir(&plugin_dir(&l, "kubernetes.io~empty-dir").join("data"));
    symlink(l.outside.join("does-not-exist"), vol.join(".velero")).unwrap();
    write_done_file(&vol, "restore-uid-6").unwrap();
    assert_done(&vol, "restore-uid-6");
    assert_outside_untouched(&l);
}

#[test]
fn done_file_refuses_hostile_restore_uid() {
    let l = layout();
    let vol = mkdir(&plugin_dir(&l, "kubernetes.io~empty-dir").join("data"));
    for uid in ["", ".", "..", "../x", "a/b", "/abs", "a\0b"] {
        match write_done_file(&vol, uid) {
            Err(VolumeError::Unsafe { .. }) => {}
            other => panic!("{uid:?}: expected Unsafe, got {other:?}"),
        }
    }
    assert!(entries(&vol).is_empty());
}

#[test]
fn done_file_refuses_symlinked_volume_path() {
    let l = layout();
    let link = plugin_dir(&l, "link");
    fs::create_dir_all(link.parent().unwrap()).unwrap();
    symlink(&l.outside, &link).unwrap();
    assert!(matches!(
        write_done_file(&link, "restore-uid-7"),
        Err(VolumeError::Io { .. })
    ));
    assert_outside_untouched(&l);
}

// ---- resolve(): PVC -> PV lookups against the real API server ----

mod resolve_api {
    use super::*;
    use crate::harness::{Env, FaultProxy, Flavour, RequestMatch};
    use crate::real_api_server::{client_of, require_real_api_server};
    use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Pod};
    use kube::api::{DeleteParams, PostParams};
    use kube::{Api, Client};
    use podvolume_agent::agent::volume::resolve;
    use serde_json::{Value, json};

    const CLAIM: &str = "data-web-0";

    /// One test's objects: the pod's namespace is the environment's application namespace, the
    /// PV a cluster-scoped name of its own (deleted at the end). `client` is the agent's
    /// identity (`daemonset/`'s RBAC) through the proxy.
    struct Cluster {
        env: Env,
        proxy: FaultProxy,
        client: Client,
        pv: String,
    }

    impl Cluster {
        async fn new() -> Cluster {
            require_real_api_server();
            let mut env = Env::new(Flavour::Velero).await;
            let proxy = env.fault_proxy().await;
            let client = client_of(proxy.kubeconfig()).await;
            let pv = format!("pv-{}", env.app_ns);
            Cluster {
                env,
                proxy,
                client,
                pv,
            }
        }

        fn pod(&self, volumes: Value, uid: Option<&str>) -> Pod {
            let mut metadata = json!({"name": "web-0", "namespace": self.env.app_ns});
            if let Some(uid) = uid {
                metadata["uid"] = json!(uid);
            }
            serde_json::from_value(json!({
                "metadata": metadata,
                "spec": {"containers": [{"name": "app"}], "volumes": volumes},
            }))
            .unwrap()
        }

        fn claim_pod(&self) -> Pod {
            self.pod(
                json!([{"name": "data", "persistentVolumeClaim": {"claimName": CLAIM}}]),
                Some(UID),
            )
        }

        /// The claim, bound to `volume_name` when given. An unbound one names a storage class
        /// nothing provides, so that the controller manager's binder leaves it unbound.
        async fn put_pvc(&self, volume_name: Option<&str>) {
            let mut spec = json!({"accessModes": ["ReadWriteOnce"],
                                  "resources": {"requests": {"storage": "1Gi"}}});
            match volume_name {
                Some(name) => {
                    spec["volumeName"] = json!(name);
                    spec["storageClassName"] = json!("");
                }
                None => spec["storageClassName"] = json!("podvolume-test-unprovided"),
            }
            let pvc: PersistentVolumeClaim = serde_json::from_value(json!({
                "metadata": {"name": CLAIM, "namespace": self.env.app_ns}, "spec": spec,
            }))
            .unwrap();
            Api::<PersistentVolumeClaim>::namespaced(self.env.client.clone(), &self.env.app_ns)
                .create(&PostParams::default(), &pvc)
                .await
                .unwrap();
        }

        /// The PV, reserved for the test's claim (`claimRef`) so no other claim binds it.
        async fn put_pv(&self, annotations: Value, source: Value) {
            let mut spec = json!({
                "capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"],
                "storageClassName": "",
                "claimRef": {"namespace": self.env.app_ns, "name": CLAIM},
            });
            for (k, v) in source.as_object().unwrap() {
                spec[k] = v.clone();
            }
            let pv: PersistentVolume = serde_json::from_value(json!({
                "metadata": {"name": self.pv, "annotations": annotations}, "spec": spec,
            }))
            .unwrap();
            Api::<PersistentVolume>::all(self.env.client.clone())
                .create(&PostParams::default(), &pv)
                .await
                .unwrap();
        }

        async fn cleanup(self) {
            let pvs = Api::<PersistentVolume>::all(self.env.client.clone());
            if pvs.get_opt(&self.pv).await.unwrap().is_some() {
                pvs.delete(&self.pv, &DeleteParams::default())
                    .await
                    .unwrap();
            }
            self.env.cleanup().await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn resolves_empty_dir_without_api_calls() {
        let c = Cluster::new().await;
        let l = layout();
        let dir = mkdir(&plugin_dir(&l, "kubernetes.io~empty-dir").join("cache"));
        let p = c.pod(json!([{"name": "cache", "emptyDir": {}}]), Some(UID));
        let found = resolve(&c.client, &l.pods, &p, "cache").await.unwrap();
        assert_eq!(found, fs::canonicalize(dir).unwrap());
        assert_eq!(
            c.proxy.request_count(&RequestMatch::any()),
            0,
            "{:?}",
            c.proxy.request_log()
        );
        c.cleanup().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn resolves_claim_bound_to_csi_pv() {
        let c = Cluster::new().await;
        let l = layout();
        let dir = mkdir(
            &plugin_dir(&l, "kubernetes.io~csi")
                .join(&c.pv)
                .join("mount"),
        );
        c.put_pvc(Some(&c.pv)).await;
        c.put_pv(
            json!({}),
            json!({"csi": {"driver": "ebs.csi.aws.com", "volumeHandle": "vol-1"}}),
        )
        .await;
        let found = resolve(&c.client, &l.pods, &c.claim_pod(), "data")
            .await
            .unwrap();
        assert_eq!(found, fs::canonicalize(dir).unwrap());
        // spec.csi says CSI: no CSIDriver lookup.
        assert_eq!(
            c.proxy
                .request_count(&RequestMatch::any().resource("csidrivers")),
            0
        );
        c.cleanup().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn resolves_claim_bound_to_nfs_pv() {
        let c = Cluster::new().await;
        let l = layout();
        let dir = mkdir(&plugin_dir(&l, "kubernetes.io~nfs").join(&c.pv));
        c.put_pvc(Some(&c.pv)).await;
        // An external, non-CSI provisioner: the cluster's CSIDriver list decides, and it names
        // no such driver (this server has none).
        c.put_pv(
            json!({"pv.kubernetes.io/provisioned-by": "cluster.local/nfs-subdir-external-provisioner"}),
            json!({"nfs": {"server": "nfs.example", "path": "/export"}}),
        )
        .await;
        let found = resolve(&c.client, &l.pods, &c.claim_pod(), "data")
            .await
            .unwrap();
        assert_eq!(found, fs::canonicalize(dir).unwrap());
        // The list was asked for and answered (the agent's RBAC allows it), not a fallback.
        let lists: Vec<u16> = c
            .proxy
            .request_log()
            .iter()
            .filter(|r| r.info.resource.as_deref() == Some("csidrivers"))
            .map(|r| r.status)
            .collect();
        assert_eq!(lists, [200], "{:?}", c.proxy.request_log());
        c.cleanup().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn missing_claim() {
        let c = Cluster::new().await;
        let l = layout();
        let err = resolve(&c.client, &l.pods, &c.claim_pod(), "data")
            .await
            .unwrap_err();
        assert!(matches!(err, VolumeError::ClaimNotFound { .. }), "{err:?}");
        assert_eq!(
            err.to_string(),
            format!("persistentvolumeclaim {}/{CLAIM} not found", c.env.app_ns)
        );
        c.cleanup().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn unbound_claim() {
        let c = Cluster::new().await;
        let l = layout();
        c.put_pvc(None).await;
        let err = resolve(&c.client, &l.pods, &c.claim_pod(), "data")
            .await
            .unwrap_err();
        assert!(matches!(err, VolumeError::ClaimNotBound { .. }), "{err:?}");
        c.cleanup().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn missing_persistent_volume() {
        let c = Cluster::new().await;
        let l = layout();
        c.put_pvc(Some(&c.pv)).await;
        let err = resolve(&c.client, &l.pods, &c.claim_pod(), "data")
            .await
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            format!("persistentvolume {} not found", c.pv)
        );
        c.cleanup().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn api_failure_keeps_the_api_error() {
        let c = Cluster::new().await;
        let l = layout();
        c.put_pvc(Some(&c.pv)).await;
        c.proxy.fail_next(
            RequestMatch::any().resource("persistentvolumeclaims"),
            1,
            500,
        );
        let err = resolve(&c.client, &l.pods, &c.claim_pod(), "data")
            .await
            .unwrap_err();
        assert!(matches!(err, VolumeError::Api(_)), "{err:?}");
        assert!(
            err.to_string()
                .starts_with("Kubernetes API request failed: "),
            "{err}"
        );
        // The one request was the claim's, answered by the proxy's fault.
        let log = c.proxy.request_log();
        assert!(
            log.len() == 1 && log[0].injected && log[0].status == 500,
            "{log:?}"
        );
        c.cleanup().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pod_without_uid() {
        let c = Cluster::new().await;
        let l = layout();
        let p = c.pod(json!([{"name": "cache", "emptyDir": {}}]), None);
        let err = resolve(&c.client, &l.pods, &p, "cache").await.unwrap_err();
        assert_eq!(
            err.to_string(),
            format!("pod {}/web-0 has no metadata.uid", c.env.app_ns)
        );
        c.cleanup().await;
    }
}
