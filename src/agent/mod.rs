//! The node agent: watches this node's PodVolumeBackups and PodVolumeRestores and runs them.

use crate::cli::RunArgs;

pub mod volume;

/// Runs the agent until SIGTERM/SIGINT; returns the process exit code.
pub async fn run(args: RunArgs) -> i32 {
    tracing::error!(node = %args.node_name, "the node agent is not implemented yet");
    1
}
