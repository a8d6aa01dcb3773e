//! API errors rendered as Kubernetes `Status` objects.

use serde_json::{Value, json};
use std::fmt;

/// An error answered by the stand-in, rendered like the real API server does (a `Status` object).
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    /// HTTP status code (also `Status.code`).
    pub code: u16,
    /// `Status.reason`, e.g. `NotFound`, `Conflict`, `Invalid`.
    pub reason: String,
    /// Human readable message.
    pub message: String,
    /// `Status.details`, when the real server fills it.
    pub details: Option<Value>,
}

/// `plural` or `plural.group`, the way the API server names a resource in messages.
pub(crate) fn qualified(group: &str, plural: &str) -> String {
    if group.is_empty() {
        plural.to_string()
    } else {
        format!("{plural}.{group}")
    }
}

impl ApiError {
    pub(crate) fn new(code: u16, reason: &str, message: impl Into<String>) -> Self {
        ApiError {
            code,
            reason: reason.to_string(),
            message: message.into(),
            details: None,
        }
    }

    fn with_details(mut self, group: &str, kind: &str, name: &str) -> Self {
        let mut d = json!({ "name": name, "kind": kind });
        if !group.is_empty() {
            d["group"] = json!(group);
        }
        self.details = Some(d);
        self
    }

    pub(crate) fn not_found(group: &str, plural: &str, name: &str) -> Self {
        Self::new(
            404,
            "NotFound",
            format!("{} \"{name}\" not found", qualified(group, plural)),
        )
        .with_details(group, plural, name)
    }

    /// 404 for a URL that names no known resource.
    pub(crate) fn no_route() -> Self {
        Self::new(
            404,
            "NotFound",
            "the server could not find the requested resource",
        )
    }

    pub(crate) fn already_exists(group: &str, plural: &str, name: &str) -> Self {
        Self::new(
            409,
            "AlreadyExists",
            format!("{} \"{name}\" already exists", qualified(group, plural)),
        )
        .with_details(group, plural, name)
    }

    pub(crate) fn conflict(group: &str, plural: &str, name: &str) -> Self {
        Self::conflict_msg(
            group,
            plural,
            name,
            "the object has been modified; please apply your changes to the latest version and try again",
        )
    }

    pub(crate) fn conflict_msg(group: &str, plural: &str, name: &str, why: &str) -> Self {
        Self::new(
            409,
            "Conflict",
            format!(
                "Operation cannot be fulfilled on {} \"{name}\": {why}",
                qualified(group, plural)
            ),
        )
        .with_details(group, plural, name)
    }

    /// 422 Invalid, `causes` as `field: message` strings.
    pub(crate) fn invalid(group: &str, kind: &str, name: &str, cause: &str) -> Self {
        let gk = if group.is_empty() {
            kind.to_string()
        } else {
            format!("{kind}.{group}")
        };
        Self::new(
            422,
            "Invalid",
            format!("{gk} \"{name}\" is invalid: {cause}"),
        )
        .with_details(group, kind, name)
    }

    pub(crate) fn bad_request(message: impl Into<String>) -> Self {
        Self::new(400, "BadRequest", message)
    }

    pub(crate) fn method_not_allowed() -> Self {
        Self::new(
            405,
            "MethodNotAllowed",
            "the server does not allow this method on the requested resource",
        )
    }

    pub(crate) fn unsupported_media_type(content_type: &str) -> Self {
        Self::new(
            415,
            "UnsupportedMediaType",
            format!(
                "the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml (got {content_type:?})"
            ),
        )
    }

    pub(crate) fn expired(message: impl Into<String>) -> Self {
        Self::new(410, "Expired", message)
    }

    /// A generic error for an HTTP code (used by fault injection).
    pub(crate) fn for_code(code: u16) -> Self {
        let (reason, msg) = match code {
            400 => ("BadRequest", "bad request"),
            401 => ("Unauthorized", "Unauthorized"),
            403 => ("Forbidden", "forbidden"),
            404 => (
                "NotFound",
                "the server could not find the requested resource",
            ),
            409 => ("Conflict", "conflict"),
            410 => ("Expired", "expired"),
            429 => (
                "TooManyRequests",
                "the server has received too many requests and has asked us to try again later",
            ),
            500 => (
                "InternalError",
                "an error on the server (\"injected fault\") has prevented the request from succeeding",
            ),
            503 => (
                "ServiceUnavailable",
                "the server is currently unable to handle the request",
            ),
            504 => (
                "Timeout",
                "the server was unable to return a response in the time allotted, but may still be processing the request",
            ),
            _ => ("Unknown", "injected fault"),
        };
        Self::new(code, reason, msg)
    }

    /// The `Status` object for this error.
    pub fn to_status(&self) -> Value {
        let mut s = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        });
        if let Some(d) = &self.details {
            s["details"] = d.clone();
        }
        s
    }
}

impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}: {}", self.code, self.reason, self.message)
    }
}

impl std::error::Error for ApiError {}
