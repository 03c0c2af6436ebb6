// Every field of the language, spelled every way it can be, compiles; the
// emitted items carry the validated scheme, its canonical text and its hash.
kivi::scheme! {
    pub Kivi2 {
        key: quant(bits = 2, axis = channel, group = 32),
        value: quant(bits = 2, axis = token, group = 32),
        residual: 128,
        heads: gqa(q = 32, kv = 8),
        head_dim: 128,
    }

    Everything {
        value: quant(bits = 3, axis = token, group = 16, scale = f32),
        key: quant(bits = 4, axis = channel, group = 64, scale = f16),
        residual: 128,
        sinks: 4,
        flush: chunked,
        heads: mqa(q = 4),
        head_dim: 256,
        dtype: bf16,
        softmax_scale: 0.0625,
        sliding_window: 512,
        nonfinite: reject,
    }

    Baseline { key: full, value: full, heads: mha(8), sliding_window: none }
}

fn main() {
    let k = Kivi2::spec();
    assert_eq!(k.heads, Some(kivi::Heads::Gqa { q: 32, kv: 8 }));
    assert_eq!(Kivi2::HASH, kivi::scheme_hash(&k));
    assert_eq!(kivi::parse_scheme(Kivi2::CANONICAL).unwrap(), k);

    let e = Everything::spec();
    assert_eq!(e.sinks, 4);
    assert_eq!(e.flush, kivi::Flush::Chunked);
    assert_eq!(e.dtype, kivi::Dtype::Bf16);
    assert_eq!(e.softmax_scale, Some(0.0625));
    assert_eq!(e.sliding_window, Some(512));
    assert_eq!(e.shape().unwrap().group_size(), 4);

    let b = Baseline::spec();
    assert_eq!(b.key, kivi::Codec::Full);
    assert_eq!(b.heads, Some(kivi::Heads::Mha(8)));
}
