// `query: int8(group = G)` through the macro: the field is part of the
// spec, its canonical text and hash, and the generated decode kernel's name.
kivi::scheme! {
    pub Kivi2Q8 {
        key: quant(bits = 2, axis = channel, group = 32),
        value: quant(bits = 2, axis = token, group = 32),
        residual: 128,
        query: int8(group = 32),
        heads: gqa(q = 8, kv = 2),
        head_dim: 128,
    }
}

fn main() {
    let s = Kivi2Q8::spec();
    assert_eq!(s.query, Some(kivi::spec::QueryQuant { group: 32 }));
    assert_eq!(Kivi2Q8::HASH, kivi::scheme_hash(&s));
    assert!(Kivi2Q8::KERNELS[2].0.contains("-q8.g32"), "{}", Kivi2Q8::KERNELS[2].0);
}
