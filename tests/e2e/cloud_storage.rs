//! Azure and GCS locations as Velero configures them, against real servers (Azurite and
//! fake-gcs-server behind TLS with a private CA, see `tests/cloud/`): kopia PodVolumeBackups of
//! Velero 1.17+'s shape into the repositories Velero's server made at `<prefix>/kopia/<ns>/`, and
//! the locations a node cannot use ending Failed with the real cause, nothing written.
//!
//! The agent runs in a mount namespace whose /etc/hosts resolves the Azure account's name (the
//! production URL form `https://<account>.blob.<domain>`, which is the only one the uploaders
//! address), with `STORAGE_EMULATOR_HOST` for GCS (Velero's kopia path has no GCS endpoint
//! setting; Google's Go client reads that variable in Velero's server and in kopia alike).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use kube::Api;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind, PostParams};
use podvolume_agent::crd::{Phase, PodVolumeBackup};
use serde_json::json;

use crate::cloud::{AZURE_DOMAIN, Azurite, FakeGcs};
use crate::harness::*;

const LONG: Duration = Duration::from_secs(180);
const KEY_VAR: &str = "AZURE_STORAGE_ACCOUNT_ACCESS_KEY";

async fn secret(env: &Env, name: &str, value: &str) {
    let api: Api<Secret> = Api::namespaced(env.client.clone(), &env.ns);
    let s: Secret = serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": env.ns},
        "data": {"cloud": b64(value.as_bytes())},
    }))
    .unwrap();
    api.create(&PostParams::default(), &s).await.unwrap();
}

/// A Ready BackupRepository of `location`, as Velero's server leaves it once it made the
/// repository.
async fn ready_repository(env: &Env, location: &str) {
    let gvk = GroupVersionKind::gvk("velero.io", "v1", "BackupRepository");
    let api: Api<DynamicObject> =
        Api::namespaced_with(env.client.clone(), &env.ns, &ApiResource::from_gvk(&gvk));
    let obj: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "velero.io/v1", "kind": "BackupRepository",
        "metadata": {
            "name": format!("{}-{location}-kopia", env.app_ns), "namespace": env.ns,
            "labels": {
                "velero.io/volume-namespace": env.app_ns,
                "velero.io/storage-location": location,
                "velero.io/repository-type": "kopia",
            },
        },
        "spec": {
            "volumeNamespace": env.app_ns, "backupStorageLocation": location,
            "repositoryType": "kopia", "resticIdentifier": "", "maintenanceFrequency": "1h0m0s",
        },
        "status": {"phase": "Ready"},
    }))
    .unwrap();
    api.create(&PostParams::default(), &obj).await.unwrap();
}

/// The system's roots and `ca`: what Velero's server trusts with the location's caCert.
fn bundle(dir: &Path, ca: &Path) -> PathBuf {
    let mut b = std::fs::read("/etc/ssl/certs/ca-certificates.crt").unwrap_or_default();
    b.extend(std::fs::read(ca).unwrap());
    let p = dir.join("bundle.pem");
    std::fs::write(&p, b).unwrap();
    p
}

/// `kopia repository create` at `prefix` as Velero's server does (its identity, no
/// maintenance by the node), through `cmd` (the program is kopia, its environment set).
fn create_repository(mut cmd: Command, env: &Env, storage: &[String], prefix: &str, tag: &str) {
    let dir = env.tmp.path().join(format!("velero-kopia-{tag}"));
    std::fs::create_dir_all(&dir).unwrap();
    let out = cmd
        .args(["repository", "create"])
        .args(storage)
        .arg(format!("--prefix={prefix}"))
        .args([
            "--override-username=default",
            "--override-hostname=default",
            "--no-auto-maintenance",
        ])
        .env("KOPIA_CONFIG_PATH", dir.join("repository.config"))
        .env("KOPIA_LOG_DIR", dir.join("logs"))
        .env("KOPIA_CHECK_FOR_UPDATES", "false")
        .env(
            "KOPIA_PASSWORD",
            std::fs::read_to_string(&env.password_file).unwrap().trim(),
        )
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "kopia repository create ({tag}): {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

async fn kopia_pvb(env: &Env, name: &str, pod: &k8s_openapi::api::core::v1::Pod, location: &str) {
    env.create_pvb_with(
        name,
        pod,
        "data",
        NODE,
        json!({}),
        json!({"backupStorageLocation": location, "repoIdentifier": "", "uploaderType": "kopia", "tags": null}),
    )
    .await;
}

fn outcome(p: &PodVolumeBackup) -> (Option<Phase>, String, Option<String>) {
    let st = p.status.clone().unwrap_or_default();
    (st.phase, st.message.unwrap_or_default(), st.snapshot_id)
}

/// Good Azure and GCS locations Complete into Velero's repositories; a wrong account key, a
/// credentials file without the entry config.storageAccountKeyEnvVar names, a missing container
/// or bucket, a location without the CA that signs the server, and Azure AD (which the uploaders
/// cannot use) each end Failed with the cause, no key in any message, and nothing written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn azure_and_gcs_locations_complete_or_fail_with_the_cause() {
    let env = Env::new(Flavour::Velero).await;
    let az = Azurite::start(&["velero"]);
    let gcs = FakeGcs::start(&["velero-gcs"]);
    let az_ca = b64(&std::fs::read(&az.ca_pem).unwrap());
    let gcs_ca = b64(&std::fs::read(&gcs.ca_pem).unwrap());
    let ns = env.app_ns.clone();

    // Velero's server made the repositories of the good locations and of those whose only fault
    // is on the node's side (its prefix per location).
    let az_bundle = bundle(az.dir.path(), &az.ca_pem);
    let az_storage = vec![
        "azure".to_string(),
        "--container=velero".into(),
        format!("--storage-account={}", az.account),
        format!("--storage-domain={AZURE_DOMAIN}:{}", az.port),
    ];
    for loc in ["az-good", "az-wrong-key", "az-no-entry", "az-no-ca"] {
        let mut c = az.command(kopia_bin());
        c.env("AZURE_STORAGE_KEY", &az.key)
            .env("SSL_CERT_FILE", &az_bundle);
        create_repository(c, &env, &az_storage, &format!("{loc}/kopia/{ns}/"), loc);
    }
    let gcs_bundle = bundle(gcs.dir.path(), &gcs.ca_pem);
    let gcs_storage = vec![
        "gcs".to_string(),
        "--bucket=velero-gcs".into(),
        format!("--credentials-file={}", gcs.service_account.display()),
    ];
    for loc in ["gcs-good", "gcs-no-ca"] {
        let mut c = Command::new(kopia_bin());
        c.env("STORAGE_EMULATOR_HOST", gcs.emulator_host())
            .env("SSL_CERT_FILE", &gcs_bundle);
        create_repository(c, &env, &gcs_storage, &format!("{loc}/kopia/{ns}/"), loc);
    }

    let good_file = format!("{KEY_VAR}={}\nAZURE_CLOUD_NAME=AzurePublicCloud\n", az.key);
    let wrong_key = {
        let mut k = az.key.clone().into_bytes();
        k[0] = if k[0] == b'A' { b'B' } else { b'A' };
        String::from_utf8(k).unwrap()
    };
    secret(&env, "az-creds", &good_file).await;
    secret(&env, "az-wrong", &format!("{KEY_VAR}={wrong_key}\n")).await;
    secret(
        &env,
        "az-no-entry",
        "AZURE_SUBSCRIPTION_ID=00000000\nAZURE_RESOURCE_GROUP=rg\n",
    )
    .await;
    secret(
        &env,
        "az-aad",
        "AZURE_TENANT_ID=t\nAZURE_CLIENT_ID=c\nAZURE_CLIENT_SECRET=aadS3cretValue\n",
    )
    .await;
    secret(
        &env,
        "gcs-creds",
        &std::fs::read_to_string(&gcs.service_account).unwrap(),
    )
    .await;
    let azure = |bucket: &str, prefix: &str, creds: &str, ca: bool, aad: bool| {
        let mut config = json!({
            "storageAccount": az.account, "storageAccountURI": az.account_uri(),
            "resourceGroup": "rg", "subscriptionId": "00000000",
        });
        if aad {
            config["useAAD"] = json!("true");
        } else {
            config["storageAccountKeyEnvVar"] = json!(KEY_VAR);
        }
        let mut spec = json!({
            "provider": "velero.io/azure",
            "objectStorage": {"bucket": bucket, "prefix": prefix},
            "config": config,
            "credential": {"name": creds, "key": "cloud"},
        });
        if ca {
            spec["objectStorage"]["caCert"] = json!(az_ca);
        }
        spec
    };
    let google = |bucket: &str, prefix: &str, ca: bool| {
        let mut spec = json!({
            "provider": "velero.io/gcp",
            "objectStorage": {"bucket": bucket, "prefix": prefix},
            "credential": {"name": "gcs-creds", "key": "cloud"},
        });
        if ca {
            spec["objectStorage"]["caCert"] = json!(gcs_ca);
        }
        spec
    };
    let locations = [
        (
            "az-good",
            azure("velero", "az-good", "az-creds", true, false),
        ),
        (
            "az-wrong-key",
            azure("velero", "az-wrong-key", "az-wrong", true, false),
        ),
        (
            "az-no-entry",
            azure("velero", "az-no-entry", "az-no-entry", true, false),
        ),
        (
            "az-no-container",
            azure("missing", "p", "az-creds", true, false),
        ),
        (
            "az-no-ca",
            azure("velero", "az-no-ca", "az-creds", false, false),
        ),
        ("az-aad", azure("velero", "az-aad", "az-aad", true, true)),
        ("gcs-good", google("velero-gcs", "gcs-good", true)),
        ("gcs-no-bucket", google("missing", "p", true)),
        ("gcs-no-ca", google("velero-gcs", "gcs-no-ca", false)),
    ];
    for (name, spec) in &locations {
        create_storage_location(&env.client, &env.ns, name, spec.clone()).await;
        ready_repository(&env, name).await;
    }
    let blobs_before = az.blobs("velero", "");
    let objects_before = gcs.objects("velero-gcs", "");

    let (pod, dirs) = env.create_pod("cloud-pod", NODE, &["data"]).await;
    Env::fill(&dirs["data"], &[("a.bin", 2 << 20), ("sub/b.bin", 70_000)]);
    let flags = [
        format!("--kopia-binary={}", kopia_bin().display()),
        "--init-missing-repository=false".to_string(),
    ];
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let mut agent = env.start_agent_wrapped(
        NODE,
        &flags,
        KubeconfigVia::Flag,
        &az.wrapper(),
        &[("STORAGE_EMULATOR_HOST", gcs.emulator_host())],
    );
    agent.wait_ready(LONG).await;

    let expected: &[(&str, &[&str])] = &[
        ("az-good", &[]),
        ("az-wrong-key", &["AuthorizationFailure"]),
        (
            "az-no-entry",
            &[&format!("the credentials file has no {KEY_VAR}")],
        ),
        ("az-no-container", &["ContainerNotFound"]),
        (
            "az-no-ca",
            &["x509: certificate signed by unknown authority"],
        ),
        (
            "az-aad",
            &["config.useAAD is true", "config.storageAccountKeyEnvVar"],
        ),
        ("gcs-good", &[]),
        ("gcs-no-bucket", &["bucket doesn't exist"]),
        (
            "gcs-no-ca",
            &["x509: certificate signed by unknown authority"],
        ),
    ];
    for (loc, _) in expected {
        kopia_pvb(&env, &format!("pvb-{loc}"), &pod, loc).await;
    }
    let mut report = Vec::new();
    for (loc, words) in expected {
        let done = env
            .wait_pvb(
                &format!("pvb-{loc}"),
                &[Phase::Completed, Phase::Failed, Phase::Canceled],
                LONG,
            )
            .await;
        let (phase, message, snapshot) = outcome(&done);
        report.push(format!("{loc}: {phase:?} {message}"));
        if words.is_empty() {
            assert_eq!(
                phase,
                Some(Phase::Completed),
                "{loc}: {message}\n{}",
                agent.logs()
            );
            assert!(snapshot.is_some_and(|s| s.len() == 32), "{loc}");
        } else {
            assert_eq!(phase, Some(Phase::Failed), "{loc}: {message}");
            for w in *words {
                assert!(message.contains(w), "{loc}: {message:?} lacks {w:?}");
            }
        }
        for secret_value in [az.key.as_str(), wrong_key.as_str(), "aadS3cretValue"] {
            assert!(
                !message.contains(secret_value),
                "{loc}: a key in the message"
            );
        }
    }
    eprintln!("{}", report.join("\n"));
    assert!(
        !agent.logs().contains(&az.key),
        "the account key was logged"
    );

    // The good ones wrote snapshots under their own prefixes; nothing else changed.
    let blobs_after = az.blobs("velero", "");
    let new: Vec<&String> = blobs_after
        .iter()
        .filter(|b| !blobs_before.contains(b))
        .collect();
    assert!(!new.is_empty());
    assert!(
        new.iter()
            .all(|b| b.starts_with(&format!("az-good/kopia/{ns}/"))),
        "written outside the good location's repository: {new:?}"
    );
    assert!(
        az.container("list", "missing", "").is_err(),
        "a container was created"
    );
    let objects_after = gcs.objects("velero-gcs", "");
    let new: Vec<&String> = objects_after
        .iter()
        .filter(|o| !objects_before.contains(o))
        .collect();
    assert!(!new.is_empty());
    assert!(
        new.iter()
            .all(|o| o.starts_with(&format!("gcs-good/kopia/{ns}/"))),
        "written outside the good location's repository: {new:?}"
    );
}
