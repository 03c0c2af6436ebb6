//! The generated prefill and append kernels on the GPU write exactly the
//! words `PagedCache` writes (pool blocks, sink buffers, window rings), bit
//! for bit, for every preset and the corner-case schemes; decode over the
//! device-filled cache then matches the oracle.
//!
//! Needs a GPU; elsewhere each test prints `SKIP ...: <reason>` and passes.

mod cuda_util;
#[path = "sim_util/mod.rs"]
mod sim_util;

use cuda_util::backend_or_skip;
use kivi_runtime::cuda::DeviceCache;
use kivi_runtime::{reference, AttnParams, CacheConfig, PagedCache};
use kivi_spec::{presets, Heads, Scheme, Tensor};
use kivi_templates::{default_variant, generate, Generated, Kernel};
use sim_util::{extra_schemes, rel_error, Rng};

fn cases() -> Vec<Scheme> {
    let mut out = Vec::new();
    for (h, d) in [
        (Heads::Gqa { q: 8, kv: 2 }, 64),
        (Heads::Mqa(4), 256),
        (Heads::Mha(3), 96),
    ] {
        for s in presets::all().into_iter().chain(extra_schemes()) {
            if let Ok(s) = s.with_shape(h, d) {
                out.push(s);
            }
        }
    }
    out
}

fn kernels() -> Vec<Generated> {
    let mut out = Vec::new();
    for s in cases() {
        for k in [Kernel::Prefill, Kernel::Append, Kernel::Decode] {
            out.push(generate(&s, k, &default_variant(&s, k)).unwrap());
        }
    }
    out
}

/// Host and device caches must agree word for word.
fn assert_same(s: &Scheme, host: &PagedCache, ids: &[u64], dev: &DeviceCache, when: &str) {
    let pool = dev.download_pool().unwrap();
    assert!(
        pool == host.pool(),
        "{}: pool words differ from PagedCache {when}",
        s.name
    );
    for (b, &id) in ids.iter().enumerate() {
        assert_eq!(
            dev.table(b),
            host.block_table(id).unwrap(),
            "{}: block table {when}",
            s.name
        );
    }
    let shape = s.shape().unwrap();
    let row = shape.kv_heads * shape.head_dim;
    for t in [Tensor::Key, Tensor::Value] {
        let sinks = dev.download_rows(t, true).unwrap();
        let ns = s.sinks as usize;
        for (b, &id) in ids.iter().enumerate() {
            let v = host.view(id).unwrap();
            let mut want = vec![0f32; shape.head_dim];
            for p in 0..ns.min(v.tokens()) {
                for hh in 0..shape.kv_heads {
                    v.row(t, p, hh, &mut want);
                    let got = &sinks[(b * ns + p) * row + hh * shape.head_dim..][..shape.head_dim];
                    assert_eq!(got, &want[..], "{}: {} sink {p} {when}", s.name, t.name());
                }
            }
        }
        let rings = dev.download_rows(t, false).unwrap();
        let slots = kivi_spec::layout::window_capacity(s, t).max(1);
        for (b, &id) in ids.iter().enumerate() {
            let v = host.view(id).unwrap();
            // compare only the slots the host says are live
            let r = kivi_spec::layout::regions(s, t, v.tokens());
            for j in r.quantized..r.quantized + r.window {
                let slot = j % slots;
                let mut want = vec![0f32; shape.head_dim];
                for hh in 0..shape.kv_heads {
                    v.row(t, r.sinks + j, hh, &mut want);
                    let got = &rings[(b * slots + slot) * row + hh * shape.head_dim..][..shape.head_dim];
                    assert_eq!(
                        got,
                        &want[..],
                        "{}: {} window token {} {when}",
                        s.name,
                        t.name(),
                        r.sinks + j
                    );
                }
            }
        }
    }
}

#[test]
fn cuda_prefill_and_append_match_paged_cache_bit_for_bit() {
    let Some(cuda) = backend_or_skip("cuda_extend", kernels) else {
        return;
    };
    let mut n = 0;
    for (i, s) in cases().iter().enumerate() {
        let shape = s.shape().unwrap();
        let row = shape.kv_heads * shape.head_dim;
        let lens = [1usize, 31, 33, 127, 300];
        let cfg = CacheConfig::for_tokens(4096);
        let mut host = PagedCache::new(s.clone(), cfg).unwrap();
        let mut dev = DeviceCache::new(cuda.device().clone(), s, lens.len(), 600, cfg).unwrap();
        let mut rng = Rng(40 + i as u64);
        let ids: Vec<u64> = lens.iter().map(|_| host.add_sequence()).collect();
        // prefill: one batch of unequal lengths
        let ks: Vec<Vec<f32>> = lens.iter().map(|&t| rng.vec(t * row)).collect();
        let vs: Vec<Vec<f32>> = lens
            .iter()
            .map(|&t| rng.vec(t * row).iter().map(|x| x * 3.0 + 0.5).collect())
            .collect();
        for (b, &id) in ids.iter().enumerate() {
            host.extend(id, &ks[b], &vs[b]).unwrap();
        }
        dev.extend(&lens, &ks.concat(), &vs.concat()).unwrap();
        assert_same(s, &host, &ids, &dev, "after prefill");
        // append: 70 decode steps, every flush of the window on the way
        let mut all_k = ks.clone();
        let mut all_v = vs.clone();
        for step in 0..70 {
            let k: Vec<Vec<f32>> = ids.iter().map(|_| rng.vec(row)).collect();
            let v: Vec<Vec<f32>> = ids.iter().map(|_| rng.vec(row)).collect();
            for (b, &id) in ids.iter().enumerate() {
                host.append(id, &k[b], &v[b]).unwrap();
                all_k[b].extend(&k[b]);
                all_v[b].extend(&v[b]);
            }
            dev.extend(&vec![1; ids.len()], &k.concat(), &v.concat()).unwrap();
            if step % 23 == 0 || step == 69 {
                assert_same(s, &host, &ids, &dev, &format!("after append step {step}"));
            }
        }
        // decode over the device-filled cache vs the oracle
        let attn = AttnParams::of(s, shape);
        let q = rng.vec(ids.len() * shape.q_heads * shape.head_dim);
        let got = dev.decode(&q, attn, None).unwrap();
        let per = shape.q_heads * shape.head_dim;
        let mut want = Vec::new();
        for b in 0..ids.len() {
            want.extend(reference::attend(s, &q[b * per..(b + 1) * per], &all_k[b], &all_v[b], attn).unwrap());
        }
        let e = rel_error(&got, &want);
        assert!(e <= 1e-4, "{}: decode after device extend, relative error {e}", s.name);
        n += 1;
    }
    println!("cuda: prefill + 70 appends bit-identical to PagedCache for {n} scheme/layout pairs");
}

#[test]
fn cuda_extend_refuses_bad_input_without_changing_anything() {
    let Some(cuda) = backend_or_skip("cuda_extend_bad", kernels) else {
        return;
    };
    // a layout of `cases()`, so the bundle's precompiled kernels cover it
    let s = presets::kivi2().with_shape(Heads::Mha(3), 96).unwrap();
    let row = 3 * 96;
    let cfg = CacheConfig::for_tokens(1024);
    let mut dev = DeviceCache::new(cuda.device().clone(), &s, 1, 300, cfg).unwrap();
    let mut rng = Rng(5);
    dev.extend(&[10], &rng.vec(10 * row), &rng.vec(10 * row)).unwrap();
    let before = dev.download_pool().unwrap();
    let mut k = rng.vec(row);
    k[7] = f32::INFINITY;
    assert!(dev.extend(&[1], &k, &rng.vec(row)).is_err());
    assert!(dev.extend(&[2], &rng.vec(row), &rng.vec(row)).is_err(), "wrong length");
    assert!(
        dev.extend(&[400], &rng.vec(400 * row), &rng.vec(400 * row)).is_err(),
        "over capacity"
    );
    assert_eq!(dev.lens(), &[10]);
    assert!(dev.download_pool().unwrap() == before);
}
