//! Helpers of the `cuda_*` tests: open the GPU or skip with the reason, and
//! the precompile mode that fills an artifact cache for a GPU machine
//! without NVRTC (scripts/gpu-bundle.sh).
#![allow(dead_code)]

use kivi_runtime::cuda::{Arch, Compiler, CudaBackend, NvrtcOptions};
use kivi_runtime::Error;
use kivi_templates::Generated;

/// The backend on GPU 0, or `None` after printing why the test is skipped.
///
/// With `KIVI_CUDA_PRECOMPILE=sm_XX` set and no GPU, compiles every kernel
/// `needed()` names for that architecture into the artifact cache first, so
/// that the same test binary finds them on a GPU machine that has no NVRTC.
pub fn backend_or_skip(test: &str, needed: impl FnOnce() -> Vec<Generated>) -> Option<CudaBackend> {
    match CudaBackend::new() {
        Ok(b) => {
            let i = b.device().info();
            println!(
                "{test}: on {} ({}, {} SMs, NVRTC {})",
                i.name,
                i.arch,
                i.sms,
                b.device().compiler().version()
            );
            Some(b)
        }
        Err(e @ Error::Unavailable { .. }) => {
            // scripts/gpu-check.sh sets this: on the GPU machine a skip is a failure.
            if std::env::var_os("KIVI_REQUIRE_GPU").is_some() {
                panic!("{test}: KIVI_REQUIRE_GPU is set but the GPU is unavailable: {e}");
            }
            if let Ok(arch) = std::env::var("KIVI_CUDA_PRECOMPILE") {
                precompile(test, &arch, needed());
            }
            println!("SKIP {test}: {e}");
            None
        }
        Err(e) => panic!("{test}: opening the GPU failed with an unexpected error: {e}"),
    }
}

fn precompile(test: &str, arch: &str, gens: Vec<Generated>) {
    use rayon::prelude::*;
    let arch = Arch::parse(arch).expect("KIVI_CUDA_PRECOMPILE must name an arch such as sm_90");
    // Online: compile what is missing. Offline (no NVRTC, KIVI_NVRTC_VERSION
    // set): verify that the cache already holds every kernel — how
    // scripts/gpu-bundle.sh checks a bundle is complete.
    let c = Compiler::new().expect("precompiling needs NVRTC (scripts/provision-cuda.sh) or KIVI_NVRTC_VERSION");
    let opts = NvrtcOptions::for_arch(arch);
    let mut gens = gens;
    gens.sort_by(|a, b| a.name.cmp(&b.name));
    gens.dedup_by(|a, b| a.source == b.source);
    gens.par_iter().for_each(|g| {
        c.compile(&g.name, &g.source, &opts)
            .unwrap_or_else(|e| panic!("{}: {e}", g.name));
    });
    println!(
        "PRECOMPILED {test}: {} kernels for {arch} {} {}",
        gens.len(),
        if c.is_offline() { "verified present in" } else { "into" },
        c.cache().map_or("(no cache)".into(), |x| x.dir().display().to_string())
    );
}
