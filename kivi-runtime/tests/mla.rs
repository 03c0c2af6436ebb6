//! MLA caches (`heads: mla(...)`) on DeepSeek-V2-Lite shapes (16 query
//! heads, latent 512, RoPE 64): the paged cache and the CPU decode against
//! the oracle at odd lengths, exact memory, streaming = prefill, typed
//! errors, and the math check that could fail: the absorbed form equals
//! explicit per-head attention after the up-projections.

use kivi_runtime::cpu::mla as cpu_mla;
use kivi_runtime::mla::{reference, MlaCache, MlaConfig, Part};
use kivi_runtime::rand::Rng;
use kivi_runtime::{AttnParams, CacheConfig, Error, PagedCache};
use kivi_spec::{parse_scheme, Scheme};

const HEADS: usize = 16;
const LATENT: usize = 512;
const ROPE: usize = 64;
const LENGTHS: [usize; 5] = [1, 31, 33, 127, 1000];
/// DeepSeek-V2-Lite: 1/sqrt(qk_nope_head_dim + qk_rope_head_dim) = 1/sqrt(192).
const SCALE: &str = "0.07216878";

fn scheme(key: &str, rope: &str, extra: &str) -> Scheme {
    let text = format!(
        "DsLite {{ key: {key}, heads: mla(q = {HEADS}, latent = {LATENT}, rope_dim = {ROPE}, rope = {rope}), softmax_scale: {SCALE}, {extra} }}"
    );
    parse_scheme(&text).unwrap_or_else(|e| panic!("{text}\n{e}"))
}

/// The latent codecs (2 and 4 bits, both axes, Lloyd–Max once) crossed with
/// exact and 4-bit RoPE parts, with windows, sinks, chunked flush and bf16.
fn schemes() -> Vec<Scheme> {
    let c2 = "quant(bits = 2, axis = channel, group = 32)";
    let c4 = "quant(bits = 4, axis = channel, group = 32)";
    let t4 = "quant(bits = 4, axis = token, group = 64)";
    let r4t = "quant(bits = 4, axis = token, group = 32)";
    let r4c = "quant(bits = 4, axis = channel, group = 32)";
    vec![
        scheme(c2, "full", "residual: 32"),
        scheme(c2, r4t, "residual: 32, sinks: 4"),
        scheme(c4, "full", "residual: 32, flush: chunked"),
        scheme(t4, r4c, "residual: 16, sinks: 2, dtype: bf16"),
        scheme(
            "quant(bits = 2, axis = token, group = 32, levels = lloyd_max)",
            r4t,
            "residual: 8",
        ),
    ]
}

/// Synthetic MLA rows shaped like DeepSeek's: the latent (after its
/// RMSNorm) has per-channel scales with a few heavy channels at 10-50x and
/// small per-channel offsets; the RoPE key has its own channel scales and is
/// rotated by position (half-split pairs, base 10000).
struct Data {
    latent: Vec<f32>,
    rope: Vec<f32>,
}

fn data(rng: &mut Rng, tokens: usize) -> Data {
    let mut ch_scale: Vec<f32> = (0..LATENT).map(|_| 0.5 + rng.unit() as f32).collect();
    for _ in 0..8 {
        ch_scale[rng.below(LATENT)] *= 10.0 + 40.0 * rng.unit() as f32;
    }
    let ch_mean: Vec<f32> = (0..LATENT).map(|_| 0.3 * rng.normal()).collect();
    let mut latent = Vec::with_capacity(tokens * LATENT);
    for _ in 0..tokens {
        for c in 0..LATENT {
            latent.push(ch_scale[c] * (ch_mean[c] + rng.normal()));
        }
    }
    let half = ROPE / 2;
    let mut r_scale: Vec<f32> = (0..ROPE).map(|_| 0.5 + rng.unit() as f32).collect();
    r_scale[rng.below(ROPE)] *= 20.0;
    let mut rope = Vec::with_capacity(tokens * ROPE);
    for t in 0..tokens {
        let pre: Vec<f32> = (0..ROPE).map(|c| r_scale[c] * rng.normal()).collect();
        let mut row = vec![0f32; ROPE];
        for i in 0..half {
            let theta = t as f32 * 10000f32.powf(-(2.0 * i as f32) / ROPE as f32);
            let (s, c) = theta.sin_cos();
            row[i] = pre[i] * c - pre[i + half] * s;
            row[i + half] = pre[i] * s + pre[i + half] * c;
        }
        rope.extend(row);
    }
    Data { latent, rope }
}

fn query(rng: &mut Rng) -> Vec<f32> {
    (0..HEADS)
        .flat_map(|_| {
            (0..LATENT + ROPE)
                .map(|c| if c < LATENT { 0.15 } else { 0.3 } * rng.normal())
                .collect::<Vec<_>>()
        })
        .collect()
}

fn rel_err(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let num = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    let den = want.iter().map(|b| b.abs()).fold(0f32, f32::max).max(1e-30);
    num / den
}

fn config(blocks: usize) -> MlaConfig {
    MlaConfig {
        block_tokens: None,
        max_blocks: blocks,
    }
}

/// Every scheme, every odd length, one batch: the cache's rows equal the
/// oracle's views bit for bit, its memory equals the spec's count, and the
/// CPU decode of the whole batch equals the oracle's attention.
#[test]
fn cache_and_cpu_decode_match_the_oracle_at_odd_lengths() {
    let mut rng = Rng::new(0x3a1a);
    for s in schemes() {
        let params = reference::attn_params(&s).unwrap();
        let mut cache = MlaCache::new(s.clone(), config(64)).unwrap();
        let mut ids = Vec::new();
        let mut inputs = Vec::new();
        for &t in &LENGTHS {
            let d = data(&mut rng, t);
            let id = cache.add_sequence();
            cache.extend(id, &d.latent, &d.rope).unwrap();
            ids.push(id);
            inputs.push(d);
        }
        let q: Vec<f32> = (0..ids.len()).flat_map(|_| query(&mut rng)).collect();
        let got = cpu_mla::decode(&cache, &ids, &q, params).unwrap();
        for (b, (&id, d)) in ids.iter().zip(&inputs).enumerate() {
            let t = LENGTHS[b];
            let (cv, rv) = reference::cache_views(&s, &d.latent, &d.rope).unwrap();
            assert!(
                cache.dequantize(id, Part::Latent).unwrap() == cv,
                "{} T={t}: latent rows",
                s.name
            );
            assert!(
                cache.dequantize(id, Part::Rope).unwrap() == rv,
                "{} T={t}: rope rows",
                s.name
            );
            let (lat, rope) = kivi_spec::mla::mla_bytes_for_tokens(&s, t).unwrap();
            let m = cache.sequence_memory(id).unwrap();
            assert_eq!((m.latent, m.rope), (lat, rope), "{} T={t}: memory", s.name);
            let qb = &q[b * HEADS * (LATENT + ROPE)..][..HEADS * (LATENT + ROPE)];
            let want = reference::decode_attention(&s, qb, &cv, &rv, params).unwrap();
            let e = rel_err(&got[b * HEADS * LATENT..][..HEADS * LATENT], &want);
            assert!(e < 1e-5, "{} T={t}: cpu vs oracle rel err {e}", s.name);
        }
        // A sliding window attends to the last W tokens only.
        let win = AttnParams {
            window: Some(40),
            ..params
        };
        let got = cpu_mla::decode(&cache, &ids[4..], &q[4 * HEADS * (LATENT + ROPE)..], win).unwrap();
        let want = reference::attend(
            &s,
            &q[4 * HEADS * (LATENT + ROPE)..],
            &inputs[4].latent,
            &inputs[4].rope,
            win,
        )
        .unwrap();
        assert!(rel_err(&got, &want) < 1e-5, "{}: window", s.name);
    }
}

/// Appending one token at a time, in odd chunks, or all at once gives the
/// same blocks, bit for bit, and the same rows.
#[test]
fn streaming_equals_prefill() {
    let mut rng = Rng::new(7);
    for s in schemes() {
        let t = 127;
        let d = data(&mut rng, t);
        let mut one = MlaCache::new(s.clone(), config(8)).unwrap();
        let a = one.add_sequence();
        one.extend(a, &d.latent, &d.rope).unwrap();
        for chunk in [1usize, 7] {
            let mut c = MlaCache::new(s.clone(), config(8)).unwrap();
            let b = c.add_sequence();
            for (cl, cr) in d.latent.chunks(chunk * LATENT).zip(d.rope.chunks(chunk * ROPE)) {
                c.extend(b, cl, cr).unwrap();
            }
            assert_eq!(c.block_table(b).unwrap(), one.block_table(a).unwrap());
            for &blk in one.block_table(a).unwrap() {
                for part in [Part::Latent, Part::Rope] {
                    assert!(
                        c.block_part(blk, part) == one.block_part(blk, part),
                        "{} chunk {chunk}",
                        s.name
                    );
                }
            }
            for part in [Part::Latent, Part::Rope] {
                assert!(c.dequantize(b, part).unwrap() == one.dequantize(a, part).unwrap());
            }
            assert_eq!(c.memory(), one.memory());
        }
    }
}

/// The math check: with exact codecs (f32, `full` latent and RoPE part),
/// absorbed MLA decode equals explicit multi-head attention over the
/// up-projected keys `[W_UK_h^T c_t ; k_rope_t]` and values `W_UV_h^T c_t`,
/// computed by the generic oracle on an MHA scheme. Nope and value head
/// dims are DeepSeek-V2-Lite's (128, 128); the output is `W_UV_h^T o_h`.
#[test]
fn absorbed_form_equals_expanded_multi_head_attention() {
    let (dn, dv, t) = (128usize, 128usize, 33usize);
    let mut rng = Rng::new(42);
    let s = scheme("full", "full", "dtype: f32");
    let d = data(&mut rng, t);
    let w_uk: Vec<f32> = (0..HEADS * LATENT * dn).map(|_| rng.normal() * 0.05).collect();
    let w_uv: Vec<f32> = (0..HEADS * LATENT * dv).map(|_| rng.normal() * 0.05).collect();
    let q_nope: Vec<f32> = (0..HEADS * dn).map(|_| rng.normal() * 0.2).collect();
    let q_rope: Vec<f32> = (0..HEADS * ROPE).map(|_| rng.normal() * 0.3).collect();
    // x^T W for W [LATENT, n] of head h.
    let proj = |w: &[f32], h: usize, n: usize, x: &[f32]| -> Vec<f32> {
        let mut o = vec![0f64; n];
        for (l, xv) in x.iter().enumerate() {
            for (j, oj) in o.iter_mut().enumerate() {
                *oj += *xv as f64 * w[(h * LATENT + l) * n + j] as f64;
            }
        }
        o.into_iter().map(|v| v as f32).collect()
    };
    // Expanded MHA: head dim dn + R for keys; values padded to the same width.
    let hd = dn + ROPE;
    let mha = parse_scheme(&format!(
        "Mha {{ key: full, value: full, heads: mha({HEADS}), head_dim: {hd}, dtype: f32, softmax_scale: {SCALE} }}"
    ))
    .unwrap();
    let mut k = vec![0f32; t * HEADS * hd];
    let mut v = vec![0f32; t * HEADS * hd];
    for tok in 0..t {
        let c = &d.latent[tok * LATENT..(tok + 1) * LATENT];
        for h in 0..HEADS {
            let at = (tok * HEADS + h) * hd;
            k[at..at + dn].copy_from_slice(&proj(&w_uk, h, dn, c));
            k[at + dn..at + hd].copy_from_slice(&d.rope[tok * ROPE..(tok + 1) * ROPE]);
            v[at..at + dv].copy_from_slice(&proj(&w_uv, h, dv, c));
        }
    }
    let mut q = vec![0f32; HEADS * hd];
    for h in 0..HEADS {
        q[h * hd..h * hd + dn].copy_from_slice(&q_nope[h * dn..(h + 1) * dn]);
        q[h * hd + dn..(h + 1) * hd].copy_from_slice(&q_rope[h * ROPE..(h + 1) * ROPE]);
    }
    let p = AttnParams {
        softmax_scale: 1.0 / 192f32.sqrt(),
        window: None,
    };
    let expanded = kivi_runtime::reference::attend(&mha, &q, &k, &v, p).unwrap();
    // Absorbed: q_latent_h = W_UK_h q_nope_h.
    let mut qa = vec![0f32; HEADS * (LATENT + ROPE)];
    for h in 0..HEADS {
        for l in 0..LATENT {
            let row = &w_uk[(h * LATENT + l) * dn..][..dn];
            qa[h * (LATENT + ROPE) + l] = row.iter().zip(&q_nope[h * dn..(h + 1) * dn]).map(|(a, b)| a * b).sum();
        }
        qa[h * (LATENT + ROPE) + LATENT..(h + 1) * (LATENT + ROPE)].copy_from_slice(&q_rope[h * ROPE..(h + 1) * ROPE]);
    }
    let mut cache = MlaCache::new(s.clone(), config(4)).unwrap();
    let id = cache.add_sequence();
    cache.extend(id, &d.latent, &d.rope).unwrap();
    let absorbed_oracle = reference::attend(&s, &qa, &d.latent, &d.rope, p).unwrap();
    let absorbed_cpu = cpu_mla::decode(&cache, &[id], &qa, p).unwrap();
    for (name, o) in [("oracle", &absorbed_oracle), ("cpu", &absorbed_cpu)] {
        let mut up = Vec::new();
        let mut want = Vec::new();
        for h in 0..HEADS {
            up.extend(proj(&w_uv, h, dv, &o[h * LATENT..(h + 1) * LATENT]));
            want.extend_from_slice(&expanded[h * hd..h * hd + dv]);
        }
        let e = rel_err(&up, &want);
        assert!(e < 1e-4, "{name}: absorbed vs expanded rel err {e}");
    }
    // And the check can fail: dropping the RoPE part changes the result.
    let mut no_rope = qa.clone();
    for h in 0..HEADS {
        no_rope[h * (LATENT + ROPE) + LATENT..(h + 1) * (LATENT + ROPE)].fill(0.0);
    }
    let wrong = reference::attend(&s, &no_rope, &d.latent, &d.rope, p).unwrap();
    assert!(rel_err(&wrong, &absorbed_oracle) > 1e-2);
}

#[test]
fn bad_input_is_a_typed_error_and_changes_nothing() {
    let s = schemes().remove(0);
    let mut cache = MlaCache::new(s.clone(), config(2)).unwrap();
    let id = cache.add_sequence();
    let mut rng = Rng::new(1);
    let d = data(&mut rng, 40);
    cache.extend(id, &d.latent, &d.rope).unwrap();
    let before = (cache.memory(), cache.dequantize(id, Part::Latent).unwrap());
    let unchanged = |c: &MlaCache| (c.memory(), c.dequantize(id, Part::Latent).unwrap()) == before;
    // Wrong widths, mismatched token counts.
    assert!(matches!(
        cache.append(id, &[0.0; 511], &[0.0; 64]),
        Err(Error::Shape { .. })
    ));
    assert!(matches!(
        cache.extend(id, &[0.0; 1024], &[0.0; 64]),
        Err(Error::Shape { .. })
    ));
    // NaN in the RoPE part.
    let mut r = vec![0.0; 64];
    r[5] = f32::NAN;
    assert!(matches!(
        cache.append(id, &[0.0; 512], &r),
        Err(Error::NonFinite {
            tensor: "rope",
            channel: 5,
            ..
        })
    ));
    // A value no f16 scale can hold.
    let big = vec![1e30f32; 512 * 32];
    assert!(matches!(
        cache.extend(id, &big, &vec![0.0; 64 * 32]),
        Err(Error::NonFinite { .. } | Error::ScaleOverflow { .. })
    ));
    // Out of blocks (2 blocks of 64 tokens hold 128 stored tokens).
    let more = data(&mut rng, 200);
    assert!(matches!(
        cache.extend(id, &more.latent, &more.rope),
        Err(Error::OutOfBlocks { .. })
    ));
    assert!(unchanged(&cache));
    assert!(matches!(
        cache.extend(99, &d.latent, &d.rope),
        Err(Error::UnknownSequence(99))
    ));
    // Queries: wrong length, NaN, unknown sequence.
    let p = reference::attn_params(&s).unwrap();
    assert!(matches!(
        cpu_mla::decode(&cache, &[id], &[0.0; 10], p),
        Err(Error::Shape { .. })
    ));
    let mut q = vec![0.0; HEADS * (LATENT + ROPE)];
    q[3] = f32::INFINITY;
    assert!(matches!(
        cpu_mla::decode(&cache, &[id], &q, p),
        Err(Error::NonFinite { tensor: "query", .. })
    ));
    q[3] = 0.0;
    assert!(matches!(
        cpu_mla::decode(&cache, &[id, 7], &[q.clone(), q.clone()].concat(), p),
        Err(Error::InSequence { seq: 1, .. })
    ));
    // An empty sequence attends to nothing: zeros.
    let e = cache.add_sequence();
    assert!(cpu_mla::decode(&cache, &[e], &q, p).unwrap().iter().all(|x| *x == 0.0));
    // The generic cache and oracle refuse an mla scheme rather than ignore
    // its RoPE part.
    assert!(matches!(
        PagedCache::new(s.clone(), CacheConfig::for_tokens(64)),
        Err(Error::Config(_))
    ));
    assert!(kivi_runtime::reference::attend(&s, &q[..HEADS * LATENT], &d.latent, &d.latent, p).is_err());
    // Block sizes that split a channel group.
    assert!(matches!(
        MlaCache::new(
            s,
            MlaConfig {
                block_tokens: Some(48),
                max_blocks: 1
            }
        ),
        Err(Error::Config(_))
    ));
}

/// Bytes per token of DeepSeek-V2-Lite's cache under kivi-style codecs,
/// against an f16 cache of the latent and RoPE key (1152 B) and DeepSeek's
/// FP8 layout (656 B), from the cache's own count over whole groups.
#[test]
fn bytes_per_token_against_f16_and_fp8() {
    let mut rng = Rng::new(5);
    let cases = [
        ("quant(bits = 2, axis = channel, group = 32)", "full", 320),
        (
            "quant(bits = 2, axis = channel, group = 32)",
            "quant(bits = 4, axis = token, group = 32)",
            192 + 40,
        ),
        ("quant(bits = 4, axis = channel, group = 32)", "full", 256 + 64 + 128),
        ("full", "full", 1152),
    ];
    for (key, rope, want) in cases {
        let s = scheme(key, rope, "");
        let mut cache = MlaCache::new(s, config(4)).unwrap();
        let id = cache.add_sequence();
        let d = data(&mut rng, 64);
        cache.extend(id, &d.latent, &d.rope).unwrap();
        let m = cache.sequence_memory(id).unwrap();
        assert_eq!(m.windows, 0);
        assert_eq!((m.latent + m.rope) / 64, want, "{key} / {rope}");
        assert_eq!(m.block_bytes, 64 * want, "one full block is exactly the payload");
        assert!(want < 656 || key == "full");
    }
}

/// The generated CUDA decode kernel, executed in the simulator, against the
/// oracle: every scheme without Lloyd–Max levels (the template has none
/// yet), the odd lengths in one batch, and a sliding window.
#[test]
fn simulated_cuda_decode_matches_the_oracle() {
    use kivi_runtime::device::SimDevice;
    use kivi_runtime::mla::device::MlaDeviceDecode;
    let mut rng = Rng::new(0x51a);
    let dev = SimDevice::shared();
    for s in schemes().into_iter().take(4) {
        let params = reference::attn_params(&s).unwrap();
        let mut cache = MlaCache::new(s.clone(), config(64)).unwrap();
        let mut ids = Vec::new();
        let mut inputs = Vec::new();
        for &t in &LENGTHS {
            let d = data(&mut rng, t);
            let id = cache.add_sequence();
            cache.extend(id, &d.latent, &d.rope).unwrap();
            ids.push(id);
            inputs.push(d);
        }
        let q: Vec<f32> = (0..ids.len()).flat_map(|_| query(&mut rng)).collect();
        let sim = MlaDeviceDecode::new(dev.clone(), &s, None).unwrap();
        let win = AttnParams {
            window: Some(40),
            ..params
        };
        for p in [params, win] {
            let got = sim.decode(&cache, &ids, &q, p).unwrap();
            for (b, d) in inputs.iter().enumerate() {
                let qb = &q[b * HEADS * (LATENT + ROPE)..][..HEADS * (LATENT + ROPE)];
                let want = reference::attend(&s, qb, &d.latent, &d.rope, p).unwrap();
                let e = rel_err(&got[b * HEADS * LATENT..][..HEADS * LATENT], &want);
                assert!(
                    e < 1e-4,
                    "{} T={} window {:?}: sim vs oracle rel err {e}",
                    s.name,
                    LENGTHS[b],
                    p.window
                );
            }
        }
    }
}

/// Every launch variant of the MLA kernel (threads x tile) is correct:
/// what a tuner may choose from. Lloyd–Max latents are refused with the
/// field that asks for them.
#[test]
fn every_simulated_mla_variant_matches_the_oracle() {
    use kivi_runtime::device::SimDevice;
    use kivi_runtime::mla::device::MlaDeviceDecode;
    let mut rng = Rng::new(0x7a5);
    let s = schemes().remove(1);
    let variants = kivi_templates::mla_variants(&s);
    assert!(variants.len() >= 6, "{variants:?}");
    let runs = MlaDeviceDecode::new_many(SimDevice::shared(), &s, &variants).unwrap();
    let mut cache = MlaCache::new(s.clone(), config(16)).unwrap();
    let mut ids = Vec::new();
    let mut inputs = Vec::new();
    for t in [1, 33, 127] {
        let d = data(&mut rng, t);
        let id = cache.add_sequence();
        cache.extend(id, &d.latent, &d.rope).unwrap();
        ids.push(id);
        inputs.push(d);
    }
    let q: Vec<f32> = (0..ids.len()).flat_map(|_| query(&mut rng)).collect();
    let p = reference::attn_params(&s).unwrap();
    let want: Vec<f32> = inputs
        .iter()
        .enumerate()
        .flat_map(|(b, d)| {
            reference::attend(
                &s,
                &q[b * HEADS * (LATENT + ROPE)..][..HEADS * (LATENT + ROPE)],
                &d.latent,
                &d.rope,
                p,
            )
            .unwrap()
        })
        .collect();
    for run in &runs {
        let got = run.decode(&cache, &ids, &q, p).unwrap();
        let e = rel_err(&got, &want);
        assert!(e < 1e-4, "{}: rel err {e}", run.generated().name);
    }
    let lloyd = schemes().remove(4);
    let e = MlaDeviceDecode::new(SimDevice::shared(), &lloyd, None).err().unwrap();
    assert!(e.to_string().contains("lloyd_max"), "{e}");
}

/// The MLA tuner on the simulated device: every variant is checked against
/// the oracle before it is timed, and the choice is a correct one.
#[test]
fn tuning_times_only_correct_variants() {
    use kivi_runtime::device::SimDevice;
    use kivi_runtime::mla::device::{tune, TUNE_TOLERANCE};
    let mut rng = Rng::new(9);
    // The scheme of the variant test: its library is compiled once.
    let s = schemes().remove(1);
    let mut cache = MlaCache::new(s.clone(), config(4)).unwrap();
    let id = cache.add_sequence();
    let d = data(&mut rng, 70);
    cache.extend(id, &d.latent, &d.rope).unwrap();
    let q = query(&mut rng);
    let p = reference::attn_params(&s).unwrap();
    let (pick, all) = tune(SimDevice::shared(), &cache, &[id], &q, p, 0, 1).unwrap();
    assert_eq!(all.len(), kivi_templates::mla_variants(&s).len());
    for c in &all {
        assert!(c.rel_err <= TUNE_TOLERANCE && c.timing.is_some(), "{c:?}");
    }
    assert!(all.iter().any(|c| c.variant == pick));
    // A query of the wrong length is refused before anything runs.
    assert!(matches!(
        tune(SimDevice::shared(), &cache, &[id], &q[1..], p, 0, 1),
        Err(Error::Shape { .. })
    ));
}

/// Random MLA schemes (small shapes, every codec option the cache takes)
/// and random sessions of appends, odd extends, frees and new sequences:
/// after every operation each live sequence's rows equal the oracle's
/// one-shot views of its whole history, its bytes equal the spec's count,
/// and the CPU decode equals the oracle's attention.
#[test]
fn random_sessions_match_the_oracle() {
    let mut rng = Rng::new(0xf022);
    let codec = |rng: &mut Rng, d: usize| -> String {
        let bits = [1, 2, 3, 4, 8][rng.below(5)];
        match rng.below(4) {
            0 => "full".into(),
            1 => format!(
                "quant(bits = {bits}, axis = channel, group = {})",
                [4, 8, 16][rng.below(3)]
            ),
            2 => {
                let g = [1, 2, 4, d][rng.below(4)];
                format!("quant(bits = {bits}, axis = token, group = {g}, scale = f32)")
            }
            _ => format!(
                "quant(bits = {}, axis = token, group = {d}, levels = lloyd_max)",
                1 + rng.below(4)
            ),
        }
    };
    let mut sessions = 0;
    while sessions < 40 {
        let (q, l, r) = (1 + rng.below(4), [8, 16, 32][rng.below(3)], [2, 4, 8][rng.below(3)]);
        let text = format!(
            "F {{ key: {}, heads: mla(q = {q}, latent = {l}, rope_dim = {r}, rope = {}), residual: {}, sinks: {}, flush: {}, dtype: {} }}",
            codec(&mut rng, l),
            codec(&mut rng, r),
            [0, 4, 16][rng.below(3)],
            rng.below(3),
            ["eager", "chunked"][rng.below(2)],
            ["f16", "bf16", "f32"][rng.below(3)],
        );
        let Ok(s) = parse_scheme(&text) else { continue }; // e.g. chunked without a window
        sessions += 1;
        let p = reference::attn_params(&s).unwrap();
        let mut cache = MlaCache::new(s.clone(), config(64)).unwrap();
        let mut live: Vec<(u64, Vec<f32>, Vec<f32>)> = Vec::new();
        for _ in 0..12 {
            match rng.below(6) {
                0 => live.push((cache.add_sequence(), Vec::new(), Vec::new())),
                1 if !live.is_empty() => {
                    let (id, _, _) = live.remove(rng.below(live.len()));
                    cache.free_sequence(id).unwrap();
                }
                _ if !live.is_empty() => {
                    let i = rng.below(live.len());
                    let n = [1, 1, 3, 17, 40][rng.below(5)];
                    let c: Vec<f32> = (0..n * l)
                        .map(|k| rng.normal() * if k % l == 1 { 20.0 } else { 1.0 })
                        .collect();
                    let kr: Vec<f32> = (0..n * r).map(|_| rng.normal()).collect();
                    let (id, hc, hk) = &mut live[i];
                    cache.extend(*id, &c, &kr).unwrap();
                    hc.extend(c);
                    hk.extend(kr);
                }
                _ => live.push((cache.add_sequence(), Vec::new(), Vec::new())),
            }
            let mut ids = Vec::new();
            let mut qs = Vec::new();
            for (id, hc, hk) in &live {
                let (cv, rv) = reference::cache_views(&s, hc, hk).unwrap();
                assert!(cache.dequantize(*id, Part::Latent).unwrap() == cv, "{text}");
                assert!(cache.dequantize(*id, Part::Rope).unwrap() == rv, "{text}");
                let t = hc.len() / l;
                let (bl, br) = kivi_spec::mla::mla_bytes_for_tokens(&s, t).unwrap();
                let m = cache.sequence_memory(*id).unwrap();
                assert_eq!((m.latent, m.rope), (bl, br), "{text} T={t}");
                ids.push(*id);
                qs.extend((0..q * (l + r)).map(|_| rng.normal()));
            }
            let got = cpu_mla::decode(&cache, &ids, &qs, p).unwrap();
            for (b, (_, hc, hk)) in live.iter().enumerate() {
                let want = reference::attend(&s, &qs[b * q * (l + r)..][..q * (l + r)], hc, hk, p).unwrap();
                let e = rel_err(&got[b * q * l..][..q * l], &want);
                assert!(e < 1e-4 || want.iter().all(|x| *x == 0.0), "{text}: rel err {e}");
            }
        }
    }
}
