// A group of zero elements has no min or max.
kivi::scheme! {
    pub Empty {
        key: quant(bits = 2, axis = channel, group = 0),
        value: quant(bits = 2, axis = token, group = 32),
    }
}

fn main() {}
