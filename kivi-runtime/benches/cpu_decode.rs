//! A tight decode loop for profiling the CPU kernel (`perf record`):
//! `cargo bench -p kivi-runtime --bench cpu_decode -- [scheme] [context] [reps] [threads] [tile]`.
//! `scheme` is a preset name or a scheme file (`kivi show --help`);
//! `KIVI_BENCH_LAYOUT=mqa` takes MQA 4:1 d256 instead of GQA 32:8 d128.
//! Prints the median wall time per decode. `kivi bench` is the measured,
//! peer-compared benchmark; this one exists to look inside the kernel.

use kivi_runtime::{AttnParams, Backend, CacheConfig, CpuBackend, CpuParams, PagedCache};
use kivi_spec::{presets, Heads};
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    let scheme = args.first().map_or("kivi2", |s| s.as_str());
    let context: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(32768);
    let reps: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(50);
    let threads: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(0);
    // Several tiles (comma-separated) are timed interleaved, rep by rep.
    let tiles: Vec<usize> = args
        .get(4)
        .map_or("64", |s| s.as_str())
        .split(',')
        .map(|t| t.parse().expect("tile_tokens"))
        .collect();
    let mqa = std::env::var("KIVI_BENCH_LAYOUT").is_ok_and(|l| l == "mqa");
    let (hq, hkv, d) = if mqa { (4usize, 1usize, 256usize) } else { (32, 8, 128) };
    let heads = if mqa {
        Heads::Mqa(hq as u32)
    } else {
        Heads::Gqa {
            q: hq as u32,
            kv: hkv as u32,
        }
    };
    let s = presets::by_name(scheme)
        .or_else(|| kivi_spec::load_scheme(scheme).ok())
        .expect("a preset name or scheme file")
        .with_shape(heads, d as u32)
        .expect("shape");
    let shape = s.shape().expect("bound");
    let mut rng = kivi_runtime::rand::Rng::new(0x9e37_79b9_7f4a_7c15);
    let mut rnd = move || rng.f32();
    let k: Vec<f32> = (0..context * hkv * d)
        .map(|i| (i % d % 5) as f32 * 0.5 - 1.0 + rnd())
        .collect();
    let v: Vec<f32> = (0..context * hkv * d).map(|_| rnd()).collect();
    let q: Vec<f32> = (0..hq * d).map(|_| rnd()).collect();
    let mut cache = PagedCache::new(s.clone(), CacheConfig::for_tokens(context + 64)).expect("cache");
    let id = cache.add_sequence();
    cache.extend(id, &k, &v).expect("extend");
    let cpus: Vec<CpuBackend> = tiles
        .iter()
        .map(|&tile_tokens| {
            CpuBackend::new(CpuParams {
                threads,
                tile_tokens,
                ..CpuParams::default()
            })
            .expect("cpu backend")
        })
        .collect();
    let attn = AttnParams::of(&s, shape);
    let mut times = vec![Vec::with_capacity(reps); cpus.len()];
    for _ in 0..reps {
        for (cpu, times) in cpus.iter().zip(&mut times) {
            let t0 = Instant::now();
            std::hint::black_box(cpu.decode(&cache, &[id], &q, attn).expect("decode"));
            times.push(t0.elapsed().as_secs_f64() * 1e3);
        }
    }
    for (tile, times) in tiles.iter().zip(&mut times) {
        times.sort_by(f64::total_cmp);
        println!(
            "{scheme} {hq}:{hkv} d{d} context {context} tile {tile} ({}): median {:.3} ms, min {:.3} ms over {reps} warm reps",
            cpus[0].kernel_path(&cache),
            times[reps / 2],
            times[0]
        );
    }
}
