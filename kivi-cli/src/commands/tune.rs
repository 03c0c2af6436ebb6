//! `kivi tune`: tune kernel variants for a scheme over shape buckets and
//! cache the decisions.

use super::schemes::load_scheme;
use crate::args::BackendChoice;
use kivi_spec::{Heads, Scheme};
use kivi_tuner::bucket::Bucket;
use kivi_tuner::decisions::{self, Entry, Status, Store};
use kivi_tuner::progress::Bar;
use kivi_tuner::tune::{self, DecisionOrigin, Outcome, Plan, Target};
use kivi_tuner::CpuTarget;
use std::path::PathBuf;
use std::time::Instant;

/// The backends `tune` measures (`auto` adds a static ranking of the CUDA
/// variants when it falls back to cpu).
const BACKENDS: &[BackendChoice] = &[
    BackendChoice::Auto,
    BackendChoice::Cpu,
    BackendChoice::Sim,
    BackendChoice::Cuda,
];

#[derive(clap::Args)]
pub struct Args {
    /// Scheme text (contains `{`), else a preset name (`kivi schemes`), else a file path (`./NAME` for a file named like a preset)
    #[arg(long)]
    scheme: String,
    /// Backend to tune
    #[arg(long, default_value = "auto", value_parser = crate::args::backend(BACKENDS))]
    backend: BackendChoice,
    /// Head layout: gqa:Q:KV, mha:N or mqa:Q (default: the scheme's own, else gqa:32:8)
    #[arg(long, value_parser = super::show::parse_heads)]
    heads: Option<Heads>,
    /// Head dimension (default: the scheme's, else 128)
    #[arg(long)]
    head_dim: Option<u32>,
    /// Context lengths to tune, comma-separated (each names a power-of-two bucket)
    #[arg(long, value_delimiter = ',', default_value = "1k,4k,16k", value_parser = crate::args::count)]
    contexts: Vec<usize>,
    /// Batch sizes to tune, comma-separated
    #[arg(long, value_delimiter = ',', default_value = "1,4", value_parser = crate::args::count)]
    batches: Vec<usize>,
    /// Time budget in seconds for all buckets that need measuring
    #[arg(long, default_value_t = 60.0)]
    budget: f64,
    /// Print the results as JSON on stdout instead of a table
    #[arg(long)]
    json: bool,
    /// Write an SVG chart of time per variant per context length
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Decision cache directory (default: $KIVI_CACHE_DIR, $XDG_CACHE_HOME/kivi or ~/.cache/kivi)
    #[arg(long)]
    cache_dir: Option<PathBuf>,
    /// Record this variant as the choice for every bucket (verified, not timed)
    #[arg(long)]
    pin: Option<String>,
    /// Ignore cached timings and pins; measure everything again
    #[arg(long)]
    force: bool,
    /// Also measure candidates that an earlier run skipped when its budget ran out
    #[arg(long)]
    resume: bool,
    /// Import a decision bundle (from `kivi inspect --export`) instead of tuning
    #[arg(long, conflicts_with_all = ["pin", "force"])]
    import: Option<PathBuf>,
    /// No progress bar
    #[arg(long)]
    quiet: bool,
    /// A calibration file (`kivi calibrate`) for a scheme with levels = nuq tensors, vq(...) codecs or low_rank (any backend: their codebooks, tables or bases); decisions are keyed by the scheme and this calibration together
    #[arg(long)]
    calibration: Option<PathBuf>,
    /// The model layer whose codebooks or bases `--calibration` supplies
    #[arg(long, default_value_t = 0, requires = "calibration")]
    layer: usize,
}

/// `--calibration`'s file, checked against what `scheme` needs: `None`
/// for a scheme without calibrated codebooks (`levels = nuq`, `vq(...)`),
/// an error when such a scheme has no file or another scheme has one.
fn calibration(scheme: &Scheme, args: &Args) -> super::Result<Option<kivi_runtime::calib::Calibration>> {
    let needs = scheme.has_vq()
        || [kivi_spec::Tensor::Key, kivi_spec::Tensor::Value].iter().any(|t| {
            scheme
                .codec(*t)
                .quant()
                .is_some_and(|q| matches!(q.levels, kivi_spec::Levels::Nuq(_)))
        });
    let Some(path) = &args.calibration else {
        if needs {
            return Err(format!(
                "scheme `{}` has levels = nuq tensors or vq(...) codecs, whose codebooks come from a calibration: pass --calibration FILE (made by `kivi calibrate`) and --layer N",
                scheme.name
            )
            .into());
        }
        return Ok(None);
    };
    if !needs {
        return Err(format!(
            "--calibration: scheme `{}` has no levels = nuq tensor and no vq(...) codec, so a calibration would change nothing but its tuning key; drop the flag",
            scheme.name
        )
        .into());
    }
    let cal =
        kivi_runtime::calib::Calibration::load(path).map_err(|e| format!("--calibration {}: {e}", path.display()))?;
    Ok(Some(cal))
}

/// The CUDA target `t` (GPU or simulated), with `--calibration`'s vq
/// codebooks and `nuq` tables where the scheme needs them.
fn with_cuda_calibration(
    t: kivi_tuner::cuda::CudaTarget,
    scheme: &Scheme,
    args: &Args,
) -> super::Result<kivi_tuner::cuda::CudaTarget> {
    if scheme.low_rank.is_some() {
        return Ok(t); // the calibration holds its bases: LowRankTarget takes them
    }
    match calibration(scheme, args)? {
        None => Ok(t),
        Some(cal) => Ok(t.with_calibration(&cal, args.layer).map_err(|e| {
            format!(
                "--calibration {} (layer {}): {e}",
                args.calibration
                    .as_deref()
                    .unwrap_or(std::path::Path::new(""))
                    .display(),
                args.layer
            )
        })?),
    }
}

/// The CPU target for `scheme`, with `--calibration`'s codebooks where given.
fn cpu_target(scheme: &Scheme, args: &Args) -> super::Result<CpuTarget> {
    let Some(cal) = calibration(scheme, args)? else {
        return Ok(CpuTarget::new(scheme)?);
    };
    let path = args.calibration.as_deref().unwrap_or(std::path::Path::new(""));
    Ok(CpuTarget::with_calibration(scheme, &cal, args.layer)
        .map_err(|e| format!("--calibration {} (layer {}): {e}", path.display(), args.layer))?)
}

/// For a low-rank scheme, the calibration `--calibration` names (its bases
/// are checked by `LowRankTarget::new`); `None` for any other scheme.
fn low_rank_calibration(scheme: &Scheme, args: &Args) -> super::Result<Option<kivi_runtime::calib::Calibration>> {
    if scheme.low_rank.is_none() {
        return Ok(None);
    }
    let Some(path) = &args.calibration else {
        return Err(format!(
            "scheme `{}` has low_rank, whose bases come from a calibration: pass --calibration FILE (made by `kivi calibrate`) and --layer N",
            scheme.name
        )
        .into());
    };
    let cal =
        kivi_runtime::calib::Calibration::load(path).map_err(|e| format!("--calibration {}: {e}", path.display()))?;
    Ok(Some(cal))
}

/// Binds the shape from the flags or the scheme's own.
pub fn bind(scheme: &Scheme, heads: Option<Heads>, head_dim: Option<u32>) -> super::Result<Scheme> {
    let h = heads.or(scheme.heads).unwrap_or(Heads::Gqa { q: 32, kv: 8 });
    let d = head_dim.or(scheme.head_dim).unwrap_or(128);
    Ok(scheme
        .with_shape(h, d)
        .map_err(|e| format!("scheme `{}`: {e}", scheme.name))?)
}

pub fn fmt_time(s: f64) -> String {
    if !s.is_finite() {
        "-".into()
    } else if s >= 1.0 {
        format!("{s:.2} s")
    } else if s >= 1e-3 {
        format!("{:.3} ms", s * 1e3)
    } else {
        format!("{:.1} us", s * 1e6)
    }
}

/// The table rows worth showing for one entry: the choice, the default,
/// the three next fastest, and everything rejected.
pub fn print_entry_table(e: &Entry, all: bool) {
    let def = e
        .candidate(&e.default)
        .and_then(|c| c.timing.filter(|_| c.status.timed()));
    let mut timed: Vec<_> = e
        .candidates
        .iter()
        .filter(|c| c.status.timed() && c.timing.is_some())
        .collect();
    timed.sort_by(|a, b| a.timing.unwrap().median_s.total_cmp(&b.timing.unwrap().median_s));
    let mut rows: Vec<&decisions::CandidateRecord> = Vec::new();
    let push = |c: &'_ decisions::CandidateRecord, rows: &mut Vec<_>| {
        if !rows.iter().any(|r: &&decisions::CandidateRecord| r.name == c.name) {
            rows.push(e.candidate(&c.name).expect("own candidate"));
        }
    };
    if let Some(c) = e.candidate(&e.chosen) {
        push(c, &mut rows);
    }
    if let Some(c) = e.candidate(&e.default) {
        push(c, &mut rows);
    }
    // The chosen, the default and three more of the fastest (all with --all).
    let limit = if all { usize::MAX } else { 5 };
    for c in &timed {
        if rows.len() >= limit {
            break;
        }
        push(c, &mut rows);
    }
    for c in e.candidates.iter().filter(|c| all || c.status == Status::Rejected) {
        push(c, &mut rows);
    }
    let w = rows.iter().map(|r| r.name.len()).max().unwrap_or(8).max(8) + 2;
    println!(
        "  {:<w$} {:>10} {:>21} {:>7} {:>9}  status",
        "variant", "median", "p20 / p80", "GB/s", "vs dflt"
    );
    for r in rows {
        let mark = if r.name == e.chosen { "*" } else { " " };
        let name = if r.name == e.default {
            format!("{} (default)", r.name)
        } else {
            r.name.clone()
        };
        let name = format!("{mark}{name}");
        let w2 = w + 10;
        match r.timing.filter(|_| r.status.timed()) {
            Some(t) => {
                let sp = def
                    .map(|d| format!("{:.2}x", d.median_s / t.median_s))
                    .unwrap_or_else(|| "-".into());
                let roof = e
                    .peak_gbps
                    .map(|p| format!(" ({:.0}%)", t.gbps / p * 100.0))
                    .unwrap_or_default();
                println!(
                    "  {name:<w2$.w2$} {:>10} {:>21} {:>7.2} {:>9}  {}{roof}{}",
                    fmt_time(t.median_s),
                    format!("{} / {}", fmt_time(t.p20_s), fmt_time(t.p80_s)),
                    t.gbps,
                    sp,
                    r.status.name(),
                    r.reason.as_ref().map(|x| format!(": {x}")).unwrap_or_default()
                );
            }
            None => println!(
                "  {name:<w2$.w2$} {:>10} {:>21} {:>7} {:>9}  {}{}",
                "-",
                "-",
                "-",
                "-",
                r.status.name(),
                r.reason.as_ref().map(|x| format!(": {x}")).unwrap_or_default()
            ),
        }
    }
    let count = |s: Status| e.candidates.iter().filter(|c| c.status == s).count();
    if !all {
        println!(
            "  ({} candidates: {} ok, {} eliminated, {} rejected, {} pruned, {} skipped; `kivi inspect` lists them all)",
            e.candidates.len(),
            count(Status::Ok),
            count(Status::Eliminated),
            count(Status::Rejected),
            count(Status::Pruned),
            count(Status::Skipped)
        );
    }
}

/// The CUDA decode variants ranked without timing them: generated, compiled
/// with NVRTC for `arch` where NVRTC is present (ptxas resources), occupancy
/// on `sms` multiprocessors, pruned and ranked. `on` names the device the
/// numbers describe (the simulated device's, or an H200's where there is
/// no device at all).
fn print_static_ranking(scheme: &Scheme, buckets: &[Bucket], arch: kivi_runtime::cuda::Arch, sms: u32, on: &str) {
    use kivi_runtime::cuda::Compiler;
    let compiler = Compiler::new().ok();
    let mut batches: Vec<u32> = buckets.iter().map(|b| b.batch).collect();
    batches.dedup();
    for batch in batches {
        let b = buckets.iter().find(|x| x.batch == batch).expect("listed");
        println!();
        println!(
            "CUDA decode variants, static ranking for batch {batch} on {arch} / {sms} SMs ({on}; {}; not timed on a GPU):",
            if compiler.is_some() {
                "compiled with NVRTC, ptxas resources"
            } else {
                "NVRTC not found, launch shapes only"
            }
        );
        match kivi_tuner::cuda::static_ranking(scheme, b, arch, sms, compiler.as_ref()) {
            Err(e) => println!("  {e}"),
            Ok(rows) => {
                println!(
                    "  {:<28} {:>7} {:>7} {:>6} {:>6} {:>9} {:>6}  verdict",
                    "variant", "threads", "blocks", "regs", "spill", "smem B", "score"
                );
                for (i, r) in rows.iter().enumerate() {
                    let res = r.compiled.as_ref().ok().and_then(|x| x.as_ref());
                    let verdict = match (&r.pruned, &r.compiled) {
                        (Some(p), _) => format!("pruned: {p}"),
                        (None, Err(e)) => format!("rank {} (not compiled: {e})", i + 1),
                        (None, Ok(_)) => format!(
                            "rank {}{}",
                            i + 1,
                            r.blocks_per_sm
                                .map(|(n, why)| format!(", {n} blocks/SM (limit: {why})"))
                                .unwrap_or_default()
                        ),
                    };
                    println!(
                        "  {:<28} {:>7} {:>7} {:>6} {:>6} {:>9} {:>6}  {verdict}",
                        r.name,
                        r.threads,
                        r.grid_blocks,
                        res.map_or("-".into(), |x| x.registers.to_string()),
                        res.map_or("-".into(), |x| (x.spill_stores + x.spill_loads).to_string()),
                        r.shared_bytes,
                        r.score.map_or("-".into(), |x| format!("{x:.2}")),
                    );
                }
            }
        }
    }
}

fn origin_text(o: &Outcome) -> String {
    match &o.origin {
        DecisionOrigin::Cached => "cached (nothing measured)".into(),
        DecisionOrigin::Pinned => "pinned".into(),
        DecisionOrigin::Tuned { measured, reused } => {
            format!("tuned in {:.1} s ({measured} measured, {reused} reused)", o.spent_s)
        }
        DecisionOrigin::Failed(e) => format!("FAILED: {e}"),
    }
}

pub fn run(args: Args) -> super::Result {
    let t0 = Instant::now();
    if !(args.budget.is_finite() && args.budget > 0.0) {
        return Err(format!("--budget {} must be a positive number of seconds", args.budget).into());
    }
    let dir = decisions::cache_dir(args.cache_dir.as_deref())?;
    let mut warnings: Vec<String> = Vec::new();
    if let Some(bundle) = &args.import {
        let n = decisions::import_bundle(&dir, bundle, &mut warnings)?;
        for w in &warnings {
            eprintln!("kivi: warning: {w}");
        }
        println!(
            "imported {n} decisions from {} into {}",
            bundle.display(),
            dir.display()
        );
        return Ok(());
    }
    let scheme = bind(&load_scheme(&args.scheme)?, args.heads, args.head_dim)?;
    let shape = scheme.shape().expect("bound");
    let gqa = shape.group_size();
    let (contexts, batches) = (&args.contexts, &args.batches);
    if contexts.is_empty() || batches.is_empty() {
        return Err("--contexts and --batches need at least one value each".into());
    }
    let mut buckets: Vec<Bucket> = Vec::new();
    for &b in batches {
        for &c in contexts {
            let k = Bucket::of(b, c, gqa);
            if !buckets.contains(&k) {
                buckets.push(k);
            }
        }
    }

    let mut notes: Vec<String> = Vec::new();
    // (arch, SMs, what they describe) for a ranking of the CUDA variants on paper
    let mut static_report: Option<(kivi_runtime::cuda::Arch, u32, String)> = None;
    // A low-rank scheme tunes its coordinate scheme's kernels (CPU paths or
    // generated CUDA), keyed by the low-rank scheme and the calibration of
    // its bases (kivi_tuner::low_rank).
    let low_rank = low_rank_calibration(&scheme, &args)?;
    let tuned = kivi_templates::kernel_scheme(&scheme).into_owned();
    let cpu = || -> super::Result<CpuTarget> {
        match low_rank {
            Some(_) => Ok(CpuTarget::new(&tuned)?),
            None => cpu_target(&scheme, &args),
        }
    };
    let target: Box<dyn Target> = match args.backend {
        // `reference` is not offered (BACKENDS): there is nothing to tune in it.
        BackendChoice::Cpu | BackendChoice::Reference => Box::new(cpu()?),
        BackendChoice::Sim => {
            let dev = kivi_runtime::device::SimDevice::shared();
            let i = dev.info();
            static_report = Some((i.arch, i.sms.max(1) as u32, "the simulated device's limits".into()));
            notes.push(
                "simulated device: timings are host-clock times of simulated launches and rank nothing \
                 about a GPU; the run checks every candidate against the reference"
                    .into(),
            );
            Box::new(with_cuda_calibration(
                kivi_tuner::cuda::CudaTarget::sim(&tuned, dev)?,
                &scheme,
                &args,
            )?)
        }
        // Asked for a GPU by name: no GPU is an error, never another backend.
        BackendChoice::Cuda => Box::new(with_cuda_calibration(
            kivi_tuner::cuda::CudaTarget::new(&tuned).map_err(|why| {
                format!("--backend cuda: {why} (use --backend sim to tune on the simulated device, or cpu)")
            })?,
            &scheme,
            &args,
        )?),
        BackendChoice::Auto => match kivi_tuner::cuda::CudaTarget::new(&tuned) {
            Ok(t) => Box::new(with_cuda_calibration(t, &scheme, &args)?),
            Err(why) => {
                // No GPU here: tune what can run, and still say how the
                // CUDA variants compare on paper.
                notes.push(format!("no usable CUDA device ({why}); tuning the cpu backend instead"));
                static_report = Some((
                    kivi_runtime::cuda::Arch::SM90,
                    132,
                    "an H200, assumed: no GPU here".into(),
                ));
                Box::new(cpu()?)
            }
        },
    };
    let target: Box<dyn Target> = match &low_rank {
        Some(cal) => Box::new(
            kivi_tuner::low_rank::LowRankTarget::new(&scheme, target, cal, args.layer).map_err(|e| {
                let path = args.calibration.as_deref().unwrap_or(std::path::Path::new("?"));
                format!("--calibration {} (layer {}): {e}", path.display(), args.layer)
            })?,
        ),
        None => target,
    };
    let target: &dyn Target = target.as_ref();
    let store = Store::new(dir.clone(), target.device(), target.toolchain());
    let plan = Plan {
        budget_s: args.budget,
        force: args.force,
        pin: args.pin.clone(),
        resume: args.resume,
    };
    let mut bar = Bar::new(buckets.clone(), args.budget, args.quiet || args.json);
    for n in &notes {
        eprintln!("kivi: note: {n}");
    }
    let outcomes = tune::run(target, &store, &scheme, &buckets, &plan, &mut bar, &mut warnings);
    bar.clear();
    for w in &warnings {
        eprintln!("kivi: warning: {w}");
    }

    let entries: Vec<&Entry> = outcomes.iter().filter_map(|o| o.entry.as_ref()).collect();
    if let Some(p) = &args.plot {
        let title = format!(
            "kivi tune: {} ({}, head_dim {}) on {}",
            scheme.name,
            scheme.heads.expect("bound"),
            shape.head_dim,
            target.device().name
        );
        let svg = crate::plot::svg(&title, &entries);
        decisions::write_atomic(p, svg.as_bytes())?;
    }
    if args.json {
        let out = serde_json::json!({
            "scheme": scheme.name,
            "scheme_hash": tune::hex(kivi_spec::scheme_hash(&scheme)),
            "backend": target.backend(),
            "device": target.device(),
            "toolchain": target.toolchain(),
            "cache_file": store.path(),
            "notes": notes,
            "warnings": warnings,
            "elapsed_s": t0.elapsed().as_secs_f64(),
            "buckets": outcomes.iter().map(|o| serde_json::json!({
                "bucket": o.bucket,
                "origin": origin_text(o),
                "spent_s": o.spent_s,
                "entry": o.entry,
            })).collect::<Vec<_>>(),
        });
        println!("{}", serde_json::to_string_pretty(&out).map_err(|e| e.to_string())?);
    } else {
        println!(
            "kivi tune: scheme {} ({}, head_dim {}), backend {} on {}",
            scheme.name,
            scheme.heads.expect("bound"),
            shape.head_dim,
            target.backend(),
            target.device().summary()
        );
        for o in &outcomes {
            println!();
            println!(
                "bucket {} (batch {}, context {}, gqa {}): {}",
                o.bucket,
                o.bucket.batch,
                o.bucket.context,
                o.bucket.gqa,
                origin_text(o)
            );
            if let Some(e) = &o.entry {
                println!("  chosen {}: {}", e.chosen, e.reason);
                print_entry_table(e, false);
            }
        }
        if let Some((arch, sms, on)) = &static_report {
            print_static_ranking(&scheme, &buckets, *arch, *sms, on);
        }
        println!();
        println!("decisions: {}", store.path().display());
        println!("elapsed: {:.1} s", t0.elapsed().as_secs_f64());
    }
    if outcomes.iter().all(|o| matches!(o.origin, DecisionOrigin::Failed(_))) {
        return Err("no bucket could be tuned".into());
    }
    Ok(())
}
