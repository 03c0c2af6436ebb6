//! `query: int8(group = G)` in the generated CUDA: the decode template's
//! `__dp4a` path, executed by the simulator against the oracle on 2- and
//! 4-bit keys, f16 and f32 scales, sinks, a sliding window, query groups of
//! 32 and 64, MHA, GQA and MQA, lengths 1, 31, 33, 127 and 1000, two
//! variants each (one compile for all).

mod device_util;
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

/// Many-query attention on the device layer (simulated): the block kernel
/// is not generated for an int8 query, so the backend decodes each query
/// with the int8 decode kernel; against the oracle's streaming definition.
#[test]
fn sim_device_attend_block_is_streaming_decode() {
    use kivi_runtime::device::{DeviceBackend, SimDevice};
    use kivi_runtime::rand::Rng;
    use kivi_runtime::{reference, Backend, CacheConfig, NewTokens, PagedCache};
    let s = schemes()[1].with_shape(Heads::Gqa { q: 4, kv: 2 }, 32).unwrap();
    let (hq, hkv, d, past, n) = (4, 2, 32, 40, 6);
    let mut rng = Rng::new(11);
    let k = rng.vec((past + n) * hkv * d);
    let v = rng.vec((past + n) * hkv * d);
    let q = rng.vec(n * hq * d);
    let attn = AttnParams::of(&s, s.shape().unwrap());
    let want = reference::block_attention_streaming(&s, past, &q, &k, &v, attn).unwrap();
    let mut cache = PagedCache::new(s.clone(), CacheConfig::for_tokens(256)).unwrap();
    let seq = cache.add_sequence();
    let row = hkv * d;
    cache.extend(seq, &k[..past * row], &v[..past * row]).unwrap();
    let be = DeviceBackend::new(SimDevice::shared());
    let blk = [NewTokens {
        seq,
        q: &q,
        k: &k[past * row..],
        v: &v[past * row..],
    }];
    let got = be.attend_block(&mut cache, &blk, attn).unwrap();
    let e = rel_error(&got, &want);
    assert!(e <= 1e-5, "relative error {e}");
    assert_eq!(cache.len(seq).unwrap(), past + n);
    let e = kivi_templates::generate_block(&s, Default::default()).unwrap_err();
    assert!(
        matches!(
            e,
            kivi_templates::GenError::Unsupported {
                field: kivi_spec::Field::Query,
                ..
            }
        ),
        "{e}"
    );
}

/// The generated int8 decode compiles with NVRTC for sm_90 (`__dp4a`,
/// doubles) where NVRTC is provisioned; skipped with a line otherwise.
#[test]
fn nvrtc_compiles_the_int8_decode() {
    use kivi_runtime::cuda::{Arch, NvrtcOptions};
    let Some(compiler) = device_util::nvrtc_or_skip("nvrtc_compiles_the_int8_decode") else {
        return;
    };
    let opts = NvrtcOptions::for_arch(Arch::parse("sm_90").unwrap());
    for s in schemes() {
        let s = s.with_shape(Heads::Gqa { q: 32, kv: 8 }, 128).unwrap();
        let vs = variants(&s, Kernel::Decode);
        let g = generate(&s, Kernel::Decode, &vs[0]).unwrap();
        let c = compiler
            .compile(&g.name, &g.source, &opts)
            .unwrap_or_else(|e| panic!("{}: {e}", g.name));
        assert!(c.artifact.ptx.contains("dp4a"), "{}: no dp4a in the PTX", g.name);
    }
}
