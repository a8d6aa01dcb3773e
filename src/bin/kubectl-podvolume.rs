//! `kubectl podvolume`: a kubectl plugin (kubectl runs `kubectl-podvolume` from PATH).

use clap::Parser;

use podvolume_agent::plugin::cli::PluginCli;

#[tokio::main]
async fn main() {
    podvolume_agent::telemetry::init_logging(podvolume_agent::cli::LogFormat::Plain, "warn");
    let code = podvolume_agent::plugin::main(PluginCli::parse()).await;
    std::process::exit(code);
}
