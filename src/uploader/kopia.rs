//! kopia through its CLI (being written).
