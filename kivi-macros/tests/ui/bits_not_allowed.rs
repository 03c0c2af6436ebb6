// Only 1, 2, 3, 4 and 8 bit codes are implemented.
kivi::scheme! {
    pub FiveBit {
        key: quant(bits = 2, axis = channel, group = 32),
        value: quant(bits = 5, axis = token, group = 32),
    }
}

fn main() {}
