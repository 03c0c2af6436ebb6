// An apply list names at least one tensor.
kivi::scheme! {
    pub S {
        key: quant(bits = 2, axis = channel, group = 32),
        value: quant(bits = 2, axis = token, group = 32),
        rotation: hadamard(block = 64, apply = []),
    }
}

fn main() {}
