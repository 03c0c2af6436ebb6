// key and value have no default.
kivi::scheme! {
    pub NoValue {
        key: quant(bits = 2, axis = channel, group = 32),
        residual: 128,
    }
}

fn main() {}
