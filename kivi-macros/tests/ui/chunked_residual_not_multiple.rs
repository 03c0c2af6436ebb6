// Chunked flush quantizes the whole window at once: R must be whole channel groups.
kivi::scheme! {
    pub Chunky {
        key: quant(bits = 2, axis = channel, group = 32),
        value: quant(bits = 2, axis = token, group = 32),
        residual: 100,
        flush: chunked,
    }
}

fn main() {}
