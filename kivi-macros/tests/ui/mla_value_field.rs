// An mla cache stores one latent per token, read as key and value alike:
// its codec is `key`, and a `value` field is refused.
kivi::scheme! {
    pub Mla2 {
        key: quant(bits = 2, axis = channel, group = 32),
        value: quant(bits = 2, axis = token, group = 32),
        heads: mla(q = 16, latent = 512, rope_dim = 64),
    }
}

fn main() {}
