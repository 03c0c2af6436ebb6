// Pre-RoPE keys: the macro parses `rope: pre(...)`, rebuilds the value
// (f64 base and factor) and generates the kernels, whose names carry it.
kivi::scheme! {
    pub GemmaGlobal {
        key: quant(bits = 2, axis = channel, group = 32),
        value: quant(bits = 2, axis = token, group = 32),
        residual: 128,
        rope: pre(theta = 1_000_000, style = half, scaling = linear(8)),
        heads: mqa(q = 4),
        head_dim: 256,
    }
}

fn main() {
    let s = GemmaGlobal::spec();
    let r = s.rope.expect("pre-RoPE keys");
    assert_eq!((r.theta, r.style, r.scaling), (1e6, kivi::spec::RopeStyle::Half, 8.0));
    assert_eq!(GemmaGlobal::HASH, kivi::scheme_hash(&s));
    assert!(GemmaGlobal::CANONICAL.contains("rope: pre(theta = 1000000.0, style = half, scaling = linear(8.0)),"));
    assert!(GemmaGlobal::KERNELS[2].0.contains("-ropeh1000000x8"), "{}", GemmaGlobal::KERNELS[2].0);
}
