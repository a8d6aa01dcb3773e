//! podvolume-agent: a Kubernetes node agent for file-system volume backups, compatible with
//! Velero's `PodVolumeBackup`/`PodVolumeRestore` API.
//!
//! Data flows one way: an uploader runner spawns restic or kopia, a framer cuts its output into
//! records, a parser turns records into typed events, a progress tracker keeps the latest
//! [`progress::OperationProgress`], and consumers (the one-shot CLI, the status writer) read that
//! value at their own pace.

pub mod agent;
pub mod cli;
pub mod client;
pub mod crd;
pub mod datamover;
pub mod engine;
pub mod error;
pub mod facts;
pub mod framing;
pub mod oneshot;
pub mod operation;
pub mod plugin;
pub mod progress;
pub mod runner;
pub mod telemetry;
pub mod text;
pub mod uploader;
