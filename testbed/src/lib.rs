//! Test-only Kubernetes API server stand-in (work in progress).
