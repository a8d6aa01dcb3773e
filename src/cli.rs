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
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    pub update_interval: Duration,
    /// Time between SIGINT and SIGKILL when stopping the uploader.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub cancel_grace: Duration,
    /// How long to wait for a repository lock held by someone else.
    #[arg(long, default_value = "1m", value_parser = humantime::parse_duration)]
    pub lock_wait: Duration,
    /// Fail instead of initialising a repository that does not exist.
    #[arg(long)]
    pub no_init: bool,
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
