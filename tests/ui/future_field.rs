// Planned fields are recognised and refused, never silently ignored.
kivi::scheme! {
    pub LowRank {
        key: quant(bits = 2, axis = channel, group = 32),
        value: quant(bits = 2, axis = token, group = 32),
        low_rank: pre,
    }
}

fn main() {}
