//! Command-line definition. Every flag can also be set by the environment variable shown in
//! `--help`, which is how the DaemonSet configures the agent.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::uploader::UploaderKind;

#[derive(Debug, Parser)]
#[command(
    name = "podvolume-agent",
    version,
    about = "Kubernetes node agent for file-system volume backups"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Back up a directory into a repository, with live progress.
    Backup(BackupArgs),
    /// Restore a snapshot into a directory, with live progress.
    Restore(RestoreArgs),
    /// Run the node agent: handle this node's PodVolumeBackups and PodVolumeRestores.
    /// A flag given twice takes its last value (manifest defaults, then overrides).
    #[command(args_override_self = true)]
    Run(Box<RunArgs>),
    /// Print the PodVolumeBackup and PodVolumeRestore CRDs (YAML) for clusters without Velero.
    Crds,
    /// Wait for SIGTERM and exit: the process of the pods that keep an exposed CSI snapshot's
    /// volume mounted while the node agent moves its data.
    Hold,
    /// List the operations a node agent knows (running, queued, recently finished).
    Operations(ClientArgs),
    /// Show one operation's progress (ID: the object's UID or `namespace/name`).
    Progress(OperationArgs),
    /// Cancel one operation (ID: the object's UID or `namespace/name`); best effort, idempotent.
    Cancel(OperationArgs),
}

/// How the client subcommands reach a node agent's operations API.
#[derive(Debug, Clone, Args)]
pub struct ClientArgs {
    /// The agent's address (its `--listen-address`), plain HTTP.
    #[arg(
        long,
        env = "PODVOLUME_AGENT_URL",
        default_value = "http://127.0.0.1:8085"
    )]
    pub url: String,
    /// File holding the bearer token; otherwise the token of the current kubeconfig context.
    #[arg(long)]
    pub token_file: Option<PathBuf>,
    /// kubeconfig whose current context's token is sent (default: the files in `KUBECONFIG`,
    /// then `~/.kube/config`).
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
    /// Output format.
    #[arg(short = 'o', long = "output", value_enum, default_value_t = OutputFormat::Table)]
    pub output: OutputFormat,
    /// Give up on the request after this long.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub timeout: Duration,
}

#[derive(Debug, Clone, Args)]
pub struct OperationArgs {
    #[command(flatten)]
    pub client: ClientArgs,
    /// The operation: the PodVolumeBackup/PodVolumeRestore UID, or `namespace/name`.
    pub id: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OutputFormat {
    Table,
    Json,
}

/// Who may call the operations API.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ApiAuth {
    /// Bearer tokens checked with TokenReview and SubjectAccessReview.
    Kubernetes,
    /// No checks: local use only, refused unless `--listen-address` is a loopback address.
    None,
}

/// `podvolume-agent run`. Names are fixed: the manifests in `daemonset/`, the README and the tests
/// use them.
#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    /// This node's name (downward API `spec.nodeName`).
    #[arg(long, env = "NODE_NAME")]
    pub node_name: String,
    /// Namespace of the PodVolumeBackups/PodVolumeRestores (Velero's namespace).
    #[arg(long, env = "VELERO_NAMESPACE", default_value = "velero")]
    pub namespace: String,
    /// How often running operations write progress to their object.
    #[arg(long, env = "UPDATE_INTERVAL", default_value = "10s", value_parser = parse_interval)]
    pub update_interval: Duration,
    /// Transfers at once on this node; others wait in Accepted, oldest first.
    #[arg(long, env = "CONCURRENCY", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub concurrency: u32,
    /// Cancel and fail an operation running longer than this (`0` = no limit).
    #[arg(long, env = "OPERATION_TIMEOUT", default_value = "4h", value_parser = parse_optional_duration)]
    pub operation_timeout: OptionalDuration,
    /// No byte progress for this long raises a Warning event (`0` = never).
    #[arg(long, env = "STALL_TIMEOUT", default_value = "30m", value_parser = parse_optional_duration)]
    pub stall_timeout: OptionalDuration,
    /// Also cancel and fail a stalled operation.
    #[arg(long, env = "FAIL_ON_STALL")]
    pub fail_on_stall: bool,
    /// Time between SIGINT and SIGKILL when stopping an uploader.
    #[arg(long, env = "CANCEL_GRACE", default_value = "10s", value_parser = parse_duration)]
    pub cancel_grace: Duration,
    /// Where the kubelet's pods directory is mounted.
    #[arg(long, env = "HOST_PODS_DIR", default_value = "/host_pods")]
    pub host_pods_dir: PathBuf,
    /// Scratch space: uploader caches and credentials files.
    #[arg(long, env = "VELERO_SCRATCH_DIR", default_value = "/scratch")]
    pub scratch_dir: PathBuf,
    /// Durable state: finished results not yet written to the API server.
    #[arg(long, env = "STATE_DIR", default_value = "/var/lib/podvolume-agent")]
    pub state_dir: PathBuf,
    #[arg(long, env = "RESTIC_BINARY", default_value = "restic")]
    pub restic_binary: PathBuf,
    #[arg(long, env = "KOPIA_BINARY", default_value = "kopia")]
    pub kopia_binary: PathBuf,
    /// kopia's cache of one repository on this node (content and metadata, MB; 4/5 and 1/5, soft
    /// and hard limits), in the scratch directory: Velero's default. A BackupRepository's
    /// `spec.repositoryConfig.cacheLimitMB` (Velero's backup repository ConfigMap) overrides it.
    #[arg(long, env = "KOPIA_CACHE_LIMIT_MB", default_value_t = 5000, value_parser = clap::value_parser!(u64).range(1..))]
    pub kopia_cache_limit_mb: u64,
    /// kopia's caches of all repositories on this node (MB), kept between transfers: before a
    /// transfer, the caches of the repositories used least recently (none in use) are removed
    /// until the others and this one's limit fit; they start cold on their next use. 0: no bound.
    #[arg(long, env = "KOPIA_CACHE_TOTAL_MB", default_value_t = 20000)]
    pub kopia_cache_total_mb: u64,
    /// Uploader for objects whose `spec.uploaderType` is empty.
    #[arg(long, env = "DEFAULT_UPLOADER", value_enum, default_value_t = UploaderKind::Restic)]
    pub default_uploader: UploaderKind,
    /// Repository password file; otherwise the Secret `velero-repo-credentials`, key
    /// `repository-password`, in the namespace, read through the API.
    #[arg(long, env = "REPO_PASSWORD_FILE")]
    pub repo_password_file: Option<PathBuf>,
    /// Create a repository that does not exist. Off by default: Velero's server creates
    /// repositories before any PodVolumeBackup, so a missing one means the agent is looking in
    /// the wrong place and the backup is Failed.
    /// `--init-missing-repository=false` turns it off again (a later flag wins).
    #[arg(
        long,
        env = "INIT_MISSING_REPOSITORY",
        num_args = 0..=1,
        require_equals = true,
        default_value_t = false,
        default_missing_value = "true",
        action = clap::ArgAction::Set,
        value_parser = clap::builder::BoolishValueParser::new(),
        conflicts_with = "no_init"
    )]
    pub init_missing_repository: bool,
    /// An extended option for every restic command (`-o KEY=VALUE`), repeatable, e.g.
    /// `azure.access-tier=Hot` or `s3.storage-class=STANDARD_IA`; the agent's own settings
    /// (cache, CA, TLS) are not changed by it.
    #[arg(long = "restic-option", env = "RESTIC_OPTIONS", value_delimiter = ',', value_name = "KEY=VALUE", value_parser = parse_restic_option)]
    pub restic_options: Vec<String>,
    /// Never create a missing repository. The default since `--init-missing-repository` exists;
    /// kept so manifests that set it keep working.
    #[arg(long, env = "NO_INIT")]
    pub no_init: bool,
    /// Credentials file for storage locations without `spec.credential` (Velero mounts the
    /// Secret `cloud-credentials` here). Ignored when it does not exist (e.g. IAM roles for
    /// service accounts).
    #[arg(
        long,
        env = "DEFAULT_CREDENTIALS_FILE",
        default_value = "/credentials/cloud"
    )]
    pub default_credentials_file: PathBuf,
    /// Complete (instead of fail) backups where some files could not be read (restic exit 3);
    /// the snapshot ID is kept either way.
    #[arg(long, env = "PARTIAL_AS_COMPLETED")]
    pub partial_as_completed: bool,
    /// How long to wait for a repository lock held by a live process.
    #[arg(long, env = "LOCK_WAIT", default_value = "2m", value_parser = parse_duration)]
    pub lock_wait: Duration,
    /// Runs of one object interrupted by agent restarts before it is failed.
    #[arg(long, env = "MAX_ATTEMPTS", default_value_t = 3)]
    pub max_attempts: u32,
    /// How long a DataUpload may take from its claim to its volume mounted on a node (the
    /// snapshot ready, moved, its claim bound, the hold pod running) before it is failed and
    /// everything exposed for it removed; Velero's node agent's flag of the same name.
    #[arg(long, env = "DATA_MOVER_PREPARE_TIMEOUT", default_value = "30m", value_parser = parse_duration)]
    pub data_mover_prepare_timeout: Duration,
    /// Velero's node-agent ConfigMap in the namespace (one data key of JSON), read at start:
    /// `loadConcurrency` (transfers at once on this node, instead of `--concurrency`;
    /// `prepareQueueLength`), `loadAffinity`, `backupPVC`, `restorePVC`, `podResources`,
    /// `priorityClassName`, `podLabels`, `podAnnotations` for data movement's hold pods.
    #[arg(long, env = "NODE_AGENT_CONFIGMAP")]
    pub node_agent_configmap: Option<String>,
    /// The image of the pods that hold an exposed snapshot's volume mounted; by default the
    /// image of the agent's own DaemonSet (`node-agent` in the namespace).
    #[arg(long, env = "DATA_MOVER_IMAGE")]
    pub data_mover_image: Option<String>,
    /// Health, metrics and operations API.
    #[arg(long, env = "LISTEN_ADDRESS", default_value = "0.0.0.0:8085")]
    pub listen_address: std::net::SocketAddr,
    /// Who may call the operations API (`/v1/operations`): `kubernetes` checks bearer tokens with
    /// TokenReview and SubjectAccessReview; `none` is for local use and needs a loopback
    /// `--listen-address`. Health and metrics are never authenticated.
    #[arg(long, env = "API_AUTH", value_enum, default_value_t = ApiAuth::Kubernetes)]
    pub api_auth: ApiAuth,
    #[arg(long, env = "LOG_FORMAT", value_enum, default_value_t = LogFormat::Json)]
    pub log_format: LogFormat,
    /// kubeconfig file. Without it, as kubectl: the files in `KUBECONFIG` (an empty value is
    /// unset), then `~/.kube/config`, then the in-cluster configuration (a DaemonSet's pod).
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
}

/// A duration where `0` means "none".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionalDuration(pub Option<Duration>);

/// `KEY=VALUE` with a dotted key (restic's extended options are `<backend>.<name>`).
fn parse_restic_option(s: &str) -> Result<String, String> {
    match s.split_once('=') {
        Some((k, _))
            if k.contains('.') && !k.starts_with('-') && !k.contains(char::is_whitespace) =>
        {
            Ok(s.to_string())
        }
        _ => Err(format!(
            "{s:?}: expected KEY=VALUE with a restic option key such as azure.access-tier"
        )),
    }
}

/// A period something is done at: more than zero (a zero period is no period; the timers
/// behind it cannot run at it).
fn parse_interval(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d.is_zero() {
        return Err("must be more than zero (e.g. 1s, 500ms)".into());
    }
    Ok(d)
}

fn parse_optional_duration(s: &str) -> Result<OptionalDuration, String> {
    if s.trim() == "0" {
        return Ok(OptionalDuration(None));
    }
    let d = parse_duration(s)?;
    Ok(OptionalDuration((!d.is_zero()).then_some(d)))
}

/// A duration as humantime reads it, with an error that says what one looks like (humantime's
/// own, `expected number at 0`, does not).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s.trim()).map_err(|e| {
        format!("{e}: a duration is a number with a unit, e.g. 10s, 500ms, 2m or 1h30m")
    })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Plain,
    Json,
}

/// Options shared by the one-shot commands.
#[derive(Debug, Args)]
pub struct CommonArgs {
    /// Repository: a restic repository URL or path (`/srv/repo`, `rest:http://...`, `s3:...`); a
    /// directory for kopia.
    #[arg(long, env = "PODVOLUME_REPOSITORY")]
    pub repo: String,
    /// Which uploader moves the data.
    #[arg(long, value_enum, default_value_t = UploaderKind::Restic, env = "PODVOLUME_UPLOADER")]
    pub uploader: UploaderKind,
    /// File holding the repository password (read by the uploader; never passed in argv).
    #[arg(long, env = "PODVOLUME_PASSWORD_FILE")]
    pub password_file: PathBuf,
    /// Print one OperationProgress JSON object per line on stdout instead of a progress bar.
    #[arg(long)]
    pub json: bool,
    /// How often progress is printed (humantime: `1s`, `500ms`).
    #[arg(long, default_value = "1s", value_parser = parse_interval)]
    pub update_interval: Duration,
    /// Time between SIGINT and SIGKILL when stopping the uploader.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub cancel_grace: Duration,
    /// How long to wait for a repository lock held by someone else.
    #[arg(long, default_value = "1m", value_parser = parse_duration)]
    pub lock_wait: Duration,
    /// PEM file with the CA certificate(s) of the object store (restic `--cacert`), for S3
    /// servers behind a private CA. Cloud credentials come from the usual environment variables
    /// (`AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY`, `AWS_SHARED_CREDENTIALS_FILE`/`AWS_PROFILE`,
    /// `AZURE_ACCOUNT_NAME`/`AZURE_ACCOUNT_KEY`, `GOOGLE_APPLICATION_CREDENTIALS`).
    #[arg(long, env = "PODVOLUME_CACERT", value_name = "FILE")]
    pub cacert: Option<PathBuf>,
    /// Accept any TLS certificate of the object store (restic `--insecure-tls`).
    #[arg(long, env = "PODVOLUME_INSECURE_TLS")]
    pub insecure_tls: bool,
    /// An extended option for every restic command (`-o KEY=VALUE`), repeatable, e.g.
    /// `azure.access-tier=Hot` or `s3.storage-class=STANDARD_IA`; the agent's own settings
    /// (cache, CA, TLS) are not changed by it.
    #[arg(long = "restic-option", env = "RESTIC_OPTIONS", value_delimiter = ',', value_name = "KEY=VALUE", value_parser = parse_restic_option)]
    pub restic_options: Vec<String>,
    /// Private cache directory for the uploader (default: ~/.cache/podvolume-agent).
    #[arg(long, env = "PODVOLUME_CACHE_DIR")]
    pub cache_dir: Option<PathBuf>,
    #[arg(long, default_value = "restic", env = "RESTIC_BINARY")]
    pub restic_binary: PathBuf,
    #[arg(long, default_value = "kopia", env = "KOPIA_BINARY")]
    pub kopia_binary: PathBuf,
    #[arg(long, value_enum, default_value_t = LogFormat::Plain, env = "LOG_FORMAT")]
    pub log_format: LogFormat,
    /// More logging on stderr (repeat for debug).
    #[arg(short, long, action = clap::ArgAction::Count)]
    pub verbose: u8,
}

#[derive(Debug, Args)]
pub struct BackupArgs {
    #[command(flatten)]
    pub common: CommonArgs,
    /// Host name recorded in the snapshot (Velero uses `velero` so it is stable across pods).
    #[arg(long, default_value = "velero")]
    pub host: String,
    /// Tag `key=value` for the snapshot (repeatable).
    #[arg(long = "tag", value_parser = parse_tag)]
    pub tags: Vec<(String, String)>,
    /// Parent snapshot for change detection (restic finds one itself when the path and host match).
    #[arg(long)]
    pub parent: Option<String>,
    /// Upload limit in KiB/s (restic `--limit-upload`).
    #[arg(long)]
    pub limit_upload: Option<u64>,
    /// Fail instead of creating a repository that does not exist (a backup that creates one
    /// says so).
    #[arg(long)]
    pub no_init: bool,
    /// The directory to back up.
    pub path: PathBuf,
}

#[derive(Debug, Args)]
pub struct RestoreArgs {
    #[command(flatten)]
    pub common: CommonArgs,
    /// Directory to restore into (created if missing).
    #[arg(long)]
    pub target: PathBuf,
    /// Download limit in KiB/s (restic `--limit-download`).
    #[arg(long)]
    pub limit_download: Option<u64>,
    /// Snapshot ID (restic: short or long ID; kopia: manifest ID).
    pub snapshot: String,
}

fn parse_tag(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("expected key=value, got {s:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_zero_update_interval_is_refused_with_the_flag_named() {
        for zero in ["0", "0s", "0ms"] {
            let run = Cli::try_parse_from([
                "podvolume-agent",
                "run",
                "--node-name=n1",
                &format!("--update-interval={zero}"),
            ]);
            let e = run.expect_err(zero).to_string();
            assert!(
                e.contains("--update-interval") && e.contains("more than zero"),
                "{e}"
            );
            let backup = Cli::try_parse_from([
                "podvolume-agent",
                "backup",
                "--repo=/r",
                "--password-file=/p",
                &format!("--update-interval={zero}"),
                "/data",
            ]);
            let e = backup.expect_err(zero).to_string();
            assert!(e.contains("more than zero"), "{e}");
        }
        Cli::try_parse_from([
            "podvolume-agent",
            "backup",
            "--repo=/r",
            "--password-file=/p",
            "--update-interval=1s",
            "/data",
        ])
        .unwrap();
        let ok = Cli::try_parse_from([
            "podvolume-agent",
            "run",
            "--node-name=n1",
            "--update-interval=250ms",
        ])
        .unwrap();
        let Command::Run(args) = ok.command else {
            panic!("not run")
        };
        assert_eq!(args.update_interval, Duration::from_millis(250));
    }
}
