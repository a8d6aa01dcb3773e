//! HTTP serving: accept loop, connection-level faults, routing and the request handlers.

use crate::auth::AuthConfig;
use crate::discovery;
use crate::error::ApiError;
use crate::faults::{FaultAction, Faults, RequestInfo, RequestRecord};
use crate::managed::{Operation, Writer, manager_name};
use crate::patch::{JsonPatchError, json_patch, merge_patch};
use crate::resources::ResourceInfo;
use crate::selectors::{FieldSelector, LabelSelector};
use crate::store::{EventType, HistoryEvent, Store, WriteMode};
use bytes::Bytes;
use http_body_util::{BodyExt, Full, combinators::BoxBody};
use hyper::body::{Frame, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::{Notify, mpsc, watch};

pub(crate) type Body = BoxBody<Bytes, Infallible>;

/// State shared by the accept loop, every connection and the test's handle.
pub(crate) struct Shared {
    pub store: Mutex<Store>,
    pub faults: Mutex<Faults>,
    pub log: Mutex<Vec<RequestRecord>>,
    pub auth: Mutex<AuthConfig>,
    /// true while the server is "down": connections are closed at once.
    pub down: watch::Sender<bool>,
    pub down_epoch: AtomicU64,
    /// Bumped to end every open watch stream (as if their timeout expired).
    pub close_watches: watch::Sender<u64>,
    pub bookmark_interval: Mutex<Duration>,
    pub version: (String, String),
    pub addr: SocketAddr,
}

/// Lock a mutex, ignoring poisoning (a panicking test thread must not wedge the server).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Streaming response body fed by a channel (watch).
struct ChannelBody(mpsc::Receiver<Bytes>);

impl hyper::body::Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.get_mut()
            .0
            .poll_recv(cx)
            .map(|o| o.map(|b| Ok(Frame::data(b))))
    }
}

fn json_response(code: u16, value: &Value) -> Response<Body> {
    let body = serde_json::to_vec(value).unwrap_or_default();
    Response::builder()
        .status(StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)).boxed())
        .expect("valid response")
}

fn error_response(e: &ApiError) -> Response<Body> {
    json_response(e.code, &e.to_status())
}

/// Run the accept loop until the task is aborted.
pub(crate) async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        if *shared.down.borrow() {
            drop(stream);
            continue;
        }
        let shared = shared.clone();
        tokio::spawn(async move {
            let kill = Arc::new(Notify::new());
            let svc = {
                let shared = shared.clone();
                let kill = kill.clone();
                hyper::service::service_fn(move |req| handle(shared.clone(), kill.clone(), req))
            };
            let conn = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc);
            let mut down_rx = shared.down.subscribe();
            tokio::select! {
                _ = conn => {}
                _ = kill.notified() => {}
                _ = down_rx.wait_for(|d| *d) => {}
            }
        });
    }
}

/// Where a request goes.
#[derive(Debug, Clone, PartialEq)]
enum Route {
    Version,
    Health,
    CoreVersions,
    Groups,
    Group(String),
    ResourceList(String, String),
    Resource {
        group: String,
        version: String,
        namespace: Option<String>,
        plural: String,
        name: Option<String>,
        sub: Option<String>,
    },
    Unknown,
}

fn parse_route(path: &str) -> Route {
    let segs: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    let (group, version, rest) = match segs.as_slice() {
        ["version"] => return Route::Version,
        ["healthz" | "livez" | "readyz", ..] => return Route::Health,
        ["api"] => return Route::CoreVersions,
        ["api", v] => return Route::ResourceList(String::new(), v.to_string()),
        ["api", v, rest @ ..] => ("", *v, rest),
        ["apis"] => return Route::Groups,
        ["apis", g] => return Route::Group(g.to_string()),
        ["apis", g, v] => return Route::ResourceList(g.to_string(), v.to_string()),
        ["apis", g, v, rest @ ..] => (*g, *v, rest),
        _ => return Route::Unknown,
    };
    let (namespace, rest) = match rest {
        ["namespaces", ns, next, tail @ ..] if *next != "status" && *next != "finalize" => {
            let mut r = vec![*next];
            r.extend_from_slice(tail);
            (Some(ns.to_string()), r)
        }
        _ => (None, rest.to_vec()),
    };
    let (plural, name, sub) = match rest.as_slice() {
        [p] => (p.to_string(), None, None),
        [p, n] => (p.to_string(), Some(n.to_string()), None),
        [p, n, s] => (p.to_string(), Some(n.to_string()), Some(s.to_string())),
        _ => return Route::Unknown,
    };
    Route::Resource {
        group: group.to_string(),
        version: version.to_string(),
        namespace,
        plural,
        name,
        sub,
    }
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3])
                    .ok()
                    .and_then(|h| u8::from_str_radix(h, 16).ok());
                match hex {
                    Some(b) => {
                        out.push(b);
                        i += 2;
                    }
                    None => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn parse_query(q: &str) -> HashMap<String, String> {
    q.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| match p.split_once('=') {
            Some((k, v)) => (percent_decode(k), percent_decode(v)),
            None => (percent_decode(p), String::new()),
        })
        .collect()
}

fn is_true(q: &HashMap<String, String>, key: &str) -> bool {
    matches!(q.get(key).map(String::as_str), Some("true" | "1"))
}

fn request_info(method: &Method, route: &Route, q: &HashMap<String, String>) -> RequestInfo {
    match route {
        Route::Resource {
            group,
            namespace,
            plural,
            name,
            sub,
            ..
        } => {
            let verb = match *method {
                Method::GET if name.is_some() => "get",
                Method::GET if is_true(q, "watch") => "watch",
                Method::GET => "list",
                Method::POST => "create",
                Method::PUT => "update",
                Method::PATCH => "patch",
                Method::DELETE if name.is_some() => "delete",
                Method::DELETE => "deletecollection",
                _ => "unknown",
            };
            RequestInfo {
                verb: verb.to_string(),
                group: Some(group.clone()),
                resource: Some(plural.clone()),
                subresource: sub.clone(),
                namespace: namespace.clone(),
                name: name.clone(),
            }
        }
        _ => RequestInfo {
            verb: method.as_str().to_lowercase(),
            ..Default::default()
        },
    }
}

async fn handle(
    shared: Arc<Shared>,
    kill: Arc<Notify>,
    req: Request<Incoming>,
) -> Result<Response<Body>, Infallible> {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let query_raw = req.uri().query().unwrap_or("").to_string();
    let content_type = req
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let user_agent = req
        .headers()
        .get("user-agent")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let body = match req.into_body().collect().await {
        Ok(c) => c.to_bytes(),
        Err(_) => Bytes::new(),
    };
    let query = parse_query(&query_raw);
    let manager = manager_name(
        query.get("fieldManager").map(String::as_str),
        user_agent.as_deref(),
    );
    let route = parse_route(&path);
    let info = request_info(&method, &route, &query);
    let (delay, action) = lock(&shared.faults).evaluate(&info);
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    let mut record = RequestRecord {
        method: method.to_string(),
        path,
        query: query_raw,
        body_len: body.len(),
        body: body.clone(),
        info: info.clone(),
        status: 0,
    };
    let response = match action {
        Some(FaultAction::Drop) => {
            lock(&shared.log).push(record);
            kill.notify_one();
            std::future::pending::<()>().await;
            unreachable!("the connection task drops this future");
        }
        Some(FaultAction::Error(code)) => error_response(&ApiError::for_code(code)),
        Some(FaultAction::Conflict) if crate::faults::WRITE_VERBS.contains(&info.verb.as_str()) => {
            error_response(&ApiError::conflict(
                info.group.as_deref().unwrap_or(""),
                info.resource.as_deref().unwrap_or(""),
                info.name.as_deref().unwrap_or(""),
            ))
        }
        _ => {
            let req = ApiRequest {
                method: &method,
                info: &info,
                query: &query,
                content_type: &content_type,
                manager,
                body: &body,
            };
            match dispatch(&shared, route, &req) {
                Ok(r) => r,
                Err(e) => error_response(&e),
            }
        }
    };
    record.status = response.status().as_u16();
    lock(&shared.log).push(record);
    Ok(response)
}

/// What the handlers need of a request.
struct ApiRequest<'a> {
    method: &'a Method,
    info: &'a RequestInfo,
    query: &'a HashMap<String, String>,
    content_type: &'a str,
    /// The field manager of its writes (`fieldManager`, else the User-Agent's prefix).
    manager: String,
    body: &'a Bytes,
}

fn dispatch(
    shared: &Arc<Shared>,
    route: Route,
    req: &ApiRequest<'_>,
) -> Result<Response<Body>, ApiError> {
    if !matches!(route, Route::Resource { .. }) && *req.method != Method::GET {
        return Err(ApiError::method_not_allowed());
    }
    match route {
        Route::Version => Ok(json_response(
            200,
            &discovery::version_info(&shared.version.0, &shared.version.1),
        )),
        Route::Health => Ok(Response::builder()
            .status(200)
            .header("content-type", "text/plain")
            .body(Full::new(Bytes::from_static(b"ok")).boxed())
            .expect("valid response")),
        Route::CoreVersions => Ok(json_response(
            200,
            &discovery::api_versions(&shared.addr.to_string()),
        )),
        Route::Groups => Ok(json_response(
            200,
            &discovery::api_group_list(&lock(&shared.store).resources),
        )),
        Route::Group(g) => discovery::api_group(&lock(&shared.store).resources, &g)
            .map(|d| json_response(200, &d))
            .ok_or_else(ApiError::no_route),
        Route::ResourceList(g, v) => {
            discovery::api_resource_list(&lock(&shared.store).resources, &g, &v)
                .map(|d| json_response(200, &d))
                .ok_or_else(ApiError::no_route)
        }
        Route::Unknown => Err(ApiError::no_route()),
        Route::Resource {
            group,
            version,
            namespace,
            plural,
            name,
            sub,
        } => {
            let res = lock(&shared.store)
                .resource(&group, &plural)
                .filter(|r| r.version(&version).is_some())
                .cloned()
                .ok_or_else(ApiError::no_route)?;
            let rreq = ResourceRequest {
                res,
                version,
                namespace,
                name,
                sub,
            };
            rreq.serve(shared, req)
        }
    }
}

struct ResourceRequest {
    res: ResourceInfo,
    version: String,
    namespace: Option<String>,
    name: Option<String>,
    sub: Option<String>,
}

fn parse_json(body: &Bytes) -> Result<Value, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("error decoding request body: {e}")))
}

fn is_crd(res: &ResourceInfo) -> bool {
    res.group == "apiextensions.k8s.io" && res.plural == "customresourcedefinitions"
}

/// The status a CRD gets once "established".
fn crd_status(crd: &Value) -> Value {
    let now = crate::store::now_rfc3339();
    let names = crd.pointer("/spec/names").cloned().unwrap_or(json!({}));
    let stored: Vec<Value> = crd
        .pointer("/spec/versions")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter(|v| v.get("storage").and_then(Value::as_bool) == Some(true))
        .filter_map(|v| v.get("name").cloned())
        .collect();
    json!({
        "acceptedNames": names,
        "storedVersions": stored,
        "conditions": [
            {"type": "NamesAccepted", "status": "True", "reason": "NoConflicts", "message": "no conflicts found", "lastTransitionTime": now},
            {"type": "Established", "status": "True", "reason": "InitialNamesAccepted", "message": "the initial names have been accepted", "lastTransitionTime": now},
        ],
    })
}

/// Create or update a CRD object and (re)register the resource it defines. With a `writer`
/// (API writes, `put_json_as`) the write is recorded in managedFields, and the status the
/// server then sets as written by `kube-apiserver` through `/status`, as on a real server.
pub(crate) fn upsert_crd(
    store: &mut Store,
    crd: Value,
    mode: WriteMode,
    writer: Option<&Writer>,
) -> Result<Value, ApiError> {
    let crd_res = store
        .resource("apiextensions.k8s.io", "customresourcedefinitions")
        .cloned()
        .expect("CRD resource");
    let name = crd
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    let info = ResourceInfo::from_crd(&crd)
        .map_err(|e| ApiError::invalid(&crd_res.group, &crd_res.kind, &name, &e))?;
    let obj = match store.get(&crd_res, None, &name) {
        None => store.create(&crd_res, "v1", None, crd, mode, writer)?,
        Some(_) => store.update(&crd_res, "v1", None, &name, crd, mode, true, writer)?,
    };
    store.register(info);
    let mut with_status = obj.clone();
    with_status["status"] = crd_status(&obj);
    let status_writer = writer.map(|_| Writer::update("kube-apiserver", Some("status")));
    store.update(
        &crd_res,
        "v1",
        None,
        &name,
        with_status,
        WriteMode::Status,
        true,
        status_writer.as_ref(),
    )
}

fn output(mut obj: Value, res: &ResourceInfo, version: &str) -> Value {
    obj["apiVersion"] = json!(res.api_version(version));
    obj
}

impl ResourceRequest {
    fn ns(&self) -> Option<&str> {
        self.namespace.as_deref()
    }

    fn selectors(
        &self,
        query: &HashMap<String, String>,
    ) -> Result<(LabelSelector, FieldSelector), ApiError> {
        let label = LabelSelector::parse(query.get("labelSelector").map_or("", String::as_str))?;
        let field = FieldSelector::parse(
            query.get("fieldSelector").map_or("", String::as_str),
            &self.res.supported_fields(&self.version),
        )?;
        Ok((label, field))
    }

    /// The writer of an update/patch/create of this request (not server-side apply).
    fn writer(&self, req: &ApiRequest<'_>) -> Writer {
        Writer::update(&req.manager, self.sub.as_deref())
    }

    fn serve(self, shared: &Arc<Shared>, req: &ApiRequest<'_>) -> Result<Response<Body>, ApiError> {
        let (query, body) = (req.query, req.body);
        let res = &self.res;
        let verb = req.info.verb.as_str();
        if res.create_only && verb != "create" {
            return Err(ApiError::method_not_allowed());
        }
        if !res.namespaced && self.namespace.is_some() {
            return Err(ApiError::no_route());
        }
        let collection_verb = matches!(verb, "list" | "watch" | "deletecollection");
        if res.namespaced && self.namespace.is_none() && !collection_verb && !res.create_only {
            return Err(ApiError::no_route());
        }
        if let Some(sub) = &self.sub {
            let has_status = res
                .version(&self.version)
                .is_some_and(|v| v.status_subresource);
            if sub != "status" || !has_status {
                return Err(ApiError::no_route());
            }
            if !matches!(verb, "get" | "update" | "patch") {
                return Err(ApiError::method_not_allowed());
            }
        }
        match verb {
            "get" => {
                let name = self.name.as_deref().unwrap_or("");
                let obj = lock(&shared.store)
                    .get(res, self.ns(), name)
                    .ok_or_else(|| ApiError::not_found(&res.group, &res.plural, name))?;
                Ok(json_response(200, &output(obj, res, &self.version)))
            }
            "list" => {
                let (label, field) = self.selectors(query)?;
                let page = Page::from_query(query)?;
                let store = lock(&shared.store);
                let rv = page.after.as_ref().map_or(store.rv, |(rv, _)| *rv);
                // Objects come in key order (namespace, name), as from etcd, read from the
                // page's start on: a page costs what it holds.
                let after = page.after.as_ref().map(|(_, key)| {
                    let (ns, name) = key.split_once('/').unwrap_or(("", key.as_str()));
                    (ns.to_string(), name.to_string())
                });
                let mut matching = store
                    .list_after(
                        res,
                        self.ns(),
                        after.as_ref().map(|(a, b)| (a.as_str(), b.as_str())),
                    )
                    .filter(|o| label.matches(o) && field.matches(o));
                let items: Vec<Value> = matching
                    .by_ref()
                    .take(page.limit.unwrap_or(usize::MAX))
                    .cloned()
                    .map(|o| output(o, res, &self.version))
                    .collect();
                // A real server counts the rest only without selectors (etcd counts keys); with
                // them it only knows whether more may follow.
                let (more, remaining) = if label.is_empty() && field.is_empty() {
                    let n = matching.count();
                    (n > 0, Some(n))
                } else {
                    (matching.next().is_some(), None)
                };
                let mut metadata = json!({"resourceVersion": rv.to_string()});
                if more {
                    let last = items.last().map(object_key).unwrap_or_default();
                    metadata["continue"] = Value::String(continue_token(rv, &last));
                    if let Some(n) = remaining {
                        metadata["remainingItemCount"] = json!(n);
                    }
                }
                Ok(json_response(
                    200,
                    &json!({
                        "kind": res.list_kind,
                        "apiVersion": res.api_version(&self.version),
                        "metadata": metadata,
                        "items": items,
                    }),
                ))
            }
            "watch" => self.watch(shared, query),
            "create" => self.create(shared, req),
            "update" => {
                let obj = parse_json(body)?;
                let writer = self.writer(req);
                let name = self.name.as_deref().unwrap_or("");
                let mode = if self.sub.is_some() {
                    WriteMode::Status
                } else {
                    WriteMode::Main
                };
                let mut store = lock(&shared.store);
                let out = if is_crd(res) {
                    let mut obj = obj;
                    if store.get(res, None, name).is_none() {
                        return Err(ApiError::not_found(&res.group, &res.plural, name));
                    }
                    if mode == WriteMode::Status {
                        store.update(
                            res,
                            &self.version,
                            None,
                            name,
                            obj,
                            mode,
                            false,
                            Some(&writer),
                        )?
                    } else {
                        obj["metadata"]["name"] = json!(name);
                        upsert_crd(&mut store, obj, WriteMode::Main, Some(&writer))?
                    }
                } else {
                    store.update(
                        res,
                        &self.version,
                        self.ns(),
                        name,
                        obj,
                        mode,
                        false,
                        Some(&writer),
                    )?
                };
                Ok(json_response(200, &output(out, res, &self.version)))
            }
            "patch" => self.patch(shared, req),
            "delete" => {
                let options = if body.is_empty() {
                    Value::Null
                } else {
                    parse_json(body)?
                };
                let name = self.name.as_deref().unwrap_or("");
                let mut store = lock(&shared.store);
                let out = store.delete(res, self.ns(), name, &options)?;
                if is_crd(res)
                    && store.get(res, None, name).is_none()
                    && let Ok(info) = ResourceInfo::from_crd(&out)
                {
                    store.unregister(&info.group, &info.plural);
                }
                Ok(json_response(200, &output(out, res, &self.version)))
            }
            "deletecollection" => {
                let (label, field) = self.selectors(query)?;
                let mut store = lock(&shared.store);
                let victims: Vec<Value> = store
                    .list(res, self.ns())
                    .into_iter()
                    .filter(|o| label.matches(o) && field.matches(o))
                    .collect();
                let mut items = Vec::new();
                for v in victims {
                    let ns = v
                        .pointer("/metadata/namespace")
                        .and_then(Value::as_str)
                        .map(str::to_string);
                    let name = v
                        .pointer("/metadata/name")
                        .and_then(Value::as_str)
                        .unwrap_or("")
                        .to_string();
                    items.push(output(
                        store.delete(res, ns.as_deref(), &name, &Value::Null)?,
                        res,
                        &self.version,
                    ));
                }
                Ok(json_response(
                    200,
                    &json!({
                        "kind": res.list_kind,
                        "apiVersion": res.api_version(&self.version),
                        "metadata": {"resourceVersion": store.rv.to_string()},
                        "items": items,
                    }),
                ))
            }
            _ => Err(ApiError::method_not_allowed()),
        }
    }

    fn create(
        &self,
        shared: &Arc<Shared>,
        req: &ApiRequest<'_>,
    ) -> Result<Response<Body>, ApiError> {
        let res = &self.res;
        if self.name.is_some() {
            return Err(ApiError::method_not_allowed());
        }
        let obj = parse_json(req.body)?;
        let writer = self.writer(req);
        if res.create_only {
            let mut obj = output(obj, res, &self.version);
            obj["kind"] = json!(res.kind);
            let auth = lock(&shared.auth);
            let answer = match res.plural.as_str() {
                "tokenreviews" => auth.token_review(obj),
                _ => auth.subject_access_review(obj),
            };
            return Ok(json_response(201, &answer));
        }
        let mut store = lock(&shared.store);
        let out = if is_crd(res) {
            let name = obj
                .pointer("/metadata/name")
                .and_then(Value::as_str)
                .unwrap_or("");
            if store.get(res, None, name).is_some() {
                return Err(ApiError::already_exists(&res.group, &res.plural, name));
            }
            upsert_crd(&mut store, obj, WriteMode::Main, Some(&writer))?
        } else {
            store.create(
                res,
                &self.version,
                self.ns(),
                obj,
                WriteMode::Main,
                Some(&writer),
            )?
        };
        Ok(json_response(201, &output(out, res, &self.version)))
    }

    fn patch(
        &self,
        shared: &Arc<Shared>,
        req: &ApiRequest<'_>,
    ) -> Result<Response<Body>, ApiError> {
        let (query, content_type, body) = (req.query, req.content_type, req.body);
        let mut writer = self.writer(req);
        let res = &self.res;
        let name = self.name.as_deref().unwrap_or("");
        let media = content_type.split(';').next().unwrap_or("").trim();
        let mode = if self.sub.is_some() {
            WriteMode::Status
        } else {
            WriteMode::Main
        };
        let mut store = lock(&shared.store);
        let existing = store.get(res, self.ns(), name);
        let patched = match media {
            "application/merge-patch+json" | "application/strategic-merge-patch+json" => {
                if media.starts_with("application/strategic") && res.custom {
                    return Err(ApiError::unsupported_media_type(media));
                }
                let patch = parse_json(body)?;
                let mut obj =
                    existing.ok_or_else(|| ApiError::not_found(&res.group, &res.plural, name))?;
                merge_patch(&mut obj, &patch);
                obj
            }
            "application/json-patch+json" => {
                let patch = parse_json(body)?;
                let mut obj =
                    existing.ok_or_else(|| ApiError::not_found(&res.group, &res.plural, name))?;
                match json_patch(&mut obj, &patch) {
                    Ok(()) => obj,
                    Err(JsonPatchError::Decode(m)) => return Err(ApiError::bad_request(m)),
                    Err(JsonPatchError::Apply(m)) => return Err(ApiError::new(422, "Invalid", m)),
                }
            }
            "application/apply-patch+yaml" => {
                if query.get("fieldManager").is_none_or(|m| m.is_empty()) {
                    return Err(ApiError::invalid(
                        "meta.k8s.io",
                        "PatchOptions",
                        "",
                        "fieldManager: Required value: is required for apply patch",
                    ));
                }
                let text = std::str::from_utf8(body)
                    .map_err(|e| ApiError::bad_request(format!("error decoding YAML: {e}")))?;
                let patch: Value = serde_norway::from_str(text)
                    .map_err(|e| ApiError::bad_request(format!("error decoding YAML: {e}")))?;
                if !patch.is_object() {
                    return Err(ApiError::bad_request("error decoding YAML: not an object"));
                }
                match patch.pointer("/metadata/name").and_then(Value::as_str) {
                    Some(n) if n == name => {}
                    _ => {
                        return Err(ApiError::bad_request(format!(
                            "the name of the object does not match the name on the URL ({name})"
                        )));
                    }
                }
                if patch
                    .pointer("/metadata/managedFields")
                    .is_some_and(|m| !m.is_null())
                {
                    return Err(ApiError::bad_request("metadata.managedFields must be nil"));
                }
                writer.operation = Operation::Apply(patch.clone());
                match existing {
                    None => {
                        let out = if is_crd(res) {
                            upsert_crd(&mut store, patch, WriteMode::Main, Some(&writer))?
                        } else {
                            store.create(
                                res,
                                &self.version,
                                self.ns(),
                                patch,
                                WriteMode::Main,
                                Some(&writer),
                            )?
                        };
                        return Ok(json_response(201, &output(out, res, &self.version)));
                    }
                    Some(mut obj) => {
                        merge_patch(&mut obj, &patch);
                        obj
                    }
                }
            }
            other => return Err(ApiError::unsupported_media_type(other)),
        };
        let out = if is_crd(res) && mode == WriteMode::Main {
            upsert_crd(&mut store, patched, WriteMode::Main, Some(&writer))?
        } else {
            store.update(
                res,
                &self.version,
                self.ns(),
                name,
                patched,
                mode,
                true,
                Some(&writer),
            )?
        };
        Ok(json_response(200, &output(out, res, &self.version)))
    }

    fn watch(
        self,
        shared: &Arc<Shared>,
        query: &HashMap<String, String>,
    ) -> Result<Response<Body>, ApiError> {
        let (label, field) = self.selectors(query)?;
        let rv_param = query
            .get("resourceVersion")
            .filter(|s| !s.is_empty())
            .cloned();
        let send_initial = is_true(query, "sendInitialEvents");
        let bookmarks = is_true(query, "allowWatchBookmarks");
        let timeout = match query.get("timeoutSeconds") {
            Some(t) => Some(Duration::from_secs(t.parse().map_err(|_| {
                ApiError::bad_request(format!("invalid timeoutSeconds {t:?}"))
            })?)),
            None => None,
        };
        let start: Option<u64> = match rv_param.as_deref() {
            None | Some("0") => None,
            Some(s) => Some(s.parse().map_err(|_| {
                ApiError::invalid(
                    "meta.k8s.io",
                    "ListOptions",
                    "",
                    &format!("resourceVersion: Invalid value: {s:?}"),
                )
            })?),
        };
        let (tx, rx) = mpsc::channel::<Bytes>(256);
        let mut notify_rx;
        let mut initial = Vec::new();
        let last;
        {
            let store = lock(&shared.store);
            notify_rx = store.notify.subscribe();
            if send_initial || start.is_none() {
                initial = store
                    .list(&self.res, self.ns())
                    .into_iter()
                    .filter(|o| label.matches(o) && field.matches(o))
                    .collect();
                last = store.rv;
            } else {
                last = start.unwrap_or(0);
            }
        }
        let shared = shared.clone();
        let mut kill_rx = shared.close_watches.subscribe();
        let bookmark_interval = *lock(&shared.bookmark_interval);
        tokio::spawn(async move {
            let res = &self.res;
            let version = self.version.clone();
            let line = |etype: &str, obj: Value| -> Bytes {
                // `type` first, like the real server's encoder.
                let obj = serde_json::to_string(&obj).unwrap_or_default();
                Bytes::from(format!("{{\"type\":\"{etype}\",\"object\":{obj}}}\n"))
            };
            let bookmark = |rv: u64, initial_end: bool| -> Value {
                let mut meta = json!({"resourceVersion": rv.to_string()});
                if initial_end {
                    meta["annotations"] = json!({"k8s.io/initial-events-end": "true"});
                }
                json!({"kind": res.kind, "apiVersion": res.api_version(&version), "metadata": meta})
            };
            for obj in initial {
                if tx
                    .send(line("ADDED", output(obj, res, &version)))
                    .await
                    .is_err()
                {
                    return;
                }
            }
            let mut last = last;
            if send_initial
                && bookmarks
                && tx
                    .send(line("BOOKMARK", bookmark(last, true)))
                    .await
                    .is_err()
            {
                return;
            }
            let deadline = timeout.map(|t| tokio::time::Instant::now() + t);
            loop {
                let scan = {
                    let store = lock(&shared.store);
                    store.events_since(last).map(|evs| (evs, store.rv))
                };
                match scan {
                    Err(floor) => {
                        let err = ApiError::expired(format!(
                            "too old resource version: {last} ({floor})"
                        ));
                        let _ = tx.send(line("ERROR", err.to_status())).await;
                        return;
                    }
                    Ok((evs, current)) => {
                        for ev in evs {
                            if let Some((etype, obj)) = self.filter_event(&ev, &label, &field)
                                && tx
                                    .send(line(etype, output(obj, res, &version)))
                                    .await
                                    .is_err()
                            {
                                return;
                            }
                        }
                        last = current;
                    }
                }
                let sleep_deadline = async {
                    match deadline {
                        Some(d) => tokio::time::sleep_until(d).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    r = notify_rx.changed() => if r.is_err() { return },
                    _ = tokio::time::sleep(bookmark_interval), if bookmarks => {
                        if tx.send(line("BOOKMARK", bookmark(last, false))).await.is_err() {
                            return;
                        }
                    }
                    _ = sleep_deadline => return,
                    _ = tx.closed() => return,
                    _ = kill_rx.changed() => return,
                }
            }
        });
        Ok(Response::builder()
            .status(200)
            .header("content-type", "application/json")
            .body(ChannelBody(rx).boxed())
            .expect("valid response"))
    }

    /// How a stored event looks to this watch (selector transitions become ADDED/DELETED).
    fn filter_event(
        &self,
        ev: &HistoryEvent,
        label: &LabelSelector,
        field: &FieldSelector,
    ) -> Option<(&'static str, Value)> {
        if ev.group != self.res.group || ev.plural != self.res.plural {
            return None;
        }
        if self.res.namespaced && self.ns().is_some_and(|n| n != ev.namespace) {
            return None;
        }
        let m = |o: &Value| label.matches(o) && field.matches(o);
        let now = m(&ev.object);
        let etype = match ev.etype {
            EventType::Added | EventType::Deleted => now.then_some(ev.etype.as_str()),
            EventType::Modified => match (ev.prev.as_ref().is_some_and(m), now) {
                (true, true) => Some("MODIFIED"),
                (false, true) => Some("ADDED"),
                (true, false) => Some("DELETED"),
                (false, false) => None,
            },
        }?;
        Some((etype, ev.object.clone()))
    }
}

/// `limit`/`continue` of a list request. Pages are cut in key order like a real API server's;
/// unlike one (which serves every page from the snapshot at the first page's resourceVersion),
/// later pages show the objects as they are now, under the first page's resourceVersion.
struct Page {
    limit: Option<usize>,
    /// The first page's resourceVersion and the key of the last object served.
    after: Option<(u64, String)>,
}

impl Page {
    fn from_query(query: &HashMap<String, String>) -> Result<Page, ApiError> {
        let limit = match query.get("limit").map(String::as_str) {
            None | Some("") | Some("0") => None,
            Some(l) => Some(
                l.parse::<usize>()
                    .map_err(|_| ApiError::bad_request(format!("limit: Invalid value: {l:?}")))?,
            ),
        };
        let after =
            match query.get("continue").map(String::as_str) {
                None | Some("") => None,
                Some(token) => Some(parse_continue_token(token).ok_or_else(|| {
                    ApiError::bad_request("continue key is not valid".to_string())
                })?),
            };
        Ok(Page { limit, after })
    }
}

fn object_key(o: &Value) -> String {
    let m = |f: &str| {
        o.pointer(&format!("/metadata/{f}"))
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string()
    };
    format!("{}/{}", m("namespace"), m("name"))
}

/// Opaque to clients, as the real one: hex of `<rv>/<key>`.
fn continue_token(rv: u64, key: &str) -> String {
    format!("{rv}/{key}")
        .bytes()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn parse_continue_token(token: &str) -> Option<(u64, String)> {
    if !token.len().is_multiple_of(2) {
        return None;
    }
    let bytes: Option<Vec<u8>> = (0..token.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(token.get(i..i + 2)?, 16).ok())
        .collect();
    let text = String::from_utf8(bytes?).ok()?;
    let (rv, key) = text.split_once('/')?;
    Some((rv.parse().ok()?, key.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes() {
        assert_eq!(
            parse_route("/api/v1/namespaces/ns1/pods/p/status"),
            Route::Resource {
                group: String::new(),
                version: "v1".into(),
                namespace: Some("ns1".into()),
                plural: "pods".into(),
                name: Some("p".into()),
                sub: Some("status".into()),
            }
        );
        assert_eq!(
            parse_route("/api/v1/namespaces/ns1/status"),
            Route::Resource {
                group: String::new(),
                version: "v1".into(),
                namespace: None,
                plural: "namespaces".into(),
                name: Some("ns1".into()),
                sub: Some("status".into()),
            }
        );
        assert_eq!(
            parse_route("/apis/velero.io/v1"),
            Route::ResourceList("velero.io".into(), "v1".into())
        );
        assert_eq!(parse_query("a=b%3Dc&l=x+in+(a%2Cb)")["l"], "x in (a,b)");
        assert_eq!(parse_query("a=b%3Dc")["a"], "b=c");
    }
}
