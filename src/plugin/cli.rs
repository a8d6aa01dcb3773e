//! `kubectl podvolume` command line.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

#[derive(Debug, Parser)]
#[command(
    name = "kubectl-podvolume",
    bin_name = "kubectl podvolume",
    version,
    about = "Progress of Velero's file-system backups and restores, for the whole backup: volumes, bytes, rate, ETA"
)]
pub struct PluginCli {
    #[command(flatten)]
    pub conn: Connection,
    #[command(subcommand)]
    pub command: PluginCommand,
}

/// Where the objects are; the same flags as kubectl's.
#[derive(Debug, Clone, Args)]
pub struct Connection {
    /// kubeconfig file (default: `KUBECONFIG`, then `~/.kube/config`, then in-cluster).
    #[arg(long, global = true)]
    pub kubeconfig: Option<PathBuf>,
    /// kubeconfig context to use (default: the current context).
    #[arg(long, global = true)]
    pub context: Option<String>,
    /// Velero's namespace, where the PodVolumeBackups/PodVolumeRestores (and DataUploads/
    /// DataDownloads) are.
    #[arg(short = 'n', long, global = true, default_value = "velero")]
    pub namespace: String,
}

#[derive(Debug, Subcommand)]
pub enum PluginCommand {
    /// One line per Velero backup that has pod volume backups or DataUploads.
    Backups(ListArgs),
    /// One line per Velero restore that has pod volume restores or DataDownloads.
    Restores(ListArgs),
    /// One Velero backup: the whole and each volume, pod volumes and moved CSI snapshots (a
    /// live view on a terminal).
    Backup(ShowArgs),
    /// One Velero restore: the whole and each volume (a live view on a terminal).
    Restore(ShowArgs),
    /// Ask the node agents to stop every unfinished volume of a backup or restore.
    Cancel {
        #[command(subcommand)]
        target: CancelTarget,
    },
}

#[derive(Debug, Subcommand)]
pub enum CancelTarget {
    /// Sets `spec.cancel: true` on the backup's unfinished PodVolumeBackups and DataUploads.
    Backup { name: String },
    /// Sets `spec.cancel: true` on the restore's unfinished PodVolumeRestores and DataDownloads.
    Restore { name: String },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Output {
    Table,
    Json,
}

#[derive(Debug, Clone, Args)]
pub struct Measure {
    /// The rate is measured over the progress changes seen in this window.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    pub window: Duration,
    /// Running volumes with no byte moved for this long are shown as stalled.
    #[arg(long, default_value = "1m", value_parser = humantime::parse_duration)]
    pub stalled_after: Duration,
}

#[derive(Debug, Clone, Args)]
pub struct ListArgs {
    #[arg(short = 'o', long = "output", value_enum, default_value_t = Output::Table)]
    pub output: Output,
    /// Keep watching: print a backup's line again each time its volumes change.
    #[arg(short = 'w', long)]
    pub watch: bool,
    #[command(flatten)]
    pub measure: Measure,
}

#[derive(Debug, Clone, Args)]
pub struct ShowArgs {
    /// The Velero backup/restore name (label `velero.io/backup-name` / `velero.io/restore-name`).
    pub name: String,
    /// Print the table once and exit, even on a terminal.
    #[arg(long, conflicts_with = "watch")]
    pub once: bool,
    /// Print one line per change (one JSON object per line with `-o json`) until every volume is
    /// finished, instead of the live view.
    #[arg(short = 'w', long)]
    pub watch: bool,
    #[arg(short = 'o', long = "output", value_enum, default_value_t = Output::Table)]
    pub output: Output,
    /// How often the live view is redrawn.
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    pub refresh: Duration,
    #[command(flatten)]
    pub measure: Measure,
}
