//! Every decode variant of every preset, executed by `sim` from its
//! generated CUDA source and checked against the reference oracle, on three
//! head layouts (GQA 32:8 d128, MQA 4:1 d256, MHA 8:8 d64) and odd lengths.

mod sim_util;

use kivi_runtime::sim::{compile, SimBackend};
use kivi_runtime::AttnParams;
use kivi_spec::{presets, Heads, Scheme};
use kivi_templates::{generate, variants, Kernel};
use sim_util::*;

/// Runs every decode variant of `s` on one batch; returns (variants, worst error).
fn sweep(s: &Scheme, lens: &[usize], seed: u64) -> (usize, f32) {
    let b = Batch::new(s, lens, seed, true);
    let attn = AttnParams::of(s, s.shape().unwrap());
    let want = b.reference(attn);
    let vs = variants(s, Kernel::Decode);
    assert!(!vs.is_empty(), "{}: no decode variants", s.name);
    let gens: Vec<_> = vs.iter().map(|v| generate(s, Kernel::Decode, v).unwrap()).collect();
    let t = std::time::Instant::now();
    let lib = compile(&gens.iter().collect::<Vec<_>>()).unwrap();
    let compiled = t.elapsed();
    let t = std::time::Instant::now();
    let mut worst = 0f32;
    for g in gens {
        let name = g.name.clone();
        let sim = SimBackend::with_library(s, g, lib.clone()).unwrap();
        let e = b.rel_error(&sim, attn, &want);
        assert!(
            e <= 1e-4,
            "{name}: relative error {e} against the reference (lengths {lens:?})"
        );
        worst = worst.max(e);
    }
    report(&format!(
        "  {}: {} variants, compile {:.1?}, run {:.1?}, worst rel err {worst:.2e}",
        kivi_templates::scheme_tag(s),
        vs.len(),
        compiled,
        t.elapsed()
    ));
    (vs.len(), worst)
}

fn layout_test(heads: Heads, d: u32, lens: &[usize]) {
    let mut total = 0;
    let mut worst = 0f32;
    for (i, p) in presets::all().iter().enumerate() {
        let s = p.with_shape(heads, d).unwrap();
        let (n, e) = sweep(&s, lens, 100 + i as u64);
        total += n;
        worst = worst.max(e);
    }
    report(&format!(
        "sim: executed {total} decode variants ({} presets, {heads} d{d}, lengths {lens:?}); all agreed with the reference (worst relative error {worst:.2e} <= 1e-4)",
        presets::all().len()
    ));
}

#[test]
fn sim_every_decode_variant_gqa_32_8_d128() {
    layout_test(Heads::Gqa { q: 32, kv: 8 }, 128, &[1, 33, 301]);
}

#[test]
fn sim_every_decode_variant_mqa_4_d256() {
    layout_test(Heads::Mqa(4), 256, &[1, 31, 127, 301]);
}

#[test]
fn sim_every_decode_variant_mha_8_d64() {
    layout_test(Heads::Mha(8), 64, &[1, 33, 127, 301]);
}
