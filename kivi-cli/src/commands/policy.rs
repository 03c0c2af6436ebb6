//! `kivi policy`: per-layer key/value precisions under a byte budget,
//! KVTuner-style (kivi_eval::policy). Measures every layer's damage under
//! every candidate on the calibration text (or reads a saved measurement),
//! searches the assignment of least predicted damage within the budget
//! exactly, and writes it as a model declaration that `kivi eval --models`
//! and `kivi show --model` read. Needs the `eval` feature:
//! `cargo run --release -p kivi-cli --features eval -- policy --budget kivi2 --out p.kivi`.

use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// The byte budget: a scheme (preset, text or file) on every layer (`kivi2`), bytes of K/V per token for all layers (`1500B`), or bits per held element (`3bits`); priced at --context
    #[arg(long, default_value = "kivi2")]
    pub budget: String,
    /// The context (tokens) bytes are priced at; sliding layers hold at most their window
    #[arg(long, default_value = "768", value_parser = crate::args::count)]
    pub context: usize,
    /// Bit widths of the KIVI candidate grid: keys per channel, values per token (groups of 32), every (K, V) pair; empty for none
    #[arg(long, value_delimiter = ',', default_value = "1,2,3,4")]
    pub bits: Vec<u32>,
    /// Full-precision recent window of the grid's candidates
    #[arg(long, default_value_t = 128)]
    pub residual: u32,
    /// Attention sinks of the grid's candidates
    #[arg(long, default_value_t = 0)]
    pub sinks: u32,
    /// More candidates, comma-separated: preset names, scheme text or files
    #[arg(long, value_delimiter = ',')]
    pub candidates: Vec<String>,
    /// A file of scheme declarations added to the candidates
    #[arg(long)]
    pub candidates_file: Option<PathBuf>,
    /// Where to write the model declaration (default: stdout)
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// The declaration's name
    #[arg(long, default_value = "policy")]
    pub name: String,
    /// Write the measured sensitivities (JSON) here
    #[arg(long)]
    pub save_sensitivities: Option<PathBuf>,
    /// Skip the measurement: search sensitivities saved by --save-sensitivities (candidates come from the file)
    #[arg(long, conflicts_with_all = ["candidates", "candidates_file"])]
    pub sensitivities: Option<PathBuf>,
    /// Calibration text (default: the bundled US Constitution, disjoint from the evaluation texts)
    #[arg(long)]
    pub text: Option<PathBuf>,
    /// Tokens prefilled (and quantized) before the scored steps
    #[arg(long, default_value_t = 512, value_parser = crate::args::count)]
    pub prefix: usize,
    /// Teacher-forced decode steps scored per configuration
    #[arg(long, default_value_t = 32, value_parser = crate::args::count)]
    pub steps: usize,
    /// Configurations decoded together in one batch
    #[arg(long, default_value_t = 32, value_parser = crate::args::count)]
    pub chunk: usize,
    /// A Gemma 3 GGUF file (default: fetch Gemma 3 270M Q4_K_M into $KIVI_CACHE_DIR/models or .cache/models)
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Worker threads for the model
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// No progress bar
    #[arg(long)]
    pub quiet: bool,
}

#[cfg(feature = "eval")]
pub fn run(args: Args) -> super::Result {
    use kivi_eval::policy::{self, Budget, Sensitivity, SensitivityConfig};
    use std::io::{IsTerminal, Write};
    // Everything that needs no model is checked before the model loads.
    let budget = Budget::parse(&args.budget)?;
    if let Budget::Scheme(s) = &budget {
        let scheme = kivi_eval::kv::resolve_scheme(s).map_err(|e| format!("--budget: {e}"))?;
        refuse_low_rank("--budget", &scheme)?;
    }
    let sens: Sensitivity = match &args.sensitivities {
        Some(p) => {
            let text = std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()))?;
            serde_json::from_str(&text).map_err(|e| format!("{}: not a sensitivity file: {e}", p.display()))?
        }
        None => {
            let mut candidates = if args.bits.is_empty() {
                Vec::new()
            } else {
                policy::kivi_grid(&args.bits, args.residual, args.sinks)?
            };
            for c in &args.candidates {
                candidates.push(kivi_eval::kv::resolve_scheme(c).map_err(|e| format!("--candidates: {e}"))?);
            }
            if let Some(p) = &args.candidates_file {
                let text = std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()))?;
                candidates.extend(kivi_spec::parse_schemes(&text).map_err(|e| format!("{}:{e}", p.display()))?);
            }
            if candidates.is_empty() {
                return Err("no candidates: give --bits, --candidates or --candidates-file".into());
            }
            for c in &candidates {
                refuse_low_rank("candidate", c)?;
            }
            kivi_eval::set_threads(args.threads)?;
            let cfg = SensitivityConfig {
                model: args.model.clone(),
                text: args.text.clone(),
                prefix: args.prefix,
                steps: args.steps,
                candidates,
                chunk: args.chunk,
                weights: kivi_eval::model::Weights::F32,
            };
            let tty = std::io::stderr().is_terminal() && !args.quiet;
            let t0 = std::time::Instant::now();
            let quiet = args.quiet;
            let mut progress = |done: usize, total: usize| {
                if quiet {
                    return;
                }
                let width = 30;
                let fill = (done * width).checked_div(total).unwrap_or(width);
                let eta = t0.elapsed().as_secs_f64() * (total - done) as f64 / done.max(1) as f64;
                let line = format!(
                    "kivi policy: [{}{}] {done}/{total} decode steps, {:.0} s, ~{eta:.0} s left",
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
                } else if done == total || done.is_multiple_of(8) {
                    eprintln!("{line}");
                }
            };
            let s = policy::measure(
                &cfg,
                &mut |l| {
                    if !quiet {
                        eprintln!("kivi policy: {l}")
                    }
                },
                &mut progress,
            )?;
            if let Some(p) = &args.save_sensitivities {
                std::fs::write(p, serde_json::to_string_pretty(&s)?).map_err(|e| format!("{}: {e}", p.display()))?;
            }
            s
        }
    };
    let found = policy::find(&sens, &budget, args.context)?;
    let layout = &sens.layout;
    let comment = format!(
        "Found by `kivi policy --budget {}` at {} tokens: {} of {} budget bytes \
         ({:.1} of {:.1} bytes/token, all layers),\npredicted damage (summed per-layer KL, nats) {:.5}; \
         sensitivities: {} ({} prefilled, {} scored steps) on {}.",
        args.budget,
        found.context,
        found.plan.cost,
        found.budget,
        found.plan.cost as f64 / found.context as f64,
        found.budget as f64 / found.context as f64,
        found.plan.damage,
        sens.text,
        sens.prefix,
        sens.steps,
        std::path::Path::new(&sens.model_file)
            .file_name()
            .map_or(sens.model_file.clone(), |f| f.to_string_lossy().into_owned()),
    );
    let decl = policy::declaration(&args.name, layout, &found.schemes, &comment)?;
    // The written text must read back to what was found.
    let back = kivi_spec::parse_model(&decl).map_err(|e| format!("internal: the declaration does not parse: {e}"))?;
    if policy::resolve_model(&back, layout)? != found.schemes {
        return Err("internal: the declaration reads back to other schemes".into());
    }
    match &args.out {
        Some(p) => {
            std::fs::write(p, &decl).map_err(|e| format!("{}: {e}", p.display()))?;
            eprintln!("kivi policy: wrote {}", p.display());
        }
        None => print!("{decl}"),
    }
    // The table goes to stderr when the declaration goes to stdout.
    let mut table = String::new();
    table += "| layer | kind | damage (KL, nats) per candidate | chosen | its damage | bytes at context |\n|---|---|---|---|---|---|\n";
    let kinds = layout.kinds();
    for (l, kind) in kinds.iter().enumerate() {
        let c = found.plan.choice[l];
        let row: Vec<String> = sens
            .names
            .iter()
            .zip(&sens.damage[l])
            .map(|(n, d)| format!("{n} {d:.4}"))
            .collect();
        table += &format!(
            "| {l} | {} | {} | {} | {:.5} | {} |\n",
            kind.name(),
            row.join(", "),
            sens.names[c],
            sens.damage[l][c],
            policy::layer_bytes(&found.schemes[l], layout, l, found.context)?
        );
    }
    if args.out.is_some() {
        print!("{table}");
    } else if !args.quiet {
        eprint!("{table}");
    }
    Ok(())
}

/// A `low_rank` scheme needs its bases from a calibration file (which
/// `kivi policy` does not take) and is priced by its coordinates, not by
/// full rows (what the policy's byte model counts): refused by name before
/// anything runs, rather than failing after the model loads.
#[cfg(feature = "eval")]
fn refuse_low_rank(what: &str, s: &kivi_spec::Scheme) -> super::Result {
    if s.low_rank.is_some() {
        return Err(format!(
            "{what} `{}` has low_rank: its bases come from a calibration file, which `kivi policy` does not take yet \
             (measure it with `kivi eval --calibration FILE`)",
            s.name
        )
        .into());
    }
    Ok(())
}

#[cfg(not(feature = "eval"))]
pub fn run(_args: Args) -> super::Result {
    Err("built without the `eval` feature; run `cargo run --release -p kivi-cli --features eval -- policy ...`".into())
}
