//! A running transfer with Velero's async-operation contract: `progress()` returns the latest
//! [`OperationProgress`] at no cost, `cancel()` is best effort, idempotent and a no-op once the
//! operation finished.

use std::future::Future;
use std::sync::Arc;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::progress::OperationProgress;
use crate::uploader::Outcome;

/// The producer side, held by the task that runs the transfer.
#[derive(Debug, Clone)]
pub struct OperationSink {
    progress: watch::Sender<OperationProgress>,
    cancel: CancellationToken,
}

impl OperationSink {
    /// Publishes a new value; readers always see the newest one (nothing queues up).
    pub fn publish(&self, p: OperationProgress) {
        self.progress.send_replace(p);
    }

    /// The value published last.
    pub fn latest(&self) -> OperationProgress {
        self.progress.borrow().clone()
    }

    pub fn cancel_token(&self) -> &CancellationToken {
        &self.cancel
    }

    pub fn cancel_requested(&self) -> bool {
        self.cancel.is_cancelled()
    }
}

/// Handle to a running (or finished) operation. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Operation {
    progress: watch::Receiver<OperationProgress>,
    cancel: CancellationToken,
    outcome: watch::Receiver<Option<Arc<Outcome>>>,
}

impl Operation {
    /// Starts `job` on the runtime. The job gets the sink to publish progress and to learn of a
    /// cancel; its result becomes the operation's outcome.
    pub fn spawn<F, Fut>(initial: OperationProgress, job: F) -> Operation
    where
        F: FnOnce(OperationSink) -> Fut,
        Fut: Future<Output = Outcome> + Send + 'static,
    {
        let (ptx, prx) = watch::channel(initial);
        let (otx, orx) = watch::channel(None);
        let cancel = CancellationToken::new();
        let sink = OperationSink {
            progress: ptx,
            cancel: cancel.clone(),
        };
        let fut = job(sink);
        tokio::spawn(async move {
            let outcome = fut.await;
            otx.send_replace(Some(Arc::new(outcome)));
        });
        Operation {
            progress: prx,
            cancel,
            outcome: orx,
        }
    }

    /// The latest progress.
    pub fn progress(&self) -> OperationProgress {
        self.progress.borrow().clone()
    }

    /// A receiver that wakes on every new progress value.
    pub fn subscribe(&self) -> watch::Receiver<OperationProgress> {
        self.progress.clone()
    }

    pub fn is_finished(&self) -> bool {
        self.outcome.borrow().is_some()
    }

    /// Asks the operation to stop and waits until it has: when this returns, the uploader's whole
    /// process group is gone. Calling it again, or after the end, changes nothing.
    pub async fn cancel(&self) -> Arc<Outcome> {
        if !self.is_finished() {
            self.cancel.cancel();
        }
        self.wait().await
    }

    /// Requests a stop without waiting for it.
    pub fn request_cancel(&self) {
        if !self.is_finished() {
            self.cancel.cancel();
        }
    }

    /// Waits for the end.
    pub async fn wait(&self) -> Arc<Outcome> {
        let mut rx = self.outcome.clone();
        loop {
            if let Some(o) = rx.borrow_and_update().clone() {
                return o;
            }
            if rx.changed().await.is_err() {
                // The job's task ended without an outcome: it panicked.
                return Arc::new(Outcome::internal("the operation's task ended unexpectedly"));
            }
        }
    }
}
