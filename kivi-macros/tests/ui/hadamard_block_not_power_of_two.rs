// A Walsh–Hadamard block has a power-of-two size.
kivi::scheme! {
    pub S {
        key: quant(bits = 2, axis = channel, group = 32),
        value: quant(bits = 2, axis = token, group = 32),
        rotation: hadamard(block = 48, apply = [key]),
    }
}

fn main() {}
