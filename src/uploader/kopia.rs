//! kopia through its CLI: argv/env for each command, the stderr/stdout parser, and outcome
//! classification.
//!
//! kopia has no machine-readable progress (see the project's reference on uploader output, section
//! "kopia (CLI)"). What this module builds against:
//!
//! - `snapshot create --json --progress` redraws one human progress line on stderr with `\r`
//!   (framed with `Separators::NewlineAndCarriageReturn`, so each redraw is one record), prints
//!   per-entry errors as `\n ! Error when processing "<path>": <error>`, and prints the snapshot
//!   manifest as one compact JSON line on stdout at the end.
//! - Byte counts are SI strings with one decimal (`52.4 MB`; base 2 with
//!   `KOPIA_BYTES_STRING_BASE_2`), so exact counts cannot be recovered from progress lines: each
//!   figure is read as the smallest count it could stand for. The manifest's
//!   `rootEntry.summ.size` is exact and is the backup's total; a restore's total is measured on
//!   the target by the engine.
//! - Exit codes are only 0 and 1 (2 on a Go panic): failures are classified by text. The first
//!   SIGINT/SIGTERM makes kopia save a *partial* snapshot and exit 0 with `incomplete: "canceled"`,
//!   so exit 0 alone never means complete.
//! - Console log lines carry no level prefix in current kopia; older releases prefixed errors with
//!   `ERROR`. Both are recognised.
//!
//! Flags and variables used (kopia's global flags accept an environment variable each):
//! - `KOPIA_PASSWORD` (the `--password` flag's variable): the password, read from the password file
//!   and passed in the environment only, never in argv.
//! - `KOPIA_CONFIG_PATH` (`--config-file`): `<cache_dir>/kopia/repository.config`, private to us.
//! - `KOPIA_LOG_DIR` (`--log-dir`): `<cache_dir>/kopia/logs`; `KOPIA_DISABLE_REPOSITORY_LOG=true`
//!   and bounds on the log files kept there (see [`LOG_BOUNDS`]).
//! - `--cache-directory=<cache_dir>/kopia/cache` on `repository connect|create` (kopia stores it in
//!   the config file; later commands read it from there).
//! - `KOPIA_PERSIST_CREDENTIALS_ON_CONNECT=false` (`--persist-credentials`) and
//!   `KOPIA_USE_KEYRING=false`: kopia would otherwise write the password next to the config file.
//!   Every command gets `KOPIA_PASSWORD` instead.
//! - `KOPIA_CHECK_FOR_UPDATES=false`, `KOPIA_DISABLE_COLOR=true` (hidden `--disable-color`).
//! - `--progress` (a global flag): since 0.23 progress is off unless stdout is a terminal.
//! - `snapshot restore` has no `--json`; it prints its progress with `--progress` and a final
//!   `Restored N files, ...` line on stderr.
//! - `--no-auto-maintenance` on every command that writes: kopia would otherwise run
//!   maintenance after it when the connection's identity owns maintenance, and Velero owns its
//!   repositories' maintenance (an error in it would also fail a saved snapshot).
//!
//! Repositories: a local path (`repository connect filesystem --path`), or object storage given
//! as `s3:<http|https>://<host[:port]>/<bucket>[/<prefix>]` (restic's form; `s3:<host>/...`
//! means https), connected with `repository connect s3 --endpoint --bucket --prefix` and the
//! prefix ending in `/` as Velero's does (without it kopia reads another place). S3 keys come
//! from `AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY`/`AWS_SESSION_TOKEN` (kopia's own variables),
//! or from an AWS shared-credentials file (`AWS_SHARED_CREDENTIALS_FILE`, `AWS_PROFILE`), which
//! kopia cannot read itself: its keys are passed in those variables, never in argv. The region
//! is `AWS_REGION` (or `AWS_DEFAULT_REGION`); a private CA is `--root-ca-pem-path`, no
//! verification `--disable-tls-verification`.

use std::ffi::OsString;
use std::fmt;
use std::os::unix::ffi::OsStringExt;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::{
    Direction, ExitInfo, Outcome, OutcomeKind, ProgressSample, RepositoryAccess, RunSummary,
    RunSummaryView, UploaderEvent,
};
use crate::error::Error;
use crate::facts::RunFacts;
use crate::text::{clean_line, format_bytes, truncate};

/// Inherited variables that would change which repository, password, config or output format
/// kopia uses; removed from the child's environment before ours are set.
pub const SCRUBBED_ENV: &[&str] = &[
    "KOPIA_PASSWORD",
    "KOPIA_CONFIG_PATH",
    "KOPIA_CACHE_DIRECTORY",
    "KOPIA_LOG_DIR",
    "KOPIA_PERSIST_CREDENTIALS_ON_CONNECT",
    "KOPIA_USE_KEYRING",
    "KOPIA_CHECK_FOR_UPDATES",
    "KOPIA_DISABLE_COLOR",
    "KOPIA_DISABLE_REPOSITORY_LOG",
    "KOPIA_LOG_DIR_MAX_FILES",
    "KOPIA_LOG_DIR_MAX_SIZE_MB",
    "KOPIA_CONTENT_LOG_DIR_MAX_FILES",
    "KOPIA_CONTENT_LOG_DIR_MAX_SIZE_MB",
    // Would switch progress byte strings to base 2; the parser copes, but SI is what we expect.
    "KOPIA_BYTES_STRING_BASE_2",
    // kopia's Azure flags read these: the repository's own are set from its access.
    "AZURE_STORAGE_ACCOUNT",
    "AZURE_STORAGE_KEY",
    "AZURE_STORAGE_DOMAIN",
    "AZURE_STORAGE_SAS_TOKEN",
    // Replaced by a bundle with the location's CA when it has one (object storage that is not S3).
    "SSL_CERT_FILE",
];

/// kopia's own logs. The CLI writes every content it touches to a content log (about 100 MB for a
/// backup of 200,000 small files) and the same entries gzipped into the repository as `_log_`
/// blobs (5 MB for that backup, about 7% of kopia's CPU there). Velero's data path (kopia as a
/// library) writes neither, and the repository is Velero's: no log blobs go in it (from 0.22;
/// 0.21 has no such setting and ignores the variable). The files under `--log-dir` (in the
/// repository's directory on the scratch volume) stay, for whoever debugs kopia, but bounded:
/// kopia's defaults keep 1000 MB of each kind per repository. kopia sweeps them at each
/// command's start.
const LOG_BOUNDS: &[(&str, &str)] = &[
    ("KOPIA_DISABLE_REPOSITORY_LOG", "true"),
    ("KOPIA_LOG_DIR_MAX_FILES", "100"),
    ("KOPIA_LOG_DIR_MAX_SIZE_MB", "50"),
    ("KOPIA_CONTENT_LOG_DIR_MAX_FILES", "20"),
    ("KOPIA_CONTENT_LOG_DIR_MAX_SIZE_MB", "100"),
];

/// Variables whose values are secrets: never shown by `Debug`.
const SECRET_ENV: &[&str] = &[
    "KOPIA_PASSWORD",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AZURE_STORAGE_KEY",
    "AZURE_STORAGE_SAS_TOKEN",
    "AZURE_ACCOUNT_KEY",
    "AZURE_ACCOUNT_SAS",
];

/// A kopia invocation: argv (without the program) and environment. The environment holds the
/// repository password, so `Debug` redacts it.
#[derive(Clone, Default)]
pub struct KopiaInvocation {
    pub args: Vec<OsString>,
    pub env: Vec<(OsString, OsString)>,
}

impl fmt::Debug for KopiaInvocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let env: Vec<(&OsString, &dyn fmt::Debug)> = self
            .env
            .iter()
            .map(|(k, v)| {
                let shown: &dyn fmt::Debug = if SECRET_ENV.iter().any(|s| k == s) {
                    &"<redacted>"
                } else {
                    v
                };
                (k, shown)
            })
            .collect();
        f.debug_struct("KopiaInvocation")
            .field("args", &self.args)
            .field("env", &env)
            .finish()
    }
}

impl KopiaInvocation {
    fn arg(mut self, a: impl Into<OsString>) -> Self {
        self.args.push(a.into());
        self
    }
}

/// kopia's private directory under the access's cache dir.
fn kopia_dir(access: &RepositoryAccess) -> PathBuf {
    access.cache_dir.join("kopia")
}

/// The config file `repository connect` writes and every later command reads.
pub fn config_path(access: &RepositoryAccess) -> PathBuf {
    kopia_dir(access).join("repository.config")
}

/// Reads the password file. One trailing newline (`\n` or `\r\n`) is not part of the password, as
/// with restic's `--password-file`.
fn read_password(path: &Path) -> Result<OsString, Error> {
    let mut bytes = std::fs::read(path).map_err(|source| Error::Io {
        what: "cannot read the kopia password file",
        path: path.to_path_buf(),
        source,
    })?;
    if bytes.last() == Some(&b'\n') {
        bytes.pop();
        if bytes.last() == Some(&b'\r') {
            bytes.pop();
        }
    }
    if bytes.is_empty() {
        return Err(Error::Invalid(format!(
            "the kopia password file {} is empty",
            path.display()
        )));
    }
    Ok(OsString::from_vec(bytes))
}

fn base(access: &RepositoryAccess) -> Result<KopiaInvocation, Error> {
    let dir = kopia_dir(access);
    let mut env: Vec<(OsString, OsString)> = vec![
        (
            "KOPIA_PASSWORD".into(),
            read_password(&access.password_file)?,
        ),
        (
            "KOPIA_CONFIG_PATH".into(),
            config_path(access).into_os_string(),
        ),
        ("KOPIA_LOG_DIR".into(), dir.join("logs").into_os_string()),
        (
            "KOPIA_PERSIST_CREDENTIALS_ON_CONNECT".into(),
            "false".into(),
        ),
        ("KOPIA_USE_KEYRING".into(), "false".into()),
        ("KOPIA_CHECK_FOR_UPDATES".into(), "false".into()),
        ("KOPIA_DISABLE_COLOR".into(), "true".into()),
    ];
    env.extend(
        LOG_BOUNDS
            .iter()
            .map(|(k, v)| (OsString::from(*k), OsString::from(*v))),
    );
    for (k, v) in &access.extra_env {
        env.push((k.into(), v.into()));
    }
    // kopia takes a CA for S3 only (`--root-ca-pem-path`, kept in its config); its Azure and GCS
    // clients trust Go's root store, which SSL_CERT_FILE replaces: the system's roots plus the
    // location's CA, on every command (they all talk to the store).
    if let Some(ca) = &access.ca_cert
        && matches!(
            Storage::parse(&access.repository),
            Ok(Storage::Azure { .. } | Storage::Gcs { .. })
        )
    {
        env.push((
            "SSL_CERT_FILE".into(),
            ca_bundle(&dir, ca)?.into_os_string(),
        ));
    }
    Ok(KopiaInvocation {
        args: Vec::new(),
        env,
    })
}

/// Where Go looks for the system's roots on Linux (crypto/x509), in its order.
const SYSTEM_ROOTS: &[&str] = &[
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/ca-bundle.pem",
    "/etc/pki/tls/cacert.pem",
    "/etc/pki/ca-trust/extracted/pem/tls-ca-bundle.pem",
    "/etc/ssl/cert.pem",
];

/// `<dir>/ca-bundle.pem`: the system's roots (the agent's own SSL_CERT_FILE, else the first of
/// Go's files that exists; none is fine) followed by `ca`.
fn ca_bundle(dir: &Path, ca: &Path) -> Result<PathBuf, Error> {
    let io = |what: &'static str, path: &Path| {
        let path = path.to_path_buf();
        move |source| Error::Io { what, path, source }
    };
    let mut bundle = std::env::var_os("SSL_CERT_FILE")
        .map(PathBuf::from)
        .into_iter()
        .chain(SYSTEM_ROOTS.iter().map(PathBuf::from))
        .find_map(|p| std::fs::read(p).ok())
        .unwrap_or_default();
    if !bundle.is_empty() && !bundle.ends_with(b"\n") {
        bundle.push(b'\n');
    }
    bundle.extend(std::fs::read(ca).map_err(io("cannot read the CA certificate", ca))?);
    std::fs::create_dir_all(dir).map_err(io("cannot create kopia's directory", dir))?;
    let path = dir.join("ca-bundle.pem");
    std::fs::write(&path, bundle).map_err(io("cannot write the CA bundle", &path))?;
    Ok(path)
}

/// Where a kopia repository lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Storage {
    Filesystem(PathBuf),
    S3 {
        /// `host[:port]`.
        endpoint: String,
        tls: bool,
        bucket: String,
        /// Empty, or ending with `/`.
        prefix: String,
    },
    /// Azure Blob Storage: `azure:<container>:/<prefix>` (restic's form). The account, its key
    /// (or SAS) and the endpoint come from the environment.
    Azure {
        container: String,
        /// Empty, or ending with `/`.
        prefix: String,
    },
    /// Google Cloud Storage: `gs:<bucket>:/<prefix>` (restic's form).
    Gcs {
        bucket: String,
        /// Empty, or ending with `/`.
        prefix: String,
    },
}

/// A prefix as Velero's layout needs it: no leading `/`, a trailing `/` unless empty (kopia joins
/// the prefix to its blob names as given).
fn dir_prefix(p: &str) -> String {
    let p = p.trim_matches('/');
    if p.is_empty() {
        String::new()
    } else {
        format!("{p}/")
    }
}

/// `<bucket>:/<prefix>` of restic's `azure:` and `gs:` forms.
fn bucket_and_prefix(rest: &str, form: &str) -> Result<(String, String), Error> {
    let (bucket, prefix) = rest.split_once(':').unwrap_or((rest, ""));
    if bucket.is_empty() || bucket.contains('/') {
        return Err(Error::Invalid(format!("kopia repository: expected {form}")));
    }
    Ok((bucket.to_string(), dir_prefix(prefix)))
}

impl Storage {
    /// From a repository string: `s3:<scheme>://<host>/<bucket>[/<prefix>]` or a local path.
    pub fn parse(repository: &str) -> Result<Storage, Error> {
        if let Some(rest) = repository.strip_prefix("azure:") {
            let (container, prefix) = bucket_and_prefix(rest, "azure:<container>:/<prefix>")?;
            return Ok(Storage::Azure { container, prefix });
        }
        if let Some(rest) = repository.strip_prefix("gs:") {
            let (bucket, prefix) = bucket_and_prefix(rest, "gs:<bucket>:/<prefix>")?;
            return Ok(Storage::Gcs { bucket, prefix });
        }
        let Some(rest) = repository.strip_prefix("s3:") else {
            if repository.is_empty() {
                return Err(Error::Invalid("the kopia repository is empty".into()));
            }
            return Ok(Storage::Filesystem(PathBuf::from(repository)));
        };
        let (tls, rest) = match rest.split_once("://") {
            Some(("https", r)) => (true, r),
            Some(("http", r)) => (false, r),
            Some((scheme, _)) => {
                return Err(Error::Invalid(format!(
                    "kopia S3 repository: unsupported scheme {scheme:?} (http or https)"
                )));
            }
            None => (true, rest),
        };
        let mut parts = rest.splitn(3, '/');
        let endpoint = parts.next().unwrap_or_default().to_string();
        let bucket = parts.next().unwrap_or_default().to_string();
        let prefix = parts
            .next()
            .unwrap_or_default()
            .trim_matches('/')
            .to_string();
        if endpoint.is_empty() || bucket.is_empty() {
            return Err(Error::Invalid(
                "kopia S3 repository: expected s3:https://<host[:port]>/<bucket>[/<prefix>]".into(),
            ));
        }
        if endpoint.contains('@') {
            return Err(Error::Invalid(
                "kopia S3 repository: credentials do not go in the URL (use AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)".into(),
            ));
        }
        // Velero's prefixes end in '/'.
        let prefix = dir_prefix(&prefix);
        Ok(Storage::S3 {
            endpoint,
            tls,
            bucket,
            prefix,
        })
    }
}

/// The value of `name` in the access's extra environment, else in the agent's own.
fn env_value(access: &RepositoryAccess, name: &str) -> Option<String> {
    access
        .extra_env
        .iter()
        .rev()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.clone())
        .or_else(|| std::env::var(name).ok())
        .filter(|v| !v.is_empty())
}

/// S3 keys for kopia's variables from an AWS shared-credentials file (INI: `[profile]` sections
/// of `key = value`), which kopia cannot read. Nothing when the keys are already in the
/// environment or no file is named.
fn shared_credentials(access: &RepositoryAccess) -> Result<Vec<(OsString, OsString)>, Error> {
    if env_value(access, "AWS_ACCESS_KEY_ID").is_some() {
        return Ok(Vec::new());
    }
    let Some(file) = env_value(access, "AWS_SHARED_CREDENTIALS_FILE") else {
        return Ok(Vec::new());
    };
    let profile = env_value(access, "AWS_PROFILE").unwrap_or_else(|| "default".into());
    let text = std::fs::read_to_string(&file).map_err(|source| Error::Io {
        what: "cannot read the AWS credentials file",
        path: PathBuf::from(&file),
        source,
    })?;
    let mut section = String::new();
    let mut found = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            section = name.trim().trim_start_matches("profile ").to_string();
            continue;
        }
        if section != profile {
            continue;
        }
        if let Some((k, v)) = line.split_once('=') {
            let var = match k.trim() {
                "aws_access_key_id" => "AWS_ACCESS_KEY_ID",
                "aws_secret_access_key" => "AWS_SECRET_ACCESS_KEY",
                "aws_session_token" => "AWS_SESSION_TOKEN",
                _ => continue,
            };
            found.push((OsString::from(var), OsString::from(v.trim())));
        }
    }
    if found.is_empty() {
        return Err(Error::Invalid(format!(
            "the AWS credentials file has no keys for profile {profile:?}"
        )));
    }
    Ok(found)
}

/// kopia's Azure variables from restic's (`AZURE_ACCOUNT_NAME`, `AZURE_ACCOUNT_KEY` or
/// `AZURE_ACCOUNT_SAS`, `AZURE_ENDPOINT_SUFFIX`), which the agent sets for an Azure location and
/// a user of the one-shot CLI sets for either uploader; kopia's own names are taken as they are.
/// kopia addresses `https://<account>.<domain>/`, restic `https://<account>.blob.<suffix>/`.
fn azure_credentials(access: &RepositoryAccess) -> Result<Vec<(OsString, OsString)>, Error> {
    let either =
        |kopia: &str, restic: &str| env_value(access, kopia).or_else(|| env_value(access, restic));
    let account = either("AZURE_STORAGE_ACCOUNT", "AZURE_ACCOUNT_NAME").ok_or_else(|| {
        Error::Invalid("kopia Azure repository: no storage account (AZURE_ACCOUNT_NAME)".into())
    })?;
    let mut env = vec![("AZURE_STORAGE_ACCOUNT".into(), account.into())];
    match (
        either("AZURE_STORAGE_KEY", "AZURE_ACCOUNT_KEY"),
        either("AZURE_STORAGE_SAS_TOKEN", "AZURE_ACCOUNT_SAS"),
    ) {
        (Some(key), _) => env.push(("AZURE_STORAGE_KEY".into(), key.into())),
        (None, Some(sas)) => env.push(("AZURE_STORAGE_SAS_TOKEN".into(), sas.into())),
        (None, None) => {
            return Err(Error::Invalid(
                "kopia Azure repository: no storage account key or SAS (AZURE_ACCOUNT_KEY or AZURE_ACCOUNT_SAS)".into(),
            ));
        }
    }
    let domain = env_value(access, "AZURE_STORAGE_DOMAIN")
        .or_else(|| env_value(access, "AZURE_ENDPOINT_SUFFIX").map(|s| format!("blob.{s}")));
    if let Some(domain) = domain {
        env.push(("AZURE_STORAGE_DOMAIN".into(), domain.into()));
    }
    Ok(env)
}

fn repository_command(access: &RepositoryAccess, verb: &str) -> Result<KopiaInvocation, Error> {
    let mut cache = OsString::from("--cache-directory=");
    cache.push(kopia_dir(access).join("cache"));
    let mut inv = base(access)?.arg("repository").arg(verb);
    match Storage::parse(&access.repository)? {
        Storage::Filesystem(path) => {
            let mut p = OsString::from("--path=");
            p.push(path);
            inv = inv.arg("filesystem").arg(p);
        }
        Storage::S3 {
            endpoint,
            tls,
            bucket,
            prefix,
        } => {
            inv.env.extend(shared_credentials(access)?);
            inv = inv
                .arg("s3")
                .arg(format!("--endpoint={endpoint}"))
                .arg(format!("--bucket={bucket}"))
                .arg(format!("--prefix={prefix}"));
            if let Some(region) =
                env_value(access, "AWS_REGION").or_else(|| env_value(access, "AWS_DEFAULT_REGION"))
            {
                inv = inv.arg(format!("--region={region}"));
            }
            if !tls {
                inv = inv.arg("--disable-tls");
            }
            if access.insecure_tls {
                inv = inv.arg("--disable-tls-verification");
            }
            if let Some(ca) = &access.ca_cert {
                let mut a = OsString::from("--root-ca-pem-path=");
                a.push(ca);
                inv = inv.arg(a);
            }
        }
        Storage::Azure { container, prefix } => {
            inv.env.extend(azure_credentials(access)?);
            inv = inv
                .arg("azure")
                .arg(format!("--container={container}"))
                .arg(format!("--prefix={prefix}"));
        }
        Storage::Gcs { bucket, prefix } => {
            inv = inv
                .arg("gcs")
                .arg(format!("--bucket={bucket}"))
                .arg(format!("--prefix={prefix}"));
            // A path, not a secret; without one kopia finds Google's default credentials.
            if let Some(file) = env_value(access, "GOOGLE_APPLICATION_CREDENTIALS") {
                inv = inv.arg(format!("--credentials-file={file}"));
            }
        }
    }
    if verb == "create" {
        inv = inv.arg("--no-auto-maintenance");
    }
    for flag in cache_limit_flags(access.kopia_cache_limit_mb) {
        inv = inv.arg(flag);
    }
    Ok(inv.arg(cache))
}

/// The cache bound of a connection, split as Velero 1.18's kopia connection splits its
/// `cacheLimitMB`: 4/5 for content and 1/5 for metadata as hard limits, 4/5 of each as the size
/// kopia sweeps down to.
fn cache_limit_flags(limit_mb: Option<u64>) -> Vec<String> {
    let Some(limit) = limit_mb else {
        return Vec::new();
    };
    let content = (limit / 5 * 4).max(1);
    let metadata = (limit / 5).max(1);
    vec![
        format!("--content-cache-size-mb={}", (content / 5 * 4).max(1)),
        format!("--content-cache-size-limit-mb={content}"),
        format!("--metadata-cache-size-mb={}", (metadata / 5 * 4).max(1)),
        format!("--metadata-cache-size-limit-mb={metadata}"),
    ]
}

/// `kopia repository connect filesystem --path=<repo>`: writes our private config file.
pub fn connect(access: &RepositoryAccess) -> Result<KopiaInvocation, Error> {
    repository_command(access, "connect")
}

// --- connection reuse ----------------------------------------------------------------------------
//
// Every kopia command opens the repository on its own: it loads the binary, derives the key from
// the password (scrypt, 64 MiB and a few hundred ms of CPU) and reads the repository's format and
// indexes. `repository connect` and `policy set` before each snapshot were two such opens more
// than Velero's data path makes (one process, one open). The connection is kept in the
// repository's private config (one per repository, see the agent's cache dirs) and reused while
// nothing it was made with has changed; the keep-everything policy is set once per source and
// connection. A reused connection that fails is dropped and the command run again after a fresh
// `repository connect` (see the engine), so a repository recreated in place, rotated keys or a
// new CA cost one retry, never a wrong result.

/// The file that records what the current connection was made with.
fn connection_record(access: &RepositoryAccess) -> PathBuf {
    kopia_dir(access).join("connection")
}

/// The sources whose keep-everything policy was set through the current connection.
fn policy_record(access: &RepositoryAccess) -> PathBuf {
    kopia_dir(access).join("policies")
}

/// What `repository connect` is made with, the password aside (a wrong one fails every command
/// anyway, and no trace of it is written): its argv, its environment (keys included, so rotated
/// ones reconnect) and the CA file's content. FNV-1a, hex.
///
/// The CA and an AWS credentials file are written per operation (a new path each time) and kopia
/// copies what it needs of them into its config at connect (the CA's PEM, the keys), so those
/// two count by content, not path: otherwise no connection would ever be reused on S3 with a
/// private CA or a location's own Secret. A GCS credentials file is kept by path in kopia's
/// config and read by every command, so its path counts: a per-operation file reconnects.
fn connection_fingerprint(access: &RepositoryAccess) -> Result<String, Error> {
    const CA_FLAG: &str = "--root-ca-pem-path=";
    let inv = connect(access)?;
    let mut parts: Vec<u8> = Vec::new();
    let mut eat = |b: &[u8]| {
        parts.extend_from_slice(b);
        parts.push(0);
    };
    let content = |path: &std::ffi::OsStr| std::fs::read(path).unwrap_or_default();
    for a in &inv.args {
        // The flag's path is `access.ca_cert`, whose content is counted below.
        let a = a.as_encoded_bytes();
        eat(if a.starts_with(CA_FLAG.as_bytes()) {
            CA_FLAG.as_bytes()
        } else {
            a
        });
    }
    for (k, v) in &inv.env {
        if k == "KOPIA_PASSWORD" {
            continue;
        }
        eat(k.as_encoded_bytes());
        if k == "AWS_SHARED_CREDENTIALS_FILE" {
            eat(&content(v));
        } else {
            eat(v.as_encoded_bytes());
        }
    }
    if let Some(ca) = &access.ca_cert {
        eat(&std::fs::read(ca).unwrap_or_default());
    }
    let h = crate::text::fnv1a64(&parts);
    Ok(format!("{h:016x}"))
}

/// True when the repository's config holds a connection made with exactly what `access` says now.
pub fn connection_is_current(access: &RepositoryAccess) -> bool {
    let Ok(want) = connection_fingerprint(access) else {
        return false;
    };
    config_path(access).is_file()
        && std::fs::read_to_string(connection_record(access)).is_ok_and(|have| have.trim() == want)
}

/// Records a connection `repository connect|create` has just made.
pub fn remember_connection(access: &RepositoryAccess) {
    if let Ok(f) = connection_fingerprint(access)
        && let Err(e) = std::fs::write(connection_record(access), f)
    {
        tracing::debug!(error = %e, "cannot record the kopia connection; the next operation connects again");
    }
}

/// Forgets the connection and the policies set through it: the next operation connects again.
pub fn forget_connection(access: &RepositoryAccess) {
    let _ = std::fs::remove_file(connection_record(access));
    let _ = std::fs::remove_file(policy_record(access));
}

/// Forgets the connection and empties kopia's cache of the repository too: what failed on a
/// reused connection may be the cache itself (kopia keeps the repository's format blob there for
/// minutes: a repository recreated in place with another key is read with the old one).
pub fn forget_connection_and_cache(access: &RepositoryAccess) {
    forget_connection(access);
    let _ = std::fs::remove_dir_all(kopia_dir(access).join("cache"));
}

/// True when the keep-everything policy of `source` was set through the current connection.
pub fn policy_is_set(access: &RepositoryAccess, source: &str) -> bool {
    std::fs::read_to_string(policy_record(access)).is_ok_and(|l| l.lines().any(|s| s == source))
}

/// Records that the keep-everything policy of `source` is set.
pub fn remember_policy(access: &RepositoryAccess, source: &str) {
    use std::io::Write;
    let r = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(policy_record(access))
        .and_then(|mut f| writeln!(f, "{source}"));
    if let Err(e) = r {
        tracing::debug!(error = %e, "cannot record the policy; it is set again next time");
    }
}

/// `kopia repository create filesystem --path=<repo>`: initialises the repository and connects.
pub fn create(access: &RepositoryAccess) -> Result<KopiaInvocation, Error> {
    repository_command(access, "create")
}

/// What a snapshot records besides the data: Velero 1.17+ snapshots carry a source identity
/// of their own (`default@default:snapshot-pod-volume/kopia/<ns>/<pod>/<volume>`), the
/// description `Kopia Uploader` and the pin `velero-pin`.
#[derive(Debug, Clone, Default)]
pub struct SnapshotOptions {
    /// `--override-source user@host:path`: the identity the snapshot is filed under (and the
    /// previous snapshots kopia chooses a parent among).
    pub source: Option<String>,
    pub description: Option<String>,
    pub pins: Vec<String>,
    /// Files read at once (`--parallel`).
    pub parallel: Option<u32>,
    /// `--fail-fast`: stop at the first unreadable entry (Velero sets it).
    pub fail_fast: bool,
    /// Set Velero's keep-everything policy on the source before the snapshot: without a policy
    /// of its own the source falls under kopia's default retention (10 latest, 48 hourly, ...),
    /// which `snapshot create` applies at once and would delete snapshots Velero still needs.
    pub keep_all_policy: bool,
}

/// `kopia snapshot create --json --progress <source>`: progress on stderr, manifest on stdout.
pub fn snapshot_create(
    access: &RepositoryAccess,
    source: &Path,
    tags: &[(String, String)],
    options: &SnapshotOptions,
) -> Result<KopiaInvocation, Error> {
    let mut inv = base(access)?
        .arg("snapshot")
        .arg("create")
        .arg("--json")
        // With --json: the manifest with its statistics (files cached / read), which
        // incremental_bytes needs; alone it prints no manifest at all.
        .arg("--json-verbose")
        .arg("--progress")
        .arg("--no-auto-maintenance");
    if let Some(s) = &options.source {
        inv = inv.arg(format!("--override-source={s}"));
    }
    if let Some(d) = &options.description {
        inv = inv.arg(format!("--description={d}"));
    }
    for p in &options.pins {
        inv = inv.arg(format!("--pin={p}"));
    }
    for (k, v) in tags {
        inv = inv.arg(format!("--tags={k}:{v}"));
    }
    if let Some(n) = options.parallel {
        inv = inv.arg(format!("--parallel={n}"));
    }
    if options.fail_fast {
        inv = inv.arg("--fail-fast");
    }
    Ok(inv.arg(source.as_os_str()))
}

/// Velero's per-source policy (keep everything, no compression, manual scheduling, unknown
/// entry types ignored), set on `source` (`user@host:path`) before its snapshots.
pub fn policy_keep_all(access: &RepositoryAccess, source: &str) -> Result<KopiaInvocation, Error> {
    const KEEP: &str = "2147483647";
    let mut inv = base(access)?.arg("policy").arg("set").arg(source);
    for k in ["latest", "hourly", "daily", "weekly", "monthly", "annual"] {
        inv = inv.arg(format!("--keep-{k}={KEEP}"));
    }
    Ok(inv
        .arg("--compression=none")
        .arg("--manual")
        .arg("--ignore-unknown-types=true")
        .arg("--no-auto-maintenance"))
}

/// Deletes one snapshot manifest: only one the agent itself has just made (its Backup ended
/// while it ran, so no Backup references it). Its content goes with Velero's next maintenance.
pub fn snapshot_delete(access: &RepositoryAccess, id: &str) -> Result<KopiaInvocation, Error> {
    check_snapshot_id(id)?;
    Ok(base(access)?
        .arg("snapshot")
        .arg("delete")
        .arg(id)
        .arg("--delete")
        .arg("--no-auto-maintenance"))
}

/// The longest snapshot ID accepted for a restore: kopia's manifest IDs are 32 hex digits and its
/// object IDs (`k<hash>`, `Ix<hash>`) a few characters more than their hash; this leaves room.
pub const MAX_SNAPSHOT_ID_LEN: usize = 128;

/// A snapshot ID for kopia's argv: 1 to 128 ASCII letters and digits (manifest and object IDs
/// are that).
pub fn check_snapshot_id(id: &str) -> Result<(), Error> {
    super::check_snapshot_id(
        "kopia",
        id,
        MAX_SNAPSHOT_ID_LEN,
        u8::is_ascii_alphanumeric,
        "letters and digits",
    )
}

/// How a snapshot is written out (Velero's `uploaderSettings`).
#[derive(Debug, Clone, Default)]
pub struct RestoreOptions {
    /// `--write-sparse-files` (`WriteSparseFiles: "true"`).
    pub write_sparse_files: bool,
    /// `--parallel` (`ParallelFilesDownload`).
    pub parallel: Option<u32>,
}

/// `kopia snapshot restore --progress <id> <target>`. restore has no `--json`: progress and the
/// final `Restored ...` line are text on stderr. Fails when `snapshot_id` is not a kopia ID (see
/// [`check_snapshot_id`]).
pub fn snapshot_restore(
    access: &RepositoryAccess,
    snapshot_id: &str,
    target: &Path,
    options: &RestoreOptions,
) -> Result<KopiaInvocation, Error> {
    check_snapshot_id(snapshot_id)?;
    let mut inv = base(access)?
        .arg("snapshot")
        .arg("restore")
        .arg("--progress");
    if options.write_sparse_files {
        inv = inv.arg("--write-sparse-files");
    }
    let parallel = options.parallel.or_else(|| {
        default_restore_parallel(&Storage::parse(&access.repository).ok()?, cpu_count())
    });
    if let Some(n) = parallel {
        inv = inv.arg(format!("--parallel={n}"));
    }
    Ok(inv.arg(snapshot_id).arg(target.as_os_str()))
}

/// Files restored at once when the restore names no `ParallelFilesDownload`; `None` leaves
/// kopia's own default (8).
///
/// From object storage: Velero's data path's default, one file per CPU (`runtime.NumCPU()`).
/// kopia's S3 client keeps at most 2 idle connections to its endpoint (its transport is a clone
/// of Go's default one), so with more files at once than that, most reads end their connection
/// and the next one opens a new one, TLS handshake included: a cold restore of 50,000 small files
/// from S3 over TLS opened 21,630 connections at kopia's 8 and 4 at 2, and took 49-52 s (kopia's
/// user CPU 30-31 s) instead of 28-30 s (17 s) on 2 CPUs (BENCHMARKS.md case 9). Velero's node agent pays the
/// same price above 2 CPUs; matching its default is never worse than what the operator had, and
/// `--parallel-files-download` still chooses per restore.
/// From a filesystem repository: kopia's 8, measured faster than 2 on 200,000 small files.
fn default_restore_parallel(storage: &Storage, cpus: u32) -> Option<u32> {
    match storage {
        Storage::Filesystem(_) => None,
        Storage::S3 { .. } | Storage::Azure { .. } | Storage::Gcs { .. } => Some(cpus.max(1)),
    }
}

/// CPUs this process may run on: what Go's `runtime.NumCPU()` counts (the scheduler's affinity
/// mask, not a cgroup quota), so the number matches Velero's on the same node.
fn cpu_count() -> u32 {
    use nix::sched::{CpuSet, sched_getaffinity};
    use nix::unistd::Pid;
    match sched_getaffinity(Pid::from_raw(0)) {
        Ok(set) => (0..CpuSet::count())
            .filter(|&i| set.is_set(i).unwrap_or(false))
            .count()
            .max(1) as u32,
        Err(_) => std::thread::available_parallelism().map_or(1, |n| n.get() as u32),
    }
}

/// Parses kopia's human byte strings: `0 B`, `52.4 MB`, `1.2 GB`, `512 KB`/`kB`, and base 2
/// (`KiB`, `MiB`, `GiB`, ...). The space before the unit is optional and a bare number is bytes.
///
/// kopia rounds sizes to the printed precision, so a figure stands for a range of byte counts and
/// this returns the *smallest* of them: half a unit of the last printed digit below the figure
/// (`1.3 MB` -> 1,250,000; `2 MiB`, kopia's 2.0 with `.0` trimmed, -> 1.95 MiB; plain bytes are
/// exact). Progress built from these
/// values never exceeds the exact size the snapshot manifest reports at the end, so it never has to
/// go backwards. Exact integer arithmetic (no floats); `None` for anything else or when that
/// smallest value is above `u64::MAX`.
pub fn parse_si_bytes(s: &str) -> Option<u64> {
    let s = s.trim();
    let num_end = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(num_end);
    let unit = unit.trim_start();
    let (int_part, frac_part) = match num.split_once('.') {
        Some((i, f)) => (i, f),
        None => (num, ""),
    };
    if int_part.is_empty() && frac_part.is_empty() || frac_part.contains('.') {
        return None;
    }
    let multiplier: u128 = unit_multiplier(unit)?;
    let int: u128 = if int_part.is_empty() {
        0
    } else {
        // More than 39 digits cannot fit in u128 and certainly not in the u64 result.
        if int_part.len() > 30 {
            return None;
        }
        int_part.parse().ok()?
    };
    // Digits beyond 18 decimals cannot matter for a byte count.
    let frac_digits = &frac_part[..frac_part.len().min(18)];
    let (frac, scale): (u128, u128) = if frac_digits.is_empty() {
        // kopia prints every size with one decimal and trims a trailing `.0` (`niceNumber`):
        // `201 MB` is 201.0 MB, at least 200.95 MB, not 200.5 MB. Plain bytes are exact.
        if multiplier == 1 { (0, 1) } else { (0, 10) }
    } else {
        (
            frac_digits.parse().ok()?,
            10u128.pow(frac_digits.len() as u32),
        )
    };
    // The figure in units of its last printed digit (`52.4` -> 524 tenths). Every overflow below
    // means a result far above u64::MAX.
    let figure = int.checked_mul(scale)?.checked_add(frac)?;
    let value = if multiplier == 1 || figure == 0 {
        // Plain bytes are printed exactly (a fraction of a byte is dropped).
        figure * multiplier / scale
    } else {
        // ceil((figure - 1/2) * multiplier / scale): the smallest whole byte count that rounds to
        // the figure.
        (figure.checked_mul(2)? - 1)
            .checked_mul(multiplier)?
            .div_ceil(2 * scale)
    };
    u64::try_from(value).ok()
}

fn unit_multiplier(unit: &str) -> Option<u128> {
    let u = unit.strip_suffix(['B', 'b']).unwrap_or(unit);
    if u.is_empty() {
        // `B`, or a bare number.
        return Some(1);
    }
    let (prefix, base2) = match u.strip_suffix('i') {
        Some(p) => (p, true),
        None => (u, false),
    };
    let power = match prefix {
        "k" | "K" => 1,
        "M" | "m" => 2,
        "G" | "g" => 3,
        "T" | "t" => 4,
        "P" | "p" => 5,
        "E" | "e" => 6,
        _ => return None,
    };
    let base: u128 = if base2 { 1024 } else { 1000 };
    Some(base.pow(power))
}

/// The snapshot manifest printed by `snapshot create --json`. Unknown fields are ignored.
#[derive(Deserialize)]
struct Manifest {
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    incomplete: Option<String>,
    #[serde(default, rename = "rootEntry")]
    root_entry: Option<RootEntry>,
    #[serde(default)]
    stats: Option<ManifestStats>,
}

#[derive(Deserialize)]
struct ManifestStats {
    #[serde(rename = "cachedFiles")]
    cached_files: Option<u64>,
    #[serde(rename = "nonCachedFiles")]
    non_cached_files: Option<u64>,
}

#[derive(Deserialize)]
struct RootEntry {
    #[serde(default)]
    summ: Option<DirSummary>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct DirSummary {
    size: u64,
    files: u64,
    #[serde(rename = "numFailed")]
    num_failed: u64,
}

/// Phrases that end a kopia run, whatever the line starts with (current kopia prints errors with
/// no level prefix).
const FATAL_PHRASES: &[&str] = &[
    "invalid repository password",
    "repository is not connected",
    "not connected to a repository",
    "repository not initialized",
    "unable to find repository",
    "unable to open repository",
    "error connecting to repository",
    "cannot access storage path",
    "can't connect to storage",
    "unable to get local filesystem entry",
];

/// Stateless-per-record parser for kopia's output (both streams).
#[derive(Debug, Clone, Copy)]
pub struct KopiaParser {
    direction: Direction,
}

impl KopiaParser {
    pub fn new(direction: Direction) -> Self {
        Self { direction }
    }

    /// Parses one framed record from either stream.
    pub fn parse(&self, record: &[u8]) -> UploaderEvent {
        let trimmed = record.trim_ascii();
        if trimmed.first() == Some(&b'{') {
            return parse_manifest(trimmed);
        }
        self.text(clean_line(trimmed))
    }

    fn text(&self, line: String) -> UploaderEvent {
        if line.is_empty() {
            return UploaderEvent::Ignored;
        }
        // Per-entry errors come after `\n ! ` while progress is on.
        let body = match line.strip_prefix('!') {
            Some(rest) => rest.trim_start(),
            None => line.as_str(),
        };
        // Older kopia prefixed error log lines with their level. Azure's SDK errors span lines,
        // one of which is `ERROR CODE: <code>`: part of the error above, not a level.
        let (level_error, body) = match body.strip_prefix("ERROR") {
            Some(rest) if rest.starts_with(" CODE:") => (false, body),
            Some(rest) if rest.is_empty() || rest.starts_with([' ', ':', '\t']) => {
                (true, rest.trim_start_matches(':').trim_start())
            }
            _ => (false, body),
        };
        if let Some(ev) = item_error(body) {
            return ev;
        }
        if body.starts_with("Found ") && body.contains("fatal error(s) while snapshotting") {
            return UploaderEvent::Text(body.to_string());
        }
        if let Some(sample) = backup_progress(body) {
            return UploaderEvent::Progress(sample);
        }
        if self.direction == Direction::Restore {
            if let Some(sample) = restore_progress(body) {
                return UploaderEvent::Progress(sample);
            }
            if let Some(summary) = restore_summary(body) {
                return UploaderEvent::Summary(summary);
            }
        }
        if looks_like_progress(body) {
            return UploaderEvent::Malformed(format!(
                "unparsable kopia progress line: {}",
                truncate(body, 256)
            ));
        }
        if level_error || FATAL_PHRASES.iter().any(|p| body.contains(p)) {
            return UploaderEvent::Fatal(body.to_string());
        }
        UploaderEvent::Text(line)
    }
}

fn parse_manifest(json: &[u8]) -> UploaderEvent {
    match serde_json::from_slice::<Manifest>(json) {
        Ok(m) if m.id.is_some() || m.root_entry.is_some() => {
            let summ = m.root_entry.and_then(|r| r.summ).unwrap_or_default();
            UploaderEvent::Summary(RunSummary {
                snapshot_id: m.id.filter(|id| !id.is_empty()),
                total_bytes: summ.size,
                total_files: summ.files,
                bytes_added: 0,
                failed_items: summ.num_failed,
                incomplete: m.incomplete.filter(|r| !r.is_empty()),
                files_cached: m.stats.as_ref().and_then(|s| s.cached_files),
                files_read: m.stats.as_ref().and_then(|s| s.non_cached_files),
                ..RunSummary::default()
            })
        }
        // Valid JSON, but not a manifest: not ours to judge.
        Ok(_) => UploaderEvent::Ignored,
        Err(e) => UploaderEvent::Malformed(format!(
            "unparsable kopia JSON record of {} bytes ({e})",
            json.len()
        )),
    }
}

/// Velero's `incrementalBytes` for a kopia snapshot: the bytes read again rather than taken
/// unchanged from the parent snapshot (its own uploader reports the estimated total minus the
/// cached bytes). The manifest counts files, not bytes, so the figure is exact when no file or
/// every file came from the parent; in between it is the "hashed" figure of kopia's last
/// progress line (printed when the upload finishes), which kopia rounds to one decimal of its
/// unit and the parser reads as the lower bound: at most 0.1 of that unit (kB, MB, GB, ...)
/// below the truth, never above it, exact below 900 bytes. `None` when kopia said
/// neither (no statistics in the manifest).
pub fn incremental_bytes(s: &RunSummary, last_bytes_read: Option<u64>) -> Option<u64> {
    match (s.files_cached?, s.files_read?) {
        (_, 0) => Some(0),
        (0, _) => Some(s.total_bytes),
        _ => last_bytes_read.map(|b| b.min(s.total_bytes)),
    }
}

/// `Error when processing "<path>": <error>`.
fn item_error(body: &str) -> Option<UploaderEvent> {
    let rest = body.strip_prefix("Error when processing \"")?;
    let (item, message) = rest.split_once("\": ")?;
    Some(UploaderEvent::ItemError {
        item: item.to_string(),
        message: message.trim().to_string(),
    })
}

/// A progress line we should have understood (so a failure to parse it is worth reporting).
fn looks_like_progress(body: &str) -> bool {
    let after_spinner = strip_spinner(body).unwrap_or(body);
    after_spinner.contains(" hashing, ") && after_spinner.contains(" hashed (")
        || body.starts_with("Processed ") && body.contains(") of ")
}

const SPINNER: &[char] = &['|', '/', '-', '\\', '*'];

fn strip_spinner(body: &str) -> Option<&str> {
    let mut chars = body.chars();
    let first = chars.next()?;
    if !SPINNER.contains(&first) {
        return None;
    }
    let rest = chars.as_str();
    rest.starts_with(' ').then(|| rest.trim_start())
}

/// A tiny cursor over a progress line; every step returns `None` when the text does not match.
struct Cursor<'a>(&'a str);

impl<'a> Cursor<'a> {
    fn lit(&mut self, s: &str) -> Option<()> {
        self.0 = self.0.strip_prefix(s)?;
        Some(())
    }

    fn try_lit(&mut self, s: &str) -> bool {
        self.lit(s).is_some()
    }

    fn count(&mut self) -> Option<u64> {
        let end = self
            .0
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(self.0.len());
        let (n, rest) = self.0.split_at(end);
        let n = n.parse().ok()?;
        self.0 = rest;
        Some(n)
    }

    /// `<number> <unit>` as kopia prints it, e.g. `52.4 MB`.
    fn bytes(&mut self) -> Option<u64> {
        let num_end = self
            .0
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(self.0.len());
        let after_num = self.0[num_end..].strip_prefix(' ')?;
        let unit_end = after_num
            .find(|c: char| !c.is_ascii_alphabetic())
            .unwrap_or(after_num.len());
        let len = num_end + 1 + unit_end;
        let v = parse_si_bytes(&self.0[..len])?;
        self.0 = &self.0[len..];
        Some(v)
    }

    /// `(<bytes>)`.
    fn paren_bytes(&mut self) -> Option<u64> {
        self.lit("(")?;
        let v = self.bytes()?;
        self.lit(")")?;
        Some(v)
    }
}

/// ` <spinner> <N> hashing, <N> hashed (<bytes>), <N> cached (<bytes>), uploaded <bytes>
/// [ (<N> fatal errors)][ (<N> errors ignored)], estimated <bytes> (<P>%) <D> left`
/// or `..., estimating...`.
fn backup_progress(body: &str) -> Option<ProgressSample> {
    let mut c = Cursor(strip_spinner(body).unwrap_or(body));
    c.count()?;
    c.lit(" hashing, ")?;
    let hashed_files = c.count()?;
    c.lit(" hashed ")?;
    let hashed_bytes = c.paren_bytes()?;
    c.lit(", ")?;
    let cached_files = c.count()?;
    c.lit(" cached ")?;
    let cached_bytes = c.paren_bytes()?;
    c.lit(", uploaded ")?;
    c.bytes()?;
    // ` (<N> fatal errors)` and ` (<N> errors ignored)`, each optional.
    while c.try_lit(" (") {
        c.count()?;
        if !(c.try_lit(" fatal errors)") || c.try_lit(" errors ignored)")) {
            return None;
        }
    }
    let estimated = if c.try_lit(", estimating...") {
        None
    } else if c.try_lit(", estimated ") {
        // The percentage (may exceed 100) and the time left follow; we compute our own.
        Some(c.bytes()?)
    } else if c.0.is_empty() {
        // Progress printed without the estimate part (not expected with --progress).
        None
    } else {
        return None;
    };
    Some(ProgressSample {
        bytes_done: hashed_bytes.saturating_add(cached_bytes),
        total_bytes: estimated,
        files_done: hashed_files.saturating_add(cached_files),
        total_files: None,
        scan_finished: estimated.is_some(),
        bytes_read: Some(hashed_bytes),
    })
}

/// `Processed <N> (<bytes>) of <M> (<bytes>)[, skipped <N> (<bytes>)][, ignored N errors]
/// [ <rate>/s (<P>%) remaining <D>].`
fn restore_progress(body: &str) -> Option<ProgressSample> {
    let mut c = Cursor(body);
    c.lit("Processed ")?;
    let files_done = c.count()?;
    c.lit(" ")?;
    let restored = c.paren_bytes()?;
    c.lit(" of ")?;
    let total_files = c.count()?;
    c.lit(" ")?;
    let total_bytes = c.paren_bytes()?;
    let mut skipped_bytes = 0;
    if c.try_lit(", skipped ") {
        c.count()?;
        c.lit(" ")?;
        skipped_bytes = c.paren_bytes()?;
    }
    if c.try_lit(", ignored ") {
        c.count()?;
        c.lit(" errors")?;
    }
    // kopia estimates the time left once it has a rate: the closest thing to "the walk is done".
    let has_eta = c.0.starts_with(' ') && c.0.contains(" remaining ");
    if !(has_eta || c.0 == ".") {
        return None;
    }
    Some(ProgressSample {
        bytes_done: restored.saturating_add(skipped_bytes),
        total_bytes: Some(total_bytes),
        files_done,
        total_files: Some(total_files),
        scan_finished: has_eta,
        bytes_read: None,
    })
}

/// `Restored N files, M directories and K symbolic links (<bytes>)[, skipped N (<bytes>)]...`.
fn restore_summary(body: &str) -> Option<RunSummary> {
    let mut c = Cursor(body);
    c.lit("Restored ")?;
    let files = c.count()?;
    c.lit(" files, ")?;
    c.count()?;
    c.lit(" directories and ")?;
    let symlinks = c.count()?;
    c.lit(" symbolic links ")?;
    let bytes = c.paren_bytes()?;
    let (mut skipped_count, mut skipped_bytes) = (0, 0);
    if c.try_lit(", skipped ") {
        skipped_count = c.count()?;
        c.lit(" ")?;
        skipped_bytes = c.paren_bytes()?;
    }
    Some(RunSummary {
        snapshot_id: None,
        total_bytes: bytes.saturating_add(skipped_bytes),
        total_files: files.saturating_add(symlinks).saturating_add(skipped_count),
        ..RunSummary::default()
    })
}

/// Text kopia prints on failures, per kind (its exit code is just 1).
const WRONG_PASSWORD: &[&str] = &["invalid repository password"];
const REPOSITORY_MISSING: &[&str] = &[
    "repository is not connected",
    "not connected to a repository",
    "unable to find repository",
    "repository not initialized",
    "cannot access storage path",
];
const SOURCE_MISSING: &[&str] = &["unable to get local filesystem entry"];

/// Classifies how a kopia run ended. `stopped`: we sent the stop signal to the running child
/// (the runner's `stop`), not merely that a cancel was requested: a run that ended on its own
/// before our stop reached it keeps its own outcome.
pub fn classify(exit: ExitInfo, facts: &RunFacts, stopped: bool, direction: Direction) -> Outcome {
    let text = facts.error_text();
    let has = |needles: &[&str]| needles.iter().any(|n| text.contains(n));
    let summary = facts.summary.as_ref();
    let incomplete = summary.and_then(|s| s.incomplete.as_deref());
    let failed_items = facts
        .failed_items
        .max(summary.map_or(0, |s| s.failed_items));
    let manifest_failed = summary.is_some_and(|s| s.failed_items > 0);
    let backup = direction == Direction::Backup;
    // `--fail-fast`: kopia stops itself at the first unreadable entry, saves what it has as
    // `incomplete: canceled` and exits 1; a signal's stop exits 0.
    let fail_fast_stop = exit.code == Some(1) && failed_items > 0;

    let kind = match (exit.code, exit.signal) {
        // A manifest marked incomplete is never a complete backup, whatever the exit code.
        _ if backup && incomplete.is_some() => {
            if stopped {
                OutcomeKind::Canceled
            } else if incomplete == Some("canceled") && !fail_fast_stop {
                OutcomeKind::Interrupted
            } else {
                OutcomeKind::Failed
            }
        }
        (Some(0), _) if backup && summary.is_none() => OutcomeKind::Failed,
        (Some(0), _) if backup && manifest_failed => OutcomeKind::Partial,
        (Some(0), _) => OutcomeKind::Success,
        // The whole snapshot was saved (a complete manifest, nothing failed) before our stop
        // reached kopia, which was finishing after it: the backup is done, and its snapshot is
        // the result. kopia's progress counts bytes hashed, which run ahead of the upload, so a
        // cancel near the end can come after the save.
        _ if backup
            && stopped
            && !manifest_failed
            && summary.is_some_and(|s| s.snapshot_id.is_some()) =>
        {
            OutcomeKind::Success
        }
        _ if stopped => OutcomeKind::Canceled,
        (None, Some(sig)) => OutcomeKind::KilledBySignal { signal: sig },
        // Saved, but some entries could not be read (`Found N fatal error(s)`, exit 1).
        _ if backup && manifest_failed => OutcomeKind::Partial,
        _ if has(WRONG_PASSWORD) => OutcomeKind::WrongPassword,
        _ if has(REPOSITORY_MISSING) => OutcomeKind::RepositoryMissing,
        _ if text.contains("repository.config") && text.contains("no such file or directory") => {
            OutcomeKind::RepositoryMissing
        }
        _ if backup && has(SOURCE_MISSING) && text.contains("no such file or directory") => {
            OutcomeKind::SourceMissing
        }
        _ => OutcomeKind::Failed,
    };

    let manifest_id = summary.and_then(|s| s.snapshot_id.clone());
    // An incomplete snapshot is not a result anyone should restore from: name it, don't return it.
    let snapshot_id = if incomplete.is_some() {
        None
    } else {
        manifest_id.clone()
    };
    let message = match &kind {
        _ if backup && incomplete.is_some() => {
            let reason = incomplete.unwrap_or_default();
            let saved = match &manifest_id {
                Some(id) => format!("kopia saved an incomplete snapshot {id}"),
                None => "kopia saved an incomplete snapshot".to_string(),
            };
            match kind {
                OutcomeKind::Canceled => format!("canceled; {saved} (incomplete: {reason})"),
                OutcomeKind::Failed if fail_fast_stop => format!(
                    "kopia stopped at the first unreadable item (fail-fast): {}; {saved} (incomplete: {reason}), which is not a result",
                    unreadable_items(failed_items, facts)
                ),
                OutcomeKind::Interrupted => format!(
                    "{saved} (incomplete: {reason}): kopia was interrupted by a signal we did not send"
                ),
                _ => format!("{saved} (incomplete: {reason})"),
            }
        }
        OutcomeKind::Success => match summary {
            Some(s) if backup => format!(
                "snapshot {} saved: {} in {} files",
                manifest_id.as_deref().unwrap_or("(no id)"),
                format_bytes(s.total_bytes),
                s.total_files
            ),
            Some(s) => restore_message(s.total_bytes, s.total_files),
            None if backup => "completed".to_string(),
            None => "restore completed".to_string(),
        },
        OutcomeKind::Partial => partial_message(snapshot_id.as_deref(), failed_items, facts),
        OutcomeKind::Canceled => "canceled".to_string(),
        OutcomeKind::Failed if exit.code == Some(0) => {
            "kopia exited 0 but printed no snapshot manifest; the snapshot cannot be confirmed"
                .to_string()
        }
        OutcomeKind::Failed if exit.code == Some(2) => facts.cause("kopia crashed (exit code 2)"),
        _ => facts.cause(&format!("kopia failed with {exit}")),
    };
    Outcome {
        kind,
        message,
        exit_code: exit.code,
        snapshot_id,
        summary: summary.map(|s| RunSummaryView {
            incremental_bytes: incremental_bytes(s, facts.last_bytes_read),
            ..RunSummaryView::from(s)
        }),
        failed_items,
        first_failed_items: facts.first_failed_items.clone(),
        truncated_frames: facts.truncated_frames,
        repository_created: false,
        incomplete_snapshot_id: if backup && incomplete.is_some() {
            manifest_id.clone()
        } else {
            None
        },
    }
}

/// The message of a successful restore of `total_bytes` in `files` files (the engine writes it
/// again once it has measured the exact size).
pub fn restore_message(total_bytes: u64, files: u64) -> String {
    format!(
        "restore completed: {} in {files} files",
        format_bytes(total_bytes)
    )
}

/// Bytes of the regular files under `root`, which is not itself followed if it is a symlink;
/// symlinks inside are neither followed nor counted. Entries that vanish during the walk are
/// skipped; any other error ends it. Blocking: run it off the async runtime.
pub fn regular_file_bytes(root: &Path) -> std::io::Result<u64> {
    use std::io::ErrorKind::NotFound;
    let mut total: u64 = 0;
    let meta = std::fs::symlink_metadata(root)?;
    if meta.is_file() {
        return Ok(meta.len());
    }
    if !meta.is_dir() {
        return Ok(0);
    }
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let entries = match std::fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == NotFound && dir != root => continue,
            Err(e) => return Err(e),
        };
        for entry in entries {
            let entry = entry?;
            // The entry's own type: a symlink is a symlink, whatever it points to.
            let file_type = match entry.file_type() {
                Ok(t) => t,
                Err(e) if e.kind() == NotFound => continue,
                Err(e) => return Err(e),
            };
            if file_type.is_dir() {
                stack.push(entry.path());
            } else if file_type.is_file() {
                match entry.metadata() {
                    Ok(m) => total = total.saturating_add(m.len()),
                    Err(e) if e.kind() == NotFound => {}
                    Err(e) => return Err(e),
                }
            }
        }
    }
    Ok(total)
}

/// "snapshot X saved, but 2 items could not be read: a (permission denied), b (...)". `failed` is
/// the larger of the manifest's `numFailed` and the errors seen on stderr.
pub fn partial_message(snapshot_id: Option<&str>, failed: u64, facts: &RunFacts) -> String {
    let saved = match snapshot_id {
        Some(id) => format!("snapshot {id} saved"),
        None => "snapshot saved".to_string(),
    };
    if failed == 0 {
        return format!("{saved}, but some source data could not be read");
    }
    format!("{saved}, but {}", unreadable_items(failed, facts))
}

/// `<N> item(s) could not be read: <cause> (first: a, b and M more)`.
fn unreadable_items(failed: u64, facts: &RunFacts) -> String {
    facts.items_summary(failed, "could not be read")
}

#[cfg(test)]
mod tests {
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
            args(
                &snapshot_restore(&acc, "k123", Path::new("/target"), &Default::default()).unwrap()
            ),
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
            p.parse(
                b"ERROR open repository: unable to open repository: invalid repository password"
            ),
            UploaderEvent::Fatal(
                "open repository: unable to open repository: invalid repository password".into()
            )
        );
        assert_eq!(
            p.parse(b"error connecting to repository: repository not initialized in the provided storage"),
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
}
