//! Object storage: the global resourceVersion counter, the write pipeline (metadata, pruning,
//! status subresource, generation, finalizers) and a bounded event history for watches.

use crate::error::ApiError;
use crate::managed::{self, Writer};
use crate::resources::{ResourceInfo, builtins};
use crate::schema::{prune_object_meta, prune_root};
use serde_json::{Map, Value, json};
use std::collections::{BTreeMap, VecDeque};
use tokio::sync::watch;

/// Key of a stored object. Cluster-scoped objects have an empty namespace.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct ObjKey {
    group: String,
    plural: String,
    namespace: String,
    name: String,
}

impl ObjKey {
    fn new(res: &ResourceInfo, ns: Option<&str>, name: &str) -> Self {
        ObjKey {
            group: res.group.clone(),
            plural: res.plural.clone(),
            namespace: if res.namespaced {
                ns.unwrap_or("").to_string()
            } else {
                String::new()
            },
            name: name.to_string(),
        }
    }
}

/// Watch event type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EventType {
    Added,
    Modified,
    Deleted,
}

impl EventType {
    pub fn as_str(self) -> &'static str {
        match self {
            EventType::Added => "ADDED",
            EventType::Modified => "MODIFIED",
            EventType::Deleted => "DELETED",
        }
    }
}

/// One write, as remembered for watches.
#[derive(Debug, Clone)]
pub(crate) struct HistoryEvent {
    pub rv: u64,
    pub group: String,
    pub plural: String,
    pub namespace: String,
    pub etype: EventType,
    pub object: Value,
    /// The object before a MODIFIED write (for selector transitions).
    pub prev: Option<Value>,
}

/// How a write treats status and preconditions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WriteMode {
    /// A write to the main resource through the API.
    Main,
    /// A write to the `/status` subresource.
    Status,
    /// Test setup through the Rust API: whole object, no preconditions, system fields kept if given.
    Direct,
}

pub(crate) struct Store {
    pub rv: u64,
    pub resources: BTreeMap<(String, String), ResourceInfo>,
    objects: BTreeMap<ObjKey, Value>,
    history: VecDeque<HistoryEvent>,
    /// Events with rv <= floor are no longer in the history.
    pub history_floor: u64,
    pub history_limit: usize,
    pub notify: watch::Sender<u64>,
}

pub(crate) fn now_rfc3339() -> String {
    jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string()
}

fn meta_str<'a>(obj: &'a Value, field: &str) -> Option<&'a str> {
    obj.get("metadata")
        .and_then(|m| m.get(field))
        .and_then(Value::as_str)
}

fn meta_mut(obj: &mut Value) -> &mut Map<String, Value> {
    if !obj.get("metadata").is_some_and(Value::is_object) {
        obj["metadata"] = json!({});
    }
    obj["metadata"]
        .as_object_mut()
        .expect("metadata is an object")
}

fn finalizers(obj: &Value) -> Vec<String> {
    obj.pointer("/metadata/finalizers")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|f| f.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

fn random_suffix() -> String {
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    uuid::Uuid::new_v4().as_bytes()[..5]
        .iter()
        .map(|b| ALPHABET[*b as usize % ALPHABET.len()] as char)
        .collect()
}

/// Whether `a` and `b` differ in the part of an object whose change bumps
/// `metadata.generation`: all but metadata, apiVersion, kind (and status with the status
/// subresource).
fn generation_changed(a: &Value, b: &Value, status_subresource: bool) -> bool {
    let counted = |k: &str| match k {
        "metadata" | "apiVersion" | "kind" => false,
        "status" => !status_subresource,
        _ => true,
    };
    let (Value::Object(a), Value::Object(b)) = (a, b) else {
        return a != b;
    };
    let n = |m: &Map<String, Value>| m.keys().filter(|k| counted(k)).count();
    n(a) != n(b)
        || a.iter()
            .filter(|(k, _)| counted(k))
            .any(|(k, v)| b.get(k) != Some(v))
}

impl Store {
    pub fn new(history_limit: usize) -> Self {
        let (notify, _) = watch::channel(0);
        let mut store = Store {
            rv: 0,
            resources: BTreeMap::new(),
            objects: BTreeMap::new(),
            history: VecDeque::new(),
            history_floor: 0,
            history_limit,
            notify,
        };
        for r in builtins() {
            store
                .resources
                .insert((r.group.clone(), r.plural.clone()), r);
        }
        let ns = store
            .resource("", "namespaces")
            .cloned()
            .expect("namespaces");
        for name in ["default", "kube-system", "kube-public", "kube-node-lease"] {
            let obj = json!({"metadata": {"name": name}, "spec": {"finalizers": ["kubernetes"]}, "status": {"phase": "Active"}});
            store
                .create(&ns, "v1", None, obj, WriteMode::Direct, None)
                .expect("default namespaces");
        }
        store
    }

    pub fn resource(&self, group: &str, plural: &str) -> Option<&ResourceInfo> {
        self.resources.get(&(group.to_string(), plural.to_string()))
    }

    pub fn resource_by_kind(&self, group: &str, kind: &str) -> Option<&ResourceInfo> {
        self.resources
            .values()
            .find(|r| r.group == group && r.kind == kind)
    }

    fn bump(&mut self) -> u64 {
        self.rv += 1;
        self.rv
    }

    fn record(&mut self, etype: EventType, object: &Value, prev: Option<Value>) {
        let ev = HistoryEvent {
            rv: self.rv,
            group: String::new(),
            plural: String::new(),
            namespace: meta_str(object, "namespace").unwrap_or("").to_string(),
            etype,
            object: object.clone(),
            prev,
        };
        self.history.push_back(ev);
        while self.history.len() > self.history_limit {
            if let Some(old) = self.history.pop_front() {
                self.history_floor = old.rv;
            }
        }
        self.notify.send_replace(self.rv);
    }

    fn record_for(
        &mut self,
        res: &ResourceInfo,
        etype: EventType,
        object: &Value,
        prev: Option<Value>,
    ) {
        self.record(etype, object, prev);
        if let Some(ev) = self.history.back_mut() {
            ev.group = res.group.clone();
            ev.plural = res.plural.clone();
        }
    }

    /// Forget the whole history (like an etcd compaction): watches from an older
    /// resourceVersion get 410 Gone.
    pub fn compact(&mut self) {
        self.history.clear();
        self.history_floor = self.rv;
    }

    pub fn set_history_limit(&mut self, limit: usize) {
        self.history_limit = limit.max(1);
        while self.history.len() > self.history_limit {
            if let Some(old) = self.history.pop_front() {
                self.history_floor = old.rv;
            }
        }
    }

    /// Events after `rv`, or `Err(floor)` when some of them are no longer in the history.
    pub fn events_since(&self, rv: u64) -> Result<Vec<HistoryEvent>, u64> {
        if rv < self.history_floor {
            return Err(self.history_floor);
        }
        Ok(self.history.iter().filter(|e| e.rv > rv).cloned().collect())
    }

    pub fn get(&self, res: &ResourceInfo, ns: Option<&str>, name: &str) -> Option<Value> {
        self.objects.get(&ObjKey::new(res, ns, name)).cloned()
    }

    pub fn contains(&self, res: &ResourceInfo, ns: Option<&str>, name: &str) -> bool {
        self.objects.contains_key(&ObjKey::new(res, ns, name))
    }

    /// All objects of a resource, in one namespace or all of them.
    pub fn list(&self, res: &ResourceInfo, ns: Option<&str>) -> Vec<Value> {
        self.objects
            .iter()
            .filter(|(k, _)| k.group == res.group && k.plural == res.plural)
            .filter(|(k, _)| !res.namespaced || ns.is_none_or(|n| k.namespace == n))
            .map(|(_, v)| v.clone())
            .collect()
    }

    /// The objects of a resource after the key `(namespace, name)`, in key order, by reference.
    /// A list page costs what the page holds, not the whole collection (as from etcd's range
    /// read): a paged list of 100,000 objects is not 200 copies of all of them.
    pub fn list_after<'a>(
        &'a self,
        res: &'a ResourceInfo,
        ns: Option<&'a str>,
        after: Option<(&str, &str)>,
    ) -> impl Iterator<Item = &'a Value> + 'a {
        use std::ops::Bound;
        let namespace = |n: &str| {
            if res.namespaced {
                n.to_string()
            } else {
                String::new()
            }
        };
        let start = match after {
            Some((a_ns, a_name)) => Bound::Excluded(ObjKey {
                group: res.group.clone(),
                plural: res.plural.clone(),
                namespace: a_ns.to_string(),
                name: a_name.to_string(),
            }),
            None => Bound::Included(ObjKey {
                group: res.group.clone(),
                plural: res.plural.clone(),
                namespace: ns.map(namespace).unwrap_or_default(),
                name: String::new(),
            }),
        };
        self.objects
            .range((start, Bound::Unbounded))
            .take_while(move |(k, _)| k.group == res.group && k.plural == res.plural)
            .filter(move |(k, _)| !res.namespaced || ns.is_none_or(|n| k.namespace == n))
            .map(|(_, v)| v)
    }

    /// Common preparation of a written object: type fields, ObjectMeta-only metadata,
    /// namespace, pruning.
    fn prepare(
        &self,
        res: &ResourceInfo,
        version: &str,
        ns: Option<&str>,
        obj: &mut Value,
    ) -> Result<(), ApiError> {
        if !obj.is_object() {
            return Err(ApiError::bad_request(format!(
                "the body of the request must be a JSON object describing a {}",
                res.kind
            )));
        }
        obj["apiVersion"] = json!(res.api_version(version));
        obj["kind"] = json!(res.kind);
        meta_mut(obj);
        prune_object_meta(&mut obj["metadata"]);
        let meta = meta_mut(obj);
        if res.namespaced {
            let url_ns = ns.unwrap_or("");
            match meta.get("namespace").and_then(Value::as_str) {
                None | Some("") => {
                    meta.insert("namespace".into(), json!(url_ns));
                }
                Some(n) if n == url_ns => {}
                Some(_) => {
                    return Err(ApiError::bad_request(
                        "the namespace of the provided object does not match the namespace sent on the request",
                    ));
                }
            }
        } else {
            meta.remove("namespace");
        }
        if res.custom
            && let Some(schema) = res.version(version).and_then(|v| v.schema.as_deref())
        {
            prune_root(obj, schema);
            if let Some(cause) = crate::schema::enum_violation(obj, schema) {
                let name = meta_str(obj, "name").unwrap_or("").to_string();
                return Err(ApiError::invalid(&res.group, &res.kind, &name, &cause));
            }
        }
        Ok(())
    }

    fn status_subresource(res: &ResourceInfo, version: &str) -> bool {
        res.version(version).is_some_and(|v| v.status_subresource)
    }

    /// Create an object. `writer` (API writes and `put_json_as`) is recorded in
    /// `metadata.managedFields`; without one (test setup) they are stored as given.
    pub fn create(
        &mut self,
        res: &ResourceInfo,
        version: &str,
        ns: Option<&str>,
        mut obj: Value,
        mode: WriteMode,
        writer: Option<&Writer>,
    ) -> Result<Value, ApiError> {
        self.prepare(res, version, ns, &mut obj)?;
        let direct = mode == WriteMode::Direct;
        if !direct && meta_str(&obj, "resourceVersion").is_some_and(|s| !s.is_empty()) {
            return Err(ApiError::bad_request(
                "resourceVersion should not be set on objects to be created",
            ));
        }
        let mut name = meta_str(&obj, "name").unwrap_or("").to_string();
        if name.is_empty() {
            let Some(prefix) = meta_str(&obj, "generateName").filter(|p| !p.is_empty()) else {
                return Err(ApiError::invalid(
                    &res.group,
                    &res.kind,
                    "",
                    "metadata.name: Required value: name or generateName is required",
                ));
            };
            let prefix = prefix.to_string();
            loop {
                name = format!("{prefix}{}", random_suffix());
                if !self.objects.contains_key(&ObjKey::new(res, ns, &name)) {
                    break;
                }
            }
        }
        let key = ObjKey::new(res, ns, &name);
        if self.objects.contains_key(&key) {
            return Err(ApiError::already_exists(&res.group, &res.plural, &name));
        }
        if mode == WriteMode::Main
            && Self::status_subresource(res, version)
            && let Value::Object(m) = &mut obj
        {
            m.remove("status");
        }
        let rv = self.bump();
        let meta = meta_mut(&mut obj);
        meta.insert("name".into(), json!(name));
        let keep = |meta: &Map<String, Value>, f: &str| {
            direct && meta.get(f).is_some_and(|v| !v.is_null())
        };
        if !keep(meta, "uid") {
            meta.insert("uid".into(), json!(uuid::Uuid::new_v4().to_string()));
        }
        if !keep(meta, "creationTimestamp") {
            meta.insert("creationTimestamp".into(), json!(now_rfc3339()));
        }
        if !direct {
            meta.remove("deletionTimestamp");
            meta.remove("deletionGracePeriodSeconds");
        }
        meta.insert("generation".into(), json!(1));
        meta.insert("resourceVersion".into(), json!(rv.to_string()));
        if let Some(w) = writer {
            let status_sub = Self::status_subresource(res, version);
            managed::record(w, &res.api_version(version), status_sub, None, &mut obj);
        }
        self.objects.insert(key, obj.clone());
        self.record_for(res, EventType::Added, &obj, None);
        Ok(obj)
    }

    /// Replace an object (`mode` says which part). `writer` as for [`create`](Self::create); a
    /// write that changes nothing changes no managedFields either.
    #[allow(clippy::too_many_arguments)]
    pub fn update(
        &mut self,
        res: &ResourceInfo,
        version: &str,
        ns: Option<&str>,
        name: &str,
        mut obj: Value,
        mode: WriteMode,
        allow_unconditional: bool,
        writer: Option<&Writer>,
    ) -> Result<Value, ApiError> {
        let key = ObjKey::new(res, ns, name);
        // Borrowed until the write: the stored object is replaced, not copied.
        let existing = self
            .objects
            .get(&key)
            .ok_or_else(|| ApiError::not_found(&res.group, &res.plural, name))?;
        self.prepare(res, version, ns, &mut obj)?;
        match meta_str(&obj, "name") {
            None | Some("") => {
                meta_mut(&mut obj).insert("name".into(), json!(name));
            }
            Some(n) if n == name => {}
            Some(n) => {
                return Err(ApiError::bad_request(format!(
                    "the name of the object ({n}) does not match the name on the URL ({name})"
                )));
            }
        }
        let current_rv = meta_str(existing, "resourceVersion")
            .unwrap_or("")
            .to_string();
        if mode != WriteMode::Direct {
            match meta_str(&obj, "resourceVersion").filter(|s| !s.is_empty()) {
                Some(rv) if rv != current_rv => {
                    return Err(ApiError::conflict(&res.group, &res.plural, name));
                }
                Some(_) => {}
                None if res.custom && !allow_unconditional => {
                    return Err(ApiError::invalid(
                        &res.group,
                        &res.kind,
                        name,
                        "metadata.resourceVersion: Invalid value: 0x0: must be specified for an update",
                    ));
                }
                None => {}
            }
        }
        let status_sub = Self::status_subresource(res, version);
        let mut new = match mode {
            WriteMode::Status => {
                let mut n = existing.clone();
                n["apiVersion"] = obj["apiVersion"].clone();
                match obj.get("status") {
                    Some(s) => n["status"] = s.clone(),
                    None => {
                        if let Value::Object(m) = &mut n {
                            m.remove("status");
                        }
                    }
                }
                n
            }
            WriteMode::Main if status_sub => {
                if let Value::Object(m) = &mut obj {
                    match existing.get("status") {
                        Some(s) => {
                            m.insert("status".into(), s.clone());
                        }
                        None => {
                            m.remove("status");
                        }
                    }
                }
                obj
            }
            _ => obj,
        };
        // System fields come from the stored object.
        let old_meta = existing.get("metadata").and_then(Value::as_object);
        let direct = mode == WriteMode::Direct;
        {
            let meta = meta_mut(&mut new);
            for f in [
                "uid",
                "creationTimestamp",
                "deletionTimestamp",
                "deletionGracePeriodSeconds",
            ] {
                if direct && meta.get(f).is_some_and(|v| !v.is_null()) {
                    continue;
                }
                match old_meta.and_then(|m| m.get(f)) {
                    Some(v) => {
                        meta.insert(f.into(), v.clone());
                    }
                    None => {
                        meta.remove(f);
                    }
                }
            }
        }
        let deleting = new
            .pointer("/metadata/deletionTimestamp")
            .is_some_and(|v| !v.is_null());
        if deleting && !direct && existing.pointer("/metadata/deletionTimestamp").is_some() {
            let old = finalizers(existing);
            let added: Vec<String> = finalizers(&new)
                .into_iter()
                .filter(|f| !old.contains(f))
                .collect();
            if !added.is_empty() {
                return Err(ApiError::invalid(
                    &res.group,
                    &res.kind,
                    name,
                    &format!(
                        "metadata.finalizers: Forbidden: no new finalizers can be added if the object is being deleted, found new finalizers {added:?}"
                    ),
                ));
            }
        }
        let old_gen = existing
            .pointer("/metadata/generation")
            .and_then(Value::as_i64)
            .unwrap_or(1);
        let generation = if generation_changed(&new, existing, status_sub) {
            old_gen + 1
        } else {
            old_gen
        };
        {
            let meta = meta_mut(&mut new);
            meta.insert("generation".into(), json!(generation));
            meta.insert("resourceVersion".into(), json!(current_rv));
        }
        if let Some(w) = writer {
            managed::record(
                w,
                &res.api_version(version),
                status_sub,
                Some(existing),
                &mut new,
            );
        }
        // With a writer, a change of nothing but managedFields times (an apply of what is
        // there) is no change either: the stored times stay.
        if managed::same_object(&new, existing, writer.is_some()) {
            // No change: the real server answers with the stored object, no new resourceVersion.
            let mut out = existing.clone();
            out["apiVersion"] = new["apiVersion"].clone();
            return Ok(out);
        }
        let rv = self.bump();
        meta_mut(&mut new).insert("resourceVersion".into(), json!(rv.to_string()));
        if deleting && finalizers(&new).is_empty() {
            self.objects.remove(&key);
            self.record_for(res, EventType::Deleted, &new, None);
        } else {
            let prev = self.objects.insert(key, new.clone());
            self.record_for(res, EventType::Modified, &new, prev);
        }
        Ok(new)
    }

    /// Delete: with finalizers, mark the object (deletionTimestamp) and keep it; else remove it.
    pub fn delete(
        &mut self,
        res: &ResourceInfo,
        ns: Option<&str>,
        name: &str,
        options: &Value,
    ) -> Result<Value, ApiError> {
        let key = ObjKey::new(res, ns, name);
        let existing = self
            .objects
            .get(&key)
            .cloned()
            .ok_or_else(|| ApiError::not_found(&res.group, &res.plural, name))?;
        for (field, label) in [("uid", "UID"), ("resourceVersion", "ResourceVersion")] {
            let want = options
                .get("preconditions")
                .and_then(|p| p.get(field))
                .and_then(Value::as_str);
            let have = meta_str(&existing, field).unwrap_or("");
            if let Some(want) = want
                && want != have
            {
                return Err(ApiError::conflict_msg(
                    &res.group,
                    &res.plural,
                    name,
                    &format!(
                        "Precondition failed: {label} in precondition: {want}, {label} in object meta: {have}"
                    ),
                ));
            }
        }
        if !finalizers(&existing).is_empty() {
            if existing
                .pointer("/metadata/deletionTimestamp")
                .is_some_and(|v| !v.is_null())
            {
                return Ok(existing);
            }
            let mut new = existing.clone();
            let rv = self.bump();
            let generation = existing
                .pointer("/metadata/generation")
                .and_then(Value::as_i64)
                .unwrap_or(1);
            let meta = meta_mut(&mut new);
            meta.insert("deletionTimestamp".into(), json!(now_rfc3339()));
            meta.insert("deletionGracePeriodSeconds".into(), json!(0));
            meta.insert("generation".into(), json!(generation + 1));
            meta.insert("resourceVersion".into(), json!(rv.to_string()));
            self.objects.insert(key, new.clone());
            self.record_for(res, EventType::Modified, &new, Some(existing));
            return Ok(new);
        }
        self.objects.remove(&key);
        let rv = self.bump();
        let mut gone = existing;
        meta_mut(&mut gone).insert("resourceVersion".into(), json!(rv.to_string()));
        self.record_for(res, EventType::Deleted, &gone, None);
        Ok(gone)
    }

    /// Register (or re-register) a resource defined by a CRD.
    pub fn register(&mut self, res: ResourceInfo) {
        self.resources
            .insert((res.group.clone(), res.plural.clone()), res);
    }

    /// Forget a CRD's resource and delete all its objects (DELETED events).
    pub fn unregister(&mut self, group: &str, plural: &str) {
        let Some(res) = self
            .resources
            .remove(&(group.to_string(), plural.to_string()))
        else {
            return;
        };
        let keys: Vec<ObjKey> = self
            .objects
            .keys()
            .filter(|k| k.group == group && k.plural == plural)
            .cloned()
            .collect();
        for k in keys {
            if let Some(mut obj) = self.objects.remove(&k) {
                let rv = self.bump();
                meta_mut(&mut obj).insert("resourceVersion".into(), json!(rv.to_string()));
                self.record_for(&res, EventType::Deleted, &obj, None);
            }
        }
    }
}
