//! Prometheus metrics (OpenMetrics text). Velero's names are kept for existing dashboards; ours
//! add what Velero lacks. No label carries a per-object value: label values come from small fixed
//! sets (node, direction, result, class), so cardinality is bounded.

use std::sync::atomic::AtomicU64;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NodeLabel {
    pub node: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OperationLabel {
    pub node: String,
    pub operation: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DirectionLabel {
    pub direction: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabel {
    pub result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ClassLabel {
    pub class: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabel {
    pub state: String,
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

fn latency_histogram() -> Histogram {
    // 1 s .. ~9 h
    Histogram::new(exponential_buckets(1.0, 2.0, 16))
}

fn write_histogram() -> Histogram {
    // 1 ms .. ~16 s
    Histogram::new(exponential_buckets(0.001, 2.0, 15))
}

/// All metrics of the agent.
pub struct Metrics {
    node: String,
    registry: Registry,
    // Velero's names. The two `_count` series are exposed as gauges because OpenMetrics would
    // rename a counter to `..._count_total`, breaking dashboards that query Velero's names.
    backup_enqueue: Family<NodeLabel, Gauge>,
    backup_dequeue: Family<NodeLabel, Gauge>,
    operation_latency: HistogramFamily<OperationLabel>,
    upload_success: Family<NodeLabel, Counter>,
    upload_failure: Family<NodeLabel, Counter>,
    upload_cancel: Family<NodeLabel, Counter>,
    download_success: Family<NodeLabel, Counter>,
    download_failure: Family<NodeLabel, Counter>,
    download_cancel: Family<NodeLabel, Counter>,
    // Ours.
    bytes: Family<DirectionLabel, Counter>,
    throughput: Family<DirectionLabel, Gauge<f64, AtomicU64>>,
    operations: Family<StateLabel, Gauge>,
    status_writes: Family<ResultLabel, Counter>,
    status_write_seconds: HistogramFamily<ResultLabel>,
    uploader_exits: Family<ClassLabel, Counter>,
    stalls: Counter,
    truncated_frames: Counter,
}

impl Metrics {
    pub fn new(node: &str) -> Self {
        let mut registry = Registry::default();
        let m = Self {
            node: node.to_string(),
            backup_enqueue: Family::default(),
            backup_dequeue: Family::default(),
            operation_latency: Family::new_with_constructor(latency_histogram),
            upload_success: Family::default(),
            upload_failure: Family::default(),
            upload_cancel: Family::default(),
            download_success: Family::default(),
            download_failure: Family::default(),
            download_cancel: Family::default(),
            bytes: Family::default(),
            throughput: Family::default(),
            operations: Family::default(),
            status_writes: Family::default(),
            status_write_seconds: Family::new_with_constructor(write_histogram),
            uploader_exits: Family::default(),
            stalls: Counter::default(),
            truncated_frames: Counter::default(),
            registry: Registry::default(),
        };
        registry.register(
            "podVolume_pod_volume_backup_enqueue_count",
            "PodVolumeBackups taken by this node's agent",
            m.backup_enqueue.clone(),
        );
        registry.register(
            "podVolume_pod_volume_backup_dequeue_count",
            "PodVolumeBackups that reached a terminal phase on this node",
            m.backup_dequeue.clone(),
        );
        registry.register(
            "podVolume_pod_volume_operation_latency_seconds",
            "Duration of pod volume operations",
            m.operation_latency.clone(),
        );
        registry.register(
            "podVolume_data_upload_success",
            "Successful volume backups",
            m.upload_success.clone(),
        );
        registry.register(
            "podVolume_data_upload_failure",
            "Failed volume backups",
            m.upload_failure.clone(),
        );
        registry.register(
            "podVolume_data_upload_cancel",
            "Canceled volume backups",
            m.upload_cancel.clone(),
        );
        registry.register(
            "podVolume_data_download_success",
            "Successful volume restores",
            m.download_success.clone(),
        );
        registry.register(
            "podVolume_data_download_failure",
            "Failed volume restores",
            m.download_failure.clone(),
        );
        registry.register(
            "podVolume_data_download_cancel",
            "Canceled volume restores",
            m.download_cancel.clone(),
        );
        registry.register(
            "podvolume_agent_transferred_bytes",
            "Bytes processed by finished operations (backup: read from volumes; restore: written)",
            m.bytes.clone(),
        );
        registry.register(
            "podvolume_agent_throughput_bytes_per_second",
            "Average transfer rate of the running operation of each direction since it started (0 when none runs)",
            m.throughput.clone(),
        );
        registry.register(
            "podvolume_agent_operations",
            "Operations by state (running, queued)",
            m.operations.clone(),
        );
        registry.register(
            "podvolume_agent_status_writes",
            "Status writes by result",
            m.status_writes.clone(),
        );
        registry.register(
            "podvolume_agent_status_write_duration_seconds",
            "Latency of status writes",
            m.status_write_seconds.clone(),
        );
        registry.register(
            "podvolume_agent_uploader_exits",
            "Uploader runs by outcome class",
            m.uploader_exits.clone(),
        );
        registry.register(
            "podvolume_agent_stalls",
            "Operations that made no byte progress for --stall-timeout",
            m.stalls.clone(),
        );
        registry.register(
            "podvolume_agent_parser_frames_truncated",
            "Uploader output records longer than the frame cap, skipped",
            m.truncated_frames.clone(),
        );
        Self { registry, ..m }
    }

    fn node(&self) -> NodeLabel {
        NodeLabel {
            node: self.node.clone(),
        }
    }

    pub fn backup_enqueued(&self) {
        self.backup_enqueue.get_or_create(&self.node()).inc();
    }

    /// A terminal outcome of an operation: `result` is success, failure or cancel.
    pub fn finished(&self, kind: &str, result: &str, duration: Duration, bytes: u64) {
        let node = self.node();
        let fam = match (kind, result) {
            ("backup", "success") => &self.upload_success,
            ("backup", "failure") => &self.upload_failure,
            ("backup", _) => &self.upload_cancel,
            (_, "success") => &self.download_success,
            (_, "failure") => &self.download_failure,
            _ => &self.download_cancel,
        };
        fam.get_or_create(&node).inc();
        if kind == "backup" {
            self.backup_dequeue.get_or_create(&node).inc();
        }
        self.operation_latency
            .get_or_create(&OperationLabel {
                node: self.node.clone(),
                operation: kind.to_string(),
            })
            .observe(duration.as_secs_f64());
        let direction = if kind == "backup" {
            "upload"
        } else {
            "download"
        };
        self.bytes
            .get_or_create(&DirectionLabel {
                direction: direction.to_string(),
            })
            .inc_by(bytes);
    }

    pub fn set_throughput(&self, direction: &str, bytes_per_second: f64) {
        self.throughput
            .get_or_create(&DirectionLabel {
                direction: direction.to_string(),
            })
            .set(bytes_per_second);
    }

    pub fn set_operations(&self, running: usize, queued: usize) {
        self.operations
            .get_or_create(&StateLabel {
                state: "running".into(),
            })
            .set(running as i64);
        self.operations
            .get_or_create(&StateLabel {
                state: "queued".into(),
            })
            .set(queued as i64);
    }

    pub fn status_write(&self, result: &str, took: Duration) {
        let l = ResultLabel {
            result: result.to_string(),
        };
        self.status_writes.get_or_create(&l).inc();
        self.status_write_seconds
            .get_or_create(&l)
            .observe(took.as_secs_f64());
    }

    pub fn uploader_exit(&self, class: &str) {
        self.uploader_exits
            .get_or_create(&ClassLabel {
                class: class.to_string(),
            })
            .inc();
    }

    pub fn stalled(&self) {
        self.stalls.inc();
    }

    pub fn truncated(&self, n: u64) {
        self.truncated_frames.inc_by(n);
    }

    /// The OpenMetrics text exposition.
    pub fn encode(&self) -> String {
        let mut s = String::new();
        let _ = prometheus_client::encoding::text::encode(&mut s, &self.registry);
        s
    }
}
