use super::*;
use crate::uploader::Stream;
use proptest::prelude::*;

fn access(dir: &Path, password: &str) -> RepositoryAccess {
    let password_file = dir.join("password");
    std::fs::write(&password_file, password).unwrap();
    RepositoryAccess {
        repository: "/backups/repo".into(),
        password_file,
        cache_dir: dir.join("cache"),
        extra_env: vec![("AWS_SHARED_CREDENTIALS_FILE".into(), "/creds".into())],
        ..Default::default()
    }
}

fn env_of<'a>(inv: &'a KopiaInvocation, key: &str) -> Option<&'a OsString> {
    inv.env.iter().find(|(k, _)| k == key).map(|(_, v)| v)
}

fn args(inv: &KopiaInvocation) -> Vec<String> {
    inv.args
        .iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect()
}

#[test]
fn a_connection_counts_per_operation_files_by_content_where_kopia_copies_them() {
    let dir = tempfile::tempdir().unwrap();
    // Two operations on one S3 repository: each has its own copy of the CA and of the
    // location's credentials file (as the agent writes them), with the same content.
    let files = |op: &str, ca: &str, key: &str| {
        let d = dir.path().join(op);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("ca.pem"), ca).unwrap();
        std::fs::write(
            d.join("creds"),
            format!("[default]\naws_access_key_id = {key}\naws_secret_access_key = s\n"),
        )
        .unwrap();
        let mut a = access(dir.path(), "pw");
        a.repository = "s3:https://minio:9000/velero/kopia/ns/".into();
        a.ca_cert = Some(d.join("ca.pem"));
        a.extra_env = vec![(
            "AWS_SHARED_CREDENTIALS_FILE".into(),
            d.join("creds").display().to_string(),
        )];
        a
    };
    let one = files("op1", "CA one", "AKI1");
    let same = files("op2", "CA one", "AKI1");
    assert_ne!(
        args(&connect(&one).unwrap()),
        args(&connect(&same).unwrap())
    );
    assert_eq!(
        connection_fingerprint(&one).unwrap(),
        connection_fingerprint(&same).unwrap()
    );
    std::fs::create_dir_all(kopia_dir(&one)).unwrap();
    std::fs::write(config_path(&one), "{}").unwrap();
    remember_connection(&one);
    assert!(connection_is_current(&same));
    // Another CA or other keys reconnect.
    assert!(!connection_is_current(&files("op3", "CA two", "AKI1")));
    assert!(!connection_is_current(&files("op4", "CA one", "AKI2")));
    // kopia keeps a GCS credentials file by path: a new path reconnects.
    let gcs = |op: &str| {
        let mut a = access(dir.path(), "pw");
        a.repository = "gs:velero:/kopia/ns/".into();
        a.extra_env = vec![(
            "GOOGLE_APPLICATION_CREDENTIALS".into(),
            dir.path().join(op).join("creds").display().to_string(),
        )];
        a
    };
    assert_ne!(
        connection_fingerprint(&gcs("op1")).unwrap(),
        connection_fingerprint(&gcs("op2")).unwrap()
    );
}

#[test]
fn invocations_keep_the_password_out_of_argv() {
    let dir = tempfile::tempdir().unwrap();
    let acc = access(dir.path(), "s3cret\n");
    let cache = dir.path().join("cache").join("kopia");
    for inv in [
        connect(&acc).unwrap(),
        create(&acc).unwrap(),
        snapshot_create(&acc, Path::new("/vol"), &[], &Default::default()).unwrap(),
        snapshot_restore(&acc, "k123", Path::new("/target"), &Default::default()).unwrap(),
    ] {
        assert!(args(&inv).iter().all(|a| !a.contains("s3cret")));
        assert_eq!(env_of(&inv, "KOPIA_PASSWORD").unwrap(), "s3cret");
        assert_eq!(
            env_of(&inv, "KOPIA_CONFIG_PATH").unwrap(),
            cache.join("repository.config").as_os_str()
        );
        assert_eq!(
            env_of(&inv, "KOPIA_LOG_DIR").unwrap(),
            cache.join("logs").as_os_str()
        );
        assert_eq!(env_of(&inv, "KOPIA_CHECK_FOR_UPDATES").unwrap(), "false");
        assert_eq!(env_of(&inv, "KOPIA_DISABLE_COLOR").unwrap(), "true");
        // No log blobs in Velero's repository; the local logs bounded.
        assert_eq!(
            env_of(&inv, "KOPIA_DISABLE_REPOSITORY_LOG").unwrap(),
            "true"
        );
        for k in [
            "KOPIA_LOG_DIR_MAX_SIZE_MB",
            "KOPIA_CONTENT_LOG_DIR_MAX_SIZE_MB",
        ] {
            let mb: u32 = env_of(&inv, k).unwrap().to_str().unwrap().parse().unwrap();
            assert!((1..=100).contains(&mb), "{k}={mb}");
        }
        assert_eq!(
            env_of(&inv, "KOPIA_PERSIST_CREDENTIALS_ON_CONNECT").unwrap(),
            "false"
        );
        assert_eq!(
            env_of(&inv, "AWS_SHARED_CREDENTIALS_FILE").unwrap(),
            "/creds"
        );
        let debug = format!("{inv:?}");
        assert!(!debug.contains("s3cret"), "{debug}");
        assert!(debug.contains("<redacted>"));
        // Everything we set is scrubbed from the inherited environment first.
        for (k, _) in &inv.env {
            let k = k.to_str().unwrap();
            assert!(
                SCRUBBED_ENV.contains(&k) || !k.starts_with("KOPIA_"),
                "{k} not scrubbed"
            );
        }
    }
    let cache_flag = format!("--cache-directory={}", cache.join("cache").display());
    assert_eq!(
        args(&connect(&acc).unwrap()),
        [
            "repository",
            "connect",
            "filesystem",
            "--path=/backups/repo",
            cache_flag.as_str()
        ]
    );
    assert_eq!(args(&create(&acc).unwrap())[1], "create");
    assert_eq!(
        args(&snapshot_create(&acc, Path::new("/vol"), &[], &Default::default()).unwrap()),
        [
            "snapshot",
            "create",
            "--json",
            "--json-verbose",
            "--progress",
            "--no-auto-maintenance",
            "/vol"
        ]
    );
    assert_eq!(
        args(&snapshot_restore(&acc, "k123", Path::new("/target"), &Default::default()).unwrap()),
        ["snapshot", "restore", "--progress", "k123", "/target"]
    );
}

/// Azure and GCS in restic's forms: the account, key and domain go to kopia's variables
/// (never argv), the CA into a bundle kopia's Go TLS reads through SSL_CERT_FILE.
#[test]
fn the_cache_limit_is_split_as_velero_splits_it() {
    assert_eq!(
        cache_limit_flags(Some(5000)),
        [
            "--content-cache-size-mb=3200",
            "--content-cache-size-limit-mb=4000",
            "--metadata-cache-size-mb=800",
            "--metadata-cache-size-limit-mb=1000",
        ]
    );
    assert!(cache_limit_flags(None).is_empty());
    assert!(cache_limit_flags(Some(1)).iter().all(|f| f.ends_with("=1")));
}

#[test]
fn azure_and_gcs_repositories_connect_with_keys_in_the_environment() {
    assert_eq!(
        Storage::parse("azure:velero:/cluster/kopia/ns/").unwrap(),
        Storage::Azure {
            container: "velero".into(),
            prefix: "cluster/kopia/ns/".into()
        }
    );
    assert_eq!(
        Storage::parse("gs:bkt:/").unwrap(),
        Storage::Gcs {
            bucket: "bkt".into(),
            prefix: String::new()
        }
    );
    for bad in ["azure:", "azure::/p", "gs:a/b:/p"] {
        assert!(Storage::parse(bad).is_err(), "{bad}");
    }
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca.pem");
    std::fs::write(
        &ca,
        "-----BEGIN CERTIFICATE-----\nTESTCA\n-----END CERTIFICATE-----\n",
    )
    .unwrap();
    let mut a = access(dir.path(), "pw");
    a.repository = "azure:velero:/kopia/ns/".into();
    a.ca_cert = Some(ca.clone());
    a.extra_env = vec![
        ("AZURE_ACCOUNT_NAME".into(), "acct".into()),
        ("AZURE_ACCOUNT_KEY".into(), "azs3cretkey==".into()),
        ("AZURE_ENDPOINT_SUFFIX".into(), "localhost:10443".into()),
    ];
    let inv = connect(&a).unwrap();
    let argv = args(&inv);
    assert_eq!(
        argv[..5],
        [
            "repository",
            "connect",
            "azure",
            "--container=velero",
            "--prefix=kopia/ns/"
        ]
    );
    assert!(!argv.iter().any(|a| a.contains("s3cret")), "{argv:?}");
    assert_eq!(env_of(&inv, "AZURE_STORAGE_ACCOUNT").unwrap(), "acct");
    assert_eq!(env_of(&inv, "AZURE_STORAGE_KEY").unwrap(), "azs3cretkey==");
    assert_eq!(
        env_of(&inv, "AZURE_STORAGE_DOMAIN").unwrap(),
        "blob.localhost:10443"
    );
    assert!(!format!("{inv:?}").contains("s3cret"));
    let bundle = PathBuf::from(env_of(&inv, "SSL_CERT_FILE").unwrap());
    let text = std::fs::read_to_string(&bundle).unwrap();
    assert!(
        text.ends_with("TESTCA\n-----END CERTIFICATE-----\n"),
        "{text}"
    );
    // Every command carries it, not only connect.
    assert!(
        snapshot_delete(&a, "k0123456789abcdef0123456789abcdef").is_ok_and(|i| env_of(
            &i,
            "SSL_CERT_FILE"
        )
        .is_some())
    );
    // No key and no SAS: refused before kopia runs.
    a.extra_env.retain(|(k, _)| k != "AZURE_ACCOUNT_KEY");
    assert!(
        connect(&a)
            .unwrap_err()
            .to_string()
            .contains("no storage account key")
    );

    let mut g = access(dir.path(), "pw");
    g.repository = "gs:bkt:/p/kopia/ns/".into();
    g.extra_env = vec![(
        "GOOGLE_APPLICATION_CREDENTIALS".into(),
        "/credentials/cloud".into(),
    )];
    let inv = connect(&g).unwrap();
    assert_eq!(
        args(&inv)[..6],
        [
            "repository",
            "connect",
            "gcs",
            "--bucket=bkt",
            "--prefix=p/kopia/ns/",
            "--credentials-file=/credentials/cloud"
        ]
    );
    assert!(env_of(&inv, "SSL_CERT_FILE").is_none(), "no CA, no bundle");
}

#[test]
fn object_storage_repositories_connect_with_s3_flags_and_keys_in_the_environment() {
    assert_eq!(
        Storage::parse("s3:https://minio.example:9000/velero/prefix/kopia/ns").unwrap(),
        Storage::S3 {
            endpoint: "minio.example:9000".into(),
            tls: true,
            bucket: "velero".into(),
            prefix: "prefix/kopia/ns/".into(),
        }
    );
    assert_eq!(
        Storage::parse("s3:http://10.0.0.1/b").unwrap(),
        Storage::S3 {
            endpoint: "10.0.0.1".into(),
            tls: false,
            bucket: "b".into(),
            prefix: String::new(),
        }
    );
    assert_eq!(
        Storage::parse("/backups/repo").unwrap(),
        Storage::Filesystem("/backups/repo".into())
    );
    for bad in ["s3:https://", "s3:ftp://h/b", "s3:https://k:s@h/b", ""] {
        assert!(Storage::parse(bad).is_err(), "{bad}");
    }

    let dir = tempfile::tempdir().unwrap();
    let creds = dir.path().join("cloud");
    std::fs::write(
        &creds,
        "[default]\naws_access_key_id = AKIDEFAULT\naws_secret_access_key = s3cretdefault\n\
         [backup]\naws_access_key_id=AKIBACKUP\naws_secret_access_key=s3cretbackup\n",
    )
    .unwrap();
    let ca = dir.path().join("ca.pem");
    let mut a = access(dir.path(), "pw");
    a.repository = "s3:https://minio:9000/velero/kopia/ns/".into();
    a.ca_cert = Some(ca.clone());
    a.insecure_tls = true;
    a.extra_env = vec![
        (
            "AWS_SHARED_CREDENTIALS_FILE".into(),
            creds.display().to_string(),
        ),
        ("AWS_PROFILE".into(), "backup".into()),
        ("AWS_REGION".into(), "minio".into()),
    ];
    let inv = connect(&a).unwrap();
    let argv = args(&inv);
    let cache_flag = format!(
        "--cache-directory={}",
        kopia_dir(&a).join("cache").display()
    );
    assert_eq!(
        argv,
        [
            "repository",
            "connect",
            "s3",
            "--endpoint=minio:9000",
            "--bucket=velero",
            "--prefix=kopia/ns/",
            "--region=minio",
            "--disable-tls-verification",
            &format!("--root-ca-pem-path={}", ca.display()),
            &cache_flag,
        ]
    );
    assert!(
        !argv
            .iter()
            .any(|a| a.contains("s3cret") || a.contains("AKI"))
    );
    assert_eq!(env_of(&inv, "AWS_ACCESS_KEY_ID").unwrap(), "AKIBACKUP");
    assert_eq!(
        env_of(&inv, "AWS_SECRET_ACCESS_KEY").unwrap(),
        "s3cretbackup"
    );
    assert!(!format!("{inv:?}").contains("s3cretbackup"));
    // A profile the file lacks is an error that names it, not a connect without keys.
    a.extra_env[1].1 = "nope".into();
    let err = connect(&a).unwrap_err().to_string();
    assert!(err.contains("\"nope\""), "{err}");
    // Keys already in the environment win over the file.
    a.extra_env
        .push(("AWS_ACCESS_KEY_ID".into(), "AKIENV".into()));
    assert!(env_of(&connect(&a).unwrap(), "AWS_SECRET_ACCESS_KEY").is_none());
    // Creating one: never maintained by whoever connects next.
    a.extra_env.pop();
    a.extra_env[1].1 = "default".into();
    assert!(args(&create(&a).unwrap()).contains(&"--no-auto-maintenance".to_string()));
}

#[test]
fn velero_snapshots_carry_its_identity_pin_and_policy() {
    let dir = tempfile::tempdir().unwrap();
    let a = access(dir.path(), "pw");
    let options = SnapshotOptions {
        source: Some("default@default:snapshot-pod-volume/kopia/ns/pod/data".into()),
        description: Some("Kopia Uploader".into()),
        pins: vec!["velero-pin".into()],
        parallel: Some(4),
        fail_fast: false,
        keep_all_policy: true,
    };
    let tags = [("backup".to_string(), "b1".to_string())];
    assert_eq!(
        args(&snapshot_create(&a, Path::new("/vol"), &tags, &options).unwrap()),
        [
            "snapshot",
            "create",
            "--json",
            "--json-verbose",
            "--progress",
            "--no-auto-maintenance",
            "--override-source=default@default:snapshot-pod-volume/kopia/ns/pod/data",
            "--description=Kopia Uploader",
            "--pin=velero-pin",
            "--tags=backup:b1",
            "--parallel=4",
            "/vol"
        ]
    );
    let policy = args(&policy_keep_all(&a, "default@default:x").unwrap());
    assert_eq!(&policy[..3], ["policy", "set", "default@default:x"]);
    for k in ["latest", "hourly", "daily", "weekly", "monthly", "annual"] {
        assert!(
            policy.contains(&format!("--keep-{k}=2147483647")),
            "{policy:?}"
        );
    }
    for f in ["--compression=none", "--manual", "--no-auto-maintenance"] {
        assert!(policy.contains(&f.to_string()), "{policy:?}");
    }
    let restore = RestoreOptions {
        write_sparse_files: true,
        parallel: Some(2),
    };
    assert_eq!(
        args(&snapshot_restore(&a, "k1", Path::new("/t"), &restore).unwrap()),
        [
            "snapshot",
            "restore",
            "--progress",
            "--write-sparse-files",
            "--parallel=2",
            "k1",
            "/t"
        ]
    );
}

#[test]
fn a_restore_from_object_storage_reads_one_file_per_cpu_unless_told() {
    let dir = tempfile::tempdir().unwrap();
    let mut a = access(dir.path(), "pw");
    let restore = |a: &RepositoryAccess, parallel| {
        let o = RestoreOptions {
            write_sparse_files: false,
            parallel,
        };
        args(&snapshot_restore(a, "k1", Path::new("/t"), &o).unwrap())
    };
    // A filesystem repository: kopia's own default.
    assert!(
        !restore(&a, None)
            .iter()
            .any(|f| f.starts_with("--parallel"))
    );
    for repository in [
        "s3:https://minio.example:9000/velero/kopia/ns",
        "azure:velero:/kopia/ns/",
        "gs:bkt:/kopia/ns/",
    ] {
        a.repository = repository.into();
        let cpus = cpu_count();
        assert!(cpus >= 1);
        assert!(
            restore(&a, None).contains(&format!("--parallel={cpus}")),
            "{repository}"
        );
        // What the Restore says wins.
        assert!(restore(&a, Some(5)).contains(&"--parallel=5".to_string()));
    }
    assert_eq!(
        default_restore_parallel(&Storage::parse("gs:b:/").unwrap(), 0),
        Some(1)
    );
}

#[test]
fn a_complete_snapshot_saved_before_our_stop_is_the_result() {
    let mut f = RunFacts::default();
    f.summary = Some(RunSummary {
        snapshot_id: Some("a983b4aa0948c7dfb0c936d03a7f5a7d".into()),
        total_bytes: 41_943_040,
        total_files: 2,
        ..RunSummary::default()
    });
    // Killed (SIGKILL after the grace period) after it printed its complete manifest.
    let o = classify(
        ExitInfo {
            code: None,
            signal: Some(9),
        },
        &f,
        true,
        Direction::Backup,
    );
    assert_eq!(o.kind, OutcomeKind::Success, "{o:?}");
    assert_eq!(
        o.snapshot_id.as_deref(),
        Some("a983b4aa0948c7dfb0c936d03a7f5a7d")
    );
    // Without a manifest, or with an incomplete one, a stopped kopia is canceled, no result.
    let o = classify(
        ExitInfo {
            code: None,
            signal: Some(9),
        },
        &RunFacts::default(),
        true,
        Direction::Backup,
    );
    assert_eq!((o.kind, o.snapshot_id), (OutcomeKind::Canceled, None));
    f.summary.as_mut().unwrap().incomplete = Some("canceled".into());
    let o = classify(ExitInfo::code(0), &f, true, Direction::Backup);
    assert_eq!((o.kind, o.snapshot_id), (OutcomeKind::Canceled, None));
}

#[test]
fn restore_refuses_snapshot_ids_that_are_not_kopia_ids() {
    let dir = tempfile::tempdir().unwrap();
    let a = access(dir.path(), "pw");
    for good in [
        "a1b2c3",
        "0123456789abcdef0123456789abcdef",
        "k0123456789abcdef",
    ] {
        let inv = snapshot_restore(&a, good, Path::new("/t"), &Default::default()).unwrap();
        assert!(args(&inv).contains(&good.to_string()), "{good}");
    }
    let long = "a".repeat(MAX_SNAPSHOT_ID_LEN + 1);
    for bad in [
        "-h",
        "--overwrite-files",
        "",
        "abc def",
        "k1/sub/dir",
        "a1\nERROR forged",
        long.as_str(),
    ] {
        let err = snapshot_restore(&a, bad, Path::new("/t"), &Default::default())
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("invalid kopia snapshot ID \""),
            "{bad:?}: {err}"
        );
        assert!(!err.contains('\n'), "the ID is shown escaped: {err}");
        assert!(err.len() < 200, "the ID is shown cut short: {err}");
    }
    let err = snapshot_restore(
        &a,
        "--overwrite-files",
        Path::new("/t"),
        &Default::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("\"--overwrite-files\""), "{err}");
}

#[test]
fn password_file_errors() {
    let dir = tempfile::tempdir().unwrap();
    let mut acc = access(dir.path(), "pw\r\n");
    assert_eq!(
        env_of(&connect(&acc).unwrap(), "KOPIA_PASSWORD").unwrap(),
        "pw"
    );
    // Only one trailing newline is removed; inner whitespace is the user's.
    std::fs::write(&acc.password_file, " pw \n\n").unwrap();
    assert_eq!(
        env_of(&connect(&acc).unwrap(), "KOPIA_PASSWORD").unwrap(),
        " pw \n"
    );
    std::fs::write(&acc.password_file, "\n").unwrap();
    assert!(matches!(connect(&acc), Err(Error::Invalid(_))));
    acc.password_file = dir.path().join("missing");
    let err = snapshot_create(&acc, Path::new("/vol"), &[], &Default::default()).unwrap_err();
    assert!(matches!(err, Error::Io { .. }));
    assert!(err.to_string().contains("password file"), "{err}");
}

#[test]
fn si_bytes() {
    let cases: &[(&str, Option<u64>)] = &[
        ("0 B", Some(0)),
        ("1 B", Some(1)),
        ("999 B", Some(999)),
        // Half a unit of the last printed digit below the figure.
        ("52.4 MB", Some(52_400_000 - 50_000)),
        ("1.2 GB", Some(1_200_000_000 - 50_000_000)),
        ("512 KB", Some(512_000 - 50)),
        ("512 kB", Some(512_000 - 50)),
        ("0.9 KB", Some(900 - 50)),
        ("3 TB", Some(3_000_000_000_000 - 50_000_000_000)),
        ("0.0 KB", Some(0)),
        ("0.1 KB", Some(50)),
        ("1.30 MB", Some(1_300_000 - 5_000)),
        // 1536 - 51.2 = 1484.8: the smallest whole byte count is 1485.
        ("1.5 KiB", Some(1485)),
        // A whole figure is kopia's one decimal with `.0` trimmed: 2.0 MiB less 0.05 MiB.
        ("2 MiB", Some(2_044_724)),
        // 1.1 GiB = 1_181_116_006.4, less 1/20 GiB = 53_687_091.2: 1_127_428_915.2, rounded up.
        ("1.1 GiB", Some(1_127_428_916)),
        ("4 EB", Some(3_950_000_000_000_000_000)),
        // 16 EiB overflows u64, but the smallest value it stands for (15.95 EiB) does not.
        ("16 EiB", Some(18_389_097_998_479_209_268)),
        ("17 EiB", None),
        ("18.4 EB", Some(18_350_000_000_000_000_000)),
        // 18.45e18 > u64::MAX.
        ("18.5 EB", None),
        ("52.4MB", Some(52_400_000 - 50_000)),
        ("  7 B  ", Some(7)),
        ("42", Some(42)),
        ("", None),
        ("B", None),
        (".", None),
        ("1.2.3 MB", None),
        ("-1 B", None),
        ("1 XB", None),
        ("1 MB/s", None),
        ("NaN B", None),
        ("1e3 B", None),
    ];
    for (input, want) in cases {
        assert_eq!(parse_si_bytes(input), *want, "{input:?}");
    }
}

fn backup() -> KopiaParser {
    KopiaParser::new(Direction::Backup)
}

fn restore() -> KopiaParser {
    KopiaParser::new(Direction::Restore)
}

#[test]
fn backup_progress_lines() {
    let p = backup();
    assert_eq!(
        p.parse(b" | 3 hashing, 10 hashed (52.4 MB), 2 cached (1.2 GB), uploaded 40 MB, estimating...   "),
        UploaderEvent::Progress(ProgressSample {
            // Lower bounds of each figure: 52.35 MB + 1.15 GB.
            bytes_done: 52_350_000 + 1_150_000_000,
            total_bytes: None,
            files_done: 12,
            total_files: None,
            scan_finished: false,
            bytes_read: Some(52_350_000),
        })
    );
    assert_eq!(
        p.parse(b" \\ 0 hashing, 5 hashed (1 MB), 0 cached (0 B), uploaded 1 MB (2 fatal errors) (1 errors ignored), estimated 2.5 MB (40.0%) 3s left"),
        UploaderEvent::Progress(ProgressSample {
            // "1 MB" is kopia's 1.0 MB, at least 0.95 MB; "2.5 MB" from 2.45 MB.
            bytes_done: 950_000,
            total_bytes: Some(2_450_000),
            files_done: 5,
            total_files: None,
            scan_finished: true,
            bytes_read: Some(950_000),
        })
    );
    // The final frame, with a percentage above 100.
    assert_eq!(
        p.parse(b" * 0 hashing, 7 hashed (3.1 MiB), 1 cached (1 KiB), uploaded 3 MiB, estimated 3 MiB (104.2%) 0s left"),
        UploaderEvent::Progress(ProgressSample {
            // 3.1 MiB - 0.05 MiB = 3_198_156.8 -> 3_198_157; 1.0 KiB - 0.05 KiB = 972.8 -> 973.
            bytes_done: 3_198_157 + 973,
            // 3.0 MiB - 0.05 MiB.
            total_bytes: Some(3_093_300),
            files_done: 8,
            total_files: None,
            scan_finished: true,
            bytes_read: Some(3_198_157),
        })
    );
    // A mangled progress line is reported, not silently taken as text.
    assert!(matches!(
        p.parse(b" - 1 hashing, x hashed (1 MB), 0 cached (0 B), uploaded 0 B, estimating..."),
        UploaderEvent::Malformed(_)
    ));
}

#[test]
fn item_errors_fatal_and_text() {
    let p = backup();
    let want = UploaderEvent::ItemError {
        item: "dir/secret.txt".into(),
        message: "unable to open file: open /vol/dir/secret.txt: permission denied".into(),
    };
    let line = br#"Error when processing "dir/secret.txt": unable to open file: open /vol/dir/secret.txt: permission denied"#;
    assert_eq!(p.parse(line), want);
    let mut bang = b" ! ".to_vec();
    bang.extend_from_slice(line);
    assert_eq!(p.parse(&bang), want);
    let mut old = b"ERROR ".to_vec();
    old.extend_from_slice(line);
    assert_eq!(p.parse(&old), want);

    assert_eq!(
        p.parse(b"Found 1 fatal error(s) while snapshotting root@node:/vol."),
        UploaderEvent::Text("Found 1 fatal error(s) while snapshotting root@node:/vol.".into())
    );
    assert_eq!(
        p.parse(b"ERROR Found 2 fatal error(s) while snapshotting root@node:/vol."),
        UploaderEvent::Text("Found 2 fatal error(s) while snapshotting root@node:/vol.".into())
    );
    assert_eq!(
        p.parse(b"ERROR open repository: unable to open repository: invalid repository password"),
        UploaderEvent::Fatal(
            "open repository: unable to open repository: invalid repository password".into()
        )
    );
    assert_eq!(
        p.parse(
            b"error connecting to repository: repository not initialized in the provided storage"
        ),
        UploaderEvent::Fatal(
            "error connecting to repository: repository not initialized in the provided storage"
                .into()
        )
    );
    assert_eq!(
        p.parse(b"\x1b[31mERROR\x1b[0m something broke"),
        UploaderEvent::Fatal("something broke".into())
    );
    assert_eq!(
        p.parse(b"Snapshotting root@node:/vol ..."),
        UploaderEvent::Text("Snapshotting root@node:/vol ...".into())
    );
    assert_eq!(p.parse(b"   "), UploaderEvent::Ignored);
    assert_eq!(
        p.parse(b"ERRORS are fine"),
        UploaderEvent::Text("ERRORS are fine".into())
    );
    // A line of an Azure SDK error block, not a log level.
    assert_eq!(
        p.parse(b"ERROR CODE: AuthorizationFailure"),
        UploaderEvent::Text("ERROR CODE: AuthorizationFailure".into())
    );
}

#[test]
fn incremental_bytes_are_exact_at_the_ends_and_the_hashed_figure_between() {
    let p = backup();
    // A real manifest (testdata/kopia/0.23.1/snapshot-incremental-json-verbose.stdout): every
    // file came from the parent.
    let unchanged = br#"{"id":"017a","stats":{"totalSize":200976615,"fileCount":0,"cachedFiles":11,"nonCachedFiles":0,"dirCount":2},"rootEntry":{"summ":{"size":200976602,"files":10}}}"#;
    let UploaderEvent::Summary(s) = p.parse(unchanged) else {
        panic!("a manifest")
    };
    assert_eq!((s.files_cached, s.files_read), (Some(11), Some(0)));
    assert_eq!(incremental_bytes(&s, Some(123)), Some(0));
    let first = RunSummary {
        total_bytes: 5000,
        files_cached: Some(0),
        files_read: Some(4),
        ..RunSummary::default()
    };
    assert_eq!(incremental_bytes(&first, Some(4900)), Some(5000));
    let mixed = RunSummary {
        files_cached: Some(3),
        files_read: Some(1),
        ..first.clone()
    };
    assert_eq!(incremental_bytes(&mixed, Some(1200)), Some(1200));
    assert_eq!(
        incremental_bytes(&mixed, Some(9000)),
        Some(5000),
        "never above the total"
    );
    assert_eq!(
        incremental_bytes(&mixed, None),
        None,
        "no progress line: unknown"
    );
    let no_stats = RunSummary {
        files_cached: None,
        ..first
    };
    assert_eq!(incremental_bytes(&no_stats, Some(1)), None);
    // The progress line's hashed figure is what is carried.
    let UploaderEvent::Progress(sample) =
        p.parse(b" * 0 hashing, 1 hashed (12.3 KB), 11 cached (201 MB), uploaded 12.4 KB, estimated 201 MB (100.0%) 0s left")
    else {
        panic!("a progress line")
    };
    // The lower bound of what kopia rounded: 12.3 KB is at least 12,250 bytes.
    assert_eq!(sample.bytes_read, Some(12_250));
}

#[test]
fn manifests() {
    let p = backup();
    let complete = br#"{"id":"a1b2c3","source":{"host":"node","userName":"root","path":"/vol"},"description":"","startTime":"2026-12-02T10:00:00Z","endTime":"2026-12-02T10:00:05Z","rootEntry":{"name":"vol","type":"d","mode":"0755","mtime":"2026-12-02T09:00:00Z","obj":"kabc","summ":{"size":5242880,"files":12,"symlinks":1,"dirs":3,"maxTime":"2026-12-02T09:00:00Z","numFailed":0,"newField":[1,2]}},"tags":null,"future":{"x":1}}"#;
    assert_eq!(
        p.parse(complete),
        UploaderEvent::Summary(RunSummary {
            snapshot_id: Some("a1b2c3".into()),
            total_bytes: 5_242_880,
            total_files: 12,
            ..RunSummary::default()
        })
    );
    let partial = br#"{"id":"d4","incomplete":"canceled","rootEntry":{"summ":{"size":100,"files":2,"numFailed":1,"errors":[{"path":"x","error":"denied"}]}}}"#;
    assert_eq!(
        p.parse(partial),
        UploaderEvent::Summary(RunSummary {
            snapshot_id: Some("d4".into()),
            total_bytes: 100,
            total_files: 2,
            failed_items: 1,
            incomplete: Some("canceled".into()),
            ..RunSummary::default()
        })
    );
    // Zero-valued fields omitted.
    assert_eq!(
        p.parse(br#"{"id":"e5","rootEntry":{}}"#),
        UploaderEvent::Summary(RunSummary {
            snapshot_id: Some("e5".into()),
            ..RunSummary::default()
        })
    );
    assert_eq!(p.parse(br#"{"unrelated":true}"#), UploaderEvent::Ignored);
    assert!(matches!(
        p.parse(br#"{"id":"x","rootEnt"#),
        UploaderEvent::Malformed(_)
    ));
    assert!(matches!(
        p.parse(br#"{"id":"x","rootEntry":{"summ":{"size":-1}}}"#),
        UploaderEvent::Malformed(_)
    ));
}

#[test]
fn restore_lines() {
    let p = restore();
    assert_eq!(
        p.parse(b"Processed 3 (1.5 MB) of 10 (6 MB)."),
        UploaderEvent::Progress(ProgressSample {
            bytes_done: 1_450_000,
            total_bytes: Some(5_950_000),
            files_done: 3,
            total_files: Some(10),
            scan_finished: false,
            bytes_read: None,
        })
    );
    assert_eq!(
        p.parse(b"Processed 9 (4 MB) of 10 (6 MB), skipped 2 (1 MB), ignored 1 errors 2 MB/s (83.3%) remaining 1s.   "),
        UploaderEvent::Progress(ProgressSample {
            // Restored "4 MB" (4.0, >= 3.95 MB) plus skipped "1 MB" (>= 0.95 MB).
            bytes_done: 3_950_000 + 950_000,
            total_bytes: Some(5_950_000),
            files_done: 9,
            total_files: Some(10),
            scan_finished: true,
            bytes_read: None,
        })
    );
    assert_eq!(
        p.parse(b"Restored 12 files, 3 directories and 1 symbolic links (5.2 MB)."),
        UploaderEvent::Summary(RunSummary {
            total_bytes: 5_150_000,
            total_files: 13,
            ..RunSummary::default()
        })
    );
    assert_eq!(
        p.parse(b"Restored 2 files, 1 directories and 0 symbolic links (1 MB), skipped 3 (2 MB), ignored 1 errors."),
        UploaderEvent::Summary(RunSummary {
            // "1 MB" restored (>= 0.95 MB) plus "2 MB" skipped (>= 1.95 MB).
            total_bytes: 950_000 + 1_950_000,
            total_files: 5,
            ..RunSummary::default()
        })
    );
    assert!(matches!(
        p.parse(b"Processed 3 (1.5 MB) of ten (6 MB)."),
        UploaderEvent::Malformed(_)
    ));
    // A backup does not take restore lines as its summary.
    assert!(matches!(
        backup().parse(b"Restored 2 files, 1 directories and 0 symbolic links (1 MB)."),
        UploaderEvent::Text(_)
    ));
}

fn facts_of(p: KopiaParser, lines: &[(Stream, &str)]) -> RunFacts {
    let mut f = RunFacts::default();
    for (s, l) in lines {
        f.observe(*s, &p.parse(l.as_bytes()));
    }
    f
}

const OK_MANIFEST: &str = r#"{"id":"k1","rootEntry":{"summ":{"size":2000000,"files":4}}}"#;

#[test]
fn classify_success_and_exit_zero_without_manifest() {
    let f = facts_of(backup(), &[(Stream::Stdout, OK_MANIFEST)]);
    let o = classify(ExitInfo::code(0), &f, false, Direction::Backup);
    assert_eq!(o.kind, OutcomeKind::Success);
    assert_eq!(o.snapshot_id.as_deref(), Some("k1"));
    assert_eq!(o.message, "snapshot k1 saved: 1.9 MiB in 4 files");
    assert_eq!(o.summary.unwrap().total_bytes, 2_000_000);

    let o = classify(
        ExitInfo::code(0),
        &RunFacts::default(),
        false,
        Direction::Backup,
    );
    assert_eq!(o.kind, OutcomeKind::Failed);
    assert!(o.message.contains("no snapshot manifest"), "{}", o.message);

    let f = facts_of(
        restore(),
        &[(
            Stream::Stderr,
            "Restored 4 files, 1 directories and 0 symbolic links (2 MB).",
        )],
    );
    let o = classify(ExitInfo::code(0), &f, false, Direction::Restore);
    assert_eq!(o.kind, OutcomeKind::Success);
    assert_eq!(o.snapshot_id, None);
    // "2 MB" is at least 1.95 MB (1.86 MiB); the engine replaces it with the measured size.
    let summary = o.summary.clone().unwrap();
    assert_eq!((summary.total_bytes, summary.total_files), (1_950_000, 4));
    assert_eq!(o.message, "restore completed: 1.9 MiB in 4 files");
    assert_eq!(o.message, restore_message(1_950_000, 4));
}

#[test]
fn classify_incomplete_manifests() {
    let canceled =
        r#"{"id":"k2","incomplete":"canceled","rootEntry":{"summ":{"size":10,"files":1}}}"#;
    let f = facts_of(backup(), &[(Stream::Stdout, canceled)]);
    // Exit 0 after our SIGINT: canceled, and the partial snapshot is not returned as a result.
    let o = classify(ExitInfo::code(0), &f, true, Direction::Backup);
    assert_eq!(o.kind, OutcomeKind::Canceled);
    assert_eq!(o.snapshot_id, None);
    assert!(
        o.message.contains("k2") && o.message.contains("canceled"),
        "{}",
        o.message
    );
    // Same output without our request: someone else interrupted it.
    let o = classify(ExitInfo::code(0), &f, false, Direction::Backup);
    assert_eq!(o.kind, OutcomeKind::Interrupted);
    assert!(o.message.contains("incomplete: canceled"), "{}", o.message);

    let limit = r#"{"id":"k3","incomplete":"limit reached","rootEntry":{"summ":{"size":10}}}"#;
    let f = facts_of(backup(), &[(Stream::Stdout, limit)]);
    let o = classify(ExitInfo::code(0), &f, false, Direction::Backup);
    assert_eq!(o.kind, OutcomeKind::Failed);
    assert!(o.message.contains("limit reached"), "{}", o.message);
}

#[test]
fn classify_partial() {
    let f = facts_of(
        backup(),
        &[
            (
                Stream::Stderr,
                r#" ! Error when processing "a/b": permission denied"#,
            ),
            (
                Stream::Stdout,
                r#"{"id":"k4","rootEntry":{"summ":{"size":10,"files":1,"numFailed":2}}}"#,
            ),
            (
                Stream::Stderr,
                "Found 2 fatal error(s) while snapshotting root@node:/vol.",
            ),
        ],
    );
    let o = classify(ExitInfo::code(1), &f, false, Direction::Backup);
    assert_eq!(o.kind, OutcomeKind::Partial);
    assert_eq!(o.snapshot_id.as_deref(), Some("k4"));
    assert_eq!(o.failed_items, 2);
    assert_eq!(
        o.message,
        "snapshot k4 saved, but 2 items could not be read: permission denied (1 of them) (first: a/b and 1 more)"
    );
    assert_eq!(o.first_failed_items.len(), 1);
}

#[test]
fn classify_failures_by_text_and_signal() {
    let cases: &[(&str, OutcomeKind)] = &[
        (
            "open repository: unable to open repository: invalid repository password",
            OutcomeKind::WrongPassword,
        ),
        (
            "ERROR error connecting to repository: invalid repository password",
            OutcomeKind::WrongPassword,
        ),
        (
            "open repository: repository is not connected. See https://kopia.io/docs/repositories/",
            OutcomeKind::RepositoryMissing,
        ),
        (
            "error connecting to repository: repository not initialized in the provided storage",
            OutcomeKind::RepositoryMissing,
        ),
        (
            "error loading config file: open /c/kopia/repository.config: no such file or directory",
            OutcomeKind::RepositoryMissing,
        ),
        (
            "unable to get local filesystem entry: lstat /nope: no such file or directory",
            OutcomeKind::SourceMissing,
        ),
        ("something else broke", OutcomeKind::Failed),
    ];
    for (line, want) in cases {
        let f = facts_of(backup(), &[(Stream::Stderr, line)]);
        let o = classify(ExitInfo::code(1), &f, false, Direction::Backup);
        assert_eq!(&o.kind, want, "{line}");
        assert!(!o.message.is_empty());
    }
    let f = facts_of(backup(), &[(Stream::Stderr, "something else broke")]);
    let o = classify(ExitInfo::code(1), &f, false, Direction::Backup);
    assert_eq!(
        o.message,
        "kopia failed with exit code 1: something else broke"
    );
    let o = classify(ExitInfo::code(2), &f, false, Direction::Backup);
    assert_eq!(
        o.message,
        "kopia crashed (exit code 2): something else broke"
    );

    let killed = ExitInfo {
        code: None,
        signal: Some(9),
    };
    let o = classify(killed, &RunFacts::default(), false, Direction::Backup);
    assert_eq!(o.kind, OutcomeKind::KilledBySignal { signal: 9 });
    // Escalated to SIGKILL after our cancel: still a cancel.
    let o = classify(killed, &RunFacts::default(), true, Direction::Backup);
    assert_eq!(o.kind, OutcomeKind::Canceled);
    // A run that completed before our cancel took effect is a success.
    let f = facts_of(backup(), &[(Stream::Stdout, OK_MANIFEST)]);
    let o = classify(ExitInfo::code(0), &f, true, Direction::Backup);
    assert_eq!(o.kind, OutcomeKind::Success);
    // Restore failures.
    let f = facts_of(
        restore(),
        &[(Stream::Stderr, "invalid repository password")],
    );
    let o = classify(ExitInfo::code(1), &f, false, Direction::Restore);
    assert_eq!(o.kind, OutcomeKind::WrongPassword);
}

#[test]
fn partial_message_wording() {
    let f = RunFacts::default();
    assert_eq!(
        partial_message(Some("k"), 0, &f),
        "snapshot k saved, but some source data could not be read"
    );
    assert_eq!(
        partial_message(None, 3, &f),
        "snapshot saved, but 3 items could not be read"
    );
}

/// A model of how kopia prints byte counts (observed behaviour: one decimal with a trailing
/// `.0` dropped, the next unit from 0.9 of it on, `T` the largest prefix, so from 900 TB the
/// figure is in P units with a `T` label), used to check that parsing is a lower bound.
fn kopia_bytes_string(b: u64, base2: bool) -> String {
    let (thousand, prefixes) = if base2 {
        (1024.0, ["", "Ki", "Mi", "Gi", "Ti"])
    } else {
        (1000.0, ["", "K", "M", "G", "T"])
    };
    let nice = |f: f64| {
        let s = format!("{f:.1}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    };
    let mut f = b as f64;
    for p in prefixes {
        if f < 0.9 * thousand {
            return format!("{} {p}B", nice(f));
        }
        f /= thousand;
    }
    format!("{} {}B", nice(f), prefixes[4])
}

#[test]
fn si_bytes_of_kopias_own_strings() {
    // Values that kopia rounds up: the parsed figure must not exceed them.
    for (b, text, want) in [
        (1_260_000, "1.3 MB", 1_250_000),
        (1_960_000, "2 MB", 1_950_000),
        (899_999, "900 KB", 899_950),
        (950_000, "0.9 MB", 850_000),
        (999, "1 KB", 950),
        (899, "899 B", 899),
    ] {
        assert_eq!(kopia_bytes_string(b, false), text);
        let v = parse_si_bytes(text).unwrap();
        assert_eq!(v, want, "{text}");
        assert!(v <= b, "{text}: {v} > {b}");
    }
    assert_eq!(kopia_bytes_string(3_250_586, true), "3.1 MiB");
}

#[test]
fn regular_file_bytes_counts_files_and_follows_no_symlinks() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    std::fs::create_dir_all(root.join("a/b")).unwrap();
    std::fs::write(root.join("top"), vec![0u8; 1000]).unwrap();
    std::fs::write(root.join("a/one"), vec![0u8; 20]).unwrap();
    std::fs::write(root.join("a/b/two"), vec![0u8; 3]).unwrap();
    std::fs::write(root.join("a/b/empty"), b"").unwrap();
    // Outside the tree, reachable only through symlinks.
    let outside = dir.path().join("outside");
    std::fs::create_dir(&outside).unwrap();
    std::fs::write(outside.join("big"), vec![0u8; 50_000]).unwrap();
    std::os::unix::fs::symlink(&outside, root.join("a/to-dir")).unwrap();
    std::os::unix::fs::symlink(outside.join("big"), root.join("to-file")).unwrap();
    std::os::unix::fs::symlink("/nonexistent", root.join("dangling")).unwrap();
    assert_eq!(regular_file_bytes(&root).unwrap(), 1023);
    assert_eq!(regular_file_bytes(&root.join("a/b/two")).unwrap(), 3);
    // A symlinked root is not followed either.
    let link = dir.path().join("link");
    std::os::unix::fs::symlink(&outside, &link).unwrap();
    assert_eq!(regular_file_bytes(&link).unwrap(), 0);
    assert_eq!(regular_file_bytes(&outside).unwrap(), 50_000);
    assert!(regular_file_bytes(&dir.path().join("missing")).is_err());
}

proptest! {
    #[test]
    fn si_bytes_never_exceed_what_kopia_printed(b in 0u64..900_000_000_000_000, base2 in any::<bool>()) {
        let text = kopia_bytes_string(b, base2);
        let v = parse_si_bytes(&text).unwrap();
        prop_assert!(v <= b, "{} parsed as {} > {}", text, v, b);
        // And not far below: less than one unit of the printed figure.
        let unit = unit_multiplier(text.split_once(' ').unwrap().1).unwrap() as u64;
        prop_assert!(b - v < unit, "{} parsed as {}, {} below {}", text, v, b - v, b);
    }

    #[test]
    fn si_bytes_never_panics(s in ".{0,40}") {
        let _ = parse_si_bytes(&s);
    }

    #[test]
    fn si_bytes_is_a_lower_bound_of_integers(n in 0u64..1_000_000_000, unit in prop::sample::select(vec![("B", 1u64), ("KB", 1000), ("kB", 1000), ("MB", 1_000_000), ("KiB", 1024), ("MiB", 1 << 20), ("GiB", 1 << 30)])) {
        // The smallest value the printed figure could stand for: kopia's whole figures are one
        // decimal with `.0` trimmed, so half a tenth of a unit below it (plain bytes and zero
        // are exact).
        let v = parse_si_bytes(&format!("{n} {}", unit.0)).unwrap();
        let want = if unit.1 == 1 || n == 0 {
            n * unit.1
        } else {
            u64::try_from((u128::from(20 * n - 1) * u128::from(unit.1)).div_ceil(20)).unwrap()
        };
        prop_assert_eq!(v, want);
    }

    #[test]
    fn parser_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..300)) {
        let _ = backup().parse(&bytes);
        let _ = restore().parse(&bytes);
    }

    #[test]
    fn parser_never_panics_on_near_misses(
        s in r"[ |/*\\!-]{0,3}[0-9]{0,3} (hashing|hashed|cached|Processed|Restored)[ ,()0-9.A-Za-z%]{0,80}"
    ) {
        let _ = backup().parse(s.as_bytes());
        let _ = restore().parse(s.as_bytes());
    }
}
