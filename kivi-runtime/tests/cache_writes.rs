//! The vectorised cache writes against the reference path (`quant.rs`
//! group by group), bit for bit: every preset and the schemes that exercise
//! the rest of the language, GQA/MQA/MHA, odd lengths, sinks and windows,
//! through `extend`, `append` and random chunks, on every instruction set
//! this CPU has (AVX-512, AVX2, the one-lane scalar form). Bad input gets
//! the reference path's error and changes nothing.

mod common;
use common::*;
use kivi_runtime::cpu::Isa;
use kivi_runtime::*;
use kivi_spec::*;

const LENGTHS: [usize; 5] = [1, 31, 33, 127, 1000];

fn isas() -> Vec<Isa> {
    let mut v = vec![Isa::Scalar];
    for isa in [Isa::Avx2, Isa::Avx512] {
        // `set_write_isa` caps to the machine: keep the ones it has.
        let s = presets::kivi2().with_shape(Heads::Mha(1), 64).unwrap();
        let mut c = PagedCache::new(s, CacheConfig::for_tokens(16)).unwrap();
        c.set_write_isa(Some(isa));
        if c.write_isa() == Some(isa) {
            v.push(isa);
        }
    }
    v
}

/// Layouts of every kind; head_dim 256 for the codec presets' 256-wide
/// groups, 40 for rows that no vector width divides evenly into groups.
fn shapes() -> Vec<(Heads, u32)> {
    vec![
        (Heads::Mha(2), 64),
        (Heads::Gqa { q: 8, kv: 2 }, 128),
        (Heads::Mqa(4), 256),
        (Heads::Gqa { q: 6, kv: 3 }, 40),
    ]
}

fn all_schemes() -> Vec<Scheme> {
    let mut v = presets::listed();
    v.extend(schemes());
    v.extend(codec_schemes());
    v
}

/// Everything a reader can see of sequence `id`, as bits.
fn state(c: &PagedCache, id: SeqId) -> Vec<u32> {
    let mut out = c.pool().to_vec();
    let view = c.view(id).unwrap();
    out.push(view.tokens() as u32);
    out.extend(view.table());
    for t in [Tensor::Key, Tensor::Value] {
        out.push(view.quantized(t) as u32);
        for raw in [view.sinks_raw(t), view.ring_raw(t)] {
            match raw {
                RawRows::Bits16(b) => out.extend(b.iter().map(|x| *x as u32)),
                RawRows::F32(f) => out.extend(f.iter().map(|x| x.to_bits())),
            }
        }
        for h in 0..c.shape().kv_heads {
            if let Some(m) = view.mean(t, h) {
                out.extend(m.iter().map(|x| x.to_bits()));
            }
        }
        out.extend(c.dequantize(id, t).unwrap().iter().map(|x| x.to_bits()));
    }
    out
}

fn cache(s: &Scheme, isa: Option<Isa>, tokens: usize) -> PagedCache {
    let mut c = PagedCache::new(s.clone(), CacheConfig::for_tokens(tokens + 64)).unwrap();
    c.set_write_isa(isa);
    c
}

#[test]
fn fast_writes_equal_the_reference_bit_for_bit() {
    let isas = isas();
    let mut rng = Rng::new(0xfa57);
    let mut cases = 0;
    for s in all_schemes() {
        for (heads, d) in shapes() {
            let Ok(s) = s.with_shape(heads, d) else { continue };
            let shape = s.shape().unwrap();
            let row = shape.kv_heads * shape.head_dim;
            for n in LENGTHS {
                // The 1000-token case on the large shapes only for the presets.
                if n == 1000 && row > 256 && !presets::listed().iter().any(|p| p.name == s.name) {
                    continue;
                }
                let k = rng.kv(n, shape.kv_heads, shape.head_dim, true);
                let v = rng.kv(n, shape.kv_heads, shape.head_dim, false);
                // Extend at once, append one by one, random chunks: the
                // window ring's stale slots differ between them, so each
                // is compared with the reference path fed alike.
                let mut chunks = vec![n];
                chunks.push(1);
                let mut left = n;
                while left > 0 {
                    let c = (1 + rng.below(70)).min(left);
                    chunks.push(c);
                    left -= c;
                }
                let modes: Vec<(&str, Vec<usize>)> = vec![
                    ("extend", vec![n]),
                    ("append", vec![1; n]),
                    ("chunks", chunks[2..].to_vec()),
                ];
                for (mode, sizes) in modes {
                    let fill = |isa: Option<Isa>| {
                        let mut c = cache(&s, isa, n);
                        let id = c.add_sequence();
                        let mut at = 0;
                        for &m in &sizes {
                            if m == 1 {
                                c.append(id, &k[at * row..(at + 1) * row], &v[at * row..(at + 1) * row])
                                    .unwrap();
                            } else {
                                c.extend(id, &k[at * row..(at + m) * row], &v[at * row..(at + m) * row])
                                    .unwrap();
                            }
                            at += m;
                        }
                        // The vectorised writes ran (they did not decline).
                        assert_eq!(c.last_write_path(), isa.and(c.write_isa()));
                        state(&c, id)
                    };
                    let want = fill(None);
                    for &isa in &isas {
                        let what = format!("{mode}: {} {heads:?} d{d} n{n} {}", s.name, isa.name());
                        assert!(fill(Some(isa)) == want, "{what}");
                        cases += 1;
                    }
                }
            }
        }
    }
    assert!(cases > 200, "only {cases} cases ran");
}

/// Groups whose least or greatest value is a zero of either sign (the sign
/// is stored in the zero point), values that round to zero, f16 ties and
/// subnormals, bf16 ties.
#[test]
fn signed_zeros_ties_and_subnormals_match() {
    let specials = [
        0.0f32,
        -0.0,
        1e-9,
        -1e-9,
        6e-8,
        -6e-8,
        1.0 + 1.0 / 2048.0,
        1.0 + 3.0 / 2048.0,
        1.0 + 1.0 / 256.0,
        -(1.0 + 1.0 / 256.0),
        3e-39,
        -3e-39,
        65504.0,
        -65519.0,
        0.5,
        -0.25,
    ];
    let mut rng = Rng::new(0x2e60);
    for s in all_schemes() {
        for dtype in [Dtype::F16, Dtype::Bf16, Dtype::F32] {
            let s = Scheme { dtype, ..s.clone() };
            let Ok(s) = s.with_shape(Heads::Gqa { q: 4, kv: 2 }, 64) else {
                continue;
            };
            let n = 97;
            let row = 128;
            let mut k = vec![0f32; n * row];
            let mut v = vec![0f32; n * row];
            for (i, (a, b)) in k.iter_mut().zip(v.iter_mut()).enumerate() {
                // Runs of zeros and specials, some rows all zero.
                let pick = rng.below(8);
                *a = if (i / row) % 5 == 0 {
                    if pick < 4 {
                        0.0
                    } else {
                        -0.0
                    }
                } else {
                    specials[rng.below(specials.len())] * if pick == 0 { 1.0 } else { 1e-3 }
                };
                *b = specials[rng.below(specials.len())];
            }
            // Keep every value storable by every tensor of the scheme.
            let limit = 1000.0;
            for x in k.iter_mut().chain(v.iter_mut()) {
                if x.abs() > limit {
                    *x = x.signum() * limit;
                }
            }
            let mut r = cache(&s, None, n);
            let rid = r.add_sequence();
            r.extend(rid, &k, &v).unwrap();
            let want = state(&r, rid);
            for isa in isas() {
                let mut e = cache(&s, Some(isa), n);
                let id = e.add_sequence();
                e.extend(id, &k, &v).unwrap();
                assert!(state(&e, id) == want, "{} {dtype:?} {}", s.name, isa.name());
                let append = |isa: Option<Isa>| {
                    let mut a = cache(&s, isa, n);
                    let id = a.add_sequence();
                    for t in 0..n {
                        a.append(id, &k[t * row..(t + 1) * row], &v[t * row..(t + 1) * row])
                            .unwrap();
                    }
                    state(&a, id)
                };
                assert!(
                    append(Some(isa)) == append(None),
                    "append {} {dtype:?} {}",
                    s.name,
                    isa.name()
                );
            }
        }
    }
}

/// NaN, infinities, values that overflow the activation dtype or a group's
/// scale: the fast path returns the reference path's error, and the cache
/// (pool, windows, lengths) is exactly as before.
#[test]
fn bad_input_same_error_nothing_changed() {
    let mut rng = Rng::new(0xbad);
    let bad = [
        f32::NAN,
        -f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        65520.0,
        -1e6,
        40000.0,
        3e38,
    ];
    for s in all_schemes() {
        for (heads, d) in [(Heads::Mha(2), 64), (Heads::Mqa(4), 256)] {
            let Ok(s) = s.with_shape(heads, d) else { continue };
            let shape = s.shape().unwrap();
            let row = shape.kv_heads * shape.head_dim;
            let n0 = 150;
            let k = rng.kv(n0, shape.kv_heads, shape.head_dim, true);
            let v = rng.kv(n0, shape.kv_heads, shape.head_dim, false);
            for isa in isas() {
                // The same history on both paths, value by value.
                let mut c = cache(&s, Some(isa), n0 + 300);
                let mut r = cache(&s, None, n0 + 300);
                let (id, rid) = (c.add_sequence(), r.add_sequence());
                c.extend(id, &k, &v).unwrap();
                r.extend(rid, &k, &v).unwrap();
                for (i, &x) in bad.iter().enumerate() {
                    let n = 1 + (i * 7) % 33;
                    let mut kb = rng.kv(n, shape.kv_heads, shape.head_dim, true);
                    let mut vb = rng.kv(n, shape.kv_heads, shape.head_dim, false);
                    let at = rng.below(n * row);
                    if i % 2 == 0 {
                        kb[at] = x;
                    } else {
                        vb[at] = x;
                    }
                    let before = state(&c, id);
                    let free = c.free_blocks();
                    let what = format!("{} {} value {x} n {n}", s.name, isa.name());
                    let got = c.extend(id, &kb, &vb);
                    let want = r.extend(rid, &kb, &vb);
                    assert_eq!(format!("{got:?}"), format!("{want:?}"), "{what}");
                    if got.is_err() {
                        assert!(state(&c, id) == before, "changed on error: {what}");
                        assert_eq!(c.free_blocks(), free, "{what}");
                        if n == 1 {
                            let got = c.append(id, &kb, &vb);
                            assert_eq!(format!("{got:?}"), format!("{want:?}"), "{what}");
                            assert!(state(&c, id) == before, "append changed on error: {what}");
                        }
                    }
                    // Storable after all (40000 with f32 scales): the same
                    // cache as the reference's.
                    assert!(state(&c, id) == state(&r, rid), "{what}");
                }
            }
        }
    }
}

/// `full` tensors check their rows as they store them (one read of the
/// input) and zero what they stored when a row fails: a bad value anywhere
/// in an extend (first row, last row, between) of every length, on the
/// sequential and the parallel (long extend) writes, gets the reference's
/// error with everything a reader sees unchanged, the same `memory()` and
/// free list, and, where the touched rows were zero before (a fresh pool),
/// the pool word for word. In blocks a freed sequence left behind, its
/// stale rows may read zero afterwards; they were never readable. The next
/// good extend stores what the reference does.
#[test]
fn full_rows_checked_while_stored_lose_nothing() {
    let mut rng = Rng::new(0xf16);
    let schemes = [Dtype::F16, Dtype::Bf16, Dtype::F32].map(|dtype| Scheme {
        dtype,
        ..presets::f16()
    });
    for s in schemes {
        for (heads, d) in [
            (Heads::Gqa { q: 8, kv: 2 }, 128),
            (Heads::Mqa(4), 256),
            (Heads::Mha(2), 64),
        ] {
            let s = s.clone().with_shape(heads, d).unwrap();
            let shape = s.shape().unwrap();
            let row = shape.kv_heads * shape.head_dim;
            for isa in isas() {
                for &n in &LENGTHS {
                    for stale in [false, true] {
                        let room = 2200;
                        let mut c = cache(&s, Some(isa), room);
                        let mut r = cache(&s, None, room);
                        if stale {
                            // A freed sequence's rows fill the blocks the next one takes.
                            for c in [&mut c, &mut r] {
                                let old = c.add_sequence();
                                let k = rng.kv(900, shape.kv_heads, shape.head_dim, true);
                                c.extend(old, &k, &k).unwrap();
                                c.free_sequence(old).unwrap();
                            }
                        }
                        let (id, rid) = (c.add_sequence(), r.add_sequence());
                        let n0 = 37;
                        let k = rng.kv(n0, shape.kv_heads, shape.head_dim, true);
                        let v = rng.kv(n0, shape.kv_heads, shape.head_dim, false);
                        c.extend(id, &k, &v).unwrap();
                        r.extend(rid, &k, &v).unwrap();
                        let mut kb = rng.kv(n, shape.kv_heads, shape.head_dim, true);
                        let mut vb = rng.kv(n, shape.kv_heads, shape.head_dim, false);
                        let at = match n % 3 {
                            0 => 0,
                            1 => n * row - 1,
                            _ => rng.below(n * row),
                        };
                        // Beyond f16's range counts only for f16 rows.
                        let bad = match s.dtype {
                            Dtype::F16 => [f32::NAN, f32::INFINITY, -1e6, 70000.0][n % 4],
                            _ => [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -f32::NAN][n % 4],
                        };
                        if n % 2 == 0 {
                            kb[at] = bad;
                        } else {
                            vb[at] = bad;
                        }
                        let what = format!("{:?} {:?} {} n {n} at {at} stale {stale}", s.dtype, heads, isa.name());
                        let before = state(&c, id);
                        let (mem, free, table) = (c.memory(), c.free_blocks(), c.block_table(id).unwrap().to_vec());
                        let got = c.extend(id, &kb, &vb);
                        let want = r.extend(rid, &kb, &vb);
                        assert!(got.is_err(), "{what}");
                        assert_eq!(format!("{got:?}"), format!("{want:?}"), "{what}");
                        assert_eq!(c.memory(), mem, "{what}");
                        assert_eq!(c.free_blocks(), free, "{what}");
                        assert_eq!(c.block_table(id).unwrap(), &table[..], "{what}");
                        let after = state(&c, id);
                        let pool = c.pool().len();
                        // Past the pool: lengths, table, windows, dequantized values.
                        assert!(after[pool..] == before[pool..], "readable state changed: {what}");
                        if !stale {
                            assert!(after == before, "pool changed: {what}");
                        }
                        // Then a good extend: the reference's tokens.
                        let kg = rng.kv(n, shape.kv_heads, shape.head_dim, true);
                        let vg = rng.kv(n, shape.kv_heads, shape.head_dim, false);
                        c.extend(id, &kg, &vg).unwrap();
                        r.extend(rid, &kg, &vg).unwrap();
                        assert_eq!(c.last_write_path(), Some(isa), "{what}");
                        let (a, b) = (state(&c, id), state(&r, rid));
                        assert!(a[pool..] == b[pool..], "{what}");
                    }
                }
            }
        }
    }
}

/// The knob: `None` is the reference path, `Some` caps at what the CPU has.
#[test]
fn write_isa_is_capped_to_the_machine() {
    let s = Scheme {
        value: quant(2, Axis::Token, 8),
        ..presets::kivi2()
    };
    let s = s.with_shape(Heads::Mha(2), 40).unwrap();
    let mut c = PagedCache::new(s, CacheConfig::for_tokens(64)).unwrap();
    c.set_write_isa(None);
    assert_eq!(c.write_isa(), None);
    c.set_write_isa(Some(Isa::Scalar));
    assert_eq!(c.write_isa(), Some(Isa::Scalar));
    // head_dim 40: no 16-lane rows, so at most AVX2
    c.set_write_isa(Some(Isa::Avx512));
    assert_ne!(c.write_isa(), Some(Isa::Avx512));
}
