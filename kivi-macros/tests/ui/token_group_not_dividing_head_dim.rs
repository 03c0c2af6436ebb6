// A token-axis group splits one token's channels, so it must divide head_dim.
kivi::scheme! {
    pub Uneven {
        key: quant(bits = 2, axis = channel, group = 32),
        value: quant(bits = 2, axis = token, group = 48),
        head_dim: 128,
    }
}

fn main() {}
