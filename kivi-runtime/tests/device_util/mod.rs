//! Helpers of the `device_*` tests: the devices to run on (the simulated
//! device always; GPU 0 when one is usable, else a printed skip), and the
//! precompile mode that fills an artifact cache for a GPU machine without
//! NVRTC (scripts/gpu-bundle.sh).
//!
//! One suite, written once against [`kivi_runtime::device::Device`], runs on
//! every device: the host code of the GPU path is the same on both, so CI
//! runs all of it on the simulated device.
#![allow(dead_code)]

use kivi_runtime::cuda::{Arch, Compiler, CudaDevice, NvrtcOptions};
use kivi_runtime::device::{Device, DeviceBackend, DeviceCache, SimDevice};
use kivi_runtime::{Error, PagedCache};
use kivi_spec::{Scheme, Tensor};
use kivi_templates::Generated;
use std::sync::Arc;

/// GPU 0, or `None` after printing why the GPU half of a test is skipped.
///
/// With `KIVI_REQUIRE_GPU` set (scripts/gpu-check.sh) a missing GPU is a
/// failure. With `KIVI_CUDA_PRECOMPILE=sm_XX` set and no GPU, compiles every
/// kernel `needed()` names for that architecture into the artifact cache
/// first, so that the same test binary finds them on a GPU machine that has
/// no NVRTC.
pub fn gpu_or_skip(test: &str, needed: impl FnOnce() -> Vec<Generated>) -> Option<Arc<dyn Device>> {
    match CudaDevice::new(0) {
        Ok(d) => {
            println!("{test}: on {}", d.describe());
            Some(Arc::new(d))
        }
        Err(e @ Error::Unavailable { .. }) => {
            if std::env::var_os("KIVI_REQUIRE_GPU").is_some() {
                panic!("{test}: KIVI_REQUIRE_GPU is set but the GPU is unavailable: {e}");
            }
            if let Ok(arch) = std::env::var("KIVI_CUDA_PRECOMPILE") {
                precompile(test, &arch, needed());
            }
            println!("SKIP {test} on cuda: {e}");
            None
        }
        Err(e) => panic!("{test}: opening the GPU failed with an unexpected error: {e}"),
    }
}

/// Every device this test runs on: the simulated device, then GPU 0 when
/// one is usable. On the GPU machine (`KIVI_REQUIRE_GPU`) and when filling
/// a GPU bundle (`KIVI_CUDA_PRECOMPILE`) only the GPU: the simulated half
/// runs in CI.
pub fn devices(test: &str, needed: impl FnOnce() -> Vec<Generated>) -> Vec<Arc<dyn Device>> {
    let mut out: Vec<Arc<dyn Device>> = Vec::new();
    if std::env::var_os("KIVI_REQUIRE_GPU").is_none() && std::env::var_os("KIVI_CUDA_PRECOMPILE").is_none() {
        out.push(SimDevice::shared());
    }
    out.extend(gpu_or_skip(test, needed));
    out
}

/// [`devices`] as decode backends.
pub fn backends(test: &str, needed: impl FnOnce() -> Vec<Generated>) -> Vec<DeviceBackend> {
    devices(test, needed).into_iter().map(DeviceBackend::new).collect()
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

/// NVRTC for a compile-only test, or `None` after printing why `test` is
/// skipped. With `KIVI_REQUIRE_NVRTC` set (the GPU machine's check) a
/// missing or offline NVRTC is a failure instead.
pub fn nvrtc_or_skip(test: &str) -> Option<Compiler> {
    match Compiler::new() {
        Ok(c) if !c.is_offline() => Some(c),
        other => {
            let why = other.err().map_or("offline mode".to_string(), |e| e.to_string());
            assert!(
                std::env::var_os("KIVI_REQUIRE_NVRTC").is_none(),
                "KIVI_REQUIRE_NVRTC is set but NVRTC is unavailable: {why}"
            );
            println!("SKIP {test}: {why}");
            None
        }
    }
}

/// Device and host caches agree word for word: pool, block tables, sink
/// and window rows, centering means.
pub fn assert_same(s: &Scheme, host: &PagedCache, ids: &[u64], dev: &DeviceCache, when: &str) {
    let shape = s.shape().unwrap();
    let (h, d) = (shape.kv_heads, shape.head_dim);
    let pool = dev.download_pool().unwrap();
    if let Some(i) = pool.iter().zip(host.pool()).position(|(a, b)| a != b) {
        let bw = host.layout().block_words;
        panic!(
            "{} {:?} d{d}: pool word {i} (block {}, word {} of it) is {:#x}, PagedCache has {:#x} {when}",
            s.name,
            s.heads.unwrap(),
            i / bw,
            i % bw,
            pool[i],
            host.pool()[i]
        );
    }
    assert_eq!(pool.len(), host.pool().len(), "{}: pool length {when}", s.name);
    for t in [Tensor::Key, Tensor::Value] {
        let sinks = dev.download_rows(t, true).unwrap();
        let rings = dev.download_rows(t, false).unwrap();
        let means = dev.download_means(t).unwrap();
        let slots = kivi_spec::layout::window_capacity(s, t).max(1);
        let ns = s.sinks as usize;
        let mut want = vec![0f32; d];
        for (b, &id) in ids.iter().enumerate() {
            assert_eq!(
                dev.table(b),
                host.block_table(id).unwrap(),
                "{}: block table {when}",
                s.name
            );
            let v = host.view(id).unwrap();
            let r = kivi_spec::layout::regions(s, t, v.tokens());
            for hh in 0..h {
                for p in 0..ns.min(v.tokens()) {
                    v.row(t, p, hh, &mut want);
                    assert_eq!(
                        &sinks[((b * ns + p) * h + hh) * d..][..d],
                        &want[..],
                        "{}: sink {p} {when}",
                        s.name
                    );
                }
                for j in r.quantized..r.quantized + r.window {
                    v.row(t, r.sinks + j, hh, &mut want);
                    let got = &rings[((b * slots + j % slots) * h + hh) * d..][..d];
                    assert_eq!(
                        got,
                        &want[..],
                        "{}: {} window token {} {when}",
                        s.name,
                        t.name(),
                        r.sinks + j
                    );
                }
                if let Some(m) = v.mean(t, hh) {
                    assert_eq!(
                        &means[(b * h + hh) * d..][..d],
                        m,
                        "{}: {} means {when}",
                        s.name,
                        t.name()
                    );
                }
            }
        }
    }
}

/// Writes the same tokens to `host` and `dc` (new caches): one sequence per
/// entry of `lens`, prefilled with that many tokens, then `appends`
/// one-token steps of every sequence at once. The caches are compared word
/// for word ([`assert_same`]) after the prefill, after every
/// `check_every`-th step and after the last. `gen(rng, tokens, key)` draws
/// `tokens` rows of keys (`key`) or values. Returns the host's sequence ids
/// and each sequence's keys and values as written, for the oracle.
#[allow(clippy::too_many_arguments)]
pub fn write_both(
    s: &Scheme,
    host: &mut PagedCache,
    dc: &mut DeviceCache,
    lens: &[usize],
    rng: &mut kivi_runtime::rand::Rng,
    appends: usize,
    check_every: usize,
    mut gen: impl FnMut(&mut kivi_runtime::rand::Rng, usize, bool) -> Vec<f32>,
) -> (Vec<u64>, Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let shape = s.shape().unwrap();
    let row = shape.kv_heads * shape.head_dim;
    let ids: Vec<u64> = lens.iter().map(|_| host.add_sequence()).collect();
    let mut ks: Vec<Vec<f32>> = lens.iter().map(|&t| gen(rng, t, true)).collect();
    let mut vs: Vec<Vec<f32>> = lens.iter().map(|&t| gen(rng, t, false)).collect();
    for (b, &id) in ids.iter().enumerate() {
        host.extend(id, &ks[b], &vs[b]).unwrap();
    }
    dc.extend(lens, &ks.concat(), &vs.concat()).unwrap();
    assert_same(s, host, &ids, dc, "after prefill");
    for step in 0..appends {
        let k = gen(rng, ids.len(), true);
        let v = gen(rng, ids.len(), false);
        for (b, &id) in ids.iter().enumerate() {
            host.append(id, &k[b * row..][..row], &v[b * row..][..row]).unwrap();
            ks[b].extend(&k[b * row..][..row]);
            vs[b].extend(&v[b * row..][..row]);
        }
        dc.extend(&vec![1; ids.len()], &k, &v).unwrap();
        if step % check_every == 0 || step + 1 == appends {
            assert_same(s, host, &ids, dc, &format!("after append step {step}"));
        }
    }
    (ids, ks, vs)
}

/// `rows` (`[tokens, row]`) shaped like a layer's K/V: a per-channel
/// offset on every row, and for keys (`key`) a few loud channels (every
/// 16th, from channel 3, six times louder) — what centering, outliers and
/// minmax tables are for.
pub fn with_offsets(mut rows: Vec<f32>, row: usize, key: bool) -> Vec<f32> {
    for (j, x) in rows.iter_mut().enumerate() {
        let ch = j % row;
        let offset = ((ch * 7 % 13) as f32 - 6.0) * 0.25;
        *x = if key && ch % 16 == 3 {
            *x * 6.0 + offset
        } else {
            *x + offset
        };
    }
    rows
}

/// [`with_offsets`] of `tokens` rows of standard normal draws.
pub fn offset_rows(rng: &mut kivi_runtime::rand::Rng, tokens: usize, row: usize, key: bool) -> Vec<f32> {
    with_offsets(rng.vec(tokens * row), row, key)
}
