// Hadamard blocks tile a token's channels.
kivi::scheme! {
    pub S {
        key: quant(bits = 2, axis = channel, group = 32),
        value: quant(bits = 2, axis = token, group = 32),
        rotation: hadamard(block = 256, apply = [key, value]),
        head_dim: 128,
    }
}

fn main() {}
