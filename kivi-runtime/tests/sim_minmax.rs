//! `nuq` tables with a zero point per group (`norm = minmax` and
//! `minmax_pinned`) and key outliers on pre-RoPE keys in the generated
//! CUDA: the 2-bit accuracy winner `pk128mp_v1nuq_o2` (eval/schemes/
//! acc3.kivi, read from that file) and neighbours — unpinned minmax keys,
//! minmax keys with outliers on both tensors, key outliers on pre-RoPE
//! uniform keys — on GQA 8:2, MQA and MHA:
//!
//! - decode over an uploaded host cache matches the oracle
//!   (`cache_view_calibrated` + `decode_attention`, which adds each key
//!   outlier's correction before turning the key) at lengths 1, 31, 33,
//!   127, 1000, with and without a sliding window;
//! - the device's own prefill and appends write exactly the words a host
//!   cache built with the same calibration writes (zero points included);
//! - every decode variant of two cases agrees with the oracle (all cases
//!   under `KIVI_FULL_SWEEP=1`);
//! - the sources compile with NVRTC for sm_90 where NVRTC is provisioned;
//! - a minmax key without `rope: pre(...)` stays refused by validation.
//!
//! Runs on the simulated device (CI) and on GPU 0 where one is usable.

mod device_util;
#[path = "sim_util/mod.rs"]
mod sim_util;

use device_util::{devices, write_both};
use kivi_runtime::calib::{Calibration, FitOptions, LayerSamples, ModelId};
use kivi_runtime::device::{Device, DeviceBackend, DeviceCache};
use kivi_runtime::reference::{cache_view_calibrated, decode_attention};
use kivi_runtime::{AttnParams, Backend, CacheConfig, PagedCache};
use kivi_spec::{Heads, Norm, Scheme, Tensor};
use kivi_templates::{default_variant, generate_calibrated, variants, Codebooks, Generated, Kernel};
use sim_util::{rel_error, Rng};
use std::sync::Arc;

const LENS: [usize; 5] = [1, 31, 33, 127, 1000];
/// Largest absolute error over the largest absolute output (`rel_error`).
const TOL: f32 = 1e-5;

/// The winner, declared once in eval/schemes/acc3.kivi.
fn winner() -> Scheme {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../eval/schemes/acc3.kivi")).unwrap();
    let d = kivi_spec::parse_decls(&text).unwrap();
    let s = d
        .into_iter()
        .find(|d| d.scheme.name == "pk128mp_v1nuq_o2")
        .expect("acc3.kivi declares pk128mp_v1nuq_o2")
        .scheme;
    assert!(matches!(
        s.key.quant().unwrap().levels,
        kivi_spec::Levels::Nuq(Norm::MinMaxPinned)
    ));
    s
}

/// The neighbours, head_dim 64.
fn neighbours() -> Vec<Scheme> {
    [
        // unpinned minmax keys, plain values, no sinks
        "mm { key: quant(bits = 2, axis = channel, group = 32, levels = nuq, norm = minmax), \
         value: quant(bits = 2, axis = token, group = 32), residual: 32, \
         rope: pre(theta = 10000, style = half) }",
        // minmax keys with outliers on both tensors (key outliers on
        // pre-RoPE keys), interleaved pairs, another base, sinks
        "mmo { key: quant(bits = 3, axis = channel, group = 32, levels = nuq, norm = minmax_pinned), \
         value: quant(bits = 2, axis = token, group = 32, levels = lloyd_max), \
         outliers: sparse(per_token = 2, apply = [key, value]), residual: 16, sinks: 2, \
         rope: pre(theta = 1000000, style = interleaved) }",
        // key outliers on pre-RoPE uniform keys (no table at all)
        "ko { key: quant(bits = 2, axis = channel, group = 32), \
         value: quant(bits = 2, axis = token, group = 32), \
         outliers: sparse(per_token = 3, apply = [key]), residual: 32, \
         rope: pre(theta = 10000, style = half) }",
    ]
    .iter()
    .map(|t| kivi_spec::parse_scheme(t).unwrap())
    .collect()
}

/// The winner on the Gemma 3 270M shape (MQA 4:1, head_dim 256), GQA 8:2
/// and MHA 2; each neighbour on GQA 8:2, MQA 4 and MHA 3 at head_dim 64.
fn cases() -> Vec<Scheme> {
    let w = winner();
    let mut out: Vec<Scheme> = [Heads::Mqa(4), Heads::Gqa { q: 8, kv: 2 }, Heads::Mha(2)]
        .iter()
        .map(|h| w.with_shape(*h, 256).unwrap())
        .collect();
    for s in neighbours() {
        for h in [Heads::Gqa { q: 8, kv: 2 }, Heads::Mqa(4), Heads::Mha(3)] {
            out.push(s.with_shape(h, 64).unwrap());
        }
    }
    out
}

/// Pre-RoPE keys with per-channel offsets (what minmax tables are for) and
/// a few loud channels; values with an offset.
fn inputs(rng: &mut Rng, tokens: usize, row: usize, key: bool) -> Vec<f32> {
    device_util::offset_rows(rng, tokens, row, key)
}

/// A one-layer calibration fitted for `s` on pre-RoPE keys (the post-RoPE
/// samples are other draws); `None` for a scheme without `nuq` levels.
fn calibration(s: &Scheme) -> Option<Calibration> {
    if kivi_runtime::calib::levels_for(s, None, 0).is_ok() {
        return None;
    }
    let shape = s.shape().unwrap();
    let (h, d) = (shape.kv_heads, shape.head_dim);
    let mut rng = Rng::new(11 + h as u64 + d as u64);
    let model = ModelId {
        name: "sim-minmax".into(),
        layers: 1,
        kv_heads: h as u32,
        head_dim: d as u32,
    };
    let mut cal = Calibration::new(model, "random");
    let n = 256;
    let (k, v) = (inputs(&mut rng, n, h * d, true), inputs(&mut rng, n, h * d, false));
    let mut x = LayerSamples::new(0, n, shape.q_heads, h, d, rng.vec(n * h * d), v);
    x.keys_pre_rope = Some(k);
    cal.fit_codebooks(s, &[x], FitOptions::default()).unwrap();
    Some(cal)
}

fn codebooks(s: &Scheme, cal: Option<&Calibration>) -> Codebooks {
    let get = |t| cal.and_then(|c| c.codebook(s, t, 0).ok());
    Codebooks {
        key: get(Tensor::Key),
        value: get(Tensor::Value),
    }
}

fn gen(s: &Scheme, cb: &Codebooks, k: Kernel, v: &kivi_templates::Variant) -> Generated {
    generate_calibrated(s, k, v, Default::default(), cb).unwrap_or_else(|e| panic!("{} {k}: {e}", s.name))
}

/// Decode, prefill and append (default variants) of every case.
fn kernels() -> Vec<Generated> {
    let mut out = Vec::new();
    for s in cases() {
        let cb = codebooks(&s, calibration(&s).as_ref());
        for k in Kernel::ALL {
            out.push(gen(&s, &cb, k, &default_variant(&s, k)));
        }
    }
    out
}

fn load_all(dev: &Arc<dyn Device>) {
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let all = kernels();
    dev.load_many(&all.iter().collect::<Vec<_>>()).unwrap();
}

fn new_cache(s: &Scheme, cal: Option<&Calibration>, cfg: CacheConfig) -> PagedCache {
    match cal {
        Some(c) => PagedCache::with_calibration(s.clone(), cfg, c, 0).unwrap(),
        None => PagedCache::new(s.clone(), cfg).unwrap(),
    }
}

fn oracle(s: &Scheme, cal: Option<&Calibration>, q: &[f32], k: &[f32], v: &[f32], attn: AttnParams) -> Vec<f32> {
    let view = |t, x| match cal {
        Some(c) => cache_view_calibrated(s, t, x, c, 0).unwrap(),
        None => kivi_runtime::reference::cache_view(s, t, x).unwrap(),
    };
    decode_attention(s, q, &view(Tensor::Key, k), &view(Tensor::Value, v), attn).unwrap()
}

/// A host cache holding one sequence per `LENS` entry (prefilled or
/// streamed, alternately), with its inputs.
struct Filled {
    cache: PagedCache,
    ids: Vec<u64>,
    ks: Vec<Vec<f32>>,
    vs: Vec<Vec<f32>>,
}

fn filled(s: &Scheme, cal: Option<&Calibration>, seed: u64) -> Filled {
    let row = s.shape().unwrap().kv_heads * s.shape().unwrap().head_dim;
    let mut rng = Rng::new(seed);
    let mut cache = new_cache(s, cal, CacheConfig::for_tokens(4096));
    let (mut ks, mut vs, mut ids) = (Vec::new(), Vec::new(), Vec::new());
    for (b, &t) in LENS.iter().enumerate() {
        let (k, v) = (inputs(&mut rng, t, row, true), inputs(&mut rng, t, row, false));
        let id = cache.add_sequence();
        if b % 2 == 1 {
            for p in 0..t {
                cache.append(id, &k[p * row..][..row], &v[p * row..][..row]).unwrap();
            }
        } else {
            cache.extend(id, &k, &v).unwrap();
        }
        ks.push(k);
        vs.push(v);
        ids.push(id);
    }
    Filled { cache, ids, ks, vs }
}

fn oracle_batch(s: &Scheme, cal: Option<&Calibration>, f: &Filled, q: &[f32], attn: AttnParams) -> Vec<f32> {
    let per = q.len() / f.ids.len();
    (0..f.ids.len())
        .flat_map(|b| oracle(s, cal, &q[b * per..][..per], &f.ks[b], &f.vs[b], attn))
        .collect()
}

#[test]
fn minmax_decode_matches_reference() {
    for dev in devices("minmax_decode", kernels) {
        load_all(&dev);
        let backend = DeviceBackend::new(dev.clone());
        let (mut worst, mut n) = (0f32, 0);
        for (i, s) in cases().iter().enumerate() {
            let shape = s.shape().unwrap();
            let cal = calibration(s);
            let f = filled(s, cal.as_ref(), 100 + i as u64);
            let q = Rng::new(200 + i as u64).vec(LENS.len() * shape.q_heads * shape.head_dim);
            for window in [None, Some(40)] {
                let attn = AttnParams {
                    window,
                    ..AttnParams::of(s, shape)
                };
                let want = oracle_batch(s, cal.as_ref(), &f, &q, attn);
                let got = backend.decode(&f.cache, &f.ids, &q, attn).unwrap();
                let e = rel_error(&got, &want);
                assert!(
                    e <= TOL,
                    "{} {:?} window {window:?}: relative error {e}",
                    s.name,
                    s.heads.unwrap()
                );
                worst = worst.max(e);
                n += 1;
            }
        }
        sim_util::report(&format!(
            "{}: minmax / pre-RoPE key outlier decode of {n} scheme/layout/window cases agrees with the oracle \
             (worst relative error {worst:.2e})",
            dev.kind().name()
        ));
    }
}

#[test]
fn minmax_writes_match_paged_cache_bit_for_bit() {
    for dev in devices("minmax_extend", kernels) {
        load_all(&dev);
        let mut n = 0;
        for (i, s) in cases().iter().enumerate() {
            let shape = s.shape().unwrap();
            let row = shape.kv_heads * shape.head_dim;
            let cal = calibration(s);
            let cfg = CacheConfig::for_tokens(8192);
            let mut host = new_cache(s, cal.as_ref(), cfg);
            let mut dc = match &cal {
                Some(c) => DeviceCache::with_calibration(dev.clone(), s, LENS.len(), 1100, cfg, c, 0).unwrap(),
                None => DeviceCache::new(dev.clone(), s, LENS.len(), 1100, cfg).unwrap(),
            };
            assert_eq!(dc.identity(), host.identity());
            let mut rng = Rng::new(500 + i as u64);
            // 33 appends: every sequence crosses a flush on the way
            let (ids, ks, vs) = write_both(s, &mut host, &mut dc, &LENS, &mut rng, 33, 16, |r, t, key| {
                inputs(r, t, row, key)
            });
            let attn = AttnParams::of(s, shape);
            let q = rng.vec(ids.len() * shape.q_heads * shape.head_dim);
            let got = dc.decode(&q, attn, None).unwrap();
            let per = shape.q_heads * shape.head_dim;
            let want: Vec<f32> = (0..ids.len())
                .flat_map(|b| oracle(s, cal.as_ref(), &q[b * per..][..per], &ks[b], &vs[b], attn))
                .collect();
            let e = rel_error(&got, &want);
            assert!(e <= TOL, "{}: decode after device writes, relative error {e}", s.name);
            n += 1;
        }
        sim_util::report(&format!(
            "{}: minmax / pre-RoPE key outlier prefill + 33 appends bit-identical to PagedCache for {n} scheme/layout pairs",
            dev.kind().name()
        ));
    }
}

/// The cases every decode variant runs for: in CI the winner on its Gemma
/// shape and the minmax keys with outliers on both tensors on GQA 8:2;
/// under `KIVI_FULL_SWEEP=1` (scripts/full-sweep.sh) every case.
fn sweep_picks() -> Vec<Scheme> {
    let all = cases();
    if std::env::var_os("KIVI_FULL_SWEEP").is_some() {
        all
    } else {
        let picks = vec![all[0].clone(), all[6].clone()];
        assert_eq!(picks[0].heads, Some(Heads::Mqa(4)));
        assert_eq!(
            (picks[1].name.as_str(), picks[1].heads),
            ("mmo", Some(Heads::Gqa { q: 8, kv: 2 }))
        );
        picks
    }
}

#[test]
fn every_minmax_variant_matches_the_oracle() {
    let picks = sweep_picks();
    let needed = || {
        picks
            .iter()
            .flat_map(|s| {
                let cb = codebooks(s, calibration(s).as_ref());
                variants(s, Kernel::Decode)
                    .into_iter()
                    .map(move |v| gen(s, &cb, Kernel::Decode, &v))
                    .collect::<Vec<_>>()
            })
            .collect()
    };
    for dev in devices("minmax_variants", needed) {
        for (i, s) in picks.iter().enumerate() {
            let vs = variants(s, Kernel::Decode);
            assert!(vs.len() >= 4, "{}: only {} variants", s.name, vs.len());
            let cal = calibration(s);
            let f = filled(s, cal.as_ref(), 300 + i as u64);
            let shape = s.shape().unwrap();
            let dc = DeviceCache::upload(dev.clone(), &f.cache, &f.ids).unwrap();
            let q = Rng::new(400 + i as u64).vec(LENS.len() * shape.q_heads * shape.head_dim);
            for window in [None, Some(40)] {
                let attn = AttnParams {
                    window,
                    ..AttnParams::of(s, shape)
                };
                let want = oracle_batch(s, cal.as_ref(), &f, &q, attn);
                let modules = dc.decode_modules(&vs).unwrap();
                for (v, m) in vs.iter().zip(&modules) {
                    let got = dc.decode_on(m, &q, attn).unwrap();
                    let e = rel_error(&got, &want);
                    assert!(
                        e <= TOL,
                        "{} {} window {window:?}: relative error {e}",
                        s.name,
                        v.name()
                    );
                }
            }
            sim_util::report(&format!(
                "{}: {} decode variants of {} {:?} agree with the oracle",
                dev.kind().name(),
                vs.len(),
                s.name,
                s.heads.unwrap()
            ));
        }
    }
}

/// A minmax key stays where validation puts it: channel-axis keys with
/// `rope: pre(...)`. Without `rope` (a post-RoPE minmax key) the scheme is
/// refused by validation, so no generator entry point sees it.
#[test]
fn post_rope_minmax_keys_stay_refused() {
    let text = "p { key: quant(bits = 2, axis = channel, group = 32, levels = nuq, norm = minmax), \
                value: quant(bits = 2, axis = token, group = 32), residual: 32 }";
    let e = kivi_spec::parse_scheme(text)
        .map(|s| kivi_spec::validate(&s).map(|_| s))
        .map_err(|e| e.to_string());
    let msg = match e {
        Err(m) => m,
        Ok(Err(v)) => v.message,
        Ok(Ok(_)) => panic!("a post-RoPE minmax key validated"),
    };
    assert!(msg.contains("norm = minmax") && msg.contains("rope: pre"), "{msg}");
    // the same key with `rope: pre(...)` validates (and generates: above)
    let pre = text.replace(
        "residual: 32 }",
        "residual: 32, rope: pre(theta = 10000, style = half) }",
    );
    kivi_spec::parse_scheme(&pre).unwrap();
}

/// The sources of two cases (the winner on its Gemma shape, the minmax
/// keys with outliers on both tensors), every decode variant and the
/// prefill and append kernels, compile with NVRTC for sm_90 where NVRTC
/// is provisioned (ptxas's report: shared memory and spills bounded);
/// skipped with a line otherwise.
#[test]
fn nvrtc_compiles_the_minmax_kernels() {
    use kivi_runtime::cuda::{Arch, NvrtcOptions};
    let Some(compiler) = device_util::nvrtc_or_skip("nvrtc_compiles_the_minmax_kernels") else {
        return;
    };
    let opts = NvrtcOptions::for_arch(Arch::parse("sm_90").unwrap());
    let all = cases();
    let mut n = 0;
    for s in [&all[0], &all[6]] {
        let cb = codebooks(s, calibration(s).as_ref());
        let mut gens: Vec<Generated> = variants(s, Kernel::Decode)
            .iter()
            .map(|v| gen(s, &cb, Kernel::Decode, v))
            .collect();
        for k in [Kernel::Prefill, Kernel::Append] {
            gens.push(gen(s, &cb, k, &default_variant(s, k)));
        }
        for g in gens {
            let c = compiler
                .compile(&g.name, &g.source, &opts)
                .unwrap_or_else(|e| panic!("{}: {e}", g.name));
            for e in &g.entry_points {
                assert!(c.artifact.ptx.contains(&format!(".entry {e}(")), "{}: {e}", g.name);
            }
            // ptxas's report (when its log has one): static shared memory
            // fits, and the decode lanes' accumulators and turned query fit
            // registers (no decode variant spilled with NVRTC 13.0; the
            // extend pipeline's rows live in local memory by design,
            // docs/cuda.md), printed for the record
            let res = c.resources();
            for r in &res {
                assert!(r.shared <= 48 * 1024, "{}: {r:?}", g.name);
                if r.function.contains("kivi_decode") {
                    assert!(r.spill_stores <= 4, "{}: {r:?}", g.name);
                }
            }
            if let Some(r) = res.iter().find(|r| r.function.contains("kivi_decode")) {
                println!(
                    "{}: {} registers, {} bytes spilled, {} bytes of stack, {} bytes shared",
                    g.name, r.registers, r.spill_stores, r.stack_frame, r.shared
                );
            }
            n += 1;
        }
    }
    println!("nvrtc_compiles_the_minmax_kernels: {n} sources compiled for sm_90");
}
