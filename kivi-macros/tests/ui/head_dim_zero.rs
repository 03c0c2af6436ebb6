// head_dim 0 is a typo, not a model.
kivi::scheme! {
    pub NoDim {
        key: quant(bits = 2, axis = channel, group = 32),
        value: full,
        head_dim: 0,
    }
}

fn main() {}
