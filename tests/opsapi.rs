//! The operations API, health and metrics over HTTP against the real agent binary, running as
//! `daemonset/`'s ServiceAccount on a real kube-apiserver (`PODVOLUME_E2E_KUBECONFIG`, as
//! `scripts/test-real-cluster.sh` runs this file), plus the client subcommands. Callers are
//! ServiceAccounts of the test with TokenRequest tokens and Roles granting what each test says
//! (or nothing): the server's own TokenReview and SubjectAccessReview answer the agent. The agent
//! reaches the server through the fault-injecting proxy, which counts its reviews and makes the
//! outage.

// The harness is shared with tests/e2e (owned there); its lints are not this file's.
#[allow(clippy::collapsible_if)]
#[path = "e2e/harness.rs"]
mod harness;
#[path = "common/real_api_server.rs"]
mod real_api_server;

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use harness::*;
use kube::ResourceExt;
use podvolume_agent::crd::{Phase, PodVolumeBackup};
use real_api_server::{BoundAs, Caller, caller, real_env};
use serde_json::{Value, json};

const LONG: Duration = Duration::from_secs(120);

/// A bearer token no server issued: its TokenReview says unauthenticated.
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

/// RBAC rules on Velero's PodVolumeBackups and PodVolumeRestores.
fn velero_rules(resources: &[&str], verbs: &[&str], names: &[&str]) -> Value {
    let mut rule = json!({"apiGroups": ["velero.io"], "resources": resources, "verbs": verbs});
    if !names.is_empty() {
        rule["resourceNames"] = json!(names);
    }
    json!([rule])
}

const BOTH: &[&str] = &["podvolumebackups", "podvolumerestores"];

/// May read and cancel: get, list and update (the verb the API asks for a cancel; not patch).
async fn admin(env: &Env) -> Caller {
    let rules = velero_rules(BOTH, &["get", "list", "update"], &[]);
    caller(env, &env.ns, "ops-admin", rules, BoundAs::User).await
}

/// May get and list, granted to the group of its namespace's ServiceAccounts only (it lives in
/// the application namespace): allowed only when the agent passes on the groups of the
/// TokenReview.
async fn reader(env: &Env, name: &str) -> Caller {
    let rules = velero_rules(BOTH, &["get", "list"], &[]);
    caller(env, &env.app_ns, name, rules, BoundAs::NamespaceGroup).await
}

/// Authenticated, allowed nothing.
async fn nobody(env: &Env) -> Caller {
    caller(env, &env.ns, "nobody", json!([]), BoundAs::Nothing).await
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
/// POST that is not a cancel; the reviews ask the right questions (the server's RBAC answers
/// them: a grant by object name, by verb, per resource, by group) and are cached; health and
/// metrics need no token; no token and no repository password in logs or answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_authentication_authorization_and_errors() {
    let mut env = real_env(Flavour::Velero).await;
    let proxy = env.fault_proxy().await;
    let admin = admin(&env).await;
    let reader = reader(&env, "reader").await;
    let nobody = nobody(&env).await;
    // get on pvb-1 by name and nothing else: the review must carry the object's name.
    let pvb1_only = caller(
        &env,
        &env.ns,
        "pvb-1-only",
        velero_rules(&["podvolumebackups"], &["get"], &["pvb-1"]),
        BoundAs::User,
    )
    .await;
    // list of restores and nothing else: the list asks about each resource on its own.
    let restores_lister = caller(
        &env,
        &env.ns,
        "restores-lister",
        velero_rules(&["podvolumerestores"], &["list"], &[]),
        BoundAs::User,
    )
    .await;
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
        let (code, _, body) = get(p, Some(nobody.token.as_str())).await;
        assert_eq!(code, 403, "{p}: {body}");
        let msg = error_of(403, &body);
        assert!(msg.contains(&nobody.username()), "{msg}");
    }
    let (code, _, body) = call(
        port,
        "POST",
        &format!("/v1/operations/{uid}/cancel"),
        Some(reader.token.as_str()),
    )
    .await;
    assert_eq!(code, 403, "reader may not cancel: {body}");
    error_of(403, &body);

    // 200: list.
    let (code, _, body) = get("/v1/operations", Some(reader.token.as_str())).await;
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
    let by_uid = get(
        &format!("/v1/operations/{uid}"),
        Some(reader.token.as_str()),
    )
    .await;
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
    let by_encoded = get(
        &format!("/v1/operations/{}%2Fpvb-1", env.ns),
        Some(reader.token.as_str()),
    )
    .await;
    assert_eq!(by_encoded.0, 200, "{}", by_encoded.2);
    assert_eq!(json(&by_encoded.2), p);
    let by_segments = get(
        &format!("/v1/operations/{}/pvb-1", env.ns),
        Some(reader.token.as_str()),
    )
    .await;
    assert_eq!(by_segments.0, 200, "{}", by_segments.2);
    assert_eq!(json(&by_segments.2), p);

    // A failed operation: 200, the error is the operation's.
    let (code, _, body) = get(
        &format!("/v1/operations/{bad_uid}"),
        Some(reader.token.as_str()),
    )
    .await;
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
        let (code, _, body) = get(&p, Some(reader.token.as_str())).await;
        assert_eq!(code, 404, "{p}: {body}");
        error_of(404, &body);
    }
    // 405: POST to something that is not a cancel.
    let (code, _, body) = call(
        port,
        "POST",
        &format!("/v1/operations/{uid}"),
        Some(admin.token.as_str()),
    )
    .await;
    assert_eq!(code, 405, "{body}");
    error_of(405, &body);
    // The list itself is GET only.
    let (code, _, _) = call(port, "POST", "/v1/operations", Some(admin.token.as_str())).await;
    assert_eq!(code, 405);

    // The reviews asked the right questions: each caller's answers are what RBAC grants it.
    // get names the object, in the agent's namespace (pvb-1-only may read pvb-1, by UID or by
    // name, and not pvb-bad).
    for p in [
        format!("/v1/operations/{uid}"),
        format!("/v1/operations/{}/pvb-1", env.ns),
    ] {
        let (code, _, body) = get(&p, Some(pvb1_only.token.as_str())).await;
        assert_eq!(code, 200, "pvb-1-only may get {p}: {body}");
    }
    let (code, _, body) = get(
        &format!("/v1/operations/{bad_uid}"),
        Some(pvb1_only.token.as_str()),
    )
    .await;
    assert_eq!(code, 403, "pvb-1-only may not get pvb-bad: {body}");
    // A cancel asks for update (pvb-1-only has get; admin has update and no patch): 200 for a
    // finished operation.
    let cancel = format!("/v1/operations/{uid}/cancel");
    let (code, _, body) = call(port, "POST", &cancel, Some(pvb1_only.token.as_str())).await;
    assert_eq!(code, 403, "get is not enough to cancel: {body}");
    let (code, _, body) = call(port, "POST", &cancel, Some(admin.token.as_str())).await;
    assert_eq!(code, 200, "update is what a cancel needs: {body}");
    assert_eq!(json(&body)["completed"], true, "{body}");
    // The list asks list, per resource: backups are listed only to who may list them.
    let (code, _, body) = get("/v1/operations", Some(pvb1_only.token.as_str())).await;
    assert_eq!(code, 403, "get is not list: {body}");
    let (code, _, body) = get("/v1/operations", Some(restores_lister.token.as_str())).await;
    assert_eq!(code, 200, "may list restores: {body}");
    assert_eq!(
        json(&body)["items"],
        json!([]),
        "no backups for a restores lister"
    );
    // The reader's 200s above came through the groups the TokenReview gave: its Role is bound
    // to the group of its namespace's ServiceAccounts only (see `reader`).

    // Cached: asking again costs no review. One answer, then the same three times at once
    // (reviews are kept for 10 s).
    let tr = RequestMatch::any().resource("tokenreviews");
    let sar = RequestMatch::any().resource("subjectaccessreviews");
    assert!(
        proxy.request_count(&tr) > 0 && proxy.request_count(&sar) > 0,
        "the agent's reviews go through the proxy: {:?}",
        proxy.request_log()
    );
    let again = format!("/v1/operations/{uid}");
    assert_eq!(get(&again, Some(reader.token.as_str())).await.0, 200);
    let (tr0, sar0) = (proxy.request_count(&tr), proxy.request_count(&sar));
    for _ in 0..3 {
        assert_eq!(get(&again, Some(reader.token.as_str())).await.0, 200);
    }
    assert_eq!(proxy.request_count(&tr), tr0, "TokenReview not cached");
    assert_eq!(
        proxy.request_count(&sar),
        sar0,
        "SubjectAccessReview not cached"
    );

    // Secrets: neither tokens nor the repository password anywhere.
    let logs = agent.logs();
    for secret in [
        admin.token.as_str(),
        reader.token.as_str(),
        nobody.token.as_str(),
        pvb1_only.token.as_str(),
        restores_lister.token.as_str(),
        BOGUS,
        "e2e password",
    ] {
        assert!(
            !logs.contains(secret),
            "a token or password in the agent's logs"
        );
        for a in &answers {
            assert!(!a.contains(secret), "a token or password in an answer: {a}");
        }
    }
    env.cleanup().await;
}

/// POST cancel of a running backup: 202, the object goes Canceling -> Canceled with
/// `spec.cancel` set, restic stops; of a queued one: 202 and Canceled before it started; again
/// once finished: 200 with the final progress. One cancel goes through `podvolume-agent cancel`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_through_the_api_ends_canceled() {
    let env = real_env(Flavour::Velero).await;
    let admin = admin(&env).await;
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
        Some(admin.token.as_str()),
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
    std::fs::write(&token_file, format!("{}\n", admin.token)).unwrap();
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
    assert!(!out.contains(&admin.token) && !err.contains(&admin.token));
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
            Some(admin.token.as_str()),
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
        Some(admin.token.as_str()),
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
    assert!(!agent.logs().contains(&admin.token));
    env.cleanup().await;
}

/// `/metrics` after one e2e backup: Velero's outcome counters and ours moved by exactly one
/// backup, the byte counter by the volume's size.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_after_an_e2e_backup() {
    let env = real_env(Flavour::Velero).await;
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

/// `/livez` answers while the API server is down (an outage of the proxy between the agent and
/// the server from before the agent starts), `/readyz` and the operations API do not (503); once
/// it is back, the agent becomes ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_while_the_api_server_is_down() {
    let mut env = real_env(Flavour::Velero).await;
    let admin = admin(&env).await;
    let proxy = env.fault_proxy().await;
    proxy.set_down(true);
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
    let (code, _, body) = call(
        agent.port,
        "GET",
        "/v1/operations",
        Some(admin.token.as_str()),
    )
    .await;
    assert_eq!(code, 503, "{body}");
    error_of(503, &body);
    proxy.set_down(false);
    agent.wait_ready(LONG).await;
    env.cleanup().await;
}

/// `--api-auth=none` is refused on a non-loopback address (the agent exits with a clear error);
/// on loopback it serves without tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_auth_none_only_on_loopback() {
    let mut env = real_env(Flavour::Velero).await;
    let proxy = env.fault_proxy().await;
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
    assert!(
        proxy.request_count(&RequestMatch::any()) > 0,
        "the agent reaches the server through the proxy"
    );
    for review in ["tokenreviews", "subjectaccessreviews"] {
        assert_eq!(
            proxy.request_count(&RequestMatch::any().resource(review)),
            0,
            "no {review} with --api-auth=none: {:?}",
            proxy.request_log()
        );
    }
    env.cleanup().await;
}

/// `podvolume-agent operations` and `progress`: tables by default, `-o json`, the token from a
/// file or from the current kubeconfig context, clear errors (exit 1) for 401/403/404.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_subcommands() {
    let env = real_env(Flavour::Velero).await;
    let reader_file = reader(&env, "reader").await;
    // A second reader, whose token comes from its kubeconfig's current context.
    let reader_kc = reader(&env, "kubeconfig-reader").await;

    let (pod, dirs) = env.create_pod("app-cl", NODE, &["data"]).await;
    let total = Env::fill(&dirs["data"], &[("a.bin", 2 << 20)]);
    let mut agent = env.start_agent(NODE, &[]);
    agent.wait_ready(LONG).await;
    let pvb = env.create_pvb("pvb-cl", &pod, "data", NODE).await;
    env.wait_pvb("pvb-cl", &[Phase::Completed], LONG).await;
    let uid = pvb.uid().unwrap();
    let url = format!("http://127.0.0.1:{}", agent.port);
    let token_file = env.tmp.path().join("reader-token");
    std::fs::write(&token_file, &reader_file.token).unwrap();
    let tf = token_file.to_str().unwrap();
    let kcp = reader_kc.kubeconfig.to_str().unwrap();

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
    for s in [&reader_file.token, &reader_kc.token] {
        assert!(!agent.logs().contains(s));
    }
    env.cleanup().await;
}
