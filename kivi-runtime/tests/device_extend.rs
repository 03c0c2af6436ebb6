//! The generated prefill and append kernels, launched by `DeviceCache`,
//! write exactly the words `PagedCache` writes (pool blocks, sink buffers,
//! window rings), bit for bit, for every preset and the corner-case schemes;
//! decode over the device-filled cache then matches the oracle. A failed
//! append (non-finite input, scale overflow) leaves the device cache exactly
//! as it was.
//!
//! Runs on the simulated device everywhere and on GPU 0 where one is usable.

mod device_util;
#[path = "sim_util/mod.rs"]
mod sim_util;

use device_util::devices;
use kivi_runtime::device::{Device, DeviceCache};
use kivi_runtime::{reference, AttnParams, CacheConfig, PagedCache};
use kivi_spec::{presets, Heads, Scheme, Tensor};
use kivi_templates::{default_variant, generate, Generated, Kernel};
use sim_util::{extra_schemes, rel_error, Rng};
use std::sync::Arc;

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

/// f32 activations with f16 scales: large values pass the host's rounding
/// and overflow their scale on the device.
fn undo_scheme() -> Scheme {
    kivi_spec::parse_scheme(
        "Undo { key: quant(bits = 2, axis = channel, group = 32), \
         value: quant(bits = 2, axis = token, group = 32), residual: 0, dtype: f32 }",
    )
    .unwrap()
    .with_shape(Heads::Gqa { q: 4, kv: 2 }, 64)
    .unwrap()
}

fn kernels() -> Vec<Generated> {
    let mut out = Vec::new();
    for s in cases().into_iter().chain([undo_scheme()]) {
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
fn prefill_and_append_match_paged_cache_bit_for_bit() {
    for dev in devices("extend", kernels) {
        extend_on(&dev);
    }
}

fn extend_on(cuda: &Arc<dyn Device>) {
    let mut n = 0;
    for (i, s) in cases().iter().enumerate() {
        let shape = s.shape().unwrap();
        let row = shape.kv_heads * shape.head_dim;
        let lens = [1usize, 31, 33, 127, 300];
        let cfg = CacheConfig::for_tokens(4096);
        let mut host = PagedCache::new(s.clone(), cfg).unwrap();
        let mut dev = DeviceCache::new(cuda.clone(), s, lens.len(), 600, cfg).unwrap();
        let mut rng = Rng::new(40 + i as u64);
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
    println!(
        "{}: prefill + 70 appends bit-identical to PagedCache for {n} scheme/layout pairs",
        cuda.kind().name()
    );
}

#[test]
fn extend_refuses_bad_input_without_changing_anything() {
    for dev in devices("extend_bad", kernels) {
        bad_extend_on(&dev);
    }
}

fn bad_extend_on(cuda: &Arc<dyn Device>) {
    // a layout of `cases()`, so the bundle's precompiled kernels cover it
    let s = presets::kivi2().with_shape(Heads::Mha(3), 96).unwrap();
    let row = 3 * 96;
    let cfg = CacheConfig::for_tokens(1024);
    let mut dev = DeviceCache::new(cuda.clone(), &s, 1, 300, cfg).unwrap();
    let mut rng = Rng::new(5);
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

/// A value no group could quantize (±1e5 with f16 scales; f32 activations,
/// so rounding lets it through) is refused by the append that brings it,
/// on the device cache as on the host (the same range rule), leaving every
/// buffer exactly as it was; later appends then match a host cache that
/// refused the same append. (The kernel's own overflow status, undone by
/// `DeviceCache`, is tested below the host check, in the crate's unit tests.)
#[test]
fn failed_device_append_is_undone() {
    for dev in devices("extend_undo", kernels) {
        undo_on(&dev);
    }
}

fn undo_on(cuda: &Arc<dyn Device>) {
    let s = undo_scheme();
    let row = 2 * 64;
    let cfg = CacheConfig::for_tokens(2048);
    let mut dev = DeviceCache::new(cuda.clone(), &s, 2, 500, cfg).unwrap();
    let mut host = PagedCache::new(s.clone(), cfg).unwrap();
    let ids = [host.add_sequence(), host.add_sequence()];
    let mut rng = Rng::new(9);
    let (k, v) = (rng.vec(2 * 45 * row), rng.vec(2 * 45 * row));
    dev.extend(&[45, 45], &k, &v).unwrap();
    for b in 0..2 {
        host.extend(ids[b], &k[b * 45 * row..][..45 * row], &v[b * 45 * row..][..45 * row])
            .unwrap();
    }
    let pool = dev.download_pool().unwrap();
    let rows: Vec<Vec<f32>> = [Tensor::Key, Tensor::Value]
        .iter()
        .flat_map(|&t| {
            [
                dev.download_rows(t, true).unwrap(),
                dev.download_rows(t, false).unwrap(),
            ]
        })
        .collect();
    // Values of 1e5 and -1e5 in one token-axis group: scale 6.7e4 > f16 max.
    let mut bad_v = rng.vec(2 * row);
    bad_v[row + 3] = 1e5;
    bad_v[row + 4] = -1e5;
    let e = dev.extend(&[1, 1], &rng.vec(2 * row), &bad_v).unwrap_err();
    assert!(
        e.to_string().contains("sequence 1") && e.to_string().contains("100000"),
        "{e}"
    );
    assert_eq!(dev.lens(), &[45, 45]);
    assert!(dev.download_pool().unwrap() == pool, "pool changed by a failed append");
    let after: Vec<Vec<f32>> = [Tensor::Key, Tensor::Value]
        .iter()
        .flat_map(|&t| {
            [
                dev.download_rows(t, true).unwrap(),
                dev.download_rows(t, false).unwrap(),
            ]
        })
        .collect();
    assert!(after == rows, "sink/window rows changed by a failed append");
    // The host refuses the same append, for the same reason.
    assert!(host.append(ids[1], &rng.vec(row), &bad_v[row..]).is_err());
    // Later appends land as if the failed one never happened.
    for _ in 0..40 {
        let (k, v) = (rng.vec(2 * row), rng.vec(2 * row));
        dev.extend(&[1, 1], &k, &v).unwrap();
        for b in 0..2 {
            host.append(ids[b], &k[b * row..][..row], &v[b * row..][..row]).unwrap();
        }
    }
    assert_same(&s, &host, &ids, &dev, "after a failed append and 40 good ones");
}

/// Shapes no preset is bound to: GQA 7:1 at head_dim 80 and MHA 3 at 96.
fn odd_shapes() -> [(Heads, u32); 2] {
    [(Heads::Gqa { q: 7, kv: 1 }, 80), (Heads::Mha(3), 96)]
}

/// Every scheme of the suite that binds `shape` (a token-axis group must
/// divide head_dim).
fn bound(h: Heads, d: u32) -> Vec<Scheme> {
    presets::all()
        .into_iter()
        .chain(extra_schemes())
        .filter_map(|s| s.with_shape(h, d).ok())
        .collect()
}

/// Every prefill and append variant the generator offers (not only the
/// default), for every scheme that binds the odd shapes: a prefill of odd
/// lengths then 40 appends, bit-identical with `PagedCache` throughout.
#[test]
fn every_prefill_and_append_variant_matches_paged_cache() {
    let gens = || {
        let mut out = Vec::new();
        for (h, d) in odd_shapes() {
            for s in bound(h, d) {
                for k in [Kernel::Prefill, Kernel::Append] {
                    for v in kivi_templates::variants(&s, k) {
                        out.push(generate(&s, k, &v).unwrap());
                    }
                }
            }
        }
        out
    };
    for dev in devices("extend_variants", gens) {
        // One library for the whole sweep on the simulator.
        let all = gens();
        dev.load_many(&all.iter().collect::<Vec<_>>()).unwrap();
        let mut runs = 0;
        for (h, d) in odd_shapes() {
            for (i, s) in bound(h, d).iter().enumerate() {
                let pv = kivi_templates::variants(s, Kernel::Prefill);
                let av = kivi_templates::variants(s, Kernel::Append);
                assert!(
                    pv.len() >= 3 && av.len() >= 3,
                    "{}: {} / {} variants",
                    s.name,
                    pv.len(),
                    av.len()
                );
                for (j, (p, a)) in pv.iter().zip(&av).enumerate() {
                    let shape = s.shape().unwrap();
                    let row = shape.kv_heads * shape.head_dim;
                    let lens = [1usize, 33, 70];
                    let cfg = CacheConfig::for_tokens(1024);
                    let mut host = PagedCache::new(s.clone(), cfg).unwrap();
                    let mut dc = DeviceCache::new(dev.clone(), s, lens.len(), 200, cfg).unwrap();
                    let ids: Vec<u64> = lens.iter().map(|_| host.add_sequence()).collect();
                    let mut rng = Rng::new(1000 + 10 * i as u64 + j as u64);
                    let ks: Vec<Vec<f32>> = lens.iter().map(|&t| rng.vec(t * row)).collect();
                    let vs: Vec<Vec<f32>> = lens.iter().map(|&t| rng.vec(t * row)).collect();
                    for (b, &id) in ids.iter().enumerate() {
                        host.extend(id, &ks[b], &vs[b]).unwrap();
                    }
                    dc.extend_with(&lens, &ks.concat(), &vs.concat(), Some(*p)).unwrap();
                    for _ in 0..40 {
                        let k: Vec<f32> = rng.vec(lens.len() * row);
                        let v: Vec<f32> = rng.vec(lens.len() * row);
                        for (b, &id) in ids.iter().enumerate() {
                            host.append(id, &k[b * row..][..row], &v[b * row..][..row]).unwrap();
                        }
                        dc.extend_with(&vec![1; lens.len()], &k, &v, Some(*a)).unwrap();
                    }
                    let when = format!("prefill {} then 40 appends {} on {h} d{d}", p.name(), a.name());
                    assert_same(s, &host, &ids, &dc, &when);
                    runs += 1;
                }
            }
        }
        sim_util::report(&format!(
            "{}: {runs} prefill/append variant pairs bit-identical to PagedCache on GQA 7:1 d80 and MHA 3 d96",
            dev.kind().name()
        ));
        assert!(runs >= 20, "{runs}");
    }
}
