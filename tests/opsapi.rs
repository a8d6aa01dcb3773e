//! The operations API, health and metrics over HTTP against the real agent binary and the API
//! stand-in (its TokenReview and SubjectAccessReview answer what each test configures), plus the
//! client subcommands. Tests that need the stand-in's review controls say so and skip against a
//! real cluster.

// The harness is shared with tests/e2e (owned there); its lints are not this file's.
#[allow(clippy::collapsible_if)]
#[path = "e2e/harness.rs"]
mod harness;

use std::path::PathBuf;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use harness::*;
use kube::ResourceExt;
use podvolume_agent::crd::{Phase, PodVolumeBackup};
use podvolume_testbed::{AccessRequest, RequestMatch, UserInfo};
use serde_json::Value;

const LONG: Duration = Duration::from_secs(120);

const ADMIN: &str = "admin-token-7f3a9c1e5b";
const READER: &str = "reader-token-2d8e4f6a0c";
const NOBODY: &str = "nobody-token-9b1c3e5d7f";
const BOGUS: &str = "bogus-token-4a6c8e0b2d";

/// One HTTP exchange with the agent: (status, headers, body).
async fn call(port: u16, method: &str, path: &str, token: Option<&str>) -> (u16, String, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let auth = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    s.write_all(
        format!(
            "{method} {path} HTTP/1.1\r\nHost: localhost\r\n{auth}Content-Length: 0\r\nConnection: close\r\n\r\n"
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await.unwrap();
    let text = String::from_utf8_lossy(&buf).to_string();
    let code = text.split_whitespace().nth(1).unwrap().parse().unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    (code, head.to_string(), body.to_string())
}

fn json(body: &str) -> Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"))
}

/// Checks a JSON error answer and returns its message.
fn error_of(code: u16, body: &str) -> String {
    let v = json(body);
    assert_eq!(v["code"], code, "{body}");
    assert!(v["reason"].is_string(), "{body}");
    v["message"].as_str().expect("message").to_string()
}

/// The test's users: admin may do anything, reader may get and list, nobody nothing. Every
/// SubjectAccessReview is recorded.
fn set_up_auth(env: &Env) -> Arc<Mutex<Vec<AccessRequest>>> {
    let s = env.standin().expect("stand-in");
    s.set_token(ADMIN, UserInfo::new("admin", &["ops"]));
    s.set_token(READER, UserInfo::new("reader", &["viewers"]));
    s.set_token(NOBODY, UserInfo::new("nobody", &[]));
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    s.set_authorizer(move |r: &AccessRequest| {
        log.lock().unwrap().push(r.clone());
        r.group == "velero.io"
            && match r.user.as_str() {
                "admin" => true,
                "reader" => r.verb == "get" || r.verb == "list",
                _ => false,
            }
    });
    seen
}

/// A restic wrapper limiting uploads, so a backup stays in progress long enough to act on.
fn slow_restic(env: &Env, kib: u32) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let p = env.tmp.path().join(format!("opsapi-restic-slow-{kib}"));
    std::fs::write(
        &p,
        format!(
            "#!/bin/sh\nRESTIC='{}'\ncase \" $* \" in *\" backup \"*) exec \"$RESTIC\" \"$@\" --limit-upload={kib};; esac\nexec \"$RESTIC\" \"$@\"\n",
            restic_bin().display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    p
}

/// The value of one sample line `name{labels} value` of the OpenMetrics text.
fn sample(metrics: &str, series: &str) -> Option<f64> {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}

/// Runs `podvolume-agent <args>`; (exit code, stdout, stderr).
fn client(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_podvolume-agent"))
        .args(args)
        .env_remove("KUBECONFIG")
        .env("HOME", "/nonexistent")
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

async fn wait_in_progress(env: &Env, name: &str, agent: &Agent) {
    let deadline = Instant::now() + LONG;
    loop {
        let p = env.pvbs().get(name).await.unwrap();
        let st = p.status.clone().unwrap_or_default();
        if st.phase == Some(Phase::InProgress)
            && st.progress.as_ref().is_some_and(|p| p.bytes_done > 0)
        {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "never in progress: {st:?}\n{}",
            agent.logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn phase(p: &PodVolumeBackup) -> Option<Phase> {
    p.status.as_ref().and_then(|s| s.phase)
}

/// Every endpoint and status code of the read side: 401 without and with a bad token, 403 from
/// the SubjectAccessReview, 200 for list and progress (by UID, `namespace%2Fname` and
/// `namespace/name`), 404 for an unknown id, 200 with `err` for a failed operation, 405 for a
/// POST that is not a cancel; the reviews ask the right questions and are cached; health and
/// metrics need no token; no token and no repository password in logs or answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_authentication_authorization_and_errors() {
    let env = Env::new(Flavour::Velero).await;
    let Some(standin) = env.standin() else {
        eprintln!("skipped: needs the stand-in's TokenReview/SubjectAccessReview controls");
        return;
    };
    let reviews = set_up_auth(&env);
    let (pod, dirs) = env.create_pod("app-1", NODE, &["data"]).await;
    let total = Env::fill(&dirs["data"], &[("a.bin", 3 << 20), ("b/c.txt", 1234)]);
    let mut agent = env.start_agent(NODE, &[]);
    agent.wait_ready(LONG).await;
    let pvb = env.create_pvb("pvb-1", &pod, "data", NODE).await;
    let uid = pvb.uid().unwrap();
    let done = env
        .wait_pvb("pvb-1", &[Phase::Completed, Phase::Failed], LONG)
        .await;
    assert_eq!(phase(&done), Some(Phase::Completed), "{}", agent.logs());
    // A failed one: the volume is not in the pod.
    let bad = env.create_pvb("pvb-bad", &pod, "nosuchvolume", NODE).await;
    let bad_uid = bad.uid().unwrap();
    env.wait_pvb("pvb-bad", &[Phase::Failed], LONG).await;

    let port = agent.port;
    let mut answers = Vec::new();
    let mut get = async |path: &str, token: Option<&str>| {
        let a = call(port, "GET", path, token).await;
        answers.push(format!("{}\n{}", a.1, a.2));
        a
    };

    // Health and metrics: no token needed.
    for p in ["/livez", "/readyz", "/metrics"] {
        let (code, _, _) = get(p, None).await;
        assert_eq!(code, 200, "{p}");
    }

    // 401: no token, a token the TokenReview rejects, a non-bearer scheme.
    let paths = [
        "/v1/operations".to_string(),
        format!("/v1/operations/{uid}"),
        "/v1/operations/no-such-id".to_string(),
    ];
    for p in &paths {
        let (code, head, body) = get(p, None).await;
        assert_eq!(code, 401, "{p}: {body}");
        assert!(
            head.to_ascii_lowercase()
                .contains("www-authenticate: bearer"),
            "{head}"
        );
        error_of(401, &body);
        let (code, _, body) = get(p, Some(BOGUS)).await;
        assert_eq!(code, 401, "{p}: {body}");
        error_of(401, &body);
    }
    let (code, _, _) = call(port, "POST", &format!("/v1/operations/{uid}/cancel"), None).await;
    assert_eq!(code, 401);
    let (code, _, _) = call(
        port,
        "POST",
        &format!("/v1/operations/{uid}/cancel"),
        Some(BOGUS),
    )
    .await;
    assert_eq!(code, 401);

    // 403: authenticated, not allowed.
    for p in &paths {
        let (code, _, body) = get(p, Some(NOBODY)).await;
        assert_eq!(code, 403, "{p}: {body}");
        let msg = error_of(403, &body);
        assert!(msg.contains("nobody"), "{msg}");
    }
    let (code, _, body) = call(
        port,
        "POST",
        &format!("/v1/operations/{uid}/cancel"),
        Some(READER),
    )
    .await;
    assert_eq!(code, 403, "reader may not cancel: {body}");
    error_of(403, &body);

    // 200: list.
    let (code, _, body) = get("/v1/operations", Some(READER)).await;
    assert_eq!(code, 200, "{body}");
    let list = json(&body);
    let items = list["items"].as_array().unwrap();
    let item = items
        .iter()
        .find(|i| i["id"] == uid.as_str())
        .unwrap_or_else(|| panic!("{uid} not listed: {body}"));
    assert_eq!(item["kind"], "backup");
    assert_eq!(item["namespace"], env.ns.as_str());
    assert_eq!(item["name"], "pvb-1");
    assert_eq!(item["state"], "finished");
    assert_eq!(item["phase"], "Completed");
    assert_eq!(item["progress"]["nCompleted"], total);
    assert!(items.iter().any(|i| i["id"] == bad_uid.as_str()));

    // 200: progress by UID and by name, both forms; Velero's field names.
    let by_uid = get(&format!("/v1/operations/{uid}"), Some(READER)).await;
    assert_eq!(by_uid.0, 200, "{}", by_uid.2);
    let p = json(&by_uid.2);
    for f in [
        "completed",
        "err",
        "nCompleted",
        "nTotal",
        "operationUnits",
        "description",
        "started",
        "updated",
    ] {
        assert!(p.get(f).is_some(), "{f} missing: {p}");
    }
    assert_eq!(p["completed"], true);
    assert_eq!(p["err"], "");
    assert_eq!(p["nCompleted"], total);
    assert_eq!(p["nTotal"], total);
    assert_eq!(p["operationUnits"], "bytes");
    let by_encoded = get(&format!("/v1/operations/{}%2Fpvb-1", env.ns), Some(READER)).await;
    assert_eq!(by_encoded.0, 200, "{}", by_encoded.2);
    assert_eq!(json(&by_encoded.2), p);
    let by_segments = get(&format!("/v1/operations/{}/pvb-1", env.ns), Some(READER)).await;
    assert_eq!(by_segments.0, 200, "{}", by_segments.2);
    assert_eq!(json(&by_segments.2), p);

    // A failed operation: 200, the error is the operation's.
    let (code, _, body) = get(&format!("/v1/operations/{bad_uid}"), Some(READER)).await;
    assert_eq!(code, 200, "{body}");
    let f = json(&body);
    assert_eq!(f["completed"], true);
    assert!(!f["err"].as_str().unwrap().is_empty(), "{body}");

    // 404: unknown UID, unknown name, bad path.
    for p in [
        "/v1/operations/no-such-id".to_string(),
        format!("/v1/operations/{}%2Fno-such-pvb", env.ns),
        "/v1/operations/a/b/c".to_string(),
    ] {
        let (code, _, body) = get(&p, Some(READER)).await;
        assert_eq!(code, 404, "{p}: {body}");
        error_of(404, &body);
    }
    // 405: POST to something that is not a cancel.
    let (code, _, body) = call(port, "POST", &format!("/v1/operations/{uid}"), Some(ADMIN)).await;
    assert_eq!(code, 405, "{body}");
    error_of(405, &body);
    // The list itself is GET only.
    let (code, _, _) = call(port, "POST", "/v1/operations", Some(ADMIN)).await;
    assert_eq!(code, 405);

    // The reviews asked the right questions.
    let seen = reviews.lock().unwrap().clone();
    let asked = |user: &str, verb: &str, resource: &str, name: &str| {
        seen.iter().any(|r| {
            r.user == user
                && r.verb == verb
                && r.group == "velero.io"
                && r.resource == resource
                && r.namespace == env.ns
                && r.name == name
        })
    };
    assert!(
        asked("reader", "get", "podvolumebackups", "pvb-1"),
        "{seen:#?}"
    );
    assert!(asked("reader", "list", "podvolumebackups", ""), "{seen:#?}");
    assert!(
        asked("reader", "list", "podvolumerestores", ""),
        "{seen:#?}"
    );
    assert!(
        asked("reader", "update", "podvolumebackups", "pvb-1"),
        "{seen:#?}"
    );
    assert!(
        seen.iter()
            .any(|r| r.user == "reader" && r.groups == ["viewers"]),
        "groups from the TokenReview are passed on"
    );
    // Cached: asking again costs no review.
    let tr = RequestMatch::any().resource("tokenreviews");
    let sar = RequestMatch::any().resource("subjectaccessreviews");
    let (tr0, sar0) = (standin.request_count(&tr), standin.request_count(&sar));
    for _ in 0..3 {
        assert_eq!(
            get(&format!("/v1/operations/{uid}"), Some(READER)).await.0,
            200
        );
    }
    assert_eq!(standin.request_count(&tr), tr0, "TokenReview not cached");
    assert_eq!(
        standin.request_count(&sar),
        sar0,
        "SubjectAccessReview not cached"
    );

    // Secrets: neither tokens nor the repository password anywhere.
    let logs = agent.logs();
    for secret in [ADMIN, READER, NOBODY, BOGUS, "e2e password"] {
        assert!(!logs.contains(secret), "{secret:?} in the agent's logs");
        for a in &answers {
            assert!(!a.contains(secret), "{secret:?} in an answer: {a}");
        }
    }
    env.cleanup().await;
}

/// POST cancel of a running backup: 202, the object goes Canceling -> Canceled with
/// `spec.cancel` set, restic stops; of a queued one: 202 and Canceled before it started; again
/// once finished: 200 with the final progress. One cancel goes through `podvolume-agent cancel`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_through_the_api_ends_canceled() {
    let env = Env::new(Flavour::Velero).await;
    if env.standin().is_none() {
        eprintln!("skipped: needs the stand-in's TokenReview/SubjectAccessReview controls");
        return;
    }
    set_up_auth(&env);
    let (pod, dirs) = env.create_pod("app-c", NODE, &["a", "b"]).await;
    Env::fill(&dirs["a"], &[("x.bin", 30 << 20)]);
    Env::fill(&dirs["b"], &[("y.bin", 1 << 20)]);
    let slow = slow_restic(&env, 500);
    let mut agent = env.start_agent(
        NODE,
        &[
            &format!("--restic-binary={}", slow.display()),
            "--concurrency=1",
        ],
    );
    agent.wait_ready(LONG).await;
    let rec = env.record(env.pvbs(), "pvb-run");
    let running = env.create_pvb("pvb-run", &pod, "a", NODE).await;
    wait_in_progress(&env, "pvb-run", &agent).await;
    let queued = env.create_pvb("pvb-queued", &pod, "b", NODE).await;
    env.wait_pvb("pvb-queued", &[Phase::Accepted], LONG).await;
    let port = agent.port;

    // Queued: 202, then Canceled by its reconciler without ever starting.
    let (code, _, body) = call(
        port,
        "POST",
        &format!("/v1/operations/{}/cancel", queued.uid().unwrap()),
        Some(ADMIN),
    )
    .await;
    assert_eq!(code, 202, "{body}");
    assert_eq!(json(&body)["completed"], false, "{body}");
    let q = env.wait_pvb("pvb-queued", &[Phase::Canceled], LONG).await;
    assert_eq!(q.spec.cancel, Some(true));
    assert!(
        q.status.as_ref().unwrap().start_timestamp.is_none(),
        "the queued one must not have started"
    );
    assert_eq!(
        phase(&env.pvbs().get("pvb-run").await.unwrap()),
        Some(Phase::InProgress)
    );

    // Running: through the client subcommand, by name.
    let token_file = env.tmp.path().join("admin-token");
    std::fs::write(&token_file, format!("{ADMIN}\n")).unwrap();
    let url = format!("http://127.0.0.1:{port}");
    let id = format!("{}/pvb-run", env.ns);
    let (code, out, err) = client(&[
        "cancel",
        &id,
        "--url",
        &url,
        "--token-file",
        token_file.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("cancel requested"), "{out}");
    assert!(!out.contains(ADMIN) && !err.contains(ADMIN));
    let r = env.wait_pvb("pvb-run", &[Phase::Canceled], LONG).await;
    assert_eq!(r.spec.cancel, Some(true));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let phases: Vec<Option<Phase>> = rec.versions().iter().map(phase).collect();
    let canceling = phases.iter().position(|p| *p == Some(Phase::Canceling));
    let canceled = phases.iter().position(|p| *p == Some(Phase::Canceled));
    assert!(
        matches!((canceling, canceled), (Some(a), Some(b)) if a < b),
        "expected Canceling then Canceled: {phases:?}"
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    while !env.uploader_processes().is_empty() {
        assert!(Instant::now() < deadline, "restic still running");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Again, now finished: 200 with the final progress; idempotent.
    for _ in 0..2 {
        let (code, _, body) = call(
            port,
            "POST",
            &format!("/v1/operations/{}/cancel", running.uid().unwrap()),
            Some(ADMIN),
        )
        .await;
        assert_eq!(code, 200, "{body}");
        let p = json(&body);
        assert_eq!(p["completed"], true, "{body}");
    }
    // Unknown: 404.
    let (code, _, body) = call(
        port,
        "POST",
        "/v1/operations/no-such-id/cancel",
        Some(ADMIN),
    )
    .await;
    assert_eq!(code, 404, "{body}");

    let (_, metrics) = agent.http_get("/metrics").await.unwrap();
    let node = format!("{{node=\"{NODE}\"}}");
    assert_eq!(
        sample(
            &metrics,
            &format!("podVolume_data_upload_cancel_total{node}")
        ),
        Some(2.0),
        "{metrics}"
    );
    assert_eq!(
        sample(
            &metrics,
            &format!("podVolume_pod_volume_backup_dequeue_count{node}")
        ),
        Some(2.0),
        "{metrics}"
    );
    assert!(!agent.logs().contains(ADMIN));
    env.cleanup().await;
}

/// `/metrics` after one e2e backup: Velero's outcome counters and ours moved by exactly one
/// backup, the byte counter by the volume's size.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_after_an_e2e_backup() {
    let env = Env::new(Flavour::Velero).await;
    let (pod, dirs) = env.create_pod("app-m", NODE, &["data"]).await;
    let total = Env::fill(
        &dirs["data"],
        &[("big.bin", 5 << 20), ("s/a.txt", 1000), ("s/b.txt", 2345)],
    );
    let mut agent = env.start_agent(NODE, &[]);
    agent.wait_ready(LONG).await;
    let (code, before) = agent.http_get("/metrics").await.unwrap();
    assert_eq!(code, 200);
    let node = format!("{{node=\"{NODE}\"}}");
    let success = format!("podVolume_data_upload_success_total{node}");
    assert_ne!(sample(&before, &success), Some(1.0));
    env.create_pvb("pvb-m", &pod, "data", NODE).await;
    let done = env
        .wait_pvb("pvb-m", &[Phase::Completed, Phase::Failed], LONG)
        .await;
    assert_eq!(phase(&done), Some(Phase::Completed), "{}", agent.logs());
    // The slot is released just after the terminal write: wait for the running gauge to drop.
    let running = "podvolume_agent_operations{state=\"running\"}";
    let deadline = Instant::now() + Duration::from_secs(10);
    let m = loop {
        let (code, m) = agent.http_get("/metrics").await.unwrap();
        assert_eq!(code, 200);
        if sample(&m, running) == Some(0.0) || Instant::now() > deadline {
            break m;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(
        m.trim_end().ends_with("# EOF"),
        "OpenMetrics text ends with # EOF"
    );
    let expect = [
        (success.clone(), 1.0),
        (format!("podVolume_data_upload_failure_total{node}"), 0.0),
        (format!("podVolume_data_upload_cancel_total{node}"), 0.0),
        (
            format!("podVolume_pod_volume_backup_enqueue_count{node}"),
            1.0,
        ),
        (
            format!("podVolume_pod_volume_backup_dequeue_count{node}"),
            1.0,
        ),
        (
            format!(
                "podVolume_pod_volume_operation_latency_seconds_count{{node=\"{NODE}\",operation=\"backup\"}}"
            ),
            1.0,
        ),
        (
            "podvolume_agent_transferred_bytes_total{direction=\"upload\"}".to_string(),
            total as f64,
        ),
        (
            "podvolume_agent_uploader_exits_total{class=\"success\"}".to_string(),
            1.0,
        ),
        (
            "podvolume_agent_operations{state=\"running\"}".to_string(),
            0.0,
        ),
        (
            "podvolume_agent_operations{state=\"queued\"}".to_string(),
            0.0,
        ),
        (
            "podvolume_agent_throughput_bytes_per_second{direction=\"upload\"}".to_string(),
            0.0,
        ),
    ];
    let mut wrong = Vec::new();
    for (series, want) in &expect {
        let got = sample(&m, series).unwrap_or(0.0);
        if got != *want {
            wrong.push(format!("{series}: {got} != {want}"));
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}\n{m}");
    let writes = sample(&m, "podvolume_agent_status_writes_total{result=\"ok\"}").unwrap_or(0.0);
    assert!(writes >= 3.0, "claim, InProgress, terminal: {writes}\n{m}");
    assert!(
        sample(
            &m,
            "podvolume_agent_status_write_duration_seconds_count{result=\"ok\"}"
        ) == Some(writes)
    );
    // No per-object label values.
    for l in m.lines().filter(|l| !l.starts_with('#')) {
        assert!(
            !l.contains("pvb-m") && !l.contains(&env.ns) && !l.contains(&pod.uid().unwrap()),
            "per-object label: {l}"
        );
    }
    env.cleanup().await;
}

/// `/livez` answers while the API server is down, `/readyz` and the operations API do not (503);
/// once it is back, the agent becomes ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_while_the_api_server_is_down() {
    let env = Env::new(Flavour::Velero).await;
    let Some(standin) = env.standin() else {
        eprintln!("skipped: needs the stand-in's outage control");
        return;
    };
    standin.set_server_down(true);
    let mut agent = env.start_agent(NODE, &[]);
    let deadline = Instant::now() + LONG;
    while agent.http_get("/livez").await.is_none() {
        assert!(Instant::now() < deadline, "{}", agent.logs());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(agent.http_get("/livez").await.unwrap().0, 200);
    assert_eq!(agent.http_get("/readyz").await.unwrap().0, 503);
    assert_eq!(agent.http_get("/metrics").await.unwrap().0, 200);
    let (code, _, body) = call(agent.port, "GET", "/v1/operations", Some(ADMIN)).await;
    assert_eq!(code, 503, "{body}");
    error_of(503, &body);
    standin.set_server_down(false);
    agent.wait_ready(LONG).await;
    env.cleanup().await;
}

/// `--api-auth=none` is refused on a non-loopback address (the agent exits with a clear error);
/// on loopback it serves without tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_auth_none_only_on_loopback() {
    let env = Env::new(Flavour::Velero).await;
    let mut refused = env.start_agent(NODE, &["--api-auth=none", "--listen-address=0.0.0.0:0"]);
    let code = refused.wait(Duration::from_secs(30));
    assert_eq!(code, Some(2), "{}", refused.logs());
    assert!(
        refused
            .logs()
            .contains("--api-auth=none is only allowed with a loopback"),
        "{}",
        refused.logs()
    );

    let mut agent = env.start_agent(NODE, &["--api-auth=none"]);
    agent.wait_ready(LONG).await;
    let (code, _, body) = call(agent.port, "GET", "/v1/operations", None).await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(json(&body)["items"], serde_json::json!([]));
    let (code, _, body) = call(agent.port, "GET", "/v1/operations/nope", None).await;
    assert_eq!(code, 404, "{body}");
    if let Some(s) = env.standin() {
        assert_eq!(
            s.request_count(&RequestMatch::any().resource("tokenreviews")),
            0,
            "no reviews with --api-auth=none"
        );
    }
    env.cleanup().await;
}

/// `podvolume-agent operations` and `progress`: tables by default, `-o json`, the token from a
/// file or from the current kubeconfig context, clear errors (exit 1) for 401/403/404.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_subcommands() {
    let env = Env::new(Flavour::Velero).await;
    let Some(standin) = env.standin() else {
        eprintln!("skipped: needs the stand-in's TokenReview controls");
        return;
    };
    set_up_auth(&env);
    // The kubeconfig's own token authenticates as the reader.
    let kc: Value =
        serde_norway::from_str(&std::fs::read_to_string(&env.kubeconfig).unwrap()).unwrap();
    let kc_token = kc["users"][0]["user"]["token"]
        .as_str()
        .unwrap()
        .to_string();
    standin.set_token(&kc_token, UserInfo::new("reader", &["viewers"]));

    let (pod, dirs) = env.create_pod("app-cl", NODE, &["data"]).await;
    let total = Env::fill(&dirs["data"], &[("a.bin", 2 << 20)]);
    let mut agent = env.start_agent(NODE, &[]);
    agent.wait_ready(LONG).await;
    let pvb = env.create_pvb("pvb-cl", &pod, "data", NODE).await;
    env.wait_pvb("pvb-cl", &[Phase::Completed], LONG).await;
    let uid = pvb.uid().unwrap();
    let url = format!("http://127.0.0.1:{}", agent.port);
    let token_file = env.tmp.path().join("reader-token");
    std::fs::write(&token_file, READER).unwrap();
    let tf = token_file.to_str().unwrap();
    let kcp = env.kubeconfig.to_str().unwrap();

    // Table.
    let (code, out, err) = client(&["operations", "--url", &url, "--token-file", tf]);
    assert_eq!(code, 0, "{err}");
    let header = out.lines().next().unwrap();
    for col in ["ID", "KIND", "NAMESPACE/NAME", "STATE", "PHASE", "PROGRESS"] {
        assert!(header.contains(col), "{out}");
    }
    let row = out.lines().find(|l| l.contains(&uid)).expect(&out);
    assert!(
        row.contains(&format!("{}/pvb-cl", env.ns))
            && row.contains("Completed")
            && row.contains("100.0%"),
        "{row}"
    );
    // JSON, token from the kubeconfig.
    let (code, out, err) = client(&[
        "operations",
        "--url",
        &url,
        "--kubeconfig",
        kcp,
        "-o",
        "json",
    ]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(json(&out)["items"][0]["id"], uid.as_str());
    // progress, by name and by uid.
    let id = format!("{}/pvb-cl", env.ns);
    let (code, out, err) = client(&["progress", &id, "--url", &url, "--token-file", tf]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("Completed:") && out.contains("true") && out.contains("100.0%"),
        "{out}"
    );
    let (code, out, err) = client(&[
        "progress",
        &uid,
        "--url",
        &url,
        "--kubeconfig",
        kcp,
        "-o",
        "json",
    ]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(json(&out)["nCompleted"], total);
    // Errors.
    let (code, _, err) = client(&["progress", "nope", "--url", &url, "--token-file", tf]);
    assert_eq!(code, 1);
    assert!(err.contains("404"), "{err}");
    let (code, _, err) = client(&["cancel", &uid, "--url", &url, "--token-file", tf]);
    assert_eq!(code, 1);
    assert!(err.contains("403"), "{err}");
    let (code, _, err) = client(&["operations", "--url", &url]);
    assert_eq!(code, 1);
    assert!(err.contains("401") && err.contains("--token-file"), "{err}");
    let (code, _, err) = client(&["operations", "--url", "http://127.0.0.1:1"]);
    assert_eq!(code, 1);
    assert!(err.contains("cannot connect"), "{err}");
    for s in [READER, kc_token.as_str()] {
        assert!(!agent.logs().contains(s));
    }
    env.cleanup().await;
}
