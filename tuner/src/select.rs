//! Selection at run time: which variant runs for a shape bucket.
//!
//! [`select_or_tune`] looks the bucket up in the decision cache and returns
//! the stored choice; on a miss it either falls back to the heuristic
//! default or tunes the bucket now, as [`Mode`] says (`KIVI_TUNE`).
//!
//! The heuristic defaults (what runs when nothing is cached):
//! - **cpu**: [`CpuParams::default()`] — automatic splits (enough tasks for
//!   four per thread, at least 256 tokens each), tiles of 64 tokens, the
//!   global rayon pool.
//! - **cuda**: the generator's canonical variant for the kernel (the first
//!   one `kivi_templates::variants` lists).

use crate::bucket::Bucket;
use crate::cpu::CpuTarget;
use crate::decisions::{cache_dir, entry_key, Store};
use crate::tune::{self, DecisionOrigin, Plan, Target};
use kivi_runtime::{CpuBackend, CpuParams};
use kivi_spec::Scheme;
use std::path::PathBuf;

/// How much selection may do on a cache miss.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Never read the cache: always the heuristic default.
    Off,
    /// Use cached decisions; on a miss, the heuristic default (the default mode).
    Cached,
    /// Use cached decisions; on a miss, tune the bucket now and cache it.
    Tune,
}

impl Mode {
    /// `off`, `cached` or `tune`.
    pub fn parse(s: &str) -> Result<Mode, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "off" | "0" | "none" => Ok(Mode::Off),
            "cached" | "cache" | "" => Ok(Mode::Cached),
            "tune" | "on" | "1" => Ok(Mode::Tune),
            other => Err(format!("KIVI_TUNE=`{other}` is not one of off, cached, tune")),
        }
    }

    /// From `KIVI_TUNE` (unset: [`Mode::Cached`]).
    pub fn from_env() -> Result<Mode, String> {
        match std::env::var("KIVI_TUNE") {
            Ok(v) => Mode::parse(&v),
            Err(_) => Ok(Mode::Cached),
        }
    }
}

/// Which backend to select for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    Cpu,
    Cuda,
}

/// Options for [`select_or_tune`].
#[derive(Clone, Debug)]
pub struct SelectOptions {
    pub mode: Mode,
    /// `None`: `KIVI_CACHE_DIR`, `$XDG_CACHE_HOME/kivi` or `~/.cache/kivi`.
    pub cache_dir: Option<PathBuf>,
    /// Seconds a tune-on-miss may spend on one bucket.
    pub budget_s: f64,
}

impl Default for SelectOptions {
    fn default() -> Self {
        SelectOptions {
            mode: Mode::Cached,
            cache_dir: None,
            budget_s: 10.0,
        }
    }
}

impl SelectOptions {
    /// `KIVI_TUNE` for the mode, `KIVI_TUNE_BUDGET` (seconds) for the budget.
    pub fn from_env() -> Result<SelectOptions, String> {
        let mut o = SelectOptions {
            mode: Mode::from_env()?,
            ..SelectOptions::default()
        };
        if let Ok(b) = std::env::var("KIVI_TUNE_BUDGET") {
            o.budget_s = b
                .parse::<f64>()
                .ok()
                .filter(|x| x.is_finite() && *x > 0.0)
                .ok_or_else(|| format!("KIVI_TUNE_BUDGET=`{b}` is not a positive number of seconds"))?;
        }
        Ok(o)
    }
}

/// Where a selection came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// A stored decision.
    Cached,
    /// Tuned just now (tune-on-miss).
    Tuned,
    /// A stored pin.
    Pinned,
    /// The heuristic default (mode off, a miss in cached mode, or tuning failed).
    Default,
}

/// The variant to run for one bucket, and why.
#[derive(Clone, Debug)]
pub struct Selection {
    pub backend: &'static str,
    pub bucket: Bucket,
    /// Variant name (`CpuParams::name()` for the CPU, the generator's variant name for CUDA).
    pub variant: String,
    pub source: Source,
    /// One line: the stored reason, or why the default applies.
    pub reason: String,
    /// Cache problems met on the way (corrupt or stale files): report them.
    pub warnings: Vec<String>,
}

/// Selects a variant through any [`Target`].
pub fn select_with(
    target: &dyn Target,
    scheme: &Scheme,
    bucket: Bucket,
    opts: &SelectOptions,
) -> Result<Selection, String> {
    let cands = target.candidates(&bucket);
    let default = cands
        .first()
        .ok_or_else(|| format!("the {} backend offers no variant for {bucket}", target.backend()))?;
    let mut sel = Selection {
        backend: target.backend(),
        bucket,
        variant: default.name.clone(),
        source: Source::Default,
        reason: String::new(),
        warnings: Vec::new(),
    };
    if opts.mode == Mode::Off {
        sel.reason = "tuning is off (KIVI_TUNE=off): heuristic default".into();
        return Ok(sel);
    }
    let dir = cache_dir(opts.cache_dir.as_deref())?;
    let store = Store::new(dir, target.device(), target.toolchain());
    let file = store.load(&mut sel.warnings);
    let key = entry_key(tune::decision_hash(target, scheme), &bucket);
    if let Some(e) = file.entries.get(&key) {
        // Re-validation of a hit: the stored hashes must match what would
        // run now, and the choice must still pass the static checks.
        let chosen = cands.iter().find(|c| c.name == e.chosen);
        match chosen {
            Some(c) if tune::is_fresh(e, &cands, false) => match target.check(c, &bucket) {
                Ok(()) => {
                    sel.variant = e.chosen.clone();
                    sel.source = if e.pinned { Source::Pinned } else { Source::Cached };
                    sel.reason = e.reason.clone();
                    return Ok(sel);
                }
                Err(why) => sel.warnings.push(format!(
                    "cached choice `{}` for {bucket} no longer passes its checks ({why})",
                    e.chosen
                )),
            },
            _ => sel.warnings.push(format!(
                "cached decision for {bucket} is out of date (the variants changed)"
            )),
        }
    }
    if opts.mode == Mode::Cached {
        sel.reason =
            format!("no cached decision for {bucket}: heuristic default (run `kivi tune` or set KIVI_TUNE=tune)");
        return Ok(sel);
    }
    let plan = Plan {
        budget_s: opts.budget_s,
        force: false,
        pin: None,
        resume: false,
    };
    let mut warnings = Vec::new();
    let out = tune::run(target, &store, scheme, &[bucket], &plan, &mut (), &mut warnings);
    sel.warnings.extend(warnings);
    match out.into_iter().next() {
        Some(tune::Outcome {
            origin: DecisionOrigin::Failed(e),
            ..
        }) => sel.reason = format!("tuning {bucket} failed ({e}): heuristic default"),
        Some(tune::Outcome {
            origin, entry: Some(e), ..
        }) => {
            sel.variant = e.chosen;
            sel.reason = e.reason;
            sel.source = if origin == DecisionOrigin::Pinned {
                Source::Pinned
            } else {
                Source::Tuned
            };
        }
        _ => sel.reason = "tuning produced no decision: heuristic default".into(),
    }
    Ok(sel)
}

/// The main entry point: selects (or, in [`Mode::Tune`], tunes) the variant
/// for `scheme` on `backend` at `bucket`. `scheme` must be bound to a shape.
///
/// On the CPU this needs nothing else. For CUDA it opens GPU 0 (the
/// decision cache is keyed by the GPU's fingerprint); without a usable GPU
/// it returns an error the caller can act on (fall back to the CPU).
///
/// ```no_run
/// use kivi_tuner::{select_or_tune, Bucket, BackendKind, SelectOptions};
/// let s = kivi_spec::presets::kivi2().with_shape(kivi_spec::Heads::Gqa { q: 32, kv: 8 }, 128).unwrap();
/// let sel = select_or_tune(&s, BackendKind::Cpu, Bucket::of(1, 3000, 4), &SelectOptions::from_env().unwrap()).unwrap();
/// for w in &sel.warnings { eprintln!("warning: {w}"); }
/// println!("{} ({:?}): {}", sel.variant, sel.source, sel.reason);
/// ```
pub fn select_or_tune(
    scheme: &Scheme,
    backend: BackendKind,
    bucket: Bucket,
    opts: &SelectOptions,
) -> Result<Selection, String> {
    match backend {
        BackendKind::Cpu => select_with(&CpuTarget::new(scheme)?, scheme, bucket, opts),
        BackendKind::Cuda => {
            Err("cuda selection is not available in this build (no CUDA tuning target); use the cpu backend".into())
        }
    }
}

/// [`select_or_tune`] on the CPU, returning a ready backend.
///
/// ```no_run
/// use kivi_runtime::Backend;
/// use kivi_tuner::{select_cpu, Bucket, SelectOptions};
/// let s = kivi_spec::presets::kivi2().with_shape(kivi_spec::Heads::Gqa { q: 32, kv: 8 }, 128).unwrap();
/// let (backend, sel) = select_cpu(&s, Bucket::of(1, 3000, 4), &SelectOptions::default()).unwrap();
/// assert_eq!(backend.name(), "cpu");
/// ```
pub fn select_cpu(scheme: &Scheme, bucket: Bucket, opts: &SelectOptions) -> Result<(CpuBackend, Selection), String> {
    let target = CpuTarget::new(scheme)?;
    let sel = select_with(&target, scheme, bucket, opts)?;
    let params = target.params(&bucket, &sel.variant).unwrap_or_else(CpuParams::default);
    let backend = CpuBackend::new(params).map_err(|e| e.to_string())?;
    Ok((backend, sel))
}

/// [`select_or_tune`] on CUDA, returning the decode variant to pass to
/// `kivi_runtime::device::DeviceBackend::with_variant`.
pub fn select_cuda(
    scheme: &Scheme,
    bucket: Bucket,
    opts: &SelectOptions,
) -> Result<(kivi_templates::Variant, Selection), String> {
    let target = crate::cuda::CudaTarget::new(scheme)?;
    let sel = select_with(&target, scheme, bucket, opts)?;
    let v = target
        .variant(&sel.variant)
        .unwrap_or_else(|| kivi_templates::default_variant(scheme, kivi_templates::Kernel::Decode));
    Ok((v, sel))
}
