//! `query: int8(group = G)` in the generated CUDA: the decode template's
//! `__dp4a` path, executed by the simulator against the oracle on 2- and
//! 4-bit keys, f16 and f32 scales, sinks, a sliding window, query groups of
//! 32 and 64, MHA, GQA and MQA, lengths 1, 31, 33, 127 and 1000, two
//! variants each (one compile for all).

mod sim_util;

use kivi_runtime::sim::{compile, SimBackend};
use kivi_runtime::AttnParams;
use kivi_spec::{parse_scheme, Heads, Scheme};
use kivi_templates::{generate, variants, Generated, Kernel};
use sim_util::*;

const LENS: [usize; 5] = [1, 31, 33, 127, 1000];

fn schemes() -> Vec<Scheme> {
    [
        "r0q8 { key: quant(bits = 2, axis = channel, group = 32), value: quant(bits = 2, axis = token, group = 32),
                query: int8(group = 32) }",
        "k4q8 { key: quant(bits = 4, axis = channel, group = 32), value: quant(bits = 4, axis = token, group = 32),
                residual: 16, sinks: 3, query: int8(group = 32) }",
        "f32q8 { key: quant(bits = 2, axis = channel, group = 64, scale = f32), value: quant(bits = 2, axis = token, group = 16),
                 residual: 40, sliding_window: 300, query: int8(group = 64) }",
    ]
    .iter()
    .map(|t| parse_scheme(t).unwrap())
    .collect()
}

#[test]
fn sim_int8_query_matches_the_oracle() {
    let bound: Vec<Scheme> = schemes()
        .iter()
        .zip([
            (Heads::Gqa { q: 8, kv: 2 }, 64),
            (Heads::Mqa(4), 128),
            (Heads::Mha(2), 64),
        ])
        .map(|(s, (h, d))| s.with_shape(h, d).unwrap())
        .collect();
    // The canonical variant and the last of the space (other tiles, teams
    // and load widths).
    let gens: Vec<Vec<Generated>> = bound
        .iter()
        .map(|s| {
            let vs = variants(s, Kernel::Decode);
            let mut pick = vec![vs[0], vs[vs.len() - 1]];
            pick.dedup();
            pick.iter().map(|v| generate(s, Kernel::Decode, v).unwrap()).collect()
        })
        .collect();
    let lib = compile(&gens.iter().flatten().collect::<Vec<_>>()).unwrap();
    let mut n = 0;
    for (i, (s, gs)) in bound.iter().zip(gens).enumerate() {
        let b = Batch::new(s, &LENS, 700 + i as u64, true);
        let attn = AttnParams::of(s, s.shape().unwrap());
        let want = b.reference(attn);
        for g in gs {
            assert!(
                g.name.contains(&format!("-q8.g{}", s.query.unwrap().group)),
                "{}",
                g.name
            );
            let name = g.name.clone();
            let sim = SimBackend::with_library(s, g, lib.clone()).unwrap();
            let e = b.rel_error(&sim, attn, &want);
            assert!(e <= 1e-5, "{name}: relative error {e} (lengths {LENS:?})");
            n += 1;
        }
    }
    report(&format!(
        "sim: {n} int8-query decode variants agreed with the reference"
    ));
}
