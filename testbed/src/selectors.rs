//! Label and field selectors (the query-string syntax of `labelSelector` / `fieldSelector`).

use crate::error::ApiError;
use serde_json::Value;

#[derive(Debug, Clone, PartialEq)]
enum LabelReq {
    Eq(String, String),
    NotEq(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    NotExists(String),
}

/// A parsed `labelSelector`.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct LabelSelector(Vec<LabelReq>);

/// Split on commas that are not inside parentheses.
fn split_top_level(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut depth = 0i32;
    let mut cur = String::new();
    for c in s.chars() {
        match c {
            '(' => {
                depth += 1;
                cur.push(c);
            }
            ')' => {
                depth -= 1;
                cur.push(c);
            }
            ',' if depth == 0 => out.push(std::mem::take(&mut cur)),
            _ => cur.push(c),
        }
    }
    out.push(cur);
    out
}

fn bad_label(s: &str) -> ApiError {
    ApiError::bad_request(format!(
        "unable to parse requirement: invalid label selector {s:?}"
    ))
}

impl LabelSelector {
    pub(crate) fn parse(s: &str) -> Result<Self, ApiError> {
        let mut reqs = Vec::new();
        if s.trim().is_empty() {
            return Ok(LabelSelector(reqs));
        }
        for term in split_top_level(s) {
            let term = term.trim();
            if term.is_empty() {
                return Err(bad_label(s));
            }
            if let Some(key) = term.strip_prefix('!') {
                reqs.push(LabelReq::NotExists(key.trim().to_string()));
            } else if let Some(open) = term.find('(') {
                let close = term.rfind(')').ok_or_else(|| bad_label(s))?;
                let head: Vec<&str> = term[..open].split_whitespace().collect();
                let values: Vec<String> = term[open + 1..close]
                    .split(',')
                    .map(|v| v.trim().to_string())
                    .filter(|v| !v.is_empty())
                    .collect();
                match head.as_slice() {
                    [key, "in"] => reqs.push(LabelReq::In(key.to_string(), values)),
                    [key, "notin"] => reqs.push(LabelReq::NotIn(key.to_string(), values)),
                    _ => return Err(bad_label(s)),
                }
            } else if let Some((k, v)) = term.split_once("!=") {
                reqs.push(LabelReq::NotEq(k.trim().into(), v.trim().into()));
            } else if let Some((k, v)) = term.split_once("==") {
                reqs.push(LabelReq::Eq(k.trim().into(), v.trim().into()));
            } else if let Some((k, v)) = term.split_once('=') {
                reqs.push(LabelReq::Eq(k.trim().into(), v.trim().into()));
            } else if term.contains(char::is_whitespace) {
                return Err(bad_label(s));
            } else {
                reqs.push(LabelReq::Exists(term.to_string()));
            }
        }
        Ok(LabelSelector(reqs))
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub(crate) fn matches(&self, obj: &Value) -> bool {
        let labels = obj.pointer("/metadata/labels").and_then(Value::as_object);
        let get = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
        self.0.iter().all(|r| match r {
            LabelReq::Eq(k, v) => get(k) == Some(v.as_str()),
            LabelReq::NotEq(k, v) => get(k) != Some(v.as_str()),
            LabelReq::In(k, vs) => get(k).is_some_and(|x| vs.iter().any(|v| v == x)),
            LabelReq::NotIn(k, vs) => !get(k).is_some_and(|x| vs.iter().any(|v| v == x)),
            LabelReq::Exists(k) => get(k).is_some(),
            LabelReq::NotExists(k) => get(k).is_none(),
        })
    }
}

/// A parsed `fieldSelector` (`path=value`, `path==value`, `path!=value`, comma separated).
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct FieldSelector(Vec<(String, bool, String)>);

impl FieldSelector {
    /// Parse and check every field against `supported` (dotted paths such as `spec.nodeName`).
    pub(crate) fn parse(s: &str, supported: &[String]) -> Result<Self, ApiError> {
        let mut reqs = Vec::new();
        if s.trim().is_empty() {
            return Ok(FieldSelector(reqs));
        }
        for term in s.split(',') {
            let term = term.trim();
            let (field, equal, value) = if let Some((f, v)) = term.split_once("!=") {
                (f, false, v)
            } else if let Some((f, v)) = term.split_once("==") {
                (f, true, v)
            } else if let Some((f, v)) = term.split_once('=') {
                (f, true, v)
            } else {
                return Err(ApiError::bad_request(format!(
                    "invalid selector: '{s}'; can't understand '{term}'"
                )));
            };
            let field = field.trim();
            if !supported.iter().any(|f| f == field) {
                return Err(ApiError::bad_request(format!(
                    "field label not supported: {field}"
                )));
            }
            reqs.push((field.to_string(), equal, value.trim().to_string()));
        }
        Ok(FieldSelector(reqs))
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub(crate) fn matches(&self, obj: &Value) -> bool {
        self.0.iter().all(|(field, equal, value)| {
            let mut cur = Some(obj);
            for part in field.split('.') {
                cur = cur.and_then(|c| c.get(part));
            }
            let actual = match cur {
                None | Some(Value::Null) => String::new(),
                Some(Value::String(s)) => s.clone(),
                Some(other) => other.to_string(),
            };
            (actual == *value) == *equal
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn label_selector_syntax() {
        let obj = json!({"metadata": {"labels": {"a": "1", "b": "x"}}});
        let m = |s: &str| LabelSelector::parse(s).unwrap().matches(&obj);
        assert!(m(""));
        assert!(m("a=1"));
        assert!(m("a==1,b"));
        assert!(!m("a!=1"));
        assert!(m("c!=1"));
        assert!(m("b in (x, y),a"));
        assert!(!m("b notin (x,y)"));
        assert!(m("c notin (x)"));
        assert!(m("!c"));
        assert!(!m("!a"));
        assert!(LabelSelector::parse("a in x").is_err());
    }

    #[test]
    fn field_selector_syntax() {
        let supported = vec!["metadata.name".to_string(), "spec.nodeName".to_string()];
        let obj = json!({"metadata": {"name": "p"}, "spec": {"nodeName": "n1"}});
        let m = |s: &str| FieldSelector::parse(s, &supported).unwrap().matches(&obj);
        assert!(m("metadata.name=p,spec.nodeName==n1"));
        assert!(!m("spec.nodeName!=n1"));
        assert!(FieldSelector::parse("spec.other=x", &supported).is_err());
    }
}
