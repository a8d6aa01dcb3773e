//! The operations API: Velero's Progress and Cancel over HTTP, for the operations this agent
//! knows (queued, running, and finished ones for the retention window).
//!
//! | method | path | answer |
//! | --- | --- | --- |
//! | GET | `/v1/operations` | `{"items": [...]}`: id, kind, namespace, name, state, phase, progress |
//! | GET | `/v1/operations/{id}` | the `OperationProgress` JSON; 404 for an unknown id |
//! | POST | `/v1/operations/{id}/cancel` | 202 when a stop was started, 200 when already finished |
//!
//! `{id}` is the object's UID or `namespace/name` (the slash may be sent as `%2F`, or as a path
//! separator). Callers authenticate with a bearer token (TokenReview) and are authorised with a
//! SubjectAccessReview on the object's resource in `velero.io`: `get` for reads, `update` for
//! cancel, `list` for the list. Review results are cached for [`REVIEW_TTL`]. Tokens are never
//! logged nor echoed.

use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use axum::Router;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use serde_json::json;
use tokio::sync::OnceCell;

use super::Context;
use super::registry::{CancelReason, CancelResult, EntryState, OperationKind, OperationSummary};
use crate::cli::{ApiAuth, RunArgs};
use crate::crd::{PodVolumeBackup, PodVolumeRestore};
use crate::progress::OperationProgress;

/// How long a TokenReview or SubjectAccessReview answer is reused.
pub const REVIEW_TTL: Duration = Duration::from_secs(10);
/// Entries per review cache; beyond it, expired entries go, then everything.
const CACHE_CAP: usize = 1024;
const GROUP: &str = "velero.io";

/// Refuses `--api-auth=none` on a non-loopback listen address.
pub fn check_auth_mode(args: &RunArgs) -> Result<(), String> {
    if args.api_auth == ApiAuth::None && !args.listen_address.ip().is_loopback() {
        return Err(format!(
            "--api-auth=none is only allowed with a loopback --listen-address (127.0.0.1 or ::1), \
             not {}: anyone reaching it could read and cancel operations",
            args.listen_address
        ));
    }
    Ok(())
}

#[derive(Clone)]
struct OpsState {
    ops: Arc<OnceCell<Arc<Context>>>,
    tokens: Arc<TtlCache<Token, Option<Caller>>>,
    access: Arc<TtlCache<AccessKey, bool>>,
}

/// The routes of the operations API, to merge into the admin router.
pub fn router(ops: Arc<OnceCell<Arc<Context>>>) -> Router {
    let state = OpsState {
        ops,
        tokens: Arc::new(TtlCache::new(REVIEW_TTL, CACHE_CAP)),
        access: Arc::new(TtlCache::new(REVIEW_TTL, CACHE_CAP)),
    };
    Router::new()
        .route("/v1/operations", get(list))
        .route("/v1/operations/{*rest}", get(progress).post(cancel))
        .with_state(state)
}

// ----- errors -----

/// An error answer: `{"code": 404, "reason": "NotFound", "message": "..."}`.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }
    fn unauthorized(message: &str) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, message)
    }
    fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, message)
    }
}

fn reason_of(status: StatusCode) -> &'static str {
    match status {
        StatusCode::UNAUTHORIZED => "Unauthorized",
        StatusCode::FORBIDDEN => "Forbidden",
        StatusCode::NOT_FOUND => "NotFound",
        StatusCode::METHOD_NOT_ALLOWED => "MethodNotAllowed",
        StatusCode::SERVICE_UNAVAILABLE => "ServiceUnavailable",
        _ => "InternalError",
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = axum::Json(json!({
            "code": self.status.as_u16(),
            "reason": reason_of(self.status),
            "message": self.message,
        }));
        let mut r = (self.status, body).into_response();
        if self.status == StatusCode::UNAUTHORIZED {
            r.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        r
    }
}

// ----- review caches -----

/// A bearer token as a cache key. No `Debug`/`Display`: it must not reach a log by accident.
#[derive(Clone, PartialEq, Eq, Hash)]
struct Token(String);

/// The authenticated user, as the TokenReview said.
#[derive(Clone, PartialEq, Eq, Hash)]
struct Caller {
    username: String,
    uid: String,
    groups: Vec<String>,
    extra: BTreeMap<String, Vec<String>>,
}

#[derive(Clone, PartialEq, Eq, Hash)]
struct AccessKey {
    caller: Caller,
    verb: &'static str,
    resource: &'static str,
    namespace: String,
    name: String,
}

/// A small map whose entries expire; bounded so that a flood of distinct tokens cannot grow it.
struct TtlCache<K, V> {
    ttl: Duration,
    cap: usize,
    map: Mutex<HashMap<K, (V, Instant)>>,
}

impl<K: Eq + Hash, V: Clone> TtlCache<K, V> {
    fn new(ttl: Duration, cap: usize) -> Self {
        Self {
            ttl,
            cap,
            map: Mutex::new(HashMap::new()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<K, (V, Instant)>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn get(&self, k: &K) -> Option<V> {
        let map = self.lock();
        map.get(k)
            .filter(|(_, at)| at.elapsed() < self.ttl)
            .map(|(v, _)| v.clone())
    }

    fn put(&self, k: K, v: V) {
        let mut map = self.lock();
        if map.len() >= self.cap {
            let ttl = self.ttl;
            map.retain(|_, (_, at)| at.elapsed() < ttl);
            if map.len() >= self.cap {
                map.clear();
            }
        }
        map.insert(k, (v, Instant::now()));
    }
}

// ----- authentication and authorisation -----

fn bearer(headers: &HeaderMap) -> Option<String> {
    let v = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = v.trim().split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then(|| token.to_string())
}

impl OpsState {
    /// The agent's context, once connected to the API server.
    fn ctx(&self) -> Result<Arc<Context>, ApiError> {
        self.ops.get().cloned().ok_or_else(|| {
            ApiError::unavailable("the agent is not connected to the API server yet")
        })
    }

    /// Who calls; `None` with `--api-auth=none`.
    async fn authenticate(
        &self,
        ctx: &Context,
        headers: &HeaderMap,
    ) -> Result<Option<Caller>, ApiError> {
        if ctx.args.api_auth == ApiAuth::None {
            return Ok(None);
        }
        let Some(token) = bearer(headers) else {
            return Err(ApiError::unauthorized(
                "a bearer token is required (Authorization: Bearer <token>)",
            ));
        };
        let key = Token(token);
        let caller = match self.tokens.get(&key) {
            Some(c) => c,
            None => {
                let c = token_review(ctx, &key).await?;
                self.tokens.put(key, c.clone());
                c
            }
        };
        caller
            .map(Some)
            .ok_or_else(|| ApiError::unauthorized("the bearer token is not valid"))
    }

    /// 403 unless `caller` may `verb` the resource (`name` empty: any object) in `namespace`.
    async fn authorize(
        &self,
        ctx: &Context,
        caller: &Option<Caller>,
        verb: &'static str,
        resource: &'static str,
        namespace: &str,
        name: &str,
    ) -> Result<(), ApiError> {
        let Some(caller) = caller else {
            return Ok(());
        };
        let key = AccessKey {
            caller: caller.clone(),
            verb,
            resource,
            namespace: namespace.to_string(),
            name: name.to_string(),
        };
        let allowed = match self.access.get(&key) {
            Some(a) => a,
            None => {
                let a = access_review(ctx, &key).await?;
                self.access.put(key, a);
                a
            }
        };
        if allowed {
            Ok(())
        } else {
            let what = if name.is_empty() {
                resource.to_string()
            } else {
                format!("{resource} {name:?}")
            };
            Err(ApiError::new(
                StatusCode::FORBIDDEN,
                format!(
                    "user {:?} may not {verb} {GROUP} {what} in namespace {namespace:?}",
                    caller.username
                ),
            ))
        }
    }
}

async fn token_review(ctx: &Context, token: &Token) -> Result<Option<Caller>, ApiError> {
    let review = TokenReview {
        spec: TokenReviewSpec {
            token: token.0.clone(),
            audiences: None,
        },
        ..Default::default()
    };
    let api: Api<TokenReview> = Api::all(ctx.client.clone());
    let answer = api
        .create(&PostParams::default(), &review)
        .await
        .map_err(|e| {
            // kube's error carries the API's answer, never the request body (the token).
            tracing::warn!(error = %e, "TokenReview failed");
            ApiError::unavailable("cannot verify the bearer token with the API server")
        })?;
    let Some(status) = answer.status else {
        return Ok(None);
    };
    if status.authenticated != Some(true) {
        return Ok(None);
    }
    let user = status.user.unwrap_or_default();
    Ok(Some(Caller {
        username: user.username.unwrap_or_default(),
        uid: user.uid.unwrap_or_default(),
        groups: user.groups.unwrap_or_default(),
        extra: user.extra.unwrap_or_default(),
    }))
}

async fn access_review(ctx: &Context, key: &AccessKey) -> Result<bool, ApiError> {
    let c = &key.caller;
    let review = SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: Some(c.username.clone()),
            uid: (!c.uid.is_empty()).then(|| c.uid.clone()),
            groups: Some(c.groups.clone()),
            extra: (!c.extra.is_empty()).then(|| c.extra.clone()),
            resource_attributes: Some(ResourceAttributes {
                group: Some(GROUP.to_string()),
                resource: Some(key.resource.to_string()),
                verb: Some(key.verb.to_string()),
                namespace: Some(key.namespace.clone()),
                name: (!key.name.is_empty()).then(|| key.name.clone()),
                ..Default::default()
            }),
            ..Default::default()
        },
        ..Default::default()
    };
    let api: Api<SubjectAccessReview> = Api::all(ctx.client.clone());
    let answer = api
        .create(&PostParams::default(), &review)
        .await
        .map_err(|e| {
            tracing::warn!(error = %e, "SubjectAccessReview failed");
            ApiError::unavailable("cannot check the caller's permissions with the API server")
        })?;
    Ok(answer
        .status
        .is_some_and(|s| s.allowed && !s.denied.unwrap_or(false)))
}

// ----- handlers -----

fn resource_of(kind: OperationKind) -> &'static str {
    match kind {
        OperationKind::Backup => "podvolumebackups",
        OperationKind::Restore => "podvolumerestores",
        OperationKind::DataUpload => "datauploads",
        OperationKind::DataDownload => "datadownloads",
    }
}

fn caller_name(c: &Option<Caller>) -> &str {
    c.as_ref().map_or("-", |c| c.username.as_str())
}

async fn list(State(s): State<OpsState>, headers: HeaderMap) -> Result<Response, ApiError> {
    let ctx = s.ctx()?;
    let caller = s.authenticate(&ctx, &headers).await?;
    let ns = ctx.args.namespace.clone();
    let mut allowed = Vec::new();
    let mut denied = None;
    for kind in [
        OperationKind::Backup,
        OperationKind::Restore,
        OperationKind::DataUpload,
        OperationKind::DataDownload,
    ] {
        match s
            .authorize(&ctx, &caller, "list", resource_of(kind), &ns, "")
            .await
        {
            Ok(()) => allowed.push(kind),
            Err(e) if e.status == StatusCode::FORBIDDEN => denied = Some(e),
            Err(e) => return Err(e),
        }
    }
    if allowed.is_empty() {
        return Err(denied.unwrap_or_else(|| ApiError::new(StatusCode::FORBIDDEN, "forbidden")));
    }
    let items: Vec<OperationSummary> = ctx
        .registry
        .list()
        .into_iter()
        .filter(|o| allowed.contains(&o.kind))
        .collect();
    tracing::debug!(
        user = caller_name(&caller),
        n = items.len(),
        "operations listed"
    );
    Ok(axum::Json(json!({ "items": items })).into_response())
}

/// What a path under `/v1/operations/` names.
enum Target {
    Uid(String),
    Name(String, String),
}

impl Target {
    fn parse(id: &str) -> Option<Target> {
        let id = id.trim_end_matches('/');
        match id.split_once('/') {
            None if !id.is_empty() => Some(Target::Uid(id.to_string())),
            Some((ns, name)) if !ns.is_empty() && !name.is_empty() && !name.contains('/') => {
                Some(Target::Name(ns.to_string(), name.to_string()))
            }
            _ => None,
        }
    }

    fn display(&self) -> String {
        match self {
            Target::Uid(u) => u.clone(),
            Target::Name(ns, n) => format!("{ns}/{n}"),
        }
    }
}

/// Finds the operation, after checking the caller's right to `verb` it. For an unknown one the
/// caller must still be allowed to `verb` PodVolumeBackups there: whether an id exists is not
/// told to someone who may not read it.
async fn resolve(
    s: &OpsState,
    ctx: &Context,
    caller: &Option<Caller>,
    verb: &'static str,
    target: &Target,
) -> Result<OperationSummary, ApiError> {
    let found = match target {
        Target::Uid(uid) => ctx.registry.get(uid),
        Target::Name(ns, name) => ctx.registry.find_by_name(ns, name),
    };
    match found {
        Some(op) => {
            s.authorize(
                ctx,
                caller,
                verb,
                resource_of(op.kind),
                &op.namespace,
                &op.name,
            )
            .await?;
            Ok(op)
        }
        None => {
            let (ns, name) = match target {
                Target::Uid(_) => (ctx.args.namespace.as_str(), ""),
                Target::Name(ns, name) => (ns.as_str(), name.as_str()),
            };
            s.authorize(ctx, caller, verb, "podvolumebackups", ns, name)
                .await?;
            Err(ApiError::new(
                StatusCode::NOT_FOUND,
                format!(
                    "no operation {:?} on this node (unknown, not for this node, or finished more than {} ago)",
                    target.display(),
                    humantime::format_duration(super::RETENTION)
                ),
            ))
        }
    }
}

/// The operation's progress; one is made up for operations that have not started a transfer.
fn progress_of(op: &OperationSummary) -> OperationProgress {
    if let Some(p) = &op.progress {
        return p.clone();
    }
    let mut p = OperationProgress::new(op.queued_at);
    p.updated = SystemTime::now().max(op.queued_at);
    match op.state {
        EntryState::Queued => p.description = "queued: waiting for a free slot".to_string(),
        EntryState::Running => p.description = "starting".to_string(),
        EntryState::Finished => {
            p.completed = true;
            p.description = op.phase.to_lowercase();
            if op.phase != "Completed" {
                p.err = format!("ended in phase {} before a transfer started", op.phase);
            }
        }
    }
    p
}

async fn progress(
    State(s): State<OpsState>,
    Path(rest): Path<String>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let ctx = s.ctx()?;
    let caller = s.authenticate(&ctx, &headers).await?;
    let target = Target::parse(&rest).ok_or_else(|| not_found_path(&rest))?;
    let op = resolve(&s, &ctx, &caller, "get", &target).await?;
    Ok(axum::Json(progress_of(&op)).into_response())
}

fn not_found_path(rest: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        format!("no such path /v1/operations/{rest}"),
    )
}

async fn cancel(
    State(s): State<OpsState>,
    Path(rest): Path<String>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let ctx = s.ctx()?;
    let caller = s.authenticate(&ctx, &headers).await?;
    let Some(id) = rest.trim_end_matches('/').strip_suffix("/cancel") else {
        return Err(ApiError::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "POST is only for /v1/operations/{id}/cancel",
        ));
    };
    let target = Target::parse(id).ok_or_else(|| not_found_path(&rest))?;
    let op = resolve(&s, &ctx, &caller, "update", &target).await?;
    if op.state == EntryState::Finished {
        return Ok((StatusCode::OK, axum::Json(progress_of(&op))).into_response());
    }
    // Through the object, so that it goes Canceling -> Canceled exactly as with a user's
    // `spec.cancel` (a queued one is written Canceled by its reconciler).
    let patched = set_spec_cancel(&ctx, &op).await;
    if let Err(e) = &patched {
        tracing::warn!(namespace = %op.namespace, name = %op.name, uid = %op.id, error = %e, "cannot set spec.cancel");
    }
    let result = if op.state == EntryState::Running {
        // Stop at once rather than after the watch event; the reconciler's cancel is a no-op then.
        ctx.registry.cancel(&op.id, CancelReason::Requested)
    } else if patched.is_ok() {
        CancelResult::WasQueued
    } else {
        return Err(ApiError::unavailable(
            "cannot set spec.cancel on the object; try again",
        ));
    };
    let op_before = op.clone();
    let now = ctx.registry.get(&op.id).unwrap_or(op);
    match result {
        CancelResult::Finished(p) => {
            let p = p.unwrap_or_else(|| progress_of(&now));
            Ok((StatusCode::OK, axum::Json(p)).into_response())
        }
        CancelResult::Unknown => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!("no operation {:?} on this node", target.display()),
        )),
        CancelResult::WasQueued | CancelResult::Stopping => {
            tracing::info!(namespace = %now.namespace, name = %now.name, uid = %now.id, user = caller_name(&caller), "cancel requested through the operations API");
            // A queued one is ended by its reconciler once the watch brings `spec.cancel`, which
            // can be before the re-read above: 202 answers with the operation as the cancel
            // found it (queued, not completed), never with a body that says it already ended.
            let body = if result == CancelResult::WasQueued {
                progress_of(&op_before)
            } else {
                progress_of(&now)
            };
            Ok((StatusCode::ACCEPTED, axum::Json(body)).into_response())
        }
    }
}

async fn set_spec_cancel(ctx: &Context, op: &OperationSummary) -> Result<(), kube::Error> {
    let patch = Patch::Merge(crate::crd::cancel_patch());
    let pp = PatchParams {
        field_manager: Some(super::status::FIELD_MANAGER.to_string()),
        ..PatchParams::default()
    };
    match op.kind {
        OperationKind::Backup => {
            let api: Api<PodVolumeBackup> = Api::namespaced(ctx.client.clone(), &op.namespace);
            api.patch(&op.name, &pp, &patch).await.map(drop)
        }
        OperationKind::Restore => {
            let api: Api<PodVolumeRestore> = Api::namespaced(ctx.client.clone(), &op.namespace);
            api.patch(&op.name, &pp, &patch).await.map(drop)
        }
        OperationKind::DataUpload => {
            let api: Api<crate::datamover::DataUpload> =
                Api::namespaced(ctx.client.clone(), &op.namespace);
            api.patch(&op.name, &pp, &patch).await.map(drop)
        }
        OperationKind::DataDownload => {
            let api: Api<crate::datamover::DataDownload> =
                Api::namespaced(ctx.client.clone(), &op.namespace);
            api.patch(&op.name, &pp, &patch).await.map(drop)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets() {
        assert!(matches!(Target::parse("abc-123"), Some(Target::Uid(u)) if u == "abc-123"));
        assert!(
            matches!(Target::parse("velero/pvb-1"), Some(Target::Name(n, m)) if n == "velero" && m == "pvb-1")
        );
        assert!(Target::parse("").is_none());
        assert!(Target::parse("a/b/c").is_none());
        assert!(Target::parse("/b").is_none());
    }

    #[test]
    fn bearer_tokens() {
        let mut h = HeaderMap::new();
        assert_eq!(bearer(&h), None);
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Bearer abc"),
        );
        assert_eq!(bearer(&h).as_deref(), Some("abc"));
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Basic abc"));
        assert_eq!(bearer(&h), None);
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("bearer  "));
        assert_eq!(bearer(&h), None);
    }

    #[test]
    fn cache_expires_and_stays_bounded() {
        let c: TtlCache<u32, bool> = TtlCache::new(Duration::from_millis(50), 4);
        for i in 0..10 {
            c.put(i, true);
        }
        assert!(c.lock().len() <= 4);
        assert_eq!(c.get(&9), Some(true));
        std::thread::sleep(Duration::from_millis(60));
        assert_eq!(c.get(&9), None);
    }
}
