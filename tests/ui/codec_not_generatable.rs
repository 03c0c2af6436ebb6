// A scheme with a shape gets CUDA kernels at build time; a codec the templates cannot do is a compile error there.
kivi::scheme! {
    pub S {
        key: quant(bits = 2, axis = channel, group = 32),
        value: quant(bits = 2, axis = token, group = 32),
        rotation: hadamard(block = 64, apply = [key]),
        heads: gqa(q = 8, kv = 2),
        head_dim: 128,
    }
}

fn main() {}
