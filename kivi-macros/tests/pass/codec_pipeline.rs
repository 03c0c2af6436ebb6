// A scheme with a shape gets CUDA kernels at build time; the codec pipeline
// (rotation, Lloyd–Max levels, outliers, centering) is generated like KIVI's
// uniform codes, so such a declaration compiles.
kivi::scheme! {
    pub Rotated {
        key: quant(bits = 3, axis = token, group = 64, levels = lloyd_max, norm = l2),
        value: quant(bits = 2, axis = token, group = 32),
        rotation: hadamard(block = 64, apply = [key, value], signs = 3),
        outliers: sparse(per_token = 2, apply = [key]),
        center: channel_mean(tokens = 16, apply = [key]),
        residual: 32,
        heads: gqa(q = 8, kv = 2),
        head_dim: 128,
    }
}

fn main() {
    let s = Rotated::spec();
    assert!(s.rotation.is_some() && s.outliers.is_some() && s.center.is_some());
    assert_eq!(Rotated::HASH, kivi::scheme_hash(&s));
    // prefill, append and decode, named for every pipeline step
    assert_eq!(Rotated::KERNELS.len(), 3);
    assert!(Rotated::KERNELS[2].0.contains("k.t.g64.b3.lml2.h64x3.o2.m16"), "{}", Rotated::KERNELS[2].0);
}
