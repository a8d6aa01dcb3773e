//! How a BackupStorageLocation becomes the uploader's access to object storage, as Velero's
//! restic path built it: credentials from the BSL's Secret (else the agent's default credentials
//! file) in the provider's environment variables, the CA certificate as `--cacert`, and
//! `insecureSkipTLSVerify` as `--insecure-tls`.
//!
//! Secret values only ever go to files only the agent can read (0600, in a directory of their
//! own per operation, removed when the operation ends) or to the uploader's environment; they are
//! remembered so that messages can be scrubbed of them, and never logged.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::Secret;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
use kube::{Api, Client};
use serde::Deserialize;

/// The parts of `velero.io/v1` BackupStorageLocation's spec that decide repository access.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StorageLocationSpec {
    #[serde(default)]
    pub provider: String,
    #[serde(default)]
    pub config: BTreeMap<String, String>,
    pub credential: Option<SecretKeyRef>,
    pub object_storage: Option<ObjectStorage>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ObjectStorage {
    pub bucket: Option<String>,
    pub prefix: Option<String>,
    /// Base64 PEM (deprecated in Velero, still common with MinIO).
    pub ca_cert: Option<String>,
    pub ca_cert_ref: Option<SecretKeyRef>,
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct SecretKeyRef {
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub key: String,
}

/// Which family of object store a provider name means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Provider {
    Aws,
    Azure,
    Gcp,
    /// `velero.io/fs`: Velero's own filesystem backend for kopia repositories (`config.fspath`, a
    /// path the node agent's container sees). No credentials. Velero's server has no object store
    /// plugin for it, so it serves tests and benchmarks rather than production backups.
    Fs,
    /// A plugin's own provider: no extra environment (its repository needs none we know of).
    Other,
}

impl Provider {
    /// `aws`, `azure`, `gcp` with or without `velero.io/`; any other provider with an `s3Url` is
    /// S3 (MinIO, Ceph RGW behind a plugin's name), as in Velero.
    pub fn of(spec: &StorageLocationSpec) -> Provider {
        match spec.provider.trim_start_matches("velero.io/") {
            "aws" => Provider::Aws,
            "azure" => Provider::Azure,
            "gcp" => Provider::Gcp,
            "fs" => Provider::Fs,
            _ if spec.config.get("s3Url").is_some_and(|u| !u.is_empty()) => Provider::Aws,
            _ => Provider::Other,
        }
    }
}

/// Repository access settings of one operation. Dropping it removes its private files.
#[derive(Debug, Default)]
pub struct LocationAccess {
    pub extra_env: Vec<(String, String)>,
    pub ca_cert: Option<PathBuf>,
    pub insecure_tls: bool,
    /// Secret values, for scrubbing messages; never printed.
    pub secrets: Vec<String>,
    /// The location as read (kopia's repository is found from its bucket and prefix).
    pub spec: StorageLocationSpec,
    files: Option<PrivateDir>,
    /// The transfer's hold on its kopia repository's directory (see `kopia_caches`).
    pub cache_claim: Option<super::kopia_caches::CacheClaim>,
}

impl LocationAccess {
    /// `message` with every secret value of this location replaced by `***`.
    pub fn redact(&self, message: &str) -> String {
        crate::text::redact_secrets(message, &self.secrets)
    }
}

/// A directory of private files, removed with everything in it when dropped.
#[derive(Debug)]
struct PrivateDir(PathBuf);

impl Drop for PrivateDir {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.0)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(dir = %self.0.display(), error = %e, "could not remove an operation's credentials");
        }
    }
}

/// Where operations keep their private files: `<scratch>/credentials/operations/<uid>/`.
pub fn operations_dir(scratch_dir: &Path) -> PathBuf {
    scratch_dir.join("credentials").join("operations")
}

/// Removes the private files of operations a killed agent could not clean up.
pub fn remove_leftovers(scratch_dir: &Path) {
    let dir = operations_dir(scratch_dir);
    if let Err(e) = std::fs::remove_dir_all(&dir)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        tracing::warn!(dir = %dir.display(), error = %e, "could not remove old credentials files");
    }
}

/// Reads the BSL `name` in `namespace` and builds the access of the operation `uid`.
pub async fn location_access(
    client: &Client,
    namespace: &str,
    name: &str,
    default_credentials_file: &Path,
    scratch_dir: &Path,
    uid: &str,
) -> Result<LocationAccess, String> {
    if name.is_empty() {
        return Err("spec.backupStorageLocation is empty: no storage location to use".to_string());
    }
    let what = format!("BackupStorageLocation {namespace}/{name}");
    let gvk = GroupVersionKind::gvk("velero.io", "v1", "BackupStorageLocation");
    let api: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), namespace, &ApiResource::from_gvk(&gvk));
    let obj = match api.get_opt(name).await {
        Ok(Some(o)) => o,
        Ok(None) => return Err(format!("{what} not found")),
        // No BSL CRD at all answers 404 on the resource path too.
        Err(kube::Error::Api(e)) if e.code == 404 => return Err(format!("{what} not found")),
        Err(e) => return Err(format!("cannot read {what}: {e}")),
    };
    let spec: StorageLocationSpec =
        serde_json::from_value(obj.data.get("spec").cloned().unwrap_or_default())
            .map_err(|e| format!("{what}: unreadable spec: {e}"))?;
    let secrets = SecretReader {
        api: Api::namespaced(client.clone(), namespace),
        namespace,
        location: &what,
    };
    let files = PrivateFiles::new(operations_dir(scratch_dir).join(safe_name(uid)));
    let mut access = build(&spec, &what, default_credentials_file, files, &secrets).await?;
    access.spec = spec;
    Ok(access)
}

/// Secrets of the Velero namespace, read for one location (errors name both).
struct SecretReader<'a> {
    api: Api<Secret>,
    namespace: &'a str,
    location: &'a str,
}

impl SecretReader<'_> {
    async fn value(&self, r: &SecretKeyRef, field: &str) -> Result<Vec<u8>, String> {
        let name = format!("Secret {}/{}", self.namespace, r.name);
        if r.name.is_empty() || r.key.is_empty() {
            return Err(format!(
                "{}: {field} needs a Secret name and key",
                self.location
            ));
        }
        let secret = self
            .api
            .get_opt(&r.name)
            .await
            .map_err(|e| format!("{}: cannot read {name} ({field}): {e}", self.location))?
            .ok_or_else(|| format!("{}: {name} ({field}) not found", self.location))?;
        let from_data = secret
            .data
            .as_ref()
            .and_then(|d| d.get(&r.key))
            .map(|v| v.0.clone());
        let from_string = secret
            .string_data
            .as_ref()
            .and_then(|d| d.get(&r.key))
            .map(|v| v.clone().into_bytes());
        from_data
            .or(from_string)
            .ok_or_else(|| format!("{}: {name} has no key {:?} ({field})", self.location, r.key))
    }
}

/// The operation's private directory, created on first use.
struct PrivateFiles {
    dir: PathBuf,
    created: Option<PrivateDir>,
}

impl PrivateFiles {
    fn new(dir: PathBuf) -> Self {
        Self { dir, created: None }
    }

    fn write(&mut self, name: &str, data: &[u8]) -> Result<PathBuf, String> {
        if self.created.is_none() {
            use std::os::unix::fs::DirBuilderExt;
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&self.dir)
                .map_err(|e| format!("cannot create {}: {e}", self.dir.display()))?;
            self.created = Some(PrivateDir(self.dir.clone()));
        }
        super::write_private(&self.dir, name, data)
            .map_err(|e| format!("cannot write {}: {e}", self.dir.join(name).display()))
    }
}

async fn build(
    spec: &StorageLocationSpec,
    what: &str,
    default_credentials_file: &Path,
    mut files: PrivateFiles,
    secrets: &SecretReader<'_>,
) -> Result<LocationAccess, String> {
    let provider = Provider::of(spec);
    let mut access = LocationAccess::default();

    // TLS applies to any provider that talks HTTPS to an endpoint we are told about.
    let ca = match spec.object_storage.as_ref() {
        Some(ObjectStorage {
            ca_cert_ref: Some(r),
            ..
        }) if !r.name.is_empty() => Some((
            secrets.value(r, "spec.objectStorage.caCertRef").await?,
            "spec.objectStorage.caCertRef",
        )),
        Some(ObjectStorage {
            ca_cert: Some(b64), ..
        }) if !b64.trim().is_empty() => {
            // k8s-openapi's ByteString is the API's base64 encoding.
            let pem: k8s_openapi::ByteString =
                serde_json::from_value(serde_json::Value::String(b64.trim().to_string()))
                    .map_err(|e| format!("{what}: spec.objectStorage.caCert is not base64: {e}"))?;
            let pem = pem.0;
            Some((pem, "spec.objectStorage.caCert"))
        }
        _ => None,
    };
    if let Some((pem, field)) = ca {
        if !looks_like_pem_certificate(&pem) {
            return Err(format!(
                "{what}: {field} holds no PEM certificate (expected -----BEGIN CERTIFICATE-----)"
            ));
        }
        access.ca_cert = Some(files.write("ca.pem", &pem)?);
    }
    access.insecure_tls = spec
        .config
        .get("insecureSkipTLSVerify")
        .is_some_and(|v| v.eq_ignore_ascii_case("true"));

    if matches!(provider, Provider::Other | Provider::Fs) {
        access.files = files.created.take();
        return Ok(access);
    }
    // The BSL's own credentials, else the file Velero mounts for every location.
    let credentials_file = match &spec.credential {
        Some(r) if !r.name.is_empty() => {
            let value = secrets.value(r, "spec.credential").await?;
            access.secrets.extend(secret_values(&value));
            Some(files.write("cloud-credentials", &value)?)
        }
        _ if default_credentials_file.exists() => {
            // Scrubbed from messages like a Secret's values: an uploader that echoes its
            // credentials in an error must not carry them into the object's status. A file too
            // large to be a credentials file is not read (its path is still passed on).
            let small =
                std::fs::metadata(default_credentials_file).is_ok_and(|m| m.len() <= 1 << 20);
            if let (true, Ok(value)) = (small, std::fs::read(default_credentials_file)) {
                access.secrets.extend(secret_values(&value));
            }
            Some(default_credentials_file.to_path_buf())
        }
        _ => None,
    };
    let file =
        |k: &str, f: &Option<PathBuf>| f.as_ref().map(|f| (k.to_string(), f.display().to_string()));
    match provider {
        Provider::Aws => {
            access
                .extra_env
                .extend(file("AWS_SHARED_CREDENTIALS_FILE", &credentials_file));
            if let Some(profile) = spec.config.get("profile").filter(|p| !p.is_empty()) {
                access
                    .extra_env
                    .push(("AWS_PROFILE".to_string(), profile.clone()));
            }
        }
        Provider::Gcp => access
            .extra_env
            .extend(file("GOOGLE_APPLICATION_CREDENTIALS", &credentials_file)),
        Provider::Azure => {
            let azure = azure_access(
                spec,
                what,
                credentials_file.as_deref(),
                default_credentials_file,
            )?;
            access.secrets.push(azure.key.clone());
            access.extra_env.extend([
                ("AZURE_ACCOUNT_NAME".to_string(), azure.account),
                ("AZURE_ACCOUNT_KEY".to_string(), azure.key),
                ("AZURE_ENDPOINT_SUFFIX".to_string(), azure.endpoint_suffix),
            ]);
        }
        Provider::Other | Provider::Fs => {}
    }
    access.files = files.created.take();
    Ok(access)
}

/// How an Azure location is reached by the uploaders: the account, its key and the endpoint
/// suffix (`https://<account>.blob.<suffix>`).
#[derive(Debug, PartialEq, Eq)]
struct AzureAccess {
    account: String,
    key: String,
    endpoint_suffix: String,
}

/// Velero's Azure rules (its `pkg/util/azure`): the credentials file is dotenv; the storage account
/// key is the entry `config.storageAccountKeyEnvVar` names; with `config.useAAD=true` Velero
/// authenticates with Azure AD (it still uses an `AZURE_STORAGE_KEY` entry when the file has
/// one); with neither, Velero's server fetches the key through Azure Resource Manager. restic and
/// the kopia CLI authenticate to Blob Storage with the key (or a SAS), so the last two forms
/// end with what the location needs instead. The endpoint is `config.storageAccountURI` when set,
/// else the blob endpoint of the cloud the file's `AZURE_CLOUD_NAME` names.
fn azure_access(
    spec: &StorageLocationSpec,
    what: &str,
    credentials_file: Option<&Path>,
    default_credentials_file: &Path,
) -> Result<AzureAccess, String> {
    let config = |k: &str| {
        spec.config
            .get(k)
            .map(|v| v.trim())
            .filter(|v| !v.is_empty())
    };
    let account = config("storageAccount")
        .ok_or_else(|| format!("{what}: config.storageAccount is required for azure"))?
        .to_string();
    let creds = match credentials_file {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| format!("{what}: cannot read the credentials file: {e}"))?;
            dotenv_map(&text)
        }
        None => BTreeMap::new(),
    };
    let no_file = || {
        format!(
            "{what}: azure needs a credentials file with the storage account key (spec.credential, or {})",
            default_credentials_file.display()
        )
    };
    let key = if let Some(var) = config("storageAccountKeyEnvVar") {
        if credentials_file.is_none() {
            return Err(no_file());
        }
        creds
            .get(var)
            .filter(|k| !k.is_empty())
            .cloned()
            .ok_or_else(|| {
                format!(
                    "{what}: the credentials file has no {var}, the entry config.storageAccountKeyEnvVar names for the storage account key"
                )
            })?
    } else {
        let aad = match config("useAAD") {
            None => false,
            Some(v) => parse_go_bool(v)
                .ok_or_else(|| format!("{what}: config.useAAD {v:?} is not a boolean"))?,
        };
        match creds
            .get("AZURE_STORAGE_KEY")
            .filter(|k| aad && !k.is_empty())
        {
            Some(k) => k.clone(),
            None if aad => {
                return Err(format!(
                    "{what}: config.useAAD is true (Azure AD: service principal, certificate or workload identity); \
                     the uploaders this agent runs reach Blob Storage with the storage account key: \
                     put the key in the credentials file and name its entry in config.storageAccountKeyEnvVar"
                ));
            }
            None => {
                return Err(format!(
                    "{what}: config.storageAccountKeyEnvVar is not set, so Velero's server fetches the storage \
                     account key through Azure Resource Manager (resourceGroup, subscriptionId and an Azure AD \
                     identity), which this agent does not do: put the key in the credentials file and name its \
                     entry in config.storageAccountKeyEnvVar"
                ));
            }
        }
    };
    let endpoint_suffix = match config("storageAccountURI") {
        Some(uri) => account_uri_suffix(uri, &account)
            .map_err(|why| format!("{what}: config.storageAccountURI {uri:?}: {why}"))?,
        None => match creds
            .get("AZURE_CLOUD_NAME")
            .map(|c| c.to_ascii_uppercase())
            .as_deref()
            .unwrap_or("")
        {
            "" | "AZURECLOUD" | "AZUREPUBLICCLOUD" => "core.windows.net".to_string(),
            "AZURECHINACLOUD" => "core.chinacloudapi.cn".to_string(),
            "AZUREUSGOVERNMENT" | "AZUREUSGOVERNMENTCLOUD" => "core.usgovcloudapi.net".to_string(),
            other => {
                return Err(format!(
                    "{what}: unknown cloud {other:?} (AZURE_CLOUD_NAME in the credentials file)"
                ));
            }
        },
    };
    Ok(AzureAccess {
        account,
        key,
        endpoint_suffix,
    })
}

/// The endpoint suffix of an account URI `https://<account>.blob.<suffix>[/]`: the only form
/// restic (`AZURE_ENDPOINT_SUFFIX`) and the kopia CLI (`--storage-domain`) can address.
fn account_uri_suffix(uri: &str, account: &str) -> Result<String, String> {
    let (scheme, rest) = uri
        .split_once("://")
        .ok_or_else(|| "not a URL".to_string())?;
    if !scheme.eq_ignore_ascii_case("https") {
        return Err(format!(
            "the uploaders reach Blob Storage over HTTPS only, not {scheme}"
        ));
    }
    let (host, path) = rest.split_once('/').unwrap_or((rest, ""));
    if !path.trim_matches('/').is_empty() {
        return Err(format!(
            "has a path ({path:?}); the uploaders address an account only as https://{account}.blob.<domain>"
        ));
    }
    let host = host.to_ascii_lowercase();
    match host.strip_prefix(&format!("{}.blob.", account.to_ascii_lowercase())) {
        Some(suffix) if !suffix.is_empty() && !suffix.contains('@') => Ok(suffix.to_string()),
        _ => Err(format!(
            "the uploaders address an account only as https://{account}.blob.<domain>; this host is {host:?}"
        )),
    }
}

/// Go's `strconv.ParseBool`, which Velero uses for its boolean config values.
fn parse_go_bool(v: &str) -> Option<bool> {
    match v {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Some(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Some(false),
        _ => None,
    }
}

fn looks_like_pem_certificate(pem: &[u8]) -> bool {
    std::str::from_utf8(pem).is_ok_and(|s| s.contains("-----BEGIN CERTIFICATE-----"))
}

/// `KEY=value` lines (optionally quoted, `export` allowed, `#` comments), as Velero reads its
/// Azure credentials file (godotenv); a later line wins.
fn dotenv_map(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter_map(|line| {
            let line = line.trim();
            if line.starts_with('#') {
                return None;
            }
            let line = line.strip_prefix("export ").unwrap_or(line);
            let (k, v) = line.split_once('=')?;
            Some((
                k.trim().to_string(),
                v.trim().trim_matches('"').trim_matches('\'').to_string(),
            ))
        })
        .collect()
}

/// The values in a credentials file (`key = value` / `KEY=value` lines, or the whole file), for
/// scrubbing messages. Keys and section names are not secret and are left alone.
fn secret_values(file: &[u8]) -> Vec<String> {
    let text = String::from_utf8_lossy(file);
    let mut values: Vec<String> = text
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(_, v)| v.trim().trim_matches('"').to_string())
        .filter(|v| !v.is_empty())
        .collect();
    let whole = text.trim();
    if !whole.is_empty() {
        values.push(whole.to_string());
    }
    // A GCP service-account key is JSON: its private key's lines are values too.
    values.extend(
        text.split("\\n")
            .map(|s| s.trim().to_string())
            .filter(|s| s.len() >= 16 && !s.starts_with("-----")),
    );
    values
}

/// UIDs are safe path components; anything else is made one.
pub(crate) fn safe_name(uid: &str) -> String {
    let s: String = uid
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if s.is_empty() { "_".to_string() } else { s }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(v: serde_json::Value) -> StorageLocationSpec {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn providers_as_velero_names_them() {
        for (p, want) in [
            ("aws", Provider::Aws),
            ("velero.io/aws", Provider::Aws),
            ("azure", Provider::Azure),
            ("velero.io/azure", Provider::Azure),
            ("gcp", Provider::Gcp),
            ("velero.io/gcp", Provider::Gcp),
            ("example.com/plugin", Provider::Other),
        ] {
            assert_eq!(
                Provider::of(&spec(serde_json::json!({"provider": p}))),
                want,
                "{p}"
            );
        }
        let minio = spec(serde_json::json!({
            "provider": "example.com/minio", "config": {"s3Url": "https://minio:9000"}
        }));
        assert_eq!(Provider::of(&minio), Provider::Aws);
    }

    #[test]
    fn secret_values_cover_ini_and_dotenv() {
        let v = secret_values(
            b"[default]\naws_access_key_id = AKIAXYZ\naws_secret_access_key = s/e+cr3t\n",
        );
        assert!(v.contains(&"AKIAXYZ".to_string()));
        assert!(v.contains(&"s/e+cr3t".to_string()));
        assert!(!v.iter().any(|x| x == "aws_access_key_id"));
        let map = dotenv_map(
            "AZURE_SUBSCRIPTION_ID=x\n# KEY=no\nexport AZURE_STORAGE_ACCOUNT_ACCESS_KEY=\"k==\"\n",
        );
        assert_eq!(
            map.get("AZURE_STORAGE_ACCOUNT_ACCESS_KEY")
                .map(String::as_str),
            Some("k==")
        );
        assert!(!map.contains_key("# KEY") && !map.contains_key("KEY"));
    }

    #[test]
    fn pem_check_and_names() {
        assert!(looks_like_pem_certificate(
            b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
        ));
        assert!(!looks_like_pem_certificate(b"not a certificate"));
        assert_eq!(safe_name("../x"), "___x");
        assert_eq!(safe_name("0b1c-22"), "0b1c-22");
    }

    /// `build` for locations that need no Secret (the reader is never asked).
    async fn built(v: serde_json::Value, default_file: &Path) -> Result<LocationAccess, String> {
        let config = kube::Config::new("http://127.0.0.1:9".parse().unwrap());
        let client = Client::try_from(config).unwrap();
        let reader = SecretReader {
            api: Api::namespaced(client, "velero"),
            namespace: "velero",
            location: "BackupStorageLocation velero/l",
        };
        // Next to the default file (a temporary directory of the test), as in the scratch dir.
        let dir = default_file
            .parent()
            .unwrap()
            .join(format!("op-{}", rand_suffix()));
        let files = PrivateFiles::new(dir);
        build(
            &spec(v),
            "BackupStorageLocation velero/l",
            default_file,
            files,
            &reader,
        )
        .await
    }

    fn rand_suffix() -> u64 {
        use std::sync::atomic::{AtomicU64, Ordering};
        static N: AtomicU64 = AtomicU64::new(0);
        N.fetch_add(1, Ordering::SeqCst)
    }

    fn env_of(a: &LocationAccess) -> Vec<(&str, &str)> {
        a.extra_env
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect()
    }

    #[tokio::test]
    async fn default_credentials_file_per_provider() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("cloud");
        std::fs::write(
            &file,
            "AZURE_STORAGE_ACCOUNT_ACCESS_KEY=azkey123\nMY_KEY=other456\n",
        )
        .unwrap();
        let f = file.to_str().unwrap();
        let aws = built(
            serde_json::json!({"provider": "velero.io/aws", "config": {"profile": "p1", "insecureSkipTLSVerify": "true"}}),
            &file,
        )
        .await
        .unwrap();
        assert_eq!(
            env_of(&aws),
            [("AWS_SHARED_CREDENTIALS_FILE", f), ("AWS_PROFILE", "p1")]
        );
        assert!(aws.insecure_tls && aws.ca_cert.is_none());
        // The default file's values are scrubbed from messages as a Secret's are.
        assert_eq!(
            aws.redact("Fatal: key other456 and azkey123 rejected"),
            "Fatal: key *** and *** rejected"
        );
        let gcp = built(serde_json::json!({"provider": "gcp"}), &file)
            .await
            .unwrap();
        assert_eq!(env_of(&gcp), [("GOOGLE_APPLICATION_CREDENTIALS", f)]);
        assert!(!gcp.insecure_tls);
        let azure = built(
            serde_json::json!({"provider": "azure", "config": {"storageAccount": "acct", "storageAccountKeyEnvVar": "AZURE_STORAGE_ACCOUNT_ACCESS_KEY"}}),
            &file,
        )
        .await
        .unwrap();
        assert_eq!(
            env_of(&azure),
            [
                ("AZURE_ACCOUNT_NAME", "acct"),
                ("AZURE_ACCOUNT_KEY", "azkey123"),
                ("AZURE_ENDPOINT_SUFFIX", "core.windows.net"),
            ]
        );
        assert_eq!(azure.redact("key azkey123 leaked"), "key *** leaked");
        let renamed = built(
            serde_json::json!({"provider": "azure", "config": {"storageAccount": "acct", "storageAccountKeyEnvVar": "MY_KEY"}}),
            &file,
        )
        .await
        .unwrap();
        assert_eq!(env_of(&renamed)[1], ("AZURE_ACCOUNT_KEY", "other456"));
        let err = built(serde_json::json!({"provider": "azure"}), &file)
            .await
            .unwrap_err();
        assert!(err.contains("config.storageAccount is required"), "{err}");
        let plugin = built(serde_json::json!({"provider": "example.com/x"}), &file)
            .await
            .unwrap();
        assert!(plugin.extra_env.is_empty());
        // No default file (IAM roles for service accounts): nothing is set.
        let irsa = built(
            serde_json::json!({"provider": "aws"}),
            &tmp.path().join("none"),
        )
        .await
        .unwrap();
        assert!(irsa.extra_env.is_empty());
    }

    #[tokio::test]
    async fn inline_ca_is_checked_and_written_privately() {
        let tmp = tempfile::tempdir().unwrap();
        let none = &tmp.path().join("no-default-file");
        let pem = b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n";
        let b64 = |d: &[u8]| serde_json::to_value(k8s_openapi::ByteString(d.to_vec())).unwrap();
        let a = built(
            serde_json::json!({"provider": "x", "objectStorage": {"caCert": b64(pem)}}),
            none,
        )
        .await
        .unwrap();
        let ca = a.ca_cert.clone().unwrap();
        assert_eq!(std::fs::read(&ca).unwrap(), pem);
        drop(a);
        assert!(!ca.exists(), "removed with the access");
        let err = built(
            serde_json::json!({"provider": "x", "objectStorage": {"caCert": "%%%"}}),
            none,
        )
        .await
        .unwrap_err();
        assert!(err.contains("caCert is not base64"), "{err}");
        let err = built(
            serde_json::json!({"provider": "x", "objectStorage": {"caCert": b64(b"junk")}}),
            none,
        )
        .await
        .unwrap_err();
        assert!(err.contains("holds no PEM certificate"), "{err}");
    }

    /// Velero's rules for the key and the endpoint, and the forms the uploaders cannot use.
    #[tokio::test]
    async fn azure_key_and_endpoint_as_velero_finds_them() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("cloud");
        std::fs::write(
            &file,
            "AZURE_SUBSCRIPTION_ID=sub\nAZURE_RESOURCE_GROUP=rg\nAZURE_STORAGE_KEY=plainkey\nK=k1\n",
        )
        .unwrap();
        let azure = |config: serde_json::Value| {
            let file = file.clone();
            async move {
                built(
                    serde_json::json!({"provider": "velero.io/azure", "config": config}),
                    &file,
                )
                .await
            }
        };
        // A production-style custom endpoint: its suffix, port kept.
        let a = azure(
            serde_json::json!({"storageAccount": "Acct", "storageAccountKeyEnvVar": "K",
            "storageAccountURI": "https://acct.blob.storage.example:8443/"}),
        )
        .await
        .unwrap();
        assert_eq!(
            env_of(&a)[2],
            ("AZURE_ENDPOINT_SUFFIX", "storage.example:8443")
        );
        // No key variable and no AAD: Velero's server would ask Azure Resource Manager.
        let err = azure(serde_json::json!({"storageAccount": "acct"}))
            .await
            .unwrap_err();
        assert!(err.contains("Azure Resource Manager"), "{err}");
        assert!(err.contains("config.storageAccountKeyEnvVar"), "{err}");
        // AAD: Velero uses an AZURE_STORAGE_KEY entry when there is one ...
        let a = azure(serde_json::json!({"storageAccount": "acct", "useAAD": "true"}))
            .await
            .unwrap();
        assert_eq!(env_of(&a)[1], ("AZURE_ACCOUNT_KEY", "plainkey"));
        // ... and without one the uploaders cannot authenticate.
        std::fs::write(
            &file,
            "AZURE_TENANT_ID=t\nAZURE_CLIENT_ID=c\nAZURE_CLIENT_SECRET=s3cr3tvalue\n",
        )
        .unwrap();
        let err = azure(serde_json::json!({"storageAccount": "acct", "useAAD": "true"}))
            .await
            .unwrap_err();
        assert!(err.contains("config.useAAD is true"), "{err}");
        assert!(!err.contains("s3cr3tvalue"), "{err}");
        let err = azure(serde_json::json!({"storageAccount": "acct", "useAAD": "yes"}))
            .await
            .unwrap_err();
        assert!(err.contains("is not a boolean"), "{err}");
        let err = azure(
            serde_json::json!({"storageAccount": "acct", "storageAccountKeyEnvVar": "MISSING"}),
        )
        .await
        .unwrap_err();
        assert!(err.contains("the credentials file has no MISSING"), "{err}");
        // Sovereign clouds by the file's AZURE_CLOUD_NAME.
        std::fs::write(&file, "K=k1\nAZURE_CLOUD_NAME=AzureChinaCloud\n").unwrap();
        let a =
            azure(serde_json::json!({"storageAccount": "acct", "storageAccountKeyEnvVar": "K"}))
                .await
                .unwrap();
        assert_eq!(
            env_of(&a)[2],
            ("AZURE_ENDPOINT_SUFFIX", "core.chinacloudapi.cn")
        );
        std::fs::write(&file, "K=k1\nAZURE_CLOUD_NAME=Mars\n").unwrap();
        let err =
            azure(serde_json::json!({"storageAccount": "acct", "storageAccountKeyEnvVar": "K"}))
                .await
                .unwrap_err();
        assert!(err.contains("unknown cloud"), "{err}");
        // URIs the uploaders cannot address.
        std::fs::write(&file, "K=k1\n").unwrap();
        for (uri, why) in [
            ("http://acct.blob.example", "over HTTPS only"),
            ("https://127.0.0.1:10000/acct", "has a path"),
            (
                "https://storage.example",
                "only as https://acct.blob.<domain>",
            ),
            (
                "https://other.blob.example",
                "only as https://acct.blob.<domain>",
            ),
        ] {
            let err = azure(serde_json::json!({"storageAccount": "acct", "storageAccountKeyEnvVar": "K", "storageAccountURI": uri}))
                .await
                .unwrap_err();
            assert!(err.contains(why), "{uri}: {err}");
        }
        // No credentials file at all.
        let err = built(
            serde_json::json!({"provider": "azure", "config": {"storageAccount": "acct", "storageAccountKeyEnvVar": "K"}}),
            &tmp.path().join("none"),
        )
        .await
        .unwrap_err();
        assert!(err.contains("needs a credentials file"), "{err}");
    }

    #[test]
    fn private_files_are_0600_and_go_with_the_access() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("op");
        let mut files = PrivateFiles::new(dir.clone());
        let f = files.write("cloud-credentials", b"x").unwrap();
        assert_eq!(
            std::fs::metadata(&f).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert_eq!(
            std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777,
            0o700
        );
        let access = LocationAccess {
            files: files.created.take(),
            ..Default::default()
        };
        drop(access);
        assert!(!dir.exists());
    }
}
