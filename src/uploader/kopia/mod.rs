//! kopia through its CLI: argv/env for each command, the stderr/stdout parser, and outcome
//! classification.
//!
//! kopia has no machine-readable progress (see the project's reference on uploader output, section
//! "kopia (CLI)"). What this module builds against:
//!
//! - `snapshot create --json --progress` redraws one human progress line on stderr with `\r`
//!   (framed with `Separators::NewlineAndCarriageReturn`, so each redraw is one record), prints
//!   per-entry errors as `\n ! Error when processing "<path>": <error>`, and prints the snapshot
//!   manifest as one compact JSON line on stdout at the end.
//! - Byte counts are SI strings with one decimal (`52.4 MB`; base 2 with
//!   `KOPIA_BYTES_STRING_BASE_2`), so exact counts cannot be recovered from progress lines: each
//!   figure is read as the smallest count it could stand for. The manifest's
//!   `rootEntry.summ.size` is exact and is the backup's total; a restore's total is measured on
//!   the target by the engine.
//! - Exit codes are only 0 and 1 (2 on a Go panic): failures are classified by text. The first
//!   SIGINT/SIGTERM makes kopia save a *partial* snapshot and exit 0 with `incomplete: "canceled"`,
//!   so exit 0 alone never means complete.
//! - Console log lines carry no level prefix in current kopia; older releases prefixed errors with
//!   `ERROR`. Both are recognised.
//!
//! Flags and variables used (kopia's global flags accept an environment variable each):
//! - `KOPIA_PASSWORD` (the `--password` flag's variable): the password, read from the password file
//!   and passed in the environment only, never in argv.
//! - `KOPIA_CONFIG_PATH` (`--config-file`): `<cache_dir>/kopia/repository.config`, private to us.
//! - `KOPIA_LOG_DIR` (`--log-dir`): `<cache_dir>/kopia/logs`; `KOPIA_DISABLE_REPOSITORY_LOG=true`
//!   and bounds on the log files kept there (see [`LOG_BOUNDS`]).
//! - `--cache-directory=<cache_dir>/kopia/cache` on `repository connect|create` (kopia stores it in
//!   the config file; later commands read it from there).
//! - `KOPIA_PERSIST_CREDENTIALS_ON_CONNECT=false` (`--persist-credentials`) and
//!   `KOPIA_USE_KEYRING=false`: kopia would otherwise write the password next to the config file.
//!   Every command gets `KOPIA_PASSWORD` instead.
//! - `KOPIA_CHECK_FOR_UPDATES=false`, `KOPIA_DISABLE_COLOR=true` (hidden `--disable-color`).
//! - `--progress` (a global flag): since 0.23 progress is off unless stdout is a terminal.
//! - `snapshot restore` has no `--json`; it prints its progress with `--progress` and a final
//!   `Restored N files, ...` line on stderr.
//! - `--no-auto-maintenance` on every command that writes: kopia would otherwise run
//!   maintenance after it when the connection's identity owns maintenance, and Velero owns its
//!   repositories' maintenance (an error in it would also fail a saved snapshot).
//!
//! Repositories: a local path (`repository connect filesystem --path`), or object storage given
//! as `s3:<http|https>://<host[:port]>/<bucket>[/<prefix>]` (restic's form; `s3:<host>/...`
//! means https), connected with `repository connect s3 --endpoint --bucket --prefix` and the
//! prefix ending in `/` as Velero's does (without it kopia reads another place). S3 keys come
//! from `AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY`/`AWS_SESSION_TOKEN` (kopia's own variables),
//! or from an AWS shared-credentials file (`AWS_SHARED_CREDENTIALS_FILE`, `AWS_PROFILE`), which
//! kopia cannot read itself: its keys are passed in those variables, never in argv. The region
//! is `AWS_REGION` (or `AWS_DEFAULT_REGION`); a private CA is `--root-ca-pem-path`, no
//! verification `--disable-tls-verification`.

mod commands;
mod outcome;
mod parse;
mod repository;
#[cfg(test)]
mod tests;

use std::ffi::OsString;
use std::fmt;
use std::os::unix::ffi::OsStringExt;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::{
    Direction, ExitInfo, Outcome, OutcomeKind, ProgressSample, RepositoryAccess, RunSummary,
    RunSummaryView, UploaderEvent,
};
use crate::error::Error;
use crate::facts::RunFacts;
use crate::text::{clean_line, format_bytes, truncate};

pub use commands::*;
pub use outcome::*;
pub use parse::*;
pub use repository::*;
