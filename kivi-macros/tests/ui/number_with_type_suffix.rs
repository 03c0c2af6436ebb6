// A Rust type suffix on a number: syn would read `300u8` as 300 and drop
// the suffix silently; the scheme parser refuses it.
kivi::scheme! {
    pub Suffixed {
        key: quant(bits = 2, axis = channel, group = 32),
        value: quant(bits = 2, axis = token, group = 32),
        residual: 300u8,
    }
}

fn main() {}
