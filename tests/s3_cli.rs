//! Object storage through the one-shot CLI: the real binary and the real restic against a real S3
//! server (moto, see `tests/s3/`) on loopback behind TLS with a CA made for the test.

mod common;
#[path = "s3/mod.rs"]
mod s3;

use std::path::Path;
use std::process::{Command, Output, Stdio};

use common::*;
use s3::S3Server;

/// `podvolume-agent <args> --repo <repo>` as `user` (credentials through the usual
/// `AWS_SHARED_CREDENTIALS_FILE`).
fn cli(bed: &Bed, s3: &S3Server, user: &str, repo: &str, args: &[&str]) -> Output {
    Command::new(agent_bin())
        .args(args)
        .arg("--repo")
        .arg(repo)
        .arg("--password-file")
        .arg(&bed.password_file)
        .arg("--cache-dir")
        .arg(&bed.cache)
        .env("AWS_SHARED_CREDENTIALS_FILE", s3.credentials_path(user))
        .env("RESTIC_BINARY", restic_bin())
        .env_remove("AWS_ACCESS_KEY_ID")
        .env_remove("AWS_SECRET_ACCESS_KEY")
        .env_remove("PODVOLUME_CACERT")
        .env_remove("PODVOLUME_INSECURE_TLS")
        .stdin(Stdio::null())
        .output()
        .unwrap()
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

#[test]
fn restic_under_test_is_the_requested_version() {
    assert_requested_version();
}

#[test]
fn backup_and_restore_round_trip_over_tls_with_the_ca() {
    let s3 = S3Server::start(&[("alice", &["bkt-a"])]);
    let bed = Bed::new();
    write_random(&bed.source.join("a.bin"), 3 << 20, 1);
    write_random(&bed.source.join("sub/b.bin"), 200_000, 2);
    let repo = s3.repo("bkt-a", "restic/ns1");
    let ca = s3.ca_pem.display().to_string();

    // The CLI initialises a missing repository (a user at a terminal asked for this one).
    let out = cli(
        &bed,
        &s3,
        "alice",
        &repo,
        &["backup", "--cacert", &ca, bed.source.to_str().unwrap()],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let id = text(&out.stdout).trim().to_string();
    assert!(!id.is_empty());
    let listed = s3.snapshots("alice", &repo, &bed.password_file);
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert!(listed[0].starts_with(&id), "{listed:?} vs {id}");

    let target = bed.path().join("restored");
    let out = cli(
        &bed,
        &s3,
        "alice",
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
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    files_equal(&bed.source, &target);
}

#[test]
fn without_the_ca_the_x509_cause_is_reported_and_nothing_is_created() {
    let s3 = S3Server::start(&[("alice", &["bkt-a"])]);
    let bed = Bed::new();
    write_random(&bed.source.join("a.bin"), 100_000, 3);
    let repo = s3.repo("bkt-a", "restic/ns1");
    let out = cli(
        &bed,
        &s3,
        "alice",
        &repo,
        &["backup", bed.source.to_str().unwrap()],
    );
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(
        err.contains("x509: certificate signed by unknown authority"),
        "{err}"
    );
    assert!(
        err.contains(&format!("cannot open the repository at {repo}")),
        "{err}"
    );
    assert!(!err.contains("Is there a repository"), "{err}");
    // An unreachable repository is never initialised: nothing is at that location.
    let probe = s3.restic("alice", &repo, &bed.password_file, &["cat", "config"]);
    assert!(!probe.status.success());
    assert!(
        text(&probe.stderr).contains("The specified key does not exist"),
        "{}",
        text(&probe.stderr)
    );
}

#[test]
fn insecure_tls_accepts_the_unknown_certificate() {
    let s3 = S3Server::start(&[("alice", &["bkt-a"])]);
    let bed = Bed::new();
    write_random(&bed.source.join("a.bin"), 100_000, 4);
    let repo = s3.repo("bkt-a", "restic/ns1");
    let out = cli(
        &bed,
        &s3,
        "alice",
        &repo,
        &["backup", "--insecure-tls", bed.source.to_str().unwrap()],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(s3.snapshots("alice", &repo, &bed.password_file).len(), 1);
}

#[test]
fn access_denied_and_missing_repository_are_told_apart() {
    let s3 = S3Server::start(&[("alice", &["bkt-a"]), ("bob", &["bkt-b"])]);
    let bed = Bed::new();
    write_random(&bed.source.join("a.bin"), 100_000, 5);
    let ca = s3.ca_pem.display().to_string();
    let repo = s3.repo("bkt-a", "restic/ns1");

    // bob may not touch alice's bucket: the server's reason, and no attempt to create anything.
    let out = cli(
        &bed,
        &s3,
        "bob",
        &repo,
        &["backup", "--cacert", &ca, bed.source.to_str().unwrap()],
    );
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(err.contains("Access Denied"), "{err}");
    assert!(err.contains("cannot open the repository"), "{err}");

    // alice's bucket without a repository and --no-init: missing, with the server's words.
    let out = cli(
        &bed,
        &s3,
        "alice",
        &repo,
        &[
            "backup",
            "--no-init",
            "--cacert",
            &ca,
            bed.source.to_str().unwrap(),
        ],
    );
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(err.contains(&format!("no repository at {repo}")), "{err}");
    assert!(err.contains("The specified key does not exist"), "{err}");
}

/// `podvolume-agent <args> --uploader kopia` with the kopia under test, as `user` (its keys in an
/// AWS shared-credentials file, which the agent hands kopia in its own variables).
fn kopia_cli(bed: &Bed, s3: &S3Server, user: &str, repo: &str, args: &[&str]) -> Output {
    let kopia = format!("--kopia-binary={}", kopia_bin().display());
    let mut all = args.to_vec();
    all.extend(["--uploader=kopia", kopia.as_str()]);
    cli(bed, s3, user, repo, &all)
}

#[test]
fn kopia_under_test_is_the_requested_version() {
    assert_requested_kopia_version();
}

/// kopia over S3 with TLS and the test's CA: a backup (the repository created on first use, at
/// the prefix with Velero's trailing slash), a restore byte for byte; a wrong password and a
/// missing CA give kopia's cause; `--insecure-tls` connects without the CA. No key in argv.
#[test]
fn kopia_backup_and_restore_over_tls_with_the_ca() {
    let s3 = S3Server::start(&[("alice", &["bkt-k"])]);
    let bed = Bed::new();
    write_random(&bed.source.join("a.bin"), 3 << 20, 1);
    write_random(&bed.source.join("sub/b.bin"), 200_000, 2);
    let repo = format!("s3:{}/bkt-k/kopia/ns1", s3.endpoint());
    let ca = s3.ca_pem.display().to_string();

    let out = kopia_cli(
        &bed,
        &s3,
        "alice",
        &repo,
        &[
            "backup",
            "--json",
            "--cacert",
            &ca,
            bed.source.to_str().unwrap(),
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let lines: Vec<serde_json::Value> = text(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let last = lines.last().unwrap();
    assert_eq!(last["completed"], true, "{last}");
    assert_eq!(
        last["nCompleted"].as_u64(),
        Some((3 << 20) + 200_000),
        "{last}"
    );
    let description = last["description"].as_str().unwrap();
    let id = description
        .strip_prefix("snapshot ")
        .and_then(|d| d.split_whitespace().next())
        .unwrap()
        .to_string();
    assert_eq!(id.len(), 32, "{description}");

    let target = bed.path().join("restored");
    let out = kopia_cli(
        &bed,
        &s3,
        "alice",
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
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    files_equal(&bed.source, &target);

    // Without the CA: the x509 cause, nothing created elsewhere.
    let other = Bed::new();
    std::fs::write(&other.password_file, "correct horse battery staple\n").unwrap();
    let out = kopia_cli(
        &other,
        &s3,
        "alice",
        &repo,
        &["backup", bed.source.to_str().unwrap()],
    );
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    assert!(
        err.contains("x509: certificate signed by unknown authority"),
        "{err}"
    );

    // --insecure-tls: the same repository without the CA.
    let out = kopia_cli(
        &other,
        &s3,
        "alice",
        &repo,
        &["backup", "--insecure-tls", bed.source.to_str().unwrap()],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));

    // A wrong password: kopia's words, exit 1.
    let wrong = Bed::new();
    std::fs::write(&wrong.password_file, "not the password\n").unwrap();
    let out = kopia_cli(
        &wrong,
        &s3,
        "alice",
        &repo,
        &["backup", "--cacert", &ca, bed.source.to_str().unwrap()],
    );
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("invalid repository password"),
        "{}",
        text(&out.stderr)
    );
    let keys = s3.keys("alice");
    assert!(!text(&out.stderr).contains(&keys.secret_access_key));
}
