// MLA heads: the latent's codec is `key` (no `value` field), the RoPE part's
// is `rope = ...`; the macro emits the scheme, its canonical text and hash.
kivi::scheme! {
    pub DeepSeekLite2 {
        key: quant(bits = 2, axis = channel, group = 32),
        residual: 64,
        heads: mla(q = 16, latent = 512, rope_dim = 64, rope = quant(bits = 4, axis = token, group = 32)),
        softmax_scale: 0.07216878,
    }

    Exact { key: full, heads: mla(rope_dim = 64, latent = 512, q = 16) }
}

fn main() {
    let s = DeepSeekLite2::spec();
    let m = s.mla().unwrap();
    assert_eq!((m.q, m.latent, m.rope_dim), (16, 512, 64));
    assert_eq!(s.value, s.key);
    assert_eq!(s.head_dim, Some(512));
    assert_eq!(DeepSeekLite2::HASH, kivi::scheme_hash(&s));
    assert_eq!(kivi::parse_scheme(DeepSeekLite2::CANONICAL).unwrap(), s);
    // No CUDA template for mla heads yet: no kernels are embedded.
    assert!(DeepSeekLite2::KERNELS.is_empty());
    assert_eq!(Exact::spec().mla().unwrap().rope, kivi::Codec::Full);
}
