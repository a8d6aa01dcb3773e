//! The agent's HTTP endpoints: health and metrics (never authenticated), and the operations API
//! ([`super::opsapi`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use tokio_util::sync::CancellationToken;

use super::Context;
use super::metrics::Metrics;
use super::registry::Registry;

#[derive(Clone)]
pub struct AdminState {
    pub ready: Arc<AtomicBool>,
    pub shutdown: CancellationToken,
    pub metrics: Arc<Metrics>,
    pub registry: Registry,
    /// Set once the agent is connected (the operations API needs the API client).
    pub ops: Arc<tokio::sync::OnceCell<Arc<Context>>>,
}

pub fn router(state: AdminState) -> Router {
    Router::new()
        .route("/livez", get(livez))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(state.clone())
        .merge(super::opsapi::router(state.ops))
}

pub async fn serve(listener: tokio::net::TcpListener, state: AdminState) {
    let shutdown = state.shutdown.clone();
    let app = router(state);
    // Keep answering /livez until the process exits: shutdown must not look like a hang.
    let _ = shutdown;
    if let Err(e) = axum::serve(listener, app).await {
        tracing::error!(error = %e, "admin server stopped");
    }
}

/// The process works: the runtime answers. Independent of the API server on purpose.
async fn livez() -> &'static str {
    "ok"
}

/// Serving: the CRDs were found and both watches listed once; not while shutting down.
async fn readyz(State(s): State<AdminState>) -> impl IntoResponse {
    if s.shutdown.is_cancelled() {
        (StatusCode::SERVICE_UNAVAILABLE, "shutting down")
    } else if s.ready.load(Ordering::SeqCst) {
        (StatusCode::OK, "ok")
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: waiting for the API server and the first watch list",
        )
    }
}

async fn metrics(State(s): State<AdminState>) -> impl IntoResponse {
    s.metrics
        .set_operations(s.registry.running(), s.registry.queued());
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        s.metrics.encode(),
    )
}
