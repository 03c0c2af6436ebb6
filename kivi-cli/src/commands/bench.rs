//! `kivi bench`: decode-attention time of the CPU backend per scheme, against
//! the f16 baseline and Python peers, with the roofline numbers that bound it.
//!
//! ```text
//! kivi bench --quick                      # GQA 32:8 at 1k and 32k, batch 1
//! kivi bench                              # the full suite (1k..32k, batch 1 and 8, GQA and MQA)
//! kivi bench --long --json > bench.json   # adds 64k
//! kivi bench --contexts 4096 --batches 8 --layouts mqa --schemes f16,kivi2 --no-peers
//! kivi bench --quick --peers numpy,llama.cpp  # adds ggml's flash attention (f16, q8_0, q4_0 KV)
//! kivi bench --layouts mqa --contexts 32k --schemes f16,kivi2,eval/schemes/vq.kivi \
//!     --calibration gemma-vq.kivical      # calibrated schemes (nuq, vq) with their codebooks
//! kivi bench --layouts gqa --contexts 32k --schemes f16,kivi2,lr.kivi --no-peers
//!     # a low_rank scheme: its whole decode step (projection, coordinates,
//!     # reconstruction), bases fitted on the bench's own K/V without --calibration
//! ```

use crate::bench as suite;

use kivi_runtime::CpuParams;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// A fast subset: GQA 32:8, contexts 1024 and 32768, batch 1, 5 reps, numpy peer only
    #[arg(long)]
    quick: bool,
    /// Add 65536 tokens to the contexts (about 2.2 GB of f16 cache at batch 8)
    #[arg(long)]
    long: bool,
    /// Context lengths, comma-separated [default: 1k,4k,16k,32k]
    #[arg(long, value_delimiter = ',', value_parser = crate::args::count)]
    contexts: Vec<usize>,
    /// Batch sizes, comma-separated [default: 1,8]
    #[arg(long, value_delimiter = ',', value_parser = crate::args::count)]
    batches: Vec<usize>,
    /// Head layouts, comma-separated: gqa (32:8, d128), mqa (4:1, d256) [default: gqa,mqa]
    #[arg(long, value_delimiter = ',')]
    layouts: Vec<String>,
    /// Schemes, comma-separated: preset names or scheme files (see `kivi show --help`); f16 is the baseline [default: f16,int8,kivi4,kivi2]
    #[arg(long, value_delimiter = ',')]
    schemes: Vec<String>,
    /// Timed repetitions per point [default: 9, --quick 5]
    #[arg(long)]
    reps: Option<usize>,
    /// Kernel splits per sequence (0 = auto)
    #[arg(long, default_value_t = CpuParams::default().splits)]
    splits: usize,
    /// Kernel tile, tokens
    #[arg(long, default_value_t = CpuParams::default().tile_tokens, value_parser = crate::args::count)]
    tile: usize,
    /// Worker threads (0 = all cores)
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Force the scalar inner loops
    #[arg(long)]
    scalar: bool,
    /// Cap the kernel at AVX2 even where AVX-512 is available
    #[arg(long)]
    no_avx512: bool,
    /// Keep the KV warm in the CPU caches between reps (default: evict by
    /// reading 2x the last-level cache before each timed decode, as in serving)
    #[arg(long)]
    warm: bool,
    /// Skip the Python peers
    #[arg(long)]
    no_peers: bool,
    /// Peers to run, comma-separated: numpy, torch, jax, llama.cpp (ggml's CPU
    /// flash attention over f16/q8_0/q4_0 KV, built from the llama-cpp-python
    /// sdist on first use, a few minutes, cached) [default: numpy,torch,jax; --quick numpy]
    #[arg(long, value_delimiter = ',')]
    peers: Vec<String>,
    /// Where the llama.cpp peer's build is cached (one folder per version)
    #[arg(long, default_value = ".cache/ggml")]
    ggml_dir: PathBuf,
    /// The peers' venv, created on first use
    #[arg(long, default_value = ".cache/bench-py")]
    venv: PathBuf,
    /// Run the peers with this Python instead of the venv (e.g. one with CPU torch)
    #[arg(long)]
    python: Option<PathBuf>,
    /// Skip the prefill/append throughput and memory table
    #[arg(long)]
    no_prefill: bool,
    /// Tokens for the prefill/append/memory table
    #[arg(long, default_value = "32k", value_parser = crate::args::count)]
    prefill_tokens: usize,
    /// Only the cache-write table: append/extend tokens/s and GB/s per scheme
    /// (default: every preset), vectorised and reference writes side by side
    #[arg(long)]
    writes: bool,
    /// Print the report as JSON on stdout (progress goes to stderr)
    #[arg(long)]
    json: bool,
    /// Also write the JSON report to this file
    #[arg(long)]
    out: Option<PathBuf>,
    /// A calibration file (`kivi calibrate`) for schemes with calibrated codebooks (levels = nuq, vq(...)) or low_rank bases; its model's shape must match the layouts (Gemma 3 270M: --layouts mqa). Without it the bench fits them on its own K/V
    #[arg(long)]
    calibration: Option<PathBuf>,
    /// The layer of the calibration whose codebooks or bases the caches use
    #[arg(long, default_value_t = 0)]
    layer: usize,
}

pub fn run(a: Args) -> super::Result {
    let command = format!("kivi {}", std::env::args().skip(1).collect::<Vec<_>>().join(" "));
    let or = |v: Vec<String>, d: &[&str]| {
        if v.is_empty() {
            d.iter().map(|s| s.to_string()).collect()
        } else {
            v
        }
    };
    let mut contexts = if !a.contexts.is_empty() {
        a.contexts.clone()
    } else if a.quick {
        vec![1024, 32768]
    } else {
        vec![1024, 4096, 16384, 32768]
    };
    if a.long && !contexts.contains(&65536) {
        contexts.push(65536);
    }
    let batches = if !a.batches.is_empty() {
        a.batches.clone()
    } else if a.quick {
        vec![1]
    } else {
        vec![1, 8]
    };
    let layouts = or(a.layouts, if a.quick { &["gqa"] } else { &["gqa", "mqa"] })
        .iter()
        .map(|n| suite::Layout::by_name(n).ok_or_else(|| format!("unknown layout `{n}`; expected gqa or mqa")))
        .collect::<Result<Vec<_>, _>>()?;
    if contexts.iter().chain(&batches).any(|&x| x == 0) {
        return Err("contexts and batches must be positive".into());
    }
    if a.writes {
        let isa = match (a.scalar, a.no_avx512) {
            (true, _) => kivi_runtime::cpu::Isa::Scalar,
            (false, true) => kivi_runtime::cpu::Isa::Avx2,
            _ => kivi_runtime::cpu::Isa::Avx512,
        };
        let out = a.out.as_deref();
        return crate::bench::writes::main(&layouts, a.schemes, a.prefill_tokens, a.reps, isa, a.json, out);
    }
    let params = CpuParams {
        splits: a.splits,
        tile_tokens: a.tile,
        threads: a.threads,
        scalar: a.scalar,
        avx512: !a.no_avx512,
    };
    kivi_runtime::CpuBackend::new(params)?;
    let cfg = suite::Config {
        layouts,
        contexts,
        batches,
        schemes: or(a.schemes, &["f16", "int8", "kivi4", "kivi2"]),
        reps: a.reps.unwrap_or(if a.quick { 5 } else { 9 }),
        params,
        cold: !a.warm,
        prefill: !a.no_prefill,
        prefill_tokens: a.prefill_tokens,
        calibration: match &a.calibration {
            Some(p) => Some((
                kivi_runtime::calib::Calibration::load(p).map_err(|e| e.to_string())?,
                a.layer,
            )),
            None => None,
        },
    };
    let peer_opts = suite::peers::PeerOptions {
        venv: a.venv,
        python: a.python,
        peers: if a.no_peers {
            Vec::new()
        } else {
            or(
                a.peers,
                if a.quick {
                    &["numpy"]
                } else {
                    &["numpy", "torch", "jax"]
                },
            )
        },
        // Peers are slow at long contexts: at most 5 timed reps each.
        reps: cfg.reps.min(5),
        threads: if a.threads > 0 {
            a.threads
        } else {
            rayon::current_num_threads()
        },
        cold: !a.warm,
        ggml_dir: a.ggml_dir,
    };
    let mut log = |m: &str| eprintln!("kivi bench: {m}");
    let mut peers = |shapes: &[suite::peers::Shape]| {
        let mut log = |m: &str| eprintln!("kivi bench: {m}");
        suite::peers::run(&peer_opts, shapes, &mut log)
    };
    let report = suite::run(&cfg, command, &mut peers, &mut log)?;
    let json = serde_json::to_string_pretty(&report)?;
    if let Some(path) = &a.out {
        std::fs::write(path, &json).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    }
    if a.json {
        println!("{json}");
    } else {
        print!("{}", suite::render(&report));
    }
    Ok(())
}
