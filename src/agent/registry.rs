//! The operations this agent knows: queued (waiting for a slot, oldest first), running, and
//! recently finished. Enforces `--concurrency`, holds each operation's cancel token, and answers
//! Progress/Cancel for the operations API.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use futures::future::BoxFuture;
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::operation::Operation;
use crate::progress::OperationProgress;

/// Why an operation is being stopped; decides the final phase and message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum CancelReason {
    /// `spec.cancel: true`, or a cancel through the operations API.
    Requested,
    /// The object is being deleted.
    Deleted,
    /// `--operation-timeout` elapsed.
    Timeout,
    /// No byte progress for `--stall-timeout` with `--fail-on-stall`.
    Stalled,
    /// The agent is shutting down: the object is left to be run again by the next start.
    Shutdown,
    /// The Backup/Restore it belongs to no longer waits for it (see `owner`); the registry
    /// keeps the words saying which and why (`cancel_detail`).
    OwnerDone,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum OperationKind {
    Backup,
    Restore,
    /// CSI snapshot data movement of a backup (a DataUpload).
    DataUpload,
    /// CSI snapshot data movement of a restore (a DataDownload).
    DataDownload,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum EntryState {
    Queued,
    Running,
    Finished,
}

/// What is known of one operation, for listing.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct OperationSummary {
    pub id: String,
    pub kind: OperationKind,
    pub namespace: String,
    pub name: String,
    pub state: EntryState,
    pub phase: String,
    pub progress: Option<OperationProgress>,
    /// When it was queued (accepted); the start of a queued operation's progress.
    #[serde(skip)]
    pub queued_at: SystemTime,
}

struct Entry {
    kind: OperationKind,
    namespace: String,
    name: String,
    state: EntryState,
    phase: String,
    cancel: CancellationToken,
    reason: Option<CancelReason>,
    /// What the reason alone does not say (the owner and its phase).
    detail: Option<String>,
    operation: Option<Operation>,
    final_progress: Option<OperationProgress>,
    finished_at: Option<Instant>,
    queued_at: SystemTime,
}

/// A job to run when a slot frees: given the token, returns the future that runs it.
pub type Job = Box<dyn FnOnce(CancellationToken) -> BoxFuture<'static, ()> + Send>;

#[derive(Default)]
struct Inner {
    entries: HashMap<String, Entry>,
    /// (order key, uid) -> job; the smallest key runs first.
    queue: BTreeMap<(SystemTime, String), Job>,
    running: usize,
}

/// Shared registry; cheap to clone.
#[derive(Clone)]
pub struct Registry {
    inner: Arc<Mutex<Inner>>,
    /// Set at start from `--concurrency`, or from the node-agent ConfigMap once it is read.
    concurrency: Arc<std::sync::atomic::AtomicUsize>,
    retention: Duration,
}

/// What `cancel` did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CancelResult {
    /// It was waiting for a slot: removed, it never started.
    WasQueued,
    /// A stop was started (or already under way).
    Stopping,
    /// It had already finished.
    Finished(Option<OperationProgress>),
    Unknown,
}

impl Registry {
    pub fn new(concurrency: usize, retention: Duration) -> Self {
        Self {
            inner: Arc::default(),
            concurrency: Arc::new(concurrency.max(1).into()),
            retention,
        }
    }

    /// Changes how many run at once; queued ones start if slots became free.
    pub fn set_concurrency(&self, concurrency: usize) {
        self.concurrency
            .store(concurrency.max(1), std::sync::atomic::Ordering::Relaxed);
        self.dispatch();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the operation is queued or running (a finished one does not count).
    pub fn is_active(&self, uid: &str) -> bool {
        self.lock()
            .entries
            .get(uid)
            .is_some_and(|e| e.state != EntryState::Finished)
    }

    /// Queues a job; it runs when a slot is free, oldest `order` first. Ignored when the uid is
    /// already active.
    pub fn submit(
        &self,
        uid: &str,
        kind: OperationKind,
        namespace: &str,
        name: &str,
        order: SystemTime,
        job: Job,
    ) -> bool {
        {
            let mut inner = self.lock();
            if inner
                .entries
                .get(uid)
                .is_some_and(|e| e.state != EntryState::Finished)
            {
                return false;
            }
            inner.entries.insert(
                uid.to_string(),
                Entry {
                    kind,
                    namespace: namespace.to_string(),
                    name: name.to_string(),
                    state: EntryState::Queued,
                    phase: "Accepted".to_string(),
                    cancel: CancellationToken::new(),
                    reason: None,
                    detail: None,
                    operation: None,
                    final_progress: None,
                    finished_at: None,
                    queued_at: order,
                },
            );
            inner.queue.insert((order, uid.to_string()), job);
        }
        self.dispatch();
        true
    }

    /// Starts queued jobs while slots are free.
    fn dispatch(&self) {
        loop {
            let (uid, job, token) = {
                let mut inner = self.lock();
                if inner.running >= self.concurrency.load(std::sync::atomic::Ordering::Relaxed) {
                    return;
                }
                let Some(((_, uid), job)) = inner.queue.pop_first() else {
                    return;
                };
                let Some(entry) = inner.entries.get_mut(&uid) else {
                    continue;
                };
                entry.state = EntryState::Running;
                let token = entry.cancel.clone();
                inner.running += 1;
                (uid, job, token)
            };
            let this = self.clone();
            let fut = job(token);
            tokio::spawn(async move {
                // The slot is released however the job ends, panics included.
                let guard = SlotGuard {
                    registry: this.clone(),
                    uid,
                };
                fut.await;
                drop(guard);
            });
        }
    }

    fn release(&self, uid: &str) {
        {
            let mut inner = self.lock();
            inner.running = inner.running.saturating_sub(1);
            let retention = self.retention;
            if let Some(e) = inner.entries.get_mut(uid) {
                e.state = EntryState::Finished;
                e.finished_at = Some(Instant::now());
                if e.final_progress.is_none() {
                    e.final_progress = e.operation.as_ref().map(Operation::progress);
                }
                e.operation = None;
            }
            inner
                .entries
                .retain(|_, e| e.finished_at.is_none_or(|t| t.elapsed() < retention));
        }
        self.dispatch();
    }

    /// Attaches the running uploader operation (for Progress and Cancel).
    pub fn attach(&self, uid: &str, op: Operation) {
        if let Some(e) = self.lock().entries.get_mut(uid) {
            e.operation = Some(op);
        }
    }

    pub fn set_phase(&self, uid: &str, phase: &str) {
        if let Some(e) = self.lock().entries.get_mut(uid) {
            e.phase = phase.to_string();
        }
    }

    pub fn set_final(&self, uid: &str, progress: OperationProgress) {
        if let Some(e) = self.lock().entries.get_mut(uid) {
            e.final_progress = Some(progress);
        }
    }

    /// Why the operation was asked to stop, if it was.
    pub fn cancel_reason(&self, uid: &str) -> Option<CancelReason> {
        self.lock().entries.get(uid).and_then(|e| e.reason)
    }

    pub fn cancel_detail(&self, uid: &str) -> Option<String> {
        self.lock().entries.get(uid).and_then(|e| e.detail.clone())
    }

    /// `cancel` with words for the message; kept only when this reason is the first.
    pub fn cancel_because(&self, uid: &str, reason: CancelReason, detail: String) -> CancelResult {
        if let Some(entry) = self.lock().entries.get_mut(uid)
            && entry.reason.is_none()
            && entry.state != EntryState::Finished
        {
            entry.detail = Some(detail);
        }
        self.cancel(uid, reason)
    }

    /// Best effort, idempotent. The first reason given wins.
    pub fn cancel(&self, uid: &str, reason: CancelReason) -> CancelResult {
        let mut inner = self.lock();
        let Some(entry) = inner.entries.get_mut(uid) else {
            return CancelResult::Unknown;
        };
        match entry.state {
            EntryState::Finished => CancelResult::Finished(entry.final_progress.clone()),
            EntryState::Running => {
                entry.reason.get_or_insert(reason);
                entry.cancel.cancel();
                CancelResult::Stopping
            }
            EntryState::Queued => {
                entry.reason.get_or_insert(reason);
                entry.state = EntryState::Finished;
                entry.finished_at = Some(Instant::now());
                let key = (entry.queued_at, uid.to_string());
                inner.queue.remove(&key);
                CancelResult::WasQueued
            }
        }
    }

    /// Stops everything (agent shutdown): queued jobs are dropped, running ones told to stop.
    pub fn cancel_all(&self, reason: CancelReason) {
        let uids: Vec<String> = self.lock().entries.keys().cloned().collect();
        for uid in uids {
            self.cancel(&uid, reason);
        }
    }

    pub fn running(&self) -> usize {
        self.lock().running
    }

    pub fn queued(&self) -> usize {
        self.lock().queue.len()
    }

    pub fn get(&self, uid: &str) -> Option<OperationSummary> {
        self.lock().entries.get(uid).map(|e| summary(uid, e))
    }

    /// Looks an operation up by `namespace/name`.
    pub fn find_by_name(&self, namespace: &str, name: &str) -> Option<OperationSummary> {
        self.lock()
            .entries
            .iter()
            .filter(|(_, e)| e.namespace == namespace && e.name == name)
            .max_by_key(|(_, e)| e.queued_at)
            .map(|(uid, e)| summary(uid, e))
    }

    pub fn list(&self) -> Vec<OperationSummary> {
        let mut v: Vec<OperationSummary> = self
            .lock()
            .entries
            .iter()
            .map(|(uid, e)| summary(uid, e))
            .collect();
        v.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
        v
    }

    /// Waits until nothing runs (bounded by the caller).
    pub async fn drained(&self) {
        while self.running() > 0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

fn summary(uid: &str, e: &Entry) -> OperationSummary {
    OperationSummary {
        id: uid.to_string(),
        kind: e.kind,
        namespace: e.namespace.clone(),
        name: e.name.clone(),
        state: e.state,
        phase: e.phase.clone(),
        // The final progress once there is one: its error is scrubbed of the location's
        // secrets, the live operation's is not (it stays attached until the slot is freed,
        // which a terminal write during an API outage can hold for long).
        progress: e
            .final_progress
            .clone()
            .or_else(|| e.operation.as_ref().map(Operation::progress)),
        queued_at: e.queued_at,
    }
}

struct SlotGuard {
    registry: Registry,
    uid: String,
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        self.registry.release(&self.uid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[tokio::test]
    async fn runs_oldest_first_within_the_concurrency_limit() {
        let reg = Registry::new(1, Duration::from_secs(60));
        let order = Arc::new(Mutex::new(Vec::new()));
        let peak = Arc::new(AtomicUsize::new(0));
        let now = SystemTime::now();
        let gate = CancellationToken::new();
        // Occupy the slot so the rest queue up, then submit newest first.
        {
            let gate = gate.clone();
            reg.submit(
                "first",
                OperationKind::Backup,
                "ns",
                "first",
                now,
                Box::new(move |_| Box::pin(async move { gate.cancelled().await })),
            );
        }
        for (i, uid) in ["c", "b", "a"].iter().enumerate() {
            let order = order.clone();
            let peak = peak.clone();
            let reg2 = reg.clone();
            let uid_s = uid.to_string();
            let when = now + Duration::from_secs(10 - i as u64);
            reg.submit(
                uid,
                OperationKind::Backup,
                "ns",
                uid,
                when,
                Box::new(move |_| {
                    Box::pin(async move {
                        peak.fetch_max(reg2.running(), Ordering::SeqCst);
                        order.lock().unwrap().push(uid_s);
                    })
                }),
            );
        }
        assert_eq!(reg.queued(), 3);
        // Cancel of a queued one removes it without running it.
        assert_eq!(
            reg.cancel("b", CancelReason::Requested),
            CancelResult::WasQueued
        );
        gate.cancel();
        tokio::time::timeout(Duration::from_secs(5), reg.drained())
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(
            *order.lock().unwrap(),
            vec!["a".to_string(), "c".to_string()]
        );
        assert_eq!(peak.load(Ordering::SeqCst), 1);
        assert!(matches!(
            reg.cancel("a", CancelReason::Requested),
            CancelResult::Finished(_)
        ));
        assert_eq!(
            reg.cancel("zzz", CancelReason::Requested),
            CancelResult::Unknown
        );
    }
}
