//! A fault-injecting HTTPS proxy in front of a real kube-apiserver: the faults a real server will not produce on demand, switched by the test while
//! the agent runs.
//!
//! The agent gets a kubeconfig whose server is the proxy (its own certificate, made at test time
//! with the `openssl` command, which `scripts/start-control-plane.sh` needs too) and whose
//! credentials are the agent's own: the proxy passes every header through, the bearer token
//! among them, so the real server still authenticates and authorises the agent. Every request is
//! forwarded, watch streams and chunked bodies included, over a connection to the upstream server
//! of its own (one per agent connection, so cutting one cuts the other), unless a fault rule
//! matches it:
//!
//! - an error status with a Status body as the API server writes it ([`FaultProxy::fail_next`],
//!   [`FaultProxy::conflict_next`]; 429 with `Retry-After`);
//! - the connection closed without an answer ([`FaultProxy::drop_next`]);
//! - the request held unanswered until [`FaultProxy::release_held`] ([`FaultProxy::hold`]);
//! - an outage ([`FaultProxy::set_down`], [`FaultProxy::down_for`]): every open connection
//!   (watches included) is cut and every new one reset at once.
//!
//! Every request is logged with the status it was answered ([`FaultProxy::request_log`]).
//!
//! What it cannot do: make the upstream server itself misbehave (a write applied whose answer is
//! lost is [`FaultProxy::drop_next`] before the write, never after it), or slow the server's own
//! work; and the test's own client goes to the server directly, so only the agent meets faults.
//!
//! Included by path from `tests/e2e/harness.rs`.
#![allow(dead_code)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use serde_json::{Value, json};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, watch};

/// What a request is about, as the API server's request-info resolver sees its path.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestInfo {
    /// get, list, watch, create, update, patch, delete, deletecollection; for non-resource
    /// paths (discovery, `/version`) the lowercase HTTP method.
    pub verb: String,
    /// API group ("" for core), None for non-resource paths.
    pub group: Option<String>,
    pub resource: Option<String>,
    pub subresource: Option<String>,
    pub namespace: Option<String>,
    pub name: Option<String>,
}

/// Verbs that write.
pub const WRITE_VERBS: &[&str] = &["create", "update", "patch", "delete", "deletecollection"];

impl RequestInfo {
    /// From the method, path and query of a request, as the API server resolves them:
    /// `/api/v1/...` or `/apis/<group>/<version>/...`, then `[namespaces/<ns>/]<resource>
    /// [/<name>[/<subresource>]]`.
    pub fn of(method: &str, path: &str, query: &str) -> RequestInfo {
        let segments: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
        let (group, rest): (&str, &[&str]) = match segments.as_slice() {
            ["api", _version, rest @ ..] => ("", rest),
            ["apis", group, _version, rest @ ..] => (group, rest),
            _ => ("", &[]),
        };
        // `namespaces/<ns>` alone is the Namespace object itself.
        let (namespace, rest) = match rest {
            ["namespaces", ns, rest @ ..] if !rest.is_empty() => (Some(*ns), rest),
            rest => (None, rest),
        };
        let Some(resource) = rest.first() else {
            return RequestInfo {
                verb: method.to_lowercase(),
                ..Default::default()
            };
        };
        let name = rest.get(1).map(|s| s.to_string());
        let watch = query
            .split('&')
            .any(|p| p == "watch=true" || p == "watch=1");
        let verb = match method {
            "GET" if name.is_some() => "get",
            "GET" if watch => "watch",
            "GET" => "list",
            "POST" => "create",
            "PUT" => "update",
            "PATCH" => "patch",
            "DELETE" if name.is_some() => "delete",
            "DELETE" => "deletecollection",
            other => return RequestInfo::of_other(other),
        };
        RequestInfo {
            verb: verb.to_string(),
            group: Some(group.to_string()),
            resource: Some(resource.to_string()),
            subresource: rest.get(2).map(|s| s.to_string()),
            namespace: namespace.map(str::to_string),
            name,
        }
    }

    fn of_other(method: &str) -> RequestInfo {
        RequestInfo {
            verb: method.to_lowercase(),
            ..Default::default()
        }
    }
}

/// Selects requests for faults and counts. Built with the chained methods; an unset criterion
/// matches anything.
#[derive(Debug, Clone, Default)]
pub struct RequestMatch {
    verbs: Option<Vec<String>>,
    resource: Option<String>,
    subresource: Option<Option<String>>,
    namespace: Option<String>,
    name: Option<String>,
    path_contains: Option<String>,
}

impl RequestMatch {
    /// Every request (discovery and other non-resource paths too).
    pub fn any() -> Self {
        Self::default()
    }

    /// Only this verb (may be called several times: any of them).
    pub fn verb(mut self, verb: &str) -> Self {
        self.verbs
            .get_or_insert_with(Vec::new)
            .push(verb.to_string());
        self
    }

    /// Only writes: create, update, patch, delete, deletecollection.
    pub fn writes(mut self) -> Self {
        self.verbs = Some(WRITE_VERBS.iter().map(|s| s.to_string()).collect());
        self
    }

    /// Only this resource (plural, e.g. `podvolumebackups`).
    pub fn resource(mut self, plural: &str) -> Self {
        self.resource = Some(plural.to_string());
        self
    }

    /// Only this subresource; `None` means the main resource only.
    pub fn subresource(mut self, sub: Option<&str>) -> Self {
        self.subresource = Some(sub.map(str::to_string));
        self
    }

    pub fn namespace(mut self, ns: &str) -> Self {
        self.namespace = Some(ns.to_string());
        self
    }

    pub fn name(mut self, name: &str) -> Self {
        self.name = Some(name.to_string());
        self
    }

    /// Only requests whose path holds `s`.
    pub fn path_contains(mut self, s: &str) -> Self {
        self.path_contains = Some(s.to_string());
        self
    }

    pub fn matches(&self, path: &str, info: &RequestInfo) -> bool {
        let same = |want: &Option<String>, got: &Option<String>| {
            want.as_ref().is_none_or(|w| got.as_ref() == Some(w))
        };
        self.verbs.as_ref().is_none_or(|v| v.contains(&info.verb))
            && same(&self.resource, &info.resource)
            && self
                .subresource
                .as_ref()
                .is_none_or(|s| *s == info.subresource)
            && same(&self.namespace, &info.namespace)
            && same(&self.name, &info.name)
            && self
                .path_contains
                .as_ref()
                .is_none_or(|s| path.contains(s.as_str()))
    }
}

/// One request as the proxy saw it.
#[derive(Debug, Clone)]
pub struct RequestRecord {
    pub method: String,
    pub path: String,
    pub query: String,
    pub info: RequestInfo,
    /// The status answered (for a watch: of the response head, whatever the stream did after);
    /// 0 when the connection was closed without an answer (a drop fault, an outage, a held
    /// request cut, the upstream server unreachable).
    pub status: u16,
    /// The answer was the proxy's fault, not the server's.
    pub injected: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Action {
    /// Answer this status with a Status object, without forwarding.
    Status(u16),
    /// Close the connection without answering.
    Drop,
    /// Hold the request until released, then forward it.
    Hold,
}

#[derive(Debug, Clone)]
struct Rule {
    matcher: RequestMatch,
    action: Action,
    /// Fires this many more times (None: until `until` or cleared).
    remaining: Option<u32>,
    until: Option<Instant>,
}

/// Where the proxy forwards to.
struct Upstream {
    host: String,
    port: u16,
    tls: (tokio_rustls::TlsConnector, ServerName<'static>),
}

struct Shared {
    upstream: Upstream,
    acceptor: tokio_rustls::TlsAcceptor,
    rules: Mutex<Vec<Rule>>,
    log: Mutex<Vec<RequestRecord>>,
    /// true while the server is "down".
    down: watch::Sender<bool>,
    /// Counts [`FaultProxy::set_down`] calls, so a timed outage ends only its own window.
    down_epoch: AtomicU64,
    /// Bumped to let every held request go on.
    release: watch::Sender<u64>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A running proxy; dropping it stops it and cuts its connections.
pub struct FaultProxy {
    shared: Arc<Shared>,
    addr: SocketAddr,
    kubeconfig: PathBuf,
    accept_task: tokio::task::JoinHandle<()>,
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.accept_task.abort();
        self.shared.down.send_replace(true);
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("reading kubeconfig {0}: {1}")]
    Kubeconfig(PathBuf, String),
    #[error("making the proxy's certificate with openssl: {0}")]
    Certificate(String),
    #[error("TLS setup: {0}")]
    Tls(#[from] rustls::Error),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

impl FaultProxy {
    /// Starts a proxy in front of the server of `kubeconfig` (its current context), with its
    /// certificate and its own kubeconfig in `dir`: `kubeconfig` with the server and CA replaced
    /// by the proxy's, the credentials kept.
    pub async fn start(kubeconfig: &Path, dir: &Path) -> Result<FaultProxy, ProxyError> {
        let bad = |e: String| ProxyError::Kubeconfig(kubeconfig.to_path_buf(), e);
        let kc = kube::config::Kubeconfig::read_from(kubeconfig).map_err(|e| bad(e.to_string()))?;
        let config = kube::Config::from_custom_kubeconfig(kc, &Default::default())
            .await
            .map_err(|e| bad(e.to_string()))?;
        let upstream = upstream(&config).map_err(bad)?;

        let pki = dir.join("fault-proxy");
        std::fs::create_dir_all(&pki)?;
        make_certificate(&pki)?;
        let certs = CertificateDer::pem_file_iter(pki.join("tls.crt"))
            .and_then(|i| i.collect::<Result<Vec<_>, _>>())
            .map_err(|e| ProxyError::Certificate(e.to_string()))?;
        let key = PrivateKeyDer::from_pem_file(pki.join("tls.key"))
            .map_err(|e| ProxyError::Certificate(e.to_string()))?;
        let mut server = rustls::ServerConfig::builder_with_provider(
            rustls::crypto::ring::default_provider().into(),
        )
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(certs, key)?;
        // HTTP/1.1 only: a watch is then one connection, which an outage can cut alone.
        server.alpn_protocols = vec![b"http/1.1".to_vec()];

        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let proxy_kubeconfig = dir.join("via-fault-proxy.kubeconfig");
        write_kubeconfig(kubeconfig, &proxy_kubeconfig, addr, &pki.join("ca.crt")).map_err(bad)?;

        let shared = Arc::new(Shared {
            upstream,
            acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(server)),
            rules: Mutex::new(Vec::new()),
            log: Mutex::new(Vec::new()),
            down: watch::Sender::new(false),
            down_epoch: AtomicU64::new(0),
            release: watch::Sender::new(0),
        });
        let accept_task = tokio::spawn(accept_loop(listener, shared.clone()));
        Ok(FaultProxy {
            shared,
            addr,
            kubeconfig: proxy_kubeconfig,
            accept_task,
        })
    }

    /// The kubeconfig that reaches the server through the proxy.
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    fn add_rule(
        &self,
        matcher: RequestMatch,
        action: Action,
        remaining: Option<u32>,
        window: Option<Duration>,
    ) {
        lock(&self.shared.rules).push(Rule {
            matcher,
            action,
            remaining,
            until: window.map(|w| Instant::now() + w),
        });
    }

    /// Answer `code` (409, 429, 500, 503, ...) with a Status object to the next `n` matching
    /// requests, which never reach the server. A 429 says `Retry-After: 1`.
    pub fn fail_next(&self, m: RequestMatch, n: u32, code: u16) {
        self.add_rule(m, Action::Status(code), Some(n), None);
    }

    /// Answer `code` to every matching request during `window`.
    pub fn fail_for(&self, m: RequestMatch, window: Duration, code: u16) {
        self.add_rule(m, Action::Status(code), None, Some(window));
    }

    /// Answer 409 Conflict to the next `n` matching writes (every write verb when `m` names
    /// none), as the server does to a write carrying a stale resourceVersion.
    pub fn conflict_next(&self, m: RequestMatch, n: u32) {
        let m = if m.verbs.is_some() { m } else { m.writes() };
        self.fail_next(m, n, 409);
    }

    /// Close the connection without answering the next `n` matching requests (which never
    /// reach the server).
    pub fn drop_next(&self, m: RequestMatch, n: u32) {
        self.add_rule(m, Action::Drop, Some(n), None);
    }

    /// Hold every matching request unanswered until [`release_held`](Self::release_held) (or
    /// [`clear_faults`](Self::clear_faults)), then forward it.
    pub fn hold(&self, m: RequestMatch) {
        self.add_rule(m, Action::Hold, None, None);
    }

    /// Lets the held requests go on to the server, and ends the hold rules.
    pub fn release_held(&self) {
        lock(&self.shared.rules).retain(|r| r.action != Action::Hold);
        self.shared.release.send_modify(|n| *n += 1);
    }

    /// Removes every rule, lets held requests go on and ends an outage.
    pub fn clear_faults(&self) {
        self.release_held();
        lock(&self.shared.rules).clear();
        self.set_down(false);
    }

    /// An outage: every open connection is cut (watches included) and every new one reset,
    /// until set back to false.
    pub fn set_down(&self, down: bool) {
        self.shared.down_epoch.fetch_add(1, Ordering::SeqCst);
        self.shared.down.send_replace(down);
    }

    /// An outage of `window` (needs a Tokio runtime).
    pub fn down_for(&self, window: Duration) {
        let epoch = self.shared.down_epoch.fetch_add(1, Ordering::SeqCst) + 1;
        self.shared.down.send_replace(true);
        let shared = self.shared.clone();
        tokio::spawn(async move {
            tokio::time::sleep(window).await;
            if shared.down_epoch.load(Ordering::SeqCst) == epoch {
                shared.down.send_replace(false);
            }
        });
    }

    /// Every request so far, oldest first (by when it was answered).
    pub fn request_log(&self) -> Vec<RequestRecord> {
        lock(&self.shared.log).clone()
    }

    /// How many logged requests `m` matches.
    pub fn request_count(&self, m: &RequestMatch) -> usize {
        lock(&self.shared.log)
            .iter()
            .filter(|r| m.matches(&r.path, &r.info))
            .count()
    }
}

/// Host, port and TLS of the kubeconfig's server.
fn upstream(config: &kube::Config) -> Result<Upstream, String> {
    let url = &config.cluster_url;
    let host = url.host().ok_or("the server URL has no host")?;
    // An IPv6 literal comes bracketed.
    let host = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_string();
    if url.scheme_str() != Some("https") {
        return Err(format!("{url}: not an https server"));
    }
    let port = url.port_u16().unwrap_or(443);
    let mut roots = rustls::RootCertStore::empty();
    let ders: Vec<CertificateDer<'static>> = match (&config.root_cert, &config.root_cert_file) {
        (Some(ders), _) => ders
            .iter()
            .map(|d| CertificateDer::from(d.clone()))
            .collect(),
        (None, Some(file)) => CertificateDer::pem_file_iter(file)
            .and_then(|i| i.collect())
            .map_err(|e| format!("{}: {e}", file.display()))?,
        (None, None) => return Err("an https server without a CA".to_string()),
    };
    for der in ders {
        roots.add(der).map_err(|e| e.to_string())?;
    }
    let client = rustls::ClientConfig::builder_with_provider(
        rustls::crypto::ring::default_provider().into(),
    )
    .with_safe_default_protocol_versions()
    .map_err(|e| e.to_string())?
    .with_root_certificates(roots)
    .with_no_client_auth();
    let name = config
        .tls_server_name
        .clone()
        .unwrap_or_else(|| host.clone());
    let name = ServerName::try_from(name).map_err(|e| e.to_string())?;
    Ok(Upstream {
        host,
        port,
        tls: (tokio_rustls::TlsConnector::from(Arc::new(client)), name),
    })
}

/// A CA and a serving certificate for 127.0.0.1 signed by it (rustls refuses a CA certificate
/// as a server's own), with `openssl`; EC keys, quick to make.
fn make_certificate(dir: &Path) -> Result<(), ProxyError> {
    // Each argument is one word: the command lines read as typed in a shell.
    let run = |args: &str| -> Result<(), ProxyError> {
        let out = std::process::Command::new("openssl")
            .args(args.split_whitespace())
            .current_dir(dir)
            .output()
            .map_err(|e| ProxyError::Certificate(format!("running openssl: {e}")))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(ProxyError::Certificate(format!(
                "openssl {args}: {}",
                String::from_utf8_lossy(&out.stderr)
            )))
        }
    };
    let ec = "-newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes";
    run(&format!(
        "req -x509 {ec} -keyout ca.key -out ca.crt -days 2 -subj /CN=podvolume-fault-proxy-ca \
         -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign"
    ))?;
    run(&format!(
        "req -new {ec} -keyout tls.key -out tls.csr -subj /CN=podvolume-fault-proxy"
    ))?;
    std::fs::write(
        dir.join("tls.ext"),
        "subjectAltName=IP:127.0.0.1\nbasicConstraints=critical,CA:FALSE\n\
         keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n",
    )?;
    run(
        "x509 -req -in tls.csr -CA ca.crt -CAkey ca.key -set_serial 1 -days 2 \
         -extfile tls.ext -out tls.crt",
    )
}

/// `from` with its current context's cluster pointed at the proxy: server and CA replaced,
/// everything else (the user's token above all) kept.
fn write_kubeconfig(from: &Path, to: &Path, addr: SocketAddr, ca: &Path) -> Result<(), String> {
    let text = std::fs::read_to_string(from).map_err(|e| e.to_string())?;
    let mut kc: Value = serde_norway::from_str(&text).map_err(|e| e.to_string())?;
    let current = kc["current-context"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let cluster_name = kc["contexts"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["name"] == current.as_str()))
        .map(|c| c["context"]["cluster"].clone())
        .ok_or("no current context")?;
    let cluster = kc["clusters"]
        .as_array_mut()
        .and_then(|cs| cs.iter_mut().find(|c| c["name"] == cluster_name))
        .and_then(|c| c["cluster"].as_object_mut())
        .ok_or("the current context names no cluster")?;
    for key in [
        "certificate-authority-data",
        "tls-server-name",
        "insecure-skip-tls-verify",
    ] {
        cluster.remove(key);
    }
    cluster.insert("server".into(), json!(format!("https://{addr}")));
    cluster.insert("certificate-authority".into(), json!(ca));
    std::fs::write(to, serde_norway::to_string(&kc).map_err(|e| e.to_string())?)
        .map_err(|e| e.to_string())?;
    // It carries the token: readable by its owner only.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(to, std::fs::Permissions::from_mode(0o600)).map_err(|e| e.to_string())
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        let Ok((tcp, _)) = listener.accept().await else {
            continue;
        };
        if *shared.down.borrow() {
            // Reset, not a clean close: what a client meets when the server's host is gone.
            let _ = tcp.set_zero_linger();
            drop(tcp);
            continue;
        }
        tokio::spawn(serve_connection(tcp, shared.clone()));
    }
}

/// Anything a connection can run over: TCP, or TLS over TCP.
trait Stream: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Stream for T {}

async fn connect_upstream(up: &Upstream) -> std::io::Result<Box<dyn Stream>> {
    let tcp = TcpStream::connect((up.host.as_str(), up.port)).await?;
    tcp.set_nodelay(true)?;
    let (connector, name) = &up.tls;
    Ok(Box::new(connector.connect(name.clone(), tcp).await?))
}

/// One agent connection: TLS, then HTTP/1.1 requests forwarded over one upstream connection.
/// Ends, cutting both, when either side closes, on an outage, or when a request is dropped.
async fn serve_connection(tcp: TcpStream, shared: Arc<Shared>) {
    let _ = tcp.set_nodelay(true);
    let mut down = shared.down.subscribe();
    let Ok(Ok(tls)) =
        tokio::time::timeout(Duration::from_secs(10), shared.acceptor.accept(tcp)).await
    else {
        return;
    };
    let upstream = tokio::select! {
        u = connect_upstream(&shared.upstream) => u,
        _ = down.wait_for(|d| *d) => return,
    };
    let (sender, upstream_conn) = match upstream {
        Ok(io) => match hyper::client::conn::http1::handshake(TokioIo::new(io)).await {
            Ok(pair) => pair,
            Err(_) => return,
        },
        // The agent sees its connection closed, as it would with the server gone.
        Err(_) => return,
    };
    let sender = Arc::new(tokio::sync::Mutex::new(sender));
    let kill = Arc::new(Notify::new());
    let svc = {
        let shared = shared.clone();
        let kill = kill.clone();
        hyper::service::service_fn(move |req| {
            handle(shared.clone(), sender.clone(), kill.clone(), req)
        })
    };
    let conn = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(tls), svc);
    tokio::select! {
        _ = conn => {}
        _ = upstream_conn => {}
        _ = kill.notified() => {}
        _ = down.wait_for(|d| *d) => {}
    }
}

type Body = BoxBody<Bytes, hyper::Error>;

fn full(body: Vec<u8>) -> Body {
    Full::new(Bytes::from(body))
        .map_err(|never: Infallible| match never {})
        .boxed()
}

/// Headers of one hop, not to be passed on (hyper frames the bodies itself).
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

fn strip_hop_by_hop(h: &mut hyper::HeaderMap) {
    for name in HOP_BY_HOP {
        h.remove(*name);
    }
}

async fn handle(
    shared: Arc<Shared>,
    sender: Arc<tokio::sync::Mutex<SendRequest<Incoming>>>,
    kill: Arc<Notify>,
    mut req: Request<Incoming>,
) -> Result<Response<Body>, Infallible> {
    let method = req.method().as_str().to_string();
    let path = req.uri().path().to_string();
    let query = req.uri().query().unwrap_or("").to_string();
    let info = RequestInfo::of(&method, &path, &query);
    let mut record = RequestRecord {
        method,
        path,
        query,
        info,
        status: 0,
        injected: false,
    };
    let action = {
        let now = Instant::now();
        let mut rules = lock(&shared.rules);
        rules.retain(|r| r.until.is_none_or(|u| u > now) && r.remaining != Some(0));
        let rule = rules
            .iter_mut()
            .find(|r| r.matcher.matches(&record.path, &record.info));
        rule.map(|r| {
            if let Some(n) = r.remaining.as_mut() {
                *n -= 1;
            }
            r.action
        })
    };
    match action {
        Some(Action::Status(code)) => {
            record.status = code;
            record.injected = true;
            let response = status_response(code, &record.info);
            lock(&shared.log).push(record);
            return Ok(response);
        }
        Some(Action::Drop) => {
            record.injected = true;
            lock(&shared.log).push(record);
            kill.notify_one();
            // The connection task ends, dropping this future.
            std::future::pending::<()>().await;
            unreachable!("the connection task drops this future");
        }
        Some(Action::Hold) => {
            let mut release = shared.release.subscribe();
            let _ = release.changed().await;
        }
        None => {}
    }
    strip_hop_by_hop(req.headers_mut());
    let answer = {
        let mut sender = sender.lock().await;
        match sender.ready().await {
            Ok(()) => sender.send_request(req).await,
            Err(e) => Err(e),
        }
    };
    match answer {
        Ok(mut response) => {
            record.status = response.status().as_u16();
            lock(&shared.log).push(record);
            strip_hop_by_hop(response.headers_mut());
            Ok(response.map(|b| b.boxed()))
        }
        Err(_) => {
            // The upstream connection broke: the agent's breaks too, as it would without the
            // proxy.
            lock(&shared.log).push(record);
            kill.notify_one();
            std::future::pending::<()>().await;
            unreachable!("the connection task drops this future");
        }
    }
}

/// An error answer as the API server writes it: a `Status` object with the reason its clients
/// (kube-rs among them) act on.
fn status_response(code: u16, info: &RequestInfo) -> Response<Body> {
    let resource = info.resource.clone().unwrap_or_default();
    let group = info.group.clone().unwrap_or_default();
    let name = info.name.clone().unwrap_or_default();
    let qualified = if group.is_empty() {
        resource.clone()
    } else {
        format!("{resource}.{group}")
    };
    let (reason, message) = match code {
        409 => (
            "Conflict",
            format!(
                "Operation cannot be fulfilled on {qualified} \"{name}\": the object has been modified; please apply your changes to the latest version and try again"
            ),
        ),
        429 => (
            "TooManyRequests",
            "Too many requests, please try again later.".to_string(),
        ),
        500 => (
            "InternalError",
            "Internal error occurred: injected by the fault proxy".to_string(),
        ),
        503 => (
            "ServiceUnavailable",
            "the server is currently unable to handle the request".to_string(),
        ),
        504 => (
            "Timeout",
            "the server was unable to return a response in the time allotted".to_string(),
        ),
        _ => ("", format!("injected by the fault proxy: status {code}")),
    };
    let mut details = json!({"name": name, "group": group, "kind": resource});
    if code == 429 {
        details["retryAfterSeconds"] = json!(1);
    }
    let body = json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {},
        "status": "Failure", "message": message, "reason": reason,
        "details": details, "code": code,
    });
    let mut response = Response::new(full(serde_json::to_vec(&body).unwrap_or_default()));
    *response.status_mut() =
        StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let headers = response.headers_mut();
    headers.insert("content-type", "application/json".parse().unwrap());
    if code == 429 {
        headers.insert("retry-after", "1".parse().unwrap());
    }
    response
}

#[test]
fn request_info_resolves_paths_as_the_api_server_does() {
    let pvb = RequestInfo::of(
        "PATCH",
        "/apis/velero.io/v1/namespaces/velero/podvolumebackups/pvb-1",
        "",
    );
    assert_eq!(
        pvb,
        RequestInfo {
            verb: "patch".into(),
            group: Some("velero.io".into()),
            resource: Some("podvolumebackups".into()),
            subresource: None,
            namespace: Some("velero".into()),
            name: Some("pvb-1".into()),
        }
    );
    let status = RequestInfo::of(
        "PUT",
        "/apis/velero.io/v1/namespaces/velero/podvolumebackups/pvb-1/status",
        "",
    );
    assert_eq!(status.subresource.as_deref(), Some("status"));
    let watch = RequestInfo::of("GET", "/api/v1/namespaces/app/pods", "watch=true&x=1");
    assert_eq!(
        (watch.verb.as_str(), watch.group.as_deref()),
        ("watch", Some(""))
    );
    assert_eq!(RequestInfo::of("GET", "/api/v1/pods", "").verb, "list");
    let ns = RequestInfo::of("GET", "/api/v1/namespaces/app", "");
    assert_eq!(
        (
            ns.verb.as_str(),
            ns.resource.as_deref(),
            ns.name.as_deref(),
            ns.namespace
        ),
        ("get", Some("namespaces"), Some("app"), None)
    );
    let discovery = RequestInfo::of("GET", "/apis/velero.io/v1", "");
    assert_eq!((discovery.verb.as_str(), discovery.resource), ("get", None));
    let m = RequestMatch::any()
        .verb("patch")
        .resource("podvolumebackups")
        .name("pvb-1");
    assert!(m.matches(
        "/apis/velero.io/v1/namespaces/velero/podvolumebackups/pvb-1",
        &pvb
    ));
    assert!(!m.clone().subresource(Some("status")).matches("", &pvb));
    assert!(!m.matches("", &status), "a PUT is an update, not a patch");
}
