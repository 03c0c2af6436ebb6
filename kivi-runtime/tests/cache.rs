//! The paged cache against the oracle: streaming equals prefill bit for
//! bit, the dequantized view equals `reference::cache_view`, blocks are
//! reused without leaking, memory is accounted exactly, and bad input
//! changes nothing.

mod common;
use common::*;
use kivi_runtime::quant::{group_params, round_to_dtype};
use kivi_runtime::*;
use kivi_spec::layout::regions;
use kivi_spec::*;

fn bound(s: &Scheme, heads: Heads, d: u32) -> Option<Scheme> {
    s.with_shape(heads, d).ok()
}

/// Fills one sequence in random chunks (streaming when every chunk is 1).
fn fill(c: &mut PagedCache, k: &[f32], v: &[f32], row: usize, rng: &mut Rng, max_chunk: usize) -> SeqId {
    let id = c.add_sequence();
    let t = k.len() / row;
    let mut at = 0;
    while at < t {
        let n = (1 + rng.below(max_chunk)).min(t - at);
        c.extend(id, &k[at * row..(at + n) * row], &v[at * row..(at + n) * row])
            .unwrap();
        at += n;
    }
    id
}

#[test]
fn streaming_equals_prefill_bit_for_bit_random_lengths() {
    stream_prefill_oracle(schemes(), 60);
}

#[test]
fn codec_pipelines_stream_equals_prefill_and_the_oracle() {
    stream_prefill_oracle(codec_schemes(), 50);
}

fn stream_prefill_oracle(all: Vec<Scheme>, min_cases: usize) {
    let mut rng = Rng::new(0x5eed);
    let mut cases = 0;
    for s in all {
        for (heads, d) in layouts() {
            let Some(s) = bound(&s, heads, d) else { continue };
            let shape = s.shape().unwrap();
            let row = shape.kv_heads * shape.head_dim;
            for _ in 0..3 {
                let t = 1 + rng.below(300);
                let k = rng.kv(t, shape.kv_heads, shape.head_dim, true);
                let v = rng.kv(t, shape.kv_heads, shape.head_dim, false);
                let mut a = PagedCache::new(s.clone(), CacheConfig::for_tokens(2000)).unwrap();
                let mut b = PagedCache::new(s.clone(), CacheConfig::for_tokens(2000)).unwrap();
                let sa = fill(&mut a, &k, &v, row, &mut rng, 1);
                let sb = b.add_sequence();
                b.extend(sb, &k, &v).unwrap();
                let mut cm = PagedCache::new(s.clone(), CacheConfig::for_tokens(2000)).unwrap();
                let sc = fill(&mut cm, &k, &v, row, &mut rng, 70);
                for t_ in [Tensor::Key, Tensor::Value] {
                    let want = reference::cache_view(&s, t_, if t_ == Tensor::Key { &k } else { &v }).unwrap();
                    let got_a = a.dequantize(sa, t_).unwrap();
                    let got_b = b.dequantize(sb, t_).unwrap();
                    let got_c = cm.dequantize(sc, t_).unwrap();
                    assert!(
                        got_a.iter().zip(&want).all(|(x, y)| x.to_bits() == y.to_bits()),
                        "{} {:?} t={t} stream",
                        s.name,
                        t_
                    );
                    assert!(
                        got_b.iter().zip(&want).all(|(x, y)| x.to_bits() == y.to_bits()),
                        "{} {:?} t={t} prefill",
                        s.name,
                        t_
                    );
                    assert!(
                        got_c.iter().zip(&want).all(|(x, y)| x.to_bits() == y.to_bits()),
                        "{} {:?} t={t} chunks",
                        s.name,
                        t_
                    );
                }
                // Same allocation order, so the very words must agree.
                let (va, vb) = (a.view(sa).unwrap(), b.view(sb).unwrap());
                assert_eq!(va.table(), vb.table());
                for &blk in va.table() {
                    for h in 0..shape.kv_heads {
                        for t_ in [Tensor::Key, Tensor::Value] {
                            assert_eq!(va.block_part(blk, h, t_), vb.block_part(blk, h, t_), "{} t={t}", s.name);
                        }
                    }
                }
                assert_eq!(a.memory(), b.memory());
                cases += 1;
            }
        }
    }
    assert!(cases > min_cases, "only {cases} cases ran");
}

#[test]
fn quantized_elements_within_half_step_plus_parameter_rounding() {
    let mut rng = Rng::new(42);
    for s in schemes() {
        let Some(s) = bound(&s, Heads::Gqa { q: 4, kv: 2 }, 64) else {
            continue;
        };
        let (h, d) = (2, 64);
        let t = 250;
        let k = rng.kv(t, h, d, true);
        let view = reference::cache_view(&s, Tensor::Key, &k).unwrap();
        let Codec::Quant(q) = s.key else { continue };
        let r = regions(&s, Tensor::Key, t);
        let x: Vec<f32> = k.iter().map(|v| round_to_dtype(*v, s.dtype)).collect();
        let at = |tok: usize, hh: usize, c: usize| (tok * h + hh) * d + c;
        let mut checked = 0;
        for tok in r.sinks..r.sinks + r.quantized {
            for hh in 0..h {
                for c in 0..d {
                    let members: Vec<f32> = match q.axis {
                        Axis::Channel => {
                            let g0 = r.sinks + (tok - r.sinks) / q.group as usize * q.group as usize;
                            (g0..g0 + q.group as usize).map(|u| x[at(u, hh, c)]).collect()
                        }
                        Axis::Token => {
                            let c0 = c / q.group as usize * q.group as usize;
                            (c0..c0 + q.group as usize).map(|u| x[at(tok, hh, u)]).collect()
                        }
                    };
                    let (p, lo, hi) = group_params(members, &q);
                    let exact_scale = (hi - lo) / q.max_code() as f32;
                    let bound = p.scale / 2.0
                        + (p.zero - lo).abs()
                        + q.max_code() as f32 * (p.scale - exact_scale).abs()
                        + 4.0 * f32::EPSILON * hi.abs().max(lo.abs());
                    let e = (view[at(tok, hh, c)] - x[at(tok, hh, c)]).abs();
                    assert!(e <= bound, "{}: error {e} > bound {bound}", s.name);
                    checked += 1;
                }
            }
        }
        // window and sink tokens are stored exactly
        for tok in (0..r.sinks).chain(r.sinks + r.quantized..t) {
            for i in 0..h * d {
                assert_eq!(view[tok * h * d + i], x[tok * h * d + i]);
            }
        }
        assert!(checked > 0 || r.quantized == 0);
    }
}

#[test]
fn blocks_are_reused_after_free_without_leaking() {
    let s = presets::kivi2().with_shape(Heads::Gqa { q: 4, kv: 2 }, 64).unwrap();
    let row = 2 * 64;
    let mut rng = Rng::new(7);
    let mut c = PagedCache::new(
        s.clone(),
        CacheConfig {
            block_tokens: Some(32),
            max_blocks: 24,
        },
    )
    .unwrap();
    // A sequence of huge values fills most of the pool, then goes away.
    let big: Vec<f32> = (0..700 * row).map(|i| 1000.0 + (i % 13) as f32).collect();
    let a = c.add_sequence();
    c.extend(a, &big, &big).unwrap();
    let used = c.memory().blocks_in_use;
    assert!(used >= 17, "{used}");
    let table_a = c.block_table(a).unwrap().to_vec();
    c.free_sequence(a).unwrap();
    assert_eq!(c.free_blocks(), 24);
    assert_eq!(c.memory().total, 0);
    // New sequences take the same blocks and see only their own data.
    let k = rng.kv(400, 2, 64, true);
    let v = rng.kv(400, 2, 64, false);
    let b = c.add_sequence();
    for i in 0..400 {
        c.append(b, &k[i * row..(i + 1) * row], &v[i * row..(i + 1) * row])
            .unwrap();
    }
    let table_b = c.block_table(b).unwrap().to_vec();
    assert!(
        table_b.iter().all(|x| table_a.contains(x)),
        "freed blocks are reused first"
    );
    assert_eq!(
        c.dequantize(b, Tensor::Key).unwrap(),
        reference::cache_view(&s, Tensor::Key, &k).unwrap()
    );
    assert_eq!(
        c.dequantize(b, Tensor::Value).unwrap(),
        reference::cache_view(&s, Tensor::Value, &v).unwrap()
    );
    let q: Vec<f32> = (0..4 * 64).map(|_| rng.f32()).collect();
    let ap = AttnParams::of(&s, s.shape().unwrap());
    let want = reference::attend(&s, &q, &k, &v, ap).unwrap();
    let got = ReferenceBackend.decode(&c, &[b], &q, ap).unwrap();
    assert!(rel_err(&got, &want) < 1e-6);
    assert!(c.sequences() == vec![b]);
    assert!(matches!(c.free_sequence(a), Err(Error::UnknownSequence(_))));
}

#[test]
fn memory_report_is_the_sum_of_allocations() {
    let mut rng = Rng::new(3);
    for s in schemes().into_iter().chain(codec_schemes()) {
        let Some(s) = bound(&s, Heads::Gqa { q: 8, kv: 4 }, 128) else {
            continue;
        };
        let shape = s.shape().unwrap();
        let mut c = PagedCache::new(s.clone(), CacheConfig::for_tokens(5000)).unwrap();
        let lens = [1usize, 31, 33, 127, 1000];
        let mut want_windows = 0;
        let mut want_tables = 0;
        for &t in &lens {
            let id = c.add_sequence();
            let k = rng.kv(t, shape.kv_heads, shape.head_dim, false);
            c.extend(id, &k, &k).unwrap();
            let blocks = c.block_table(id).unwrap().len();
            // exactly enough blocks for the quantized tokens
            let nq = regions(&s, Tensor::Key, t)
                .quantized
                .max(regions(&s, Tensor::Value, t).quantized);
            assert_eq!(blocks, nq.div_ceil(c.layout().block_tokens), "{}", s.name);
            want_tables += blocks * 4;
            for tn in [Tensor::Key, Tensor::Value] {
                let slots = s.sinks as usize + kivi_spec::layout::window_capacity(&s, tn);
                want_windows += slots * shape.kv_heads * shape.head_dim * s.dtype.bytes();
            }
        }
        let m = c.memory();
        assert_eq!(
            m.blocks_in_use * c.layout().block_bytes(),
            m.codes + m.scales + m.zeros + m.outliers,
            "{}",
            s.name
        );
        assert_eq!(m.windows, want_windows, "{}", s.name);
        assert_eq!(m.tables, want_tables);
        // Means: one D-row per KV head per centered tensor, for each
        // sequence long enough to have them.
        let centered = [Tensor::Key, Tensor::Value]
            .iter()
            .filter_map(|t| s.center_of(*t))
            .map(|n| lens.iter().filter(|&&l| l >= n).count())
            .sum::<usize>();
        assert_eq!(
            m.means,
            centered * shape.kv_heads * shape.head_dim * s.dtype.bytes(),
            "{}",
            s.name
        );
        let lloyd: usize = [&s.key, &s.value]
            .iter()
            .filter_map(|c| c.quant())
            .filter(|q| q.levels != Levels::Uniform)
            .map(|q| 4 << q.bits)
            .sum();
        assert_eq!(m.codebooks, lloyd, "{}", s.name);
        assert_eq!(
            m.total,
            m.codes + m.scales + m.zeros + m.outliers + m.means + m.codebooks + m.windows + m.tables
        );
        let per_seq: usize = c.sequences().iter().map(|&i| c.sequence_memory(i).unwrap().total).sum();
        assert_eq!(per_seq + m.codebooks, m.total);
        assert_eq!(c.free_blocks() + m.blocks_in_use, c.max_blocks());
    }
}

#[test]
fn kivi2_bytes_per_token_at_head_dim_128() {
    let s = presets::kivi2().with_shape(Heads::Gqa { q: 32, kv: 8 }, 128).unwrap();
    // key: 128 x 2 bits = 32 B codes + 128 channels x (f16 scale + f16 zero) / 32 tokens = 16 B
    // value: 32 B codes + 4 groups x 4 B = 16 B
    assert_eq!(layout::bytes_per_token_per_head(&s), (96 * 32, 32));
    let l = layout::BlockLayout::new(&s, s.shape().unwrap(), 64);
    assert_eq!(l.block_bytes(), 96 * 64 * 8);
}

fn snapshot(c: &PagedCache, id: SeqId) -> (Vec<f32>, Vec<f32>, MemoryReport, usize, usize) {
    (
        c.dequantize(id, Tensor::Key).unwrap(),
        c.dequantize(id, Tensor::Value).unwrap(),
        c.memory(),
        c.free_blocks(),
        c.len(id).unwrap(),
    )
}

#[test]
fn bad_input_is_refused_and_changes_nothing() {
    let s = presets::kivi2().with_shape(Heads::Mha(2), 32).unwrap();
    let row = 64;
    let mut rng = Rng::new(9);
    let mut c = PagedCache::new(
        s.clone(),
        CacheConfig {
            block_tokens: Some(32),
            max_blocks: 3,
        },
    )
    .unwrap();
    let id = c.add_sequence();
    let k = rng.kv(150, 2, 32, false);
    c.extend(id, &k, &k).unwrap();
    let before = snapshot(&c, id);

    let mut nan = k[..40 * row].to_vec();
    nan[37 * row + 5] = f32::NAN;
    let e = c.extend(id, &nan, &k[..40 * row]).unwrap_err();
    assert!(
        matches!(
            e,
            Error::NonFinite {
                token: 187,
                head: 0,
                channel: 5,
                ..
            }
        ),
        "{e}"
    );
    assert_eq!(snapshot(&c, id), before);

    let mut inf = k[..row].to_vec();
    inf[3] = 1e6; // overflows f16
    assert!(matches!(
        c.append(id, &k[..row], &inf),
        Err(Error::NonFinite { tensor: "value", .. })
    ));
    assert_eq!(snapshot(&c, id), before);

    assert!(matches!(
        c.append(id, &k[..row - 1], &k[..row]),
        Err(Error::Shape { .. })
    ));
    assert!(matches!(
        c.extend(id, &k[..row * 2], &k[..row]),
        Err(Error::Shape { .. })
    ));
    assert!(matches!(
        c.append(99, &k[..row], &k[..row]),
        Err(Error::UnknownSequence(99))
    ));

    // The pool holds 3 blocks of 32 tokens: 150 tokens use 1 (key: 0 quantized
    // groups past R=128 ... values 22 tokens); 200 more need more than 3.
    let more = rng.kv(200, 2, 32, false);
    let e = c.extend(id, &more, &more).unwrap_err();
    assert!(matches!(e, Error::OutOfBlocks { .. }), "{e}");
    assert_eq!(snapshot(&c, id), before);
    assert!(e.to_string().contains("out of cache blocks"));

    // A bf16 value that a f16 zero point cannot hold: refused by the append
    // that brings it (not later, when it would leave the window).
    let wide = Scheme {
        dtype: Dtype::Bf16,
        residual: 0,
        ..s.clone()
    };
    let mut c2 = PagedCache::new(wide, CacheConfig::for_tokens(100)).unwrap();
    let id2 = c2.add_sequence();
    let ok = rng.kv(40, 2, 32, false);
    c2.extend(id2, &ok, &ok).unwrap();
    let before2 = snapshot(&c2, id2);
    let mut huge = rng.kv(32, 2, 32, false);
    huge[7] = 3.0e5;
    let e = c2.extend(id2, &huge, &rng.kv(32, 2, 32, false)).unwrap_err();
    assert!(matches!(e, Error::OutOfRange { tensor: "key", .. }), "{e}");
    assert_eq!(snapshot(&c2, id2), before2);

    // Unbound schemes and bad block sizes are configuration errors.
    assert!(matches!(
        PagedCache::new(presets::kivi2(), CacheConfig::for_tokens(10)),
        Err(Error::Unbound(_))
    ));
    assert!(matches!(
        PagedCache::new(
            s,
            CacheConfig {
                block_tokens: Some(48),
                max_blocks: 4
            }
        ),
        Err(Error::Config(_))
    ));
}
