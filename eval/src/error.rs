//! One error type for the whole evaluation; every message is one line that
//! names the value that was wrong.

/// What can go wrong while fetching, loading or evaluating the model.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("model download failed: {0}")]
    Fetch(String),
    #[error("model file {path}: {reason}")]
    Model { path: String, reason: String },
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
    #[error("kv cache: {0}")]
    Cache(#[from] kivi_runtime::Error),
    #[error("kv cache: {0}")]
    Kv(#[from] kivi_candle::Error),
    #[error("scheme: {0}")]
    Scheme(#[from] kivi_spec::Invalid),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("invalid evaluation setting: {0}")]
    Config(String),
}

impl Error {
    /// An I/O error with the path it concerns.
    pub fn io(path: impl AsRef<std::path::Path>, source: std::io::Error) -> Error {
        Error::Io {
            path: path.as_ref().display().to_string(),
            source,
        }
    }
}

/// Result with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
