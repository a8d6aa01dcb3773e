//! Azure Blob and Google Cloud Storage through the one-shot CLI: the real binary, the real
//! kopia and restic against real servers (Azurite and fake-gcs-server, see `tests/cloud/`) on
//! loopback behind TLS with a CA made for the test. What each run wrote is listed from the
//! server: the repository lies at the prefix given, nowhere else.
//!
//! restic is `PODVOLUME_CLOUD_RESTIC` (built with every backend by scripts/install-restic.sh).
//! Against Azurite, restic runs with `--restic-option azure.access-tier=Hot`: restic 0.18 sends
//! an empty `x-ms-access-tier` header when no tier is set, which Azurite rejects
//! (`InvalidHeaderValue`) and Azure accepts.

#[path = "cloud/mod.rs"]
mod cloud;
mod common;
#[path = "s3/mod.rs"]
mod s3;

use std::path::Path;
use std::process::{Command, Output, Stdio};

use cloud::{Azurite, FakeGcs};
use common::*;

#[test]
fn kopia_under_test_is_the_requested_version() {
    assert_requested_kopia_version();
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).to_string()
}

fn files_equal(a: &Path, b: &Path) {
    for name in ["a.bin", "sub/b.bin"] {
        assert_eq!(
            std::fs::read(a.join(name)).unwrap(),
            std::fs::read(b.join(name)).unwrap(),
            "{name} differs"
        );
    }
}

fn data(bed: &Bed) {
    write_random(&bed.source.join("a.bin"), 3 << 20, 1);
    write_random(&bed.source.join("sub/b.bin"), 200_000, 2);
}

/// `c` without the caller's credentials or settings.
fn clean(c: &mut Command) {
    for v in [
        "PODVOLUME_CACERT",
        "PODVOLUME_INSECURE_TLS",
        "RESTIC_OPTIONS",
        "GOOGLE_APPLICATION_CREDENTIALS",
        "GOOGLE_ACCESS_TOKEN",
        "STORAGE_EMULATOR_HOST",
        "SSL_CERT_FILE",
        "AZURE_ACCOUNT_NAME",
        "AZURE_ACCOUNT_KEY",
        "AZURE_ACCOUNT_SAS",
        "AZURE_ENDPOINT_SUFFIX",
        "AZURE_STORAGE_ACCOUNT",
        "AZURE_STORAGE_KEY",
        "AZURE_STORAGE_DOMAIN",
    ] {
        c.env_remove(v);
    }
}

/// `c` (cleaned, its environment set) with the common arguments.
fn agent(mut c: Command, bed: &Bed, uploader: &str, repo: &str, args: &[&str]) -> Output {
    c.args(args)
        .arg("--repo")
        .arg(repo)
        .arg("--password-file")
        .arg(&bed.password_file)
        .arg("--cache-dir")
        .arg(&bed.cache)
        .arg(format!("--uploader={uploader}"))
        .arg(format!("--kopia-binary={}", kopia_bin().display()))
        .env("RESTIC_BINARY", cloud::cloud_restic())
        .stdin(Stdio::null());
    c.output().unwrap()
}

/// `podvolume-agent <args>` against Azurite with `key` as the account key.
fn azure_cli(
    az: &Azurite,
    key: &str,
    bed: &Bed,
    uploader: &str,
    repo: &str,
    args: &[&str],
) -> Output {
    let mut c = az.command(&agent_bin());
    clean(&mut c);
    c.env("AZURE_ACCOUNT_NAME", &az.account)
        .env("AZURE_ACCOUNT_KEY", key)
        .env("AZURE_ENDPOINT_SUFFIX", az.endpoint_suffix());
    let mut all = args.to_vec();
    if uploader == "restic" {
        all.push("--restic-option=azure.access-tier=Hot");
    }
    agent(c, bed, uploader, repo, &all)
}

/// The snapshot ID a `backup` printed last on stdout.
fn snapshot_id(out: &Output) -> String {
    text(&out.stdout)
        .lines()
        .last()
        .unwrap_or_default()
        .trim()
        .to_string()
}

/// A backup and a restore byte for byte with each uploader over TLS with the test's CA; the
/// repository's blobs are under the prefix given (Velero's `<prefix>/kopia|restic/<ns>/`), and
/// the key never reaches argv or the output.
#[test]
fn azure_backup_and_restore_with_kopia_and_restic_over_tls() {
    let az = Azurite::start(&["velero"]);
    let ca = az.ca_pem.display().to_string();
    for uploader in ["kopia", "restic"] {
        let bed = Bed::new();
        data(&bed);
        let repo = format!("azure:velero:/cluster-a/{uploader}/ns1");
        let out = azure_cli(
            &az,
            &az.key,
            &bed,
            uploader,
            &repo,
            &["backup", "--cacert", &ca, bed.source.to_str().unwrap()],
        );
        assert_eq!(
            out.status.code(),
            Some(0),
            "{uploader}: {}\n{}",
            text(&out.stderr),
            az.log()
        );
        let id = snapshot_id(&out);
        assert!(id.len() >= 32, "{uploader}: {}", text(&out.stdout));
        let blobs = az.blobs("velero", "");
        assert!(!blobs.is_empty());
        let mine: Vec<&String> = blobs
            .iter()
            .filter(|b| b.starts_with(&format!("cluster-a/{uploader}/ns1/")))
            .collect();
        let marker = if uploader == "kopia" {
            "kopia.repository"
        } else {
            "config"
        };
        assert!(
            mine.iter().any(|b| b.ends_with(&format!("/ns1/{marker}"))),
            "{uploader}: no {marker} under cluster-a/{uploader}/ns1/: {blobs:?}"
        );
        assert!(
            blobs.iter().all(|b| b.starts_with("cluster-a/")),
            "blobs outside the prefix: {blobs:?}"
        );

        let target = bed.path().join("restored");
        let out = azure_cli(
            &az,
            &az.key,
            &bed,
            uploader,
            &repo,
            &[
                "restore",
                "--cacert",
                &ca,
                "--target",
                target.to_str().unwrap(),
                &id,
            ],
        );
        assert_eq!(
            out.status.code(),
            Some(0),
            "{uploader}: {}",
            text(&out.stderr)
        );
        files_equal(&bed.source, &target);
        let all = format!("{}{}", text(&out.stdout), text(&out.stderr));
        assert!(!all.contains(&az.key), "{uploader}: the key was printed");
    }
}

/// A wrong account key, a missing container, a server certificate the CA does not sign: exit 1
/// with the service's own cause, and nothing written anywhere.
#[test]
fn azure_bad_key_missing_container_and_unknown_ca_fail_with_the_cause() {
    let az = Azurite::start(&["velero"]);
    let ca = az.ca_pem.display().to_string();
    let bed = Bed::new();
    data(&bed);
    let src = bed.source.to_str().unwrap().to_string();
    let wrong_key = {
        let mut k = az.key.clone().into_bytes();
        k[0] = if k[0] == b'A' { b'B' } else { b'A' };
        String::from_utf8(k).unwrap()
    };
    for uploader in ["kopia", "restic"] {
        let repo = format!("azure:velero:/p/{uploader}/ns1");
        let out = azure_cli(
            &az,
            &wrong_key,
            &bed,
            uploader,
            &repo,
            &["backup", "--cacert", &ca, &src],
        );
        assert_eq!(out.status.code(), Some(1), "{uploader}");
        let err = text(&out.stderr);
        assert!(
            err.contains("AuthorizationFailure") || err.contains("403"),
            "{uploader}: {err}"
        );
        assert!(
            !err.contains(&wrong_key),
            "{uploader}: the key was printed: {err}"
        );
    }
    // kopia: restic retries a missing container for many minutes (restic's own backoff; its
    // 404 ContainerNotFound is not a "does not exist" to it) before it fails.
    let out = azure_cli(
        &az,
        &az.key,
        &bed,
        "kopia",
        "azure:missing:/p/kopia/ns1",
        &["backup", "--cacert", &ca, &src],
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("ContainerNotFound"),
        "{}",
        text(&out.stderr)
    );
    // Without the CA: Go's x509 words (restic 0.18 retries a TLS failure for minutes too).
    let out = azure_cli(
        &az,
        &az.key,
        &bed,
        "kopia",
        "azure:velero:/p/kopia/ns2",
        &["backup", &src],
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("x509: certificate signed by unknown authority"),
        "{}",
        text(&out.stderr)
    );
    assert_eq!(
        az.blobs("velero", ""),
        Vec::<String>::new(),
        "something was written"
    );
    assert!(
        az.container("list", "missing", "").is_err(),
        "the missing container was created"
    );
}

fn gcs_cli(g: &FakeGcs, bed: &Bed, uploader: &str, repo: &str, args: &[&str]) -> Output {
    let mut c = Command::new(agent_bin());
    clean(&mut c);
    // The emulator needs no token; restic still asks for one unless given it.
    c.env("STORAGE_EMULATOR_HOST", g.emulator_host())
        .env("GOOGLE_ACCESS_TOKEN", "emulator-needs-none")
        .env("GOOGLE_APPLICATION_CREDENTIALS", &g.service_account);
    agent(c, bed, uploader, repo, args)
}

/// A backup and a restore byte for byte with each uploader over TLS with the test's CA, the
/// objects under the prefix given.
#[test]
fn gcs_backup_and_restore_with_kopia_and_restic_over_tls() {
    let g = FakeGcs::start(&["velero-gcs"]);
    let ca = g.ca_pem.display().to_string();
    for uploader in ["kopia", "restic"] {
        let bed = Bed::new();
        data(&bed);
        let repo = format!("gs:velero-gcs:/cluster-a/{uploader}/ns1");
        let out = gcs_cli(
            &g,
            &bed,
            uploader,
            &repo,
            &["backup", "--cacert", &ca, bed.source.to_str().unwrap()],
        );
        assert_eq!(
            out.status.code(),
            Some(0),
            "{uploader}: {}",
            text(&out.stderr)
        );
        let id = snapshot_id(&out);
        let objects = g.objects("velero-gcs", "");
        let marker = if uploader == "kopia" {
            "kopia.repository"
        } else {
            "config"
        };
        assert!(
            objects
                .iter()
                .any(|o| o == &format!("cluster-a/{uploader}/ns1/{marker}")),
            "{uploader}: {objects:?}"
        );
        assert!(
            objects.iter().all(|o| o.starts_with("cluster-a/")),
            "{objects:?}"
        );
        let target = bed.path().join("restored");
        let out = gcs_cli(
            &g,
            &bed,
            uploader,
            &repo,
            &[
                "restore",
                "--cacert",
                &ca,
                "--target",
                target.to_str().unwrap(),
                &id,
            ],
        );
        assert_eq!(
            out.status.code(),
            Some(0),
            "{uploader}: {}",
            text(&out.stderr)
        );
        files_equal(&bed.source, &target);
    }
}

/// A missing bucket (both uploaders) and a certificate the CA does not sign (kopia): exit 1 with
/// the service's cause, nothing created. (fake-gcs-server checks no credentials, so a wrong
/// service account cannot be shown against it.)
#[test]
fn gcs_missing_bucket_and_unknown_ca_fail_with_the_cause() {
    let g = FakeGcs::start(&["velero-gcs"]);
    let ca = g.ca_pem.display().to_string();
    let bed = Bed::new();
    data(&bed);
    let src = bed.source.to_str().unwrap().to_string();
    for uploader in ["kopia", "restic"] {
        let out = gcs_cli(
            &g,
            &bed,
            uploader,
            "gs:missing:/p",
            &["backup", "--no-init", "--cacert", &ca, &src],
        );
        assert_eq!(
            out.status.code(),
            Some(1),
            "{uploader}: {}",
            text(&out.stderr)
        );
        let err = text(&out.stderr);
        assert!(
            err.contains("404") && err.contains("otFound"),
            "{uploader}: {err}"
        );
    }
    let out = gcs_cli(
        &g,
        &bed,
        "kopia",
        "gs:velero-gcs:/p/kopia/ns2",
        &["backup", &src],
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("x509: certificate signed by unknown authority"),
        "{}",
        text(&out.stderr)
    );
    assert_eq!(g.objects("velero-gcs", ""), Vec::<String>::new());
}
