// The second of two identical fields is the error.
kivi::scheme! {
    pub Twice {
        key: quant(bits = 2, axis = channel, group = 32),
        value: quant(bits = 2, axis = token, group = 32),
        residual: 128,
        residual: 64,
    }
}

fn main() {}
