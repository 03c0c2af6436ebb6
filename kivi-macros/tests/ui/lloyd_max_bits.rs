// Lloyd–Max tables exist for 1 to 4 bits only.
kivi::scheme! {
    pub S {
        key: quant(bits = 8, axis = token, group = 32, levels = lloyd_max),
        value: quant(bits = 2, axis = token, group = 32),
    }
}

fn main() {}
