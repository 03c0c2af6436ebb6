//! GPU decode benchmark: kivi2 / kivi4 / int8 / f16 at GQA 32:8 d128,
//! batch 1 and 8, odd contexts from 1k to 32k, timed with CUDA events on the
//! kernel's stream (warm-up, L2 flushed before every run, median with
//! p20/p80), reported as achieved GB/s of KV bytes against the device's
//! peak bandwidth. Also times every decode variant at the largest shape.
//! Every timed run's output is first checked against the reference oracle
//! (`kivi_tuner::gpu_bench`, which holds the logic).
//!
//! ```text
//! cargo bench --bench gpu_decode -- [--backend cuda|sim] [--out FILE.json] [--quick] [--precompile sm_90]
//! ```
//!
//! `--backend sim` runs the same code on the simulated device (the CPU) at
//! small shapes. `--precompile ARCH` needs no GPU: it compiles every kernel
//! the benchmark would load into the artifact cache (scripts/gpu-bundle.sh
//! uses it), so the binary runs on a GPU machine that has a driver but no
//! NVRTC. Without a GPU (and without `--precompile` or `--backend sim`) it
//! prints why and exits 2.

use kivi_runtime::cuda::{Arch, Compiler, NvrtcOptions};
use kivi_runtime::device::{self, DeviceKind};
use kivi_runtime::Error;
use kivi_templates::{default_variant, generate, variants, Generated, Kernel};
use kivi_tuner::gpu_bench::{self, GpuBenchOptions};
use std::time::Instant;

fn kernels() -> Vec<Generated> {
    let mut out = Vec::new();
    for s in gpu_bench::gqa_schemes() {
        for k in [Kernel::Prefill, Kernel::Append] {
            out.push(generate(&s, k, &default_variant(&s, k)).expect("default variant"));
        }
        for v in variants(&s, Kernel::Decode) {
            out.push(generate(&s, Kernel::Decode, &v).expect("listed variant"));
        }
    }
    out
}

struct Args {
    out: Option<String>,
    quick: bool,
    precompile: Option<String>,
    backend: DeviceKind,
}

fn args() -> Args {
    let mut a = Args {
        out: None,
        quick: false,
        precompile: None,
        backend: DeviceKind::Cuda,
    };
    let mut it = std::env::args().skip(1);
    while let Some(x) = it.next() {
        match x.as_str() {
            "--out" => a.out = it.next(),
            "--quick" => a.quick = true,
            "--precompile" => a.precompile = it.next(),
            // The `kivi` program's spelling and usage-error style: one line,
            // the possible values, exit status 2.
            "--backend" => match it.next().as_deref() {
                Some("cuda") => a.backend = DeviceKind::Cuda,
                Some("sim") => a.backend = DeviceKind::Sim,
                Some(other) => usage(&format!(
                    "invalid value '{other}' for '--backend <BACKEND>' [possible values: cuda, sim]"
                )),
                None => usage("a value is required for '--backend <BACKEND>' [possible values: cuda, sim]"),
            },
            "--bench" => {} // cargo bench passes it
            other => usage(&format!(
                "unexpected argument '{other}' found; expected --backend cuda|sim, --out FILE, --quick, --precompile ARCH"
            )),
        }
    }
    a
}

/// A usage error: one line on stderr, exit status 2.
fn usage(msg: &str) -> ! {
    eprintln!("gpu_decode: error: {msg}");
    std::process::exit(2);
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

fn main() {
    let a = args();
    if let Some(arch) = &a.precompile {
        if let Err(e) = precompile(arch) {
            eprintln!("gpu_decode: precompile failed: {e}");
            std::process::exit(1);
        }
        return;
    }
    let opts = match a.backend {
        DeviceKind::Cuda => GpuBenchOptions::gpu(a.quick),
        DeviceKind::Sim => GpuBenchOptions::sim(),
    };
    let report = device::open(a.backend).and_then(|dev| gpu_bench::run(dev, &opts));
    match report {
        Ok(r) => {
            let json = serde_json::to_string_pretty(&r).expect("a report serializes");
            if let Some(path) = &a.out {
                if let Err(e) = std::fs::write(path, &json) {
                    eprintln!("gpu_decode: cannot write {path}: {e}");
                    std::process::exit(1);
                }
                println!("wrote {path}");
            } else {
                println!("{json}");
            }
        }
        Err(e @ Error::Unavailable { .. }) => {
            eprintln!("gpu_decode: no GPU to benchmark: {e} (`--backend sim` runs it on the simulated device)");
            std::process::exit(2);
        }
        Err(e) => {
            eprintln!("gpu_decode: {e}");
            std::process::exit(1);
        }
    }
}
