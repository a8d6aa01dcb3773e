//! Velero's kopia repositories, as Velero 1.17+ lays them out: where the repository of a
//! (volume namespace, storage location) is, how it is known to exist, and the identity Velero
//! files pod volume snapshots under. The restic conventions (`repoIdentifier`) need none of this:
//! Velero writes the repository URL into each PodVolumeBackup; for kopia it writes nothing and the
//! node works it out from the BackupRepository and the BackupStorageLocation.
//!
//! The agent never creates, connects as owner of maintenance, maintains, expires or upgrades
//! one of these repositories: Velero's server initialises it (its BackupRepository controller)
//! before it creates any PodVolumeBackup, and runs its maintenance.

use kube::api::{ApiResource, DynamicObject, GroupVersionKind, ListParams};
use kube::{Api, Client};

use super::storage::{Provider, StorageLocationSpec};

pub const VOLUME_NAMESPACE_LABEL: &str = "velero.io/volume-namespace";
pub const STORAGE_LOCATION_LABEL: &str = "velero.io/storage-location";
pub const REPOSITORY_TYPE_LABEL: &str = "velero.io/repository-type";

/// The identity (`user@host`) Velero's kopia uploader connects and files snapshots under.
pub const VELERO_IDENTITY: &str = "default@default";
/// Velero 1.17+'s requester name, the first part of a pod volume snapshot's source path.
pub const REQUESTER: &str = "snapshot-pod-volume";
/// The description and pin Velero puts on every pod volume snapshot (the pin keeps kopia's
/// retention from deleting it).
pub const DESCRIPTION: &str = "Kopia Uploader";
pub const PIN: &str = "velero-pin";
/// The annotation on a PodVolumeBackup that names the claim of a PVC volume.
pub const PVC_NAME_ANNOTATION: &str = "velero.io/pvc-name";

/// The source a Velero 1.17+ pod volume snapshot is filed under:
/// `default@default:snapshot-pod-volume/kopia/<pod namespace>/<pod>/<claim, else volume>`.
/// The path is relative, as Velero writes it; kopia keeps it verbatim.
pub fn velero_source(pod_namespace: &str, pod: &str, claim_or_volume: &str) -> String {
    format!("{VELERO_IDENTITY}:{REQUESTER}/kopia/{pod_namespace}/{pod}/{claim_or_volume}")
}

/// Velero's data mover's requester name, the first part of a CSI snapshot's source path.
pub const DATA_MOVER_REQUESTER: &str = "snapshot-data-upload-download";

/// The source Velero's data mover files a claim's moved CSI snapshots under:
/// `default@default:snapshot-data-upload-download/kopia/<source namespace>/<claim>` (its
/// `datamover.GetRealSource` behind the requester and uploader). The same source on both sides
/// is what keeps one claim's snapshots one history with Velero's own node agent.
pub fn data_mover_source(source_namespace: &str, claim: &str) -> String {
    format!("{VELERO_IDENTITY}:{DATA_MOVER_REQUESTER}/kopia/{source_namespace}/{claim}")
}

/// A label value as Velero writes it: values longer than 63 characters are shortened with a
/// hash there, so they are not selected on here (the spec is compared instead).
fn selectable(v: &str) -> bool {
    !v.is_empty() && v.len() <= 63
}

/// A Ready kopia BackupRepository, as far as the agent uses it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadyRepository {
    pub name: String,
    /// `spec.repositoryConfig.cacheLimitMB` (from Velero's backup repository ConfigMap): the
    /// kopia cache of this repository on a node, in MB.
    pub cache_limit_mb: Option<u64>,
}

/// `spec.repositoryConfig.cacheLimitMB` as Velero reads it (a decimal string; anything else,
/// or zero, is no limit of the repository's own).
fn cache_limit_mb(spec: &serde_json::Value) -> Option<u64> {
    spec["repositoryConfig"]["cacheLimitMB"]
        .as_str()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|v| *v > 0)
}

/// The Ready kopia BackupRepository of (`volume_namespace`, `location`) in `namespace`.
/// Missing, several, or not Ready: an error naming what was looked for, and what Velero says.
pub async fn ready_repository(
    client: &Client,
    namespace: &str,
    volume_namespace: &str,
    location: &str,
) -> Result<ReadyRepository, RepositoryError> {
    let gvk = GroupVersionKind::gvk("velero.io", "v1", "BackupRepository");
    let api: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), namespace, &ApiResource::from_gvk(&gvk));
    let mut selector = vec![format!("{REPOSITORY_TYPE_LABEL}=kopia")];
    if selectable(volume_namespace) {
        selector.push(format!("{VOLUME_NAMESPACE_LABEL}={volume_namespace}"));
    }
    if selectable(location) {
        selector.push(format!("{STORAGE_LOCATION_LABEL}={location}"));
    }
    let what = format!(
        "the kopia BackupRepository of namespace {volume_namespace:?} and storage location {location:?} (in {namespace})"
    );
    let list = match api
        .list(&ListParams::default().labels(&selector.join(",")))
        .await
    {
        Ok(l) => l,
        Err(kube::Error::Api(e)) if e.code == 404 => {
            return Err(format!(
                "{what}: the BackupRepository CRD is not installed (Velero 1.17+ creates kopia repositories through it)"
            )
            .into());
        }
        Err(e) => return Err(format!("cannot list {what}: {e}").into()),
    };
    let field = |o: &DynamicObject, part: &str, name: &str| {
        o.data[part][name].as_str().unwrap_or_default().to_string()
    };
    let matching: Vec<&DynamicObject> = list
        .items
        .iter()
        .filter(|o| {
            field(o, "spec", "volumeNamespace") == volume_namespace
                && field(o, "spec", "backupStorageLocation") == location
                && field(o, "spec", "repositoryType") == "kopia"
        })
        .collect();
    let repo = match matching[..] {
        [one] => one,
        [] => {
            let message = format!(
                "{what} does not exist: Velero's server creates it before the first pod volume backup of the namespace; this node agent does not create repositories"
            );
            return Err(RepositoryError {
                missing: true,
                message,
            });
        }
        _ => {
            let names: Vec<&str> = matching
                .iter()
                .filter_map(|o| o.metadata.name.as_deref())
                .collect();
            return Err(format!("{what}: several match ({})", names.join(", ")).into());
        }
    };
    let name = repo.metadata.name.clone().unwrap_or_default();
    match field(repo, "status", "phase").as_str() {
        "Ready" => Ok(ReadyRepository {
            name,
            cache_limit_mb: cache_limit_mb(&repo.data["spec"]),
        }),
        phase => {
            let message = field(repo, "status", "message");
            let phase = if phase.is_empty() { "New" } else { phase };
            Err(format!(
                "BackupRepository {namespace}/{name} is {phase}, not Ready{}",
                if message.is_empty() {
                    String::new()
                } else {
                    format!(": {message}")
                }
            )
            .into())
        }
    }
}

/// Why there is no Ready repository: none exists (`missing`), or another reason.
#[derive(Debug)]
pub struct RepositoryError {
    pub missing: bool,
    pub message: String,
}

impl From<String> for RepositoryError {
    fn from(message: String) -> Self {
        RepositoryError {
            missing: false,
            message,
        }
    }
}

impl std::fmt::Display for RepositoryError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// The Ready kopia BackupRepository of (`volume_namespace`, `location`), asking Velero's server
/// for it first when there is none, as Velero's data mover does (its repository ensurer): a
/// BackupRepository object named `<namespace>-<location>-kopia` with Velero's labels, which
/// Velero's BackupRepository controller then initialises or connects (the agent never touches
/// the repository's storage itself). Velero creates none before CSI data movement, only before
/// pod volume backups. Waits up to `within` for it to be Ready.
pub async fn ensure_repository(
    client: &Client,
    namespace: &str,
    volume_namespace: &str,
    location: &str,
    within: std::time::Duration,
) -> Result<ReadyRepository, String> {
    match ready_repository(client, namespace, volume_namespace, location).await {
        Err(e) if e.missing => {}
        other => return other.map_err(|e| e.message),
    }
    if !selectable(volume_namespace) || !selectable(location) {
        return Err(format!(
            "no kopia BackupRepository of namespace {volume_namespace:?} and location {location:?}, and names this long are not asked for here (Velero shortens their labels)"
        ));
    }
    let gvk = GroupVersionKind::gvk("velero.io", "v1", "BackupRepository");
    let api: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), namespace, &ApiResource::from_gvk(&gvk));
    let name = format!("{volume_namespace}-{location}-kopia");
    let obj: DynamicObject = serde_json::from_value(serde_json::json!({
        "apiVersion": "velero.io/v1", "kind": "BackupRepository",
        "metadata": {"name": name, "namespace": namespace, "labels": {
            VOLUME_NAMESPACE_LABEL: volume_namespace, STORAGE_LOCATION_LABEL: location,
            REPOSITORY_TYPE_LABEL: "kopia"}},
        "spec": {"volumeNamespace": volume_namespace, "backupStorageLocation": location,
            "repositoryType": "kopia", "resticIdentifier": "",
            // What Velero's Go type sends for its unset duration (the field is required); its
            // server sets the real frequency when it initialises the repository.
            "maintenanceFrequency": "0s"},
    }))
    .expect("a BackupRepository");
    match api.create(&kube::api::PostParams::default(), &obj).await {
        Ok(_) => {
            tracing::info!(backup_repository = %name, "asked Velero's server for the kopia repository (a BackupRepository)")
        }
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(kube::Error::Api(e)) => {
            return Err(format!(
                "cannot create BackupRepository {namespace}/{name}: {}",
                e.message
            ));
        }
        Err(e) => {
            return Err(format!(
                "cannot create BackupRepository {namespace}/{name}: {e}"
            ));
        }
    }
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let r = ready_repository(client, namespace, volume_namespace, location).await;
        if r.is_ok() || tokio::time::Instant::now() >= deadline {
            return r.map_err(|e| {
                format!(
                    "{e} (waited {} for Velero's server to make it Ready)",
                    humantime::format_duration(within)
                )
            });
        }
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    }
}

/// Where Velero put the kopia repository of `volume_namespace` in the location `spec`, as the
/// repository string the uploader module takes, and the region (for `AWS_REGION`). The prefix is
/// `<location prefix>/kopia/<namespace>/`, with the trailing slash Velero's layout needs; the
/// bucket (an Azure container) is the location's. S3 and S3-compatible locations become
/// `s3:<scheme>://<endpoint>/<bucket>/<prefix>/` (the endpoint from `config.s3Url`, else the
/// region's AWS endpoint), Azure ones `azure:<container>:/<prefix>/` (account, key and endpoint
/// come with the location's access, `storage::location_access`), GCS ones `gs:<bucket>:/<prefix>/`
/// (Velero's kopia path reads no endpoint for GCS: `config.storeEndpoint` is its plugin's only).
pub fn repository_location(
    spec: &StorageLocationSpec,
    what: &str,
    volume_namespace: &str,
) -> Result<(String, Option<String>), String> {
    let provider = Provider::of(spec);
    if provider == Provider::Other {
        return Err(format!(
            "{what}: provider {:?} is not one Velero's kopia repositories live in (aws, azure, gcp, velero.io/fs, or any provider with config.s3Url)",
            spec.provider
        ));
    }
    // Velero reads config.bucket/prefix only when the location has no objectStorage at all.
    let (bucket, prefix) = match spec.object_storage.clone() {
        Some(o) => (o.bucket.unwrap_or_default(), o.prefix.unwrap_or_default()),
        None => (
            spec.config.get("bucket").cloned().unwrap_or_default(),
            spec.config.get("prefix").cloned().unwrap_or_default(),
        ),
    };
    let bucket = bucket.trim_matches('/').to_string();
    let prefix = prefix.trim_matches('/').to_string();
    let path = [prefix.as_str(), "kopia", volume_namespace]
        .iter()
        .filter(|p| !p.is_empty())
        .copied()
        .collect::<Vec<_>>()
        .join("/");
    if provider == Provider::Fs {
        // Velero's filesystem backend: <fspath>/<prefix>/kopia/<ns>, the bucket unused.
        let root = spec.config.get("fspath").map(String::as_str).unwrap_or("");
        if !root.starts_with('/') {
            return Err(format!(
                "{what}: provider velero.io/fs needs config.fspath, an absolute path (it is {root:?})"
            ));
        }
        return Ok((format!("{}/{path}", root.trim_end_matches('/')), None));
    }
    if bucket.is_empty() {
        return Err(format!("{what}: no bucket (spec.objectStorage.bucket)"));
    }
    match provider {
        Provider::Azure => return Ok((format!("azure:{bucket}:/{path}/"), None)),
        Provider::Gcp => return Ok((format!("gs:{bucket}:/{path}/"), None)),
        _ => {}
    }
    let region = spec.config.get("region").filter(|r| !r.is_empty()).cloned();
    let (scheme, endpoint) = match spec.config.get("s3Url").filter(|u| !u.is_empty()) {
        Some(url) => {
            let (scheme, rest) = url
                .split_once("://")
                .ok_or_else(|| format!("{what}: config.s3Url {url:?} is not a URL"))?;
            let (host, path) = rest.split_once('/').unwrap_or((rest, ""));
            if !path.trim_matches('/').is_empty() {
                return Err(format!(
                    "{what}: config.s3Url {url:?} has a path; Velero's kopia repositories need the bare endpoint"
                ));
            }
            if host.is_empty() || !matches!(scheme, "http" | "https") {
                return Err(format!(
                    "{what}: config.s3Url {url:?} is not an http(s) URL"
                ));
            }
            (scheme.to_string(), host.to_string())
        }
        None => {
            let r = region
                .as_deref()
                .ok_or_else(|| format!("{what}: neither config.s3Url nor config.region is set"))?;
            ("https".to_string(), format!("s3-{r}.amazonaws.com"))
        }
    };
    Ok((format!("s3:{scheme}://{endpoint}/{bucket}/{path}/"), region))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(v: serde_json::Value) -> StorageLocationSpec {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn the_cache_limit_is_the_repositorys_own_when_velero_gave_one() {
        let spec = |v| serde_json::json!({"repositoryConfig": {"cacheLimitMB": v}});
        assert_eq!(cache_limit_mb(&spec(serde_json::json!("2048"))), Some(2048));
        assert_eq!(cache_limit_mb(&spec(serde_json::json!(" 10 "))), Some(10));
        assert_eq!(cache_limit_mb(&spec(serde_json::json!("0"))), None);
        assert_eq!(cache_limit_mb(&spec(serde_json::json!("lots"))), None);
        assert_eq!(cache_limit_mb(&serde_json::json!({})), None);
    }

    #[test]
    fn velero_filesystem_locations_are_a_directory_under_fspath() {
        let s = spec(serde_json::json!({
            "provider": "velero.io/fs",
            "objectStorage": {"bucket": "ignored", "prefix": "/cluster-a/"},
            "config": {"fspath": "/mnt/backups/"},
        }));
        assert_eq!(
            repository_location(&s, "BSL", "app").unwrap(),
            ("/mnt/backups/cluster-a/kopia/app".to_string(), None)
        );
        let relative = spec(serde_json::json!({"provider": "fs", "config": {"fspath": "backups"}}));
        let err = repository_location(&relative, "BSL", "app").unwrap_err();
        assert!(err.contains("absolute path"), "{err}");
        let missing = spec(serde_json::json!({"provider": "fs"}));
        assert!(repository_location(&missing, "BSL", "app").is_err());
    }

    #[test]
    fn the_repository_is_under_the_locations_prefix_per_namespace() {
        let s = spec(serde_json::json!({
            "provider": "aws",
            "objectStorage": {"bucket": "/velero/", "prefix": "/cluster-a/"},
            "config": {"region": "minio", "s3Url": "https://minio.example:9000"},
        }));
        assert_eq!(
            repository_location(&s, "BSL", "app").unwrap(),
            (
                "s3:https://minio.example:9000/velero/cluster-a/kopia/app/".to_string(),
                Some("minio".to_string())
            )
        );
        let no_prefix = spec(serde_json::json!({
            "provider": "velero.io/aws",
            "objectStorage": {"bucket": "b"},
            "config": {"region": "eu-west-1"},
        }));
        assert_eq!(
            repository_location(&no_prefix, "BSL", "ns").unwrap().0,
            "s3:https://s3-eu-west-1.amazonaws.com/b/kopia/ns/"
        );
        let http = spec(serde_json::json!({
            "provider": "aws", "objectStorage": {"bucket": "b"},
            "config": {"s3Url": "http://10.0.0.1:9000/"},
        }));
        assert_eq!(
            repository_location(&http, "BSL", "ns").unwrap(),
            ("s3:http://10.0.0.1:9000/b/kopia/ns/".to_string(), None)
        );
    }

    #[test]
    fn locations_the_agent_cannot_reach_as_velero_does_are_refused_with_the_reason() {
        let plugin = spec(
            serde_json::json!({"provider": "example.com/x", "objectStorage": {"bucket": "b"}}),
        );
        assert!(
            repository_location(&plugin, "BSL x", "ns")
                .unwrap_err()
                .contains("is not one Velero's kopia repositories live in")
        );
        let path = spec(serde_json::json!({
            "provider": "aws", "objectStorage": {"bucket": "b"},
            "config": {"s3Url": "https://h/sub"},
        }));
        assert!(
            repository_location(&path, "BSL x", "ns")
                .unwrap_err()
                .contains("has a path")
        );
        let nothing =
            spec(serde_json::json!({"provider": "aws", "objectStorage": {"bucket": "b"}}));
        assert!(
            repository_location(&nothing, "BSL x", "ns")
                .unwrap_err()
                .contains("neither config.s3Url nor config.region")
        );
        let no_bucket = spec(serde_json::json!({"provider": "aws", "config": {"region": "r"}}));
        assert!(
            repository_location(&no_bucket, "BSL x", "ns")
                .unwrap_err()
                .contains("no bucket")
        );
    }

    #[test]
    fn azure_and_gcs_repositories_are_the_container_or_bucket_at_veleros_prefix() {
        let azure = spec(serde_json::json!({
            "provider": "velero.io/azure",
            "objectStorage": {"bucket": "velero", "prefix": "/cluster-a/"},
            "config": {"storageAccount": "acct", "region": "ignored"},
        }));
        assert_eq!(
            repository_location(&azure, "BSL", "app").unwrap(),
            ("azure:velero:/cluster-a/kopia/app/".to_string(), None)
        );
        let gcs = spec(serde_json::json!({
            "provider": "gcp",
            "objectStorage": {"bucket": "b"},
            "config": {"storeEndpoint": "https://gcs.example/storage/v1/"},
        }));
        assert_eq!(
            repository_location(&gcs, "BSL", "ns").unwrap(),
            ("gs:b:/kopia/ns/".to_string(), None)
        );
        // Velero reads config.bucket and config.prefix only without objectStorage.
        let from_config = spec(serde_json::json!({
            "provider": "gcp", "config": {"bucket": "cb", "prefix": "cp"},
        }));
        assert_eq!(
            repository_location(&from_config, "BSL", "ns").unwrap().0,
            "gs:cb:/cp/kopia/ns/"
        );
    }

    #[test]
    fn velero_117_source_identity() {
        assert_eq!(
            velero_source("app", "web-0", "data-web-0"),
            "default@default:snapshot-pod-volume/kopia/app/web-0/data-web-0"
        );
    }
}
