//! Velero 1.17+'s kopia pod volume backups and restores, end to end with the real kopia: the
//! PodVolumeBackup names no repository (`repoIdentifier: ""`), the agent finds the one Velero's
//! server created through the BackupRepository and the BackupStorageLocation (moto's S3 behind
//! TLS with its own CA, see `tests/s3/`), and files the snapshot as Velero does. The test plays
//! Velero's server: it creates the repository with kopia as Velero's BackupRepository
//! controller does (`default@default`, at `<prefix>/kopia/<namespace>/`) and marks the
//! BackupRepository Ready.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use kube::Api;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind, PostParams};
use podvolume_agent::crd::{Phase, PodVolumeBackup, PodVolumeRestore};
use serde_json::json;

use crate::harness::*;
use crate::s3::S3Server;

const LONG: Duration = Duration::from_secs(180);
const LOCATION: &str = "kopia-loc";
const BUCKET: &str = "velero";
const PREFIX: &str = "cluster-a";
/// The agent's default: it never creates a repository.
const VELERO_DEFAULT: &str = "--init-missing-repository=false";

/// An S3 server with a location on it as `velero install` writes one (credentials Secret, CA
/// inline), and kopia run as Velero's server runs it against that location.
struct VeleroKopia {
    s3: S3Server,
    /// Velero's own kopia config (its server's connection), apart from the agent's.
    config: PathBuf,
    password: String,
}

impl VeleroKopia {
    async fn new(env: &Env) -> VeleroKopia {
        let s3 = S3Server::start(&[("velero", &[BUCKET])]);
        let secrets: Api<Secret> = Api::namespaced(env.client.clone(), &env.ns);
        let secret: Secret = serde_json::from_value(json!({
            "metadata": {"name": "cloud-credentials", "namespace": env.ns},
            "data": {"cloud": b64(s3.keys("velero").credentials_file().as_bytes())},
        }))
        .unwrap();
        secrets
            .create(&PostParams::default(), &secret)
            .await
            .unwrap();
        create_storage_location(
            &env.client,
            &env.ns,
            LOCATION,
            json!({
                "provider": "aws",
                "objectStorage": {"bucket": BUCKET, "prefix": PREFIX,
                                  "caCert": b64(&std::fs::read(&s3.ca_pem).unwrap())},
                "config": {"region": "us-east-1", "s3ForcePathStyle": "true", "s3Url": s3.endpoint()},
                "credential": {"name": "cloud-credentials", "key": "cloud"},
            }),
        )
        .await;
        let config = env.tmp.path().join("velero-kopia/repository.config");
        std::fs::create_dir_all(config.parent().unwrap()).unwrap();
        // The agent's password (--repo-password-file), as Velero's velero-repo-credentials.
        let password = std::fs::read_to_string(&env.password_file).unwrap();
        VeleroKopia {
            s3,
            config,
            password,
        }
    }

    fn prefix(namespace: &str) -> String {
        format!("{PREFIX}/kopia/{namespace}/")
    }

    /// `kopia <args>` as Velero's server: its identity, its config, the location's keys and CA.
    fn kopia(&self, args: &[&str]) -> std::process::Output {
        let keys = self.s3.keys("velero");
        Command::new(kopia_bin())
            .args(args)
            .env("KOPIA_CONFIG_PATH", &self.config)
            .env("KOPIA_PASSWORD", &self.password)
            .env("KOPIA_CHECK_FOR_UPDATES", "false")
            .env("KOPIA_LOG_DIR", self.config.with_file_name("logs"))
            .env("AWS_ACCESS_KEY_ID", &keys.access_key_id)
            .env("AWS_SECRET_ACCESS_KEY", &keys.secret_access_key)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    }

    fn storage_flags(&self, namespace: &str) -> Vec<String> {
        vec![
            "s3".into(),
            format!("--bucket={BUCKET}"),
            format!("--prefix={}", Self::prefix(namespace)),
            format!(
                "--endpoint={}",
                self.s3.endpoint().trim_start_matches("https://")
            ),
            format!("--root-ca-pem-path={}", self.s3.ca_pem.display()),
            "--override-username=default".into(),
            "--override-hostname=default".into(),
        ]
    }

    /// Creates the repository of `namespace` as Velero's BackupRepository controller does.
    fn create_repository(&self, namespace: &str) {
        let mut args = vec!["repository", "create"];
        let flags = self.storage_flags(namespace);
        args.extend(flags.iter().map(String::as_str));
        args.push("--no-auto-maintenance");
        let out = self.kopia(&args);
        assert!(
            out.status.success(),
            "kopia repository create: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Every snapshot manifest in the repository of `namespace`, incomplete ones too.
    fn snapshots(&self, namespace: &str) -> Vec<serde_json::Value> {
        let mut args = vec!["repository", "connect"];
        let flags = self.storage_flags(namespace);
        args.extend(flags.iter().map(String::as_str));
        let out = self.kopia(&args);
        assert!(
            out.status.success(),
            "kopia repository connect: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let out = self.kopia(&["snapshot", "list", "--json", "--all", "--incomplete"]);
        assert!(
            out.status.success(),
            "kopia snapshot list: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    }

    /// The objects under the namespace's repository prefix (nothing there: no repository).
    fn objects(&self, namespace: &str) -> usize {
        let mut args = vec!["repository", "connect"];
        let flags = self.storage_flags(namespace);
        args.extend(flags.iter().map(String::as_str));
        let out = self.kopia(&args);
        let text = String::from_utf8_lossy(&out.stderr).to_string();
        if out.status.success() {
            return usize::MAX;
        }
        assert!(
            text.contains("repository not initialized") || text.contains("not found"),
            "{text}"
        );
        0
    }
}

/// A BackupRepository as Velero's server makes it (name `<ns>-<location>-kopia`, its labels),
/// in `phase`.
async fn backup_repository(env: &Env, volume_namespace: &str, phase: &str) {
    let gvk = GroupVersionKind::gvk("velero.io", "v1", "BackupRepository");
    let api: Api<DynamicObject> =
        Api::namespaced_with(env.client.clone(), &env.ns, &ApiResource::from_gvk(&gvk));
    let obj: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "velero.io/v1", "kind": "BackupRepository",
        "metadata": {
            "name": format!("{volume_namespace}-{LOCATION}-kopia"), "namespace": env.ns,
            "labels": {
                "velero.io/volume-namespace": volume_namespace,
                "velero.io/storage-location": LOCATION,
                "velero.io/repository-type": "kopia",
            },
        },
        "spec": {
            "volumeNamespace": volume_namespace, "backupStorageLocation": LOCATION,
            "repositoryType": "kopia", "resticIdentifier": "", "maintenanceFrequency": "1h0m0s",
        },
        "status": {"phase": phase},
    }))
    .unwrap();
    api.create(&PostParams::default(), &obj).await.unwrap();
}

/// A PodVolumeBackup as Velero 1.17+'s server creates it for a pod volume.
async fn kopia_pvb(env: &Env, name: &str, pod: &k8s_openapi::api::core::v1::Pod, volume: &str) {
    env.create_pvb_with(
        name,
        pod,
        volume,
        NODE,
        json!({}),
        json!({
            "backupStorageLocation": LOCATION, "repoIdentifier": "", "uploaderType": "kopia",
            "tags": null,
        }),
    )
    .await;
}

fn kopia_agent_flags() -> Vec<String> {
    vec![
        format!("--kopia-binary={}", kopia_bin().display()),
        VELERO_DEFAULT.to_string(),
    ]
}

fn status(p: &PodVolumeBackup) -> podvolume_agent::crd::PodVolumeBackupStatus {
    p.status.clone().unwrap_or_default()
}

/// A Velero-1.17-shaped kopia PodVolumeBackup completes into the repository Velero made, filed
/// under Velero's identity with its pin and keep-everything policy; a second backup of the
/// volume finds the first as its parent (its files come from kopia's cache); the matching
/// PodVolumeRestore writes the data back byte for byte with the done file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn velero_117_kopia_backup_incremental_and_restore() {
    let env = Env::new(Flavour::Velero).await;
    let velero = VeleroKopia::new(&env).await;
    velero.create_repository(&env.app_ns);
    backup_repository(&env, &env.app_ns, "Ready").await;
    let (pod, dirs) = env.create_pod("kopia-src", NODE, &["data"]).await;
    let total = Env::fill(
        &dirs["data"],
        &[
            ("big.bin", 24 << 20),
            ("d/a.txt", 1234),
            ("d/e/b.txt", 56789),
        ],
    );
    let flags = kopia_agent_flags();
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let mut agent = env.start_agent(NODE, &flags);
    agent.wait_ready(LONG).await;

    kopia_pvb(&env, "pvb-k1", &pod, "data").await;
    let done = env
        .wait_pvb(
            "pvb-k1",
            &[Phase::Completed, Phase::Failed, Phase::Canceled],
            LONG,
        )
        .await;
    let st = status(&done);
    assert_eq!(st.phase, Some(Phase::Completed), "{st:?}\n{}", agent.logs());
    let id = st.snapshot_id.clone().unwrap();
    assert!(
        id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit()),
        "{id}"
    );
    let p = st.progress.clone().unwrap();
    assert_eq!((p.bytes_done, p.total_bytes), (total as i64, total as i64));

    // Where Velero looks, as Velero files it.
    let listed = velero.snapshots(&env.app_ns);
    assert_eq!(listed.len(), 1, "{listed:#?}");
    let m = &listed[0];
    assert_eq!(m["id"], id.as_str());
    let source = format!("snapshot-pod-volume/kopia/{}/kopia-src/data", env.app_ns);
    assert_eq!(m["source"]["userName"], "default");
    assert_eq!(m["source"]["host"], "default");
    assert_eq!(m["source"]["path"], source.as_str());
    assert_eq!(m["description"], "Kopia Uploader");
    assert_eq!(m["pins"], json!(["velero-pin"]));
    assert!(m.get("incomplete").is_none(), "{m}");
    // Velero's keep-everything policy on the source, so kopia's retention deletes nothing.
    let out = velero.kopia(&[
        "policy",
        "show",
        "--json",
        &format!("default@default:{source}"),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let policy: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(policy["retention"]["keepLatest"], 2147483647, "{policy}");
    assert_eq!(policy["retention"]["keepAnnual"], 2147483647, "{policy}");

    // A second backup of the volume: kopia's parent is the first (same source), so the
    // unchanged files come from its cache.
    std::fs::write(dirs["data"].join("new.txt"), b"a new file").unwrap();
    kopia_pvb(&env, "pvb-k2", &pod, "data").await;
    let done2 = env
        .wait_pvb(
            "pvb-k2",
            &[Phase::Completed, Phase::Failed, Phase::Canceled],
            LONG,
        )
        .await;
    let st2 = status(&done2);
    assert_eq!(
        st2.phase,
        Some(Phase::Completed),
        "{st2:?}\n{}",
        agent.logs()
    );
    let listed = velero.snapshots(&env.app_ns);
    let second = listed
        .iter()
        .find(|m| m["id"] == st2.snapshot_id.as_deref().unwrap())
        .expect("second snapshot listed");
    assert!(
        second["stats"]["cachedFiles"].as_u64().unwrap_or(0) >= 3,
        "unchanged files re-read: {second}"
    );
    assert!(
        second["stats"]["nonCachedFiles"]
            .as_u64()
            .unwrap_or(u64::MAX)
            <= 1,
        "{second}"
    );
    // Velero's incrementalBytes: all of the first backup, only the new 10-byte file (kopia
    // prints it exactly, "10 B") the second time.
    assert_eq!(
        st.incremental_bytes,
        st.progress.as_ref().map(|p| p.total_bytes),
        "{st:?}"
    );
    assert_eq!(st2.incremental_bytes, Some(10), "{st2:?}");

    // The restore, as Velero 1.17+ creates it (no repoIdentifier, uploaderSettings).
    let (dst_pod, dst) = env.create_pod("kopia-dst", NODE, &["data"]).await;
    let restore = env.create_restore("r1").await;
    let pvr: PodVolumeRestore = serde_json::from_value(json!({
        "apiVersion": "velero.io/v1", "kind": "PodVolumeRestore",
        "metadata": {
            "name": "pvr-k", "namespace": env.ns,
            "ownerReferences": [restore.owner_reference()],
        },
        "spec": {
            "pod": {"kind": "Pod", "namespace": env.app_ns, "name": "kopia-dst", "uid": dst_pod.metadata.uid},
            "volume": "data", "backupStorageLocation": LOCATION, "repoIdentifier": "",
            "snapshotID": id, "sourceNamespace": env.app_ns, "uploaderType": "kopia",
            "uploaderSettings": {"WriteSparseFiles": "false", "ParallelFilesDownload": "2"},
        },
    }))
    .unwrap();
    env.pvrs()
        .create(&PostParams::default(), &pvr)
        .await
        .unwrap();
    let r = env
        .wait_pvr(
            "pvr-k",
            &[Phase::Completed, Phase::Failed, Phase::Canceled],
            LONG,
        )
        .await;
    let rst = r.status.clone().unwrap();
    assert_eq!(
        rst.phase,
        Some(Phase::Completed),
        "{rst:?}\n{}",
        agent.logs()
    );
    for f in ["big.bin", "d/a.txt", "d/e/b.txt"] {
        assert_eq!(
            std::fs::read(dirs["data"].join(f)).unwrap(),
            std::fs::read(dst["data"].join(f)).unwrap(),
            "{f}"
        );
    }
    assert!(
        !dst["data"].join("new.txt").exists(),
        "the first snapshot was restored"
    );
    assert!(dst["data"].join(".velero").join(&restore.uid).is_file());
    let rp = rst.progress.unwrap();
    assert_eq!(
        (rp.bytes_done, rp.total_bytes),
        (total as i64, total as i64)
    );
    // No key of the location anywhere the agent writes.
    let keys = velero.s3.keys("velero");
    let logs = agent.logs();
    // One kopia connection for the three transfers: the location's CA and credentials are
    // written anew for each operation, and the same content is the same connection.
    assert_eq!(logs.matches(" repository connect ").count(), 1, "{logs}");
    assert!(
        !logs.contains(&keys.secret_access_key),
        "secret key in the log"
    );
    for o in [&done, &done2] {
        let text = serde_json::to_string(o).unwrap();
        assert!(!text.contains(&keys.secret_access_key));
    }
    assert!(
        env.uploader_processes().is_empty(),
        "{:?}",
        env.uploader_processes()
    );
    env.cleanup().await;
}

/// A repository Velero has not made is not made by the agent: no BackupRepository, one that is
/// not Ready, or a Ready one whose repository is not in the bucket: each Failed with the cause,
/// nothing written to the bucket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kopia_repository_velero_did_not_create_fails_and_is_not_created() {
    let env = Env::new(Flavour::Velero).await;
    let velero = VeleroKopia::new(&env).await;
    let (pod, dirs) = env.create_pod("kopia-none", NODE, &["data"]).await;
    Env::fill(&dirs["data"], &[("a.bin", 1 << 20)]);
    let flags = kopia_agent_flags();
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let mut agent = env.start_agent(NODE, &flags);
    agent.wait_ready(LONG).await;

    kopia_pvb(&env, "pvb-norepo", &pod, "data").await;
    let done = env
        .wait_pvb(
            "pvb-norepo",
            &[Phase::Completed, Phase::Failed, Phase::Canceled],
            LONG,
        )
        .await;
    let st = status(&done);
    let message = st.message.clone().unwrap_or_default();
    assert_eq!(st.phase, Some(Phase::Failed), "{st:?}");
    assert!(
        message.contains("BackupRepository") && message.contains("does not exist"),
        "{message}"
    );

    backup_repository(&env, &env.app_ns, "NotReady").await;
    kopia_pvb(&env, "pvb-notready", &pod, "data").await;
    let done = env
        .wait_pvb(
            "pvb-notready",
            &[Phase::Completed, Phase::Failed, Phase::Canceled],
            LONG,
        )
        .await;
    let message = status(&done).message.unwrap_or_default();
    assert_eq!(status(&done).phase, Some(Phase::Failed));
    assert!(message.contains("is NotReady, not Ready"), "{message}");

    // Ready, but nothing in the bucket (a wrong prefix, a wiped bucket).
    let gvk = GroupVersionKind::gvk("velero.io", "v1", "BackupRepository");
    let api: Api<DynamicObject> =
        Api::namespaced_with(env.client.clone(), &env.ns, &ApiResource::from_gvk(&gvk));
    api.patch(
        &format!("{}-{LOCATION}-kopia", env.app_ns),
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(json!({"status": {"phase": "Ready"}})),
    )
    .await
    .unwrap();
    kopia_pvb(&env, "pvb-empty", &pod, "data").await;
    let done = env
        .wait_pvb(
            "pvb-empty",
            &[Phase::Completed, Phase::Failed, Phase::Canceled],
            LONG,
        )
        .await;
    let message = status(&done).message.unwrap_or_default();
    assert_eq!(status(&done).phase, Some(Phase::Failed), "{message}");
    assert!(
        message.contains("does not create repositories"),
        "{message}"
    );
    assert_eq!(velero.objects(&env.app_ns), 0, "a repository was created");
    assert!(env.uploader_processes().is_empty());
    env.cleanup().await;
}

/// `spec.cancel` stops kopia as it stops restic: Canceling, then Canceled, no kopia left; the
/// partial snapshot kopia saves on SIGINT is not reported as the result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_mid_kopia_backup_ends_canceled_with_no_kopia_left() {
    let env = Env::new(Flavour::Velero).await;
    let velero = VeleroKopia::new(&env).await;
    velero.create_repository(&env.app_ns);
    backup_repository(&env, &env.app_ns, "Ready").await;
    let (pod, dirs) = env.create_pod("kopia-cancel", NODE, &["data"]).await;
    Env::fill(&dirs["data"], &[("a.bin", 1 << 20)]);
    // Long to hash and nothing to upload: kopia reads every zero of a 64 GiB sparse file, so it
    // is surely mid-snapshot when the cancel comes (kopia's progress counts bytes hashed, which
    // run ahead of the upload: a throttled upload can still end on its own before the cancel).
    std::fs::File::create(dirs["data"].join("huge.img"))
        .unwrap()
        .set_len(64 << 30)
        .unwrap();
    let flags = kopia_agent_flags();
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let mut agent = env.start_agent(NODE, &flags);
    agent.wait_ready(LONG).await;
    kopia_pvb(&env, "pvb-kcancel", &pod, "data").await;
    env.wait_moving("pvb-kcancel", &agent, LONG).await;
    assert!(
        !env.uploader_processes().is_empty(),
        "kopia should be running"
    );
    let rec = env.record(env.pvbs(), "pvb-kcancel");
    env.cancel_pvb("pvb-kcancel").await;
    let done = env
        .wait_pvb(
            "pvb-kcancel",
            &[Phase::Completed, Phase::Failed, Phase::Canceled],
            LONG,
        )
        .await;
    let st = status(&done);
    assert_eq!(st.phase, Some(Phase::Canceled), "{st:?}\n{}", agent.logs());
    assert_eq!(st.snapshot_id.as_deref().unwrap_or(""), "", "{st:?}");
    assert!(
        env.uploader_processes().is_empty(),
        "{:?}",
        env.uploader_processes()
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        rec.versions()
            .iter()
            .any(|v| v.status.as_ref().and_then(|s| s.phase) == Some(Phase::Canceling)),
        "Canceling was never shown"
    );
    // kopia saves a partial snapshot marked incomplete on our SIGINT: not the result, and
    // pinned for ever if left, so the agent deletes it and says so; nothing is left.
    let message = st.message.as_deref().unwrap_or("");
    assert!(
        message.contains("; the incomplete snapshot ")
            && message.ends_with(" kopia saved was deleted"),
        "{message}\n{}",
        agent.logs()
    );
    let listed = velero.snapshots(&env.app_ns);
    assert!(listed.is_empty(), "{listed:#?}");
    env.cleanup().await;
}

/// The kopia this run is labelled with is the one it runs; the log says which.
#[test]
fn kopia_under_test() {
    assert_requested_kopia_version();
}
