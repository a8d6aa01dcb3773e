//! Which phases the installed CRDs let the agent write.
//!
//! Velero 1.17+ CRDs allow eight phases (New, Accepted, Prepared, InProgress, Canceling,
//! Canceled, Completed, Failed); Velero 1.16 and older install only New, InProgress, Completed
//! and Failed, and the API server answers any other phase with 422 `Unsupported value`. Velero's
//! server waits only for a terminal phase, so on the older CRDs the agent writes the subset the
//! way Velero <= 1.16's own node agent did: New -> InProgress -> Completed | Failed, a cancel
//! ending Failed with a message that says it was canceled.
//!
//! The set is read from each CRD's `status.phase` enum at start and whenever the CRD changes
//! (a watch on the two CRDs by name), and learned from a 422 that names the supported values,
//! so an agent whose CRD read is refused still converges after one refused write. The status
//! writer adapts every status patch to the set ([`KindPhases::adapt`]): the one place all
//! writes pass, so no caller needs to know which Velero installed the CRDs.

use std::sync::atomic::{AtomicU8, Ordering};

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use serde_json::Value;

use crate::crd::Phase;

const ALL: [Phase; 8] = [
    Phase::New,
    Phase::Accepted,
    Phase::Prepared,
    Phase::InProgress,
    Phase::Canceling,
    Phase::Canceled,
    Phase::Completed,
    Phase::Failed,
];

fn bit(p: Phase) -> u8 {
    1 << ALL.iter().position(|q| *q == p).unwrap_or(0)
}

/// A set of phases (one bit each).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct PhaseSet(u8);

impl PhaseSet {
    pub const EVERY: PhaseSet = PhaseSet(u8::MAX);

    pub fn contains(self, p: Phase) -> bool {
        self.0 & bit(p) != 0
    }

    /// From an enum's values; unknown names are ignored. `None` when nothing is known.
    fn from_names<'a>(names: impl IntoIterator<Item = &'a str>) -> Option<PhaseSet> {
        let mut set = 0u8;
        for n in names {
            if let Some(p) = ALL.iter().find(|p| p.as_str() == n) {
                set |= bit(*p);
            }
        }
        (set != 0).then_some(PhaseSet(set))
    }

    /// The `status.phase` enum of the CRD's `v1` version; every phase when the schema sets no
    /// enum (nothing is refused), `None` when the CRD has no `v1`.
    pub fn of_crd(crd: &CustomResourceDefinition) -> Option<PhaseSet> {
        let version = crd.spec.versions.iter().find(|v| v.name == "v1")?;
        let phase = version
            .schema
            .as_ref()
            .and_then(|s| s.open_api_v3_schema.as_ref())
            .and_then(|s| s.properties.as_ref())
            .and_then(|p| p.get("status"))
            .and_then(|s| s.properties.as_ref())
            .and_then(|p| p.get("phase"));
        match phase.and_then(|p| p.enum_.as_ref()) {
            Some(values) => PhaseSet::from_names(values.iter().filter_map(|v| v.0.as_str())),
            None => Some(PhaseSet::EVERY),
        }
    }

    /// From an API server's refusal of a phase: `status.phase: Unsupported value: "Accepted":
    /// supported values: "New", "InProgress", "Completed", "Failed"`.
    pub fn of_refusal(message: &str) -> Option<PhaseSet> {
        let at = message.find("status.phase: Unsupported value")?;
        let rest = &message[at..];
        let list = &rest[rest.find("supported values:")? + "supported values:".len()..];
        // The values are quoted; the list ends at the first character that is not part of it.
        let end = list
            .find(|c: char| !(c.is_ascii_alphanumeric() || matches!(c, '"' | ',' | ' ')))
            .unwrap_or(list.len());
        PhaseSet::from_names(
            list[..end]
                .split(',')
                .map(|v| v.trim().trim_matches('"'))
                .filter(|v| !v.is_empty()),
        )
    }

    fn names(self) -> Vec<&'static str> {
        ALL.iter()
            .filter(|p| self.contains(**p))
            .map(|p| p.as_str())
            .collect()
    }
}

impl std::fmt::Debug for PhaseSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.names().join(","))
    }
}

/// The phases one kind's CRD allows, shared by every writer of that kind.
pub struct KindPhases {
    kind: &'static str,
    set: AtomicU8,
}

impl KindPhases {
    pub fn new(kind: &'static str) -> KindPhases {
        KindPhases {
            kind,
            set: AtomicU8::new(PhaseSet::EVERY.0),
        }
    }

    pub fn get(&self) -> PhaseSet {
        PhaseSet(self.set.load(Ordering::Relaxed))
    }

    /// Records what the CRD (or a refusal) says; returns whether it changed anything. Logged
    /// once per change, not per write.
    pub fn learn(&self, set: PhaseSet, from: &str) -> bool {
        let before = PhaseSet(self.set.swap(set.0, Ordering::Relaxed));
        if before != set {
            let phases = format!("{set:?}");
            if set.contains(Phase::Accepted) && set.contains(Phase::Canceled) {
                tracing::info!(kind = self.kind, %phases, from, "phases the CRD allows");
            } else {
                tracing::warn!(
                    kind = self.kind,
                    %phases,
                    from,
                    "the installed CRD allows only these phases (Velero <= 1.16): claims are not \
                     written as Accepted, a cancel ends Failed with a message that says so"
                );
            }
        }
        before != set
    }

    /// `status` as the CRD accepts it. A phase the CRD lacks is written as Velero <= 1.16's
    /// agent wrote it: Accepted, Prepared and Canceling are not written (the object keeps its
    /// phase, the other fields are written), Canceled is written Failed with a message that
    /// starts with "canceled". New, InProgress, Completed and Failed are in every Velero's CRD.
    pub fn adapt(&self, mut status: Value) -> Value {
        let set = self.get();
        let Some(phase) = status
            .get("phase")
            .and_then(Value::as_str)
            .and_then(|n| ALL.iter().find(|p| p.as_str() == n).copied())
        else {
            return status;
        };
        if set.contains(phase) {
            return status;
        }
        match phase {
            Phase::Canceled if set.contains(Phase::Failed) => {
                status["phase"] = Value::String(Phase::Failed.as_str().into());
                let message = status["message"].as_str().unwrap_or("").to_string();
                if !message.to_ascii_lowercase().starts_with("cancel") {
                    status["message"] = Value::String(if message.is_empty() {
                        "canceled".into()
                    } else {
                        format!("canceled: {message}")
                    });
                }
            }
            Phase::Accepted | Phase::Prepared | Phase::Canceling => {
                if let Some(m) = status.as_object_mut() {
                    m.remove("phase");
                }
            }
            _ => {}
        }
        status
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn four() -> PhaseSet {
        PhaseSet::from_names(["New", "InProgress", "Completed", "Failed"]).unwrap()
    }

    #[test]
    fn a_refusal_names_the_supported_phases() {
        let m = r#"PodVolumeBackup.velero.io "pvb-sigterm" is invalid: status.phase: Unsupported value: "Accepted": supported values: "New", "InProgress", "Completed", "Failed""#;
        assert_eq!(PhaseSet::of_refusal(m), Some(four()));
        // kube's rendering adds the reason and code after the list.
        let m2 = format!("ApiError: {m}: Invalid (ErrorResponse {{ status: \"Failure\" }})");
        assert_eq!(PhaseSet::of_refusal(&m2), Some(four()));
        assert_eq!(PhaseSet::of_refusal("spec.node: Required value"), None);
    }

    #[test]
    fn the_crds_enum_gives_the_set() {
        // Velero's own CRDs as its installer prints them (testdata/velero-crds/README.md).
        for (file, expected) in [
            ("v1.16.2/velero.io_podvolumebackups.yaml", four()),
            ("v1.16.2/velero.io_podvolumerestores.yaml", four()),
            ("v1.18.3/velero.io_podvolumebackups.yaml", PhaseSet::EVERY),
            ("v1.18.3/velero.io_podvolumerestores.yaml", PhaseSet::EVERY),
        ] {
            let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("testdata/velero-crds")
                .join(file);
            let crd: CustomResourceDefinition = serde_norway::from_str(
                &std::fs::read_to_string(&path)
                    .unwrap_or_else(|e| panic!("{}: {e}", path.display())),
            )
            .unwrap();
            assert_eq!(PhaseSet::of_crd(&crd), Some(expected), "{file}");
        }
        // Ours (generated from the Rust types) has all eight.
        use kube::CustomResourceExt;
        for crd in [
            crate::crd::PodVolumeBackup::crd(),
            crate::crd::PodVolumeRestore::crd(),
        ] {
            assert_eq!(PhaseSet::of_crd(&crd), Some(PhaseSet::EVERY));
        }
    }

    #[test]
    fn four_phases_write_as_velero_116_did() {
        let k = KindPhases::new("PodVolumeBackup");
        assert!(k.learn(four(), "test"));
        assert!(!k.learn(four(), "test"), "no change, nothing new to say");
        assert_eq!(
            k.adapt(json!({"phase": "Accepted", "message": "accepted"})),
            json!({"message": "accepted"})
        );
        assert_eq!(
            k.adapt(json!({"phase": "Canceling", "message": "canceling: on request"})),
            json!({"message": "canceling: on request"})
        );
        assert_eq!(
            k.adapt(json!({"phase": "Canceled", "message": "the object is being deleted"})),
            json!({"phase": "Failed", "message": "canceled: the object is being deleted"})
        );
        assert_eq!(
            k.adapt(json!({"phase": "Canceled", "message": "canceled on request"})),
            json!({"phase": "Failed", "message": "canceled on request"})
        );
        for p in ["InProgress", "Completed", "Failed"] {
            assert_eq!(k.adapt(json!({"phase": p})), json!({"phase": p}));
        }
        // Eight phases: nothing changes.
        k.learn(PhaseSet::EVERY, "test");
        assert_eq!(
            k.adapt(json!({"phase": "Canceled", "message": "x"})),
            json!({"phase": "Canceled", "message": "x"})
        );
    }
}
