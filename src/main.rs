use clap::Parser;

use podvolume_agent::cli::{Cli, Command};
use podvolume_agent::{oneshot, telemetry};

fn level(verbose: u8) -> &'static str {
    match verbose {
        0 => "warn",
        1 => "info",
        _ => "debug",
    }
}

#[tokio::main]
async fn main() {
    let cli = Cli::parse();
    let code = match cli.command {
        Command::Backup(args) => {
            telemetry::init_logging(args.common.log_format, level(args.common.verbose));
            oneshot::backup(args).await
        }
        Command::Restore(args) => {
            telemetry::init_logging(args.common.log_format, level(args.common.verbose));
            oneshot::restore(args).await
        }
    };
    std::process::exit(code);
}
