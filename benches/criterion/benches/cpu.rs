//! criterion benches of the CPU decode and cache-write kernels, per preset
//! and head layout, with statistics against a saved baseline:
//!
//! ```text
//! cd benches/criterion
//! cargo bench -- --save-baseline main    # before a change
//! cargo bench -- --baseline main         # after: "Performance has regressed" per bench
//! cargo bench -- 'decode/kivi2'          # only some (a regex over the names)
//! ```
//!
//! Names: `decode/<preset>/<layout>/<context>` (one query token, batch 1,
//! all cores, KV warm: a regression detector, not the cold, peer-compared
//! numbers of `kivi bench`), `extend/<preset>/<layout>` (one
//! `PagedCache::extend` of 4096 tokens into a fresh cache) and
//! `append/<preset>/<layout>` (256 single-token appends). Throughput is
//! KV bytes read per decode and tokens written per write. Every decode is
//! checked against the reference oracle once before it is timed.

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use kivi_criterion::{kv, scheme, LAYOUTS, PRESETS};
use kivi_runtime::{AttnParams, Backend, CacheConfig, CpuBackend, CpuParams, PagedCache, ReferenceBackend};
use kivi_spec::layout::Footprint;
use std::time::Duration;

/// Decode contexts: one inside the last-level cache, one far past it.
const CONTEXTS: [usize; 2] = [4096, 32768];
const WRITE_TOKENS: usize = 4096;
const APPENDS: usize = 256;

fn decode(c: &mut Criterion) {
    let cpu = CpuBackend::new(CpuParams::default()).expect("cpu backend");
    let mut g = c.benchmark_group("decode");
    g.sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3));
    for layout in LAYOUTS {
        for context in CONTEXTS {
            let (k, v) = kv(context, layout, 0x5eed + context as u64);
            let mut r = kivi_runtime::rand::Rng::new(77);
            let q: Vec<f32> = (0..(layout.1 * layout.3) as usize).map(|_| r.f32()).collect();
            for preset in PRESETS {
                let s = scheme(preset, layout).expect("preset fits the layout");
                let mut cache = PagedCache::new(s.clone(), CacheConfig::for_tokens(context + 64)).expect("cache");
                let id = cache.add_sequence();
                cache.extend(id, &k, &v).expect("extend");
                let attn = AttnParams::of(&s, s.shape().expect("bound"));
                // A wrong kernel is not worth timing.
                let got = cpu.decode(&cache, &[id], &q, attn).expect("decode");
                let want = ReferenceBackend.decode(&cache, &[id], &q, attn).expect("reference");
                let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
                let err = got.iter().zip(&want).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / scale;
                assert!(err < 1e-3, "{preset} {} {context}: cpu vs reference {err}", layout.0);
                g.throughput(Throughput::Bytes(Footprint::for_tokens(&s, context).total() as u64));
                g.bench_function(format!("{preset}/{}/{context}", layout.0), |b| {
                    b.iter(|| cpu.decode(&cache, &[id], &q, attn).expect("decode"))
                });
            }
        }
    }
    g.finish();
}

fn writes(c: &mut Criterion) {
    let mut g = c.benchmark_group("extend");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3));
    g.throughput(Throughput::Elements(WRITE_TOKENS as u64));
    for layout in LAYOUTS {
        let (k, v) = kv(WRITE_TOKENS, layout, 99);
        for preset in PRESETS {
            let s = scheme(preset, layout).expect("preset fits the layout");
            g.bench_function(format!("{preset}/{}", layout.0), |b| {
                // A fresh cache per sample (not timed): extend's cost
                // includes claiming its blocks, as in a real prefill.
                b.iter_batched(
                    || PagedCache::new(s.clone(), CacheConfig::for_tokens(WRITE_TOKENS + 256)).expect("cache"),
                    |mut cache| {
                        let id = cache.add_sequence();
                        cache.extend(id, &k, &v).expect("extend");
                        cache
                    },
                    BatchSize::LargeInput,
                )
            });
        }
    }
    g.finish();

    let mut g = c.benchmark_group("append");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    g.throughput(Throughput::Elements(APPENDS as u64));
    for layout in LAYOUTS {
        let (k, v) = kv(APPENDS, layout, 98);
        let row = (layout.2 * layout.3) as usize;
        for preset in PRESETS {
            let s = scheme(preset, layout).expect("preset fits the layout");
            g.bench_function(format!("{preset}/{}", layout.0), |b| {
                b.iter_batched(
                    || PagedCache::new(s.clone(), CacheConfig::for_tokens(APPENDS + 256)).expect("cache"),
                    |mut cache| {
                        let id = cache.add_sequence();
                        for t in 0..APPENDS {
                            cache
                                .append(id, &k[t * row..(t + 1) * row], &v[t * row..(t + 1) * row])
                                .expect("append");
                        }
                        cache
                    },
                    BatchSize::LargeInput,
                )
            });
        }
    }
    g.finish();
}

criterion_group!(benches, decode, writes);
criterion_main!(benches);
