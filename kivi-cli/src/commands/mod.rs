//! One module per subcommand: `Args` (clap) and `run`.

pub mod attend;
pub mod attend_mla;
pub mod bench;
pub mod calibrate;
pub mod codegen;
pub mod eval;
pub mod generate;
pub mod inspect;
pub mod policy;
pub mod schemes;
pub mod show;
pub mod show_mla;
pub mod tune;

/// Errors bubble up to `main`, which prints them on one line.
pub type Error = Box<dyn std::error::Error + Send + Sync>;
pub type Result<T = ()> = std::result::Result<T, Error>;
