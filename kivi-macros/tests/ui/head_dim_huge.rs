// No attention head is 4096 channels wide; this is a typo.
kivi::scheme! {
    pub Wide {
        key: quant(bits = 2, axis = channel, group = 32),
        value: quant(bits = 2, axis = token, group = 32),
        head_dim: 4096,
    }
}

fn main() {}
