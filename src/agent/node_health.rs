//! Whether a node is lost: its object gone, or not Ready for longer than Kubernetes itself waits
//! before evicting its pods. Data movement running on a lost node is ended by another node's
//! agent (see [`super::movement`]); without that it would stay InProgress for ever, its exposed
//! claim and hold pod with it.

use std::time::{Duration, SystemTime};

use k8s_openapi::api::core::v1::Node;
use kube::{Api, Client};

/// How long a node may be not Ready before it counts as lost (the default eviction timeout of
/// Kubernetes' node lifecycle controller).
pub const LOST_AFTER: Duration = Duration::from_secs(300);
/// How often an agent looks at the node of another node's transfer (one read per object).
pub const CHECK_EVERY: Duration = Duration::from_secs(300);

/// How long a node's verdict is reused: every progress write of another node's transfer
/// reaches every agent's reconcile, and must not cost a read of its Node each time.
const REUSE_FOR: Duration = Duration::from_secs(60);

/// The nodes this agent has looked at lately, and what it found.
#[derive(Default)]
pub struct NodeHealth {
    seen: std::sync::Mutex<std::collections::HashMap<String, (std::time::Instant, Option<String>)>>,
}

impl NodeHealth {
    /// Why `node` is lost, or None (healthy, or its state cannot be read: nothing is ended
    /// then). One read of the Node per minute at most.
    pub async fn lost(&self, client: &Client, node: &str) -> Option<String> {
        if let Some((at, why)) = self.seen.lock().expect("node health").get(node)
            && at.elapsed() < REUSE_FOR
        {
            return why.clone();
        }
        let api: Api<Node> = Api::all(client.clone());
        let why = match api.get_opt(node).await {
            Ok(n) => why_lost(node, n.as_ref(), SystemTime::now()),
            Err(e) => {
                tracing::debug!(error = %e, "cannot read Node {node}");
                return None;
            }
        };
        let mut seen = self.seen.lock().expect("node health");
        seen.retain(|_, (at, _)| at.elapsed() < REUSE_FOR);
        seen.insert(node.to_string(), (std::time::Instant::now(), why.clone()));
        why
    }
}

/// The rule, on a Node as read (None: it does not exist) at `now`.
pub fn why_lost(name: &str, node: Option<&Node>, now: SystemTime) -> Option<String> {
    let Some(node) = node else {
        return Some(format!("node {name} no longer exists"));
    };
    let ready = node
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|c| c.iter().find(|c| c.type_ == "Ready"))?;
    if ready.status == "True" {
        return None;
    }
    let since = ready.last_transition_time.as_ref()?;
    let since = SystemTime::from(since.0);
    let for_ = now.duration_since(since).ok()?;
    (for_ >= LOST_AFTER).then(|| {
        format!(
            "node {name} is lost (Ready {} for {}{})",
            ready.status,
            humantime::format_duration(Duration::from_secs(for_.as_secs())),
            ready
                .reason
                .as_deref()
                .map(|r| format!(": {r}"))
                .unwrap_or_default()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(status: &str, since_secs_ago: u64, now: SystemTime) -> Node {
        let since = humantime::format_rfc3339_seconds(now - Duration::from_secs(since_secs_ago));
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "n1"},
            "status": {"conditions": [{"type": "Ready", "status": status,
                "reason": "NodeStatusUnknown", "lastTransitionTime": since.to_string()}]},
        }))
        .unwrap()
    }

    #[test]
    fn lost_when_gone_or_not_ready_for_five_minutes() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(2_000_000_000);
        assert_eq!(
            why_lost("n1", None, now).unwrap(),
            "node n1 no longer exists"
        );
        assert!(why_lost("n1", Some(&node("True", 10_000, now)), now).is_none());
        assert!(why_lost("n1", Some(&node("Unknown", 299, now)), now).is_none());
        let why = why_lost("n1", Some(&node("Unknown", 301, now)), now).unwrap();
        assert!(
            why.starts_with("node n1 is lost (Ready Unknown for 5m 1s"),
            "{why}"
        );
        assert!(why_lost("n1", Some(&node("False", 600, now)), now).is_some());
        // No Ready condition at all (a node object not yet reported on): not judged.
        let bare: Node =
            serde_json::from_value(serde_json::json!({"metadata": {"name": "n1"}})).unwrap();
        assert!(why_lost("n1", Some(&bare), now).is_none());
    }
}
