use clap::Parser;

use podvolume_agent::cli::{Cli, Command, LogFormat};
use podvolume_agent::{client, oneshot, telemetry};

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
        Command::Run(args) => {
            telemetry::init_logging(args.log_format, "info");
            podvolume_agent::agent::run(*args).await
        }
        Command::Operations(args) => {
            telemetry::init_logging(LogFormat::Plain, "warn");
            client::operations(args).await
        }
        Command::Progress(args) => {
            telemetry::init_logging(LogFormat::Plain, "warn");
            client::progress(args).await
        }
        Command::Cancel(args) => {
            telemetry::init_logging(LogFormat::Plain, "warn");
            client::cancel(args).await
        }
        Command::Hold => {
            // PID 1's child under tini: SIGTERM (or SIGINT) ends it at once.
            use tokio::signal::unix::{SignalKind, signal};
            match (
                signal(SignalKind::terminate()),
                signal(SignalKind::interrupt()),
            ) {
                (Ok(mut term), Ok(mut int)) => {
                    tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
                    0
                }
                _ => 1,
            }
        }
        Command::Crds => {
            print!("{}", podvolume_agent::crd::crds_yaml());
            0
        }
    };
    std::process::exit(code);
}
