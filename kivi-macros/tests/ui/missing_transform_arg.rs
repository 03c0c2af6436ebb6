// A rotation needs its block size.
kivi::scheme! {
    pub S {
        key: quant(bits = 2, axis = channel, group = 32),
        value: quant(bits = 2, axis = token, group = 32),
        rotation: hadamard(apply = [key]),
    }
}

fn main() {}
