//! The crate's error type.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot start {program}: {source}")]
    Spawn {
        program: String,
        source: std::io::Error,
    },
    #[error("cannot determine the {program} version from {output:?}")]
    UnknownVersion { program: String, output: String },
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{0}")]
    Invalid(String),
    #[error("{0}")]
    Uploader(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
