//! Tests of the API server stand-in itself, over real HTTP with `kube::Client` (and a raw
//! TCP client for the in-stream watch error).

use futures::{StreamExt, TryStreamExt};
use http_body_util::BodyExt;
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use k8s_openapi::api::core::v1::{Namespace, PersistentVolume, PersistentVolumeClaim, Pod, Secret};
use k8s_openapi::api::events::v1::Event as NewEvent;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams,
    WatchEvent, WatchParams,
};
use kube::core::Status;
use podvolume_testbed::{RequestMatch, TestApiServer, UserInfo, velero_crds_dir};
use serde_json::{Value, json};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const NS: &str = "velero";
/// Group of the PodVolumeBackup flavour that declares `subresources: {status: {}}`.
const STATUS_GROUP: &str = "pvstatus.example.com";

fn pvb_resource(group: &str) -> ApiResource {
    ApiResource {
        group: group.into(),
        version: "v1".into(),
        api_version: format!("{group}/v1"),
        kind: "PodVolumeBackup".into(),
        plural: "podvolumebackups".into(),
    }
}

fn velero_pvb_crd() -> String {
    std::fs::read_to_string(velero_crds_dir().join("velero.io_podvolumebackups.yaml"))
        .expect("Velero CRDs in ../shared/reference/velero-crds")
}

/// Velero's PVB CRD, renamed to another group and given the status subresource.
fn status_pvb_crd() -> String {
    velero_pvb_crd()
        .replace("velero.io", STATUS_GROUP)
        .replace("subresources: {}", "subresources:\n      status: {}")
}

async fn setup() -> (TestApiServer, kube::Client) {
    let server = TestApiServer::start().await.expect("start");
    server.install_velero_crds().expect("velero CRDs");
    server
        .apply_crd_yaml(&status_pvb_crd())
        .expect("status CRD");
    let client = server.client().await;
    (server, client)
}

fn pvb(name: &str, node: &str) -> DynamicObject {
    serde_json::from_value(json!({
        "apiVersion": "velero.io/v1",
        "kind": "PodVolumeBackup",
        "metadata": {"name": name, "namespace": NS, "labels": {"velero.io/backup-name": "b1"}},
        "spec": {
            "node": node,
            "pod": {"kind": "Pod", "namespace": "app", "name": "p1", "uid": "u1"},
            "volume": "data",
            "backupStorageLocation": "default",
            "repoIdentifier": "s3:bucket/x",
        }
    }))
    .unwrap()
}

fn api(client: &kube::Client, group: &str) -> Api<DynamicObject> {
    Api::namespaced_with(client.clone(), NS, &pvb_resource(group))
}

fn api_error(r: Result<impl std::fmt::Debug, kube::Error>) -> Box<Status> {
    match r {
        Err(kube::Error::Api(s)) => s,
        other => panic!("expected an API error, got {other:?}"),
    }
}

fn rv(o: &DynamicObject) -> u64 {
    o.metadata
        .resource_version
        .as_deref()
        .unwrap()
        .parse()
        .unwrap()
}

fn generation(o: &DynamicObject) -> i64 {
    o.metadata.generation.unwrap()
}

/// A request through kube's client stack, returning status and JSON body whatever the code.
async fn raw(
    client: &kube::Client,
    method: &str,
    path: &str,
    content_type: &str,
    body: Value,
) -> (u16, Value) {
    raw_with(client, method, path, content_type, &[], body).await
}

/// [`raw`] with extra request headers (e.g. a User-Agent).
async fn raw_with(
    client: &kube::Client,
    method: &str,
    path: &str,
    content_type: &str,
    headers: &[(&str, &str)],
    body: Value,
) -> (u16, Value) {
    let bytes = if body.is_null() {
        Vec::new()
    } else {
        serde_json::to_vec(&body).unwrap()
    };
    let mut req = http::Request::builder()
        .method(method)
        .uri(path)
        .header("content-type", content_type);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req.body(kube::client::Body::from(bytes)).unwrap();
    let resp = client.send(req).await.expect("send");
    let code = resp.status().as_u16();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (code, serde_json::from_slice(&bytes).unwrap_or(Value::Null))
}

#[tokio::test]
async fn kubeconfig_version_and_discovery() {
    let (server, client) = setup().await;
    let kc = kube::config::Kubeconfig::read_from(server.kubeconfig_path()).unwrap();
    assert_eq!(
        kc.clusters[0].cluster.as_ref().unwrap().server.as_deref(),
        Some(server.url().as_str())
    );
    let info = client.apiserver_version().await.unwrap();
    assert_eq!((info.major.as_str(), info.minor.as_str()), ("1", "30"));

    let (code, groups) = raw(&client, "GET", "/apis", "", Value::Null).await;
    assert_eq!(code, 200);
    let names: Vec<&str> = groups["groups"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g["name"].as_str().unwrap())
        .collect();
    for g in [
        "velero.io",
        STATUS_GROUP,
        "events.k8s.io",
        "authentication.k8s.io",
        "authorization.k8s.io",
        "apiextensions.k8s.io",
    ] {
        assert!(names.contains(&g), "{g} missing from {names:?}");
    }
    let (_, velero) = raw(&client, "GET", "/apis/velero.io/v1", "", Value::Null).await;
    let rnames: Vec<&str> = velero["resources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["name"].as_str().unwrap())
        .collect();
    assert!(rnames.contains(&"podvolumebackups"));
    assert!(rnames.contains(&"podvolumerestores"));
    assert!(
        !rnames.contains(&"podvolumebackups/status"),
        "Velero's CRD has no status subresource"
    );
    let pvb = &velero["resources"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == "podvolumebackups")
        .unwrap();
    assert_eq!(pvb["singularName"], "podvolumebackup");
    assert_eq!(pvb["kind"], "PodVolumeBackup");
    assert_eq!(pvb["namespaced"], true);
    let (_, flavour) = raw(
        &client,
        "GET",
        &format!("/apis/{STATUS_GROUP}/v1"),
        "",
        Value::Null,
    )
    .await;
    let rnames: Vec<&str> = flavour["resources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["name"].as_str().unwrap())
        .collect();
    assert!(rnames.contains(&"podvolumebackups/status"));
    let (_, core) = raw(&client, "GET", "/api/v1", "", Value::Null).await;
    let pods = core["resources"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == "pods")
        .unwrap();
    assert_eq!(pods["shortNames"], json!(["po"]));

    // kube's own discovery sees the same thing.
    let discovery = kube::discovery::Discovery::new(client.clone())
        .run()
        .await
        .unwrap();
    let velero = discovery.get("velero.io").unwrap();
    let (_, caps) = velero
        .recommended_resources()
        .into_iter()
        .find(|(r, _)| r.plural == "podvolumebackups")
        .unwrap();
    assert!(caps.subresources.iter().all(|(r, _)| r.plural != "status"));
    let flavour = discovery.get(STATUS_GROUP).unwrap();
    let (_, caps) = flavour
        .recommended_resources()
        .into_iter()
        .find(|(r, _)| r.plural == "podvolumebackups")
        .unwrap();
    assert!(caps.subresources.iter().any(|(r, _)| r.plural == "status"));
}

#[tokio::test]
async fn create_get_metadata_and_errors() {
    let (server, client) = setup().await;
    let api = api(&client, "velero.io");
    let before = server.resource_version();
    let created = api
        .create(&PostParams::default(), &pvb("a", "n1"))
        .await
        .unwrap();
    assert!(rv(&created) > before);
    assert_eq!(generation(&created), 1);
    assert_eq!(created.metadata.uid.as_ref().unwrap().len(), 36);
    assert!(created.metadata.creation_timestamp.is_some());
    let again = api.get("a").await.unwrap();
    assert_eq!(again.metadata.uid, created.metadata.uid);

    let s = api_error(api.create(&PostParams::default(), &pvb("a", "n1")).await);
    assert_eq!((s.code, s.reason.as_str()), (409, "AlreadyExists"));

    let s = api_error(api.get("missing").await);
    assert_eq!((s.code, s.reason.as_str()), (404, "NotFound"));
    let (code, body) = raw(
        &client,
        "GET",
        "/apis/velero.io/v1/namespaces/velero/podvolumebackups/missing",
        "",
        Value::Null,
    )
    .await;
    assert_eq!(code, 404);
    assert_eq!(body["kind"], "Status");
    assert_eq!(body["details"]["name"], "missing");

    let mut nameless = pvb("x", "n1");
    nameless.metadata.name = None;
    let s = api_error(api.create(&PostParams::default(), &nameless).await);
    assert_eq!((s.code, s.reason.as_str()), (422, "Invalid"));
    nameless.metadata.generate_name = Some("gen-".into());
    let generated = api.create(&PostParams::default(), &nameless).await.unwrap();
    assert!(generated.metadata.name.unwrap().starts_with("gen-"));

    // A real server answers 400 BadRequest (not 422) to a namespace mismatch.
    let mut other_ns = pvb("b", "n1");
    other_ns.metadata.namespace = Some("elsewhere".into());
    let s = api_error(api.create(&PostParams::default(), &other_ns).await);
    assert_eq!((s.code, s.reason.as_str()), (400, "BadRequest"));

    // Unknown resources and subresources are 404.
    let (code, _) = raw(
        &client,
        "GET",
        "/apis/velero.io/v1/namespaces/velero/nothings",
        "",
        Value::Null,
    )
    .await;
    assert_eq!(code, 404);
}

#[tokio::test]
async fn update_conflicts_generation_and_noop_writes() {
    let (server, client) = setup().await;
    let api = api(&client, "velero.io");
    let created = api
        .create(&PostParams::default(), &pvb("a", "n1"))
        .await
        .unwrap();

    // PUT with a stale resourceVersion.
    let mut stale = created.clone();
    let updated = api
        .patch(
            "a",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"volume": "v2"}})),
        )
        .await
        .unwrap();
    assert_eq!(generation(&updated), 2, "spec change bumps generation");
    stale.data["spec"]["volume"] = json!("v3");
    let s = api_error(api.replace("a", &PostParams::default(), &stale).await);
    assert_eq!((s.code, s.reason.as_str()), (409, "Conflict"));

    // Merge patch carrying a stale resourceVersion.
    let s = api_error(
        api.patch(
            "a",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"resourceVersion": created.metadata.resource_version}, "spec": {"volume": "x"}})),
        )
        .await,
    );
    assert_eq!(s.code, 409);

    // PUT of a custom resource without resourceVersion is refused (422), with the current one works.
    let mut current = api.get("a").await.unwrap();
    current.metadata.resource_version = None;
    let s = api_error(api.replace("a", &PostParams::default(), &current).await);
    assert_eq!(s.code, 422);
    let mut current = api.get("a").await.unwrap();
    current.data["spec"]["volume"] = json!("v4");
    let replaced = api
        .replace("a", &PostParams::default(), &current)
        .await
        .unwrap();
    assert_eq!(generation(&replaced), 3);

    // Metadata-only change: new resourceVersion, same generation.
    let labelled = api
        .patch(
            "a",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"x": "y"}}})),
        )
        .await
        .unwrap();
    assert!(rv(&labelled) > rv(&replaced));
    assert_eq!(generation(&labelled), 3);

    // A write that changes nothing keeps the resourceVersion (no event either).
    let same = api
        .patch(
            "a",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"x": "y"}}})),
        )
        .await
        .unwrap();
    assert_eq!(rv(&same), rv(&labelled));

    // Without the status subresource a status change is a change of the object: it bumps
    // generation like on a real server (only metadata is excluded there).
    let with_status = api
        .patch(
            "a",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": "InProgress"}})),
        )
        .await
        .unwrap();
    assert_eq!(with_status.data["status"]["phase"], "InProgress");
    assert_eq!(generation(&with_status), 4);
    assert_eq!(server.resource_version(), rv(&with_status));
}

#[tokio::test]
async fn patch_flavours() {
    let (server, client) = setup().await;
    let api = api(&client, "velero.io");
    api.create(&PostParams::default(), &pvb("a", "n1"))
        .await
        .unwrap();
    let path = "/apis/velero.io/v1/namespaces/velero/podvolumebackups/a";

    // JSON patch with a passing test op.
    let (code, out) = raw(&client, "PATCH", path, "application/json-patch+json", json!([
        {"op": "test", "path": "/spec/node", "value": "n1"},
        {"op": "replace", "path": "/spec/volume", "value": "v2"},
        {"op": "add", "path": "/metadata/finalizers", "value": ["velero.io/pod-volume-finalizer"]}
    ]))
    .await;
    assert_eq!(code, 200);
    assert_eq!(out["spec"]["volume"], "v2");
    assert_eq!(out["metadata"]["finalizers"].as_array().unwrap().len(), 1);

    // A failing test op: 422 Invalid (the real server's answer to any JSON patch apply error).
    let (code, body) = raw(&client, "PATCH", path, "application/json-patch+json",
        json!([{"op": "test", "path": "/spec/node", "value": "other"}, {"op": "replace", "path": "/spec/volume", "value": "bad"}])).await;
    assert_eq!((code, body["reason"].as_str()), (422, Some("Invalid")));
    assert_eq!(
        server
            .get_json("velero.io/v1", "podvolumebackups", Some(NS), "a")
            .unwrap()["spec"]["volume"],
        "v2"
    );
    // A malformed JSON patch: 400.
    let (code, _) = raw(
        &client,
        "PATCH",
        path,
        "application/json-patch+json",
        json!({"op": "add"}),
    )
    .await;
    assert_eq!(code, 400);
    // JSON patch testing a stale resourceVersion and replacing it: 409 like a merge patch.
    let (code, _) = raw(
        &client,
        "PATCH",
        path,
        "application/json-patch+json",
        json!([{"op": "replace", "path": "/metadata/resourceVersion", "value": "1"}]),
    )
    .await;
    assert_eq!(code, 409);

    // Strategic merge patch is not supported for custom resources: 415.
    let (code, body) = raw(
        &client,
        "PATCH",
        path,
        "application/strategic-merge-patch+json",
        json!({"spec": {"volume": "x"}}),
    )
    .await;
    assert_eq!(
        (code, body["reason"].as_str()),
        (415, Some("UnsupportedMediaType"))
    );

    // Server-side apply needs a fieldManager.
    let (code, _) = raw(&client, "PATCH", path, "application/apply-patch+yaml",
        json!({"apiVersion": "velero.io/v1", "kind": "PodVolumeBackup", "metadata": {"name": "a"}, "spec": {"volume": "x"}})).await;
    assert_eq!(code, 422);
    let applied = api
        .patch(
            "a",
            &PatchParams::apply("agent"),
            &Patch::Apply(json!({
                "apiVersion": "velero.io/v1", "kind": "PodVolumeBackup",
                "metadata": {"name": "a"}, "spec": {"uploaderType": "restic"}
            })),
        )
        .await
        .unwrap();
    assert_eq!(applied.data["spec"]["uploaderType"], "restic");
    assert_eq!(
        applied.data["spec"]["volume"], "v2",
        "apply merges the given fields"
    );
    // Apply creates a missing object.
    let created = api
        .patch(
            "new",
            &PatchParams::apply("agent"),
            &Patch::Apply(pvb("new", "n2")),
        )
        .await
        .unwrap();
    assert_eq!(created.data["spec"]["node"], "n2");

    // Strategic merge on a built-in resource is accepted (applied as a merge patch).
    let pods: Api<Pod> = Api::namespaced(client.clone(), "app");
    pods.create(&PostParams::default(), &serde_json::from_value(json!({"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c", "image": "i"}]}})).unwrap()).await.unwrap();
    let p = pods
        .patch(
            "p",
            &PatchParams::default(),
            &Patch::Strategic(json!({"metadata": {"labels": {"a": "b"}}})),
        )
        .await
        .unwrap();
    assert_eq!(p.metadata.labels.unwrap()["a"], "b");
}

#[tokio::test]
async fn pruning_of_unknown_fields() {
    let (server, client) = setup().await;
    let api = api(&client, "velero.io");
    let mut obj = pvb("a", "n1");
    obj.data["spec"]["unknownSpecField"] = json!(1);
    obj.data["spec"]["pod"]["extra"] = json!("x");
    obj.data["spec"]["tags"] = json!({"backup": "b1"});
    obj.data["somethingTopLevel"] = json!({"a": 1});
    let created = api.create(&PostParams::default(), &obj).await.unwrap();
    assert!(created.data["spec"].get("unknownSpecField").is_none());
    assert!(created.data["spec"]["pod"].get("extra").is_none());
    assert_eq!(
        created.data["spec"]["tags"]["backup"], "b1",
        "additionalProperties keep map entries"
    );
    assert!(created.data.get("somethingTopLevel").is_none());

    // Status fields that the schema does not declare are dropped on every write, too.
    let patched = api
        .patch("a", &PatchParams::default(), &Patch::Merge(json!({
            "status": {"phase": "Completed", "message": "ok", "bytesPerSecond": 10, "progress": {"bytesDone": 5, "eta": 3}}
        })))
        .await
        .unwrap();
    assert_eq!(
        patched.data["status"],
        json!({"phase": "Completed", "message": "ok", "progress": {"bytesDone": 5}})
    );

    // Metadata keeps only ObjectMeta fields.
    let (code, body) = raw(
        &client,
        "PATCH",
        "/apis/velero.io/v1/namespaces/velero/podvolumebackups/a",
        "application/merge-patch+json",
        json!({"metadata": {"bogus": 1, "annotations": {"k": "v"}}}),
    )
    .await;
    assert_eq!(code, 200);
    assert!(body["metadata"].get("bogus").is_none());
    assert_eq!(body["metadata"]["annotations"]["k"], "v");

    // x-kubernetes-preserve-unknown-fields keeps unknown fields below it.
    server
        .apply_crd_yaml(
            r#"
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {name: things.example.com}
spec:
  group: example.com
  names: {kind: Thing, plural: things, singular: thing, listKind: ThingList}
  scope: Cluster
  versions:
  - name: v1
    served: true
    storage: true
    schema:
      openAPIV3Schema:
        type: object
        properties:
          spec:
            type: object
            properties:
              free: {type: object, x-kubernetes-preserve-unknown-fields: true}
              fixed: {type: object, properties: {a: {type: string}}}
"#,
        )
        .unwrap();
    let things: Api<DynamicObject> = Api::all_with(
        client.clone(),
        &ApiResource {
            group: "example.com".into(),
            version: "v1".into(),
            api_version: "example.com/v1".into(),
            kind: "Thing".into(),
            plural: "things".into(),
        },
    );
    let t = things
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "apiVersion": "example.com/v1", "kind": "Thing", "metadata": {"name": "t"},
                "spec": {"free": {"any": {"deep": [1]}}, "fixed": {"a": "1", "b": "2"}, "other": 1}
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(
        t.data["spec"],
        json!({"free": {"any": {"deep": [1]}}, "fixed": {"a": "1"}})
    );
}

#[tokio::test]
async fn status_subresource_absent() {
    let (_server, client) = setup().await;
    let api = api(&client, "velero.io");
    let mut obj = pvb("a", "n1");
    obj.data["status"] = json!({"phase": "New"});
    let created = api.create(&PostParams::default(), &obj).await.unwrap();
    assert_eq!(
        created.data["status"]["phase"], "New",
        "no subresource: create keeps status"
    );
    let s = api_error(api.get_status("a").await);
    assert_eq!(s.code, 404);
    let s = api_error(
        api.patch_status(
            "a",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": "Failed"}})),
        )
        .await,
    );
    assert_eq!(s.code, 404);
    let s = api_error(
        api.replace_status("a", &PostParams::default(), &created)
            .await,
    );
    assert_eq!(s.code, 404);
    let out = api
        .patch(
            "a",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": "InProgress"}})),
        )
        .await
        .unwrap();
    assert_eq!(
        out.data["status"]["phase"], "InProgress",
        "main writes change status"
    );
}

#[tokio::test]
async fn status_subresource_present() {
    let (_server, client) = setup().await;
    let api = api(&client, STATUS_GROUP);
    let mut obj = pvb("a", "n1");
    obj.types.as_mut().unwrap().api_version = format!("{STATUS_GROUP}/v1");
    obj.data["status"] = json!({"phase": "Completed"});
    let created = api.create(&PostParams::default(), &obj).await.unwrap();
    assert!(created.data.get("status").is_none(), "create drops status");

    let st = api
        .patch_status(
            "a",
            &PatchParams::default(),
            &Patch::Merge(
                json!({"status": {"phase": "InProgress"}, "spec": {"volume": "ignored"}}),
            ),
        )
        .await
        .unwrap();
    assert_eq!(st.data["status"]["phase"], "InProgress");
    assert_eq!(
        st.data["spec"]["volume"], "data",
        "status writes change only status"
    );
    assert_eq!(generation(&st), 1, "status writes do not bump generation");
    assert!(rv(&st) > rv(&created));
    assert_eq!(
        api.get_status("a").await.unwrap().data["status"]["phase"],
        "InProgress"
    );

    // Main-object writes ignore status (the stored one is kept).
    let main = api
        .patch(
            "a",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": "Failed"}, "spec": {"volume": "v2"}})),
        )
        .await
        .unwrap();
    assert_eq!(main.data["status"]["phase"], "InProgress");
    assert_eq!(main.data["spec"]["volume"], "v2");
    assert_eq!(generation(&main), 2);

    // Status PUT with a stale resourceVersion conflicts.
    let mut stale = st.clone();
    stale.data["status"]["phase"] = json!("Completed");
    let s = api_error(
        api.replace_status("a", &PostParams::default(), &stale)
            .await,
    );
    assert_eq!(s.code, 409);
}

#[tokio::test]
async fn list_in_pages_with_limit_and_continue() {
    let (_server, client) = setup().await;
    let api = api(&client, "velero.io");
    for i in 0..7 {
        let mut o = pvb(&format!("pvb-{i}"), if i % 2 == 0 { "n1" } else { "n2" });
        o.metadata.labels =
            Some(serde_json::from_value(json!({"n": (i % 2).to_string()})).unwrap());
        api.create(&PostParams::default(), &o).await.unwrap();
    }
    let mut seen = Vec::new();
    let mut token: Option<String> = None;
    let mut pages = 0;
    let mut first_rv = None;
    loop {
        let mut lp = ListParams::default().limit(3).labels("n=0");
        if let Some(t) = &token {
            lp = lp.continue_token(t);
        }
        let page = api.list(&lp).await.unwrap();
        pages += 1;
        assert!(page.items.len() <= 3);
        let rv = page.metadata.resource_version.clone();
        assert_eq!(
            *first_rv.get_or_insert(rv.clone()),
            rv,
            "every page carries the first page's resourceVersion"
        );
        seen.extend(page.items.iter().map(|o| o.metadata.name.clone().unwrap()));
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(c) => {
                // A real server counts the rest only without selectors.
                assert_eq!(page.metadata.remaining_item_count, None);
                token = Some(c);
            }
            None => break,
        }
    }
    assert_eq!(pages, 2);
    assert_eq!(seen, ["pvb-0", "pvb-2", "pvb-4", "pvb-6"]);
    // Without a selector: every object once, in key order, each page counting the rest. Pages
    // are read from their start key on (a page costs what it holds); objects of another
    // namespace sorting before and after this one's are never in them.
    for (ns, name) in [("a-before", "pvb-x"), ("z-after", "pvb-y")] {
        let mut o = pvb(name, "n1");
        o.metadata.namespace = Some(ns.into());
        Api::<DynamicObject>::namespaced_with(client.clone(), ns, &pvb_resource("velero.io"))
            .create(&PostParams::default(), &o)
            .await
            .unwrap();
    }
    let mut seen = Vec::new();
    let mut remaining = Vec::new();
    let mut lp = ListParams::default().limit(2);
    loop {
        let page = api.list(&lp).await.unwrap();
        assert!(page.items.len() <= 2);
        seen.extend(page.items.iter().map(|o| o.metadata.name.clone().unwrap()));
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(c) => {
                remaining.push(page.metadata.remaining_item_count.unwrap());
                lp = lp.continue_token(&c);
            }
            None => break,
        }
    }
    assert_eq!(seen, (0..7).map(|i| format!("pvb-{i}")).collect::<Vec<_>>());
    assert_eq!(remaining, [5, 3, 1]);
    let err = api_error(api.list(&ListParams::default().continue_token("zz")).await);
    assert_eq!(err.code, 400, "{err:?}");
}

#[tokio::test]
async fn list_with_selectors() {
    let (server, client) = setup().await;
    let api = api(&client, "velero.io");
    for (name, node, labels) in [
        ("a", "n1", json!({"env": "prod", "tier": "x"})),
        ("b", "n2", json!({"env": "dev"})),
        ("c", "n1", json!({})),
    ] {
        let mut o = pvb(name, node);
        o.metadata.labels = Some(serde_json::from_value(labels).unwrap());
        api.create(&PostParams::default(), &o).await.unwrap();
    }
    let names = |l: &kube::core::ObjectList<DynamicObject>| -> Vec<String> {
        l.items
            .iter()
            .map(|o| o.metadata.name.clone().unwrap())
            .collect()
    };
    let q = |sel: &'static str| {
        let api = api.clone();
        async move { names(&api.list(&ListParams::default().labels(sel)).await.unwrap()) }
    };
    assert_eq!(q("env=prod").await, ["a"]);
    assert_eq!(q("env==dev").await, ["b"]);
    assert_eq!(q("env!=prod").await, ["b", "c"]);
    assert_eq!(q("env in (prod,dev)").await, ["a", "b"]);
    assert_eq!(q("env notin (prod)").await, ["b", "c"]);
    assert_eq!(q("tier").await, ["a"]);
    assert_eq!(q("!env").await, ["c"]);
    let l = api
        .list(&ListParams::default().fields("metadata.name=b"))
        .await
        .unwrap();
    assert_eq!(names(&l), ["b"]);
    assert_eq!(
        l.metadata.resource_version.as_deref(),
        Some(server.resource_version().to_string().as_str())
    );
    let s = api_error(
        api.list(&ListParams::default().fields("spec.node=n1"))
            .await,
    );
    assert_eq!(
        s.code, 400,
        "field selectors on CR fields need selectableFields"
    );

    // Cluster-wide list of a namespaced resource.
    let mut elsewhere = pvb("d", "n1");
    elsewhere.metadata.namespace = Some("other".into());
    Api::<DynamicObject>::namespaced_with(client.clone(), "other", &pvb_resource("velero.io"))
        .create(&PostParams::default(), &elsewhere)
        .await
        .unwrap();
    let all: Api<DynamicObject> = Api::all_with(client.clone(), &pvb_resource("velero.io"));
    assert_eq!(
        all.list(&ListParams::default()).await.unwrap().items.len(),
        4
    );
    let l = all
        .list(&ListParams::default().fields("metadata.namespace=other"))
        .await
        .unwrap();
    assert_eq!(names(&l), ["d"]);

    // Pods: spec.nodeName.
    let pods: Api<Pod> = Api::all(client.clone());
    for (ns, name, node) in [
        ("app", "p1", "n1"),
        ("app", "p2", "n2"),
        ("web", "p3", "n1"),
    ] {
        Api::<Pod>::namespaced(client.clone(), ns)
            .create(&PostParams::default(), &serde_json::from_value(json!({
                "metadata": {"name": name}, "spec": {"nodeName": node, "containers": [{"name": "c", "image": "i"}]}
            })).unwrap())
            .await
            .unwrap();
    }
    let on_n1 = pods
        .list(&ListParams::default().fields("spec.nodeName=n1"))
        .await
        .unwrap();
    let mut got: Vec<String> = on_n1
        .items
        .iter()
        .map(|p| p.metadata.name.clone().unwrap())
        .collect();
    got.sort();
    assert_eq!(got, ["p1", "p3"]);
}

#[tokio::test]
async fn watch_events_selectors_and_finalizers() {
    let (server, client) = setup().await;
    let api = api(&client, "velero.io");
    let start = server.resource_version().to_string();
    let wp = WatchParams::default().labels("watched=yes");
    let mut stream = api.watch(&wp, &start).await.unwrap().boxed();

    let mut o = pvb("a", "n1");
    o.metadata.labels = Some([("watched".to_string(), "yes".to_string())].into());
    o.metadata.finalizers = Some(vec!["velero.io/pod-volume-finalizer".into()]);
    api.create(&PostParams::default(), &o).await.unwrap();
    api.create(&PostParams::default(), &pvb("unwatched", "n1"))
        .await
        .unwrap();
    api.patch(
        "a",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"cancel": true}})),
    )
    .await
    .unwrap();

    // Deletion with a finalizer: deletionTimestamp set, the object stays.
    let deleted = api
        .delete("a", &DeleteParams::default())
        .await
        .unwrap()
        .left()
        .expect("object returned");
    assert!(deleted.metadata.deletion_timestamp.is_some());
    assert_eq!(deleted.metadata.deletion_grace_period_seconds, Some(0));
    assert!(api.get("a").await.is_ok());
    // No new finalizers while deleting.
    let s = api_error(
        api.patch(
            "a",
            &PatchParams::default(),
            &Patch::Merge(
                json!({"metadata": {"finalizers": ["velero.io/pod-volume-finalizer", "x/y"]}}),
            ),
        )
        .await,
    );
    assert_eq!(s.code, 422);
    // Emptying the finalizers removes it.
    api.patch(
        "a",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"finalizers": null}})),
    )
    .await
    .unwrap();
    assert_eq!(api_error(api.get("a").await).code, 404);

    let mut seen = Vec::new();
    while seen.len() < 4 {
        let ev = tokio::time::timeout(Duration::from_secs(5), stream.try_next())
            .await
            .expect("event in time")
            .unwrap()
            .unwrap();
        seen.push(match ev {
            WatchEvent::Added(o) => format!("ADDED {}", o.metadata.name.unwrap()),
            WatchEvent::Modified(o) => format!(
                "MODIFIED {} deleting={}",
                o.metadata.name.unwrap(),
                o.metadata.deletion_timestamp.is_some()
            ),
            WatchEvent::Deleted(o) => format!("DELETED {}", o.metadata.name.unwrap()),
            WatchEvent::Bookmark(_) => continue,
            WatchEvent::Error(e) => panic!("{e:?}"),
        });
    }
    assert_eq!(
        seen,
        [
            "ADDED a",
            "MODIFIED a deleting=false",
            "MODIFIED a deleting=true",
            "DELETED a"
        ]
    );

    // Without finalizers the object goes at once.
    api.delete("unwatched", &DeleteParams::default())
        .await
        .unwrap();
    assert_eq!(api_error(api.get("unwatched").await).code, 404);

    // Label transitions: a watch sees an object leave/enter its selector as DELETED/ADDED.
    let start = server.resource_version().to_string();
    let mut stream = api
        .watch(&WatchParams::default().labels("watched=yes"), &start)
        .await
        .unwrap()
        .boxed();
    api.create(&PostParams::default(), &pvb("b", "n1"))
        .await
        .unwrap();
    api.patch(
        "b",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {"watched": "yes"}}})),
    )
    .await
    .unwrap();
    api.patch(
        "b",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {"watched": "no"}}})),
    )
    .await
    .unwrap();
    let mut kinds = Vec::new();
    while kinds.len() < 2 {
        match tokio::time::timeout(Duration::from_secs(5), stream.try_next())
            .await
            .unwrap()
            .unwrap()
            .unwrap()
        {
            WatchEvent::Added(_) => kinds.push("ADDED"),
            WatchEvent::Deleted(_) => kinds.push("DELETED"),
            WatchEvent::Modified(_) => kinds.push("MODIFIED"),
            _ => {}
        }
    }
    assert_eq!(kinds, ["ADDED", "DELETED"]);
}

#[tokio::test]
async fn watch_replay_bookmarks_and_timeout() {
    let server = TestApiServer::builder()
        .bookmark_interval(Duration::from_millis(100))
        .start()
        .await
        .unwrap();
    server.install_velero_crds().unwrap();
    let client = server.client().await;
    let api = api(&client, "velero.io");
    let start = server.resource_version().to_string();
    api.create(&PostParams::default(), &pvb("a", "n1"))
        .await
        .unwrap();
    api.create(&PostParams::default(), &pvb("b", "n1"))
        .await
        .unwrap();
    // Replay from history: both creations arrive although the watch starts afterwards.
    let mut wp = WatchParams::default().timeout(1);
    wp.bookmarks = true;
    let began = Instant::now();
    let events: Vec<_> = api
        .watch(&wp, &start)
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap();
    assert!(
        began.elapsed() >= Duration::from_millis(900),
        "timeoutSeconds honoured"
    );
    let added = events
        .iter()
        .filter(|e| matches!(e, WatchEvent::Added(_)))
        .count();
    let bookmarks: Vec<String> = events
        .iter()
        .filter_map(|e| match e {
            WatchEvent::Bookmark(b) => Some(b.metadata.resource_version.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(added, 2);
    assert!(!bookmarks.is_empty());
    assert_eq!(
        bookmarks.last().unwrap(),
        &server.resource_version().to_string()
    );

    // resourceVersion "0": the current state as synthetic ADDED events.
    let events: Vec<_> = api
        .watch(&WatchParams::default().timeout(1), "0")
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap();
    assert_eq!(
        events
            .iter()
            .filter(|e| matches!(e, WatchEvent::Added(_)))
            .count(),
        2
    );
}

#[tokio::test]
async fn watch_from_compacted_history_gets_410_in_stream() {
    let (server, client) = setup().await;
    let api = api(&client, "velero.io");
    let old = server.resource_version();
    api.create(&PostParams::default(), &pvb("a", "n1"))
        .await
        .unwrap();
    server.compact_history();

    // Raw HTTP: 200, chunked, then an ERROR event carrying a 410 Status.
    let mut tcp = tokio::net::TcpStream::connect(server.addr()).await.unwrap();
    let req = format!(
        "GET /apis/velero.io/v1/namespaces/velero/podvolumebackups?watch=1&resourceVersion={old} HTTP/1.1\r\nHost: x\r\n\r\n"
    );
    tcp.write_all(req.as_bytes()).await.unwrap();
    let mut buf = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(5);
    while !String::from_utf8_lossy(&buf).contains("\"ERROR\"") {
        assert!(
            Instant::now() < deadline,
            "no ERROR event: {}",
            String::from_utf8_lossy(&buf)
        );
        let mut chunk = [0u8; 4096];
        let n = tokio::time::timeout(Duration::from_secs(5), tcp.read(&mut chunk))
            .await
            .unwrap()
            .unwrap();
        assert!(n > 0, "closed early: {}", String::from_utf8_lossy(&buf));
        buf.extend_from_slice(&chunk[..n]);
    }
    let text = String::from_utf8_lossy(&buf).to_string();
    assert!(text.starts_with("HTTP/1.1 200"));
    assert!(
        text.to_ascii_lowercase()
            .contains("transfer-encoding: chunked")
    );
    let line = text
        .lines()
        .find(|l| l.starts_with("{\"type\""))
        .unwrap_or_else(|| panic!("no event line in {text:?}"));
    let ev: Value = serde_json::from_str(line).unwrap();
    assert_eq!(ev["type"], "ERROR");
    assert_eq!(ev["object"]["kind"], "Status");
    assert_eq!(ev["object"]["code"], 410);
    assert_eq!(ev["object"]["reason"], "Expired");

    // kube's watch API surfaces it as WatchEvent::Error.
    let mut stream = api
        .watch(&WatchParams::default(), &old.to_string())
        .await
        .unwrap()
        .boxed();
    match stream.try_next().await.unwrap().unwrap() {
        WatchEvent::Error(e) => assert_eq!(e.code, 410),
        other => panic!("expected an error event, got {other:?}"),
    }
}

type WatcherRx = tokio::sync::mpsc::UnboundedReceiver<
    Result<kube::runtime::watcher::Event<DynamicObject>, String>,
>;

/// Names of the objects of the next initial (re-)list the watcher reports.
async fn wait_init_done(rx: &mut WatcherRx) -> Vec<String> {
    use kube::runtime::watcher::Event;
    let mut names = Vec::new();
    loop {
        match tokio::time::timeout(Duration::from_secs(15), rx.recv())
            .await
            .expect("watcher event")
            .unwrap()
        {
            Ok(Event::Init) => names.clear(),
            Ok(Event::InitApply(o)) => names.push(o.metadata.name.unwrap()),
            Ok(Event::InitDone) => return names,
            _ => {}
        }
    }
}

#[tokio::test]
async fn kube_runtime_watcher_relists_after_410() {
    use kube::runtime::{WatchStreamExt, watcher};
    let (server, client) = setup().await;
    let api = api(&client, "velero.io");
    api.create(&PostParams::default(), &pvb("a", "n1"))
        .await
        .unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let w = watcher(api.clone(), watcher::Config::default()).default_backoff();
    let task = tokio::spawn(async move {
        let mut w = std::pin::pin!(w);
        while let Some(ev) = w.next().await {
            let _ = tx.send(ev.map_err(|e| e.to_string()));
        }
    });
    assert_eq!(wait_init_done(&mut rx).await, ["a"]);
    let list_match = RequestMatch::any()
        .verb("list")
        .resource("podvolumebackups");
    let lists_before = server.request_count(&list_match);

    // Outage: the watch connection is closed; meanwhile the history moves past the
    // watcher's resourceVersion.
    server.set_server_down(true);
    tokio::time::sleep(Duration::from_millis(200)).await;
    server
        .put_json(serde_json::to_value(pvb("b", "n2")).unwrap())
        .unwrap();
    server.compact_history();
    server.set_server_down(false);

    let mut names = wait_init_done(&mut rx).await;
    names.sort();
    assert_eq!(
        names,
        ["a", "b"],
        "the watcher re-listed after the in-stream 410"
    );
    assert!(server.request_count(&list_match) > lists_before);
    task.abort();
}

#[tokio::test]
async fn fault_injection_and_request_log() {
    let (server, client) = setup().await;
    let api = api(&client, "velero.io");
    api.create(&PostParams::default(), &pvb("a", "n1"))
        .await
        .unwrap();
    let get_pvb = RequestMatch::any().verb("get").resource("podvolumebackups");

    // Next N requests answer 503. kube's default client retries 429/503/504 by itself...
    let before = server.request_count(&get_pvb);
    server.fail_next(get_pvb.clone(), 2, 503);
    api.get("a").await.unwrap();
    assert_eq!(
        server.request_count(&get_pvb) - before,
        3,
        "two 503s, retried"
    );
    // ...so use one without retries to see them.
    let mut config = server.config().await;
    config.default_retry = false;
    let api = Api::<DynamicObject>::namespaced_with(
        kube::Client::try_from(config).unwrap(),
        NS,
        &pvb_resource("velero.io"),
    );
    server.fail_next(get_pvb.clone(), 2, 503);
    assert_eq!(api_error(api.get("a").await).code, 503);
    assert_eq!(api_error(api.get("a").await).code, 503);
    api.get("a").await.unwrap();

    // A window of 500s.
    server.fail_for(
        RequestMatch::any().resource("podvolumebackups"),
        Duration::from_millis(300),
        500,
    );
    assert_eq!(api_error(api.get("a").await).code, 500);
    tokio::time::sleep(Duration::from_millis(350)).await;
    api.get("a").await.unwrap();

    // Dropped connection: no answer at all.
    server.drop_next(get_pvb.clone(), 1);
    let err = api.get("a").await.unwrap_err();
    assert!(!matches!(err, kube::Error::Api(_)), "{err:?}");
    api.get("a").await.unwrap();
    assert!(server.request_log().iter().any(|r| r.status == 0));

    // Forced conflicts on writes; nothing is written.
    let rv_before = server.resource_version();
    server.conflict_next(RequestMatch::any().resource("podvolumebackups"), 1);
    api.get("a").await.unwrap(); // reads are not affected
    let s = api_error(
        api.patch(
            "a",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"volume": "x"}})),
        )
        .await,
    );
    assert_eq!((s.code, s.reason.as_str()), (409, "Conflict"));
    assert_eq!(server.resource_version(), rv_before);
    api.patch(
        "a",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"volume": "x"}})),
    )
    .await
    .unwrap();

    // Latency.
    server.add_latency(get_pvb.clone(), Duration::from_millis(300), None);
    let t = Instant::now();
    api.get("a").await.unwrap();
    assert!(t.elapsed() >= Duration::from_millis(300));
    server.clear_faults();

    // Server down for a window, then back.
    server.server_down_for(Duration::from_millis(300));
    assert!(api.get("a").await.is_err());
    tokio::time::sleep(Duration::from_millis(400)).await;
    api.get("a").await.unwrap();

    // Counters and the request log.
    let patches = RequestMatch::any()
        .verb("patch")
        .resource("podvolumebackups")
        .subresource(None);
    assert_eq!(server.request_count(&patches), 2);
    let counts = server.request_counts();
    assert_eq!(
        counts[&(
            "patch".to_string(),
            "podvolumebackups".to_string(),
            String::new()
        )],
        2
    );
    let writes = server.write_log();
    assert!(
        writes
            .iter()
            .all(|w| w.info.name.as_deref() != Some("other-node-pvb"))
    );
    let last_patch = writes
        .iter()
        .rev()
        .find(|w| w.info.verb == "patch")
        .unwrap();
    assert_eq!(last_patch.status, 200);
    assert_eq!(last_patch.body_len, last_patch.body.len());
    assert!(last_patch.path.ends_with("/podvolumebackups/a"));
    server.clear_request_log();
    assert!(server.request_log().is_empty());

    // Direct store access bypasses faults and is not logged.
    server.fail_for(RequestMatch::any(), Duration::from_secs(60), 503);
    assert!(
        server
            .get_json("velero.io/v1", "podvolumebackups", Some(NS), "a")
            .is_some()
    );
    assert!(server.request_log().is_empty());
}

#[tokio::test]
async fn core_resources_and_direct_store_access() {
    let (server, client) = setup().await;
    let ns: Api<Namespace> = Api::all(client.clone());
    assert!(ns.get("default").await.is_ok());
    ns.create(
        &PostParams::default(),
        &serde_json::from_value(json!({"metadata": {"name": "velero"}})).unwrap(),
    )
    .await
    .unwrap();

    let secrets: Api<Secret> = Api::namespaced(client.clone(), NS);
    server
        .put(&Secret {
            metadata: kube::api::ObjectMeta {
                name: Some("velero-repo-credentials".into()),
                namespace: Some(NS.into()),
                ..Default::default()
            },
            string_data: None,
            data: Some(
                [(
                    "repository-password".to_string(),
                    k8s_openapi::ByteString(b"static-passw0rd".to_vec()),
                )]
                .into(),
            ),
            ..Default::default()
        })
        .unwrap();
    let s = secrets.get("velero-repo-credentials").await.unwrap();
    assert_eq!(s.data.unwrap()["repository-password"].0, b"static-passw0rd");

    let pvs: Api<PersistentVolume> = Api::all(client.clone());
    pvs.create(&PostParams::default(), &serde_json::from_value(json!({
        "metadata": {"name": "pv1"}, "spec": {"csi": {"driver": "d", "volumeHandle": "h"}, "capacity": {"storage": "1Gi"}}
    })).unwrap()).await.unwrap();
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), "app");
    pvcs.create(
        &PostParams::default(),
        &serde_json::from_value(json!({
            "metadata": {"name": "data"}, "spec": {"volumeName": "pv1"}
        }))
        .unwrap(),
    )
    .await
    .unwrap();
    assert_eq!(
        pvcs.get("data")
            .await
            .unwrap()
            .spec
            .unwrap()
            .volume_name
            .as_deref(),
        Some("pv1")
    );

    let events: Api<NewEvent> = Api::namespaced(client.clone(), NS);
    events.create(&PostParams::default(), &serde_json::from_value(json!({
        "metadata": {"generateName": "pvb-"}, "eventTime": "2024-01-01T00:00:00.000000Z",
        "reportingController": "podvolume-agent", "reportingInstance": "n1", "action": "Backup", "reason": "Started",
        "regarding": {"kind": "PodVolumeBackup", "namespace": NS, "name": "a"}, "type": "Normal"
    })).unwrap()).await.unwrap();
    let core_events: Api<k8s_openapi::api::core::v1::Event> = Api::namespaced(client.clone(), NS);
    core_events.create(&PostParams::default(), &serde_json::from_value(json!({
        "metadata": {"name": "e1"}, "involvedObject": {"kind": "PodVolumeBackup", "name": "a", "namespace": NS}, "reason": "X"
    })).unwrap()).await.unwrap();
    let l = core_events
        .list(&ListParams::default().fields("involvedObject.name=a"))
        .await
        .unwrap();
    assert_eq!(l.items.len(), 1);
    assert_eq!(
        events
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .len(),
        1
    );

    // Pod status is a subresource for pods: a main write keeps the stored status.
    let pods: Api<Pod> = Api::namespaced(client.clone(), "app");
    let mut pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "p", "namespace": "app", "uid": "fixed-uid"}, "spec": {"nodeName": "n1", "containers": [{"name": "c", "image": "i"}]},
        "status": {"phase": "Running"}
    })).unwrap();
    pod = server.put(&pod).unwrap();
    assert_eq!(
        pod.metadata.uid.as_deref(),
        Some("fixed-uid"),
        "direct put keeps given system fields"
    );
    let p = pods
        .patch(
            "p",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": "Failed"}})),
        )
        .await
        .unwrap();
    assert_eq!(p.status.unwrap().phase.as_deref(), Some("Running"));
    let p = pods
        .patch_status(
            "p",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": "Succeeded"}})),
        )
        .await
        .unwrap();
    assert_eq!(p.status.unwrap().phase.as_deref(), Some("Succeeded"));
    assert_eq!(
        server
            .get::<Pod>(Some("app"), "p")
            .unwrap()
            .status
            .unwrap()
            .phase
            .as_deref(),
        Some("Succeeded")
    );
    assert_eq!(server.list::<Pod>(None).len(), 1);

    // Direct delete honours finalizers like the API.
    let mut fin = serde_json::to_value(pvb("f", "n1")).unwrap();
    fin["metadata"]["finalizers"] = json!(["velero.io/pod-volume-finalizer"]);
    server.put_json(fin).unwrap();
    let marked = server
        .delete_json("velero.io/v1", "podvolumebackups", Some(NS), "f")
        .unwrap();
    assert!(marked["metadata"]["deletionTimestamp"].is_string());
}

#[tokio::test]
async fn token_and_subject_access_reviews() {
    let (server, client) = setup().await;
    server.set_token(
        "good",
        UserInfo::new(
            "system:serviceaccount:monitoring:prometheus",
            &["system:serviceaccounts"],
        ),
    );
    server.set_authorizer(|a| a.verb == "get" && a.resource == "pods" && a.subresource.is_empty());
    let reviews: Api<TokenReview> = Api::all(client.clone());
    let tr = |token: &str| TokenReview {
        spec: TokenReviewSpec {
            token: token.into(),
            ..Default::default()
        },
        ..Default::default()
    };
    let ok = reviews
        .create(&PostParams::default(), &tr("good"))
        .await
        .unwrap()
        .status
        .unwrap();
    assert_eq!(ok.authenticated, Some(true));
    assert_eq!(
        ok.user.unwrap().username.as_deref(),
        Some("system:serviceaccount:monitoring:prometheus")
    );
    let bad = reviews
        .create(&PostParams::default(), &tr("bad"))
        .await
        .unwrap()
        .status
        .unwrap();
    assert_eq!(bad.authenticated, Some(false));

    let sars: Api<SubjectAccessReview> = Api::all(client.clone());
    let sar = |verb: &str| SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: Some("u".into()),
            resource_attributes: Some(ResourceAttributes {
                verb: Some(verb.into()),
                resource: Some("pods".into()),
                namespace: Some("app".into()),
                ..Default::default()
            }),
            ..Default::default()
        },
        ..Default::default()
    };
    assert!(
        sars.create(&PostParams::default(), &sar("get"))
            .await
            .unwrap()
            .status
            .unwrap()
            .allowed
    );
    assert!(
        !sars
            .create(&PostParams::default(), &sar("delete"))
            .await
            .unwrap()
            .status
            .unwrap()
            .allowed
    );
    // Create only.
    let (code, _) = raw(
        &client,
        "GET",
        "/apis/authentication.k8s.io/v1/tokenreviews",
        "",
        Value::Null,
    )
    .await;
    assert_eq!(code, 405);
}

#[tokio::test]
async fn crd_lifecycle_over_http() {
    let (_server, client) = setup().await;
    let crds: Api<k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition> = Api::all(client.clone());
    let text = std::fs::read_to_string(velero_crds_dir().join("velero.io_podvolumerestores.yaml"))
        .unwrap()
        .replace("velero.io", "other.example.com");
    let crd = serde_norway::from_str(&text).unwrap();
    let created = crds.create(&PostParams::default(), &crd).await.unwrap();
    // Its creator's managedFields entry, and kube-apiserver's for the status it set.
    let mf = serde_json::to_value(created.metadata.managed_fields.clone().unwrap()).unwrap();
    let mf = mf.as_array().unwrap();
    assert_eq!(mf.len(), 2, "{mf:#?}");
    assert!(mf_entry(mf, "unknown", "Update")["fieldsV1"]["f:spec"].is_object());
    let status = mf_entry(mf, "kube-apiserver", "Update");
    assert_eq!(status["subresource"], "status");
    assert!(status["fieldsV1"]["f:status"]["f:conditions"].is_object());
    assert!(status["fieldsV1"].get("f:spec").is_none());
    let conditions = created.status.unwrap().conditions.unwrap();
    assert!(
        conditions
            .iter()
            .any(|c| c.type_ == "Established" && c.status == "True")
    );
    let pvrs: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        NS,
        &ApiResource {
            group: "other.example.com".into(),
            version: "v1".into(),
            api_version: "other.example.com/v1".into(),
            kind: "PodVolumeRestore".into(),
            plural: "podvolumerestores".into(),
        },
    );
    assert!(
        pvrs.list(&ListParams::default())
            .await
            .unwrap()
            .items
            .is_empty()
    );
    crds.delete(
        "podvolumerestores.other.example.com",
        &DeleteParams::default(),
    )
    .await
    .unwrap();
    assert_eq!(api_error(pvrs.list(&ListParams::default()).await).code, 404);
}

/// `metadata.managedFields` of an object (empty if it has none).
fn managed_fields(o: &Value) -> Vec<Value> {
    o["metadata"]["managedFields"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

/// The managedFields entry of `manager` (with `operation`), panicking if there is none.
fn mf_entry<'a>(mf: &'a [Value], manager: &str, operation: &str) -> &'a Value {
    mf.iter()
        .find(|e| e["manager"] == manager && e["operation"] == operation)
        .unwrap_or_else(|| panic!("no {operation} entry of {manager} in {mf:#?}"))
}

#[tokio::test]
async fn managed_fields_recorded_per_manager() {
    let (server, client) = setup().await;
    let av = format!("{STATUS_GROUP}/v1");
    let coll = format!("/apis/{STATUS_GROUP}/v1/namespaces/{NS}/podvolumebackups");
    let path = format!("{coll}/a");
    let merge = "application/merge-patch+json";
    let mut body = serde_json::to_value(pvb("a", "n1")).unwrap();
    body["apiVersion"] = json!(av);
    body["status"] = json!({"phase": "New"});

    // Create by one manager (fieldManager): one Update entry owning every field it wrote
    // (status excluded: the status subresource resets it), no system field.
    let (code, created) = raw(
        &client,
        "POST",
        &format!("{coll}?fieldManager=creator"),
        "application/json",
        body,
    )
    .await;
    assert_eq!(code, 201);
    let mf = managed_fields(&created);
    assert_eq!(mf.len(), 1, "{mf:#?}");
    let creator = &mf[0];
    assert_eq!(creator["manager"], "creator");
    assert_eq!(creator["operation"], "Update");
    assert_eq!(creator["apiVersion"], av.as_str());
    assert_eq!(creator["fieldsType"], "FieldsV1");
    assert!(creator.get("subresource").is_none());
    let time = creator["time"].as_str().unwrap();
    assert!(
        time.len() == 20 && time.ends_with('Z') && time.as_bytes()[10] == b'T',
        "{time}"
    );
    let creator_fields = json!({
        "f:metadata": {"f:labels": {".": {}, "f:velero.io/backup-name": {}}},
        "f:spec": {".": {}, "f:backupStorageLocation": {}, "f:node": {},
                   "f:pod": {".": {}, "f:kind": {}, "f:name": {}, "f:namespace": {}, "f:uid": {}},
                   "f:repoIdentifier": {}, "f:volume": {}},
    });
    assert_eq!(creator["fieldsV1"], creator_fields);
    // GET and list show them as stored.
    let stored = server
        .get_json(&av, "podvolumebackups", Some(NS), "a")
        .unwrap();
    assert_eq!(managed_fields(&stored), mf);
    let got = api(&client, STATUS_GROUP).get("a").await.unwrap();
    assert_eq!(
        serde_json::to_value(got.metadata.managed_fields.unwrap()).unwrap(),
        json!(mf)
    );
    let (_, list) = raw(&client, "GET", &coll, "", Value::Null).await;
    assert_eq!(managed_fields(&list["items"][0]), mf);

    // A /status merge patch by a second manager known only by its User-Agent.
    let ua = [(
        "user-agent",
        "status-writer/1.2.3 (linux/amd64) kubernetes/abcdef",
    )];
    let status_patch = json!({"status": {"phase": "InProgress", "progress": {"totalBytes": 10}}});
    let (code, st) = raw_with(
        &client,
        "PATCH",
        &format!("{path}/status"),
        merge,
        &ua,
        status_patch.clone(),
    )
    .await;
    assert_eq!(code, 200);
    let mf = managed_fields(&st);
    assert_eq!(mf.len(), 2, "{mf:#?}");
    assert_eq!(mf_entry(&mf, "creator", "Update"), creator);
    let writer = mf_entry(&mf, "status-writer", "Update");
    assert_eq!(writer["subresource"], "status");
    assert_eq!(
        writer["fieldsV1"],
        json!({"f:status": {".": {}, "f:phase": {}, "f:progress": {".": {}, "f:totalBytes": {}}}})
    );

    // No-op patches change nothing: same resourceVersion, same managedFields.
    let (code, again) = raw_with(
        &client,
        "PATCH",
        &format!("{path}/status"),
        merge,
        &ua,
        status_patch,
    )
    .await;
    assert_eq!(code, 200);
    assert_eq!(
        again["metadata"]["resourceVersion"],
        st["metadata"]["resourceVersion"]
    );
    assert_eq!(managed_fields(&again), mf);
    let (_, same) = raw(
        &client,
        "PATCH",
        &format!("{path}?fieldManager=somebody"),
        merge,
        json!({"spec": {"node": "n1"}}),
    )
    .await;
    assert_eq!(
        same["metadata"]["resourceVersion"],
        st["metadata"]["resourceVersion"]
    );
    assert_eq!(managed_fields(&same), mf);

    // The creator changing one of its fields keeps it, and takes nothing from anybody.
    let (_, changed) = raw(
        &client,
        "PATCH",
        &format!("{path}?fieldManager=creator"),
        merge,
        json!({"spec": {"volume": "v2"}}),
    )
    .await;
    assert_eq!(changed["spec"]["volume"], "v2");
    let mf = managed_fields(&changed);
    assert_eq!(mf.len(), 2, "{mf:#?}");
    assert_eq!(
        mf_entry(&mf, "creator", "Update")["fieldsV1"],
        creator_fields
    );
    assert_eq!(mf_entry(&mf, "status-writer", "Update"), writer);

    // Another manager changing a field the creator owned takes it over.
    let (_, taken) = raw(
        &client,
        "PATCH",
        &format!("{path}?fieldManager=other"),
        merge,
        json!({"spec": {"node": "n2"}}),
    )
    .await;
    let mf = managed_fields(&taken);
    assert_eq!(mf.len(), 3, "{mf:#?}");
    let mut without_node = creator_fields.clone();
    without_node["f:spec"]
        .as_object_mut()
        .unwrap()
        .remove("f:node");
    assert_eq!(mf_entry(&mf, "creator", "Update")["fieldsV1"], without_node);
    assert_eq!(
        mf_entry(&mf, "other", "Update")["fieldsV1"],
        json!({"f:spec": {"f:node": {}}})
    );
    assert_eq!(mf_entry(&mf, "status-writer", "Update"), writer);

    // A field removed is removed from its owner's set; the remover gains nothing.
    let other = mf_entry(&mf, "other", "Update").clone();
    let (_, removed) = raw(
        &client,
        "PATCH",
        &format!("{path}?fieldManager=other"),
        merge,
        json!({"spec": {"repoIdentifier": null}}),
    )
    .await;
    assert!(removed["spec"].get("repoIdentifier").is_none());
    let mf = managed_fields(&removed);
    let mut without_repo = without_node.clone();
    without_repo["f:spec"]
        .as_object_mut()
        .unwrap()
        .remove("f:repoIdentifier");
    assert_eq!(mf_entry(&mf, "creator", "Update")["fieldsV1"], without_repo);
    assert_eq!(mf_entry(&mf, "other", "Update"), &other);

    // Server-side apply: an Apply entry owning what was applied; the field it changed is
    // taken from its owner, whose entry, left empty, is dropped.
    let apply = |node: &str| {
        json!({"apiVersion": av, "kind": "PodVolumeBackup", "metadata": {"name": "a"},
               "spec": {"node": node, "uploaderType": "restic"}})
    };
    let api = api(&client, STATUS_GROUP);
    let applied = api
        .patch(
            "a",
            &PatchParams::apply("applier"),
            &Patch::Apply(apply("n3")),
        )
        .await
        .unwrap();
    let applied = serde_json::to_value(applied).unwrap();
    let mf = managed_fields(&applied);
    assert_eq!(mf.len(), 3, "{mf:#?}");
    let entry = mf_entry(&mf, "applier", "Apply");
    assert_eq!(
        entry["fieldsV1"],
        json!({"f:spec": {"f:node": {}, "f:uploaderType": {}}})
    );
    assert!(entry.get("subresource").is_none());
    assert_eq!(mf[0]["operation"], "Apply", "Apply entries come first");
    assert!(mf.iter().all(|e| e["manager"] != "other"), "{mf:#?}");
    // The same apply again, a second later, is a no-op (the stored time stays).
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let again = api
        .patch(
            "a",
            &PatchParams::apply("applier"),
            &Patch::Apply(apply("n3")),
        )
        .await
        .unwrap();
    let again = serde_json::to_value(again).unwrap();
    assert_eq!(
        again["metadata"]["resourceVersion"],
        applied["metadata"]["resourceVersion"]
    );
    assert_eq!(managed_fields(&again), mf);
    // managedFields in an apply patch: 400.
    let mut bad = apply("n4");
    bad["metadata"]["managedFields"] = json!([{"manager": "x"}]);
    let (code, _) = raw(
        &client,
        "PATCH",
        &format!("{path}?fieldManager=applier"),
        "application/apply-patch+yaml",
        bad,
    )
    .await;
    assert_eq!(code, 400);

    // Client-supplied managedFields replace the stored ones before the write is recorded.
    let imported = json!({"manager": "imported", "operation": "Update", "apiVersion": av,
        "time": "2026-01-01T00:00:00Z", "fieldsType": "FieldsV1",
        "fieldsV1": {"f:spec": {"f:node": {}, "f:volume": {}}}});
    let (_, replaced) = raw(
        &client,
        "PATCH",
        &format!("{path}?fieldManager=third"),
        merge,
        json!({"metadata": {"managedFields": [imported]}, "spec": {"volume": "v5"}}),
    )
    .await;
    let mf = managed_fields(&replaced);
    assert_eq!(mf.len(), 2, "{mf:#?}");
    assert_eq!(
        mf_entry(&mf, "imported", "Update")["fieldsV1"],
        json!({"f:spec": {"f:node": {}}})
    );
    assert_eq!(
        mf_entry(&mf, "imported", "Update")["time"],
        "2026-01-01T00:00:00Z"
    );
    assert_eq!(
        mf_entry(&mf, "third", "Update")["fieldsV1"],
        json!({"f:spec": {"f:volume": {}}})
    );
    // ...but not through /status, where the stored ones always count.
    let (_, ignored) = raw_with(
        &client,
        "PATCH",
        &format!("{path}/status"),
        merge,
        &ua,
        json!({"metadata": {"managedFields": [{"manager": "forged", "operation": "Update",
            "fieldsV1": {"f:spec": {}}}]}, "status": {"phase": "Completed"}}),
    )
    .await;
    let mf_after = managed_fields(&ignored);
    assert!(mf_after.iter().all(|e| e["manager"] != "forged"));
    assert_eq!(mf_after.len(), 3, "{mf_after:#?}");

    // An empty list resets them: the write's own entry is then the only one.
    let (_, reset) = raw(
        &client,
        "PATCH",
        &format!("{path}?fieldManager=resetter"),
        merge,
        json!({"metadata": {"managedFields": []}, "spec": {"volume": "v6"}}),
    )
    .await;
    let mf = managed_fields(&reset);
    assert_eq!(mf.len(), 1, "{mf:#?}");
    assert_eq!(mf[0]["manager"], "resetter");
    assert_eq!(mf[0]["fieldsV1"], json!({"f:spec": {"f:volume": {}}}));

    // Without fieldManager nor User-Agent: "unknown".
    let (_, anon) = raw_with(
        &client,
        "PATCH",
        &path,
        merge,
        &[("user-agent", "")],
        json!({"spec": {"volume": "v7"}}),
    )
    .await;
    let mf = managed_fields(&anon);
    assert_eq!(
        mf_entry(&mf, "unknown", "Update")["fieldsV1"],
        json!({"f:spec": {"f:volume": {}}})
    );
}

#[tokio::test]
async fn managed_fields_of_put_json_as_and_put_json() {
    let (server, client) = setup().await;
    // Velero's CRD (no status subresource): created by Velero's server, then written with its
    // status by the node agent.
    let without_status = serde_json::to_value(pvb("b", "n1")).unwrap();
    let created = server
        .put_json_as("velero-server", None, without_status.clone())
        .unwrap();
    let mf = managed_fields(&created);
    assert_eq!(mf.len(), 1, "{mf:#?}");
    assert_eq!(mf[0]["manager"], "velero-server");
    assert_eq!(mf[0]["operation"], "Update");
    assert_eq!(mf[0]["apiVersion"], "velero.io/v1");
    assert!(mf[0].get("subresource").is_none());
    assert_eq!(mf[0]["fieldsV1"]["f:spec"]["f:node"], json!({}));
    assert!(mf[0]["fieldsV1"].get("f:status").is_none());
    let creator = mf[0].clone();
    let mut with_status = without_status.clone();
    with_status["status"] =
        json!({"phase": "Completed", "progress": {"totalBytes": 5, "bytesDone": 5}});
    let written = server
        .put_json_as("node-agent-server", None, with_status.clone())
        .unwrap();
    let mf = managed_fields(&written);
    assert_eq!(mf.len(), 2, "{mf:#?}");
    assert_eq!(mf_entry(&mf, "velero-server", "Update"), &creator);
    assert_eq!(
        mf_entry(&mf, "node-agent-server", "Update")["fieldsV1"],
        json!({"f:status": {".": {}, "f:phase": {}, "f:progress": {".": {}, "f:bytesDone": {}, "f:totalBytes": {}}}})
    );
    // What the API serves is what is stored.
    let served = api(&client, "velero.io").get("b").await.unwrap();
    assert_eq!(
        serde_json::to_value(served.metadata.managed_fields.unwrap()).unwrap(),
        json!(mf)
    );
    // Rewriting the same object is a no-op for managedFields too.
    let rv_before = server.resource_version();
    let same = server
        .put_json_as("node-agent-server", None, with_status.clone())
        .unwrap();
    assert_eq!(server.resource_version(), rv_before);
    assert_eq!(managed_fields(&same), mf);
    // "status" needs the status subresource (404 like the real server); nothing else goes.
    let e = server
        .put_json_as("x", Some("status"), with_status.clone())
        .unwrap_err();
    assert_eq!(e.code, 404);
    let e = server
        .put_json_as("x", Some("scale"), with_status)
        .unwrap_err();
    assert_eq!(e.code, 400);

    // With the status subresource: a main write owns no status, a "status" write only the
    // status fields it changed.
    let mut obj = serde_json::to_value(pvb("c", "n1")).unwrap();
    obj["apiVersion"] = json!(format!("{STATUS_GROUP}/v1"));
    obj["status"] = json!({"phase": "InProgress", "message": "m"});
    let created = server.put_json_as("creator", None, obj.clone()).unwrap();
    assert_eq!(
        created["status"]["phase"], "InProgress",
        "the whole object is written"
    );
    let mf = managed_fields(&created);
    assert_eq!(mf.len(), 1, "{mf:#?}");
    assert!(mf[0]["fieldsV1"].get("f:status").is_none(), "{mf:#?}");
    obj["status"]["phase"] = json!("Completed");
    obj["spec"]["volume"] = json!("not owned by a status write");
    // As through /status, managedFields in the object do not count.
    obj["metadata"]["managedFields"] = json!([{"manager": "forged", "operation": "Update",
        "fieldsType": "FieldsV1", "fieldsV1": {"f:spec": {"f:node": {}}}}]);
    let st = server
        .put_json_as("status-writer", Some("status"), obj)
        .unwrap();
    let mf = managed_fields(&st);
    assert_eq!(mf.len(), 2, "{mf:#?}");
    assert!(mf.iter().all(|e| e["manager"] != "forged"), "{mf:#?}");
    assert_eq!(
        mf_entry(&mf, "creator", "Update"),
        &managed_fields(&created)[0]
    );
    let entry = mf_entry(&mf, "status-writer", "Update");
    assert_eq!(entry["subresource"], "status");
    assert_eq!(entry["fieldsV1"], json!({"f:status": {"f:phase": {}}}));

    // put_json stores managedFields as given and computes none.
    let mut given = serde_json::to_value(pvb("d", "n1")).unwrap();
    let hand_made = json!([{"manager": "hand", "operation": "Update", "fieldsType": "FieldsV1",
                            "fieldsV1": {"f:spec": {"f:node": {}}}}]);
    given["metadata"]["managedFields"] = hand_made.clone();
    let put = server.put_json(given).unwrap();
    assert_eq!(put["metadata"]["managedFields"], hand_made);
    let plain = server
        .put_json(serde_json::to_value(pvb("e", "n1")).unwrap())
        .unwrap();
    assert!(plain["metadata"].get("managedFields").is_none());
    // An API write to such an object records its writer.
    let patched = api(&client, "velero.io")
        .patch(
            "e",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"volume": "v2"}})),
        )
        .await
        .unwrap();
    let mf = serde_json::to_value(patched.metadata.managed_fields.unwrap()).unwrap();
    assert_eq!(mf.as_array().unwrap().len(), 1, "{mf:#?}");
    assert_eq!(mf[0]["fieldsV1"], json!({"f:spec": {"f:volume": {}}}));
    assert_eq!(mf[0]["manager"], "unknown", "kube 5 sends no User-Agent");
}
