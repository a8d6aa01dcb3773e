//! Velero's node-agent ConfigMap (`--node-agent-configmap`), read as Velero 1.18's node agent
//! reads it (`pkg/types/node_agent.go`, `pkg/cmd/cli/nodeagent/server.go`): one data key whose
//! value is JSON; read once at start. A user's existing ConfigMap keeps meaning what it meant:
//!
//! | key | here |
//! |---|---|
//! | `loadConcurrency.globalConfig`, `.perNodeConfig[]` | transfers at once on this node (pod volumes and data movement); the smallest matching per-node rule wins |
//! | `loadConcurrency.prepareQueueLength` | DataUploads/DataDownloads being exposed at once, cluster-wide |
//! | `loadAffinity[]` | the hold pod's node affinity (the rule for the claim's storage class, else the first without one) |
//! | `backupPVC.<storage class>` | the exposed snapshot claim's class, read-only mount, annotations |
//! | `restorePVC.ignoreDelayBinding` | restore volumes made without waiting for the target's consumer |
//! | `podResources`, `priorityClassName`, `podLabels`, `podAnnotations` | the hold pods |
//!
//! `privilegedFsBackup` and `cachePVC` concern Velero's data-path pods, which this agent does not
//! run (it moves pod volumes from its own pod; its kopia cache is in its scratch directory):
//! read, logged as not applicable.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::{Value, json};

/// A Kubernetes label selector (`matchLabels`, `matchExpressions`).
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct LabelSelector {
    #[serde(default)]
    pub match_labels: BTreeMap<String, String>,
    #[serde(default)]
    pub match_expressions: Vec<Requirement>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
pub struct Requirement {
    pub key: String,
    pub operator: String,
    #[serde(default)]
    pub values: Vec<String>,
}

impl LabelSelector {
    /// Whether `labels` match (an empty selector matches everything, as Kubernetes' does).
    /// An unknown operator matches nothing.
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.match_labels
            .iter()
            .all(|(k, v)| labels.get(k) == Some(v))
            && self.match_expressions.iter().all(|r| {
                let have = labels.get(&r.key);
                match r.operator.as_str() {
                    "In" => have.is_some_and(|v| r.values.contains(v)),
                    "NotIn" => have.is_none_or(|v| !r.values.contains(v)),
                    "Exists" => have.is_some(),
                    "DoesNotExist" => have.is_none(),
                    _ => false,
                }
            })
    }
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct LoadConcurrency {
    #[serde(default)]
    pub global_config: i64,
    #[serde(default)]
    pub per_node_config: Vec<RuledConcurrency>,
    #[serde(default)]
    pub prepare_queue_length: i64,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RuledConcurrency {
    #[serde(default)]
    pub node_selector: LabelSelector,
    #[serde(default)]
    pub number: i64,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct LoadAffinity {
    #[serde(default)]
    pub node_selector: LabelSelector,
    #[serde(default)]
    pub storage_class: String,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct BackupPvc {
    #[serde(default)]
    pub storage_class: String,
    #[serde(default)]
    pub read_only: bool,
    #[serde(default)]
    pub spc_no_relabeling: bool,
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RestorePvc {
    #[serde(default)]
    pub ignore_delay_binding: bool,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PodResources {
    #[serde(default)]
    pub cpu_request: String,
    #[serde(default)]
    pub cpu_limit: String,
    #[serde(default)]
    pub memory_request: String,
    #[serde(default)]
    pub memory_limit: String,
    #[serde(default)]
    pub ephemeral_storage_request: String,
    #[serde(default)]
    pub ephemeral_storage_limit: String,
}

/// The ConfigMap's JSON (`NodeAgentConfigs`); unknown keys are ignored, as Velero's decoder does.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct NodeAgentConfigs {
    #[serde(default)]
    pub load_concurrency: Option<LoadConcurrency>,
    #[serde(default)]
    pub load_affinity: Vec<LoadAffinity>,
    #[serde(default, rename = "backupPVC")]
    pub backup_pvc: BTreeMap<String, BackupPvc>,
    #[serde(default, rename = "restorePVC")]
    pub restore_pvc: Option<RestorePvc>,
    #[serde(default)]
    pub pod_resources: Option<PodResources>,
    #[serde(default)]
    pub priority_class_name: String,
    #[serde(default)]
    pub privileged_fs_backup: bool,
    #[serde(default, rename = "cachePVC")]
    pub cache_pvc: Option<Value>,
    #[serde(default)]
    pub pod_labels: BTreeMap<String, String>,
    #[serde(default)]
    pub pod_annotations: BTreeMap<String, String>,
}

impl NodeAgentConfigs {
    /// The ConfigMap's data: exactly one key (Velero 1.18 refuses more), its value JSON.
    pub fn from_data(name: &str, data: &BTreeMap<String, String>) -> Result<Self, String> {
        let mut values = data.values();
        let (Some(json), None) = (values.next(), values.next()) else {
            return Err(format!(
                "ConfigMap {name} must have exactly one data key (it has {})",
                data.len()
            ));
        };
        serde_json::from_str(json).map_err(|e| format!("ConfigMap {name}: not valid JSON: {e}"))
    }

    /// Transfers at once on a node with `labels`: `globalConfig` (1 when not above zero), or
    /// the smallest `number` above zero of the per-node rules that match. None without a
    /// `loadConcurrency` section (the `--concurrency` flag then decides).
    pub fn concurrency(&self, labels: &BTreeMap<String, String>) -> Option<usize> {
        let lc = self.load_concurrency.as_ref()?;
        let global = if lc.global_config > 0 {
            lc.global_config
        } else {
            1
        };
        let per_node = lc
            .per_node_config
            .iter()
            .filter(|r| r.number > 0 && r.node_selector.matches(labels))
            .map(|r| r.number)
            .min();
        Some(usize::try_from(per_node.unwrap_or(global)).unwrap_or(1))
    }

    /// DataUploads/DataDownloads that may be being exposed at once, cluster-wide (0: no limit).
    pub fn prepare_queue_length(&self) -> usize {
        self.load_concurrency
            .as_ref()
            .map_or(0, |l| usize::try_from(l.prepare_queue_length).unwrap_or(0))
    }

    /// The hold pod's `affinity` for a claim of `storage_class`: the `loadAffinity` rule for
    /// that class, else the first rule naming no class (Velero's `GetLoadAffinityByStorageClass`).
    pub fn affinity(&self, storage_class: &str) -> Option<Value> {
        let rule = self
            .load_affinity
            .iter()
            .find(|a| !a.storage_class.is_empty() && a.storage_class == storage_class)
            .or_else(|| {
                self.load_affinity
                    .iter()
                    .find(|a| a.storage_class.is_empty())
            })?;
        let sel = &rule.node_selector;
        let mut exprs: Vec<Value> = sel
            .match_labels
            .iter()
            .map(|(k, v)| json!({"key": k, "operator": "In", "values": [v]}))
            .collect();
        exprs.extend(
            sel.match_expressions
                .iter()
                .map(|r| json!({"key": r.key, "operator": r.operator, "values": r.values})),
        );
        if exprs.is_empty() {
            return None;
        }
        Some(
            json!({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": exprs}]}}}),
        )
    }

    /// `backupPVC` for a source claim of `storage_class`.
    pub fn backup_pvc(&self, storage_class: &str) -> Option<&BackupPvc> {
        self.backup_pvc.get(storage_class)
    }

    pub fn ignore_delay_binding(&self) -> bool {
        self.restore_pvc
            .as_ref()
            .is_some_and(|r| r.ignore_delay_binding)
    }

    /// The hold pod container's `resources`; Err when a quantity is not one (Velero then ignores
    /// the whole section, and so does the agent, saying why).
    pub fn resources(&self) -> Result<Option<Value>, String> {
        let Some(r) = &self.pod_resources else {
            return Ok(None);
        };
        let mut requests = serde_json::Map::new();
        let mut limits = serde_json::Map::new();
        for (field, name, value, is_limit) in [
            ("cpuRequest", "cpu", &r.cpu_request, false),
            ("memoryRequest", "memory", &r.memory_request, false),
            (
                "ephemeralStorageRequest",
                "ephemeral-storage",
                &r.ephemeral_storage_request,
                false,
            ),
            ("cpuLimit", "cpu", &r.cpu_limit, true),
            ("memoryLimit", "memory", &r.memory_limit, true),
            (
                "ephemeralStorageLimit",
                "ephemeral-storage",
                &r.ephemeral_storage_limit,
                true,
            ),
        ] {
            if value.is_empty() {
                continue;
            }
            if !is_quantity(value) {
                return Err(format!("podResources.{field} {value:?} is not a quantity"));
            }
            let into = if is_limit { &mut limits } else { &mut requests };
            into.insert(name.to_string(), json!(value));
        }
        Ok(Some(json!({"requests": requests, "limits": limits})))
    }

    /// What is read but does not apply to this agent, for the start log.
    pub fn not_applicable(&self) -> Vec<&'static str> {
        let mut v = Vec::new();
        if self.privileged_fs_backup {
            v.push("privilegedFsBackup (the agent's own pod reads pod volumes; no data-path pods)");
        }
        if self.cache_pvc.is_some() {
            v.push("cachePVC (the kopia cache is in the agent's scratch directory)");
        }
        v
    }
}

/// A Kubernetes quantity: a decimal number (sign, point, exponent allowed) with an optional
/// binary (Ki..Ei) or decimal (n, u, m, k, M, G, T, P, E) suffix.
fn is_quantity(s: &str) -> bool {
    let s = s.trim();
    let num_end = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '+' || c == '-'))
        .unwrap_or(s.len());
    let (num, suffix) = s.split_at(num_end);
    let digits = num.strip_prefix(['+', '-']).unwrap_or(num);
    if digits.is_empty()
        || digits.matches('.').count() > 1
        || !digits.chars().any(|c| c.is_ascii_digit())
        || digits.contains(['+', '-'])
    {
        return false;
    }
    matches!(
        suffix,
        "" | "Ki"
            | "Mi"
            | "Gi"
            | "Ti"
            | "Pi"
            | "Ei"
            | "n"
            | "u"
            | "m"
            | "k"
            | "M"
            | "G"
            | "T"
            | "P"
            | "E"
    ) || (suffix.starts_with(['e', 'E'])
        && suffix[1..]
            .trim_start_matches(['+', '-'])
            .parse::<u32>()
            .is_ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    /// A ConfigMap value written as Velero 1.18's documentation shows one.
    const VELERO_CONFIG: &str = r#"{
      "loadConcurrency": {
        "globalConfig": 2,
        "perNodeConfig": [
          {"nodeSelector": {"matchLabels": {"kubernetes.io/hostname": "node1"}}, "number": 3},
          {"nodeSelector": {"matchLabels": {"beta.kubernetes.io/instance-type": "Standard_B4ms"}}, "number": 5},
          {"nodeSelector": {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a", "b"]}]}, "number": 0}
        ],
        "prepareQueueLength": 10
      },
      "loadAffinity": [
        {"nodeSelector": {"matchLabels": {"beta.kubernetes.io/instance-type": "Standard_B4ms"},
          "matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["n1"]}]}},
        {"nodeSelector": {"matchLabels": {"disk": "ssd"}}, "storageClass": "fast"}
      ],
      "backupPVC": {"fast": {"storageClass": "fast-clone", "readOnly": true, "annotations": {"a": "b"}}},
      "restorePVC": {"ignoreDelayBinding": true},
      "podResources": {"cpuRequest": "100m", "memoryLimit": "1Gi"},
      "priorityClassName": "data-mover",
      "privilegedFsBackup": true,
      "cachePVC": {"storageClass": "x", "residentThresholdInMB": 1024},
      "podLabels": {"team": "ops"},
      "somethingNewer": {"x": 1}
    }"#;

    fn config() -> NodeAgentConfigs {
        NodeAgentConfigs::from_data("cm", &labels(&[("node-agent-config.json", VELERO_CONFIG)]))
            .unwrap()
    }

    #[test]
    fn exactly_one_key_of_json() {
        assert!(NodeAgentConfigs::from_data("cm", &BTreeMap::new()).is_err());
        let two = labels(&[("a", "{}"), ("b", "{}")]);
        assert!(
            NodeAgentConfigs::from_data("cm", &two)
                .unwrap_err()
                .contains("exactly one")
        );
        let bad = labels(&[("a", "{not json")]);
        assert!(
            NodeAgentConfigs::from_data("cm", &bad)
                .unwrap_err()
                .contains("not valid JSON")
        );
        assert_eq!(
            NodeAgentConfigs::from_data("cm", &labels(&[("a", "{}")])).unwrap(),
            NodeAgentConfigs::default()
        );
    }

    #[test]
    fn concurrency_is_global_or_the_smallest_matching_rule() {
        let c = config();
        assert_eq!(c.concurrency(&labels(&[])), Some(2));
        assert_eq!(
            c.concurrency(&labels(&[("kubernetes.io/hostname", "node1")])),
            Some(3)
        );
        assert_eq!(
            c.concurrency(&labels(&[
                ("kubernetes.io/hostname", "node1"),
                ("beta.kubernetes.io/instance-type", "Standard_B4ms")
            ])),
            Some(3)
        );
        // A matching rule of 0 does not count.
        assert_eq!(c.concurrency(&labels(&[("zone", "a")])), Some(2));
        assert_eq!(c.prepare_queue_length(), 10);
        // No section: the flag decides; a section without a global number: Velero's default 1.
        assert_eq!(NodeAgentConfigs::default().concurrency(&labels(&[])), None);
        let zero: NodeAgentConfigs =
            serde_json::from_str(r#"{"loadConcurrency": {"globalConfig": 0}}"#).unwrap();
        assert_eq!(zero.concurrency(&labels(&[])), Some(1));
    }

    #[test]
    fn affinity_by_storage_class_else_the_first_without_one() {
        let c = config();
        let fast = c.affinity("fast").unwrap();
        let terms = &fast["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
            [0]["matchExpressions"];
        assert_eq!(
            terms[0],
            json!({"key": "disk", "operator": "In", "values": ["ssd"]})
        );
        let other = c.affinity("slow").unwrap();
        let terms = &other["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
            [0]["matchExpressions"];
        assert_eq!(terms.as_array().unwrap().len(), 2);
        assert_eq!(
            terms[1],
            json!({"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["n1"]})
        );
        assert!(NodeAgentConfigs::default().affinity("x").is_none());
    }

    #[test]
    fn pod_settings_and_claims() {
        let c = config();
        assert_eq!(c.backup_pvc("fast").unwrap().storage_class, "fast-clone");
        assert!(c.backup_pvc("fast").unwrap().read_only);
        assert!(c.backup_pvc("slow").is_none());
        assert!(c.ignore_delay_binding());
        assert_eq!(
            c.resources().unwrap().unwrap(),
            json!({"requests": {"cpu": "100m"}, "limits": {"memory": "1Gi"}})
        );
        assert_eq!(c.not_applicable().len(), 2);
        let bad: NodeAgentConfigs =
            serde_json::from_str(r#"{"podResources": {"cpuRequest": "lots"}}"#).unwrap();
        assert!(bad.resources().unwrap_err().contains("cpuRequest"));
    }

    #[test]
    fn selectors_match_as_kubernetes_does() {
        let sel = |j: &str| serde_json::from_str::<LabelSelector>(j).unwrap();
        let l = labels(&[("a", "1"), ("b", "2")]);
        assert!(sel("{}").matches(&l));
        assert!(sel(r#"{"matchLabels": {"a": "1"}}"#).matches(&l));
        assert!(!sel(r#"{"matchLabels": {"a": "2"}}"#).matches(&l));
        assert!(
            sel(r#"{"matchExpressions": [{"key": "c", "operator": "NotIn", "values": ["1"]}]}"#)
                .matches(&l)
        );
        assert!(sel(r#"{"matchExpressions": [{"key": "a", "operator": "Exists"}]}"#).matches(&l));
        assert!(
            !sel(r#"{"matchExpressions": [{"key": "a", "operator": "DoesNotExist"}]}"#).matches(&l)
        );
        assert!(
            !sel(r#"{"matchExpressions": [{"key": "a", "operator": "Gt", "values": ["0"]}]}"#)
                .matches(&l)
        );
    }

    #[test]
    fn quantities() {
        for q in ["1", "100m", "1.5Gi", "2e3", "512Mi", "0.5", "1E6"] {
            assert!(is_quantity(q), "{q}");
        }
        for q in ["", "lots", "1GB", "1..2", "Mi", "--1", "1 Gi"] {
            assert!(!is_quantity(q), "{q}");
        }
    }
}
