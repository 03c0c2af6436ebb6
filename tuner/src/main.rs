//! `kivi`: inspect schemes, run decode attention on numpy inputs, generate
//! CUDA, tune, benchmark and evaluate. Every failure is a one-line message
//! and a non-zero exit, never a panic.

mod cli;
mod npy;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "kivi", version, about = "Quantized KV caches: declare, generate, tune, run")]
struct Cli {
    #[command(subcommand)]
    cmd: Command,
}

#[derive(Subcommand)]
enum Command {
    /// List the preset schemes
    Schemes(cli::schemes::Args),
    /// Print a scheme's canonical form and exact memory cost
    Show(cli::show::Args),
    /// Fill a cache from .npy K/V and run decode attention for a .npy query
    Attend(cli::attend::Args),
    /// Print the generated CUDA source of a scheme's kernel
    Codegen(cli::codegen::Args),
    /// Tune kernel variants and cache the decisions
    Tune(cli::tune::Args),
    /// Show cached tuning decisions and why they were made
    Inspect(cli::inspect::Args),
    /// Benchmark decode attention against peers
    Bench(cli::bench::Args),
    /// Accuracy of schemes on a real LLM (Gemma 3 270M)
    Eval(cli::eval::Args),
}

/// Dies quietly on a closed pipe (`kivi schemes | head`), as Unix tools do,
/// instead of panicking in `println!`: Rust ignores SIGPIPE by default.
#[cfg(unix)]
fn default_sigpipe() {
    extern "C" {
        fn signal(signum: i32, handler: usize) -> usize;
    }
    const SIGPIPE: i32 = 13;
    const SIG_DFL: usize = 0;
    // SAFETY: restoring the default disposition of one signal before any
    // thread starts; `signal` is async-signal-safe and has this C signature.
    unsafe {
        signal(SIGPIPE, SIG_DFL);
    }
}

#[cfg(not(unix))]
fn default_sigpipe() {}

fn main() {
    default_sigpipe();
    let cli = Cli::parse();
    let result = match cli.cmd {
        Command::Schemes(a) => cli::schemes::run(a),
        Command::Show(a) => cli::show::run(a),
        Command::Attend(a) => cli::attend::run(a),
        Command::Codegen(a) => cli::codegen::run(a),
        Command::Tune(a) => cli::tune::run(a),
        Command::Inspect(a) => cli::inspect::run(a),
        Command::Bench(a) => cli::bench::run(a),
        Command::Eval(a) => cli::eval::run(a),
    };
    if let Err(e) = result {
        eprintln!("kivi: error: {e}");
        std::process::exit(1);
    }
}
