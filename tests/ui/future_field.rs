// Planned fields are recognised and refused, never silently ignored.
kivi::scheme! {
    pub PreRope {
        key: quant(bits = 2, axis = channel, group = 32),
        value: quant(bits = 2, axis = token, group = 32),
        rope: pre,
    }
}

fn main() {}
