// Every KV head serves the same number of query heads.
kivi::scheme! {
    pub Gqa30 {
        key: quant(bits = 2, axis = channel, group = 32),
        value: quant(bits = 2, axis = token, group = 32),
        heads: gqa(q = 30, kv = 8),
    }
}

fn main() {}
