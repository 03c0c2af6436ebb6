//! Decode by `sim` beyond the presets: 1/3/8-bit codes, straddling groups,
//! bf16 and f32 activations, f32 scales, sinks, chunked flush, sliding
//! window and softmax scale, `full` keys — on GQA 32:8 d128 and MQA 4:1
//! d256, in batches of unequal lengths (1, 31, 33, 127, 1000).

mod sim_util;

use kivi_runtime::sim::{compile, SimBackend};
use kivi_runtime::{AttnParams, Backend};
use kivi_spec::{presets, Heads, Scheme};
use kivi_templates::{generate, variants, Generated, Kernel};
use sim_util::*;

const LENS: [usize; 5] = [1, 31, 33, 127, 1000];

/// The canonical variant, one from the middle of the space and the last.
fn some_variants(s: &Scheme) -> Vec<Generated> {
    let vs = variants(s, Kernel::Decode);
    let mut pick = vec![vs[0], vs[vs.len() / 2], vs[vs.len() - 1]];
    pick.dedup();
    pick.iter().map(|v| generate(s, Kernel::Decode, v).unwrap()).collect()
}

fn run_layout(heads: Heads, d: u32) -> usize {
    let schemes: Vec<Scheme> = extra_schemes()
        .into_iter()
        .filter_map(|s| s.with_shape(heads, d).ok())
        .collect();
    assert!(schemes.len() >= 8, "{heads} d{d}: only {} schemes fit", schemes.len());
    let gens: Vec<Vec<Generated>> = schemes.iter().map(some_variants).collect();
    let lib = compile(&gens.iter().flatten().collect::<Vec<_>>()).unwrap();
    let mut n = 0;
    for (i, (s, gs)) in schemes.iter().zip(gens).enumerate() {
        let b = Batch::new(s, &LENS, 300 + i as u64, true);
        let attn = AttnParams::of(s, s.shape().unwrap());
        let want = b.reference(attn);
        for g in gs {
            let name = g.name.clone();
            let sim = SimBackend::with_library(s, g, lib.clone()).unwrap();
            let e = b.rel_error(&sim, attn, &want);
            assert!(e <= 1e-4, "{name}: relative error {e} (lengths {LENS:?})");
            n += 1;
        }
    }
    report(&format!(
        "sim: {n} decode variants of {} non-preset schemes at {heads} d{d} agreed with the reference",
        schemes.len()
    ));
    n
}

#[test]
fn sim_non_preset_schemes_gqa_32_8_d128() {
    run_layout(Heads::Gqa { q: 32, kv: 8 }, 128);
}

#[test]
fn sim_non_preset_schemes_mqa_4_d256() {
    run_layout(Heads::Mqa(4), 256);
}

/// Run-time attention settings override the scheme's: a sliding window of
/// 0 tokens attends to nothing, any other window and scale match the oracle;
/// an empty sequence in the batch gives zeros and does not disturb the rest.
#[test]
fn sim_runtime_window_scale_and_empty_sequences() {
    let s = presets::kivi4().with_shape(Heads::Gqa { q: 8, kv: 2 }, 64).unwrap();
    let mut b = Batch::new(&s, &[0, 200, 1], 9, false);
    let sim = SimBackend::for_cache(&b.cache, None).unwrap();
    for attn in [
        AttnParams {
            softmax_scale: 0.3,
            window: None,
        },
        AttnParams {
            softmax_scale: 0.125,
            window: Some(37),
        },
        AttnParams {
            softmax_scale: 0.125,
            window: Some(1),
        },
        AttnParams {
            softmax_scale: 0.125,
            window: Some(0),
        },
    ] {
        let want = b.reference(attn);
        let got = sim.decode(&b.cache, &b.seqs, &b.q, attn).unwrap();
        assert!(
            rel_error(&got, &want) <= 1e-4 || want.iter().all(|x| *x == 0.0),
            "{attn:?}"
        );
        let per = 8 * 64;
        assert!(got[..per].iter().all(|x| *x == 0.0), "empty sequence must give zeros");
        if attn.window == Some(0) {
            assert!(got.iter().all(|x| *x == 0.0));
        }
    }
    // A NaN query is refused with an error, not a NaN output.
    b.q[5] = f32::NAN;
    let attn = AttnParams::of(&s, s.shape().unwrap());
    assert!(sim.decode(&b.cache, &b.seqs, &b.q, attn).is_err());
    // A backend for another scheme refuses the cache.
    let other = presets::kivi2().with_shape(Heads::Gqa { q: 8, kv: 2 }, 64).unwrap();
    let wrong = SimBackend::new(&other, None, Default::default()).unwrap();
    b.q[5] = 0.0;
    let e = wrong.decode(&b.cache, &b.seqs, &b.q, attn).unwrap_err();
    assert!(e.to_string().contains("another scheme"), "{e}");
}
