//! What `kubectl podvolume` knows about a Velero backup or restore: its volumes as the API server
//! serves them, and the figures for the whole (counts by phase, bytes, rate, ETA, stall).
//!
//! Pure: no Kubernetes client, no clock. Objects come in as JSON values, every observation comes
//! with the time it was made, and every figure is computed for a `now` given by the caller, so
//! the unit tests below drive time by hand.
//!
//! The rate is measured, not taken from the agents' messages (Velero's own node agent writes none):
//! each volume's `bytesDone` is remembered, and every increase adds to a counter of bytes moved
//! for its volume and for the whole. A decrease (a volume run again after an agent restart) or a
//! volume appearing or disappearing adds nothing, so the counter never goes back and the rate
//! never drops to zero because a volume finished or a new one started at 0. The rate over the
//! window is the counter's increase between the first and the last *change* in the window:
//! agents write progress every few seconds, and measuring from change to change counts exactly
//! the bytes of the writes in between, while a window ending "now" would sag between writes.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::{Duration, SystemTime};

use serde::Serialize;
use serde_json::Value;

/// Which Velero operation the objects belong to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    Backup,
    Restore,
}

impl Kind {
    /// The label Velero puts on every PodVolumeBackup/PodVolumeRestore of one backup/restore.
    pub fn group_label(self) -> &'static str {
        match self {
            Kind::Backup => "velero.io/backup-name",
            Kind::Restore => "velero.io/restore-name",
        }
    }

    /// The resource, as kubectl names it.
    pub fn resource(self) -> &'static str {
        match self {
            Kind::Backup => "podvolumebackup",
            Kind::Restore => "podvolumerestore",
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Backup => "backup",
            Kind::Restore => "restore",
        }
    }
}

/// Where a volume is, in the five buckets an operator counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum State {
    /// New, Accepted, Prepared (or no phase yet): waiting for an agent or for its turn.
    Queued,
    /// InProgress or Canceling: data is moving (or stopping).
    Running,
    Completed,
    Failed,
    Canceled,
}

impl State {
    pub fn of_phase(phase: &str) -> State {
        match phase {
            "" | "New" | "Accepted" | "Prepared" => State::Queued,
            "Completed" => State::Completed,
            "Failed" => State::Failed,
            "Canceled" => State::Canceled,
            // InProgress, Canceling, and phases of a later Velero this build does not know: the
            // object is taken and not finished.
            _ => State::Running,
        }
    }

    pub fn is_terminal(self) -> bool {
        matches!(self, State::Completed | State::Failed | State::Canceled)
    }
}

/// One PodVolumeBackup or PodVolumeRestore, reduced to what the views show.
#[derive(Debug, Clone, PartialEq)]
pub struct Volume {
    pub uid: String,
    /// The object's name.
    pub name: String,
    /// The Velero backup/restore it belongs to (its group label); "" when unlabelled.
    pub group: String,
    /// `namespace/name` of the pod.
    pub pod: String,
    pub volume: String,
    /// PVB: `spec.node`; PVR: `status.node` (the agent that took it), "" before.
    pub node: String,
    /// The phase as written ("" means New).
    pub phase: String,
    pub bytes_done: u64,
    /// `None` until the total is known (a volume still queued or scanning).
    pub total_bytes: Option<u64>,
    pub message: String,
    pub cancel_requested: bool,
    pub created: Option<SystemTime>,
    pub started: Option<SystemTime>,
    pub completed: Option<SystemTime>,
    /// A DataUpload/DataDownload (CSI snapshot data movement), not a pod volume.
    pub moved: bool,
}

impl Volume {
    /// Reads an object of either kind, written by our agent or Velero's, under either CRD
    /// flavour. Missing or mistyped fields read as absent; only a missing `metadata.uid` makes it
    /// unusable (nothing could track it).
    pub fn from_object(kind: Kind, obj: &Value) -> Option<Volume> {
        let meta = &obj["metadata"];
        let spec = &obj["spec"];
        let status = &obj["status"];
        let uid = text(&meta["uid"]);
        if uid.is_empty() {
            return None;
        }
        let phase = text(&status["phase"]);
        let state = State::of_phase(&phase);
        // A DataUpload names its source claim, a DataDownload its target volume; both have no
        // pod (the hold pod is the agent's business).
        let moved_claim = if let Some(pvc) = spec["sourcePVC"].as_str() {
            Some(format!("{}/{pvc}", text(&spec["sourceNamespace"])))
        } else {
            spec["targetVolume"].as_object().map(|t| {
                format!(
                    "{}/{}",
                    t.get("namespace")
                        .and_then(Value::as_str)
                        .unwrap_or_default(),
                    t.get("pvc").and_then(Value::as_str).unwrap_or_default()
                )
            })
        };
        let done = count(&status["progress"]["bytesDone"]);
        let mut total = Some(count(&status["progress"]["totalBytes"])).filter(|t| *t > 0);
        if total.is_none() && kind == Kind::Restore {
            // Velero copies the backup's final size into the restore's spec before it starts.
            total = Some(count(&spec["snapshotSize"])).filter(|t| *t > 0);
        }
        if total.is_none() && state == State::Completed {
            // A completed volume is whole: an empty one has a total of 0 (and no progress at
            // all when Velero's agent wrote it).
            total = Some(done);
        }
        let bytes_done = match total {
            Some(t) => done.min(t),
            None => done,
        };
        let node = match kind {
            Kind::Backup if moved_claim.is_none() => text(&spec["node"]),
            _ => text(&status["node"]),
        };
        let pod_ns = text(&spec["pod"]["namespace"]);
        let pod_name = text(&spec["pod"]["name"]);
        Some(Volume {
            uid,
            name: text(&meta["name"]),
            group: text(&meta["labels"][kind.group_label()]),
            pod: if moved_claim.is_some() {
                "(data mover)".to_string()
            } else if pod_ns.is_empty() {
                pod_name
            } else {
                format!("{pod_ns}/{pod_name}")
            },
            volume: match &moved_claim {
                Some(claim) => format!("claim {claim}"),
                None => text(&spec["volume"]),
            },
            moved: moved_claim.is_some(),
            node,
            phase,
            bytes_done,
            total_bytes: total,
            message: text(&status["message"]),
            cancel_requested: spec["cancel"].as_bool() == Some(true)
                || meta["annotations"][crate::crd::CANCEL_ANNOTATION].as_str() == Some("true")
                || !meta["deletionTimestamp"].is_null(),
            created: time(&meta["creationTimestamp"]),
            started: time(&status["startTimestamp"]),
            completed: time(&status["completionTimestamp"]),
        })
    }

    pub fn state(&self) -> State {
        State::of_phase(&self.phase)
    }

    /// The phase as shown: "New" for an object no agent has touched yet.
    pub fn phase_label(&self) -> &str {
        if self.phase.is_empty() {
            "New"
        } else {
            &self.phase
        }
    }
}

fn text(v: &Value) -> String {
    v.as_str().unwrap_or_default().to_string()
}

/// A byte count: negative, fractional or mistyped values read as 0.
fn count(v: &Value) -> u64 {
    v.as_u64().unwrap_or(0)
}

fn time(v: &Value) -> Option<SystemTime> {
    let t: jiff::Timestamp = v.as_str()?.parse().ok()?;
    Some(SystemTime::from(t))
}

/// Bytes moved over time, from which a rate is measured.
#[derive(Debug, Clone)]
struct Meter {
    /// Bytes moved since observation began (sum of increases).
    moved: u64,
    /// (time of a change, `moved` after it), oldest first; spans at least the window when it
    /// can, and always keeps two changes once there were two.
    changes: VecDeque<(SystemTime, u64)>,
    /// When the first observation was made (a stall is measured from it until something moves).
    since: SystemTime,
}

impl Meter {
    fn new(at: SystemTime) -> Meter {
        Meter {
            moved: 0,
            changes: VecDeque::new(),
            since: at,
        }
    }

    fn add(&mut self, bytes: u64, at: SystemTime, window: Duration) {
        if bytes == 0 {
            return;
        }
        self.moved += bytes;
        match self.changes.back_mut() {
            // Two observations at the same instant are one change.
            Some(last) if last.0 >= at => last.1 = self.moved,
            _ => self.changes.push_back((at, self.moved)),
        }
        // Keep the newest change older than the window's start as the anchor, nothing older.
        while self.changes.len() > 2 {
            let edge = at.checked_sub(window).unwrap_or(SystemTime::UNIX_EPOCH);
            if self.changes[1].0 <= edge {
                self.changes.pop_front();
            } else {
                break;
            }
        }
    }

    /// Bytes per second between the first and the last change kept; `None` before two changes
    /// at least `min_span` apart (two agents writing within milliseconds of each other say
    /// nothing about a rate).
    fn rate(&self, min_span: Duration) -> Option<f64> {
        let (first, last) = (self.changes.front()?, self.changes.back()?);
        let span = last.0.duration_since(first.0).ok()?;
        (span >= min_span && !span.is_zero())
            .then(|| (last.1 - first.1) as f64 / span.as_secs_f64())
    }

    /// How long nothing has moved, as of `now`.
    fn idle(&self, now: SystemTime) -> Duration {
        let last = self.changes.back().map(|c| c.0).unwrap_or(self.since);
        now.duration_since(last).unwrap_or_default()
    }
}

/// How a rate was obtained.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum RateBasis {
    /// Measured from changes seen within the window.
    Window,
    /// Bytes done divided by the time since the first volume started: all that one reading of
    /// the objects can tell (`--once`, or the first moments of a watch).
    SinceStart,
}

/// An estimate of the time left.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Eta {
    pub seconds: u64,
    /// Some volumes have no total yet: the real ETA is at least this.
    pub at_least: bool,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Counts {
    pub total: usize,
    /// Volumes in a terminal phase (completed, failed or canceled).
    pub done: usize,
    pub queued: usize,
    pub running: usize,
    pub completed: usize,
    pub failed: usize,
    pub canceled: usize,
}

/// The figures for one Velero backup/restore at one instant.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Summary {
    pub kind: Kind,
    pub name: String,
    pub volumes: Counts,
    pub bytes_done: u64,
    /// Sum of the totals known so far.
    pub total_bytes: u64,
    /// Some unfinished volume has no total yet: the real total is at least `total_bytes`.
    pub total_at_least: bool,
    /// Bytes still to move in the volumes whose total is known.
    pub remaining_bytes: u64,
    pub rate_bytes_per_second: Option<f64>,
    pub rate_basis: Option<RateBasis>,
    pub eta: Option<Eta>,
    /// Volumes are running but no byte has moved for at least the stall threshold.
    pub stalled_seconds: Option<u64>,
    /// Every volume is in a terminal phase.
    pub finished: bool,
    #[serde(with = "opt_rfc3339")]
    pub created: Option<SystemTime>,
    /// The first volume's start.
    #[serde(with = "opt_rfc3339")]
    pub started: Option<SystemTime>,
    /// The last volume's completion, once finished.
    #[serde(with = "opt_rfc3339")]
    pub completed: Option<SystemTime>,
}

/// One volume's figures at one instant.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Item {
    pub name: String,
    pub uid: String,
    pub pod: String,
    pub volume: String,
    pub node: String,
    pub phase: String,
    pub state: State,
    pub bytes_done: u64,
    pub total_bytes: Option<u64>,
    pub rate_bytes_per_second: Option<f64>,
    pub message: String,
    pub cancel_requested: bool,
    #[serde(with = "opt_rfc3339")]
    pub started: Option<SystemTime>,
    #[serde(with = "opt_rfc3339")]
    pub completed: Option<SystemTime>,
}

mod opt_rfc3339 {
    use std::time::SystemTime;

    use serde::Serializer;

    pub fn serialize<S: Serializer>(t: &Option<SystemTime>, s: S) -> Result<S::Ok, S::Error> {
        match t {
            Some(t) => s.collect_str(&humantime::format_rfc3339_seconds(*t)),
            None => s.serialize_none(),
        }
    }
}

/// Settings of the measurement.
#[derive(Debug, Clone, Copy)]
pub struct Settings {
    /// The rate is measured over changes within this long.
    pub window: Duration,
    /// Running volumes without any byte moving for this long are "stalled".
    pub stall_after: Duration,
}

impl Settings {
    /// The shortest span of changes a window rate is measured over: a tenth of the window.
    pub fn min_span(&self) -> Duration {
        self.window / 10
    }
}

/// Every volume seen, grouped by Velero backup/restore, with the meters of each.
#[derive(Debug)]
pub struct Tracker {
    kind: Kind,
    settings: Settings,
    volumes: BTreeMap<String, Volume>,
    /// The last `bytesDone` seen per uid (kept after a deletion, so a re-created reading of the
    /// same object is not counted twice).
    last_done: HashMap<String, u64>,
    groups: HashMap<String, Meter>,
    per_volume: HashMap<String, Meter>,
}

impl Tracker {
    pub fn new(kind: Kind, settings: Settings) -> Tracker {
        Tracker {
            kind,
            settings,
            volumes: BTreeMap::new(),
            last_done: HashMap::new(),
            groups: HashMap::new(),
            per_volume: HashMap::new(),
        }
    }

    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// A volume as read at `at` (list, or a watch event). Returns whether anything shown changed.
    pub fn observe(&mut self, v: Volume, at: SystemTime) -> bool {
        let window = self.settings.window;
        let group = self
            .groups
            .entry(v.group.clone())
            .or_insert_with(|| Meter::new(at));
        let mine = self
            .per_volume
            .entry(v.uid.clone())
            .or_insert_with(|| Meter::new(at));
        // The first reading is a baseline: what was done before we looked has no time attached.
        if let Some(prev) = self.last_done.insert(v.uid.clone(), v.bytes_done) {
            let gained = v.bytes_done.saturating_sub(prev);
            group.add(gained, at, window);
            mine.add(gained, at, window);
        }
        let changed = self.volumes.get(&v.uid) != Some(&v);
        self.volumes.insert(v.uid.clone(), v);
        changed
    }

    /// A volume deleted.
    pub fn remove(&mut self, uid: &str) -> bool {
        self.volumes.remove(uid).is_some()
    }

    /// After a re-list: volumes not in it are gone.
    /// Keeps the volumes of `moved` kind (data movement or pod volumes) whose uid is in `uids`,
    /// and every volume of the other kind (a re-list of one feed says nothing of the other).
    pub fn retain(&mut self, moved: bool, uids: &std::collections::HashSet<String>) -> bool {
        let before = self.volumes.len();
        self.volumes
            .retain(|k, v| v.moved != moved || uids.contains(k));
        before != self.volumes.len()
    }

    /// The Velero backups/restores seen (their names), sorted.
    pub fn groups(&self) -> Vec<String> {
        let mut g: Vec<String> = self.volumes.values().map(|v| v.group.clone()).collect();
        g.sort();
        g.dedup();
        g
    }

    pub fn volumes_of<'a>(&'a self, group: &'a str) -> impl Iterator<Item = &'a Volume> + 'a {
        self.volumes.values().filter(move |v| v.group == group)
    }

    /// The volumes of `group`, ordered for display: by pod, then volume.
    pub fn items(&self, group: &str, now: SystemTime) -> Vec<Item> {
        let mut items: Vec<Item> = self
            .volumes_of(group)
            .map(|v| {
                let rate = if v.state() == State::Running {
                    self.per_volume
                        .get(&v.uid)
                        .and_then(|m| m.rate(self.settings.min_span()))
                        .or_else(|| since_start(v.bytes_done, v.started, now))
                } else {
                    None
                };
                Item {
                    name: v.name.clone(),
                    uid: v.uid.clone(),
                    pod: v.pod.clone(),
                    volume: v.volume.clone(),
                    node: v.node.clone(),
                    phase: v.phase_label().to_string(),
                    state: v.state(),
                    bytes_done: v.bytes_done,
                    total_bytes: v.total_bytes,
                    rate_bytes_per_second: rate,
                    message: v.message.clone(),
                    cancel_requested: v.cancel_requested,
                    started: v.started,
                    completed: v.completed,
                }
            })
            .collect();
        items.sort_by(|a, b| (&a.pod, &a.volume, &a.name).cmp(&(&b.pod, &b.volume, &b.name)));
        items
    }

    /// The figures for `group` as of `now`; `None` when it has no volume.
    pub fn summary(&self, group: &str, now: SystemTime) -> Option<Summary> {
        let mut c = Counts::default();
        let (mut done, mut total, mut remaining) = (0u64, 0u64, 0u64);
        let mut at_least = false;
        let (mut created, mut started, mut completed) = (None, None, None);
        for v in self.volumes_of(group) {
            let state = v.state();
            c.total += 1;
            match state {
                State::Queued => c.queued += 1,
                State::Running => c.running += 1,
                State::Completed => c.completed += 1,
                State::Failed => c.failed += 1,
                State::Canceled => c.canceled += 1,
            }
            if state.is_terminal() {
                c.done += 1;
            }
            done += v.bytes_done;
            match v.total_bytes {
                Some(t) => {
                    total += t;
                    if !state.is_terminal() {
                        remaining += t.saturating_sub(v.bytes_done);
                    }
                }
                None if !state.is_terminal() => at_least = true,
                None => {}
            }
            created = earliest(created, v.created);
            started = earliest(started, v.started);
            completed = latest(completed, v.completed);
        }
        if c.total == 0 {
            return None;
        }
        let finished = c.done == c.total;
        let meter = self.groups.get(group);
        let stalled = meter
            .map(|m| m.idle(now))
            .filter(|idle| c.running > 0 && *idle >= self.settings.stall_after)
            .map(|idle| idle.as_secs());
        let (rate, basis) = if finished {
            // The whole run's average, for the record.
            let end = completed.unwrap_or(now);
            match average(done, started, end) {
                Some(r) => (Some(r), Some(RateBasis::SinceStart)),
                None => (None, None),
            }
        } else if let Some(r) = meter.and_then(|m| m.rate(self.settings.min_span())) {
            (Some(r), Some(RateBasis::Window))
        } else if let Some(r) = since_start(done, started, now) {
            (Some(r), Some(RateBasis::SinceStart))
        } else {
            (None, None)
        };
        let eta = match rate {
            Some(r) if !finished && stalled.is_none() && r > 0.0 && remaining > 0 => Some(Eta {
                seconds: (remaining as f64 / r).ceil() as u64,
                at_least,
            }),
            _ => None,
        };
        Some(Summary {
            kind: self.kind,
            name: group.to_string(),
            volumes: c,
            bytes_done: done,
            total_bytes: total,
            total_at_least: at_least,
            remaining_bytes: remaining,
            rate_bytes_per_second: rate,
            rate_basis: basis,
            eta,
            stalled_seconds: stalled,
            finished,
            created,
            started,
            completed: completed.filter(|_| finished),
        })
    }
}

/// Bytes over the time since `started`; `None` without a start, before a second has passed
/// (or with a start in the future: the node's clock ahead of ours), or with nothing done.
fn since_start(bytes: u64, started: Option<SystemTime>, now: SystemTime) -> Option<f64> {
    average(bytes, started, now)
}

fn average(bytes: u64, started: Option<SystemTime>, end: SystemTime) -> Option<f64> {
    let secs = end.duration_since(started?).ok()?.as_secs_f64();
    (secs >= 1.0 && bytes > 0).then(|| bytes as f64 / secs)
}

fn earliest(a: Option<SystemTime>, b: Option<SystemTime>) -> Option<SystemTime> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

fn latest(a: Option<SystemTime>, b: Option<SystemTime>) -> Option<SystemTime> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const MB: u64 = 1_000_000;

    fn t(secs: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000 + secs)
    }

    fn stamp(secs: u64) -> String {
        humantime::format_rfc3339_seconds(t(secs)).to_string()
    }

    fn settings() -> Settings {
        Settings {
            window: Duration::from_secs(60),
            stall_after: Duration::from_secs(60),
        }
    }

    /// A PVB of backup `b1` as our agent writes it.
    fn pvb(
        uid: &str,
        node: &str,
        phase: &str,
        done: u64,
        total: u64,
        start: Option<u64>,
    ) -> Volume {
        let mut status =
            json!({"phase": phase, "progress": {"bytesDone": done, "totalBytes": total}});
        if let Some(s) = start {
            status["startTimestamp"] = json!(stamp(s));
        }
        let obj = json!({
            "metadata": {"name": format!("b1-{uid}"), "uid": uid, "creationTimestamp": stamp(0),
                         "labels": {"velero.io/backup-name": "b1"}},
            "spec": {"node": node, "volume": "data", "pod": {"namespace": "app", "name": format!("pod-{uid}")}},
            "status": status,
        });
        Volume::from_object(Kind::Backup, &obj).unwrap()
    }

    #[test]
    fn reads_objects_of_velero_and_ours() {
        // Written by Velero's own node agent under Velero's CRDs: no message, no progress on an
        // empty volume, phase as Velero spells it.
        let velero = json!({
            "metadata": {"name": "b1-x", "uid": "u1", "labels": {"velero.io/backup-name": "b1"}},
            "spec": {"node": "n1", "volume": "v", "pod": {"namespace": "a", "name": "p"}},
            "status": {"phase": "Completed", "snapshotID": "", "completionTimestamp": "2026-12-02T10:00:00Z"},
        });
        let v = Volume::from_object(Kind::Backup, &velero).unwrap();
        assert_eq!(
            (v.state(), v.bytes_done, v.total_bytes),
            (State::Completed, 0, Some(0))
        );
        assert_eq!(
            (v.pod.as_str(), v.node.as_str(), v.message.as_str()),
            ("a/p", "n1", "")
        );
        assert!(v.completed.is_some());
        // New object, no status at all.
        let new = json!({"metadata": {"uid": "u2", "name": "n"}, "spec": {}});
        let v = Volume::from_object(Kind::Backup, &new).unwrap();
        assert_eq!(
            (v.state(), v.phase_label(), v.total_bytes),
            (State::Queued, "New", None)
        );
        // Mistyped and negative figures read as absent; bytesDone never above the total.
        let odd = json!({"metadata": {"uid": "u3"}, "status": {"phase": "InProgress",
            "progress": {"bytesDone": 900, "totalBytes": 500}}});
        let v = Volume::from_object(Kind::Backup, &odd).unwrap();
        assert_eq!((v.bytes_done, v.total_bytes), (500, Some(500)));
        let odd = json!({"metadata": {"uid": "u4"}, "status": {"progress": {"bytesDone": -1, "totalBytes": "x"}}});
        let v = Volume::from_object(Kind::Backup, &odd).unwrap();
        assert_eq!((v.bytes_done, v.total_bytes), (0, None));
        // No uid: unusable.
        assert!(Volume::from_object(Kind::Backup, &json!({"metadata": {}})).is_none());
        // A restore: total from spec.snapshotSize before the agent reports one; node from status.
        let pvr = json!({
            "metadata": {"uid": "r1", "labels": {"velero.io/restore-name": "r"}},
            "spec": {"snapshotSize": 1000, "cancel": true, "pod": {"namespace": "a", "name": "p"}},
            "status": {"phase": "Accepted", "node": "n2"},
        });
        let v = Volume::from_object(Kind::Restore, &pvr).unwrap();
        assert_eq!((v.group.as_str(), v.node.as_str()), ("r", "n2"));
        assert_eq!((v.total_bytes, v.cancel_requested), (Some(1000), true));
        // Unknown future phase: taken, not finished.
        assert_eq!(State::of_phase("Verifying"), State::Running);
    }

    #[test]
    fn counts_bytes_and_at_least() {
        let mut tr = Tracker::new(Kind::Backup, settings());
        tr.observe(
            pvb("a", "n1", "InProgress", 40 * MB, 100 * MB, Some(0)),
            t(10),
        );
        tr.observe(pvb("b", "n2", "InProgress", 10 * MB, 0, Some(5)), t(10));
        tr.observe(pvb("c", "n2", "Accepted", 0, 0, None), t(10));
        tr.observe(
            pvb("d", "n3", "Completed", 20 * MB, 20 * MB, Some(0)),
            t(10),
        );
        tr.observe(pvb("e", "n3", "Failed", 5 * MB, 30 * MB, Some(1)), t(10));
        tr.observe(pvb("f", "n1", "Canceled", 0, 0, None), t(10));
        let s = tr.summary("b1", t(10)).unwrap();
        assert_eq!(
            s.volumes,
            Counts {
                total: 6,
                done: 3,
                queued: 1,
                running: 2,
                completed: 1,
                failed: 1,
                canceled: 1
            }
        );
        assert_eq!(s.bytes_done, 75 * MB);
        assert_eq!(s.total_bytes, 150 * MB, "known totals only");
        assert!(s.total_at_least, "b and c have no total yet");
        assert_eq!(
            s.remaining_bytes,
            60 * MB,
            "only a's, the failed one's is not to come"
        );
        // One reading: the average since the first start (t0), 75 MB in 10 s.
        assert_eq!(s.rate_basis, Some(RateBasis::SinceStart));
        assert_eq!(s.rate_bytes_per_second, Some(7.5 * MB as f64));
        assert_eq!(
            s.eta,
            Some(Eta {
                seconds: 8,
                at_least: true
            })
        );
        assert!(!s.finished && s.stalled_seconds.is_none());
        assert!(tr.summary("other", t(10)).is_none());
    }

    #[test]
    fn window_rate_from_changes_and_eta() {
        let mut tr = Tracker::new(Kind::Backup, settings());
        tr.observe(pvb("a", "n1", "InProgress", 0, 100 * MB, Some(0)), t(0));
        tr.observe(pvb("b", "n2", "InProgress", 0, 100 * MB, Some(0)), t(0));
        // Agents write every 10 s, offset by 5 s; 1 MB/s each.
        tr.observe(
            pvb("a", "n1", "InProgress", 10 * MB, 100 * MB, Some(0)),
            t(10),
        );
        let s = tr.summary("b1", t(10)).unwrap();
        assert_eq!(
            s.rate_basis,
            Some(RateBasis::SinceStart),
            "one change is no rate yet"
        );
        tr.observe(
            pvb("b", "n2", "InProgress", 15 * MB, 100 * MB, Some(0)),
            t(15),
        );
        tr.observe(
            pvb("a", "n1", "InProgress", 20 * MB, 100 * MB, Some(0)),
            t(20),
        );
        let s = tr.summary("b1", t(21)).unwrap();
        assert_eq!(s.rate_basis, Some(RateBasis::Window));
        // From the change at 10 to the change at 20: b's 15 MB and a's 10 MB.
        assert_eq!(s.rate_bytes_per_second, Some(2.5 * MB as f64));
        assert_eq!(s.remaining_bytes, 165 * MB);
        assert_eq!(
            s.eta,
            Some(Eta {
                seconds: 66,
                at_least: false
            })
        );
        // Two writes milliseconds apart are no measurement: the average since start stands.
        let mut close = Tracker::new(Kind::Backup, settings());
        close.observe(pvb("a", "n1", "InProgress", 0, 100 * MB, Some(0)), t(0));
        close.observe(pvb("b", "n2", "InProgress", 0, 100 * MB, Some(0)), t(0));
        let near = t(20) + Duration::from_millis(5);
        close.observe(
            pvb("a", "n1", "InProgress", 20 * MB, 100 * MB, Some(0)),
            t(20),
        );
        close.observe(
            pvb("b", "n2", "InProgress", 20 * MB, 100 * MB, Some(0)),
            near,
        );
        let s = close.summary("b1", near).unwrap();
        assert_eq!(s.rate_basis, Some(RateBasis::SinceStart));
        let r = s.rate_bytes_per_second.unwrap();
        assert!((r - 40.0 * MB as f64 / 20.005).abs() < 1.0, "{r}");
        // The rate does not sag between writes: "now" is not part of it.
        assert_eq!(
            tr.summary("b1", t(29)).unwrap().rate_bytes_per_second,
            Some(2.5 * MB as f64)
        );
    }

    #[test]
    fn window_slides_and_keeps_an_anchor() {
        let mut tr = Tracker::new(Kind::Backup, settings());
        tr.observe(pvb("a", "n1", "InProgress", 0, 1000 * MB, Some(0)), t(0));
        // 1 MB/s for 100 s, then 4 MB/s: after 60 s at the new speed only it counts.
        let mut done = 0;
        for s in (10..=100).step_by(10) {
            done += 10 * MB;
            tr.observe(pvb("a", "n1", "InProgress", done, 1000 * MB, Some(0)), t(s));
        }
        for s in (110..=200).step_by(10) {
            done += 40 * MB;
            tr.observe(pvb("a", "n1", "InProgress", done, 1000 * MB, Some(0)), t(s));
        }
        let s = tr.summary("b1", t(200)).unwrap();
        assert_eq!(s.rate_bytes_per_second, Some(4.0 * MB as f64));
        // Changes rarer than the window: the last two still give a rate.
        let mut tr = Tracker::new(Kind::Backup, settings());
        tr.observe(pvb("a", "n1", "InProgress", 0, 1000 * MB, Some(0)), t(0));
        tr.observe(
            pvb("a", "n1", "InProgress", 100 * MB, 1000 * MB, Some(0)),
            t(100),
        );
        tr.observe(
            pvb("a", "n1", "InProgress", 300 * MB, 1000 * MB, Some(0)),
            t(300),
        );
        let s = tr.summary("b1", t(300)).unwrap();
        assert_eq!(s.rate_bytes_per_second, Some(1.0 * MB as f64));
    }

    #[test]
    fn a_volume_finishing_or_starting_or_restarting_does_not_drop_the_rate() {
        let mut tr = Tracker::new(Kind::Backup, settings());
        tr.observe(pvb("a", "n1", "InProgress", 0, 20 * MB, Some(0)), t(0));
        tr.observe(pvb("b", "n1", "Accepted", 0, 0, None), t(0));
        tr.observe(
            pvb("a", "n1", "InProgress", 10 * MB, 20 * MB, Some(0)),
            t(10),
        );
        tr.observe(
            pvb("a", "n1", "Completed", 20 * MB, 20 * MB, Some(0)),
            t(20),
        );
        let before = tr.summary("b1", t(20)).unwrap().rate_bytes_per_second;
        assert_eq!(before, Some(1.0 * MB as f64));
        // b starts at 0 with a total: no change, no drop.
        tr.observe(pvb("b", "n1", "InProgress", 0, 50 * MB, Some(21)), t(21));
        let s = tr.summary("b1", t(22)).unwrap();
        assert_eq!(s.rate_bytes_per_second, before);
        assert_eq!(s.eta.map(|e| e.seconds), Some(50));
        // An agent restart runs b again from 0: the counter does not go back.
        tr.observe(
            pvb("b", "n1", "InProgress", 30 * MB, 50 * MB, Some(21)),
            t(30),
        );
        tr.observe(pvb("b", "n1", "InProgress", 0, 50 * MB, Some(31)), t(31));
        let s = tr.summary("b1", t(32)).unwrap();
        let r = s.rate_bytes_per_second.unwrap();
        assert!(r > 0.0, "{s:?}");
        assert_eq!(s.remaining_bytes, 50 * MB);
        assert!(s.eta.unwrap().seconds > 0);
        // A deleted volume leaves the counts, not the measured bytes.
        assert!(tr.remove("a"));
        let s = tr.summary("b1", t(33)).unwrap();
        assert_eq!((s.volumes.total, s.rate_bytes_per_second), (1, Some(r)));
    }

    #[test]
    fn stalled_and_finished() {
        let mut tr = Tracker::new(Kind::Backup, settings());
        tr.observe(pvb("a", "n1", "InProgress", 0, 100 * MB, Some(0)), t(0));
        tr.observe(
            pvb("a", "n1", "InProgress", 10 * MB, 100 * MB, Some(0)),
            t(10),
        );
        tr.observe(
            pvb("a", "n1", "InProgress", 20 * MB, 100 * MB, Some(0)),
            t(20),
        );
        let s = tr.summary("b1", t(79)).unwrap();
        assert!(s.stalled_seconds.is_none() && s.eta.is_some());
        let s = tr.summary("b1", t(80)).unwrap();
        assert_eq!(s.stalled_seconds, Some(60));
        assert!(s.eta.is_none(), "no ETA while stalled");
        // Nothing seen moving since the first reading counts too.
        let mut q = Tracker::new(Kind::Backup, settings());
        q.observe(
            pvb("a", "n1", "InProgress", 5 * MB, 100 * MB, Some(0)),
            t(0),
        );
        assert_eq!(q.summary("b1", t(61)).unwrap().stalled_seconds, Some(61));
        // Only queued volumes: waiting, not stalled.
        let mut w = Tracker::new(Kind::Backup, settings());
        w.observe(pvb("a", "n1", "New", 0, 0, None), t(0));
        let s = w.summary("b1", t(600)).unwrap();
        assert!(s.stalled_seconds.is_none() && s.rate_bytes_per_second.is_none());
        // Finished: no ETA, the run's average over its duration.
        let mut obj = pvb("a", "n1", "Completed", 100 * MB, 100 * MB, Some(0));
        obj.completed = Some(t(50));
        tr.observe(obj, t(50));
        let s = tr.summary("b1", t(500)).unwrap();
        assert!(s.finished && s.eta.is_none() && s.stalled_seconds.is_none());
        assert_eq!(s.rate_bytes_per_second, Some(2.0 * MB as f64));
        assert_eq!(s.completed, Some(t(50)));
    }

    #[test]
    fn never_a_negative_or_infinite_eta() {
        let mut tr = Tracker::new(Kind::Backup, settings());
        // Start in the future (node clock ahead): no rate rather than a negative one.
        tr.observe(
            pvb("a", "n1", "InProgress", 10 * MB, 100 * MB, Some(100)),
            t(10),
        );
        let s = tr.summary("b1", t(10)).unwrap();
        assert!(s.rate_bytes_per_second.is_none() && s.eta.is_none());
        // All known bytes done but still running (finalizing): nothing left to estimate.
        let mut tr = Tracker::new(Kind::Backup, settings());
        tr.observe(pvb("a", "n1", "InProgress", 0, 100 * MB, Some(0)), t(0));
        tr.observe(
            pvb("a", "n1", "InProgress", 50 * MB, 100 * MB, Some(0)),
            t(10),
        );
        tr.observe(
            pvb("a", "n1", "InProgress", 100 * MB, 100 * MB, Some(0)),
            t(20),
        );
        let s = tr.summary("b1", t(21)).unwrap();
        assert_eq!((s.remaining_bytes, s.eta), (0, None));
    }

    #[test]
    fn per_volume_items() {
        let mut tr = Tracker::new(Kind::Backup, settings());
        tr.observe(pvb("b", "n2", "InProgress", 0, 100 * MB, Some(0)), t(0));
        tr.observe(pvb("a", "n1", "Completed", 10 * MB, 10 * MB, Some(0)), t(0));
        tr.observe(
            pvb("b", "n2", "InProgress", 10 * MB, 100 * MB, Some(0)),
            t(10),
        );
        tr.observe(
            pvb("b", "n2", "InProgress", 30 * MB, 100 * MB, Some(0)),
            t(20),
        );
        let items = tr.items("b1", t(20));
        assert_eq!(items.len(), 2);
        assert_eq!(items[0].pod, "app/pod-a", "sorted by pod");
        assert_eq!(items[0].rate_bytes_per_second, None, "finished: no rate");
        assert_eq!(items[1].rate_bytes_per_second, Some(2.0 * MB as f64));
        assert_eq!(
            (items[1].node.as_str(), items[1].phase.as_str()),
            ("n2", "InProgress")
        );
    }

    #[test]
    fn data_uploads_and_downloads_are_read_beside_pod_volumes() {
        let du = json!({
            "metadata": {"uid": "d1", "name": "b1-x", "labels": {"velero.io/backup-name": "b1"}},
            "spec": {"sourcePVC": "data", "sourceNamespace": "app", "snapshotType": "CSI"},
            "status": {"phase": "InProgress", "node": "n1", "progress": {"bytesDone": 5, "totalBytes": 10}},
        });
        let v = Volume::from_object(Kind::Backup, &du).unwrap();
        assert!(v.moved);
        assert_eq!(
            (
                v.pod.as_str(),
                v.volume.as_str(),
                v.node.as_str(),
                v.group.as_str()
            ),
            ("(data mover)", "claim app/data", "n1", "b1")
        );
        assert_eq!((v.bytes_done, v.total_bytes), (5, Some(10)));
        let dd = json!({
            "metadata": {"uid": "d2", "name": "r1-y", "labels": {"velero.io/restore-name": "r1"}},
            "spec": {"targetVolume": {"pvc": "data", "pv": "", "namespace": "app2"}, "snapshotSize": 100},
            "status": {"phase": "Accepted"},
        });
        let v = Volume::from_object(Kind::Restore, &dd).unwrap();
        assert!(v.moved);
        assert_eq!(v.volume, "claim app2/data");
        assert_eq!(v.total_bytes, Some(100));
        // A re-list of the pod volumes keeps the moved ones, and the other way round.
        let mut t = Tracker::new(
            Kind::Backup,
            Settings {
                window: Duration::from_secs(60),
                stall_after: Duration::from_secs(60),
            },
        );
        let at = SystemTime::UNIX_EPOCH + Duration::from_secs(1000);
        t.observe(Volume::from_object(Kind::Backup, &du).unwrap(), at);
        let pvb = json!({"metadata": {"uid": "p1", "name": "b1-p", "labels": {"velero.io/backup-name": "b1"}},
            "spec": {"node": "n1", "pod": {"namespace": "app", "name": "web"}, "volume": "cache"}});
        t.observe(Volume::from_object(Kind::Backup, &pvb).unwrap(), at);
        assert!(!t.retain(false, &["p1".to_string()].into()));
        assert_eq!(t.items("b1", at).len(), 2);
        assert!(t.retain(true, &Default::default()));
        assert_eq!(t.items("b1", at).len(), 1);
    }
}
