//! Calibrated codebooks (`levels = nuq`) on keys stored before RoPE
//! (`rope: pre(...)`, KVQuant's recipe):
//!
//! - the key codebook of a pre-RoPE scheme is fitted on the samples'
//!   pre-RoPE keys and recorded as such (it equals the codebook a
//!   post-RoPE twin fits on the same keys, and differs from the one fitted
//!   on the post-RoPE keys); samples without pre-RoPE keys are an error;
//! - a codebook fitted at the other stage is a typed [`CalibError::Stage`]
//!   (both ways), never a silently wrong table;
//! - a weighted pre-RoPE fit depends on the queries only through the norm
//!   of each RoPE pair (turning the queries by any angle per pair leaves it
//!   unchanged; the post-RoPE fit does change);
//! - a calibrated pre-RoPE cache (reference writes and vectorised writes,
//!   streamed and prefilled) stores what the oracle computes with the same
//!   codebook, bit for bit, and the reference backend and the CPU backend
//!   (both RoPE strategies, every instruction set) decode like the oracle
//!   at lengths 1, 31, 33, 127, 1000 on MHA / GQA / MQA, both RoPE bases of
//!   Gemma 3 and both pair conventions; the same for `norm = minmax` keys
//!   (a table over [0, 1] with a zero point per group);
//! - a minmax group codes like uniform levels when its table is the
//!   uniform one, and a minmax fit learns a table in [0, 1] no worse than
//!   the uniform levels on what it was fitted on;
//! - a pinned minmax fit (`norm = minmax_pinned`) keeps its ends at exactly
//!   0 and 1, learns the inner entries (no worse than uniform, other than
//!   the free fit's), is its own calibration entry, and a file whose
//!   pinned table has other ends is refused; the degenerate fits (no
//!   points, points only at the ends, fewer than 2 levels) are handled.

use kivi_runtime::calib::*;
use kivi_runtime::cpu::Isa;
use kivi_runtime::rand::Rng;
use kivi_runtime::reference::{cache_view_calibrated, decode_attention};
use kivi_runtime::*;
use kivi_spec::{parse_scheme, Heads, Rope, RopeStyle, Scheme, Tensor};

mod calib_util;
use calib_util::kv;

const LENS: [usize; 5] = [1, 31, 33, 127, 1000];

/// Pre-RoPE keys on both axes, nuq or uniform values, sinks; channel-axis
/// nuq keys of 2, 4 (16 entries: two permutes and a blend on AVX2) and 1
/// bits, both pair styles, which the CPU backend's vector path decodes.
const SCHEMES: [&str; 4] = [
    "pre_ck { key: quant(bits = 2, axis = channel, group = 32, levels = nuq),
              value: quant(bits = 2, axis = token, group = 32, levels = nuq, norm = l2),
              residual: 16, sinks: 4, rope: pre(theta = 10000, style = half) }",
    "pre_tk { key: quant(bits = 3, axis = token, group = 16, levels = nuq, norm = l2),
              value: quant(bits = 2, axis = token, group = 32),
              residual: 5, sinks: 2, rope: pre(theta = 1000000, style = interleaved) }",
    "pre_ck4 { key: quant(bits = 4, axis = channel, group = 32, levels = nuq),
              value: quant(bits = 2, axis = token, group = 32),
              residual: 16, sinks: 4, rope: pre(theta = 10000, style = interleaved) }",
    "pre_ck1 { key: quant(bits = 1, axis = channel, group = 32, levels = nuq),
              value: quant(bits = 2, axis = token, group = 32, levels = nuq, norm = l2),
              residual: 16, sinks: 4, rope: pre(theta = 10000, style = half) }",
];

/// Keys with a learned table over [0, 1] and a zero point per group
/// (`norm = minmax`), KVQuant's per-channel offset before the table; only
/// pre-RoPE channel-axis keys take it (validation).
const MINMAX: &str = "pre_mm { key: quant(bits = 2, axis = channel, group = 32, levels = nuq, norm = minmax),
              value: quant(bits = 1, axis = token, group = 32, levels = nuq, norm = l2),
              residual: 16, sinks: 4, rope: pre(theta = 10000, style = half) }";

/// `MINMAX` with the table's ends pinned at 0 and 1 (`norm =
/// minmax_pinned`): stored and decoded like `MINMAX`, fitted with only the
/// inner entries free.
const PINNED: &str = "pre_mp { key: quant(bits = 2, axis = channel, group = 32, levels = nuq, norm = minmax_pinned),
              value: quant(bits = 1, axis = token, group = 32, levels = nuq, norm = l2),
              residual: 16, sinks: 4, rope: pre(theta = 10000, style = half) }";

/// `PINNED` with two key outliers per token (stored before RoPE, added to
/// the decoded pre-RoPE row before it turns): off the vector path. Value
/// outliers too: the vectorised token-axis write once computed their
/// corrections against the empty fixed table of a `nuq` codec (`x - 0`
/// rather than `x - s L[c]`), which this case caught.
const PINNED_O: &str = "pre_mpo { key: quant(bits = 2, axis = channel, group = 32, levels = nuq, norm = minmax_pinned),
              value: quant(bits = 1, axis = token, group = 32, levels = nuq, norm = l2),
              outliers: sparse(per_token = 2, apply = [key, value]),
              residual: 16, sinks: 4, rope: pre(theta = 10000, style = half) }";

fn model(layers: u32, kv: u32, d: u32) -> ModelId {
    ModelId {
        name: "toy".into(),
        layers,
        kv_heads: kv,
        head_dim: d,
    }
}

/// The scheme without `rope`: same quantizer, keys stored after RoPE.
fn post_twin(s: &Scheme) -> Scheme {
    Scheme {
        rope: None,
        ..s.clone()
    }
}

/// `k` (`[T, H, D]`, positions `0..T`) turned by `rope`.
fn apply_rope(rope: &Rope, k: &[f32], h: usize, d: usize) -> Vec<f32> {
    let mut out = k.to_vec();
    for (ri, row) in out.chunks_exact_mut(d).enumerate() {
        let t = ri / h;
        for i in 0..d / 2 {
            let (c, s) = rope.cos_sin(t, i, d);
            let (a, b) = match rope.style {
                RopeStyle::Half => (i, i + d / 2),
                RopeStyle::Interleaved => (2 * i, 2 * i + 1),
            };
            let (x, y) = (row[a], row[b]);
            row[a] = x * c - y * s;
            row[b] = y * c + x * s;
        }
    }
    out
}

/// Samples of `layers` layers: pre-RoPE keys, the same keys turned by the
/// scheme's RoPE as the post-RoPE keys, values, and queries.
fn samples(s: &Scheme, heads: Heads, d: usize, layers: usize, seed: u64) -> Vec<LayerSamples> {
    let (hq, hkv) = (heads.q_heads() as usize, heads.kv_heads() as usize);
    let rope = s.rope.expect("a pre-RoPE scheme");
    let mut rng = Rng::new(seed);
    let t = 96;
    (0..layers)
        .map(|l| {
            let pre = kv(&mut rng, t, hkv, d, true);
            let mut x = LayerSamples::new(
                l,
                t,
                hq,
                hkv,
                d,
                apply_rope(&rope, &pre, hkv, d),
                kv(&mut rng, t, hkv, d, false),
            );
            x.keys_pre_rope = Some(pre);
            x.queries = Some(
                (0..t * hq * d)
                    .map(|i| (1.0 + (i % d) as f32 / 4.0) * rng.normal())
                    .collect(),
            );
            x
        })
        .collect()
}

fn fit(s: &Scheme, xs: &[LayerSamples], weighted: bool) -> Result<Calibration, CalibError> {
    let x = &xs[0];
    let mut c = Calibration::new(
        model(xs.len() as u32, x.kv_heads as u32, x.head_dim as u32),
        "test draws",
    );
    c.fit_codebooks(
        s,
        xs,
        FitOptions {
            weighted,
            ..FitOptions::default()
        },
    )?;
    Ok(c)
}

#[test]
fn pre_rope_key_codebooks_are_fitted_on_pre_rope_keys_and_recorded_so() {
    let heads = Heads::Gqa { q: 4, kv: 2 };
    let s = parse_scheme(SCHEMES[0]).unwrap().with_shape(heads, 32).unwrap();
    let twin = post_twin(&s);
    let xs = samples(&s, heads, 32, 2, 3);
    let cal = fit(&s, &xs, false).unwrap();
    let fk = fit_key(&s, Tensor::Key).unwrap();
    for layer in 0..2 {
        let e = cal
            .get(layer, Tensor::Key, Stage::PreRope, Kind::Codebook, &fk)
            .unwrap();
        assert!(cal
            .get(layer, Tensor::Key, Stage::PostRope, Kind::Codebook, &fk)
            .is_none());
        // Values have no RoPE: their codebook is post-RoPE as always.
        let fv = fit_key(&s, Tensor::Value).unwrap();
        assert!(cal
            .get(layer, Tensor::Value, Stage::PostRope, Kind::Codebook, &fv)
            .is_some());
        // The same table as the post-RoPE twin fitted on the pre-RoPE keys,
        // not the one it fits on the post-RoPE keys.
        let as_post: Vec<LayerSamples> = xs
            .iter()
            .map(|x| {
                let mut y = x.clone();
                y.keys = x.keys_pre_rope.clone().unwrap();
                y
            })
            .collect();
        let on_pre = fit(&twin, &as_post, false)
            .unwrap()
            .codebook(&twin, Tensor::Key, layer)
            .unwrap();
        let on_post = fit(&twin, &xs, false)
            .unwrap()
            .codebook(&twin, Tensor::Key, layer)
            .unwrap();
        assert_eq!(e.data, on_pre, "layer {layer}");
        assert_ne!(e.data, on_post, "layer {layer}");
        assert_eq!(cal.codebook(&s, Tensor::Key, layer).unwrap(), on_pre);
    }
    // The stage survives the file.
    let back = Calibration::from_bytes(&cal.to_bytes()).unwrap();
    assert_eq!(back, cal);
    assert_eq!(
        back.codebook(&s, Tensor::Key, 1).unwrap(),
        cal.codebook(&s, Tensor::Key, 1).unwrap()
    );
    // Samples without pre-RoPE keys cannot fit a pre-RoPE scheme.
    let mut bare = xs.clone();
    bare[1].keys_pre_rope = None;
    let e = fit(&s, &bare, false).unwrap_err();
    assert!(
        matches!(e, CalibError::Samples(_)) && e.to_string().contains("no pre-RoPE keys"),
        "{e}"
    );
}

#[test]
fn a_codebook_of_the_other_stage_is_a_typed_error() {
    let heads = Heads::Mqa(2);
    let s = parse_scheme(SCHEMES[0]).unwrap().with_shape(heads, 32).unwrap();
    let twin = post_twin(&s);
    let xs = samples(&s, heads, 32, 1, 4);
    let post_cal = fit(&twin, &xs, false).unwrap();
    let pre_cal = fit(&s, &xs, false).unwrap();
    for (scheme, cal, wanted, found) in [
        (&s, &post_cal, Stage::PreRope, Stage::PostRope),
        (&twin, &pre_cal, Stage::PostRope, Stage::PreRope),
    ] {
        let e = cal.codebook(scheme, Tensor::Key, 0).unwrap_err();
        assert!(
            matches!(&e, CalibError::Stage { wanted: w, found: f, layer: 0, .. } if *w == wanted && *f == found),
            "{e:?}"
        );
        assert!(e.to_string().contains(&format!("{wanted} keys")), "{e}");
        let e = PagedCache::with_calibration(scheme.clone(), CacheConfig::for_tokens(64), cal, 0)
            .err()
            .unwrap();
        assert!(
            matches!(&e, Error::Calibration(c) if matches!(**c, CalibError::Stage { .. })),
            "{e}"
        );
        assert!(cache_view_calibrated(scheme, Tensor::Key, &xs[0].keys, cal, 0).is_err());
        // Values carry no stage: their codebook serves both.
        assert!(cal.codebook(scheme, Tensor::Value, 0).is_ok());
    }
}

#[test]
fn weighted_pre_rope_fits_see_only_the_norm_of_each_query_pair() {
    for text in SCHEMES {
        let heads = Heads::Gqa { q: 4, kv: 2 };
        let s = parse_scheme(text).unwrap().with_shape(heads, 32).unwrap();
        let rope = s.rope.unwrap();
        let xs = samples(&s, heads, 32, 1, 5);
        // The queries turned by another RoPE (a far-off position per
        // token): every pair keeps its norm, the channels do not.
        let other = Rope { theta: 7.0, ..rope };
        let mut turned = xs.clone();
        let q = turned[0].queries.take().unwrap();
        let q: Vec<f32> = q
            .iter()
            .enumerate()
            .map(|(i, x)| x * (1.0 + (i / 32 % 3) as f32))
            .collect();
        turned[0].queries = Some(apply_rope(&other, &q, 1, 32));
        let mut scaled = xs.clone();
        scaled[0].queries = Some(q);
        let a = fit(&s, &scaled, true).unwrap().codebook(&s, Tensor::Key, 0).unwrap();
        let b = fit(&s, &turned, true).unwrap().codebook(&s, Tensor::Key, 0).unwrap();
        let plain = fit(&s, &scaled, false).unwrap().codebook(&s, Tensor::Key, 0).unwrap();
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() <= 1e-4 * x.abs().max(1.0), "{}: {a:?} vs {b:?}", s.name);
        }
        assert_ne!(a, plain, "{}: weighting changed nothing", s.name);
        // The post-RoPE twin weights channels one by one: the turn shows.
        let twin = post_twin(&s);
        let a = fit(&twin, &scaled, true)
            .unwrap()
            .codebook(&twin, Tensor::Key, 0)
            .unwrap();
        let b = fit(&twin, &turned, true)
            .unwrap()
            .codebook(&twin, Tensor::Key, 0)
            .unwrap();
        let moved = a.iter().zip(&b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(moved > 1e-3, "{}: post-RoPE weights ignored the channels", s.name);
    }
}

fn layouts() -> [Heads; 3] {
    [Heads::Mha(2), Heads::Gqa { q: 8, kv: 2 }, Heads::Mqa(4)]
}

/// Cache (reference and vectorised writes, streamed and prefilled) against
/// the oracle with the same codebooks, bit for bit; then the reference and
/// CPU backends against oracle attention over those views.
#[test]
fn calibrated_pre_rope_caches_match_the_oracle_odd_lengths_and_layouts() {
    let d = 32;
    let mut case = 0u64;
    for text in SCHEMES.into_iter().chain([MINMAX, PINNED, PINNED_O]) {
        let s0 = parse_scheme(text).unwrap();
        for heads in layouts() {
            for theta in [10_000.0, 1_000_000.0] {
                case += 1;
                let mut s = s0.with_shape(heads, d as u32).unwrap();
                let r = s.rope.as_mut().unwrap();
                r.theta = theta;
                kivi_spec::validate(&s).unwrap();
                let hq = heads.q_heads() as usize;
                let cal = fit(&s, &samples(&s, heads, d, 2, 70 + case), true).unwrap();
                let layer = 1;
                let total: usize = LENS.iter().sum();
                let mut rng = Rng::new(80 + case);
                let mut caches: Vec<PagedCache> = [None, Some(Isa::Avx512)]
                    .into_iter()
                    .map(|isa| {
                        let mut c = PagedCache::with_calibration(
                            s.clone(),
                            CacheConfig::for_tokens(total + 64 * LENS.len()),
                            &cal,
                            layer,
                        )
                        .unwrap();
                        c.set_write_isa(isa);
                        c
                    })
                    .collect();
                let (seqs, views) = calib_util::fill_and_check(&mut caches, &s, &cal, layer, &LENS, &mut rng, &heads);
                assert_eq!(caches[0].pool(), caches[1].pool());
                let q: Vec<f32> = (0..LENS.len() * hq * d).map(|_| 2.0 * rng.f32() - 1.0).collect();
                let attn = AttnParams::of(&s, s.shape().unwrap());
                let per = hq * d;
                let want: Vec<f32> = views
                    .iter()
                    .enumerate()
                    .flat_map(|(b, (kw, vw))| decode_attention(&s, &q[b * per..(b + 1) * per], kw, vw, attn).unwrap())
                    .collect();
                let check = |got: &[f32], what: &str| {
                    for (b, n) in LENS.iter().enumerate() {
                        let (w, g) = (&want[b * per..(b + 1) * per], &got[b * per..(b + 1) * per]);
                        // Judged against max |ref|, or the mean |v| where the
                        // weighted sum cancels to less (as tests/calib.rs).
                        let vmean = views[b].1.iter().map(|x| x.abs()).sum::<f32>() / views[b].1.len() as f32;
                        let scale = w.iter().fold(0f32, |m, x| m.max(x.abs())).max(vmean).max(1e-30);
                        let err = w.iter().zip(g).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
                        assert!(
                            err <= 1e-5 * scale,
                            "{} theta {theta} {heads} len {n} {what}: {err:e} vs {scale:e}",
                            s.name
                        );
                    }
                };
                check(
                    &ReferenceBackend.decode(&caches[0], &seqs, &q, attn).unwrap(),
                    "reference backend",
                );
                let p0 = CpuParams::default();
                for p in [
                    p0,
                    CpuParams { avx512: false, ..p0 },
                    CpuParams {
                        scalar: true,
                        splits: 3,
                        tile_tokens: 16,
                        ..p0
                    },
                ] {
                    let b = CpuBackend::new(p).unwrap();
                    assert!(
                        b.kernel_path(&caches[0]).ends_with("+rope"),
                        "{}",
                        b.kernel_path(&caches[0])
                    );
                    // Channel-axis table keys take the vector decode
                    // (unless key outliers need the group-wise decode).
                    if s.key.quant().is_some_and(|q| q.axis == kivi_spec::Axis::Channel)
                        && !p.scalar
                        && s.outliers_of(Tensor::Key) == 0
                    {
                        assert!(
                            b.kernel_path(&caches[0]).ends_with("vec+rope"),
                            "{}: {}",
                            s.name,
                            b.kernel_path(&caches[0])
                        );
                    }
                    for rotate_query in [false, true] {
                        kivi_runtime::cpu::set_rope_strategy(rotate_query);
                        let got = b.decode(&caches[0], &seqs, &q, attn);
                        kivi_runtime::cpu::set_rope_strategy(false);
                        check(
                            &got.unwrap(),
                            &format!("cpu {} ({}) query={rotate_query}", p.name(), p.isa(d).name()),
                        );
                    }
                }
            }
        }
    }
}

/// The oracle's minmax group: with the uniform table `c / (2^b - 1)` it
/// decodes what uniform levels decode, up to the rounding of one f16 scale
/// (`s = hi - lo` against `(hi - lo) / 3`); a constant group decodes
/// exactly; the stored parameters are uniform levels' zero and span.
#[test]
fn minmax_groups_code_like_uniform_levels_with_the_uniform_table() {
    use kivi_runtime::quant::{dequantize_in, minmax_group_in, quantize_group_in};
    let s = parse_scheme(MINMAX).unwrap();
    let q = *s.key.quant().unwrap();
    let u = kivi_spec::Quant {
        levels: kivi_spec::Levels::Uniform,
        ..q
    };
    let table = [0.0, 1.0 / 3.0, 2.0 / 3.0, 1.0];
    let mut rng = Rng::new(3);
    for n in [1usize, 31, 33, 127] {
        let x: Vec<f32> = (0..n).map(|_| 5.0 + 3.0 * rng.normal()).collect();
        let (mut cm, mut cu) = (vec![0u32; n], vec![0u32; n]);
        let (pm, lo, hi) = quantize_group_in(&x, &q, &table, &mut cm);
        let (pu, _, _) = quantize_group_in(&x, &u, &[], &mut cu);
        assert_eq!(pm.zero, pu.zero, "len {n}");
        assert_eq!(minmax_group_in(&x, &q, &table, &mut vec![0; n]).0, pm);
        let tol = 2e-3 * (hi - lo) + 1e-6;
        for i in 0..n {
            let a = dequantize_in(cm[i], pm, &q, &table);
            let b = dequantize_in(cu[i], pu, &u, &[]);
            assert!((a - b).abs() <= tol, "len {n} [{i}]: {a} vs {b}");
            // Nearest level: no decode is further from x than half a step
            // (plus the roundings, the f16 zero point's included).
            let zr = x[i].abs() * 2f32.powi(-10);
            assert!(
                (a - x[i]).abs() <= (hi - lo) / 6.0 + tol + zr,
                "len {n} [{i}]: {a} vs {}",
                x[i]
            );
        }
    }
    let c = vec![1.25f32; 7];
    let mut codes = vec![9u32; 7];
    let (p, _, _) = quantize_group_in(&c, &q, &table, &mut codes);
    assert_eq!((p.scale, codes), (0.0, vec![0; 7]));
    assert_eq!(dequantize_in(0, p, &q, &table), 1.25);
}

/// A minmax key fit learns an ascending table inside [0, 1] that is at
/// least as good as the uniform levels it replaces on its own samples
/// (the report's comparison), and differs from them on keys with a
/// Gaussian spread inside each group.
#[test]
fn minmax_fits_learn_a_table_in_the_unit_interval() {
    let heads = Heads::Gqa { q: 4, kv: 2 };
    let s = parse_scheme(MINMAX).unwrap().with_shape(heads, 32).unwrap();
    let xs = samples(&s, heads, 32, 1, 9);
    for weighted in [false, true] {
        let mut c = Calibration::new(model(1, 2, 32), "test draws");
        let reports = c
            .fit_codebooks(
                &s,
                &xs,
                FitOptions {
                    weighted,
                    ..FitOptions::default()
                },
            )
            .unwrap();
        let t = c.codebook(&s, Tensor::Key, 0).unwrap();
        assert_eq!(t.len(), 4);
        assert!(t.windows(2).all(|w| w[0] <= w[1]), "{t:?}");
        assert!(t.iter().all(|x| (0.0..=1.0).contains(x)), "{t:?}");
        let r = reports.iter().find(|r| r.tensor == Tensor::Key).unwrap();
        assert!(
            r.mse <= r.mse_lloyd_max,
            "{weighted}: {} vs uniform {}",
            r.mse,
            r.mse_lloyd_max
        );
        assert!(
            r.mse < 0.95 * r.mse_lloyd_max,
            "{weighted}: a Gaussian group gains little? {t:?}"
        );
    }
}

/// A pinned minmax fit: ends exactly 0.0 and 1.0, inner entries learned
/// (ascending, inside (0, 1), not the uniform ones on Gaussian groups),
/// weighted error no worse than uniform levels and no better than the
/// free fit (the same Lloyd steps with two entries fewer free); both fits
/// live side by side in one calibration under their own fit keys.
#[test]
fn pinned_minmax_fits_keep_exact_ends_and_learn_the_inner_levels() {
    let heads = Heads::Gqa { q: 4, kv: 2 };
    let pinned = parse_scheme(PINNED).unwrap().with_shape(heads, 32).unwrap();
    let free = parse_scheme(MINMAX).unwrap().with_shape(heads, 32).unwrap();
    assert_ne!(fit_key(&pinned, Tensor::Key), fit_key(&free, Tensor::Key));
    let xs = samples(&pinned, heads, 32, 1, 9);
    for weighted in [false, true] {
        let opts = FitOptions {
            weighted,
            ..FitOptions::default()
        };
        let mut c = Calibration::new(model(1, 2, 32), "test draws");
        let rp = c.fit_codebooks(&pinned, &xs, opts).unwrap();
        let rf = c.fit_codebooks(&free, &xs, opts).unwrap();
        let t = c.codebook(&pinned, Tensor::Key, 0).unwrap();
        let tf = c.codebook(&free, Tensor::Key, 0).unwrap();
        assert_eq!(t.len(), 4);
        assert_eq!((t[0], t[3]), (0.0, 1.0), "{t:?}");
        assert!(t.windows(2).all(|w| w[0] < w[1]), "{t:?}");
        assert!(
            (t[1] - 1.0 / 3.0).abs() > 1e-3 && (t[2] - 2.0 / 3.0).abs() > 1e-3,
            "inner entries not learned: {t:?}"
        );
        assert!(tf[0] > 0.01 && tf[3] < 0.99, "the free fit pulls its ends in: {tf:?}");
        let key = |r: &[FitReport]| r.iter().find(|r| r.tensor == Tensor::Key).unwrap().clone();
        let (p, f) = (key(&rp), key(&rf));
        assert!(
            p.mse < p.mse_lloyd_max,
            "{weighted}: {} vs uniform {}",
            p.mse,
            p.mse_lloyd_max
        );
        assert_eq!(p.mse_lloyd_max, f.mse_lloyd_max, "the same samples and uniform table");
        assert!(f.mse <= p.mse, "{weighted}: free {} vs pinned {}", f.mse, p.mse);
    }
}

/// The pinned k-means on its own: degenerate inputs (fewer than 2
/// levels: a typed error; no points, or 1 bit: the uniform table; points
/// only at the ends: the inner entries keep their uniform places), and on
/// points clustered inside, ends still exact while the inner entries move
/// to the clusters.
#[test]
fn pinned_kmeans_handles_degenerate_inputs() {
    assert!(matches!(kmeans_1d_pinned(&mut [], 1, 10), Err(CalibError::Samples(_))));
    assert!(matches!(
        kmeans_1d_pinned(&mut [(0.5, 1.0)], 0, 10),
        Err(CalibError::Samples(_))
    ));
    assert_eq!(
        kmeans_1d_pinned(&mut [], 4, 10).unwrap(),
        [0.0, 1.0 / 3.0, 2.0 / 3.0, 1.0]
    );
    assert_eq!(
        kmeans_1d_pinned(&mut [(0.3, 1.0), (0.9, 2.0)], 2, 10).unwrap(),
        [0.0, 1.0]
    );
    let mut ends = vec![(0.0, 1.0), (1.0, 1.0), (0.0, 3.0), (1.0, 0.5)];
    assert_eq!(
        kmeans_1d_pinned(&mut ends, 4, 10).unwrap(),
        [0.0, 1.0 / 3.0, 2.0 / 3.0, 1.0]
    );
    // Two tight clusters inside, plus a little weight at the ends; values
    // a rounding outside [0, 1] (f16 zero points) do not move the ends.
    let mut pts: Vec<(f32, f32)> = (0..200)
        .map(|i| (if i % 2 == 0 { 0.45 } else { 0.55 } + (i % 7) as f32 * 1e-3, 1.0))
        .chain([(-1e-4, 0.1), (1.0001, 0.1)])
        .collect();
    let t = kmeans_1d_pinned(&mut pts, 4, 100).unwrap();
    assert_eq!((t[0], t[3]), (0.0, 1.0), "{t:?}");
    assert!((t[1] - 0.453).abs() < 0.01 && (t[2] - 0.553).abs() < 0.01, "{t:?}");
    assert!(table_mse(&pts, &t) < table_mse(&pts, &[0.0, 1.0 / 3.0, 2.0 / 3.0, 1.0]));
}

/// A calibration file whose entry under a pinned fit key has other ends
/// (hand-edited, or written by another tool) is a typed error, never a
/// table that silently shrinks the groups' extremes.
#[test]
fn a_pinned_codebook_without_exact_ends_is_refused() {
    let heads = Heads::Mqa(2);
    let s = parse_scheme(PINNED).unwrap().with_shape(heads, 32).unwrap();
    let mut c = Calibration::new(model(1, 1, 32), "hand-made");
    c.insert(Entry {
        layer: 0,
        tensor: Tensor::Key,
        stage: Stage::of(&s, Tensor::Key),
        kind: Kind::Codebook,
        fit: fit_key(&s, Tensor::Key).unwrap(),
        shape: vec![4],
        data: vec![0.16, 0.39, 0.6, 0.84],
    })
    .unwrap();
    let e = c.codebook(&s, Tensor::Key, 0).unwrap_err();
    assert!(matches!(e, CalibError::Malformed(_)), "{e}");
    assert!(e.to_string().contains("start at 0 and end at 1"), "{e}");
    assert!(PagedCache::with_calibration(s.clone(), CacheConfig::for_tokens(64), &c, 0).is_err());
}
