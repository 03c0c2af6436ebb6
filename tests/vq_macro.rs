//! `kivi::scheme!` accepts `vq(...)` codecs and rebuilds them exactly
//! (shared codebook names included), and embeds their CUDA kernels: the
//! exact nearest-centroid prefill and append, and the lookup-table decode
//! (the codebooks are kernel arguments, so no calibration is needed to
//! generate them).

kivi::scheme! {
    /// 1-bit product VQ on both tensors, one codebook per tensor shared by all layers.
    pub LoopVq {
        key: vq(dim = 8, entries = 256, codebook = loop),
        value: vq(dim = 8, entries = 256),
        residual: 16,
        sinks: 4,
        heads: mqa(q = 4),
        head_dim: 256,
    }
}

#[test]
fn the_macro_and_the_parser_agree_on_vq() {
    let s = LoopVq::spec();
    let text = kivi::spec::canonical(&s);
    assert_eq!(kivi::parse_scheme(&text).unwrap(), s);
    assert_eq!(s.key.vq().unwrap().codebook.unwrap().as_str(), "loop");
    assert_eq!(kivi::spec::layout::bits_per_element(&s), 1.0);
    assert_eq!(LoopVq::HASH, kivi::scheme_hash(&s));
    let names: Vec<&str> = LoopVq::KERNELS.iter().map(|k| k.0).collect();
    assert_eq!(names.len(), 3, "{names:?}");
    for (n, k) in names.iter().zip(["/prefill/", "/append/", "/decode/"]) {
        assert!(n.contains(k), "{n}");
    }
}
