// A block holds a whole number of every channel-axis group: 64 and 3493
// would need blocks of 223,552 tokens (found by the scheme fuzzer).
kivi::scheme! {
    pub Coprime {
        key: quant(bits = 4, axis = channel, group = 64),
        value: quant(bits = 4, axis = channel, group = 3493),
    }
}

fn main() {}
