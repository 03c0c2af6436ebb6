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
    let t = std::time::Instant::now();
    let sim = SimBackend::for_cache(&b.cache, None).unwrap();
    eprintln!("compile {:?}", t.elapsed());
    let t = std::time::Instant::now();
    let e = b.rel_error(&sim, attn, &want);
    eprintln!("run {:?} err {e}", t.elapsed());
    assert!(e <= 1e-4, "{e}");
}

#[test]
fn sim_timing() {
    let s = presets::kivi2().with_shape(Heads::Gqa { q: 32, kv: 8 }, 128).unwrap();
    let b = Batch::new(&s, &[1, 33, 300], 5, false);
    let attn = AttnParams::of(&s, s.shape().unwrap());
    let want = b.reference(attn);
    let sim = SimBackend::for_cache(&b.cache, None).unwrap();
    for _ in 0..3 {
        let t = std::time::Instant::now();
        let e = b.rel_error(&sim, attn, &want);
        eprintln!("run {:?} err {e}", t.elapsed());
    }
}
