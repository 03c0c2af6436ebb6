//! `kivi`: inspect schemes, run decode attention on numpy inputs, generate
//! CUDA, tune, benchmark and evaluate. Every failure is a one-line message
//! and a non-zero exit, never a panic.

mod bench;
mod commands;
mod npy;
mod plot;

use clap::error::ErrorKind;
use clap::{Parser, Subcommand};

/// clap's error as one line: its first line without the `error: ` prefix,
/// and the valid values when it lists them.
fn usage_line(e: &clap::Error) -> String {
    let text = e.render().to_string();
    let mut lines = text.lines().map(str::trim).filter(|l| !l.is_empty());
    let first = lines.next().unwrap_or("invalid arguments");
    let first = first.strip_prefix("error: ").unwrap_or(first);
    match lines.find(|l| l.starts_with("[possible values:")) {
        Some(values) => format!("{first} {values}"),
        None => match e.kind() {
            ErrorKind::MissingRequiredArgument => {
                let missing: Vec<&str> = text
                    .lines()
                    .skip(1)
                    .map(str::trim)
                    .filter(|l| l.starts_with('-') || l.starts_with('<'))
                    .collect();
                format!("{first} {}", missing.join(", "))
            }
            _ => first.to_string(),
        },
    }
}

#[derive(Parser)]
#[command(name = "kivi", version, about = "Quantized KV caches: declare, generate, tune, run")]
struct Cli {
    #[command(subcommand)]
    cmd: Command,
}

#[derive(Subcommand)]
enum Command {
    /// List the preset schemes
    Schemes(commands::schemes::Args),
    /// Print a scheme's canonical form and exact memory cost
    Show(commands::show::Args),
    /// Fill a cache from .npy K/V and run decode attention for a .npy query
    Attend(commands::attend::Args),
    /// Print the generated CUDA source of a scheme's kernel
    Codegen(commands::codegen::Args),
    /// Tune kernel variants and cache the decisions
    Tune(commands::tune::Args),
    /// Show cached tuning decisions and why they were made
    Inspect(commands::inspect::Args),
    /// Benchmark decode attention against peers
    Bench(commands::bench::Args),
    /// Accuracy of schemes on a real LLM (Gemma 3 270M)
    Eval(commands::eval::Args),
    /// Generate text with Gemma 3 270M on a kivi cache
    Generate(commands::generate::Args),
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
    // Usage errors follow the CLI's rule too: one line on stderr, exit 2
    // (clap's own report spans several lines); help and version print as usual.
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) => e.exit(),
        Err(e) if e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => e.exit(),
        Err(e) => {
            eprintln!("kivi: error: {}", usage_line(&e));
            std::process::exit(2);
        }
    };
    let result = match cli.cmd {
        Command::Schemes(a) => commands::schemes::run(a),
        Command::Show(a) => commands::show::run(a),
        Command::Attend(a) => commands::attend::run(a),
        Command::Codegen(a) => commands::codegen::run(a),
        Command::Tune(a) => commands::tune::run(a),
        Command::Inspect(a) => commands::inspect::run(a),
        Command::Bench(a) => commands::bench::run(a),
        Command::Eval(a) => commands::eval::run(a),
        Command::Generate(a) => commands::generate::run(a),
    };
    if let Err(e) = result {
        eprintln!("kivi: error: {e}");
        std::process::exit(1);
    }
}
