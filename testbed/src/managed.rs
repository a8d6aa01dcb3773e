//! `metadata.managedFields`: which manager owns which fields, recorded on every write the way a
//! real API server's field manager does it (one entry per manager, operation, subresource and,
//! for updates, apiVersion; the owned fields as a `FieldsV1` set).
//!
//! `FieldsV1` encoding: an object field `x` is `"f:x": {...its owned children...}`, a leaf
//! (scalar, list, empty object) `"f:x": {}`; a field that is owned itself and also has owned
//! children (an object the manager added) carries a `".": {}` member as well. Lists are
//! atomic here (the real server keys associative lists such as `ownerReferences` with
//! `k:{...}` and sets such as `finalizers` with `v:...`); such keys in client-supplied sets are
//! kept as opaque path elements.

use serde_json::{Map, Value, json};
use std::collections::BTreeMap;

/// `metadata` fields no manager ever owns (the real server strips these from every set).
const SYSTEM_META: &[&str] = &[
    "name",
    "namespace",
    "uid",
    "resourceVersion",
    "generation",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "selfLink",
    "managedFields",
];

/// What kind of write recorded an entry.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Operation {
    /// create, PUT, merge/strategic/JSON patch.
    Update,
    /// Server-side apply, with the applied configuration.
    Apply(Value),
}

impl Operation {
    fn as_str(&self) -> &'static str {
        match self {
            Operation::Update => "Update",
            Operation::Apply(_) => "Apply",
        }
    }
}

/// Who writes, and how: the owner of the fields the write sets.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Writer {
    pub manager: String,
    pub operation: Operation,
    /// `Some("status")` for a write to the `/status` subresource.
    pub subresource: Option<String>,
}

impl Writer {
    pub fn update(manager: &str, subresource: Option<&str>) -> Self {
        Writer {
            manager: manager.to_string(),
            operation: Operation::Update,
            subresource: subresource.map(str::to_string),
        }
    }

    fn status(&self) -> bool {
        self.subresource.as_deref() == Some("status")
    }
}

/// The manager of an API request: the `fieldManager` query parameter if non-empty, else the
/// User-Agent up to its first `/` (printable characters, at most 128), else `"unknown"`.
pub(crate) fn manager_name(field_manager: Option<&str>, user_agent: Option<&str>) -> String {
    if let Some(m) = field_manager.filter(|m| !m.is_empty()) {
        return m.to_string();
    }
    let prefix: String = user_agent
        .unwrap_or("")
        .split('/')
        .next()
        .unwrap_or("")
        .chars()
        .filter(|c| !c.is_control())
        .take(128)
        .collect();
    if prefix.is_empty() {
        "unknown".to_string()
    } else {
        prefix
    }
}

/// Which top-level fields a write may own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scope {
    All,
    /// A main-resource write of a resource with the status subresource.
    NoStatus,
    /// A `/status` write.
    StatusOnly,
}

impl Scope {
    fn of(writer: &Writer, status_subresource: bool) -> Scope {
        if writer.status() {
            Scope::StatusOnly
        } else if status_subresource {
            Scope::NoStatus
        } else {
            Scope::All
        }
    }

    fn allows(self, top: &str) -> bool {
        match top {
            "apiVersion" | "kind" => false,
            "status" => self != Scope::NoStatus,
            _ => self != Scope::StatusOnly,
        }
    }
}

fn f(name: &str) -> String {
    format!("f:{name}")
}

/// A set of fields as a tree: each node a field (its key as `FieldsV1` writes it: `"f:spec"`,
/// or a `k:`/`v:`/`i:` element of a client-supplied set), `member` when the field itself is in
/// the set. Empty nodes are not kept.
#[derive(Debug, Default, Clone, PartialEq)]
struct Fields {
    member: bool,
    children: BTreeMap<String, Fields>,
}

impl Fields {
    fn leaf() -> Fields {
        Fields {
            member: true,
            children: BTreeMap::new(),
        }
    }

    fn is_empty(&self) -> bool {
        !self.member && self.children.is_empty()
    }

    /// Decode a `FieldsV1` value (`{}`: a leaf; `".": {}`: the field itself besides children).
    fn decode(v: &Value) -> Fields {
        let mut node = Fields::default();
        if let Value::Object(m) = v {
            for (k, c) in m {
                if k == "." {
                    node.member = true;
                    continue;
                }
                let mut child = Fields::decode(c);
                if c.as_object().is_none_or(Map::is_empty) {
                    child.member = true;
                }
                node.children.insert(k.clone(), child);
            }
        }
        node
    }

    fn encode(&self) -> Value {
        let mut m = Map::new();
        if self.member && !self.children.is_empty() {
            m.insert(".".into(), json!({}));
        }
        for (k, c) in &self.children {
            m.insert(k.clone(), c.encode());
        }
        Value::Object(m)
    }

    fn union(&mut self, other: Fields) {
        self.member |= other.member;
        for (k, c) in other.children {
            match self.children.get_mut(&k) {
                Some(mine) => mine.union(c),
                None => {
                    self.children.insert(k, c);
                }
            }
        }
    }

    /// Remove the fields of `taken` and everything under them; whether anything went.
    fn remove(&mut self, taken: &Fields) -> bool {
        let mut changed = false;
        for (k, t) in &taken.children {
            let Some(mine) = self.children.get_mut(k) else {
                continue;
            };
            if t.member {
                self.children.remove(k);
                changed = true;
            } else if mine.remove(t) {
                changed = true;
                if mine.is_empty() {
                    self.children.remove(k);
                }
            }
        }
        changed
    }

    /// Keep only the fields `obj` has (a non-`f:` element is not resolved: kept); whether
    /// anything went.
    fn retain_existing(&mut self, obj: &Value) -> bool {
        let mut changed = false;
        self.children.retain(|k, c| {
            let Some(name) = k.strip_prefix("f:") else {
                return true;
            };
            match obj.get(name) {
                Some(v) => {
                    if c.retain_existing(v) {
                        changed = true;
                    }
                    if c.is_empty() {
                        changed = true;
                        false
                    } else {
                        true
                    }
                }
                None => {
                    changed = true;
                    false
                }
            }
        });
        changed
    }
}

/// The set of `per(old, new)` over every top-level field and every non-system metadata field
/// the scope allows (the `metadata` object itself is never owned).
fn owned_roots(
    scope: Scope,
    old: Option<&Value>,
    new: &Value,
    per: impl Fn(Option<&Value>, &Value) -> Option<Fields>,
) -> Fields {
    let mut root = Fields::default();
    let Value::Object(m) = new else { return root };
    for (k, v) in m {
        if !scope.allows(k) {
            continue;
        }
        let o = old.and_then(|o| o.get(k));
        let child = if k == "metadata" {
            let mut node = Fields::default();
            if let Value::Object(meta) = v {
                for (mk, mv) in meta {
                    if SYSTEM_META.contains(&mk.as_str()) {
                        continue;
                    }
                    if let Some(c) = per(o.and_then(|o| o.get(mk)), mv) {
                        node.children.insert(f(mk), c);
                    }
                }
            }
            (!node.is_empty()).then_some(node)
        } else {
            per(o, v)
        };
        if let Some(c) = child {
            root.children.insert(f(k), c);
        }
    }
    root
}

/// Fields of `new` a write changed or added, compared with `old` (none: a create): leaves
/// whose value differs, and objects that were not there (or not objects) before.
fn changed_fields(scope: Scope, old: Option<&Value>, new: &Value) -> Fields {
    fn diff(old: Option<&Value>, new: &Value) -> Option<Fields> {
        match new {
            Value::Object(m) => {
                let old = old.and_then(Value::as_object);
                let mut node = Fields {
                    member: old.is_none(),
                    children: BTreeMap::new(),
                };
                for (k, v) in m {
                    if let Some(c) = diff(old.and_then(|o| o.get(k)), v) {
                        node.children.insert(f(k), c);
                    }
                }
                (!node.is_empty()).then_some(node)
            }
            _ => (old != Some(new)).then(Fields::leaf),
        }
    }
    owned_roots(scope, old, new, diff)
}

/// Fields present in an applied configuration: its leaves (and empty objects); `null`s
/// (removals) are not owned.
fn applied_fields(scope: Scope, applied: &Value) -> Fields {
    fn present(v: &Value) -> Option<Fields> {
        match v {
            Value::Null => None,
            Value::Object(m) if !m.is_empty() => {
                let mut node = Fields::default();
                for (k, c) in m {
                    if let Some(c) = present(c) {
                        node.children.insert(f(k), c);
                    }
                }
                (!node.is_empty()).then_some(node)
            }
            _ => Some(Fields::leaf()),
        }
    }
    owned_roots(scope, None, applied, |_, v| present(v))
}

/// One managedFields entry being worked on.
struct Entry {
    raw: Map<String, Value>,
    fields: Fields,
    changed: bool,
}

impl Entry {
    fn parse(v: Value) -> Option<Entry> {
        let Value::Object(raw) = v else { return None };
        let fields = raw.get("fieldsV1").map(Fields::decode).unwrap_or_default();
        Some(Entry {
            raw,
            fields,
            changed: false,
        })
    }

    fn new(w: &Writer, api_version: &str) -> Entry {
        let mut raw = Map::new();
        raw.insert("manager".into(), json!(w.manager));
        raw.insert("operation".into(), json!(w.operation.as_str()));
        raw.insert("apiVersion".into(), json!(api_version));
        raw.insert("fieldsType".into(), json!("FieldsV1"));
        if let Some(s) = &w.subresource {
            raw.insert("subresource".into(), json!(s));
        }
        Entry {
            raw,
            fields: Fields::default(),
            changed: true,
        }
    }

    fn str(&self, key: &str) -> &str {
        self.raw.get(key).and_then(Value::as_str).unwrap_or("")
    }

    /// The writer's own entry: same manager, operation, subresource and (updates only, as on
    /// the real server) apiVersion.
    fn is_of(&self, w: &Writer, api_version: &str) -> bool {
        self.str("manager") == w.manager
            && self.str("operation") == w.operation.as_str()
            && self.str("subresource") == w.subresource.as_deref().unwrap_or("")
            && (matches!(w.operation, Operation::Apply(_)) || self.str("apiVersion") == api_version)
    }

    fn sort_key(&self) -> [&str; 5] {
        ["operation", "time", "manager", "apiVersion", "subresource"].map(|k| self.str(k))
    }

    fn into_value(mut self) -> Value {
        if self.changed {
            self.raw.insert("fieldsV1".into(), self.fields.encode());
            self.raw
                .entry("fieldsType")
                .or_insert_with(|| json!("FieldsV1"));
        }
        Value::Object(self.raw)
    }
}

/// The managedFields a write starts from (taken out of `new`): the list the client sent if it
/// sent one (not through `/status`, where the stored ones always count), else the stored ones.
/// `[]` (or `[{}]`, an entry owning nothing) thus resets them.
fn start_from(w: &Writer, stored: Option<&Value>, new: &mut Value) -> Vec<Value> {
    let sent = new
        .get_mut("metadata")
        .and_then(Value::as_object_mut)
        .and_then(|m| m.remove("managedFields"))
        .filter(|v| !v.is_null());
    let list = match sent {
        Some(s) if !w.status() => s,
        _ => stored.cloned().unwrap_or(Value::Null),
    };
    match list {
        Value::Array(a) => a,
        _ => Vec::new(),
    }
}

/// Record a write in `new`'s `metadata.managedFields`. `old` is the stored object (`None` for
/// a create); `new` is the object to be stored, with every other field final, and with the
/// managedFields as the request sent them (or as patched onto the stored object).
pub(crate) fn record(
    w: &Writer,
    api_version: &str,
    status_subresource: bool,
    old: Option<&Value>,
    new: &mut Value,
) {
    let stored = old.and_then(|o| o.pointer("/metadata/managedFields"));
    let scope = Scope::of(w, status_subresource);
    let mut entries: Vec<Entry> = start_from(w, stored, new)
        .into_iter()
        .filter_map(Entry::parse)
        .collect();
    let changed = changed_fields(scope, old, new);
    let own = entries.iter().position(|e| e.is_of(w, api_version));
    // What this write changed is no longer anybody else's.
    for (i, e) in entries.iter_mut().enumerate() {
        if Some(i) != own && e.fields.remove(&changed) {
            e.changed = true;
        }
    }
    let now = || json!(crate::store::now_rfc3339());
    let take = |entries: &mut Vec<Entry>| -> usize {
        match own {
            Some(i) => i,
            None => {
                entries.push(Entry::new(w, api_version));
                entries.len() - 1
            }
        }
    };
    match &w.operation {
        Operation::Update => {
            if !changed.is_empty() {
                let i = take(&mut entries);
                let e = &mut entries[i];
                e.fields.union(changed);
                e.changed = true;
                e.raw.insert("apiVersion".into(), json!(api_version));
                e.raw.insert("time".into(), now());
            }
        }
        Operation::Apply(applied) => {
            let i = take(&mut entries);
            let e = &mut entries[i];
            e.fields = applied_fields(scope, applied);
            e.changed = true;
            e.raw.insert("apiVersion".into(), json!(api_version));
            e.raw.insert("time".into(), now());
        }
    }
    // Fields the object no longer has are nobody's.
    for e in &mut entries {
        if e.fields.retain_existing(new) {
            e.changed = true;
        }
    }
    entries.retain(|e| !e.fields.is_empty());
    // The real server's order: operation, time, manager, apiVersion, subresource.
    entries.sort_by(|a, b| a.sort_key().cmp(&b.sort_key()));
    let list: Vec<Value> = entries.into_iter().map(Entry::into_value).collect();
    if let Some(meta) = new.get_mut("metadata").and_then(Value::as_object_mut) {
        if list.is_empty() {
            meta.remove("managedFields");
        } else {
            meta.insert("managedFields".into(), Value::Array(list));
        }
    }
}

/// `a` and `b` are the same object, up to `apiVersion` (a write through another version) and,
/// with `ignore_times`, the `time` of managedFields entries: a write that changes nothing but
/// those times is a no-op (the real server then keeps the stored times and writes nothing).
pub(crate) fn same_object(a: &Value, b: &Value, ignore_times: bool) -> bool {
    fn same_entry(x: &Value, y: &Value) -> bool {
        match (x, y) {
            (Value::Object(x), Value::Object(y)) => {
                let keys = |m: &'_ Map<String, Value>| m.keys().filter(|k| *k != "time").count();
                keys(x) == keys(y)
                    && x.iter()
                        .filter(|(k, _)| *k != "time")
                        .all(|(k, v)| y.get(k) == Some(v))
            }
            _ => x == y,
        }
    }
    fn same_meta(x: &Value, y: &Value, ignore_times: bool) -> bool {
        let (Value::Object(x), Value::Object(y)) = (x, y) else {
            return x == y;
        };
        x.len() == y.len()
            && x.iter().all(|(k, v)| match y.get(k) {
                None => false,
                Some(w) if k == "managedFields" && ignore_times => {
                    match (v.as_array(), w.as_array()) {
                        (Some(v), Some(w)) => {
                            v.len() == w.len() && v.iter().zip(w).all(|(p, q)| same_entry(p, q))
                        }
                        _ => v == w,
                    }
                }
                Some(w) => v == w,
            })
    }
    let (Value::Object(a), Value::Object(b)) = (a, b) else {
        return a == b;
    };
    let keys = |m: &'_ Map<String, Value>| m.keys().filter(|k| *k != "apiVersion").count();
    keys(a) == keys(b)
        && a.iter()
            .filter(|(k, _)| *k != "apiVersion")
            .all(|(k, v)| match b.get(k) {
                None => false,
                Some(w) if k == "metadata" => same_meta(v, w, ignore_times),
                Some(w) => v == w,
            })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(entry: &Value) -> &Value {
        &entry["fieldsV1"]
    }

    #[test]
    fn manager_from_field_manager_or_user_agent() {
        assert_eq!(manager_name(Some("fm"), Some("ua/1.0")), "fm");
        assert_eq!(
            manager_name(Some(""), Some("kubectl/v1.30 (linux)")),
            "kubectl"
        );
        assert_eq!(manager_name(None, None), "unknown");
        assert_eq!(manager_name(None, Some("")), "unknown");
        assert_eq!(manager_name(None, Some(&"x".repeat(300))).len(), 128);
    }

    #[test]
    fn encode_decode_round_trip_with_members() {
        let v = json!({"f:metadata": {"f:labels": {".": {}, "f:a": {}}},
                       "f:spec": {"f:l": {}, "f:m": {".": {}, "k:{\"uid\":\"1\"}": {".": {}, "f:x": {}}}}});
        let set = Fields::decode(&v);
        assert!(set.children["f:metadata"].children["f:labels"].member);
        assert!(!set.children["f:metadata"].member);
        assert!(set.children["f:spec"].children["f:l"].member);
        assert_eq!(set.encode(), v);
    }

    #[test]
    fn create_owns_everything_but_system_fields() {
        let w = Writer::update("creator", None);
        let mut obj = json!({"apiVersion": "g/v1", "kind": "K",
            "metadata": {"name": "n", "namespace": "ns", "uid": "u", "resourceVersion": "1",
                         "generation": 1, "creationTimestamp": "t", "labels": {"a": "1"},
                         "finalizers": ["x"]},
            "spec": {"a": 1, "o": {"b": [1, 2]}, "e": {}}});
        record(&w, "g/v1", false, None, &mut obj);
        let mf = obj["metadata"]["managedFields"].as_array().unwrap();
        assert_eq!(mf.len(), 1);
        assert_eq!(mf[0]["manager"], "creator");
        assert_eq!(mf[0]["operation"], "Update");
        assert_eq!(mf[0]["apiVersion"], "g/v1");
        assert_eq!(mf[0]["fieldsType"], "FieldsV1");
        assert!(mf[0].get("subresource").is_none());
        assert_eq!(
            fields(&mf[0]),
            &json!({"f:metadata": {"f:finalizers": {}, "f:labels": {".": {}, "f:a": {}}},
                    "f:spec": {".": {}, "f:a": {}, "f:e": {}, "f:o": {".": {}, "f:b": {}}}})
        );
    }

    #[test]
    fn update_takes_changed_fields_and_drops_removed_ones() {
        let mut old = json!({"metadata": {"name": "n"}, "spec": {"a": 1, "b": 2, "c": 3}});
        record(&Writer::update("one", None), "v1", false, None, &mut old);
        let mut new = old.clone();
        new["spec"] = json!({"a": 1, "b": 20});
        record(
            &Writer::update("two", None),
            "v1",
            false,
            Some(&old),
            &mut new,
        );
        let mf = new["metadata"]["managedFields"].as_array().unwrap();
        assert_eq!(mf.len(), 2);
        let by = |m: &str| mf.iter().find(|e| e["manager"] == m).unwrap();
        assert_eq!(fields(by("one")), &json!({"f:spec": {".": {}, "f:a": {}}}));
        assert_eq!(fields(by("two")), &json!({"f:spec": {"f:b": {}}}));
        // Removing the last field "one" owns drops its entry.
        let mut newer = new.clone();
        newer["spec"] = json!({"b": 20});
        newer["metadata"]["managedFields"] = json!([by("two").clone()]);
        record(
            &Writer::update("two", None),
            "v1",
            false,
            Some(&new),
            &mut newer,
        );
        let mf = newer["metadata"]["managedFields"].as_array().unwrap();
        assert_eq!(mf.len(), 1);
        assert_eq!(mf[0]["manager"], "two");
    }

    #[test]
    fn reset_and_time_only_differences() {
        let mut old = json!({"metadata": {"name": "n"}, "spec": {"a": 1}});
        record(&Writer::update("one", None), "v1", false, None, &mut old);
        let mut new = old.clone();
        new["metadata"]["managedFields"] = json!([]);
        new["spec"]["a"] = json!(2);
        record(
            &Writer::update("two", None),
            "v1",
            false,
            Some(&old),
            &mut new,
        );
        let mf = new["metadata"]["managedFields"].as_array().unwrap();
        assert_eq!(mf.len(), 1);
        assert_eq!(mf[0]["manager"], "two");
        let mut later = new.clone();
        later["metadata"]["managedFields"][0]["time"] = json!("2000-01-01T00:00:00Z");
        assert!(same_object(&new, &later, true));
        assert!(!same_object(&new, &later, false));
        later["apiVersion"] = json!("v2");
        assert!(same_object(&new, &later, true));
        later["spec"]["a"] = json!(3);
        assert!(!same_object(&new, &later, true));
    }
}
