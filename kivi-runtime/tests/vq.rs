//! Product vector quantization (`vq(...)`): k-means and the calibration
//! entries (round trip, crafted damage refused by name), the paged cache
//! against the oracle bit for bit (streamed and prefilled, odd lengths,
//! MHA / GQA / MQA, shared and per-layer codebooks, 4- to 12-bit codes),
//! the CPU backend's lookup-table decode against oracle attention on every
//! instruction set, exact memory, and clear errors without a calibration.

use kivi_runtime::calib::*;
use kivi_runtime::rand::Rng;
use kivi_runtime::reference::{cache_view, cache_view_calibrated, decode_attention};
use kivi_runtime::vq::{kmeans, nearest, VqFitOptions};
use kivi_runtime::*;
use kivi_spec::{fnv1a64, parse_scheme, Heads, Scheme, Tensor};

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
    c.fit_vq(s, &samples, VqFitOptions::default()).unwrap();
    c
}

const VQ: [&str; 4] = [
    // Both tensors vq, per-layer codebooks, sinks and a short window.
    "a { key: vq(dim = 8, entries = 16), value: vq(dim = 4, entries = 256), residual: 4, sinks: 2 }",
    // KIVI-2 keys, vq values with a shared codebook (the 2-bit class).
    "b { key: quant(bits = 2, axis = channel, group = 32), value: vq(dim = 8, entries = 256, codebook = shared), residual: 32 }",
    // One codebook for keys and values, 10-bit codes (three a word), bf16.
    "c { key: vq(dim = 4, entries = 1024, codebook = c), value: vq(dim = 4, entries = 1024, codebook = c), residual: 8, dtype: bf16 }",
    // vq keys, full values, chunked flush, no window at the start.
    "d { key: vq(dim = 2, entries = 4), value: full, residual: 16, flush: chunked }",
];

/// Group sizes 1, 4, 7 and 8: the CPU lookups take heads four at a time,
/// with a remainder (7) or none (4, 8), and one head alone (MHA).
fn layouts() -> [Heads; 5] {
    [
        Heads::Mha(2),
        Heads::Gqa { q: 16, kv: 2 },
        Heads::Gqa { q: 8, kv: 2 },
        Heads::Gqa { q: 7, kv: 1 },
        Heads::Mqa(4),
    ]
}

#[test]
fn kmeans_is_deterministic_and_finds_separated_clusters() {
    let mut rng = Rng::new(5);
    // Four tight 2-D clusters.
    let centres = [(-4.0f32, -4.0f32), (4.0, -4.0), (-4.0, 4.0), (4.0, 4.0)];
    let pts: Vec<f32> = (0..400)
        .flat_map(|i| {
            let (x, y) = centres[i % 4];
            [x + 0.1 * rng.f32(), y + 0.1 * rng.f32()]
        })
        .collect();
    let a = kmeans(&pts, 2, 4, 50, 9);
    assert_eq!(a, kmeans(&pts, 2, 4, 50, 9));
    for (x, y) in centres {
        let c = nearest(&[x, y], &a, 2);
        assert!((a[2 * c] - x).abs() < 0.1 && (a[2 * c + 1] - y).abs() < 0.1, "{a:?}");
    }
    // Fewer points than centroids: every point is a centroid; no points: zeros.
    let few = kmeans(&[1.0, 2.0, 3.0, 4.0], 2, 4, 10, 1);
    assert_eq!(few.len(), 8);
    assert!(few.chunks(2).all(|c| c == [1.0, 2.0] || c == [3.0, 4.0]));
    assert_eq!(kmeans(&[], 2, 4, 10, 1), vec![0.0; 8]);
    // Ties go to the lowest index.
    assert_eq!(nearest(&[0.0], &[1.0, -1.0, 1.0], 1), 0);
}

#[test]
fn vq_entries_round_trip_and_crafted_damage_is_refused_by_name() {
    let s = parse_scheme(VQ[0]).unwrap().with_shape(Heads::Mha(2), 32).unwrap();
    let cal = calibrate(&s, Heads::Mha(2), 32, 2, 1);
    // Two layers, two tensors: four entries of [sub, E, M].
    assert_eq!(cal.entries().len(), 4);
    assert!(cal.entries().iter().all(|e| e.kind == Kind::VqCodebook));
    let e = &cal.entries()[0];
    assert_eq!(e.shape, [4, 16, 8]);
    let b = cal.to_bytes();
    let back = Calibration::from_bytes(&b).unwrap();
    assert_eq!(back, cal);
    assert_eq!(back.hash(), fnv1a64(&b[..b.len() - 8]));
    // The same fit twice gives the same file.
    assert_eq!(calibrate(&s, Heads::Mha(2), 32, 2, 1).to_bytes(), b);
    // Every flipped byte is a typed error, never a panic.
    for i in (0..b.len()).step_by(7) {
        let mut x = b.clone();
        x[i] ^= 0x10;
        assert!(Calibration::from_bytes(&x).is_err(), "byte {i}");
    }
    // Entries that pass the hash but not the shape rules.
    let mut one = Calibration::new(model(1, 2, 32), "x");
    for (shape, want) in [
        (vec![4u32, 16, 4], "do not cover head_dim 32"),
        (vec![4, 12, 8], "12 entries"),
        (vec![32, 8], "shape [sub-vectors, entries, dim]"),
    ] {
        let n = shape.iter().product::<u32>() as usize;
        let bad = Entry {
            layer: 0,
            tensor: Tensor::Key,
            stage: Stage::PostRope,
            kind: Kind::VqCodebook,
            fit: "vq dim=8 entries=16".into(),
            shape,
            data: vec![0.5; n],
        };
        let e = one.insert(bad).unwrap_err().to_string();
        assert!(e.contains(want), "{want}: {e}");
    }
    // An unknown entry kind code in an otherwise valid file.
    // magic, version, model (name, 3 x u32), source, count, then the
    // first entry's layer and its header bytes (tensor, stage, kind, 0).
    let kind_at = 8 + 4 + (4 + cal.model.name.len()) + 12 + (4 + cal.source.len()) + 4 + 4;
    assert_eq!(&b[kind_at..kind_at + 4], &[0, 0, 3, 0]);
    let mut x = b[..b.len() - 8].to_vec();
    x[kind_at + 2] = 9;
    let h = fnv1a64(&x);
    x.extend_from_slice(&h.to_le_bytes());
    let e = Calibration::from_bytes(&x).unwrap_err().to_string();
    assert!(e.contains("unknown kind 9"), "{e}");
}

#[test]
fn a_vq_scheme_without_its_codebooks_is_a_clear_error() {
    let s = parse_scheme(VQ[0]).unwrap().with_shape(Heads::Mqa(2), 32).unwrap();
    let e = PagedCache::new(s.clone(), CacheConfig::for_tokens(64)).err().unwrap();
    assert!(
        e.to_string().contains("vq(...)") && e.to_string().contains("keys"),
        "{e}"
    );
    assert!(cache_view(&s, Tensor::Value, &[0.0; 32]).is_err());
    let cal = calibrate(&s, Heads::Mqa(2), 32, 2, 3);
    // A layer past the model's, and one the calibration lacks.
    let e = PagedCache::with_calibration(s.clone(), CacheConfig::for_tokens(64), &cal, 2)
        .err()
        .unwrap();
    assert!(
        e.to_string().contains("layer 2 key") && e.to_string().contains("2 layers"),
        "{e}"
    );
    let mut partial = Calibration::new(cal.model.clone(), "partial");
    for en in cal.entries().iter().filter(|e| e.layer == 0 || e.tensor == Tensor::Key) {
        partial.insert(en.clone()).unwrap();
    }
    let e = PagedCache::with_calibration(s.clone(), CacheConfig::for_tokens(64), &partial, 1)
        .err()
        .unwrap();
    assert!(
        e.to_string().contains("layer 1 value") && e.to_string().contains("no vq codebook"),
        "{e}"
    );
    // Codebooks fitted for another quantizer.
    let other =
        parse_scheme("a { key: vq(dim = 4, entries = 16), value: vq(dim = 4, entries = 256), residual: 4, sinks: 2 }")
            .unwrap()
            .with_shape(Heads::Mqa(2), 32)
            .unwrap();
    let e = PagedCache::with_calibration(other.clone(), CacheConfig::for_tokens(64), &cal, 0)
        .err()
        .unwrap();
    assert!(
        e.to_string().contains("vq dim=4 entries=16")
            && e.to_string().contains("vq codebooks for: vq dim=8 entries=16"),
        "{e}"
    );
    assert!(cache_view_calibrated(&other, Tensor::Key, &[0.0; 32], &cal, 0).is_err());
    // Another model shape.
    let mut bigger = cal.clone();
    bigger.model.kv_heads = 2;
    assert!(PagedCache::with_calibration(s, CacheConfig::for_tokens(64), &bigger, 0).is_err());
}

/// Cache (streamed and prefilled) against the oracle with the same
/// codebooks, bit for bit; the CPU backend on every instruction set
/// against oracle attention over them; exact memory.
#[test]
fn vq_caches_match_the_oracle_odd_lengths_and_layouts() {
    for (i, text) in VQ.iter().enumerate() {
        check_against_oracle(i, text, 32);
    }
}

/// Value sub-vectors the CPU's vector loops take in chunks of 8, 2 and 1
/// (`S` = 11, 3, 24, 48, 44), centroids of 16, 4, 2 and 1 channel(s) (a
/// head a vector on AVX-512, four, eight or sixteen heads a vector, by
/// heads where the centroid is wider than AVX2's eight lanes), 8-, 6- and
/// 1-bit codes. Keys are scored in chunks of 8, 4, 2 and 1 sub-vectors
/// (as many tables as fit 32 KiB): `i`'s byte codes at `S` = 11 take
/// 8 + 2 + 1 at one and four heads, 4 + 4 + 2 + 1 at seven and eight.
#[test]
fn vq_values_match_the_oracle_at_every_vector_chunking() {
    let cases = [
        (
            "e { key: vq(dim = 16, entries = 4), value: vq(dim = 16, entries = 16), residual: 4 }",
            176,
        ),
        (
            "f { key: vq(dim = 16, entries = 4), value: vq(dim = 16, entries = 16), residual: 4 }",
            48,
        ),
        (
            "g { key: quant(bits = 2, axis = channel, group = 32), value: vq(dim = 2, entries = 64), residual: 8 }",
            48,
        ),
        (
            "h { key: vq(dim = 8, entries = 256), value: vq(dim = 1, entries = 2), residual: 8, sinks: 2 }",
            48,
        ),
        (
            "i { key: vq(dim = 16, entries = 256), value: vq(dim = 4, entries = 256), residual: 8, sinks: 3 }",
            176,
        ),
    ];
    for (i, (text, d)) in cases.into_iter().enumerate() {
        check_against_oracle(10 + i, text, d);
    }
}

/// Scheme `text` (number `i`, for the seeds) at head width `d` on every
/// layout of [`layouts`]: caches against the oracle bit for bit, exact
/// memory, and the CPU backend on every instruction set, at one and at
/// three splits, within 1e-5.
fn check_against_oracle(i: usize, text: &str, d: usize) {
    let s0 = parse_scheme(text).unwrap();
    for (j, heads) in layouts().into_iter().enumerate() {
        let s = s0.with_shape(heads, d as u32).unwrap();
        let (hq, hkv) = (heads.q_heads() as usize, heads.kv_heads() as usize);
        let cal = calibrate(&s, heads, d, 2, 70 + j as u64);
        let layer = 1;
        let lens = [1usize, 31, 33, 127, 1000];
        let total: usize = lens.iter().sum();
        let mut rng = Rng::new(80 + (i * 4 + j) as u64);
        let mut caches: Vec<PagedCache> = (0..2)
            .map(|_| {
                PagedCache::with_calibration(s.clone(), CacheConfig::for_tokens(total + 64 * lens.len()), &cal, layer)
                    .unwrap()
            })
            .collect();
        let (seqs, views) = calib_util::fill_and_check(&mut caches, &s, &cal, layer, &lens[..], &mut rng, &heads);
        assert_eq!(caches[0].pool(), caches[1].pool());
        // Exact memory: codes only per block, codebooks once.
        let m = caches[0].memory();
        let l = caches[0].layout();
        assert_eq!(
            m.codes,
            m.blocks_in_use * hkv * (l.key.codes_words() + l.value.codes_words()) * 4
        );
        let book_bytes = |t: Tensor| s.codec(t).vq().map_or(0, |v| d * v.entries as usize * 4);
        let shared = s
            .key
            .vq()
            .is_some_and(|k| k.codebook.is_some() && s.value.vq() == Some(k));
        let want_books = if shared {
            book_bytes(Tensor::Key)
        } else {
            book_bytes(Tensor::Key) + book_bytes(Tensor::Value)
        };
        assert_eq!(m.codebooks, want_books, "{}", s.name);
        assert_eq!(
            caches[0].identity(),
            calib::identity(kivi_spec::scheme_hash(&s), Some(cal.hash()))
        );
        let q: Vec<f32> = (0..lens.len() * hq * d).map(|_| 2.0 * rng.f32()).collect();
        let attn = AttnParams::of(&s, s.shape().unwrap());
        let per = hq * d;
        let want: Vec<f32> = views
            .iter()
            .enumerate()
            .flat_map(|(b, (kw, vw))| decode_attention(&s, &q[b * per..(b + 1) * per], kw, vw, attn).unwrap())
            .collect();
        // Every instruction set, each with the automatic splits and with
        // three splits of 48-token tiles (splits and tiles that start off
        // the block grid, so the lookups' pieces have odd row counts).
        let p0 = CpuParams::default();
        let p3 = CpuParams {
            splits: 3,
            tile_tokens: 48,
            ..p0
        };
        let isas = |p: CpuParams| [p, CpuParams { avx512: false, ..p }, CpuParams { scalar: true, ..p }];
        for p in isas(p0).into_iter().chain(isas(p3)) {
            let got = CpuBackend::new(p).unwrap().decode(&caches[0], &seqs, &q, attn).unwrap();
            for (b, n) in lens.iter().enumerate() {
                let (w, g) = (&want[b * per..(b + 1) * per], &got[b * per..(b + 1) * per]);
                let vmean = views[b].1.iter().map(|x| x.abs()).sum::<f32>() / views[b].1.len() as f32;
                let scale = w.iter().fold(0f32, |m, x| m.max(x.abs())).max(vmean).max(1e-30);
                let err = w.iter().zip(g).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
                assert!(
                    err <= 1e-5 * scale,
                    "{} {heads} len {n} {}: {err:e} vs max |ref| {scale:e}",
                    s.name,
                    p.name()
                );
            }
        }
    }
}

/// A shared codebook is one entry for every layer (and both tensors that
/// name it): caches of different layers decode with the same table.
#[test]
fn a_named_codebook_is_shared_across_layers() {
    let s = parse_scheme(VQ[2]).unwrap().with_shape(Heads::Mqa(2), 32).unwrap();
    let cal = calibrate(&s, Heads::Mqa(2), 32, 3, 11);
    assert_eq!(cal.entries().len(), 1);
    assert_eq!(cal.entries()[0].layer, 0);
    assert!(cal.entries()[0].fit.contains("shared=c"));
    let a = PagedCache::with_calibration(s.clone(), CacheConfig::for_tokens(64), &cal, 0).unwrap();
    let b = PagedCache::with_calibration(s.clone(), CacheConfig::for_tokens(64), &cal, 2).unwrap();
    assert_eq!(a.vq_book(Tensor::Key), b.vq_book(Tensor::Value));
    assert_eq!(a.codebook_bytes(), 32 * 1024 * 4);
    // What a model sums once across its layers.
    assert_eq!(a.shared_codebooks(), vec![("c".to_string(), 32 * 1024 * 4)]);
    let per_layer = parse_scheme(VQ[0]).unwrap().with_shape(Heads::Mqa(2), 32).unwrap();
    let cal = calibrate(&per_layer, Heads::Mqa(2), 32, 1, 12);
    let c = PagedCache::with_calibration(per_layer, CacheConfig::for_tokens(64), &cal, 0).unwrap();
    assert!(c.shared_codebooks().is_empty());
}
