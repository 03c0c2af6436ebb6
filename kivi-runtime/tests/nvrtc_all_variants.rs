//! Every kernel family (prefill, append, decode) of every preset at three
//! head layouts (and of the codec-pipeline presets and schemes where they
//! bind), compiled by NVRTC for sm_80 and sm_90 to PTX and CUBIN, with the
//! resource use ptxas reports (registers, spills, shared memory). No GPU
//! needed.
//!
//! Which variants: with `KIVI_FULL_SWEEP=1` (scripts/full-sweep.sh) every
//! variant of every (scheme, layout, kernel), for both archs. In CI a
//! deterministic sample of the same space ([`sample`]): the default variant
//! of every (scheme, layout, kernel) for both archs, so every kernel family x
//! codec x layout x arch still compiles, plus, per (scheme, layout, kernel),
//! one more variant rotating through the list (and through the archs), and,
//! for decode, the variant with the largest tile (the one nearest the 48 KiB
//! shared-memory bound). A cold CI run compiled every variant (1566 builds,
//! ~380 s of the suite's time on two cores); the sample is about a fifth.
//! Sources that come out byte-identical (same kernel text for the same arch)
//! are compiled once in either mode; the report counts them.
//!
//! Writes `target/kivi-nvrtc-report.json` and prints the counts. Fails on
//! any compile error and on any variant whose static shared memory exceeds
//! the 48 KiB a block can have without opting in.
//!
//! Skips (with the reason printed) only when NVRTC cannot be found; the test
//! script provisions it (scripts/provision-cuda.sh), so in CI it runs.
//! Compiled artifacts (with NVRTC's log, which carries ptxas's `-v` report)
//! go through the artifact cache (`$KIVI_CACHE_DIR`, else `~/.cache/kivi`),
//! so a second run is quick.

mod codec_util;

use kivi_runtime::cuda::{ptxas, Arch, Compiler, NvrtcOptions, Origin};
use kivi_spec::{presets, Heads, Scheme};
use kivi_templates::{generate, variants, Generated, Kernel, Variant};
use rayon::prelude::*;
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::time::Instant;

const LAYOUTS: [(Heads, u32); 3] = [
    (Heads::Gqa { q: 32, kv: 8 }, 128),
    (Heads::Mqa(4), 256),
    (Heads::Mha(8), 64),
];
const ARCHS: [Arch; 2] = [Arch::SM80, Arch::SM90];

/// `KIVI_NVRTC_ARCHS=sm_90` narrows a local run to some archs; CI runs both.
/// Writes a summary line to the stderr handle, which the test harness does
/// not capture (it captures `print!`), so CI logs show the counts.
macro_rules! report {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr().lock(), $($t)*);
    }};
}

fn archs() -> Vec<Arch> {
    match std::env::var("KIVI_NVRTC_ARCHS") {
        Ok(v) if !v.trim().is_empty() => v
            .split(',')
            .map(|a| Arch::parse(a).expect("KIVI_NVRTC_ARCHS"))
            .collect(),
        _ => ARCHS.to_vec(),
    }
}
const MAX_STATIC_SHARED: u32 = 48 * 1024;

/// `KIVI_FULL_SWEEP=1`: every variant (scripts/full-sweep.sh).
fn full_sweep() -> bool {
    std::env::var_os("KIVI_FULL_SWEEP").is_some()
}

/// The (variant, arch) builds of one (scheme, layout, kernel), the `k`-th
/// group of its kernel family: all of them under `KIVI_FULL_SWEEP`, else the
/// default variant (the first) for every arch, one more variant rotating
/// with `k` through the rest of the list and through the archs, and for
/// decode the variant with the largest tile (most shared memory: the 48 KiB
/// bound is checked where it is tightest).
fn sample(vs: &[Variant], kernel: Kernel, archs: &[Arch], k: usize, full: bool) -> Vec<(Variant, Arch)> {
    if full {
        return vs.iter().flat_map(|&v| archs.iter().map(move |&a| (v, a))).collect();
    }
    let mut out: Vec<(Variant, Arch)> = archs.iter().map(|&a| (vs[0], a)).collect();
    let mut push = |pick: (Variant, Arch)| {
        if !out.contains(&pick) {
            out.push(pick);
        }
    };
    if vs.len() > 1 {
        push((vs[1 + (k * 5) % (vs.len() - 1)], archs[k % archs.len()]));
    }
    if kernel == Kernel::Decode {
        let largest = vs
            .iter()
            .max_by_key(|v| (v.tile_tokens * v.heads_per_block, v.threads, v.load_width))
            .expect("not empty");
        push((*largest, archs[(k + 1) % archs.len()]));
    }
    out
}

struct Job {
    scheme: Scheme,
    kernel: Kernel,
    variant: Variant,
    arch: Arch,
}

struct Row {
    name: String,
    arch: Arch,
    origin: &'static str,
    seconds: f64,
    resources: Vec<ptxas::Resources>,
    error: Option<String>,
    ptx: String,
}

fn target_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("CARGO_TARGET_DIR") {
        return PathBuf::from(d);
    }
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target")
}

#[test]
fn every_variant_compiles_for_sm80_and_sm90() {
    let compiler = match Compiler::new() {
        Ok(c) if !c.is_offline() => c,
        Ok(_) => {
            assert!(
                std::env::var_os("KIVI_REQUIRE_NVRTC").is_none(),
                "KIVI_REQUIRE_NVRTC is set but NVRTC is not loadable (offline mode)"
            );
            println!("SKIP nvrtc_all_variants: NVRTC is not on this machine (offline mode)");
            return;
        }
        Err(e) => {
            assert!(
                std::env::var_os("KIVI_REQUIRE_NVRTC").is_none(),
                "KIVI_REQUIRE_NVRTC is set but NVRTC is unavailable: {e}"
            );
            println!("SKIP nvrtc_all_variants: {e}");
            return;
        }
    };
    let t0 = Instant::now();
    let archs = archs();
    let full = full_sweep();
    let mut jobs = Vec::new();
    // Groups seen so far per kernel family: the rotation index of `sample`.
    let mut groups = [0usize; 3];
    let mut add = |jobs: &mut Vec<Job>, s: &Scheme, kernel: Kernel, vs: &[Variant]| {
        let k = &mut groups[Kernel::ALL.iter().position(|&x| x == kernel).unwrap()];
        for (variant, arch) in sample(vs, kernel, &archs, *k, full) {
            jobs.push(Job {
                scheme: s.clone(),
                kernel,
                variant,
                arch,
            });
        }
        *k += 1;
    };
    let mut listed = 0;
    for preset in presets::all() {
        for (heads, d) in LAYOUTS {
            let s = preset.with_shape(heads, d).expect("every preset binds these layouts");
            for kernel in Kernel::ALL {
                let vs = variants(&s, kernel);
                assert!(!vs.is_empty(), "{} {heads} d{d}: no {kernel} variants", s.name);
                listed += vs.len() * archs.len();
                add(&mut jobs, &s, kernel, &vs);
            }
        }
    }
    // The codec pipeline: every variant of the pipeline presets where they
    // bind (head_dim 256), and of each codec scheme of `device_codecs` at
    // the first layout it binds.
    let before = jobs.len();
    let codecs: Vec<Scheme> = presets::pipeline()
        .iter()
        .filter_map(|p| p.with_shape(Heads::Mqa(4), 256).ok())
        .chain(
            codec_util::codec_schemes()
                .into_iter()
                .filter_map(|c| LAYOUTS.iter().find_map(|&(h, d)| c.with_shape(h, d).ok())),
        )
        .collect();
    assert!(codecs.len() >= 10, "{} codec schemes bound", codecs.len());
    for s in codecs {
        for kernel in Kernel::ALL {
            let vs = variants(&s, kernel);
            assert!(!vs.is_empty(), "{}: no {kernel} variants", s.name);
            listed += vs.len() * archs.len();
            add(&mut jobs, &s, kernel, &vs);
        }
    }
    let pipeline = jobs.len() - before;
    report!(
        "nvrtc_all_variants: {} of the {listed} (variant, arch) builds of the space ({}); {pipeline} of them are codec-pipeline kernels",
        jobs.len(),
        if full { "KIVI_FULL_SWEEP: all of it" } else { "CI sample; KIVI_FULL_SWEEP=1 builds all of it" }
    );
    // Every source first (generation is cheap), then each distinct (source,
    // arch) compiled once: a byte-identical kernel needs no second NVRTC run.
    let generated: Vec<Result<Generated, String>> = jobs
        .par_iter()
        .map(|j| generate(&j.scheme, j.kernel, &j.variant).map_err(|e| e.to_string()))
        .collect();
    let mut seen: HashMap<(&str, Arch), usize> = HashMap::new();
    let mut distinct = Vec::new();
    for (i, g) in generated.iter().enumerate() {
        if let Ok(g) = g {
            if seen.insert((g.source.as_str(), jobs[i].arch), i).is_some() {
                continue;
            }
        }
        distinct.push(i);
    }
    let duplicates = jobs.len() - distinct.len();
    report!("  byte-identical to an earlier build (compiled once): {duplicates}");
    let rows: Vec<Row> = distinct
        .par_iter()
        .map(|&i| {
            let j = &jobs[i];
            let g = match &generated[i] {
                Ok(g) => g,
                Err(e) => {
                    return Row {
                        name: format!("{}/{}/{}", j.scheme.name, j.kernel, j.variant.name()),
                        arch: j.arch,
                        origin: "generate",
                        seconds: 0.0,
                        resources: vec![],
                        error: Some(e.clone()),
                        ptx: String::new(),
                    }
                }
            };
            let opts = NvrtcOptions::for_arch(j.arch);
            let t = Instant::now();
            match compiler.compile(&g.name, &g.source, &opts) {
                Ok(c) => {
                    let origin = match c.origin {
                        Origin::Cached => "cached",
                        Origin::Compiled { .. } => "compiled",
                        Origin::Recompiled { .. } => "recompiled",
                    };
                    let mut error = None;
                    if c.artifact.cubin.is_empty() {
                        error = Some("no CUBIN".to_string());
                    }
                    for e in &g.entry_points {
                        if !c.artifact.ptx.contains(&format!(".entry {e}(")) {
                            error = Some(format!("entry point {e} missing from the PTX"));
                        }
                    }
                    let resources = c.resources();
                    if resources.len() != g.entry_points.len() {
                        error = Some(format!(
                            "ptxas reported {} entry points, the source has {}",
                            resources.len(),
                            g.entry_points.len()
                        ));
                    }
                    if let Some(big) = resources.iter().find(|r| r.shared > MAX_STATIC_SHARED) {
                        error = Some(format!(
                            "{} uses {} bytes of static shared memory",
                            big.function, big.shared
                        ));
                    }
                    Row {
                        name: g.name.clone(),
                        arch: j.arch,
                        origin,
                        seconds: t.elapsed().as_secs_f64(),
                        resources,
                        error,
                        ptx: c.artifact.ptx,
                    }
                }
                Err(e) => Row {
                    name: g.name.clone(),
                    arch: j.arch,
                    origin: "failed",
                    seconds: t.elapsed().as_secs_f64(),
                    resources: vec![],
                    error: Some(e.to_string()),
                    ptx: String::new(),
                },
            }
        })
        .collect();
    let wall = t0.elapsed().as_secs_f64();

    // The resource numbers come from the ptxas NVRTC runs to make the CUBIN
    // (`--ptxas-options=-v`); the wheel's standalone ptxas on the PTX must
    // agree. Checked on a sample: a second ptxas run per variant would double
    // the test's time for the same numbers.
    // Six decode builds spread over the list, whatever its length.
    let decode_ok = rows
        .iter()
        .filter(|r| r.error.is_none() && r.name.contains("/decode/"))
        .count();
    let mut crosschecked = 0;
    for r in rows
        .iter()
        .filter(|r| r.error.is_none() && r.name.contains("/decode/"))
        .step_by(decode_ok.div_ceil(6).max(1))
        .take(6)
    {
        let standalone = ptxas::resources(&r.ptx, r.arch).expect("the wheel's ptxas runs");
        let key = |v: &[ptxas::Resources]| {
            let mut k: Vec<_> = v
                .iter()
                .map(|x| (x.function.clone(), x.registers, x.spill_stores, x.shared))
                .collect();
            k.sort();
            k
        };
        assert_eq!(
            key(&standalone),
            key(&r.resources),
            "{} ({}): ptxas and NVRTC's report differ",
            r.name,
            r.arch
        );
        crosschecked += 1;
    }

    // Report.
    let mut per_arch: BTreeMap<String, (usize, usize, usize, usize)> = BTreeMap::new(); // ok, failed, compiled, spilling
    for r in &rows {
        let e = per_arch.entry(r.arch.name()).or_default();
        if r.error.is_none() {
            e.0 += 1;
        } else {
            e.1 += 1;
        }
        if r.origin == "compiled" || r.origin == "recompiled" {
            e.2 += 1;
        }
        if r.resources.iter().any(|x| x.spills()) {
            e.3 += 1;
        }
    }
    let variants: Vec<serde_json::Value> = rows
        .iter()
        .map(|r| {
            let res: Vec<serde_json::Value> = r
                .resources
                .iter()
                .map(|x| {
                    serde_json::json!({
                        "function": x.function,
                        "registers": x.registers,
                        "spill_stores": x.spill_stores,
                        "spill_loads": x.spill_loads,
                        "stack_frame": x.stack_frame,
                        "shared": x.shared,
                        "cmem0": x.cmem0,
                    })
                })
                .collect();
            serde_json::json!({
                "name": r.name,
                "arch": r.arch.name(),
                "origin": r.origin,
                "seconds": r.seconds,
                "error": r.error,
                "resources": res,
            })
        })
        .collect();
    let report = serde_json::json!({
        "nvrtc": compiler.version(),
        "wall_seconds": wall,
        "variants": variants,
    });
    let json = serde_json::to_string_pretty(&report).expect("a JSON value serializes");
    let path = target_dir().join("kivi-nvrtc-report.json");
    let _ = std::fs::create_dir_all(target_dir());
    std::fs::write(&path, json).expect("write the report");

    let compiled: usize = per_arch.values().map(|v| v.2).sum();
    report!(
        "nvrtc {}: {} kernel builds ({duplicates} more byte-identical; {} compiled now, the rest from the artifact cache) in {wall:.1} s; report {}",
        compiler.version(),
        rows.len(),
        compiled,
        path.display()
    );
    report!("  resource reports cross-checked against standalone ptxas: {crosschecked}");
    for (arch, (ok, failed, fresh, spill)) in &per_arch {
        report!("  {arch}: {ok} compiled ok, {failed} failed, {fresh} compiled now, {spill} with register spills");
    }
    let worst = rows
        .iter()
        .flat_map(|r| r.resources.iter().map(move |x| (x.registers, &r.name, r.arch)))
        .max();
    if let Some((regs, name, arch)) = worst {
        report!("  most registers: {regs} ({name}, {arch})");
    }
    let failures: Vec<&Row> = rows.iter().filter(|r| r.error.is_some()).collect();
    for f in failures.iter().take(10) {
        println!(
            "FAILED {} ({}): {}",
            f.name,
            f.arch,
            f.error
                .as_deref()
                .unwrap_or("")
                .lines()
                .take(6)
                .collect::<Vec<_>>()
                .join(" | ")
        );
    }
    assert!(
        failures.is_empty(),
        "{} of {} kernel builds failed",
        failures.len(),
        rows.len()
    );
    // Every kernel of every preset and layout was built for both archs.
    assert_eq!(per_arch.len(), archs.len());
}
