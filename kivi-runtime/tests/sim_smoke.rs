mod sim_util;
use kivi_runtime::sim::SimBackend;
use kivi_runtime::AttnParams;
use kivi_spec::{presets, Heads};
use sim_util::*;

#[test]
fn sim_default_variant_matches_reference() {
    let s = presets::kivi2().with_shape(Heads::Gqa { q: 8, kv: 2 }, 64).unwrap();
    let b = Batch::new(&s, &[1, 33, 300], 5, true);
    let attn = AttnParams::of(&s, s.shape().unwrap());
    let want = b.reference(attn);
    let sim = SimBackend::for_cache(&b.cache, None).unwrap();
    let e = b.rel_error(&sim, attn, &want);
    assert!(e <= 1e-4, "{e}");
}
