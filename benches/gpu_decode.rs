//! GPU decode benchmark: kivi2 / kivi4 / int8 / f16 at GQA 32:8 d128,
//! batch 1 and 8, odd contexts from 1k to 32k, timed with CUDA events on the
//! kernel's stream (warm-up, L2 flushed before every run, median with
//! p20/p80), reported as achieved GB/s of KV bytes against the device's
//! peak bandwidth. Also times every decode variant at the largest shape.
//!
//! ```text
//! cargo bench --bench gpu_decode -- [--out FILE.json] [--quick] [--precompile sm_90]
//! ```
//!
//! `--precompile ARCH` needs no GPU: it compiles every kernel the benchmark
//! would load into the artifact cache (scripts/gpu-bundle.sh uses it), so the
//! binary runs on a GPU machine that has a driver but no NVRTC.
//! Without a GPU (and without `--precompile`) it prints why and exits 2.

use kivi_runtime::cuda::{Arch, Compiler, CudaBackend, DeviceCache, NvrtcOptions, Timing};
use kivi_runtime::{reference, AttnParams, CacheConfig, Error};
use kivi_spec::{presets, Heads, Scheme};
use kivi_templates::{default_variant, generate, variants, Generated, Kernel};
use std::fmt::Write;
use std::time::Instant;

const CONTEXTS: [usize; 6] = [1021, 2039, 4093, 8191, 16381, 32749];
const BATCHES: [usize; 2] = [1, 8];
const CHUNK: usize = 4096;

struct Rng(u64);
impl Rng {
    fn fill(&mut self, out: &mut [f32]) {
        for o in out {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            *o = ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0;
        }
    }
}

fn schemes() -> Vec<Scheme> {
    [presets::kivi2(), presets::kivi4(), presets::int8(), presets::f16()]
        .into_iter()
        .map(|s| {
            s.with_shape(Heads::Gqa { q: 32, kv: 8 }, 128)
                .expect("presets bind GQA 32:8 d128")
        })
        .collect()
}

fn kernels() -> Vec<Generated> {
    let mut out = Vec::new();
    for s in schemes() {
        for k in [Kernel::Prefill, Kernel::Append] {
            out.push(generate(&s, k, &default_variant(&s, k)).expect("default variant"));
        }
        for v in variants(&s, Kernel::Decode) {
            out.push(generate(&s, Kernel::Decode, &v).expect("listed variant"));
        }
    }
    out
}

fn json_str(s: &str) -> String {
    format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
}

struct Args {
    out: Option<String>,
    quick: bool,
    precompile: Option<String>,
}

fn args() -> Args {
    let mut a = Args {
        out: None,
        quick: false,
        precompile: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(x) = it.next() {
        match x.as_str() {
            "--out" => a.out = it.next(),
            "--quick" => a.quick = true,
            "--precompile" => a.precompile = it.next(),
            "--bench" => {} // cargo bench passes it
            other => {
                eprintln!("gpu_decode: unknown argument `{other}`; expected --out FILE, --quick, --precompile ARCH");
                std::process::exit(64);
            }
        }
    }
    a
}

fn precompile(arch: &str) -> Result<(), Error> {
    let arch = Arch::parse(arch)?;
    let c = Compiler::new()?;
    let opts = NvrtcOptions::for_arch(arch);
    let gens = kernels();
    let t = Instant::now();
    for g in &gens {
        c.compile(&g.name, &g.source, &opts)?;
    }
    println!(
        "PRECOMPILED gpu_decode: {} kernels for {arch} in {:.1} s {} {}",
        gens.len(),
        t.elapsed().as_secs_f64(),
        if c.is_offline() { "verified present in" } else { "into" },
        c.cache().map_or("(no cache)".into(), |x| x.dir().display().to_string())
    );
    Ok(())
}

/// Fills a device cache of `batch` sequences of `ctx` tokens by chunked
/// prefill on the GPU; returns the first sequence's inputs when `keep`.
fn fill(
    dc: &mut DeviceCache,
    s: &Scheme,
    batch: usize,
    ctx: usize,
    seed: u64,
    keep: bool,
) -> Result<(Vec<f32>, Vec<f32>), Error> {
    let shape = s.shape().expect("bound");
    let row = shape.kv_heads * shape.head_dim;
    let mut rng = Rng(seed);
    let (mut k0, mut v0) = (Vec::new(), Vec::new());
    let mut done = 0;
    while done < ctx {
        let n = CHUNK.min(ctx - done);
        let mut k = vec![0f32; batch * n * row];
        let mut v = vec![0f32; batch * n * row];
        rng.fill(&mut k);
        rng.fill(&mut v);
        if keep {
            k0.extend_from_slice(&k[..n * row]);
            v0.extend_from_slice(&v[..n * row]);
        }
        dc.extend(&vec![n; batch], &k, &v)?;
        done += n;
    }
    Ok((k0, v0))
}

fn timing_json(t: &Timing) -> String {
    format!(
        "\"median_ms\": {:.5}, \"p20_ms\": {:.5}, \"p80_ms\": {:.5}, \"samples\": {}",
        t.median_ms, t.p20_ms, t.p80_ms, t.samples
    )
}

fn run(a: &Args) -> Result<String, Error> {
    let cuda = CudaBackend::new()?;
    let dev = cuda.device().clone();
    let info = dev.info().clone();
    let peak = info.peak_bandwidth_gbs();
    println!(
        "gpu_decode on {} ({}, {} SMs, L2 {} MiB, peak {} GB/s, driver {}, NVRTC {}{})",
        info.name,
        info.arch,
        info.sms,
        info.l2_bytes >> 20,
        peak.map_or("?".into(), |p| format!("{p:.0}")),
        info.driver_version,
        dev.compiler().version(),
        if dev.compiler().is_offline() {
            ", offline artifacts"
        } else {
            ""
        }
    );
    let (warmup, iters) = if a.quick { (3, 10) } else { (10, 50) };
    let contexts: Vec<usize> = if a.quick { vec![1021, 32749] } else { CONTEXTS.to_vec() };
    let mut rows = Vec::new();
    for s in schemes() {
        let shape = s.shape().expect("bound");
        let attn = AttnParams::of(&s, shape);
        for &batch in &BATCHES {
            for &ctx in &contexts {
                let bt = kivi_spec::layout::default_block_tokens(&s);
                let cfg = CacheConfig {
                    block_tokens: None,
                    max_blocks: batch * (ctx.div_ceil(bt) + 1),
                };
                let mut dc = DeviceCache::new(dev.clone(), &s, batch, ctx, cfg)?;
                let check = batch == 1 && ctx <= 4093;
                let (k0, v0) = fill(&mut dc, &s, batch, ctx, 17 + ctx as u64, check)?;
                let mut q = vec![0f32; batch * shape.q_heads * shape.head_dim];
                Rng(99).fill(&mut q);
                let module = dc.decode_module(None)?;
                let mut run = dc.prepare_decode(&module, &q, attn)?;
                let mut err = None;
                if check {
                    run.launch()?;
                    let got = run.output()?;
                    let want = reference::attend(&s, &q[..shape.q_heads * shape.head_dim], &k0, &v0, attn)?;
                    let scale = want.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-30);
                    // a NaN anywhere is a failure (f32::max would skip it)
                    let e = if got.iter().all(|x| x.is_finite()) {
                        got.iter().zip(&want).fold(0f32, |m, (g, w)| m.max((g - w).abs())) / scale
                    } else {
                        f32::INFINITY
                    };
                    if e > 1e-3 {
                        return Err(Error::Config(format!(
                            "{}: batch {batch} ctx {ctx}: relative error {e} vs the reference",
                            s.name
                        )));
                    }
                    err = Some(e);
                }
                let t = run.time(warmup, iters)?;
                let bytes = dc.decode_bytes();
                let gbs = bytes as f64 / (t.median_ms * 1e-3) / 1e9;
                println!(
                    "  {:8} b{batch} ctx {ctx:5}: {:8.4} ms (p20 {:.4}, p80 {:.4})  {:7.1} MB  {gbs:7.1} GB/s{}",
                    s.name,
                    t.median_ms,
                    t.p20_ms,
                    t.p80_ms,
                    bytes as f64 / 1e6,
                    peak.map_or(String::new(), |p| format!("  {:.0}% of peak", 100.0 * gbs / p))
                );
                rows.push(format!(
                    "    {{\"scheme\": {}, \"kernel\": {}, \"batch\": {batch}, \"context\": {ctx}, \"kv_bytes\": {bytes}, {}, \"gbs\": {gbs:.2}, \"fraction_of_peak\": {}, \"checked_rel_error\": {}}}",
                    json_str(&s.name),
                    json_str(&module.generated.name),
                    timing_json(&t),
                    peak.map_or("null".into(), |p| format!("{:.4}", gbs / p)),
                    err.map_or("null".into(), |e| format!("{e:.3e}"))
                ));
            }
        }
    }
    // Every decode variant at the largest shape.
    let mut sweep = Vec::new();
    let (batch, ctx) = (8, *contexts.last().expect("contexts"));
    for s in schemes() {
        let shape = s.shape().expect("bound");
        let attn = AttnParams::of(&s, shape);
        let bt = kivi_spec::layout::default_block_tokens(&s);
        let cfg = CacheConfig {
            block_tokens: None,
            max_blocks: batch * (ctx.div_ceil(bt) + 1),
        };
        let mut dc = DeviceCache::new(dev.clone(), &s, batch, ctx, cfg)?;
        fill(&mut dc, &s, batch, ctx, 5, false)?;
        let mut q = vec![0f32; batch * shape.q_heads * shape.head_dim];
        Rng(7).fill(&mut q);
        let bytes = dc.decode_bytes();
        let mut best: Option<(f64, String)> = None;
        for v in variants(&s, Kernel::Decode) {
            let module = dc.decode_module(Some(v))?;
            let mut run = dc.prepare_decode(&module, &q, attn)?;
            let t = run.time(warmup.min(5), iters.min(20))?;
            let gbs = bytes as f64 / (t.median_ms * 1e-3) / 1e9;
            if !matches!(&best, Some((b, _)) if *b <= t.median_ms) {
                best = Some((t.median_ms, v.name()));
            }
            sweep.push(format!(
                "    {{\"scheme\": {}, \"variant\": {}, \"batch\": {batch}, \"context\": {ctx}, {}, \"gbs\": {gbs:.2}}}",
                json_str(&s.name),
                json_str(&v.name()),
                timing_json(&t)
            ));
        }
        if let Some((ms, name)) = best {
            println!(
                "  sweep {:8} b{batch} ctx {ctx}: best {name} {ms:.4} ms ({:.1} GB/s)",
                s.name,
                bytes as f64 / (ms * 1e-3) / 1e9
            );
        }
    }
    let mut out = String::new();
    let _ = writeln!(out, "{{");
    let _ = writeln!(
        out,
        "  \"device\": {{\"name\": {}, \"arch\": {}, \"sms\": {}, \"l2_bytes\": {}, \"driver_version\": {}, \"peak_gbs\": {}}},",
        json_str(&info.name),
        json_str(&info.arch.name()),
        info.sms,
        info.l2_bytes,
        info.driver_version,
        peak.map_or("null".into(), |p| format!("{p:.1}"))
    );
    let _ = writeln!(out, "  \"nvrtc\": {},", json_str(dev.compiler().version()));
    let _ = writeln!(
        out,
        "  \"timing\": {{\"warmup\": {warmup}, \"iters\": {iters}, \"l2_flush\": true, \"clock\": \"cuda events\"}},"
    );
    let _ = writeln!(out, "  \"decode\": [\n{}\n  ],", rows.join(",\n"));
    let _ = writeln!(out, "  \"variant_sweep\": [\n{}\n  ]", sweep.join(",\n"));
    let _ = writeln!(out, "}}");
    Ok(out)
}

fn main() {
    let a = args();
    if let Some(arch) = &a.precompile {
        if let Err(e) = precompile(arch) {
            eprintln!("gpu_decode: precompile failed: {e}");
            std::process::exit(1);
        }
        return;
    }
    match run(&a) {
        Ok(json) => {
            if let Some(path) = &a.out {
                if let Err(e) = std::fs::write(path, &json) {
                    eprintln!("gpu_decode: cannot write {path}: {e}");
                    std::process::exit(1);
                }
                println!("wrote {path}");
            } else {
                print!("{json}");
            }
        }
        Err(e @ Error::Unavailable { .. }) => {
            eprintln!("gpu_decode: no GPU to benchmark: {e}");
            std::process::exit(2);
        }
        Err(e) => {
            eprintln!("gpu_decode: {e}");
            std::process::exit(1);
        }
    }
}
