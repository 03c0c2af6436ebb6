//! Pre-RoPE keys (`rope: pre(...)`) in the generated CUDA decode kernel,
//! executed by the simulator against the oracle: both RoPE bases of Gemma 3
//! (10000, 1000000), both pair conventions, MHA / GQA / MQA, a batch of
//! sequences at lengths 1, 31, 33, 127, 1000 (odd ones streamed), with
//! sinks, a residual window and a sliding window. The many-query block
//! kernel does not turn keys yet: it refuses with a typed error and leaves
//! the cache unchanged.

mod sim_util;
use kivi_runtime::device::{DeviceBackend, SimDevice};
use kivi_runtime::sim::SimBackend;
use kivi_runtime::{AttnParams, Backend, CacheConfig, Error, NewTokens, PagedCache};
use kivi_spec::{parse_scheme, Heads, Rope, RopeStyle, Scheme};
use sim_util::*;

const LENS: [usize; 5] = [1, 31, 33, 127, 1000];

fn pre(text: &str, theta: f64, style: RopeStyle, heads: Heads, d: u32) -> Scheme {
    let mut s = parse_scheme(text).unwrap().with_shape(heads, d).unwrap();
    s.rope = Some(Rope {
        theta,
        style,
        scaling: 1.0,
    });
    kivi_spec::validate(&s).unwrap();
    s
}

#[test]
fn sim_decode_turns_pre_rope_keys_like_the_oracle() {
    let kivi2 = "k2 { key: quant(bits = 2, axis = channel, group = 32), value: quant(bits = 2, axis = token, group = 32), residual: 32, sinks: 3 }";
    let tok4 = "t4 { key: quant(bits = 4, axis = token, group = 32), value: quant(bits = 2, axis = token, group = 32), residual: 16, sliding_window: 300 }";
    let cases = [
        pre(kivi2, 10_000.0, RopeStyle::Half, Heads::Gqa { q: 8, kv: 2 }, 64),
        pre(kivi2, 1_000_000.0, RopeStyle::Interleaved, Heads::Mqa(4), 64),
        pre(tok4, 1_000_000.0, RopeStyle::Half, Heads::Mha(2), 32),
        pre(tok4, 10_000.0, RopeStyle::Interleaved, Heads::Mqa(4), 64),
    ];
    for s in &cases {
        let batch = Batch::new(s, &LENS, 0x13, true);
        let sim = SimBackend::for_cache(&batch.cache, None).unwrap();
        let a = AttnParams::of(s, s.shape().unwrap());
        let want = batch.reference(a);
        let e = batch.rel_error(&sim, a, &want);
        assert!(e <= 1e-4, "{}: {e}", kivi_templates::scheme_tag(s));
        // The same cache without RoPE in the kernel is far off: the test
        // can tell turned keys from stored ones.
        let mut plain = s.clone();
        plain.rope = None;
        let off = rel_error(&batch.reference(a), &{
            let b2 = Batch::new(&plain, &LENS, 0x13, true);
            b2.reference(a)
        });
        assert!(off > 1e-2, "{}: rope changes nothing? {off}", s.name);
        report(&format!(
            "sim rope: {} within {e:e} of the oracle",
            kivi_templates::scheme_tag(s)
        ));
    }
}

#[test]
fn block_kernel_refuses_pre_rope_keys_and_leaves_the_cache() {
    let s = pre(
        "k2 { key: quant(bits = 2, axis = channel, group = 32), value: quant(bits = 2, axis = token, group = 32), residual: 32 }",
        10_000.0,
        RopeStyle::Half,
        Heads::Mqa(4),
        64,
    );
    let mut c = PagedCache::new(s.clone(), CacheConfig::for_tokens(256)).unwrap();
    let id = c.add_sequence();
    let x: Vec<f32> = (0..40 * 64).map(|i| ((i * 7 % 13) as f32 - 6.0) / 4.0).collect();
    c.extend(id, &x, &x).unwrap();
    let before = c.memory();
    let q = vec![0.5f32; 4 * 4 * 64];
    let blk = NewTokens {
        seq: id,
        q: &q,
        k: &x[..4 * 64],
        v: &x[..4 * 64],
    };
    let be = DeviceBackend::new(SimDevice::shared());
    let e = be.attend_block(&mut c, &[blk], AttnParams::of(&s, s.shape().unwrap()));
    assert!(matches!(e, Err(Error::Unavailable { .. })), "{e:?}");
    assert_eq!((c.len(id).unwrap(), c.memory()), (40, before));
}
