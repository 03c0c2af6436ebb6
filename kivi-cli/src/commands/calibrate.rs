//! `kivi calibrate`: learn the calibrated parts of schemes (`levels = nuq`
//! codebooks) from Gemma 3 270M's own K/V on a calibration text, and write
//! a calibration file (kivi_runtime::calib). Like `kivi eval`, it needs the
//! `eval` feature: `cargo run --release -p kivi-cli --features eval --
//! calibrate --schemes FILE --out gemma.kivical`.

use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// Schemes whose `levels = nuq` tensors get codebooks, comma-separated: preset names or scheme files (none: only the per-channel statistics)
    #[arg(long, value_delimiter = ',')]
    pub schemes: Vec<String>,
    /// A file of scheme declarations added to `--schemes` (scheme text holds commas)
    #[arg(long)]
    pub schemes_file: Option<PathBuf>,
    /// Where to write the calibration file
    #[arg(long)]
    pub out: PathBuf,
    /// Tokens of the calibration text to use, at most
    #[arg(long, default_value = "4k", value_parser = crate::args::count)]
    pub tokens: usize,
    /// Tokens per forward pass (each chunk a fresh sequence)
    #[arg(long, default_value = "1k", value_parser = crate::args::count)]
    pub chunk_tokens: usize,
    /// A text file (default: the bundled US Constitution, disjoint from the evaluation texts)
    #[arg(long)]
    pub text: Option<PathBuf>,
    /// A Gemma 3 GGUF file (default: fetch Gemma 3 270M Q4_K_M into $KIVI_CACHE_DIR/models or .cache/models)
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Weight key values by the mean squared query per channel (a stand-in for KVQuant's Fisher weights)
    #[arg(long)]
    pub weighted: bool,
    /// Most k-means (Lloyd) iterations per codebook
    #[arg(long, default_value_t = 100)]
    pub iterations: usize,
    /// Worker threads for the model
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// No progress bar
    #[arg(long)]
    pub quiet: bool,
}

#[cfg(feature = "eval")]
pub fn run(args: Args) -> super::Result {
    use kivi_eval::calibrate::{run, CalibConfig, Step};
    use kivi_eval::model::Weights;
    use kivi_runtime::calib::FitOptions;
    use std::io::{IsTerminal, Write};
    kivi_eval::set_threads(args.threads)?;
    let mut schemes = args
        .schemes
        .iter()
        .map(|s| kivi_eval::kv::resolve_scheme(s))
        .collect::<Result<Vec<_>, _>>()?;
    if let Some(p) = &args.schemes_file {
        let text = std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()))?;
        schemes.extend(kivi_spec::parse_schemes(&text).map_err(|e| format!("{}:{e}", p.display()))?);
    }
    let cfg = CalibConfig {
        model: args.model,
        text: args.text,
        tokens: args.tokens,
        chunk: args.chunk_tokens,
        schemes,
        fit: FitOptions {
            weighted: args.weighted,
            iterations: args.iterations,
        },
        weights: Weights::F32,
    };
    // A bar redrawn in place on a terminal, one line per step otherwise.
    let tty = std::io::stderr().is_terminal() && !args.quiet;
    let t0 = std::time::Instant::now();
    let mut progress = |s: Step| {
        let (what, done, total) = match s {
            Step::Note(l) => {
                if !args.quiet {
                    eprintln!("kivi calibrate: {l}");
                }
                return;
            }
            Step::Forward { done, total } => ("forward passes", done, total),
            Step::Fit { done, total } => ("codebooks (layers x schemes)", done, total),
        };
        if args.quiet {
            return;
        }
        let width = 30;
        let fill = (done * width).checked_div(total).unwrap_or(width);
        let line = format!(
            "kivi calibrate: [{}{}] {done}/{total} {what}, {:.0} s",
            "#".repeat(fill),
            ".".repeat(width - fill),
            t0.elapsed().as_secs_f64()
        );
        if tty {
            eprint!("\r{line}");
            if done == total {
                eprintln!();
            }
            let _ = std::io::stderr().flush();
        } else {
            eprintln!("{line}");
        }
    };
    let (cal, reports) = run(&cfg, &mut progress)?;
    cal.save(&args.out)?;
    println!(
        "wrote {} ({} entries, hash {:016x}) for {}",
        args.out.display(),
        cal.entries().len(),
        cal.hash(),
        cal.model
    );
    if !reports.is_empty() {
        println!("| layer | tensor | values | mse nuq | mse lloyd_max | ratio |");
        println!("|---:|---|---:|---:|---:|---:|");
        for r in &reports {
            println!(
                "| {} | {} | {} | {:.5} | {:.5} | {:.3} |",
                r.layer,
                r.tensor.name(),
                r.values,
                r.mse,
                r.mse_lloyd_max,
                r.mse / r.mse_lloyd_max
            );
        }
    }
    Ok(())
}

#[cfg(not(feature = "eval"))]
pub fn run(_args: Args) -> super::Result {
    Err(
        "built without the `eval` feature; run `cargo run --release -p kivi-cli --features eval -- calibrate ...`"
            .into(),
    )
}
