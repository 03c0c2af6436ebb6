// A field the language does not know is an error, not silently ignored.
kivi::scheme! {
    pub Typo {
        key: quant(bits = 2, axis = channel, group = 32),
        value: quant(bits = 2, axis = token, group = 32),
        residul: 128,
    }
}

fn main() {}
