// Planned fields are recognised and refused, never silently ignored.
kivi::scheme! {
    pub Normalized {
        key: quant(bits = 2, axis = channel, group = 32),
        value: quant(bits = 2, axis = token, group = 32),
        normalize: pre,
    }
}

fn main() {}
