//! JSON merge patch (RFC 7386) and JSON patch (RFC 6902).

use serde_json::Value;

/// Apply an RFC 7386 merge patch to `target`.
pub(crate) fn merge_patch(target: &mut Value, patch: &Value) {
    let Value::Object(patch_map) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(Default::default());
    }
    let Value::Object(target_map) = target else {
        return;
    };
    for (key, value) in patch_map {
        if value.is_null() {
            target_map.remove(key);
        } else {
            merge_patch(target_map.entry(key.clone()).or_insert(Value::Null), value);
        }
    }
}

/// Why a JSON patch was not applied.
#[derive(Debug)]
pub(crate) enum JsonPatchError {
    /// The patch document is malformed (the server answers 400).
    Decode(String),
    /// An operation could not be applied, including a failed `test` (the server answers 422).
    Apply(String),
}

fn parse_pointer(path: &str) -> Result<Vec<String>, JsonPatchError> {
    if path.is_empty() {
        return Ok(Vec::new());
    }
    if !path.starts_with('/') {
        return Err(JsonPatchError::Apply(format!(
            "invalid JSON pointer {path:?}"
        )));
    }
    Ok(path[1..]
        .split('/')
        .map(|t| t.replace("~1", "/").replace("~0", "~"))
        .collect())
}

fn array_index(token: &str, len: usize, allow_end: bool) -> Result<usize, JsonPatchError> {
    if allow_end && token == "-" {
        return Ok(len);
    }
    let idx: usize = token
        .parse()
        .map_err(|_| JsonPatchError::Apply(format!("invalid array index {token:?}")))?;
    let max = if allow_end {
        len
    } else {
        len.saturating_sub(1)
    };
    if idx > max || (!allow_end && len == 0) {
        return Err(JsonPatchError::Apply(format!(
            "array index {idx} out of bounds"
        )));
    }
    Ok(idx)
}

fn resolve<'a>(doc: &'a Value, tokens: &[String]) -> Option<&'a Value> {
    let mut cur = doc;
    for t in tokens {
        cur = match cur {
            Value::Object(m) => m.get(t)?,
            Value::Array(a) => a.get(t.parse::<usize>().ok()?)?,
            _ => return None,
        };
    }
    Some(cur)
}

fn resolve_mut<'a>(doc: &'a mut Value, tokens: &[String]) -> Option<&'a mut Value> {
    let mut cur = doc;
    for t in tokens {
        cur = match cur {
            Value::Object(m) => m.get_mut(t)?,
            Value::Array(a) => a.get_mut(t.parse::<usize>().ok()?)?,
            _ => return None,
        };
    }
    Some(cur)
}

fn missing(path: &str) -> JsonPatchError {
    JsonPatchError::Apply(format!("doc is missing path: {path:?}"))
}

fn add(doc: &mut Value, path: &str, value: Value) -> Result<(), JsonPatchError> {
    let tokens = parse_pointer(path)?;
    let Some((last, parent_tokens)) = tokens.split_last() else {
        *doc = value;
        return Ok(());
    };
    let parent = resolve_mut(doc, parent_tokens).ok_or_else(|| missing(path))?;
    match parent {
        Value::Object(m) => {
            m.insert(last.clone(), value);
            Ok(())
        }
        Value::Array(a) => {
            let idx = array_index(last, a.len(), true)?;
            a.insert(idx, value);
            Ok(())
        }
        _ => Err(missing(path)),
    }
}

fn remove(doc: &mut Value, path: &str) -> Result<Value, JsonPatchError> {
    let tokens = parse_pointer(path)?;
    let Some((last, parent_tokens)) = tokens.split_last() else {
        return Err(JsonPatchError::Apply(
            "cannot remove the whole document".into(),
        ));
    };
    let parent = resolve_mut(doc, parent_tokens).ok_or_else(|| missing(path))?;
    match parent {
        Value::Object(m) => m.remove(last).ok_or_else(|| missing(path)),
        Value::Array(a) => {
            let idx = array_index(last, a.len(), false)?;
            Ok(a.remove(idx))
        }
        _ => Err(missing(path)),
    }
}

fn op_str<'a>(op: &'a Value, field: &str) -> Result<&'a str, JsonPatchError> {
    op.get(field)
        .and_then(Value::as_str)
        .ok_or_else(|| JsonPatchError::Decode(format!("operation is missing a string {field:?}")))
}

fn op_value(op: &Value) -> Result<Value, JsonPatchError> {
    op.get("value")
        .cloned()
        .ok_or_else(|| JsonPatchError::Decode("operation is missing \"value\"".into()))
}

/// Apply an RFC 6902 patch (a JSON array of operations) to `doc`. On error `doc` may be
/// partially modified: callers work on a copy.
pub(crate) fn json_patch(doc: &mut Value, patch: &Value) -> Result<(), JsonPatchError> {
    let ops = patch.as_array().ok_or_else(|| {
        JsonPatchError::Decode("a JSON patch must be an array of operations".into())
    })?;
    for op in ops {
        let kind = op_str(op, "op")?;
        let path = op_str(op, "path")?;
        match kind {
            "add" => add(doc, path, op_value(op)?)?,
            "remove" => {
                remove(doc, path)?;
            }
            "replace" => {
                let value = op_value(op)?;
                let tokens = parse_pointer(path)?;
                let target = resolve_mut(doc, &tokens).ok_or_else(|| missing(path))?;
                *target = value;
            }
            "move" => {
                let from = op_str(op, "from")?;
                let v = remove(doc, from)?;
                add(doc, path, v)?;
            }
            "copy" => {
                let from = op_str(op, "from")?;
                let v = resolve(doc, &parse_pointer(from)?)
                    .cloned()
                    .ok_or_else(|| missing(from))?;
                add(doc, path, v)?;
            }
            "test" => {
                let expected = op_value(op)?;
                let actual = resolve(doc, &parse_pointer(path)?).ok_or_else(|| missing(path))?;
                if *actual != expected {
                    return Err(JsonPatchError::Apply(format!(
                        "testing value {path} failed: test failed"
                    )));
                }
            }
            other => {
                return Err(JsonPatchError::Decode(format!(
                    "unexpected operation {other:?}"
                )));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn merge_patch_rfc7386() {
        let mut t = json!({"a": "b", "c": {"d": "e", "f": "g"}, "l": [1, 2]});
        merge_patch(&mut t, &json!({"a": "z", "c": {"f": null}, "l": [3]}));
        assert_eq!(t, json!({"a": "z", "c": {"d": "e"}, "l": [3]}));
    }

    #[test]
    fn json_patch_ops() {
        let mut d = json!({"a": {"b": [1, 2]}, "x~y": 1});
        json_patch(
            &mut d,
            &json!([
                {"op": "add", "path": "/a/b/-", "value": 3},
                {"op": "add", "path": "/a/b/0", "value": 0},
                {"op": "remove", "path": "/x~0y"},
                {"op": "copy", "from": "/a/b", "path": "/c"},
                {"op": "move", "from": "/c", "path": "/d"},
                {"op": "replace", "path": "/a/b/1", "value": 9},
                {"op": "test", "path": "/d/3", "value": 3}
            ]),
        )
        .unwrap();
        assert_eq!(d, json!({"a": {"b": [0, 9, 2, 3]}, "d": [0, 1, 2, 3]}));
        assert!(matches!(
            json_patch(&mut d, &json!([{"op": "test", "path": "/d/0", "value": 5}])),
            Err(JsonPatchError::Apply(_))
        ));
        assert!(matches!(
            json_patch(&mut d, &json!({"op": "add"})),
            Err(JsonPatchError::Decode(_))
        ));
    }
}
