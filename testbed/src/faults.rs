//! Fault injection rules, request matching and the request log.

use bytes::Bytes;
use std::time::{Duration, Instant};

/// What a request is about, as the API server's request-info resolver sees it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestInfo {
    /// Kubernetes verb: get, list, watch, create, update, patch, delete, deletecollection
    /// (for non-resource paths such as discovery: the lowercase HTTP method).
    pub verb: String,
    /// API group ("" for core), None for non-resource paths.
    pub group: Option<String>,
    /// Resource plural, None for non-resource paths.
    pub resource: Option<String>,
    pub subresource: Option<String>,
    pub namespace: Option<String>,
    pub name: Option<String>,
}

/// Verbs that write.
pub const WRITE_VERBS: &[&str] = &["create", "update", "patch", "delete", "deletecollection"];

/// Selects requests for faults and counters. Built with the chained methods; an unset
/// criterion matches anything.
#[derive(Debug, Clone, Default)]
pub struct RequestMatch {
    verbs: Option<Vec<String>>,
    resource: Option<String>,
    subresource: Option<Option<String>>,
    namespace: Option<String>,
    name: Option<String>,
}

impl RequestMatch {
    /// Matches every request (also discovery and other non-resource paths).
    pub fn any() -> Self {
        Self::default()
    }

    /// Only this verb (may be called several times: any of them).
    pub fn verb(mut self, verb: &str) -> Self {
        self.verbs
            .get_or_insert_with(Vec::new)
            .push(verb.to_string());
        self
    }

    /// Only writes: create, update, patch, delete, deletecollection.
    pub fn writes(mut self) -> Self {
        self.verbs = Some(WRITE_VERBS.iter().map(|s| s.to_string()).collect());
        self
    }

    /// Only this resource (plural, e.g. `podvolumebackups`).
    pub fn resource(mut self, plural: &str) -> Self {
        self.resource = Some(plural.to_string());
        self
    }

    /// Only this subresource; `None` means the main resource only.
    pub fn subresource(mut self, sub: Option<&str>) -> Self {
        self.subresource = Some(sub.map(str::to_string));
        self
    }

    pub fn namespace(mut self, ns: &str) -> Self {
        self.namespace = Some(ns.to_string());
        self
    }

    pub fn name(mut self, name: &str) -> Self {
        self.name = Some(name.to_string());
        self
    }

    pub(crate) fn has_verbs(&self) -> bool {
        self.verbs.is_some()
    }

    pub fn matches(&self, info: &RequestInfo) -> bool {
        self.verbs.as_ref().is_none_or(|v| v.contains(&info.verb))
            && self
                .resource
                .as_ref()
                .is_none_or(|r| info.resource.as_ref() == Some(r))
            && self
                .subresource
                .as_ref()
                .is_none_or(|s| *s == info.subresource)
            && self
                .namespace
                .as_ref()
                .is_none_or(|n| info.namespace.as_ref() == Some(n))
            && self
                .name
                .as_ref()
                .is_none_or(|n| info.name.as_ref() == Some(n))
    }
}

/// One request as the server saw it.
#[derive(Debug, Clone)]
pub struct RequestRecord {
    pub method: String,
    pub path: String,
    pub query: String,
    pub body_len: usize,
    pub body: Bytes,
    pub info: RequestInfo,
    /// HTTP status answered; 0 when the connection was dropped without an answer. For a
    /// watch: the status of the response head (200), whatever happens in the stream.
    pub status: u16,
}

impl RequestRecord {
    pub fn is_write(&self) -> bool {
        WRITE_VERBS.contains(&self.info.verb.as_str())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FaultAction {
    /// Answer this HTTP status with a Status object.
    Error(u16),
    /// Close the TCP connection without answering.
    Drop,
    /// Answer 409 Conflict without applying the write.
    Conflict,
    /// Delay the answer.
    Latency(Duration),
}

#[derive(Debug, Clone)]
pub(crate) struct FaultRule {
    pub matcher: RequestMatch,
    pub action: FaultAction,
    /// Fires this many more times (None: unlimited within the window).
    pub remaining: Option<u32>,
    /// Active until then (None: until `remaining` is used up or the faults are cleared).
    pub until: Option<Instant>,
}

#[derive(Debug, Default)]
pub(crate) struct Faults {
    pub rules: Vec<FaultRule>,
}

impl Faults {
    /// Total latency to add and the first firing non-latency action for a request.
    pub fn evaluate(&mut self, info: &RequestInfo) -> (Duration, Option<FaultAction>) {
        let now = Instant::now();
        self.rules
            .retain(|r| r.until.is_none_or(|u| u > now) && r.remaining != Some(0));
        let mut delay = Duration::ZERO;
        let mut action = None;
        for rule in self.rules.iter_mut() {
            if !rule.matcher.matches(info) {
                continue;
            }
            match rule.action {
                FaultAction::Latency(d) => {
                    delay += d;
                    if let Some(n) = rule.remaining.as_mut() {
                        *n -= 1;
                    }
                }
                a if action.is_none() => {
                    action = Some(a);
                    if let Some(n) = rule.remaining.as_mut() {
                        *n -= 1;
                    }
                }
                _ => {}
            }
        }
        (delay, action)
    }
}
