//! The generated prefill and append kernels, run by `sim`, write exactly
//! the words `PagedCache` writes: blocks (codes, scales, zero points, raw
//! rows), sink buffers and window rings, bit for bit.

mod sim_util;

use kivi_runtime::sim::{compile, SeqState, SimExtend, SimLibrary};
use kivi_runtime::{CacheConfig, PagedCache};
use kivi_spec::{presets, Heads, Scheme};
use kivi_templates::{default_variant, generate, Generated, Kernel};
use sim_util::*;
use std::sync::Arc;

fn shapes() -> [(Heads, u32); 3] {
    [
        (Heads::Gqa { q: 8, kv: 2 }, 64),
        (Heads::Mqa(4), 256),
        (Heads::Mha(3), 48),
    ]
}

fn schemes() -> Vec<Scheme> {
    let mut v = presets::all();
    v.extend(extra_schemes());
    v
}

/// Prefill of a batch of unequal lengths equals `PagedCache::extend`.
fn check_prefill(s: &Scheme, kernel: &SimExtend, lens: &[usize], seed: u64) {
    let shape = s.shape().unwrap();
    let row = shape.kv_heads * shape.head_dim;
    let total: usize = lens.iter().sum();
    let mut cache = PagedCache::new(s.clone(), CacheConfig::for_tokens(total + 64 * lens.len())).unwrap();
    let mut rng = Rng::new(seed);
    let mut ks = Vec::new();
    let mut vs = Vec::new();
    let mut ids = Vec::new();
    for &t in lens {
        let k = rng.vec(t * row);
        let v: Vec<f32> = rng.vec(t * row).iter().map(|x| x * 3.0 + 0.5).collect();
        let id = cache.add_sequence();
        cache.extend(id, &k, &v).unwrap();
        ks.push(k);
        vs.push(v);
        ids.push(id);
    }
    let mut pool = vec![0u32; cache.pool().len()];
    let mut states: Vec<SeqState> = ids
        .iter()
        .map(|&id| SeqState::empty(s, cache.block_table(id).unwrap().to_vec()).unwrap())
        .collect();
    let kr: Vec<&[f32]> = ks.iter().map(|x| x.as_slice()).collect();
    let vr: Vec<&[f32]> = vs.iter().map(|x| x.as_slice()).collect();
    let status = kernel.run(&mut pool, &mut states, &kr, &vr).unwrap();
    assert!(status.iter().all(|x| !x), "{}: overflow reported", s.name);
    assert!(
        pool == cache.pool(),
        "{}: prefill pool words differ from PagedCache ({})",
        s.name,
        kernel.generated().name
    );
    for (st, &id) in states.iter().zip(&ids) {
        assert_eq!(
            *st,
            SeqState::of(&cache, id).unwrap(),
            "{}: prefill windows differ",
            s.name
        );
    }
}

/// Appending one token at a time to a batch equals `PagedCache::append`,
/// through every flush of the window.
fn check_append(s: &Scheme, kernel: &SimExtend, starts: &[usize], steps: usize, seed: u64) {
    let shape = s.shape().unwrap();
    let row = shape.kv_heads * shape.head_dim;
    let mut cache = PagedCache::new(s.clone(), CacheConfig::for_tokens(4096)).unwrap();
    let mut rng = Rng::new(seed);
    let mut ids = Vec::new();
    for &t in starts {
        let id = cache.add_sequence();
        if t > 0 {
            cache.extend(id, &rng.vec(t * row), &rng.vec(t * row)).unwrap();
        }
        ids.push(id);
    }
    for step in 0..steps {
        let mut pool = cache.pool().to_vec();
        let mut states: Vec<SeqState> = ids.iter().map(|&id| SeqState::of(&cache, id).unwrap()).collect();
        let k: Vec<Vec<f32>> = ids.iter().map(|_| rng.vec(row)).collect();
        let v: Vec<Vec<f32>> = ids.iter().map(|_| rng.vec(row)).collect();
        for (i, &id) in ids.iter().enumerate() {
            cache.append(id, &k[i], &v[i]).unwrap();
            states[i].table = cache.block_table(id).unwrap().to_vec();
        }
        let kr: Vec<&[f32]> = k.iter().map(|x| x.as_slice()).collect();
        let vr: Vec<&[f32]> = v.iter().map(|x| x.as_slice()).collect();
        kernel.run(&mut pool, &mut states, &kr, &vr).unwrap();
        assert!(
            pool == cache.pool(),
            "{}: append step {step}: pool words differ",
            s.name
        );
        for (st, &id) in states.iter().zip(&ids) {
            assert_eq!(
                *st,
                SeqState::of(&cache, id).unwrap(),
                "{}: append step {step}: windows differ",
                s.name
            );
        }
    }
}

/// Every scheme bound to every shape it fits, with its kernel generated;
/// all compiled into one library (one compiler run per test).
fn kernels(kernel: Kernel, shapes: &[(Heads, u32)]) -> (Vec<(Scheme, Generated)>, Arc<SimLibrary>) {
    let mut out = Vec::new();
    for &(heads, d) in shapes {
        for s in schemes() {
            let Ok(s) = s.with_shape(heads, d) else { continue };
            let g = generate(&s, kernel, &default_variant(&s, kernel)).unwrap();
            out.push((s, g));
        }
    }
    let lib = compile(&out.iter().map(|(_, g)| g).collect::<Vec<_>>()).unwrap();
    (out, lib)
}

#[test]
fn sim_prefill_equals_paged_cache_bit_for_bit() {
    let (ks, lib) = kernels(Kernel::Prefill, &shapes());
    for (i, (s, g)) in ks.iter().enumerate() {
        let runner = SimExtend::with_library(s, g.clone(), lib.clone()).unwrap();
        check_prefill(s, &runner, &[1, 31, 33, 127, 300], 11 + i as u64);
    }
    report(&format!(
        "sim: prefill kernels of {} scheme/shape pairs wrote PagedCache's words bit for bit",
        ks.len()
    ));
    assert!(ks.len() >= 35);
}

#[test]
fn sim_append_equals_paged_cache_bit_for_bit() {
    let (ks, lib) = kernels(Kernel::Append, &[(Heads::Gqa { q: 8, kv: 2 }, 64), (Heads::Mha(3), 48)]);
    for (i, (s, g)) in ks.iter().enumerate() {
        let runner = SimExtend::with_library(s, g.clone(), lib.clone()).unwrap();
        // 0, 1 and 150 tokens in, then enough steps to flush channel groups
        // and chunked windows at least once.
        check_append(s, &runner, &[0, 1, 150], 140, 7 + i as u64);
    }
    report(&format!(
        "sim: append kernels of {} scheme/shape pairs wrote PagedCache's words bit for bit at every step",
        ks.len()
    ));
    assert!(ks.len() >= 20);
}
