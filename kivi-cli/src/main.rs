//! `kivi`: inspect schemes, run decode attention on numpy inputs, generate
//! CUDA, tune, benchmark and evaluate. Every failure is a one-line message
//! and a non-zero exit, never a panic.

mod args;
mod bench;
mod commands;
mod npy;
mod plot;

use clap::error::{ContextKind, ContextValue, ErrorKind};
use clap::{CommandFactory, Parser, Subcommand};

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
            // `kivi show kivi2`: schemes are named by a flag everywhere; say
            // so where the subcommand takes one (its usage line names it).
            // (`show` takes --scheme or --model, so its usage line names neither.)
            ErrorKind::UnknownArgument
                if positional(e) && (text.contains("--scheme <SCHEME>") || text.contains("Usage: kivi show ")) =>
            {
                format!("{first}; name a scheme with --scheme NAME")
            }
            _ => first.to_string(),
        },
    }
}

/// Whether clap refused a bare word (not a flag).
fn positional(e: &clap::Error) -> bool {
    matches!(e.get(ContextKind::InvalidArg), Some(ContextValue::String(a)) if !a.starts_with('-'))
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
    /// Learn calibrated codebooks (levels = nuq) from Gemma 3 270M's K/V and write a calibration file
    Calibrate(commands::calibrate::Args),
    /// Search per-layer key/value precisions under a byte budget (KVTuner-style) and write the model declaration
    Policy(commands::policy::Args),
    /// Print a shell completion script, e.g. `kivi completions bash > ~/.local/share/bash-completion/completions/kivi`
    Completions(Completions),
}

#[derive(clap::Args)]
struct Completions {
    /// The shell to complete for
    #[arg(value_enum)]
    shell: clap_complete::Shell,
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
        Command::Calibrate(a) => commands::calibrate::run(a),
        Command::Policy(a) => commands::policy::run(a),
        Command::Completions(a) => {
            clap_complete::generate(a.shell, &mut Cli::command(), "kivi", &mut std::io::stdout());
            Ok(())
        }
    };
    if let Err(e) = result {
        eprintln!("kivi: error: {e}");
        std::process::exit(1);
    }
}

/// The one CLI convention, checked over clap's own model of every
/// subcommand (enumerated from `Cli::command()`, so a new subcommand is
/// held to it without editing this list):
/// - a scheme is named by `--scheme NAME` (one) or `--schemes A,B` (many),
///   never positionally;
/// - a flag that takes a list is plural and comma-separated, and one whose
///   help says "comma-separated" really is a list;
/// - `--backend` is a fixed choice whose values the help lists;
/// - every token count (contexts, lengths, windows, tiles) takes `1k`/`32k`
///   suffixes through the one parser, and refuses junk.
#[cfg(test)]
mod convention {
    use super::Cli;
    use clap::{Arg, Command, CommandFactory};
    use std::ffi::OsStr;

    /// Every subcommand, nested ones included, but not clap's `help`.
    fn walk(cmd: &Command, out: &mut Vec<Command>) {
        for sub in cmd.get_subcommands() {
            if sub.get_name() != "help" {
                out.push(sub.clone());
                walk(sub, out);
            }
        }
    }

    fn subcommands() -> Vec<Command> {
        let mut root = Cli::command();
        root.build();
        let mut out = Vec::new();
        walk(&root, &mut out);
        assert!(out.len() >= 8, "only {} subcommands found", out.len());
        out
    }

    fn help(a: &Arg) -> String {
        let mut h = a.get_help().map(|s| s.to_string()).unwrap_or_default();
        if let Some(l) = a.get_long_help() {
            h.push(' ');
            h.push_str(&l.to_string());
        }
        h.to_lowercase()
    }

    fn takes_value(a: &Arg) -> bool {
        a.get_num_args().is_some_and(|n| n.takes_values())
    }

    /// Whether `kivi SUB --flag VALUE` gets past clap, with every other
    /// argument made optional so that only this value is judged.
    fn parses(cmd: &Command, a: &Arg, v: &str) -> bool {
        let long = format!("--{}", a.get_long().unwrap_or_default());
        let probe = cmd.clone().mut_args(|x| x.required(false));
        // A flag that is required unless another is present (`kivi show
        // --scheme` unless `--model`) still reports the pair as missing:
        // that is not about this value, which clap checked first.
        match probe.try_get_matches_from([OsStr::new("kivi"), OsStr::new(&long), OsStr::new(v)]) {
            Ok(_) => true,
            Err(e) => e.kind() == clap::error::ErrorKind::MissingRequiredArgument,
        }
    }

    /// Flags that are token counts, by name or by what their help says.
    fn is_token_count(a: &Arg) -> bool {
        let long = a.get_long().unwrap_or("");
        let h = help(a);
        takes_value(a)
            && (long.contains("context")
                || long.contains("token")
                || ["window", "lens", "prefix", "tile"].contains(&long)
                || h.contains("tokens"))
    }

    #[test]
    fn no_scheme_is_positional() {
        for cmd in subcommands() {
            for a in cmd.get_positionals() {
                let id = a.get_id().as_str();
                assert!(
                    !id.contains("scheme"),
                    "kivi {}: the scheme is positional (`{id}`); use --scheme NAME",
                    cmd.get_name()
                );
            }
            for a in cmd
                .get_arguments()
                .filter(|a| a.get_long().is_some_and(|l| l.contains("scheme")))
            {
                let long = a.get_long().unwrap_or("");
                assert!(
                    ["scheme", "schemes", "schemes-file"].contains(&long),
                    "kivi {}: --{long} is not --scheme or --schemes",
                    cmd.get_name()
                );
            }
        }
    }

    #[test]
    fn list_flags_are_plural_and_comma_separated() {
        for cmd in subcommands() {
            for a in cmd.get_arguments().filter(|a| takes_value(a)) {
                let long = a.get_long().unwrap_or("");
                let list = a.get_value_delimiter() == Some(',');
                if list {
                    assert!(
                        long.ends_with('s'),
                        "kivi {} --{long}: a list flag is plural",
                        cmd.get_name()
                    );
                }
                if help(a).contains("comma-separated") {
                    assert!(
                        list,
                        "kivi {} --{long}: says comma-separated but is one value",
                        cmd.get_name()
                    );
                }
                // The singular spellings of the list flags are gone.
                assert!(
                    !["batch", "layout", "peer"].contains(&long),
                    "kivi {} --{long}: list flags are plural",
                    cmd.get_name()
                );
            }
        }
    }

    #[test]
    fn backend_flags_are_fixed_choices_listed_in_help() {
        let mut seen = 0;
        for mut cmd in subcommands() {
            let help_text = cmd.render_long_help().to_string();
            let name = cmd.get_name().to_string();
            for a in cmd.get_arguments().filter(|a| a.get_long() == Some("backend")) {
                seen += 1;
                let values = a.get_possible_values();
                assert!(!values.is_empty(), "kivi {name} --backend is free text");
                for v in &values {
                    assert!(
                        help_text.contains(v.get_name()),
                        "kivi {name} --help does not list backend `{}`",
                        v.get_name()
                    );
                }
                assert!(!parses(&cmd, a, "tpu"), "kivi {name} --backend accepts `tpu`");
            }
        }
        assert!(seen >= 3, "only {seen} --backend flags found");
    }

    #[test]
    fn token_counts_take_size_suffixes() {
        let mut seen = 0;
        for cmd in subcommands() {
            for a in cmd.get_arguments().filter(|a| is_token_count(a)) {
                seen += 1;
                let long = a.get_long().unwrap_or("");
                for ok in ["512", "1k", "32K", "1m"] {
                    assert!(parses(&cmd, a, ok), "kivi {} --{long} refuses `{ok}`", cmd.get_name());
                }
                for bad in ["1x", "k", "-1", ""] {
                    assert!(
                        !parses(&cmd, a, bad),
                        "kivi {} --{long} accepts `{bad}`",
                        cmd.get_name()
                    );
                }
            }
        }
        assert!(seen >= 8, "only {seen} token-count flags found");
    }
}
