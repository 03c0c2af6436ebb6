// A window of millions of tokens is a typo, not a scheme.
kivi::scheme! {
    pub Huge {
        key: quant(bits = 2, axis = channel, group = 32),
        value: quant(bits = 2, axis = token, group = 32),
        residual: 2000000,
    }
}

fn main() {}
