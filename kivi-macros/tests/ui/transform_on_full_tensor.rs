// Transforms change how quantized tokens are stored; a full tensor has none.
kivi::scheme! {
    pub S {
        key: quant(bits = 2, axis = channel, group = 32),
        value: full,
        rotation: hadamard(block = 64, apply = [key, value]),
    }
}

fn main() {}
