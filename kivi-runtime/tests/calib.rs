//! Calibration files and `levels = nuq`: the file format refuses damage
//! with typed errors (every truncation, every flipped byte, wrong versions,
//! crafted inconsistencies), k-means finds what theory says, and a
//! calibrated cache stores exactly what the oracle computes with the same
//! codebook, the CPU backend decodes it like the oracle at odd lengths and
//! MHA / GQA / MQA, and a codebook equal to the Lloyd–Max table stores the
//! very bits of the `lloyd_max` twin.

use kivi_runtime::calib::*;
use kivi_runtime::cpu::Isa;
use kivi_runtime::rand::Rng;
use kivi_runtime::reference::{cache_view, cache_view_calibrated, decode_attention};
use kivi_runtime::*;
use kivi_spec::{fnv1a64, lloyd_max_levels, parse_scheme, Heads, Scheme, Tensor};

mod calib_util;
use calib_util::kv;

fn model(layers: u32, kv: u32, d: u32) -> ModelId {
    ModelId {
        name: "toy".into(),
        layers,
        kv_heads: kv,
        head_dim: d,
    }
}

fn gaussian(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.normal()).collect()
}

/// A small calibration with codebooks for two tensors and channel RMS.
fn small() -> (Calibration, Scheme) {
    let s = parse_scheme(
        "n { key: quant(bits = 2, axis = channel, group = 8, levels = nuq), \
             value: quant(bits = 3, axis = token, group = 16, levels = nuq, norm = l2), residual: 8, sinks: 1 }",
    )
    .unwrap();
    let mut rng = Rng::new(5);
    let samples: Vec<LayerSamples> = (0..2)
        .map(|l| {
            let mut x = LayerSamples::new(l, 40, 2, 1, 16, gaussian(&mut rng, 640), gaussian(&mut rng, 640));
            x.keys_pre_rope = Some(gaussian(&mut rng, 640));
            x
        })
        .collect();
    let mut c = Calibration::new(model(2, 1, 16), "gaussian");
    c.fit_codebooks(&s, &samples, FitOptions::default()).unwrap();
    c.add_channel_rms(&samples).unwrap();
    (c, s)
}

#[test]
fn round_trip_and_hash_do_not_depend_on_insertion_order() {
    let (c, _) = small();
    assert_eq!(c.entries().len(), 2 * 2 + 2 * 3);
    let b = c.to_bytes();
    let back = Calibration::from_bytes(&b).unwrap();
    assert_eq!(back, c);
    assert_eq!(back.to_bytes(), b);
    let mut rev = Calibration::new(c.model.clone(), c.source.clone());
    for e in c.entries().iter().rev() {
        rev.insert(e.clone()).unwrap();
    }
    assert_eq!(rev.hash(), c.hash());
    // The hash is the file's last eight bytes, FNV-1a of the rest.
    assert_eq!(c.hash(), fnv1a64(&b[..b.len() - 8]));
    // Any change of content changes it.
    let mut other = c.clone();
    other.source.push('!');
    assert_ne!(other.hash(), c.hash());
    // Files round-trip through disk, written atomically.
    let dir = std::env::temp_dir().join(format!("kivi-calib-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("c.kivical");
    c.save(&path).unwrap();
    assert_eq!(Calibration::load(&path).unwrap(), c);
    let e = Calibration::load(&dir.join("missing")).unwrap_err();
    assert!(
        matches!(e, CalibError::Io { .. }) && e.to_string().contains("missing"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn every_truncation_and_every_flipped_byte_is_a_typed_error() {
    let (c, _) = small();
    let b = c.to_bytes();
    for n in 0..b.len() {
        let e = Calibration::from_bytes(&b[..n]).unwrap_err();
        assert!(
            matches!(
                e,
                CalibError::Truncated { .. } | CalibError::Corrupt { .. } | CalibError::BadMagic
            ),
            "prefix {n}: {e}"
        );
    }
    let mut rng = Rng::new(9);
    for i in 0..b.len() {
        let mut d = b.clone();
        d[i] ^= 1 << rng.below(8);
        let e = Calibration::from_bytes(&d).unwrap_err();
        match i {
            0..8 => assert!(matches!(e, CalibError::BadMagic), "byte {i}: {e}"),
            8..12 => assert!(matches!(e, CalibError::Version { .. }), "byte {i}: {e}"),
            _ => assert!(matches!(e, CalibError::Corrupt { .. }), "byte {i}: {e}"),
        }
    }
    // Bytes appended after the hash: the hash no longer matches.
    let mut long = b.clone();
    long.push(0);
    assert!(Calibration::from_bytes(&long).is_err());
    assert!(matches!(
        Calibration::from_bytes(b"garbage").unwrap_err(),
        CalibError::Truncated { .. }
    ));
}

/// Re-hashes a body so that only the structural checks can refuse it.
fn rehash(mut body: Vec<u8>) -> Vec<u8> {
    body.truncate(body.len() - 8);
    let h = fnv1a64(&body);
    body.extend_from_slice(&h.to_le_bytes());
    body
}

#[test]
fn crafted_files_with_valid_hashes_are_refused_by_name() {
    let (c, _) = small();
    // Version 2 (hash fixed up): the version check comes first.
    let mut b = c.to_bytes();
    b[8] = 2;
    let e = Calibration::from_bytes(&rehash(b)).unwrap_err();
    assert_eq!(
        e.to_string(),
        "calibration format version 2; this build reads version 1"
    );
    // A codebook whose levels are not ascending.
    let mut one = Calibration::new(model(1, 1, 4), "x");
    let cb = Entry {
        layer: 0,
        tensor: Tensor::Key,
        stage: Stage::PostRope,
        kind: Kind::Codebook,
        fit: "f".into(),
        shape: vec![4],
        data: vec![-1.0, 0.0, 0.5, 2.0],
    };
    one.insert(cb.clone()).unwrap();
    let good = one.to_bytes();
    let data_at = good.len() - 8 - 16;
    let mut b = good.clone();
    b[data_at..data_at + 4].copy_from_slice(&3f32.to_le_bytes());
    let e = Calibration::from_bytes(&rehash(b)).unwrap_err();
    assert!(e.to_string().contains("not ascending"), "{e}");
    // Non-finite data.
    let mut b = good.clone();
    b[data_at..data_at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    assert!(Calibration::from_bytes(&rehash(b))
        .unwrap_err()
        .to_string()
        .contains("non-finite"));
    // An unknown kind, an unknown tensor, a reserved byte.
    let head_at = good.len() - 8 - 16 - 4 - 4 - 4 - 1 - 4;
    for (off, val, want) in [(2, 9u8, "unknown kind"), (0, 7, "tensor code"), (3, 1, "reserved")] {
        let mut b = good.clone();
        b[head_at + off] = val;
        let e = Calibration::from_bytes(&rehash(b)).unwrap_err();
        assert!(e.to_string().contains(want), "{want}: {e}");
    }
    // A dimension that claims more data than the file holds.
    let mut b = good.clone();
    let dim_at = data_at - 4;
    b[dim_at..dim_at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(matches!(
        Calibration::from_bytes(&rehash(b)).unwrap_err(),
        CalibError::Truncated { .. }
    ));
    // Inserting checks the same things.
    let mut bad = cb.clone();
    bad.layer = 1;
    assert!(one.insert(bad).unwrap_err().to_string().contains("layer out of range"));
    let mut bad = cb.clone();
    bad.data = vec![0.0; 3];
    bad.shape = vec![3];
    assert!(one.insert(bad).is_err());
    let mut bad = cb;
    bad.stage = Stage::PreRope;
    bad.tensor = Tensor::Value;
    assert!(one.insert(bad).is_err());
}

#[test]
fn kmeans_on_gaussian_data_finds_the_lloyd_max_table() {
    let mut rng = Rng::new(3);
    for bits in 1..=4u32 {
        let mut pts: Vec<(f32, f32)> = (0..200_000).map(|_| (rng.normal(), 1.0)).collect();
        let table = kmeans_1d(&mut pts, 1 << bits, 300);
        let lm = lloyd_max_levels(bits).unwrap();
        for (a, b) in table.iter().zip(lm) {
            assert!((a - b).abs() < 0.03, "{bits} bits: {table:?} vs {lm:?}");
        }
        assert!(table_mse(&pts, &table) <= table_mse(&pts, lm) * 1.001);
    }
    // Skewed data: the learned table beats the Gaussian one by a margin.
    let mut pts: Vec<(f32, f32)> = (0..100_000).map(|_| (rng.normal().abs().powi(2) - 1.0, 1.0)).collect();
    let table = kmeans_1d(&mut pts, 4, 100);
    let lm = lloyd_max_levels(2).unwrap();
    assert!(table_mse(&pts, &table) < 0.7 * table_mse(&pts, lm));
    // Degenerate inputs: no panic, `k` levels.
    assert_eq!(kmeans_1d(&mut [], 4, 10).len(), 4);
    assert_eq!(kmeans_1d(&mut [(1.0, 1.0)], 4, 10), vec![1.0; 4]);
    assert_eq!(kmeans_1d(&mut [(1.0, 0.0), (2.0, 0.0)], 2, 10).len(), 2);
}

/// Weighting by the query's squared magnitude per channel moves levels
/// towards the values of heavy channels: the weighted error falls, the
/// unweighted rises (a trade the fit makes on purpose).
#[test]
fn weighted_fit_trades_towards_heavy_query_channels() {
    let s = parse_scheme("w { key: quant(bits = 2, axis = token, group = 8, levels = nuq), value: full }").unwrap();
    let (t, d) = (512, 16);
    let mut rng = Rng::new(11);
    // Channels 0..4 skewed, the others Gaussian; queries large on 0..4.
    let keys: Vec<f32> = (0..t * d)
        .map(|i| {
            if i % d < 4 {
                rng.normal().powi(2) * 2.0
            } else {
                rng.normal()
            }
        })
        .collect();
    let queries: Vec<f32> = (0..t * d)
        .map(|i| (if i % d < 4 { 8.0 } else { 0.1 }) * rng.normal())
        .collect();
    let mut x = LayerSamples::new(0, t, 1, 1, d, keys, vec![0.0; t * d]);
    x.queries = Some(queries);
    let fit = |weighted| {
        let mut c = Calibration::new(model(1, 1, d as u32), "w");
        let r = c
            .fit_codebooks(
                &s,
                std::slice::from_ref(&x),
                FitOptions {
                    weighted,
                    ..FitOptions::default()
                },
            )
            .unwrap();
        (c.codebook(&s, Tensor::Key, 0).unwrap(), r[0].mse)
    };
    let (plain, _) = fit(false);
    let (weighted, wmse) = fit(true);
    assert_ne!(plain, weighted);
    // What the weighting is for: the error of the scores `q . k`.
    let view = |table: Vec<f32>| {
        let mut c = Calibration::new(model(1, 1, d as u32), "w");
        c.insert(Entry {
            layer: 0,
            tensor: Tensor::Key,
            stage: Stage::PostRope,
            kind: Kind::Codebook,
            fit: fit_key(&s, Tensor::Key).unwrap(),
            shape: vec![4],
            data: table,
        })
        .unwrap();
        let b = s.with_shape(Heads::Mha(1), d as u32).unwrap();
        cache_view_calibrated(&b, Tensor::Key, &x.keys, &c, 0).unwrap()
    };
    let q = x.queries.as_ref().unwrap();
    let score_err = |kv: &[f32]| -> f64 {
        (0..t)
            .map(|i| {
                let e: f64 = (0..d)
                    .map(|c| q[i * d + c] as f64 * (kv[i * d + c] - x.keys[i * d + c]) as f64)
                    .sum();
                e * e
            })
            .sum::<f64>()
    };
    let (ep, ew) = (score_err(&view(plain)), score_err(&view(weighted)));
    assert!(ew < ep, "weighted score error {ew} vs plain {ep} (weighted mse {wmse})");
}

const NUQ: [&str; 2] = [
    "nuq_tok { key: quant(bits = 3, axis = token, group = 16, levels = nuq),
               value: quant(bits = 2, axis = token, group = 32, levels = nuq, norm = l2), residual: 5, sinks: 2 }",
    "nuq_pipe { key: quant(bits = 2, axis = channel, group = 8, levels = nuq, norm = l2),
                value: quant(bits = 4, axis = token, group = 16, levels = nuq),
                rotation: hadamard(block = 32, apply = [key, value], signs = 9),
                outliers: sparse(per_token = 2, apply = [key]),
                center: channel_mean(tokens = 4, apply = [value]), residual: 4 }",
];

fn layouts() -> [Heads; 4] {
    [
        Heads::Mha(2),
        Heads::Gqa { q: 8, kv: 2 },
        Heads::Gqa { q: 7, kv: 1 },
        Heads::Mqa(4),
    ]
}

/// A calibration of `layers` layers fitted on other draws of the same data.
fn calibrate(s: &Scheme, heads: Heads, d: usize, layers: usize, seed: u64) -> Calibration {
    let (hq, hkv) = (heads.q_heads() as usize, heads.kv_heads() as usize);
    let mut rng = Rng::new(seed);
    let samples: Vec<LayerSamples> = (0..layers)
        .map(|l| {
            LayerSamples::new(
                l,
                96,
                hq,
                hkv,
                d,
                kv(&mut rng, 96, hkv, d, true),
                kv(&mut rng, 96, hkv, d, false),
            )
        })
        .collect();
    let mut c = Calibration::new(model(layers as u32, hkv as u32, d as u32), "test draws");
    c.fit_codebooks(s, &samples, FitOptions::default()).unwrap();
    c
}

/// Cache (reference writes and vectorised writes, streamed and prefilled)
/// against the oracle with the same codebook, bit for bit; then the CPU
/// backend on every instruction set against oracle attention over them.
#[test]
fn calibrated_caches_match_the_oracle_odd_lengths_and_layouts() {
    let d = 32;
    for (i, text) in NUQ.iter().enumerate() {
        let s0 = parse_scheme(text).unwrap();
        for (j, heads) in layouts().into_iter().enumerate() {
            let s = s0.with_shape(heads, d as u32).unwrap();
            let hq = heads.q_heads() as usize;
            let cal = calibrate(&s, heads, d, 2, 70 + j as u64);
            let layer = 1;
            let lens = [1usize, 31, 33, 127, 1000];
            let total: usize = lens.iter().sum();
            let mut rng = Rng::new(80 + (i * 4 + j) as u64);
            let mut caches: Vec<PagedCache> = [None, Some(Isa::Avx512)]
                .into_iter()
                .map(|isa| {
                    let mut c = PagedCache::with_calibration(
                        s.clone(),
                        CacheConfig::for_tokens(total + 64 * lens.len()),
                        &cal,
                        layer,
                    )
                    .unwrap();
                    c.set_write_isa(isa);
                    c
                })
                .collect();
            let (seqs, views) = calib_util::fill_and_check(&mut caches, &s, &cal, layer, &lens[..], &mut rng, &heads);
            assert_eq!(caches[0].pool(), caches[1].pool());
            let q: Vec<f32> = (0..lens.len() * hq * d).map(|_| 2.0 * rng.f32()).collect();
            let attn = AttnParams::of(&s, s.shape().unwrap());
            let per = hq * d;
            let want: Vec<f32> = views
                .iter()
                .enumerate()
                .flat_map(|(b, (kw, vw))| decode_attention(&s, &q[b * per..(b + 1) * per], kw, vw, attn).unwrap())
                .collect();
            let p0 = CpuParams::default();
            for p in [p0, CpuParams { avx512: false, ..p0 }, CpuParams { scalar: true, ..p0 }] {
                let got = CpuBackend::new(p).unwrap().decode(&caches[0], &seqs, &q, attn).unwrap();
                for (b, n) in lens.iter().enumerate() {
                    let (w, g) = (&want[b * per..(b + 1) * per], &got[b * per..(b + 1) * per]);
                    // Judged against max |ref|, or the mean |v| where the
                    // weighted sum cancels to less: f32 accumulation error
                    // scales with the values summed, not with their sum.
                    let vmean = views[b].1.iter().map(|x| x.abs()).sum::<f32>() / views[b].1.len() as f32;
                    let scale = w.iter().fold(0f32, |m, x| m.max(x.abs())).max(vmean).max(1e-30);
                    let err = w.iter().zip(g).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
                    assert!(
                        err <= 1e-5 * scale,
                        "{} {heads} len {n} {} ({}): {err:e} vs max |ref| {scale:e}",
                        s.name,
                        p.name(),
                        p.isa(d).name()
                    );
                }
            }
        }
    }
}

/// With the Lloyd–Max table as its codebook, a `nuq` scheme stores the
/// very bits of its `lloyd_max` twin and decodes to the same output: the
/// table is the only thing `nuq` changes.
#[test]
fn a_lloyd_max_codebook_gives_the_lloyd_max_twin_bit_for_bit() {
    let d = 64;
    let heads = Heads::Gqa { q: 8, kv: 2 };
    let text = "t { key: quant(bits = 3, axis = token, group = 32, levels = LEVELS), \
                    value: quant(bits = 2, axis = channel, group = 16, levels = LEVELS, norm = l2), residual: 9 }";
    let nuq = parse_scheme(&text.replace("LEVELS", "nuq"))
        .unwrap()
        .with_shape(heads, d)
        .unwrap();
    let lm = parse_scheme(&text.replace("LEVELS", "lloyd_max"))
        .unwrap()
        .with_shape(heads, d)
        .unwrap();
    let mut cal = Calibration::new(model(1, 2, d), "lloyd-max tables");
    for (t, bits) in [(Tensor::Key, 3), (Tensor::Value, 2)] {
        cal.insert(Entry {
            layer: 0,
            tensor: t,
            stage: Stage::PostRope,
            kind: Kind::Codebook,
            fit: fit_key(&nuq, t).unwrap(),
            shape: vec![1 << bits],
            data: lloyd_max_levels(bits).unwrap().to_vec(),
        })
        .unwrap();
    }
    let mut a = PagedCache::with_calibration(nuq.clone(), CacheConfig::for_tokens(600), &cal, 0).unwrap();
    let mut b = PagedCache::new(lm.clone(), CacheConfig::for_tokens(600)).unwrap();
    let mut rng = Rng::new(2);
    let (k, v) = (kv(&mut rng, 333, 2, 64, true), kv(&mut rng, 333, 2, 64, false));
    let (ia, ib) = (a.add_sequence(), b.add_sequence());
    a.extend(ia, &k, &v).unwrap();
    b.extend(ib, &k, &v).unwrap();
    assert_eq!(a.pool(), b.pool());
    assert_eq!(a.memory(), b.memory());
    assert_eq!(
        cache_view_calibrated(&nuq, Tensor::Key, &k, &cal, 0).unwrap(),
        cache_view(&lm, Tensor::Key, &k).unwrap()
    );
    let q = rng.vec(8 * 64);
    let attn = AttnParams::of(&lm, lm.shape().unwrap());
    let cpu = CpuBackend::default();
    assert_eq!(
        cpu.decode(&a, &[ia], &q, attn).unwrap(),
        cpu.decode(&b, &[ib], &q, attn).unwrap()
    );
    // Identity: the scheme hash joined with the calibration's.
    assert_eq!(b.identity(), kivi_spec::scheme_hash(&lm));
    assert_eq!(a.identity(), identity(kivi_spec::scheme_hash(&nuq), Some(cal.hash())));
    let mut cal2 = cal.clone();
    cal2.source.push('2');
    let a2 = PagedCache::with_calibration(nuq, CacheConfig::for_tokens(64), &cal2, 0).unwrap();
    assert_ne!(a2.identity(), a.identity());
}

#[test]
fn missing_or_mismatched_calibrations_are_clear_errors() {
    let (cal, s) = small();
    let s = s.with_shape(Heads::Mqa(2), 16).unwrap();
    // No calibration at all.
    let e = PagedCache::new(s.clone(), CacheConfig::for_tokens(64)).err().unwrap();
    assert!(
        e.to_string().contains("levels = nuq") && e.to_string().contains("key"),
        "{e}"
    );
    assert!(cache_view(&s, Tensor::Value, &[0.0; 16]).is_err());
    // A layer past the model's.
    let e = PagedCache::with_calibration(s.clone(), CacheConfig::for_tokens(64), &cal, 2)
        .err()
        .unwrap();
    assert!(
        e.to_string().contains("layer 2 key") && e.to_string().contains("2 layers"),
        "{e}"
    );
    // A layer the calibration lacks (fitted on layer 0 only).
    let mut partial = Calibration::new(cal.model.clone(), "partial");
    for en in cal.entries().iter().filter(|e| e.layer == 0) {
        partial.insert(en.clone()).unwrap();
    }
    let e = PagedCache::with_calibration(s.clone(), CacheConfig::for_tokens(64), &partial, 1)
        .err()
        .unwrap();
    assert!(
        e.to_string().contains("layer 1 key") && e.to_string().contains("no codebook"),
        "{e}"
    );
    // A quantizer the codebooks were not fitted for (another group size).
    let other = parse_scheme(
        "n { key: quant(bits = 2, axis = channel, group = 16, levels = nuq), \
             value: quant(bits = 3, axis = token, group = 16, levels = nuq, norm = l2), residual: 8, sinks: 1 }",
    )
    .unwrap()
    .with_shape(Heads::Mqa(2), 16)
    .unwrap();
    let e = PagedCache::with_calibration(other, CacheConfig::for_tokens(64), &cal, 0)
        .err()
        .unwrap();
    assert!(
        e.to_string().contains("group=16") && e.to_string().contains("codebooks for: bits=2 axis=channel group=8"),
        "{e}"
    );
    // Another model shape.
    let wide = s.with_shape(Heads::Mqa(2), 16).unwrap();
    let mut bigger = cal.clone();
    bigger.model.kv_heads = 2;
    let e = PagedCache::with_calibration(wide, CacheConfig::for_tokens(64), &bigger, 0)
        .err()
        .unwrap();
    assert!(
        matches!(&e, Error::Calibration(c) if matches!(**c, CalibError::ModelMismatch { .. })),
        "{e}"
    );
    // Samples that disagree with the model.
    let mut c = Calibration::new(model(1, 1, 16), "x");
    let bad = LayerSamples::new(0, 4, 1, 1, 16, vec![0.0; 63], vec![0.0; 64]);
    assert!(c
        .fit_codebooks(&s, &[bad], FitOptions::default())
        .unwrap_err()
        .to_string()
        .contains("keys hold 63"));
    let nan = LayerSamples::new(0, 4, 1, 1, 16, vec![f32::NAN; 64], vec![0.0; 64]);
    assert!(c.fit_codebooks(&s, &[nan], FitOptions::default()).is_err());
    let other_shape = LayerSamples::new(0, 4, 2, 2, 16, vec![0.0; 128], vec![0.0; 128]);
    assert!(c.fit_codebooks(&s, &[other_shape], FitOptions::default()).is_err());
}

/// Sinks decide which tokens a table is fitted on: two schemes that differ
/// only in sinks get two tables, and fitting the second leaves the first's
/// as it was (it used to overwrite it under one shared fit key).
#[test]
fn schemes_differing_only_in_sinks_keep_their_own_tables() {
    let text = |sinks: u32| {
        format!(
            "pub S{sinks} {{ key: quant(bits = 2, axis = channel, group = 16, levels = nuq), \
             value: quant(bits = 2, axis = token, group = 32, levels = nuq), residual: 0, sinks: {sinks} }}"
        )
    };
    let (a, b) = (parse_scheme(&text(0)).unwrap(), parse_scheme(&text(24)).unwrap());
    for t in [Tensor::Key, Tensor::Value] {
        assert_ne!(fit_key(&a, t), fit_key(&b, t), "{t:?}");
    }
    let (hq, hkv, d) = (4usize, 2usize, 32usize);
    let mut rng = Rng::new(11);
    let samples = vec![LayerSamples::new(
        0,
        96,
        hq,
        hkv,
        d,
        kv(&mut rng, 96, hkv, d, true),
        kv(&mut rng, 96, hkv, d, false),
    )];
    let mut c = Calibration::new(model(1, hkv as u32, d as u32), "test draws");
    c.fit_codebooks(&a, &samples, FitOptions::default()).unwrap();
    let before: Vec<Vec<f32>> = [Tensor::Key, Tensor::Value]
        .iter()
        .map(|&t| c.codebook(&a, t, 0).unwrap())
        .collect();
    c.fit_codebooks(&b, &samples, FitOptions::default()).unwrap();
    for (i, &t) in [Tensor::Key, Tensor::Value].iter().enumerate() {
        assert_eq!(
            c.codebook(&a, t, 0).unwrap(),
            before[i],
            "{t:?}: fitting S24 changed S0's table"
        );
        // 24 of 96 tokens left out: another sample, another table.
        assert_ne!(c.codebook(&b, t, 0).unwrap(), before[i], "{t:?}");
    }
}
