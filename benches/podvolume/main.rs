//! Benchmarks behind the README's performance claims. Not a libtest harness: each
//! subcommand measures one case and writes a Markdown section; `scripts/bench.sh` runs them all
//! and assembles `BENCHMARKS.md`.
//!
//! `cargo bench --bench podvolume -- <subcommand> [options]` (cargo adds `--bench`, ignored).

mod agent;
mod cancel;
// The node agent's identity from `daemonset/`, as the e2e suite makes it on a real API server.
#[path = "../../tests/e2e/identity.rs"]
mod identity;
mod kopia;
mod overhead;
mod parser;
mod replay;
mod shapes;
mod stream;
mod util;

use std::path::PathBuf;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(about = "podvolume-agent benchmarks")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Capture restic status streams with timing into a directory (testdata/restic-streams).
    Capture {
        #[arg(long, default_value = "restic")]
        restic: PathBuf,
        #[arg(long)]
        work: PathBuf,
        #[arg(long)]
        out: PathBuf,
        /// Only this shape.
        #[arg(long)]
        only: Option<String>,
    },
    /// Cases 1 and 2: overhead over bare restic, incremental with and without a parent.
    Overhead {
        #[arg(long, default_value = "restic")]
        restic: PathBuf,
        #[arg(long)]
        agent: PathBuf,
        #[arg(long)]
        work: PathBuf,
        #[arg(long, default_value_t = 5)]
        runs: usize,
        /// Runs of each case 1 variant (default: --runs). restic's own CPU varies by about 10%
        /// from run to run on a shared machine: more runs narrow the confidence interval.
        #[arg(long)]
        cpu_runs: Option<usize>,
        /// Small sizes for a fast check.
        #[arg(long)]
        quick: bool,
        #[arg(long)]
        out: PathBuf,
    },
    /// Case 3: progress timeliness and status writes, replaying captured streams in virtual time.
    Replay {
        #[arg(long)]
        streams: PathBuf,
        #[arg(long)]
        out: PathBuf,
    },
    /// Case 6: parser throughput.
    Parser {
        #[arg(long)]
        streams: PathBuf,
        /// Seconds per measurement.
        #[arg(long, default_value_t = 0.5)]
        secs: f64,
        #[arg(long)]
        out: PathBuf,
    },
    /// Case 4: cancel latency through the engine.
    Cancel {
        #[arg(long, default_value = "restic")]
        restic: PathBuf,
        #[arg(long)]
        work: PathBuf,
        #[arg(long, default_value_t = 10)]
        runs: usize,
        #[arg(long)]
        out: PathBuf,
    },
    /// Case 7: kopia's rows (overhead over bare kopia, progress age, cancel latency).
    Kopia {
        #[arg(long)]
        kopia: PathBuf,
        #[arg(long)]
        agent: PathBuf,
        #[arg(long)]
        work: PathBuf,
        #[arg(long, default_value_t = 5)]
        runs: usize,
        #[arg(long, default_value_t = 10)]
        cancel_runs: usize,
        #[arg(long)]
        quick: bool,
        #[arg(long)]
        out: PathBuf,
    },
    /// Cases 4b and 5: cancel latency through the API and memory at scale, the agent binary
    /// against a real kube-apiserver (started here, stopped at the end).
    Agent {
        #[arg(long, default_value = "restic")]
        restic: PathBuf,
        #[arg(long)]
        agent: PathBuf,
        /// Directory with etcd, kube-apiserver, kube-controller-manager and kubectl
        /// (what `scripts/install-control-plane.sh` prints).
        #[arg(long)]
        control_plane_bin: PathBuf,
        /// Velero's CRDs (`velero install --crds-only --dry-run -o yaml`).
        #[arg(long)]
        velero_crds: PathBuf,
        #[arg(long)]
        work: PathBuf,
        #[arg(long, default_value_t = 10)]
        cancel_runs: usize,
        /// PodVolumeBackups of other nodes in the watched namespace.
        #[arg(long, default_value_t = 10_000)]
        objects: usize,
        /// Backups running at once for the per-operation figure.
        #[arg(long, default_value_t = 4)]
        running: usize,
        #[arg(long)]
        quick: bool,
        #[arg(long)]
        out: PathBuf,
    },
}

fn main() {
    // cargo bench passes `--bench` to harness-less benches; drop it.
    let args: Vec<String> = std::env::args().filter(|a| a != "--bench").collect();
    let cli = Cli::parse_from(args);
    match cli.cmd {
        Cmd::Capture {
            restic,
            work,
            out,
            only,
        } => shapes::capture_all(&restic, &work, &out, only.as_deref()),
        Cmd::Overhead {
            restic,
            agent,
            work,
            runs,
            cpu_runs,
            quick,
            out,
        } => write(
            &out,
            &overhead::run(
                &restic,
                &agent,
                &work,
                runs,
                cpu_runs.unwrap_or(runs),
                quick,
            ),
        ),
        Cmd::Replay { streams, out } => write(&out, &replay::run(&streams)),
        Cmd::Parser { streams, secs, out } => write(&out, &parser::run(&streams, secs)),
        Cmd::Cancel {
            restic,
            work,
            runs,
            out,
        } => write(&out, &cancel::run(&restic, &work, runs)),
        Cmd::Kopia {
            kopia,
            agent,
            work,
            runs,
            cancel_runs,
            quick,
            out,
        } => write(
            &out,
            &kopia::run(&kopia::Options {
                kopia: &kopia,
                agent: &agent,
                work: &work,
                runs,
                cancel_runs,
                quick,
            }),
        ),
        Cmd::Agent {
            restic,
            agent,
            control_plane_bin,
            velero_crds,
            work,
            cancel_runs,
            objects,
            running,
            quick,
            out,
        } => write(
            &out,
            &agent::run(&agent::Options {
                restic: &restic,
                agent: &agent,
                control_plane_bin: &control_plane_bin,
                velero_crds: &velero_crds,
                work: &work,
                cancel_runs,
                objects,
                running,
                quick,
            }),
        ),
    }
}

fn write(out: &std::path::Path, md: &str) {
    print!("{md}");
    std::fs::write(out, md).unwrap_or_else(|e| panic!("{}: {e}", out.display()));
}
