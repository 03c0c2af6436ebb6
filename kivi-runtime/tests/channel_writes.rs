//! Channel-axis table keys (`levels = nuq` with every norm, Lloyd–Max)
//! through the vectorised writes (`cpu/write.rs`'s channel pipeline)
//! against the reference path (`quant.rs` group by group), bit for bit:
//! with and without `rope: pre`, key outliers, rotation and centering;
//! MHA/GQA/MQA and a head_dim no 16-lane vector divides; odd lengths
//! through `extend`, `append` and mixed chunks; f16, bf16 and f32
//! activations; every instruction set this CPU has. The codebooks are
//! written here rather than fitted, so that some put decision thresholds
//! exactly on the values the inputs divide to (ties go to the lower level).

mod common;
use common::*;
use kivi_runtime::calib::*;
use kivi_runtime::cpu::Isa;
use kivi_runtime::*;
use kivi_spec::*;

const LENGTHS: [usize; 5] = [1, 31, 33, 127, 1000];

fn isas() -> Vec<Isa> {
    let mut v = vec![Isa::Scalar];
    for isa in [Isa::Avx2, Isa::Avx512] {
        let s = presets::kivi2().with_shape(Heads::Mha(1), 64).unwrap();
        let mut c = PagedCache::new(s, CacheConfig::for_tokens(16)).unwrap();
        c.set_write_isa(Some(isa));
        if c.write_isa() == Some(isa) {
            v.push(isa);
        }
    }
    v
}

/// Everything a reader can see of sequence `id`, as bits (as in
/// `cache_writes.rs`).
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

/// A codebook of `n` levels for `norm`. `ties`: levels whose decision
/// thresholds are short binary fractions (minmax: `k / 2(n-1)`-ish over
/// [0, 1]; rms/l2: the integers, levels at the half-integers), which the
/// tie inputs below hit exactly. Otherwise a random ascending table.
fn table(norm: Norm, n: usize, ties: bool, rng: &mut Rng) -> Vec<f32> {
    let minmax = norm.has_zero();
    let mut t: Vec<f32> = if ties {
        if minmax {
            // 0, 1/8, 2/8, ... then 1: thresholds 1/16, 3/16, ... (2, 4
            // levels: 0, 1/4, 1/2, 1 style).
            let step = if n <= 4 { 0.25 } else { 1.0 / 16.0 };
            (0..n).map(|k| if k == n - 1 { 1.0 } else { k as f32 * step }).collect()
        } else {
            (0..n).map(|k| k as f32 - (n as f32 - 1.0) / 2.0).collect()
        }
    } else {
        let mut v: Vec<f32> = (0..n)
            .map(|_| if minmax { rng.f32().abs() } else { 2.0 * rng.f32() })
            .collect();
        v.sort_by(f32::total_cmp);
        v.dedup();
        while v.len() < n {
            let last = *v.last().unwrap();
            v.push(last + 0.125);
        }
        v
    };
    if norm == Norm::MinMaxPinned {
        // A pinned table starts at 0 and ends at 1.
        let (lo, hi) = (t[0], t[n - 1]);
        for x in t.iter_mut() {
            *x = (*x - lo) / (hi - lo);
        }
        t[0] = 0.0;
        t[n - 1] = 1.0;
    }
    t
}

/// A cache of `s` with written codebooks for its `nuq` tensors.
fn cache(s: &Scheme, ties: bool, isa: Option<Isa>, tokens: usize, seed: u64) -> PagedCache {
    let shape = s.shape().unwrap();
    let mut cal = Calibration::new(
        ModelId {
            name: "test".into(),
            layers: 1,
            kv_heads: shape.kv_heads as u32,
            head_dim: shape.head_dim as u32,
        },
        "written by the test",
    );
    let mut rng = Rng::new(seed);
    for t in [Tensor::Key, Tensor::Value] {
        let Some(fit) = fit_key(s, t) else { continue };
        let q = s.codec(t).quant().unwrap();
        let n = 1usize << q.bits;
        let data = table(q.levels.norm().unwrap_or(Norm::Rms), n, ties, &mut rng);
        cal.insert(Entry {
            layer: 0,
            tensor: t,
            stage: Stage::of(s, t),
            kind: Kind::Codebook,
            fit,
            shape: vec![n as u32],
            data,
        })
        .unwrap();
    }
    let config = CacheConfig::for_tokens(tokens + 64);
    let mut c = if fit_key(s, Tensor::Key).is_some() || fit_key(s, Tensor::Value).is_some() {
        PagedCache::with_calibration(s.clone(), config, &cal, 0).unwrap()
    } else {
        PagedCache::new(s.clone(), config).unwrap()
    };
    c.set_write_isa(isa);
    c
}

const KEYS: [&str; 6] = [
    "quant(bits = 2, axis = channel, group = 16, levels = nuq, norm = minmax)",
    "quant(bits = 2, axis = channel, group = 32, levels = nuq, norm = minmax_pinned)",
    "quant(bits = 3, axis = channel, group = 16, levels = nuq)",
    "quant(bits = 4, axis = channel, group = 16, levels = nuq, norm = l2)",
    "quant(bits = 2, axis = channel, group = 16, levels = lloyd_max)",
    "quant(bits = 3, axis = channel, group = 8, levels = lloyd_max, norm = l2, scale = f32)",
];

const EXTRAS: [&str; 5] = [
    "",
    "rope: pre(theta = 10000, style = half),",
    "outliers: sparse(per_token = 2, apply = [key]),",
    "rope: pre(theta = 10000, style = interleaved), outliers: sparse(per_token = 3, apply = [key, value]),",
    "rotation: hadamard(block = 8, apply = [key]), center: channel_mean(tokens = 6, apply = [key]),",
];

const VALUES: [&str; 3] = [
    "quant(bits = 2, axis = token, group = 8)",
    "quant(bits = 1, axis = token, group = 8, levels = nuq, norm = l2)",
    "full",
];

/// Every (key, extra) pair, the values, dtype, residual and sinks varied
/// with them. `norm = minmax` keys need `rope: pre(...)` (the other kernels
/// store no zero point for table codes): they get it where the extra has
/// none. Pairs the language refuses otherwise are counted, and few may be.
fn schemes() -> Vec<Scheme> {
    let mut v = Vec::new();
    let mut refused = Vec::new();
    for (i, key) in KEYS.iter().enumerate() {
        for (j, extra) in EXTRAS.iter().enumerate() {
            let n = i * EXTRAS.len() + j;
            let value = VALUES[n % VALUES.len()];
            let dtype = ["f16", "bf16", "f32"][(n / 2) % 3];
            let (residual, sinks) = [(16, 0), (5, 3), (40, 1)][n % 3];
            let rope = if key.contains("minmax") && !extra.contains("rope") {
                "rope: pre(theta = 500000, style = interleaved),"
            } else {
                ""
            };
            let text = format!(
                "k{i}_{j} {{ key: {key}, value: {value}, {extra} {rope} residual: {residual}, sinks: {sinks}, dtype: {dtype} }}"
            );
            match parse_scheme(&text) {
                Ok(s) => v.push(s),
                Err(e) => refused.push(format!("{text}: {e}")),
            }
        }
    }
    assert!(refused.len() <= 4, "{refused:#?}");
    v
}

fn shapes() -> [(Heads, u32); 4] {
    [
        (Heads::Mha(2), 64),
        (Heads::Gqa { q: 8, kv: 2 }, 128),
        (Heads::Mqa(4), 256),
        (Heads::Gqa { q: 6, kv: 3 }, 40),
    ]
}

/// Fills a cache of `s` with `k`/`v` by `sizes` (1: an `append`), on
/// `isa` (`None`: the reference path), and returns what a reader sees.
fn fill(s: &Scheme, ties: bool, isa: Option<Isa>, k: &[f32], v: &[f32], sizes: &[usize]) -> Vec<u32> {
    let row = s.shape().unwrap().kv_heads * s.shape().unwrap().head_dim;
    let n = k.len() / row;
    let mut c = cache(s, ties, isa, n, 0x7ab1e);
    let id = c.add_sequence();
    let mut at = 0;
    for &m in sizes {
        let (kk, vv) = (&k[at * row..(at + m) * row], &v[at * row..(at + m) * row]);
        if m == 1 {
            c.append(id, kk, vv).unwrap();
        } else {
            c.extend(id, kk, vv).unwrap();
        }
        at += m;
    }
    // The vectorised writes ran (they did not decline).
    assert_eq!(c.last_write_path(), isa.and(c.write_isa()), "{}", s.name);
    state(&c, id)
}

#[test]
fn channel_table_keys_equal_the_reference_bit_for_bit() {
    let isas = isas();
    let mut rng = Rng::new(0xc4a7);
    let (mut cases, mut fills) = (0, 0);
    for (si, s) in schemes().into_iter().enumerate() {
        // Two layouts a scheme (rotating through all four), the GQA 6:3
        // d40 one (no 16-lane rows) for every fourth.
        let all = shapes();
        let picked = [all[si % 3], if si % 4 == 0 { all[3] } else { all[(si + 1) % 3] }];
        for (heads, d) in picked {
            let s = s.clone().with_shape(heads, d).unwrap();
            let shape = s.shape().unwrap();
            let row = shape.kv_heads * shape.head_dim;
            for n in LENGTHS {
                let k = rng.kv(n, shape.kv_heads, shape.head_dim, true);
                let v = rng.kv(n, shape.kv_heads, shape.head_dim, false);
                let mut chunks = Vec::new();
                let mut left = n;
                while left > 0 {
                    let c = (1 + rng.below(70)).min(left);
                    chunks.push(c);
                    left -= c;
                }
                let mut modes: Vec<(&str, Vec<usize>)> = vec![("extend", vec![n]), ("chunks", chunks)];
                // One token a call: up to 127 (1000 appends on three paths
                // of every scheme would be most of the suite's time).
                if n <= 127 {
                    modes.push(("append", vec![1; n]));
                }
                for (mode, sizes) in modes {
                    // Tie tables (on random inputs) every other fill.
                    fills += 1;
                    let ties = fills % 2 == 1;
                    let want = fill(&s, ties, None, &k, &v, &sizes);
                    for &isa in &isas {
                        let got = fill(&s, ties, Some(isa), &k, &v, &sizes);
                        assert!(
                            got == want,
                            "{mode}: {} {heads:?} d{d} n{n} {} (row {row})",
                            s.name,
                            isa.name()
                        );
                        cases += 1;
                    }
                }
            }
        }
    }
    assert!(cases > 400, "only {cases} cases ran");
}

/// Inputs that divide exactly onto the decision thresholds of the tie
/// tables: per channel group, minmax channels spanning exactly [0, 1]
/// (so `(x - z) / s` is `x`) with members on every threshold; rms/l2
/// channels of `±a` (the norm is `a`, `x / a` is ±1, a threshold) or all
/// zeros (`y = 0`, another threshold); constant channels (`s = 0`: code 0
/// for minmax); and zeros of either sign at the ends. A tie must go to the
/// lower level on every path.
#[test]
fn ties_and_boundaries_match() {
    let isas = isas();
    let mut rng = Rng::new(0x71e5);
    let mut cases = 0;
    for s in schemes() {
        // Without outliers and transforms: those move the values off the
        // thresholds (they run in the test above).
        if s.outliers_of(Tensor::Key) > 0 || s.rotation_of(Tensor::Key).is_some() || s.center_of(Tensor::Key).is_some()
        {
            continue;
        }
        let q = *s.codec(Tensor::Key).quant().unwrap();
        let levels = 1usize << q.bits;
        let minmax = q.has_zeros();
        for (heads, d) in [(Heads::Gqa { q: 4, kv: 2 }, 64), (Heads::Mqa(2), 256)] {
            let s = s.clone().with_shape(heads, d).unwrap();
            let shape = s.shape().unwrap();
            let (h, d) = (shape.kv_heads, shape.head_dim);
            let row = h * d;
            let n = 161;
            let g = q.group as usize;
            // The thresholds of the tie table, as the inputs see them.
            let t = table(q.levels.norm().unwrap_or(Norm::Rms), levels, true, &mut rng);
            let thresholds: Vec<f32> = t.windows(2).map(|w| (w[0] + w[1]) * 0.5).collect();
            let mut k = vec![0f32; n * row];
            for tok in 0..n {
                let m = tok % g;
                for hh in 0..h {
                    for c in 0..d {
                        let kind = (c + 3 * hh) % 7;
                        let a = [1.0f32, 0.5, 2.0, 0.25][c % 4];
                        let pick = thresholds[rng.below(thresholds.len())];
                        k[(tok * h + hh) * d + c] = match (minmax, kind) {
                            // Constant channels.
                            (_, 0) => 0.75,
                            // Zeros of either sign (an end of the group).
                            (_, 1) => [0.0, -0.0][rng.below(2)] * if m == 0 { 1.0 } else { 0.0 },
                            (true, 2) => -[0.0, -0.0][m % 2],
                            (true, _) => match m {
                                0 => 0.0,
                                1 => 1.0,
                                _ => pick,
                            },
                            // rms/l2: a channel of ±a, a tie in every member.
                            (false, _) => a * [1.0, -1.0][rng.below(2)],
                        };
                    }
                }
            }
            let v = rng.kv(n, h, d, false);
            for dtype in [Dtype::F16, Dtype::Bf16, Dtype::F32] {
                let s = Scheme { dtype, ..s.clone() };
                for sizes in [vec![n], vec![1; n], vec![37, 1, 64, 59]] {
                    let want = fill(&s, true, None, &k, &v, &sizes);
                    for &isa in &isas {
                        assert!(
                            fill(&s, true, Some(isa), &k, &v, &sizes) == want,
                            "{} {heads:?} {dtype:?} {} sizes {}",
                            s.name,
                            isa.name(),
                            sizes.len()
                        );
                        cases += 1;
                    }
                }
            }
        }
    }
    assert!(cases > 100, "only {cases} cases ran");
}

/// Bad input (NaN, infinities, values a group cannot store) in a channel
/// table key write: the reference path's error, nothing changed.
#[test]
fn bad_input_same_error_nothing_changed() {
    let mut rng = Rng::new(0xbad5);
    let bad = [f32::NAN, f32::INFINITY, 65520.0, -1e6, 3e38];
    for s in schemes().into_iter().step_by(4) {
        let s = s.with_shape(Heads::Gqa { q: 8, kv: 2 }, 128).unwrap();
        let shape = s.shape().unwrap();
        let row = shape.kv_heads * shape.head_dim;
        let k = rng.kv(100, shape.kv_heads, shape.head_dim, true);
        let v = rng.kv(100, shape.kv_heads, shape.head_dim, false);
        for isa in isas() {
            let mut c = cache(&s, false, Some(isa), 400, 1);
            let mut r = cache(&s, false, None, 400, 1);
            let (id, rid) = (c.add_sequence(), r.add_sequence());
            c.extend(id, &k, &v).unwrap();
            r.extend(rid, &k, &v).unwrap();
            for (i, &x) in bad.iter().enumerate() {
                let n = 1 + (i * 13) % 40;
                let mut kb = rng.kv(n, shape.kv_heads, shape.head_dim, true);
                let vb = rng.kv(n, shape.kv_heads, shape.head_dim, false);
                kb[rng.below(n * row)] = x;
                let before = state(&c, id);
                let got = c.extend(id, &kb, &vb);
                let want = r.extend(rid, &kb, &vb);
                let what = format!("{} {} {x}", s.name, isa.name());
                assert_eq!(format!("{got:?}"), format!("{want:?}"), "{what}");
                if got.is_err() {
                    assert!(state(&c, id) == before, "changed on error: {what}");
                }
                assert!(state(&c, id) == state(&r, rid), "{what}");
            }
        }
    }
}
