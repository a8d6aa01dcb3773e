//! TokenReview and SubjectAccessReview answers, configured by the test.

use serde_json::{Value, json};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

/// The user a valid token authenticates as.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UserInfo {
    pub username: String,
    pub uid: String,
    pub groups: Vec<String>,
    pub extra: BTreeMap<String, Vec<String>>,
}

impl UserInfo {
    pub fn new(username: &str, groups: &[&str]) -> Self {
        UserInfo {
            username: username.to_string(),
            groups: groups.iter().map(|g| g.to_string()).collect(),
            ..Default::default()
        }
    }
}

/// What a SubjectAccessReview asks about.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AccessRequest {
    pub user: String,
    pub groups: Vec<String>,
    pub verb: String,
    pub group: String,
    pub resource: String,
    pub subresource: String,
    pub namespace: String,
    pub name: String,
    /// For non-resource requests (`nonResourceAttributes.path`), else empty.
    pub path: String,
}

/// Decides SubjectAccessReviews.
pub type Authorizer = Arc<dyn Fn(&AccessRequest) -> bool + Send + Sync>;

pub(crate) struct AuthConfig {
    pub tokens: HashMap<String, UserInfo>,
    pub authorizer: Authorizer,
}

impl Default for AuthConfig {
    fn default() -> Self {
        AuthConfig {
            tokens: HashMap::new(),
            authorizer: Arc::new(|_| true),
        }
    }
}

fn s(v: &Value, p: &str) -> String {
    v.pointer(p)
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string()
}

impl AuthConfig {
    pub fn token_review(&self, mut review: Value) -> Value {
        let token = s(&review, "/spec/token");
        let audiences = review
            .pointer("/spec/audiences")
            .cloned()
            .unwrap_or(json!([]));
        review["status"] = match self.tokens.get(&token) {
            Some(u) => json!({
                "authenticated": true,
                "user": {"username": u.username, "uid": u.uid, "groups": u.groups, "extra": u.extra},
                "audiences": audiences,
            }),
            None => json!({"authenticated": false, "error": "invalid bearer token"}),
        };
        review
    }

    pub fn subject_access_review(&self, mut review: Value) -> Value {
        let groups = review
            .pointer("/spec/groups")
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(|g| g.as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default();
        let non_resource = review.pointer("/spec/nonResourceAttributes").is_some();
        let req = if non_resource {
            AccessRequest {
                user: s(&review, "/spec/user"),
                groups,
                verb: s(&review, "/spec/nonResourceAttributes/verb"),
                path: s(&review, "/spec/nonResourceAttributes/path"),
                ..Default::default()
            }
        } else {
            let ra = |f: &str| s(&review, &format!("/spec/resourceAttributes/{f}"));
            AccessRequest {
                user: s(&review, "/spec/user"),
                groups,
                verb: ra("verb"),
                group: ra("group"),
                resource: ra("resource"),
                subresource: ra("subresource"),
                namespace: ra("namespace"),
                name: ra("name"),
                path: String::new(),
            }
        };
        let allowed = (self.authorizer)(&req);
        review["status"] = if allowed {
            json!({"allowed": true, "reason": "allowed by the test authorizer"})
        } else {
            json!({"allowed": false, "reason": "denied by the test authorizer"})
        };
        review
    }
}
