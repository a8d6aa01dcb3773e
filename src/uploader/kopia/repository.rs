//! How kopia reaches a repository: the environment and argv every command shares, the storage
//! a repository string names, credentials, and the connection and policy kept between commands.

use super::*;

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
pub(super) const LOG_BOUNDS: &[(&str, &str)] = &[
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
    pub(super) fn arg(mut self, a: impl Into<OsString>) -> Self {
        self.args.push(a.into());
        self
    }
}

/// kopia's private directory under the access's cache dir.
pub(super) fn kopia_dir(access: &RepositoryAccess) -> PathBuf {
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

pub(super) fn base(access: &RepositoryAccess) -> Result<KopiaInvocation, Error> {
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

pub(super) fn repository_command(
    access: &RepositoryAccess,
    verb: &str,
) -> Result<KopiaInvocation, Error> {
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
pub(super) fn cache_limit_flags(limit_mb: Option<u64>) -> Vec<String> {
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
pub(super) fn connection_fingerprint(access: &RepositoryAccess) -> Result<String, Error> {
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
