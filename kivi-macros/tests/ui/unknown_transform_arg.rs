// Unknown arguments of a transform are refused with the valid ones.
kivi::scheme! {
    pub S {
        key: quant(bits = 2, axis = channel, group = 32),
        value: quant(bits = 2, axis = token, group = 32),
        rotation: hadamard(block = 64, apply = [key], seed = 3),
    }
}

fn main() {}
