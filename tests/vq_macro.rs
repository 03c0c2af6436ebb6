//! `kivi::scheme!` accepts `vq(...)` codecs and rebuilds them exactly
//! (shared codebook names included); of the CUDA kernels it embeds the
//! lookup-table decode only (vq rows are coded on the host by the oracle's
//! encoder, so no prefill or append kernel is generated).

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
    assert_eq!(LoopVq::KERNELS.len(), 1);
    assert!(LoopVq::KERNELS[0].0.contains("/decode/"), "{}", LoopVq::KERNELS[0].0);
}
