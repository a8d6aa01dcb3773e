//! Object storage as Velero configures it: BackupStorageLocations with their own credential
//! Secrets and CAs, against real S3 servers (moto behind TLS, see `tests/s3/`), and the agent's
//! refusal to create a repository Velero's server did not.

use std::time::Duration;

use k8s_openapi::api::core::v1::{Event, Secret};
use kube::Api;
use kube::api::{ListParams, PostParams};
use podvolume_agent::crd::{Phase, PodVolumeBackup, PodVolumeRestore};
use serde_json::json;

use crate::harness::*;
use crate::s3::S3Server;

const LONG: Duration = Duration::from_secs(180);

/// The default of `run`: no repository is ever created by the agent.
const VELERO_DEFAULT: &str = "--init-missing-repository=false";

async fn create_secret(env: &Env, name: &str, key: &str, value: &[u8]) {
    let secrets: Api<Secret> = Api::namespaced(env.client.clone(), &env.ns);
    let s: Secret = serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": env.ns},
        "data": {key: b64(value)},
    }))
    .unwrap();
    secrets.create(&PostParams::default(), &s).await.unwrap();
}

/// An `aws` location on `server`'s `bucket`, as `velero install` writes one for MinIO.
fn s3_location(server: &S3Server, bucket: &str, provider: &str) -> serde_json::Value {
    json!({
        "provider": provider,
        "objectStorage": {"bucket": bucket},
        "config": {"region": "us-east-1", "s3ForcePathStyle": "true", "s3Url": server.endpoint()},
    })
}

async fn backup_into(
    env: &Env,
    name: &str,
    pod: &k8s_openapi::api::core::v1::Pod,
    volume: &str,
    location: &str,
    repo: &str,
) {
    env.create_pvb_with(
        name,
        pod,
        volume,
        NODE,
        json!({}),
        json!({"backupStorageLocation": location, "repoIdentifier": repo}),
    )
    .await;
}

async fn ended(env: &Env, name: &str) -> PodVolumeBackup {
    env.wait_pvb(
        name,
        &[Phase::Completed, Phase::Failed, Phase::Canceled],
        LONG,
    )
    .await
}

fn phase_and_message(p: &PodVolumeBackup) -> (Option<Phase>, String) {
    let st = p.status.clone().unwrap_or_default();
    (st.phase, st.message.unwrap_or_default())
}

/// Everything the agent and the API server show about the test: the agent's whole log, every
/// PVB/PVR and Event of the namespace.
async fn everything_shown(env: &Env, agent: &Agent) -> String {
    let mut all = agent.logs();
    let pvbs = env.pvbs().list(&ListParams::default()).await.unwrap();
    all.push_str(&serde_json::to_string(&pvbs.items).unwrap());
    let pvrs = env.pvrs().list(&ListParams::default()).await.unwrap();
    all.push_str(&serde_json::to_string(&pvrs.items).unwrap());
    let events: Api<Event> = Api::namespaced(env.client.clone(), &env.ns);
    let ev = events.list(&ListParams::default()).await.unwrap();
    all.push_str(&serde_json::to_string(&ev.items).unwrap());
    let events: Api<k8s_openapi::api::events::v1::Event> =
        Api::namespaced(env.client.clone(), &env.ns);
    let ev = events.list(&ListParams::default()).await.unwrap();
    assert!(!ev.items.is_empty() || !all.is_empty());
    all.push_str(&serde_json::to_string(&ev.items).unwrap());
    if let Some((200, body)) = agent.http_get("/metrics").await {
        all.push_str(&body);
    }
    all
}

/// Two locations on two S3 servers with different CAs, each with its own credentials Secret
/// whose user may use only its own bucket: a PVB for each Completes into its own bucket, a PVR
/// from one restores byte for byte, the credentials files are gone afterwards, and no secret
/// value appears anywhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_locations_with_their_own_credentials_and_cas() {
    let env = Env::new(Flavour::Velero).await;
    let sa = S3Server::start(&[("alice", &["bkt-a"])]);
    let sb = S3Server::start(&[("bob", &["bkt-b"])]);
    let repo_a = sa.repo("bkt-a", &format!("restic/{}", env.app_ns));
    let repo_b = sb.repo("bkt-b", &format!("restic/{}", env.app_ns));
    // Velero's server creates the repositories (BackupRepository) before any PVB.
    for (s, user, repo) in [(&sa, "alice", &repo_a), (&sb, "bob", &repo_b)] {
        let out = s.restic(user, repo, &env.password_file, &["init"]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // Location a: the deprecated inline caCert; location b: caCertRef.
    create_secret(
        &env,
        "creds-a",
        "cloud",
        sa.keys("alice").credentials_file().as_bytes(),
    )
    .await;
    create_secret(
        &env,
        "creds-b",
        "cloud",
        sb.keys("bob").credentials_file().as_bytes(),
    )
    .await;
    create_secret(&env, "ca-b", "ca.crt", &std::fs::read(&sb.ca_pem).unwrap()).await;
    let mut spec_a = s3_location(&sa, "bkt-a", "aws");
    spec_a["credential"] = json!({"name": "creds-a", "key": "cloud"});
    spec_a["objectStorage"]["caCert"] = json!(b64(&std::fs::read(&sa.ca_pem).unwrap()));
    create_storage_location(&env.client, &env.ns, "loc-a", spec_a).await;
    let mut spec_b = s3_location(&sb, "bkt-b", "velero.io/aws");
    spec_b["credential"] = json!({"name": "creds-b", "key": "cloud"});
    spec_b["objectStorage"]["caCertRef"] = json!({"name": "ca-b", "key": "ca.crt"});
    create_storage_location(&env.client, &env.ns, "loc-b", spec_b).await;

    let (pod, dirs) = env.create_pod("s3-pod", NODE, &["va", "vb"]).await;
    let total_a = Env::fill(&dirs["va"], &[("a.bin", 2 << 20), ("d/a.txt", 321)]);
    let total_b = Env::fill(&dirs["vb"], &[("b.bin", 3 << 20), ("d/b.txt", 4321)]);
    let scratch = env.tmp.path().join(format!("scratch-{NODE}"));
    let mut agent = env.start_agent(NODE, &[VELERO_DEFAULT]);
    agent.wait_ready(LONG).await;
    backup_into(&env, "pvb-a", &pod, "va", "loc-a", &repo_a).await;
    backup_into(&env, "pvb-b", &pod, "vb", "loc-b", &repo_b).await;
    let mut ids = Vec::new();
    for (name, s, user, repo, total) in [
        ("pvb-a", &sa, "alice", &repo_a, total_a),
        ("pvb-b", &sb, "bob", &repo_b, total_b),
    ] {
        let done = ended(&env, name).await;
        let (phase, msg) = phase_and_message(&done);
        assert_eq!(
            phase,
            Some(Phase::Completed),
            "{name}: {msg}\n{}",
            agent.logs()
        );
        let st = done.status.clone().unwrap();
        let id = st.snapshot_id.clone().unwrap();
        assert_eq!(st.progress.unwrap().bytes_done, total as i64);
        // In its own bucket, where Velero will look.
        let listed = s.snapshots(user, repo, &env.password_file);
        assert_eq!(listed.len(), 1, "{name}: {listed:?}");
        assert!(listed[0].starts_with(&id), "{listed:?} vs {id}");
        ids.push(id);
    }

    // A restore from location b, byte for byte.
    let (dst_pod, dst) = env.create_pod("s3-dst", NODE, &["vb"]).await;
    let restore = env.create_restore("r1").await;
    let pvr: PodVolumeRestore = serde_json::from_value(json!({
        "apiVersion": "velero.io/v1", "kind": "PodVolumeRestore",
        "metadata": {
            "name": "pvr-b", "namespace": env.ns,
            "ownerReferences": [restore.owner_reference()],
        },
        "spec": {
            "pod": {"kind": "Pod", "namespace": env.app_ns, "name": "s3-dst", "uid": dst_pod.metadata.uid},
            "volume": "vb", "backupStorageLocation": "loc-b", "repoIdentifier": repo_b,
            "snapshotID": ids[1], "sourceNamespace": env.app_ns, "uploaderType": "restic",
        },
    }))
    .unwrap();
    env.pvrs()
        .create(&PostParams::default(), &pvr)
        .await
        .unwrap();
    let r = env
        .wait_pvr(
            "pvr-b",
            &[Phase::Completed, Phase::Failed, Phase::Canceled],
            LONG,
        )
        .await;
    let st = r.status.clone().unwrap();
    assert_eq!(st.phase, Some(Phase::Completed), "{st:?}\n{}", agent.logs());
    for f in ["b.bin", "d/b.txt"] {
        assert_eq!(
            std::fs::read(dirs["vb"].join(f)).unwrap(),
            std::fs::read(dst["vb"].join(f)).unwrap(),
            "{f}"
        );
    }

    // The operations' credentials files went with them.
    let ops = scratch.join("credentials/operations");
    let left: Vec<_> = std::fs::read_dir(&ops)
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "left behind: {left:?}");
    let shown = everything_shown(&env, &agent).await;
    for keys in [sa.keys("alice"), sb.keys("bob")] {
        assert!(
            !shown.contains(&keys.secret_access_key),
            "a secret key was shown"
        );
        assert!(
            !shown.contains(&keys.access_key_id),
            "an access key id was shown"
        );
    }
    env.cleanup().await;
}

/// What goes wrong with a location ends the PVB Failed with the cause, naming the object and
/// never a secret: no such location, no such Secret, credentials the server refuses, the CA
/// removed, a repository that does not exist (not created: it is not the agent's to create).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn location_failures_end_failed_with_the_cause() {
    let env = Env::new(Flavour::Velero).await;
    let s = S3Server::start(&[("alice", &["bkt-a"]), ("bob", &["bkt-b"])]);
    let repo = s.repo("bkt-a", &format!("restic/{}", env.app_ns));
    let out = s.restic("alice", &repo, &env.password_file, &["init"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ca = b64(&std::fs::read(&s.ca_pem).unwrap());
    create_secret(
        &env,
        "creds-alice",
        "cloud",
        s.keys("alice").credentials_file().as_bytes(),
    )
    .await;
    create_secret(
        &env,
        "creds-bob",
        "cloud",
        s.keys("bob").credentials_file().as_bytes(),
    )
    .await;
    let unknown = "[default]\naws_access_key_id = AKIAUNKNOWNKEY000000\naws_secret_access_key = zzUnknownSecretValue\n";
    create_secret(&env, "creds-unknown", "cloud", unknown.as_bytes()).await;
    let location = |creds: &str, with_ca: bool| {
        let mut spec = s3_location(&s, "bkt-a", "aws");
        spec["credential"] = json!({"name": creds, "key": "cloud"});
        if with_ca {
            spec["objectStorage"]["caCert"] = json!(ca);
        }
        spec
    };
    create_storage_location(&env.client, &env.ns, "good", location("creds-alice", true)).await;
    create_storage_location(&env.client, &env.ns, "no-secret", location("absent", true)).await;
    create_storage_location(&env.client, &env.ns, "no-key", {
        let mut l = location("creds-alice", true);
        l["credential"]["key"] = json!("other");
        l
    })
    .await;
    create_storage_location(
        &env.client,
        &env.ns,
        "unknown-key",
        location("creds-unknown", true),
    )
    .await;
    create_storage_location(
        &env.client,
        &env.ns,
        "other-user",
        location("creds-bob", true),
    )
    .await;
    create_storage_location(
        &env.client,
        &env.ns,
        "no-ca",
        location("creds-alice", false),
    )
    .await;
    create_storage_location(&env.client, &env.ns, "bad-pem", {
        let mut l = location("creds-alice", true);
        l["objectStorage"]["caCert"] = json!(b64(b"not a certificate"));
        l
    })
    .await;

    let (pod, dirs) = env.create_pod("fail-pod", NODE, &["data"]).await;
    Env::fill(&dirs["data"], &[("a.bin", 100_000)]);
    let mut agent = env.start_agent(NODE, &[VELERO_DEFAULT]);
    agent.wait_ready(LONG).await;
    let missing_repo = s.repo("bkt-a", "restic/never-created");
    let ns = env.ns.clone();
    let cases: Vec<(&str, &str, String, Vec<String>)> = vec![
        ("pvb-good", "good", repo.clone(), vec![]),
        (
            "pvb-no-bsl",
            "nowhere",
            repo.clone(),
            vec![format!("BackupStorageLocation {ns}/nowhere not found")],
        ),
        (
            "pvb-no-secret",
            "no-secret",
            repo.clone(),
            vec![format!("Secret {ns}/absent (spec.credential) not found")],
        ),
        (
            "pvb-no-key",
            "no-key",
            repo.clone(),
            vec![format!("Secret {ns}/creds-alice has no key \"other\"")],
        ),
        (
            "pvb-unknown-key",
            "unknown-key",
            repo.clone(),
            vec!["The AWS Access Key Id you provided does not exist in our records".into()],
        ),
        (
            "pvb-other-user",
            "other-user",
            repo.clone(),
            vec!["Access Denied".into()],
        ),
        (
            "pvb-no-ca",
            "no-ca",
            repo.clone(),
            vec!["x509: certificate signed by unknown authority".into()],
        ),
        (
            "pvb-bad-pem",
            "bad-pem",
            repo.clone(),
            vec![
                "BackupStorageLocation".into(),
                "caCert holds no PEM certificate".into(),
            ],
        ),
        (
            "pvb-no-repo",
            "good",
            missing_repo.clone(),
            vec![
                format!("no repository at {missing_repo}"),
                "The specified key does not exist".into(),
                "does not exist. The node agent does not create repositories".into(),
            ],
        ),
    ];
    for (name, loc, r, _) in &cases {
        backup_into(&env, name, &pod, "data", loc, r).await;
    }
    for (name, _, _, words) in &cases {
        let done = ended(&env, name).await;
        let (phase, msg) = phase_and_message(&done);
        eprintln!("{name}: {phase:?}: {msg}");
        if words.is_empty() {
            assert_eq!(phase, Some(Phase::Completed), "{name}: {msg}");
            continue;
        }
        assert_eq!(phase, Some(Phase::Failed), "{name}: {msg}");
        for w in words {
            assert!(msg.contains(w.as_str()), "{name}: {w:?} not in {msg:?}");
        }
    }
    // Not created behind Velero's back: still nothing at that location.
    let probe = s.restic(
        "alice",
        &missing_repo,
        &env.password_file,
        &["cat", "config"],
    );
    assert!(!probe.status.success());
    assert!(
        String::from_utf8_lossy(&probe.stderr).contains("The specified key does not exist"),
        "{}",
        String::from_utf8_lossy(&probe.stderr)
    );
    let shown = everything_shown(&env, &agent).await;
    for secret in [
        s.keys("alice").secret_access_key.as_str(),
        s.keys("bob").secret_access_key.as_str(),
        s.keys("alice").access_key_id.as_str(),
        "zzUnknownSecretValue",
    ] {
        assert!(!shown.contains(secret), "a secret value was shown");
    }
    env.cleanup().await;
}

/// The data-loss defect: a repository path that does not exist inside the agent (Velero's server
/// initialised it elsewhere) must not be created in the agent's own filesystem. Created only with
/// `--init-missing-repository`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_repository_is_created_only_when_asked() {
    let env = Env::new(Flavour::Velero).await;
    let (pod, dirs) = env.create_pod("init-pod", NODE, &["data"]).await;
    Env::fill(&dirs["data"], &[("a.bin", 100_000)]);
    let mut agent = env.start_agent(NODE, &[VELERO_DEFAULT]);
    agent.wait_ready(LONG).await;
    env.create_pvb("pvb-refused", &pod, "data", NODE).await;
    let done = ended(&env, "pvb-refused").await;
    let (phase, msg) = phase_and_message(&done);
    assert_eq!(phase, Some(Phase::Failed), "{msg}");
    assert!(
        msg.contains(&format!("no repository at {}", env.repo.display())),
        "{msg}"
    );
    assert!(msg.contains("--init-missing-repository"), "{msg}");
    assert!(
        !env.repo.exists(),
        "the agent created {}",
        env.repo.display()
    );
    drop(agent);

    let mut agent = env.start_agent(NODE, &["--init-missing-repository"]);
    agent.wait_ready(LONG).await;
    env.create_pvb("pvb-created", &pod, "data", NODE).await;
    let done = ended(&env, "pvb-created").await;
    let (phase, msg) = phase_and_message(&done);
    assert_eq!(phase, Some(Phase::Completed), "{msg}\n{}", agent.logs());
    assert_eq!(env.restic_snapshots().len(), 1);
    env.cleanup().await;
}
