//! Pruning of unknown fields, the way the API server applies a CRD's structural `openAPIV3Schema`.

use serde_json::{Map, Value};

/// Fields of `ObjectMeta`; everything else under `metadata` is dropped on every write.
pub(crate) const OBJECT_META_FIELDS: &[&str] = &[
    "name",
    "generateName",
    "namespace",
    "selfLink",
    "uid",
    "resourceVersion",
    "generation",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "labels",
    "annotations",
    "ownerReferences",
    "finalizers",
    "managedFields",
];

/// Keep only the standard `ObjectMeta` fields of `metadata` (if it is an object).
pub(crate) fn prune_object_meta(meta: &mut Value) {
    if let Value::Object(m) = meta {
        m.retain(|k, _| OBJECT_META_FIELDS.contains(&k.as_str()));
    }
}

fn preserves_unknown(schema: &Value) -> bool {
    schema
        .get("x-kubernetes-preserve-unknown-fields")
        .and_then(Value::as_bool)
        .unwrap_or(false)
}

/// Prune a whole custom resource against its version's `openAPIV3Schema`.
///
/// `apiVersion`, `kind` and `metadata` are always kept at the root (metadata is reduced to
/// `ObjectMeta` fields by the caller); every other field must be declared by the schema.
pub(crate) fn prune_root(obj: &mut Value, schema: &Value) {
    let Value::Object(map) = obj else { return };
    let keep_unknown = preserves_unknown(schema);
    let props = schema.get("properties").and_then(Value::as_object);
    let additional = schema.get("additionalProperties");
    let keys: Vec<String> = map.keys().cloned().collect();
    for key in keys {
        if matches!(key.as_str(), "apiVersion" | "kind" | "metadata") {
            continue;
        }
        prune_entry(map, &key, props, additional, keep_unknown);
    }
}

fn prune_entry(
    map: &mut Map<String, Value>,
    key: &str,
    props: Option<&Map<String, Value>>,
    additional: Option<&Value>,
    keep_unknown: bool,
) {
    if let Some(sub) = props.and_then(|p| p.get(key)) {
        if let Some(v) = map.get_mut(key) {
            prune(v, sub);
        }
        return;
    }
    match additional {
        Some(Value::Object(_)) => {
            let sub = additional.cloned().unwrap_or(Value::Null);
            if let Some(v) = map.get_mut(key) {
                prune(v, &sub);
            }
        }
        Some(Value::Bool(true)) => {}
        _ if keep_unknown => {}
        _ => {
            map.remove(key);
        }
    }
}

/// Prune `value` against `schema` (recursive through properties, additionalProperties and items).
pub(crate) fn prune(value: &mut Value, schema: &Value) {
    match value {
        Value::Object(map) => {
            let embedded = schema
                .get("x-kubernetes-embedded-resource")
                .and_then(Value::as_bool)
                .unwrap_or(false);
            let props = schema.get("properties").and_then(Value::as_object);
            let additional = schema.get("additionalProperties");
            // A schema that says nothing about the object's fields (no properties, no
            // additionalProperties) prunes everything unless unknown fields are preserved.
            let keep_unknown = preserves_unknown(schema);
            let keys: Vec<String> = map.keys().cloned().collect();
            for key in keys {
                if embedded && matches!(key.as_str(), "apiVersion" | "kind") {
                    continue;
                }
                if embedded && key == "metadata" {
                    if let Some(m) = map.get_mut("metadata") {
                        prune_object_meta(m);
                    }
                    continue;
                }
                prune_entry(map, &key, props, additional, keep_unknown);
            }
        }
        Value::Array(items) => {
            if let Some(item_schema) = schema.get("items") {
                for item in items.iter_mut() {
                    prune(item, item_schema);
                }
            }
        }
        _ => {}
    }
}

/// The first value outside its schema's `enum`, as the API server's validation reports it
/// (`status.phase: Unsupported value: "Accepted": supported values: "New", "InProgress"`), or
/// `None`. Walks properties, additionalProperties and items like pruning; run after it.
pub(crate) fn enum_violation(obj: &Value, schema: &Value) -> Option<String> {
    fn walk(value: &Value, schema: &Value, path: &str) -> Option<String> {
        if let Some(allowed) = schema.get("enum").and_then(Value::as_array)
            && !value.is_null()
            && !allowed.contains(value)
        {
            let list: Vec<String> = allowed.iter().map(Value::to_string).collect();
            return Some(format!(
                "{path}: Unsupported value: {value}: supported values: {}",
                list.join(", ")
            ));
        }
        match value {
            Value::Object(map) => map.iter().find_map(|(k, v)| {
                let sub = schema
                    .get("properties")
                    .and_then(|p| p.get(k))
                    .or_else(|| schema.get("additionalProperties").filter(|a| a.is_object()))?;
                let p = if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                };
                walk(v, sub, &p)
            }),
            Value::Array(items) => {
                let sub = schema.get("items")?;
                items
                    .iter()
                    .enumerate()
                    .find_map(|(i, v)| walk(v, sub, &format!("{path}[{i}]")))
            }
            _ => None,
        }
    }
    walk(obj, schema, "")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn prunes_recursively_and_preserves_where_told() {
        let schema = json!({
            "type": "object",
            "properties": {
                "spec": {"type": "object", "properties": {
                    "a": {"type": "string"},
                    "m": {"type": "object", "additionalProperties": {"type": "string"}},
                    "l": {"type": "array", "items": {"type": "object", "properties": {"x": {"type": "integer"}}}},
                    "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": true,
                              "properties": {"known": {"type": "object", "properties": {"k": {"type": "string"}}}}}
                }}
            }
        });
        let mut obj = json!({
            "apiVersion": "g/v1", "kind": "K", "metadata": {"name": "n"},
            "status": {"phase": "x"},
            "spec": {"a": "1", "b": 2, "m": {"k1": "v"}, "l": [{"x": 1, "y": 2}],
                     "free": {"anything": {"deep": 1}, "known": {"k": "v", "drop": 1}}}
        });
        prune_root(&mut obj, &schema);
        assert_eq!(enum_violation(&obj, &schema), None);
        assert_eq!(
            obj,
            json!({
                "apiVersion": "g/v1", "kind": "K", "metadata": {"name": "n"},
                "spec": {"a": "1", "m": {"k1": "v"}, "l": [{"x": 1}],
                         "free": {"anything": {"deep": 1}, "known": {"k": "v"}}}
            })
        );
    }

    #[test]
    fn a_value_outside_an_enum_is_reported_as_the_api_server_does() {
        let schema = json!({"type": "object", "properties": {"status": {"type": "object", "properties": {
            "phase": {"type": "string", "enum": ["New", "InProgress", "Completed", "Failed"]}}}}});
        let ok = json!({"status": {"phase": "InProgress"}});
        assert_eq!(enum_violation(&ok, &schema), None);
        let bad = json!({"status": {"phase": "Accepted"}});
        assert_eq!(
            enum_violation(&bad, &schema).as_deref(),
            Some(
                r#"status.phase: Unsupported value: "Accepted": supported values: "New", "InProgress", "Completed", "Failed""#
            )
        );
    }
}
