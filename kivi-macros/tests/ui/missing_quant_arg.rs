// bits, axis and group have no default.
kivi::scheme! {
    pub NoGroup {
        key: quant(bits = 2, axis = channel),
        value: full,
    }
}

fn main() {}
