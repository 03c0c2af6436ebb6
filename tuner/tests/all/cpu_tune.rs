//! A short real tuning run of the CPU backend (tiny contexts so it stays
//! fast), then selection served from the cache it wrote.

use crate::common;

use kivi_runtime::{AttnParams, Backend, CacheConfig, PagedCache, ReferenceBackend};
use kivi_spec::{presets, Heads};
use kivi_tuner::decisions::{Status, Store};
use kivi_tuner::tune::{self, DecisionOrigin, Plan, Target};
use kivi_tuner::{select_cpu, Bucket, CpuTarget, Mode, SelectOptions, Source};

#[test]
fn real_cpu_tuning_run_and_cached_selection() {
    let scheme = presets::kivi2().with_shape(Heads::Gqa { q: 8, kv: 2 }, 64).unwrap();
    let mut target = CpuTarget::new(&scheme).unwrap();
    target.max_copies = 2;
    let dir = common::temp_dir("cpu-real");
    let store = Store::new(dir.clone(), target.device(), target.toolchain());
    let buckets = [Bucket::of(1, 256, 4), Bucket::of(2, 512, 4)];
    let plan = Plan {
        budget_s: 3.0,
        ..Plan::default()
    };
    let t = std::time::Instant::now();
    let mut w = Vec::new();
    let out = tune::run(&target, &store, &scheme, &buckets, &plan, &mut (), &mut w);
    assert!(t.elapsed().as_secs_f64() < 30.0);
    assert!(w.is_empty(), "{w:?}");
    for o in &out {
        assert!(matches!(o.origin, DecisionOrigin::Tuned { .. }), "{:?}", o.origin);
        let e = o.entry.as_ref().unwrap();
        assert_eq!(e.default, kivi_runtime::CpuParams::default().name());
        let d = e.candidate(&e.default).unwrap();
        assert_eq!(d.status, Status::Ok);
        assert!(d.timing.unwrap().median_s > 0.0);
        assert!(
            e.candidates.iter().all(|c| c.status != Status::Rejected),
            "the cpu kernel disagrees with the reference: {:?}",
            e.candidates
                .iter()
                .filter(|c| c.status == Status::Rejected)
                .map(|c| (&c.name, &c.reason))
                .collect::<Vec<_>>()
        );
        assert!(
            e.candidates.iter().any(|c| c.status == Status::Pruned),
            "the 256-token bucket prunes long splits"
        );
        assert!(e.method.contains("rotated over"));
    }

    // Second run: served from the cache, quickly.
    let t = std::time::Instant::now();
    let out = tune::run(&target, &store, &scheme, &buckets, &plan, &mut (), &mut w);
    assert!(out.iter().all(|o| o.origin == DecisionOrigin::Cached));
    assert!(t.elapsed().as_secs_f64() < 2.0);

    // Selection returns a backend that matches the reference at odd lengths.
    let opts = SelectOptions {
        mode: Mode::Cached,
        cache_dir: Some(dir),
        budget_s: 1.0,
    };
    let (backend, sel) = select_cpu(&scheme, Bucket::of(2, 300, 4), &opts).unwrap();
    assert_eq!(sel.source, Source::Cached);
    assert_eq!(backend.params.name(), sel.variant);
    let mut cache = PagedCache::new(scheme.clone(), CacheConfig::for_tokens(2000)).unwrap();
    let mut seqs = Vec::new();
    for (i, len) in [257usize, 301].iter().enumerate() {
        let id = cache.add_sequence();
        let kv: Vec<f32> = (0..len * 2 * 64)
            .map(|j| ((j * 31 + i * 7) % 97) as f32 / 48.0 - 1.0)
            .collect();
        cache.extend(id, &kv, &kv).unwrap();
        seqs.push(id);
    }
    let q: Vec<f32> = (0..2 * 8 * 64).map(|j| ((j * 13) % 29) as f32 / 14.0 - 1.0).collect();
    let attn = AttnParams::of(&scheme, scheme.shape().unwrap());
    let got = backend.decode(&cache, &seqs, &q, attn).unwrap();
    let want = ReferenceBackend.decode(&cache, &seqs, &q, attn).unwrap();
    kivi_tuner::cpu::compare(&got, &want).unwrap();
}
